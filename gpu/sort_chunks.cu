// CUDA twin of reference/sort_chunks.cpp: sort_chunks_by_index (SPEC §7) and the map-driven row
// permutation shared with the EP local permute. Kernel plan: see gpu/sort_chunks.cuh.
#include <cub/block/block_scan.cuh>

#include "gpu/perm_detail.cuh"
#include "gpu/sort_chunks.cuh"

namespace moe::gpu {

namespace {

using namespace detail;

constexpr int kThreads = 256;
// Split sizes are clamped here before the scan so absurd int64 entries cannot overflow the sum;
// any such entry fails the V <= N_rows check anyway (N_rows < 2^31).
constexpr long long kSplitClamp = 1LL << 40;

// One CTA: split_sizes checked and scanned (start, C+1 entries), sorted_indices checked to be a
// permutation (seen[c] = position of c, pre-filled with -1), then the output start of each chunk.
// *gate = 1 on any fault.
__global__ void __launch_bounds__(1024)
    chunk_meta_kernel(const void* split, int split_kind, const void* sorted, int sorted_kind,
                      long long C, long long N, long long* start, long long* out_start,
                      int32_t* seen, int32_t* gate, void* err) {
  using Scan = cub::BlockScan<long long, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ long long carry;
  __shared__ int s_bad;
  if (threadIdx.x == 0) {
    carry = 0;
    s_bad = 0;
  }
  __syncthreads();
  for (long long base = 0; base < C; base += 1024) {
    const long long c = base + threadIdx.x;
    long long v = c < C ? load_int(split, split_kind, c) : 0;
    if (v < 0) {
      fault(err, PermFault::split_size_negative, c, v);
      atomicOr(&s_bad, 1);
      v = 0;
    }
    v = min(v, kSplitClamp);
    long long ex, tot;
    Scan(tmp).ExclusiveSum(v, ex, tot);
    __syncthreads();
    if (c < C) start[c] = carry + ex;
    __syncthreads();
    if (threadIdx.x == 0) carry += tot;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    start[C] = carry;
    if (carry > N) {
      fault(err, PermFault::split_sum, carry, N);
      atomicOr(&s_bad, 1);
    }
  }
  for (long long j = threadIdx.x; j < C; j += blockDim.x) {
    const long long x = load_int(sorted, sorted_kind, j);
    if (x < 0 || x >= C || atomicCAS(seen + x, -1, static_cast<int32_t>(j)) != -1) {
      fault(err, PermFault::sorted_indices_perm, j, x);
      atomicOr(&s_bad, 1);
    }
  }
  __syncthreads();
  const bool bad = s_bad;
  __syncthreads();
  if (!bad) {
    // Output start of the chunk emitted j-th: the sizes of the chunks emitted before it.
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (long long base = 0; base < C; base += 1024) {
      const long long j = base + threadIdx.x;
      const long long c = j < C ? load_int(sorted, sorted_kind, j) : 0;
      const long long v = j < C ? start[c + 1] - start[c] : 0;
      long long ex, tot;
      Scan(tmp).ExclusiveSum(v, ex, tot);
      __syncthreads();
      if (j < C) out_start[c] = carry + ex;
      __syncthreads();
      if (threadIdx.x == 0) carry += tot;
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) *gate = bad;
}

// map[i] = dst(i): chunk by binary search over start, identity for i >= V (R1) and everywhere
// after a fault.
__global__ void chunk_map_kernel(const long long* start, const long long* out_start, long long C,
                                 long long N, const int32_t* gate, int32_t* map) {
  const bool bad = *gate;
  const long long V = start[C];
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < N;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long dst = i;
    if (!bad && i < V) {
      long long lo = 0, hi = C;  // first j with start[j] > i, minus one: the non-empty chunk
      while (lo < hi) {
        const long long mid = (lo + hi) / 2;
        if (start[mid] > i) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const long long c = lo - 1;
      dst = out_start[c] + (i - start[c]);
    }
    map[i] = static_cast<int32_t>(dst);
  }
}

// G threads per row (32 for wide rows, 1 for single elements).
template <int VB, int G>
__global__ void permute_rows_kernel(uint8_t* dst, const uint8_t* src, const int32_t* map,
                                    long long rows, long long row_bytes, bool scatter, int bad,
                                    void* err, const int32_t* gate) {
  if (gate && *gate) return;
  const int lane = threadIdx.x % G;
  const long long nvec = row_bytes / VB;
  for (long long i = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / G; i < rows;
       i += (static_cast<long long>(gridDim.x) * blockDim.x) / G) {
    const long long m = map[i];
    const bool ok = m >= 0 && m < rows;
    if (!ok) {
      if (lane == 0) fault(err, static_cast<PermFault>(bad), i, m);
      if (scatter) continue;  // gather: the row becomes zeros
    }
    uint8_t* d = dst + (scatter ? m : i) * row_bytes;
    const uint8_t* s = ok ? src + (scatter ? i : m) * row_bytes : nullptr;
    move_row<VB>(d, s, nvec, lane, G);
  }
}

__global__ void check_perm_kernel(const void* map, int kind, long long n, int bad, void* err,
                                  int32_t* gate, int32_t* seen) {
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long v = load_int(map, kind, i);
    if (v < 0 || v >= n || atomicCAS(seen + v, -1, static_cast<int32_t>(i)) != -1) {
      fault(err, static_cast<PermFault>(bad), i, v);
      atomicOr(gate, 1);
    }
  }
}

int64_t row_bytes_of(const DeviceTensor& t) {
  const int64_t w = t.rank() == 1 ? 1 : (t.dim(0) == 0 ? 0 : t.numel() / t.dim(0));
  return w * static_cast<int64_t>(dtype_size(t.dtype()));
}

}  // namespace

namespace detail {

void permute_rows(void* dst, const void* src, const int32_t* map, int64_t rows, int64_t row_bytes,
                  bool scatter, PermFault bad, void* err, const int32_t* gate, Stream s) {
  if (rows == 0 || row_bytes == 0) return;
  const int vb = vec_bytes(row_bytes, {dst, src});
  dispatch_vec(vb, [&](auto v) {
    constexpr int VB = decltype(v)::value;
    if (row_bytes / VB >= 8) {
      permute_rows_kernel<VB, 32><<<grid_for(rows, kThreads / 32), kThreads, 0, s>>>(
          static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), map, rows, row_bytes,
          scatter, static_cast<int>(bad), err, gate);
    } else {
      permute_rows_kernel<VB, 1><<<grid_for(rows, kThreads), kThreads, 0, s>>>(
          static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), map, rows, row_bytes,
          scatter, static_cast<int>(bad), err, gate);
    }
    check_launch("permute_rows_kernel");
  });
}

