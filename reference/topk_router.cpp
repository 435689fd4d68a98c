// CPU reference of topk_router (SPEC §1). See topk_router.h for layouts.
//
// Two precisions on purpose (SPEC §1.4 "Selection is defined on fp32 values"): the selection
// (scores s, selection scores z, group scores, top-k) is computed in fp32 exactly as §1.2 says,
// through the same score functions the CUDA twin uses (harness/core/score_fn.h); probs and
// gradients are then computed in double from that selection.
#include "reference/topk_router.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "harness/core/score_fn.h"

namespace moe::ref {

namespace {

using Eigen::ArrayXd;
constexpr double kEps = static_cast<double>(kRouterEps);
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

double sp_d(double x) {
  return x > 20.0 ? x : std::log1p(std::exp(x));
}
double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Canonical order: value descending, index ascending, IEEE equality (-0 == +0).
std::vector<int> canonical_topk(const std::vector<float>& v, int64_t k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// fp32 scores s_e and selection scores z_e of one row (§1.2 steps 1-2).
struct RowScores {
  std::vector<float> x, s, z, b;
};

RowScores row_scores(const Tensor& logits, const Tensor* bias, const RouterParams& p, int64_t t) {
  const int64_t E = logits.dim(1);
  RowScores r;
  r.x.resize(E);
  r.s.resize(E);
  r.z.resize(E);
  r.b.assign(E, 0.0f);
  for (int64_t e = 0; e < E; ++e) r.x[e] = static_cast<float>(logits.at(t, e));
  if (bias)
    for (int64_t e = 0; e < E; ++e) r.b[e] = static_cast<float>(bias->at(e));
  switch (p.score_function) {
    case ScoreFunction::softmax:
      if (p.use_pre_softmax) {
        // Same fp32 operations and summation order as the CUDA kernel (score_fn.h).
        const float m = *std::max_element(r.x.begin(), r.x.end());
        for (int64_t e = 0; e < E; ++e) r.s[e] = score::exp_f32(r.x[e] - m);
        const float inv = 1.0f / score::row_sum_f32(r.s.data(), E);
        for (int64_t e = 0; e < E; ++e) r.s[e] = r.s[e] * inv;
      } else {
        r.s = r.x;
      }
      break;
    case ScoreFunction::sigmoid:
      for (int64_t e = 0; e < E; ++e) r.s[e] = score::sigmoid_f32(r.x[e]);
      break;
    case ScoreFunction::sqrtsoftplus:
      for (int64_t e = 0; e < E; ++e) r.s[e] = score::sqrtsoftplus_f32(r.x[e]);
      break;
  }
  for (int64_t e = 0; e < E; ++e) r.z[e] = bias ? r.s[e] + r.b[e] : r.s[e];
  return r;
}

// A score below 2^-128 may be 0 in a correct implementation (SPEC §0: sigma evaluated
// literally in fp32 underflows there), so it may move by its whole value; above, 0.
double flush_allowance(float s) {
  const double a = std::fabs(static_cast<double>(s));
  return a < 0x1.0p-128 ? a : 0.0;
}

// §1.2 step 3 plus the §1.4 margins. delta: 16 ulp_f32 of the boundary's magnitude, or (project
// copy, §1.4) the flush allowances of the two sides where that is larger: two scores that a
// correct kernel may both return as 0 are a near tie.
RowSelection select_row(const RowScores& r, const RouterParams& p, bool has_bias) {
  const int64_t E = static_cast<int64_t>(r.z.size()), K = p.topk;
  RowSelection sel;
  std::vector<float> zc = r.z;
  sel.group_margin = INFINITY;
  double group_delta = 0;
  if (p.grouped()) {
    const int64_t G = p.num_groups, per = E / G, kg = K / p.group_topk;
    std::vector<float> gscore(G);
    std::vector<double> gflush(G, 0.0);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> part(r.z.begin() + g * per, r.z.begin() + (g + 1) * per);
      float acc = 0.0f;
      for (int i : canonical_topk(part, kg)) {
        acc += part[i];  // fp32, in selection order
        gflush[g] += flush_allowance(r.s[g * per + i]);
      }
      gscore[g] = acc;
    }
    std::vector<int> order(G);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return gscore[a] > gscore[b]; });
    std::vector<bool> keep(G, false);
    for (int64_t i = 0; i < p.group_topk; ++i) keep[order[i]] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) zc[e] = kNegInf;
    if (p.group_topk < G) {
      const double a = gscore[order[p.group_topk - 1]], b = gscore[order[p.group_topk]];
      sel.group_margin = a - b;
      group_delta = std::max(16.0 * ulp(DType::f32, std::max(std::fabs(a), std::fabs(b))),
                             gflush[order[p.group_topk - 1]] + gflush[order[p.group_topk]]);
    }
  }
  sel.experts = canonical_topk(zc, K);
  sel.margin = INFINITY;
  double mag = 0, flush = 0;
  if (K < E) {
    std::vector<int> all = canonical_topk(zc, std::min<int64_t>(K + 1, E));
    const int kth = all[K - 1], next = all[K];
    sel.next = next;
    sel.margin = static_cast<double>(zc[kth]) - static_cast<double>(zc[next]);
    mag = std::fabs(zc[kth]);
    if (has_bias) mag = std::max({mag, std::fabs(double(r.b[kth])), std::fabs(double(r.b[next]))});
    if (std::isnan(sel.margin)) sel.margin = INFINITY;  // -inf - -inf: no competitor
    flush = flush_allowance(r.s[kth]) + flush_allowance(r.s[next]);
  }
  sel.delta = std::max({16.0 * ulp(DType::f32, mag), flush, group_delta});
  return sel;
}

