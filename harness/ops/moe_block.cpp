// Registry record of moe_block (SPEC §11) over ep_size x dp_size ranks simulated in one process.
// Inputs (global, unsharded): x [B,S,H], gate_kernel [H,E], wi_0/wi_1 [E,H,M], wo [E,M,H],
// optional wi_0_bias/wi_1_bias [E,M], wo_bias [E,H], expert_bias [E] f32. Outputs: y [B,S,H],
// aux_loss [] f32 (coeff > 0) and the EP-invariant diagnostics routing_map, probs, group_sizes.
// Grads: x, gate_kernel, wi_0, wi_1, wo and the FFN biases present; never expert_bias.
//
// Bound: the composite rule of SPEC §12, |got - want| <= b*|want| + b*max(1, rms(want)) with
// TE's block budget b of the tensor's class (forward, FFN gradient, gate gradient, aux loss) for
// the coarsest activation dtype of the case (d or probs_dtype; f16 = bf16/4). Invariants: §11.5
// dense fp64 parity (1, 4), EP invariance against ep_size = dp_size = 1 (1), backend invariance
// (2), alignment invariance (3), finiteness. The generator redraws token rows until the selection
// is stable under every finite-difference probe (margins above 10x the step, §12).
#include <algorithm>
#include <cmath>

#include "harness/core/params/block.h"
#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "harness/ops/router_family.h"
#include "reference/moe_block.h"
#include "reference/topk_router.h"

#ifdef MOE_WITH_CUDA
#include "harness/ops/bench_device.h"
#include "harness/ops/block_gpu.h"
#endif

namespace moe::ops {

MoeBlockParams moe_block_params(const Case& c) {
  MoeBlockParams p;
  p.num_experts = c.i("num_experts");
  p.topk = c.i("topk");
  p.activation = parse_activation(c.s("activation", "silu"));
  p.score_function = parse_score_function(c.s("score_function", "softmax"));
  p.use_pre_softmax = c.b("use_pre_softmax", false);
  p.num_groups = c.i("num_groups", 0);
  p.group_topk = c.i("group_topk", 0);
  p.scaling_factor = c.f("scaling_factor", 1.0);
  p.aux_loss_coeff = c.f("aux_loss_coeff", 0.0);
  p.backend = parse_moe_backend(c.s("backend", "kernel"));
  p.align_size = c.i("align_size", 0);
  p.ep_size = c.i("ep_size", 1);
  p.dp_size = c.i("dp_size", 1);
  p.probs_dtype = parse_dtype(c.s("probs_dtype", "float32"));
  p.router_logits_dtype = parse_router_logits_dtype(c.s("router_logits_dtype", "float32"));
  return p;
}

std::optional<Case> moe_block_case_for_ep(const Case& c, int64_t P) {
  if (c.i("ep_size", 1) == P && c.i("dp_size", 1) == 1) return c;
  if (P < 1 || c.has("forcing") || c.i("num_experts") % P != 0) return std::nullopt;
  Case e = c;
  e.set("ep_size", P).set("dp_size", int64_t{1});
  e.set("B", (c.i("B") + P - 1) / P * P);
  if (c.has("name")) e.set("name", c.s("name") + "_ep" + std::to_string(P));
  return e;
}

namespace {

MoeBlockParams block_params(const Case& c) {
  return moe_block_params(c);
}

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case("moe_block", {Regime::uniform, Regime::uniform, Regime::skewed,
                                     Regime::all_to_one, Regime::zero_tokens});
    const int64_t P = *rc::gen::element<int64_t>(1, 1, 2, 4);
    const int64_t D = *rc::gen::element<int64_t>(1, 1, 2);
    // At least two experts so a selection boundary exists; L = 2 makes the local permute a
    // real reordering.
    const int64_t Ek = std::max<int64_t>(2, P * *rc::gen::element<int64_t>(1, 2, 2));
    int64_t K, G = 0, gk = 0;
    if (Ek >= 4 && *rc::gen::element(false, false, true)) {
      G = 2;
      gk = *any_in(1, 3);
      K = gk * *any_in(1, Ek / G + 1);
    } else {
      K = *any_in(1, std::min<int64_t>(Ek, 3) + 1);
    }
    const bool no_tokens = draw_no_rows(c);
    c.set("B", no_tokens ? int64_t{0} : P * D * *rc::gen::element<int64_t>(1, 2));
    c.set("S", *any_in(1, 5));
    c.set("H", *any_in(2, 7)).set("M", *any_in(2, 6));
    c.set("num_experts", Ek).set("topk", K).set("num_groups", G).set("group_topk", gk);
    const auto f = *rc::gen::element<std::string>("softmax", "sigmoid", "sqrtsoftplus");
    c.set("score_function", f);
    c.set("use_pre_softmax", f == "softmax" && *rc::gen::arbitrary<bool>());
    c.set("expert_bias", f != "softmax" && *rc::gen::arbitrary<bool>());
    c.set("scaling_factor", *rc::gen::element(1.0, 2.5));
    c.set("activation", *rc::gen::element<std::string>("silu", "silu", "linear"));
    c.set("aux_loss_coeff", no_tokens ? 0.0 : *rc::gen::element(0.0, 0.01));
    c.set("backend", *rc::gen::element<std::string>("kernel", "argsort"));
    c.set("align_size", *rc::gen::element<int64_t>(0, 0, 2, 4));
    c.set("ep_size", P).set("dp_size", D);
    c.set("probs_dtype", *rc::gen::element<std::string>("float32", "float32", "bfloat16"));
    c.set("router_logits_dtype", *rc::gen::element<std::string>("float32", "input"));
    c.set("wi_0_bias", *rc::gen::arbitrary<bool>()).set("wi_1_bias", *rc::gen::arbitrary<bool>());
    c.set("wo_bias", *rc::gen::arbitrary<bool>());
    return c;
  });
}

