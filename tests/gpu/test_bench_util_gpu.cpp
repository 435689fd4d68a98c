// gpu/bench_util's yardsticks: the same-size copy and the empty kernel that `bench` sets beside
// every memory-bound row (tools/bench_cmd.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "harness/ops/registry.h"

#ifdef MOE_WITH_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "gpu/bench_util.cuh"
#endif

namespace {

#define MOE_SKIP_WITHOUT_GPU()                                          \
  do {                                                                  \
    if (!::moe::ops::gpu_available())                                   \
      GTEST_SKIP() << "no CUDA GPU: " << ::moe::ops::gpu_description(); \
  } while (0)

#ifdef MOE_WITH_CUDA

// Each way is timed, the row's figure is the faster copy, and an empty kernel, which moves
// nothing, is faster than either copy of 8 MB (at least 2.7 us of DRAM traffic at 3 TB/s).
TEST(BenchUtilGpu, SizedCopyTimesEveryWayAndKeepsTheFasterCopy) {
  MOE_SKIP_WITHOUT_GPU();
  const moe::gpu::SizedCopy c = moe::gpu::time_copy_of(8e6, 20);
  for (const moe::gpu::TimingStats* t : {&c.memcpy, &c.kernel, &c.empty}) {
    EXPECT_GE(t->samples, 20);
    EXPECT_GT(t->median_ms, 0.0);
    EXPECT_LE(t->min_ms, t->median_ms);
  }
  EXPECT_EQ(c.median_ms, std::min(c.memcpy.median_ms, c.kernel.median_ms));
  EXPECT_LT(c.empty.median_ms, c.median_ms);
}

// The yardstick's copy kernel copies: every byte of sizes around its 32 KiB chunks (one 16-byte
// vector, a chunk and a vector, a short last chunk) and one that wraps every CTA's 6-stage ring
// several times, with the bytes past the end untouched; bad sizes or addresses name bytes.
TEST(BenchUtilGpu, CopyKernelCopiesEveryByteAndNothingMore) {
  MOE_SKIP_WITHOUT_GPU();
  const size_t big = size_t{32 * 1024} * 6 * 400 + 48;
  for (size_t bytes :
       {size_t{16}, size_t{32 * 1024}, size_t{32 * 1024 + 16}, size_t{5 * 32 * 1024 - 4080}, big}) {
    std::vector<uint8_t> src(bytes + 64), got(bytes + 64);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
    void *ds = nullptr, *dd = nullptr;
    ASSERT_EQ(cudaMalloc(&ds, src.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dd, src.size()), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ds, src.data(), src.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dd, 0xA5, src.size()), cudaSuccess);
    moe::gpu::copy_kernel(dd, ds, bytes);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), dd, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    size_t wrong = 0, first = bytes;
    for (size_t i = 0; i < bytes; ++i) {
      if (got[i] != src[i]) {
        if (wrong++ == 0) first = i;
      }
    }
    EXPECT_EQ(wrong, 0u) << bytes << " bytes, first wrong at " << first;
    for (size_t i = bytes; i < got.size(); ++i) ASSERT_EQ(got[i], 0xA5) << bytes << ": byte " << i;
    cudaFree(ds);
    cudaFree(dd);
  }
  EXPECT_THROW(
      {
        try {
          moe::gpu::copy_kernel(nullptr, nullptr, 24);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("bytes (24)"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
}

// Bytes round up to whole 16-byte vectors per half; a tiny or zero count still times a copy.
TEST(BenchUtilGpu, SizedCopyTakesTinySizes) {
  MOE_SKIP_WITHOUT_GPU();
  for (double bytes : {0.0, 1.0, 33.0}) {
    const moe::gpu::SizedCopy c = moe::gpu::time_copy_of(bytes, 20);
    EXPECT_GT(c.median_ms, 0.0) << bytes;
  }
}

// The sustained warm-up: a bad value names sustain_ms and changes nothing; on, the untimed
// launches run for at least that long before the samples, in whole groups of 4; off again, only
// the fixed warm-up.
TEST(BenchUtilGpu, SustainedWarmUpRunsUntimedLaunchesForItsDuration) {
  MOE_SKIP_WITHOUT_GPU();
  EXPECT_THROW(
      {
        try {
          moe::gpu::set_sustain_ms(-1);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("sustain_ms"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
  EXPECT_EQ(moe::gpu::sustain_ms(), 0.0);
  int launches = 0;
  const auto launch = [&](int) { ++launches; };  // nothing on the device: host time alone
  const int warmup = 2, samples = 20;
  moe::gpu::set_sustain_ms(30);
  const auto t0 = std::chrono::steady_clock::now();
  moe::gpu::time_launches(launch, warmup, samples, 1, moe::gpu::bench_stream());
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  moe::gpu::set_sustain_ms(0);
  EXPECT_GE(ms, 30.0);
  EXPECT_GE(launches, warmup + 4 + samples);
  EXPECT_EQ((launches - warmup - samples) % 4, 0) << launches;
  launches = 0;
  moe::gpu::time_launches(launch, warmup, samples, 1, moe::gpu::bench_stream());
  EXPECT_EQ(launches, warmup + samples);
}

#endif

}  // namespace
