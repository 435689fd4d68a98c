// Registry record of topk_router (SPEC §1).
#include <cmath>
#include <tuple>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/router_family.h"
#include "harness/ops/ties.h"
#include "reference/topk_router.h"

namespace moe::ops {

namespace {

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c;
    c.op = "topk_router";
    c.dtype = *rc::gen::element(DType::f32, DType::bf16, DType::f16);
    c.regime =
        *rc::gen::element(Regime::uniform, Regime::skewed, Regime::exact_ties, Regime::near_ties,
                          Regime::large_magnitude, Regime::all_to_one, Regime::zero_tokens);
    c.seed = *rc::gen::arbitrary<uint32_t>();
    int64_t E, K, G = 0, gk = 0;
    // Weighted toward the edges (issue 19): 3/10 small random ungrouped, 1/10 small random
    // grouped, 4/10 edge (E, K) (K = 1, K = E, warp/block multiples and one past them, E up to
    // 4096), 2/10 edge grouping (g_k = G, g_k = 1, G = 1, whole groups).
    const int mode = *rc::gen::weightedElement<int>({{3, 0}, {1, 1}, {4, 2}, {2, 3}});
    if (mode == 1) {
      G = *any_in(1, 9);
      const int64_t per = *any_in(1, 9);
      E = G * per;
      gk = *any_in(1, G + 1);
      K = gk * *any_in(1, per + 1);
    } else if (mode == 2) {
      std::tie(E, K) = *gen_edge_experts_topk();
    } else if (mode == 3) {
      const GroupedShape s = *gen_edge_grouped();
      E = s.E, K = s.K, G = s.G, gk = s.gk;
    } else {
      E = *any_in(1, 70);
      K = *any_in(1, E + 1);
    }
    const auto f = *rc::gen::element<std::string>("softmax", "sigmoid", "sqrtsoftplus");
    const int64_t T = mode >= 2 ? *gen_edge_rows(E) : *any_in(1, 24);
    c.set("T", c.regime == Regime::zero_tokens ? int64_t{0} : T);
    c.set("E", E).set("topk", K).set("num_groups", G).set("group_topk", gk);
    c.set("score_function", f);
    c.set("use_pre_softmax", f == "softmax" && *rc::gen::arbitrary<bool>());
    c.set("expert_bias", f != "softmax" && *rc::gen::arbitrary<bool>());
    c.set("scaling_factor", *rc::gen::element(1.0, 2.5, 0.75));
    c.set("routing_map_format", *rc::gen::element<std::string>("bytemap", "bitmap_u8"));
    c.set("grad_dtype", std::string(dtype_name(*rc::gen::element(c.dtype, DType::f32))));
    return c;
  });
}

