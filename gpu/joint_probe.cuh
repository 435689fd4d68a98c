// A joint yardstick for GEMM-like kernels on sm_90 (H100/H200): how fast can ANY kernel do a
// product's tensor-core work and its DRAM traffic at the same time on this board?
//
// Why: bench's roofline (harness/ops/roofline.h) is max(flops / dense cuBLAS rate, bytes / copy
// bandwidth), each rate measured alone. At the DeepSeek-like expert shape both terms are close
// (2.7 vs 2.9 ms on an H100), and the board is power-capped: the dense GEMM alone already runs at
// the 700 W cap (docs/perf.md, session 10). Two kernels on two streams do not overlap (session 11),
// so only one kernel doing both shows what the pair costs together.
//
// The probe kernel does the least any such kernel must, with none of its dependencies:
//   - `stages` weight-like stages: 32 KiB of bf16 (one 256 x 64 K-major, 128-byte-swizzled tile)
//     bulk-copied from DRAM into a 4-stage shared-memory ring, each used by two passes of
//     wgmma m64n256k16 (both consumer warpgroups, a resident 128 x 64 row tile): 256 FLOP per
//     streamed byte, the expert weight's reuse at ~256 rows per expert. Where a product reads
//     less than a tile a stage (wgrad), runs of stages copy one tile: from DRAM once, then L2;
//   - `extra` bytes more read from DRAM (the row operand's one read), spread over the stages;
//   - `stores` of each CTA's two accumulators as bf16 (64 KiB each), spread over the stages, on
//     one of three store paths (JointStore).
// One persistent CTA per SM, every CTA a contiguous share of the stages. There is no L2 reuse to
// arrange, no group boundary, no schedule and no epilogue dependence: a real kernel of the same
// FLOPs and bytes does at least this work. mode `mma` leaves out the copies (the tile stays
// resident), mode `stream` the products, mode `store` both: each part alone, to show the probe
// reaches the dense, copy and memset rates (else it bounds nothing). It is a yardstick, not a
// bound: a slow probe proves nothing about other kernels, a fast one that the work fits.
#pragma once

#include <cstdint>

#include "gpu/runtime.cuh"

