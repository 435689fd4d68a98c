// The joint yardstick (gpu/joint_probe.cuh):
//   - JointProbeGpu: the probe kernel does the work it claims. Small integers in its tiles and row
//     tile make every fp32 sum exact, so each store must equal, bit for bit, twice the product
//     of the CTA's row tile with the sum of the tiles it streamed up to that store (mode joint),
//     with its first tile times the stages (mode mma), or zero (modes stream and store), on
//     each store path;
//   - JointProbeBench (MOE_JOINT_PROBE=1): a GEMM-like case's FLOPs and fewest bytes in one kernel,
//     against the dense cuBLAS rate and the copy bandwidth of the same run (docs/perf.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "harness/core/dtype.h"
#include "harness/core/rng.h"
#include "harness/ops/registry.h"

#ifdef MOE_WITH_CUDA
#include <cuda_runtime.h>

#include "gpu/bench_util.cuh"
#include "gpu/grouped_gemm.cuh"
#include "gpu/joint_probe.cuh"
#endif

using namespace moe;

#ifdef MOE_WITH_CUDA
namespace {

#define MOE_SKIP_WITHOUT_JOINT_PROBE()                                       \
  do {                                                                       \
    if (!::moe::ops::gpu_available() || !gpu::sm90::joint_probe_available()) \
      GTEST_SKIP() << "the joint probe needs an sm_90 GPU (H100/H200): "     \
                   << ::moe::ops::gpu_description();                         \
  } while (0)

// Element (row, k) of a 128-byte-swizzled K-major tile of 64 k-values a row (TMA SWIZZLE_128B:
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8)).
int64_t swizzled(int64_t row, int64_t k) {
  return row * 64 + ((k / 8) ^ (row % 8)) * 8 + k % 8;
}

Tensor small_ints(int64_t n, uint64_t seed) {
  Tensor t(DType::bf16, {n});
  Rng rng(seed, "joint probe");
  for (int64_t i = 0; i < n; ++i) t.set(i, static_cast<double>(rng.below(3) - 1));
  return t;
}

void upload_into(gpu::DeviceTensor& dst, const Tensor& src) {
  const gpu::DeviceTensor d = gpu::DeviceTensor::upload(src);
  gpu::gemm_detail::copy_device(dst.data(), d.data(), dst.nbytes());
}

}  // namespace

// 42 stages over 4 CTAs (10 or 11 each), 13 stores, extra reads of 1013 16-byte units (uneven
// per stage); a tile a stage, or 9 tiles in runs of 4-5 stages (wgrad's reuse; runs straddle
// CTAs).
class JointProbeWork : public ::testing::TestWithParam<int64_t> {};