CaseBuilder base(const std::string& name, DType d, const std::string& backend, int64_t P, int64_t D,
                 int64_t B, int64_t S, int64_t E, int64_t K, int64_t H, int64_t M, int64_t a) {
  CaseBuilder b("moe_block", d);
  b.seed(31).name(name).set("B", B).set("S", S).set("H", H).set("M", M);
  b.set("num_experts", E).set("topk", K).set("num_groups", int64_t{0});
  b.set("group_topk", int64_t{0}).set("score_function", "softmax");
  b.set("use_pre_softmax", false).set("expert_bias", false).set("scaling_factor", 1.0);
  b.set("activation", "silu").set("aux_loss_coeff", 0.0).set("backend", backend);
  b.set("align_size", a).set("ep_size", P).set("dp_size", D).set("probs_dtype", "float32");
  b.set("router_logits_dtype", "float32").set("wi_0_bias", false).set("wi_1_bias", false);
  return b.set("wo_bias", false);
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R3: forced routing, P = 2, B = 2, S = 16, K = 2, E = 8, a = 16, H = 32, M = 64.
  for (const char* be : {"kernel", "argsort"}) {
    v.push_back(base(std::string("R3_") + be, DType::f32, be, 2, 1, 2, 16, 8, 2, 32, 64, 16)
                    .set("forcing", "r3"));
  }
  // R5/R7: kernel backend under EP, a in {0, 16}, aux off (compared with P = 1 in the tests).
  v.push_back(base("R5_R7_a0", DType::f32, "kernel", 2, 1, 4, 4, 8, 2, 16, 16, 0));
  v.push_back(base("R5_R7_a16", DType::f32, "kernel", 2, 1, 4, 4, 8, 2, 16, 16, 16));
  // R4 at block level: FFN biases with a = 16.
  v.push_back(base("R4_bias_a16", DType::bf16, "kernel", 1, 1, 2, 8, 4, 2, 8, 8, 16)
                  .set("wi_0_bias", true)
                  .set("wi_1_bias", true)
                  .set("wo_bias", true));
  // Catalogue.
  v.push_back(base("mixtral_like", DType::bf16, "kernel", 2, 2, 4, 8, 8, 2, 32, 48, 0)
                  .set("aux_loss_coeff", 0.01));
  v.push_back(base("deepseek_like", DType::bf16, "argsort", 4, 1, 4, 4, 16, 4, 16, 16, 4)
                  .set("score_function", "sigmoid")
                  .set("expert_bias", true)
                  .set("num_groups", int64_t{4})
                  .set("group_topk", int64_t{2})
                  .set("scaling_factor", 2.5)
                  .set("aux_loss_coeff", 0.001));
  v.push_back(base("f16_sqrtsoftplus_input_logits", DType::f16, "kernel", 2, 1, 2, 6, 4, 2, 8, 8, 4)
                  .set("score_function", "sqrtsoftplus")
                  .set("router_logits_dtype", "input")
                  .set("probs_dtype", "bfloat16"));
  v.push_back(base("softmax_pre_ep8", DType::f32, "argsort", 8, 1, 8, 2, 8, 3, 8, 8, 2)
                  .set("use_pre_softmax", true));
  // Many experts, as DeepSeek-like models have (E = 64, K = 4, aux loss on); the other cases have
  // at most 16.
  v.push_back(base("many_experts_e64", DType::bf16, "kernel", 2, 1, 2, 8, 64, 4, 16, 8, 0)
                  .set("aux_loss_coeff", 0.01));
  v.push_back(base("zero_tokens", DType::f32, "kernel", 2, 2, 0, 4, 4, 2, 8, 8, 4)
                  .regime(Regime::zero_tokens));
  return v;
}

// --- selection stability under finite-difference probes ------------------------------------------

