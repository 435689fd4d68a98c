// CPU reference of swiglu_expert_ffn (SPEC §10.2), the gated expert FFN, forward and backward.
// Twin: gpu/swiglu_ffn.cuh.
//
// Layouts (row-major): x [M_total, H] in d; group_sizes [G] int; wi_0, wi_1 [G, H, M] in d;
// wo [G, M, H] in d; wi_0_bias, wi_1_bias [G, M] and wo_bias [G, H] (optional, any float dtype;
// the block passes the weights' dtype). Group g owns rows [o_g, o_g + n_g); rows past
// sum n_g are the tail.
//
// Forward, per grouped row r of group g (each GEMM is a §10.1 grouped GEMM, rounded once to d):
//   gate_proj    = rnd_d( x[r] @ wi_0[g] + wi_0_bias[g] )      [M_total, M] d
//   up_proj      = rnd_d( x[r] @ wi_1[g] + wi_1_bias[g] )      [M_total, M] d
//   intermediate = rnd_d( act(gate_proj) * up_proj )           [M_total, M] d, computed from the
//                                                              rounded gate/up values
//   out          = rnd_d( intermediate @ wo[g] + wo_bias[g] )  [M_total, H] d
// act = silu (x*sigmoid(x)) or linear. Tail rows of every output are 0; the activation of a
// padding row (x = 0) with biases is non-zero, which combine never reads.
//
// Backward with ct = grad out [M_total, H]. d_inter, d_gate and d_up are stored in d between
// stages [DECISION]; each GEMM result is rounded once:
//   d_inter  = rnd_d( ct @ wo[g]^T )
//   d_up     = rnd_d( d_inter * act(gate) )
//   d_gate   = rnd_d( act'(gate) * d_inter * up ), silu'(x) = s(x)*(1 + x*(1 - s(x)))
//   grad_x   = rnd_d( d_gate @ wi_0[g]^T + d_up @ wi_1[g]^T )  (one rounding of the sum)
//   grad_wo[g]   = rnd_d( inter_g^T ct_g ),   grad_wo_bias[g]   = sum_g ct
//   grad_wi_0[g] = rnd_d( x_g^T d_gate_g ),   grad_wi_0_bias[g] = sum_g d_gate
//   grad_wi_1[g] = rnd_d( x_g^T d_up_g ),     grad_wi_1_bias[g] = sum_g d_up
// Empty groups give exactly 0 weight gradients; tail rows of grad_x are 0. Weight and bias
// gradients take their parameter's dtype. Rounding::none: f64 everywhere, no rounding.
#pragma once

#include <optional>

#include "harness/core/params/ffn.h"
#include "reference/common.h"

namespace moe::ref {

struct FfnWeights {
  const Tensor& wi_0;
  const Tensor& wi_1;
  const Tensor& wo;
  const Tensor* wi_0_bias = nullptr;
  const Tensor* wi_1_bias = nullptr;
  const Tensor* wo_bias = nullptr;
};

struct SwigluFfnFwd {
  Tensor out;           // [M_total, H] d
  Tensor gate_proj;     // [M_total, M] d
  Tensor up_proj;       // [M_total, M] d
  Tensor intermediate;  // [M_total, M] d
};

SwigluFfnFwd swiglu_expert_ffn_fwd(const Tensor& x, const Tensor& group_sizes, const FfnWeights& w,
                                   Activation act, Rounding r = Rounding::to_dtype);

struct SwigluFfnBwd {
  Tensor grad_x;                                                       // [M_total, H] d
  Tensor grad_wi_0;                                                    // [G, H, M]
  Tensor grad_wi_1;                                                    // [G, H, M]
  Tensor grad_wo;                                                      // [G, M, H]
  std::optional<Tensor> grad_wi_0_bias, grad_wi_1_bias, grad_wo_bias;  // iff the bias was given
  // Stage values of the backward ([M_total, M] in d), kept for tolerance computations.
  Tensor d_gate, d_up;
};

// gate_proj, up_proj and intermediate are the forward's saved outputs.
SwigluFfnBwd swiglu_expert_ffn_bwd(const Tensor& grad_out, const Tensor& x,
                                   const Tensor& group_sizes, const FfnWeights& w,
                                   const Tensor& gate_proj, const Tensor& up_proj,
                                   const Tensor& intermediate, Activation act,
                                   Rounding r = Rounding::to_dtype);

// act(x) and act'(x) in double (shared with the dense block reference).
double activation_value(Activation act, double x);
double activation_grad(Activation act, double x);

}  // namespace moe::ref
