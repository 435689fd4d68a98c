// CUDA twin of reference/moe_block.h: moe_block (SPEC §11), forward and backward, over P = ep_size
// EP ranks and D = dp_size data-parallel ranks. Same names and argument order as moe::ref,
// DeviceTensor in place of Tensor, a trailing Stream (and RunOptions). No CUDA types here.
//
// The block composes the gpu/ twins of the spec's ops and nothing else: topk_router (§1),
// aux_loss_scores and moe_aux_loss (§2, §3), token_dispatch/token_combine (§4, §5) or the argsort
// ops (§8), ragged_a2a_params, ragged_all_to_all and the local permute (§9) through a
// Communicator, and swiglu_expert_ffn (§10.2). The gate GEMMs are one-group cuBLAS products of
// gpu/grouped_gemm.cuh with fp32 accumulation: logits = rnd_d(x @ rnd_d(gate_kernel)), and in the
// backward d_x_gate = d_logits @ gate_kernel^T and d_gate_kernel = x^T @ d_logits in fp32
// (moe_gate_grads). The glue (casts, d_x = rnd_d(d_x_gate + d_x_dispatch),
// the aux-loss slice add, the shard reductions of the weight gradients, routing-map column counts)
// is small element-wise kernels in moe_block.cu. Deterministic: the shard reductions run in a fixed
// order in fp32 (no float atomics); column counts use integer atomics only.
//
// Shards k = dp*P + ep as in the reference. The EP part of each data-parallel group (steps 5-7 and
// the backward steps 2-4) runs in moe_block_experts_fwd/bwd, which take the Communicator and the
// shards of the ranks it drives (comm.local_ranks(), ascending). Two layouts:
//   - one process holds every shard (the overloads without a communicator: an in-process
//     communicator of P ranks, any P and D on one GPU);
//   - one process per EP rank (the NCCL communicator, D = 1): each process passes the same global
//     inputs, computes only its own shard (its rows of x, its L experts), and gets the same global
//     outputs as the first layout: y, routing_map, probs, grad x and the FFN weight gradients are
//     all-gathered, every rank computes the global aux loss from the all-gathered f32 logits, and
//     the gate-kernel gradient is the fp32 sum of the per-shard gradients in shard order.
// Both layouts do the same arithmetic in the same order, so their results agree bitwise (the
// multi-GPU tests check this against the one-GPU run).
#pragma once

#include <optional>
#include <vector>

#include "gpu/comm.cuh"
#include "gpu/dispatch.cuh"  // RunOptions
#include "gpu/runtime.cuh"
#include "gpu/swiglu_ffn.cuh"
#include "harness/core/params/block.h"
#include "harness/core/params/dispatch.h"

