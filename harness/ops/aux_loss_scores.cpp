// Registry record of aux_loss_scores (SPEC §2).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "harness/core/rng.h"
#include "harness/core/score_fn.h"
#include "harness/ops/check.h"
#include "harness/ops/router_family.h"
#include "harness/ops/ties.h"
#include "reference/aux_loss.h"

namespace moe::ops {

namespace {

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c;
    c.op = "aux_loss_scores";
    c.dtype = *rc::gen::element(DType::f32, DType::bf16, DType::f16);
    c.regime =
        *rc::gen::element(Regime::uniform, Regime::skewed, Regime::exact_ties, Regime::near_ties,
                          Regime::large_magnitude, Regime::all_to_one, Regime::zero_tokens);
    c.seed = *rc::gen::arbitrary<uint32_t>();
    // Half the cases at the edges (issue 19): K = 1, K = E, warp/block multiples and one past
    // them, E up to 4096, T = 0, 1, 257.
    int64_t E, K, T;
    if (*rc::gen::element(false, true)) {
      std::tie(E, K) = *gen_edge_experts_topk();
      T = *gen_edge_rows(E);
    } else {
      E = *any_in(1, 70);
      K = *any_in(1, E + 1);
      T = *any_in(1, 24);
    }
    c.set("T", c.regime == Regime::zero_tokens ? int64_t{0} : T);
    c.set("E", E).set("topk", K);
    c.set("score_function", *rc::gen::element<std::string>("softmax", "sigmoid", "sqrtsoftplus"));
    c.set("routing_map_format", *rc::gen::element<std::string>("bytemap", "bitmap_u8"));
    return c;
  });
}

Case base(DType d, int64_t T, int64_t E, int64_t K, const std::string& f, const std::string& name) {
  Case c;
  c.op = "aux_loss_scores";
  c.dtype = d;
  c.seed = 11;
  c.set("name", name).set("T", T).set("E", E).set("topk", K).set("score_function", f);
  c.set("routing_map_format", "bytemap");
  return c;
}

std::vector<Case> named() {
  std::vector<Case> v;
  for (const char* f : {"softmax", "sigmoid", "sqrtsoftplus"}) {  // R10: bf16 logits, f32 scores
    v.push_back(base(DType::bf16, 128, 32, 4, f, std::string("R10_") + f));
  }
  v.push_back(base(DType::f32, 16, 8, 1, "sigmoid", "k1_normalised_over_all"));
  v.push_back(
      base(DType::f16, 16, 64, 8, "softmax", "bitmap").set("routing_map_format", "bitmap_u8"));
  v.push_back(base(DType::f32, 0, 8, 2, "softmax", "zero_tokens"));
  v.back().regime = Regime::zero_tokens;
  // Edges (issue 19): K = E = 8 for every score function; one past a warp; the maximum E.
  for (const char* f : {"softmax", "sigmoid", "sqrtsoftplus"})
    v.push_back(base(DType::bf16, 16, 8, 8, f, std::string("e8_k8_") + f));
  v.push_back(base(DType::bf16, 16, 33, 33, "sigmoid", "e33_k33"));
  v.push_back(base(DType::f32, 16, 33, 1, "sqrtsoftplus", "e33_k1"));
  v.push_back(base(DType::bf16, 4, 4096, 32, "softmax", "e4096_k32"));
  // Every finite bf16 logit (regime every_pattern), at E = 256 and at E = 200 (empty lanes).
  v.push_back(base(DType::bf16, 256, 256, 8, "sigmoid", "every_bf16_e256"));
  v.back().regime = Regime::every_pattern;
  v.push_back(base(DType::bf16, 328, 200, 8, "sigmoid", "every_bf16_e200"));
  v.back().regime = Regime::every_pattern;
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E");
  TensorMap m;
  m.emplace("input.logits", make_logits(c, T, E, c.i("topk"), "input.logits"));
  Tensor ct(DType::f32, {T, E});
  Rng rng(c.seed, "cotangent.scores");
  fill_normal(ct, rng, 1.0);
  m.emplace("cotangent.scores", std::move(ct));
  return m;
}