double sp(double x) {
  return x > 20 ? x : std::log1p(std::exp(x));
}
double sig(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Whether the selection of a row with exact logits l stays the same when every logit moves by up
// to delta: interval bounds on every selection score z_e, then the selected experts (and groups)
// must stay strictly above everything left out.
bool stable_row(const std::vector<double>& l, const Tensor* bias, const RouterParams& p,
                const std::vector<int>& selected, double delta) {
  const int64_t E = static_cast<int64_t>(l.size());
  if (p.topk == E) return true;
  std::vector<double> lo(E), hi(E);
  const bool pre = p.score_function == ScoreFunction::softmax && p.use_pre_softmax;
  for (int64_t e = 0; e < E; ++e) {
    const double b = bias ? bias->at(e) : 0.0;
    switch (p.score_function) {
      case ScoreFunction::softmax:
        if (pre) {
          // s_e = 1/(1 + sum_j exp(l_j - l_e)); every difference moves by up to 2*delta.
          double rest = 0;
          for (int64_t j = 0; j < E; ++j)
            if (j != e) rest += std::exp(l[j] - l[e]);
          lo[e] = 1.0 / (1.0 + rest * std::exp(2 * delta));
          hi[e] = 1.0 / (1.0 + rest * std::exp(-2 * delta));
        } else {
          lo[e] = l[e] - delta;
          hi[e] = l[e] + delta;
        }
        break;
      case ScoreFunction::sigmoid:
        lo[e] = sig(l[e] - delta) + b;
        hi[e] = sig(l[e] + delta) + b;
        break;
      case ScoreFunction::sqrtsoftplus:
        lo[e] = std::sqrt(sp(l[e] - delta)) + b;
        hi[e] = std::sqrt(sp(l[e] + delta)) + b;
        break;
    }
  }
  std::vector<bool> sel(E, false);
  for (int e : selected) sel[e] = true;
  std::vector<bool> candidate(E, true);
  if (p.grouped()) {
    const int64_t G = p.num_groups, per = E / G, kp = p.topk / p.group_topk;
    std::vector<double> glo(G), ghi(G);
    std::vector<bool> gsel(G, false);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> a(lo.begin() + g * per, lo.begin() + (g + 1) * per);
      std::vector<double> c(hi.begin() + g * per, hi.begin() + (g + 1) * per);
      std::sort(a.rbegin(), a.rend());
      std::sort(c.rbegin(), c.rend());
      for (int64_t j = 0; j < kp; ++j) glo[g] += a[j], ghi[g] += c[j];
      for (int64_t e = g * per; e < (g + 1) * per; ++e) gsel[g] = gsel[g] || sel[e];
    }
    double min_in = INFINITY, max_out = -INFINITY;
    for (int64_t g = 0; g < G; ++g) {
      if (gsel[g])
        min_in = std::min(min_in, glo[g]);
      else
        max_out = std::max(max_out, ghi[g]);
    }
    if (!(min_in > max_out)) return false;
    for (int64_t e = 0; e < E; ++e) candidate[e] = gsel[e / per];
  }
  double min_in = INFINITY, max_out = -INFINITY;
  for (int64_t e = 0; e < E; ++e) {
    if (sel[e])
      min_in = std::min(min_in, lo[e]);
    else if (candidate[e])
      max_out = std::max(max_out, hi[e]);
  }
  return min_in > max_out;
}

// Largest logit change any finite-difference probe of x (row t) or of gate_kernel can cause.
struct RowDelta {
  double by_x = 0, by_gate = 0;
};
RowDelta row_delta(const std::vector<double>& x, const Tensor& gk, double step) {
  const int64_t H = gk.dim(0), E = gk.dim(1);
  RowDelta d;
  for (int64_t e = 0; e < E; ++e) {
    double bx = 0, bg = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double w = gk.at(h, e);
      bx += std::max(1.0, std::fabs(x[h])) * std::fabs(w);
      bg += std::fabs(x[h]) * std::max(1.0, std::fabs(w));
    }
    d.by_x = std::max(d.by_x, step * bx);
    d.by_gate = std::max(d.by_gate, step * bg);
  }
  return d;
}

struct Stability {
  bool x_ok = true, gate_ok = true;
};
// Stability of one token row (values as the block's finite-difference mode computes them).
Stability row_stability(const std::vector<double>& x, const Tensor& gk, const Tensor* bias,
                        const RouterParams& p) {
  const int64_t H = gk.dim(0), E = gk.dim(1);
  Tensor logits(DType::f64, {1, E});
  std::vector<double> l(E, 0.0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t h = 0; h < H; ++h) l[e] += x[h] * gk.at(h, e);
    logits.set(0, e, l[e]);
  }
  const auto sel = ref::topk_router_select(logits, bias, p);
  const RowDelta d = row_delta(x, gk, FdOptions{}.step);
  // Margins must exceed 10x the largest probe (SPEC §12).
  return {stable_row(l, bias, p, sel[0].experts, 10 * d.by_x),
          stable_row(l, bias, p, sel[0].experts, 10 * d.by_gate)};
}

