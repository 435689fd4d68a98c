// The MoE block (SPEC §11) with one EP rank per process over NCCL (gpu::moe_block_fwd/bwd with an
// NcclCommunicator, ep_size = world size, dp_size = 1). Every rank builds the same global inputs
// from the case seed, computes its own shard, and holds the same global outputs and gradients,
// which must
//   - match the CPU reference within SPEC §12 (the registry record's own comparison), and
//   - equal, bit for bit, the one-GPU run of the same case with all P ranks simulated in process
//     (both layouts do the same arithmetic in the same order; see gpu/moe_block.cuh).
// R3 (forced routing overflowing an unaligned receive buffer), R5 (the combine's saved input is
// eo_post [R_pre, H]) and R7 (pad_offsets absent at a = 0, [E] i32 at a = 16) are checked on the
// real ranks. Verdicts are reduced over ranks, so every rank reports the same result.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "gpu/moe_block.cuh"
#include "harness/core/params/ep.h"
#include "harness/ops/block_gpu.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/registry.h"
#include "tests/multi_gpu/nccl_env.h"

namespace moe {
namespace {

using gpu::DeviceTensor;

// Named moe_block cases at ep_size = P and dp_size = 1: the EP = 2 regression cases as they are,
// every other case whose experts divide by P rewritten to that EP size (moe_block_case_for_ep).
std::vector<Case> ep_cases(int P) {
  std::vector<Case> v;
  for (const Case& c : ops::find_op("moe_block")->named()) {
    if (auto e = ops::moe_block_case_for_ep(c, P)) v.push_back(*e);
  }
  return v;
}

// Random cases of the record's generator rewritten to ep_size = P (same seeds on every rank, so
// every rank draws the same cases).
std::vector<Case> random_ep_cases(int P, int n) {
  const ops::OpInfo& op = *ops::find_op("moe_block");
  std::vector<Case> v;
  for (int i = 0; static_cast<int>(v.size()) < n && i < 4000; ++i) {
    const Case c = op.gen()(rc::Random(20261122ull * 1000003ull + i), 60).value();
    if (auto e = ops::moe_block_case_for_ep(c, P)) v.push_back(*e);
  }
  return v;
}

// Keys of `a` whose tensors are not bitwise equal to those of `b`, with the differing elements.
std::vector<std::string> bitwise_diffs(const TensorMap& a, const TensorMap& b) {
  std::vector<std::string> out;
  for (const auto& [k, t] : a) {
    auto it = b.find(k);
    if (it == b.end()) {
      out.push_back(k + " missing from the one-GPU run");
      continue;
    }
    if (t.bitwise_equal(it->second)) continue;
    int64_t n = 0;
    if (t.shape() == it->second.shape() && t.dtype() == it->second.dtype()) {
      for (int64_t i = 0; i < t.numel(); ++i) n += !(t.at(i) == it->second.at(i));
    }
    out.push_back(k + ": " + std::to_string(n) + " of " + std::to_string(t.numel()) +
                  " elements differ");
  }
  return out;
}

// Runs c over NCCL and in process; returns this rank's failure lines.
std::vector<std::string> check_case(gpu::NcclCommunicator& comm, const Case& c) {
  const ops::OpInfo& op = *ops::find_op("moe_block");
  std::vector<std::string> bad;
  const TensorMap in = op.make_inputs(c);
  const TensorMap want = op.reference(c, in, false);
  ops::set_block_communicator(&comm);
  TensorMap got;
  try {
    got = op.gpu(c, in);
  } catch (const std::exception& e) {
    ops::set_block_communicator(nullptr);
    return {std::string("NCCL run threw: ") + e.what()};
  }
  ops::set_block_communicator(nullptr);
  const Report r = op.compare(c, in, want, got);
  if (!r.ok()) bad.push_back("vs reference:\n" + r.str());
  const TensorMap one_gpu = op.gpu(c, in);
  for (const std::string& d : bitwise_diffs(got, one_gpu)) bad.push_back("vs one GPU: " + d);
  return bad;
}

void expect_all_ranks_pass(gpu::NcclCommunicator& comm, const Case& c,
                           const std::vector<std::string>& bad) {
  std::string msg;
  for (const std::string& b : bad) msg += b + "\n";
  EXPECT_TRUE(bad.empty()) << "rank " << comm.rank() << ": " << c.line() << "\n" << msg;
  EXPECT_EQ(comm.all_reduce_sum(bad.empty() ? 0 : 1), 0) << "some rank failed " << c.line();
}

TEST(NcclMoeBlock, NamedCasesMatchReferenceAndOneGpu) {
  MOE_NCCL_OR_SKIP(comm);
  const std::vector<Case> cases = ep_cases(comm.size());
  ASSERT_FALSE(cases.empty());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line());
    expect_all_ranks_pass(comm, c, check_case(comm, c));
  }
  if (comm.rank() == 0)
    std::printf("checked %zu named cases at ep_size %d\n", cases.size(), comm.size());
}

