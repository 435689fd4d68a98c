// CUDA twin of reference/dispatch.cpp: token_dispatch (SPEC §4) and token_combine (SPEC §5).
// Kernel plan and fault handling: see gpu/dispatch.cuh.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "gpu/bulk_copy.cuh"
#include "gpu/dispatch.cuh"
#include "gpu/perm_detail.cuh"

namespace moe::gpu {

namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kSlotCap = 256;  // slots staged in shared memory; later ones are decoded in place
constexpr unsigned kFull = 0xffffffffu;

// A knob that swaps a bulk-copy kernel (rows written by cp.async.bulk from shared memory) for its
// twin of ordinary stores, same bits: unset, empty or `bulk` the former, `lsu` the latter
// (two_way_setting: any other value throws naming the variable). Read on every call (tests flip
// it). Same-run A/Bs use it, and scripts/gpu_sanitize.sh sets it for initcheck, which does not see
// global memory written by bulk copies: every element such a copy wrote reads as uninitialized
// (docs/experiments/bulk-initcheck-probe.cu, session 46), so without it the block family reported
// 2016 false uninitialized reads where the EP all-to-all and gather_shards read those rows.
bool lsu_setting(const char* name) {
  return !two_way_setting(name, "bulk", "lsu");
}

// ---------------------------------------------------------------------------------------------
// Routing ranks (shared with argsort dispatch through perm_detail.cuh)

// Thread (lane, y) of a 32x8 block owns expert e = 32*blockIdx.x + lane and 32-token word w:
// one coalesced read per token row, one bitmap word out.
__global__ void routing_map_bits_kernel(const void* map, int kind, long long T, long long E,
                                        uint32_t* bits, void* err) {
  const long long e = static_cast<long long>(blockIdx.x) * 32 + threadIdx.x;
  const long long words = (T + 31) / 32;
  if (e >= E) return;
  for (long long w = static_cast<long long>(blockIdx.y) * 8 + threadIdx.y; w < words;
       w += static_cast<long long>(gridDim.y) * 8) {
    uint32_t b = 0;
    // Eight loads in flight per thread before any of them is looked at.
    for (int base = 0; base < 32; base += 8) {
      long long v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const long long t = w * 32 + base + j;
        v[j] = t < T ? load_int(map, kind, t * E + e) : 0;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (v[j] == 1) {
          b |= 1u << (base + j);
        } else if (v[j] != 0) {
          fault(err, PermFault::routing_map_value, (w * 32 + base + j) * E + e, v[j]);
        }
      }
    }
    bits[w * E + e] = b;
  }
}

// One CTA per 32 experts: warp w sums the popcounts of its slice of words, the slices are
// scanned in shared memory, then each warp writes the running offsets of its slice.
__global__ void __launch_bounds__(1024)
    column_ranks_kernel(const uint32_t* __restrict__ bits, long long words, long long E,
                        int32_t* __restrict__ woff, long long* __restrict__ count) {
  __shared__ long long part[32][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long e = static_cast<long long>(blockIdx.x) * 32 + lane;
  const long long per = (words + 31) / 32;
  const long long w0 = warp * per, w1 = min(words, w0 + per);
  long long sum = 0;
  if (e < E) {
#pragma unroll 8
    for (long long w = w0; w < w1; ++w) sum += __popc(bits[w * E + e]);
  }
  part[warp][lane] = sum;
  __syncthreads();
  long long run = 0;
  for (int i = 0; i < warp; ++i) run += part[i][lane];
  if (e >= E) return;
#pragma unroll 8
  for (long long w = w0; w < w1; ++w) {
    woff[w * E + e] = static_cast<int32_t>(run);
    run += __popc(bits[w * E + e]);
  }
  if (warp == 31) count[e] = run;
}

// ---------------------------------------------------------------------------------------------
// token_dispatch forward

// Per-expert layout, one CTA of 1024 threads over E in tiles (scans carried across tiles):
//   ustart_e = sum_{e'<e} c_e'            kept_e = c_e, or clamp(N_out - ustart_e, 0, c_e) (drop)
//   al_e = aligned(kept_e)                aoff_e = sum_{e'<e} al_e'   padoff_e = sum (al - kept)
// aoff and padoff have E+1 entries (the totals last); routed = sum c_e is checked against N_out.
__global__ void __launch_bounds__(1024)
    dispatch_layout_kernel(const long long* count, long long E, long long n_out, long long a,
                           bool drop, long long* ustart, long long* kept, long long* aoff,
                           long long* padoff, int32_t* tokens_per_expert, int32_t* pad_offsets,
                           void* err) {
  using Scan = cub::BlockScan<long long, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ long long carry[3];
  if (threadIdx.x == 0) carry[0] = carry[1] = carry[2] = 0;
  __syncthreads();
  for (long long base = 0; base < E; base += 1024) {
    const long long e = base + threadIdx.x;
    const long long c = e < E ? count[e] : 0;
    long long us, tot_c, ao, tot_a, po, tot_p;
    Scan(tmp).ExclusiveSum(c, us, tot_c);
    __syncthreads();
    us += carry[0];
    const long long k = drop ? max(0LL, min(c, n_out - us)) : c;
    const long long al = a > 0 ? (k + a - 1) / a * a : k;
    Scan(tmp).ExclusiveSum(al, ao, tot_a);
    __syncthreads();
    Scan(tmp).ExclusiveSum(al - k, po, tot_p);
    __syncthreads();
    ao += carry[1];
    po += carry[2];
    if (e < E) {
      ustart[e] = us;
      kept[e] = k;
      aoff[e] = ao;
      padoff[e] = po;
      tokens_per_expert[e] = static_cast<int32_t>(al);
      if (pad_offsets) pad_offsets[e] = static_cast<int32_t>(po);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry[0] += tot_c;
      carry[1] += tot_a;
      carry[2] += tot_p;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    aoff[E] = carry[1];
    padoff[E] = carry[2];
    if (!drop && carry[0] > n_out) fault(err, PermFault::capacity, carry[0], n_out);
  }
}

// One warp per token: experts in descending order, 32 at a time from the top; a ballot
// compacts the routed lanes so higher experts take lower slots. Unused entries get -1.
__global__ void row_id_map_kernel(const uint32_t* __restrict__ bits,
                                  const int32_t* __restrict__ woff,
                                  const long long* __restrict__ ustart, long long T, long long E,
                                  long long n_out, bool drop, int32_t* __restrict__ rid) {
  const int lane = threadIdx.x & 31;
  const long long W = 2 * E + 1;
  for (long long t = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; t < T;
       t += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    int32_t* row = rid + t * W;
    long long n = 0;
#pragma unroll 4
    for (long long base = (E - 1) / 32 * 32; base >= 0; base -= 32) {
      const long long e = base + lane;
      bool routed = false;
      long long u = 0;
      if (e < E) {
        u = ustart[e] + column_rank(bits, woff, E, t, e, &routed);
        if (drop && u >= n_out) routed = false;  // drop_overflow: a dropped slot leaves no trace
      }
      const unsigned m = __ballot_sync(kFull, routed);
      if (routed) {
        const long long pos = n + __popc(lane == 31 ? 0u : m >> (lane + 1));
        row[pos] = static_cast<int32_t>(u);
        row[E + pos] = static_cast<int32_t>(e);
      }
      n += __popc(m);
    }
    for (long long k = n + lane; k < E; k += 32) {
      row[k] = -1;
      row[E + k] = -1;
    }
    if (lane == 0) row[2 * E] = static_cast<int32_t>(n);
  }
}

// A decoded slot k of token t: its physical row (-1 when the entry is invalid), expert, weight.
struct Slot {
  long long row;
  float w;
  int e;
};

// Slot count n_t, checked to lie in [0, E] (reference: read_slots).
__device__ __forceinline__ long long slot_count(const int32_t* rid, long long E, long long t,
                                                void* err) {
  const long long W = 2 * E + 1;
  const long long n = rid[t * W + 2 * E];
  if (n < 0 || n > E) {
    fault(err, PermFault::row_id_map_entry, t * W + 2 * E, n);
    return 0;
  }
  return n;
}

// Checks slot k of the token whose map row starts at `base`, from its loaded entries u, e, the pad
// offset p of e and its weight w (loaded only for a valid e), as the reference does: expert, then
// u, then the physical row.
__device__ __forceinline__ Slot check_slot(long long base, long long E, long long k, long long u,
                                           long long e, long long p, float w, long long rows,
                                           void* err) {
  Slot s{-1, 1.0f, -1};
  if (e < 0 || e >= E) {
    fault(err, PermFault::row_id_map_entry, base + E + k, e);
    return s;
  }
  if (u < 0) {
    fault(err, PermFault::row_id_map_entry, base + k, u);
    return s;
  }
  const long long row = u + p;
  if (row < 0 || row >= rows) {
    fault(err, PermFault::source_row, row, rows);
    return s;
  }
  s.row = row;
  s.e = static_cast<int>(e);
  s.w = w;
  return s;
}

// Decodes and checks slot k of token t. wts: [T,E] weights of run-time dtype wcode, or null for
// weight 1.
__device__ __forceinline__ Slot decode_slot(const int32_t* rid, long long E, long long t,
                                            long long k, const int32_t* pad, long long rows,
                                            const void* wts, int wcode, void* err) {
  const long long base = t * (2 * E + 1);
  const long long u = rid[base + k], e = rid[base + E + k];
  const bool ok = e >= 0 && e < E;
  const long long p = ok && pad ? pad[e] : 0;
  const float w = ok && wts ? load_f(wts, wcode, t * E + e) : 1.0f;
  return check_slot(base, E, k, u, e, p, w, rows, err);
}

// Every row of `permuted` in one pass, in grid-strided work items:
//   item i < T     token i: warp k of the CTA copies x[t] to row dst(t,e_k) (a zero row for an
//                  R12 zero-prob slot); the CTA's warps read the same x row, so it comes from HBM
//                  once;
//   item T + j     warp w zeroes entry v = nwarps*j + w of the zero list: the padding rows of
//                  every expert (v < padoff[E], expert found by binary search over padoff), then
//                  the tail past sum(aligned counts).
// SPEC §4 requires the padding and tail rows written as +0, so they share the pass and its vector
// stores instead of a second kernel that could start only after the last token's copy: with
// align_size = 128 at E = 256 they are a fifth of the rows written. A zero item writes nwarps rows,
// as a token with K = nwarps slots does, so the grid (as many CTAs as the GPU keeps resident: one
// wave) gives every CTA the same work within one item. Row stores are streaming (no row of
// permuted is read back here), leaving the L2 to the x rows. No shared memory, no barrier.
template <int VB>
__global__ void __launch_bounds__(kThreads)
    dispatch_rows_kernel(const uint8_t* x, const int32_t* rid, const int32_t* pad,
                         const void* probs, void* pprobs, int pcode, uint8_t* out, long long T,
                         long long E, long long rows, long long row_bytes, const long long* kept,
                         const long long* aoff, const long long* padoff) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const long long nvec = row_bytes / VB;
  const long long pads = padoff[E], aligned = aoff[E];
  const long long zeros = pads + max(0LL, rows - aligned);
  const long long items = T + (zeros + nwarps - 1) / nwarps;
  for (long long it = blockIdx.x; it < items; it += gridDim.x) {
    if (it < T) {
      const long long t = it;
      const long long n = slot_count(rid, E, t, nullptr);
      for (long long k = warp; k < n; k += nwarps) {
        const Slot s = decode_slot(rid, E, t, k, pad, rows, nullptr, 0, nullptr);
        if (s.row < 0) continue;  // only after a capacity fault, already raised
        bool zero = false;
        if (probs) {
          if (lane == 0) copy_elem(pprobs, s.row, probs, t * E + s.e, pcode);
          zero = load_f(probs, pcode, t * E + s.e) == 0.0f;  // R12: +0 and -0 both
        }
        move_row<VB, true>(out + s.row * row_bytes, zero ? nullptr : x + t * row_bytes, nvec, lane,
                           32);
      }
      continue;
    }
    const long long v = (it - T) * nwarps + warp;
    if (v >= zeros) continue;
    long long row;
    if (v < pads) {
      long long lo = 0, hi = E;  // first j in [0,E] with padoff[j] > v, minus one
      while (lo < hi) {
        const long long mid = (lo + hi) / 2;
        if (padoff[mid] > v) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const long long e = lo - 1;
      row = aoff[e] + kept[e] + (v - padoff[e]);
    } else {
      row = aligned + (v - pads);
    }
    if (row >= rows) continue;  // padding past the buffer: only after a capacity fault
    move_row<VB, true>(out + row * row_bytes, nullptr, nvec, lane, 32);
    if (pprobs && lane == 0) zero_elem(pprobs, row, pcode);
  }
}

// CTAs of dispatch_rows_kernel<VB> the GPU keeps resident at once.
template <int VB>
int64_t dispatch_rows_resident() {
  static const int64_t n = [] {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch_rows_kernel<VB>, kThreads,
                                                      0) != cudaSuccess ||
        per_sm < 1) {
      cudaGetLastError();
      per_sm = 1;
    }
    return static_cast<int64_t>(per_sm) * num_sms();
  }();
  return n;
}

