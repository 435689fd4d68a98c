#include "harness/ops/registry.h"

#ifdef MOE_WITH_CUDA
#include "gpu/runtime.cuh"
#endif

namespace moe::ops {

// One line per op record (harness/ops/<op>.cpp), in SPEC order.
const OpInfo& topk_router_op();
const OpInfo& aux_loss_scores_op();
const OpInfo& moe_aux_loss_op();

const std::vector<const OpInfo*>& all_ops() {
  static const std::vector<const OpInfo*> ops = {
      &topk_router_op(),
      &aux_loss_scores_op(),
      &moe_aux_loss_op(),
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

std::string gpu_description() {
#ifdef MOE_WITH_CUDA
  return gpu::device_description();
#else
  return "this build has no CUDA backend";
#endif
}

}  // namespace moe::ops
