// `moe-harness bench-targets TARGETS.json REPORT.json [--any-device] [--json FILE]`: absolute
// floors (tools/bench_compare.h) judged on one `bench --json` report. Runs anywhere (no GPU).
// Exit status: 0 every target met, 1 one missed, missing, unverified or without a value, 2 bad
// usage, a file that is not a targets file or a report, or a report from another board than the
// targets' (unless --any-device).
#include <cstdio>
#include <fstream>
#include <string>

#include "tools/bench_compare.h"
#include "tools/commands.h"

namespace moe::tools {

void add_bench_targets_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "bench-targets",
      "Judge a `bench --json` report against absolute floors (a targets file: per row, a "
      "minimum % of copy, % of roofline or tokens/s); fail when one is not met");
  static std::string targets_path, report_path, json_path;
  static bool any_device = false;
  cmd->add_option("TARGETS", targets_path,
                  "Targets file: {\"title\", \"device\" (a text the report's device must hold), "
                  "\"targets\": [{\"op\", \"name\", \"dir\", \"impl\" (default moe-gpu), "
                  "\"metric\": pct_copy | pct_roof | tokens_per_s, \"min\", \"note\"}]}")
      ->required();
  cmd->add_option("REPORT", report_path, "The `bench --json` report to judge")->required();
  cmd->add_flag("--any-device", any_device,
                "Judge a report from another board than the targets' (the floors were set for "
                "theirs: read the verdicts as a guide)");
  cmd->add_option("--json", json_path, "Also write the verdicts to this JSON file");
  cmd->callback([&status] {
    try {
      const BenchTargets t = read_bench_targets(read_bench_report(targets_path), targets_path);
      const TargetsCheck c = check_targets(t, read_bench_report(report_path), report_path);
      if (!c.device_matches && !any_device) {
        std::fprintf(stderr,
                     "bench-targets: %s sets targets for a board named '%s'; %s is from '%s' "
                     "(--any-device to judge it anyway)\n",
                     targets_path.c_str(), t.device.c_str(), report_path.c_str(), c.device.c_str());
        status = 2;
        return;
      }
      std::printf("REPORT %s: %s%s%s%s\n", report_path.c_str(), c.device.c_str(),
                  c.build.empty() ? "" : ", ", c.build.c_str(),
                  c.device_matches ? "" : " (another board than the targets')");
      std::fputs(format_targets(t, c).c_str(), stdout);
      if (!json_path.empty()) {
        std::ofstream f(json_path);
        f << targets_json(t, c).dump(2) << "\n";
        if (!f) {
          std::fprintf(stderr, "--json: cannot write '%s'\n", json_path.c_str());
          status = 2;
          return;
        }
      }
      status = c.failed() ? 1 : 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench-targets: %s\n", e.what());
      status = 2;
    }
  });
}

}  // namespace moe::tools