Tensor scaled_normal(const Case& c, DType d, const Shape& s, double sd, const std::string& name) {
  Tensor t(d, s);
  Rng rng(c.seed, name);
  fill_normal(t, rng, sd);
  return t;
}

TensorMap make_inputs(const Case& c) {
  const int64_t B = c.i("B"), S = c.i("S"), H = c.i("H"), M = c.i("M"), E = c.i("num_experts");
  const int64_t K = c.i("topk"), T = B * S;
  const DType d = c.dtype;
  const bool r3 = c.s("forcing", "") == "r3";
  TensorMap m;
  Tensor gk =
      scaled_normal(c, d, {H, E}, 2.0 / std::sqrt(static_cast<double>(H)), "input.gate_kernel");
  if (r3) {
    gk = Tensor(d, {H, E});  // [I_E; 0]: the first E hidden dims are the logits
    for (int64_t e = 0; e < E; ++e) gk.set(e, e, 1.0);
  } else if (c.regime == Regime::skewed || c.regime == Regime::all_to_one) {
    // A preferred set of experts through hidden dim 0, which the tokens keep positive.
    const int64_t hot = c.regime == Regime::all_to_one ? K : std::max<int64_t>(1, E / 4);
    const double bonus = c.regime == Regime::all_to_one ? 6.0 : 1.5;
    for (int64_t e = 0; e < hot; ++e) gk.set(0, e, gk.at(0, e) + bonus);
  }
  std::optional<Tensor> bias;
  if (c.b("expert_bias", false)) {
    Tensor b(DType::f32, {E});
    Rng rng(c.seed, "input.expert_bias");
    for (int64_t e = 0; e < E; ++e) b.set(e, rng.uniform(-0.3, 0.3));
    bias = std::move(b);
  }
  const MoeBlockParams p = block_params(c);
  Tensor x(d, {B, S, H});
  Rng rng(c.seed, "input.x");
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(H);
    for (int attempt = 0; attempt < 64; ++attempt) {
      for (int64_t h = 0; h < H; ++h) row[h] = round_to(d, rng.normal());
      if (r3) {
        // Token 0 -> {0,2}, token 1 -> {1,3}, the rest -> {2,3} on every shard (S tokens each).
        const int64_t s = t % S;
        const std::vector<int64_t> on = s == 0   ? std::vector<int64_t>{0, 2}
                                        : s == 1 ? std::vector<int64_t>{1, 3}
                                                 : std::vector<int64_t>{2, 3};
        for (int64_t e = 0; e < E; ++e) row[e] = 0.0;
        for (int64_t e : on) row[e] = 10.0;
        break;
      }
      if (c.regime == Regime::skewed || c.regime == Regime::all_to_one) {
        row[0] = round_to(d, std::fabs(row[0]) + 1.0);
      }
      const Stability st = row_stability(row, gk, bias ? &*bias : nullptr, p.router());
      if (st.x_ok && st.gate_ok) break;
    }
    for (int64_t h = 0; h < H; ++h) x.set(t * H + h, row[h]);
  }
  m.emplace("input.x", std::move(x));
  m.emplace("input.gate_kernel", std::move(gk));
  const double si = 1.0 / std::sqrt(static_cast<double>(H));
  const double so = 1.0 / std::sqrt(static_cast<double>(M));
  m.emplace("input.wi_0", scaled_normal(c, d, {E, H, M}, si, "input.wi_0"));
  m.emplace("input.wi_1", scaled_normal(c, d, {E, H, M}, si, "input.wi_1"));
  m.emplace("input.wo", scaled_normal(c, d, {E, M, H}, so, "input.wo"));
  if (c.b("wi_0_bias", false))
    m.emplace("input.wi_0_bias", scaled_normal(c, d, {E, M}, 0.5, "input.wi_0_bias"));
  if (c.b("wi_1_bias", false))
    m.emplace("input.wi_1_bias", scaled_normal(c, d, {E, M}, 0.5, "input.wi_1_bias"));
  if (c.b("wo_bias", false))
    m.emplace("input.wo_bias", scaled_normal(c, d, {E, H}, 0.5, "input.wo_bias"));
  if (bias) m.emplace("input.expert_bias", std::move(*bias));
  m.emplace("cotangent.y", scaled_normal(c, d, {B, S, H}, 1.0, "cotangent.y"));
  if (p.aux_loss()) {
    m.emplace("cotangent.aux_loss", scaled_normal(c, DType::f32, {}, 1.0, "cotangent.aux_loss"));
  }
  return m;
}

