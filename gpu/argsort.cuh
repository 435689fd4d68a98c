// CUDA twin of reference/argsort.h: the argsort backend (SPEC §8, TE "PURE_JAX"):
// routing_map_to_selected_experts, argsort_token_dispatch and argsort_token_combine, forward and
// backward. Same names and argument order as moe::ref, DeviceTensor in place of Tensor, a
// trailing Stream (and RunOptions). No CUDA types here.
//
// Math and layouts: see reference/argsort.h.
//
// The stable argsort of argsort_token_dispatch is never run as a sort: every key is an expert id,
// so the position of an item is a counting-sort position. Real item (t,k) with expert e lands at
// start(e) + rank(t,e) (rank = tokens before t routed to e, from the same column bitmap as
// token_dispatch; ids within a row are distinct, so the flat-index order within e is the token
// order); padding position N+q of owner e at offset o lands at start(e) + c_e + o when o < need_e,
// and an overflow placeholder (key E-1) after the real rows of group E-1, in q order. One CTA per
// token reads x[t] once and writes its K rows; a warp per padding position writes a zero row.
// Backward passes and the combine gather through inv = argsort(sorted_indices), built by one
// compare-and-swap pass that also checks the permutation; sums run in fp32 in k order.
#pragma once

#include "gpu/dispatch.cuh"  // RunOptions
#include "gpu/runtime.cuh"
#include "harness/core/params/dispatch.h"

namespace moe::gpu {

struct RoutingMapToSelectedExpertsFwd {
  DeviceTensor selected_experts;  // [T,K] i32, ascending per row
  DeviceTensor weights;           // [T,K] in sparse_probs' dtype
};

RoutingMapToSelectedExpertsFwd routing_map_to_selected_experts_fwd(const DeviceTensor& sparse_probs,
                                                                   const DeviceTensor& routing_map,
                                                                   int64_t topk, Stream s = nullptr,
                                                                   const RunOptions& o = {});

// grad_sparse_probs [T,num_experts] in grad_weights' dtype.
DeviceTensor routing_map_to_selected_experts_bwd(const DeviceTensor& grad_weights,
                                                 const DeviceTensor& selected_experts,
                                                 int64_t num_experts, Stream s = nullptr,
                                                 const RunOptions& o = {});

struct ArgsortTokenDispatchFwd {
  DeviceTensor sorted_x;        // [N+P_pad,H] d
  DeviceTensor sorted_indices;  // [N+P_pad] i32
  DeviceTensor group_sizes;     // [E] i32
  ArgsortPermParams state;      // K, N, P_pad
};

ArgsortTokenDispatchFwd argsort_token_dispatch_fwd(const DeviceTensor& x,
                                                   const DeviceTensor& selected_experts,
                                                   const ArgsortDispatchParams& p,
                                                   Stream s = nullptr, const RunOptions& o = {});

// grad_x [N/K,H] in grad_sorted_x's dtype.
DeviceTensor argsort_token_dispatch_bwd(const DeviceTensor& grad_sorted_x,
                                        const DeviceTensor& sorted_indices,
                                        const ArgsortPermParams& p, Stream s = nullptr,
                                        const RunOptions& o = {});

// combined [N/K,H] in expert_outputs' dtype.
DeviceTensor argsort_token_combine_fwd(const DeviceTensor& expert_outputs,
                                       const DeviceTensor& sorted_indices,
                                       const DeviceTensor& weights, const ArgsortPermParams& p,
                                       Stream s = nullptr, const RunOptions& o = {});

struct ArgsortTokenCombineBwd {
  DeviceTensor grad_expert_outputs;  // [N+P_pad,H] in grad_combined's dtype
  DeviceTensor grad_weights;         // [T,K] in weights' dtype
};

// The CUDA path needs grad_combined in expert_outputs' dtype (std::invalid_argument otherwise).
ArgsortTokenCombineBwd argsort_token_combine_bwd(const DeviceTensor& grad_combined,
                                                 const DeviceTensor& expert_outputs,
                                                 const DeviceTensor& sorted_indices,
                                                 const DeviceTensor& weights,
                                                 const ArgsortPermParams& p, Stream s = nullptr,
                                                 const RunOptions& o = {});

}  // namespace moe::gpu
