// Hopper grouped GEMM kernel (sm_90a: TMA, mbarrier, wgmma). Plan: gpu/grouped_gemm_sm90.cuh.
// Compiled for sm_90a only (CMakeLists.txt: moe_gpu_sm90); elsewhere the kernel body is empty and
// available() is false, so GemmImpl::sm90 falls back to cuBLAS.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "gpu/bulk_copy.cuh"
#include "gpu/device_util.cuh"
#include "gpu/grouped_gemm_sm90.cuh"
#include "gpu/wgmma.cuh"

namespace moe::gpu::sm90 {

namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kChunkBytes = 64 * kBK * 2;  // one 64-column box of an MN-major B stage
// The forward / dgrad kernel that folds tails (kFold, see decode) also holds a group's tail rows
// in each stage: 64 rows of the row operand, each CTA of the pair loading 32 and multicasting
// them. The other kernels' stages are kStageBytes: on H100 (docs/perf.md, session 14) the larger
// stages alone (less L1) made the forward 1-6% slower, the tail code in the same kernel 3-10%.
constexpr int kTailBytes = 64 * kBK * 2;
constexpr int stage_bytes_rows(bool fold) {
  return kStageBytes + (fold ? kTailBytes : 0);
}
constexpr int kThreads = 384;           // warpgroup 0: producer; 1 and 2: consumers
constexpr int kCluster = kClusterSize;  // adjacent row tiles sharing one weight tile
// Dynamic schedule: a ring of kSched table entries handed from rank 0's producer to every reader
// of the cluster. Two slots let the producer publish the entry after the current one while the
// readers still take the one before. Readers: lane 0 of every consumer warp of both CTAs (it
// broadcasts the entry to its warp) and the other CTAs' producer threads; each arrives itself on
// rank 0's sched_empty: 17 arrivals an entry (with every consumer thread a reader, 513, half of
// them remote; the times did not measurably change).
constexpr int kSched = 2;
constexpr int kSchedReaders = kCluster * (kThreads - 128) / 32 + (kCluster - 1);
// Stages, then the full / empty barriers of the stages and of the schedule ring, then its slots.
constexpr int smem_bytes_rows(bool fold) {
  return kStages * stage_bytes_rows(fold) + 1024 /* alignment */ + (2 * kStages + 2 * kSched) * 8 +
         kSched * 4;
}
static_assert(smem_bytes_rows(true) <= 227 * 1024, "shared memory");
// wgrad's staging of the epilogue (store_block_staged): 2 KiB per consumer warp at kStageOutAt
// from the aligned base, past the stages, barriers and slots.
constexpr int kStageOutBytes = 2048, kStageOutAt = kStages * kStageBytes + 128;
static_assert((2 * kStages + 2 * kSched) * 8 + kSched * 4 <= 128, "barriers and slots");
// wgrad's asynchronous epilogue (store_block_tma; 16-bit c, no accumulation): each consumer
// warpgroup stages its 64 x 256 block of c in two halves of two 64 x 64 TMA boxes (128-byte
// swizzled, 8 KiB each), and one thread stores each half with TMA; the second half and the next
// tile's products go on meanwhile. 16 KiB a warpgroup is what fits beside the 4 stages. Whole
// blocks (64 KiB) leave room for 3 stages only, and that ran slower than the epilogue through the
// warps' stores (5.3 against 4.9 ms, DeepSeek-like, H100; docs/perf.md, session 16), as did four
// rounds of one box in two alternating buffers (4.9-5.1 ms; halves: 4.5 ms).
constexpr int kOutBox = 64 * 64 * 2, kOutBoxes = 2;
constexpr int kOutAt = kStages * kStageBytes + 1024;  // past the stages and the barriers
constexpr int kSmemBytesW =
    kStageOutAt + 1024 /* alignment */ + (kThreads - 128) / 32 * kStageOutBytes;
constexpr int kSmemBytesTma = kOutAt + 2 * kOutBoxes * kOutBox + 1024 /* alignment */;
// The deferred epilogue (kDefer) is written during the next tile's products where that tile has
// at most kDeferBlocks k-blocks (512 rows; the DeepSeek-like groups have 4-5), else after them.
constexpr int kDeferBlocks = 8;
static_assert(kSmemBytesW <= 227 * 1024 && kSmemBytesTma <= 227 * 1024, "shared memory");
// The row kernel without folded tails has the same room past its stages for the same
// asynchronous epilogue (KParams::row_store); the folding kernel's stages leave none.
constexpr int smem_bytes_launch_rows(bool fold) {
  return fold ? smem_bytes_rows(true) : kSmemBytesTma;
}
static_assert(kBM == kTileRows && kBN == kTileCols, "tile shape");

// The panel wgrad kernel (grouped_cols_panel_kernel): a CTA's 128 columns of a_g over all of the
// group's rows (kPanel.blocks blocks of 64 at most: groups of up to kPanelRows rows) stay in shared
// memory while the pair walks every column tile of c[g], so only b_g streams through the stages.
// Per 128 x 256 tile of a 256-row group an SM then reads 64 KiB from L2 (its half of b_g's tile;
// the peer multicasts the other half) instead of 128 (a_g's tile too), the panel's 64 KiB once a
// run (8 tiles on the DeepSeek-like wgrad). The panel is a ring of slots: the next run's first
// blocks load into slots this run does not use. Shared memory: 3 stages of b_g (32 KiB), 6 panel
// slots (16 KiB), the TMA epilogue's 32 KiB of staging, the barriers.
// The shape is a template parameter: 4 stages and 4 slots (groups of at most 256 rows) ran no
// faster on equal groups of 256 (H200, session 37: wgrad 4.35-4.38 ms against 4.26-4.32).
struct PanelShape {
  int stages, blocks;
  constexpr int at() const { return stages * kBBytes; }  // the panel's slots, past the stages
  constexpr int out_at() const { return at() + blocks * kABytes; }  // the epilogue's staging
  constexpr int bar_at() const { return out_at() + 2 * kOutBoxes * kOutBox; }
  constexpr int smem() const { return bar_at() + 2 * (stages + blocks) * 8 + 1024 /* align */; }
};
constexpr PanelShape kPanel{3, 6};
static_assert(kPanel.blocks * kBK == kPanelRows, "the header's kPanelRows");
static_assert(kPanel.smem() <= 227 * 1024, "shared memory");
static_assert(kPanel.blocks <= kDeferBlocks, "every panel tile writes the pending block during it");

struct KParams {
  const int64_t* offsets;
  const int32_t* tile_start;
  const int32_t* order;   // draw order (RowGroupedProduct::order) or null: table order
  int32_t* tile_counter;  // dynamic: entries drawn past the first one per cluster (zero at start)
  bool dynamic;           // false: cluster c walks entries c, c + clusters, ... (static)
  int groups, tiles, n_tiles, k_blocks;
  // k-blocks of the first operand pair: blocks [k_split, k_blocks) load the second pair's maps
  // (RowGroupedProduct::a2), from its column 0. k_split = k_blocks: one pair.
  int k_split;
  int64_t rows;
  int64_t nc;
  void* c;
  const void* bias;
  int bias_type;  // 0 none, 1 f32, 2 bf16, 3 f16
  bool accumulate;
  int hint_a, hint_b;  // l2_policy() of the row operand's and the weight's loads
  int hint_c;          // l2_policy() of store_block_wide's stores; 0: plain stores (no hint)
  // Groups of more than band_over M-pairs are walked in bands of band_pairs M-pairs (see decode).
  int band_pairs, band_over;
  bool wide_store;  // 16-bit c without bias or accumulation: store_block_wide (wide_store_setting)
  bool narrow;      // a warpgroup's rows of at most 32: the transposed product (narrow_setting)
  // The plain row kernel (no folded tails), 16-bit c without bias or accumulation: a warpgroup's
  // blocks of 64 of the group's rows by TMA stores, 1 after the tile's products, 2 during the
  // next tile's; 0: the warps' stores (RowGroupedProduct::row_store).
  int row_store;
};

// The row kernel's TMA descriptors, per operand pair: the row operand in boxes of 128, 64 and 32
// rows (a full tile, one half, a folded tail's share) and the weight. Pair 1 repeats pair 0 when
// the product has one.
struct RowMaps {
  CUtensorMap a[2], a64[2], a32[2], b[2];
  CUtensorMap c;  // c as [1][rows][Nc] in 64 x 64 boxes (KParams::row_store; else unused)
};

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// One CTA's share of a table entry. The two CTAs of a cluster share one operand tile, each
// loading half of it and multicasting it to both:
//   M-pair: two row tiles of one column tile share the weight tile;
//   N-pair: one row tile of two column tiles shares the row tile. Only a group's last row tile,
//           when its row-tile count is odd, runs as N-pairs (as an M-pair its partner would
//           compute rows past the group and B would be read twice).
// banded: the tile belongs to a banded group (see decode); its weight loads stay evict_normal.
// tail: an M-pair that also computes the group's folded tail, rows [tail0, row_end) (at most 64):
// the four consumer warpgroups of the pair each take 64 of the weight tile's 256 columns.
struct Tile {
  int g, n0;
  bool npair, banded, tail;
  int64_t row0, row_end, tail0;
};

// The width of a folded tail's products (consume_tile): its rows (1..64) rounded up to 16, 32 or
// 64, the N of the transposed wgmma.
__device__ __forceinline__ int tail_width(int64_t rows) {
  return rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
}

// The group of table entry t: the last g with tile_start[g] <= t (empty groups have no entries).
__device__ __forceinline__ int group_of(const int32_t* tile_start, int groups, int t) {
  int lo = 0, hi = groups;  // first j in [0, G] with tile_start[j] > t, minus one
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(tile_start + mid) > t) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo - 1;
}

// Entries of group g, per column pair q (columns 2q, 2q + 1): the M-pairs of column 2q, those of
// column 2q + 1, then (odd row-tile count, unless the kFold kernel folds it into the last M-pair:
// folds_tail) the N-pair of the last row tile. So every reader of a weight tile is adjacent in
// the table and runs at about the same time (the weight is read from DRAM once). A group of more
// than p.band_over M-pairs (its row operand much larger than L2) is walked in bands of p.band_pairs
// M-pairs instead: each band's M-pairs for column 0, 1, ..., then the next band, the N-pairs last.
// There the row operand, not the weight, is what must not be re-read: by columns, every column tile
// would stream the whole row operand from DRAM again; by bands, a band's rows are read once while
// the group's weight (every column) stays in L2. Must match tiles_of_group() (kFold:
// RowGroupedProduct::fold_tail).
template <bool kFold>
__device__ __forceinline__ Tile decode(const KParams& p, int d, uint32_t rank) {
  const int t = p.order ? __ldg(p.order + d) : d;  // the d-th entry drawn
  Tile tl;
  tl.g = group_of(p.tile_start, p.groups, t);
  const int64_t off = __ldg(p.offsets + tl.g);
  tl.row_end = __ldg(p.offsets + tl.g + 1);
  const int m_tiles = static_cast<int>((tl.row_end - off + kBM - 1) / kBM);
  const int m_pairs = m_tiles / 2;
  // A group of 4 m + 1 64-row slots (m >= 1, folds_tail) folds its last slot into its last M-pair
  // (tail): as an N-pair row tile, those <= 64 rows would stream the group's whole weight once
  // more for a fraction of the products.
  const bool fold = kFold && m_pairs >= 1 && (tl.row_end - off + 63) / 64 % 4 == 1;
  const int odd = (m_tiles & 1) && !fold;
  tl.tail0 = off + static_cast<int64_t>(m_pairs) * kCluster * kBM;
  tl.tail = false;
  const int local = t - __ldg(p.tile_start + tl.g);
  tl.banded = m_pairs > p.band_over;
  if (tl.banded) {
    if (local < m_pairs * p.n_tiles) {
      const int per_band = p.band_pairs * p.n_tiles, b = local / per_band;
      const int in_band = local - b * per_band;
      const int size = min(p.band_pairs, m_pairs - b * p.band_pairs);  // the last band: fewer
      const int pm = b * p.band_pairs + in_band % size;
      tl.npair = false;
      tl.tail = fold && pm == m_pairs - 1;
      tl.row0 = off + static_cast<int64_t>(kCluster * pm + rank) * kBM;
      tl.n0 = in_band / size * kBN;
    } else {
      tl.npair = true;
      tl.row0 = off + static_cast<int64_t>(m_tiles - 1) * kBM;
      tl.n0 = (2 * (local - m_pairs * p.n_tiles) + static_cast<int>(rank)) * kBN;
    }
    return tl;
  }
  const int per_q = 2 * m_pairs + odd;
  const int q = local / per_q, r = local % per_q;
  // The last column pair of an odd column-tile count has one column: r < m_pairs or the N-pair.
  const int cols_q = min(2, p.n_tiles - 2 * q);
  if (r < cols_q * m_pairs) {
    tl.npair = false;
    const int pm = r % m_pairs;
    tl.tail = fold && pm == m_pairs - 1;
    tl.row0 = off + static_cast<int64_t>(kCluster * pm + rank) * kBM;
    tl.n0 = (2 * q + r / m_pairs) * kBN;
  } else {
    tl.npair = true;
    tl.row0 = off + static_cast<int64_t>(m_tiles - 1) * kBM;
    tl.n0 = (2 * q + static_cast<int>(rank)) * kBN;  // may be >= Nc: then it stores nothing
  }
  return tl;
}