ref::MoeBlockInputs view(const TensorMap& in) {
  return {in.at("input.x"),
          in.at("input.gate_kernel"),
          in.at("input.wi_0"),
          in.at("input.wi_1"),
          in.at("input.wo"),
          find_tensor(in, "input.wi_0_bias"),
          find_tensor(in, "input.wi_1_bias"),
          find_tensor(in, "input.wo_bias"),
          find_tensor(in, "input.expert_bias")};
}

TensorMap run(const MoeBlockParams& p, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const ref::MoeBlockInputs v = view(in);
  ref::MoeBlockFwd f = ref::moe_block_fwd(v, p, rnd);
  ref::MoeBlockGrads g =
      ref::moe_block_bwd(in.at("cotangent.y"), find_tensor(in, "cotangent.aux_loss"), v, f, p, rnd);
  TensorMap out;
  out.emplace("output.y", std::move(f.y));
  if (f.aux_loss) out.emplace("output.aux_loss", std::move(*f.aux_loss));
  out.emplace("output.routing_map", std::move(f.routing_map));
  out.emplace("output.probs", std::move(f.probs));
  out.emplace("output.group_sizes", std::move(f.group_sizes));
  out.emplace("grad.x", std::move(g.x));
  out.emplace("grad.gate_kernel", std::move(g.gate_kernel));
  out.emplace("grad.wi_0", std::move(g.wi_0));
  out.emplace("grad.wi_1", std::move(g.wi_1));
  out.emplace("grad.wo", std::move(g.wo));
  if (g.wi_0_bias) out.emplace("grad.wi_0_bias", std::move(*g.wi_0_bias));
  if (g.wi_1_bias) out.emplace("grad.wi_1_bias", std::move(*g.wi_1_bias));
  if (g.wo_bias) out.emplace("grad.wo_bias", std::move(*g.wo_bias));
  return out;
}

TensorMap reference(const Case& c, const TensorMap& in, bool exact) {
  return run(block_params(c), in, exact);
}

// --- composite tolerance ------------------------------------------------------------------------

// TE's block budgets (SPEC §12) for the coarsest activation dtype of the case.
double budget(const Case& c, const std::string& key) {
  const DType pd = parse_dtype(c.s("probs_dtype", "float32"));
  auto coarse = [](DType a) { return a == DType::bf16 ? 2 : a == DType::f16 ? 1 : 0; };
  const int level = std::max(coarse(c.dtype), coarse(pd));
  const double scale = level == 1 ? 0.25 : 1.0;  // f16 budgets are bf16's / 4
  const bool f32 = level == 0;
  if (key == "output.aux_loss") return f32 ? 1e-5 : 1e-3 * scale;
  if (key == "grad.gate_kernel") return f32 ? 5e-4 : 5e-1 * scale;
  if (key.rfind("grad.", 0) == 0) return f32 ? 5e-5 : 1e-1 * scale;
  return f32 ? 2e-5 : 5e-2 * scale;  // y, probs
}

Tensor composite_bound(double b, const Tensor& want) {
  double ss = 0;
  for (int64_t i = 0; i < want.numel(); ++i) ss += want.at(i) * want.at(i);
  const double rms = want.numel() ? std::sqrt(ss / static_cast<double>(want.numel())) : 0.0;
  Tensor bound(DType::f64, want.shape());
  for (int64_t i = 0; i < want.numel(); ++i) {
    bound.set(i, b * std::fabs(want.at(i)) + b * std::max(1.0, rms));
  }
  return bound;
}

Tensor bound(const Case& c, const std::string& key, const TensorMap&, const TensorMap& want) {
  return composite_bound(budget(c, key), want.at(key));
}

// got vs want: float tensors within the composite bound (of want), the rest bitwise.
void compare_maps(const Case& c, const std::string& what, const TensorMap& got,
                  const TensorMap& want, FailureList& bad, bool bitwise_probs) {
  for (auto& [key, w] : want) {
    auto it = got.find(key);
    if (it == got.end()) {
      bad.add(what + ": " + key + " missing");
      continue;
    }
    TensorReport r;
    if (is_floating(w.dtype()) && !(bitwise_probs && key == "output.probs")) {
      const Tensor b = composite_bound(budget(c, key), w);
      const Tensor g = it->second.to(DType::f64), ww = w.to(DType::f64);
      r = compare(key, g, ww, &b);
    } else {
      r = compare(key, it->second, w, nullptr);
    }
    if (!r.ok()) bad.add(what + ":\n" + r.str());
  }
}

// --- SPEC §1.4 near ties at block level ----------------------------------------------------------

// How much one ulp of d on logit l moves the selection score z (the block's extra near-tie term).
double score_shift(const RouterParams& p, DType d, double l, double z_max) {
  const double u = ulp(d, l);
  switch (p.score_function) {
    case ScoreFunction::softmax:
      // pre: dz_e <= z_e (|dl_e| + |dl_j|) for the two logits moved; post: z = l.
      return p.use_pre_softmax ? 2 * z_max * u : u;
    case ScoreFunction::sigmoid:
      return std::fabs(sig(l + u) - sig(l)) + std::fabs(sig(l) - sig(l - u));
    case ScoreFunction::sqrtsoftplus:
      return std::fabs(std::sqrt(sp(l + u)) - std::sqrt(sp(l - u)));
  }
  return u;
}