TEST_P(JointProbeWork, EveryStoreHoldsTheProductsOfItsStages) {
  MOE_SKIP_WITHOUT_JOINT_PROBE();
  constexpr int kCtas = 4;
  const gpu::sm90::JointWork w{42, 16 * 1013, 13, GetParam()};
  gpu::sm90::JointProbe probe(w);
  const int64_t tile_elems = gpu::sm90::kJointStageBytes / 2;
  const int64_t n_tiles = gpu::sm90::joint_streamed_tiles(w);
  const Tensor tiles = small_ints(n_tiles * tile_elems, 1), rows = small_ints(128 * 64, 2);
  upload_into(probe.tiles(), tiles);
  upload_into(probe.rows(), rows);
  auto A = [&](int64_t r, int64_t k) { return rows.at(swizzled(r, k)); };
  // Stage s's tile, element (k, n).
  auto B = [&](int64_t s, int64_t k, int64_t n) {
    const int64_t tile = gpu::sm90::joint_tile_of(w.stages, w.tiles, s);
    return tiles.at(tile * tile_elems + swizzled(n, k));
  };
  Tensor poison(DType::bf16, {probe.out().numel()});
  for (int64_t i = 0; i < poison.numel(); ++i) poison.set(i, 12345.0);

  using gpu::sm90::JointStore;
  ASSERT_TRUE(probe.bulk_fits());
  for (const auto store : {JointStore::st32, JointStore::st128, JointStore::bulk})
    for (const auto mode : {gpu::sm90::JointMode::joint, gpu::sm90::JointMode::mma,
                            gpu::sm90::JointMode::stream, gpu::sm90::JointMode::store}) {
      upload_into(probe.out(), poison);
      probe.launch(mode, nullptr, kCtas, store);
      const Tensor out = probe.out().download();
      std::vector<std::string> bad;
      for (int64_t s = 0; s < w.stages; ++s) {
        const int64_t u = gpu::sm90::joint_store_at(w.stages, w.stores, s);
        if (u < 0) continue;
        int cta = 0;
        while (gpu::sm90::joint_first_stage(w.stages, cta + 1, kCtas) <= s) ++cta;
        const int64_t first = gpu::sm90::joint_first_stage(w.stages, cta, kCtas);
        // Column sums of the B tiles this store covers (mode mma: the first tile, every stage).
        std::vector<double> bsum(64 * 256, 0.0);
        for (int64_t t = first; t <= s; ++t)
          for (int64_t k = 0; k < 64; ++k)
            for (int64_t n = 0; n < 256; ++n)
              bsum[k * 256 + n] += mode == gpu::sm90::JointMode::mma ? B(first, k, n) : B(t, k, n);
        for (int cw = 0; cw < 2; ++cw) {
          for (int64_t pair = 0; pair < 8192; ++pair) {
            const int64_t i = pair / 128, t = pair % 128, warp = t / 32, lane = t % 32;
            const int64_t word = gpu::sm90::joint_out_word(store, i, t);
            const int64_t j = i / 2, h = i % 2;
            const int64_t r = 64 * cw + 16 * warp + lane / 4 + 8 * h;
            for (int e = 0; e < 2; ++e) {
              const int64_t n = 8 * j + 2 * (lane % 4) + e;
              double want = 0;
              if (mode == gpu::sm90::JointMode::joint || mode == gpu::sm90::JointMode::mma)
                for (int64_t k = 0; k < 64; ++k) want += 2.0 * A(r, k) * bsum[k * 256 + n];
              want = round_to(DType::bf16, want);
              const double got = out.at(2 * ((u * 2 + cw) * 8192 + word) + e);
              if (got != want && bad.size() < 8)
                bad.push_back("store " + std::to_string(u) + " row " + std::to_string(r) + " col " +
                              std::to_string(n) + ": " + std::to_string(got) + ", want " +
                              std::to_string(want));
            }
          }
        }
      }
      EXPECT_TRUE(bad.empty()) << "store " << static_cast<int>(store) << " mode "
                               << static_cast<int>(mode) << ": " << bad.size()
                               << "+ wrong, first: " << (bad.empty() ? "" : bad.front());
    }
}

INSTANTIATE_TEST_SUITE_P(TilesPerStage, JointProbeWork, ::testing::Values(0, 9),
                         [](const auto& info) {
                           return info.param == 0 ? std::string("OneTileAStage")
                                                  : "Tiles" + std::to_string(info.param);
                         });

