// bench --timeline's host side (tools/timeline.h): kernel names shortened, a recorded call
// summarised (span, GPU busy time as the union over streams, idle gaps, time per stage) and
// written as a Chrome trace. The recording itself (CUPTI) is tested on the GPU
// (tests/gpu/test_timeline_gpu.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tools/timeline.h"

using moe::gpu::TimelineEvent;
using namespace moe::tools;

namespace {

TimelineEvent event(const char* kind, const char* name, const char* stage, uint32_t stream,
                    double start_us, double end_us) {
  TimelineEvent e;
  e.kind = kind;
  e.name = name;
  e.stage = stage;
  e.stream = stream;
  e.start_ns = static_cast<uint64_t>(start_us * 1000) + 1'000'000'000;  // any epoch
  e.end_ns = static_cast<uint64_t>(end_us * 1000) + 1'000'000'000;
  return e;
}

// Two streams, one overlap, two holes (10-12 and 30-35 us), a copy outside every stage; given out
// of start order.
std::vector<TimelineEvent> sample() {
  return {event("kernel", "void moe::gpu::(anonymous namespace)::act_fwd_vec_kernel<float>(float*)",
                "experts/ffn.act", 9, 15, 30),
          event("kernel", "void gate_kernel<1>(int)", "gate", 7, 0, 10),
          event("kernel", "void moe::gpu::(anonymous namespace)::act_fwd_vec_kernel<float>(float*)",
                "experts/ffn.act", 7, 12, 20),
          event("memcpy", "memcpy DtoH", "", 7, 35, 40)};
}

}  // namespace

TEST(Timeline, ShortKernelNamesDropScopeTemplateArgumentsAndParameters) {
  EXPECT_EQ(short_kernel_name("void moe::gpu::(anonymous namespace)::act_fwd_vec_kernel<__nv_"
                              "bfloat16>(__nv_bfloat16 const*, __nv_bfloat16 const*, long, bool)"),
            "act_fwd_vec_kernel");
  EXPECT_EQ(short_kernel_name("void moe::gpu::sm90::grouped_rows_kernel<(moe::gpu::sm90::Kind)0, "
                              "true, (bool)0>(moe::gpu::sm90::Params)"),
            "grouped_rows_kernel");
  EXPECT_EQ(short_kernel_name("moe::gpu::rowk::fwd8_kernel(moe::gpu::rowk::Args)"), "fwd8_kernel");
  EXPECT_EQ(short_kernel_name("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"),
            "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT");
  EXPECT_EQ(short_kernel_name("void cub::CUB_300000_SM_900::DeviceRadixSortOnesweepKernel<cub::"
                              "detail::Policy<int>, true>(int*, int)"),
            "DeviceRadixSortOnesweepKernel");
  EXPECT_EQ(short_kernel_name(""), "");
}

