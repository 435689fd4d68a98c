// Parameters, host-side validation and buffer sizing of the expert-parallel pieces (SPEC §9),
// shared by the CPU reference and the CUDA wrappers so both reject the same inputs with the same
// messages.
//
// Notation: P = num_ep (EP ranks), E experts, L = E/P local experts per rank (rank j owns experts
// [jL, (j+1)L)), A = all_shards_tokens_per_expert [P,E] (row i = rank i's dispatch group sizes,
// aligned when align_size > 0), Snd[i][j] = sum_l A[i, jL+l] = rows rank i sends to rank j.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "harness/core/tensor.h"

namespace moe {

// §9.2: forward = dispatch direction (token rows to the expert owners), reverse = back.
enum class A2ADirection : uint8_t { forward, reverse };
std::string_view a2a_direction_name(A2ADirection d);
A2ADirection parse_a2a_direction(std::string_view s);  // throws naming direction
A2ADirection opposite(A2ADirection d);

// A [P,E] integer (i32 or i64), E % P == 0, every entry >= 0 (data-dependent, checked by the
// reference), shard_id in [0, P). Returns L = E/P.
int64_t validate_ep_counts(const TensorMeta& all_shards_tokens_per_expert, int64_t num_ep);
void validate_shard_id(int64_t shard_id, int64_t num_ep);

// §9.3 host checks, per rank r: operand[r] [R_in,H] and output_init[r] [R_out,H] with one float
// dtype and one shape across ranks (SPMD), the four arrays [P] integer. allow_f64: the
// reference's finite-difference mode.
void validate_ragged_all_to_all(const std::vector<TensorMeta>& operand,
                                const std::vector<TensorMeta>& output_init,
                                const std::vector<TensorMeta>& input_offsets,
                                const std::vector<TensorMeta>& send_sizes,
                                const std::vector<TensorMeta>& output_offsets,
                                const std::vector<TensorMeta>& recv_sizes, int64_t num_ep,
                                bool allow_f64 = false);

// The data-dependent §9.3 preconditions on the arrays of every rank (host copies, [P] each):
// sizes >= 0, offsets >= 0, recv_d[s] == send_s[d], every source range inside [0, operand_rows),
// sum_s recv_d[s] <= output_rows (the R3 overflow), every destination range inside
// [0, output_rows) and no two destination ranges on one rank overlapping. Throws
// std::invalid_argument naming the array, the ranks and the values.
void check_ragged_a2a_arrays(const std::vector<std::vector<int64_t>>& input_offsets,
                             const std::vector<std::vector<int64_t>>& send_sizes,
                             const std::vector<std::vector<int64_t>>& output_offsets,
                             const std::vector<std::vector<int64_t>>& recv_sizes,
                             int64_t operand_rows, int64_t output_rows);

// §9.4 host checks. x_recv [R,H] float; A as above; shard_id in [0,P).
void validate_local_permute_after_a2a(const TensorMeta& x_recv,
                                      const TensorMeta& all_shards_tokens_per_expert,
                                      int64_t shard_id, int64_t num_ep, bool allow_f64 = false);
// expert_outputs [R,H] float, row_id_map [R] i32.
void validate_local_unpermute_before_a2a(const TensorMeta& expert_outputs,
                                         const TensorMeta& row_id_map, bool allow_f64 = false);

// §9.5 buffer sizing. All throw std::invalid_argument naming the parameter on a bad value
// (B % (P*D) != 0, non-positive sizes, a < 0, E % P != 0).
struct EpShape {
  int64_t batch = 0, seq = 0, topk = 1, num_ep = 1, dp = 1, num_experts = 1, align_size = 0;
};
void validate_ep_shape(const EpShape& s);
// N_s = (B/(P*D))*S*K, the real rows per (EP, DP) shard.
int64_t shard_rows(const EpShape& s);
// R_pre = N_s + E*(a-1) when a > 0, else N_s: the argsort dispatch buffer, and the zero buffer
// the reverse A2A writes into.
int64_t pre_a2a_rows(const EpShape& s);
// R = (B/D)*S*K + (a > 0 ? E*(a-1) : 0): the worst-case receive rows per EP rank (R3 fix).
int64_t recv_rows(const EpShape& s);
inline int64_t recv_rows(int64_t B, int64_t S, int64_t K, int64_t P, int64_t D, int64_t E,
                         int64_t a) {
  return recv_rows(EpShape{B, S, K, P, D, E, a});
}

}  // namespace moe
