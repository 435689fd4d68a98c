#include "harness/core/params/dispatch.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace moe {

namespace {

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

std::string str(int64_t v) {
  return std::to_string(v);
}

// Row indices and counts are stored as int32 (row_id_map, tokens_per_expert, sorted_indices).
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();

void check_i32(const TensorMeta& t, const std::string& what) {
  if (t.dtype != DType::i32) {
    bad(what + ": expected dtype int32, got " + std::string(dtype_name(t.dtype)));
  }
}

// A routing map is a [T,E] 0/1 tensor; bool is the schema's dtype, integer maps are accepted.
void check_map_dtype(const TensorMeta& t, const std::string& what) {
  const DType d = t.dtype;
  if (d == DType::boolean || d == DType::u8 || d == DType::i32 || d == DType::i64) return;
  bad(what + ": unsupported dtype " + std::string(dtype_name(d)) +
      " (expected bool, uint8, int32 or int64 with values in {0,1})");
}

void check_rows(int64_t rows, const std::string& what) {
  if (rows > kMaxRows) {
    bad(what + ": " + str(rows) + " rows exceed the int32 row-index range " + str(kMaxRows));
  }
}

// row_id_map [T,2E+1] i32 with an odd column count; returns E.
int64_t check_row_id_map(const TensorMeta& m) {
  require_rank(m, 2, "row_id_map");
  check_i32(m, "row_id_map");
  const int64_t cols = m.dim(1);
  if (cols < 1 || cols % 2 != 1) {
    bad("row_id_map: the column count must be 2E+1 (odd), got " + m.describe());
  }
  return (cols - 1) / 2;
}

void check_pad_offsets(const TensorMeta* pad_offsets, int64_t E) {
  if (!pad_offsets) return;
  check_i32(*pad_offsets, "pad_offsets");
  require_shape(*pad_offsets, {E}, "pad_offsets");
}

}  // namespace

int64_t dispatch_out_rows(int64_t num_out_tokens, int64_t num_experts, int64_t align_size) {
  if (num_out_tokens < 0) bad("num_out_tokens: must be >= 0, got " + str(num_out_tokens));
  if (align_size < 0) bad("align_size: must be >= 0 (0 = no padding), got " + str(align_size));
  if (num_experts < 0) bad("num_experts: must be >= 0, got " + str(num_experts));
  check_rows(num_out_tokens, "num_out_tokens");
  if (align_size == 0) return num_out_tokens;
  // N_out and E(a-1) are each < 2^31 here or rejected, so the sum cannot overflow int64.
  if (align_size > kMaxRows || (num_experts > 0 && align_size - 1 > kMaxRows / num_experts)) {
    bad("align_size: E*(align_size-1) with num_experts=" + str(num_experts) +
        ", align_size=" + str(align_size) + " exceeds the int32 row-index range");
  }
  const int64_t rows = (num_out_tokens + num_experts * (align_size - 1)) / align_size * align_size;
  check_rows(rows, "align_size");
  return rows;
}

DispatchDims validate_token_dispatch(const TensorMeta& x, const TensorMeta& routing_map,
                                     const TensorMeta* probs, const TokenDispatchParams& p,
                                     bool allow_f64) {
  // Parameters first (R8): a bad num_out_tokens fails before shapes are even looked at.
  if (p.num_out_tokens < 0) bad("num_out_tokens: must be >= 0, got " + str(p.num_out_tokens));
  if (p.align_size < 0) bad("align_size: must be >= 0 (0 = no padding), got " + str(p.align_size));
  if (p.drop_overflow && p.align_size > 0) {
    bad("drop_overflow: not supported together with align_size=" + str(p.align_size) +
        " (SPEC §4.5)");
  }
  require_rank(x, 2, "x");
  require_float_dtype(x, "x", allow_f64);
  require_rank(routing_map, 2, "routing_map");
  check_map_dtype(routing_map, "routing_map");
  DispatchDims d;
  d.T = x.dim(0);
  d.H = x.dim(1);
  d.E = routing_map.dim(1);
  if (routing_map.dim(0) != d.T) {
    bad("routing_map: T=" + str(routing_map.dim(0)) + " differs from x's T=" + str(d.T) + " (x " +
        x.describe() + ", routing_map " + routing_map.describe() + ")");
  }
  if (d.E < 1) bad("routing_map: needs at least one expert column, got " + routing_map.describe());
  check_rows(d.T, "x");
  if (2 * d.E + 1 > kMaxRows) bad("routing_map: E=" + str(d.E) + " is too large");
  if (probs) {
    require_float_dtype(*probs, "probs", allow_f64);
    require_shape(*probs, {d.T, d.E}, "probs");
  }
  d.R_out = dispatch_out_rows(p.num_out_tokens, d.E, p.align_size);
  return d;
}

