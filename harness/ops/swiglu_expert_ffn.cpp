// Registry record of swiglu_expert_ffn (SPEC §10.2). Inputs: x [M_total,H], group_sizes [G],
// wi_0/wi_1 [G,H,M], wo [G,M,H], optional wi_0_bias/wi_1_bias [G,M] and wo_bias [G,H]. Outputs:
// out [M_total,H] and the saved gate_proj, up_proj, intermediate [M_total,M]. Backward: grads of
// x, the weights and the biases present.
// Bounds: each stage's SPEC §12 rule (reduction rule for the GEMMs and sums, elementwise rule for
// act(gate)*up, d_up, d_gate), propagated through the stages: see bound().
#include <algorithm>
#include <cmath>

#include "harness/core/params/ffn.h"
#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#ifdef MOE_WITH_CUDA
#include "harness/ops/bench_device.h"
#include "harness/ops/ffn_family_gpu.h"
#endif
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/grouped_gemm.h"
#include "reference/swiglu_ffn.h"

namespace moe::ops {

namespace {

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case("swiglu_expert_ffn", kSizeRegimes);
    const int64_t M = draw_no_rows(c) ? 0 : *any_in(1, 16);
    c.set("G", *any_in(1, 5)).set("M_total", M);
    c.set("H", *any_in(1, 7)).set("M", *any_in(1, 7));
    c.set("tail", M == 0 ? int64_t{0} : *any_in(0, M + 1) / 2);
    c.set("activation", *rc::gen::element<std::string>("silu", "silu", "linear"));
    c.set("wi_0_bias", *rc::gen::arbitrary<bool>());
    c.set("wi_1_bias", *rc::gen::arbitrary<bool>());
    c.set("wo_bias", *rc::gen::arbitrary<bool>());
    return c;
  });
}

CaseBuilder base(const std::string& name, DType d, int64_t G, int64_t Mt, int64_t H, int64_t M,
                 int64_t tail, bool biases) {
  CaseBuilder b("swiglu_expert_ffn", d);
  b.seed(29).name(name).set("G", G).set("M_total", Mt).set("H", H).set("M", M).set("tail", tail);
  b.set("activation", "silu").set("wi_0_bias", biases).set("wi_1_bias", biases);
  return b.set("wo_bias", biases);
}

std::vector<Case> named() {
  std::vector<Case> v;
  v.push_back(
      base("empty_groups_bias", DType::bf16, 8, 40, 32, 48, 6, true).regime(Regime::zero_tokens));
  v.push_back(base("all_to_one", DType::f32, 4, 24, 16, 32, 0, false).regime(Regime::all_to_one));
  v.push_back(base("linear", DType::f32, 3, 17, 8, 8, 3, false).set("activation", "linear"));
  v.push_back(base("zero_rows", DType::f16, 2, 0, 8, 8, 0, true));
  v.push_back(base("r3_shape", DType::bf16, 4, 184, 32, 64, 56, false));
  v.push_back(base("even_groups", DType::bf16, 4, 70, 16, 32, 3, false).set("even_groups", true));
  return v;
}

Tensor scaled_normal(const Case& c, const Shape& s, double sd, const std::string& name) {
  Tensor t(c.dtype, s);
  Rng rng(c.seed, name);
  fill_normal(t, rng, sd);
  return t;
}

TensorMap make_inputs(const Case& c) {
  const int64_t G = c.i("G"), Mt = c.i("M_total"), H = c.i("H"), M = c.i("M");
  TensorMap m;
  m.emplace("input.x", normal_tensor(c, c.dtype, {Mt, H}, "input.x"));
  const auto sizes = make_group_sizes(c, G, Mt - c.i("tail", 0), "input.group_sizes");
  Tensor gs(DType::i32, {G});
  for (int64_t g = 0; g < G; ++g) gs.set(g, static_cast<double>(sizes[g]));
  m.emplace("input.group_sizes", std::move(gs));
  // Fan-in scaling keeps every stage O(1).
  const double si = 1.0 / std::sqrt(static_cast<double>(H)),
               so = 1.0 / std::sqrt(static_cast<double>(M));
  m.emplace("input.wi_0", scaled_normal(c, {G, H, M}, si, "input.wi_0"));
  m.emplace("input.wi_1", scaled_normal(c, {G, H, M}, si, "input.wi_1"));
  m.emplace("input.wo", scaled_normal(c, {G, M, H}, so, "input.wo"));
  if (c.b("wi_0_bias", false))
    m.emplace("input.wi_0_bias", scaled_normal(c, {G, M}, 0.5, "input.wi_0_bias"));
  if (c.b("wi_1_bias", false))
    m.emplace("input.wi_1_bias", scaled_normal(c, {G, M}, 0.5, "input.wi_1_bias"));
  if (c.b("wo_bias", false))
    m.emplace("input.wo_bias", scaled_normal(c, {G, H}, 0.5, "input.wo_bias"));
  m.emplace("cotangent.out", normal_tensor(c, c.dtype, {Mt, H}, "cotangent.out"));
  return m;
}