TEST(JointProbeGpu, WorkForACaseCoversItsFlopsAndBytes) {
  // 1193 stages (39 MB of tiles), 6 MB of extra reads (about 5 KiB a stage), 16 stores.
  const double flops = 1e10, read = 4.5e7, write = 1e6;
  const gpu::sm90::JointWork w = gpu::sm90::joint_work_for(flops, read, write);
  EXPECT_GE(w.stages * gpu::sm90::kJointStageFlops, flops);
  EXPECT_LT((w.stages - 1) * gpu::sm90::kJointStageFlops, flops);
  const double streamed = static_cast<double>(w.stages * gpu::sm90::kJointStageBytes + w.extra);
  EXPECT_GE(streamed, read);
  EXPECT_LT(streamed, read + 16);
  EXPECT_GE(static_cast<double>(w.stores * gpu::sm90::kJointStoreBytes), write);
  EXPECT_LT(static_cast<double>((w.stores - 1) * gpu::sm90::kJointStoreBytes), write);
  EXPECT_EQ(w.tiles, 0);
  // Fewer reads than a tile a stage (wgrad's shape): the fewest tiles that cover them, no extra.
  const gpu::sm90::JointWork v = gpu::sm90::joint_work_for(flops, 4.5e6, write);
  EXPECT_EQ(v.stages, w.stages);
  EXPECT_EQ(v.tiles, 138);  // ceil(4.5e6 / 32768)
  EXPECT_EQ(v.extra, 0);
  for (const int64_t s : {int64_t{0}, v.stages / 2, v.stages - 1}) {
    const int64_t t = gpu::sm90::joint_tile_of(v.stages, v.tiles, s);
    EXPECT_GE(t, 0);
    EXPECT_LT(t, v.tiles);
  }
  EXPECT_EQ(gpu::sm90::joint_tile_of(v.stages, v.tiles, v.stages - 1), v.tiles - 1);
  EXPECT_THROW(gpu::sm90::joint_work_for(flops, 1e9, 0), std::invalid_argument);   // 800 KiB/stage
  EXPECT_THROW(gpu::sm90::joint_work_for(flops, 0, 1e12), std::invalid_argument);  // stores
  EXPECT_THROW(gpu::sm90::joint_work_for(-1, 0, 0), std::invalid_argument);
}

