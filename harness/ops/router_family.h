// Bindings shared by the router-family records (topk_router, aux_loss_scores, moe_aux_loss):
// the CUDA runners live in router_family_gpu.cpp, built only with the CUDA backend.
#pragma once

#include "harness/core/params/router.h"
#include "harness/ops/registry.h"

namespace moe::ops {

#ifdef MOE_WITH_CUDA
TensorMap topk_router_gpu(const Case& c, const TensorMap& in);
TensorMap aux_loss_scores_gpu(const Case& c, const TensorMap& in);
TensorMap moe_aux_loss_gpu(const Case& c, const TensorMap& in);
OpInfo::Bench topk_router_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench aux_loss_scores_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench moe_aux_loss_gpu_bench(const Case& c, const TensorMap& in);
#endif

// Router parameters of a Case (keys: topk, score_function, use_pre_softmax, num_groups,
// group_topk, scaling_factor, routing_map_format).
RouterParams router_params(const Case& c);

// Logits [T,E] in c.dtype for the case's regime, from (c.seed, name).
Tensor make_logits(const Case& c, int64_t T, int64_t E, int64_t K, const std::string& name);

// Rows with a logit beyond this magnitude are not perturbed by finite differences: SPEC's step
// 1e-3 * max(1, |x|) would exceed the curvature scale of exp/sigmoid there.
inline constexpr double kFdMaxLogit = 10.0;
TensorMap fd_mask_large_rows(const Tensor& logits);

// Rows where two routing maps (same format) differ.
std::vector<int64_t> routing_rows_differ(const Tensor& a, const Tensor& b);

}  // namespace moe::ops
