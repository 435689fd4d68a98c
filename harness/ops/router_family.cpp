// Pieces shared by the router-family records: parameters of a Case, logits per regime, and the
// tie-aware comparison of SPEC §1.4.
#include "harness/ops/router_family.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness/core/rng.h"
#include "harness/core/score_fn.h"

namespace moe::ops {

RouterParams router_params(const Case& c) {
  RouterParams p;
  p.topk = c.i("topk");
  p.score_function = parse_score_function(c.s("score_function", "softmax"));
  p.use_pre_softmax = c.b("use_pre_softmax", false);
  p.num_groups = c.i("num_groups", 0);
  p.group_topk = c.i("group_topk", 0);
  p.scaling_factor = c.f("scaling_factor", 1.0);
  p.routing_map_format = parse_map_format(c.s("routing_map_format", "bytemap"));
  return p;
}

Tensor make_logits(const Case& c, int64_t T, int64_t E, int64_t K, const std::string& name) {
  Tensor x(c.dtype, {T, E});
  Rng rng(c.seed, name);
  const DType d = c.dtype;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double v = 0;
      switch (c.regime) {
        case Regime::uniform:
        case Regime::zero_tokens:
          v = 2.0 * rng.normal();
          break;
        case Regime::skewed:  // the first eighth of the experts are strongly preferred
          v = rng.normal() + (e < std::max<int64_t>(1, E / 8) ? 3.0 : 0.0);
          break;
        case Regime::exact_ties:  // few distinct values: bitwise-equal scores everywhere
          v = 0.5 * static_cast<double>(rng.below(5) - 2);
          break;
        case Regime::near_ties:
          v = rng.normal();
          break;
        case Regime::large_magnitude:
          v = (rng.coin() ? 1.0 : -1.0) * rng.uniform(100.0, d == DType::f16 ? 3000.0 : 10000.0);
          break;
        case Regime::all_to_one:  // every token prefers the same K experts
          v = rng.normal() + (e < K ? 12.0 : 0.0);
          break;
        case Regime::every_pattern: {
          // Element i holds pattern i mod 2^16 of f16 (f16 logits) or bf16 (bf16 and f32: exact
          // in both), non-finite patterns as 0 (SPEC §0: finite inputs): T * E >= 65536 covers
          // every finite value, so a lookup table or a special case of some range is read whole.
          const auto bits = static_cast<uint16_t>((t * E + e) & 0xffff);
          v = d == DType::f16 ? f16_value(bits) : bf16_value(bits);
          if (!std::isfinite(v)) v = 0.0;
          break;
        }
      }
      x.set(t, e, v);
    }
    if (c.regime == Regime::near_ties && K < E) {
      // Put the (K+1)-th largest logit one ulp of d below the K-th: scores differ by ~1 ulp.
      std::vector<int64_t> idx(E);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(),
                       [&](int64_t a, int64_t b) { return x.at(t, a) > x.at(t, b); });
      const double kth = x.at(t, idx[K - 1]);
      x.set(t, idx[K], kth - ulp(d, kth));
    }
  }
  return x;
}

TensorMap fd_mask_large_rows(const Tensor& logits) {
  Tensor mask(DType::f64, logits.shape());
  for (int64_t t = 0; t < logits.dim(0); ++t) {
    double mx = 0;
    for (int64_t e = 0; e < logits.dim(1); ++e) mx = std::max(mx, std::fabs(logits.at(t, e)));
    for (int64_t e = 0; e < logits.dim(1); ++e) mask.set(t, e, mx <= kFdMaxLogit ? 1.0 : 0.0);
  }
  TensorMap m;
  m.emplace("input.logits", std::move(mask));
  return m;
}

std::vector<int64_t> routing_rows_differ(const Tensor& a, const Tensor& b) {
  std::vector<int64_t> rows;
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || a.rank() != 2) return rows;
  for (int64_t t = 0; t < a.dim(0); ++t) {
    for (int64_t j = 0; j < a.dim(1); ++j) {
      if (a.at(t, j) != b.at(t, j)) {
        rows.push_back(t);
        break;
      }
    }
  }
  return rows;
}

