// The joint yardstick's kernel (gpu/joint_probe.cuh). Compiled for sm_90a only, like
// gpu/grouped_gemm_sm90.cu (CMakeLists.txt: moe_gpu_sm90).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "gpu/bulk_copy.cuh"
#include "gpu/device_util.cuh"
#include "gpu/grouped_gemm.cuh"
#include "gpu/grouped_gemm_sm90.cuh"
#include "gpu/joint_probe.cuh"
#include "gpu/wgmma.cuh"

namespace moe::gpu::sm90 {

namespace {

constexpr int kStages = 4, kThreads = 384;  // warpgroup 0: producer; 1 and 2: consumers
constexpr int kRowBytes = 128 * 64 * 2;     // the resident row tile, 128 x 64 bf16
constexpr int kPiece = 4096;                // bytes per bulk copy
constexpr int64_t kMaxExtraPerStage = 16 * 1024;

struct JParams {
  const uint8_t* tiles;                      // tiles x kJointStageBytes
  const uint8_t* extra;                      // extra bytes
  const uint8_t* rows;                       // kRowBytes
  uint32_t* out;                             // stores x kJointStoreBytes
  int64_t stages, extra16, stores, n_tiles;  // n_tiles: JointWork::tiles
  int extra_slot;  // shared-memory bytes per stage for the extra reads (multiple of 1024)
  int mode;        // JointMode
  int store;       // JointStore
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_JOINT_KERNEL 1
#endif

#ifdef MOE_JOINT_KERNEL
using namespace moe::gpu::bulk;
using namespace moe::gpu::wgmma;

// Two passes of the stage's tile against this warpgroup's 64 rows (d += A B twice: the FLOPs of
// 256 rows per streamed byte; the sum is what the test checks).
__device__ __forceinline__ void two_passes(float (&acc)[128], uint32_t sa, uint32_t sb) {
  wgmma_fence();
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n256k16<__nv_bfloat16, 0, 0>(acc, make_desc(sa + kk * 32, 16, 1024),
                                            make_desc(sb + kk * 32, 16, 1024));
  }
  wgmma_commit();
}

__device__ __forceinline__ uint32_t bf16_pair(const float (&acc)[128], int i) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Store u: this warpgroup's 64 x 256 fragment as bf16, pair i of thread t at word
// (u * 2 + cw) * 8192 + joint_out_word(store, i, t). bulk: staged (`stage`, 32 KiB) and copied by
// the warpgroup's thread 0, whose earlier copy `pending` says is still to be waited for.
__device__ __forceinline__ void store_fragment(uint32_t* out, int64_t u, int cw,
                                               const float (&acc)[128], JointStore store,
                                               uint8_t* stage, bool& pending) {
  const int t = threadIdx.x % 128;
  uint32_t* o = out + (u * 2 + cw) * 8192;
  if (store == JointStore::st32) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[joint_out_word(JointStore::st32, i, t)] = bf16_pair(acc, i);
  } else if (store == JointStore::st128) {
#pragma unroll
    for (int q = 0; q < 16; ++q)
      *reinterpret_cast<uint4*>(o + joint_out_word(JointStore::st128, 4 * q, t)) =
          make_uint4(bf16_pair(acc, 4 * q), bf16_pair(acc, 4 * q + 1), bf16_pair(acc, 4 * q + 2),
                     bf16_pair(acc, 4 * q + 3));
  } else {
    // The previous copy has read the buffer before anyone overwrites it.
    if (t == 0 && pending) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
    const uint32_t base = smem_addr(stage);
#pragma unroll
    for (int i = 0; i < 64; ++i)
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(
                       base + 4 * static_cast<uint32_t>(joint_out_word(store, i, t))),
                   "r"(bf16_pair(acc, i))
                   : "memory");
    // Every thread's writes are visible to the async proxy before thread 0 starts the copy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
    if (t == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(o),
                   "r"(base), "r"(static_cast<uint32_t>(kJointStoreBytes / 2))
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    pending = true;
  }
}
#endif

__global__ void __launch_bounds__(kThreads, 1) joint_kernel(const JParams p) {
#ifdef MOE_JOINT_KERNEL
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023));
  const int slot_bytes = static_cast<int>(kJointStageBytes) + p.extra_slot;
  uint8_t* rows = smem + kStages * slot_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(rows + kRowBytes);
  uint64_t* empty = full + kStages;
  uint64_t* rows_ready = empty + kStages;
  const JointStore store = static_cast<JointStore>(p.store);
  // bulk's staging, 32 KiB a consumer warpgroup, 1024-aligned past the barriers.
  uint8_t* staging = rows + kRowBytes + 1024;
  const int64_t first = joint_first_stage(p.stages, blockIdx.x, gridDim.x);
  const int64_t last = joint_first_stage(p.stages, blockIdx.x + 1, gridDim.x);
  const JointMode mode = static_cast<JointMode>(p.mode);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);  // every consumer thread arrives
    }
    mbar_init(rows_ready, 1);
    mbar_init_fence();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    const uint64_t pol = evict_first_policy();
    // Tiles that several stages copy are read again from L2 within microseconds: evict_normal,
    // not evict_first, lest 7.5 GB of stores push them out first (wgrad).
    uint64_t tile_pol = pol;
    if (p.n_tiles != 0)
      asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(tile_pol));
    mbar_arrive_expect_tx(rows_ready, kRowBytes);
    for (int c = 0; c < kRowBytes; c += kPiece)
      copy_g2s(rows + c, p.rows + c, kPiece, rows_ready, pol);
    // mode mma: one tile into slot 0, multiplied by every stage; mode store: none.
    const int64_t loads = mode == JointMode::store ? 0
                          : mode == JointMode::mma ? std::min<int64_t>(1, last - first)
                                                   : last - first;
    for (int64_t i = 0; i < loads; ++i) {
      const int64_t s = first + i;
      const int slot = static_cast<int>(i % kStages);
      mbar_wait(&empty[slot], static_cast<uint32_t>((i / kStages) & 1) ^ 1);
      uint8_t* dst = smem + slot * slot_bytes;
      int64_t eoff = 0, elen = 0;
      if (mode != JointMode::mma) joint_extra_range(p.stages, p.extra16, s, eoff, elen);
      mbar_arrive_expect_tx(&full[slot], static_cast<uint32_t>(kJointStageBytes + elen));
      const uint8_t* src = p.tiles + joint_tile_of(p.stages, p.n_tiles, s) * kJointStageBytes;
      for (int c = 0; c < kJointStageBytes; c += kPiece)
        copy_g2s(dst + c, src + c, kPiece, &full[slot], tile_pol);
      for (int64_t c = 0; c < elen; c += kPiece)
        copy_g2s(dst + kJointStageBytes + c, p.extra + eoff + c,
                 static_cast<uint32_t>(std::min<int64_t>(kPiece, elen - c)), &full[slot], pol);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int cw = wg - 1;
  uint8_t* stage_out = staging + cw * (kJointStoreBytes / 2);
  bool pending = false;  // bulk: a copy from stage_out may still be reading it
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  mbar_wait(rows_ready, 0);
  const uint32_t sa = smem_addr(rows) + cw * (64 * 128);
  if (mode == JointMode::store) {
    for (int64_t s = first; s < last; ++s)
      if (const int64_t u = joint_store_at(p.stages, p.stores, s); u >= 0)
        store_fragment(p.out, u, cw, acc, store, stage_out, pending);
    if (pending && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    return;
  }
  if (mode == JointMode::mma) {
    if (last > first) mbar_wait(&full[0], 0);
    const uint32_t sb = smem_addr(smem);
    for (int64_t s = first; s < last; ++s) {
      two_passes(acc, sa, sb);
      wgmma_wait<1>();
      if (const int64_t u = joint_store_at(p.stages, p.stores, s); u >= 0) {
        wgmma_wait<0>();
        store_fragment(p.out, u, cw, acc, store, stage_out, pending);
      }
    }
    wgmma_wait<0>();
    if (pending && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    return;
  }
  int prev = -1;
  for (int64_t i = 0; i < last - first; ++i) {
    const int64_t s = first + i;
    const int slot = static_cast<int>(i % kStages);
    mbar_wait(&full[slot], static_cast<uint32_t>((i / kStages) & 1));
    if (mode == JointMode::joint) {
      two_passes(acc, sa, smem_addr(smem + slot * slot_bytes));
      wgmma_wait<1>();  // the previous stage's products are done: release its slot
    }
    if (prev >= 0) mbar_arrive(&empty[prev]);
    prev = slot;
    if (const int64_t u = joint_store_at(p.stages, p.stores, s); u >= 0) {
      wgmma_wait<0>();
      store_fragment(p.out, u, cw, acc, store, stage_out, pending);
    }
  }
  wgmma_wait<0>();
  // No arrive for the last slot: the producer has nothing left to load. The copies are done
  // before the CTA (and its shared memory) goes.
  if (pending && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

int device_sms() {
  int dev = 0, sms = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

int extra_slot_bytes(const JointWork& w) {
  if (w.stages == 0) return 0;
  const int64_t per = (w.extra / 16 + w.stages - 1) / w.stages * 16;
  return static_cast<int>((per + 1023) / 1024 * 1024);
}

const JointWork& validated(const JointWork& w) {
  if (w.stages < 0 || w.extra < 0 || w.extra % 16 != 0 || w.stores < 0 || w.stores > w.stages ||
      w.tiles < 0 || w.tiles > w.stages ||
      (w.stages > 0 && (w.extra / 16 + w.stages - 1) / w.stages * 16 > kMaxExtraPerStage))
    throw std::invalid_argument("joint probe: bad work (stages " + std::to_string(w.stages) +
                                ", extra " + std::to_string(w.extra) + ", stores " +
                                std::to_string(w.stores) + ", tiles " + std::to_string(w.tiles) +
                                "; stores and tiles <= stages, at most 16 KiB of extra reads a "
                                "stage)");
  return w;
}

}  // namespace

JointWork joint_work_for(double flops, double read_bytes, double write_bytes) {
  if (!(flops >= 0) || !(read_bytes >= 0) || !(write_bytes >= 0))
    throw std::invalid_argument("joint_work_for: flops, read_bytes and write_bytes must be >= 0");
  JointWork w;
  w.stages = static_cast<int64_t>(std::ceil(flops / kJointStageFlops));
  const int64_t cover = static_cast<int64_t>(std::ceil(read_bytes / kJointStageBytes));
  if (cover < w.stages) w.tiles = std::max<int64_t>(cover, 1);
  const double left = read_bytes - static_cast<double>(joint_streamed_tiles(w)) * kJointStageBytes;
  w.extra = left > 0 ? static_cast<int64_t>(std::ceil(left / 16)) * 16 : 0;
  w.stores = static_cast<int64_t>(std::ceil(write_bytes / kJointStoreBytes));
  return validated(w);
}

bool joint_probe_available() {
  // available() checks the device and the sm_90a object both kernels are compiled into.
  static const bool ok = [] {
    cudaFuncAttributes attr{};
    return available() && cudaFuncGetAttributes(&attr, joint_kernel) == cudaSuccess &&
           attr.binaryVersion == 90;
  }();
  return ok;
}

JointProbe::JointProbe(const JointWork& w)
    : work_(validated(w)),
      tiles_(DType::bf16, {joint_streamed_tiles(w) * kJointStageBytes / 2}),
      extra_(DType::bf16, {w.extra / 2}),
      rows_(DType::bf16, {kRowBytes / 2}),
      out_(DType::bf16, {w.stores * kJointStoreBytes / 2}) {
  if (!joint_probe_available())
    throw std::runtime_error("JointProbe: needs an sm_90 GPU and the sm_90a build");
  gemm_detail::fill_hash_uniform(tiles_, 11, -1.0, 1.0);
  gemm_detail::fill_hash_uniform(extra_, 12, -1.0, 1.0);
  gemm_detail::fill_hash_uniform(rows_, 13, -1.0, 1.0);
}

namespace {
// Dynamic shared memory of a launch: the stages, the row tile, the barriers (in 1 KiB), bulk's
// staging and 1 KiB for the alignment.
int smem_bytes(const JointWork& w, JointStore store) {
  return kStages * (static_cast<int>(kJointStageBytes) + extra_slot_bytes(w)) + kRowBytes + 1024 +
         (store == JointStore::bulk ? 2 * static_cast<int>(kJointStoreBytes / 2) : 0) + 1024;
}
constexpr int kMaxSmem = 227 * 1024;
}  // namespace

bool JointProbe::bulk_fits() const {
  return smem_bytes(work_, JointStore::bulk) <= kMaxSmem;
}

void JointProbe::launch(JointMode mode, Stream s, int ctas, JointStore store) {
  JParams p{};
  p.tiles = static_cast<const uint8_t*>(tiles_.data());
  p.extra = static_cast<const uint8_t*>(extra_.data());
  p.rows = static_cast<const uint8_t*>(rows_.data());
  p.out = static_cast<uint32_t*>(out_.data());
  p.stages = work_.stages;
  p.extra16 = work_.extra / 16;
  p.stores = work_.stores;
  p.n_tiles = work_.tiles;
  p.extra_slot = extra_slot_bytes(work_);
  p.mode = static_cast<int>(mode);
  p.store = static_cast<int>(store);
  const int smem = smem_bytes(work_, store);
  if (smem > kMaxSmem)
    throw std::invalid_argument("JointProbe: store bulk needs " + std::to_string(smem) +
                                " bytes of shared memory for this work (at most " +
                                std::to_string(kMaxSmem) + ")");
  MOE_CUDA_CHECK(
      cudaFuncSetAttribute(joint_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int grid = ctas > 0 ? ctas : device_sms();
  joint_kernel<<<grid, kThreads, smem, s>>>(p);
  MOE_CUDA_CHECK(cudaGetLastError());
}

double JointProbe::median_ms(JointMode mode, int warmup, int reps, Stream s, JointStore store) {
  return gemm_detail::median_ms([&] { launch(mode, s, 0, store); }, warmup, reps, s);
}

}  // namespace moe::gpu::sm90