namespace moe::gpu {

struct MoeBlockInputs {
  const DeviceTensor& x;                      // [B,S,H] d
  const DeviceTensor& gate_kernel;            // [H,E]
  const DeviceTensor& wi_0;                   // [E,H,M]
  const DeviceTensor& wi_1;                   // [E,H,M]
  const DeviceTensor& wo;                     // [E,M,H]
  const DeviceTensor* wi_0_bias = nullptr;    // [E,M]
  const DeviceTensor* wi_1_bias = nullptr;    // [E,M]
  const DeviceTensor* wo_bias = nullptr;      // [E,H]
  const DeviceTensor* expert_bias = nullptr;  // [E]
};

// The §11.2 residuals of one (EP rank, DP rank) shard (the reference's MoeShardState).
struct MoeShardState {
  int64_t ep_rank = 0, dp_rank = 0;
  int64_t first_token = 0, tokens = 0;
  DeviceTensor x2d;           // [T_s,H] d
  DeviceTensor logits;        // [T_s,E] f32 or d
  DeviceTensor routing_map;   // [T_s,E] bool
  DeviceTensor saved_scores;  // [T_s,E] f32
  DeviceTensor sparse_probs;  // [T_s,E] probs_dtype
  DeviceTensor group_sizes;   // [E] i32, aligned when a > 0
  // kernel backend
  DeviceTensor row_id_map;                  // [T_s,2E+1] i32
  std::optional<DeviceTensor> pad_offsets;  // [E] i32 iff align_size > 0 (R7)
  // argsort backend
  DeviceTensor selected_experts;  // [T_s,K] i32
  DeviceTensor sorted_indices;    // [N+P_pad] i32
  DeviceTensor weights;           // [T_s,K] probs_dtype
  ArgsortPermParams perm;
  int64_t dispatch_rows = 0;
  // EP (P > 1)
  std::optional<DeviceTensor> all_shards_tokens_per_expert;  // A [P,E] i32
  std::optional<DeviceTensor> local_row_id_map;              // [R] i32 (R14)
  // FFN
  DeviceTensor sorted_x, local_group_sizes, gate_proj, up_proj, intermediate;
  DeviceTensor eo_post;  // [R_pre,H] under EP (R5), the FFN output else
};

struct MoeBlockFwd {
  DeviceTensor y;                                // [B,S,H] d
  std::optional<DeviceTensor> aux_loss;          // [] f32, iff aux_loss_coeff > 0
  DeviceTensor routing_map;                      // [B*S,E] bool
  DeviceTensor probs;                            // [B*S,E] probs_dtype
  DeviceTensor group_sizes;                      // [E] i32, unaligned c_e
  std::vector<MoeShardState> shards;             // this process's shards, ascending dp*P + ep
  std::optional<DeviceTensor> aux_const_buf;     // [2] f32
  std::optional<DeviceTensor> aux_tpe;           // [E] i32
  std::optional<DeviceTensor> aux_saved_scores;  // [B*S,E] f32
};

// o.poison fills every output and intermediate with NaN first (tests, §11.5-5); o.validate reads
// the device error flags back after the permutation ops (synchronising).
MoeBlockFwd moe_block_fwd(const MoeBlockInputs& in, const MoeBlockParams& p, Stream s = nullptr,
                          const RunOptions& o = {});

struct MoeBlockGrads {
  DeviceTensor x, gate_kernel, wi_0, wi_1, wo;
  std::optional<DeviceTensor> wi_0_bias, wi_1_bias, wo_bias;
};

// grad_aux_loss [] (null = 0; only read when aux_loss_coeff > 0).
MoeBlockGrads moe_block_bwd(const DeviceTensor& grad_y, const DeviceTensor* grad_aux_loss,
                            const MoeBlockInputs& in, const MoeBlockFwd& fwd,
                            const MoeBlockParams& p, Stream s = nullptr, const RunOptions& o = {});

// The same block over a communicator that drives all P EP ranks in this process, or exactly one
// (then dp_size must be 1 and comm.size() == ep_size). MoeBlockFwd::shards holds the shards this
// process computes; the other outputs are global on every process (see the file comment).
MoeBlockFwd moe_block_fwd(Communicator& comm, const MoeBlockInputs& in, const MoeBlockParams& p,
                          Stream s = nullptr, const RunOptions& o = {});
MoeBlockGrads moe_block_bwd(Communicator& comm, const DeviceTensor& grad_y,
                            const DeviceTensor* grad_aux_loss, const MoeBlockInputs& in,
                            const MoeBlockFwd& fwd, const MoeBlockParams& p, Stream s = nullptr,
                            const RunOptions& o = {});

// --- per-rank EP pieces -------------------------------------------------------------------------

// The FFN weights of one EP rank's L experts in d: views of the inputs when no cast or slice is
// needed (P = 1 and weights already in d), owned copies otherwise.
class LocalExpertWeights {
 public:
  LocalExpertWeights(const MoeBlockInputs& in, int64_t ep_rank, int64_t L, DType d, Stream s);
  FfnWeights view() const;

 private:
  const DeviceTensor* get(int i) const;
  // wi_0, wi_1, wo, the three biases: an owned copy, or else the input itself (moves stay valid).
  std::optional<DeviceTensor> own_[6];
  const DeviceTensor* src_[6] = {};
};

// Steps 5-7 for the ranks comm drives: shards[i] is rank comm.local_ranks()[i]'s shard of one
// data-parallel group, buffers[i] its dispatch buffer (consumed). Fills sorted_x, the local
// permute state, the FFN residuals and eo_post.
void moe_block_experts_fwd(Communicator& comm, const std::vector<MoeShardState*>& shards,
                           std::vector<DeviceTensor>& buffers,
                           const std::vector<const LocalExpertWeights*>& weights,
                           const MoeBlockParams& p, const MoeBlockShape& shape, Stream s,
                           const RunOptions& o);

// Backward steps 2-4 for the same ranks: d_eo_post[i] (consumed) -> d_buffer[i] (the dispatch
// buffer's cotangent) and the FFN gradients of rank i's L experts.
struct ExpertGrads {
  DeviceTensor d_buffer;
  SwigluFfnBwd ffn;
};
std::vector<ExpertGrads> moe_block_experts_bwd(Communicator& comm,
                                               const std::vector<const MoeShardState*>& shards,
                                               std::vector<DeviceTensor>& d_eo_post,
                                               const std::vector<const LocalExpertWeights*>& w,
                                               const MoeBlockParams& p, const MoeBlockShape& shape,
                                               Stream s, const RunOptions& o);

// The gate GEMM's gradients of one shard: d_x_gate [T, H] = d_logits [T, E] . gk_d^T and
// gk_grad [H, E] = x^T . d_logits, fp32 results (overwritten), where x [T, H] and gk_d [H, E] =
// rnd_d(gate_kernel) are in the block's dtype d. For bf16, d_logits is split into three bf16
// terms that sum to it exactly (each holds 8 of its 24 significant bits), run as bf16
// tensor-core GEMMs with fp32 accumulation (d_x_gate: one contraction over the 3E terms against
// gk_d repeated; gk_grad: one product per term accumulating into its small output). The products
// are exact in fp32, so these are fp32 sums of d_logits' products, without fp32 SIMT GEMMs
// (docs/perf.md, session 17). Other dtypes: fp32 GEMMs of the widened operands.
void moe_gate_grads(const DeviceTensor& d_logits, const DeviceTensor& x, const DeviceTensor& gk_d,
                    DeviceTensor& d_x_gate, DeviceTensor& gk_grad, Stream s);

}  // namespace moe::gpu