// §1.2 steps 4-6 for one row, in double. probs gets scaling * p_e on the selected experts.
void post_process(const Tensor& logits, const RowScores& r, const std::vector<int>& S,
                  const RouterParams& p, bool has_bias, Rounding rnd, int64_t t, Tensor& probs,
                  Tensor& saved) {
  const int64_t E = logits.dim(1), K = static_cast<int64_t>(S.size());
  std::vector<double> xd(E);
  for (int64_t e = 0; e < E; ++e) xd[e] = logits.at(t, e);  // f64 in FD mode, exact widening else
  ArrayXd pe(K);
  switch (p.score_function) {
    case ScoreFunction::softmax: {
      if (p.use_pre_softmax) {
        const double m = *std::max_element(xd.begin(), xd.end());
        ArrayXd ex(E);
        for (int64_t e = 0; e < E; ++e) ex[e] = std::exp(xd[e] - m);
        const ArrayXd s = ex / ex.sum();
        // saved: the fp32 score of step 1, as the kernel saves it (same order of fp32 sums).
        for (int64_t e = 0; e < E; ++e)
          saved.set(t, e, rnd == Rounding::to_dtype ? double(r.s[e]) : s[e]);
        for (int64_t k = 0; k < K; ++k) pe[k] = s[S[k]];
      } else {
        double m = -INFINITY;
        for (int e : S) m = std::max(m, xd[e]);
        for (int64_t k = 0; k < K; ++k) pe[k] = std::exp(xd[S[k]] - m);
        pe /= pe.sum();
        for (int64_t e = 0; e < E; ++e) saved.set(t, e, -INFINITY);
        for (int64_t k = 0; k < K; ++k) saved.set(t, S[k], pe[k]);
      }
      break;
    }
    case ScoreFunction::sigmoid:
    case ScoreFunction::sqrtsoftplus: {
      const bool sig = p.score_function == ScoreFunction::sigmoid;
      // saved_scores is the fp32 score of §1.2 step 1 (score_fn.h, bitwise the kernel's); the
      // sigmoid backward's a(1 - a) amplifies any ulp difference in a near a = 1.
      for (int64_t e = 0; e < E; ++e) {
        const double exact = sig ? sigmoid_d(xd[e]) : xd[e];
        saved.set(t, e, sig && rnd == Rounding::to_dtype ? double(r.s[e]) : exact);
      }
      for (int64_t k = 0; k < K; ++k) {
        const int e = S[k];
        // v_e as the kernel forms it (§1.2 step 4): the fp32 score, unbiased as fl(fl(s + b) - b)
        // in fp32, so a zero bias is bitwise a missing bias (R15). In finite-difference mode the
        // exact double score is used, consistent with the analytic gradient.
        double v;
        if (rnd == Rounding::none) {
          v = sig ? sigmoid_d(xd[e]) : std::sqrt(sp_d(xd[e]));
        } else {
          v = has_bias ? (r.s[e] + r.b[e]) - r.b[e] : r.s[e];
        }
        pe[k] = v;
      }
      if (K > 1) pe /= (pe.sum() + kEps);
      break;
    }
  }
  for (int64_t k = 0; k < K; ++k) probs.set(t, S[k], p.scaling_factor * pe[k]);
}

