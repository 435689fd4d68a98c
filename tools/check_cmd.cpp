// `moe-harness list` and `moe-harness check`: every named and random case of each op through one
// implementation (the reference's self-checks, our CUDA twins, a plugin's or a registered one),
// compared with the reference (include/moe_harness/impl.h). Output: a table row per op as soon as
// it finishes, the mismatch report and replay line of every failing case (shrunk when random),
// optional JSON and JUnit reports and golden files of the failures.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include "golden/golden.h"
#include "harness/ops/call_guard.h"
#include "harness/ops/case_validation.h"
#include "harness/ops/edges.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/registry.h"
#include "moe_harness/impl.h"
#include "tools/commands.h"
#include "tools/reports.h"

#ifdef MOE_WITH_NCCL
#include <memory>

#include "gpu/nccl_comm.cuh"
#include "harness/ops/block_gpu.h"
#endif

namespace moe::tools {

namespace {

// --backend gpu|reference and --impl gpu are the pre-implementation-registry spellings.
std::string canonical_impl(const std::string& s) {
  return s == "gpu" ? "moe-gpu" : s;
}

std::vector<std::string> load_plugins(const std::vector<std::string>& paths) {
  std::vector<std::string> names;
  for (auto& p : paths) names.push_back(load_plugin(p));
  return names;
}

std::string plugin_flags(const std::vector<std::string>& paths) {
  std::string s;
  for (auto& p : paths) s += (s.empty() ? "" : " ") + std::string("--plugin ") + p;
  return s;
}

// The --json / --junit reports of a run that does not end normally.
//   - A case timeout: the watchdog runs a hook (ops::set_timeout_hook) before the process ends, and
//     it writes the ops done, the cases of the op in progress reported so far (in case order:
//     cases that finished on other workers after the first one still running are left out) and
//     the case whose call did not return, failed. That call still runs, so the run's state is
//     copied here as it grows, under a lock the hook waits for a bounded time only.
//   - A crash (or a kill): nothing can be written then, so each op's start writes the reports
//     as they stand with that op marked interrupted (JSON "interrupted", a failed JUnit test
//     case). The run's normal end overwrites them; a usage error removes them.
class LiveReports {
 public:
  LiveReports(const Run& run, std::string json, std::string junit, bool hook_timeouts)
      : state_(std::make_shared<State>()) {
    state_->run.impl = run.impl;  // the run's settings; its ops come through end_op
    state_->run.ties = run.ties;
    state_->run.seed = run.seed;
    state_->run.cases_per_op = run.cases_per_op;
    state_->run.runs = run.runs;
    state_->run.case_timeout_s = run.case_timeout_s;
    state_->json = std::move(json);
    state_->junit = std::move(junit);
    active_ = !state_->json.empty() || !state_->junit.empty();
    if (!active_ || !hook_timeouts) return;
    ops::set_timeout_hook([st = state_](const ops::TimedOutCall& t) { write(*st, t); });
    hooked_ = true;
  }
  ~LiveReports() {
    if (hooked_) ops::set_timeout_hook({});
    if (checkpointed_ && !finished_) {
      std::lock_guard<std::timed_mutex> lock(state_->mu);
      std::error_code ec;  // a report this run wrote and did not finish: no report, as before
      if (!state_->json.empty()) std::filesystem::remove(state_->json, ec);
      if (!state_->junit.empty()) std::filesystem::remove(state_->junit, ec);
    }
  }
  LiveReports(const LiveReports&) = delete;
  LiveReports& operator=(const LiveReports&) = delete;

  // The run wrote its own reports: they stay.
  void finished() { finished_ = true; }