Case base(DType d, int64_t T, int64_t E, int64_t K, const std::string& f, const std::string& name) {
  Case c;
  c.op = "topk_router";
  c.dtype = d;
  c.seed = 7;
  c.set("name", name).set("T", T).set("E", E).set("topk", K).set("score_function", f);
  c.set("use_pre_softmax", false).set("num_groups", int64_t{0}).set("group_topk", int64_t{0});
  c.set("scaling_factor", 1.0).set("routing_map_format", "bytemap").set("expert_bias", false);
  c.set("grad_dtype", std::string(dtype_name(d)));
  return c;
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R2: bf16/f16 logits, T=2048, E=128, K=8, every score-function variant.
  for (DType d : {DType::bf16, DType::f16}) {
    const std::string dn(dtype_name(d));
    v.push_back(base(d, 2048, 128, 8, "softmax", "R2_" + dn + "_softmax_post"));
    v.push_back(
        base(d, 2048, 128, 8, "softmax", "R2_" + dn + "_softmax_pre").set("use_pre_softmax", true));
    v.push_back(base(d, 2048, 128, 8, "sigmoid", "R2_" + dn + "_sigmoid"));
    v.push_back(
        base(d, 2048, 128, 8, "sigmoid", "R2_" + dn + "_sigmoid_bias").set("expert_bias", true));
    v.push_back(base(d, 2048, 128, 8, "sqrtsoftplus", "R2_" + dn + "_sqrtsoftplus"));
  }
  // R2 secondary fix: an f32 cotangent with bf16 logits gives an f32 grad_logits.
  v.push_back(base(DType::bf16, 64, 32, 4, "sigmoid", "R2_bf16_logits_f32_cotangent")
                  .set("grad_dtype", "float32"));
  // R13: exact ties (known answers are asserted in tests/cpu/test_router.cpp).
  v.push_back(base(DType::f32, 4, 8, 3, "sigmoid", "R13_A").set("scaling_factor", 1.0));
  v.back().regime = Regime::exact_ties;
  v.push_back(base(DType::f32, 4, 64, 2, "sigmoid", "R13_B"));
  v.back().regime = Regime::exact_ties;
  v.push_back(base(DType::f32, 4, 64, 16, "sigmoid", "R13_C"));
  v.back().regime = Regime::exact_ties;
  v.push_back(base(DType::f32, 4, 8, 4, "sigmoid", "R13_grouped")
                  .set("num_groups", int64_t{4})
                  .set("group_topk", int64_t{2}));
  v.back().regime = Regime::exact_ties;
  // R15: sigmoid with and without an expert bias.
  v.push_back(base(DType::f32, 64, 32, 4, "sigmoid", "R15_no_bias"));
  v.push_back(base(DType::f32, 64, 32, 4, "sigmoid", "R15_bias").set("expert_bias", true));
  // Catalogue: DeepSeek-V3-like and Mixtral-like shapes, small T; bitmap; edge cases.
  v.push_back(base(DType::bf16, 32, 256, 8, "sigmoid", "deepseek_v3")
                  .set("expert_bias", true)
                  .set("num_groups", int64_t{8})
                  .set("group_topk", int64_t{4})
                  .set("scaling_factor", 2.5));
  // Every finite bf16 / f16 logit (regime every_pattern): the DeepSeek-V3 shape over 256 rows,
  // rows of 200 experts (a 32-lane row layout with empty lanes), and f16 (no sigmoid table).
  v.push_back(base(DType::bf16, 256, 256, 8, "sigmoid", "every_bf16_deepseek_v3")
                  .set("expert_bias", true)
                  .set("num_groups", int64_t{8})
                  .set("group_topk", int64_t{4})
                  .set("scaling_factor", 2.5));
  v.back().regime = Regime::every_pattern;
  v.push_back(base(DType::bf16, 328, 200, 8, "sigmoid", "every_bf16_e200"));
  v.back().regime = Regime::every_pattern;
  v.push_back(base(DType::f16, 256, 256, 8, "sigmoid", "every_f16_e256"));
  v.back().regime = Regime::every_pattern;
  v.push_back(base(DType::bf16, 32, 8, 2, "softmax", "mixtral"));
  v.push_back(base(DType::f32, 16, 64, 6, "sqrtsoftplus", "bitmap_sqrtsoftplus")
                  .set("routing_map_format", "bitmap_u8"));
  v.push_back(base(DType::f16, 16, 7, 7, "softmax", "k_equals_e_pre").set("use_pre_softmax", true));
  v.push_back(base(DType::f32, 16, 1, 1, "sigmoid", "e1_k1"));
  v.push_back(base(DType::f32, 0, 16, 2, "softmax", "zero_tokens"));
  v.back().regime = Regime::zero_tokens;
  v.push_back(base(DType::bf16, 16, 32, 4, "sigmoid", "near_ties"));
  v.back().regime = Regime::near_ties;
  v.push_back(base(DType::f32, 16, 32, 4, "sqrtsoftplus", "large_magnitude"));
  v.back().regime = Regime::large_magnitude;
  // Edges (issue 19): K = E = 8 (one full chunk of 8, everything selected) for every score
  // function, in bf16 where a 1-ulp error is visible; K = 1 one past a warp; K = 32 one past a
  // block; the supported maximum E; g_k = G; T one past a 256-row block.
  v.push_back(base(DType::bf16, 16, 8, 8, "softmax", "e8_k8_softmax_post"));
  v.push_back(
      base(DType::bf16, 16, 8, 8, "softmax", "e8_k8_softmax_pre").set("use_pre_softmax", true));
  v.push_back(base(DType::bf16, 16, 8, 8, "sigmoid", "e8_k8_sigmoid"));
  v.push_back(
      base(DType::bf16, 16, 8, 8, "sigmoid", "e8_k8_sigmoid_bias").set("expert_bias", true));
  v.push_back(base(DType::bf16, 16, 8, 8, "sqrtsoftplus", "e8_k8_sqrtsoftplus"));
  v.push_back(
      base(DType::f32, 16, 8, 8, "sigmoid", "e8_k8_sigmoid_f32").set("scaling_factor", 2.5));
  v.push_back(base(DType::bf16, 16, 33, 1, "sigmoid", "e33_k1"));
  v.push_back(base(DType::bf16, 16, 33, 33, "sqrtsoftplus", "e33_k33"));
  v.push_back(base(DType::bf16, 8, 257, 32, "sigmoid", "e257_k32").set("expert_bias", true));
  v.push_back(
      base(DType::bf16, 4, 4096, 32, "softmax", "e4096_k32_pre").set("use_pre_softmax", true));
  v.push_back(base(DType::f16, 16, 32, 8, "sigmoid", "grouped_gk_eq_g")
                  .set("num_groups", int64_t{4})
                  .set("group_topk", int64_t{4}));
  v.push_back(base(DType::bf16, 257, 16, 4, "softmax", "t257_block_plus_1"));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("topk");
  TensorMap m;
  m.emplace("input.logits", make_logits(c, T, E, K, "input.logits"));
  if (c.b("expert_bias", false)) {
    Tensor b(DType::f32, {E});
    Rng rng(c.seed, "input.expert_bias");
    for (int64_t e = 0; e < E; ++e) {
      b.set(e, c.regime == Regime::exact_ties ? 0.25 * static_cast<double>(rng.below(2))
                                              : rng.uniform(-0.5, 0.5));
    }
    m.emplace("input.expert_bias", std::move(b));
  }
  Tensor ct(parse_dtype(c.s("grad_dtype", std::string(dtype_name(c.dtype)))), {T, E});
  Rng rng(c.seed, "cotangent.probs");
  fill_normal(ct, rng, 1.0);
  m.emplace("cotangent.probs", std::move(ct));
  return m;
}