rc::Gen<std::pair<int64_t, int64_t>> gen_edge_experts_topk() {
  return rc::gen::exec([] {
    if (*rc::gen::element(false, false, false, true)) {  // K = E at small E (a known miss)
      const int64_t E = *rc::gen::elementOf(std::vector<int64_t>{1, 2, 3, 4, 7, 8, 9, 16});
      return std::make_pair(E, E);
    }
    const int64_t E = *rc::gen::elementOf(kEdgeExperts);
    const int64_t kmax = E > 1024 ? 32 : E;
    int64_t K = *rc::gen::elementOf(std::vector<int64_t>{1, E, E - 1, 8, 16, 32, 33, 0});
    if (K == 0) K = *any_in(1, kmax + 1);
    K = std::clamp<int64_t>(K, 1, kmax);
    return std::make_pair(E, K);
  });
}

rc::Gen<GroupedShape> gen_edge_grouped() {
  return rc::gen::exec([] {
    const int64_t G = *rc::gen::elementOf(std::vector<int64_t>{1, 2, 4, 8, 16, 32, 33});
    const int64_t per = *rc::gen::elementOf(std::vector<int64_t>{1, 2, 8, 9, 32, 33});
    const int64_t gk = *rc::gen::elementOf(std::vector<int64_t>{G, 1, 0});  // 0: random
    GroupedShape s{G * per, 0, G, gk == 0 ? *any_in(1, G + 1) : gk};
    // k' = K/g_k: whole groups (k' = E/G), one, or random, with K <= 32 beyond E = 1024.
    int64_t kp = *rc::gen::elementOf(std::vector<int64_t>{per, 1, 0});
    if (kp == 0) kp = *any_in(1, per + 1);
    if (s.E > 1024) kp = std::min<int64_t>(kp, std::max<int64_t>(1, 32 / s.gk));
    s.K = s.gk * kp;
    return s;
  });
}

rc::Gen<int64_t> gen_edge_rows(int64_t cols) {
  return rc::gen::exec([cols] {
    int64_t T = *rc::gen::elementOf(std::vector<int64_t>{1, 2, 0, 257, -1});
    if (T < 0) T = *any_in(1, 24);
    const int64_t cap = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols));
    return std::min(T, cap);
  });
}

// ---- Rounding-aware error budgets ------------------------------------------------------------
//
// SPEC §1.2/§2 fix the kernels' arithmetic: fp32 scores, an fp32 sum, one division (or a
// reciprocal and a multiply), one fp32 multiply by scaling_factor, then ONE rounding to d. With
// u = 2^-24 and first-order error analysis (Higham, Accuracy and Stability, §2-3):
//  - a score s_j (sigmoid, sqrtsoftplus, exp) is within a_j = score_abs_err(s_j) = 8u|s_j| +
//    4 * 2^-150 of the exact value (4 ulp_f32: score_fn.h's ~1-2 ulp and a correctly rounded
//    libm both pass; SPEC §1.4's "a few ulps" between implementations);
//  - softmax's exp(fl(x_j - m)): the subtraction adds u|x_j - m| relative error to exp's result;
//  - a bias round trip v = fl(fl(s + b) - b) adds u(|s + b| + |s|) (SPEC §1.2 step 4);
//  - a sum of n positive terms in any order: (n - 1)u of the sum, plus the sum of the terms'
//    own errors; "+ eps", the division (or reciprocal and multiply) and the scaling multiply one u
//    each (two for reciprocal + multiply).
// So p_e = sf * num_e / D, D = sum num_j + eps, has
//    e_e = |sf| (err_e + p_e * sum err_j) / D + |sf p_e| * rounds * u,
// rounds = (n - 1) + the roundings after the sum. Second order: e / (1 - rho), rho = e/|x|
// (Higham's gamma_n = nu / (1 - nu)), plus 2^-150 per rounding for fp32 underflow as tol_bound.
// A bf16 normaliser (error ~2^-9 relative) is far outside this (e ~ (K + 20) u relative).