// The same rows for rows of 16-byte vectors (sm_90), moved by bulk copies: each warp of the CTA
// runs its own ring of kDispStages shared-memory stages. A work item is (token t, column chunk c)
// (items gw, gw + GW, ... of the GW warps of the grid): lane 0 copies chunk c of x[t] into a stage
// kDispStages - 1 items ahead, and once it has landed, lane k copies it out to the row of each
// slot k, k + 32, ... (from a chunk of zeros for an R12 zero-prob slot) as a bulk group. A stage
// takes its next chunk once every lane's copies out of it have read it. Then the zero rows: lane
// `lane` of warp gw writes rows gw * 32 + lane, + GW * 32, ... of the zero list from the zero
// chunk. The DeepSeek-V3 dispatch moved 85.9 / 87.4% of the copy bandwidth (a = 0 / 128) through
// each warp's 16-byte streaming stores (dispatch_rows_kernel), 87.3 / 89.6% here (H100, session
// 32).
constexpr int kDispWarps = 2, kDispStages = 4;
constexpr int kDispChunk = 16 * 1024;  // bytes of a row per work item, at most
constexpr int kDispSmem =
    (kDispWarps * kDispStages + 1) * kDispChunk + kDispWarps * kDispStages * 8;

__global__ void __launch_bounds__(kDispWarps * 32, 1)
    dispatch_rows_bulk_kernel(const uint8_t* x, const int32_t* rid, const int32_t* pad,
                              const void* probs, void* pprobs, int pcode, uint8_t* out, long long T,
                              long long E, long long rows, long long row_bytes, int chunks,
                              int chunk_bytes, const long long* kept, const long long* aoff,
                              const long long* padoff) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint8_t* zeros_chunk = smem + kDispWarps * kDispStages * kDispChunk;
  uint8_t* ring = smem + warp * kDispStages * kDispChunk;
  auto* full = reinterpret_cast<uint64_t*>(zeros_chunk + kDispChunk) + warp * kDispStages;
  for (int i = threadIdx.x; i < kDispChunk / 16; i += blockDim.x)
    reinterpret_cast<int4*>(zeros_chunk)[i] = int4{0, 0, 0, 0};
  bulk::fence_proxy_async();  // the zeros are read by bulk copies
  if (lane == 0) {
    for (int st = 0; st < kDispStages; ++st) bulk::mbar_init(&full[st], 1);
    bulk::mbar_init_fence();
  }
  __syncthreads();
  const long long GW = static_cast<long long>(gridDim.x) * kDispWarps;
  const long long gw = static_cast<long long>(blockIdx.x) * kDispWarps + warp;
  const long long items = T * chunks;
  const long long mine = items > gw ? (items - gw + GW - 1) / GW : 0;
  auto chunk_size = [&](int c) {
    return static_cast<uint32_t>(min(static_cast<long long>(chunk_bytes),
                                     row_bytes - static_cast<long long>(c) * chunk_bytes));
  };
  const uint64_t pol = bulk::evict_first_policy();  // each x row is read once
  auto load = [&](long long j) {                    // lane 0: item j of this warp into its stage
    const int st = static_cast<int>(j % kDispStages);
    const long long i = gw + j * GW, t = i / chunks;
    const int c = static_cast<int>(i - t * chunks);
    bulk::mbar_arrive_expect_tx(&full[st], chunk_size(c));
    bulk::copy_g2s(ring + st * kDispChunk,
                   x + t * row_bytes + static_cast<long long>(c) * chunk_bytes, chunk_size(c),
                   &full[st], pol);
  };
  if (lane == 0) {
    for (long long j = 0; j < kDispStages && j < mine; ++j) load(j);
  }
  for (long long j = 0; j < mine; ++j) {
    const int st = static_cast<int>(j % kDispStages);
    const long long i = gw + j * GW, t = i / chunks;
    const int c = static_cast<int>(i - t * chunks);
    const long long off = static_cast<long long>(c) * chunk_bytes;
    const uint32_t bytes = chunk_size(c);
    const long long n = slot_count(rid, E, t, nullptr);
    bulk::mbar_wait(&full[st], static_cast<uint32_t>((j / kDispStages) & 1));
    for (long long k = lane; k < n; k += 32) {
      const Slot sl = decode_slot(rid, E, t, k, pad, rows, nullptr, 0, nullptr);
      if (sl.row < 0) continue;  // only after a capacity fault, already raised
      bool zero = false;
      if (probs) {
        if (c == 0) copy_elem(pprobs, sl.row, probs, t * E + sl.e, pcode);
        zero = load_f(probs, pcode, t * E + sl.e) == 0.0f;  // R12: +0 and -0 both
      }
      bulk::copy_s2g(out + sl.row * row_bytes + off, zero ? zeros_chunk : ring + st * kDispChunk,
                     bytes);
    }
    bulk::commit_group();
    // This lane's copies of item j - 1 have read their stage; once every lane's have, it takes
    // item j - 1 + kDispStages.
    bulk::wait_group_read<1>();
    __syncwarp();
    if (lane == 0 && j >= 1 && j - 1 + kDispStages < mine) load(j - 1 + kDispStages);
  }
  const long long pads = padoff[E], aligned = aoff[E];
  const long long nz = pads + max(0LL, rows - aligned);
  for (long long v = gw * 32 + lane; v < nz; v += GW * 32) {
    long long row;
    if (v < pads) {
      long long lo = 0, hi = E;  // first j in [0,E] with padoff[j] > v, minus one
      while (lo < hi) {
        const long long mid = (lo + hi) / 2;
        if (padoff[mid] > v) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const long long e = lo - 1;
      row = aoff[e] + kept[e] + (v - padoff[e]);
    } else {
      row = aligned + (v - pads);
    }
    if (row >= rows) continue;  // padding past the buffer: only after a capacity fault
    for (int c = 0; c < chunks; ++c)
      bulk::copy_s2g(out + row * row_bytes + static_cast<long long>(c) * chunk_bytes, zeros_chunk,
                     chunk_size(c));
    bulk::commit_group();
    if (pprobs) zero_elem(pprobs, row, pcode);
  }
  bulk::wait_group_all();  // every copy out has completed before the kernel ends
}

