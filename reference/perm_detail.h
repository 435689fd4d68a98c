// Private helpers of the permutation-family references (dispatch, sort_chunks, argsort). Included
// only by reference/*.cpp: it pulls in Eigen.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <cstring>
#include <vector>

#include "harness/core/params/dispatch.h"
#include "harness/core/tensor.h"

namespace moe::ref::detail {

using MatX = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// A rank-1 or rank-2 tensor as a [rows, cols] matrix of exact doubles (rank 1: one column).
inline MatX to_matrix(const Tensor& t) {
  const int64_t rows = t.rank() == 0 ? 1 : t.dim(0);
  const int64_t cols = rows == 0 ? 0 : t.numel() / rows;
  MatX m(rows, cols);
  for (int64_t i = 0; i < t.numel(); ++i) m.data()[i] = t.at(i);
  return m;
}

// Writes m into t element by element; set() rounds each value once (RNE) to t's dtype.
inline void store(Tensor& t, const MatX& m) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, m.data()[i]);
}

// Exact integer read of an index tensor (i32/i64/u8/bool), without a detour through double.
inline int64_t int_at(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::i32:
      return t.data<int32_t>()[i];
    case DType::i64:
      return t.data<int64_t>()[i];
    case DType::u8:
    case DType::boolean:
      return t.data<uint8_t>()[i];
    default:
      return static_cast<int64_t>(t.at(i));
  }
}

// dst[dr] = src[sr] for rank-1 (one element) or rank-2 (one row) tensors: a bitwise copy when the
// dtypes agree, one exact conversion otherwise (Rounding::none writes f64).
inline void copy_row(Tensor& dst, int64_t dr, const Tensor& src, int64_t sr) {
  const int64_t w = src.rank() == 1 ? 1 : src.row_stride();
  if (w == 0) return;
  if (dst.dtype() == src.dtype()) {
    const size_t bytes = static_cast<size_t>(w) * dtype_size(src.dtype());
    std::memcpy(dst.bytes() + dr * bytes, src.bytes() + sr * bytes, bytes);
    return;
  }
  for (int64_t h = 0; h < w; ++h) dst.set(dr * w + h, src.at(sr * w + h));
}

// Reads a [T,E] routing map and checks every value is 0 or 1 (data-dependent, SPEC §4.5).
inline std::vector<uint8_t> read_routing_map(const Tensor& map) {
  std::vector<uint8_t> m(static_cast<size_t>(map.numel()));
  for (int64_t i = 0; i < map.numel(); ++i) {
    const int64_t v = int_at(map, i);
    if (v != 0 && v != 1) throw_perm_fault(PermFault::routing_map_value, i, v);
    m[i] = static_cast<uint8_t>(v);
  }
  return m;
}

// Reads an integer index vector and checks it is a permutation of [0, n); fault names the op's
// parameter.
inline std::vector<int64_t> read_permutation(const Tensor& idx, PermFault fault) {
  const int64_t n = idx.numel();
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = int_at(idx, i);
    if (x < 0 || x >= n || seen[x]) throw_perm_fault(fault, i, x);
    seen[x] = 1;
    v[i] = x;
  }
  return v;
}

}  // namespace moe::ref::detail