  void begin_op(const std::string& op, const std::string& impl) {
    if (!active_) return;
    std::lock_guard<std::timed_mutex> lock(state_->mu);
    state_->current = OpResult{};
    state_->current.op = op;
    state_->current.impl = impl;
    state_->run.interrupted_op = op;
    state_->run.interrupted =
        "the process ended while this op ran (a crash or a kill): its cases "
        "are not in this report; stderr names a crash's case and its replay "
        "line";
    write_reports(state_->run, state_->json, state_->junit);
    state_->run.interrupted_op.clear();
    state_->run.interrupted.clear();
    checkpointed_ = true;
  }
  void add_case(const CaseResult& r) {
    if (!active_) return;
    std::lock_guard<std::timed_mutex> lock(state_->mu);
    state_->current.cases.push_back(report_copy(r));
  }
  void end_op(const OpResult& o) {
    if (!active_) return;
    std::lock_guard<std::timed_mutex> lock(state_->mu);
    OpResult copy;
    copy.op = o.op;
    copy.impl = o.impl;
    for (const CaseResult& r : o.cases) copy.cases.push_back(report_copy(r));
    copy.passed = o.passed;
    copy.failed = o.failed;
    copy.not_supported = o.not_supported;
    copy.worst_pct = o.worst_pct;
    copy.seconds = o.seconds;
    copy.edge_classes = o.edge_classes;
    copy.aborted = o.aborted;
    copy.not_run = o.not_run;
    state_->run.ops.push_back(std::move(copy));
    state_->current = OpResult{};
  }

 private:
  struct State {
    std::timed_mutex mu;
    Run run;
    OpResult current;
    std::string json, junit;
  };

  // What the reports print of a case (its outputs, kept for --save-failures, are not).
  static CaseResult report_copy(const CaseResult& r) {
    CaseResult c;
    c.c = r.c;
    c.verdict = r.verdict;
    c.report = r.report;
    c.notes = r.notes;
    c.replay = r.replay;
    c.original = r.original;
    c.worst_pct = r.worst_pct;
    c.seconds = r.seconds;
    c.named = r.named;
    c.invalid_case = r.invalid_case;
    c.context_lost = r.context_lost;
    return c;
  }

  static void write(State& st, const ops::TimedOutCall& t) {
    std::unique_lock<std::timed_mutex> lock(st.mu, std::chrono::seconds(5));
    if (!lock.owns_lock()) {
      std::fprintf(stderr, "moe-harness: the reports were not written (the run's state is busy)\n");
      return;
    }
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", t.timeout_s);
    Run run;
    run.impl = st.run.impl;
    run.ties = st.run.ties;
    run.seed = st.run.seed;
    run.cases_per_op = st.run.cases_per_op;
    run.runs = st.run.runs;
    run.case_timeout_s = st.run.case_timeout_s;
    run.ops = std::move(st.run.ops);  // the process ends after this: the state is not needed
    run.stopped = std::string("case timeout: a call of implementation '") + t.impl + "' ran past " +
                  secs + " s; the cases after it were not run";
    OpResult o = std::move(st.current);
    CaseResult hung;
    try {
      hung.c = Case::parse(t.case_line);
    } catch (const std::exception&) {  // our own line: parses unless the format changed
      hung.c.op = o.op;
    }
    hung.verdict = Verdict::failed;
    hung.report = std::string("the call did not return within the case timeout (") + secs +
                  " s); the run stopped here, exit status 1\n";
    hung.replay = t.replay;
    hung.seconds = t.timeout_s;
    o.cases.push_back(std::move(hung));
    o.passed = o.failed = o.not_supported = 0;
    for (const CaseResult& r : o.cases) {
      (r.verdict == Verdict::passed   ? o.passed
       : r.verdict == Verdict::failed ? o.failed
                                      : o.not_supported) += 1;
      o.worst_pct = std::max(o.worst_pct, r.worst_pct);
      o.seconds += r.seconds;
    }
    run.ops.push_back(std::move(o));
    write_reports(run, st.json, st.junit);
  }