// ---------------------------------------------------------------------------------------------
// Typed row kernels (fp32 arithmetic): dispatch backward, combine forward and backward.

// One CTA per token: out[t] = rnd(sum_{k<n_t} f32(src[row_k]) * w_k) in slot order, w_k from
// wts [T,E] or 1. Used by dispatch backward (grad_x) and combine forward.
//
// Latency bounds it (ncu, H200, DeepSeek-V3 combine: 70% of the stalled warps waited on global
// loads, at 59% of DRAM peak): each token began with its slots decoded behind a barrier, three
// dependent loads (count, map, weight) with no row in flight. Here the next token's slots are
// decoded into the other shared buffer while this token's last loads are in flight. The sum is
// the same sequence of fp32 multiply-adds in slot order as before: the arithmetic is unchanged.
// Measured on an H100 (DeepSeek-V3, H = 7168, K = 8, % of copy bandwidth in the same run):
// combine fwd 83.3 -> 88.3%, dispatch bwd 83.1 -> 89.2% at U = 4, KB = 1, kMinBlocks = 1 (or 2,
// the same). Loading several slots' rows before adding (KB = 2 or 4, U = 2) or capping the
// registers for 3-4 blocks an SM measured slower (44-72%): spills and fewer vectors per thread.
// U, KB and kMinBlocks stay template parameters so those variants can be timed again; writing the
// loop out for KB = 1 by hand changes the generated SASS (nvdisasm), and a compile-time thread
// count cost 22 points, so a simplification here needs a same-run A/B first.
template <class T, int N, int U, int KB, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    gather_sum_kernel(const T* src, long long src_rows, const int32_t* rid, const int32_t* pad,
                      const void* wts, int wcode, T* out, long long Tn, long long E, long long H,
                      void* err) {
  __shared__ Slot s_slot[2][kSlotCap];
  using VT = Vec<T, N>;
  const long long nvec = H / N;
  const long long stride = static_cast<long long>(blockDim.x) * U;
  // Slot count of token t and its first kSlotCap slots into buf (every slot is checked once).
  auto decode = [&](long long t, Slot* buf) -> long long {
    const long long n = slot_count(rid, E, t, err);
    for (long long k = threadIdx.x; k < n && k < kSlotCap; k += blockDim.x) {
      buf[k] = decode_slot(rid, E, t, k, pad, src_rows, wts, wcode, err);
    }
    return n;
  };
  // Slots past kSlotCap are decoded in place, and checked here once.
  auto check_rest = [&](long long t, long long n) {
    for (long long k = kSlotCap + threadIdx.x; k < n; k += blockDim.x) {
      decode_slot(rid, E, t, k, pad, src_rows, wts, wcode, err);
    }
  };
  long long t = blockIdx.x;
  if (t >= Tn) return;
  int cur = 0;
  long long n = decode(t, s_slot[0]);
  check_rest(t, n);
  __syncthreads();
  for (; t < Tn; t += gridDim.x) {
    const long long tn = t + gridDim.x;
    long long nn = 0;
    bool next_done = false;
    auto decode_next = [&] {
      if (next_done) return;
      next_done = true;
      if (tn < Tn) nn = decode(tn, s_slot[cur ^ 1]);
    };
    const Slot* slots = s_slot[cur];
    VT* dst = reinterpret_cast<VT*>(out + t * H);
    for (long long b = threadIdx.x; b < nvec; b += stride) {
      float acc[U][N];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) acc[u][j] = 0.0f;
      for (long long k0 = 0; k0 < n; k0 += KB) {
        VT v[KB][U];
        float w[KB];
        bool ok[KB];
#pragma unroll
        for (int q = 0; q < KB; ++q) {
          const long long k = k0 + q;
          Slot sl{-1, 1.0f, -1};
          if (k < n) {
            sl = k < kSlotCap ? slots[k]
                              : decode_slot(rid, E, t, k, pad, src_rows, wts, wcode, nullptr);
          }
          ok[q] = sl.row >= 0;  // a row < 0 only follows a fault, already raised
          w[q] = sl.w;
          const VT* row = reinterpret_cast<const VT*>(src + (ok[q] ? sl.row : 0) * H);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const long long i = b + static_cast<long long>(u) * blockDim.x;
            if (ok[q] && i < nvec) v[q][u] = row[i];
          }
        }
        if (k0 + KB >= n) decode_next();  // overlaps the last batch's loads
#pragma unroll
        for (int q = 0; q < KB; ++q) {
          if (!ok[q]) continue;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const long long i = b + static_cast<long long>(u) * blockDim.x;
            if (i < nvec) {
#pragma unroll
              for (int j = 0; j < N; ++j) acc[u][j] += to_f32(v[q][u].v[j]) * w[q];
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long i = b + static_cast<long long>(u) * blockDim.x;
        if (i < nvec) {
          VT o;
#pragma unroll
          for (int j = 0; j < N; ++j) o.v[j] = from_f32<T>(acc[u][j]);
          dst[i] = o;
        }
      }
    }
    decode_next();  // no slot or no vector for this thread: decode the next token now
    if (tn < Tn) check_rest(tn, nn);
    __syncthreads();  // the next token's slots are in place; this token's buffer is free
    cur ^= 1;
    n = nn;
  }
}

