// moe-harness: CI gating and numerics debugging over the op registry.
//
//   moe-harness list [--plugin PATH]                   ops x implementations
//   moe-harness check [--impl NAME] [--plugin PATH] ... (tools/check_cmd.cpp)
//   moe-harness golden record|verify|diff|show ...     (tools/golden_cmd.cpp)
//   moe-harness bench [--op NAME] [--json FILE]        (tools/bench_cmd.cpp)
//   moe-harness bench-compare OLD.json NEW.json        (tools/bench_compare_cmd.cpp)
//   moe-harness bench-targets TARGETS.json REPORT.json (tools/bench_targets_cmd.cpp)
//   moe-harness launch -n N -- COMMAND...              (tools/launch_cmd.cpp)
//
// Exit status: 0 all passed, 1 a check failed, 2 bad usage (or --impl moe-gpu without a GPU).
#include <cstdio>

#include "tools/commands.h"

int main(int argc, char** argv) {
  // Line-buffered even when piped, so a CI log shows each op's row as soon as it finishes.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{
      "moe-harness: proves Mixture-of-Experts kernels right (CPU reference, CUDA, golden files)"};
  app.set_version_flag("--version",
                       std::string("moe-harness ") + MOE_VERSION + " (git " + MOE_GIT_REV + ")");
  app.require_subcommand(1);
  int status = 0;
  moe::tools::add_list_command(app, status);
  moe::tools::add_check_command(app, status);
  moe::tools::add_golden_command(app, status);
  moe::tools::add_bench_command(app, status);
  moe::tools::add_bench_compare_command(app, status);
  moe::tools::add_bench_targets_command(app, status);
  moe::tools::add_launch_command(app, status);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  return status;
}
