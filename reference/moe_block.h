// CPU reference of moe_block (SPEC §11): the whole MoE layer with ragged-A2A expert parallelism,
// over P = ep_size EP ranks and D = dp_size data-parallel ranks simulated in one process, forward
// and backward. Twin: gpu/moe_block.cuh.
//
// The block composes the reference ops of the spec and nothing else (no op is re-implemented):
//   per shard k = dp*P + ep, with x_k = rows [k*T_s, (k+1)*T_s) of x [B*S, H], T_s = B/(P*D)*S:
//   1. gate     logits = rnd_d(x_k @ rnd_d(gate_kernel)) [T_s,E] d, then f32 when
//               router_logits_dtype = float32 (widening only)
//   2. router   topk_router_fwd (§1) -> probs, routing_map, saved_scores; sparse_probs =
//               cast(probs, probs_dtype); expert_bias cast to f32
//   3. aux      (coeff > 0) global f32 logits [B*S,E]; rerun the router for the global routing
//               map, tpe = its column sums; aux_loss_scores_fwd (§2) then moe_aux_loss_fwd (§3)
//               with T_tot = B*S; aux_loss [] f32
//   4. dispatch kernel: token_dispatch_fwd(x_k, routing_map, N_out = T_s*K, a) (§4);
//               argsort: routing_map_to_selected_experts_fwd + argsort_token_dispatch_fwd (§8)
//   5. EP       (P > 1) A = all_gather(group_sizes) [P,E]; forward ragged_all_to_all of the
//               dispatch buffer into zeros [R,H] (R = recv_rows, §9.5); local_permute_after_a2a
//   6. FFN      swiglu_expert_ffn_fwd (§10.2) with the rank's L experts (weights cast to d)
//   7. EP back  local_unpermute_before_a2a, reverse ragged_all_to_all into zeros [R_pre,H] ->
//   eo_post
//   8. combine  kernel: token_combine_fwd(eo_post, row_id_map, sparse_probs, pad_offsets);
//               argsort: argsort_token_combine_fwd(eo_post, sorted_indices, weights)
// Backward (§11.3) runs each op's backward in reverse order with the saved state: one local
// chunk-sort map for the local permute, the unpermute and both backward passes (R14), the tensor
// combine consumed (eo_post, [R_pre,H], R5), the router backward on f32(d_sparse_probs) plus the
// aux-loss slice, d_x = rnd_d(f32(d_x_gate) + f32(d_x_dispatch)). d_gate_kernel is summed over all
// P*D shards, the FFN weight and bias gradients over the D data-parallel shards of each expert.
// There is no gradient for expert_bias.
//
// Dtypes: y [B,S,H] in d (x's dtype); aux_loss [] f32; the diagnostics routing_map bool [B*S,E],
// probs [B*S,E] in probs_dtype and group_sizes i32 [E] (unaligned global counts c_e) are global
// and EP-invariant. Gradients take their input's dtype. Rounding::none is the finite-difference
// mode: float inputs f64, every op unrounded, selection (fp32) unchanged.
//
// moe_block_dense is the second oracle of §11.5-4: y = sum_e probs[t,e] * FFN_e(x_t) computed
// densely in double with no permutation, and its gradients by the chain rule with the selection
// fixed. It shares only the router and aux-loss references (the selection must be the same) and
// the definitional casts (logits to d, probs to the router's output dtype and to probs_dtype).
#pragma once

#include <optional>
#include <vector>

#include "harness/core/params/block.h"
#include "harness/core/params/dispatch.h"
#include "reference/common.h"

