// CPU reference of aux_loss_scores (SPEC §2) and moe_aux_loss (SPEC §3), forward and backward.
// Twin: gpu/aux_loss.cuh.
//
// aux_loss_scores: logits [T,E] d -> scores [T,E] f32, routing_map (top-K of scores, canonical
// ties), saved_scores [T,E] f32. moe_aux_loss: probs [R,C] d, tokens_per_expert [C] i32/i64 ->
// aux_loss [] d, const_buf [2] f32 = {kappa, loss_f32}.
#pragma once

#include <vector>

#include "harness/core/params/router.h"
#include "reference/common.h"

namespace moe::ref {

struct AuxLossScoresFwd {
  Tensor scores;        // [T,E] f32
  Tensor routing_map;   // [T,E] bool or [T,ceil(E/8)] u8
  Tensor saved_scores;  // [T,E] f32
};
AuxLossScoresFwd aux_loss_scores_fwd(const Tensor& logits, int64_t topk, ScoreFunction f,
                                     MapFormat fmt, Rounding r = Rounding::to_dtype);
// Row t's fp32 scores that the routing map selects on (SPEC §1.4 "Selection is defined on fp32
// values"): score_fn.h's functions, row_sum_f32's order, + eps and one division (softmax:
// softmax_f32), as the CUDA kernel computes them. raw and den: the sigmoid / sqrtsoftplus scores
// before that division and their normaliser (softmax: raw empty, den 1).
struct AuxSelection {
  std::vector<float> scores, raw;
  float den = 1.0f;
};
AuxSelection aux_selection_scores(const Tensor& logits, int64_t t, ScoreFunction f);
// grad_scores [T,E] f32 -> grad_logits [T,E] in logits_dtype.
Tensor aux_loss_scores_bwd(const Tensor& grad_scores, const Tensor& saved_scores, ScoreFunction f,
                           DType logits_dtype, Rounding r = Rounding::to_dtype);

struct MoeAuxLossFwd {
  Tensor aux_loss;   // [] in probs' dtype
  Tensor const_buf;  // [2] f32: kappa, loss_f32
};
MoeAuxLossFwd moe_aux_loss_fwd(const Tensor& probs, const Tensor& tokens_per_expert,
                               const AuxLossParams& p, Rounding r = Rounding::to_dtype);
// grad_aux_loss [] -> grad_probs [R,C] in grad_aux_loss' dtype.
Tensor moe_aux_loss_bwd(const Tensor& grad_aux_loss, const Tensor& const_buf,
                        const Tensor& tokens_per_expert, int64_t num_rows,
                        Rounding r = Rounding::to_dtype);

}  // namespace moe::ref