const Tensor* bias_of(const TensorMap& in) {
  auto it = in.find("input.expert_bias");
  return it == in.end() ? nullptr : &it->second;
}

TensorMap run_reference(const Case& c, const TensorMap& in, bool exact, const Tensor* forced_map) {
  const RouterParams p = router_params(c);
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Tensor& logits = in.at("input.logits");
  ref::TopkRouterFwd f = forced_map
                             ? ref::topk_router_fwd_forced(logits, bias_of(in), p, *forced_map, rnd)
                             : ref::topk_router_fwd(logits, bias_of(in), p, rnd);
  TensorMap out;
  out.emplace("grad.logits", ref::topk_router_bwd(in.at("cotangent.probs"), f.routing_map,
                                                  f.saved_scores, p, rnd));
  out.emplace("output.probs", std::move(f.probs));
  out.emplace("output.routing_map", std::move(f.routing_map));
  out.emplace("output.saved_scores", std::move(f.saved_scores));
  return out;
}

// Number of fp32 terms behind each output element: the reduction length plus the two fp32
// operations applied after it (score function, normalisation/scaling).
int64_t terms(const RouterParams& p, int64_t E) {
  const bool over_all = p.score_function == ScoreFunction::softmax && p.use_pre_softmax;
  return (over_all ? E : p.topk) + 2;
}

