// moe-harness bench-compare (tools/bench_compare.h): the speed gate between two bench reports.
// Reports are built here in bench's JSON layout; the command's exit codes are
// tests/scripts/bench_compare_cli.sh's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tools/bench_compare.h"

namespace {

using moe::tools::BenchCompareOptions;
using moe::tools::BenchComparison;
using moe::tools::BenchFileError;
using moe::tools::compare_bench;
using moe::tools::RowVerdict;
using nlohmann::json;
using ::testing::HasSubstr;

// A memory-bound row at pct% of copy and a GEMM row at pct% of its roofline, as bench writes
// them (median and fastest sample in us).
json memory_row(const std::string& name, double median, double min, double pct) {
  return {{"op", "token_combine"}, {"name", name},        {"dir", "fwd"},
          {"impl", "moe-gpu"},     {"kind", "memory"},    {"case", "op=token_combine " + name},
          {"verified", true},      {"median_us", median}, {"min_us", min},
          {"bytes", 2.1e9},        {"flops", 0.0},        {"pct_copy", pct}};
}
json gemm_row(const std::string& name, double median, double min, double pct_roof) {
  return {{"op", "grouped_gemm"}, {"name", name},        {"dir", "fwd"},
          {"impl", "moe-gpu"},    {"kind", "gemm"},      {"case", "op=grouped_gemm " + name},
          {"verified", true},     {"median_us", median}, {"min_us", min},
          {"bytes", 8.7e9},       {"flops", 1.9e12},     {"pct_copy", 80.0},
          {"pct_roof", pct_roof}};
}
json report(const std::string& device, std::initializer_list<json> rows) {
  json j = {{"device", device},  {"version", "1.2.0"}, {"git", "abc1234"},
            {"sustain_ms", 0.0}, {"complete", true},   {"results", json::array()}};
  for (const json& r : rows) j["results"].push_back(r);
  return j;
}

BenchComparison cmp(const json& a, const json& b, BenchCompareOptions o = {}) {
  return compare_bench(a, "old.json", b, "new.json", o);
}

TEST(BenchCompare, AReportAgainstItselfIsTheSame) {
  const json a =
      report("H100", {memory_row("ds", 770, 760, 93.8), gemm_row("ds_u", 3431, 3303, 84.9)});
  const BenchComparison c = cmp(a, a);
  ASSERT_EQ(c.rows.size(), 2u);
  for (const auto& r : c.rows) {
    EXPECT_EQ(r.verdict, RowVerdict::same) << r.name;
    EXPECT_DOUBLE_EQ(r.ratio, 1.0);
  }
  EXPECT_EQ(c.rows[0].metric, "pct_copy");
  EXPECT_EQ(c.rows[1].metric, "pct_roof");
  EXPECT_FALSE(c.failed({}));
  EXPECT_TRUE(c.notes.empty());
  EXPECT_EQ(c.old_build, "1.2.0 (git abc1234)");
}

// 90% -> 80% of copy is 12.5% more time: SLOWER at the default 5%, within a 20% allowance.
TEST(BenchCompare, ASlowdownBeyondTheAllowanceFailsAndWithinItPasses) {
  const json a = report("H100", {memory_row("ds", 800, 795, 90)});
  const json b = report("H100", {memory_row("ds", 900, 890, 80)});
  const BenchComparison c = cmp(a, b);
  EXPECT_EQ(c.rows.at(0).verdict, RowVerdict::slower);
  EXPECT_NEAR(c.rows[0].ratio, 1.125, 1e-12);
  EXPECT_NEAR(c.rows[0].best_ratio, 1.125 * 890 / 900, 1e-12);
  EXPECT_TRUE(c.failed({}));
  BenchCompareOptions loose;
  loose.max_slowdown = 0.20;
  EXPECT_EQ(cmp(a, b, loose).rows.at(0).verdict, RowVerdict::same);
  const std::string text = moe::tools::format_comparison(c, {});
  EXPECT_THAT(text, HasSubstr("SLOWER token_combine ds fwd (moe-gpu): 12.5% more time"));
  EXPECT_THAT(text, HasSubstr("1 slower"));
  EXPECT_THAT(text, HasSubstr(": FAIL"));
  EXPECT_EQ(moe::tools::comparison_json(c, {})["failed"], true);
  // The mirror image is faster and passes.
  const BenchComparison back = cmp(b, a);
  EXPECT_EQ(back.rows.at(0).verdict, RowVerdict::faster);
  EXPECT_FALSE(back.failed({}));
}

// A slow median whose fastest sample still beats OLD's median is noise, not a regression.
TEST(BenchCompare, ASlowMedianWithAFastSampleIsNotARegression) {
  const json a = report("H100", {memory_row("ds", 800, 795, 90)});
  const json b = report("H100", {memory_row("ds", 900, 760, 80)});
  const BenchComparison c = cmp(a, b);
  EXPECT_LT(c.rows.at(0).best_ratio, 1.0);
  EXPECT_EQ(c.rows[0].verdict, RowVerdict::same);
  EXPECT_FALSE(c.failed({}));
}

// Another board at lower clocks: every time 30% longer, the same share of its roofline. Against
// the yardstick the row is the same; by time it is slower (and the devices are noted).
TEST(BenchCompare, TheYardstickTakesOutTheMachineAndByTimeDoesNot) {
  const json a = report("H100 SXM", {gemm_row("ds_u", 3400, 3350, 85.0)});
  const json b = report("H100 PCIe", {gemm_row("ds_u", 4420, 4355, 85.0)});
  const BenchComparison c = cmp(a, b);
  EXPECT_EQ(c.rows.at(0).verdict, RowVerdict::same);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_THAT(c.notes[0], HasSubstr("different devices"));
  BenchCompareOptions t;
  t.by = moe::tools::CompareBy::time;
  const BenchComparison d = cmp(a, b, t);
  EXPECT_EQ(d.rows.at(0).metric, "time");
  EXPECT_NEAR(d.rows[0].ratio, 1.3, 1e-12);
  EXPECT_EQ(d.rows[0].verdict, RowVerdict::slower);
}

// --by min: the fastest samples as they are. On a board whose medians swing (an H200, session 34:
// one case's medians 3305-3745 us, its fastest samples 3213-3303), a baseline whose median swung
// up hides a real 10% slowdown from the medians' noise guard (NEW's fastest sample is not slower
// than that median); the minima catch it, and pass the swing itself.
TEST(BenchCompare, ByTheFastestSamplesTheMinimaDecide) {
  const json swung = report("H200", {gemm_row("ds_u", 3745, 3293, 66.0)});
  const json slower = report("H200", {gemm_row("ds_u", 4100, 3620, 60.0)});
  BenchCompareOptions t, m;
  t.by = moe::tools::CompareBy::time;
  m.by = moe::tools::CompareBy::min;
  const BenchComparison by_time = cmp(swung, slower, t);
  EXPECT_EQ(by_time.rows.at(0).verdict, RowVerdict::same);  // ratio 1.095, guard 0.967
  EXPECT_LT(by_time.rows[0].best_ratio, 1.0);
  const BenchComparison c = cmp(swung, slower, m);
  EXPECT_EQ(c.rows.at(0).metric, "min");
  EXPECT_NEAR(c.rows[0].ratio, 3620.0 / 3293.0, 1e-12);
  EXPECT_DOUBLE_EQ(c.rows[0].best_ratio, c.rows[0].ratio);
  EXPECT_DOUBLE_EQ(c.rows[0].old_value, 3293.0);
  EXPECT_DOUBLE_EQ(c.rows[0].new_value, 3620.0);
  EXPECT_EQ(c.rows[0].verdict, RowVerdict::slower);
  const std::string text = moe::tools::format_comparison(c, m);
  EXPECT_THAT(text, HasSubstr("9.9% more time than OLD at the fastest samples\n"));
  EXPECT_THAT(text, HasSubstr("by the fastest samples"));
  EXPECT_EQ(moe::tools::comparison_json(c, m)["by"], "min");
  // The swing itself (median +13%, fastest sample +2.5%) is the same by the minima.
  const json calm = report("H200", {gemm_row("ds_u", 3305, 3213, 75.0)});
  EXPECT_EQ(cmp(calm, swung, m).rows.at(0).verdict, RowVerdict::same);
  // Faster by the minima: 3213 -> 2900 us.
  EXPECT_EQ(cmp(calm, report("H200", {gemm_row("ds_u", 3400, 2900, 73.0)}), m).rows.at(0).verdict,
            RowVerdict::faster);
}

// A row without a roofline (no dense rate in one run) is compared by its time.
TEST(BenchCompare, ARowWithoutARooflineFallsBackToItsTime) {
  json nr = gemm_row("ds_u", 3400, 3350, 85.0);
  nr["pct_roof"] = nullptr;
  const BenchComparison c =
      cmp(report("H100", {gemm_row("ds_u", 3400, 3350, 85.0)}), report("H100", {nr}));
  EXPECT_EQ(c.rows.at(0).metric, "time");
  EXPECT_EQ(c.rows[0].verdict, RowVerdict::same);
}

TEST(BenchCompare, MissingUnverifiedAndChangedRowsFailAndAddedOnesDoNot) {
  const json a = report("H100", {memory_row("a", 800, 790, 90), memory_row("b", 800, 790, 90),
                                 memory_row("c", 800, 790, 90)});
  json unverified = memory_row("b", 800, 790, 90);
  unverified["verified"] = false;
  json resized = memory_row("c", 800, 790, 90);
  resized["bytes"] = 4.2e9;
  {  // a row gone
    const BenchComparison c =
        cmp(a, report("H100", {memory_row("b", 800, 790, 90), memory_row("c", 800, 790, 90)}));
    EXPECT_EQ(c.rows.at(0).verdict, RowVerdict::missing);
    EXPECT_TRUE(c.failed({}));
    BenchCompareOptions o;
    o.allow_missing = true;
    EXPECT_FALSE(c.failed(o));
  }
  {  // a row that failed verification, one whose bytes changed, one only NEW has
    const BenchComparison c = cmp(a, report("H100", {memory_row("a", 800, 790, 90), unverified,
                                                     resized, memory_row("d", 800, 790, 90)}));
    ASSERT_EQ(c.rows.size(), 4u);
    EXPECT_EQ(c.rows[1].verdict, RowVerdict::unverified);
    EXPECT_EQ(c.rows[2].verdict, RowVerdict::incomparable);
    EXPECT_THAT(c.rows[2].why, HasSubstr("bytes"));
    EXPECT_EQ(c.rows[3].verdict, RowVerdict::added);
    EXPECT_TRUE(c.failed({}));
  }
  {  // only the added row: passes
    const BenchComparison c =
        cmp(report("H100", {memory_row("a", 800, 790, 90)}),
            report("H100", {memory_row("a", 800, 790, 90), memory_row("d", 800, 790, 90)}));
    EXPECT_EQ(c.rows.at(1).verdict, RowVerdict::added);
    EXPECT_FALSE(c.failed({}));
  }
}

// Several runs of the baseline: a row fails only when slower than the slowest of them (beyond
// the allowance) and is faster only when faster than the fastest; their spread is reported.
TEST(BenchCompare, SeveralBaselinesJudgeAgainstTheirRange) {
  const json a = report("H100", {memory_row("a", 800, 795, 90), memory_row("b", 800, 795, 90)});
  const json b = report("H100", {memory_row("a", 840, 835, 86), memory_row("b", 800, 795, 90)});
  const json slow = report("H100", {memory_row("a", 905, 900, 80), memory_row("b", 800, 795, 90)});
  const json fast = report("H100", {memory_row("a", 700, 695, 99), memory_row("b", 800, 795, 90)});
  using moe::tools::NamedReport;
  const std::vector<NamedReport> olds = {{a, "a.json"}, {b, "b.json"}};
  // 90 and 86% in OLD: 80% is 7.5% slower than the slowest (86%), beyond 5%.
  BenchComparison c = compare_bench(olds, {slow, "new.json"}, {});
  EXPECT_EQ(c.baselines, 2);
  ASSERT_EQ(c.rows.size(), 2u);
  EXPECT_EQ(c.rows[0].verdict, RowVerdict::slower);
  EXPECT_NEAR(c.rows[0].ratio, 86.0 / 80.0, 1e-12);
  EXPECT_NEAR(c.rows[0].old_spread, 90.0 / 86.0 - 1, 1e-12);
  EXPECT_EQ(c.rows[0].baselines, 2);
  EXPECT_EQ(c.rows[1].verdict, RowVerdict::same);
  EXPECT_THAT(moe::tools::format_comparison(c, {}),
              HasSubstr("more time than the slowest of 2 OLD runs"));
  // 88% sits between them: the same, though 2.3% slower than the faster run.
  json mid = report("H100", {memory_row("a", 818, 815, 88), memory_row("b", 800, 795, 90)});
  c = compare_bench(olds, {mid, "new.json"}, {});
  EXPECT_EQ(c.rows.at(0).verdict, RowVerdict::same);
  // Faster only against the fastest baseline: 99% is 10% faster than 90%.
  c = compare_bench(olds, {fast, "new.json"}, {});
  EXPECT_EQ(c.rows.at(0).verdict, RowVerdict::faster);
  // A row of one baseline only is compared against that one; missing from NEW, it fails.
  const json c3 = report("H100", {memory_row("a", 800, 795, 90), memory_row("b", 800, 795, 90),
                                  memory_row("c", 800, 795, 90)});
  c = compare_bench({{a, "a.json"}, {c3, "c.json"}}, {a, "new.json"}, {});
  ASSERT_EQ(c.rows.size(), 3u);
  EXPECT_EQ(c.rows[2].verdict, RowVerdict::missing);
  EXPECT_THROW(compare_bench({}, {a, "new.json"}, {}), std::invalid_argument);
}

// --op / --impl keep some rows (the others are left out, not missing); a filter that names
// nothing in the reports, or nothing left to compare, is a usage error, never a silent pass.
TEST(BenchCompare, FiltersKeepRowsAndAFilterOfNothingIsAnError) {
  json theirs = memory_row("a", 900, 890, 80);  // a plugin's row, slower
  theirs["impl"] = "mine";
  json gone = memory_row("b", 800, 795, 90);  // a moe-gpu row NEW lacks
  const json a = report("H100", {memory_row("a", 800, 795, 90), gone, theirs});
  json theirs_new = theirs;
  theirs_new["pct_copy"] = 90.0;
  theirs_new["median_us"] = 800.0;
  theirs_new["min_us"] = 795.0;
  const json b = report("H100", {memory_row("a", 800, 795, 90), theirs_new});
  BenchCompareOptions o;
  o.impls = {"mine"};
  const BenchComparison c = cmp(a, b, o);
  ASSERT_EQ(c.rows.size(), 1u);
  EXPECT_EQ(c.rows[0].impl, "mine");
  EXPECT_EQ(c.rows[0].verdict, RowVerdict::faster);
  EXPECT_FALSE(c.failed(o));  // moe-gpu's missing row b is not gated
  EXPECT_TRUE(cmp(a, b).failed({}));
  o = {};
  o.ops = {"token_combine"};
  EXPECT_EQ(cmp(a, b, o).rows.size(), 3u);
  const auto error_of = [&](BenchCompareOptions f, const json& x, const json& y) {
    try {
      cmp(x, y, f);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  o = {};
  o.impls = {"mine", "mien"};
  EXPECT_THAT(error_of(o, a, b), HasSubstr("--impl mien: no row of the reports has it"));
  o = {};
  o.ops = {"grouped_gemm"};
  EXPECT_THAT(error_of(o, a, b), HasSubstr("--op grouped_gemm: no row"));
  EXPECT_THAT(error_of({}, report("H100", {}), report("H100", {})),
              HasSubstr("no rows to compare"));
}

// Burst against sustained timing is noted (the clocks differ); so is a report without a build.
TEST(BenchCompare, ADifferentWarmUpIsNoted) {
  json b = report("H100", {memory_row("a", 800, 790, 90)});
  b["sustain_ms"] = 1000.0;
  b.erase("version");
  const BenchComparison c = cmp(report("H100", {memory_row("a", 800, 790, 90)}), b);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_THAT(c.notes[0], HasSubstr("--sustain-ms 0 and 1000"));
  EXPECT_EQ(c.new_build, "");
  b["sustain_ms"] = "long";
  EXPECT_THROW(cmp(b, b), BenchFileError);
}

// A run cut short is noted; its missing rows say so.
TEST(BenchCompare, AnIncompleteRunIsNoted) {
  json b = report("H100", {memory_row("a", 800, 790, 90)});
  b["complete"] = false;
  const BenchComparison c =
      cmp(report("H100", {memory_row("a", 800, 790, 90), memory_row("b", 800, 790, 90)}), b);
  EXPECT_THAT(c.rows.at(1).why, HasSubstr("cut short"));
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_THAT(c.notes[0], HasSubstr("new.json is from a run cut short"));
}

// Files from elsewhere are untrusted: each fault names the file and the field.
TEST(BenchCompare, ABadReportNamesTheFileAndTheField) {
  const json good = report("H100", {memory_row("a", 800, 790, 90)});
  const auto fault = [&](json bad_report, const std::string& want) {
    try {
      cmp(good, bad_report);
      ADD_FAILURE() << "accepted, expected " << want;
    } catch (const BenchFileError& e) {
      EXPECT_THAT(e.what(), HasSubstr("new.json: " + want)) << e.what();
    }
  };
  fault(json::array(), "top level: expected an object");
  fault(json{{"device", "x"}}, "results: missing");
  fault(json{{"results", 3}}, "results: expected an array");
  json r = good;
  r["results"][0]["median_us"] = "fast";
  fault(r, "results[0].median_us: expected a number");
  r = good;
  r["results"][0]["median_us"] = -1;
  fault(r, "results[0].median_us: expected a positive number");
  r = good;
  r["results"][0]["min_us"] = 900;
  fault(r, "results[0].min_us: above median_us");
  r = good;
  r["results"][0].erase("op");
  fault(r, "results[0].op: missing");
  r = good;
  r["results"][0]["kind"] = "fast";
  fault(r, "results[0].kind: expected memory, gemm or tokens");
  r = good;
  r["results"][0]["pct_copy"] = nullptr;
  fault(r, "results[0].pct_copy: null");
  r = good;
  r["results"].push_back(r["results"][0]);
  fault(r, "results[1]: repeats results[0]");
  r = good;
  r["complete"] = "yes";
  fault(r, "complete: expected true or false");
  BenchCompareOptions o;
  o.max_slowdown = -0.01;
  EXPECT_THROW(compare_bench(good, "a", good, "b", o), std::invalid_argument);
}

}  // namespace
