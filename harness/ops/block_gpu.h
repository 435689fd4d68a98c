// CUDA binding of the moe_block record (SPEC §11): moe_block_gpu uploads the inputs, runs
// gpu::moe_block_fwd and gpu::moe_block_bwd with every output and intermediate poisoned first and
// the device checks read back, and returns output.* / grad.* under the reference's keys. The
// benchmark keeps the inputs and one forward's state on the device: fwd() launches the forward,
// bwd() the backward on the saved state; neither synchronises beyond what the ops themselves do
// (the grouped GEMMs read their group sizes back).
#pragma once

#ifdef MOE_WITH_CUDA

#include <vector>

#include "harness/ops/registry.h"

namespace moe::gpu {
class Communicator;
}

namespace moe::ops {

// The communicator moe_block_gpu runs the block over. Null (the default): an in-process one of
// the case's ep_size, every shard on this GPU. `moe-harness check --ep N` under the launcher sets
// an NCCL communicator (one EP rank per process); a case whose ep_size is not its size, or whose
// dp_size is not 1, then fails with the block's std::invalid_argument naming the parameter.
void set_block_communicator(gpu::Communicator* comm);
gpu::Communicator* block_communicator();

TensorMap moe_block_gpu(const Case& c, const TensorMap& in);
OpInfo::Bench moe_block_gpu_bench(const Case& c, const TensorMap& in);
// Mixtral-like (16384 tokens, H 4096, M 14336, E 8, K 2, softmax) and DeepSeek-like (8192 tokens,
// H 7168, M 2048, E 256, K 8, sigmoid with expert bias, 8 groups, group_topk 4), bf16, P = D = 1.
std::vector<Case> moe_block_gpu_bench_cases();

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