DispatchDims validate_token_dispatch_bwd(const TensorMeta& grad_permuted,
                                         const TensorMeta* grad_permuted_probs,
                                         const TensorMeta& row_id_map,
                                         const TensorMeta* pad_offsets, bool allow_f64) {
  require_rank(grad_permuted, 2, "grad_permuted");
  require_float_dtype(grad_permuted, "grad_permuted", allow_f64);
  DispatchDims d;
  d.E = check_row_id_map(row_id_map);
  d.T = row_id_map.dim(0);
  d.R_out = grad_permuted.dim(0);
  d.H = grad_permuted.dim(1);
  check_rows(d.R_out, "grad_permuted");
  if (grad_permuted_probs) {
    require_float_dtype(*grad_permuted_probs, "grad_permuted_probs", allow_f64);
    require_shape(*grad_permuted_probs, {d.R_out}, "grad_permuted_probs");
  }
  check_pad_offsets(pad_offsets, d.E);
  return d;
}

CombineDims validate_token_combine(const TensorMeta& permuted, const TensorMeta& row_id_map,
                                   const TensorMeta* merging_probs, const TensorMeta* pad_offsets,
                                   bool allow_f64) {
  require_rank(permuted, 2, "permuted");
  require_float_dtype(permuted, "permuted", allow_f64);
  CombineDims d;
  d.E = check_row_id_map(row_id_map);
  d.T = row_id_map.dim(0);
  d.R_in = permuted.dim(0);
  d.H = permuted.dim(1);
  check_rows(d.R_in, "permuted");
  if (merging_probs) {
    require_float_dtype(*merging_probs, "merging_probs", allow_f64);
    require_shape(*merging_probs, {d.T, d.E}, "merging_probs");
  }
  check_pad_offsets(pad_offsets, d.E);
  return d;
}

CombineDims validate_token_combine_bwd(const TensorMeta& grad_combined, const TensorMeta& permuted,
                                       const TensorMeta& row_id_map,
                                       const TensorMeta* merging_probs,
                                       const TensorMeta* pad_offsets, bool allow_f64) {
  const CombineDims d =
      validate_token_combine(permuted, row_id_map, merging_probs, pad_offsets, allow_f64);
  require_float_dtype(grad_combined, "grad_combined", allow_f64);
  require_shape(grad_combined, {d.T, d.H}, "grad_combined");
  return d;
}

SortChunksDims validate_sort_chunks_by_index(const TensorMeta& x, const TensorMeta& split_sizes,
                                             const TensorMeta& sorted_indices,
                                             const TensorMeta* probs, bool allow_f64) {
  require_rank(x, 2, "x");
  require_float_dtype(x, "x", allow_f64);
  require_rank(split_sizes, 1, "split_sizes");
  require_index_dtype(split_sizes, "split_sizes");
  require_rank(sorted_indices, 1, "sorted_indices");
  require_index_dtype(sorted_indices, "sorted_indices");
  SortChunksDims d{x.dim(0), x.dim(1), split_sizes.dim(0)};
  if (sorted_indices.dim(0) != d.C) {
    bad("sorted_indices: length " + str(sorted_indices.dim(0)) +
        " differs from split_sizes' length " + str(d.C));
  }
  check_rows(d.N_rows, "x");
  if (probs) {
    require_float_dtype(*probs, "probs", true);  // §7: probs may be in any float dtype
    require_shape(*probs, {d.N_rows}, "probs");
  }
  return d;
}

void validate_sort_chunks_by_map(const TensorMeta& y, const TensorMeta& row_id_map,
                                 bool allow_f64) {
  if (y.rank() != 1 && y.rank() != 2) bad("y: expected a 1-D or 2-D tensor, got " + y.describe());
  require_float_dtype(y, "y", allow_f64);
  require_rank(row_id_map, 1, "row_id_map");
  check_i32(row_id_map, "row_id_map");
  if (row_id_map.dim(0) != y.dim(0)) {
    bad("row_id_map: length " + str(row_id_map.dim(0)) + " differs from y's row count " +
        str(y.dim(0)));
  }
}

