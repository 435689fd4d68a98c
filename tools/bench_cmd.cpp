// `moe-harness bench [--op NAME]... [--json FILE]`: for every registry op with a CUDA benchmark
// hook and bench cases, first verify the case (check_gpu on the same parameters at a small size),
// then time forward and backward with CUDA events (median of >= 20 samples after warm-up), and
// report the achieved bandwidth from OpInfo::cost against a device-to-device copy measured in the
// same run:
//
//   op           case          dir   verified   median_us   GB/s   %copy
//
// Exit status: 0 all cases verified, 1 a verification failed, 2 bad usage or no GPU.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/ops/check.h"
#include "harness/ops/registry.h"
#include "tools/bench_a2a.h"
#include "tools/commands.h"

#ifdef MOE_WITH_CUDA
#include "gpu/bench_util.cuh"
#endif

namespace moe::tools {

namespace {

// The case the benchmark verifies first: the same op, dtype, regime and parameters with the row
// count (T for router ops, R for per-row reductions) cut to `rows`.
Case small_case(const Case& c, int64_t rows) {
  Case s = c;
  for (const char* key : {"T", "R"}) {
    if (s.has(key) && s.i(key) > rows) s.set(key, rows);
  }
  if (s.has("total_num_tokens") && s.has("R") && s.i("total_num_tokens") > s.i("R")) {
    s.set("total_num_tokens", s.i("R"));
  }
  return s;
}

#ifdef MOE_WITH_CUDA
struct Result {
  std::string op, name, line, dir;
  bool verified = false;
  std::string verify_note;
  double median_us = 0, min_us = 0, max_us = 0, bytes = 0, gbps = 0, pct_copy = 0;
  int samples = 0, per_sample = 0, sets = 0;
  bool graph = false;
};

int run_bench(const std::vector<std::string>& only_ops, const std::string& json_path, int samples,
              int64_t verify_rows) {
  if (!ops::gpu_available()) {
    std::fprintf(stderr, "bench: no GPU available (%s)\n", ops::gpu_description().c_str());
    return 2;
  }
  for (const std::string& name : only_ops) {
    if (!ops::find_op(name)) {
      std::fprintf(stderr, "--op: unknown op '%s' (see `moe-harness list`)\n", name.c_str());
      return 2;
    }
  }
  const std::string device = ops::gpu_description();
  const gpu::CopyBandwidth copy = gpu::measure_copy_bandwidth(size_t{1} << 30, samples);
  std::printf("device: %s\n", device.c_str());
  std::printf("copy bandwidth (cudaMemcpy D2D, %.0f MiB, read+write): %.1f GB/s (median of %d)\n",
              copy.bytes / 1048576.0, copy.gbps, copy.t.samples);
  std::printf("%-16s %-20s %-4s %-8s %11s %11s %9s %7s %5s %5s\n", "op", "case", "dir", "verified",
              "median_us", "min_us", "GB/s", "%copy", "sets", "graph");

  std::vector<Result> results;
  bool all_ok = true;
  for (const ops::OpInfo* op : ops::all_ops()) {
    if (!only_ops.empty() &&
        std::find(only_ops.begin(), only_ops.end(), op->name) == only_ops.end()) {
      continue;
    }
    if (!op->gpu_bench || !op->bench_cases || !op->gpu) continue;
    for (const Case& c : op->bench_cases()) {
      // Verify first: a failing kernel's timing means nothing.
      const Case sc = small_case(c, verify_rows);
      bool ok = false;
      std::string note;
      try {
        const Report r = ops::check_gpu(*op, sc);
        ok = r.ok();
        if (!ok) note = r.str();
      } catch (const std::exception& e) {
        note = std::string("exception: ") + e.what();
      }
      if (!ok) {
        all_ok = false;
        std::printf("VERIFY FAIL %s\n%s  replay: %s\n", sc.line().c_str(), note.c_str(),
                    ops::replay_line(sc, "gpu").c_str());
      }
      const ops::Cost cost = op->cost ? op->cost(c) : ops::Cost{};
      const TensorMap in = op->make_inputs(c);
      // Several independent sets when one set fits in L2 (see gpu/bench_util.cuh).
      const int sets = gpu::rotation_sets(std::max(cost.fwd_bytes, cost.bwd_bytes));
      std::vector<ops::OpInfo::Bench> benches;
      for (int k = 0; k < sets; ++k) benches.push_back(op->gpu_bench(c, in));
      const std::string name = c.s("name", "");
      for (const char* dir : {"fwd", "bwd"}) {
        const bool fwd = std::string(dir) == "fwd";
        if (!fwd && !benches.front().bwd) continue;
        const gpu::TimingStats t = gpu::time_launches_auto(
            [&](int i) {
              auto& b = benches[static_cast<size_t>(i % sets)];
              fwd ? b.fwd() : b.bwd();
            },
            samples);
        gpu::device_synchronize();
        Result r;
        r.op = op->name;
        r.name = name;
        r.line = c.line();
        r.dir = dir;
        r.verified = ok;
        r.verify_note = note;
        r.median_us = t.median_ms * 1e3;
        r.min_us = t.min_ms * 1e3;
        r.max_us = t.max_ms * 1e3;
        r.samples = t.samples;
        r.per_sample = t.per_sample;
        r.sets = sets;
        r.graph = t.graph;
        r.bytes = fwd ? cost.fwd_bytes : cost.bwd_bytes;
        r.gbps = r.bytes / (t.median_ms * 1e-3) / 1e9;
        r.pct_copy = 100.0 * r.gbps / copy.gbps;
        std::printf("%-16s %-20s %-4s %-8s %11.2f %11.2f %9.1f %6.1f%% %5d %5s\n", r.op.c_str(),
                    r.name.c_str(), dir, ok ? "yes" : "FAILED", r.median_us, r.min_us, r.gbps,
                    r.pct_copy, sets, r.graph ? "yes" : "no");
        std::fflush(stdout);
        results.push_back(std::move(r));
      }
    }
  }
  if (!json_path.empty()) {
    nlohmann::json j;
    j["device"] = device;
    j["copy"] = {{"bytes", copy.bytes},
                 {"gbps", copy.gbps},
                 {"median_ms", copy.t.median_ms},
                 {"samples", copy.t.samples}};
    j["results"] = nlohmann::json::array();
    for (const Result& r : results) {
      j["results"].push_back({{"op", r.op},
                              {"name", r.name},
                              {"case", r.line},
                              {"dir", r.dir},
                              {"verified", r.verified},
                              {"verify_note", r.verify_note},
                              {"median_us", r.median_us},
                              {"min_us", r.min_us},
                              {"max_us", r.max_us},
                              {"bytes", r.bytes},
                              {"gbps", r.gbps},
                              {"pct_copy", r.pct_copy},
                              {"samples", r.samples},
                              {"launches_per_sample", r.per_sample},
                              {"rotation_sets", r.sets},
                              {"cuda_graph", r.graph}});
    }
    std::ofstream f(json_path);
    if (!f) {
      std::fprintf(stderr, "--json: cannot write '%s'\n", json_path.c_str());
      return 2;
    }
    f << j.dump(2) << "\n";
  }
  return all_ok ? 0 : 1;
}
#endif

}  // namespace

void add_bench_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "bench", "Verify, then time the CUDA ops' benchmark cases against the copy bandwidth");
  static std::vector<std::string> op_names;
  static std::string json_path;
  static int samples = 25;
  static int64_t verify_rows = 1024;
  cmd->add_option("--op", op_names, "Only these ops (repeatable; see `moe-harness list`)");
  cmd->add_option("--json", json_path, "Also write the results to this JSON file");
  cmd->add_option("--samples", samples, "Timed samples per case and direction (>= 20)")
      ->check(CLI::Range(20, 100000));
  cmd->add_option("--verify-rows", verify_rows, "Rows of the verification case (T or R)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  // ragged_all_to_all over NCCL under the launcher (tools/bench_a2a.h): nccl-tests style rows.
  static RaggedA2ABenchOptions a2a;
  auto* g = "ragged_all_to_all under `moe-harness launch`";
  cmd->add_option("--hidden", a2a.hidden, "bf16 columns per row")->group(g);
  cmd->add_option("--topk", a2a.topk, "Rows per token")->group(g);
  cmd->add_option("--min-tokens", a2a.min_tokens, "Smallest tokens per rank")->group(g);
  cmd->add_option("--max-tokens", a2a.max_tokens, "Largest tokens per rank (doubling)")->group(g);
  cmd->add_option("--warmup", a2a.warmup, "Untimed calls per row")->group(g);
  cmd->add_option("--iters", a2a.iters, "Timed calls per row")->group(g);
  cmd->callback([&status] {
    if (op_names == std::vector<std::string>{"ragged_all_to_all"} &&
        std::getenv("MOE_WORLD_SIZE")) {
      // One process per GPU: the exchange over NCCL next to ncclAlltoAll (every row verified).
      a2a.json = json_path;
      status = run_ragged_a2a_bench(a2a);
      return;
    }
#ifdef MOE_WITH_CUDA
    try {
      status = run_bench(op_names, json_path, samples, verify_rows);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench: %s\n", e.what());
      status = 2;
    }
#else
    std::fprintf(stderr, "bench: this build has no CUDA backend\n");
    status = 2;
#endif
  });
}

}  // namespace moe::tools
