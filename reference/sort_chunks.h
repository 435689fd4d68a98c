// CPU reference of sort_chunks_by_index (SPEC §7), the chunk sort of the EP local permute,
// forward and backward, plus the map-driven gather/scatter it is built from.
// Twin: gpu/sort_chunks.cuh (same names, same argument order, DeviceTensor, trailing Stream).
//
// Rows of x are cut into C chunks of split_sizes[c] rows (V = sum split_sizes <= N_rows, rows
// i >= V are padding). The chunks are re-emitted in the order sorted_indices[0], [1], ...:
//   P_c    = sum_{c'<c} split_c'                 (start of chunk c in x)
//   c(i)   = the chunk with P_c <= i < P_c + split_c (empty chunks are skipped), o = i - P_c
//   j(c)   = the position with sorted_indices[j] = c
//   dst(i) = sum_{j'<j(c(i))} split[sorted_indices[j']] + o   for i < V
//   dst(i) = i                                                for i >= V (R1, PR-A)
// dst is a bijection on [0, N_rows).
//
// Tensors (row-major):
//   x              [N_rows,H]  d (f64 in finite-difference mode)
//   split_sizes    [C]         i32 or i64, every entry >= 0
//   sorted_indices [C]         i32 or i64, a permutation of [0,C)
//   probs          [N_rows]    any float dtype (optional)
//   sorted         [N_rows,H]  d:  sorted[dst(i)] = x[i]
//   row_id_map     [N_rows]    i32: row_id_map[i] = dst(i)
//   sorted_probs   [N_rows]    probs' dtype: sorted_probs[dst(i)] = probs[i]
// Backward: grad_x[i] = ct_sorted[dst(i)], grad_probs[i] = ct_sorted_probs[dst(i)] (a gather with
// the same map). split_sizes and sorted_indices get no gradient.
//
// Pure data movement: values are copied bitwise (converted only in Rounding::none mode, where
// float outputs are f64). Data-dependent errors (negative split size, V > N_rows, a
// non-permutation) throw std::invalid_argument through throw_perm_fault.
#pragma once

#include <optional>

#include "harness/core/params/dispatch.h"
#include "reference/common.h"

namespace moe::ref {

struct SortChunksFwd {
  Tensor sorted;                       // [N_rows,H] d
  Tensor row_id_map;                   // [N_rows] i32
  std::optional<Tensor> sorted_probs;  // [N_rows] in probs' dtype, iff probs
};

SortChunksFwd sort_chunks_by_index_fwd(const Tensor& x, const Tensor& split_sizes,
                                       const Tensor& sorted_indices, const Tensor* probs,
                                       Rounding r = Rounding::to_dtype);

struct SortChunksBwd {
  Tensor grad_x;                     // [N_rows,H] in grad_sorted's dtype
  std::optional<Tensor> grad_probs;  // [N_rows] in grad_sorted_probs' dtype, iff given
};

SortChunksBwd sort_chunks_by_index_bwd(const Tensor& grad_sorted, const Tensor* grad_sorted_probs,
                                       const Tensor& row_id_map, Rounding r = Rounding::to_dtype);

// The map alone: row_id_map [num_rows] i32 with row_id_map[i] = dst(i) (validates like the op).
Tensor make_chunk_sort_map(const Tensor& split_sizes, const Tensor& sorted_indices,
                           int64_t num_rows);

// y [N] or [N,H]; row_id_map [N] i32, a bijection (checked).
//   inverse = false: out[row_id_map[i]] = y[i]  (the forward scatter)
//   inverse = true:  out[i] = y[row_id_map[i]]  (the exact inverse, tail rows included; also the
//                                                backward of the forward)
// out has y's shape and dtype (f64 with Rounding::none).
Tensor sort_chunks_by_map(const Tensor& y, const Tensor& row_id_map, bool inverse,
                          Rounding r = Rounding::to_dtype);

}  // namespace moe::ref
