// `moe-harness bench-compare OLD.json [OLD2.json ...] NEW.json [--max-slowdown PCT]
// [--by yardstick|time|min] [--allow-missing] [--op NAME]... [--impl NAME]... [--json FILE]`: the
// speed gate of tools/bench_compare.h between `bench --json` reports, the last one under test. Runs
// anywhere (no GPU). Exit status: 0 no regression, 1 a row slower, missing, unverified or
// incomparable, 2 bad usage or a file that is not a bench report.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tools/bench_compare.h"
#include "tools/commands.h"

namespace moe::tools {

void add_bench_compare_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "bench-compare",
      "Compare `bench --json` reports row by row (baselines, then the one under test): each "
      "row's time over its own run's yardstick (copy bandwidth, roofline); fail on a slowdown "
      "beyond --max-slowdown");
  static std::vector<std::string> paths, ops, impls;
  static std::string by = "yardstick", json_path;
  static double max_slowdown_pct = 5.0;
  static bool allow_missing = false;
  cmd->add_option("REPORTS", paths,
                  "OLD.json [OLD2.json ...] NEW.json: one or more baseline reports (several runs "
                  "of the baseline: a row fails only when slower than all of them), then the "
                  "report under test")
      ->required()
      ->expected(2, -1);
  cmd->add_option("--max-slowdown", max_slowdown_pct,
                  "Percent more time (over the run's yardstick) a row may take before it fails; "
                  "set it above your rows' run-to-run spread")
      ->check(CLI::Range(0.0, 999.0));
  cmd->add_option("--by", by,
                  "yardstick: each row's time over its run's copy bandwidth or roofline; time: "
                  "the medians as they are (same machine, same state); min: the fastest "
                  "samples as they are (steadier where clocks swing, e.g. an H200)")
      ->check(CLI::IsMember({"yardstick", "time", "min"}));
  cmd->add_flag("--allow-missing", allow_missing,
                "A row of OLD absent from NEW is reported, not a failure");
  cmd->add_option("--op", ops, "Only the rows of this op (repeatable)");
  cmd->add_option("--impl", impls,
                  "Only the rows of this implementation (repeatable; e.g. a plugin's, to gate "
                  "its rows and not moe-gpu's)");
  cmd->add_option("--json", json_path, "Also write the comparison to this JSON file");
  cmd->callback([&status] {
    BenchCompareOptions o;
    o.max_slowdown = max_slowdown_pct / 100.0;
    o.by = by == "time" ? CompareBy::time : by == "min" ? CompareBy::min : CompareBy::yardstick;
    o.allow_missing = allow_missing;
    o.ops = ops;
    o.impls = impls;
    try {
      std::vector<NamedReport> olds;
      for (size_t i = 0; i + 1 < paths.size(); ++i) {
        olds.push_back({read_bench_report(paths[i]), paths[i]});
      }
      const NamedReport neu{read_bench_report(paths.back()), paths.back()};
      const BenchComparison c = compare_bench(olds, neu, o);
      std::printf(
          "OLD %s%s: %s%s%s\nNEW %s: %s%s%s\n", paths.front().c_str(),
          olds.size() > 1 ? (" and " + std::to_string(olds.size() - 1) + " more").c_str() : "",
          c.old_device.c_str(), c.old_build.empty() ? "" : ", ", c.old_build.c_str(),
          neu.name.c_str(), c.new_device.c_str(), c.new_build.empty() ? "" : ", ",
          c.new_build.c_str());
      std::fputs(format_comparison(c, o).c_str(), stdout);
      if (!json_path.empty()) {
        std::ofstream f(json_path);
        f << comparison_json(c, o).dump(2) << "\n";
        if (!f) {
          std::fprintf(stderr, "--json: cannot write '%s'\n", json_path.c_str());
          status = 2;
          return;
        }
      }
      status = c.failed(o) ? 1 : 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench-compare: %s\n", e.what());
      status = 2;
    }
  });
}

}  // namespace moe::tools