namespace {

constexpr double kEps = static_cast<double>(kRouterEps);

double sp_d(double x) {
  return x > 20.0 ? x : std::log1p(std::exp(x));
}
double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// e / (1 - rho) with rho capped at 1/2, plus the underflow of `rounds` roundings scaled by sf.
double second_order(double e, double x, int64_t rounds, double sf) {
  const double rho = x != 0 ? std::min(0.5, e / std::fabs(x)) : 0.0;
  return e / (1.0 - rho) +
         static_cast<double>(rounds + 1) * kUnder32 * std::max(1.0, std::fabs(sf));
}

// Errors of sf * num_e / (sum_{in_sum} num_j + eps) for every e (see above).
std::vector<double> ratio_err(const std::vector<double>& num, const std::vector<double>& err,
                              const std::vector<char>& in_sum, double eps, double sf,
                              int64_t rounds) {
  const size_t E = num.size();
  double D = eps, sum_err = 0;
  for (size_t j = 0; j < E; ++j)
    if (in_sum[j]) {
      D += num[j];
      sum_err += err[j];
    }
  std::vector<double> e(E, 0.0);
  if (!(D > 0)) return e;
  for (size_t j = 0; j < E; ++j) {
    const double p = num[j] / D, x = sf * p;
    const double e1 = std::fabs(sf) * (err[j] + p * sum_err) / D +
                      std::fabs(x) * static_cast<double>(rounds) * kU32;
    e[j] = second_order(e1, x, rounds, sf);
  }
  return e;
}

}  // namespace

double score_abs_err(double s) {
  // SPEC's sigma(x) = 1/(1 + exp(-x)) evaluated literally in fp32 (TE: utils.h:135) overflows
  // exp(-x) to +inf and returns 0 once sigma(x) < 1/FLT_MAX ~ 2^-128, where the exact value is
  // still a subnormal; that whole value is then admissible error (first GPU TE run, issue 18).
  const double flushed = std::fabs(s) < 0x1.0p-128 ? std::fabs(s) : 0.0;
  return 8.0 * kU32 * std::fabs(s) + 4.0 * kUnder32 + flushed;
}

RowErr topk_router_row_err(const RouterParams& p, const double* x, const double* bias,
                           const std::vector<char>& sel) {
  const int64_t E = static_cast<int64_t>(sel.size()), K = p.topk;
  const double sf = p.scaling_factor;
  RowErr r;
  r.probs.assign(E, 0.0);
  r.saved.assign(E, 0.0);
  std::vector<double> num(E, 0.0), err(E, 0.0);
  if (p.score_function == ScoreFunction::softmax) {
    const bool pre = p.use_pre_softmax;
    double m = -INFINITY;
    for (int64_t j = 0; j < E; ++j)
      if (pre || sel[j]) m = std::max(m, x[j]);
    for (int64_t j = 0; j < E; ++j) {
      if (!(pre || sel[j])) continue;
      num[j] = std::exp(x[j] - m);
      // exp's own error, and the rounding of x_j - m moved into the exponent.
      err[j] = num[j] * std::fabs(x[j] - m) * kU32 * (1.0 + 0x1.0p-20) + score_abs_err(num[j]);
    }
    const std::vector<char> in_sum = pre ? std::vector<char>(E, 1) : sel;
    const int64_t n = pre ? E : K;
    // probs: sum (n - 1), division as reciprocal + multiply (2), scaling (1).
    r.probs = ratio_err(num, err, in_sum, 0.0, sf, n + 2);
    // saved: the same fp32 value before scaling (softmax-post: p_e on the selection, -inf else).
    r.saved = ratio_err(num, err, in_sum, 0.0, 1.0, n + 1);
    for (int64_t j = 0; j < E; ++j) {
      if (!sel[j]) r.probs[j] = 0.0;
      if (!pre && !sel[j]) r.saved[j] = 0.0;
    }
    return r;
  }
  const bool sig = p.score_function == ScoreFunction::sigmoid;
  for (int64_t j = 0; j < E; ++j) {
    const double s = sig ? sigmoid_d(x[j]) : std::sqrt(sp_d(x[j]));
    if (sig) r.saved[j] = score_abs_err(s);  // sqrtsoftplus saves the raw logit: exact
    if (!sel[j]) continue;
    num[j] = s;
    err[j] = score_abs_err(s);
    if (bias) {  // v = fl(fl(s + b) - b)
      err[j] += kU32 * (std::fabs(s + bias[j]) + std::fabs(s)) * (1.0 + 4 * kU32) + 2.0 * kUnder32;
    }
  }
  if (K > 1) {
    // sum (K - 1), + eps (1), division as reciprocal + multiply (2), scaling (1).
    r.probs = ratio_err(num, err, sel, kEps, sf, K + 3);
  } else {
    for (int64_t j = 0; j < E; ++j) {
      if (!sel[j]) continue;
      const double xv = sf * num[j];
      r.probs[j] = second_order(std::fabs(sf) * err[j] + std::fabs(xv) * kU32, xv, 1, sf);
    }
  }
  return r;
}