namespace moe::ref {

struct MoeBlockInputs {
  const Tensor& x;                      // [B,S,H] d
  const Tensor& gate_kernel;            // [H,E]
  const Tensor& wi_0;                   // [E,H,M]
  const Tensor& wi_1;                   // [E,H,M]
  const Tensor& wo;                     // [E,M,H]
  const Tensor* wi_0_bias = nullptr;    // [E,M]
  const Tensor* wi_1_bias = nullptr;    // [E,M]
  const Tensor* wo_bias = nullptr;      // [E,H]
  const Tensor* expert_bias = nullptr;  // [E]
};

// The §11.2 residuals of one (EP rank, DP rank) shard.
struct MoeShardState {
  int64_t ep_rank = 0, dp_rank = 0;
  int64_t first_token = 0, tokens = 0;  // rows [first_token, first_token + tokens) of x [B*S,H]
  Tensor x2d;                           // [T_s,H] d
  Tensor logits;                        // [T_s,E] f32 or d (router input)
  Tensor routing_map;                   // [T_s,E] bool
  Tensor saved_scores;                  // [T_s,E] f32
  Tensor sparse_probs;                  // [T_s,E] probs_dtype (kernel: the merging probs)
  Tensor group_sizes;                   // [E] i32, aligned when a > 0
  // kernel backend
  Tensor row_id_map;                  // [T_s,2E+1] i32
  std::optional<Tensor> pad_offsets;  // [E] i32 iff align_size > 0 (R7: absent, not empty)
  // argsort backend
  Tensor selected_experts;  // [T_s,K] i32
  Tensor sorted_indices;    // [N+P_pad] i32
  Tensor weights;           // [T_s,K] probs_dtype
  ArgsortPermParams perm;
  int64_t dispatch_rows = 0;  // rows of the dispatch buffer (the forward A2A's operand)
  // EP (P > 1)
  std::optional<Tensor> all_shards_tokens_per_expert;  // A [P,E] i32
  std::optional<Tensor> local_row_id_map;              // [R] i32, the one chunk-sort map (R14)
  // FFN
  Tensor sorted_x;                          // [R or dispatch rows, H] d
  Tensor local_group_sizes;                 // [L] i32
  Tensor gate_proj, up_proj, intermediate;  // [rows, M] d
  Tensor eo_post;  // the tensor combine consumed: [R_pre,H] under EP (R5), the FFN output else
};

struct MoeBlockFwd {
  Tensor y;                           // [B,S,H] d
  std::optional<Tensor> aux_loss;     // [] f32, iff aux_loss_coeff > 0
  Tensor routing_map;                 // [B*S,E] bool
  Tensor probs;                       // [B*S,E] probs_dtype
  Tensor group_sizes;                 // [E] i32, unaligned c_e
  std::vector<MoeShardState> shards;  // index dp*P + ep
  // Aux-loss residuals (coeff > 0).
  std::optional<Tensor> aux_const_buf;     // [2] f32
  std::optional<Tensor> aux_tpe;           // [E] i32
  std::optional<Tensor> aux_saved_scores;  // [B*S,E] f32
};

MoeBlockFwd moe_block_fwd(const MoeBlockInputs& in, const MoeBlockParams& p,
                          Rounding r = Rounding::to_dtype);

struct MoeBlockGrads {
  Tensor x;                                             // [B,S,H] x's dtype
  Tensor gate_kernel;                                   // [H,E]
  Tensor wi_0, wi_1;                                    // [E,H,M]
  Tensor wo;                                            // [E,M,H]
  std::optional<Tensor> wi_0_bias, wi_1_bias, wo_bias;  // iff given; never one for expert_bias
};

// grad_y [B,S,H]; grad_aux_loss [] (null = 0; only read when aux_loss_coeff > 0).
MoeBlockGrads moe_block_bwd(const Tensor& grad_y, const Tensor* grad_aux_loss,
                            const MoeBlockInputs& in, const MoeBlockFwd& fwd,
                            const MoeBlockParams& p, Rounding r = Rounding::to_dtype);

// §11.5-4 dense oracle, in double (outputs f64): y, aux_loss, probs as the block uses them, and
// the gradients for the given cotangents. exact = true: no rounding anywhere (finite-difference
// inputs); false: the definitional casts of the block (logits to d, probs to the router output
// dtype and to probs_dtype) are applied and everything else is exact.
struct MoeBlockDense {
  Tensor y;
  std::optional<Tensor> aux_loss;
  Tensor probs;  // [B*S,E] as combined
  Tensor routing_map;
  MoeBlockGrads grads;
};
MoeBlockDense moe_block_dense(const MoeBlockInputs& in, const MoeBlockParams& p,
                              const Tensor& grad_y, const Tensor* grad_aux_loss, bool exact);

}  // namespace moe::ref