// SPEC §12's bound (1 ulp_d + the reduction term): the fallback where the exact forward cannot
// be formed under want's selection.
Tensor spec_bound(const Case& c, const std::string& key, const TensorMap& in,
                  const TensorMap& want) {
  const RouterParams p = router_params(c);
  const Tensor& ref = want.at(key);
  const int64_t T = ref.rank() == 2 ? ref.dim(0) : 0, E = c.i("E");
  const int64_t n = terms(p, E);
  if (key == "output.probs") return make_bound(TolClass::reduction, ref.dtype(), ref, n);
  if (key == "output.saved_scores") {
    if (p.score_function == ScoreFunction::sqrtsoftplus) return Tensor(DType::f64, ref.shape());
    if (p.score_function == ScoreFunction::sigmoid)
      return make_bound(TolClass::elementwise, DType::f32, ref, 1);
    return make_bound(TolClass::reduction, DType::f32, ref, n);
  }
  // grad.logits: bound from the magnitude of the terms of the §1.3 backward.
  const Tensor& a = want.at("output.saved_scores");
  const Tensor& map = want.at("output.routing_map");
  const Tensor& ct = in.at("cotangent.probs");
  Tensor mag(DType::f64, {T, E});
  for (int64_t t = 0; t < T; ++t) {
    double sum_ga = 0, A = 0;
    std::vector<double> y(E), cc(E), g(E);
    for (int64_t e = 0; e < E; ++e) {
      const bool r = routing_map_get(map, t, e);
      g[e] = std::fabs(ct.at(t, e) * p.scaling_factor);
      const double ae = a.at(t, e);
      if (p.score_function == ScoreFunction::sqrtsoftplus) {
        const double sp = ae > 20 ? ae : std::log1p(std::exp(ae));
        y[e] = std::sqrt(sp);
        cc[e] = (ae > 20 ? 1.0 : 1.0 / (1.0 + std::exp(-ae))) / (2 * y[e] + 1e-20);
      } else {
        y[e] = ae;
        cc[e] = std::fabs(ae * (1 - ae));
      }
      if (r) {
        A += y[e];
        if (std::isfinite(ae)) sum_ga += g[e] * std::fabs(y[e]);
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      const bool r = routing_map_get(map, t, e);
      const double ae = a.at(t, e);
      double m = 0;
      if (p.score_function == ScoreFunction::softmax) {
        if (std::isfinite(ae) && (r || p.use_pre_softmax))
          m = std::fabs(ae) * ((r ? g[e] : 0) + sum_ga);
      } else if (r) {
        m = p.topk > 1 ? cc[e] * (g[e] / A + sum_ga / (A * A)) : cc[e] * g[e];
      }
      mag.set(t, e, m);
    }
  }
  return make_bound(TolClass::reduction, ref.dtype(), ref, n, &mag);
}

// Rounding-aware bound [DEVIATION: tighter than SPEC §12's 1 ulp_d + 2n 2^-24 sum|x|]. SPEC §1.2
// fixes the arithmetic up to one final rounding, so a correct kernel's output is rnd_d(y) with y
// within e of the exact value x (e: router_family.cpp's derivation); make_rounded_bound admits
// exactly those values. A bf16 normaliser or any other 1-ulp_d error away from a rounding
// midpoint fails. x is the exact (f64, unrounded) forward under want's own routing map, so the
// exact and rounded selections agree by construction, near-tie rows compared under an
// implementation's selection included; grad.logits' x is the exact backward on want's fp32
// saved scores (the kernel's backward reads its own, within e of those: the da terms).
Tensor bound(const Case& c, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const RouterParams p = router_params(c);
  const Tensor& ref = want.at(key);
  if (key == "output.saved_scores" && p.score_function == ScoreFunction::sqrtsoftplus)
    return Tensor(DType::f64, ref.shape());  // the raw logits, bitwise
  const Tensor& logits = in.at("input.logits");
  const Tensor& map = want.at("output.routing_map");
  const Tensor* bias = bias_of(in);
  ref::TopkRouterFwd fx;
  try {
    fx = ref::topk_router_fwd_forced(logits, bias, p, map, ref::Rounding::none);
  } catch (const std::invalid_argument&) {
    return spec_bound(c, key, in, want);  // want's map is not a valid selection
  }
  const int64_t T = logits.dim(0), E = logits.dim(1);
  Tensor err(DType::f64, {T, E});
  const Tensor& saved = want.at("output.saved_scores");
  const Tensor& ct = in.at("cotangent.probs");
  std::vector<double> x(E), b(E), g(E), a(E), da(E), ge;
  std::vector<char> sel(E);
  if (bias)
    for (int64_t e = 0; e < E; ++e) b[e] = bias->at(e);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      x[e] = logits.at(t, e);
      sel[e] = routing_map_get(map, t, e) ? 1 : 0;
    }
    const RowErr r = topk_router_row_err(p, x.data(), bias ? b.data() : nullptr, sel);
    if (key == "output.probs") {
      for (int64_t e = 0; e < E; ++e) err.set(t, e, r.probs[e]);
      continue;
    }
    if (key == "output.saved_scores") {
      for (int64_t e = 0; e < E; ++e) err.set(t, e, r.saved[e]);
      continue;
    }
    const bool post = p.score_function == ScoreFunction::softmax && !p.use_pre_softmax;
    for (int64_t e = 0; e < E; ++e) {
      g[e] = ct.at(t, e) * p.scaling_factor;
      a[e] = saved.at(t, e);
      // Both sides within r.saved of the exact score; softmax-post's reference is rnd_f32(x).
      da[e] = post ? r.saved[e] + ulp(DType::f32, a[e]) : 2.0 * r.saved[e];
      if (!std::isfinite(a[e])) a[e] = da[e] = 0.0;  // -inf off a softmax-post selection
    }
    ge = grad_row_err(p.score_function, p.score_function == ScoreFunction::softmax && !post,
                      p.topk > 1, g.data(), a.data(), da.data(), sel);
    for (int64_t e = 0; e < E; ++e) err.set(t, e, ge[e]);
  }
  if (key == "output.probs") return make_rounded_bound(ref.dtype(), ref, fx.probs, err);
  if (key == "output.saved_scores")
    return make_rounded_bound(DType::f32, ref, fx.saved_scores, err);
  const Tensor gx = ref::topk_router_bwd(ct, map, saved, p, ref::Rounding::none);
  return make_rounded_bound(ref.dtype(), ref, gx, err);
}