// The same sums (fp32, slot order, one rounding) with the rows brought in by bulk copies, for
// rows of 16-byte vectors (sm_90). gather_sum_kernel is latency-bound there: each thread has one
// slot's row vectors in flight and then waits for them, and at 115 registers two CTAs fit an SM,
// so an SM has at most 28 KB of loads in flight and often none (H100, DeepSeek-V3 combine: 89% of
// copy bandwidth). Here one producer warp decodes slots and issues cp.async.bulk copies of row
// chunks into a ring of kBulkStages shared-memory stages (kBulkGroup slots x up to kBulkChunk
// bytes each) ahead of 256 consumer threads, two CTAs an SM, so up to 2 x 2 x 32 KB are in flight
// an SM. With one CTA of 4 stages an SM the combine forward (merging probs) ran 18% behind the
// dispatch backward (the same kernel and bytes, no weights): 622 against 529 us, 82% of copy
// bandwidth (H200; without the weight loads 518 us); two CTAs of 2 stages ran both at 515-525 us,
// 97-99% (session 38). One producer an SM was the pacing item: a stall of its decode (the weight
// load of each slot) idled the SM's copies; the second CTA's producer fills that gap.
// A work item is (token t, column chunk c, slot group g): slots g * kBulkGroup ... of t, chunk c
// of their rows. Consumer thread j owns 16-byte vector j of the chunk: its accumulators start at 0
// on the first group of (t, c), add f32(row_k[j]) * w_k in slot order, and are rounded and stored
// after the last group, the operations and order of gather_sum_kernel. The producer decodes a
// token's slots (up to 32, one a lane) once, in steps spread over the two tokens before it so no
// load latency is exposed; every slot is checked once, and rows of faulting slots are skipped.
// The rounded chunk goes out as one bulk copy from a ring of kOutSlots shared-memory slots. With
// each thread's 16-byte store instead, the output's 1/9 of the bytes cost 25% of the time (stores
// left out: 628 against 787 us) and the combine reached 92.0-92.7% of copy bandwidth; with bulk
// copies 93.3-94.2% (H100, DeepSeek-V3 a = 128; docs/perf.md, session 32).
constexpr int kBulkConsumers = 256;              // one 16-byte vector of a chunk each
constexpr int kBulkChunk = kBulkConsumers * 16;  // bytes of a row per work item, at most
constexpr int kBulkGroup = 8;                    // slots per work item
constexpr int kBulkStages = 2;
constexpr int kBulkCtasPerSm = 2;
constexpr int kOutSlots = 4;  // staged output chunks; a slot is reused after kOutSlots - 1 more
constexpr int kBulkThreads = kBulkConsumers + 32;  // + the producer warp
constexpr int kBulkStageBytes = kBulkGroup * kBulkChunk;

// A work item's description, written into its stage by producer lane 0 before its arrive on the
// stage's full barrier (the rows' copies complete on the same barrier).
struct BulkItem {
  long long t;      // token (-1: no more items)
  int c;            // column chunk
  int valid;        // bit k: slot k of the group has a row (its copy lands in row k of the stage)
  int first, last;  // first / last slot group of (t, c)
  float w[kBulkGroup];
};

constexpr int kBulkSmem = kBulkStages * kBulkStageBytes + kBulkStages * sizeof(BulkItem) +
                          2 * kBulkStages * sizeof(uint64_t) + kOutSlots * kBulkChunk;
static_assert((kBulkStages * kBulkStageBytes + kBulkStages * sizeof(BulkItem) +
               2 * kBulkStages * sizeof(uint64_t)) %
                      16 ==
                  0,
              "the output slots must be 16-byte aligned for bulk copies");

template <class T, int N>
__global__ void __launch_bounds__(kBulkThreads, kBulkCtasPerSm)
    gather_sum_bulk_kernel(const T* src, long long src_rows, const int32_t* rid, const int32_t* pad,
                           const void* wts, int wcode, T* out, long long Tn, long long E,
                           long long H, int chunks, int chunk_bytes, void* err) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* data = smem;
  auto* items = reinterpret_cast<BulkItem*>(smem + kBulkStages * kBulkStageBytes);
  auto* full = reinterpret_cast<uint64_t*>(items + kBulkStages);
  uint64_t* empty = full + kBulkStages;
  uint8_t* out_slots = reinterpret_cast<uint8_t*>(empty + kBulkStages);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kBulkStages; ++s) {
      bulk::mbar_init(&full[s], 1);
      // Every consumer thread arrives once it has read the stage, so that each thread's reads are
      // ordered before the producer's next copies into it (compute-sanitizer's racecheck follows
      // this; with one arrive a warp after __syncwarp() it reported the reuse as a race).
      bulk::mbar_init(&empty[s], kBulkConsumers);
    }
    bulk::mbar_init_fence();
  }
  __syncthreads();
  const long long row_bytes = H * static_cast<long long>(sizeof(T));
  if (threadIdx.x >= kBulkConsumers) {  // producer warp
    const int lane = threadIdx.x & 31;
    const uint64_t pol = bulk::evict_first_policy();  // each row is read once
    const long long W = 2 * E + 1, G = gridDim.x;
    int it = 0;
    auto next_stage = [&] {  // waits until the consumers are done with item it - kBulkStages
      const int s = it % kBulkStages;
      bulk::mbar_wait(&empty[s], ((it / kBulkStages) & 1) ^ 1);
      ++it;
      return s;
    };
    // Slot `lane` of a token, decoded in three steps a token apart so that no step waits for a
    // load issued just before it: (1) the count and the map entries u, e; (2) what needs e (pad
    // offset, weight); (3) the checks (check_slot). Tokens of more than 32 slots decode each
    // slot where it is used instead.
    struct Pending {
      long long n = 0, u = -1, e = -1, p = 0;
      float w = 1.0f;
    };
    auto step1 = [&](long long t, Pending& q) {
      q.n = rid[t * W + 2 * E];
      if (lane < E) {
        q.u = rid[t * W + lane];
        q.e = rid[t * W + E + lane];
      }
    };
    auto step2 = [&](long long t, Pending& q) {
      if (q.e >= 0 && q.e < E) {
        if (pad) q.p = pad[q.e];
        if (wts) q.w = load_f(wts, wcode, t * E + q.e);
      }
    };
    Pending q0, q1;  // tokens t (steps 1, 2 done) and t + G (step 1 done)
    long long t = blockIdx.x;
    if (t < Tn) {
      step1(t, q0);
      step2(t, q0);
    }
    if (t + G < Tn) step1(t + G, q1);
    for (; t < Tn; t += G) {
      Pending q2;
      if (t + 2 * G < Tn) step1(t + 2 * G, q2);
      long long n = q0.n;
      if (n < 0 || n > E) {  // slot_count's check
        if (lane == 0) fault(err, PermFault::row_id_map_entry, t * W + 2 * E, n);
        n = 0;
      }
      const bool cached = n <= 32;
      Slot mine{-1, 1.0f, -1};
      if (cached && lane < n)
        mine = check_slot(t * W, E, lane, q0.u, q0.e, q0.p, q0.w, src_rows, err);
      if (t + G < Tn) step2(t + G, q1);
      const long long groups = n > 0 ? (n + kBulkGroup - 1) / kBulkGroup : 1;
      for (int c = 0; c < chunks; ++c) {
        const long long off = static_cast<long long>(c) * chunk_bytes;
        const uint32_t bytes =
            static_cast<uint32_t>(min(static_cast<long long>(chunk_bytes), row_bytes - off));
        for (long long g = 0; g < groups; ++g) {
          const int s = next_stage();
          const long long k = g * kBulkGroup + lane;
          Slot sl{-1, 1.0f, -1};
          if (cached) {  // slot k from lane k (every lane takes part in the shuffles)
            const int from = static_cast<int>(g * kBulkGroup) + (lane & (kBulkGroup - 1));
            sl.row = __shfl_sync(kFull, mine.row, from);
            sl.w = __shfl_sync(kFull, mine.w, from);
            if (lane >= kBulkGroup) sl.row = -1;
          } else if (lane < kBulkGroup && k < n) {
            sl = decode_slot(rid, E, t, k, pad, src_rows, wts, wcode, c == 0 ? err : nullptr);
          }
          const unsigned valid = __ballot_sync(kFull, sl.row >= 0);
          float w[kBulkGroup];
#pragma unroll
          for (int q = 0; q < kBulkGroup; ++q) w[q] = __shfl_sync(kFull, sl.w, q);
          if (lane == 0) {  // one thread writes the item and releases it with its arrive
            BulkItem& item = items[s];
            item.t = t;
            item.c = c;
            item.valid = static_cast<int>(valid);
            item.first = g == 0;
            item.last = g + 1 == groups;
#pragma unroll
            for (int q = 0; q < kBulkGroup; ++q) item.w[q] = w[q];
          }
          if (lane == 0) bulk::mbar_arrive_expect_tx(&full[s], __popc(valid) * bytes);
          __syncwarp();  // the copies complete on a barrier that expects them
          if (sl.row >= 0)
            bulk::copy_g2s(data + s * kBulkStageBytes + lane * kBulkChunk,
                           reinterpret_cast<const uint8_t*>(src) + sl.row * row_bytes + off, bytes,
                           &full[s], pol);
        }
      }
      q0 = q1;
      q1 = q2;
    }
    const int s = next_stage();
    if (lane == 0) {
      items[s].t = -1;
      bulk::mbar_arrive(&full[s]);
    }
    return;
  }
  using VT = Vec<T, N>;
  const int j = threadIdx.x;
  float acc[N];
  int stores = 0;  // output chunks issued
  for (int it = 0;; ++it) {
    const int s = it % kBulkStages;
    bulk::mbar_wait(&full[s], (it / kBulkStages) & 1);
    const BulkItem& item = items[s];
    const long long t = item.t;
    if (t < 0) break;
    const long long off = static_cast<long long>(item.c) * chunk_bytes;
    const uint32_t bytes =
        static_cast<uint32_t>(min(static_cast<long long>(chunk_bytes), row_bytes - off));
    const bool mine = 16 * j < static_cast<int>(bytes);
    if (item.first) {
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] = 0.0f;
    }
    if (mine) {
      const uint8_t* stage = data + s * kBulkStageBytes + 16 * j;
#pragma unroll
      for (int k = 0; k < kBulkGroup; ++k) {
        if (!((item.valid >> k) & 1)) continue;
        const VT v = *reinterpret_cast<const VT*>(stage + k * kBulkChunk);
        const float w = item.w[k];
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] += to_f32(v.v[q]) * w;
      }
    }
    if (item.last) {  // uniform over the consumers: every one takes part in the barrier
      uint8_t* slot = out_slots + (stores % kOutSlots) * kBulkChunk;
      if (mine) {
        VT o;
#pragma unroll
        for (int q = 0; q < N; ++q) o.v[q] = from_f32<T>(acc[q]);
        *reinterpret_cast<VT*>(slot + 16 * j) = o;
        bulk::fence_proxy_async();  // before the bulk copy (async proxy) reads the slot
      }
      // The slot after this one was last read by store stores + 1 - kOutSlots: with at most
      // kOutSlots - 2 of the earlier stores still reading, it is free for the next chunk, and
      // the barrier tells every consumer so before it writes there.
      if (j == 0) bulk::wait_group_read<kOutSlots - 2>();
      asm volatile("bar.sync 1, %0;" ::"n"(kBulkConsumers) : "memory");  // consumers only
      if (j == 0) {
        bulk::copy_s2g(reinterpret_cast<uint8_t*>(out + t * H) + off, slot, bytes);
        bulk::commit_group();
      }
      ++stores;
    }
    bulk::mbar_arrive(&empty[s]);  // this thread's reads of the stage are done
  }
  if (j == 0) bulk::wait_group_all();  // the output is written before the kernel ends
}

