// moe-harness bench-targets (tools/bench_compare.h): absolute floors on one bench report. Reports
// are built here in bench's JSON layout; the command's exit codes and the kept reports of
// docs/bench are tests/scripts/bench_targets_cli.sh's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "tools/bench_compare.h"

namespace {

using moe::tools::BenchFileError;
using moe::tools::BenchTargets;
using moe::tools::check_targets;
using moe::tools::read_bench_targets;
using moe::tools::TargetsCheck;
using moe::tools::TargetVerdict;
using nlohmann::json;
using ::testing::HasSubstr;

json row(const std::string& op, const std::string& name, const std::string& kind, bool verified,
         json extra) {
  json r = {{"op", op},       {"name", name},       {"dir", "fwd"},         {"impl", "moe-gpu"},
            {"kind", kind},   {"case", "op=" + op}, {"verified", verified}, {"median_us", 100.0},
            {"min_us", 90.0}, {"bytes", 1e9},       {"flops", 0.0}};
  r.update(extra);
  return r;
}
json report() {
  return {
      {"device", "NVIDIA H100 80GB HBM3"},
      {"results",
       {row("token_combine", "ds", "memory", true, {{"pct_copy", 92.0}}),
        row("topk_router", "ds", "memory", false, {{"pct_copy", 99.0}}),
        row("grouped_gemm", "ds", "gemm", true, {{"pct_copy", 50.0}, {"pct_roof", 87.9}}),
        row("grouped_gemm", "nodense", "gemm", true, {{"pct_copy", 50.0}, {"pct_roof", nullptr}}),
        row("moe_block", "ds", "tokens", true,
            {{"pct_copy", 60.0}, {"pct_roof", 70.0}, {"tokens_per_s", 231000.0}})}}};
}
json target(const std::string& op, const std::string& name, const std::string& metric, double min) {
  return {{"op", op}, {"name", name}, {"dir", "fwd"}, {"metric", metric}, {"min", min}};
}
TargetsCheck run(std::initializer_list<json> ts, const std::string& device = "") {
  json j = {{"targets", json::array()}};
  if (!device.empty()) j["device"] = device;
  for (const json& t : ts) j["targets"].push_back(t);
  return check_targets(read_bench_targets(j, "t.json"), report(), "r.json");
}
std::string error_of(const json& j) {
  try {
    read_bench_targets(j, "t.json");
  } catch (const BenchFileError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(BenchTargets, EachVerdict) {
  const TargetsCheck c = run({target("token_combine", "ds", "pct_copy", 92),       // at the floor
                              target("grouped_gemm", "ds", "pct_roof", 88),        // 87.9
                              target("moe_block", "ds", "tokens_per_s", 230000),   // 231000
                              target("topk_router", "ds", "pct_copy", 75),         // unverified
                              target("token_combine", "ds", "pct_roof", 50),       // memory row
                              target("grouped_gemm", "nodense", "pct_roof", 50),   // null roofline
                              target("grouped_gemm", "absent", "pct_roof", 50)});  // no row
  ASSERT_EQ(c.results.size(), 7u);
  EXPECT_EQ(c.results[0].verdict, TargetVerdict::met);
  EXPECT_EQ(c.results[1].verdict, TargetVerdict::missed);
  EXPECT_DOUBLE_EQ(c.results[1].value, 87.9);
  EXPECT_EQ(c.results[2].verdict, TargetVerdict::met);
  EXPECT_EQ(c.results[3].verdict, TargetVerdict::unverified);
  EXPECT_EQ(c.results[4].verdict, TargetVerdict::no_value);
  EXPECT_EQ(c.results[5].verdict, TargetVerdict::no_value);
  EXPECT_EQ(c.results[6].verdict, TargetVerdict::missing);
  EXPECT_TRUE(c.failed());
  EXPECT_FALSE(run({target("token_combine", "ds", "pct_copy", 92)}).failed());
  const std::string text = moe::tools::format_targets(BenchTargets{}, c);
  EXPECT_THAT(text, HasSubstr("MISSED grouped_gemm ds fwd (moe-gpu): 87.9% of roofline < 88.0% of "
                              "roofline (99.9% of the target)"));
  EXPECT_THAT(text, HasSubstr("7 targets: 2 met, 1 missed, 1 missing, 1 unverified, 2 without a "
                              "value: FAIL"));
  EXPECT_EQ(moe::tools::targets_json(BenchTargets{}, c)["targets"][6]["value"], nullptr);
}

TEST(BenchTargets, TheDeviceTextMustBeInTheReportsDevice) {
  EXPECT_TRUE(run({target("token_combine", "ds", "pct_copy", 1)}, "H100").device_matches);
  EXPECT_FALSE(run({target("token_combine", "ds", "pct_copy", 1)}, "H200").device_matches);
  EXPECT_TRUE(run({target("token_combine", "ds", "pct_copy", 1)}).device_matches);
}

TEST(BenchTargets, ABadTargetsFileNamesTheTargetAndTheField) {
  EXPECT_THAT(error_of(json::array()), HasSubstr("t.json: top level: expected an object"));
  EXPECT_THAT(error_of({{"targets", json::array()}}),
              HasSubstr("t.json: targets: expected a non-empty array"));
  json t = target("token_combine", "ds", "pct_copy", 1);
  t.erase("dir");
  EXPECT_THAT(error_of({{"targets", {t}}}), HasSubstr("targets[0].dir: missing"));
  EXPECT_THAT(error_of({{"targets", {target("a", "b", "gbps", 1)}}}),
              HasSubstr("targets[0].metric: expected pct_copy, pct_roof or tokens_per_s"));
  EXPECT_THAT(error_of({{"targets", {target("a", "b", "pct_copy", 0)}}}),
              HasSubstr("targets[0].min: expected a positive number, got 0"));
  json s = target("a", "b", "pct_copy", 1);
  s["min"] = "75";
  EXPECT_THAT(error_of({{"targets", {s}}}),
              HasSubstr("targets[0].min: expected a positive number"));
  EXPECT_THAT(
      error_of({{"targets", {target("a", "b", "pct_copy", 1), target("a", "b", "pct_copy", 2)}}}),
      HasSubstr("targets[1]: repeats targets[0]"));
  json d = {{"device", 7}, {"targets", {target("a", "b", "pct_copy", 1)}}};
  EXPECT_THAT(error_of(d), HasSubstr("top level.device: expected a non-empty string"));
}

}  // namespace