TensorMap run_reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const ScoreFunction f = parse_score_function(c.s("score_function"));
  const Tensor& logits = in.at("input.logits");
  ref::AuxLossScoresFwd fw = ref::aux_loss_scores_fwd(
      logits, c.i("topk"), f, parse_map_format(c.s("routing_map_format", "bytemap")), rnd);
  TensorMap out;
  out.emplace("grad.logits", ref::aux_loss_scores_bwd(in.at("cotangent.scores"), fw.saved_scores, f,
                                                      c.dtype, rnd));
  out.emplace("output.scores", std::move(fw.scores));
  out.emplace("output.routing_map", std::move(fw.routing_map));
  out.emplace("output.saved_scores", std::move(fw.saved_scores));
  return out;
}

// SPEC §12's bound: kept for reference and for the tests that compare the two.
[[maybe_unused]] Tensor spec_bound(const Case& c, const std::string& key, const TensorMap& in,
                                   const TensorMap& want) {
  const ScoreFunction f = parse_score_function(c.s("score_function"));
  const Tensor& ref = want.at(key);
  const int64_t E = c.i("E"), n = E + 2;  // the reduction over E plus two fp32 steps
  if (key == "output.scores") return make_bound(TolClass::reduction, DType::f32, ref, n);
  if (key == "output.saved_scores") {
    if (f == ScoreFunction::sqrtsoftplus) return Tensor(DType::f64, ref.shape());  // raw logits
    if (f == ScoreFunction::sigmoid) return make_bound(TolClass::elementwise, DType::f32, ref, 1);
    return make_bound(TolClass::reduction, DType::f32, ref, n);
  }
  const Tensor& a = want.at("output.saved_scores");
  const Tensor& ct = in.at("cotangent.scores");
  const int64_t T = ref.dim(0);
  Tensor mag(DType::f64, {T, E});
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> y(E), cc(E);
    double A = 0, sum_gy = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double ae = a.at(t, e);
      if (f == ScoreFunction::sqrtsoftplus) {
        y[e] = std::sqrt(ae > 20 ? ae : std::log1p(std::exp(ae)));
        cc[e] = (ae > 20 ? 1.0 : 1.0 / (1.0 + std::exp(-ae))) / (2 * y[e] + 1e-20);
      } else {
        y[e] = ae;
        cc[e] = std::fabs(ae * (1 - ae));
      }
      A += y[e];
      sum_gy += std::fabs(ct.at(t, e) * y[e]);
    }
    for (int64_t e = 0; e < E; ++e) {
      const double g = std::fabs(ct.at(t, e));
      mag.set(t, e,
              f == ScoreFunction::softmax ? std::fabs(y[e]) * (g + sum_gy)
                                          : cc[e] * (g / A + sum_gy / (A * A)));
    }
  }
  return make_bound(TolClass::reduction, ref.dtype(), ref, n, &mag);
}

// Rounding-aware bound [DEVIATION: tighter than SPEC §12's 1 ulp + 2n 2^-24 sum|x|]: a correct
// kernel's scores are fp32 values within e of the exact scores (router_family.cpp derives e from
// SPEC §2's fp32 steps), and its grad_logits rnd_d(y) with y within e of the exact backward on
// the reference's saved scores; make_rounded_bound admits exactly those. The scores do not depend
// on the selection, so near-tie rows need no special case.
Tensor bound(const Case& c, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const ScoreFunction f = parse_score_function(c.s("score_function"));
  const Tensor& ref = want.at(key);
  if (key == "output.saved_scores" && f == ScoreFunction::sqrtsoftplus)
    return Tensor(DType::f64, ref.shape());  // the raw logits, bitwise
  const Tensor& logits = in.at("input.logits");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const Tensor& saved = want.at("output.saved_scores");
  const Tensor& ct = in.at("cotangent.scores");
  Tensor err(DType::f64, {T, E});
  std::vector<double> x(E), g(E), a(E), da(E);
  const std::vector<char> all(E, 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) x[e] = logits.at(t, e);
    const RowErr r = aux_scores_row_err(f, x.data(), E);
    if (key != "grad.logits") {
      const std::vector<double>& v = key == "output.scores" ? r.probs : r.saved;
      for (int64_t e = 0; e < E; ++e) err.set(t, e, v[e]);
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {
      g[e] = ct.at(t, e);
      a[e] = saved.at(t, e);
      // softmax: the reference saves rnd_f32(x), a kernel within e of x; sigmoid: both within e.
      da[e] = f == ScoreFunction::softmax ? r.saved[e] + ulp(DType::f32, a[e]) : 2.0 * r.saved[e];
    }
    const std::vector<double> ge =
        grad_row_err(f, f == ScoreFunction::softmax, true, g.data(), a.data(), da.data(), all);
    for (int64_t e = 0; e < E; ++e) err.set(t, e, ge[e]);
  }
  if (key == "grad.logits") {
    const Tensor gx = ref::aux_loss_scores_bwd(ct, saved, f, c.dtype, ref::Rounding::none);
    return make_rounded_bound(ref.dtype(), ref, gx, err);
  }
  const ref::AuxLossScoresFwd fx = ref::aux_loss_scores_fwd(
      logits, c.i("topk"), f, parse_map_format(c.s("routing_map_format", "bytemap")),
      ref::Rounding::none);
  return make_rounded_bound(DType::f32, ref, key == "output.scores" ? fx.scores : fx.saved_scores,
                            err);
}

