// CUDA twin of reference/aux_loss.h: aux_loss_scores (SPEC §2) and moe_aux_loss (SPEC §3),
// forward and backward. Same names and argument order as moe::ref, taking DeviceTensor and a
// trailing Stream. No CUDA types in this header.
//
// aux_loss_scores: logits [T,E] d -> scores [T,E] f32, routing_map (canonical top-K of the fp32
// scores), saved_scores [T,E] f32; the row kernels of gpu/router_row.cuh.
// moe_aux_loss: probs [R,C] d, tokens_per_expert [C] (i32, i64, f32 or bf16) -> aux_loss [] d,
// const_buf [2] f32 = {kappa, loss_f32}. Deterministic: column sums over fixed 256-row chunks,
// then fixed-order sums over chunks and columns (no atomics), so two runs are bitwise equal.
#pragma once

#include "gpu/runtime.cuh"
#include "harness/core/params/router.h"

namespace moe::gpu {

struct AuxLossScoresFwd {
  DeviceTensor scores;        // [T,E] f32
  DeviceTensor routing_map;   // [T,E] bool or [T,ceil(E/8)] u8
  DeviceTensor saved_scores;  // [T,E] f32
};
AuxLossScoresFwd aux_loss_scores_fwd(const DeviceTensor& logits, int64_t topk, ScoreFunction f,
                                     MapFormat fmt, Stream s = nullptr);
// grad_scores [T,E] f32 -> grad_logits [T,E] in logits_dtype.
DeviceTensor aux_loss_scores_bwd(const DeviceTensor& grad_scores, const DeviceTensor& saved_scores,
                                 ScoreFunction f, DType logits_dtype, Stream s = nullptr);

struct MoeAuxLossFwd {
  DeviceTensor aux_loss;   // [] in probs' dtype
  DeviceTensor const_buf;  // [2] f32: kappa, loss_f32
};
MoeAuxLossFwd moe_aux_loss_fwd(const DeviceTensor& probs, const DeviceTensor& tokens_per_expert,
                               const AuxLossParams& p, Stream s = nullptr);
// grad_aux_loss [] -> grad_probs [R,C] in grad_aux_loss' dtype.
DeviceTensor moe_aux_loss_bwd(const DeviceTensor& grad_aux_loss, const DeviceTensor& const_buf,
                              const DeviceTensor& tokens_per_expert, int64_t num_rows,
                              Stream s = nullptr);

// Into caller-owned outputs (benchmarks, poisoned-output tests); *_outputs allocates them.
AuxLossScoresFwd aux_loss_scores_fwd_outputs(const TensorMeta& logits, MapFormat fmt);
void aux_loss_scores_fwd_into(const DeviceTensor& logits, int64_t topk, ScoreFunction f,
                              MapFormat fmt, AuxLossScoresFwd& out, Stream s = nullptr);
void aux_loss_scores_bwd_into(const DeviceTensor& grad_scores, const DeviceTensor& saved_scores,
                              ScoreFunction f, DType logits_dtype, DeviceTensor& grad_logits,
                              Stream s = nullptr);
MoeAuxLossFwd moe_aux_loss_fwd_outputs(const TensorMeta& probs);
void moe_aux_loss_fwd_into(const DeviceTensor& probs, const DeviceTensor& tokens_per_expert,
                           const AuxLossParams& p, MoeAuxLossFwd& out, Stream s = nullptr);
void moe_aux_loss_bwd_into(const DeviceTensor& grad_aux_loss, const DeviceTensor& const_buf,
                           const DeviceTensor& tokens_per_expert, int64_t num_rows,
                           DeviceTensor& grad_probs, Stream s = nullptr);

}  // namespace moe::gpu