namespace moe::gpu::sm90 {

// store: the stores alone (no loads, no products): what one CTA per SM writes on each store path.
enum class JointMode : uint8_t { joint, mma, stream, store };

// How a consumer warpgroup writes its 64 x 256 bf16 fragment (32 KiB) at a store:
//   st32:  4-byte stores from registers, a warp instruction one 128-byte line;
//   st128: 16-byte stores from registers, a warp instruction four lines (512 bytes);
//   bulk:  4-byte shared-memory stores into a 32 KiB staging buffer of the warpgroup, then one
//          bulk copy (cp.async.bulk, the TMA engine) of the 32 KiB to global memory; the buffer is
//          reused once that copy has read it. Needs 64 KiB of shared memory beside the stages.
// Which store path lets one CTA per SM write at the DRAM's write bandwidth is what wgrad (7.5 GB
// of stores for 1.2 GB of reads) turns on.
enum class JointStore : uint8_t { st32, st128, bulk };

constexpr int64_t kJointStageBytes = 32 * 1024;  // streamed per stage (the MMAs' B tile)
constexpr double kJointStageFlops = 2.0 * 128 * 256 * 64 * 2;  // two passes of 128 x 256 x 64
constexpr int64_t kJointStoreBytes = 64 * 1024;  // one store: two 64 x 256 bf16 fragments

struct JointWork {
  int64_t stages = 0;  // weight-like stages (flops = stages * kJointStageFlops)
  int64_t extra = 0;   // more bytes read, a multiple of 16
  int64_t stores = 0;  // stores of kJointStoreBytes, at most `stages`
  // Distinct tiles streamed, at most `stages` (0: one a stage). Fewer: runs of consecutive stages
  // copy one tile (joint_tile_of), the first copy from DRAM and the rest from L2, as wgrad's
  // operands (one group's rows, ~4.7 MB) serve every output tile of the group.
  int64_t tiles = 0;
};

// The tiles a work streams (JointWork::tiles, 0 meaning one a stage).
inline int64_t joint_streamed_tiles(const JointWork& w) {
  return w.tiles == 0 ? w.stages : w.tiles;
}

// The work of a product of `flops` that must read `read_bytes` and write `write_bytes` at the
// least: flops rounded up to whole stages, writes to whole stores; the reads as one tile a stage
// plus extra bytes, or, where they are fewer than a tile a stage (wgrad: 1.2 GB read, 7.5 GB
// written), as the fewest whole tiles that cover them.
JointWork joint_work_for(double flops, double read_bytes, double write_bytes);

// True when the current device is an sm_90 GPU and this build carries the probe's sm_90a image.
bool joint_probe_available();

#ifdef __CUDACC__
#define MOE_JOINT_HD __host__ __device__ __forceinline__
#else
#define MOE_JOINT_HD inline
#endif

// Stage s's extra reads: bytes [16 floor(s X / S), 16 floor((s + 1) X / S)) of the extra buffer,
// X = extra / 16, S = stages.
MOE_JOINT_HD void joint_extra_range(int64_t stages, int64_t extra16, int64_t s, int64_t& off,
                                    int64_t& len) {
  const int64_t a = s * extra16 / stages, b = (s + 1) * extra16 / stages;
  off = 16 * a;
  len = 16 * (b - a);
}
// The store made after stage s (of `stores` <= `stages`, spread evenly), or -1.
MOE_JOINT_HD int64_t joint_store_at(int64_t stages, int64_t stores, int64_t s) {
  if (stores == 0) return -1;
  const int64_t before = s * stores / stages, after = (s + 1) * stores / stages;
  return after > before ? before : -1;
}
// The tile stage s copies: tiles spread evenly over the stages, in order.
MOE_JOINT_HD int64_t joint_tile_of(int64_t stages, int64_t tiles, int64_t s) {
  return tiles == 0 ? s : s * tiles / stages;
}
// Word (4 bytes: a bf16 pair) of a store's 8192-word fragment that holds pair i (0..63, the
// accumulator's elements 2i and 2i + 1) of consumer thread t (0..127).
MOE_JOINT_HD int64_t joint_out_word(JointStore store, int64_t i, int64_t t) {
  return store == JointStore::st128 ? (i / 4) * 512 + t * 4 + i % 4 : i * 128 + t;
}
// CTA c of n runs stages [joint_first_stage(S, c, n), joint_first_stage(S, c + 1, n)).
MOE_JOINT_HD int64_t joint_first_stage(int64_t stages, int64_t cta, int64_t ctas) {
  return stages * cta / ctas;
}

// Device buffers for one JointWork: the streamed tiles, the extra bytes, the row tile (bf16
// values uniform in [-1, 1], as GemmBench fills its operands) and the stores.
class JointProbe {
 public:
  explicit JointProbe(const JointWork& w);

  // One launch; `ctas` 0 means one per SM. Throws std::invalid_argument where `bulk`'s staging
  // does not fit beside the stages (bulk_fits).
  void launch(JointMode mode, Stream s = nullptr, int ctas = 0,
              JointStore store = JointStore::st32);
  // Median milliseconds of `reps` launches after `warmup`.
  double median_ms(JointMode mode, int warmup, int reps, Stream s = nullptr,
                   JointStore store = JointStore::st32);
  bool bulk_fits() const;

  const JointWork& work() const { return work_; }
  // What the kernel reads ([tiles * kJointStageBytes / 2], [extra / 2], [128 * 64] bf16) and
  // writes ([stores * kJointStoreBytes / 2] bf16); tests fill and read them.
  DeviceTensor& tiles() { return tiles_; }
  DeviceTensor& extra() { return extra_; }
  DeviceTensor& rows() { return rows_; }
  DeviceTensor& out() { return out_; }

 private:
  JointWork work_;
  DeviceTensor tiles_, extra_, rows_, out_;
};

}  // namespace moe::gpu::sm90