// wgrad (ColGroupedProduct): c[g] (=|+=) a_g^T . b_g, the reduction over the group's rows. A
// cluster's entry is a pair of output tiles of c[g] in adjacent row tiles (an "i-pair", rows
// [256 q, 256 q + 256) of c[g]) and one column tile: the pair shares b_g's column tile (each CTA
// loads half of it, multicast to both) and each CTA loads its own 128 columns of a_g.
struct WParams {
  // The groups with rows, in order (ColGroupedProduct::group_list); each has per_group = m_pairs *
  // n_tiles entries, so an entry's group, offset and end are one 16-byte load away, issued a tile
  // ahead (wgrad's tiles are short: ~4 k-blocks on the DeepSeek shape).
  const int4* groups;
  int tiles, per_group, n_tiles, m_pairs;
  // Per group of `groups` (n of them): a_g's descriptor, then (at maps + n) b_g's.
  const CUtensorMap* maps;
  int n;
  // Order of a group's entries: i-pairs inner (column tile by column tile) or column tiles inner.
  // A group whose operands outgrow L2 is streamed once per wave of concurrent entries; a wave
  // spans all of the inner dimension, so the inner one should be the shorter (see launch).
  bool pairs_inner;
  int64_t mc, nc;  // c[g] is [mc, nc]: a is [rows, mc], b [rows, nc]
  void* c;
  bool accumulate;
  int hint_c;  // l2_policy() of the TMA epilogue's stores; 0: no hint
};

struct WTile {
  int k, g;      // groups[k] is group g
  int off, end;  // the group's rows: the reduction
  int i0, n0;    // this CTA's tile: rows [i0, i0 + 128) and columns [n0, n0 + 256) of c[g]
};

// The record of entry t's group (loaded ahead of decode_w; past the table: the first one).
__device__ __forceinline__ int4 group_record(const WParams& p, int t) {
  return __ldg(p.groups + (t < p.tiles ? t / p.per_group : 0));
}

__device__ __forceinline__ WTile decode_w(const WParams& p, int t, uint32_t rank, int4 rec) {
  WTile tl;
  tl.k = t / p.per_group;
  const int local = t - tl.k * p.per_group;
  tl.g = rec.x;
  tl.off = rec.y;
  tl.end = rec.z;
  const int q = p.pairs_inner ? local % p.m_pairs : local / p.n_tiles;
  const int j = p.pairs_inner ? local / p.m_pairs : local % p.n_tiles;
  tl.i0 = (kCluster * q + static_cast<int>(rank)) * kBM;
  tl.n0 = j * kBN;
  return tl;
}

// Stages a consumer warp freed before a wgmma wait covered their products (consume_stages): a
// race that the timing almost never shows (mutant 091 passed every test on an H100), so the stage
// loop checks its own order and counts breaches here; tests read the count (stages_freed_early).
// Declared for every pass: the host reads it.
__device__ unsigned long long g_stages_freed_early;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_SM90_KERNEL 1
#endif

#ifdef MOE_SM90_KERNEL

using namespace moe::gpu::bulk;  // smem_addr, mbar_init, mbar_arrive_expect_tx, mbar_wait
using namespace moe::gpu::wgmma;

// Arrive on the barrier at the same shared-memory offset in CTA `cta` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_addr(bar)), "r"(cta));
  // Default (release, CTA scope) semantics: what is ordered is this warp's completed wgmma reads
  // of the stage before the peer's next TMA write, as in a one-CTA pipeline; a cluster-scope
  // release would add a fence per k-block.
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Schedule ring (dynamic schedule): release / acquire at cluster scope, since rank 0's producer
// writes the slot of the peer CTA and the peer's readers release it to rank 0. One arrival on
// this CTA's barrier (the CTA-local form, as in gpu/bulk_copy.cuh) or on the one at bar's offset
// in CTA `cta`.
__device__ __forceinline__ void mbar_arrive_release_cluster(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void mbar_arrive_release_cluster(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_addr(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote)
               : "memory");
}

__device__ __forceinline__ void mbar_wait_acquire_cluster(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// Rank 0's producer draws the cluster's next entry (clusters, clusters + 1, ... in draw order;
// past the table: p.tiles, which ends every loop) and hands it to every reader through ring use
// u: once all readers have released use u - kSched of the slot, write it in each CTA, then signal
// each CTA's sched_full.
__device__ __forceinline__ int sched_draw(int32_t* counter, int tiles, uint64_t* sched_full,
                                          uint64_t* sched_empty, int32_t* slot, uint32_t u,
                                          int clusters) {
  const uint32_t j = u % kSched;
  mbar_wait_acquire_cluster(&sched_empty[j], ((u / kSched) & 1) ^ 1);
  const int64_t next = static_cast<int64_t>(atomicAdd(counter, 1)) + clusters;
  const int t = next < tiles ? static_cast<int>(next) : tiles;
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(smem_addr(&slot[j])), "r"(t) : "memory");
  for (uint32_t c = 1; c < kCluster; ++c) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(smem_addr(&slot[j])), "r"(c));
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(t) : "memory");
  }
  mbar_arrive_release_cluster(&sched_full[j]);
  for (uint32_t c = 1; c < kCluster; ++c) mbar_arrive_release_cluster(&sched_full[j], c);
  return t;
}

// A reader takes ring use u and releases it itself on rank 0's sched_empty (racecheck found
// handoffs that delegate the release to one lane racy).
__device__ __forceinline__ int sched_take(uint64_t* sched_full, uint64_t* sched_empty,
                                          const int32_t* slot, uint32_t u, uint32_t rank) {
  const uint32_t j = u % kSched;
  mbar_wait_acquire_cluster(&sched_full[j], (u / kSched) & 1);
  int t;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(t) : "r"(smem_addr(&slot[j])) : "memory");
  if (rank == 0) {
    mbar_arrive_release_cluster(&sched_empty[j]);
  } else {
    mbar_arrive_release_cluster(&sched_empty[j], 0);
  }
  return t;
}

// A consumer warp takes ring use u: lane 0 alone reads the slot and releases it (the reader
// arrives itself) and hands the entry to the other lanes by shuffle.
__device__ __forceinline__ int sched_take_warp(uint64_t* sched_full, uint64_t* sched_empty,
                                               const int32_t* slot, uint32_t u, uint32_t rank) {
  int t = 0;
  if (threadIdx.x % 32 == 0) t = sched_take(sched_full, sched_empty, slot, u, rank);
  return __shfl_sync(0xffffffffu, t, 0);
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

// L2 eviction priorities of the two operands' loads (createpolicy; PTX ISA "Cache Eviction
// Priority Hints"). Cache hint 0: evict_normal, 1: evict_first, 2: evict_last.
__device__ __forceinline__ uint64_t l2_policy(int hint) {
  uint64_t pol;
  if (hint == 1) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  } else if (hint == 2) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
  }
  return pol;
}

// TMA loads into this CTA's shared memory (dst, bar: shared-space addresses, smem_addr) with an L2
// policy (l2_policy).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "l"(pol)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, uint64_t pol) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(pol)
      : "memory");
}

// Multicast loads: the box lands at the same offset in every CTA of the cluster (mask 0b11), and
// signals each CTA's barrier at bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int c0, int c1, uint64_t pol) {
  const uint16_t mask = (1u << kCluster) - 1;
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster.L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5, %6;" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "h"(mask), "l"(pol)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map,
                                                      uint32_t bar, int c0, int c1, int c2,
                                                      uint64_t pol) {
  const uint16_t mask = (1u << kCluster) - 1;
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster.L2::cache_hint [%0], [%1, {%3, %4, %5}], [%2], %6, %7;" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(mask), "l"(pol)
      : "memory");
}

// The same from generic pointers to shared memory (the wgrad kernel's producer).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, uint64_t pol) {
  tma_load_2d(smem_addr(dst), map, smem_addr(bar), c0, c1, pol);
}
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map,
                                                      uint64_t* bar, int c0, int c1, uint64_t pol) {
  tma_load_2d_multicast(smem_addr(dst), map, smem_addr(bar), c0, c1, pol);
}

template <class TB>
__device__ __forceinline__ float2 load2(const TB* p) {
  if constexpr (std::is_same_v<TB, float>) {
    return *reinterpret_cast<const float2*>(p);
  } else if constexpr (std::is_same_v<TB, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
  }
}

template <class TC>
__device__ __forceinline__ void store2(TC* p, float v0, float v1) {
  if constexpr (std::is_same_v<TC, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  } else if constexpr (std::is_same_v<TC, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
  } else {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v0, v1);
  }
}

struct NoBias {};

// Stores one consumer warpgroup's 64 x kN accumulator block at c (the block's element (0, 0),
// rows ldc elements apart): c = rnd(acc (+ bias) (+ c)), one rounding of the fp32 sum, only the
// first `rows` rows and `cols` columns. Fragment layout of m64nNk16 (fp32): acc[4j + 2h + e] is
// row 16 warp + lane / 4 + 8 h, column 8 j + 2 (lane % 4) + e. The bias type and accumulate are
// template parameters so the loop has no branches but the bounds.
template <class TC, class TB, bool kAccumulate, int kN = kBN>
__device__ __forceinline__ void store_block(TC* c, int64_t ldc, int rows, int cols,
                                            [[maybe_unused]] const TB* bias,
                                            const float (&acc)[kN / 2]) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  const int col0 = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + lane / 4 + 8 * h;
    if (r >= rows) continue;
    TC* cr = c + r * ldc + col0;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      if (j * 8 + col0 >= cols) break;
      float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      if constexpr (!std::is_same_v<TB, NoBias>) {
        const float2 bv = load2(bias + col0 + j * 8);
        v0 += bv.x;
        v1 += bv.y;
      }
      if constexpr (kAccumulate) {
        const float2 o = load2(cr + j * 8);
        v0 += o.x;
        v1 += o.y;
      }
      store2(cr + j * 8, v0, v1);
    }
  }
}

// store_block for 16-bit c without bias or accumulation, in 16-byte pieces and no shared memory
// (the row kernels that fold tails have none to spare): each quad of lanes (lane % 4 = q) holds
// 2 columns of 8 for every 8-column group j; a 4 x 4 transpose across the quad (two butterfly
// exchanges, lane ^ 1 then lane ^ 2) gives lane q all 8 columns of group 4 m + q, so one warp
// instruction writes 8 rows x 64 bytes instead of 8 rows x 16. Against store_block's 64 stores a
// thread: 16, and 64 shuffles; ncu had the DeepSeek-like dgrad's warps stalled on the global
// store queue (lg_throttle) 3.5x as often as the forward's, and this made dgrad 4-5% faster
// (docs/perf.md, session 19). Same values: one rounding of acc. c and ldc keep 16-byte
// alignment (Nc % 8 == 0, c aligned: supported()).
template <class TC>
__device__ __forceinline__ void store_block_wide(TC* c, int64_t ldc, int rows, int cols,
                                                 const float (&acc)[128], int hint_c) {
  static_assert(sizeof(TC) == 2, "16-bit c");
  const uint64_t pol = hint_c ? l2_policy(hint_c) : 0;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + lane / 4 + 8 * h;
    TC* cr = c + r * ldc;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      uint32_t w[4];  // w[k]: columns 8 (4 m + k) + 2 q, + 1 of row r
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int j = 4 * m + k;
        TC pair[2];
        store2(pair, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(pair);
      }
      // After the exchange on bit b of q, w[k] with k's bit b unlike q's holds the partner's
      // word of index k ^ b; after both, w[k] = lane (quad base + k)'s word of index q.
#pragma unroll
      for (int b = 1; b <= 2; b <<= 1) {
        const bool hi = q & b;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (k & b) continue;
          const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? w[k] : w[k | b], b);
          if (hi) {
            w[k] = got;
          } else {
            w[k | b] = got;
          }
        }
      }
      const int col = 8 * (4 * m + q);
      if (r < rows && col < cols) {
        if (hint_c) {
          asm volatile(
              "st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(cr + col),
              "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "l"(pol)
              : "memory");
        } else {
          *reinterpret_cast<uint4*>(cr + col) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
  }
}

