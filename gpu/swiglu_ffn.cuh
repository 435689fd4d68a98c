// CUDA twin of reference/swiglu_ffn.h: swiglu_expert_ffn (SPEC §10.2), the gated expert FFN,
// forward and backward. Same names and argument order as moe::ref, DeviceTensor in place of
// Tensor, a trailing Stream (and GemmOptions). No CUDA types here.
//
// Math and layouts: see reference/swiglu_ffn.h. x [M_total, H] d, group_sizes [G] (device),
// wi_0/wi_1 [G, H, M] d, wo [G, M, H] d, biases [G, M] / [G, H] (any float dtype).
//
// Stages (every GEMM is a grouped cuBLAS product of gpu/grouped_gemm.cuh with fp32 accumulation;
// the group sizes are read back once per call and shared by all products):
//   forward:  gate = rnd_d(x @ wi_0 + b0), up = rnd_d(x @ wi_1 + b1)  cuBLAS writes d directly;
//             with a bias it writes fp32 and the activation kernel adds the bias and rounds, so
//             the bias costs no extra pass.
//             inter = rnd_d(act(f32 gate) * f32 up)                    one elementwise kernel
//                                                                      (fused with the above)
//             out = rnd_d(inter @ wo + bo)                             grouped_gemm_fwd_into
//   backward: d_inter = rnd_d(ct @ wo^T), grad wo = rnd(inter^T ct), grad bo = sum ct
//             d_up = rnd_d(d_inter * act(gate)), d_gate = rnd_d(act'(gate) * (d_inter * up))
//                                                                      one elementwise kernel
//             grad x = rnd_d(d_gate @ wi_0^T + d_up @ wi_1^T)           both products accumulate
//                                                                      in one fp32 buffer,
//                                                                      rounded once
//             grad wi_0 = rnd(x^T d_gate), grad wi_1 = rnd(x^T d_up), grad b0/b1 = column sums
// Products sharing a row operand go out together (gemm_detail::grouped_products): gate and up
// (one batched call under GemmImpl::chunked; concatenating wi_0 and wi_1 would copy both weights
// every call), and grad wi_0 / grad wi_1 (both x^T . d). Measured on an H100 (bf16, GemmBench),
// TFLOP/s forward / forward+backward, chunked (default) vs streams: Mixtral-like (32768 rows,
// H 4096, M 14336, 8 experts) 584-618 / 620-637 vs 598 / 631-639; DeepSeek-like (65536 rows,
// H 7168, M 2048, 256 experts) uniform 356 / 367 vs 333 / 363, skewed 387 / 356 vs 419 / 353
// (run-to-run spread about 10%; the same chunked forward measured 356 and 423 in one run).
// act and act' run in fp32 from the rounded gate and up values [DECISION of SPEC §10.2]. Tail rows
// of every output, and the weight and bias gradients of empty groups, are exactly 0.
#pragma once

#include <optional>

#include "gpu/grouped_gemm.cuh"
#include "gpu/runtime.cuh"
#include "harness/core/params/ffn.h"

namespace moe::gpu {

struct FfnWeights {
  const DeviceTensor& wi_0;
  const DeviceTensor& wi_1;
  const DeviceTensor& wo;
  const DeviceTensor* wi_0_bias = nullptr;
  const DeviceTensor* wi_1_bias = nullptr;
  const DeviceTensor* wo_bias = nullptr;
};

struct SwigluFfnFwd {
  DeviceTensor out;           // [M_total, H] d
  DeviceTensor gate_proj;     // [M_total, M] d
  DeviceTensor up_proj;       // [M_total, M] d
  DeviceTensor intermediate;  // [M_total, M] d
};

SwigluFfnFwd swiglu_expert_ffn_fwd(const DeviceTensor& x, const DeviceTensor& group_sizes,
                                   const FfnWeights& w, Activation act, Stream s = nullptr,
                                   const GemmOptions& o = {});
// Launch-only form into preallocated outputs, with the group sizes already on the host.
void swiglu_expert_ffn_fwd_into(const DeviceTensor& x, const GroupPlan& plan, const FfnWeights& w,
                                Activation act, SwigluFfnFwd& out, Stream s,
                                const GemmOptions& o = {});

struct SwigluFfnBwd {
  DeviceTensor grad_x;                                                       // [M_total, H] d
  DeviceTensor grad_wi_0;                                                    // [G, H, M]
  DeviceTensor grad_wi_1;                                                    // [G, H, M]
  DeviceTensor grad_wo;                                                      // [G, M, H]
  std::optional<DeviceTensor> grad_wi_0_bias, grad_wi_1_bias, grad_wo_bias;  // iff the bias
  // Stage values of the backward ([M_total, M] in d; tail rows 0), as the reference keeps them.
  DeviceTensor d_gate, d_up;
};

// gate_proj, up_proj and intermediate are the forward's saved outputs.
SwigluFfnBwd swiglu_expert_ffn_bwd(const DeviceTensor& grad_out, const DeviceTensor& x,
                                   const DeviceTensor& group_sizes, const FfnWeights& w,
                                   const DeviceTensor& gate_proj, const DeviceTensor& up_proj,
                                   const DeviceTensor& intermediate, Activation act,
                                   Stream s = nullptr, const GemmOptions& o = {});
void swiglu_expert_ffn_bwd_into(const DeviceTensor& grad_out, const DeviceTensor& x,
                                const GroupPlan& plan, const FfnWeights& w,
                                const DeviceTensor& gate_proj, const DeviceTensor& up_proj,
                                const DeviceTensor& intermediate, Activation act, SwigluFfnBwd& out,
                                Stream s, const GemmOptions& o = {});

}  // namespace moe::gpu
