// moe-harness: CI gating and numerics debugging over the op registry.
//
//   moe-harness list
//   moe-harness check [--op NAME] [--backend reference|gpu] [--cases N] [--seed S] [--case LINE]
//   moe-harness launch -n N -- moe-harness check --backend gpu --ep N   (moe_block over NCCL)
//   moe-harness golden record|verify|diff|show ...   (tools/golden_cmd.cpp)
//   moe-harness bench [--op NAME] [--json FILE]        (tools/bench_cmd.cpp)
//   moe-harness launch -n N -- COMMAND...              (tools/launch_cmd.cpp)
//
// Exit status: 0 all passed, 1 a check failed, 2 bad usage (or --backend gpu without a GPU).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>

#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/registry.h"
#include "tools/commands.h"

#ifdef MOE_WITH_NCCL
#include <memory>

#include "gpu/nccl_comm.cuh"
#include "harness/ops/block_gpu.h"
#endif

namespace moe::tools {

namespace {

struct Row {
  std::string op, disposition;
  int cases = 0, passed = 0, failed = 0;
  double worst_pct = 0, seconds = 0;
};

// Runs one case on a backend; prints the report and replay line on failure.
bool run_case(const ops::OpInfo& op, const Case& c, const std::string& backend, Row& row,
              bool verbose) {
  ++row.cases;
  Report r;
  try {
    r = backend == "gpu" ? ops::check_gpu(op, c) : ops::check_reference(op, c);
  } catch (const std::exception& e) {
    r.failures.push_back(std::string("exception: ") + e.what());
  }
  row.worst_pct = std::max(row.worst_pct, r.worst_pct());
  if (r.ok()) {
    ++row.passed;
    if (verbose)
      std::printf("PASS %s (worst %.1f%% of tolerance)\n", c.line().c_str(), r.worst_pct());
    return true;
  }
  ++row.failed;
  std::printf("FAIL %s\n%s  replay: %s\n", c.line().c_str(), r.str().c_str(),
              ops::replay_line(c, backend).c_str());
  return false;
}

}  // namespace

void add_list_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand("list", "List the registered ops");
  cmd->callback([&status] {
    std::printf("%-34s %-9s %-10s %-6s %s\n", "op", "spec", "reference", "cuda", "named cases");
    for (const ops::OpInfo* op : ops::all_ops()) {
      std::printf("%-34s %-9s %-10s %-6s %zu\n", op->name.c_str(), op->spec.c_str(), "yes",
                  op->gpu ? "yes" : "no", op->named ? op->named().size() : size_t{0});
    }
    status = 0;
  });
}