  std::shared_ptr<State> state_;  // shared with the hook, which may outlive a scope it races
  bool active_ = false, hooked_ = false, checkpointed_ = false, finished_ = false;
};

// Writes the case's inputs and the reference's outputs as a golden file, and the same inputs
// with the implementation's outputs next to it: `moe-harness golden diff` compares the two.
void save_failure(const std::string& dir, const std::string& impl, const CaseResult& r,
                  std::ostream& log) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  golden::Recorded rec = golden::record_case(r.c);
  std::string base = golden::file_name(r.c);
  base = base.substr(0, base.size() - std::string(".safetensors").size());
  base += "__" + std::to_string(std::hash<std::string>{}(r.c.line()) % 1000000);
  const std::string ref_path = (fs::path(dir) / (base + ".safetensors")).string();
  golden::write_file(ref_path, rec.tensors, rec.metadata);
  TensorMap mine;
  for (auto& [k, t] : rec.tensors)
    if (k.rfind("input.", 0) == 0 || k.rfind("cotangent.", 0) == 0) mine.emplace(k, t.clone());
  for (auto& [k, t] : r.outputs) mine.emplace(k, t.clone());
  golden::Metadata md = rec.metadata;
  md["x-impl"] = impl;
  const std::string got_path = (fs::path(dir) / (base + "." + impl + ".safetensors")).string();
  golden::write_file(got_path, mine, md);
  log << "  saved: " << ref_path << " (reference), " << got_path << " (" << impl << ")\n";
}

}  // namespace

void add_list_command(CLI::App& app, int& status) {
  auto* cmd = app.add_subcommand("list", "List the registered ops and their implementations");
  static std::vector<std::string> plugins;
  cmd->add_option("--plugin", plugins, "Load this plugin first (repeatable)");
  cmd->callback([&status] {
    try {
      load_plugins(plugins);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      status = 2;
      return;
    }
    const std::vector<std::string> names = impl_names();
    std::printf("%-34s %-11s %5s", "op", "spec", "named");
    for (auto& n : names) std::printf("  %-10s", n.c_str());
    std::printf("\n");
    for (const ops::OpInfo* op : ops::all_ops()) {
      std::printf("%-34s %-12s %5zu", op->name.c_str(), op->spec.c_str(),
                  op->named ? op->named().size() : size_t{0});
      for (auto& n : names) {
        const Impl* impl = find_impl(op->name, n);
        std::printf("  %-10s", !impl ? "-" : impl->memory == Memory::cuda ? "cuda" : "host");
      }
      std::printf("\n");
    }
    std::printf(
        "\nreference: the CPU reference (check = invariants + finite differences); "
        "moe-gpu: this project's CUDA kernels%s\n",
        ops::gpu_available() ? "" : " (no GPU here)");
    status = 0;
  });
}