TEST(Timeline, SummaryCountsBusyTimeOnceAcrossStreamsAndTheIdleGaps) {
  const TimelineSummary s = summarize_timeline(sample());
  EXPECT_EQ(s.events, 4);
  EXPECT_EQ(s.kernels, 3);
  EXPECT_EQ(s.copies, 1);
  EXPECT_DOUBLE_EQ(s.span_us, 40.0);
  // [0,10] + [12,30] (two streams overlapping on [15,20]) + [35,40].
  EXPECT_DOUBLE_EQ(s.busy_us, 33.0);
  EXPECT_DOUBLE_EQ(s.idle_us, 7.0);
  EXPECT_EQ(s.gaps, 2);
  EXPECT_DOUBLE_EQ(s.largest_gap_us, 5.0);
  // Longest first, named by the work on either side (the one that ended last before the gap).
  ASSERT_EQ(s.largest_gaps.size(), 2u);
  EXPECT_DOUBLE_EQ(s.largest_gaps[0].us, 5.0);
  EXPECT_EQ(s.largest_gaps[0].after, "act_fwd_vec_kernel [experts/ffn.act]");
  EXPECT_EQ(s.largest_gaps[0].before, "memcpy DtoH [no stage]");
  EXPECT_DOUBLE_EQ(s.largest_gaps[1].us, 2.0);
  EXPECT_EQ(s.largest_gaps[1].after, "gate_kernel [gate]");
  EXPECT_EQ(s.largest_gaps[1].before, "act_fwd_vec_kernel [experts/ffn.act]");

  // Stages in the order of their first event; a stage's busy time sums its events.
  ASSERT_EQ(s.stages.size(), 3u);
  EXPECT_EQ(s.stages[0].stage, "gate");
  EXPECT_DOUBLE_EQ(s.stages[0].busy_us, 10.0);
  EXPECT_EQ(s.stages[1].stage, "experts/ffn.act");
  EXPECT_EQ(s.stages[1].kernels, 2);
  EXPECT_DOUBLE_EQ(s.stages[1].busy_us, 8.0 + 15.0);
  EXPECT_DOUBLE_EQ(s.stages[1].active_us, 30.0 - 12.0);  // its two streams overlap on [15, 20]
  EXPECT_DOUBLE_EQ(s.stages[0].active_us, 10.0);
  EXPECT_DOUBLE_EQ(s.stages[1].first_us, 12.0);
  EXPECT_DOUBLE_EQ(s.stages[1].last_us, 30.0);
  ASSERT_EQ(s.stages[1].top.size(), 1u);
  EXPECT_EQ(s.stages[1].top[0].first, "act_fwd_vec_kernel");
  EXPECT_DOUBLE_EQ(s.stages[1].top[0].second, 23.0);
  EXPECT_EQ(s.stages[2].stage, "");
  EXPECT_EQ(s.stages[2].copies, 1);
  EXPECT_EQ(s.stages[2].top[0].first, "memcpy DtoH");

  const nlohmann::json j = timeline_json(s);
  EXPECT_DOUBLE_EQ(j.at("busy_us").get<double>(), 33.0);
  EXPECT_EQ(j.at("gaps").get<int>(), 2);
  EXPECT_EQ(j.at("stages").at(1).at("stage"), "experts/ffn.act");
  EXPECT_EQ(j.at("stages").at(1).at("top").at(0).at("name"), "act_fwd_vec_kernel");
  EXPECT_DOUBLE_EQ(j.at("stages").at(1).at("active_us").get<double>(), 18.0);

  const std::string text = timeline_text("moe_block x fwd+bwd (moe-gpu)", s, 41.0);
  EXPECT_NE(text.find("timeline moe_block x fwd+bwd (moe-gpu)"), std::string::npos) << text;
  EXPECT_NE(text.find("idle 7.0 in 2 gaps (largest 5.0)"), std::string::npos) << text;
  EXPECT_NE(text.find("stage (none)"), std::string::npos) << text;
  EXPECT_NE(text.find("longest idle gaps: 5.0 us after act_fwd_vec_kernel [experts/ffn.act] "
                      "before memcpy DtoH [no stage]; 2.0 us"),
            std::string::npos)
      << text;
  EXPECT_EQ(j.at("largest_gaps").size(), 2u);
  EXPECT_NE(text.find("act_fwd_vec_kernel 23.0"), std::string::npos) << text;
  EXPECT_NE(text.find("active      18.0 us  45.0% of the span, kernels and copies      23.0 us"),
            std::string::npos)
      << text;
}

TEST(Timeline, SummaryOfNothingIsEmpty) {
  const TimelineSummary s = summarize_timeline({});
  EXPECT_EQ(s.events, 0);
  EXPECT_EQ(s.span_us, 0.0);
  EXPECT_EQ(s.busy_us, 0.0);
  EXPECT_TRUE(s.stages.empty());
}

TEST(Timeline, ChromeTraceHasOneProcessPerCallAndAThreadPerStream) {
  nlohmann::json ev = nlohmann::json::array();
  append_chrome_trace(ev, 3, "moe_block x fwd", sample());
  // process name, two thread names (streams 7 and 9), four complete events.
  ASSERT_EQ(ev.size(), 7u);
  EXPECT_EQ(ev[0].at("ph"), "M");
  EXPECT_EQ(ev[0].at("name"), "process_name");
  EXPECT_EQ(ev[0].at("args").at("name"), "moe_block x fwd");
  EXPECT_EQ(ev[1].at("args").at("name"), "stream 7");
  EXPECT_EQ(ev[2].at("args").at("name"), "stream 9");
  int complete = 0;
  for (const auto& e : ev) {
    EXPECT_EQ(e.at("pid"), 3);
    if (e.at("ph") != "X") continue;
    ++complete;
    if (e.at("name") == "gate_kernel") {
      EXPECT_DOUBLE_EQ(e.at("ts").get<double>(), 0.0);  // from the call's first event
      EXPECT_DOUBLE_EQ(e.at("dur").get<double>(), 10.0);
      EXPECT_EQ(e.at("cat"), "gate");
      EXPECT_EQ(e.at("args").at("kernel"), "void gate_kernel<1>(int)");
      EXPECT_EQ(e.at("tid"), 7);
    }
    if (e.at("name") == "memcpy DtoH") {
      EXPECT_DOUBLE_EQ(e.at("ts").get<double>(), 35.0);
      EXPECT_EQ(e.at("cat"), "memcpy");  // no stage: its kind
      EXPECT_TRUE(e.at("args").contains("bytes"));
    }
  }
  EXPECT_EQ(complete, 4);
}