void check_permutation(const void* map, IntKind kind, int64_t n, PermFault bad, void* err,
                       int32_t* gate, int32_t* inv, Stream s) {
  if (n == 0) return;
  Scratch<int32_t> own(inv ? 0 : n, s);
  int32_t* seen = inv ? inv : own.get();
  MOE_CUDA_CHECK(cudaMemsetAsync(seen, 0xFF, static_cast<size_t>(n) * sizeof(int32_t), s));
  check_perm_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
      map, static_cast<int>(kind), n, static_cast<int>(bad), err, gate, seen);
  check_launch("check_perm_kernel");
}

void chunk_sort_map(const void* split_sizes, int split_kind, const void* sorted_indices,
                    int sorted_kind, int64_t C, int64_t num_rows, int32_t* map, void* err,
                    Stream s) {
  Scratch<long long> start(C + 1, s), out_start(C, s);
  Scratch<int32_t> seen(C, s), gate(1, s);
  seen.fill_bytes(0xFF);
  chunk_meta_kernel<<<1, 1024, 0, s>>>(split_sizes, split_kind, sorted_indices, sorted_kind, C,
                                       num_rows, start.get(), out_start.get(), seen.get(),
                                       gate.get(), err);
  check_launch("chunk_meta_kernel");
  if (num_rows == 0) return;
  chunk_map_kernel<<<grid_for(num_rows, kThreads), kThreads, 0, s>>>(start.get(), out_start.get(),
                                                                     C, num_rows, gate.get(), map);
  check_launch("chunk_map_kernel");
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

void sort_chunks_by_index_fwd_into(const DeviceTensor& x, const DeviceTensor& split_sizes,
                                   const DeviceTensor& sorted_indices, const DeviceTensor* probs,
                                   SortChunksFwd& out, void* err, Stream s) {
  const TensorMeta pm = probs ? probs->meta() : TensorMeta{};
  const SortChunksDims d = validate_sort_chunks_by_index(
      x.meta(), split_sizes.meta(), sorted_indices.meta(), probs ? &pm : nullptr);
  int32_t* map = out.row_id_map.data<int32_t>();
  detail::chunk_sort_map(split_sizes.data(), static_cast<int>(int_kind(split_sizes.dtype())),
                         sorted_indices.data(), static_cast<int>(int_kind(sorted_indices.dtype())),
                         d.C, d.N_rows, map, err, s);
  // The map is a bijection (the identity after a fault), so the scatters cannot collide.
  detail::permute_rows(out.sorted.data(), x.data(), map, d.N_rows, row_bytes_of(x), true,
                       PermFault::row_id_map_perm, nullptr, nullptr, s);
  if (probs) {
    detail::permute_rows(out.sorted_probs->data(), probs->data(), map, d.N_rows,
                         dtype_size(probs->dtype()), true, PermFault::row_id_map_perm, nullptr,
                         nullptr, s);
  }
}

SortChunksFwd sort_chunks_by_index_fwd(const DeviceTensor& x, const DeviceTensor& split_sizes,
                                       const DeviceTensor& sorted_indices,
                                       const DeviceTensor* probs, Stream s, const RunOptions& o) {
  const TensorMeta pm = probs ? probs->meta() : TensorMeta{};
  const SortChunksDims d = validate_sort_chunks_by_index(
      x.meta(), split_sizes.meta(), sorted_indices.meta(), probs ? &pm : nullptr);
  SortChunksFwd out;
  out.sorted = DeviceTensor(x.dtype(), x.shape());
  out.row_id_map = DeviceTensor(DType::i32, {d.N_rows});
  if (probs) out.sorted_probs = DeviceTensor(probs->dtype(), probs->shape());
  if (o.poison) {
    poison(out.sorted, s);
    poison(out.row_id_map, s);
    poison(out.sorted_probs, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    sort_chunks_by_index_fwd_into(x, split_sizes, sorted_indices, probs, out, err, s);
  });
  return out;
}

namespace {
void check_bwd_meta(const DeviceTensor& grad_sorted, const DeviceTensor* grad_sorted_probs,
                    const DeviceTensor& row_id_map) {
  if (grad_sorted.rank() != 2) {
    throw std::invalid_argument("grad_sorted: expected a 2-D tensor, got " +
                                grad_sorted.describe());
  }
  if (grad_sorted_probs && grad_sorted_probs->rank() != 1) {
    throw std::invalid_argument("grad_sorted_probs: expected a 1-D tensor, got " +
                                grad_sorted_probs->describe());
  }
  validate_sort_chunks_by_map(grad_sorted.meta(), row_id_map.meta());
  if (grad_sorted_probs) validate_sort_chunks_by_map(grad_sorted_probs->meta(), row_id_map.meta());
}
}  // namespace

void sort_chunks_by_index_bwd_into(const DeviceTensor& grad_sorted,
                                   const DeviceTensor* grad_sorted_probs,
                                   const DeviceTensor& row_id_map, SortChunksBwd& out, void* err,
                                   Stream s) {
  check_bwd_meta(grad_sorted, grad_sorted_probs, row_id_map);
  const int64_t N = row_id_map.dim(0);
  const int32_t* map = row_id_map.data<int32_t>();
  Scratch<int32_t> gate(1, s);
  gate.fill_bytes(0);
  detail::check_permutation(map, IntKind::i32, N, PermFault::row_id_map_perm, err, gate.get(),
                            nullptr, s);
  // A gather never races, so it needs no gate; out-of-range entries give zero rows.
  detail::permute_rows(out.grad_x.data(), grad_sorted.data(), map, N, row_bytes_of(grad_sorted),
                       false, PermFault::row_id_map_perm, err, nullptr, s);
  if (grad_sorted_probs) {
    detail::permute_rows(out.grad_probs->data(), grad_sorted_probs->data(), map, N,
                         dtype_size(grad_sorted_probs->dtype()), false, PermFault::row_id_map_perm,
                         err, nullptr, s);
  }
}

SortChunksBwd sort_chunks_by_index_bwd(const DeviceTensor& grad_sorted,
                                       const DeviceTensor* grad_sorted_probs,
                                       const DeviceTensor& row_id_map, Stream s,
                                       const RunOptions& o) {
  check_bwd_meta(grad_sorted, grad_sorted_probs, row_id_map);
  SortChunksBwd out;
  out.grad_x = DeviceTensor(grad_sorted.dtype(), grad_sorted.shape());
  if (grad_sorted_probs) {
    out.grad_probs = DeviceTensor(grad_sorted_probs->dtype(), grad_sorted_probs->shape());
  }
  if (o.poison) {
    poison(out.grad_x, s);
    poison(out.grad_probs, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    sort_chunks_by_index_bwd_into(grad_sorted, grad_sorted_probs, row_id_map, out, err, s);
  });
  return out;
}

DeviceTensor make_chunk_sort_map(const DeviceTensor& split_sizes,
                                 const DeviceTensor& sorted_indices, int64_t num_rows, Stream s,
                                 const RunOptions& o) {
  if (num_rows < 0) {
    throw std::invalid_argument("num_rows: must be >= 0, got " + std::to_string(num_rows));
  }
  validate_sort_chunks_by_index(TensorMeta{DType::f32, {num_rows, 0}}, split_sizes.meta(),
                                sorted_indices.meta(), nullptr);
  DeviceTensor map(DType::i32, {num_rows});
  if (o.poison) poison(map, s);
  with_validation(o.validate, s, [&](void* err) {
    detail::chunk_sort_map(split_sizes.data(), static_cast<int>(int_kind(split_sizes.dtype())),
                           sorted_indices.data(),
                           static_cast<int>(int_kind(sorted_indices.dtype())), split_sizes.dim(0),
                           num_rows, map.data<int32_t>(), err, s);
  });
  return map;
}

void sort_chunks_by_map_into(const DeviceTensor& y, const DeviceTensor& row_id_map, bool inverse,
                             DeviceTensor& out, void* err, Stream s) {
  validate_sort_chunks_by_map(y.meta(), row_id_map.meta(), true);
  const int64_t N = y.dim(0);
  const int32_t* map = row_id_map.data<int32_t>();
  Scratch<int32_t> gate(1, s);
  gate.fill_bytes(0);
  detail::check_permutation(map, IntKind::i32, N, PermFault::row_id_map_perm, err, gate.get(),
                            nullptr, s);
  // The scatter waits for the bijection check: a repeated target would be a racing write.
  detail::permute_rows(out.data(), y.data(), map, N, row_bytes_of(y), !inverse,
                       PermFault::row_id_map_perm, err, inverse ? nullptr : gate.get(), s);
}

DeviceTensor sort_chunks_by_map(const DeviceTensor& y, const DeviceTensor& row_id_map, bool inverse,
                                Stream s, const RunOptions& o) {
  validate_sort_chunks_by_map(y.meta(), row_id_map.meta(), true);
  DeviceTensor out(y.dtype(), y.shape());
  // A failed check leaves the scatter unwritten: start from zeros, not garbage.
  if (o.poison) {
    poison(out, s);
  } else if (!inverse) {
    out.fill_bytes(0, s);
  }
  with_validation(o.validate, s,
                  [&](void* err) { sort_chunks_by_map_into(y, row_id_map, inverse, out, err, s); });
  return out;
}

}  // namespace moe::gpu