// SPEC §1.4: a selection that differs from the reference is accepted only on near-tie rows, and
// those rows are compared under the implementation's own selection. Exact ties between
// bitwise-equal inputs must follow the canonical rule.
Report compare(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  const OpInfo& op = *find_op("topk_router");
  auto gm = got.find("output.routing_map");
  const Tensor& wm = want.at("output.routing_map");
  if (gm == got.end() || !gm->second.meta().shape.size() || gm->second.shape() != wm.shape() ||
      gm->second.dtype() != wm.dtype()) {
    return compare_outputs(op, c, in, want, got);
  }
  const std::vector<int64_t> rows = routing_rows_differ(wm, gm->second);
  const RouterParams p = router_params(c);
  const Tensor& logits = in.at("input.logits");
  const Tensor* bias = bias_of(in);
  std::vector<std::string> failures;
  std::vector<int64_t> accepted;
  std::vector<bool> exact;
  if (!rows.empty()) {
    const auto sel = ref::topk_router_select(logits, bias, p);
    for (int64_t t : rows) {
      const auto& s = sel[t];
      if (s.margin > s.delta && s.group_margin > s.delta) {
        failures.push_back("routing_map row " + std::to_string(t) +
                           " differs from the reference outside a near tie (margin " +
                           format_double(s.margin) + " > delta " + format_double(s.delta) + ")");
        continue;
      }
      accepted.push_back(t);
      exact.push_back(s.margin == 0 || s.group_margin == 0);
    }
  }
  // Exact ties between bitwise-equal inputs follow the tie policy in every row (--ties te
  // departs from the reference's canonical choice, so rows that agree are checked too).
  for (auto& f : apply_tie_policy(gm->second, logits, bias, p.topk, p.num_groups, p.group_topk,
                                  accepted, exact))
    failures.push_back(f);
  // Compare every tensor under the implementation's own selection.
  Report r = rows.empty()
                 ? compare_outputs(op, c, in, want, got)
                 : compare_outputs(op, c, in, run_reference(c, in, false, &gm->second), got);
  for (auto& f : failures) r.failures.push_back(f);
  return r;
}

