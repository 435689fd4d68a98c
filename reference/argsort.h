// CPU reference of the argsort backend (SPEC §8, TE "PURE_JAX"): routing_map_to_selected_experts,
// argsort_token_dispatch and argsort_token_combine, forward and backward.
// Twin: gpu/argsort.cuh (same names, same argument order, DeviceTensor, trailing Stream).
// "argsort" always means a stable ascending argsort.
//
// routing_map_to_selected_experts (§8.1)
//   sparse_probs [T,E] p; routing_map [T,E] bool (or u8/i32/i64, values in {0,1}), exactly K set
//   entries per row (checked) ->
//   selected_experts [T,K] i32: the routed expert ids in ascending order
//   weights          [T,K] p:   weights[t,k] = sparse_probs[t, selected_experts[t,k]]
//   Backward: grad_sparse_probs [T,E] (ct's dtype) = ct_weights[t,k] at (t, selected[t,k]), else 0.
//
// argsort_token_dispatch (§8.2), N = T*K, P_pad = E(a-1) if a > 0 else 0
//   x [T,H] d; selected_experts [T,K] i32/i64, ids in [0,E), distinct per row (checked).
//   key_i = selected_experts[i/K, i%K], row_i = x[i/K]                      for i < N
//   c_e = #{i < N : key_i = e}, need_e = (a - c_e mod a) mod a
//   position p = N + q (0 <= q < P_pad): owner e = q/(a-1), o = q%(a-1),
//     key_p = e if o < need_e else E-1 (overflow placeholder), row_p = 0
//   roll r: key <- (key - r) mod E
//   sorted_indices [N+P_pad] i32 = stable argsort(key)
//   sorted_x       [N+P_pad,H] d: sorted_x[j] = row[sorted_indices[j]]
//   group_sizes    [E] i32: c_e + need_e, rolled as group_sizes'[i] = group_sizes[(i+r) mod E]
//   r != 0 with a > 0 is an error (R9).
//   Backward: grad_x[t] = sum_{k<K} ct[inv[t*K+k]] (k ascending), inv = argsort(sorted_indices);
//   positions >= N are discarded. grad_x [T,H] in ct's dtype.
//
// argsort_token_combine (§8.3)
//   expert_outputs [N+P_pad,H] d; sorted_indices [N+P_pad] (a permutation, checked);
//   weights [T,K] p, T = N/K.
//   u[i] = expert_outputs[inv[i]] for i < N
//   combined[t] = rnd_d( sum_{k<K} rnd_d(w[t,k]) * u[t*K+k] ), k ascending; [T,H] in d
//   Backward (ct = grad_combined [T,H]):
//     grad_expert_outputs[j] = rnd_d(ct[t] * rnd_d(w[t,k])) if sorted_indices[j] = t*K+k < N,
//                              else 0                                 ([N+P_pad,H] in ct's dtype)
//     grad_weights[t,k]      = rnd_p( sum_h ct[t,h] * u[t*K+k,h] )   ([T,K] in p)
//
// All arithmetic is in double from the dtype-rounded inputs, one rounding at the end (the TE
// rounding of the weights to d is applied explicitly; Rounding::none skips every rounding and
// outputs f64). Data-dependent errors throw std::invalid_argument through throw_perm_fault.
#pragma once

#include "harness/core/params/dispatch.h"
#include "reference/common.h"

namespace moe::ref {

struct RoutingMapToSelectedExpertsFwd {
  Tensor selected_experts;  // [T,K] i32, ascending per row
  Tensor weights;           // [T,K] in sparse_probs' dtype
};

RoutingMapToSelectedExpertsFwd routing_map_to_selected_experts_fwd(const Tensor& sparse_probs,
                                                                   const Tensor& routing_map,
                                                                   int64_t topk,
                                                                   Rounding r = Rounding::to_dtype);

// grad_sparse_probs [T,num_experts] in grad_weights' dtype.
Tensor routing_map_to_selected_experts_bwd(const Tensor& grad_weights,
                                           const Tensor& selected_experts, int64_t num_experts,
                                           Rounding r = Rounding::to_dtype);

struct ArgsortTokenDispatchFwd {
  Tensor sorted_x;          // [N+P_pad,H] d
  Tensor sorted_indices;    // [N+P_pad] i32
  Tensor group_sizes;       // [E] i32
  ArgsortPermParams state;  // K, N, P_pad: the static ints of the perm state
};

ArgsortTokenDispatchFwd argsort_token_dispatch_fwd(const Tensor& x, const Tensor& selected_experts,
                                                   const ArgsortDispatchParams& p,
                                                   Rounding r = Rounding::to_dtype);

// grad_x [N/K,H] in grad_sorted_x's dtype.
Tensor argsort_token_dispatch_bwd(const Tensor& grad_sorted_x, const Tensor& sorted_indices,
                                  const ArgsortPermParams& p, Rounding r = Rounding::to_dtype);

// combined [N/K,H] in expert_outputs' dtype.
Tensor argsort_token_combine_fwd(const Tensor& expert_outputs, const Tensor& sorted_indices,
                                 const Tensor& weights, const ArgsortPermParams& p,
                                 Rounding r = Rounding::to_dtype);

struct ArgsortTokenCombineBwd {
  Tensor grad_expert_outputs;  // [N+P_pad,H] in grad_combined's dtype
  Tensor grad_weights;         // [T,K] in weights' dtype
};

ArgsortTokenCombineBwd argsort_token_combine_bwd(const Tensor& grad_combined,
                                                 const Tensor& expert_outputs,
                                                 const Tensor& sorted_indices,
                                                 const Tensor& weights, const ArgsortPermParams& p,
                                                 Rounding r = Rounding::to_dtype);

}  // namespace moe::ref