// grad_probs[t,:] = 0, then grad_probs[t,e_k] = ct_pprobs[row_k] (bitwise, same dtype), so that
// a repeated expert ends as the reference's last write (slot order). One warp per token, one slot
// a lane: chunks of 32 slots in order, and within a chunk only the last of the slots naming one
// expert writes. (One lane walking the slots made each warp a chain of dependent loads: about
// 2% of the DeepSeek-V3 backward's time on an H100.)
__global__ void dispatch_bwd_probs_kernel(const void* gpp, int code, const int32_t* rid,
                                          const int32_t* pad, long long rows, void* gprobs,
                                          long long Tn, long long E) {
  const int lane = threadIdx.x & 31;
  for (long long t = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; t < Tn;
       t += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    for (long long e = lane; e < E; e += 32) zero_elem(gprobs, t * E + e, code);
    const long long n = slot_count(rid, E, t, nullptr);
    for (long long k0 = 0; k0 < n; k0 += 32) {
      Slot s{-1, 1.0f, -1};
      if (k0 + lane < n) s = decode_slot(rid, E, t, k0 + lane, pad, rows, nullptr, 0, nullptr);
      const bool ok = s.row >= 0;
      const unsigned valid = __ballot_sync(0xffffffffu, ok);
      const unsigned same = __match_any_sync(0xffffffffu, ok ? s.e : -1);
      // Lanes above this one (2u << 31 wraps to 0: none above lane 31).
      const unsigned above = ~((2u << lane) - 1u);
      __syncwarp();  // the zeroes (and the previous chunk's writes) before this chunk's
      if (ok && (same & valid & above) == 0) copy_elem(gprobs, t * E + s.e, gpp, s.row, code);
    }
  }
}

// Combine backward, step 1: owner[row] = max over slots (t,k) mapping to row of t*E + k, the slot
// whose write the reference's sequential loop leaves in place. Integer atomics only: the result
// is independent of the order. One warp per token; it also zeroes the token's grad_mp row.
__global__ void combine_owner_kernel(const int32_t* rid, const int32_t* pad, long long rows,
                                     long long Tn, long long E, long long* owner, void* gmp,
                                     int gcode, void* err) {
  const int lane = threadIdx.x & 31;
  for (long long t = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; t < Tn;
       t += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    if (gmp) {  // grad_merging_probs is 0 off the routed entries
      for (long long e = lane; e < E; e += 32) zero_elem(gmp, t * E + e, gcode);
    }
    const long long n = slot_count(rid, E, t, lane == 0 ? err : nullptr);
    for (long long k = lane; k < n; k += 32) {
      const Slot s = decode_slot(rid, E, t, k, pad, rows, nullptr, 0, err);
      if (s.row >= 0) atomicMax(owner + s.row, t * E + k);
    }
  }
}

// Combine backward without merging probs, one warp per slot: the owner's warp copies ct[t]
// (read from HBM once per CTA, the other warps hit the cache) to its row.
template <int VB>
__global__ void __launch_bounds__(kThreads)
    combine_bwd_copy_kernel(const uint8_t* ct, const int32_t* rid, const int32_t* pad,
                            const long long* owner, uint8_t* out, long long Tn, long long E,
                            long long rows, long long row_bytes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const long long nvec = row_bytes / VB;
  for (long long t = blockIdx.x; t < Tn; t += gridDim.x) {
    const long long n = slot_count(rid, E, t, nullptr);
    for (long long k = warp; k < n; k += nwarps) {
      const Slot s = decode_slot(rid, E, t, k, pad, rows, nullptr, 0, nullptr);
      if (s.row < 0 || owner[s.row] != t * E + k) continue;
      move_row<VB>(out + s.row * row_bytes, ct + t * row_bytes, nvec, lane, 32);
    }
  }
}