// The default comparison, plus a diagnosis of every row whose routing differs from the
// reference's: a row on a near tie (§1.4: the reference margin within delta plus the score change
// of one ulp of d on each involved logit) would be acceptable, but the reference block has no
// selection override to recompute y and the gradients under the GPU's selection, so such a case is
// reported as a failure naming the near-tie rows (never passed silently); a row outside a near tie
// is a plain selection error. The generator keeps margins far above delta, so neither is expected.
Report compare(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  const OpInfo& op = *find_op("moe_block");
  Report r = compare_outputs(op, c, in, want, got);
  auto gm = got.find("output.routing_map");
  const Tensor& wm = want.at("output.routing_map");
  if (gm == got.end() || gm->second.shape() != wm.shape() || gm->second.dtype() != wm.dtype()) {
    return r;
  }
  const std::vector<int64_t> rows = routing_rows_differ(wm, gm->second);
  if (rows.empty()) return r;
  const MoeBlockParams p = block_params(c);
  const RouterParams rp = p.router();
  const ref::MoeBlockFwd f = ref::moe_block_fwd(view(in), p);
  std::optional<Tensor> bias;
  if (const Tensor* b = find_tensor(in, "input.expert_bias")) bias = b->to(DType::f32);
  const int64_t kp = rp.grouped() ? p.topk / p.group_topk : 1;
  for (const ref::MoeShardState& st : f.shards) {
    std::vector<ref::RowSelection> sel;
    for (int64_t t : rows) {
      if (t < st.first_token || t >= st.first_token + st.tokens) continue;
      if (sel.empty()) sel = ref::topk_router_select(st.logits, bias ? &*bias : nullptr, rp);
      const int64_t row = t - st.first_token;
      const ref::RowSelection& s = sel[row];
      const int64_t E = st.logits.dim(1);
      double z_max = 0, shift_max = 0;
      if (rp.score_function == ScoreFunction::softmax && rp.use_pre_softmax) {
        double m = -INFINITY, sum = 0;
        for (int64_t e = 0; e < E; ++e) m = std::max(m, st.logits.at(row, e));
        for (int64_t e = 0; e < E; ++e) sum += std::exp(st.logits.at(row, e) - m);
        z_max = 1.0 / sum;
      }
      for (int64_t e = 0; e < E; ++e) {
        shift_max = std::max(shift_max, score_shift(rp, c.dtype, st.logits.at(row, e), z_max));
      }
      double extra = 0;
      if (s.next >= 0) {
        extra = score_shift(rp, c.dtype, st.logits.at(row, s.experts.back()), z_max) +
                score_shift(rp, c.dtype, st.logits.at(row, s.next), z_max);
      }
      const bool near = s.margin <= s.delta + extra ||
                        s.group_margin <= s.delta + 2 * static_cast<double>(kp) * shift_max;
      r.failures.push_back(
          "routing_map row " + std::to_string(t) + " (shard " +
          std::to_string(st.dp_rank * p.ep_size + st.ep_rank) + ") differs from the reference " +
          (near ? "on a near tie (margin " + format_double(s.margin) + ", group margin " +
                      format_double(s.group_margin) +
                      "): acceptable by SPEC §1.4, but the block cannot be recomputed under the "
                      "GPU's selection, so this case is not verified; replay with another seed"
                : "outside a near tie (margin " + format_double(s.margin) + " > delta " +
                      format_double(s.delta + extra) + ")"));
    }
  }
  return r;
}