void add_check_command(CLI::App& app, int& status) {
  auto* cmd =
      app.add_subcommand("check", "Check an implementation of every op against the reference");
  struct Args {
    std::vector<std::string> ops, plugins;
    std::string impl, backend, case_line, ties = "canonical", json, junit, save_failures;
    int cases = 20, jobs = 1, ep = 0, runs = 2;
    double case_timeout = 0;
    uint64_t seed = 1;
    bool verbose = false, random_only = false, no_shrink = false;
  };
  static Args a;
  cmd->add_option("--op", a.ops, "Only this op (repeatable; see `moe-harness list`)");
  auto* impl_opt = cmd->add_option(
      "--impl", a.impl,
      "Implementation: reference, moe-gpu, or a registered/plugin one (default: the plugin's, "
      "else moe-gpu when a GPU is present, else reference)");
  cmd->add_option("--backend", a.backend, "Alias of --impl (gpu = moe-gpu)")->excludes(impl_opt);
  cmd->add_option("--plugin", a.plugins,
                  "Load implementations from this shared library (repeatable)");
  cmd->add_option("--ties", a.ties, "Exact-tie rule of top-k selection: canonical, te or any")
      ->check(CLI::IsMember({"canonical", "te", "any"}));
  cmd->add_option("--cases", a.cases, "Random cases per op (plus every named case)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", a.seed, "Seed of the random cases");
  cmd->add_option("--case", a.case_line, "Replay exactly this case line");
  cmd->add_flag("--random-only", a.random_only, "Skip the named cases");
  cmd->add_flag("--no-shrink", a.no_shrink, "Report failing random cases as drawn");
  cmd->add_option("-j,--jobs", a.jobs, "Cases prepared and compared in parallel")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--runs", a.runs,
                  "Calls of the implementation per case, each bitwise equal to the first "
                  "(default 2; more hunts races that show now and then)")
      ->check(CLI::Range(kMinRuns, kMaxRuns));
  cmd->add_option("--case-timeout", a.case_timeout,
                  "Seconds one call of the implementation may take (default 0: no limit); a call "
                  "past it prints the case's replay line and ends the run with status 1")
      ->check(CLI::Range(0.0, ops::kMaxCaseTimeout));
  cmd->add_option("--json", a.json, "Write a JSON report here");
  cmd->add_option("--junit", a.junit, "Write a JUnit XML report here (one test case per case)");
  cmd->add_option("--save-failures", a.save_failures,
                  "Write each failing case as golden files here (reference and implementation)");
  cmd->add_flag("-v,--verbose", a.verbose, "Print every case");
  cmd->add_option("--ep", a.ep,
                  "Run moe_block's cases, rewritten to ep_size N and dp_size 1, over NCCL, one EP "
                  "rank per process (under `moe-harness launch -n N`)")
      ->check(CLI::PositiveNumber);
  cmd->callback([&status] {
    auto usage = [&status](const std::string& msg) {
      std::fprintf(stderr, "%s\n", msg.c_str());
      status = 2;
    };
    std::vector<std::string> plugin_names;
    try {
      plugin_names = load_plugins(a.plugins);
    } catch (const std::exception& e) {
      return usage(e.what());
    }
    std::string impl_name = canonical_impl(!a.impl.empty() ? a.impl : a.backend);
    if (impl_name.empty()) {
      impl_name = !plugin_names.empty()  ? plugin_names.front()
                  : ops::gpu_available() ? "moe-gpu"
                                         : "reference";
    }
    const std::vector<std::string> names = impl_names();
    if (std::find(names.begin(), names.end(), impl_name) == names.end()) {
      std::string all;
      for (auto& n : names) all += (all.empty() ? "" : ", ") + n;
      return usage("--impl: no implementation named '" + impl_name + "' (registered: " + all +
                   "; --plugin PATH loads more)");
    }
    if (impl_name == "moe-gpu" && !ops::gpu_available()) {
      return usage("--impl moe-gpu: no GPU available (" + ops::gpu_description() + ")");
    }
    CheckOptions opt;
    opt.cases = a.cases;
    opt.seed = a.seed;
    opt.named = !a.random_only;
    opt.ties = parse_tie_policy(a.ties);
    opt.shrink = !a.no_shrink;
    opt.jobs = a.jobs;
    opt.runs = a.runs;
    opt.replay_extra = plugin_flags(a.plugins);
    auto replay_flag = [&opt](const std::string& flag) {
      opt.replay_extra += (opt.replay_extra.empty() ? "" : " ") + flag;
    };
    if (a.runs != 2)  // the replay makes as many calls as the run that failed
      replay_flag("--runs " + std::to_string(a.runs));
    opt.case_timeout_s = a.case_timeout;
    if (a.case_timeout > 0) {  // the replay of a hang stops as the run did
      char t[32];
      std::snprintf(t, sizeof t, "%g", a.case_timeout);
      replay_flag(std::string("--case-timeout ") + t);
    }
    opt.keep_outputs = !a.save_failures.empty();

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
    if (a.ep > 0) {
#ifdef MOE_WITH_NCCL
      const int ep = a.ep;
      if (impl_name != "moe-gpu" || !gpu::NcclBootstrap::launched() ||
          (!a.ops.empty() && (a.ops.size() != 1 || a.ops[0] != "moe_block"))) {
        return usage("--ep " + std::to_string(ep) +
                     ": runs moe_block on moe-gpu under the launcher: moe-harness launch -n " +
                     std::to_string(ep) + " -- moe-harness check --impl moe-gpu --ep " +
                     std::to_string(ep));
      }
      try {
        guard.comm = std::make_unique<gpu::NcclCommunicator>(gpu::NcclBootstrap::from_env());
      } catch (const std::exception& e) {
        return usage("--ep " + std::to_string(ep) +
                     ": cannot create the NCCL communicator: " + e.what());
      }
      if (guard.comm->size() != ep) {
        return usage("--ep " + std::to_string(ep) + ": the launcher started " +
                     std::to_string(guard.comm->size()) + " ranks");
      }
      ops::set_block_communicator(guard.comm.get());
      a.ops = {"moe_block"};
      opt.rewrite = [ep](const Case& c) { return ops::moe_block_case_for_ep(c, ep); };
      opt.shrink = false;  // every rank must run the same cases
      std::printf("ep: %d ranks over NCCL %s, this is rank %d on GPU %d\n", ep,
                  gpu::NcclCommunicator::library_version().c_str(), guard.comm->rank(),
                  guard.comm->device());
#else
      return usage("--ep: this build has no NCCL");
#endif
    }

    const bool gpu_impl = impl_name == "moe-gpu";
    std::printf("moe-harness %s (%s), implementation: %s%s, ties: %s\n", MOE_VERSION, MOE_GIT_REV,
                impl_name.c_str(), gpu_impl ? (" on " + ops::gpu_description()).c_str() : "",
                a.ties.c_str());

    Run run;
    run.impl = impl_name;
    run.ties = a.ties;
    run.seed = a.seed;
    run.cases_per_op = a.cases;
    run.runs = a.runs;
    run.case_timeout_s = a.case_timeout;
    LiveReports live(run, a.json, a.junit, a.case_timeout > 0);

    if (!a.case_line.empty()) {
      // One case: validated against its op first, so a typo is a usage error, never a FAIL.
      Case c;
      try {
        c = ops::parse_case_for_op(a.case_line);
      } catch (const std::exception& e) {
        return usage(std::string("--case: ") + e.what());
      }
      const Impl* impl = find_impl(c.op, impl_name);
      if (!impl) return usage("--case: " + impl_name + " does not implement " + c.op);
      if (opt.rewrite) {
        auto rc = opt.rewrite(c);
        if (!rc) return usage("--case: this case does not run at --ep " + std::to_string(a.ep));
        c = *rc;
      }
      live.begin_op(c.op, impl_name);
      CaseResult r = check_case(*impl, c, opt);
      if (r.invalid_case) return usage("--case: " + r.report);
      print_case(std::cout, r, true);
      OpResult o;
      o.op = c.op;
      o.impl = impl_name;
      (r.verdict == Verdict::passed   ? o.passed
       : r.verdict == Verdict::failed ? o.failed
                                      : o.not_supported) = 1;
      o.worst_pct = r.worst_pct;
      o.seconds = r.seconds;
      if (!a.save_failures.empty() && r.verdict == Verdict::failed)
        save_failure(a.save_failures, impl_name, r, std::cout);
      o.cases.push_back(std::move(r));
      run.ops.push_back(std::move(o));
      status = write_reports(run, a.json, a.junit) ? (run.ops[0].failed ? 1 : 0) : 2;
      live.finished();
      return;
    }

    std::vector<const ops::OpInfo*> to_run;
    for (auto& n : a.ops)
      if (!ops::find_op(n)) return usage("--op: unknown op '" + n + "' (see `moe-harness list`)");
    for (const ops::OpInfo* op : ops::all_ops()) {
      const bool asked = std::find(a.ops.begin(), a.ops.end(), op->name) != a.ops.end();
      if (!a.ops.empty() && !asked) continue;
      // Without --op, a plugin's run covers the ops it implements.
      if (a.ops.empty() && !find_impl(op->name, impl_name)) continue;
      to_run.push_back(op);
    }
    if (to_run.empty())
      return usage("--impl " + impl_name + ": implements none of the ops asked for");
    std::printf("random cases per op: %d, seed: %llu, jobs: %d\n\n", a.cases,
                static_cast<unsigned long long>(a.seed), a.jobs);
    print_table_header(std::cout);
    std::string context_lost;  // the op whose case killed the CUDA context
    for (const ops::OpInfo* op : to_run) {
      const Impl* impl = find_impl(op->name, impl_name);
      OpResult o;
      if (!context_lost.empty() && impl && impl->memory == Memory::cuda) {
        // Every CUDA call of this process now fails: running the op would only fail every case.
        o.op = op->name;
        o.impl = impl_name;
        o.aborted = true;
        print_table_row(std::cout, o, "NotRun (CUDA context lost in " + context_lost + ")");
        run.ops.push_back(std::move(o));
        continue;
      }
      if (!impl) {
        o.op = op->name;
        o.impl = impl_name;
        o.not_supported = 1;
        print_table_row(std::cout, o, "NotSupported (" + impl_name + " does not implement it)");
        run.ops.push_back(std::move(o));
        continue;
      }
      // Failures are printed after the op's row; progress goes to stderr on long runs.
      auto last = std::chrono::steady_clock::now();
      const auto start = last;
      int done = 0;
      std::set<std::string> edges;
      live.begin_op(op->name, impl_name);
      o = check_impl(*impl, opt, [&](const CaseResult& r) {
        live.add_case(r);
        ++done;
        for (auto& e : ops::edge_classes(r.c)) edges.insert(e);
        if (a.verbose) print_case(std::cout, r, false);
        const auto now = std::chrono::steady_clock::now();
        if (now - last > std::chrono::seconds(10)) {
          std::fprintf(stderr, "  ... %s: %d cases done, %.0f s\n", op->name.c_str(), done,
                       std::chrono::duration<double>(now - start).count());
          last = now;
        }
      });
      o.edge_classes.assign(edges.begin(), edges.end());
      if (o.aborted) context_lost = op->name;
      print_table_row(std::cout, o,
                      o.aborted ? o.disposition() + " (CUDA context lost; " +
                                      std::to_string(o.not_run) + " cases not run)"
                                : o.disposition());
      for (const CaseResult& r : o.cases) {
        if (r.verdict != Verdict::failed) continue;
        if (!a.verbose) print_case(std::cout, r, true);
        if (!a.save_failures.empty()) {
          try {
            save_failure(a.save_failures, impl_name, r, std::cout);
          } catch (const std::exception& e) {
            std::cout << "  cannot save the failure: " << e.what() << "\n";
          }
        }
      }
      live.end_op(o);
      run.ops.push_back(std::move(o));
    }
    print_summary(std::cout, run);
    if (!context_lost.empty()) {
      std::printf(
          "CUDA context lost in %s: a case faulted on the device (its report above has the "
          "replay); the cases and ops after it were not run. Rerun the replay alone, or under "
          "compute-sanitizer, to see the fault.\n",
          context_lost.c_str());
    }
    bool any_failed = false;
    int passed = 0;
    for (auto& o : run.ops) {
      any_failed |= o.failed > 0 || o.aborted;
      passed += o.passed;
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
    live.finished();
    if (!write_reports(run, a.json, a.junit)) {
      status = 2;
      return;
    }
    if (!any_failed && passed == 0) {
      std::printf("no case was supported by %s: nothing was checked\n", impl_name.c_str());
      status = 1;
      return;
    }
    status = any_failed ? 1 : 0;
  });
}

}  // namespace moe::tools