void check_map_matches(const Tensor& map, int64_t T, int64_t E, MapFormat f, const char* what) {
  require_shape(map.meta(), routing_map_shape(T, E, f), what);
}

}  // namespace

std::vector<RowSelection> topk_router_select(const Tensor& logits, const Tensor* expert_bias,
                                             const RouterParams& p) {
  const TensorMeta bm = expert_bias ? expert_bias->meta() : TensorMeta{};
  validate_topk_router(logits.meta(), expert_bias ? &bm : nullptr, p, true);
  std::vector<RowSelection> out(static_cast<size_t>(logits.dim(0)));
  for (int64_t t = 0; t < logits.dim(0); ++t) {
    out[t] = select_row(row_scores(logits, expert_bias, p, t), p, expert_bias != nullptr);
  }
  return out;
}

namespace {

TopkRouterFwd forward_impl(const Tensor& logits, const Tensor* expert_bias, const RouterParams& p,
                           Rounding r, const Tensor* forced_map) {
  const TensorMeta bm = expert_bias ? expert_bias->meta() : TensorMeta{};
  validate_topk_router(logits.meta(), expert_bias ? &bm : nullptr, p, r == Rounding::none);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const DType d = logits.dtype();
  TopkRouterFwd out{Tensor(out_dtype(d, r), {T, E}),
                    Tensor(p.routing_map_format == MapFormat::bytemap ? DType::boolean : DType::u8,
                           routing_map_shape(T, E, p.routing_map_format)),
                    Tensor(out_dtype(DType::f32, r), {T, E})};
  if (forced_map) check_map_matches(*forced_map, T, E, p.routing_map_format, "routing_map");
  for (int64_t t = 0; t < T; ++t) {
    const RowScores rs = row_scores(logits, expert_bias, p, t);
    std::vector<int> S;
    if (forced_map) {
      for (int64_t e = 0; e < E; ++e)
        if (routing_map_get(*forced_map, t, e)) S.push_back(static_cast<int>(e));
      if (static_cast<int64_t>(S.size()) != p.topk) {
        throw std::invalid_argument("routing_map: row " + std::to_string(t) + " has " +
                                    std::to_string(S.size()) +
                                    " experts, expected topk=" + std::to_string(p.topk));
      }
    } else {
      S = select_row(rs, p, expert_bias != nullptr).experts;
    }
    post_process(logits, rs, S, p, expert_bias != nullptr, r, t, out.probs, out.saved_scores);
    for (int e : S) routing_map_set(out.routing_map, t, e, true);
  }
  return out;
}

}  // namespace

TopkRouterFwd topk_router_fwd(const Tensor& logits, const Tensor* expert_bias,
                              const RouterParams& p, Rounding r) {
  return forward_impl(logits, expert_bias, p, r, nullptr);
}