// SPEC §1.4 applied to the top-K of the fp32 scores: rows may differ only on near ties, where
// the implementation's own selection is accepted.
Report compare(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  const OpInfo& op = *find_op("aux_loss_scores");
  auto gm = got.find("output.routing_map");
  const Tensor& wm = want.at("output.routing_map");
  if (gm == got.end() || gm->second.shape() != wm.shape() || gm->second.dtype() != wm.dtype()) {
    return compare_outputs(op, c, in, want, got);
  }
  const std::vector<int64_t> rows = routing_rows_differ(wm, gm->second);
  TensorMap want2 = clone(want);
  std::vector<std::string> failures;
  std::vector<int64_t> accepted;
  std::vector<bool> exact;
  const Tensor& logits = in.at("input.logits");
  const ScoreFunction f = parse_score_function(c.s("score_function"));
  const int64_t E = c.i("E"), K = c.i("topk");
  for (int64_t t : rows) {
    // The margin of the fp32 scores selection is defined on (SPEC §1.4), as the reference's map.
    const ref::AuxSelection sel = ref::aux_selection_scores(logits, t, f);
    const std::vector<float>& s = sel.scores;
    std::vector<int64_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    const double margin = K < E ? double(s[order[K - 1]]) - double(s[order[K]]) : INFINITY;
    // SPEC §1.4's 16 ulp_f32, or (project copy) where larger the two sides' sigmoids below
    // 2^-128 over the row's normaliser: a correct kernel may return those as 0 (SPEC §0). The
    // normaliser's own error scales every score alike and moves no boundary.
    double delta = 16.0 * ulp(DType::f32, s[order[K - 1]]);
    if (f == ScoreFunction::sigmoid && K < E) {
      auto flushed = [&](int64_t e) { return sel.raw[e] < 0x1.0p-128f ? double(sel.raw[e]) : 0.0; };
      delta = std::max(delta, (flushed(order[K - 1]) + flushed(order[K])) / double(sel.den));
    }
    if (margin > delta) {
      failures.push_back("routing_map row " + std::to_string(t) +
                         " differs from the reference outside a near tie (margin " +
                         format_double(margin) + " > delta " + format_double(delta) + ")");
      continue;
    }
    accepted.push_back(t);
    exact.push_back(margin == 0);
    Tensor& m = want2.at("output.routing_map");
    for (int64_t j = 0; j < m.dim(1); ++j) m.set(t, j, gm->second.at(t, j));
  }
  // Exact ties between bitwise-equal logits follow the tie policy in every row.
  for (auto& msg :
       apply_tie_policy(gm->second, in.at("input.logits"), nullptr, K, 0, 0, accepted, exact))
    failures.push_back(msg);
  Report r = compare_outputs(op, c, in, want2, got);
  for (auto& f : failures) r.failures.push_back(f);
  return r;
}