TEST(NcclMoeBlock, RandomCasesMatchReferenceAndOneGpu) {
  MOE_NCCL_OR_SKIP(comm);
  const std::vector<Case> cases = random_ep_cases(comm.size(), 12);
  ASSERT_FALSE(cases.empty()) << "the generator drew no case with ep_size " << comm.size();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line());
    expect_all_ranks_pass(comm, c, check_case(comm, c));
  }
  if (comm.rank() == 0)
    std::printf("checked %zu random cases at ep_size %d\n", cases.size(), comm.size());
}

// The block's inputs on this rank's GPU.
struct Inputs {
  DeviceTensor x, gk, wi0, wi1, wo;
  std::optional<DeviceTensor> ct;
  explicit Inputs(const TensorMap& in)
      : x(DeviceTensor::upload(in.at("input.x"))),
        gk(DeviceTensor::upload(in.at("input.gate_kernel"))),
        wi0(DeviceTensor::upload(in.at("input.wi_0"))),
        wi1(DeviceTensor::upload(in.at("input.wi_1"))),
        wo(DeviceTensor::upload(in.at("input.wo"))) {
    if (const Tensor* t = ops::find_tensor(in, "cotangent.y")) ct = DeviceTensor::upload(*t);
  }
  gpu::MoeBlockInputs view() const { return {x, gk, wi0, wi1, wo}; }
};

// R5 and R7 on the real ranks: the saved combine input is [R_pre, H]; pad_offsets exists iff a > 0.
TEST(NcclMoeBlock, R5R7SavedStateOnEachRank) {
  MOE_NCCL_OR_SKIP(comm);
  const ops::OpInfo& op = *ops::find_op("moe_block");
  int checked = 0;
  for (const Case& c : ep_cases(comm.size())) {
    const std::string name = c.s("name", "");
    if (name.rfind("R5_R7", 0) != 0) continue;
    SCOPED_TRACE(c.line());
    const MoeBlockParams p = ops::moe_block_params(c);
    const TensorMap in = op.make_inputs(c);
    Inputs d(in);
    const gpu::MoeBlockFwd f = gpu::moe_block_fwd(comm, d.view(), p);
    ASSERT_EQ(f.shards.size(), 1u);
    const gpu::MoeShardState& st = f.shards[0];
    EXPECT_EQ(st.ep_rank, comm.rank());
    const MoeBlockShape shape{c.i("B"), c.i("S"), c.i("H"), c.i("M"), c.i("num_experts")};
    const int64_t R_pre = pre_a2a_rows(shape.ep(p));
    EXPECT_EQ(st.eo_post.shape(), (Shape{R_pre, c.i("H")})) << "R5: the combine's saved input";
    if (p.align_size > 0) {
      ASSERT_TRUE(st.pad_offsets.has_value()) << "R7: pad_offsets missing at a > 0";
      EXPECT_EQ(st.pad_offsets->shape(), (Shape{c.i("num_experts")}));
      EXPECT_EQ(st.pad_offsets->dtype(), DType::i32);
    } else {
      EXPECT_FALSE(st.pad_offsets.has_value()) << "R7: pad_offsets present at a = 0";
    }
    // The backward consumes exactly that state.
    const gpu::MoeBlockGrads g = gpu::moe_block_bwd(comm, *d.ct, nullptr, d.view(), f, p);
    EXPECT_EQ(g.x.shape(), d.x.shape());
    ++checked;
  }
  EXPECT_EQ(comm.all_reduce_sum(checked), static_cast<int64_t>(checked) * comm.size());
  if (comm.size() == 2) EXPECT_EQ(checked, 2);
}

// Layouts the NCCL block cannot run fail on every rank, before any collective, naming the
// parameter.
TEST(NcclMoeBlock, UnsupportedLayoutsThrowOnEveryRank) {
  MOE_NCCL_OR_SKIP(comm);
  const ops::OpInfo& op = *ops::find_op("moe_block");
  const std::vector<Case> cases = ep_cases(comm.size());
  ASSERT_FALSE(cases.empty());
  const Case c = cases.front();
  const TensorMap in = op.make_inputs(c);
  Inputs d(in);
  MoeBlockParams p = ops::moe_block_params(c);
  p.ep_size = comm.size() * 2;  // more EP ranks than processes
  try {
    gpu::moe_block_fwd(comm, d.view(), p);
    ADD_FAILURE() << "ep_size != world size did not throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ep_size"), std::string::npos) << e.what();
  }
  comm.barrier();
}

}  // namespace
}  // namespace moe