std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const MoeBlockParams p = block_params(c);
  for (auto& [k, v] : out) {
    if (!is_floating(v.dtype())) continue;
    for (int64_t i = 0; i < v.numel(); ++i) {
      if (!std::isfinite(v.at(i))) {
        bad.add(k + " is not finite at " + std::to_string(i));  // §11.5-5
        break;
      }
    }
  }
  // §11.5-4: the dense fp64 reference.
  const ref::MoeBlockDense dn = ref::moe_block_dense(view(in), p, in.at("cotangent.y"),
                                                     find_tensor(in, "cotangent.aux_loss"), false);
  TensorMap dense;
  dense.emplace("output.y", dn.y.clone());
  if (dn.aux_loss) dense.emplace("output.aux_loss", dn.aux_loss->clone());
  dense.emplace("output.routing_map", dn.routing_map.clone());
  dense.emplace("grad.x", dn.grads.x.clone());
  dense.emplace("grad.gate_kernel", dn.grads.gate_kernel.clone());
  dense.emplace("grad.wi_0", dn.grads.wi_0.clone());
  dense.emplace("grad.wi_1", dn.grads.wi_1.clone());
  dense.emplace("grad.wo", dn.grads.wo.clone());
  if (dn.grads.wi_0_bias) dense.emplace("grad.wi_0_bias", dn.grads.wi_0_bias->clone());
  if (dn.grads.wi_1_bias) dense.emplace("grad.wi_1_bias", dn.grads.wi_1_bias->clone());
  if (dn.grads.wo_bias) dense.emplace("grad.wo_bias", dn.grads.wo_bias->clone());
  compare_maps(c, "dense fp64 parity (SPEC §11.5-4)", out, dense, bad, false);
  // §11.5-1: EP invariance against one rank; routing maps, probs and counts bitwise.
  if (p.ep_size * p.dp_size > 1) {
    MoeBlockParams q = p;
    q.ep_size = q.dp_size = 1;
    compare_maps(c, "EP invariance vs ep_size = dp_size = 1 (SPEC §11.5-1)", out, run(q, in, false),
                 bad, true);
  }
  // §11.5-2: the other backend; group sizes and routing bitwise.
  {
    MoeBlockParams q = p;
    q.backend = p.backend == MoeBackend::kernel ? MoeBackend::argsort : MoeBackend::kernel;
    compare_maps(c, "backend invariance (SPEC §11.5-2)", out, run(q, in, false), bad, true);
  }
  // §11.5-3: alignment padding changes only the buffer layout.
  if (p.align_size > 0) {
    MoeBlockParams q = p;
    q.align_size = 0;
    compare_maps(c, "alignment invariance vs align_size = 0 (SPEC §11.5-3)", out, run(q, in, false),
                 bad, true);
  }
  return bad.take();
}

// x rows whose selection is not stable under the x probes, and the whole gate_kernel when any row
// is not stable under the gate_kernel probes, are not perturbed (SPEC §12).
TensorMap fd_masks(const Case& c, const TensorMap& in) {
  const Tensor& x = in.at("input.x");
  const Tensor& gk = in.at("input.gate_kernel");
  const Tensor* bias = find_tensor(in, "input.expert_bias");
  const RouterParams rp = block_params(c).router();
  const int64_t H = x.dim(2), T = x.dim(0) * x.dim(1);
  Tensor mx(DType::f64, x.shape()), mg(DType::f64, gk.shape());
  bool gate_ok = true;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(H);
    for (int64_t h = 0; h < H; ++h) row[h] = x.at(t * H + h);
    const Stability s = row_stability(row, gk, bias, rp);
    gate_ok = gate_ok && s.gate_ok;
    for (int64_t h = 0; h < H; ++h) mx.set(t * H + h, s.x_ok ? 1.0 : 0.0);
  }
  mg.fill(gate_ok ? 1.0 : 0.0);
  TensorMap m;
  m.emplace("input.x", std::move(mx));
  m.emplace("input.gate_kernel", std::move(mg));
  return m;
}