void add_check_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand("check", "Run the registry's property checks");
  static std::string op_name, backend, case_line;
  static int n_cases = 20;
  static uint64_t seed = 1;
  static bool verbose = false, random_only = false;
  static int ep = 0;
  cmd->add_option("--op", op_name, "Only this op (see `moe-harness list`)");
  cmd->add_option("--backend", backend, "reference or gpu (default: gpu when a GPU is present)")
      ->check(CLI::IsMember({"reference", "gpu"}));
  cmd->add_option("--cases", n_cases, "Random cases per op (plus every named case)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", seed, "Seed of the random cases");
  cmd->add_option("--case", case_line, "Replay exactly this case line");
  cmd->add_flag("--random-only", random_only, "Skip the named cases");
  cmd->add_flag("-v,--verbose", verbose, "Print every case");
  cmd->add_option("--ep", ep,
                  "Run moe_block's cases, rewritten to ep_size N and dp_size 1, over NCCL, one EP "
                  "rank per process (under `moe-harness launch -n N`)")
      ->check(CLI::PositiveNumber);
  cmd->callback([&status] {
    if (backend.empty()) backend = ops::gpu_available() ? "gpu" : "reference";
    if (backend == "gpu" && !ops::gpu_available()) {
      std::fprintf(stderr, "--backend gpu: no GPU available (%s)\n",
                   ops::gpu_description().c_str());
      status = 2;
      return;
    }
#ifdef MOE_WITH_NCCL
    // One NCCL communicator for the whole run; destroyed before the CUDA runtime shuts down.
    struct CommGuard {
      std::unique_ptr<gpu::NcclCommunicator> comm;
      ~CommGuard() {
        ops::set_block_communicator(nullptr);
        comm.reset();
      }
    } guard;
#endif
    if (ep > 0) {
#ifdef MOE_WITH_NCCL
      if (backend != "gpu" || !gpu::NcclBootstrap::launched() ||
          (!op_name.empty() && op_name != "moe_block")) {
        std::fprintf(stderr,
                     "--ep %d: runs moe_block on the gpu backend under the launcher: "
                     "moe-harness launch -n %d -- moe-harness check --backend gpu --ep %d\n",
                     ep, ep, ep);
        status = 2;
        return;
      }
      try {
        guard.comm = std::make_unique<gpu::NcclCommunicator>(gpu::NcclBootstrap::from_env());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "--ep %d: cannot create the NCCL communicator: %s\n", ep, e.what());
        status = 2;
        return;
      }
      if (guard.comm->size() != ep) {
        std::fprintf(stderr, "--ep %d: the launcher started %d ranks\n", ep, guard.comm->size());
        status = 2;
        return;
      }
      ops::set_block_communicator(guard.comm.get());
      op_name = "moe_block";
      std::printf("ep: %d ranks over NCCL %s, this is rank %d on GPU %d\n", ep,
                  gpu::NcclCommunicator::library_version().c_str(), guard.comm->rank(),
                  guard.comm->device());
#else
      std::fprintf(stderr, "--ep: this build has no NCCL\n");
      status = 2;
      return;
#endif
    }
    std::printf("backend: %s%s\n", backend.c_str(),
                backend == "gpu" ? (" on " + ops::gpu_description()).c_str() : "");
    if (!case_line.empty()) {
      Case c;
      try {
        c = Case::parse(case_line);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "--case: %s\n", e.what());
        status = 2;
        return;
      }
      const ops::OpInfo* op = ops::find_op(c.op);
      if (!op) {
        std::fprintf(stderr, "--case: unknown op '%s'\n", c.op.c_str());
        status = 2;
        return;
      }
      Row row;
      status = run_case(*op, c, backend, row, true) ? 0 : 1;
      return;
    }
    std::vector<const ops::OpInfo*> ops_to_run;
    for (const ops::OpInfo* op : ops::all_ops())
      if (op_name.empty() || op->name == op_name) ops_to_run.push_back(op);
    if (ops_to_run.empty()) {
      std::fprintf(stderr, "--op: unknown op '%s'\n", op_name.c_str());
      status = 2;
      return;
    }
    std::printf("random cases per op: %d, seed: %llu\n", n_cases,
                static_cast<unsigned long long>(seed));
    std::vector<Row> rows;
    for (const ops::OpInfo* op : ops_to_run) {
      Row row;
      row.op = op->name;
      const auto t0 = std::chrono::steady_clock::now();
      if (backend == "gpu" && !op->gpu) {
        row.disposition = "NotSupported (no CUDA twin yet)";
        rows.push_back(row);
        continue;
      }
      // With --ep, every case rewritten to that EP size on one data-parallel group (those whose
      // experts do not divide by it are skipped).
      auto for_ep = [](const Case& c) -> std::optional<Case> {
        if (ep == 0) return c;
        return ops::moe_block_case_for_ep(c, ep);
      };
      if (!random_only && op->named) {
        for (const Case& c : op->named())
          if (auto e = for_ep(c)) run_case(*op, *e, backend, row, verbose);
      }
      int drawn = 0;
      for (int i = 0; drawn < n_cases && i < 200 * std::max(n_cases, 1); ++i) {
        const int size = 10 + (n_cases > 1 ? drawn * 90 / (n_cases - 1) : 0);
        const std::optional<Case> c =
            for_ep(op->gen()(rc::Random(seed * 1000003ull + i), size).value());
        if (!c) continue;
        ++drawn;
        run_case(*op, *c, backend, row, verbose);
      }
      row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      row.disposition = row.failed ? "Incorrect" : "Passed";
      rows.push_back(row);
    }
    std::printf("\n%-34s %6s %6s %6s %10s %8s  %s\n", "op", "cases", "passed", "failed",
                "worst %tol", "time s", "disposition");
    bool any_failed = false;
    for (const Row& r : rows) {
      std::printf("%-34s %6d %6d %6d %10.1f %8.2f  %s\n", r.op.c_str(), r.cases, r.passed, r.failed,
                  r.worst_pct, r.seconds, r.disposition.c_str());
      any_failed |= r.failed > 0;
    }
#ifdef MOE_WITH_NCCL
    // Every rank checked the same cases; the run passes only if every rank passed.
    if (guard.comm) {
      const int64_t failed_ranks = guard.comm->all_reduce_sum(any_failed ? 1 : 0);
      std::printf("ranks failing: %lld of %d\n", static_cast<long long>(failed_ranks),
                  guard.comm->size());
      any_failed = failed_ranks > 0;
    }
#endif
    status = any_failed ? 1 : 0;
  });
}

}  // namespace moe::tools

int main(int argc, char** argv) {
  CLI::App app{
      "moe-harness: proves Mixture-of-Experts kernels right (CPU reference, CUDA, golden files)"};
  app.require_subcommand(1);
  int status = 0;
  moe::tools::add_list_command(app, status);
  moe::tools::add_check_command(app, status);
#ifdef MOE_HAS_GOLDEN_CMD
  moe::tools::add_golden_command(app, status);
#endif
#ifdef MOE_HAS_BENCH_CMD
  moe::tools::add_bench_command(app, status);
#endif
#ifdef MOE_HAS_LAUNCH_CMD
  moe::tools::add_launch_command(app, status);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  return status;
}
