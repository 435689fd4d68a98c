// Process-wide setup of moe_gpu_tests: at exit, free what the CUDA ops keep between calls (the
// products' cuBLAS handles, workspaces, forked streams and staging buffers; the buffer cache) while
// the driver is still up, so that compute-sanitizer's leak check (the sanitize label, memcheck
// with --leak-check full) reports only real leaks.
#include <gtest/gtest.h>

#ifdef MOE_WITH_CUDA
#include "gpu/grouped_gemm.cuh"
#include "gpu/runtime.cuh"
#include "harness/ops/check.h"

namespace {

class GpuResourcesEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!moe::ops::gpu_available()) return;
    moe::gpu::release_gemm_resources();
    moe::gpu::release_buffer_cache();
  }
};

// Registered before gtest_main's RUN_ALL_TESTS; gtest owns and deletes it.
[[maybe_unused]] ::testing::Environment* const kEnv =
    ::testing::AddGlobalTestEnvironment(new GpuResourcesEnvironment);

}  // namespace
#endif
