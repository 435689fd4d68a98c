// The multi-GPU suite's one NCCL communicator per process (tests/multi_gpu/main.cpp), made on
// first use under `moe-harness launch`. Every rank runs the same tests in the same order, so the
// collectives inside a test body meet; a test must not return early between collectives on one
// rank only (use EXPECT_*, reduce verdicts with all_reduce_sum).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "gpu/nccl_comm.cuh"

namespace moe::testing {

// The communicator, or null with the reason the suite cannot run here (no launcher environment,
// fewer GPUs than local ranks). A communicator that cannot be built ends the process (exit 3):
// its peers are blocked in ncclCommInitRank and only the launcher's teardown frees them.
gpu::NcclCommunicator* nccl_comm(std::string* why_not);

}  // namespace moe::testing

// Binds `comm` (NcclCommunicator&) or skips the test with the reason.
#define MOE_NCCL_OR_SKIP(comm)                                                            \
  std::string moe_why_not_;                                                               \
  ::moe::gpu::NcclCommunicator* moe_comm_ptr_ = ::moe::testing::nccl_comm(&moe_why_not_); \
  if (!moe_comm_ptr_) GTEST_SKIP() << moe_why_not_;                                       \
  ::moe::gpu::NcclCommunicator& comm = *moe_comm_ptr_