TopkRouterFwd topk_router_fwd_forced(const Tensor& logits, const Tensor* expert_bias,
                                     const RouterParams& p, const Tensor& routing_map, Rounding r) {
  return forward_impl(logits, expert_bias, p, r, &routing_map);
}

Tensor topk_router_bwd(const Tensor& grad_probs, const Tensor& routing_map,
                       const Tensor& saved_scores, const RouterParams& p, Rounding r) {
  require_rank(grad_probs.meta(), 2, "grad_probs");
  const DType dg = grad_probs.dtype();
  if (!(dg == DType::f32 || dg == DType::bf16 || dg == DType::f16 ||
        (dg == DType::f64 && r == Rounding::none))) {
    throw std::invalid_argument("grad_probs: unsupported dtype " + std::string(dtype_name(dg)));
  }
  const int64_t T = grad_probs.dim(0), E = grad_probs.dim(1);
  require_shape(saved_scores.meta(), {T, E}, "saved_scores");
  if (!(saved_scores.dtype() == DType::f32 ||
        (r == Rounding::none && saved_scores.dtype() == DType::f64))) {
    throw std::invalid_argument("saved_scores: must be float32, got " + saved_scores.describe());
  }
  const MapFormat fmt =
      routing_map.dtype() == DType::u8 ? MapFormat::bitmap_u8 : MapFormat::bytemap;
  check_map_matches(routing_map, T, E, fmt, "routing_map");
  if (E <= 0) throw std::invalid_argument("num_experts: must be > 0, got " + std::to_string(E));
  if (!std::isfinite(p.scaling_factor)) {
    throw std::invalid_argument("scaling_factor: must be finite, got " +
                                std::to_string(p.scaling_factor));
  }

  Tensor grad(out_dtype(dg, r), {T, E});
  ArrayXd g(E), a(E), rr(E), out(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      g[e] = grad_probs.at(t, e) * p.scaling_factor;
      a[e] = saved_scores.at(t, e);
      rr[e] = routing_map_get(routing_map, t, e) ? 1.0 : 0.0;
    }
    switch (p.score_function) {
      case ScoreFunction::sigmoid:
      case ScoreFunction::sqrtsoftplus: {
        const bool sig = p.score_function == ScoreFunction::sigmoid;
        ArrayXd y(E), c(E);
        for (int64_t e = 0; e < E; ++e) {
          if (sig) {
            y[e] = a[e];
            c[e] = a[e] * (1.0 - a[e]);
          } else {
            y[e] = std::sqrt(sp_d(a[e]));
            c[e] = (a[e] > 20.0 ? 1.0 : sigmoid_d(a[e])) / (2.0 * y[e] + kEps);
          }
        }
        if (p.topk > 1) {
          double A = 0, B = 0;
          for (int64_t e = 0; e < E; ++e)
            if (rr[e] != 0.0) {
              A += y[e];
              B += g[e] * y[e];
            }
          for (int64_t e = 0; e < E; ++e)
            g[e] = rr[e] != 0.0 ? g[e] / (A + kEps) - B / ((A + kEps) * (A + kEps)) : 0.0;
        } else {
          g *= rr;
        }
        out = g * c;
        break;
      }
      case ScoreFunction::softmax: {
        if (p.use_pre_softmax) {
          g *= rr;
          const double dot = (g * a).sum();
          out = a * (g - dot);
        } else {
          double dot = 0;
          for (int64_t e = 0; e < E; ++e)
            if (rr[e] != 0.0) dot += g[e] * a[e];
          for (int64_t e = 0; e < E; ++e) out[e] = rr[e] != 0.0 ? a[e] * (g[e] - dot) : 0.0;
        }
        break;
      }
    }
    for (int64_t e = 0; e < E; ++e) grad.set(t, e, out[e]);
  }
  return grad;
}

}  // namespace moe::ref