// store_block without bias or accumulation, through shared memory: wgrad writes a 128 x 256 tile
// for every ~256 rows of reduction, and store_block's 16-byte row pieces cost one L2 request each
// (ncu, DeepSeek-like wgrad: 456 M write requests for 7.5 GB, 12.2 ms). Each warp stages its 16
// rows one 128-byte column chunk at a time in its own 2 KiB (buf), then writes whole 128-byte row
// chunks. The staged words are swizzled (word ^ 4 (row % 8)) so the fragment's writes, eight rows
// to the same columns, fall in distinct banks. Same values as store_block: one rounding of acc.
template <class TC>
__device__ __forceinline__ void store_block_staged(TC* c, int64_t ldc, int rows, int cols,
                                                   uint8_t* buf, const float (&acc)[128]) {
  constexpr int kCols = 128 / static_cast<int>(sizeof(TC));  // columns per chunk: 64 or 32
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  uint32_t* words = reinterpret_cast<uint32_t*>(buf);
  TC* cw = c + static_cast<int64_t>(warp) * 16 * ldc;
  const int wrows = min(16, rows - warp * 16);
  // Per chunk q: fragment -> buf (row lane / 4 + 8 h, columns 8 jj + 2 (lane % 4) + e of the
  // chunk), then buf -> c.
#pragma unroll
  for (int q = 0; q < kBN / kCols; ++q) {
    if (q * kCols >= cols) break;
#pragma unroll
    for (int jj = 0; jj < kCols / 8; ++jj) {
      const int j = q * (kCols / 8) + jj;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = lane / 4 + 8 * h;
        const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        if constexpr (std::is_same_v<TC, float>) {
          const int w = (8 * jj + 2 * (lane % 4)) ^ (4 * (r % 8));  // two words: v0, v1
          *reinterpret_cast<float2*>(words + r * 32 + w) = make_float2(v0, v1);
        } else {
          const int w = (4 * jj + lane % 4) ^ (4 * (r % 8));
          TC pair[2];
          store2(pair, v0, v1);
          words[r * 32 + w] = *reinterpret_cast<const uint32_t*>(pair);
        }
      }
    }
    __syncwarp();
    // buf -> c: 16 bytes a lane, 8 lanes a 128-byte row chunk, 4 rows an instruction.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8, m = lane % 8;
      const int col = q * kCols + m * (16 / static_cast<int>(sizeof(TC)));
      if (r < wrows && col < cols) {
        const uint4 v = *reinterpret_cast<const uint4*>(words + r * 32 + ((4 * m) ^ (4 * (r % 8))));
        *reinterpret_cast<uint4*>(cw + r * ldc + col) = v;
      }
    }
    __syncwarp();
  }
}

// TMA store of a 64 x 64 box of c (3-d map: columns, rows of c[g], g) from shared memory; TMA
// writes only the part inside the map, so rows past Mc and columns past Nc are never written.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0,
                                             int c1, int c2, int hint, uint64_t pol) {
  if (hint) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], "
        "[%1], %5;" ::"l"(map),
        "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "l"(pol)
        : "memory");
    return;
  }
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
      "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Synchronises the 128 threads of one consumer warpgroup (named barrier 1 + cw; 0 is
// __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int cw) {
  asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
}

// wgrad's asynchronous epilogue: consumer warpgroup cw's 64 x 256 accumulator block, rounded
// once to TC (16-bit), to c[g] rows [i, i + 64) and columns [n0, n0 + 256), in two halves through
// buf (kOutBoxes 64 x 64 boxes, 128-byte swizzled: row r's 16-byte chunk q at r * 128 +
// 16 (q ^ r % 8), so the fragment's writes, eight rows to the same columns, fall in distinct
// banks). The block is first rounded into 64 packed pairs (pack_block: same values as
// store_block, one rounding of acc), then each half is written by store_half_tma: the
// warpgroup's first thread waits until the stores issued before have read buf, and issues the
// half's once every thread's writes are visible to the async proxy. Either both halves follow
// the products at once (store_block_tma), or (deferred, kDefer) they are written while the next
// tile's products run: the packed pairs are not the accumulators, so the warps may write them
// to shared memory between a k-block's commit and its wait.
template <class TC>
__device__ __forceinline__ void pack_block(const float (&acc)[128], uint32_t (&packed)[64]) {
  static_assert(sizeof(TC) == 2, "16-bit c");
#pragma unroll
  for (int q = 0; q < 64; ++q) {
    TC pair[2];
    store2(pair, acc[2 * q], acc[2 * q + 1]);
    packed[q] = *reinterpret_cast<const uint32_t*>(pair);
  }
}

// Where a deferred (or immediate) block goes: c[g] rows [i, i + 64), columns [n0, n0 + 64 boxes).
struct OutBlock {
  int g, i, n0, boxes;  // boxes: 64-column boxes below Nc (0: nothing to store)
};

template <int kHalf>
__device__ __forceinline__ void store_half_tma(const CUtensorMap* map, uint8_t* buf, int cw,
                                               const OutBlock& o, const uint32_t (&packed)[64],
                                               int hint, uint64_t pol) {
  constexpr int b0 = kHalf * kOutBoxes;
  if (b0 >= o.boxes) return;
  const int t = threadIdx.x % 128, lane = t % 32, warp = t / 32;
  const uint32_t base = smem_addr(buf);
  // The stores issued last (the previous half, or the previous tile's) are done reading buf.
  if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  warpgroup_sync(cw);
#pragma unroll
  for (int jj = 0; jj < kOutBoxes * 8; ++jj) {
    const int j = b0 * 8 + jj;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + lane / 4 + 8 * h;
      const uint32_t at =
          base + (jj / 8) * kOutBox + r * 128 + (((jj % 8) ^ (r % 8)) << 4) + 4 * (lane % 4);
      // acc[4 j + 2 h], acc[4 j + 2 h + 1] (pack_block's pair 2 j + h)
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(packed[2 * j + h]) : "memory");
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  warpgroup_sync(cw);
  if (t == 0) {
    for (int b = b0; b < b0 + kOutBoxes && b < o.boxes; ++b)
      tma_store_3d(map, buf + (b - b0) * kOutBox, o.n0 + 64 * b, o.i, o.g, hint, pol);
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
}

__device__ __forceinline__ OutBlock out_block(int g, int64_t i, int n0, int64_t nc) {
  return {g, static_cast<int>(i), n0,
          static_cast<int>(min(static_cast<int64_t>(4), (nc - n0 + 63) / 64))};
}

template <class TC>
__device__ __forceinline__ void store_block_tma(const CUtensorMap* map, uint8_t* buf, int cw, int g,
                                                int64_t i, int n0, int64_t nc,
                                                const float (&acc)[128], int hint) {
  static_assert(4 / kOutBoxes == 2, "two halves");
  const uint64_t pol = hint ? l2_policy(hint) : 0;
  uint32_t packed[64];
  pack_block<TC>(acc, packed);
  const OutBlock o = out_block(g, i, n0, nc);
  store_half_tma<0>(map, buf, cw, o, packed, hint, pol);
  store_half_tma<1>(map, buf, cw, o, packed, hint, pol);
}

// The forward / dgrad tile's block of consumer warpgroup cw: rows past the group's end and
// columns past Nc skipped.
template <class TC, class TB, bool kAccumulate>
__device__ __forceinline__ void store_fragment(const KParams& p, const Tile& tl, int cw,
                                               const float (&acc)[128]) {
  const int64_t r0 = tl.row0 + 64 * cw;
  const int rows = static_cast<int>(min(static_cast<int64_t>(64), tl.row_end - r0));
  const int cols = static_cast<int>(min(static_cast<int64_t>(kBN), p.nc - tl.n0));
  if (rows <= 0 || cols <= 0) return;
  if constexpr (sizeof(TC) == 2 && std::is_same_v<TB, NoBias> && !kAccumulate) {
    if (p.wide_store) {
      store_block_wide<TC>(static_cast<TC*>(p.c) + r0 * p.nc + tl.n0, p.nc, rows, cols, acc,
                           p.hint_c);
      return;
    }
  }
  const TB* b = nullptr;
  if constexpr (!std::is_same_v<TB, NoBias>)
    b = static_cast<const TB*>(p.bias) + tl.g * p.nc + tl.n0;
  store_block<TC, TB, kAccumulate>(static_cast<TC*>(p.c) + r0 * p.nc + tl.n0, p.nc, rows, cols, b,
                                   acc);
}

// A block of c of 64 columns [n0, n0 + 64) (those below Nc) by rows [r0, r0 + min(rows, kN))
// of group g, from transposed accumulators (c^T, 64 columns by kN rows, in m64nNk16's fragment
// layout: acc_t[4j + 2h + e] is column 16 warp + lane / 4 + 8 h, row 8 j + 2 (lane % 4) + e).
// c = rnd(acc (+ bias) (+ c)) as store_block, one element at a time: such blocks are a group's
// last few rows (a folded tail, a narrow warpgroup).
template <class TC, class TB, bool kAccumulate, int kN>
__device__ __forceinline__ void store_transposed(const KParams& p, int g, int64_t r0, int64_t n0,
                                                 int64_t row_count, const float (&acc_t)[kN / 2]) {
  const int rows = static_cast<int>(min(static_cast<int64_t>(kN), row_count));
  const int cols = static_cast<int>(min(static_cast<int64_t>(64), p.nc - n0));
  if (rows <= 0 || cols <= 0) return;
  TC* c = static_cast<TC*>(p.c) + r0 * p.nc + n0;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int col = warp * 16 + lane / 4 + 8 * h;
    if (col >= cols) continue;
    [[maybe_unused]] float bv = 0.0f;
    if constexpr (!std::is_same_v<TB, NoBias>)
      bv = to_f32(*(static_cast<const TB*>(p.bias) + g * p.nc + n0 + col));
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * j + 2 * (lane % 4) + e;
        if (r >= rows) continue;
        float v = acc_t[4 * j + 2 * h + e];
        if constexpr (!std::is_same_v<TB, NoBias>) v += bv;
        TC* const out = c + r * p.nc + col;
        if constexpr (kAccumulate) v += to_f32(*out);
        *out = from_f32<TC>(v);
      }
    }
  }
}

// The folded tail's block of consumer warpgroup w = 2 rank + cw of the pair: rows [tail0,
// row_end), columns [n0 + 64 w, n0 + 64 w + 64), from its transposed accumulators (consume_tile).
template <class TC, class TB, bool kAccumulate, int kN>
__device__ __forceinline__ void store_tail(const KParams& p, const Tile& tl, int w,
                                           const float (&acc_t)[kN / 2]) {
  store_transposed<TC, TB, kAccumulate, kN>(p, tl.g, tl.tail0, tl.n0 + 64 * w,
                                            tl.row_end - tl.tail0, acc_t);
}

// A narrow warpgroup's block (consume_narrow): its rows [row0 + 64 cw, row_end) (at most kN), all
// four 64-column quarters of the tile, each from its transposed accumulators acc[q kN / 2 ..].
template <class TC, class TB, bool kAccumulate, int kN>
__device__ __forceinline__ void store_narrow(const KParams& p, const Tile& tl, int cw,
                                             const float (&acc)[128]) {
  const int64_t r0 = tl.row0 + 64 * cw;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    store_transposed<TC, TB, kAccumulate, kN>(
        p, tl.g, r0, tl.n0 + 64 * q, tl.row_end - r0,
        *reinterpret_cast<const float(*)[kN / 2]>(acc + q * (kN / 2)));
}

// Calls f(TB{}) with the bias element type of the launch (p.bias_type; NoBias without a bias).
template <class F>
__device__ __forceinline__ void with_bias_type(int code, F&& f) {
  switch (code) {
    case 1:
      return f(float{});
    case 2:
      return f(__nv_bfloat16{});
    case 3:
      return f(__half{});
    default:
      return f(NoBias{});
  }
}

// A tile's stores: store_fragment, and for a tail entry (acc_t, kTailN > 0) store_tail. acc_t is
// a pointer so that a non-tail call site has no tail accumulators at all.
template <class TC, int kTailN = 0>
__device__ __forceinline__ void store_tile(const KParams& p, const Tile& tl, int cw, int w,
                                           const float (&acc)[128],
                                           const float (*acc_t)[kTailN > 0 ? kTailN / 2 : 1]) {
  with_bias_type(p.bias_type, [&](auto tag) {
    using TB = decltype(tag);
    if (p.accumulate) {
      store_fragment<TC, TB, true>(p, tl, cw, acc);
      if constexpr (kTailN > 0) store_tail<TC, TB, true, kTailN>(p, tl, w, *acc_t);
    } else {
      store_fragment<TC, TB, false>(p, tl, cw, acc);
      if constexpr (kTailN > 0) store_tail<TC, TB, false, kTailN>(p, tl, w, *acc_t);
    }
  });
}

// store_tile for a narrow warpgroup (consume_narrow).
template <class TC, int kN>
__device__ __forceinline__ void store_tile_narrow(const KParams& p, const Tile& tl, int cw,
                                                  const float (&acc)[128]) {
  with_bias_type(p.bias_type, [&](auto tag) {
    using TB = decltype(tag);
    if (p.accumulate) {
      store_narrow<TC, TB, true, kN>(p, tl, cw, acc);
    } else {
      store_narrow<TC, TB, false, kN>(p, tl, cw, acc);
    }
  });
}