std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  std::vector<std::string> bad;
  const ScoreFunction f = parse_score_function(c.s("score_function"));
  const Tensor& saved = out.at("output.saved_scores");
  const Tensor& scores = out.at("output.scores");
  const Tensor& map = out.at("output.routing_map");
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("topk");
  if (scores.dtype() != DType::f32) bad.push_back("scores must be float32 (R10)");
  for (int64_t t = 0; t < T && bad.size() < 8; ++t) {
    int64_t n = 0;
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      n += routing_map_get(map, t, e);
      sum += scores.at(t, e);
    }
    if (n != K)
      bad.push_back("row " + std::to_string(t) + " has " + std::to_string(n) + " routed experts");
    // softmax rows sum to 1; sigmoid/sqrtsoftplus rows to A/(A+eps), A = sum of the unnormalised u.
    double want = 1.0;
    if (f != ScoreFunction::softmax) {
      double A = 0;
      for (int64_t e = 0; e < E; ++e) {
        const double a = saved.at(t, e);
        A += f == ScoreFunction::sigmoid ? a : std::sqrt(a > 20 ? a : std::log1p(std::exp(a)));
      }
      want = A / (A + 1e-20);
    }
    if (std::fabs(sum - want) > 4.0 * static_cast<double>(E) * 0x1.0p-24) {
      bad.push_back("row " + std::to_string(t) + ": scores sum to " + format_double(sum) +
                    ", expected " + format_double(want));
    }
  }
  // Self-checks that do not trust the reference's saved state: saved_scores are score_fn's fp32
  // values (softmax: the scores themselves), and routing_map is an independent canonical top-K of
  // the kernels' fp32 scores (score_fn.h, row_sum_f32 order, SPEC §1.4).
  const Tensor& logits = in.at("input.logits");
  RouterParams rp;
  rp.topk = K;
  rp.score_function = f;
  for (auto& s : saved_scores_self_check(rp, true, logits, saved, map)) bad.push_back(s);
  if (f == ScoreFunction::softmax && !saved.bitwise_equal(scores))
    bad.push_back("saved_scores differ from scores (softmax)");
  std::vector<float> x(E), s32(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits.at(t, e));
    if (f == ScoreFunction::softmax) {
      score::softmax_f32(x.data(), s32.data(), E);
    } else {
      for (int64_t e = 0; e < E; ++e)
        s32[e] =
            f == ScoreFunction::sigmoid ? score::sigmoid_f32(x[e]) : score::sqrtsoftplus_f32(x[e]);
      const float den = score::row_sum_f32(s32.data(), E) + kRouterEps;
      for (int64_t e = 0; e < E; ++e) s32[e] = s32[e] / den;
    }
    const std::vector<char> sel = scan_topk_f32(s32, K);
    int64_t first = -1;
    for (int64_t e = 0; e < E && first < 0; ++e)
      if ((sel[e] != 0) != routing_map_get(map, t, e)) first = e;
    if (first >= 0) {
      bad.push_back("row " + std::to_string(t) + ": routing_map differs from an independent fp32 " +
                    "top-K (value desc, index asc) at expert " + std::to_string(first));
      break;
    }
  }
  return bad;
}

Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("T")), E = static_cast<double>(c.i("E"));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const double map = c.s("routing_map_format", "bytemap") == "bytemap" ? E : std::ceil(E / 8);
  Cost k;
  k.fwd_bytes = T * (E * d + E * 4 + map + E * 4);
  k.bwd_bytes = T * (E * 4 + E * 4 + E * d);
  return k;
}

nlohmann::json to_params(const Case& c) {
  return {{"topk", c.i("topk")},
          {"score_function", c.s("score_function")},
          {"routing_map_format", c.s("routing_map_format", "bytemap")}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c;
  c.op = "aux_loss_scores";
  c.dtype = d;
  c.seed = seed;
  const Tensor& logits = in.at("input.logits");
  c.set("T", logits.dim(0)).set("E", logits.dim(1));
  c.set("topk", j.at("topk").get<int64_t>());
  c.set("score_function", j.at("score_function").get<std::string>());
  c.set("routing_map_format", j.at("routing_map_format").get<std::string>());
  return c;
}

}  // namespace

const OpInfo& aux_loss_scores_op() {
  static const OpInfo op = [] {
    OpInfo o;
    o.name = "aux_loss_scores";
    o.spec = "SPEC §2";
    o.gen = gen;
    o.named = named;
    o.make_inputs = make_inputs;
    o.reference = run_reference;
    o.bound = bound;
    o.compare = compare;
    o.invariants = invariants;
    o.fd_masks = [](const Case&, const TensorMap& in) {
      return fd_mask_large_rows(in.at("input.logits"));
    };
    o.cost = cost;
    o.to_params = to_params;
    o.from_params = from_params;
    o.bench_cases = [] {
      return std::vector<Case>{base(DType::bf16, 65536, 256, 8, "sigmoid", "deepseek_v3"),
                               base(DType::bf16, 65536, 8, 2, "softmax", "mixtral")};
    };
#ifdef MOE_WITH_CUDA
    o.gpu = aux_loss_scores_gpu;
    o.gpu_bench = aux_loss_scores_gpu_bench;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
