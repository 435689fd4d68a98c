// The in-process communicator's all-gather (gpu/comm.cuh): the collective the MoE block uses for
// everything global when its ranks live in separate processes. The NCCL implementation is checked
// by the block's multi-GPU tests, which compare it with this one bit for bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "gpu/comm.cuh"
#include "harness/ops/registry.h"

using namespace moe;

namespace {

#define SKIP_WITHOUT_GPU() \
  if (!ops::gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << ops::gpu_description()

TEST(InProcessCommunicatorGpu, AllGatherPlacesEveryRanksBlockInRankOrder) {
  SKIP_WITHOUT_GPU();
  for (int P : {1, 3, 8}) {
    const int64_t n = 37;  // odd byte counts: no alignment assumed
    gpu::InProcessCommunicator comm(P);
    std::vector<gpu::DeviceTensor> send, recv;
    std::vector<gpu::AllGatherRank> ranks;
    for (int r = 0; r < P; ++r) {
      Tensor t(DType::u8, {n});
      for (int64_t i = 0; i < n; ++i) t.set(i, static_cast<double>((r * 31 + i * 7) % 251));
      send.push_back(gpu::DeviceTensor::upload(t));
      recv.emplace_back(DType::u8, Shape{P * n});
      recv.back().fill_bytes(0xAB, nullptr);
    }
    for (int r = 0; r < P; ++r) ranks.push_back({r, send[r].data(), recv[r].data()});
    comm.all_gather(ranks, n, nullptr);
    for (int r = 0; r < P; ++r) {
      const Tensor got = recv[r].download();
      for (int j = 0; j < P; ++j) {
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(got.at(j * n + i), static_cast<double>((j * 31 + i * 7) % 251))
              << "P=" << P << " rank " << r << " block " << j << " byte " << i;
        }
      }
    }
  }
}

TEST(InProcessCommunicatorGpu, AllGatherRejectsABadRankListOrSize) {
  SKIP_WITHOUT_GPU();
  gpu::InProcessCommunicator comm(2);
  gpu::DeviceTensor a(DType::u8, {4}), b(DType::u8, {8});
  EXPECT_THROW(comm.all_gather({{0, a.data(), b.data()}}, 4, nullptr), std::invalid_argument);
  EXPECT_THROW(comm.all_gather({{1, a.data(), b.data()}, {0, a.data(), b.data()}}, 4, nullptr),
               std::invalid_argument);
  EXPECT_THROW(comm.all_gather({{0, a.data(), b.data()}, {1, a.data(), b.data()}}, -1, nullptr),
               std::invalid_argument);
  EXPECT_THROW(comm.all_gather({{0, a.data(), b.data()}, {1, nullptr, b.data()}}, 4, nullptr),
               std::invalid_argument);
}

}  // namespace