// wgmma.wait_group N after the products of iteration `it` were committed: the products of every
// iteration before it + 1 - N are done. The one place a wait raises consume_stages' `done`.
template <int N>
__device__ __forceinline__ int wait_products(int it) {
  wgmma_wait<N>();
  return it + 1 - N;
}

// The stage loop of every consumer warpgroup: for each of k_blocks stages, wait for it, and
// (kActive) issue its products (mma(s, kb): stage s holds k-block kb; between the fence and the
// commit); then release a stage to the producers of both CTAs (the peer's multicast writes this
// CTA's copy). `it` counts stages across tiles. between(kb) runs after block kb's products are
// committed, while they run (work that touches no accumulator: the deferred epilogue).
//
// kHold picks when a stage goes back. true: wait for the previous block's products only and
// release the previous stage, so the tensor pipe never drains between blocks, but a stage is held
// until the next one lands: one of kStages fewer loads in flight. false: wait for this block's
// products and release its stage at once. The forward and dgrad stream their weights from DRAM
// and gain from the deeper load pipeline (H100, session 29: 2.3% / 2.7% faster on DeepSeek-like
// uniform); wgrad measured 6% slower without the overlap, so it holds.
//
// Every release checks the order: the stage of iteration j goes back only once a wait has covered
// j's products (j < done), else g_stages_freed_early counts it. The check is in program order, so
// it sees an early release on every run, not only when a refill happens to land in time.
//
// kS stages (kStages but in the panel wgrad kernel); before(kb) runs first in each iteration, ahead
// of the stage's wait and the fence (the panel kernel waits there for its slot: a branch between
// the fence and the commit would serialise every wgmma of the kernel, ptxas C7520).
template <bool kActive, bool kHold, int kS, class Mma, class Between, class Before>
__device__ __forceinline__ void consume_stages(uint64_t* full, uint64_t* empty, int k_blocks,
                                               int& it, Mma&& mma, Between&& between,
                                               Before&& before) {
  const int lane = threadIdx.x % 32;
  int done = it;  // iterations below are complete: the previous call waited for all it issued
  auto release = [&](int j) {
    if (lane == 0) {
      if (j >= done) atomicAdd(&g_stages_freed_early, 1ull);
      for (uint32_t c = 0; c < kCluster; ++c) mbar_arrive_cluster(&empty[j % kS], c);
    }
  };
  int prev = -1;
  for (int kb = 0; kb < k_blocks; ++kb, ++it) {
    before(kb);
    const int s = it % kS;
    mbar_wait(&full[s], (it / kS) & 1);
    if constexpr (kActive) {
      wgmma_fence();
      mma(s, kb);
      wgmma_commit();
      between(kb);
      if constexpr (kHold) {
        done = wait_products<1>(it);  // the previous k-block's products are done: release its stage
      } else {
        done = wait_products<0>(it);  // this k-block's products are done: release its stage now
      }
    } else {
      done = it + 1;  // nothing issued
    }
    if constexpr (kHold) {
      if (prev >= 0) release(prev);
      prev = it;
    } else {
      release(it);
    }
  }
  if constexpr (kActive && kHold) done = wait_products<0>(it - 1);
  if (prev >= 0) release(prev);
}

template <bool kActive, bool kHold, class Mma, class Between>
__device__ __forceinline__ void consume_stages(uint64_t* full, uint64_t* empty, int k_blocks,
                                               int& it, Mma&& mma, Between&& between) {
  consume_stages<kActive, kHold, kStages>(full, empty, k_blocks, it, mma, between, [](int) {});
}

template <bool kActive, bool kHold, class Mma>
__device__ __forceinline__ void consume_stages(uint64_t* full, uint64_t* empty, int k_blocks,
                                               int& it, Mma&& mma) {
  consume_stages<kActive, kHold>(full, empty, k_blocks, it, mma, [](int) {});
}

// Descriptors of k-slice kk (16 deep) of a stage's tile at base (consume_tile, consume_narrow):
// the row operand's (K-major, rows of 128 bytes) and the weight's (K-major, or MN-major 64-column
// boxes kChunkBytes apart).
__device__ __forceinline__ uint64_t row_desc(uint32_t base, int kk) {
  return make_desc(base + kk * 32, 16, 1024);
}
template <bool kBKMajor>
__device__ __forceinline__ uint64_t weight_desc(uint32_t base, int kk) {
  return kBKMajor ? make_desc(base + kk * 32, 16, 1024)
                  : make_desc(base + kk * 2048, kChunkBytes, 1024);
}

// One forward / dgrad tile for one consumer warpgroup (consume_stages): its 64 rows of the stage's
// row tile (K-major) by the weight tile into acc, and for a tail entry (kTailN > 0) columns
// [64 w, 64 w + 64) of the weight tile by the stage's first kTailN tail rows into acc_t,
// transposed (c^T = w^T x^T: the weight's columns are wgmma's 64 rows, the tail rows its N), so
// the products cost the tail's rows rounded up to 16, 32 or 64, not 64 of them always.
template <class T, bool kBKMajor, bool kFold, bool kActive, int kTailN, class Between>
__device__ __forceinline__ void consume_tile(const KParams& p, uint8_t* smem, uint64_t* full,
                                             uint64_t* empty, int cw, int w, int& it,
                                             float (&acc)[128],
                                             float (&acc_t)[kTailN > 0 ? kTailN / 2 : 1],
                                             Between&& between) {
  constexpr bool kTail = kTailN > 0;
  static_assert(kActive || !kTail, "a tail entry's warpgroups are all active");
  static_assert(kFold || !kTail, "tails are folded only by the kFold kernel");
  constexpr int kStageBytesR = stage_bytes_rows(kFold);
  consume_stages<kActive, false>(
      full, empty, p.k_blocks, it,
      [&](int s, int) {
        const uint32_t sa = smem_addr(smem + s * kStageBytesR) + cw * (64 * 128);
        const uint32_t sb = smem_addr(smem + s * kStageBytesR + kABytes);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk)
          wgmma_m64n256k16<T, 0, kBKMajor ? 0 : 1>(acc, row_desc(sa, kk),
                                                   weight_desc<kBKMajor>(sb, kk));
        if constexpr (kTail) {
          // The weight tile's columns 64 w.. (A: 64 rows of the K-major tile, 8 KiB each, or the
          // w-th 64-column box of the MN-major one, whose descriptor reads it M-major) by the
          // tail's rows (B: K-major, as the row tile; rows past those loaded are never read).
          const uint32_t st = smem_addr(smem + s * kStageBytesR + kStageBytes);
          const uint32_t sw = sb + w * (kBKMajor ? 64 * 128 : kChunkBytes);
#pragma unroll
          for (int kk = 0; kk < kBK / 16; ++kk)
            wgmma_m64nk16<kTailN, T, kBKMajor ? 0 : 1, 0>(acc_t, weight_desc<kBKMajor>(sw, kk),
                                                          row_desc(st, kk));
        }
      },
      between);
}

template <class T, bool kBKMajor, bool kFold, bool kActive, int kTailN>
__device__ __forceinline__ void consume_tile(const KParams& p, uint8_t* smem, uint64_t* full,
                                             uint64_t* empty, int cw, int w, int& it,
                                             float (&acc)[128],
                                             float (&acc_t)[kTailN > 0 ? kTailN / 2 : 1]) {
  consume_tile<T, kBKMajor, kFold, kActive, kTailN>(p, smem, full, empty, cw, w, it, acc, acc_t,
                                                    [](int) {});
}

// consume_tile for a warpgroup whose 64 rows hold at most kN (16 or 32) of the group's (its
// group's last rows): the weight tile's four 64-column quarters (A, as a folded tail's) by its
// first kN rows (B: K-major), transposed, into acc[q kN / 2 ..]: kN / 64 of the products of
// m64n256k16.
template <class T, bool kBKMajor, bool kFold, int kN>
__device__ __forceinline__ void consume_narrow(const KParams& p, uint8_t* smem, uint64_t* full,
                                               uint64_t* empty, int cw, int& it,
                                               float (&acc)[128]) {
  constexpr int kStageBytesR = stage_bytes_rows(kFold);
  consume_stages<true, false>(full, empty, p.k_blocks, it, [&](int s, int) {
    const uint32_t sa = smem_addr(smem + s * kStageBytesR) + cw * (64 * 128);
    const uint32_t sb = smem_addr(smem + s * kStageBytesR + kABytes);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t sw = sb + q * (kBKMajor ? 64 * 128 : kChunkBytes);
      float(&aq)[kN / 2] = *reinterpret_cast<float(*)[kN / 2]>(acc + q * (kN / 2));
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_m64nk16<kN, T, kBKMajor ? 0 : 1, 0>(aq, weight_desc<kBKMajor>(sw, kk),
                                                  row_desc(sa, kk));
    }
  });
}

// The shared-memory layout of both kernels: the stages, then the full / empty barriers of the
// stages and of the schedule ring, then its slots.
struct Pipe {
  uint8_t* smem;
  uint64_t *full, *empty, *sched_full, *sched_empty;  // sched_empty: only rank 0's are used
  int32_t* sched_slot;
  uint32_t rank;  // this CTA's rank in the cluster
};

// Lays out and initialises the pipeline of this CTA (stages of stage_bytes), then syncs the
// cluster: past it, the peer may arrive on this CTA's barriers and multicast into its stages.
__device__ __forceinline__ Pipe init_pipe(uint8_t* smem_raw, int stage_bytes) {
  Pipe q;
  // 128-byte swizzled TMA boxes need 1024-byte aligned destinations. The offset is the same in
  // both CTAs of the cluster (same kernel, same shared-memory layout), as multicast needs.
  q.smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                      ~static_cast<uintptr_t>(1023));
  q.full = reinterpret_cast<uint64_t*>(q.smem + kStages * stage_bytes);
  q.empty = q.full + kStages;
  q.sched_full = q.empty + kStages;
  q.sched_empty = q.sched_full + kSched;
  q.sched_slot = reinterpret_cast<int32_t*>(q.sched_empty + kSched);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&q.full[s], 1);
      // A stage is free once every consumer warp of BOTH CTAs has read it: the peer's multicast
      // writes this CTA's copy of the shared operand tile.
      mbar_init(&q.empty[s], kCluster * 8);
    }
    for (int j = 0; j < kSched; ++j) {
      mbar_init(&q.sched_full[j], 1);
      mbar_init(&q.sched_empty[j], kSchedReaders);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  q.rank = cluster_rank();
  cluster_sync();
  return q;
}

// One wgrad tile for one consumer warpgroup (consume_stages): k_blocks blocks of 64 rows of the
// group (rows past its end zero-filled by TMA). Stage: a_g's columns [i0, i0 + 64) and
// [i0 + 64, i0 + 128) (one box per warpgroup), then b_g's four 64-column boxes; both operands
// MN-major.
template <class T, bool kActive, class Between>
__device__ __forceinline__ void consume_tile_w(uint8_t* smem, uint64_t* full, uint64_t* empty,
                                               int cw, int k_blocks, int& it, float (&acc)[128],
                                               Between&& between) {
  consume_stages<kActive, true>(
      full, empty, k_blocks, it,
      [&](int s, int kb) {
        uint8_t* stage = smem + s * kStageBytes;
        const uint32_t sa = smem_addr(stage) + cw * kChunkBytes, sb = smem_addr(stage + kABytes);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = make_desc(sa + kk * 2048, kChunkBytes, 1024);
          const uint64_t db = make_desc(sb + kk * 2048, kChunkBytes, 1024);
          wgmma_m64n256k16<T, 1, 1>(acc, da, db, kb > 0 || kk > 0);
        }
      },
      between);
}

// One panel-kernel tile for one consumer warpgroup: consume_tile_w's products over kS stages,
// with a_g's block kb from panel slot (a_base + kb) % kP, waited for ahead of the stage (before:
// the wait returns at once after the run's first tile, the slot's next phase needing this run's
// release).
template <class T, int kS, int kP, bool kActive, class Between>
__device__ __forceinline__ void consume_tile_panel(uint8_t* smem, uint64_t* full, uint64_t* empty,
                                                   uint64_t* a_full, uint32_t a_base, int cw,
                                                   int k_blocks, int& it, float (&acc)[128],
                                                   Between&& between) {
  uint32_t slot = 0;
  consume_stages<kActive, true, kS>(
      full, empty, k_blocks, it,
      [&](int s, int kb) {
        const uint32_t sa =
            smem_addr(smem + PanelShape{kS, kP}.at() + slot * kABytes) + cw * kChunkBytes;
        const uint32_t sb = smem_addr(smem + s * kBBytes);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = make_desc(sa + kk * 2048, kChunkBytes, 1024);
          const uint64_t db = make_desc(sb + kk * 2048, kChunkBytes, 1024);
          wgmma_m64n256k16<T, 1, 1>(acc, da, db, kb > 0 || kk > 0);
        }
      },
      between,
      [&](int kb) {
        const uint32_t u = a_base + kb;
        slot = u % kP;
        mbar_wait(&a_full[slot], (u / kP) & 1);
      });
}

#endif  // MOE_SM90_KERNEL

