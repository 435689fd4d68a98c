// Parameters and host-side validation of the permutation family (SPEC §4, §5, §7, §8):
// token_dispatch, token_combine, sort_chunks_by_index, routing_map_to_selected_experts,
// argsort_token_dispatch and argsort_token_combine. Shared by the CPU reference and the CUDA
// wrappers, so both reject the same inputs with the same messages (C++17: .cu files include it).
//
// Host-checkable problems (ranks, shapes, dtypes, parameter ranges) are checked here from
// TensorMeta before any work. Data-dependent problems (bad map values, capacity overflow,
// non-permutations) are found by the reference on the host and by the CUDA kernels through the
// device error flag; both report them through throw_perm_fault(), so the messages agree.
#pragma once

#include <cstdint>
#include <optional>

#include "harness/core/tensor.h"

namespace moe {

// ---------------------------------------------------------------------------------------------
// §4 token_dispatch / §5 token_combine (kernel backend)

struct TokenDispatchParams {
  int64_t num_out_tokens = 0;  // N_out >= 0; N_out = 0 only with an all-zero routing map
  int64_t align_size = 0;      // a: 0 = no padding, a >= 1 pads every non-empty expert to a
  bool drop_overflow = false;  // [DECISION] TE PR #3347 semantics; error together with a > 0
};

// Rows of `permuted`: R_out = N_out without padding, floor((N_out + E(a-1))/a)*a with a >= 1
// (the worst case of SPEC §4.1). Throws naming num_out_tokens / align_size / num_experts on a
// negative value or an int32 overflow of the row index. Never divides by a = 0 (R8).
int64_t dispatch_out_rows(int64_t num_out_tokens, int64_t num_experts, int64_t align_size);

// Aligned count: ceil(c/a)*a for a >= 1, c for a = 0; an empty expert stays 0 (SPEC §4.1).
inline int64_t dispatch_aligned_count(int64_t count, int64_t align_size) {
  return align_size > 0 ? (count + align_size - 1) / align_size * align_size : count;
}

struct DispatchDims {
  int64_t T = 0, H = 0, E = 0;
  int64_t R_out = 0;  // rows of permuted / permuted_probs
};

// §4.5 host checks: x [T,H] float; routing_map [T,E] bool/u8/i32/i64 (values are checked by the
// op); probs [T,E] float when given; num_out_tokens >= 0 (checked first, before any shape);
// align_size >= 0; drop_overflow only with align_size = 0. allow_f64: finite-difference mode.
DispatchDims validate_token_dispatch(const TensorMeta& x, const TensorMeta& routing_map,
                                     const TensorMeta* probs, const TokenDispatchParams& p,
                                     bool allow_f64 = false);

// Backward inputs of §4.4: grad_permuted [R_out,H] float, grad_permuted_probs [R_out] float (iff
// the forward had probs), row_id_map [T,2E+1] i32, pad_offsets [E] i32 when padding.
DispatchDims validate_token_dispatch_bwd(const TensorMeta& grad_permuted,
                                         const TensorMeta* grad_permuted_probs,
                                         const TensorMeta& row_id_map,
                                         const TensorMeta* pad_offsets, bool allow_f64 = false);

struct CombineDims {
  int64_t T = 0, E = 0, H = 0;
  int64_t R_in = 0;  // rows of permuted (and of grad permuted: never recomputed, R6)
};

// §5 host checks: permuted [R_in,H] float; row_id_map [T,2E+1] i32 with an odd column count;
// merging_probs [T,E] float; pad_offsets [E] i32.
CombineDims validate_token_combine(const TensorMeta& permuted, const TensorMeta& row_id_map,
                                   const TensorMeta* merging_probs, const TensorMeta* pad_offsets,
                                   bool allow_f64 = false);
// As above, plus grad_combined [T,H] float.
CombineDims validate_token_combine_bwd(const TensorMeta& grad_combined, const TensorMeta& permuted,
                                       const TensorMeta& row_id_map,
                                       const TensorMeta* merging_probs,
                                       const TensorMeta* pad_offsets, bool allow_f64 = false);

// ---------------------------------------------------------------------------------------------
// §7 sort_chunks_by_index

struct SortChunksDims {
  int64_t N_rows = 0, H = 0, C = 0;
};
// x [N_rows,H] float; split_sizes [C] i32/i64; sorted_indices [C] i32/i64; probs [N_rows] float.
SortChunksDims validate_sort_chunks_by_index(const TensorMeta& x, const TensorMeta& split_sizes,
                                             const TensorMeta& sorted_indices,
                                             const TensorMeta* probs, bool allow_f64 = false);
// y [N] or [N,H] float; row_id_map [N] i32.
void validate_sort_chunks_by_map(const TensorMeta& y, const TensorMeta& row_id_map,
                                 bool allow_f64 = false);

// ---------------------------------------------------------------------------------------------
// §8 argsort backend

// §8.1: sparse_probs [T,E] float, routing_map [T,E] bool/u8/i32/i64, 1 <= topk <= E.
void validate_routing_map_to_selected_experts(const TensorMeta& sparse_probs,
                                              const TensorMeta& routing_map, int64_t topk,
                                              bool allow_f64 = false);
// Backward: grad_weights [T,K] float, selected_experts [T,K] i32, num_experts >= K.
void validate_routing_map_to_selected_experts_bwd(const TensorMeta& grad_weights,
                                                  const TensorMeta& selected_experts,
                                                  int64_t num_experts, bool allow_f64 = false);

struct ArgsortDispatchParams {
  int64_t num_experts = 0;                   // E >= 1
  int64_t topk = 1;                          // K, must equal selected_experts' column count
  int64_t align_size = 0;                    // a >= 0; 0 = off
  std::optional<int64_t> roll_to_expert_id;  // r in [0,E); r != 0 with a > 0 is an error (R9)
};

// The "perm state" of §8.2/§8.3: the static ints saved by argsort dispatch and consumed by its
// backward and by argsort_token_combine.
struct ArgsortPermParams {
  int64_t topk = 1;             // K
  int64_t num_real_tokens = 0;  // N = T*K
  int64_t padding_size = 0;     // P_pad = E(a-1) if a > 0, else 0
};

// P_pad of §8.2 (throws naming align_size / num_experts on a negative value or overflow).
int64_t argsort_padding_size(int64_t num_experts, int64_t align_size);

// §8.2 host checks; returns the perm state. x [T,H] float; selected_experts [T,K] i32/i64.
ArgsortPermParams validate_argsort_token_dispatch(const TensorMeta& x,
                                                  const TensorMeta& selected_experts,
                                                  const ArgsortDispatchParams& p,
                                                  bool allow_f64 = false);
// §8.2 backward: grad_sorted_x [N+P_pad,H] float, sorted_indices [N+P_pad] i32/i64.
void validate_argsort_token_dispatch_bwd(const TensorMeta& grad_sorted_x,
                                         const TensorMeta& sorted_indices,
                                         const ArgsortPermParams& p, bool allow_f64 = false);
// §8.3: expert_outputs [N+P_pad,H] float, sorted_indices [N+P_pad] i32/i64, weights [N/K,K]
// float; K >= 1, N >= 0 with N % K == 0, P_pad >= 0.
void validate_argsort_token_combine(const TensorMeta& expert_outputs,
                                    const TensorMeta& sorted_indices, const TensorMeta& weights,
                                    const ArgsortPermParams& p, bool allow_f64 = false);
// As above, plus grad_combined [N/K,H] float.
void validate_argsort_token_combine_bwd(const TensorMeta& grad_combined,
                                        const TensorMeta& expert_outputs,
                                        const TensorMeta& sorted_indices, const TensorMeta& weights,
                                        const ArgsortPermParams& p, bool allow_f64 = false);

// ---------------------------------------------------------------------------------------------
// Data-dependent faults (SPEC §0 error policy 2). CUDA kernels raise the code with the two values
// through gpu::raise_error; the host wrapper and the reference both call throw_perm_fault, which
// throws std::invalid_argument naming the parameter and the offending value(s).
enum class PermFault : int32_t {
  none = 0,
  routing_map_value = 1,      // a = flat index into routing_map, b = value (not 0 or 1)
  capacity = 2,               // a = routed count sum(routing_map), b = num_out_tokens
  row_id_map_entry = 3,       // a = flat index into row_id_map, b = value
  source_row = 4,             // a = source row of permuted, b = R_in
  split_size_negative = 5,    // a = chunk, b = split size
  split_sum = 6,              // a = V = sum(split_sizes), b = N_rows
  sorted_indices_perm = 7,    // a = position in sorted_indices, b = value (sort_chunks)
  routing_map_row_count = 8,  // a = token, b = set entries (not topk)
  expert_id_range = 9,        // a = flat index into selected_experts, b = value
  expert_id_duplicate = 10,   // a = token, b = repeated expert id
  argsort_indices_perm = 11,  // a = position in sorted_indices, b = value (argsort combine/bwd)
  row_id_map_perm = 12,       // a = row, b = value (sort_chunks_by_map: not a bijection)
};
[[noreturn]] void throw_perm_fault(PermFault f, int64_t a, int64_t b);

}  // namespace moe