std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  std::vector<std::string> bad;
  const RouterParams p = router_params(c);
  const Tensor& probs = out.at("output.probs");
  const Tensor& map = out.at("output.routing_map");
  const Tensor& saved = out.at("output.saved_scores");
  const int64_t T = c.i("T"), E = c.i("E");
  if (saved.dtype() != DType::f32 || saved.shape() != Shape{T, E}) {
    bad.push_back("saved_scores must be float32[T,E], got " + saved.describe());  // R2
  }
  const DType gd = in.at("cotangent.probs").dtype();
  if (out.at("grad.logits").dtype() != gd) {
    bad.push_back("grad_logits must take the cotangent's dtype " + std::string(dtype_name(gd)));
  }
  for (int64_t t = 0; t < T && bad.size() < 8; ++t) {
    int64_t n = 0;
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      const bool r = routing_map_get(map, t, e);
      n += r;
      sum += probs.at(t, e);
      if (!r && probs.at(t, e) != 0.0) {
        bad.push_back("row " + std::to_string(t) + ": non-zero prob at unrouted expert " +
                      std::to_string(e));
      }
    }
    if (n != p.topk) {
      bad.push_back("row " + std::to_string(t) + " has " + std::to_string(n) +
                    " routed experts, expected " + std::to_string(p.topk));
    }
    const double s = std::fabs(p.scaling_factor);
    const double tol = static_cast<double>(p.topk) * ulp(probs.dtype(), s) + 1e-12;
    const bool post = p.score_function == ScoreFunction::softmax && !p.use_pre_softmax;
    if (post && std::fabs(sum - p.scaling_factor) > tol) {
      bad.push_back("row " + std::to_string(t) + ": softmax-post probs sum to " +
                    format_double(sum) + ", expected scaling_factor");
    }
    if (p.score_function == ScoreFunction::softmax && p.use_pre_softmax &&
        std::fabs(sum) > s + tol) {
      bad.push_back("row " + std::to_string(t) + ": softmax-pre probs sum above scaling_factor");
    }
  }
  // Self-checks that do not trust the reference's saved state: saved_scores are bitwise
  // score_fn's fp32 values, and the selection is an independent fp32 top-K (canonical rule).
  const Tensor& logits = in.at("input.logits");
  for (auto& f : saved_scores_self_check(p, false, logits, saved, map)) bad.push_back(f);
  if (saved.shape() == Shape{T, E}) {
    const Tensor* bias = bias_of(in);
    std::vector<float> x(E), b(E);
    if (bias)
      for (int64_t e = 0; e < E; ++e) b[e] = static_cast<float>(bias->at(e));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits.at(t, e));
      const std::vector<char> sel = router_select_f32(p, x.data(), bias ? b.data() : nullptr, E);
      int64_t first = -1;
      for (int64_t e = 0; e < E && first < 0; ++e)
        if ((sel[e] != 0) != routing_map_get(map, t, e)) first = e;
      if (first >= 0) {
        bad.push_back("row " + std::to_string(t) +
                      ": routing_map differs from an independent fp32 " +
                      "top-K (value desc, index asc) at expert " + std::to_string(first));
        break;
      }
    }
  }
  // bitmap vs bytemap: identical probs and the LSB-first packing of the bytemap.
  Case other = c;
  other.set("routing_map_format",
            p.routing_map_format == MapFormat::bytemap ? "bitmap_u8" : "bytemap");
  const TensorMap o = run_reference(other, in, false, nullptr);
  if (!o.at("output.probs").bitwise_equal(probs) ||
      !o.at("grad.logits").bitwise_equal(out.at("grad.logits"))) {
    bad.push_back("probs or grads differ between bytemap and bitmap_u8");
  }
  const Tensor& om = o.at("output.routing_map");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      if (routing_map_get(om, t, e) != routing_map_get(map, t, e)) {
        bad.push_back("bitmap_u8 is not the LSB-first packing of the bytemap at (" +
                      std::to_string(t) + ", " + std::to_string(e) + ")");
        return bad;
      }
  return bad;
}