// Combine backward with merging probs, one warp per slot k of token t:
//   grad_permuted[row_k] = rnd(f32(ct[t]) * w_k)          (only where slot k owns row_k)
//   grad_mp[t,e_k]      = rnd_p(sum_h f32(permuted[row_k,h]) * f32(ct[t,h]))
// The dot is a per-lane fp32 partial and a fixed butterfly of shuffles: deterministic. A repeated
// expert in the row is written by its last slot only (the reference's last write); the row of
// grad_mp was zeroed by combine_owner_kernel. Two schedules, the same arithmetic:
// kWarpPerToken: a warp takes a token and its slots in turn, for few slots per token (a CTA per
// token left most of its warps idle: 0.285 ms against 0.385 at topk 2, Mixtral-like block); else
// a CTA takes a token and its warps the slots, for many (they share ct[t] in L1: 0.72 ms against
// 1.0 at topk 8, DeepSeek-like block).
template <class T, int N, bool kWarpPerToken>
__global__ void __launch_bounds__(kThreads)
    combine_bwd_probs_kernel(const T* ct, const T* permuted, const int32_t* rid, const int32_t* pad,
                             const void* mp, int wcode, const long long* owner, T* out, void* gmp,
                             long long Tn, long long E, long long rows, long long H) {
  using VT = Vec<T, N>;
  const int lane = threadIdx.x & 31;
  const long long nvec = H / N, W = 2 * E + 1;
  const long long gwarp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long t0 = kWarpPerToken ? gwarp : blockIdx.x;
  const long long t_step =
      kWarpPerToken ? (static_cast<long long>(gridDim.x) * blockDim.x) >> 5 : gridDim.x;
  const int k0 = kWarpPerToken ? 0 : static_cast<int>(threadIdx.x >> 5);
  const int k_step = kWarpPerToken ? 1 : static_cast<int>(blockDim.x >> 5);
  for (long long t = t0; t < Tn; t += t_step) {
    const long long n = slot_count(rid, E, t, nullptr);
    for (long long k = k0; k < n; k += k_step) {
      const Slot s = decode_slot(rid, E, t, k, pad, rows, mp, wcode, nullptr);
      bool last = true;
      for (long long k2 = k + 1 + lane; k2 < n; k2 += 32) last &= rid[t * W + E + k2] != s.e;
      last = __all_sync(kFull, last);
      if (s.row < 0) continue;
      const bool own = owner[s.row] == t * E + k;
      const VT* c = reinterpret_cast<const VT*>(ct + t * H);
      const VT* x = reinterpret_cast<const VT*>(permuted + s.row * H);
      VT* dst = reinterpret_cast<VT*>(out + s.row * H);
      float part = 0.0f;
#pragma unroll 4
      for (long long i = lane; i < nvec; i += 32) {
        const VT cv = c[i];
        const VT xv = x[i];
        VT g;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float cf = to_f32(cv.v[j]);
          g.v[j] = from_f32<T>(cf * s.w);
          part += to_f32(xv.v[j]) * cf;
        }
        if (own) dst[i] = g;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(kFull, part, off);
      if (lane == 0 && last) store_f(gmp, wcode, t * E + s.e, part);
    }
  }
}

// Rows of grad_permuted that no slot owns are zero (R4). One warp per row.
template <int VB>
__global__ void zero_unowned_kernel(uint8_t* out, const long long* owner, long long rows,
                                    long long row_bytes) {
  const int lane = threadIdx.x & 31;
  for (long long r = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < rows;
       r += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    if (owner[r] >= 0) continue;
    move_row<VB>(out + r * row_bytes, nullptr, row_bytes / VB, lane, 32);
  }
}

// ---------------------------------------------------------------------------------------------
// Host helpers

const int32_t* opt_i32(const std::optional<DeviceTensor>& t) {
  return t ? t->data<int32_t>() : nullptr;
}
const int32_t* opt_i32(const DeviceTensor* t) {
  return t ? t->data<int32_t>() : nullptr;
}

unsigned token_grid(int64_t T) {
  return grid_for(T, 1, 16);
}
unsigned warp_grid(int64_t items) {
  return grid_for(items, kThreads / 32, 32);
}

void check_same_dtype(const DeviceTensor& a, const DeviceTensor& b, const char* a_name,
                      const char* b_name) {
  if (a.dtype() != b.dtype()) {
    throw std::invalid_argument(
        std::string(a_name) + ": dtype " + std::string(dtype_name(a.dtype())) + " must equal " +
        b_name + "'s dtype " + std::string(dtype_name(b.dtype())) + " on the CUDA path");
  }
}

template <class T, int N>
void launch_gather_sum(const T* src, long long src_rows, const int32_t* rid, const int32_t* pad,
                       const void* wts, int wcode, T* out, long long Tn, long long E, long long H,
                       void* err, Stream s) {
  if constexpr (N * sizeof(T) == 16) {
    // MOE_GATHER_SUM=lsu: gather_sum_kernel on these rows (lsu_setting).
    if (lsu_setting("MOE_GATHER_SUM")) {
      gather_sum_kernel<T, N, 4, 1, 1><<<token_grid(Tn), kThreads, 0, s>>>(
          src, src_rows, rid, pad, wts, wcode, out, Tn, E, H, err);
      check_launch("gather_sum_kernel");
      return;
    }
    // Rows of 16-byte vectors: the bulk-copy kernel, kBulkCtasPerSm CTAs an SM (80 KB of shared
    // memory each; the attribute is set once a process, on the device num_sms() describes).
    // Chunks of at most kBulkChunk bytes, as equal as 16-byte multiples allow.
    static const bool attr_set = [] {
      MOE_CUDA_CHECK(cudaFuncSetAttribute(gather_sum_bulk_kernel<T, N>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem));
      return true;
    }();
    (void)attr_set;
    const long long row_bytes = H * static_cast<long long>(sizeof(T));
    const long long chunks = ceil_div(row_bytes, kBulkChunk);
    const long long chunk_bytes = ceil_div(ceil_div(row_bytes, chunks), 16) * 16;
    const unsigned grid =
        static_cast<unsigned>(std::min<long long>(Tn, num_sms() * kBulkCtasPerSm));
    gather_sum_bulk_kernel<T, N><<<grid, kBulkThreads, kBulkSmem, s>>>(
        src, src_rows, rid, pad, wts, wcode, out, Tn, E, H, static_cast<int>(chunks),
        static_cast<int>(chunk_bytes), err);
    check_launch("gather_sum_bulk_kernel");
  } else {
    const unsigned grid = token_grid(Tn);
    gather_sum_kernel<T, N, 4, 1, 1>
        <<<grid, kThreads, 0, s>>>(src, src_rows, rid, pad, wts, wcode, out, Tn, E, H, err);
    check_launch("gather_sum_kernel");
  }
}

}  // namespace