RowErr aux_scores_row_err(ScoreFunction f, const double* x, int64_t E) {
  RowErr r;
  r.saved.assign(E, 0.0);
  std::vector<double> num(E), err(E);
  const std::vector<char> all(E, 1);
  if (f == ScoreFunction::softmax) {
    double m = -INFINITY;
    for (int64_t j = 0; j < E; ++j) m = std::max(m, x[j]);
    for (int64_t j = 0; j < E; ++j) {
      num[j] = std::exp(x[j] - m);
      err[j] = num[j] * std::fabs(x[j] - m) * kU32 * (1.0 + 0x1.0p-20) + score_abs_err(num[j]);
    }
    // sum (E - 1), reciprocal + multiply (2); saved_scores = scores.
    r.probs = ratio_err(num, err, all, 0.0, 1.0, E + 1);
    r.saved = r.probs;
    return r;
  }
  const bool sig = f == ScoreFunction::sigmoid;
  for (int64_t j = 0; j < E; ++j) {
    num[j] = sig ? sigmoid_d(x[j]) : std::sqrt(sp_d(x[j]));
    err[j] = score_abs_err(num[j]);
    if (sig) r.saved[j] = err[j];
  }
  // sum (E - 1), + eps (1), reciprocal + multiply (2).
  r.probs = ratio_err(num, err, all, kEps, 1.0, E + 2);
  return r;
}

