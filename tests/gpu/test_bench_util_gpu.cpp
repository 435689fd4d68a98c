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

#include <cmath>
#include <cstdint>
#include <vector>

#include "gpu/bench_util.cuh"
#include "harness/core/tensor.h"
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

// The vendor's batched yardstick computes the products it claims, in the layout of grouped_gemm:
// small shapes, every dtype, a product that shares a (its dgrad summed into the owner's da) and
// one that does not, each result against double sums of the dtype-rounded operands the device
// holds. Bound per element: the result's rounding (unit roundoff u of the dtype, twice where a
// stored dgrad is added to: both roundings) plus fp32 accumulation (k 2^-24 sum |a b|, x4 spare).
TEST(BenchUtilGpu, BatchedGemmsComputeTheProductsTheyTime) {
  MOE_SKIP_WITHOUT_GPU();
  using moe::DType;
  using moe::gpu::BatchedProduct;
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    const double u = d == DType::f32 ? 0x1p-24 : d == DType::bf16 ? 0x1p-8 : 0x1p-11;
    const std::vector<BatchedProduct> ps = {{3, 5, 7, 4}, {3, 5, 7, 6, 0}, {3, 4, 6, 7}};
    moe::gpu::BatchedGemms g(d, ps, true);
    EXPECT_EQ(g.fwd_flops(), 2.0 * 3 * (5 * 7 * 4 + 5 * 7 * 6 + 4 * 6 * 7));
    g.fwd();
    g.bwd();
    moe::gpu::device_synchronize();  // they ran on bench_stream(), which does not wait for 0
    size_t checked = 0;
    // got[i] against sum over terms of x * y, with `roundings` roundings of partial results.
    const auto expect_sum = [&](double got, const std::vector<std::pair<double, double>>& terms,
                                double part, int roundings, const std::string& what) {
      double ref = 0, mag = 0;
      for (const auto& [x, y] : terms) {
        ref += x * y;
        mag += std::fabs(x * y);
      }
      const double bound = u * (std::fabs(ref) + (roundings > 1 ? std::fabs(part) : 0.0)) +
                           4.0 * static_cast<double>(terms.size()) * 0x1p-24 * mag;
      EXPECT_LE(std::fabs(got - ref), bound) << what << " ref " << ref;
      ++checked;
    };
    std::vector<double> da_first;  // product 0's dgrad alone, for the shared sum's bound
    for (size_t p = 0; p < ps.size(); ++p) {
      const BatchedProduct& q = ps[p];
      const moe::Tensor a = g.a(p).download(), b = g.b(p).download(), c = g.c(p).download(),
                        gg = g.g(p).download(), db = g.db(p).download();
      const std::string at = std::string(moe::dtype_name(d)) + " product " + std::to_string(p);
      for (int64_t z = 0; z < q.batch; ++z) {
        for (int64_t i = 0; i < q.m; ++i) {
          for (int64_t j = 0; j < q.n; ++j) {  // c = a . b
            std::vector<std::pair<double, double>> t;
            for (int64_t l = 0; l < q.k; ++l) {
              t.emplace_back(a.at(z * q.m + i, l), b.at((z * q.k + l) * q.n + j));
            }
            expect_sum(c.at(z * q.m + i, j), t, 0, 1, at + " c");
          }
        }
        for (int64_t l = 0; l < q.k; ++l) {
          for (int64_t j = 0; j < q.n; ++j) {  // db = a^T . g
            std::vector<std::pair<double, double>> t;
            for (int64_t i = 0; i < q.m; ++i) {
              t.emplace_back(a.at(z * q.m + i, l), gg.at(z * q.m + i, j));
            }
            expect_sum(db.at((z * q.k + l) * q.n + j), t, 0, 1, at + " db");
          }
        }
      }
    }
    // da = g . b^T: product 0 and 1 sum into one da (1 shares 0's a), product 2 alone.
    for (const std::vector<size_t>& group : {std::vector<size_t>{0, 1}, std::vector<size_t>{2}}) {
      const BatchedProduct& q = ps[group.front()];
      const moe::Tensor da = g.da(group.front()).download();
      std::vector<moe::Tensor> bs, gs;
      for (const size_t p : group) {
        bs.push_back(g.b(p).download());
        gs.push_back(g.g(p).download());
      }
      for (int64_t z = 0; z < q.batch; ++z) {
        for (int64_t i = 0; i < q.m; ++i) {
          for (int64_t l = 0; l < q.k; ++l) {
            std::vector<std::pair<double, double>> t;
            double first = 0;
            for (size_t e = 0; e < group.size(); ++e) {
              const int64_t n = ps[group[e]].n;
              for (int64_t j = 0; j < n; ++j) {
                t.emplace_back(gs[e].at(z * q.m + i, j), bs[e].at((z * q.k + l) * n + j));
                if (e == 0) first += t.back().first * t.back().second;
              }
            }
            expect_sum(da.at(z * q.m + i, l), t, first, static_cast<int>(group.size()),
                       std::string(moe::dtype_name(d)) + " da of product " +
                           std::to_string(group.front()));
          }
        }
      }
    }
    EXPECT_EQ(checked, 3u * (5 * 4 + 7 * 4 + 5 * 6 + 7 * 6 + 4 * 7 + 6 * 7 + 5 * 7 + 4 * 6));
  }
  // Bad shapes name the product and field.
  const auto throws_naming = [](std::vector<BatchedProduct> ps, const std::string& want) {
    try {
      moe::gpu::BatchedGemms g(DType::bf16, std::move(ps), false);
      ADD_FAILURE() << "no throw, expected " << want;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  throws_naming({{2, 0, 4, 4}}, "m = 0");
  throws_naming({{2, 3, 4, 4, 0}}, "a_from = 0");
  throws_naming({{2, 3, 4, 4}, {2, 3, 5, 4, 0}}, "product 1 shares a");
  moe::gpu::BatchedGemms fwd_only(DType::bf16, {{1, 2, 2, 2}}, false);
  EXPECT_THROW(fwd_only.bwd(), std::logic_error);
}

#endif

}  // namespace
