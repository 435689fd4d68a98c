#include "harness/ops/registry.h"

#ifdef MOE_WITH_CUDA
#include "gpu/runtime.cuh"
#endif

namespace moe::ops {

// One line per op record (harness/ops/<op>.cpp), in SPEC order.
const OpInfo& topk_router_op();
const OpInfo& aux_loss_scores_op();
const OpInfo& moe_aux_loss_op();
const OpInfo& token_dispatch_op();
const OpInfo& token_combine_op();
const OpInfo& sort_chunks_by_index_op();
const OpInfo& routing_map_to_selected_experts_op();
const OpInfo& argsort_token_dispatch_op();
const OpInfo& argsort_token_combine_op();
const OpInfo& ragged_a2a_params_op();
const OpInfo& ragged_all_to_all_op();
const OpInfo& local_permute_after_a2a_op();
const OpInfo& local_unpermute_before_a2a_op();
const OpInfo& grouped_gemm_op();
const OpInfo& swiglu_expert_ffn_op();
const OpInfo& moe_block_op();

const std::vector<const OpInfo*>& all_ops() {
  static const std::vector<const OpInfo*> ops = {
      &topk_router_op(),
      &aux_loss_scores_op(),
      &moe_aux_loss_op(),
      &token_dispatch_op(),
      &token_combine_op(),
      &sort_chunks_by_index_op(),
      &routing_map_to_selected_experts_op(),
      &argsort_token_dispatch_op(),
      &argsort_token_combine_op(),
      &ragged_a2a_params_op(),
      &ragged_all_to_all_op(),
      &local_permute_after_a2a_op(),
      &local_unpermute_before_a2a_op(),
      &grouped_gemm_op(),
      &swiglu_expert_ffn_op(),
      &moe_block_op(),
  };
  return ops;
}

const OpInfo* find_op(std::string_view name) {
  for (const OpInfo* op : all_ops())
    if (op->name == name) return op;
  return nullptr;
}

bool gpu_available() {
#ifdef MOE_WITH_CUDA
  return gpu::device_count() > 0;
#else
  return false;
#endif
}

std::string gpu_context_error() {
#ifdef MOE_WITH_CUDA
  return gpu::context_error();
#else
  return {};
#endif
}

std::string gpu_description() {
#ifdef MOE_WITH_CUDA
  return gpu::device_description();
#else
  return "this build has no CUDA backend";
#endif
}

}  // namespace moe::ops
