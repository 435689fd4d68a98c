// Kernel timelines on the GPU (gpu/timeline.cuh): a CUPTI recording returns the kernels, copies
// and memsets issued while it ran, each with the TimelineStage path that issued it, and the MoE
// block puts every piece of its forward and backward in a named stage (what `bench --timeline`
// splits a block row by). Skips without a GPU, or without CUPTI (the reason printed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/timeline.cuh"
#include "gpu/topk_router.cuh"
#include "harness/ops/registry.h"

using namespace moe;

namespace {

#define SKIP_WITHOUT_RECORDER()                                                         \
  if (!ops::gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << ops::gpu_description(); \
  if (const std::string why = gpu::timeline_unavailable(); !why.empty()) GTEST_SKIP() << why

gpu::DeviceTensor logits(int64_t T, int64_t E) {
  std::vector<double> v;
  for (int64_t i = 0; i < T * E; ++i) v.push_back(std::sin(0.37 * static_cast<double>(i)));
  return gpu::DeviceTensor::upload(Tensor::from(DType::f32, {T, E}, v));
}

std::string stages_of(const std::vector<gpu::TimelineEvent>& ev) {
  std::string s;
  for (const auto& e : ev) s += e.kind + " " + e.name + " [" + e.stage + "]\n";
  return s;
}

}  // namespace

TEST(TimelineGpu, RecordsKernelsCopiesAndMemsetsWithTheStageThatIssuedThem) {
  SKIP_WITHOUT_RECORDER();
  RouterParams p;
  p.topk = 2;
  const gpu::DeviceTensor warm = logits(64, 8);
  (void)gpu::topk_router_fwd(warm, nullptr, p);  // first use loads the module, outside the record
  const gpu::TimelineStage before("before");     // open before the recording: no id pushed
  std::vector<gpu::TimelineEvent> ev;
  uint64_t inner_end = 0;
  {
    gpu::TimelineRecording rec;
    EXPECT_THROW(gpu::TimelineRecording second, std::runtime_error);  // one at a time
    gpu::DeviceTensor x;
    {
      const gpu::TimelineStage outer("outer");
      x = logits(64, 8);  // a copy to the device
      gpu::DeviceTensor scratch(DType::f32, {1024});
      scratch.fill_bytes(0);  // a memset
      const gpu::TimelineStage inner("inner");
      (void)gpu::topk_router_fwd(x, nullptr, p);
    }
    (void)gpu::topk_router_fwd(x, nullptr, p);  // under `before` alone, which pushed no id
    ev = rec.stop();
    EXPECT_TRUE(rec.stop().empty());  // stopped once
  }
  const std::string all = stages_of(ev);
  int copies = 0, memsets = 0, inner_kernels = 0, outer_only_kernels = 0;
  for (const auto& e : ev) {
    EXPECT_LE(e.start_ns, e.end_ns) << all;
    if (e.kind == "memcpy") {
      ++copies;
      EXPECT_EQ(e.name, "memcpy HtoD") << all;
      EXPECT_EQ(e.stage, "before/outer") << all;
      EXPECT_EQ(e.bytes, 64u * 8u * 4u) << all;
    } else if (e.kind == "memset") {
      ++memsets;
      EXPECT_EQ(e.stage, "before/outer") << all;
      EXPECT_EQ(e.bytes, 4096u) << all;
    } else {
      ASSERT_EQ(e.kind, "kernel") << all;
      EXPECT_GT(e.grid[0] * e.block[0], 0) << all;
      if (e.stage == "before/outer/inner") {
        ++inner_kernels;
        inner_end = std::max(inner_end, e.end_ns);
      } else {
        EXPECT_EQ(e.stage, "") << all;  // a stage opened before the recording names nothing
        EXPECT_GE(e.start_ns, inner_end) << all;  // by start time: the second call comes last
        ++outer_only_kernels;
      }
    }
  }
  EXPECT_EQ(copies, 1) << all;
  EXPECT_EQ(memsets, 1) << all;
  EXPECT_GE(inner_kernels, 1) << all;
  EXPECT_EQ(inner_kernels, outer_only_kernels) << all;  // the same op twice
  for (size_t i = 1; i < ev.size(); ++i) EXPECT_LE(ev[i - 1].start_ns, ev[i].start_ns) << all;

  // Recording again works, and sees only its own work.
  gpu::TimelineRecording again;
  (void)gpu::topk_router_fwd(warm, nullptr, p);
  const std::vector<gpu::TimelineEvent> ev2 = again.stop();
  EXPECT_EQ(static_cast<int>(ev2.size()), outer_only_kernels) << stages_of(ev2);
}

// Every kernel, copy and memset of the block's forward and backward (the benchmark's calls, EP 2
// in process, aux loss on) lies in one of its named stages, the expert FFN's parts among them.
TEST(TimelineGpu, EveryPieceOfTheBlockIsInANamedStage) {
  SKIP_WITHOUT_RECORDER();
  const ops::OpInfo& op = *ops::find_op("moe_block");
  Case c;
  for (const Case& n : op.named())
    if (n.s("name") == "deepseek_like") c = n;
  ASSERT_EQ(c.s("name", ""), "deepseek_like");
  c.set("ep_size", int64_t{2}).set("aux_loss_coeff", 0.01);
  const TensorMap in = op.make_inputs(c);
  ops::OpInfo::Bench b = op.gpu_bench(c, in);
  b.fwd();  // first calls outside the record
  b.bwd();
  gpu::TimelineRecording rec;
  b.fwd();
  b.bwd();
  const std::vector<gpu::TimelineEvent> ev = rec.stop();
  const std::string all = stages_of(ev);
  const std::set<std::string> top = {"gate",    "router",  "dispatch", "aux",
                                     "experts", "combine", "gather"};
  std::set<std::string> seen;
  for (const auto& e : ev) {
    const std::string head = e.stage.substr(0, e.stage.find('/'));
    EXPECT_TRUE(top.count(head)) << e.kind << " " << e.name << " in stage '" << e.stage << "'\n"
                                 << all;
    seen.insert(e.stage);
  }
  for (const char* s : {"gate", "router", "dispatch", "aux", "combine", "experts/ffn.gate_up",
                        "experts/ffn.act", "experts/ffn.down", "experts/ffn.down_dgrad",
                        "experts/ffn.down_wgrad", "experts/ffn.grad_x", "experts/ffn.wi_wgrad"}) {
    EXPECT_TRUE(seen.count(s)) << "no work in stage " << s << "\n" << all;
  }
}
