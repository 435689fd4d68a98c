// CUDA twin of reference/topk_router.h (SPEC §1): fused score function, grouped top-k, expert
// bias, scaling; forward and backward. Same names and argument order as moe::ref, taking
// DeviceTensor and a trailing Stream. No CUDA types in this header.
//
// Layouts (row-major): logits [T,E] in d (f32, bf16, f16); expert_bias [E] (any float dtype,
// widened exactly); probs [T,E] in d; routing_map [T,E] bool (bytemap) or [T,ceil(E/8)] u8
// (bitmap_u8, LSB first); saved_scores [T,E] f32 always; grad_logits [T,E] in grad_probs' dtype.
//
// Kernel (gpu/router_row.cuh): one row per 1..32 lanes of a warp, the row in registers, fp32 score
// functions from harness/core/score_fn.h (bitwise equal to the CPU reference's selection scores),
// canonical top-k (value desc, index asc) by warp reductions. Deterministic: fixed reduction
// order, no atomics. Supports 1 <= E <= 4096 (kMaxExperts) and T*E beyond 2^31 (int64 offsets).
#pragma once

#include "gpu/runtime.cuh"
#include "harness/core/params/router.h"

namespace moe::gpu {

struct TopkRouterFwd {
  DeviceTensor probs;         // [T,E] d
  DeviceTensor routing_map;   // bytemap or bitmap_u8
  DeviceTensor saved_scores;  // [T,E] f32
};

TopkRouterFwd topk_router_fwd(const DeviceTensor& logits, const DeviceTensor* expert_bias,
                              const RouterParams& p, Stream s = nullptr);
// grad_logits [T,E] in grad_probs' dtype (SPEC §1.3).
DeviceTensor topk_router_bwd(const DeviceTensor& grad_probs, const DeviceTensor& routing_map,
                             const DeviceTensor& saved_scores, const RouterParams& p,
                             Stream s = nullptr);

// The same ops writing into caller-owned outputs (benchmarks, poisoned-output tests). The
// outputs' dtypes and shapes are checked; *_outputs allocates them uninitialised.
TopkRouterFwd topk_router_fwd_outputs(const TensorMeta& logits, const RouterParams& p);
void topk_router_fwd_into(const DeviceTensor& logits, const DeviceTensor* expert_bias,
                          const RouterParams& p, TopkRouterFwd& out, Stream s = nullptr);
void topk_router_bwd_into(const DeviceTensor& grad_probs, const DeviceTensor& routing_map,
                          const DeviceTensor& saved_scores, const RouterParams& p,
                          DeviceTensor& grad_logits, Stream s = nullptr);

}  // namespace moe::gpu