// Backward (SPEC §1.3, §2), first order, every fp32 operation one u and the kernel's own saved
// scores a' within da of the reference's a. With g_e rounded once (the scaling multiply):
//  softmax: dot = sum_r g a: |d dot| <= sum_r |g| da + (n + 1)u sum_r |g a| (product, g and the
//    n - 1 additions); grad = a (g - dot): a * [u|g| + d dot + u(|g| + sum|g a|)] + |g - dot| da
//    + u |grad| (the final multiply).
//  sigmoid/sqrtsoftplus: y = a (sigmoid) or sqrt(sp(a)) in fp32 (dy = da, or score_abs_err(y));
//    A = sum_r y (dA = sum dy + K u A, "+ eps" included), B = sum_r g y (dB = sum |g| dy + (K + 1)u
//    sum|g y|); g' = g/A - B/A^2 (u_e = g/A: 3u + dA/A with g's rounding and the subtraction;
//    w = B/A^2: dB/A^2 + sum|g y|/A^2 (2 dA/A + 3u)); c = a(1 - a) (dc = |1 - 2a| da + 2u|c|)
//    or sigma(a)/(2y + eps) (dc = 2 score errors + 2u, relative); grad = g' c: |c| dg' + |g'| dc
//    + u|g' c|.
std::vector<double> grad_row_err(ScoreFunction f, bool pre, bool normalised, const double* g,
                                 const double* a, const double* da,
                                 const std::vector<char>& routed) {
  const int64_t E = static_cast<int64_t>(routed.size());
  std::vector<double> e(E, 0.0);
  int64_t K = 0;
  for (int64_t j = 0; j < E; ++j) K += routed[j] != 0;
  const double Kd = static_cast<double>(K);
  if (f == ScoreFunction::softmax) {
    double dot = 0, dm = 0, gda = 0;
    for (int64_t j = 0; j < E; ++j)
      if (routed[j]) {
        dot += g[j] * a[j];
        dm += std::fabs(g[j] * a[j]);
        gda += std::fabs(g[j]) * da[j];
      }
    const double ddot = gda + (Kd + 1) * kU32 * dm;
    for (int64_t j = 0; j < E; ++j) {
      if (!routed[j] && !pre) continue;
      const double gj = routed[j] ? g[j] : 0.0;
      const double inner = gj - dot;
      const double err_inner = kU32 * std::fabs(gj) + ddot + kU32 * (std::fabs(gj) + dm);
      const double x = a[j] * inner;
      const double e1 =
          std::fabs(a[j]) * err_inner + std::fabs(inner) * da[j] + kU32 * std::fabs(x);
      e[j] = second_order(e1, x, K + 6, 1.0);
    }
    return e;
  }
  const bool sig = f == ScoreFunction::sigmoid;
  std::vector<double> y(E), dy(E), c(E), dc(E);
  for (int64_t j = 0; j < E; ++j) {
    if (sig) {
      y[j] = a[j];
      dy[j] = da[j];
      c[j] = a[j] * (1.0 - a[j]);
      dc[j] = std::fabs(1.0 - 2.0 * a[j]) * da[j] + 2.0 * kU32 * std::fabs(c[j]);
    } else {
      y[j] = std::sqrt(sp_d(a[j]));
      dy[j] = score_abs_err(y[j]);
      const double sg = a[j] > 20.0 ? 1.0 : sigmoid_d(a[j]);
      const double den = 2.0 * y[j] + kEps;
      c[j] = sg / den;
      // sigma's and y's errors, "+ eps" and the division.
      dc[j] = (a[j] > 20.0 ? 0.0 : score_abs_err(sg)) / den + c[j] * 2.0 * dy[j] / den +
              2.0 * kU32 * c[j];
    }
  }
  double A = 0, B = 0, bm = 0, sdy = 0, gdy = 0;
  for (int64_t j = 0; j < E; ++j)
    if (routed[j]) {
      A += y[j];
      B += g[j] * y[j];
      bm += std::fabs(g[j] * y[j]);
      sdy += dy[j];
      gdy += std::fabs(g[j]) * dy[j];
    }
  const double Ae = A + kEps;
  const double dA = sdy + Kd * kU32 * Ae;
  const double dB = gdy + (Kd + 1) * kU32 * bm;
  for (int64_t j = 0; j < E; ++j) {
    if (!routed[j]) continue;
    double gp, dgp;
    if (normalised) {
      gp = g[j] / Ae - B / (Ae * Ae);
      dgp = std::fabs(g[j]) / Ae * (3.0 * kU32 + dA / Ae) + dB / (Ae * Ae) +
            bm / (Ae * Ae) * (2.0 * dA / Ae + 3.0 * kU32);
    } else {
      gp = g[j];
      dgp = kU32 * std::fabs(g[j]);
    }
    const double x = gp * c[j];
    const double e1 = std::fabs(c[j]) * dgp + std::fabs(gp) * dc[j] + kU32 * std::fabs(x);
    e[j] = second_order(e1, x, K + 10, 1.0);
  }
  return e;
}