// The DeepSeek-like expert products of issue #20, 65536 rows x 7168 x 2048 in 256 groups: the
// forward, dgrad (whose bytes differ only in which operand is written) and wgrad. Prints each
// mode's median, the roofline of the same run and the probe's joint time as a share of it, and
// the time of a cudaMemset of the role's output (writes alone). MOE_JOINT_PROBE_SECONDS=n
// also runs each mode back to back for n seconds, printing wall-clock times, so that a power and
// clock log (nvidia-smi) can be lined up with them.
TEST(JointProbeBench, DeepSeekExpertProductsAtOnce) {
  MOE_SKIP_WITHOUT_JOINT_PROBE();
  if (!std::getenv("MOE_JOINT_PROBE"))
    GTEST_SKIP() << "full-size benchmark: set MOE_JOINT_PROBE=1 (needs ~10 GB of GPU memory)";
  const int64_t R = 65536, K = 7168, N = 2048, G = 256;
  const double flops = 2.0 * R * K * N;
  std::printf("device: %s\n", ops::gpu_description().c_str());
  double dense_ms = 0;
  {
    gpu::DeviceTensor x(DType::bf16, {R, K}), w(DType::bf16, {K, N}), out(DType::bf16, {R, N});
    gpu::gemm_detail::fill_hash_uniform(x, 1, -1.0, 1.0);
    gpu::gemm_detail::fill_hash_uniform(w, 2, -1.0, 1.0);
    dense_ms =
        gpu::gemm_detail::median_ms([&] { gpu::dense_gemm(gpu::GemmRole::fwd, x, w, out); }, 3, 15);
  }
  const double copy_gbps = gpu::measure_copy_bandwidth().gbps;
  struct Role {
    const char* name;
    double read, write;
  };
  // wgrad: the operands are read once (each group's rows serve all its output tiles from L2) and
  // the 7.5 GB of weight gradients written: 86% of its bytes are writes.
  const Role roles[] = {{"fwd", 2.0 * (R * K + G * K * N), 2.0 * R * N},
                        {"dgrad", 2.0 * (R * N + G * K * N), 2.0 * R * K},
                        {"wgrad", 2.0 * (R * K + R * N), 2.0 * G * K * N}};
  std::printf("dense cuBLAS %.3f ms (%.0f TFLOP/s), copy %.0f GB/s\n", dense_ms,
              flops / dense_ms * 1e-9, copy_gbps);
  using gpu::sm90::JointMode;
  using gpu::sm90::JointStore;
  std::printf("%-6s %9s %9s %9s %-6s %9s %9s %9s %9s %7s %7s\n", "role", "flop_ms", "byte_ms",
              "roof_ms", "store", "joint_ms", "mma_ms", "strm_ms", "store_ms", "%roof", "88%roof");
  const char* secs = std::getenv("MOE_JOINT_PROBE_SECONDS");
  const char* only = std::getenv("MOE_JOINT_PROBE_ROLE");  // one role's rows (and sustained runs)
  if (only && std::none_of(std::begin(roles), std::end(roles),
                           [&](const Role& r) { return std::string(only) == r.name; }))
    FAIL() << "MOE_JOINT_PROBE_ROLE=" << only << ": expected fwd, dgrad or wgrad";
  // MOE_JOINT_PROBE_STORE=st128|bulk: the store path of the sustained runs (default st32).
  JointStore sustained = JointStore::st32;
  if (const char* path = std::getenv("MOE_JOINT_PROBE_STORE")) {
    if (std::string(path) == "bulk") {
      sustained = JointStore::bulk;
    } else if (std::string(path) == "st128") {
      sustained = JointStore::st128;
    } else if (std::string(path) != "st32") {
      FAIL() << "MOE_JOINT_PROBE_STORE=" << path << ": expected st32, st128 or bulk";
    }
  }
  for (const Role& role : roles) {
    if (only && std::string(only) != role.name) continue;
    gpu::sm90::JointProbe probe(gpu::sm90::joint_work_for(flops, role.read, role.write));
    const double flop_ms = dense_ms, byte_ms = (role.read + role.write) / copy_gbps * 1e-6;
    const double roof = std::max(flop_ms, byte_ms);
    for (const auto store : {JointStore::st32, JointStore::st128, JointStore::bulk}) {
      const char* name = store == JointStore::bulk    ? "bulk"
                         : store == JointStore::st128 ? "st128"
                                                      : "st32";
      if (store == JointStore::bulk && !probe.bulk_fits()) {
        std::printf("%-6s %9s %9s %9s %-6s (its staging does not fit beside the stages)\n", "", "",
                    "", "", name);
        continue;
      }
      double ms[4];
      for (int m = 0; m < 4; ++m)
        ms[m] = probe.median_ms(static_cast<JointMode>(m), 3, 15, nullptr, store);
      std::printf("%-6s %9.3f %9.3f %9.3f %-6s %9.3f %9.3f %9.3f %9.3f %6.1f%% %7.3f\n", role.name,
                  flop_ms, byte_ms, roof, name, ms[0], ms[1], ms[2], ms[3], 100 * roof / ms[0],
                  roof / 0.88);
    }
    const double set_ms = gpu::gemm_detail::median_ms(
        [&] { MOE_CUDA_CHECK(cudaMemsetAsync(probe.out().data(), 0, probe.out().nbytes())); }, 3,
        15);
    std::printf("       memset of its %.3f GB of stores: %.3f ms (%.0f GB/s)\n",
                probe.out().nbytes() * 1e-9, set_ms, probe.out().nbytes() / set_ms * 1e-6);
    if (secs) {
      const double n = std::atof(secs);
      for (const auto mode : {gpu::sm90::JointMode::joint, gpu::sm90::JointMode::mma,
                              gpu::sm90::JointMode::stream, gpu::sm90::JointMode::store}) {
        const auto t0 = std::chrono::system_clock::now();
        int launches = 0;
        while (std::chrono::duration<double>(std::chrono::system_clock::now() - t0).count() < n) {
          for (int i = 0; i < 20; ++i, ++launches) probe.launch(mode, nullptr, 0, sustained);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        }
        const auto ms = [](auto t) {
          return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch())
              .count();
        };
        std::printf("sustained %s mode %d store %d: %lld..%lld ms since epoch, %d launches\n",
                    role.name, static_cast<int>(mode), static_cast<int>(sustained),
                    static_cast<long long>(ms(t0)),
                    static_cast<long long>(ms(std::chrono::system_clock::now())), launches);
      }
    }
  }
}
#endif