namespace detail {

void routing_map_bits(const void* map, IntKind kind, int64_t T, int64_t E, uint32_t* bits,
                      void* err, Stream s) {
  const int64_t words = ceil_div(T, 32);
  if (words == 0 || E == 0) return;
  const dim3 block(32, 8);
  const dim3 grid(static_cast<unsigned>(ceil_div(E, 32)),
                  static_cast<unsigned>(std::min<int64_t>(ceil_div(words, 8), 65535)));
  routing_map_bits_kernel<<<grid, block, 0, s>>>(map, static_cast<int>(kind), T, E, bits, err);
  check_launch("routing_map_bits_kernel");
}

void column_ranks(const uint32_t* bits, int64_t words, int64_t E, int32_t* woff, int64_t* count,
                  Stream s) {
  if (E == 0) return;
  column_ranks_kernel<<<static_cast<unsigned>(ceil_div(E, 32)), 1024, 0, s>>>(
      bits, words, E, woff, reinterpret_cast<long long*>(count));
  check_launch("column_ranks_kernel");
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// token_dispatch

void token_dispatch_fwd_into(const DeviceTensor& x, const DeviceTensor& routing_map,
                             const DeviceTensor* probs, const TokenDispatchParams& p,
                             TokenDispatchFwd& out, void* err, Stream s) {
  const TensorMeta pm = probs ? probs->meta() : TensorMeta{};
  const DispatchDims d =
      validate_token_dispatch(x.meta(), routing_map.meta(), probs ? &pm : nullptr, p);
  const int64_t T = d.T, E = d.E, R = d.R_out;
  const int64_t row_bytes = d.H * static_cast<int64_t>(dtype_size(x.dtype()));
  const int pcode = probs ? fcode(probs->dtype()) : 0;
  void* pprobs = out.permuted_probs ? out.permuted_probs->data() : nullptr;

  const int64_t words = ceil_div(T, 32);
  Scratch<uint32_t> bits(words * E, s);
  Scratch<int32_t> woff(words * E, s);
  Scratch<long long> count(E, s), ustart(E, s), kept(E, s), aoff(E + 1, s), padoff(E + 1, s);
  if (T == 0) count.fill_bytes(0);  // every expert empty: the layout is all zeros
  detail::routing_map_bits(routing_map.data(), int_kind(routing_map.dtype()), T, E, bits.get(), err,
                           s);
  if (T > 0) {
    detail::column_ranks(bits.get(), words, E, woff.get(), reinterpret_cast<int64_t*>(count.get()),
                         s);
  }
  dispatch_layout_kernel<<<1, 1024, 0, s>>>(
      count.get(), E, p.num_out_tokens, p.align_size, p.drop_overflow, ustart.get(), kept.get(),
      aoff.get(), padoff.get(), out.tokens_per_expert.data<int32_t>(),
      out.pad_offsets ? out.pad_offsets->data<int32_t>() : nullptr, err);
  check_launch("dispatch_layout_kernel");
  if (T > 0) {
    row_id_map_kernel<<<warp_grid(T), kThreads, 0, s>>>(bits.get(), woff.get(), ustart.get(), T, E,
                                                        p.num_out_tokens, p.drop_overflow,
                                                        out.row_id_map.data<int32_t>());
    check_launch("row_id_map_kernel");
  }
  const int vb = vec_bytes(row_bytes, {x.data(), out.permuted.data()});
  if (T == 0 && R == 0) return;
  // MOE_DISPATCH_ROWS=lsu: dispatch_rows_kernel on 16-byte rows too (lsu_setting).
  if (vb == 16 && row_bytes > 0 && !lsu_setting("MOE_DISPATCH_ROWS")) {
    // Rows of 16-byte vectors: the bulk-copy kernel, one CTA an SM (its rings take 144 KB of
    // shared memory; the attribute is set once a process). Chunks of at most kDispChunk bytes,
    // as equal as 16-byte multiples allow.
    static const bool attr_set = [] {
      MOE_CUDA_CHECK(cudaFuncSetAttribute(dispatch_rows_bulk_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kDispSmem));
      return true;
    }();
    (void)attr_set;
    const int64_t chunks = std::max<int64_t>(1, ceil_div(row_bytes, kDispChunk));
    const int64_t chunk_bytes = ceil_div(ceil_div(row_bytes, chunks), 16) * 16;
    const int64_t pipes = std::max<int64_t>(T * chunks, ceil_div(R, 32));
    const auto grid = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>(num_sms(), ceil_div(pipes, kDispWarps))));
    dispatch_rows_bulk_kernel<<<grid, kDispWarps * 32, kDispSmem, s>>>(
        static_cast<const uint8_t*>(x.data()), out.row_id_map.data<int32_t>(),
        opt_i32(out.pad_offsets), probs ? probs->data() : nullptr, pprobs, pcode,
        static_cast<uint8_t*>(out.permuted.data()), T, E, R, row_bytes, static_cast<int>(chunks),
        static_cast<int>(chunk_bytes), kept.get(), aoff.get(), padoff.get());
    check_launch("dispatch_rows_bulk_kernel");
    return;
  }
  dispatch_vec(vb, [&](auto v) {
    constexpr int VB = decltype(v)::value;
    // Work items: T tokens and at most ceil(R / warps) groups of zero rows (the device knows how
    // many exactly).
    const int64_t items = T + ceil_div(R, kThreads / 32);
    const auto grid = static_cast<unsigned>(std::min(items, dispatch_rows_resident<VB>()));
    dispatch_rows_kernel<VB><<<grid, kThreads, 0, s>>>(
        static_cast<const uint8_t*>(x.data()), out.row_id_map.data<int32_t>(),
        opt_i32(out.pad_offsets), probs ? probs->data() : nullptr, pprobs, pcode,
        static_cast<uint8_t*>(out.permuted.data()), T, E, R, row_bytes, kept.get(), aoff.get(),
        padoff.get());
    check_launch("dispatch_rows_kernel");
  });
}

TokenDispatchFwd token_dispatch_fwd(const DeviceTensor& x, const DeviceTensor& routing_map,
                                    const DeviceTensor* probs, const TokenDispatchParams& p,
                                    Stream s, const RunOptions& o) {
  const TensorMeta pm = probs ? probs->meta() : TensorMeta{};
  const DispatchDims d =
      validate_token_dispatch(x.meta(), routing_map.meta(), probs ? &pm : nullptr, p);
  TokenDispatchFwd out;
  out.permuted = DeviceTensor(x.dtype(), {d.R_out, d.H});
  if (probs) out.permuted_probs = DeviceTensor(probs->dtype(), {d.R_out});
  out.row_id_map = DeviceTensor(DType::i32, {d.T, 2 * d.E + 1});
  if (p.align_size >= 1) out.pad_offsets = DeviceTensor(DType::i32, {d.E});
  out.tokens_per_expert = DeviceTensor(DType::i32, {d.E});
  if (o.poison) {
    poison(out.permuted, s);
    poison(out.permuted_probs, s);
    poison(out.row_id_map, s);
    poison(out.pad_offsets, s);
    poison(out.tokens_per_expert, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    token_dispatch_fwd_into(x, routing_map, probs, p, out, err, s);
  });
  return out;
}

void token_dispatch_bwd_into(const DeviceTensor& grad_permuted,
                             const DeviceTensor* grad_permuted_probs,
                             const DeviceTensor& row_id_map, const DeviceTensor* pad_offsets,
                             TokenDispatchBwd& out, void* err, Stream s) {
  const TensorMeta gm = grad_permuted_probs ? grad_permuted_probs->meta() : TensorMeta{};
  const TensorMeta padm = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const DispatchDims d =
      validate_token_dispatch_bwd(grad_permuted.meta(), grad_permuted_probs ? &gm : nullptr,
                                  row_id_map.meta(), pad_offsets ? &padm : nullptr);
  if (d.T == 0) return;  // SPEC §0: 0-row gradients, nothing launched
  const int32_t* rid = row_id_map.data<int32_t>();
  const int32_t* pad = opt_i32(pad_offsets);
  if (d.H > 0) {
    dispatch_typed(grad_permuted.dtype(), d.H, {grad_permuted.data(), out.grad_x.data()},
                   [&](auto tag, auto n) {
                     using T = decltype(tag);
                     launch_gather_sum<T, decltype(n)::value>(grad_permuted.data<T>(), d.R_out, rid,
                                                              pad, nullptr, 0, out.grad_x.data<T>(),
                                                              d.T, d.E, d.H, err, s);
                   });
  } else {
    // No columns: nothing to sum, but the map is still checked like the reference does.
    Scratch<long long> owner(d.R_out, s);
    owner.fill_bytes(0xFF);
    combine_owner_kernel<<<warp_grid(d.T), kThreads, 0, s>>>(rid, pad, d.R_out, d.T, d.E,
                                                             owner.get(), nullptr, 0, err);
    check_launch("combine_owner_kernel");
  }
  if (grad_permuted_probs) {
    dispatch_bwd_probs_kernel<<<warp_grid(d.T), kThreads, 0, s>>>(
        grad_permuted_probs->data(), fcode(grad_permuted_probs->dtype()), rid, pad, d.R_out,
        out.grad_probs->data(), d.T, d.E);
    check_launch("dispatch_bwd_probs_kernel");
  }
}

