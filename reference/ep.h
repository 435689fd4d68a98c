// CPU reference of the expert-parallel pieces (SPEC §9): ragged_a2a_params, the ragged
// all-to-all collective over P ranks simulated in one process, and the local permute/unpermute
// around the expert FFN. Twin: gpu/ep.cuh (same names and argument order; its communicator holds
// one device buffer per rank in-process, later NCCL).
//
// Notation: P = num_ep ranks, E experts, L = E/P (rank j owns experts [jL, (j+1)L)),
// A = all_shards_tokens_per_expert [P,E] int (row i = rank i's dispatch group sizes, aligned when
// align_size > 0; identical on every rank), Snd[i][j] = sum_{l<L} A[i, jL+l] (rows i sends to j).
//
// ragged_a2a_params (§9.2), per rank s, every array [P] i32:
//                     forward                  reverse
//   send_sizes[j]     Snd[s][j]                Snd[j][s]
//   input_offsets[j]  sum_{j'<j} send[j']      sum_{j'<j} send[j']
//   recv_sizes[j]     Snd[j][s]                Snd[s][j]
//   output_offsets[j] sum_{i<s} Snd[i][j]      sum_{i<s} Snd[j][i]
// output_offsets is sender-side: the row of rank j's buffer where rank s's chunk lands.
//
// ragged_all_to_all (§9.3). Rank d holds operand X_d [R_in,H] and an output buffer O_d [R_out,H]
// with initial contents; after the call, for every source s
//   O_d[out_off_s[d] : +send_s[d]) = X_s[in_off_s[d] : +send_s[d])
// and unwritten rows keep their initial values. Every rank has the same shapes and dtype (SPMD).
// Backward (general adjoint): grad X_s[in_off_s[d] : +send_s[d]) = ct_O_d[out_off_s[d] :
// +send_s[d]), operand rows never sent get 0, the cotangent of the initial buffer is dropped.
// Preconditions (std::invalid_argument): recv_d[s] == send_s[d], sizes and offsets >= 0, every
// range in bounds, sum_s recv_d[s] <= R_out (never writes out of bounds: the R3 overflow is an
// error), no two destination ranges on a rank overlap.
//
// local_permute_after_a2a (§9.4), rank s: split[i*L+l] = A[i, sL+l] (the source-major receive
// layout), sorted_chunk_indices[l*P+i] = i*L+l (to expert-major), then
//   sorted_x          = sort_chunks_by_index(x_recv, split, sorted_chunk_indices)  [R,H]
//   local_group_sizes = sum_i A[i, sL+l]                                          [L] i32
//   row_id_map        = the chunk-sort map dst [R] i32 (identity past sum split)
// local_unpermute_before_a2a(y, row_id_map): out[i] = y[dst(i)], the exact inverse on all R rows.
// Backward of each is the other one with the same map (one map, R14). sum split > R is an error
// (R3).
//
// All of §9 is data movement: values are copied bitwise (Rounding::none writes f64).
#pragma once

#include <cstdint>
#include <vector>

#include "harness/core/params/ep.h"
#include "reference/common.h"

namespace moe::ref {

// P ranks simulated in one process. A collective takes one value per rank (index = rank) and
// returns one value per rank, as an SPMD program would see it on each rank.
class SimComm {
 public:
  explicit SimComm(int64_t num_ranks);
  int64_t size() const { return size_; }

 private:
  int64_t size_;
};

// Rank r contributes x[r] (same shape and dtype everywhere); every rank receives the stack
// [P, ...shape] (the EP all-gather of group sizes that builds A).
std::vector<Tensor> all_gather(const SimComm& comm, const std::vector<Tensor>& x);

// The four §9.2 arrays of one rank, [P] i32 each.
struct RaggedA2AParams {
  Tensor input_offsets, send_sizes, output_offsets, recv_sizes;
};

RaggedA2AParams ragged_a2a_params(const Tensor& all_shards_tokens_per_expert, int64_t shard_id,
                                  int64_t num_ep, A2ADirection direction);

// result[d] = output_init[d] with the received rows written (§9.3). params[r] are rank r's arrays.
std::vector<Tensor> ragged_all_to_all_fwd(const SimComm& comm, const std::vector<Tensor>& operand,
                                          const std::vector<Tensor>& output_init,
                                          const std::vector<RaggedA2AParams>& params,
                                          Rounding r = Rounding::to_dtype);

// grad_operand[s] [operand_rows, H] in grad_result's dtype (general adjoint, unsent rows 0).
std::vector<Tensor> ragged_all_to_all_bwd(const SimComm& comm,
                                          const std::vector<Tensor>& grad_result,
                                          const std::vector<RaggedA2AParams>& params,
                                          int64_t operand_rows, Rounding r = Rounding::to_dtype);

struct LocalPermuteFwd {
  Tensor sorted_x;           // [R,H] x_recv's dtype
  Tensor local_group_sizes;  // [L] i32
  Tensor row_id_map;         // [R] i32, the chunk-sort map dst
};

LocalPermuteFwd local_permute_after_a2a_fwd(const Tensor& x_recv,
                                            const Tensor& all_shards_tokens_per_expert,
                                            int64_t shard_id, int64_t num_ep,
                                            Rounding r = Rounding::to_dtype);
// grad_x_recv[i] = grad_sorted_x[dst(i)].
Tensor local_permute_after_a2a_bwd(const Tensor& grad_sorted_x, const Tensor& row_id_map,
                                   Rounding r = Rounding::to_dtype);

// out[i] = expert_outputs[dst(i)].
Tensor local_unpermute_before_a2a_fwd(const Tensor& expert_outputs, const Tensor& row_id_map,
                                      Rounding r = Rounding::to_dtype);
// grad_expert_outputs[dst(i)] = grad_out[i].
Tensor local_unpermute_before_a2a_bwd(const Tensor& grad_out, const Tensor& row_id_map,
                                      Rounding r = Rounding::to_dtype);

// The chunk split of rank s's receive buffer and its expert-major order (§9.4), [P*L] i32 each;
// exposed so tests can rebuild TE's two-map form (R14).
struct LocalChunks {
  Tensor split_sizes, sorted_chunk_indices;
};
LocalChunks local_chunks(const Tensor& all_shards_tokens_per_expert, int64_t shard_id,
                         int64_t num_ep);

}  // namespace moe::ref
