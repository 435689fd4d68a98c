#include "reference/swiglu_ffn.h"

#include <cmath>

#include "reference/grouped_gemm.h"

namespace moe::ref {

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Finite-difference mode works on f64 copies, so intermediates (f64) and weights share a dtype
// as the grouped GEMM requires.
struct F64View {
  Tensor x, wi_0, wi_1, wo, b0, b1, bo;
  bool has_b0 = false, has_b1 = false, has_bo = false;
};

F64View to_f64_view(const Tensor& x, const FfnWeights& w) {
  F64View v;
  v.x = x.to(DType::f64);
  v.wi_0 = w.wi_0.to(DType::f64);
  v.wi_1 = w.wi_1.to(DType::f64);
  v.wo = w.wo.to(DType::f64);
  if ((v.has_b0 = w.wi_0_bias != nullptr)) v.b0 = w.wi_0_bias->to(DType::f64);
  if ((v.has_b1 = w.wi_1_bias != nullptr)) v.b1 = w.wi_1_bias->to(DType::f64);
  if ((v.has_bo = w.wo_bias != nullptr)) v.bo = w.wo_bias->to(DType::f64);
  return v;
}

void validate(const Tensor& x, const Tensor& gs, const FfnWeights& w, Rounding r) {
  const TensorMeta b0 = w.wi_0_bias ? w.wi_0_bias->meta() : TensorMeta{};
  const TensorMeta b1 = w.wi_1_bias ? w.wi_1_bias->meta() : TensorMeta{};
  const TensorMeta bo = w.wo_bias ? w.wo_bias->meta() : TensorMeta{};
  validate_swiglu_expert_ffn(x.meta(), gs.meta(), w.wi_0.meta(), w.wi_1.meta(), w.wo.meta(),
                             w.wi_0_bias ? &b0 : nullptr, w.wi_1_bias ? &b1 : nullptr,
                             w.wo_bias ? &bo : nullptr, r == Rounding::none);
}

Tensor round_or_keep(Tensor t, DType d, Rounding r) {
  return r == Rounding::none ? std::move(t) : t.to(d);
}

}  // namespace

double activation_value(Activation act, double x) {
  return act == Activation::silu ? x * sigmoid(x) : x;
}

double activation_grad(Activation act, double x) {
  if (act == Activation::linear) return 1.0;
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

SwigluFfnFwd swiglu_expert_ffn_fwd(const Tensor& x, const Tensor& group_sizes, const FfnWeights& w,
                                   Activation act, Rounding r) {
  validate(x, group_sizes, w, r);
  if (r == Rounding::none && x.dtype() != DType::f64) {
    const F64View v = to_f64_view(x, w);
    return swiglu_expert_ffn_fwd(v.x, group_sizes,
                                 {v.wi_0, v.wi_1, v.wo, v.has_b0 ? &v.b0 : nullptr,
                                  v.has_b1 ? &v.b1 : nullptr, v.has_bo ? &v.bo : nullptr},
                                 act, r);
  }
  SwigluFfnFwd out;
  out.gate_proj = grouped_gemm_fwd(x, w.wi_0, group_sizes, w.wi_0_bias, r);
  out.up_proj = grouped_gemm_fwd(x, w.wi_1, group_sizes, w.wi_1_bias, r);
  out.intermediate = Tensor(out_dtype(x.dtype(), r), out.gate_proj.shape());
  // Tail rows of gate and up are 0, so act(0)*0 = 0 keeps the tail 0.
  for (int64_t i = 0; i < out.intermediate.numel(); ++i) {
    out.intermediate.set(i, activation_value(act, out.gate_proj.at(i)) * out.up_proj.at(i));
  }
  out.out = grouped_gemm_fwd(out.intermediate, w.wo, group_sizes, w.wo_bias, r);
  return out;
}

SwigluFfnBwd swiglu_expert_ffn_bwd(const Tensor& grad_out, const Tensor& x,
                                   const Tensor& group_sizes, const FfnWeights& w,
                                   const Tensor& gate_proj, const Tensor& up_proj,
                                   const Tensor& intermediate, Activation act, Rounding r) {
  validate(x, group_sizes, w, r);
  require_shape(gate_proj.meta(), {x.dim(0), w.wi_0.dim(2)}, "gate_proj");
  require_shape(up_proj.meta(), {x.dim(0), w.wi_0.dim(2)}, "up_proj");
  require_shape(intermediate.meta(), {x.dim(0), w.wi_0.dim(2)}, "intermediate");
  if (r == Rounding::none && (x.dtype() != DType::f64 || intermediate.dtype() != DType::f64)) {
    const F64View v = to_f64_view(x, w);
    const Tensor inter = intermediate.to(DType::f64);
    return swiglu_expert_ffn_bwd(grad_out, v.x, group_sizes,
                                 {v.wi_0, v.wi_1, v.wo, v.has_b0 ? &v.b0 : nullptr,
                                  v.has_b1 ? &v.b1 : nullptr, v.has_bo ? &v.bo : nullptr},
                                 gate_proj, up_proj, inter, act, r);
  }
  const DType d = out_dtype(x.dtype(), r);
  SwigluFfnBwd out;
  // Output projection: d_inter is stored in d (the dtype of intermediate).
  GroupedGemmBwd go = grouped_gemm_bwd(grad_out, intermediate, w.wo, group_sizes, w.wo_bias, r);
  out.grad_wo = std::move(go.grad_w);
  out.grad_wo_bias = std::move(go.grad_bias);
  const Tensor& d_inter = go.grad_x;
  Tensor d_gate(d, gate_proj.shape()), d_up(d, up_proj.shape());
  for (int64_t i = 0; i < d_inter.numel(); ++i) {
    const double g = gate_proj.at(i), u = up_proj.at(i), di = d_inter.at(i);
    d_up.set(i, di * activation_value(act, g));
    d_gate.set(i, activation_grad(act, g) * (di * u));
  }
  // Input projections in double, so grad_x is the two products' sum rounded once.
  GroupedGemmBwd g0 = grouped_gemm_bwd(d_gate, x, w.wi_0, group_sizes, w.wi_0_bias, Rounding::none);
  GroupedGemmBwd g1 = grouped_gemm_bwd(d_up, x, w.wi_1, group_sizes, w.wi_1_bias, Rounding::none);
  out.grad_x = Tensor(d, x.shape());
  for (int64_t i = 0; i < out.grad_x.numel(); ++i) {
    out.grad_x.set(i, g0.grad_x.at(i) + g1.grad_x.at(i));
  }
  out.grad_wi_0 = round_or_keep(std::move(g0.grad_w), w.wi_0.dtype(), r);
  out.grad_wi_1 = round_or_keep(std::move(g1.grad_w), w.wi_1.dtype(), r);
  if (g0.grad_bias)
    out.grad_wi_0_bias = round_or_keep(std::move(*g0.grad_bias), w.wi_0_bias->dtype(), r);
  if (g1.grad_bias)
    out.grad_wi_1_bias = round_or_keep(std::move(*g1.grad_bias), w.wi_1_bias->dtype(), r);
  out.d_gate = std::move(d_gate);
  out.d_up = std::move(d_up);
  return out;
}

}  // namespace moe::ref