template <class T, bool kBKMajor, class TC, bool kFold>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 1)
    grouped_rows_kernel(const __grid_constant__ RowMaps m, const KParams p) {
#ifdef MOE_SM90_KERNEL
  extern __shared__ uint8_t smem_raw[];
  constexpr int kStageBytesR = stage_bytes_rows(kFold);
  const Pipe pipe = init_pipe(smem_raw, kStageBytesR);
  const uint32_t rank = pipe.rank;
  uint8_t* smem = pipe.smem;
  uint64_t *full = pipe.full, *empty = pipe.empty;
  uint64_t *sched_full = pipe.sched_full, *sched_empty = pipe.sched_empty;
  int32_t* sched_slot = pipe.sched_slot;
  const int wg = threadIdx.x / 128;
  const int cluster_id = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      // This thread paces the pipeline: its k-loop issues every stage's loads, and at about 170
      // instructions a k-block (session 35, ncu source view) it was busy for nearly all of the
      // forward while the consumers waited on stages to land. So the loop is kept lean: shared
      // addresses converted once (a generic pointer costs a special-register read each time),
      // this CTA's weight boxes counted per entry, the stage and its phase from `it` unsigned.
      const uint32_t stages_s = smem_addr(smem), full_s = smem_addr(full),
                     empty_s = smem_addr(empty);
      uint32_t it = 0;
      uint32_t u = 0;  // schedule ring uses
      for (int t = cluster_id; t < p.tiles;) {
        const Tile tl = decode<kFold>(p, t, rank);
        // Row halves (64 rows) past the group's end are not loaded (their products are skipped
        // and nothing of them is stored); nor are weight boxes past Nc.
        const bool half1 = tl.row0 + 64 < tl.row_end;
        const int64_t left = p.nc - tl.n0;
        const int boxes = left <= 0 ? 0
                          : kBKMajor
                              ? static_cast<int>(min(static_cast<int64_t>(2), (left + 127) / 128))
                              : static_cast<int>(min(static_cast<int64_t>(4), (left + 63) / 64));
        constexpr uint32_t kBoxBytes = kBKMajor ? kBBytes / 2 : kChunkBytes;
        // M-pair: this CTA's weight boxes, multicast to both (K-major: box rank; MN-major: boxes
        // 2 rank and 2 rank + 1), those below `boxes`.
        const int r = static_cast<int>(rank);
        const int mine = kBKMajor ? (r < boxes) : max(0, min(2, boxes - 2 * r));
        // What lands in this CTA per stage: the row tile (or its first half), and the weight
        // boxes (M-pair: both CTAs' halves, multicast; N-pair: its own column tile's).
        // Tail entry: rank r loads the tail's rows [tail0 + 32 r, tail0 + 32 r + 32) for both
        // CTAs (a start past M_total loads row 0 instead: never stored); rank 1 only where the
        // tail's products read them (tail_width 64).
        const bool tail = kFold && tl.tail;
        const bool tail_wide = tail && tail_width(tl.row_end - tl.tail0) > 32;
        const bool tail_mine = tail && (rank == 0 || tail_wide);
        const uint32_t tail_bytes = !tail ? 0 : tail_wide ? kTailBytes : kTailBytes / 2;
        const uint32_t bytes = (half1 ? kABytes : kABytes / 2) + boxes * kBoxBytes + tail_bytes;
        const int64_t t_row = tl.tail0 + 32 * rank;
        const int tail_row = t_row < p.rows ? static_cast<int>(t_row) : 0;
        // M-pair: this CTA loads its own row tile. N-pair: rank r loads row half r (when needed)
        // for both CTAs.
        int a_row = static_cast<int>(tl.row0);
        if (tl.npair) a_row += 64 * r;
        const bool a_half_mine = rank == 0 || half1;
        // Rows past M_total (a tile's tail) are zero-filled by TMA; a box starting past it loads
        // row 0 instead (it is never stored).
        if (a_row >= p.rows) a_row = 0;
        const int b_n0 = tl.n0 + 128 * r;  // an M-pair's first column of this CTA's boxes
        for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          mbar_wait(empty_s + 8 * s, ((it / kStages) & 1) ^ 1);
          const uint32_t sa = stages_s + s * kStageBytesR, sb = sa + kABytes, bar = full_s + 8 * s;
          mbar_arrive_expect_tx(bar, bytes);
          // The operand pair of this k-block, and the block's column in it.
          const int q = kb < p.k_split ? 0 : 1;
          const int k0 = (kb - (q ? p.k_split : 0)) * kBK;
          const CUtensorMap* tm_b = &m.b[q];
          // Made here, not kept live: the producer has 40 registers (setmaxnreg).
          const uint64_t pol_a = l2_policy(p.hint_a), pol_b = l2_policy(tl.banded ? 0 : p.hint_b);
          if (tail_mine)
            tma_load_2d_multicast(sa + kStageBytes + rank * (kTailBytes / 2), &m.a32[q], bar, k0,
                                  tail_row, pol_a);
          if (!tl.npair) {
            tma_load_2d(sa, half1 ? &m.a[q] : &m.a64[q], bar, k0, a_row, pol_a);
            if (kBKMajor) {
              if (mine)
                tma_load_3d_multicast(sb + rank * kBoxBytes, tm_b, bar, k0, b_n0, tl.g, pol_b);
            } else {
              if (mine > 0)
                tma_load_3d_multicast(sb + 2 * rank * kChunkBytes, tm_b, bar, b_n0, k0, tl.g,
                                      pol_b);
              if (mine > 1)
                tma_load_3d_multicast(sb + (2 * rank + 1) * kChunkBytes, tm_b, bar, b_n0 + 64, k0,
                                      tl.g, pol_b);
            }
          } else {
            if (a_half_mine)
              tma_load_2d_multicast(sa + rank * (kABytes / 2), &m.a64[q], bar, k0, a_row, pol_a);
            for (int j = 0; j < boxes; ++j) {
              if (kBKMajor) {
                tma_load_3d(sb + j * kBoxBytes, tm_b, bar, k0, tl.n0 + 128 * j, tl.g, pol_b);
              } else {
                tma_load_3d(sb + j * kChunkBytes, tm_b, bar, tl.n0 + 64 * j, k0, tl.g, pol_b);
              }
            }
          }
        }
        if (!p.dynamic) {
          t += clusters;
        } else if (rank == 0) {
          // Drawn once this tile's loads are issued: they land meanwhile.
          t = sched_draw(p.tile_counter, p.tiles, sched_full, sched_empty, sched_slot, u++,
                         clusters);
        } else {
          t = sched_take(sched_full, sched_empty, sched_slot, u++, rank);
        }
      }
    }
    __syncwarp();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1;  // consumer warpgroup: rows [64 cw, 64 cw + 64) of the tile
    const int w = 2 * static_cast<int>(rank) + cw;  // its quarter of a tail entry's columns
    float acc[128];
    int it = 0;
    uint32_t u = 0;  // schedule ring uses
    // p.row_store (the plain kernel, 16-bit c): a block of 64 of the group's rows is rounded into
    // packed (pack_block) and written through this warpgroup's staging boxes by TMA
    // (store_half_tma), at once (1) or during the next tile's first k-blocks (2: half 0 after
    // block 0's commit, half 1 after block 2's, while the products run; pend is the block
    // waiting). Any other kind of tile writes the pending block first.
    constexpr bool kTmaRows = !kFold && sizeof(TC) == 2;
    uint8_t* const out_buf = smem + kOutAt + cw * kOutBoxes * kOutBox;
    uint32_t packed[kTmaRows ? 64 : 1];
    OutBlock pend{0, 0, 0, 0};  // boxes 0: nothing pending
    const uint64_t pol_c = kTmaRows && p.hint_c ? l2_policy(p.hint_c) : 0;
    auto write_half = [&](auto half) {
      if constexpr (kTmaRows)
        store_half_tma<decltype(half)::value>(&m.c, out_buf, cw, pend, packed, p.hint_c, pol_c);
    };
    auto write_pending = [&] {
      write_half(std::integral_constant<int, 0>{});
      write_half(std::integral_constant<int, 1>{});
      pend.boxes = 0;
    };
    for (int t = cluster_id; t < p.tiles;) {
      const Tile tl = decode<kFold>(p, t, rank);
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
      // A half past the group's end (its last row tile), or an N-pair partner past Nc, has no
      // products to compute.
      const bool active = tl.row0 + 64 * cw < tl.row_end && tl.n0 < p.nc;
      // Separate loops, not a branch per k-block: a branch around the wgmma makes ptxas fence
      // the accumulators every k-block.
      if (kFold && tl.tail) {
        // The tail's products at the width of its rows (tail_width): 16, 32 or 64.
        auto tail_tile = [&](auto width) {
          if constexpr (kFold) {  // (the other kernel has no tail entries)
            constexpr int kN = decltype(width)::value;
            float acc_t[kN / 2];
#pragma unroll
            for (int i = 0; i < kN / 2; ++i) acc_t[i] = 0.0f;
            consume_tile<T, kBKMajor, kFold, true, kN>(p, smem, full, empty, cw, w, it, acc, acc_t);
            store_tile<TC, kN>(p, tl, cw, w, acc, &acc_t);
          }
        };
        const int width = tail_width(tl.row_end - tl.tail0);
        if (width == 16) {
          tail_tile(std::integral_constant<int, 16>{});
        } else if (width == 32) {
          tail_tile(std::integral_constant<int, 32>{});
        } else {
          tail_tile(std::integral_constant<int, 64>{});
        }
      } else {
        // No tail: the tail accumulators are not touched (kTailN 0); acc stands in for them.
        float(&none)[1] = *reinterpret_cast<float(*)[1]>(acc);
        // A warpgroup's rows of the group: at most 32 of its 64 take the narrow product.
        const int64_t mine = tl.row_end - (tl.row0 + 64 * cw);
        if (kTmaRows && p.row_store && active && !(p.narrow && mine <= 32)) {
          if constexpr (kTmaRows) {
            // The pending block's halves during this tile's products (both after block 0 when
            // the tile has one).
            const int second = min(2, p.k_blocks - 1);
            consume_tile<T, kBKMajor, kFold, true, 0>(
                p, smem, full, empty, cw, w, it, acc, none, [&](int kb) {
                  if (kb == 0) write_half(std::integral_constant<int, 0>{});
                  if (kb == second) write_half(std::integral_constant<int, 1>{});
                });
            pend.boxes = 0;
            if (mine >= 64) {
              pack_block<TC>(acc, packed);
              pend = out_block(0, tl.row0 + 64 * cw, tl.n0, p.nc);
              if (p.row_store == 1) write_pending();
            } else {
              // A group's last rows: a 64-row box would write into the next group's rows,
              // which another CTA stores.
              store_fragment<TC, NoBias, false>(p, tl, cw, acc);
            }
          }
        } else if (active && p.narrow && mine <= 16) {
          write_pending();
          consume_narrow<T, kBKMajor, kFold, 16>(p, smem, full, empty, cw, it, acc);
          store_tile_narrow<TC, 16>(p, tl, cw, acc);
        } else if (active && p.narrow && mine <= 32) {
          write_pending();
          consume_narrow<T, kBKMajor, kFold, 32>(p, smem, full, empty, cw, it, acc);
          store_tile_narrow<TC, 32>(p, tl, cw, acc);
        } else {
          write_pending();
          if (active) {
            consume_tile<T, kBKMajor, kFold, true, 0>(p, smem, full, empty, cw, w, it, acc, none);
          } else {
            consume_tile<T, kBKMajor, kFold, false, 0>(p, smem, full, empty, cw, w, it, acc, none);
          }
          store_tile<TC>(p, tl, cw, w, acc, nullptr);
        }
      }
      t = p.dynamic ? sched_take_warp(sched_full, sched_empty, sched_slot, u++, rank)
                    : t + clusters;
    }
    write_pending();
    // The TMA stores are done before the CTA (and its shared memory) goes.
    if (kTmaRows && p.row_store && threadIdx.x % 128 == 0)
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  // No CTA leaves while its peer may still write its schedule slots or arrive on its barriers:
  // every remote write and arrive above precedes its thread's arrival here. Each ring use is
  // taken by every reader (the last one carries p.tiles), so no one waits past it.
  cluster_sync();
#endif
}