void validate_routing_map_to_selected_experts(const TensorMeta& sparse_probs,
                                              const TensorMeta& routing_map, int64_t topk,
                                              bool allow_f64) {
  require_rank(sparse_probs, 2, "sparse_probs");
  require_float_dtype(sparse_probs, "sparse_probs", allow_f64);
  require_rank(routing_map, 2, "routing_map");
  check_map_dtype(routing_map, "routing_map");
  if (routing_map.shape != sparse_probs.shape) {
    bad("routing_map: shape " + shape_str(routing_map.shape) + " differs from sparse_probs' " +
        shape_str(sparse_probs.shape));
  }
  const int64_t E = sparse_probs.dim(1);
  if (topk < 1 || topk > E) {
    bad("topk: must be in [1, num_experts=" + str(E) + "], got " + str(topk));
  }
}

void validate_routing_map_to_selected_experts_bwd(const TensorMeta& grad_weights,
                                                  const TensorMeta& selected_experts,
                                                  int64_t num_experts, bool allow_f64) {
  require_rank(grad_weights, 2, "grad_weights");
  require_float_dtype(grad_weights, "grad_weights", allow_f64);
  require_rank(selected_experts, 2, "selected_experts");
  require_index_dtype(selected_experts, "selected_experts");
  if (selected_experts.shape != grad_weights.shape) {
    bad("selected_experts: shape " + shape_str(selected_experts.shape) +
        " differs from grad_weights' " + shape_str(grad_weights.shape));
  }
  const int64_t K = grad_weights.dim(1);
  if (num_experts < K || num_experts < 1) {
    bad("num_experts: must be >= topk=" + str(K) + " and >= 1, got " + str(num_experts));
  }
}

int64_t argsort_padding_size(int64_t num_experts, int64_t align_size) {
  if (align_size < 0) bad("align_size: must be >= 0 (0 = no padding), got " + str(align_size));
  if (num_experts < 1) bad("num_experts: must be >= 1, got " + str(num_experts));
  if (align_size == 0) return 0;
  if (align_size - 1 > kMaxRows / num_experts) {
    bad("align_size: E*(align_size-1) with num_experts=" + str(num_experts) +
        ", align_size=" + str(align_size) + " exceeds the int32 row-index range");
  }
  return num_experts * (align_size - 1);
}

ArgsortPermParams validate_argsort_token_dispatch(const TensorMeta& x,
                                                  const TensorMeta& selected_experts,
                                                  const ArgsortDispatchParams& p, bool allow_f64) {
  if (p.num_experts < 1) bad("num_experts: must be >= 1, got " + str(p.num_experts));
  if (p.align_size < 0) bad("align_size: must be >= 0 (0 = no padding), got " + str(p.align_size));
  if (p.roll_to_expert_id) {
    const int64_t r = *p.roll_to_expert_id;
    if (r < 0 || r >= p.num_experts) {
      bad("roll_to_expert_id: must be in [0, num_experts=" + str(p.num_experts) + "), got " +
          str(r));
    }
    // R9: TE's overflow placeholders land inside a rolled group; refuse the combination.
    if (r != 0 && p.align_size > 0) {
      bad("roll_to_expert_id: " + str(r) +
          " is not supported together with align_size=" + str(p.align_size) + " (SPEC R9)");
    }
  }
  require_rank(x, 2, "x");
  require_float_dtype(x, "x", allow_f64);
  require_rank(selected_experts, 2, "selected_experts");
  require_index_dtype(selected_experts, "selected_experts");
  if (selected_experts.dim(0) != x.dim(0)) {
    bad("selected_experts: T=" + str(selected_experts.dim(0)) +
        " differs from x's T=" + str(x.dim(0)));
  }
  if (p.topk != selected_experts.dim(1)) {
    bad("topk: " + str(p.topk) + " differs from selected_experts' column count " +
        str(selected_experts.dim(1)));
  }
  if (p.topk < 1 || p.topk > p.num_experts) {
    bad("topk: must be in [1, num_experts=" + str(p.num_experts) + "], got " + str(p.topk));
  }
  ArgsortPermParams st;
  st.topk = p.topk;
  const int64_t T = x.dim(0);
  if (T > kMaxRows / p.topk) bad("x: T*topk=" + str(T) + "*" + str(p.topk) + " is too large");
  st.num_real_tokens = T * p.topk;
  st.padding_size = argsort_padding_size(p.num_experts, p.align_size);
  check_rows(st.num_real_tokens + st.padding_size, "align_size");
  return st;
}