// The block's cost as a sum of its stages, each counted as it runs (its own kernels, reading its
// inputs from and writing its outputs to device memory), with T = B*S tokens, routed rows T*K, d
// bytes per activation/weight element, l per logit (f32 or d), p per prob, 1 per routing-map
// entry. FLOPs are the GEMMs' (gate T x H x E, the SwiGLU FFN's three [T*K, H] x [H, M] products
// and their dgrad/wgrad), as before; the element-wise flops of the router, the activation and the
// combine's weighted sum are not counted (far below either bound). Not counted either: the FFN's
// [T*K, M] intermediates (a fused FFN need not store them), the padding rows align_size adds, and
// the all-to-all and local permutes under ep_size > 1.
//
// The totals are the stages' sums. Against the earlier single count (x read once, y written once,
// the weights read once, 4*T*K*H for the permuted rows; backward = 2 x forward) this adds the
// second read of x (the gate GEMM and the dispatch each read it), the logits/probs/map traffic
// between the gate, the router, the dispatch and the combine, and counts the backward stage by
// stage; the FLOPs are unchanged.
Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("B") * c.i("S")), H = static_cast<double>(c.i("H"));
  const double M = static_cast<double>(c.i("M")), E = static_cast<double>(c.i("num_experts"));
  const double K = static_cast<double>(c.i("topk"));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const MoeBlockParams bp = block_params(c);
  const double l = bp.router_logits_dtype == RouterLogitsDtype::float32 ? 4.0 : d;
  const double p = static_cast<double>(dtype_size(bp.probs_dtype));
  const double TE = T * E, TKH = T * K * H, TH = T * H;
  Cost k;
  // Gate GEMM logits[T,E] = x[T,H] . gate_kernel[H,E]. Backward: d_logits (f32) in, x and the
  // gate kernel in; d_gate_kernel out, and d_x = d_x(gate) + d_x(dispatch) (the latter in).
  k.stages.push_back({"gate", (TH + H * E) * d + TE * l, 4 * TE + (3 * TH + 2 * H * E) * d,
                      2 * TH * E, 4 * TH * E});
  // Router / top-k: logits in; probs, routing map and the saved f32 scores out. Backward: the
  // probs gradient, the map and the saved scores in; the f32 logits gradient out.
  k.stages.push_back({"router", TE * (l + p + 1 + 4), TE * (p + 1 + 4 + 4), 0, 0});
  // Dispatch: x and the map in, the T*K routed rows out; backward the reverse.
  k.stages.push_back({"dispatch", TH * d + TE + TKH * d, TKH * d + TE + TH * d, 0, 0});
  // Expert FFN (SwiGLU grouped GEMMs over the T*K rows): rows in, every expert's weights
  // 3*E*H*M in, rows out. Backward: the output gradient and the rows in, their gradient out; the
  // weights in and their gradients out.
  k.stages.push_back({"expert_ffn", (2 * TKH + 3 * E * H * M) * d, (3 * TKH + 6 * E * H * M) * d,
                      6 * T * K * H * M, 12 * T * K * H * M});
  // Combine: the FFN rows, the map and the T*K probs in; y out. Backward: d_y, the map, the probs
  // and the FFN rows in (for the probs gradient); the rows' gradient and the probs' out.
  k.stages.push_back({"combine", TKH * d + TE + T * K * p + TH * d,
                      TH * d + TE + 2 * TKH * d + 2 * T * K * p, 0, 0});
  // Aux loss (aux_loss_coeff > 0): logits in, f32 scores out and back in with the column counts.
  // Backward: the saved scores in, their logits gradient out.
  if (bp.aux_loss()) {
    k.stages.push_back({"aux_loss", TE * (l + 4 + 4) + E * 4, TE * (4 + 4), 0, 0});
  }
  for (const StageCost& s : k.stages) {
    k.fwd_bytes += s.fwd_bytes;
    k.bwd_bytes += s.bwd_bytes;
    k.fwd_flops += s.fwd_flops;
    k.bwd_flops += s.bwd_flops;
  }
  return k;
}

nlohmann::json to_params(const Case& c) {
  const MoeBlockParams p = block_params(c);
  return {{"num_experts", p.num_experts},
          {"topk", p.topk},
          {"activation", std::string(activation_name(p.activation))},
          {"score_function", std::string(score_function_name(p.score_function))},
          {"use_pre_softmax", p.use_pre_softmax},
          {"num_groups", p.num_groups},
          {"group_topk", p.group_topk},
          {"scaling_factor", p.scaling_factor},
          {"aux_loss_coeff", p.aux_loss_coeff},
          {"backend", std::string(moe_backend_name(p.backend))},
          {"align_size", p.align_size},
          {"ep_size", p.ep_size},
          {"dp_size", p.dp_size},
          {"probs_dtype", std::string(dtype_name(p.probs_dtype))},
          {"router_logits_dtype", std::string(router_logits_dtype_name(p.router_logits_dtype))}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder("moe_block", d).seed(seed);
  // SPEC §14: a null parameter is an absent optional one, i.e. its default.
  auto get_or = [&j](const char* k, auto dflt) {
    const nlohmann::json& v = j.at(k);
    return v.is_null() ? dflt : v.get<decltype(dflt)>();
  };
  const Tensor& x = in.at("input.x");
  c.set("B", x.dim(0)).set("S", x.dim(1)).set("H", x.dim(2)).set("M", in.at("input.wi_0").dim(2));
  set_params<int64_t>(c, j, {"num_experts", "topk"});
  for (const char* k : {"num_groups", "group_topk", "align_size"}) c.set(k, get_or(k, int64_t{0}));
  for (const char* k : {"ep_size", "dp_size"}) c.set(k, get_or(k, int64_t{1}));
  set_params<std::string>(
      c, j, {"activation", "score_function", "backend", "probs_dtype", "router_logits_dtype"});
  c.set("use_pre_softmax", get_or("use_pre_softmax", false));
  c.set("scaling_factor", get_or("scaling_factor", 1.0));
  c.set("aux_loss_coeff", get_or("aux_loss_coeff", 0.0));
  for (const char* k : {"wi_0_bias", "wi_1_bias", "wo_bias", "expert_bias"}) {
    c.set(k, in.count(std::string("input.") + k) != 0);
  }
  return c;
}

}  // namespace

const OpInfo& moe_block_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info("moe_block", "SPEC §11",
                {gen, named, make_inputs, reference, invariants, cost, to_params, from_params});
    o.bound = bound;
    o.fd_masks = fd_masks;
    o.compare = compare;
#ifdef MOE_WITH_CUDA
    // gpu_bench_device: the full size, with device-generated inputs.
    set_gpu(o, {moe_block_gpu, moe_block_gpu_bench, moe_block_gpu_bench_device,
                moe_block_bench_verify_case, moe_block_gpu_bench_cases});
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
