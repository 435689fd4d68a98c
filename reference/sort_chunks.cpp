#include "reference/sort_chunks.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "reference/perm_detail.h"

namespace moe::ref {

Tensor make_chunk_sort_map(const Tensor& split_sizes, const Tensor& sorted_indices,
                           int64_t num_rows) {
  if (num_rows < 0) {
    throw std::invalid_argument("num_rows: must be >= 0, got " + std::to_string(num_rows));
  }
  // Host checks on shapes and dtypes, phrased as for the op itself (x stands in for [N_rows, 0]).
  validate_sort_chunks_by_index(TensorMeta{DType::f32, {num_rows, 0}}, split_sizes.meta(),
                                sorted_indices.meta(), nullptr);
  const int64_t C = split_sizes.numel();
  std::vector<int64_t> split(C), start(C);
  int64_t V = 0;
  for (int64_t c = 0; c < C; ++c) {
    split[c] = detail::int_at(split_sizes, c);
    if (split[c] < 0) throw_perm_fault(PermFault::split_size_negative, c, split[c]);
    start[c] = V;
    // Checked per step so a huge i64 entry cannot overflow the running sum.
    if (split[c] > num_rows - V) {
      int64_t total = V;
      for (int64_t c2 = c; c2 < C; ++c2) {
        const int64_t s = detail::int_at(split_sizes, c2);
        if (s < 0) throw_perm_fault(PermFault::split_size_negative, c2, s);
        total = s > INT64_MAX - total ? INT64_MAX : total + s;
      }
      throw_perm_fault(PermFault::split_sum, total, num_rows);
    }
    V += split[c];
  }
  const std::vector<int64_t> order =
      detail::read_permutation(sorted_indices, PermFault::sorted_indices_perm);
  // Output start of chunk c: the sizes of the chunks emitted before it.
  std::vector<int64_t> out_start(C);
  int64_t acc = 0;
  for (int64_t j = 0; j < C; ++j) {
    out_start[order[j]] = acc;
    acc += split[order[j]];
  }
  Tensor map(DType::i32, {num_rows});
  for (int64_t c = 0; c < C; ++c)
    for (int64_t o = 0; o < split[c]; ++o)
      map.set(start[c] + o, static_cast<double>(out_start[c] + o));
  // Padding rows map to themselves (R1, PR-A): before the fix they went to i - V.
  for (int64_t i = V; i < num_rows; ++i) map.set(i, static_cast<double>(i));
  return map;
}

Tensor sort_chunks_by_map(const Tensor& y, const Tensor& row_id_map, bool inverse, Rounding r) {
  // Pure data movement: any float dtype moves (f64 too), so the op's own checks decide on dtypes.
  validate_sort_chunks_by_map(y.meta(), row_id_map.meta(), true);
  const std::vector<int64_t> dst = detail::read_permutation(row_id_map, PermFault::row_id_map_perm);
  Tensor out(out_dtype(y.dtype(), r), y.shape());
  const int64_t n = y.dim(0);
  for (int64_t i = 0; i < n; ++i) {
    if (inverse) {
      detail::copy_row(out, i, y, dst[i]);
    } else {
      detail::copy_row(out, dst[i], y, i);
    }
  }
  return out;
}

SortChunksFwd sort_chunks_by_index_fwd(const Tensor& x, const Tensor& split_sizes,
                                       const Tensor& sorted_indices, const Tensor* probs,
                                       Rounding r) {
  const TensorMeta probs_meta = probs ? probs->meta() : TensorMeta{};
  const SortChunksDims d =
      validate_sort_chunks_by_index(x.meta(), split_sizes.meta(), sorted_indices.meta(),
                                    probs ? &probs_meta : nullptr, r == Rounding::none);
  SortChunksFwd out;
  out.row_id_map = make_chunk_sort_map(split_sizes, sorted_indices, d.N_rows);
  out.sorted = sort_chunks_by_map(x, out.row_id_map, false, r);
  if (probs) out.sorted_probs = sort_chunks_by_map(*probs, out.row_id_map, false, r);
  return out;
}

SortChunksBwd sort_chunks_by_index_bwd(const Tensor& grad_sorted, const Tensor* grad_sorted_probs,
                                       const Tensor& row_id_map, Rounding r) {
  if (grad_sorted.rank() != 2) {
    throw std::invalid_argument("grad_sorted: expected a 2-D tensor, got " +
                                grad_sorted.describe());
  }
  if (grad_sorted_probs && grad_sorted_probs->rank() != 1) {
    throw std::invalid_argument("grad_sorted_probs: expected a 1-D tensor, got " +
                                grad_sorted_probs->describe());
  }
  SortChunksBwd out;
  out.grad_x = sort_chunks_by_map(grad_sorted, row_id_map, true, r);
  if (grad_sorted_probs)
    out.grad_probs = sort_chunks_by_map(*grad_sorted_probs, row_id_map, true, r);
  return out;
}

}  // namespace moe::ref
