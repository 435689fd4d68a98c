// In-process communicator (gpu/comm.cuh): P simulated ranks on one GPU. A ragged all-to-all is
// two kernels: one CTA checks every rank's arrays (SPEC §9.3 preconditions, in the order of
// check_ragged_a2a_arrays) and builds the prefix of the P*P chunk sizes; then one gather kernel
// moves every row of every chunk (a warp per row, 16-byte vectors where the rows allow). A fault
// closes a device gate the copy kernel reads, so a bad call writes nothing.
#include <stdexcept>
#include <string>

#include "gpu/comm.cuh"
#include "gpu/perm_detail.cuh"

namespace moe::gpu {

namespace {

using namespace detail;

constexpr int kMax = InProcessCommunicator::kMaxRanks;
constexpr int kThreads = 256;

struct A2ATable {
  int P;
  const uint8_t* send[kMax];
  uint8_t* recv[kMax];
  const int32_t* in_off[kMax];
  const int32_t* send_sz[kMax];
  const int32_t* out_off[kMax];
  const int32_t* recv_sz[kMax];
  long long send_rows[kMax];
  long long recv_rows[kMax];
};

__device__ __forceinline__ long long pair(long long x, long long y) {
  return (x << 20) | y;
}
__device__ __forceinline__ long long two(long long v1, long long v2) {
  return (v1 << 32) | (v2 & 0xffffffffLL);
}

__device__ __forceinline__ void a2a_fault(void* err, A2AFault f, long long a, long long b,
                                          int* s_bad) {
  atomicOr(s_bad, 1);
  if (err) raise_error(err, static_cast<int32_t>(f), a, b);
}

// One CTA. prefix[q] (q = s*P + d, P*P+1 entries) = rows of all chunks before chunk (s,d);
// *gate = 1 when any precondition fails (then prefix is not written).
__global__ void __launch_bounds__(1024)
    a2a_check_kernel(const __grid_constant__ A2ATable tb, long long* prefix, int32_t* gate,
                     void* err) {
  __shared__ int s_bad;
  const int P = tb.P, tid = threadIdx.x;
  if (tid == 0) s_bad = 0;
  __syncthreads();
  // 1. Signs of every entry.
  for (int q = tid; q < P * P; q += blockDim.x) {
    const int r = q / P, j = q % P;
    const long long v[4] = {tb.send_sz[r][j], tb.recv_sz[r][j], tb.in_off[r][j], tb.out_off[r][j]};
    for (int kind = 0; kind < 4; ++kind) {
      if (v[kind] < 0) {
        a2a_fault(err, A2AFault::negative, (static_cast<long long>(kind) << 40) | pair(r, j),
                  v[kind], &s_bad);
        break;
      }
    }
  }
  __syncthreads();
  const bool bad1 = s_bad;  // read by every thread before anyone can write again
  __syncthreads();
  // 2. Receivers agree with senders; source ranges inside the send buffers.
  for (int q = tid; q < P * P && !bad1; q += blockDim.x) {
    const int s = q / P, d = q % P;
    const long long send = tb.send_sz[s][d], recv = tb.recv_sz[d][s], lo = tb.in_off[s][d];
    if (recv != send) {
      a2a_fault(err, A2AFault::recv_mismatch, pair(d, s), two(recv, send), &s_bad);
    } else if (lo + send > tb.send_rows[s]) {
      a2a_fault(err, A2AFault::input_range, pair(s, d), two(lo, lo + send), &s_bad);
    }
  }
  __syncthreads();
  const bool bad2 = s_bad;
  __syncthreads();
  // 3. Per receiver: the total fits (R3), every destination range is inside, none overlap.
  for (int d = tid; d < P && !bad2; d += blockDim.x) {
    long long total = 0;
    for (int s = 0; s < P; ++s) total += tb.recv_sz[d][s];
    if (total > tb.recv_rows[d]) {
      a2a_fault(err, A2AFault::recv_total, d, total, &s_bad);
      continue;
    }
    bool ok = true;
    for (int s = 0; s < P && ok; ++s) {
      const long long lo = tb.out_off[s][d], hi = lo + tb.send_sz[s][d];
      if (hi > tb.recv_rows[d]) {
        a2a_fault(err, A2AFault::output_range, pair(s, d), two(lo, hi), &s_bad);
        ok = false;
      }
    }
    for (int s1 = 0; s1 < P && ok; ++s1) {
      const long long lo1 = tb.out_off[s1][d], hi1 = lo1 + tb.send_sz[s1][d];
      for (int s2 = s1 + 1; s2 < P && ok; ++s2) {
        const long long lo2 = tb.out_off[s2][d], hi2 = lo2 + tb.send_sz[s2][d];
        if (hi1 > lo1 && hi2 > lo2 && lo1 < hi2 && lo2 < hi1) {
          a2a_fault(err, A2AFault::overlap, d, two(s1, s2), &s_bad);
          ok = false;
        }
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    *gate = s_bad;
    if (!s_bad) {
      long long acc = 0;
      for (int q = 0; q < P * P; ++q) {
        prefix[q] = acc;
        acc += tb.send_sz[q / P][q % P];
      }
      prefix[P * P] = acc;
    }
  }
}

// Every row of every chunk: virtual row v -> chunk q by binary search over the prefix (kept in
// shared memory), then a warp moves the row.
template <int VB>
__global__ void __launch_bounds__(kThreads)
    a2a_copy_kernel(const __grid_constant__ A2ATable tb, const long long* prefix,
                    const int32_t* gate, long long row_bytes) {
  __shared__ long long s_prefix[kMax * kMax + 1];
  if (*gate) return;
  const int P = tb.P, n = P * P;
  for (int q = threadIdx.x; q <= n; q += blockDim.x) s_prefix[q] = prefix[q];
  __syncthreads();
  const long long total = s_prefix[n];
  const int lane = threadIdx.x & 31;
  const long long nvec = row_bytes / VB;
  for (long long v = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       v < total; v += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    int lo = 0, hi = n;  // first q with prefix[q] > v, minus one
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (s_prefix[mid] > v) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const int q = lo - 1, s = q / P, d = q % P;
    const long long k = v - s_prefix[q];
    const uint8_t* src = tb.send[s] + (tb.in_off[s][d] + k) * row_bytes;
    uint8_t* dst = tb.recv[d] + (tb.out_off[s][d] + k) * row_bytes;
    move_row<VB>(dst, src, nvec, lane, 32);
  }
}

struct I32Table {
  int P;
  const int32_t* send[kMax];
  int32_t* recv[kMax];
};

__global__ void a2a_i32_kernel(const __grid_constant__ I32Table tb, long long count) {
  const long long n = static_cast<long long>(tb.P) * tb.P * count;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / (tb.P * count), rem = i % (tb.P * count);
    const long long j = rem / count, c = rem % count;
    tb.recv[r][j * count + c] = tb.send[j][r * count + c];
  }
}

void check_rank_list(const std::vector<int>& ranks, int P) {
  if (static_cast<int>(ranks.size()) != P) {
    throw std::invalid_argument("ranks: an in-process collective takes all " + std::to_string(P) +
                                " ranks, got " + std::to_string(ranks.size()));
  }
  for (int i = 0; i < P; ++i) {
    if (ranks[i] != i) {
      throw std::invalid_argument("ranks: entry " + std::to_string(i) + " is rank " +
                                  std::to_string(ranks[i]) + " (expected ascending 0.." +
                                  std::to_string(P - 1) + ")");
    }
  }
}

std::string str(int64_t v) {
  return std::to_string(v);
}

}  // namespace

void throw_if_a2a_fault(const DeviceError& e, int64_t send_rows, int64_t recv_rows) {
  const auto hi20 = [](int64_t p) { return (p >> 20) & 0xfffff; };
  const auto lo20 = [](int64_t p) { return p & 0xfffff; };
  const auto hi32 = [](int64_t v) { return v >> 32; };
  const auto lo32 = [](int64_t v) { return static_cast<int64_t>(static_cast<int32_t>(v)); };
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  switch (static_cast<A2AFault>(e.code)) {
    case A2AFault::negative: {
      static const char* names[4] = {"send_sizes", "recv_sizes", "input_offsets", "output_offsets"};
      const int64_t kind = (e.a >> 40) & 3;
      bad(std::string(names[kind]) + "[rank " + str(hi20(e.a)) + "][" + str(lo20(e.a)) +
          "]: must be >= 0, got " + str(e.b));
    }
    case A2AFault::recv_mismatch:
      bad("recv_sizes: rank " + str(hi20(e.a)) + " expects " + str(hi32(e.b)) + " rows from rank " +
          str(lo20(e.a)) + ", which sends " + str(lo32(e.b)) + " (send_sizes)");
    case A2AFault::input_range:
      bad("input_offsets: rank " + str(hi20(e.a)) + " sends rows [" + str(hi32(e.b)) + ", " +
          str(lo32(e.b)) + ") to rank " + str(lo20(e.a)) + ", beyond the operand's " +
          str(send_rows) + " rows");
    case A2AFault::recv_total:
      bad("recv_sizes: rank " + str(e.a) + " receives " + str(e.b) +
          " rows in all, more than its receive buffer of " + str(recv_rows) +
          " rows (output rows R)");
    case A2AFault::output_range:
      bad("output_offsets: rank " + str(hi20(e.a)) + " writes rows [" + str(hi32(e.b)) + ", " +
          str(lo32(e.b)) + ") of rank " + str(lo20(e.a)) + "'s receive buffer of " +
          str(recv_rows) + " rows");
    case A2AFault::overlap:
      bad("output_offsets: the destination ranges of ranks " + str(hi32(e.b)) + " and " +
          str(lo32(e.b)) + " overlap on rank " + str(e.a));
    case A2AFault::rank_table:
      bad("ranks: entry " + str(e.a) + " is rank " + str(e.b));
  }
}

InProcessCommunicator::InProcessCommunicator(int num_ranks) : size_(num_ranks) {
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    throw std::invalid_argument("num_ep: the in-process communicator takes 1.." +
                                std::to_string(kMaxRanks) + " ranks, got " +
                                std::to_string(num_ranks));
  }
}

std::vector<int> InProcessCommunicator::local_ranks() const {
  std::vector<int> r(size_);
  for (int i = 0; i < size_; ++i) r[i] = i;
  return r;
}

void InProcessCommunicator::ragged_all_to_all(const std::vector<RaggedA2ARank>& ranks,
                                              int64_t row_bytes, void* err, Stream s) {
  const int P = size_;
  std::vector<int> ids;
  for (const auto& r : ranks) ids.push_back(r.rank);
  check_rank_list(ids, P);
  if (row_bytes < 0) throw std::invalid_argument("row_bytes: must be >= 0, got " + str(row_bytes));
  A2ATable tb{};
  tb.P = P;
  std::vector<const void*> ptrs;
  int64_t max_recv = 0;
  for (int i = 0; i < P; ++i) {
    const RaggedA2ARank& r = ranks[i];
    tb.send[i] = static_cast<const uint8_t*>(r.send);
    tb.recv[i] = static_cast<uint8_t*>(r.recv);
    tb.in_off[i] = r.input_offsets;
    tb.send_sz[i] = r.send_sizes;
    tb.out_off[i] = r.output_offsets;
    tb.recv_sz[i] = r.recv_sizes;
    tb.send_rows[i] = r.send_rows;
    tb.recv_rows[i] = r.recv_rows;
    ptrs.push_back(r.send);
    ptrs.push_back(r.recv);
    max_recv = std::max(max_recv, r.recv_rows);
  }
  Scratch<long long> prefix(P * P + 1, s);
  Scratch<int32_t> gate(1, s);
  a2a_check_kernel<<<1, 1024, 0, s>>>(tb, prefix.get(), gate.get(), err);
  check_launch("a2a_check_kernel");
  if (max_recv == 0 || row_bytes == 0) return;
  // The copy launch is sized by the receive buffers: their rows bound the rows that can arrive.
  uint64_t align = static_cast<uint64_t>(row_bytes) | 16u;
  for (const void* p : ptrs) align |= reinterpret_cast<uintptr_t>(p);
  const int vb = vec_bytes(row_bytes, {});
  const int vb_ptr = (align & 1) ? 1 : (align & 2) ? 2 : (align & 4) ? 4 : (align & 8) ? 8 : 16;
  dispatch_vec(std::min(vb, vb_ptr), [&](auto v) {
    constexpr int VB = decltype(v)::value;
    a2a_copy_kernel<VB><<<grid_for(max_recv * P, kThreads / 32), kThreads, 0, s>>>(
        tb, prefix.get(), gate.get(), row_bytes);
    check_launch("a2a_copy_kernel");
  });
}

void InProcessCommunicator::all_to_all_i32(const std::vector<AllToAllI32Rank>& ranks, int64_t count,
                                           Stream s) {
  const int P = size_;
  std::vector<int> ids;
  for (const auto& r : ranks) ids.push_back(r.rank);
  check_rank_list(ids, P);
  if (count <= 0) return;
  I32Table tb{};
  tb.P = P;
  for (int i = 0; i < P; ++i) {
    tb.send[i] = ranks[i].send;
    tb.recv[i] = ranks[i].recv;
  }
  a2a_i32_kernel<<<grid_for(static_cast<int64_t>(P) * P * count, kThreads), kThreads, 0, s>>>(
      tb, count);
  check_launch("a2a_i32_kernel");
}

void InProcessCommunicator::all_gather(const std::vector<AllGatherRank>& ranks, int64_t bytes,
                                       Stream s) {
  const int P = size_;
  std::vector<int> ids;
  for (const auto& r : ranks) ids.push_back(r.rank);
  check_rank_list(ids, P);
  if (bytes < 0) throw std::invalid_argument("bytes: must be >= 0, got " + std::to_string(bytes));
  if (bytes == 0) return;
  for (const AllGatherRank& r : ranks) {
    if (!r.send || !r.recv) throw std::invalid_argument("all_gather: null send or recv buffer");
  }
  for (const AllGatherRank& r : ranks) {
    for (int j = 0; j < P; ++j) {
      MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(r.recv) + j * bytes, ranks[j].send,
                                     static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
    }
  }
}

}  // namespace moe::gpu