ref::FfnWeights weights_of(const TensorMap& in) {
  return {in.at("input.wi_0"),
          in.at("input.wi_1"),
          in.at("input.wo"),
          find_tensor(in, "input.wi_0_bias"),
          find_tensor(in, "input.wi_1_bias"),
          find_tensor(in, "input.wo_bias")};
}

TensorMap reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Activation act = parse_activation(c.s("activation", "silu"));
  const Tensor& x = in.at("input.x");
  const Tensor& gs = in.at("input.group_sizes");
  const ref::FfnWeights w = weights_of(in);
  ref::SwigluFfnFwd f = ref::swiglu_expert_ffn_fwd(x, gs, w, act, rnd);
  ref::SwigluFfnBwd b = ref::swiglu_expert_ffn_bwd(in.at("cotangent.out"), x, gs, w, f.gate_proj,
                                                   f.up_proj, f.intermediate, act, rnd);
  TensorMap out;
  out.emplace("output.out", std::move(f.out));
  out.emplace("output.gate_proj", std::move(f.gate_proj));
  out.emplace("output.up_proj", std::move(f.up_proj));
  out.emplace("output.intermediate", std::move(f.intermediate));
  out.emplace("grad.x", std::move(b.grad_x));
  out.emplace("grad.wi_0", std::move(b.grad_wi_0));
  out.emplace("grad.wi_1", std::move(b.grad_wi_1));
  out.emplace("grad.wo", std::move(b.grad_wo));
  if (b.grad_wi_0_bias) out.emplace("grad.wi_0_bias", std::move(*b.grad_wi_0_bias));
  if (b.grad_wi_1_bias) out.emplace("grad.wi_1_bias", std::move(*b.grad_wi_1_bias));
  if (b.grad_wo_bias) out.emplace("grad.wo_bias", std::move(*b.grad_wo_bias));
  return out;
}

Tensor group_rows(const Tensor& gs, const Shape& shape) {
  Tensor n(DType::f64, shape);
  const int64_t per = shape[0] > 0 ? n.numel() / shape[0] : 1;
  for (int64_t i = 0; i < n.numel(); ++i) n.set(i, gs.at(i / std::max<int64_t>(1, per)));
  return n;
}

const Tensor* abs_opt(const TensorMap& in, const std::string& key, Tensor& store) {
  const Tensor* t = find_tensor(in, key);
  if (!t) return nullptr;
  store = abs_f64(*t);
  return &store;
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor o(DType::f64, a.shape());
  for (int64_t i = 0; i < o.numel(); ++i) o.set(i, a.at(i) + b.at(i));
  return o;
}

double act_v(bool silu, double x) {
  return silu ? x / (1.0 + std::exp(-x)) : x;
}
double act_d(bool silu, double x) {
  if (!silu) return 1.0;
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s * (1.0 + x * (1.0 - s));
}
// max |silu''| over the reals, taken at 0: silu'' = s(1 - s)(2 + x(1 - 2s)) with s = sigmoid(x).
constexpr double kSiluCurvature = 0.5;

