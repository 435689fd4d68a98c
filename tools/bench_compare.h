// `moe-harness bench-compare OLD.json [OLD2.json ...] NEW.json`: a speed gate for CI between
// `bench --json` reports (tools/bench_cmd.cpp), with no GPU needed. A row of one report is matched
// to the row of the other with the same op, case name, direction and implementation, and compared
// by its time relative to the yardstick measured in its own run:
//   memory-bound rows   the time of a copy of its bytes at the run's copy bandwidth (pct_copy)
//   GEMM-like, block    its roofline at the run's dense cuBLAS rate and copy bandwidth (pct_roof)
// so two runs on boards of different clocks or power states compare what the kernel does with
// the machine it had; --by time compares the medians as they are (one machine, same state);
// --by min the fastest samples as they are: on a board whose clocks swing (an H200 in session 34:
// one GEMM case's medians 3305-3745 us in five runs, its fastest samples 3213-3303) the minimum is
// the steadier statistic, and the medians' noise guard below lets a real slowdown through where
// OLD's median swung up; the price: a slowdown that spares the fastest sample goes unseen.
//
// ratio = NEW's normalised time / OLD's (> 1: slower; with several OLD reports, the slowest's). A
// row is SLOWER when ratio > 1 + max_slowdown and NEW's fastest sample, normalised the same way, is
// still slower than OLD's median (one slow median among fast samples is noise, not a regression);
// FASTER when ratio < 1 - max_slowdown (with several OLD reports: NEW against the slowest for
// SLOWER, the fastest for FASTER, and their spread is reported). max_slowdown is a policy: set it
// above the run-to-run spread of the rows you gate (docs/perf.md records this repository's on an
// H100: most rows within 1-2% between two sessions' full runs, the skewed grouped forward 5-10%
// between calls).
//
// Exit status of the command: 0 no row SLOWER, none missing, every NEW row verified; 1 otherwise
// (a row of OLD missing from NEW, unless --allow-missing; a NEW row that failed verification; a
// row whose bytes, FLOPs or case line changed, which cannot be compared); 2 bad usage (an --op or
// --impl no row has, no row left to compare) or a file that is not a bench report (its path and
// the field named).
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace moe::tools {

// What rows are compared by (--by): each run's yardstick, the medians as they are, or the fastest
// samples as they are.
enum class CompareBy { yardstick, time, min };

struct BenchCompareOptions {
  double max_slowdown = 0.05;  // fraction: 0.05 = 5%
  CompareBy by = CompareBy::yardstick;
  bool allow_missing = false;  // a row of OLD absent from NEW is a note, not a failure
  // Only rows of these ops / implementations (empty: all): e.g. a plugin's CI gates its own
  // kernel's rows and not moe-gpu's. The others are left out, not missing.
  std::vector<std::string> ops, impls;
};

enum class RowVerdict { same, slower, faster, missing, added, unverified, incomparable };
const char* verdict_name(RowVerdict v);

struct RowComparison {
  std::string op, name, dir, impl, kind;
  std::string metric;  // "pct_copy", "pct_roof", "time" (medians) or "min" (fastest samples)
  RowVerdict verdict = RowVerdict::same;
  double old_value = 0, new_value = 0;  // the metric in each report (0 where absent)
  double ratio = 0;                     // NEW's normalised time / OLD's; 0 where not compared
  double best_ratio = 0;                // NEW's fastest sample / OLD's median, normalised
  int baselines = 0;                    // OLD reports that have the row
  double old_spread = 0;  // their fastest over their slowest, minus 1 (0 with one baseline)
  std::string why;        // for missing, unverified, incomparable
};

struct BenchComparison {
  int baselines = 1;                   // OLD reports
  std::string old_device, new_device;  // OLD's: the first baseline's
  std::string old_build, new_build;    // "VERSION (git REV)" where the report has them, else ""
  bool old_complete = true, new_complete = true;
  std::vector<RowComparison> rows;  // OLD's row order, then rows only NEW has
  std::vector<std::string> notes;
  bool failed(const BenchCompareOptions& o) const;
};

// A file that is not a bench report: what() names the file, and the row and field at fault.
class BenchFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Against several runs of OLD (baselines, e.g. main's bench in a few CI runs): each row is judged
// against the slowest baseline that has it (SLOWER only when NEW is slower than all of them) and
// the fastest (FASTER only when faster than all), and reports their spread, the run-to-run
// variation --max-slowdown has to cover.
struct NamedReport {
  nlohmann::json json;
  std::string name;  // its path, for messages
};
BenchComparison compare_bench(const std::vector<NamedReport>& olds, const NamedReport& neu,
                              const BenchCompareOptions& o);
BenchComparison compare_bench(const nlohmann::json& old_report, const std::string& old_name,
                              const nlohmann::json& new_report, const std::string& new_name,
                              const BenchCompareOptions& o);
// Reads and parses a report (BenchFileError for an unreadable file or invalid JSON).
nlohmann::json read_bench_report(const std::string& path);

std::string format_comparison(const BenchComparison& c, const BenchCompareOptions& o);
nlohmann::json comparison_json(const BenchComparison& c, const BenchCompareOptions& o);

// `moe-harness bench-targets TARGETS.json REPORT.json`: absolute floors where bench-compare has
// relative ones, e.g. an issue's "the router forward at >= 75% of copy" or a plugin team's "our
// grouped GEMM at >= 85% of roofline", judged on one report. A targets file:
//   {"title": "...", "device": "H100",             (optional: a text the report's device holds)
//    "targets": [{"op": "grouped_gemm", "name": "deepseek_uniform", "dir": "fwd",
//                 "impl": "moe-gpu" (optional, the default), "metric": "pct_roof", "min": 88,
//                 "note": "..." (optional)}, ...]}
// metric: pct_copy (memory-bound rows), pct_roof (GEMM-like rows and the block) or tokens_per_s
// (the block). A target is MET when its row's value >= min; MISSED below; MISSING without such a
// row; UNVERIFIED when the row failed verification; NO VALUE when the row lacks that metric (a
// memory row's roofline, a GEMM row without a dense rate). Targets files are untrusted input: a
// wrong field throws BenchFileError naming the target and the field.
struct BenchTarget {
  std::string op, name, dir, impl = "moe-gpu", metric, note;
  double min = 0;
};
struct BenchTargets {
  std::string title, device;  // device: "" for any board
  std::vector<BenchTarget> targets;
};
BenchTargets read_bench_targets(const nlohmann::json& j, const std::string& file);

enum class TargetVerdict { met, missed, missing, unverified, no_value };
const char* target_verdict_name(TargetVerdict v);

struct TargetResult {
  BenchTarget target;
  TargetVerdict verdict = TargetVerdict::missing;
  double value = 0;  // the row's metric (0 where missing or without a value)
};
struct TargetsCheck {
  std::string device, build;          // the report's
  bool device_matches = true;         // the report's device holds the targets' device text
  std::vector<TargetResult> results;  // the targets' order
  bool failed() const;                // any target not MET
};
TargetsCheck check_targets(const BenchTargets& t, const nlohmann::json& report,
                           const std::string& report_name);
std::string format_targets(const BenchTargets& t, const TargetsCheck& c);
nlohmann::json targets_json(const BenchTargets& t, const TargetsCheck& c);

}  // namespace moe::tools
