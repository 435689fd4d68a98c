// CUDA twin of reference/ep.h: the expert-parallel pieces (SPEC §9): ragged_a2a_params, the
// ragged all-to-all through a Communicator (gpu/comm.cuh: P in-process ranks on one GPU now,
// NCCL later), and the local permute/unpermute around the expert FFN. Same names and argument
// order as moe::ref (Communicator in place of SimComm, DeviceTensor in place of Tensor), a
// trailing Stream (and RunOptions). No CUDA types here.
//
// Math and layouts: see reference/ep.h. Kernels (gpu/ep.cu):
//   ragged_a2a_params   one CTA: A checked (>= 0), the four [P] arrays of one rank.
//   ragged_all_to_all   the communicator's exchange; the forward copies output_init first. The
//                       backward is itself an exchange: every rank learns where its chunks
//                       landed (all_to_all_i32 of its output/input offsets), then sends the
//                       cotangent rows back into zeroed buffers. It first checks the original
//                       arrays exactly as the forward does, so faults read the same.
//   local permute       one CTA builds split/order from A (and local_group_sizes, and the R3
//                       receive-overflow check), then the chunk sort of gpu/sort_chunks.cuh;
//                       unpermute and both backward passes use the one map (R14).
#pragma once

#include <vector>

#include "gpu/comm.cuh"
#include "gpu/dispatch.cuh"  // RunOptions
#include "gpu/runtime.cuh"
#include "harness/core/params/ep.h"

namespace moe::gpu {

// Faults of the EP helpers (codes disjoint from PermFault and A2AFault).
enum class EpFault : int32_t {
  counts_negative = 201,  // a = rank i, b = e << 32 | (value & 0xffffffff)
  offsets_range = 202,    // a = rank s, b = 0: a row offset exceeds int32
  recv_overflow = 203,    // a = rows received (sum of split sizes), b = R (R3)
};

// The four §9.2 arrays of one rank, [P] i32 each.
struct RaggedA2AParams {
  DeviceTensor input_offsets, send_sizes, output_offsets, recv_sizes;
};

RaggedA2AParams ragged_a2a_params(const DeviceTensor& all_shards_tokens_per_expert,
                                  int64_t shard_id, int64_t num_ep, A2ADirection direction,
                                  Stream s = nullptr, const RunOptions& o = {});

// result[d] = output_init[d] with the received rows written (§9.3); params[r] are rank r's arrays
// (int32). comm must have params.size() ranks.
std::vector<DeviceTensor> ragged_all_to_all_fwd(Communicator& comm,
                                                const std::vector<DeviceTensor>& operand,
                                                const std::vector<DeviceTensor>& output_init,
                                                const std::vector<RaggedA2AParams>& params,
                                                Stream s = nullptr, const RunOptions& o = {});

// grad_operand[s] [operand_rows, H] in grad_result's dtype (the adjoint exchange; unsent rows 0).
// Operand ranges sent to two ranks (overlapping input ranges) are an error here: the adjoint
// exchange would write one row twice.
std::vector<DeviceTensor> ragged_all_to_all_bwd(Communicator& comm,
                                                const std::vector<DeviceTensor>& grad_result,
                                                const std::vector<RaggedA2AParams>& params,
                                                int64_t operand_rows, Stream s = nullptr,
                                                const RunOptions& o = {});

struct LocalPermuteFwd {
  DeviceTensor sorted_x;           // [R,H] x_recv's dtype
  DeviceTensor local_group_sizes;  // [L] i32
  DeviceTensor row_id_map;         // [R] i32
};

LocalPermuteFwd local_permute_after_a2a_fwd(const DeviceTensor& x_recv,
                                            const DeviceTensor& all_shards_tokens_per_expert,
                                            int64_t shard_id, int64_t num_ep, Stream s = nullptr,
                                            const RunOptions& o = {});
DeviceTensor local_permute_after_a2a_bwd(const DeviceTensor& grad_sorted_x,
                                         const DeviceTensor& row_id_map, Stream s = nullptr,
                                         const RunOptions& o = {});
DeviceTensor local_unpermute_before_a2a_fwd(const DeviceTensor& expert_outputs,
                                            const DeviceTensor& row_id_map, Stream s = nullptr,
                                            const RunOptions& o = {});
DeviceTensor local_unpermute_before_a2a_bwd(const DeviceTensor& grad_out,
                                            const DeviceTensor& row_id_map, Stream s = nullptr,
                                            const RunOptions& o = {});

// The chunk split of rank s's receive buffer and its expert-major order, [P*L] i32 each (R14).
struct LocalChunks {
  DeviceTensor split_sizes, sorted_chunk_indices;
};
LocalChunks local_chunks(const DeviceTensor& all_shards_tokens_per_expert, int64_t shard_id,
                         int64_t num_ep, Stream s = nullptr, const RunOptions& o = {});

}  // namespace moe::gpu
