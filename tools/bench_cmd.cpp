// `moe-harness bench [--op NAME]... [--case NAME]... [--impl NAME]... [--plugin PATH]...
// [--json FILE]`: for every registry op with a CUDA benchmark hook and bench cases, first verify
// the case (check_gpu on the same parameters at a small size: OpInfo::bench_verify_case, or the
// row count cut to --verify-rows), then time it with CUDA events (median of >= 20 samples after
// warm-up, gpu/bench_util.cuh) on inputs that stay on the device: generated there at full size by
// OpInfo::gpu_bench_device where the record has it, else made on the host by make_inputs and
// uploaded. Each case's buffers are freed before the next case.
//
// What a row reports depends on the op (OpInfo::Bench hints):
//   memory-bound (default)  fwd, bwd rows: GB/s from OpInfo::cost bytes, % of a device-to-device
//                           copy measured in the same run; a note gives a second byte count
//                           where the record supplies one (e.g. an issue's formula), and another
//                           the time of a copy of the row's own bytes, timed the same way
//                           (gpu::time_copy_of: rotated buffers; the faster of cudaMemcpy
//                           launched directly and a bulk-copy kernel in graph replays), the
//                           rate a kernel of that size can reach once launch, ramp-up and tail
//                           are paid, and an empty kernel's
//                           time, the floor of any kernel here (JSON "same_size_copy_us",
//                           "pct_same_size_copy", "same_size_copy_memcpy_us" / "_kernel_us",
//                           "empty_kernel_us")
//   GEMM-like (dense_m/k/n) fwd, fwd+bwd rows: TFLOP/s from cost flops, % of one dense cuBLAS
//                           GEMM of equal FLOPs timed in the same run (fwd; fwd + dgrad + wgrad)
//                           a uniform case (OpInfo::Bench::batched) also cuBLAS strided-batched
//                           on its products with the groups evened out (same FLOPs and bytes),
//                           the vendor's time for that work (a line under the rows; JSON
//                           "batched": products, median_us, time_ratio = the row's time /
//                           cuBLAS's, < 1 faster; min_us, min_ratio the same at the fastest
//                           samples, which hold still where clocks swing, e.g. an H200's)
//   token-level (tokens)    fwd, fwd+bwd rows: tokens/s (and TFLOP/s from cost flops); a dense
//                           shape it carries (the block: its FFN's equal-FLOP GEMM) is timed
//                           only for the roofline's rate
//
// GEMM-like and token-level rows also report their roofline (harness/ops/roofline.h) against the
// rates of the same run: roof_us = max(flops / dense rate, bytes / copy bandwidth) with the row's
// cost flops and bytes (fwd: fwd; fwd+bwd: fwd + bwd) and the dense rate of the row's direction
// (fwd, or fwd + dgrad + wgrad); for an op whose cost has stages (OpInfo::Cost::stages, the MoE
// block) the sum of each stage's max, with one line per stage under its rows (stage, roofline us
// per direction, bound by flops or bytes, share). %roof = 100 * roof_us / median_us (100% = at
// the roofline). Memory-bound rows print "-" there (they have %copy).
//
//   op  case  dir  verified  median_us  min_us  GB/s  %copy  TFLOP/s  %dense  roof_us  %roof
//       tokens/s  graph  impl                                                  (one line per row)
//
// --impl NAME (repeatable; default and `--impl moe-gpu`: this project's kernels alone) also times
// an implementation registered with Memory::cuda (a plugin's, --plugin PATH, or a C++ one) on the
// same cases of every selected op it implements, against the same copy bandwidth: verified first
// with check_case at moe-gpu's verification case (VERIFY FAIL with the replay line otherwise),
// then called at full size on the buffers `check` hands it (harness/ops/impl_bench.h: host inputs
// from make_inputs, uploaded; poisoned, guarded outputs), timed by direct launches (its run may
// synchronise: no CUDA graph). Its run does forward and backward in one call, so its row is
// `fwd+bwd` with cost fwd + bwd bytes (its roofline at the dense fwd + dgrad + wgrad rate of
// moe-gpu's fwd+bwd row); next to it a moe-gpu `fwd+bwd` row whose time is the sum of moe-gpu's
// fwd and bwd medians of this run (JSON "composed"). The moe-gpu rows of those ops are timed too.
// A case moe-gpu generates on the device is skipped for NAME (a note) when making its host inputs
// would be prohibitive (kMaxHostBenchBytes).
//
// --timeline FILE: after each row is timed, one more call of it (its direction, the first buffer
// set; an --impl row: one run) is recorded with CUPTI (gpu/timeline.cuh): the summary
// (tools/timeline.h: span, busy and idle time, time per stage) is printed under the case's rows
// and kept as the row's JSON "timeline"; every recorded call goes to FILE as a Chrome trace,
// rewritten after every case. Without CUPTI the option is a usage error (exit 2, the reason).
//
// --json FILE writes the same fields per row (rewritten after every case; "complete": true at the
// end; the device, and the build as "version" and "git"), with "impl" on every row; GEMM-like
// and token-level rows have "roof_us" and "pct_roof" (null without a dense rate), "roof_bound"
// ("flops" or "bytes") or, for an op with stages, "stages" ([{name, roof_us, bound}]), and
// "dense" (the rate's GEMM). Exit status: 0 all cases verified and timed, 1 a verification or a
// benchmark failed, 2 bad usage (an unknown --impl or one with no CUDA implementation of a
// selected op, a --plugin that cannot be loaded) or no GPU. `bench-compare` reads these reports
// (tools/bench_compare.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/ops/check.h"
#include "harness/ops/impl_bench.h"
#include "harness/ops/registry.h"
#include "harness/ops/roofline.h"
#include "moe_harness/impl.h"
#include "tools/bench_a2a.h"
#include "tools/commands.h"

#ifdef MOE_WITH_CUDA
#include "gpu/bench_util.cuh"
#include "gpu/timeline.cuh"
#include "harness/ops/bench_device.h"
#include "tools/timeline.h"
#endif