// Rows whose selection margin is below 10x the largest finite-difference step are not perturbed.
TensorMap fd_masks(const Case& c, const TensorMap& in) {
  const Tensor& logits = in.at("input.logits");
  const auto sel = ref::topk_router_select(logits, bias_of(in), router_params(c));
  Tensor mask(DType::f64, logits.shape());
  for (int64_t t = 0; t < logits.dim(0); ++t) {
    double mx = 1.0;
    for (int64_t e = 0; e < logits.dim(1); ++e) mx = std::max(mx, std::fabs(logits.at(t, e)));
    const double h = 10.0 * 1e-3 * mx;
    // SPEC's step 1e-3 * max(1, |x|) is far beyond the scores' curvature scale once |x| > 10
    // (large_magnitude rows saturate exp/sigmoid): finite differences are not informative
    // there, so such rows are compared against the GPU and the invariants only.
    const bool ok = sel[t].margin > h && sel[t].group_margin > h && mx <= kFdMaxLogit;
    for (int64_t e = 0; e < logits.dim(1); ++e) mask.set(t, e, ok ? 1.0 : 0.0);
  }
  TensorMap m;
  m.emplace("input.logits", std::move(mask));
  return m;
}

Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("T")), E = static_cast<double>(c.i("E"));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const double map =
      router_params(c).routing_map_format == MapFormat::bytemap ? E : std::ceil(E / 8);
  const double g = static_cast<double>(dtype_size(parse_dtype(c.s("grad_dtype", "float32"))));
  Cost k;
  k.fwd_bytes = T * (E * d + E * d + map + E * 4);  // logits in; probs, map, saved out
  k.bwd_bytes = T * (E * g + map + E * 4 + E * g);  // grad_probs, map, saved in; grad out
  return k;
}

nlohmann::json to_params(const Case& c) {
  const RouterParams p = router_params(c);
  return {{"topk", p.topk},
          {"score_function", std::string(score_function_name(p.score_function))},
          {"use_pre_softmax", p.use_pre_softmax},
          {"num_groups", p.num_groups},
          {"group_topk", p.group_topk},
          {"scaling_factor", p.scaling_factor},
          {"routing_map_format", std::string(map_format_name(p.routing_map_format))}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c;
  c.op = "topk_router";
  c.dtype = d;
  c.seed = seed;
  // SPEC §14: a null parameter is an absent optional one, i.e. its default.
  auto get_or = [&j](const char* k, auto dflt) {
    const nlohmann::json& v = j.at(k);
    return v.is_null() ? dflt : v.get<decltype(dflt)>();
  };
  const Tensor& logits = in.at("input.logits");
  c.set("T", logits.dim(0)).set("E", logits.dim(1));
  c.set("topk", j.at("topk").get<int64_t>());
  c.set("score_function", j.at("score_function").get<std::string>());
  c.set("use_pre_softmax", get_or("use_pre_softmax", false));
  c.set("num_groups", get_or("num_groups", int64_t{0}));
  c.set("group_topk", get_or("group_topk", int64_t{0}));
  c.set("scaling_factor", get_or("scaling_factor", 1.0));
  c.set("routing_map_format", j.at("routing_map_format").get<std::string>());
  c.set("expert_bias", in.count("input.expert_bias") != 0);
  c.set(
      "grad_dtype",
      std::string(dtype_name(in.count("cotangent.probs") ? in.at("cotangent.probs").dtype() : d)));
  return c;
}

std::vector<Case> bench_cases() {
  std::vector<Case> v;
  Case ds = base(DType::bf16, 65536, 256, 8, "sigmoid", "deepseek_v3");
  ds.set("expert_bias", true).set("num_groups", int64_t{8}).set("group_topk", int64_t{4});
  ds.set("scaling_factor", 2.5);
  v.push_back(ds);
  v.push_back(base(DType::bf16, 65536, 8, 2, "softmax", "mixtral"));
  v.push_back(base(DType::bf16, 4096, 64, 8, "sigmoid", "t4096_e64"));
  return v;
}

}  // namespace

const OpInfo& topk_router_op() {
  static const OpInfo op = [] {
    OpInfo o;
    o.name = "topk_router";
    o.spec = "SPEC §1";
    o.gen = gen;
    o.named = named;
    o.make_inputs = make_inputs;
    o.reference = [](const Case& c, const TensorMap& in, bool exact) {
      return run_reference(c, in, exact, nullptr);
    };
    o.bound = bound;
    o.compare = compare;
    o.invariants = invariants;
    o.fd_masks = fd_masks;
    o.cost = cost;
    o.to_params = to_params;
    o.from_params = from_params;
    o.bench_cases = bench_cases;
#ifdef MOE_WITH_CUDA
    o.gpu = topk_router_gpu;
    o.gpu_bench = topk_router_gpu_bench;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
