// Our own Hopper (sm_90a) grouped GEMM for the row-grouped products of grouped_gemm (SPEC §10.1):
// forward c[o_g + i, :] = a[o_g + i, :] . w_g and dgrad c[o_g + i, :] = a[o_g + i, :] . w_g^T;
// and, opt-in (ColGroupedProduct below), the column-grouped wgrad c[g] = a_g^T . b_g.
// GemmImpl::sm90 issues them here; products it cannot take (see supported()) go to
// GemmImpl::chunked. Host header: no CUDA types.
//
// Why our own kernel: on the DeepSeek-like shape (256 experts of ~256 rows, K = 7168, N = 2048)
// every expert's weight is read once for few rows, so the product is near the H100's
// compute/bandwidth ridge; cuBLAS's pointer-array batching reached ~60% of a dense GEMM there.
// This kernel is persistent (one CTA per SM walks a tile list) and keeps the tensor cores fed:
//   - tiles of 128 rows x 256 columns; a tile starts at its group's row offset and may read
//     past the group's end (those rows are computed and not stored), so the row operand needs no
//     per-group copy or descriptor; rows past M_total are zero-filled by TMA;
//   - one producer warp issues TMA loads (128-byte swizzle) into a 4-stage ring of 48 KiB
//     stages guarded by mbarriers; two consumer warpgroups each run wgmma m64n256k16 with fp32
//     accumulators on one half of the tile's rows;
//   - CTAs run in clusters of two that share one operand tile: each loads half of it and
//     multicasts it to both. M-pairs (two row tiles of one column tile) share the weight tile
//     (L2 bandwidth, not the tensor cores, bounded the one-CTA version: 70% of dense on the
//     Mixtral-like shape at 6.3 TB/s of L2 reads). A group's last row tile, when its row-tile
//     count is odd, runs as N-pairs (one row tile, two column tiles sharing the row tile): as an
//     M-pair its partner would compute rows of nothing and the weight would be read twice; and a
//     64-row half past the group's end is neither loaded nor multiplied. On the DeepSeek-like
//     shape (groups of ~256 +- 16 rows) the M-pair-only version read 15.3 GB from DRAM for an
//     8.7 GB minimum and ran at 42% of dense. Where the odd tile holds at most 64 rows past the
//     M-pairs (folds_tail), the group's last M-pair computes them too instead: each of its four
//     consumer warpgroups multiplies those rows by a quarter of the weight tile it already holds,
//     so the weight is streamed once. It does so transposed (the quarter's 64 columns as wgmma's
//     rows, the tail's rows as its N, rounded up to 16, 32 or 64: tail_width), so a tail of 1-16
//     rows costs a quarter of a 64-row product (session 26: the DeepSeek-like forward and dgrad
//     2-3% faster); the second CTA loads its 32 tail rows only for a tail of more than 32;
//   - the table lists every reader of one weight tile next to each other, groups in order, so
//     they run at about the same time and the weight is read from DRAM once; except in a group
//     whose row operand is far larger than L2 while its weight fits (the DeepSeek-like skewed
//     case's 40k-row expert): there columns by turn would stream the whole row operand from DRAM
//     once per column tile, so the table walks it in bands of rows, every column of a band
//     together;
//   - where some groups are dense (more than kDenseRows rows: bound by the tensor cores) and others
//     stream their weight (at most kStreamRows rows: bound by DRAM), clusters draw the streaming
//     entries mixed evenly among the others (mixed_order), so both kinds run at once instead of one
//     after the other;
//   - clusters draw table entries from a per-launch atomic counter as they free up, not by a
//     fixed stride: with the stride they drifted apart, the readers of one weight tile no longer
//     ran together and re-read it from DRAM (first version, docs/perf.md: 4292 -> 4105 us,
//     11.7 -> 10.8 GB on the DeepSeek-like shape; MOE_SM90_SCHED=static for A/B);
//   - rank 0's producer draws the next entry while the current one loads and hands it to both
//     CTAs through a 2-slot shared-memory ring; each slot's readers (lane 0 of every consumer
//     warp, which shuffles the entry to its warp, and the other CTA's producer) release it with
//     their own mbarrier arrival (racecheck flagged a handoff that delegated the arrival);
//   - where the weight is streamed (few rows per group) its loads are marked L2 evict_first, so
//     the row tile, which the group's other column tiles read, stays in L2 (12.7 GB of DRAM reads
//     instead of 15.3 GB on the M-pair-only version);
//   - the epilogue adds the bias (or the current c, when accumulating) in fp32 and rounds once;
//   - a product may carry a second operand pair (RowGroupedProduct::a2: the FFN's grad x =
//     d_gate wi_0^T + d_up wi_1^T), whose k-blocks follow the first pair's in the same k-loop, so
//     the sum is rounded once with no fp32 buffer between two products.
// Each output element is one CTA's fixed-order fp32 sum: the result depends only on the
// problem, not on scheduling (bitwise deterministic).
#pragma once