// wgrad kernel: the forward's pipeline; a table entry is an i-pair of c[g]'s row tiles in one
// column tile (decode_w), its k-loop the group's rows. Static schedule (cluster c takes entries
// c, c + clusters, ...): the forward's dynamic one measured slower here, 6.2-6.5 against
// 5.0-5.5 ms on the DeepSeek-like wgrad (docs/perf.md, session 13). kTma: the asynchronous
// epilogue (store_block_tma; tm_c maps c), else the one through the warps' stores. kDefer (with
// kTma): each tile's block is rounded into registers (pack_block) and written while the next
// tile's first products run, or before them where that tile is long (kDeferBlocks).
template <class T, class TC, bool kTma, bool kDefer>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 1)
    grouped_cols_kernel(const __grid_constant__ CUtensorMap tm_c,
                        const __grid_constant__ WParams p) {
#ifdef MOE_SM90_KERNEL
  extern __shared__ uint8_t smem_raw[];
  const Pipe pipe = init_pipe(smem_raw, kStageBytes);
  const uint32_t rank = pipe.rank;
  const int wg = threadIdx.x / 128;
  const int cluster_id = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int it = 0;
      int4 rec = group_record(p, cluster_id);
      for (int t = cluster_id; t < p.tiles;) {
        const WTile tl = decode_w(p, t, rank, rec);
        // The next entry's record is loaded now and used after this tile's loads are issued.
        const int next = t + clusters;
        const int4 next_rec = group_record(p, next);
        const int k_blocks = static_cast<int>((tl.end - tl.off + kBK - 1) / kBK);
        // b_g's boxes with columns below Nc (the rest of the stage is not loaded: its columns are
        // not stored). A box of a_g past Mc (an odd row-tile count leaves a CTA of the last pair,
        // or its second warpgroup, without rows) loads column 0 instead: never stored either.
        const int boxes = static_cast<int>(min(static_cast<int64_t>(4), (p.nc - tl.n0 + 63) / 64));
        const uint32_t bytes = kABytes + boxes * kChunkBytes;
        const int i0 = tl.i0 < p.mc ? tl.i0 : 0, i1 = tl.i0 + 64 < p.mc ? tl.i0 + 64 : 0;
        // The group's descriptors, written by the host before the launch (generic proxy):
        // acquired for the tensormap proxy before TMA reads them.
        const CUtensorMap* ma = p.maps + tl.k;
        const CUtensorMap* mb = p.maps + p.n + tl.k;
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(ma) : "memory");
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(mb) : "memory");
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % kStages;
          mbar_wait(&pipe.empty[s], ((it / kStages) & 1) ^ 1);
          uint8_t* sa = pipe.smem + s * kStageBytes;
          uint8_t* sb = sa + kABytes;
          mbar_arrive_expect_tx(&pipe.full[s], bytes);
          // Rows relative to the group; those past its end are zero-filled by TMA.
          const int r = kb * kBK;
          const uint64_t pol = l2_policy(0);
          tma_load_2d(sa, ma, &pipe.full[s], i0, r, pol);
          tma_load_2d(sa + kChunkBytes, ma, &pipe.full[s], i1, r, pol);
          for (int j = 2 * rank; j < 2 * rank + 2 && j < boxes; ++j)
            tma_load_2d_multicast(sb + j * kChunkBytes, mb, &pipe.full[s], tl.n0 + 64 * j, r, pol);
        }
        t = next;
        rec = next_rec;
      }
    }
    __syncwarp();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1;  // consumer warpgroup: rows [i0 + 64 cw, i0 + 64 cw + 64) of c[g]
    // This warp's staging buffer for the epilogue (kTma: this warpgroup's).
    uint8_t* stage_out = kTma ? pipe.smem + kOutAt + cw * kOutBoxes * kOutBox
                              : pipe.smem + kStageOutAt + (threadIdx.x / 32 - 4) * kStageOutBytes;
    // A tile's first product writes acc (wgmma_m64n256k16's add = 0) rather than adding to
    // zeros: no 128 moves a tile at the tile boundary, where both warpgroups' products have
    // drained and the tensor pipe waits for the next ones. No product of the tile before is in
    // flight then (consume_stages waits for all of a tile's before it returns; add = 0 on every
    // block, with the block before still in flight, stopped the kernel with an illegal
    // instruction: mutant 111). Zeroed once, so acc is never read undefined (an inactive
    // warpgroup's tile issues nothing).
    float acc[128];
#pragma unroll
    for (int q = 0; q < 128; ++q) acc[q] = 0.0f;
    // kDefer: the previous tile's block, rounded (pack_block), and where it goes; its halves are
    // written between the next tile's first blocks (half 0 after block 0's commit, half 1 after
    // block 2's, or block 1's in a two-block tile, so the first half's stores have a block's
    // time to read buf); what a one-block tile leaves, after its products.
    static_assert(!kDefer || kTma, "the deferred epilogue is the TMA one");
    uint32_t packed[kDefer ? 64 : 1];
    OutBlock pend{0, 0, 0, 0};  // boxes 0: nothing pending
    const uint64_t pol = kDefer && p.hint_c ? l2_policy(p.hint_c) : 0;
    int it = 0;
    int4 rec = group_record(p, cluster_id);
    for (int t = cluster_id; t < p.tiles;) {
      const WTile tl = decode_w(p, t, rank, rec);
      rec = group_record(p, t + clusters);  // used after this tile's products and stores
      const int k_blocks = static_cast<int>((tl.end - tl.off + kBK - 1) / kBK);
      const int64_t i = tl.i0 + 64 * cw;
      if constexpr (kDefer) {
        if (i < p.mc) {
          const int second = k_blocks >= 3 ? 2 : 1;
          int written = 0;  // halves of pend written
          auto during = [&](int kb) {
            if (kb == 0) {
              store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
              written = 1;
            } else if (kb == second) {
              store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
              written = 2;
            }
          };
          if (k_blocks <= kDeferBlocks) {
            consume_tile_w<T, true>(pipe.smem, pipe.full, pipe.empty, cw, k_blocks, it, acc,
                                    during);
          } else {
            // A long tile: the epilogue is a small part of it, and its k-loop runs faster free
            // of the hook and of the packed block (Mixtral-like wgrad 5% slower with them).
            during(0);
            during(second);
            consume_tile_w<T, true>(pipe.smem, pipe.full, pipe.empty, cw, k_blocks, it, acc,
                                    [](int) {});
          }
          if (written < 1) store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          if (written < 2) store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          pack_block<TC>(acc, packed);
          pend = out_block(tl.g, i, tl.n0, p.nc);
        } else {
          store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          pend.boxes = 0;
          consume_tile_w<T, false>(pipe.smem, pipe.full, pipe.empty, cw, k_blocks, it, acc,
                                   [](int) {});
        }
      } else if (i < p.mc) {
        consume_tile_w<T, true>(pipe.smem, pipe.full, pipe.empty, cw, k_blocks, it, acc,
                                [](int) {});
        if constexpr (kTma) {
          store_block_tma<TC>(&tm_c, stage_out, cw, tl.g, i, tl.n0, p.nc, acc, p.hint_c);
        } else {
          const int rows = static_cast<int>(min(static_cast<int64_t>(64), p.mc - i));
          const int cols = static_cast<int>(min(static_cast<int64_t>(kBN), p.nc - tl.n0));
          TC* c = static_cast<TC*>(p.c) + (tl.g * p.mc + i) * p.nc + tl.n0;
          if (p.accumulate) {
            store_block<TC, NoBias, true>(c, p.nc, rows, cols, nullptr, acc);
          } else {
            store_block_staged<TC>(c, p.nc, rows, cols, stage_out, acc);
          }
        }
      } else {
        consume_tile_w<T, false>(pipe.smem, pipe.full, pipe.empty, cw, k_blocks, it, acc,
                                 [](int) {});
      }
      t += clusters;
    }
    if constexpr (kDefer) {
      store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
      store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
    }
    // The stores are done before the CTA (and its shared memory) goes.
    if (kTma && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  cluster_sync();  // as in grouped_rows_kernel
#endif
}

// wgrad with a_g's panel resident (see kPanelRows): the host takes it where every group has at
// most kPanelRows rows, 16-bit c is written (not accumulated) and the TMA epilogue is deferred
// (launch_cols_typed); grouped_cols_kernel elsewhere. A run is one i-pair of one group and all its
// column tiles, n_tiles table entries in a row (decode_w with columns inner); cluster c takes runs
// c, c + clusters, ... (static, as grouped_cols_kernel). The producer loads the run's panel block
// kb just before the first tile's b_g block kb, so b_g's first blocks are not queued behind panel
// slots the previous run still reads. Same products in the same order, so the same bits as
// grouped_cols_kernel<T, TC, true, true>
// (Sm90GemmGpu.WgradPanelMatchesTheFp64SumsAndTheStreamingKernel).
template <class T, class TC, int kS, int kP>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 1)
    grouped_cols_panel_kernel(const __grid_constant__ CUtensorMap tm_c,
                              const __grid_constant__ WParams p) {
#ifdef MOE_SM90_KERNEL
  constexpr PanelShape kShape{kS, kP};
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kShape.bar_at());
  uint64_t* empty = full + kS;
  uint64_t* a_full = empty + kS;
  uint64_t* a_empty = a_full + kP;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kCluster * 8);  // b_g's stages: both CTAs' consumer warps (multicast)
    }
    for (int b = 0; b < kP; ++b) {
      mbar_init(&a_full[b], 1);
      mbar_init(&a_empty[b], 8);  // a slot of this CTA's own panel: its 8 consumer warps
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const uint32_t rank = cluster_rank();
  cluster_sync();
  const int wg = threadIdx.x / 128;
  const int cluster_id = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const int runs = p.tiles / p.n_tiles;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      uint32_t it = 0, a_it = 0;
      int4 rec = group_record(p, cluster_id * p.n_tiles);
      for (int r = cluster_id; r < runs; r += clusters) {
        const WTile tl = decode_w(p, r * p.n_tiles, rank, rec);
        // The next run's record, used then (past the last run: any, unused; no int overflow).
        rec = group_record(p, r + clusters < runs ? (r + clusters) * p.n_tiles : p.tiles);
        const int k_blocks = static_cast<int>((tl.end - tl.off + kBK - 1) / kBK);
        if (k_blocks > kP) __trap();  // the host's kPanelRows check failed
        const int i0 = tl.i0 < p.mc ? tl.i0 : 0, i1 = tl.i0 + 64 < p.mc ? tl.i0 + 64 : 0;
        const CUtensorMap* ma = p.maps + tl.k;
        const CUtensorMap* mb = p.maps + p.n + tl.k;
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(ma) : "memory");
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(mb) : "memory");
        const uint64_t pol = l2_policy(0);
        for (int j = 0; j < p.n_tiles; ++j) {
          const int n0 = j * kBN;
          const int boxes = static_cast<int>(min(static_cast<int64_t>(4), (p.nc - n0 + 63) / 64));
          for (int kb = 0; kb < k_blocks; ++kb, ++it) {
            const int row = kb * kBK;
            if (j == 0) {
              const uint32_t u = a_it + kb, slot = u % kP;
              mbar_wait(&a_empty[slot], ((u / kP) & 1) ^ 1);
              uint8_t* sa = smem + kShape.at() + slot * kABytes;
              mbar_arrive_expect_tx(&a_full[slot], kABytes);
              tma_load_2d(sa, ma, &a_full[slot], i0, row, pol);
              tma_load_2d(sa + kChunkBytes, ma, &a_full[slot], i1, row, pol);
            }
            const uint32_t s = it % kS;
            mbar_wait(&empty[s], ((it / kS) & 1) ^ 1);
            uint8_t* sb = smem + s * kBBytes;
            mbar_arrive_expect_tx(&full[s], boxes * kChunkBytes);
            for (int b = 2 * rank; b < 2 * rank + 2 && b < boxes; ++b)
              tma_load_2d_multicast(sb + b * kChunkBytes, mb, &full[s], n0 + 64 * b, row, pol);
          }
        }
        a_it += k_blocks;
      }
    }
    __syncwarp();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int cw = wg - 1;  // rows [i0 + 64 cw, i0 + 64 cw + 64) of c[g]
    uint8_t* stage_out = smem + kShape.out_at() + cw * kOutBoxes * kOutBox;
    float acc[128];  // as grouped_cols_kernel's: a tile's first product writes it
#pragma unroll
    for (int q = 0; q < 128; ++q) acc[q] = 0.0f;
    uint32_t packed[64];        // the previous tile's block (grouped_cols_kernel's kDefer)
    OutBlock pend{0, 0, 0, 0};  // boxes 0: nothing pending
    const uint64_t pol = p.hint_c ? l2_policy(p.hint_c) : 0;
    int it = 0;
    uint32_t a_it = 0;
    int4 rec = group_record(p, cluster_id * p.n_tiles);
    for (int r = cluster_id; r < runs; r += clusters) {
      const WTile tl = decode_w(p, r * p.n_tiles, rank, rec);
      rec = group_record(p, r + clusters < runs ? (r + clusters) * p.n_tiles : p.tiles);
      const int k_blocks = static_cast<int>((tl.end - tl.off + kBK - 1) / kBK);
      const int64_t i = tl.i0 + 64 * cw;
      for (int j = 0; j < p.n_tiles; ++j) {
        const int n0 = j * kBN;
        if (i < p.mc) {
          const int second = k_blocks >= 3 ? 2 : 1;
          int written = 0;  // halves of pend written
          consume_tile_panel<T, kS, kP, true>(
              smem, full, empty, a_full, a_it, cw, k_blocks, it, acc, [&](int kb) {
                if (kb == 0) {
                  store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
                  written = 1;
                } else if (kb == second) {
                  store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
                  written = 2;
                }
              });
          if (written < 1) store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          if (written < 2) store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          pack_block<TC>(acc, packed);
          pend = out_block(tl.g, i, n0, p.nc);
        } else {
          store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
          pend.boxes = 0;
          consume_tile_panel<T, kS, kP, false>(smem, full, empty, a_full, a_it, cw, k_blocks, it,
                                               acc, [](int) {});
        }
      }
      // The run's products are done (consume_tile_panel's last wait): its panel slots go back.
      if (threadIdx.x % 32 == 0)
        for (int kb = 0; kb < k_blocks; ++kb) mbar_arrive_cluster(&a_empty[(a_it + kb) % kP], rank);
      a_it += k_blocks;
    }
    store_half_tma<0>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
    store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);
    if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  cluster_sync();  // as in grouped_rows_kernel
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                    cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !f)
      throw std::runtime_error("sm90 grouped GEMM: cuTensorMapEncodeTiled is not available");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