// SPEC §12 bound of each output, propagated through the stages of SPEC §10.2.
//
// §12 gives every stage its own rule: a GEMM output (gate, up, out, d_inter, grad x, the weight
// gradients) the reduction rule with n = its contraction length and Σ|x_i| from its operands, a
// bias-gradient column sum the reduction rule over the group's rows, and the elementwise stages
// (inter, d_up, d_gate: one fp32 expression rounded once) the elementwise rule. The reference
// evaluates each stage from the reference's own rounded stage values; §10.2 stores gate, up,
// inter, d_inter, d_gate and d_up in d, so an implementation evaluates each stage from ITS rounded
// values, which may sit anywhere inside their own §12 bounds. A stage's bound is therefore its
// own §12 rule plus its sensitivity to its stage inputs times their bounds (first order; the
// silu curvature term bounds the second-order remainder of act and act'):
//   gate, up:  reduction rule (inputs only: no upstream stage)
//   inter:     elementwise rule + |act'(g) u| B_g + (|act(g)| + |act'(g)| B_g) B_u
//              + c/2 B_g^2 |u|                                    (c = max|silu''| = 1/2)
//   out:       reduction rule + Σ_j B_inter[j] |wo[j]|
//   grad wo:   reduction rule + Σ_r B_inter[r] |ct[r]|;  grad bo, d_inter: reduction rule
//   d_up:      elementwise rule + |act(g)| B_t + (|t| + B_t)(|act'(g)| B_g + c/2 B_g^2)
//   d_gate:    elementwise rule + |act'(g)| (|u| B_t + (|t| + B_t) B_u)
//              + c (|t| + B_t)(|u| + B_u) B_g                   (t = d_inter)
//   grad x:    reduction rule (n = 2M) + Σ_j B_dg[j] |wi_0[j]| + B_du[j] |wi_1[j]|
//   grad wi_*, grad b*: reduction rule + Σ_r |x[r]| B_d*[r]  (resp. Σ_r B_d*[r])
// Applying each rule alone (with the reference's stage values as if they were the
// implementation's) is not a bound any fp32 implementation meets: one upstream ulp moves a stage
// by more than its own rule, e.g. an f32 intermediate one or two ulps off.
Tensor bound(const Case& c, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const Tensor& ref_v = want.at(key);
  const DType d = ref_v.dtype();
  const bool silu = parse_activation(c.s("activation", "silu")) == Activation::silu;
  const double curv = silu ? kSiluCurvature : 0.0;
  const Tensor& gs = in.at("input.group_sizes");
  const Tensor& x = in.at("input.x");
  const int64_t H = x.dim(1), M = in.at("input.wi_0").dim(2);
  const Tensor ax = abs_f64(x);
  const Tensor aw0 = abs_f64(in.at("input.wi_0")), aw1 = abs_f64(in.at("input.wi_1"));
  const Tensor awo = abs_f64(in.at("input.wo")), act_ = abs_f64(in.at("cotangent.out"));
  Tensor s0, s1, so;
  const Tensor* ab0 = abs_opt(in, "input.wi_0_bias", s0);
  const Tensor* ab1 = abs_opt(in, "input.wi_1_bias", s1);
  const Tensor* abo = abs_opt(in, "input.wo_bias", so);
  const auto none = ref::Rounding::none;
  const Tensor& gate = want.at("output.gate_proj");
  const Tensor& up = want.at("output.up_proj");
  const Tensor& inter = want.at("output.intermediate");
  const Tensor n = group_rows(gs, ref_v.shape());  // rows of the group, for per-group sums

  Tensor b_gate =
      reduction_bound(d, gate, ref::grouped_gemm_fwd(ax, aw0, gs, ab0, none), H + (ab0 ? 1 : 0));
  if (key == "output.gate_proj") return b_gate;
  Tensor b_up =
      reduction_bound(d, up, ref::grouped_gemm_fwd(ax, aw1, gs, ab1, none), H + (ab1 ? 1 : 0));
  if (key == "output.up_proj") return b_up;
  Tensor b_inter = make_bound(TolClass::elementwise, d, inter, 1);
  for (int64_t i = 0; i < b_inter.numel(); ++i) {
    const double g = gate.at(i), u = up.at(i), bg = b_gate.at(i), bu = b_up.at(i);
    const double ad = std::fabs(act_d(silu, g));
    b_inter.set(i, b_inter.at(i) + ad * std::fabs(u) * bg +
                       (std::fabs(act_v(silu, g)) + ad * bg) * bu +
                       0.5 * curv * bg * bg * std::fabs(u));
  }
  if (key == "output.intermediate") return b_inter;
  const Tensor ainter = abs_f64(inter);
  if (key == "output.out") {
    return add(reduction_bound(d, ref_v, ref::grouped_gemm_fwd(ainter, awo, gs, abo, none),
                               M + (abo ? 1 : 0)),
               ref::grouped_gemm_fwd(b_inter, awo, gs, nullptr, none));
  }
  if (key == "grad.wo" || key == "grad.wo_bias") {
    const ref::GroupedGemmBwd s = ref::grouped_gemm_bwd(act_, ainter, awo, gs, abo, none);
    if (key == "grad.wo_bias") return reduction_bound(d, ref_v, *s.grad_bias, 0, &n);
    const ref::GroupedGemmBwd p = ref::grouped_gemm_bwd(act_, b_inter, awo, gs, nullptr, none);
    return add(reduction_bound(d, ref_v, s.grad_w, 0, &n), p.grad_w);
  }

  // Backward stages: d_inter = rnd(ct wo^T), then d_up and d_gate elementwise.
  const ref::SwigluFfnBwd b =
      ref::swiglu_expert_ffn_bwd(in.at("cotangent.out"), x, gs, weights_of(in), gate, up, inter,
                                 silu ? Activation::silu : Activation::linear);
  const Tensor d_inter =
      ref::grouped_gemm_bwd(in.at("cotangent.out"), inter, in.at("input.wo"), gs, nullptr).grad_x;
  const Tensor b_di = reduction_bound(
      d, d_inter, ref::grouped_gemm_bwd(act_, ainter, awo, gs, nullptr, none).grad_x, H);
  Tensor b_du = make_bound(TolClass::elementwise, d, b.d_up, 1);
  Tensor b_dg = make_bound(TolClass::elementwise, d, b.d_gate, 1);
  for (int64_t i = 0; i < b_du.numel(); ++i) {
    const double g = gate.at(i), u = std::fabs(up.at(i)), t = std::fabs(d_inter.at(i));
    const double bg = b_gate.at(i), bu = b_up.at(i), bt = b_di.at(i);
    const double ad = std::fabs(act_d(silu, g));
    b_du.set(i, b_du.at(i) + std::fabs(act_v(silu, g)) * bt +
                    (t + bt) * (ad * bg + 0.5 * curv * bg * bg));
    b_dg.set(i, b_dg.at(i) + ad * (u * bt + (t + bt) * bu) + curv * (t + bt) * (u + bu) * bg);
  }
  const Tensor adg = abs_f64(b.d_gate), adu = abs_f64(b.d_up);
  if (key == "grad.x") {
    const Tensor s = add(ref::grouped_gemm_bwd(adg, ax, aw0, gs, nullptr, none).grad_x,
                         ref::grouped_gemm_bwd(adu, ax, aw1, gs, nullptr, none).grad_x);
    const Tensor p = add(ref::grouped_gemm_bwd(b_dg, ax, aw0, gs, nullptr, none).grad_x,
                         ref::grouped_gemm_bwd(b_du, ax, aw1, gs, nullptr, none).grad_x);
    return add(reduction_bound(d, ref_v, s, 2 * M), p);
  }
  const bool is0 = key == "grad.wi_0" || key == "grad.wi_0_bias";
  const Tensor bias_shape(DType::f64, {gs.dim(0), M});  // only its presence and shape are read
  const ref::GroupedGemmBwd s =
      ref::grouped_gemm_bwd(is0 ? adg : adu, ax, is0 ? aw0 : aw1, gs, &bias_shape, none);
  const ref::GroupedGemmBwd p =
      ref::grouped_gemm_bwd(is0 ? b_dg : b_du, ax, is0 ? aw0 : aw1, gs, &bias_shape, none);
  if (key == "grad.wi_0" || key == "grad.wi_1") {
    return add(reduction_bound(d, ref_v, s.grad_w, 0, &n), p.grad_w);
  }
  return add(reduction_bound(d, ref_v, *s.grad_bias, 0, &n), *p.grad_bias);
}