#include <cstdint>
#include <vector>

#include "gpu/runtime.cuh"
#include "harness/core/dtype.h"

namespace moe::gpu::sm90 {

constexpr int64_t kTileRows = 128, kTileCols = 256;

// True when the current device is an sm_90 GPU (H100/H200) and this build carries the sm_90a
// kernel.
bool available();

// One row-grouped product over a plan, all pointers on the device.
//   b_k_major = false (fwd):  B_g[k][n] = b[g][k][n]  (b is [G, Kc, Nc])
//   b_k_major = true (dgrad): B_g[k][n] = b[g][n][k]  (b is [G, Nc, Kc])
// c[r, :] (=|+=) a[r, :] . B_g (+ bias[g, :]) for the rows r of group g; other rows untouched.
struct RowGroupedProduct {
  bool b_k_major = false;
  DType ab = DType::bf16;   // bf16 or f16
  const void* a = nullptr;  // [rows, Kc]
  const void* b = nullptr;
  int64_t rows = 0, kc = 0, nc = 0, groups = 0;
  DType c_type = DType::bf16;  // ab or f32
  void* c = nullptr;           // [rows, Nc]
  bool accumulate = false;
  const void* bias = nullptr;  // [G, Nc] or null
  DType bias_type = DType::f32;
  // A second operand pair of the same shapes and layouts, summed into the same fp32 accumulators
  // (the contraction runs over a's Kc columns, then a2's): c (=|+=) a . B_g + a2 . B2_g (+ bias),
  // rounded once. The FFN's grad x = d_gate wi_0^T + d_up wi_1^T takes it, instead of two products
  // through an fp32 buffer and a rounding pass. Both null: one pair.
  const void* a2 = nullptr;
  const void* b2 = nullptr;
  const int64_t* offsets = nullptr;     // [G + 1] group row offsets (device)
  const int32_t* tile_start = nullptr;  // [G + 1] first table entry of each group (device)
  int32_t tiles = 0;                    // tile_start[G] (see tiles_of_group)
  // [tiles] the order clusters draw the entries in: the d-th drawn is entry order[d] (device; a
  // permutation, see mixed_order). Null: table order.
  const int32_t* order = nullptr;
  // Dynamic schedule: one int32 (device) that is zero when this launch's kernel starts; the
  // kernel draws table entries from it, so each launch needs its own. Null: static schedule.
  int32_t* tile_counter = nullptr;
  // Banded walk of large groups (band_setting()): -1 auto, 0 off, n bands of n M-pairs in every
  // group of more than n.
  int band = -1;
  // Groups with folds_tail() compute their last 64-row slot with their last M-pair instead of as
  // N-pairs; the launch runs the kernel variant whose stages hold those rows. Must match the
  // table (tiles_of_group's fold_tail). See fold_tail_pays for when to set it.
  bool fold_tail = false;
  // The forward / dgrad epilogue of 16-bit c without bias or accumulation in 16-byte pieces
  // (wide_store_setting).
  bool wide_store = false;
  // The kernel without folded tails writes 16-bit c without bias or accumulation by TMA stores
  // from shared memory where a warpgroup's 64 rows are all the group's: 1 after the tile's
  // products, 2 during the next tile's; 0 never (row_store_setting).
  int row_store = 0;
  // A consumer warpgroup whose 64 rows hold at most 32 of the group's (a group's last rows) takes
  // the transposed product at their width, 16 or 32, instead of all 64 (narrow_setting).
  bool narrow = true;
  // At most this many clusters (0: as many as fit): leaves the other SMs to work on other streams
  // (GemmImpl::split).
  int max_clusters = 0;
};

// MOE_SM90_BAND, the walk of a group far larger than L2 (gpu/grouped_gemm_sm90.cu, decode):
// unset, empty or "auto" -1 (banded where the group's row operand is over 48 MiB and its weight
// under 32 MiB), "off" 0 (by column pairs everywhere), n >= 1 (bands of n M-pairs wherever a group
// has more: tests, A/B); anything else throws std::invalid_argument naming it. Read on every call.
int band_setting();

// MOE_SM90_TAIL: unset, empty or "auto" -1 (fold where fold_tail_pays), "fold" 1 (wherever a group
// folds: tests, A/B), "npair" 0 (never: the last slot's row tile runs as N-pairs), "kernel" 2 (the
// folding kernel even where no group folds: its cost on the plain kernel's work, A/B); anything
// else throws std::invalid_argument naming it. Read on every call.
int fold_tail_setting();

// L2 eviction priorities of the sm90 kernels' memory traffic, as PTX createpolicy codes (0
// evict_normal, 1 evict_first, 2 evict_last): a the row operand's loads, b the weight's, c the
// epilogue's 16-bit stores (the row kernel's store_block_wide, the wgrad kernel's TMA stores); -1
// the kernel's own choice (grouped_gemm_sm90.cu, l2_hints; wgrad: c = 1).
struct L2Hints {
  int a = -1, b = -1, c = -1;
};

// MOE_SM90_HINTS: unset, empty or "auto" every field -1; "ab" or "abc" (digits 0-2: A/B) forces
// them, two digits with c = 0; anything else throws std::invalid_argument naming it. Read on
// every call.
L2Hints l2_hints_setting();

// MOE_SM90_STORE (RowGroupedProduct::wide_store): unset, empty or "wide" true (16-byte stores
// after a transpose within each quad of lanes), "plain" false (4-byte stores from the
// accumulator fragments: A/B); anything else throws std::invalid_argument naming it. Read on
// every call.
bool wide_store_setting();

// MOE_SM90_ROW_STORE (RowGroupedProduct::row_store): unset, empty or "defer" 2 (the forward /
// dgrad kernel's TMA-store epilogue where it applies, written during the next tile's products),
// "tma" 1 (the same, after the tile's products), "sync" 0 (the warps' stores): A/B; anything else
// throws std::invalid_argument naming it. Read on every call.
int row_store_setting();

// MOE_SM90_NARROW (RowGroupedProduct::narrow): unset, empty or "auto" true (a warpgroup's rows
// of at most 32 multiplied transposed at their width), "off" false (always 64 rows: A/B);
// anything else throws std::invalid_argument naming it. Read on every call.
bool narrow_setting();

// How many stages the kernels' consumer warps freed before a wgmma wait covered their products,
// since the process started (consume_stages checks its own order on every release): 0 unless a
// change broke the stage protocol. The tests read it; synchronizes the device.
int64_t stages_freed_early();

// MOE_SM90_MIX: unset, empty or "auto" true (draw entries in mixed_order where it mixes), "off"
// false (table order); anything else throws std::invalid_argument naming it. Read on every call.
bool mix_setting();

// MOE_SM90_WGRAD_STORE: unset, empty or "tma" true (the wgrad kernel's asynchronous TMA-store
// epilogue for 16-bit c without accumulation), "sync" false (its epilogue through the warps'
// stores everywhere: A/B); anything else throws std::invalid_argument naming it. Read on every
// call.
bool wgrad_store_tma();

// MOE_SM90_WGRAD_DEFER: unset, empty or "on" true (the TMA epilogue writes each tile's block while
// the next tile's products run, from the block rounded into registers), "off" false (it writes
// the block after the tile's products, while the tensor cores wait: A/B); anything else throws
// std::invalid_argument naming it. Read on every call. Same bits either way.
bool wgrad_defer_store();

// MOE_SM90_WGRAD_PANEL: unset, empty or "auto" true (the panel wgrad kernel where it applies:
// every group of at most kPanelRows rows, 16-bit c written, the deferred TMA epilogue; see
// ColGroupedProduct), "off" false (grouped_cols_kernel everywhere: A/B); anything else throws
// std::invalid_argument naming it. Read on every call. Same bits either way.
bool wgrad_panel_setting();
// Launches of the panel wgrad kernel since the process started (the tests read it).
int64_t wgrad_panel_launches();

// Whether callers should pass a tile_counter: MOE_SM90_SCHED unset, empty or "dynamic" (true),
// or "static" (false); anything else throws std::invalid_argument. Read on every call.
bool dynamic_schedule();

// Whether launch() takes the product: available(), 16-bit operands, Kc and Nc multiples of 8
// (TMA strides are multiples of 16 bytes), 16-byte aligned a, b and c, rows and tiles in range.
bool supported(const RowGroupedProduct& p);
// Entries of the tile table for group g (one per cluster): with m = ceil(n_g / kTileRows) row
// tiles and n = ceil(Nc / kTileCols) column tiles, floor(m / 2) * n M-pairs plus, for odd m,
// ceil(n / 2) N-pairs, unless fold_tail and folds_tail(n_g).
int64_t tiles_of_group(int64_t n_g, int64_t nc, bool fold_tail);
// Whether a group of n_g rows has a tail to fold: 4 j + 1 slots of 64 rows with j >= 1 (257..320,
// 513..576, ... rows), i.e. at least one M-pair and one slot past the M-pairs. Its last row tile,
// as N-pairs, would stream the group's whole weight once more for at most 64 rows (on the
// DeepSeek-like forward, groups of 256 +- 16 rows, those N-pairs cost 0.6 ms of 3.9).
bool folds_tail(int64_t n_g);
// Whether a table over these group sizes should fold (RowGroupedProduct::fold_tail). The folding
// kernel runs all its entries slower (H100, session 14: 3-9% where nothing folds; its larger
// stages leave less L1), while each folding group saves ceil(n / 2) N-pair entries, each streaming
// as much weight as an M-pair entry. So: fold where the saved entries are at least a tenth of the
// table's. The DeepSeek-like forward (groups of 256 +- 16 rows) saves a fifth; a Mixtral-like one
// (8 groups of ~4k rows, two of which fold) under 1%.
bool fold_tail_pays(const int64_t* sizes, int64_t groups, int64_t nc);
// A group of n rows does n FLOPs per byte of its weight; an H100's ridge is about 300 FLOPs per
// DRAM byte. A group of at most kStreamRows rows (two row tiles: each weight tile is read by one
// table entry) is bound by streaming its weight from DRAM; one of more than kDenseRows rows by the
// tensor cores (each weight tile serves 4+ entries from L2).
constexpr int64_t kStreamRows = 256, kDenseRows = 1024;
// CTAs per cluster (two adjacent row tiles sharing one multicast weight tile): each cluster holds
// kClusterSize SMs (RowGroupedProduct::max_clusters).
constexpr int kClusterSize = 2;
// The draw order of a table (RowGroupedProduct::order) whose groups g own the entries
// [tile_start[g], tile_start[g + 1]): the streaming groups' entries (sizes[g] <= kStreamRows)
// merged evenly with the other groups', each kind in table order, so that some clusters stream
// weights from DRAM while the others multiply (in table order the DeepSeek-like skewed forward ran
// its dense groups and its ~200 streaming ones one after the other). Only where the table has both
// a dense group (above kDenseRows) and a streaming one; else empty (table order). Groups in
// between go with the dense ones: spreading their entries apart would have their M-pairs re-read
// weight tiles from DRAM (the Mixtral-like skewed product, groups of 331-21487 rows, ran 6-8%
// slower with them as the streaming kind).
std::vector<int32_t> mixed_order(const int64_t* sizes, const int64_t* tile_start, int64_t groups);
void launch(const RowGroupedProduct& p, Stream s);

// A group with rows, as the wgrad kernel reads it (16 bytes): its index, first row and end.
struct WgradGroup {
  int32_t g, begin, end, unused;
};

// One column-grouped product (grouped_gemm's wgrad), all pointers on the device:
//   c[g] (=|+=) a_g^T . b_g for every group g with rows, where a_g = a[o_g : o_g + n_g, :] and
//   b_g likewise: the reduction runs over the group's rows. Groups without rows get no entries
//   (their c[g] untouched: the caller zeroes them).
// Kernel (grouped_cols_kernel): the forward's pipeline and clusters, a static schedule; each
// cluster computes two 128 x 256 tiles of c[g] in adjacent row tiles that share b_g's column tile,
// over blocks of 64 of the group's rows. Each group's operands are loaded through TMA descriptors
// of their own (encode_group_maps), whose row extent ends at the group's end: TMA zero-fills a
// block's rows past it, which would otherwise hold the next group's rows. A 16-bit c written
// (not accumulated) goes out through shared memory by TMA stores (a 3-d map of c, so a box's rows
// past mc are not written into c[g + 1]) while the next tile's products run; fp32 c and
// accumulation take the warps' own stores (wgrad_store_tma). Bitwise deterministic like the
// forward.
struct ColGroupedProduct {
  DType ab = DType::bf16;   // bf16 or f16
  const void* a = nullptr;  // [rows, mc]
  const void* b = nullptr;  // [rows, nc]
  int64_t rows = 0, mc = 0, nc = 0, groups = 0;
  DType c_type = DType::bf16;  // ab or f32
  void* c = nullptr;           // [G, mc, nc]
  bool accumulate = false;
  const WgradGroup* group_list = nullptr;  // the groups with rows, in order (device, 16-aligned)
  int32_t groups_with_rows = 0;
  // [2 * groups_with_rows] descriptors (device, kMapBytes-aligned): a_g's, then b_g's, in the
  // order of group_list (encode_group_maps).
  const void* maps = nullptr;
  // Sum of col_tiles_of_group: the number of groups with rows times the entries of one.
  int32_t tiles = 0;
  // The most rows of any group (0: not known). At most kPanelRows (384) lets the panel kernel take
  // the product: a CTA's 128 columns of a_g stay in shared memory over the group's column tiles.
  int64_t max_group_rows = 0;
};
constexpr int64_t kPanelRows = 384;

// Whether launch() takes the product: available(), 16-bit operands, mc and nc multiples of 8,
// 16-byte aligned a, b and c, rows and sizes in range.
bool supported(const ColGroupedProduct& p);
// Entries of the wgrad table for a group of n_g rows: 0 when empty, else
// ceil(ceil(mc / kTileRows) / 2) * ceil(nc / kTileCols).
int64_t col_tiles_of_group(int64_t n_g, int64_t mc, int64_t nc);
// Bytes of one TMA descriptor (CUtensorMap), its alignment too.
constexpr size_t kMapBytes = 128;
// Writes the 2 * n descriptors of p.maps to host memory dst (kMapBytes-aligned) for the groups
// groups[0..n) (host): a_g = a[begin : end, :] as an [end - begin, mc] tensor, then b_g likewise.
void encode_group_maps(const ColGroupedProduct& p, const WgradGroup* groups, int n, void* dst);
void launch(const ColGroupedProduct& p, Stream s);

}  // namespace moe::gpu::sm90