CUtensorMap make_map(DType d, const void* ptr, int rank, const cuuint64_t* dims,
                     const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap m{};
  const cuuint32_t estrides[3] = {1, 1, 1};
  const CUresult r = encode_fn()(
      &m, d == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      rank, const_cast<void*>(ptr), dims, strides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("sm90 grouped GEMM: cuTensorMapEncodeTiled failed (" +
                             std::to_string(static_cast<int>(r)) + ")");
  return m;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// As many clusters as fit on the device at once (the GPCs' SM counts decide), at most one per
// table entry; 66 on an H100 SXM. Each launcher measures it once for its kernel (one device type
// per process here). Benchmark knobs: MOE_SM90_CLUSTERS=n forces n (above the co-resident count
// the persistent grid runs in waves), MOE_SM90_VERBOSE=1 prints the count.
int cluster_count(const void* kernel, int smem_bytes) {
  int n = 0;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(kCluster * 1024);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem_bytes;
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
  if (n < 1) throw std::runtime_error("sm90 grouped GEMM: no cluster fits the device");
  if (const char* e = std::getenv("MOE_SM90_CLUSTERS"); e && *e) n = std::max(1, std::atoi(e));
  if (std::getenv("MOE_SM90_VERBOSE")) std::fprintf(stderr, "sm90: %d clusters\n", n);
  return n;
}

template <class T, bool kBKMajor, class TC, bool kFold>
void launch_typed(const RowGroupedProduct& p, const KParams& kp, Stream s) {
  constexpr int kSmem = smem_bytes_launch_rows(kFold);
  auto kernel = grouped_rows_kernel<T, kBKMajor, TC, kFold>;
  static std::once_flag once;
  std::call_once(once, [&] {
    MOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  });
  const cuuint64_t a_dims[2] = {static_cast<cuuint64_t>(p.kc), static_cast<cuuint64_t>(p.rows)};
  const cuuint64_t a_strides[1] = {static_cast<cuuint64_t>(p.kc) * 2};
  const cuuint32_t a_box[2] = {kBK, kBM}, a64_box[2] = {kBK, kBM / 2}, a32_box[2] = {kBK, 32};
  RowMaps m;
  for (int q = 0; q < 2; ++q) {
    // Pair 1: the second pair's operands, or pair 0's again.
    const void* a = q == 1 && p.a2 ? p.a2 : p.a;
    const void* b = q == 1 && p.a2 ? p.b2 : p.b;
    m.a[q] = make_map(p.ab, a, 2, a_dims, a_strides, a_box);
    m.a64[q] = make_map(p.ab, a, 2, a_dims, a_strides, a64_box);
    m.a32[q] = make_map(p.ab, a, 2, a_dims, a_strides, a32_box);
    if (kBKMajor) {  // b[g][n][k]
      const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.kc), static_cast<cuuint64_t>(p.nc),
                                  static_cast<cuuint64_t>(p.groups)};
      const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.kc) * 2,
                                     static_cast<cuuint64_t>(p.kc * p.nc) * 2};
      const cuuint32_t box[3] = {kBK, kBN / kCluster, 1};
      m.b[q] = make_map(p.ab, b, 3, dims, strides, box);
    } else {  // b[g][k][n]
      const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.nc), static_cast<cuuint64_t>(p.kc),
                                  static_cast<cuuint64_t>(p.groups)};
      const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.nc) * 2,
                                     static_cast<cuuint64_t>(p.kc * p.nc) * 2};
      const cuuint32_t box[3] = {64, kBK, 1};
      m.b[q] = make_map(p.ab, b, 3, dims, strides, box);
    }
  }
  m.c = CUtensorMap{};
  if (kp.row_store) {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.nc), static_cast<cuuint64_t>(p.rows), 1};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.nc) * 2,
                                   static_cast<cuuint64_t>(p.rows * p.nc) * 2};
    const cuuint32_t box[3] = {64, 64, 1};
    m.c = make_map(p.c_type, p.c, 3, dims, strides, box);
  }
  static const int max_clusters = cluster_count(reinterpret_cast<const void*>(kernel), kSmem);
  const int grid =
      kCluster * std::min({p.tiles, max_clusters, p.max_clusters > 0 ? p.max_clusters : INT_MAX});
  kernel<<<grid, kThreads, kSmem, s>>>(m, kp);
  MOE_CUDA_CHECK(cudaGetLastError());
}

// The kernel that folds tails only where the table does (p.fold_tail).
template <class T, bool kBKMajor, class TC>
void launch_rows(const RowGroupedProduct& p, const KParams& kp, Stream s) {
  if (p.fold_tail) {
    launch_typed<T, kBKMajor, TC, true>(p, kp, s);
  } else {
    launch_typed<T, kBKMajor, TC, false>(p, kp, s);
  }
}

template <class T, class TC, bool kTma, bool kDefer = false>
void launch_cols_kernel(const ColGroupedProduct& p, const WParams& kp, Stream s) {
  constexpr int kSmem = kTma ? kSmemBytesTma : kSmemBytesW;
  auto kernel = grouped_cols_kernel<T, TC, kTma, kDefer>;
  static std::once_flag once;
  std::call_once(once, [&] {
    MOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  });
  CUtensorMap tm_c{};
  if (kTma) {  // c as [groups][Mc][Nc]: a box's rows past Mc are not written into c[g + 1]
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.nc), static_cast<cuuint64_t>(p.mc),
                                static_cast<cuuint64_t>(p.groups)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.nc) * 2,
                                   static_cast<cuuint64_t>(p.mc * p.nc) * 2};
    const cuuint32_t box[3] = {64, 64, 1};
    tm_c = make_map(p.c_type, p.c, 3, dims, strides, box);
  }
  static const int max_clusters = cluster_count(reinterpret_cast<const void*>(kernel), kSmem);
  const int grid = kCluster * std::min(p.tiles, max_clusters);
  kernel<<<grid, kThreads, kSmem, s>>>(tm_c, kp);
  MOE_CUDA_CHECK(cudaGetLastError());
}

std::atomic<int64_t> g_panel_launches{0};

template <class T, class TC, int kS, int kP>
void launch_cols_panel(const ColGroupedProduct& p, const WParams& kp, Stream s) {
  constexpr int kSmem = PanelShape{kS, kP}.smem();
  auto kernel = grouped_cols_panel_kernel<T, TC, kS, kP>;
  static std::once_flag once;
  std::call_once(once, [&] {
    MOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  });
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.nc), static_cast<cuuint64_t>(p.mc),
                              static_cast<cuuint64_t>(p.groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.nc) * 2,
                                 static_cast<cuuint64_t>(p.mc * p.nc) * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  const CUtensorMap tm_c = make_map(p.c_type, p.c, 3, dims, strides, box);
  static const int max_clusters = cluster_count(reinterpret_cast<const void*>(kernel), kSmem);
  const int grid = kCluster * std::min(kp.tiles / kp.n_tiles, max_clusters);
  kernel<<<grid, kThreads, kSmem, s>>>(tm_c, kp);
  MOE_CUDA_CHECK(cudaGetLastError());
  g_panel_launches.fetch_add(1, std::memory_order_relaxed);
}

// 16-bit c without accumulation takes the asynchronous (TMA store) epilogue unless
// MOE_SM90_WGRAD_STORE=sync (benchmark knob: the epilogue through the warps' stores); fp32 c and
// accumulation always take the latter (fp32 c would need four staging rounds in the 32 KiB beside
// the 4 stages; TMA's reduction would round twice).
template <class T, class TC>
void launch_cols_typed(const ColGroupedProduct& p, const WParams& kp, Stream s) {
  if constexpr (sizeof(TC) == 2) {
    if (!p.accumulate && wgrad_store_tma()) {
      if (!wgrad_defer_store()) return launch_cols_kernel<T, TC, true>(p, kp, s);
      if (p.max_group_rows > 0 && p.max_group_rows <= kPanelRows && wgrad_panel_setting()) {
        WParams panel = kp;
        panel.pairs_inner = false;  // runs: one i-pair by every column tile (decode_w)
        return launch_cols_panel<T, TC, kPanel.stages, kPanel.blocks>(p, panel, s);
      }
      return launch_cols_kernel<T, TC, true, true>(p, kp, s);
    }
  }
  launch_cols_kernel<T, TC, false>(p, kp, s);
}

int bias_code(const RowGroupedProduct& p) {
  if (!p.bias) return 0;
  switch (p.bias_type) {
    case DType::f32:
      return 1;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 3;
    default:
      throw std::invalid_argument("bias: unsupported dtype " +
                                  std::string(dtype_name(p.bias_type)));
  }
}

// When the weight is streamed (on average at most kStreamedAverageRows rows per group: each weight
// tile serves one or two clusters, then is not read again), its loads are marked evict_first, the
// row operand's evict_last and the epilogue's stores evict_first: the row tile, which the group's
// other column tiles read, then stays in L2 instead of being re-read from DRAM. The store hint
// matters in dgrad, whose 0.94 GB of output (DeepSeek-like) otherwise pushed its row operand out:
// DRAM reads 8.55 -> 8.22 GB against a 7.78 GB minimum, dgrad 3-4% faster (docs/perf.md,
// session 20). MOE_SM90_HINTS forces them (l2_hints_setting).
void l2_hints(const RowGroupedProduct& p, KParams& kp) {
  const L2Hints forced = l2_hints_setting();
  constexpr int64_t kStreamedAverageRows = 2 * kBM * kCluster;  // 512: not sm90::kStreamRows
  const bool streamed = p.rows <= kStreamedAverageRows * p.groups;
  kp.hint_a = forced.a >= 0 ? forced.a : streamed ? 2 : 0;
  kp.hint_b = forced.b >= 0 ? forced.b : streamed ? 1 : 0;
  kp.hint_c = forced.c >= 0 ? forced.c : streamed ? 1 : 0;
}

// Banded walk (decode): bands of about kBandBytes of row operand, for groups whose row operand
// is over kBandOverBytes (far more than L2 holds) while their whole weight fits in kBandWeightBytes
// (so it stays in L2 across bands; else the bands would re-read the weight instead). On the
// DeepSeek-like forward: bands of 4 M-pairs (14.7 MB) in groups above 13 M-pairs (3.3k rows).
void band_params(const RowGroupedProduct& p, KParams& kp) {
  constexpr int64_t kBandBytes = int64_t{16} << 20, kBandOverBytes = int64_t{48} << 20,
                    kBandWeightBytes = int64_t{32} << 20;
  kp.band_over = INT_MAX;  // off
  kp.band_pairs = 1;
  const int64_t kc = p.a2 ? 2 * p.kc : p.kc;  // both pairs' operands
  if (p.band > 0) {
    kp.band_pairs = kp.band_over = p.band;
  } else if (p.band < 0 && kc * p.nc * 2 <= kBandWeightBytes) {
    const int64_t pair_bytes = kCluster * kBM * kc * 2;
    kp.band_pairs = static_cast<int>(std::max<int64_t>(1, kBandBytes / pair_bytes));
    kp.band_over = static_cast<int>(
        std::min<int64_t>(INT_MAX, std::max<int64_t>(kp.band_pairs, kBandOverBytes / pair_bytes)));
  }
}

// The wgrad table of one group: i-pairs of c[g]'s row tiles by column tiles (decode_w).
int64_t col_pairs(int64_t mc) {
  return ((mc + kBM - 1) / kBM + 1) / 2;
}
int64_t col_tiles(int64_t nc) {
  return (nc + kBN - 1) / kBN;
}

}  // namespace

int band_setting() {
  const char* e = std::getenv("MOE_SM90_BAND");
  if (!e || !*e || std::strcmp(e, "auto") == 0) return -1;
  if (std::strcmp(e, "off") == 0) return 0;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  if (*end == '\0' && v >= 1 && v <= 1 << 20) return static_cast<int>(v);
  throw std::invalid_argument(std::string("MOE_SM90_BAND: expected auto, off or a number of "
                                          "M-pairs from 1 to 1048576, got '") +
                              e + "'");
}

