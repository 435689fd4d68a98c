// CUDA twin of reference/sort_chunks.h: sort_chunks_by_index (SPEC §7), the chunk sort of the EP
// local permute, forward and backward, plus the map-driven gather/scatter it is built from.
// Same names and argument order as moe::ref, DeviceTensor in place of Tensor, a trailing Stream
// (and RunOptions). No CUDA types here.
//
// Math and layouts: see reference/sort_chunks.h (dst(i) for i < V, dst(i) = i for the padding rows
// i >= V (R1), row_id_map [N_rows] i32).
//
// Kernels (gpu/sort_chunks.cu): one CTA checks split_sizes (>= 0, V <= N_rows) and sorted_indices
// (a permutation, through an integer compare-and-swap table) and scans the chunk starts and the
// output starts; one thread per row then finds its chunk by binary search and writes dst(i);
// the rows move in one pass (a warp per row, 16-byte vectors), scattered along dst, which is a
// bijection. The backward and sort_chunks_by_map(inverse) gather through the map after checking
// it is a permutation (row_id_map_perm); a failed check closes a gate so no scatter races.
#pragma once

#include <optional>

#include "gpu/dispatch.cuh"  // RunOptions
#include "gpu/runtime.cuh"
#include "harness/core/params/dispatch.h"

namespace moe::gpu {

struct SortChunksFwd {
  DeviceTensor sorted;                       // [N_rows,H] d
  DeviceTensor row_id_map;                   // [N_rows] i32
  std::optional<DeviceTensor> sorted_probs;  // [N_rows] in probs' dtype, iff probs
};

SortChunksFwd sort_chunks_by_index_fwd(const DeviceTensor& x, const DeviceTensor& split_sizes,
                                       const DeviceTensor& sorted_indices,
                                       const DeviceTensor* probs, Stream s = nullptr,
                                       const RunOptions& o = {});
// Launch-only form into outputs of a previous call (benchmarks); err may be null.
void sort_chunks_by_index_fwd_into(const DeviceTensor& x, const DeviceTensor& split_sizes,
                                   const DeviceTensor& sorted_indices, const DeviceTensor* probs,
                                   SortChunksFwd& out, void* err, Stream s);

struct SortChunksBwd {
  DeviceTensor grad_x;                     // [N_rows,H] in grad_sorted's dtype
  std::optional<DeviceTensor> grad_probs;  // [N_rows] in grad_sorted_probs' dtype, iff given
};

SortChunksBwd sort_chunks_by_index_bwd(const DeviceTensor& grad_sorted,
                                       const DeviceTensor* grad_sorted_probs,
                                       const DeviceTensor& row_id_map, Stream s = nullptr,
                                       const RunOptions& o = {});
void sort_chunks_by_index_bwd_into(const DeviceTensor& grad_sorted,
                                   const DeviceTensor* grad_sorted_probs,
                                   const DeviceTensor& row_id_map, SortChunksBwd& out, void* err,
                                   Stream s);

// The map alone: [num_rows] i32 with row_id_map[i] = dst(i).
DeviceTensor make_chunk_sort_map(const DeviceTensor& split_sizes,
                                 const DeviceTensor& sorted_indices, int64_t num_rows,
                                 Stream s = nullptr, const RunOptions& o = {});

// y [N] or [N,H]; row_id_map [N] i32, a bijection (checked).
//   inverse = false: out[row_id_map[i]] = y[i];  inverse = true: out[i] = y[row_id_map[i]].
DeviceTensor sort_chunks_by_map(const DeviceTensor& y, const DeviceTensor& row_id_map, bool inverse,
                                Stream s = nullptr, const RunOptions& o = {});
void sort_chunks_by_map_into(const DeviceTensor& y, const DeviceTensor& row_id_map, bool inverse,
                             DeviceTensor& out, void* err, Stream s);

namespace detail {
// The chunk-sort map of raw device arrays (split_sizes / sorted_indices of int kind 1 = i32,
// 2 = i64, C entries each) into map [num_rows] (int32). On a fault the map is the identity (so no
// later scatter can race) and the fault goes to err.
void chunk_sort_map(const void* split_sizes, int split_kind, const void* sorted_indices,
                    int sorted_kind, int64_t C, int64_t num_rows, int32_t* map, void* err,
                    Stream s);
}  // namespace detail

}  // namespace moe::gpu