namespace {
void check_perm_state(const ArgsortPermParams& p) {
  if (p.topk < 1) bad("topk: must be >= 1, got " + str(p.topk));
  if (p.num_real_tokens < 0 || p.num_real_tokens % p.topk != 0) {
    bad("num_real_tokens: must be a non-negative multiple of topk=" + str(p.topk) + ", got " +
        str(p.num_real_tokens));
  }
  if (p.padding_size < 0) bad("padding_size: must be >= 0, got " + str(p.padding_size));
  check_rows(p.num_real_tokens + p.padding_size, "padding_size");
}

void check_sorted_rows(const TensorMeta& rows, const TensorMeta& sorted_indices,
                       const ArgsortPermParams& p, const std::string& what) {
  const int64_t n = p.num_real_tokens + p.padding_size;
  if (rows.dim(0) != n) {
    bad(what + ": expected num_real_tokens+padding_size=" + str(n) + " rows, got " +
        rows.describe());
  }
  require_rank(sorted_indices, 1, "sorted_indices");
  require_index_dtype(sorted_indices, "sorted_indices");
  require_shape(sorted_indices, {n}, "sorted_indices");
}
}  // namespace

void validate_argsort_token_dispatch_bwd(const TensorMeta& grad_sorted_x,
                                         const TensorMeta& sorted_indices,
                                         const ArgsortPermParams& p, bool allow_f64) {
  check_perm_state(p);
  require_rank(grad_sorted_x, 2, "grad_sorted_x");
  require_float_dtype(grad_sorted_x, "grad_sorted_x", allow_f64);
  check_sorted_rows(grad_sorted_x, sorted_indices, p, "grad_sorted_x");
}

void validate_argsort_token_combine(const TensorMeta& expert_outputs,
                                    const TensorMeta& sorted_indices, const TensorMeta& weights,
                                    const ArgsortPermParams& p, bool allow_f64) {
  check_perm_state(p);
  require_rank(expert_outputs, 2, "expert_outputs");
  require_float_dtype(expert_outputs, "expert_outputs", allow_f64);
  check_sorted_rows(expert_outputs, sorted_indices, p, "expert_outputs");
  require_float_dtype(weights, "weights", allow_f64);
  require_shape(weights, {p.num_real_tokens / p.topk, p.topk}, "weights");
}

void validate_argsort_token_combine_bwd(const TensorMeta& grad_combined,
                                        const TensorMeta& expert_outputs,
                                        const TensorMeta& sorted_indices, const TensorMeta& weights,
                                        const ArgsortPermParams& p, bool allow_f64) {
  validate_argsort_token_combine(expert_outputs, sorted_indices, weights, p, allow_f64);
  require_float_dtype(grad_combined, "grad_combined", allow_f64);
  require_shape(grad_combined, {p.num_real_tokens / p.topk, expert_outputs.dim(1)},
                "grad_combined");
}

void throw_perm_fault(PermFault f, int64_t a, int64_t b) {
  switch (f) {
    case PermFault::none:
      break;
    case PermFault::routing_map_value:
      bad("routing_map: value " + str(b) + " at flat index " + str(a) + " is not 0 or 1");
    case PermFault::capacity:
      bad("num_out_tokens: " + str(b) + " is smaller than the routed count sum(routing_map)=" +
          str(a) + " (SPEC R11; use drop_overflow to drop the overflow)");
    case PermFault::row_id_map_entry:
      bad("row_id_map: invalid entry " + str(b) + " at flat index " + str(a));
    case PermFault::source_row:
      bad("row_id_map: source row " + str(a) + " is out of range for permuted with R_in=" + str(b) +
          " rows");
    case PermFault::split_size_negative:
      bad("split_sizes: entry " + str(a) + " is negative (" + str(b) + ")");
    case PermFault::split_sum:
      bad("split_sizes: sum " + str(a) + " exceeds the row count N_rows=" + str(b));
    case PermFault::sorted_indices_perm:
      bad("sorted_indices: not a permutation of [0, C): value " + str(b) + " at position " +
          str(a));
    case PermFault::routing_map_row_count:
      bad("routing_map: row " + str(a) + " has " + str(b) + " set entries, expected exactly topk");
    case PermFault::expert_id_range:
      bad("selected_experts: expert id " + str(b) + " at flat index " + str(a) +
          " is outside [0, num_experts)");
    case PermFault::expert_id_duplicate:
      bad("selected_experts: expert id " + str(b) + " appears twice in row " + str(a));
    case PermFault::argsort_indices_perm:
      bad("sorted_indices: not a permutation of [0, num_real_tokens+padding_size): value " +
          str(b) + " at position " + str(a));
    case PermFault::row_id_map_perm:
      bad("row_id_map: not a permutation of the rows: value " + str(b) + " at row " + str(a));
  }
  bad("throw_perm_fault: unknown fault code " + str(static_cast<int32_t>(f)));
}

}  // namespace moe