// Tail rows of every output and of grad x are exactly 0; empty groups give exactly 0 weight and
// bias gradients; each group run alone (G = 1 with its own weights) gives the same rows bitwise,
// so rows are bound to the right group.
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const Activation act = parse_activation(c.s("activation", "silu"));
  const Tensor& x = in.at("input.x");
  const auto sizes = int_values(in.at("input.group_sizes"));
  const int64_t H = x.dim(1), M = in.at("input.wi_0").dim(2);
  int64_t row = 0;
  for (size_t gi = 0; gi < sizes.size(); ++gi) {
    const auto g = static_cast<int64_t>(gi);
    const int64_t n = sizes[gi];
    if (n == 0) {
      for (const char* k : {"grad.wi_0", "grad.wi_1", "grad.wo", "grad.wi_0_bias", "grad.wi_1_bias",
                            "grad.wo_bias"}) {
        const Tensor* t = find_tensor(out, k);
        if (!t) continue;
        const int64_t per = t->numel() / t->dim(0);
        for (int64_t i = 0; i < per; ++i) {
          if (t->at(g * per + i) != 0.0) {
            bad.add(std::string(k) + " of empty group " + std::to_string(g) + " is not 0");
            break;
          }
        }
      }
      continue;
    }
    // Group g alone.
    auto slice = [&](const std::string& key, int64_t rows_from, int64_t rows) -> Tensor {
      const Tensor& t = in.at(key);
      Shape s = t.shape();
      s[0] = rows;
      Tensor o(t.dtype(), s);
      const int64_t per = t.row_stride();
      for (int64_t i = 0; i < rows * per; ++i) o.set(i, t.at(rows_from * per + i));
      return o;
    };
    const Tensor xg = slice("input.x", row, n);
    const Tensor w0 = slice("input.wi_0", g, 1), w1 = slice("input.wi_1", g, 1);
    const Tensor wo = slice("input.wo", g, 1);
    Tensor b0, b1, bo;
    if (in.count("input.wi_0_bias")) b0 = slice("input.wi_0_bias", g, 1);
    if (in.count("input.wi_1_bias")) b1 = slice("input.wi_1_bias", g, 1);
    if (in.count("input.wo_bias")) bo = slice("input.wo_bias", g, 1);
    Tensor one(DType::i32, {1});
    one.set(0, static_cast<double>(n));
    const ref::SwigluFfnFwd f = ref::swiglu_expert_ffn_fwd(
        xg, one,
        {w0, w1, wo, in.count("input.wi_0_bias") ? &b0 : nullptr,
         in.count("input.wi_1_bias") ? &b1 : nullptr, in.count("input.wo_bias") ? &bo : nullptr},
        act);
    const Tensor& y = out.at("output.out");
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        if (f.out.at(r, h) != y.at(row + r, h)) {
          bad.add("group " + std::to_string(g) + " row " + std::to_string(row + r) +
                  ": differs from the group run alone");
          h = H;
        }
      }
    }
    row += n;
  }
  for (int64_t r = row; r < x.dim(0); ++r) {
    for (const char* k :
         {"output.out", "output.gate_proj", "output.up_proj", "output.intermediate", "grad.x"}) {
      const Tensor& t = out.at(k);
      const int64_t w = std::string(k) == "output.out" || std::string(k) == "grad.x" ? H : M;
      for (int64_t i = 0; i < w; ++i) {
        if (t.at(r, i) != 0.0) {
          bad.add(std::string(k) + " tail row " + std::to_string(r) + " is not 0");
          break;
        }
      }
    }
  }
  return bad.take();
}