int fold_tail_setting() {
  const char* e = std::getenv("MOE_SM90_TAIL");
  if (!e || !*e || std::strcmp(e, "auto") == 0) return -1;
  if (std::strcmp(e, "fold") == 0) return 1;
  if (std::strcmp(e, "npair") == 0) return 0;
  if (std::strcmp(e, "kernel") == 0) return 2;
  throw std::invalid_argument(
      std::string("MOE_SM90_TAIL: expected auto, fold, kernel or npair, got '") + e + "'");
}

L2Hints l2_hints_setting() {
  const char* e = std::getenv("MOE_SM90_HINTS");
  L2Hints h;
  if (!e || !*e || std::strcmp(e, "auto") == 0) return h;
  const size_t n = std::strlen(e);
  bool ok = n == 2 || n == 3;
  for (size_t i = 0; ok && i < n; ++i) ok = e[i] >= '0' && e[i] <= '2';
  if (!ok)
    throw std::invalid_argument(std::string("MOE_SM90_HINTS: expected auto or 2 or 3 digits of 0 "
                                            "(evict_normal), 1 (evict_first), 2 (evict_last), "
                                            "got '") +
                                e + "'");
  h.a = e[0] - '0';
  h.b = e[1] - '0';
  h.c = n == 3 ? e[2] - '0' : 0;
  return h;
}

bool wide_store_setting() {
  return two_way_setting("MOE_SM90_STORE", "wide", "plain");
}

int row_store_setting() {
  const char* e = std::getenv("MOE_SM90_ROW_STORE");
  if (!e || !*e || std::strcmp(e, "defer") == 0) return 2;
  if (std::strcmp(e, "tma") == 0) return 1;
  if (std::strcmp(e, "sync") == 0) return 0;
  throw std::invalid_argument(
      std::string("MOE_SM90_ROW_STORE: expected defer, tma or sync, got '") + e + "'");
}

bool narrow_setting() {
  return two_way_setting("MOE_SM90_NARROW", "auto", "off");
}

bool mix_setting() {
  return two_way_setting("MOE_SM90_MIX", "auto", "off");
}

bool wgrad_store_tma() {
  return two_way_setting("MOE_SM90_WGRAD_STORE", "tma", "sync");
}

bool wgrad_defer_store() {
  return two_way_setting("MOE_SM90_WGRAD_DEFER", "on", "off");
}

bool dynamic_schedule() {
  return two_way_setting("MOE_SM90_SCHED", "dynamic", "static");
}

bool wgrad_panel_setting() {
  return two_way_setting("MOE_SM90_WGRAD_PANEL", "auto", "off");
}

int64_t wgrad_panel_launches() {
  return g_panel_launches.load(std::memory_order_relaxed);
}

bool available() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return false;
    if (major != 9 || minor != 0) return false;
    // The sm_90a image must be in this build (it is not when gpu/ was built for another arch).
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, grouped_rows_kernel<__nv_bfloat16, false, float, false>) ==
               cudaSuccess &&
           attr.binaryVersion == 90;
  }();
  return ok;
}

int64_t stages_freed_early() {
  unsigned long long n = 0;
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  MOE_CUDA_CHECK(cudaMemcpyFromSymbol(&n, g_stages_freed_early, sizeof n));
  return static_cast<int64_t>(n);
}

int64_t tiles_of_group(int64_t n_g, int64_t nc, bool fold_tail) {
  const int64_t m_tiles = (n_g + kBM - 1) / kBM, n_tiles = (nc + kBN - 1) / kBN;
  return m_tiles / 2 * n_tiles +
         (m_tiles % 2 && !(fold_tail && folds_tail(n_g))) * ((n_tiles + 1) / 2);
}

bool folds_tail(int64_t n_g) {
  return n_g >= kCluster * kBM && (n_g + 63) / 64 % 4 == 1;
}

bool fold_tail_pays(const int64_t* sizes, int64_t groups, int64_t nc) {
  int64_t table = 0, saved = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t plain = tiles_of_group(sizes[g], nc, false);
    table += plain;
    saved += plain - tiles_of_group(sizes[g], nc, true);
  }
  return saved > 0 && saved * 10 >= table;
}

std::vector<int32_t> mixed_order(const int64_t* sizes, const int64_t* tile_start, int64_t groups) {
  // Nothing to mix (the common case): said before the tile lists are built.
  bool any_dense = false, any_stream = false;
  for (int64_t g = 0; g < groups; ++g) {
    any_dense |= sizes[g] > kDenseRows;
    any_stream |= sizes[g] <= kStreamRows && tile_start[g + 1] > tile_start[g];
  }
  if (!any_dense || !any_stream) return {};
  std::vector<int32_t> dense, stream;  // dense: every group not streaming
  for (int64_t g = 0; g < groups; ++g) {
    auto& kind = sizes[g] > kStreamRows ? dense : stream;
    for (int64_t t = tile_start[g]; t < tile_start[g + 1]; ++t)
      kind.push_back(static_cast<int32_t>(t));
  }
  // Entry i of the order is dense while fewer than floor((i + 1) D / T) dense ones precede it: the
  // D dense entries spread evenly over the T (Bresenham), each kind keeping its table order.
  const int64_t D = static_cast<int64_t>(dense.size()), T = D + static_cast<int64_t>(stream.size());
  std::vector<int32_t> order;
  order.reserve(T);
  size_t di = 0, si = 0;
  for (int64_t i = 0; i < T; ++i) {
    const bool take_dense = static_cast<int64_t>(di) < (i + 1) * D / T;
    order.push_back(take_dense ? dense[di++] : stream[si++]);
  }
  return order;
}

bool supported(const RowGroupedProduct& p) {
  if (p.ab != DType::bf16 && p.ab != DType::f16) return false;
  if (p.c_type != p.ab && p.c_type != DType::f32) return false;
  if (p.kc <= 0 || p.nc <= 0 || p.kc % 8 != 0 || p.nc % 8 != 0) return false;
  if (p.rows <= 0 || p.rows > INT_MAX || p.kc > INT_MAX || p.nc > INT_MAX || p.groups > INT_MAX)
    return false;
  if (p.bias && p.bias_type != DType::f32 && p.bias_type != DType::bf16 &&
      p.bias_type != DType::f16)
    return false;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.c) || (p.bias && !aligned16(p.bias)))
    return false;
  if ((p.a2 == nullptr) != (p.b2 == nullptr)) return false;
  if (p.a2 && (!aligned16(p.a2) || !aligned16(p.b2) || 2 * ((p.kc + kBK - 1) / kBK) > INT_MAX))
    return false;
  return available();
}

void launch(const RowGroupedProduct& p, Stream s) {
  if (p.tiles <= 0) return;
  if (!supported(p)) throw std::invalid_argument("sm90 grouped GEMM: unsupported product");
  KParams kp{};
  kp.offsets = p.offsets;
  kp.tile_start = p.tile_start;
  kp.order = p.order;
  kp.tile_counter = p.tile_counter;
  kp.dynamic = p.tile_counter != nullptr;
  kp.groups = static_cast<int>(p.groups);
  kp.tiles = p.tiles;
  kp.rows = p.rows;
  kp.n_tiles = static_cast<int>((p.nc + kBN - 1) / kBN);
  kp.k_split = static_cast<int>((p.kc + kBK - 1) / kBK);
  // The second pair's blocks follow the first's; the first's last block is zero-filled past kc.
  kp.k_blocks = p.a2 ? 2 * kp.k_split : kp.k_split;
  kp.nc = p.nc;
  kp.c = p.c;
  kp.bias = p.bias;
  kp.bias_type = bias_code(p);
  kp.accumulate = p.accumulate;
  l2_hints(p, kp);
  band_params(p, kp);
  kp.wide_store = p.wide_store;
  kp.narrow = p.narrow;
  kp.row_store =
      !p.fold_tail && p.c_type != DType::f32 && !p.bias && !p.accumulate ? p.row_store : 0;
  const bool f16 = p.ab == DType::f16, c32 = p.c_type == DType::f32;
  if (p.b_k_major) {
    if (f16) {
      c32 ? launch_rows<__half, true, float>(p, kp, s)
          : launch_rows<__half, true, __half>(p, kp, s);
    } else {
      c32 ? launch_rows<__nv_bfloat16, true, float>(p, kp, s)
          : launch_rows<__nv_bfloat16, true, __nv_bfloat16>(p, kp, s);
    }
  } else {
    if (f16) {
      c32 ? launch_rows<__half, false, float>(p, kp, s)
          : launch_rows<__half, false, __half>(p, kp, s);
    } else {
      c32 ? launch_rows<__nv_bfloat16, false, float>(p, kp, s)
          : launch_rows<__nv_bfloat16, false, __nv_bfloat16>(p, kp, s);
    }
  }
}

int64_t col_tiles_of_group(int64_t n_g, int64_t mc, int64_t nc) {
  return n_g <= 0 ? 0 : col_pairs(mc) * col_tiles(nc);
}

bool supported(const ColGroupedProduct& p) {
  if (p.ab != DType::bf16 && p.ab != DType::f16) return false;
  if (p.c_type != p.ab && p.c_type != DType::f32) return false;
  if (p.mc <= 0 || p.nc <= 0 || p.mc % 8 != 0 || p.nc % 8 != 0) return false;
  if (p.rows <= 0 || p.rows > INT_MAX || p.mc > INT_MAX || p.nc > INT_MAX || p.groups > INT_MAX)
    return false;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.c)) return false;
  return available();
}

void encode_group_maps(const ColGroupedProduct& p, const WgradGroup* groups, int n, void* dst) {
  static_assert(sizeof(CUtensorMap) == kMapBytes, "descriptor size");
  auto* maps = static_cast<CUtensorMap*>(dst);
  const cuuint32_t box[2] = {64, kBK};  // 64 columns x 64 rows (kChunkBytes), MN-major operands
  for (int k = 0; k < n; ++k) {
    const int64_t off = groups[k].begin, n_g = groups[k].end - groups[k].begin;
    for (int o = 0; o < 2; ++o) {
      const int64_t cols = o == 0 ? p.mc : p.nc;
      const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(n_g)};
      const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
      const char* base = static_cast<const char*>(o == 0 ? p.a : p.b) + off * cols * 2;
      maps[o * n + k] = make_map(p.ab, base, 2, dims, strides, box);
    }
  }
}

void launch(const ColGroupedProduct& p, Stream s) {
  if (p.tiles <= 0) return;
  if (!p.maps || reinterpret_cast<uintptr_t>(p.maps) % kMapBytes != 0 || !p.group_list ||
      reinterpret_cast<uintptr_t>(p.group_list) % 16 != 0)
    throw std::invalid_argument(
        "sm90 grouped GEMM: wgrad groups or descriptors missing or "
        "misaligned");
  if (!supported(p)) throw std::invalid_argument("sm90 grouped GEMM: unsupported wgrad product");
  WParams kp{};
  static_assert(sizeof(WgradGroup) == sizeof(int4), "record");
  kp.groups = reinterpret_cast<const int4*>(p.group_list);
  kp.tiles = p.tiles;
  kp.n_tiles = static_cast<int>(col_tiles(p.nc));
  kp.m_pairs = static_cast<int>(col_pairs(p.mc));
  kp.per_group = kp.m_pairs * kp.n_tiles;
  kp.maps = static_cast<const CUtensorMap*>(p.maps);
  kp.n = p.groups_with_rows;
  if (p.tiles % kp.per_group != 0)
    throw std::invalid_argument("sm90 grouped GEMM: wgrad tiles not a multiple of the group's");
  // A wave of concurrent entries of a group larger than L2 streams the group's rows of a_g for
  // the wave's pairs and of b_g for its column tiles; over the group, the inner dimension is
  // covered by every wave and the outer one once. With P pairs, J column tiles and W entries a
  // wave, pairs inner streams about P^2 J / W + J tile-columns, columns inner P J^2 / W + P: the
  // shorter dimension goes inner (DeepSeek-like, 28 pairs x 8 columns: columns inner; Mixtral-like,
  // 16 x 56: pairs inner).
  kp.pairs_inner = kp.m_pairs <= kp.n_tiles;
  kp.mc = p.mc;
  kp.nc = p.nc;
  kp.c = p.c;
  // The gradient is written once and read by no tile of this launch: evict_first keeps a_g and b_g,
  // which every tile of the group reads, in L2 (DeepSeek-like skewed wgrad ~5% faster, session 20).
  const int forced_c = l2_hints_setting().c;
  kp.hint_c = forced_c >= 0 ? forced_c : 1;
  kp.accumulate = p.accumulate;
  const bool f16 = p.ab == DType::f16, c32 = p.c_type == DType::f32;
  if (f16) {
    c32 ? launch_cols_typed<__half, float>(p, kp, s) : launch_cols_typed<__half, __half>(p, kp, s);
  } else {
    c32 ? launch_cols_typed<__nv_bfloat16, float>(p, kp, s)
        : launch_cols_typed<__nv_bfloat16, __nv_bfloat16>(p, kp, s);
  }
}

}  // namespace moe::gpu::sm90