namespace moe::tools {

namespace {

// The default verification case: the same op, dtype, regime and parameters with the row count
// (T for router ops, R for per-row reductions) cut to `rows`.
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

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Where an op's benchmark cases, inputs and verification cases come from.
struct Hooks {
  std::vector<Case> cases;
  std::function<ops::OpInfo::Bench(const Case&)> device;  // null: host inputs (make_inputs)
  std::function<Case(const Case&)> verify;                // null: small_case
};

Hooks hooks_of(const ops::OpInfo& op) {
  Hooks h;
  if (!op.gpu) return h;
  if (op.gpu_bench_device) {
    if (op.bench_cases) h.cases = op.bench_cases();
    h.device = op.gpu_bench_device;
    h.verify = op.bench_verify_case;
  } else if (op.gpu_bench && op.bench_cases) {
    h.cases = op.bench_cases();
    h.verify = op.bench_verify_case;
  }
  return h;
}

enum class Kind { memory, gemm, tokens };

struct Result {
  std::string op, name, line, dir, inputs, kind;
  std::string impl = "moe-gpu";
  std::string composed;  // how the time was composed from other rows (empty: measured)
  bool verified = false;
  std::string verify_note, verify_case;
  double median_us = 0, min_us = 0, max_us = 0;
  int samples = 0, per_sample = 0, sets = 0;
  bool graph = false;
  double bytes = 0, gbps = 0, pct_copy = 0;
  double alt_bytes = 0, alt_gbps = 0, alt_pct_copy = 0;
  std::string alt_note;
  // Memory-bound moe-gpu rows: a copy of the row's bytes timed as the row is (time_copy_of).
  double same_copy_us = 0, pct_same_copy = 0;               // the faster of:
  double same_copy_memcpy_us = 0, same_copy_kernel_us = 0;  // cudaMemcpyAsync, a copy kernel
  double empty_kernel_us = 0;  // a kernel moving nothing, timed the same way
  double flops = 0, tflops = 0;
  double dense_us = 0, dense_tflops = 0, pct_dense = 0;  // GEMM-like rows (rate: token-level)
  int64_t dense_m = 0, dense_k = 0, dense_n = 0;
  // Uniform GEMM-like rows: cuBLAS strided-batched on the same products (OpInfo::Bench::batched),
  // its time in the row's direction and the row's time over it (< 1: faster than cuBLAS); the
  // same at the fastest samples (on an H200, four runs of deepseek_even: cuBLAS's forward
  // medians 3011-4940 us, our row's 2917-3347, its minima 2850-2909: session 34).
  double batched_us = 0, batched_ratio = 0, batched_min_us = 0, batched_min_ratio = 0;
  std::string batched_shapes;
  double tokens = 0, tokens_per_s = 0;  // token-level rows
  // Roofline (GEMM-like and token-level rows with a dense rate; 0 = none, printed "-").
  double roof_us = 0, pct_roof = 0;
  std::string roof_bound;                  // "flops" or "bytes" (an op without stages)
  std::vector<ops::StageRoofline> stages;  // an op with stages: each stage's roofline
  // --timeline: one more call of the row's direction, recorded (gpu/timeline.cuh).
  bool has_timeline = false;
  TimelineSummary timeline;
};

// --timeline FILE: every recorded call as one process of a Chrome trace, rewritten after every
// case like --json.
struct TimelineSink {
  std::string path;
  nlohmann::json events = nlohmann::json::array();
  int next_pid = 1;
  bool enabled() const { return !path.empty(); }
  bool write(const std::string& device) const {
    if (path.empty()) return true;
    std::ofstream f(path);
    if (!f) return false;
    f << nlohmann::json({{"traceEvents", events},
                         {"displayTimeUnit", "ms"},
                         {"otherData", {{"device", device}, {"git", MOE_GIT_REV}}}})
             .dump()
      << "\n";
    return static_cast<bool>(f);
  }
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

void print_row(const Result& r) {
  const bool mem = r.kind == "memory", roof = r.roof_us > 0;
  std::printf(
      "%-18s %-18s %-7s %-8s %11.1f %11.1f %8s %6s %8s %7s %10s %6s %10s %5s %s\n", r.op.c_str(),
      r.name.c_str(), r.dir.c_str(), r.verified ? "yes" : "FAILED", r.median_us, r.min_us,
      mem ? fmt("%.0f", r.gbps).c_str() : "-", mem ? fmt("%.1f%%", r.pct_copy).c_str() : "-",
      r.kind != "memory" ? fmt("%.1f", r.tflops).c_str() : "-",
      r.kind == "gemm" ? fmt("%.1f%%", r.pct_dense).c_str() : "-",
      roof ? fmt("%.1f", r.roof_us).c_str() : "-", roof ? fmt("%.1f%%", r.pct_roof).c_str() : "-",
      r.kind == "tokens" ? fmt("%.0f", r.tokens_per_s).c_str() : "-", r.graph ? "yes" : "no",
      r.impl.c_str());
}

// A GEMM-like or token-level row's roofline against this run's dense rate (the row's
// dense_tflops: fwd, or fwd + dgrad + wgrad for fwd+bwd) and copy bandwidth
// (harness/ops/roofline.h): the sum of the op's stages where its cost has them, else one
// max(flops / rate, bytes / bandwidth) over the row's flops and bytes. Left at 0 (printed "-",
// JSON null) for memory-bound rows and rows without a dense rate.
void set_roofline(Result& r, const ops::Cost& cost, double copy_gbps) {
  r.roof_us = r.pct_roof = 0;
  r.roof_bound.clear();
  r.stages.clear();
  if (r.kind == "memory" || !(r.dense_tflops > 0) || !(copy_gbps > 0) || !(r.median_us > 0)) {
    return;
  }
  if (!cost.stages.empty()) {
    r.stages = ops::stage_rooflines(cost.stages, r.dir == "fwd+bwd", r.dense_tflops, copy_gbps);
    r.roof_us = ops::stage_sum_us(r.stages);
  } else {
    const ops::Roofline roof = ops::roofline(r.flops, r.bytes, r.dense_tflops, copy_gbps);
    r.roof_us = roof.us;
    r.roof_bound = roof.bound();
  }
  r.pct_roof = ops::pct_of_roofline(r.roof_us, r.median_us);
}

// Under the rows of an op with stages: one line per stage with its roofline in each row's
// direction, what bounds it and its share of the row's roofline.
void print_stages(const std::vector<Result>& rows) {
  const Result* first = nullptr;
  for (const Result& r : rows) {
    if (!r.stages.empty() && !first) first = &r;
  }
  if (!first) return;
  std::printf(
      "  roofline %s %s (%s): sum over its stages of max(flops / dense rate, "
      "bytes / copy bandwidth)\n",
      first->op.c_str(), first->name.c_str(), first->impl.c_str());
  for (size_t i = 0; i < first->stages.size(); ++i) {
    std::printf("    stage %-12s", first->stages[i].name.c_str());
    for (const Result& r : rows) {
      if (r.stages.size() != first->stages.size() || r.impl != first->impl) continue;
      const ops::StageRoofline& st = r.stages[i];
      std::printf(" %s %10.1f us %-5s (%4.1f%%)", r.dir.c_str(), st.roof.us, st.roof.bound(),
                  r.roof_us > 0 ? 100.0 * st.roof.us / r.roof_us : 0.0);
    }
    std::printf("\n");
  }
}

nlohmann::json to_json(const Result& r) {
  nlohmann::json j = {{"op", r.op},
                      {"name", r.name},
                      {"case", r.line},
                      {"dir", r.dir},
                      {"kind", r.kind},
                      {"inputs", r.inputs},
                      {"verified", r.verified},
                      {"verify_case", r.verify_case},
                      {"verify_note", r.verify_note},
                      {"median_us", r.median_us},
                      {"min_us", r.min_us},
                      {"max_us", r.max_us},
                      {"samples", r.samples},
                      {"launches_per_sample", r.per_sample},
                      {"rotation_sets", r.sets},
                      {"cuda_graph", r.graph},
                      {"bytes", r.bytes},
                      {"gbps", r.gbps},
                      {"pct_copy", r.pct_copy},
                      {"flops", r.flops},
                      {"tflops", r.tflops},
                      {"impl", r.impl}};
  if (!r.composed.empty()) j["composed"] = r.composed;
  if (r.alt_bytes > 0) {
    j["alt_bytes"] = r.alt_bytes;
    j["alt_gbps"] = r.alt_gbps;
    j["alt_pct_copy"] = r.alt_pct_copy;
    j["alt_bytes_note"] = r.alt_note;
  }
  if (r.same_copy_us > 0) {
    j["same_size_copy_us"] = r.same_copy_us;
    j["pct_same_size_copy"] = r.pct_same_copy;
    j["same_size_copy_memcpy_us"] = r.same_copy_memcpy_us;
    j["same_size_copy_kernel_us"] = r.same_copy_kernel_us;
    j["empty_kernel_us"] = r.empty_kernel_us;
  }
  if (r.kind == "gemm" || r.dense_tflops > 0) {  // token-level rows: the roofline's rate
    j["dense"] = {{"m", r.dense_m},
                  {"k", r.dense_k},
                  {"n", r.dense_n},
                  {"median_us", r.dense_us},
                  {"tflops", r.dense_tflops}};
  }
  if (r.kind == "gemm") j["pct_dense"] = r.pct_dense;
  if (r.batched_us > 0) {
    j["batched"] = {{"products", r.batched_shapes},
                    {"median_us", r.batched_us},
                    {"time_ratio", r.batched_ratio},
                    {"min_us", r.batched_min_us},
                    {"min_ratio", r.batched_min_ratio}};
  }
  if (r.kind != "memory") {
    j["roof_us"] = r.roof_us > 0 ? nlohmann::json(r.roof_us) : nlohmann::json(nullptr);
    j["pct_roof"] = r.roof_us > 0 ? nlohmann::json(r.pct_roof) : nlohmann::json(nullptr);
    if (!r.roof_bound.empty()) j["roof_bound"] = r.roof_bound;
    if (!r.stages.empty()) {
      j["stages"] = nlohmann::json::array();
      for (const ops::StageRoofline& st : r.stages) {
        j["stages"].push_back(
            {{"name", st.name}, {"roof_us", st.roof.us}, {"bound", st.roof.bound()}});
      }
    }
  }
  if (r.kind == "tokens") {
    j["tokens"] = r.tokens;
    j["tokens_per_s"] = r.tokens_per_s;
  }
  if (r.has_timeline) j["timeline"] = timeline_json(r.timeline);
  return j;
}

// A row's timing fields from one measurement over `sets` rotating buffer sets.
void set_timing(Result& r, const gpu::TimingStats& t, int sets) {
  r.median_us = t.median_ms * 1e3;
  r.min_us = t.min_ms * 1e3;
  r.max_us = t.max_ms * 1e3;
  r.samples = t.samples;
  r.per_sample = t.per_sample;
  r.sets = sets;
  r.graph = t.graph;
}

// Row r against cuBLAS strided-batched on its products: medians and fastest samples (us).
void set_batched(Result& r, double median_us, double min_us, const std::string& shapes) {
  r.batched_us = median_us;
  r.batched_ratio = r.median_us / median_us;
  r.batched_min_us = min_us;
  r.batched_min_ratio = min_us > 0 ? r.min_us / min_us : 0;
  r.batched_shapes = shapes;
}

// The vendor's yardstick of a uniform GEMM-like case: cuBLAS strided-batched on its products
// (gpu::time_batched_gemms), each row's time against it. A failure (e.g. out of memory beside
// the rows' buffers) is a note: the rows stand without it.
void time_batched(DType d, const std::vector<ops::OpInfo::Bench::BatchedProduct>& products,
                  bool with_bwd, int samples, std::vector<Result>& rows) {
  std::vector<gpu::BatchedProduct> ps;
  std::string shapes;
  for (const auto& p : products) {
    ps.push_back({p.batch, p.m, p.k, p.n, p.a_from});
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s%lld x [%lld x %lld] . [%lld x %lld]",
                  shapes.empty() ? "" : " + ", static_cast<long long>(p.batch),
                  static_cast<long long>(p.m), static_cast<long long>(p.k),
                  static_cast<long long>(p.k), static_cast<long long>(p.n));
    shapes += buf;
  }
  gpu::BatchedGemmTiming t;
  try {
    t = gpu::time_batched_gemms(d, ps, with_bwd, samples);
  } catch (const std::exception& e) {
    std::printf("  note: cuBLAS strided-batched on the same products could not be timed: %s\n",
                e.what());
    return;
  }
  gpu::device_synchronize();
  for (Result& r : rows) {
    const gpu::TimingStats& bt = r.dir == "fwd" ? t.fwd : t.fwd_bwd;
    if (bt.samples == 0 || !(r.median_us > 0)) continue;
    set_batched(r, bt.median_ms * 1e3, bt.min_ms * 1e3, shapes);
  }
}

void print_batched(const std::vector<Result>& rows) {
  if (rows.empty() || !(rows.front().batched_us > 0)) return;
  std::printf("  cuBLAS strided-batched, the same products in equal groups (%s):",
              rows.front().batched_shapes.c_str());
  for (const Result& r : rows) {
    if (r.batched_us > 0) {
      std::printf(" %s %.1f us, min %.1f (this row %.3fx its time, %.3fx at the minima);",
                  r.dir == "fwd" ? "fwd" : "fwd+dgrad+wgrad", r.batched_us, r.batched_min_us,
                  r.batched_ratio, r.batched_min_ratio);
    }
  }
  std::printf("\n");
}

// --timeline: one more call of each row's direction on the first buffer set, recorded once the
// row is timed (so the recording's overhead touches no timed sample), into the row's summary
// and the sink's trace. A recording that fails is a note: the rows stand without it.
void record_timelines(const std::string& label, const std::function<void(const Result&)>& call,
                      std::vector<Result>& rows, TimelineSink& sink) {
  for (Result& r : rows) {
    const std::string name = label + " " + r.dir;
    try {
      gpu::device_synchronize();
      gpu::TimelineRecording rec;
      call(r);
      const std::vector<gpu::TimelineEvent> ev = rec.stop();
      r.timeline = summarize_timeline(ev);
      r.has_timeline = true;
      append_chrome_trace(sink.events, sink.next_pid++, name + " (" + r.impl + ")", ev);
    } catch (const std::exception& e) {
      std::printf("  note %s: no timeline: %s\n", name.c_str(), e.what());
    }
  }
}

void print_timelines(const std::string& label, const std::vector<Result>& rows) {
  for (const Result& r : rows) {
    if (r.has_timeline) {
      std::fputs(
          timeline_text(label + " " + r.dir + " (" + r.impl + ")", r.timeline, r.median_us).c_str(),
          stdout);
    }
  }
}

// Runs one case: verify, build the benchmark, time its rows, free it, time the dense baseline.
// Appends its rows to `out`; returns false when verification failed.
bool bench_case(const ops::OpInfo& op, const Hooks& h, const Case& c, int samples,
                int64_t verify_rows, const gpu::CopyBandwidth& copy, TimelineSink& sink,
                std::vector<Result>& out) {
  const auto t0 = Clock::now();
  // Verify first: a failing kernel's timing means nothing.
  const Case sc = h.verify ? h.verify(c) : small_case(c, verify_rows);
  bool ok = false;
  std::string note;
  try {
    const Report r = ops::check_gpu(op, sc);
    ok = r.ok();
    if (!ok) note = r.str();
  } catch (const std::exception& e) {
    note = std::string("exception: ") + e.what();
  }
  if (!ok) {
    std::printf("VERIFY FAIL %s\n%s  replay: %s\n", sc.line().c_str(), note.c_str(),
                ops::replay_line(sc, "gpu").c_str());
  }
  const double t_verify = seconds_since(t0);

  const auto t1 = Clock::now();
  const ops::Cost cost = op.cost ? op.cost(c) : ops::Cost{};
  std::vector<ops::OpInfo::Bench> benches;
  int sets = 1;
  {
    // Several independent sets when one set fits in L2 (see gpu/bench_util.cuh).
    sets = gpu::rotation_sets(std::max(cost.fwd_bytes, cost.bwd_bytes));
    if (h.device) {
      for (int k = 0; k < sets; ++k) benches.push_back(h.device(c));
    } else {
      const TensorMap in = op.make_inputs(c);
      for (int k = 0; k < sets; ++k) benches.push_back(op.gpu_bench(c, in));
    }
  }
  const double t_setup = seconds_since(t1);
  const auto t2 = Clock::now();
  const ops::OpInfo::Bench& hint = benches.front();
  // A token-level op may carry a dense shape too: only the rate of its roofline.
  const bool has_dense = hint.dense_m > 0;
  const Kind kind = hint.tokens > 0 ? Kind::tokens : has_dense ? Kind::gemm : Kind::memory;
  const bool has_bwd = static_cast<bool>(hint.bwd);
  std::vector<std::string> dirs = {"fwd"};
  if (has_bwd) dirs.push_back(kind == Kind::memory ? "bwd" : "fwd+bwd");

  std::vector<Result> rows;
  for (const std::string& dir : dirs) {
    const bool fwd = dir == "fwd", both = dir == "fwd+bwd";
    const std::function<void(int)> launch = [&](int i) {
      auto& b = benches[static_cast<size_t>(i % sets)];
      if (fwd || both) b.fwd();
      if (!fwd) b.bwd();
    };
    const gpu::TimingStats t =
        hint.graph ? gpu::time_launches_auto(launch, samples)
                   : gpu::time_launches(launch, 1, std::max(samples, 20), 1, gpu::bench_stream());
    gpu::device_synchronize();
    Result r;
    r.op = op.name;
    r.name = c.s("name", "");
    r.line = c.line();
    r.dir = dir;
    r.inputs = h.device ? "device" : "host";
    r.kind = kind == Kind::memory ? "memory" : kind == Kind::gemm ? "gemm" : "tokens";
    r.verified = ok;
    r.verify_note = note;
    r.verify_case = sc.line();
    set_timing(r, t, sets);
    const double sec = t.median_ms * 1e-3;
    r.bytes = fwd ? cost.fwd_bytes : both ? cost.fwd_bytes + cost.bwd_bytes : cost.bwd_bytes;
    r.gbps = r.bytes / sec / 1e9;
    r.pct_copy = 100.0 * r.gbps / copy.gbps;
    const double alt = fwd ? hint.alt_fwd_bytes : both ? 0.0 : hint.alt_bwd_bytes;
    if (alt > 0) {
      r.alt_bytes = alt;
      r.alt_gbps = alt / sec / 1e9;
      r.alt_pct_copy = 100.0 * r.alt_gbps / copy.gbps;
      r.alt_note = hint.alt_bytes_note;
    }
    r.flops = fwd ? cost.fwd_flops : both ? cost.fwd_flops + cost.bwd_flops : cost.bwd_flops;
    r.tflops = r.flops / sec / 1e12;
    r.tokens = hint.tokens;
    if (hint.tokens > 0) r.tokens_per_s = hint.tokens / sec;
    r.dense_m = hint.dense_m;
    r.dense_k = hint.dense_k;
    r.dense_n = hint.dense_n;
    rows.push_back(std::move(r));
  }
  if (sink.enabled()) {
    record_timelines(
        op.name + " " + c.s("name", ""),
        [&](const Result& r) {
          auto& b = benches.front();
          if (r.dir == "fwd" || r.dir == "fwd+bwd") b.fwd();
          if (r.dir != "fwd") b.bwd();
        },
        rows, sink);
  }
  const std::vector<ops::OpInfo::Bench::BatchedProduct> batched = hint.batched;
  benches.clear();  // free this case's buffers before the dense baseline and the next case
  gpu::device_synchronize();
  gpu::release_buffer_cache();  // and return them to the device: the next shapes differ

  if (kind == Kind::memory) {
    for (Result& r : rows) {
      if (!(r.bytes > 0) || !(r.median_us > 0)) continue;
      gpu::SizedCopy sc;
      try {
        sc = gpu::time_copy_of(r.bytes, samples);
      } catch (const std::exception& e) {  // a yardstick, not the row: note it and go on
        std::printf("  note %s %s: the copy of the same bytes could not be timed: %s\n",
                    r.name.c_str(), r.dir.c_str(), e.what());
        continue;
      }
      r.same_copy_us = sc.median_ms * 1e3;
      r.same_copy_memcpy_us = sc.memcpy.median_ms * 1e3;
      r.same_copy_kernel_us = sc.kernel.median_ms * 1e3;
      r.empty_kernel_us = sc.empty.median_ms * 1e3;
      r.pct_same_copy = 100.0 * r.same_copy_us / r.median_us;
    }
  }

  bool dense_timed = false;
  gpu::DenseGemmTiming dense;
  if (has_dense && kind != Kind::memory) {
    try {
      dense = gpu::time_dense_gemm(c.dtype, rows.front().dense_m, rows.front().dense_k,
                                   rows.front().dense_n, has_bwd, samples);
      dense_timed = true;
    } catch (const std::exception& e) {
      if (kind == Kind::gemm) throw;  // the GEMM rows' baseline: the case fails
      // A token-level row keeps its tokens/s without the roofline's rate.
      std::printf("  note %s %s: dense GEMM for the roofline's rate failed: %s\n", op.name.c_str(),
                  c.s("name", "").c_str(), e.what());
    }
  }
  if (dense_timed) {
    for (Result& r : rows) {
      const bool both = r.dir == "fwd+bwd";
      r.dense_us = (both ? dense.fwd_bwd.median_ms : dense.fwd.median_ms) * 1e3;
      r.dense_tflops = both ? dense.fwd_bwd_tflops : dense.fwd_tflops;
      if (kind == Kind::gemm) r.pct_dense = 100.0 * r.tflops / r.dense_tflops;
      set_roofline(r, cost, copy.gbps);
    }
  }
  if (!batched.empty() && kind == Kind::gemm)
    time_batched(c.dtype, batched, has_bwd, samples, rows);
  for (const Result& r : rows) print_row(r);
  for (const Result& r : rows) {
    if (r.alt_bytes > 0) {
      std::printf("  note %s %s: %.1f MB %s: %.0f GB/s, %.1f%% of copy\n", r.name.c_str(),
                  r.dir.c_str(), r.alt_bytes / 1e6, r.alt_note.c_str(), r.alt_gbps, r.alt_pct_copy);
    }
    if (r.same_copy_us > 0) {
      std::printf(
          "  note %s %s: a copy of the same %.1f MB, timed the same way: %.1f us (%.1f%% of the "
          "copy bandwidth; cudaMemcpy %.1f us, copy kernel %.1f us; an empty kernel %.1f us); "
          "this row runs at %.1f%% of its rate\n",
          r.name.c_str(), r.dir.c_str(), r.bytes / 1e6, r.same_copy_us,
          r.pct_copy * r.median_us / r.same_copy_us, r.same_copy_memcpy_us, r.same_copy_kernel_us,
          r.empty_kernel_us, r.pct_same_copy);
    }
  }
  print_stages(rows);
  print_timelines(op.name + " " + c.s("name", ""), rows);
  if (dense_timed) {
    const Result& f = rows.front();
    std::printf("  dense cuBLAS %s %lldx%lldx%lld (%s):", std::string(dtype_name(c.dtype)).c_str(),
                static_cast<long long>(f.dense_m), static_cast<long long>(f.dense_k),
                static_cast<long long>(f.dense_n),
                kind == Kind::gemm ? "equal FLOPs" : "the roofline's rate");
    for (const Result& r : rows) {
      std::printf(" %s %.1f us %.1f TFLOP/s;", r.dir == "fwd" ? "fwd" : "fwd+dgrad+wgrad",
                  r.dense_us, r.dense_tflops);
    }
    std::printf("\n");
  }
  print_batched(rows);
  std::printf("  (%s %s: %s inputs; verify %.1f s, setup %.1f s, timing %.1f s)\n", op.name.c_str(),
              c.s("name", "").c_str(), h.device ? "device" : "host", t_verify, t_setup,
              seconds_since(t2));
  std::fflush(stdout);
  for (Result& r : rows) out.push_back(std::move(r));
  return ok;
}

// Host inputs of a case whose benchmark generates them on the device are made by make_inputs for
// --impl rows (one thread: sort_chunks_by_index's 7.5 GB case takes 1-3 minutes); above this many
// bytes moved (cost fwd + bwd, a proxy for the inputs' size) that would take many minutes, and the
// case is skipped with a note (of the issue's cases: grouped GEMM, FFN and block DeepSeek-like).
constexpr double kMaxHostBenchBytes = 16e9;

// --impl NAME other than moe-gpu: a user's CUDA implementation of op, timed on case c next to the
// moe-gpu rows of the same case (gpu_rows; empty when those failed). First verified with
// check_case at the case moe-gpu is verified at; then c's inputs are made on the host
// (make_inputs) and uploaded into the buffers `check` hands it (impl_bench.h), and impl.run (one
// call: forward and backward) is timed by direct launches on bench_stream() (a run may
// synchronise or allocate: no CUDA graph). One fwd+bwd row; before the first such row of a case,
// a moe-gpu fwd+bwd row composed of the fwd and bwd medians of gpu_rows (memory-bound ops; the
// others have a measured fwd+bwd row). Appends its rows to out; returns false when verification
// failed or the buffers revealed a fault.
bool bench_impl_case(const ops::OpInfo& op, const Impl& impl, const Hooks& h, const Case& c,
                     int samples, int64_t verify_rows, const CheckOptions& copt,
                     const gpu::CopyBandwidth& copy, const std::vector<Result>& gpu_rows,
                     bool& composed_done, TimelineSink& sink, std::vector<Result>& out) {
  const std::string name = c.s("name", "");
  const ops::Cost cost = op.cost ? op.cost(c) : ops::Cost{};
  const double moved = cost.fwd_bytes + cost.bwd_bytes;
  if (h.device && moved > kMaxHostBenchBytes) {
    std::printf(
        "  note %s %s (%s): skipped: its inputs are generated on the device for moe-gpu; "
        "made on the host for %s they would be about as large as the %.1f GB it moves "
        "(limit %.0f GB)\n",
        op.name.c_str(), name.c_str(), impl.name.c_str(), impl.name.c_str(), moved / 1e9,
        kMaxHostBenchBytes / 1e9);
    std::fflush(stdout);
    return true;
  }
  const auto t0 = Clock::now();
  // Verify first: a failing kernel's timing means nothing.
  const Case sc = h.verify ? h.verify(c) : small_case(c, verify_rows);
  const CaseResult v = check_case(impl, sc, copt);
  if (v.verdict == Verdict::not_supported) {
    std::printf("  note %s %s (%s): not supported at the verification case: %s\n", op.name.c_str(),
                name.c_str(), impl.name.c_str(), v.report.c_str());
    std::fflush(stdout);
    return true;
  }
  bool ok = v.verdict == Verdict::passed;
  std::string note = ok ? "" : v.report;
  if (!ok) {
    std::printf("VERIFY FAIL %s (%s)\n%s  replay: %s\n", sc.line().c_str(), impl.name.c_str(),
                v.report.c_str(), v.replay.c_str());
  }
  const double t_verify = seconds_since(t0);
  if (impl.unsupported) {
    const std::string why = impl.unsupported(c);
    if (!why.empty()) {
      std::printf("  note %s %s (%s): not supported: %s\n", op.name.c_str(), name.c_str(),
                  impl.name.c_str(), why.c_str());
      std::fflush(stdout);
      return ok;
    }
  }

  const auto t1 = Clock::now();
  const TensorMap in = op.make_inputs(c);
  const ops::OutputMetas outs = ops::bench_outputs(impl, op, c, in, sc);
  gpu::device_synchronize();
  gpu::release_buffer_cache();  // the CUDA twin's buffers, used only to size the outputs
  // Several independent sets when one set fits in L2, as for moe-gpu (see gpu/bench_util.cuh).
  const int sets = gpu::rotation_sets(std::max(cost.fwd_bytes, cost.bwd_bytes));
  std::vector<std::unique_ptr<ops::ImplBench>> benches;
  for (int k = 0; k < sets; ++k)
    benches.push_back(std::make_unique<ops::ImplBench>(impl, c, in, outs));
  const double t_setup = seconds_since(t1);

  const auto t2 = Clock::now();
  gpu::TimingStats t;
  try {
    t = gpu::time_launches_auto(
        [&](int i) { benches[static_cast<size_t>(i % sets)]->run(gpu::bench_stream()); }, samples,
        1.0, 1000, /*allow_graph=*/false);
  } catch (const NotSupported& e) {
    std::printf("  note %s %s (%s): not supported at this size: %s\n", op.name.c_str(),
                name.c_str(), impl.name.c_str(), e.what());
    std::fflush(stdout);
    return ok;
  }
  // --timeline: one more run, recorded; its faults, if any, join the timed runs' below.
  std::vector<Result> recorded(1);
  recorded[0].dir = "fwd+bwd";
  recorded[0].impl = impl.name;
  if (sink.enabled()) {
    record_timelines(
        op.name + " " + name, [&](const Result&) { benches.front()->run(gpu::bench_stream()); },
        recorded, sink);
  }
  std::vector<std::string> faults;
  for (auto& b : benches)
    for (std::string& f : b->finish()) faults.push_back(std::move(f));
  benches.clear();  // free the buffers before the next implementation and case
  gpu::device_synchronize();
  gpu::release_buffer_cache();
  if (!faults.empty()) {
    ok = false;
    std::printf("BENCH FAULT %s (%s), in the timed runs:\n", c.line().c_str(), impl.name.c_str());
    for (const std::string& f : faults) {
      std::printf("  %s\n", f.c_str());
      note += "timed runs: " + f + "\n";
    }
  }

  // The moe-gpu rows of this case tell the kind of row and the dense baseline.
  const Result* fwd = nullptr;
  const Result* bwd = nullptr;
  const Result* both = nullptr;
  for (const Result& r : gpu_rows) {
    (r.dir == "fwd" ? fwd : r.dir == "bwd" ? bwd : both) = &r;
  }
  std::vector<Result> rows;
  if (fwd && bwd && !composed_done) {
    Result r = *fwd;
    r.dir = "fwd+bwd";
    r.composed = "fwd median + bwd median";
    r.verified = fwd->verified && bwd->verified;
    r.median_us = fwd->median_us + bwd->median_us;
    r.min_us = fwd->min_us + bwd->min_us;
    r.max_us = fwd->max_us + bwd->max_us;
    r.samples = std::min(fwd->samples, bwd->samples);
    r.per_sample = 0;  // not one timing
    r.graph = fwd->graph && bwd->graph;
    r.bytes = fwd->bytes + bwd->bytes;
    r.gbps = r.bytes / (r.median_us * 1e-6) / 1e9;
    r.pct_copy = 100.0 * r.gbps / copy.gbps;
    r.alt_bytes = r.alt_gbps = r.alt_pct_copy = 0;
    r.alt_note.clear();
    r.same_copy_us = r.pct_same_copy = r.same_copy_memcpy_us = r.same_copy_kernel_us = 0;
    r.empty_kernel_us = 0;
    r.flops = fwd->flops + bwd->flops;
    r.tflops = r.flops / (r.median_us * 1e-6) / 1e12;
    if (r.tokens > 0) r.tokens_per_s = r.tokens / (r.median_us * 1e-6);
    set_roofline(r, cost, copy.gbps);  // memory-bound: none
    rows.push_back(std::move(r));
    composed_done = true;
  }
  {
    Result r;
    r.op = op.name;
    r.name = name;
    r.line = c.line();
    r.dir = "fwd+bwd";
    r.impl = impl.name;
    r.inputs = "host";
    r.kind = gpu_rows.empty() ? "memory" : gpu_rows.front().kind;
    r.verified = ok;
    r.verify_note = note;
    r.verify_case = sc.line();
    set_timing(r, t, sets);
    const double sec = t.median_ms * 1e-3;
    r.bytes = cost.fwd_bytes + cost.bwd_bytes;
    r.gbps = r.bytes / sec / 1e9;
    r.pct_copy = 100.0 * r.gbps / copy.gbps;
    r.flops = cost.fwd_flops + cost.bwd_flops;
    r.tflops = r.flops / sec / 1e12;
    if (!gpu_rows.empty()) {
      const Result& g = gpu_rows.front();
      r.tokens = g.tokens;
      if (g.tokens > 0) r.tokens_per_s = g.tokens / sec;
      r.dense_m = g.dense_m;
      r.dense_k = g.dense_k;
      r.dense_n = g.dense_n;
    }
    if (both && both->dense_tflops > 0) {  // the dense fwd + dgrad + wgrad of this run
      r.dense_us = both->dense_us;
      r.dense_tflops = both->dense_tflops;
      if (r.kind == "gemm") r.pct_dense = 100.0 * r.tflops / r.dense_tflops;
    }
    if (both && both->batched_us > 0) {  // and cuBLAS strided-batched on the same products
      set_batched(r, both->batched_us, both->batched_min_us, both->batched_shapes);
    }
    set_roofline(r, cost, copy.gbps);  // at the same rate and bandwidth as moe-gpu's rows
    r.has_timeline = recorded[0].has_timeline;
    r.timeline = std::move(recorded[0].timeline);
    rows.push_back(std::move(r));
  }
  for (const Result& r : rows) print_row(r);
  print_stages(rows);
  print_timelines(op.name + " " + name, {rows.back()});
  for (const Result& r : rows) {
    if (r.impl != "moe-gpu" && r.batched_us > 0) {
      std::printf(
          "  %s %s fwd+bwd: %.3fx the time of cuBLAS strided-batched (%.1f us) on the "
          "same products\n",
          r.impl.c_str(), r.name.c_str(), r.batched_ratio, r.batched_us);
    }
  }
  for (const Result& r : rows) {
    if (!r.composed.empty()) {
      std::printf("  note moe-gpu %s fwd+bwd: %s of the rows above (%s runs both in one call)\n",
                  r.name.c_str(), r.composed.c_str(), impl.name.c_str());
    }
  }
  std::printf(
      "  (%s %s %s: host inputs from make_inputs, uploaded; verify %.1f s, setup %.1f s, "
      "timing %.1f s)\n",
      impl.name.c_str(), op.name.c_str(), name.c_str(), t_verify, t_setup, seconds_since(t2));
  std::fflush(stdout);
  for (Result& r : rows) out.push_back(std::move(r));
  return ok;
}

// The implementations named by --impl (other than moe-gpu) with a CUDA implementation of op.
std::vector<const Impl*> cuda_impls(const ops::OpInfo& op, const std::vector<std::string>& names) {
  std::vector<const Impl*> v;
  for (const std::string& n : names) {
    if (n == "moe-gpu") continue;
    const Impl* p = find_impl(op.name, n);
    if (p && p->memory == Memory::cuda) v.push_back(p);
  }
  return v;
}

int run_bench(const std::vector<std::string>& only_ops, const std::vector<std::string>& only_cases,
              const std::vector<std::string>& impl_args, const CheckOptions& copt,
              const std::string& json_path, const std::string& timeline_path, int samples,
              int64_t verify_rows) {
  for (const std::string& name : only_ops) {
    if (!ops::find_op(name)) {
      std::fprintf(stderr, "--op: unknown op '%s' (see `moe-harness list`)\n", name.c_str());
      return 2;
    }
  }
  // --case: every name must match a benchmark case of the selected ops (a typo must not pass as
  // an empty, green run).
  const auto selected = [&](const ops::OpInfo& op) {
    return only_ops.empty() ||
           std::find(only_ops.begin(), only_ops.end(), op.name) != only_ops.end();
  };
  for (const std::string& name : only_cases) {
    bool found = false;
    for (const ops::OpInfo* op : ops::all_ops()) {
      if (!selected(*op)) continue;
      for (const Case& c : hooks_of(*op).cases) found = found || c.s("name", "") == name;
    }
    if (!found) {
      std::fprintf(stderr, "--case: no benchmark case named '%s' in the selected ops\n",
                   name.c_str());
      return 2;
    }
  }
  // --impl: moe-gpu (this project's kernels; the default) and implementations registered with
  // Memory::cuda (plugins, C++) that implement a selected op with benchmark cases.
  std::vector<std::string> impl_list;
  for (const std::string& a : impl_args) {
    const std::string n = a == "gpu" ? "moe-gpu" : a;
    if (std::find(impl_list.begin(), impl_list.end(), n) == impl_list.end()) impl_list.push_back(n);
  }
  const bool with_gpu = impl_list.empty() ||
                        std::find(impl_list.begin(), impl_list.end(), "moe-gpu") != impl_list.end();
  const std::vector<std::string> registered = impl_names();
  for (const std::string& n : impl_list) {
    if (std::find(registered.begin(), registered.end(), n) == registered.end()) {
      std::string all;
      for (const std::string& r : registered) all += (all.empty() ? "" : ", ") + r;
      std::fprintf(stderr,
                   "--impl: no implementation named '%s' (registered: %s; --plugin PATH loads "
                   "more)\n",
                   n.c_str(), all.c_str());
      return 2;
    }
    if (n == "moe-gpu") continue;
    bool any = false;
    for (const ops::OpInfo* op : ops::all_ops()) {
      if (!selected(*op) || hooks_of(*op).cases.empty()) continue;
      any = any || !cuda_impls(*op, {n}).empty();
    }
    if (!any) {
      std::fprintf(stderr,
                   "--impl %s: no CUDA (device-memory) implementation of a selected op with "
                   "benchmark cases; bench times those (`moe-harness check --impl %s` checks "
                   "it)\n",
                   n.c_str(), n.c_str());
      return 2;
    }
  }
  if (!ops::gpu_available()) {
    std::fprintf(stderr, "bench: no GPU available (%s)\n", ops::gpu_description().c_str());
    return 2;
  }
  TimelineSink sink;
  sink.path = timeline_path;
  if (sink.enabled()) {
    if (const std::string why = gpu::timeline_unavailable(); !why.empty()) {
      std::fprintf(stderr, "--timeline: cannot record here: %s\n", why.c_str());
      return 2;
    }
  }
  const auto start = Clock::now();
  const std::string device = ops::gpu_description();
  const gpu::CopyBandwidth copy = gpu::measure_copy_bandwidth(size_t{1} << 30, samples);
  std::printf("device: %s\n", device.c_str());
  std::printf("copy bandwidth (cudaMemcpy D2D, %.0f MiB, read+write): %.1f GB/s (median of %d)\n",
              copy.bytes / 1048576.0, copy.gbps, copy.t.samples);
  if (gpu::sustain_ms() > 0)
    std::printf("sustained warm-up: %.0f ms before every timed series\n", gpu::sustain_ms());
  std::printf("%-18s %-18s %-7s %-8s %11s %11s %8s %6s %8s %7s %10s %6s %10s %5s %s\n", "op",
              "case", "dir", "verified", "median_us", "min_us", "GB/s", "%copy", "TFLOP/s",
              "%dense", "roof_us", "%roof", "tokens/s", "graph", "impl");

  std::vector<Result> results;
  // The JSON is rewritten after every case, so a run cut short keeps what it measured.
  const auto write_json = [&](bool complete) {
    if (!sink.write(device)) {
      std::fprintf(stderr, "--timeline: cannot write '%s'\n", sink.path.c_str());
      return false;
    }
    if (json_path.empty()) return true;
    nlohmann::json j;
    j["device"] = device;
    j["version"] = MOE_VERSION;  // which build timed it (bench-compare prints both)
    j["git"] = MOE_GIT_REV;
    j["complete"] = complete;
    j["sustain_ms"] = gpu::sustain_ms();
    j["copy"] = {{"bytes", copy.bytes},
                 {"gbps", copy.gbps},
                 {"median_ms", copy.t.median_ms},
                 {"samples", copy.t.samples}};
    j["results"] = nlohmann::json::array();
    for (const Result& r : results) j["results"].push_back(to_json(r));
    std::ofstream f(json_path);
    if (!f) return false;
    f << j.dump(2) << "\n";
    return static_cast<bool>(f);
  };
  if (!write_json(false)) {
    if (!json_path.empty()) std::fprintf(stderr, "--json: cannot write '%s'\n", json_path.c_str());
    return 2;
  }
  bool all_ok = true;
  for (const ops::OpInfo* op : ops::all_ops()) {
    if (!selected(*op)) continue;
    // With --impl NAME only, the ops NAME implements (and moe-gpu's rows of them, to compare).
    const std::vector<const Impl*> others = cuda_impls(*op, impl_list);
    if (!with_gpu && others.empty()) continue;
    const Hooks h = hooks_of(*op);
    for (const Case& c : h.cases) {
      if (!only_cases.empty() &&
          std::find(only_cases.begin(), only_cases.end(), c.s("name", "")) == only_cases.end()) {
        continue;
      }
      const size_t first = results.size();
      try {
        all_ok &= bench_case(*op, h, c, samples, verify_rows, copy, sink, results);
      } catch (const std::exception& e) {
        all_ok = false;
        std::printf("BENCH ERROR %s %s: %s\n", op->name.c_str(), c.line().c_str(), e.what());
        std::fflush(stdout);
      }
      write_json(false);
      const std::vector<Result> gpu_rows(results.begin() + static_cast<std::ptrdiff_t>(first),
                                         results.end());
      bool composed = false;
      for (const Impl* impl : others) {
        try {
          all_ok &= bench_impl_case(*op, *impl, h, c, samples, verify_rows, copt, copy, gpu_rows,
                                    composed, sink, results);
        } catch (const std::exception& e) {
          all_ok = false;
          std::printf("BENCH ERROR %s (%s): %s\n", c.line().c_str(), impl->name.c_str(), e.what());
          std::fflush(stdout);
        }
        write_json(false);
      }
    }
  }
  std::printf("bench: %zu rows in %.1f s\n", results.size(), seconds_since(start));
  if (!write_json(true)) {
    if (!json_path.empty()) std::fprintf(stderr, "--json: cannot write '%s'\n", json_path.c_str());
    return 2;
  }
  return all_ok ? 0 : 1;
}
#endif

}  // namespace

void add_bench_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Verify, then time the CUDA ops' benchmark cases (GB/s vs copy, TFLOP/s vs dense "
      "cuBLAS, % of roofline, tokens/s)");
  static std::vector<std::string> op_names, case_names, impl_args, plugins;
  static std::string json_path, timeline_path, ties = "canonical";
  static int samples = 25;
  static double sustain = 0;
  static int64_t verify_rows = 1024;
  cmd->add_option("--op", op_names, "Only these ops (repeatable; see `moe-harness list`)");
  cmd->add_option("--case", case_names,
                  "Only the benchmark cases of this name (repeatable; e.g. for a profiler run)");
  cmd->add_option("--impl", impl_args,
                  "Also time this CUDA implementation (repeatable): moe-gpu (the default) or a "
                  "registered/plugin one, next to moe-gpu on the same cases")
      ->group("Implementations");
  cmd->add_option("--plugin", plugins, "Load implementations from this shared library (repeatable)")
      ->group("Implementations");
  cmd->add_option("--ties", ties,
                  "Exact-tie rule when verifying an --impl implementation: canonical, te or any")
      ->check(CLI::IsMember({"canonical", "te", "any"}))
      ->group("Implementations");
  cmd->add_option("--json", json_path, "Also write the results to this JSON file");
  cmd->add_option("--timeline", timeline_path,
                  "After timing each row, record one more call of it with CUPTI: print its time "
                  "per stage and the GPU's idle gaps, and write every recorded kernel to this "
                  "Chrome trace file (Perfetto, chrome://tracing)");
  cmd->add_option("--samples", samples, "Timed samples per case and direction (>= 20)")
      ->check(CLI::Range(20, 100000));
  cmd->add_option("--sustain-ms", sustain,
                  "Before every timed series (each row, the copy and dense references), run it "
                  "untimed for this many ms, so the clocks settle under the power limit "
                  "(0: burst timing after a few warm-up launches)")
      ->check(CLI::Range(0.0, 600000.0));
  cmd->add_option("--verify-rows", verify_rows,
                  "Rows of the verification case (T or R) of ops without their own")
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
    CheckOptions copt;  // how --impl implementations are verified (check_case)
    try {
      std::string flags;
      for (const std::string& p : plugins) {
        load_plugin(p);
        flags += (flags.empty() ? "" : " ") + std::string("--plugin ") + p;
      }
      copt.replay_extra = flags;
      copt.ties = parse_tie_policy(ties);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      status = 2;
      return;
    }
    try {
      gpu::set_sustain_ms(sustain);
      status = run_bench(op_names, case_names, impl_args, copt, json_path, timeline_path, samples,
                         verify_rows);
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