TokenDispatchBwd token_dispatch_bwd(const DeviceTensor& grad_permuted,
                                    const DeviceTensor* grad_permuted_probs,
                                    const DeviceTensor& row_id_map, const DeviceTensor* pad_offsets,
                                    Stream s, const RunOptions& o) {
  const TensorMeta gm = grad_permuted_probs ? grad_permuted_probs->meta() : TensorMeta{};
  const TensorMeta padm = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const DispatchDims d =
      validate_token_dispatch_bwd(grad_permuted.meta(), grad_permuted_probs ? &gm : nullptr,
                                  row_id_map.meta(), pad_offsets ? &padm : nullptr);
  TokenDispatchBwd out;
  out.grad_x = DeviceTensor(grad_permuted.dtype(), {d.T, d.H});
  if (grad_permuted_probs) out.grad_probs = DeviceTensor(grad_permuted_probs->dtype(), {d.T, d.E});
  if (o.poison) {
    poison(out.grad_x, s);
    poison(out.grad_probs, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    token_dispatch_bwd_into(grad_permuted, grad_permuted_probs, row_id_map, pad_offsets, out, err,
                            s);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// token_combine

void token_combine_fwd_into(const DeviceTensor& permuted, const DeviceTensor& row_id_map,
                            const DeviceTensor* merging_probs, const DeviceTensor* pad_offsets,
                            DeviceTensor& combined, void* err, Stream s) {
  const TensorMeta mpm = merging_probs ? merging_probs->meta() : TensorMeta{};
  const TensorMeta padm = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const CombineDims d =
      validate_token_combine(permuted.meta(), row_id_map.meta(), merging_probs ? &mpm : nullptr,
                             pad_offsets ? &padm : nullptr);
  if (d.T == 0) return;
  const int32_t* rid = row_id_map.data<int32_t>();
  const int32_t* pad = opt_i32(pad_offsets);
  if (d.H == 0) {
    Scratch<long long> owner(d.R_in, s);
    owner.fill_bytes(0xFF);
    combine_owner_kernel<<<warp_grid(d.T), kThreads, 0, s>>>(rid, pad, d.R_in, d.T, d.E,
                                                             owner.get(), nullptr, 0, err);
    check_launch("combine_owner_kernel");
    return;
  }
  const int wcode = merging_probs ? fcode(merging_probs->dtype()) : 0;
  dispatch_typed(permuted.dtype(), d.H, {permuted.data(), combined.data()}, [&](auto tag, auto n) {
    using T = decltype(tag);
    launch_gather_sum<T, decltype(n)::value>(permuted.data<T>(), d.R_in, rid, pad,
                                             merging_probs ? merging_probs->data() : nullptr, wcode,
                                             combined.data<T>(), d.T, d.E, d.H, err, s);
  });
}

DeviceTensor token_combine_fwd(const DeviceTensor& permuted, const DeviceTensor& row_id_map,
                               const DeviceTensor* merging_probs, const DeviceTensor* pad_offsets,
                               Stream s, const RunOptions& o) {
  const TensorMeta mpm = merging_probs ? merging_probs->meta() : TensorMeta{};
  const TensorMeta padm = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const CombineDims d =
      validate_token_combine(permuted.meta(), row_id_map.meta(), merging_probs ? &mpm : nullptr,
                             pad_offsets ? &padm : nullptr);
  DeviceTensor combined(permuted.dtype(), {d.T, d.H});
  if (o.poison) poison(combined, s);
  with_validation(o.validate, s, [&](void* err) {
    token_combine_fwd_into(permuted, row_id_map, merging_probs, pad_offsets, combined, err, s);
  });
  return combined;
}

void token_combine_bwd_into(const DeviceTensor& grad_combined, const DeviceTensor& permuted,
                            const DeviceTensor& row_id_map, const DeviceTensor* merging_probs,
                            const DeviceTensor* pad_offsets, TokenCombineBwd& out, void* err,
                            Stream s) {
  const TensorMeta mpm = merging_probs ? merging_probs->meta() : TensorMeta{};
  const TensorMeta padm = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const CombineDims d =
      validate_token_combine_bwd(grad_combined.meta(), permuted.meta(), row_id_map.meta(),
                                 merging_probs ? &mpm : nullptr, pad_offsets ? &padm : nullptr);
  if (merging_probs) check_same_dtype(grad_combined, permuted, "grad_combined", "permuted");
  if (d.R_in == 0 && d.T == 0) return;
  const int32_t* rid = row_id_map.data<int32_t>();
  const int32_t* pad = opt_i32(pad_offsets);
  const int64_t row_bytes = d.H * static_cast<int64_t>(dtype_size(grad_combined.dtype()));
  uint8_t* gp = static_cast<uint8_t*>(out.grad_permuted.data());

  Scratch<long long> owner(d.R_in, s);
  owner.fill_bytes(0xFF);  // -1: no owner
  if (d.T > 0) {
    combine_owner_kernel<<<warp_grid(d.T), kThreads, 0, s>>>(
        rid, pad, d.R_in, d.T, d.E, owner.get(),
        merging_probs ? out.grad_merging_probs->data() : nullptr,
        merging_probs ? fcode(merging_probs->dtype()) : 0, err);
    check_launch("combine_owner_kernel");
  }
  if (d.T > 0 && merging_probs) {
    const int wcode = fcode(merging_probs->dtype());
    dispatch_typed(grad_combined.dtype(), d.H, {grad_combined.data(), permuted.data(), gp},
                   [&](auto tag, auto n) {
                     using T = decltype(tag);
                     constexpr int N = decltype(n)::value;
                     const auto launch = [&](auto warp_per_token) {
                       constexpr bool kW = decltype(warp_per_token)::value;
                       combine_bwd_probs_kernel<T, N, kW>
                           <<<kW ? warp_grid(d.T) : token_grid(d.T), kThreads, 0, s>>>(
                               grad_combined.data<T>(), permuted.data<T>(), rid, pad,
                               merging_probs->data(), wcode, owner.get(), reinterpret_cast<T*>(gp),
                               out.grad_merging_probs->data(), d.T, d.E, d.R_in, d.H);
                     };
                     // Slots per token, on average: R_in counts routed and padding rows.
                     if (d.R_in <= 2 * d.T) {
                       launch(std::true_type{});
                     } else {
                       launch(std::false_type{});
                     }
                     check_launch("combine_bwd_probs_kernel");
                   });
  }
  const int vb = vec_bytes(row_bytes, {grad_combined.data(), gp});
  dispatch_vec(vb, [&](auto v) {
    constexpr int VB = decltype(v)::value;
    if (d.T > 0 && !merging_probs && row_bytes > 0) {
      const auto* cb = static_cast<const uint8_t*>(grad_combined.data());
      combine_bwd_copy_kernel<VB><<<token_grid(d.T), kThreads, 0, s>>>(
          cb, rid, pad, owner.get(), gp, d.T, d.E, d.R_in, row_bytes);
      check_launch("combine_bwd_copy_kernel");
    }
    if (d.R_in > 0 && row_bytes > 0) {
      zero_unowned_kernel<VB>
          <<<warp_grid(d.R_in), kThreads, 0, s>>>(gp, owner.get(), d.R_in, row_bytes);
      check_launch("zero_unowned_kernel");
    }
  });
}

TokenCombineBwd token_combine_bwd(const DeviceTensor& grad_combined, const DeviceTensor& permuted,
                                  const DeviceTensor& row_id_map, const DeviceTensor* merging_probs,
                                  const DeviceTensor* pad_offsets, Stream s, const RunOptions& o) {
  const TensorMeta mpm = merging_probs ? merging_probs->meta() : TensorMeta{};
  const TensorMeta padm = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const CombineDims d =
      validate_token_combine_bwd(grad_combined.meta(), permuted.meta(), row_id_map.meta(),
                                 merging_probs ? &mpm : nullptr, pad_offsets ? &padm : nullptr);
  TokenCombineBwd out;
  out.grad_permuted = DeviceTensor(grad_combined.dtype(), {d.R_in, d.H});
  if (merging_probs) out.grad_merging_probs = DeviceTensor(merging_probs->dtype(), {d.T, d.E});
  if (o.poison) {
    poison(out.grad_permuted, s);
    poison(out.grad_merging_probs, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    token_combine_bwd_into(grad_combined, permuted, row_id_map, merging_probs, pad_offsets, out,
                           err, s);
  });
  return out;
}

}  // namespace moe::gpu
