// CPU reference of topk_router (SPEC §1): fused score function, grouped top-k, expert bias,
// scaling; forward and backward. Twin: gpu/topk_router.cuh (same names, same argument order).
//
// Layouts (row-major): logits [T,E] in d; expert_bias [E]; probs [T,E] in d; routing_map [T,E]
// bool (bytemap) or [T,ceil(E/8)] u8 (bitmap_u8, LSB first); saved_scores [T,E] f32 always.
// Selection is computed in fp32 exactly as §1.2 prescribes, with the canonical tie rule
// (value desc, index asc); probs and gradients are computed in double from that selection.
#pragma once

#include <vector>

#include "harness/core/params/router.h"
#include "reference/common.h"

namespace moe::ref {

struct TopkRouterFwd {
  Tensor probs;         // [T,E] d
  Tensor routing_map;   // bytemap or bitmap_u8
  Tensor saved_scores;  // [T,E] f32 (f64 with Rounding::none)
};

TopkRouterFwd topk_router_fwd(const Tensor& logits, const Tensor* expert_bias,
                              const RouterParams& p, Rounding r = Rounding::to_dtype);

// The forward under a given selection (routing_map), used to compare an implementation's outputs
// on near-tie rows under its own selection (SPEC §1.4). Reference-only.
TopkRouterFwd topk_router_fwd_forced(const Tensor& logits, const Tensor* expert_bias,
                                     const RouterParams& p, const Tensor& routing_map,
                                     Rounding r = Rounding::to_dtype);

// grad_logits [T,E] in grad_probs' dtype (§1.3).
Tensor topk_router_bwd(const Tensor& grad_probs, const Tensor& routing_map,
                       const Tensor& saved_scores, const RouterParams& p,
                       Rounding r = Rounding::to_dtype);

// The fp32 selection of one row and its boundary margins (SPEC §1.4 near-tie rule).
struct RowSelection {
  std::vector<int> experts;  // canonical order (z desc, index asc)
  int next = -1;             // the (K+1)-th candidate, the one just outside; -1 when K = E
  double margin = 0;         // z_K - z_{K+1} among the candidates (inf when K = E)
  double group_margin = 0;   // g_k-th minus (g_k+1)-th group score (inf if ungrouped or g_k = G)
  double delta = 0;          // the near-tie bound delta of §1.4 for this row
};
// Selects for every row of logits (any float dtype, values taken as f32(x)).
std::vector<RowSelection> topk_router_select(const Tensor& logits, const Tensor* expert_bias,
                                             const RouterParams& p);

}  // namespace moe::ref