std::vector<char> scan_topk_f32(const std::vector<float>& v, int64_t k) {
  const int64_t n = static_cast<int64_t>(v.size());
  std::vector<char> taken(n, 0);
  for (int64_t pick = 0; pick < k; ++pick) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (taken[i]) continue;
      if (best < 0 || v[i] > v[best]) best = i;  // strict: the lowest index wins a tie
    }
    if (best < 0) break;
    taken[best] = 1;
  }
  return taken;
}

std::vector<char> router_select_f32(const RouterParams& p, const float* x, const float* bias,
                                    int64_t E) {
  std::vector<float> z(E);
  switch (p.score_function) {
    case ScoreFunction::softmax:
      if (p.use_pre_softmax) {
        score::softmax_f32(x, z.data(), E);
      } else {
        z.assign(x, x + E);
      }
      break;
    case ScoreFunction::sigmoid:
      for (int64_t e = 0; e < E; ++e) z[e] = score::sigmoid_f32(x[e]);
      break;
    case ScoreFunction::sqrtsoftplus:
      for (int64_t e = 0; e < E; ++e) z[e] = score::sqrtsoftplus_f32(x[e]);
      break;
  }
  if (bias)
    for (int64_t e = 0; e < E; ++e) z[e] = z[e] + bias[e];
  if (p.grouped()) {
    const int64_t G = p.num_groups, per = E / G, kg = p.topk / p.group_topk;
    std::vector<float> gs(G);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> part(z.begin() + g * per, z.begin() + (g + 1) * per);
      std::vector<char> taken(per, 0);
      float acc = 0.0f;
      for (int64_t pick = 0; pick < kg; ++pick) {  // fp32 sum in selection order
        int64_t best = -1;
        for (int64_t i = 0; i < per; ++i)
          if (!taken[i] && (best < 0 || part[i] > part[best])) best = i;
        taken[best] = 1;
        acc = acc + part[best];
      }
      gs[g] = acc;
    }
    const std::vector<char> keep = scan_topk_f32(gs, p.group_topk);
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) z[e] = -INFINITY;
  }
  return scan_topk_f32(z, p.topk);
}

std::vector<std::string> saved_scores_self_check(const RouterParams& p, bool aux,
                                                 const Tensor& logits, const Tensor& saved,
                                                 const Tensor& map) {
  std::vector<std::string> bad;
  const int64_t T = logits.dim(0), E = logits.dim(1);
  if (saved.dtype() != DType::f32 || saved.shape() != logits.shape()) return bad;  // R2 elsewhere
  std::vector<float> x(E), s(E);
  for (int64_t t = 0; t < T && bad.size() < 4; ++t) {
    for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits.at(t, e));
    const bool softmax = p.score_function == ScoreFunction::softmax;
    if (softmax && aux) return bad;  // aux softmax: saved == scores, the caller's check
    if (softmax && p.use_pre_softmax) score::softmax_f32(x.data(), s.data(), E);
    for (int64_t e = 0; e < E; ++e) {
      const double got = saved.at(t, e);
      double want;
      if (p.score_function == ScoreFunction::sigmoid) {
        want = score::sigmoid_f32(x[e]);
      } else if (p.score_function == ScoreFunction::sqrtsoftplus) {
        want = x[e];
      } else if (p.use_pre_softmax) {
        want = s[e];
      } else if (!routing_map_get(map, t, e)) {
        want = -INFINITY;
      } else {
        if (!std::isfinite(got))
          bad.push_back("saved_scores(" + std::to_string(t) + ", " + std::to_string(e) +
                        ") is not finite on the selection (softmax post)");
        continue;
      }
      const float gf = static_cast<float>(got), wf = static_cast<float>(want);
      if (score::float_bits(gf) != score::float_bits(wf)) {
        bad.push_back("saved_scores(" + std::to_string(t) + ", " + std::to_string(e) + ") = " +
                      format_double(got) + " is not score_fn's fp32 value " + format_double(want));
        break;
      }
    }
  }
  return bad;
}

}  // namespace moe::ops