nlohmann::json to_params(const Case& c) {
  return {{"activation", c.s("activation", "silu")}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder("swiglu_expert_ffn", d).seed(seed);
  const Tensor& x = in.at("input.x");
  const Tensor& gs = in.at("input.group_sizes");
  int64_t used = 0;
  for (int64_t g = 0; g < gs.numel(); ++g) used += static_cast<int64_t>(gs.at(g));
  c.set("G", gs.dim(0)).set("M_total", x.dim(0)).set("H", x.dim(1));
  c.set("M", in.at("input.wi_0").dim(2)).set("tail", x.dim(0) - used);
  set_params<std::string>(c, j, {"activation"});
  c.set("wi_0_bias", in.count("input.wi_0_bias") != 0);
  c.set("wi_1_bias", in.count("input.wi_1_bias") != 0);
  c.set("wo_bias", in.count("input.wo_bias") != 0);
  return c;
}

Cost cost(const Case& c) {
  const double G = static_cast<double>(c.i("G")), Mt = static_cast<double>(c.i("M_total"));
  const double H = static_cast<double>(c.i("H")), M = static_cast<double>(c.i("M"));
  const double V = Mt - static_cast<double>(c.i("tail", 0));
  const double e = static_cast<double>(dtype_size(c.dtype));
  Cost k;
  k.fwd_bytes = (2 * Mt * H + 3 * Mt * M + 3 * G * H * M) * e;
  k.bwd_bytes = (2 * Mt * H + 3 * Mt * M + 6 * G * H * M) * e;
  k.fwd_flops = 6 * V * H * M;
  k.bwd_flops = 12 * V * H * M;
  return k;
}

std::vector<Case> bench_cases() {
  std::vector<Case> v;
  v.push_back(base("g8_m8192_h2048_m1024", DType::bf16, 8, 8192, 2048, 1024, 0, false));
  return v;
}

}  // namespace

const OpInfo& swiglu_expert_ffn_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info("swiglu_expert_ffn", "SPEC §10.2",
                {gen, named, make_inputs, reference, invariants, cost, to_params, from_params});
    o.bound = bound;
    o.bench_cases = bench_cases;
#ifdef MOE_WITH_CUDA
    // `moe-harness bench` runs the full shapes with device-generated inputs.
    set_gpu(o,
            {swiglu_expert_ffn_gpu, swiglu_expert_ffn_gpu_bench, swiglu_expert_ffn_gpu_bench_device,
             swiglu_expert_ffn_bench_verify_case, swiglu_expert_ffn_full_bench_cases});
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
