// Subcommands of the moe-harness CLI. Each add_* registers one subcommand on the app; its
// callback stores the process exit status in `status` (0 ok, 1 check failure, 2 bad usage).
#pragma once

#include <CLI/CLI.hpp>

namespace moe::tools {

void add_list_command(CLI::App& app, int& status);
void add_check_command(CLI::App& app, int& status);
void add_golden_command(CLI::App& app, int& status);         // tools/golden_cmd.cpp
void add_bench_command(CLI::App& app, int& status);          // tools/bench_cmd.cpp
void add_bench_compare_command(CLI::App& app, int& status);  // tools/bench_compare_cmd.cpp
void add_bench_targets_command(CLI::App& app, int& status);  // tools/bench_targets_cmd.cpp
void add_launch_command(CLI::App& app, int& status);         // tools/launch_cmd.cpp

}  // namespace moe::tools
