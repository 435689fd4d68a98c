// SPEC §12 determinism at sizes that fill the GPU: for every op with a CUDA twin, cases large
// enough that each kernel runs many blocks (the registry's benchmark cases with their row counts
// capped at 65536 and H at 256, the MoE block at 32768 tokens so its per-expert column counts run
// 1024 blocks), run three times; every output and gradient must be bitwise equal across runs.
// check_gpu's two runs use the small registry cases, where a missing barrier or atomic rarely
// shows; here blocks race for real. Ops without benchmark cases use all their named cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/registry.h"

using namespace moe;
using namespace moe::ops;

namespace {

constexpr int64_t kMaxRows = 65536;
constexpr int64_t kMaxHidden = 256;

std::vector<std::string> gpu_op_names() {
  std::vector<std::string> v;
  for (const OpInfo* op : all_ops())
    if (op->gpu) v.push_back(op->name);
  if (v.empty()) v.push_back("none");  // keeps the suite instantiated in CPU-only builds
  return v;
}

// A benchmark case cut to a size whose host inputs take seconds, still many blocks per kernel.
Case fill_case(const OpInfo& op, const Case& bench) {
  Case c = bench;
  if (op.name == "moe_block") {
    // 32768 tokens, E from the case: column counts over [T, E] run min(T*E/256, 1024) blocks.
    c.set("B", int64_t{8}).set("S", int64_t{4096}).set("H", int64_t{64}).set("M", int64_t{64});
    c.set("ep_size", int64_t{2}).set("dp_size", int64_t{2});
    return c;
  }
  if (op.name == "grouped_gemm" || op.name == "swiglu_expert_ffn") {
    // The GEMMs are cuBLAS's; the elementwise, bias and column-sum kernels get one row per
    // block, so a few thousand rows over 8 or 256 groups already give thousands of blocks.
    return op.bench_verify_case ? op.bench_verify_case(bench) : bench;
  }
  if (c.has("T") && c.i("T") > kMaxRows) {
    const int64_t T = c.i("T"), Ts = kMaxRows;
    if (c.has("num_out_tokens") && c.has("K")) {  // keep its relation to T*K (dispatch family)
      const int64_t K = c.i("K"), n = c.i("num_out_tokens");
      c.set("num_out_tokens", n >= T * K ? Ts * K + (n - T * K) : n * Ts / T);
    }
    c.set("T", Ts);
  }
  if (c.has("R") && c.i("R") > kMaxRows) {
    c.set("R", kMaxRows);
    if (c.has("total_num_tokens"))
      c.set("total_num_tokens", std::min(c.i("total_num_tokens"), kMaxRows));
  }
  if (c.has("H") && c.i("H") > kMaxHidden) c.set("H", kMaxHidden);
  return c;
}

std::vector<Case> fill_cases(const OpInfo& op) {
  std::vector<Case> v;
  if (op.bench_cases) {
    for (const Case& b : op.bench_cases()) v.push_back(fill_case(op, b));
  } else if (op.named) {
    v = op.named();
  }
  return v;
}

// The inputs of a fill case. moe_block's make_inputs redraws every token row until its router
// selection clears the finite-difference margins the reference comparison needs (up to 64 draws
// a row: at 32768 tokens, minutes of CPU on the GPU machine and over 15 on a 2-core one). Runs
// compared with one another need no margin: the weights (independent of the token count) come
// from make_inputs at 16 tokens a sequence, x and cotangent.y are plain seeded normals.
TensorMap fill_inputs(const OpInfo& op, const Case& c) {
  if (op.name != "moe_block") return op.make_inputs(c);
  Case small = c;
  small.set("S", int64_t{16});
  TensorMap in = op.make_inputs(small);
  for (const char* key : {"input.x", "cotangent.y"}) {
    Tensor t(c.dtype, {c.i("B"), c.i("S"), c.i("H")});
    Rng rng(c.seed, std::string(key) + ".fill");
    fill_normal(t, rng, 1.0);
    in.insert_or_assign(key, std::move(t));
  }
  return in;
}
std::string inputs_note(const OpInfo& op) {
  return op.name == "moe_block"
             ? " (x and cotangent.y of this test are plain normals, not make_inputs')"
             : "";
}

int64_t total_elements(const TensorMap& m) {
  int64_t n = 0;
  for (auto& [k, t] : m) n += t.numel();
  return n;
}

class GpuDeterminism : public ::testing::TestWithParam<std::string> {
 protected:
  const OpInfo* op() const { return find_op(GetParam()); }
};

// Runs on the CPU too: the large cases are valid and their inputs generate (a case the GPU test
// could not even build would otherwise only show on a GPU machine).
TEST_P(GpuDeterminism, LargeCasesGenerateInputs) {
  if (!op()) GTEST_SKIP() << "no op has a CUDA twin in this build";
  const std::vector<Case> cases = fill_cases(*op());
  ASSERT_FALSE(cases.empty()) << GetParam() << ": no benchmark or named case";
  for (const Case& c : cases) {
    TensorMap in;
    ASSERT_NO_THROW(in = fill_inputs(*op(), c)) << c.line();
    EXPECT_GT(total_elements(in), 0) << c.line();
  }
}

TEST_P(GpuDeterminism, ThreeRunsAreBitwiseEqual) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description();
  if (!op()) GTEST_SKIP() << "no op has a CUDA twin in this build";
  for (const Case& c : fill_cases(*op())) {
    const TensorMap in = fill_inputs(*op(), c);
    const TensorMap first = op()->gpu(c, in);
    ASSERT_FALSE(first.empty()) << c.line();
    for (int run = 2; run <= 3; ++run) {
      const TensorMap again = op()->gpu(c, in);
      ASSERT_EQ(again.size(), first.size()) << c.line();
      for (auto& [key, want] : first) {
        auto it = again.find(key);
        ASSERT_NE(it, again.end()) << key << " missing in run " << run << "; " << c.line();
        EXPECT_TRUE(it->second.bitwise_equal(want))
            << key << " differs between run 1 and run " << run
            << "; replay: " << replay_line(c, "gpu") << inputs_note(*op());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllGpuOps, GpuDeterminism, ::testing::ValuesIn(gpu_op_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
