// The implementation registry (include/moe_harness/impl.h) and the driver that checks one
// implementation of one op against the reference: it prepares each case's inputs and the
// reference's outputs, hands the implementation poisoned output buffers followed by guard bytes,
// compares what it wrote under the op's bounds and the tie policy, and runs it again for
// determinism (CheckOptions::runs calls in all).
#include "moe_harness/impl.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "harness/ops/call_guard.h"
#include "harness/ops/check.h"
#include "harness/ops/impl_buffers.h"
#include "harness/ops/impl_check.h"
#include "harness/ops/registry.h"
#include "harness/ops/ties.h"
#include "harness/ops/unwritten.h"

namespace moe {

namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<Impl>> impls;
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    // Built-ins: the reference (its check is the self-check: invariants and finite differences)
    // and this project's CUDA twins.
    for (const ops::OpInfo* op : ops::all_ops()) {
      auto ref = std::make_unique<Impl>();
      ref->op = op->name;
      ref->name = "reference";
      ref->origin = "built-in";
      ref->serial = false;
      ref->run_owned = [op](const Case& c, const TensorMap& in) {
        return op->reference(c, in, false);
      };
      reg->impls.push_back(std::move(ref));
    }
    for (const ops::OpInfo* op : ops::all_ops()) {
      if (!op->gpu) continue;
      auto gpu = std::make_unique<Impl>();
      gpu->op = op->name;
      gpu->name = "moe-gpu";
      gpu->origin = "built-in";
      gpu->memory = Memory::cuda;
      gpu->unsupported = [](const Case&) -> std::string {
        return ops::gpu_available() ? "" : "no CUDA GPU (" + ops::gpu_description() + ")";
      };
      gpu->run_owned = op->gpu;
      reg->impls.push_back(std::move(gpu));
    }
    return reg;
  }();
  return *r;
}

bool is_result_key(const std::string& k) {
  return k.rfind("output.", 0) == 0 || k.rfind("grad.", 0) == 0;
}

std::mutex& serial_mutex() {
  static std::mutex mu;
  return mu;
}

// What one call of the implementation produced, and the faults the buffers revealed.
struct Invocation {
  TensorMap got;
  std::vector<std::string> faults;
};

Invocation invoke(const Impl& impl, const Case& c, const std::string& params, const TensorMap& in,
                  const TensorMap& want) {
  Invocation inv;
  std::unique_lock<std::mutex> lock(serial_mutex(), std::defer_lock);
  if (impl.serial) lock.lock();
  if (impl.run_owned) {
    const ops::CallGuard guard;
    inv.got = impl.run_owned(c, in);
    return inv;
  }
  if (!impl.run) throw std::logic_error("implementation " + impl.name + " has no run function");
  std::vector<std::pair<std::string, TensorMeta>> outs;
  for (auto& [k, w] : want) {
    if (!is_result_key(k)) continue;
    if (!impl.provides.empty() &&
        std::find(impl.provides.begin(), impl.provides.end(), k) == impl.provides.end())
      continue;
    outs.emplace_back(k, w.meta());
  }
  auto buffers = ops::make_call_buffers(impl.memory, in, outs);
  ImplCall call{c, params, buffers->in_views(), buffers->out_views(), &in, buffers->stream()};
  {
    const ops::CallGuard guard;
    impl.run(call);
  }
  buffers->finish(inv.got, inv.faults);
  return inv;
}

// Keys whose values the implementation did not produce are filled from the reference so the
// op's comparison (which may read them) runs; their reports are dropped afterwards.
std::set<std::string> fill_unprovided(const Impl& impl, const TensorMap& want, TensorMap& got) {
  std::set<std::string> filled;
  if (impl.provides.empty()) return filled;
  for (auto& [k, w] : want) {
    if (is_result_key(k) && !got.count(k)) {
      got.emplace(k, w.clone());
      filled.insert(k);
    }
  }
  return filled;
}

}  // namespace

void register_impl(Impl impl) {
  if (!ops::find_op(impl.op))
    throw std::invalid_argument("register_impl: unknown op '" + impl.op + "'");
  if (impl.name.empty() || impl.name.find_first_of(" \t\n'\"") != std::string::npos)
    throw std::invalid_argument("register_impl: implementation name '" + impl.name +
                                "' is empty or has a space or quote");
  if (!impl.run && !impl.run_owned)
    throw std::invalid_argument("register_impl: implementation " + impl.name + " of " + impl.op +
                                " has no run function");
#ifndef MOE_WITH_CUDA
  if (impl.memory == Memory::cuda) {
    impl.unsupported = [](const Case&) -> std::string { return "this build has no CUDA backend"; };
  }
#endif
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  for (auto& p : r.impls)
    if (p->op == impl.op && p->name == impl.name)
      throw std::invalid_argument("register_impl: " + impl.op + " already has an implementation '" +
                                  impl.name + "' (" + p->origin + ")");
  r.impls.push_back(std::make_unique<Impl>(std::move(impl)));
}

std::vector<const Impl*> impls(std::string_view op) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<const Impl*> v;
  for (auto& p : r.impls)
    if (op.empty() || p->op == op) v.push_back(p.get());
  return v;
}

const Impl* find_impl(std::string_view op, std::string_view name) {
  for (const Impl* p : impls(op))
    if (p->name == name) return p;
  return nullptr;
}

std::vector<std::string> impl_names() {
  std::vector<std::string> names;
  for (const Impl* p : impls())
    if (std::find(names.begin(), names.end(), p->name) == names.end()) names.push_back(p->name);
  return names;
}

Impl host_impl(std::string op, std::string name,
               std::function<void(const Case&, const TensorMap&, TensorMap&)> fn) {
  Impl impl;
  impl.op = std::move(op);
  impl.name = std::move(name);
  impl.origin = "C++";
  impl.memory = Memory::host;
  impl.run = [fn = std::move(fn)](const ImplCall& call) {
    // The views' buffers carry the guard bytes; fn writes moe::Tensors copied from them.
    TensorMap out;
    for (auto& [k, v] : call.out) out.emplace(k, ops::tensor_from_view(v));
    fn(call.c, *call.host_in, out);
    for (auto& [k, t] : out) {
      auto it = call.out.find(k);
      if (it == call.out.end())
        throw std::runtime_error("wrote " + k + ", which is not an output of this case");
      ops::copy_to_view(t, it->second, k);
    }
  };
  return impl;
}

std::string_view verdict_name(Verdict v) {
  switch (v) {
    case Verdict::passed:
      return "passed";
    case Verdict::failed:
      return "failed";
    case Verdict::not_supported:
      return "not_supported";
  }
  return "?";
}

std::string OpResult::disposition() const {
  if (failed) return "Incorrect";
  if (aborted) return "NotRun";  // an earlier op killed the CUDA context
  if (passed == 0 && not_supported > 0) return "NotSupported";
  return "Passed";
}

std::string replay_command(const Case& c, std::string_view impl, TiePolicy ties,
                           std::string_view extra) {
  std::string s = "moe-harness check --impl " + std::string(impl);
  if (!extra.empty()) s += " " + std::string(extra);
  if (ties != TiePolicy::canonical) s += " --ties " + std::string(tie_policy_name(ties));
  return s + " --case '" + c.line() + "'";
}

namespace ops {

Report compare_impl(const Impl& impl, const Case& c, const TensorMap& in, const TensorMap& want,
                    TiePolicy ties, std::vector<std::string>& notes, TensorMap* got, int runs) {
  const OpInfo* op = find_op(c.op);
  if (!op) throw std::invalid_argument("unknown op '" + c.op + "'");
  const std::string params = op->to_params ? op->to_params(c).dump() : "{}";
  Invocation first = invoke(impl, c, params, in, want);
  const std::set<std::string> filled = fill_unprovided(impl, want, first.got);
  const std::string masked = mask_unwritten(impl.unwritten, c, in, want, first.got);
  if (!masked.empty()) notes.push_back(masked);
  Report r;
  {
    TieScope scope(ties, &notes);
    r = op->compare ? op->compare(c, in, want, first.got)
                    : compare_outputs(*op, c, in, want, first.got);
  }
  if (!filled.empty()) {
    std::erase_if(r.tensors, [&](const TensorReport& t) { return filled.count(t.name) > 0; });
    std::string keys;
    for (auto& k : filled) keys += (keys.empty() ? "" : ", ") + k;
    notes.push_back("not provided by " + impl.name + ", not compared: " + keys);
  }
  for (auto& f : first.faults) r.failures.push_back(f);
  // Runs 2..runs against the first; an implementation declared non-deterministic runs twice (its
  // differences are notes, and more calls could only repeat them).
  const int last = impl.deterministic ? runs : 2;
  for (int i = 2; i <= last; ++i) {
    Invocation again = invoke(impl, c, params, in, want);
    mask_unwritten(impl.unwritten, c, in, want, again.got);  // uninitialised rows may differ too
    const std::string which = last == 2 ? "second run" : "run " + std::to_string(i);
    for (auto& f : again.faults) r.failures.push_back(which + ": " + f);
    bool differs = false;
    for (auto& [k, v] : first.got) {
      if (filled.count(k)) continue;
      auto it = again.got.find(k);
      if (it != again.got.end() && it->second.bitwise_equal(v)) continue;
      differs = true;
      const std::string line = "determinism: " + k +
                               (last == 2 ? " differs between two runs"
                                          : " differs between runs 1 and " + std::to_string(i) +
                                                " (of " + std::to_string(last) + ")");
      if (impl.deterministic)
        r.failures.push_back(line);
      else
        notes.push_back(line + " (declared non-deterministic)");
    }
    if (differs || !again.faults.empty()) break;
  }
  if (got) *got = std::move(first.got);
  return r;
}

}  // namespace ops

namespace {
void check_runs(int runs) {
  if (runs < kMinRuns || runs > kMaxRuns)
    throw std::invalid_argument("CheckOptions::runs: expected " + std::to_string(kMinRuns) + ".." +
                                std::to_string(kMaxRuns) + " calls per case, got " +
                                std::to_string(runs));
}
void check_case_timeout(double s) {
  if (!(s >= 0 && s <= ops::kMaxCaseTimeout))  // NaN fails too
    throw std::invalid_argument(
        "CheckOptions::case_timeout_s: expected 0 (no limit) or seconds up to " +
        std::to_string(static_cast<int>(ops::kMaxCaseTimeout)) + ", got " + std::to_string(s));
}
}  // namespace

CaseResult check_case(const Impl& impl, const Case& c, const CheckOptions& opt) {
  check_runs(opt.runs);
  check_case_timeout(opt.case_timeout_s);
  CaseResult res;
  res.c = c;
  res.named = c.has("name");
  res.replay = replay_command(c, impl.name, opt.ties, opt.replay_extra);
  const ops::CaseScope scope(impl.name, c.line(), res.replay, opt.case_timeout_s);
  const auto t0 = std::chrono::steady_clock::now();
  Report r;
  try {
    const ops::OpInfo* op = ops::find_op(c.op);
    if (!op) throw std::invalid_argument("unknown op '" + c.op + "'");
    if (impl.unsupported) {
      const std::string why = impl.unsupported(c);
      if (!why.empty()) throw NotSupported(why);
    }
    if (impl.origin == "built-in" && impl.name == "reference") {
      try {
        r = ops::check_reference(*op, c);
      } catch (const std::invalid_argument&) {
        res.invalid_case = true;  // the reference validates every parameter first
        throw;
      }
    } else {
      TensorMap in, want;
      try {
        in = op->make_inputs(c);
        want = op->reference(c, in, false);
      } catch (const std::invalid_argument&) {
        // The case itself is invalid (a bad parameter value): not the implementation's fault.
        res.invalid_case = true;
        throw;
      }
      r = ops::compare_impl(impl, c, in, want, opt.ties, res.notes,
                            opt.keep_outputs ? &res.outputs : nullptr, opt.runs);
    }
    res.verdict = r.ok() ? Verdict::passed : Verdict::failed;
    res.report = r.ok() ? "" : r.str();
    if (r.ok()) res.outputs.clear();
    res.worst_pct = r.worst_pct();
  } catch (const NotSupported& e) {
    res.verdict = Verdict::not_supported;
    res.report = e.what();
  } catch (const std::exception& e) {
    res.verdict = Verdict::failed;
    res.report = r.str() + "exception: " + e.what() + "\n";
  }
  if (res.verdict == Verdict::failed && impl.memory == Memory::cuda) {
    // A kernel that faults (illegal or misaligned address, trap) kills the context for good:
    // say so on this case instead of failing every later case obscurely. Under jobs > 1 every
    // case in flight sees the sticky error, and the culprit may be any of them.
    const std::string lost = ops::gpu_context_error();
    if (!lost.empty()) {
      res.context_lost = true;
      res.report += "CUDA context lost after this case (" + lost +
                    "): a sticky error; no further CUDA work can run in this process\n";
      if (opt.jobs > 1) {
        res.report += "  with " + std::to_string(opt.jobs) +
                      " jobs, the case that caused it may be another one in flight: replay each "
                      "alone\n";
      }
    }
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

namespace {

struct Planned {
  Case c;
  std::optional<rc::Shrinkable<Case>> shrinkable;  // random cases only
};

// Greedy shrinking: the first smaller case that still fails replaces the current one, until no
// smaller case fails (or the budget runs out).
CaseResult shrink(const Impl& impl, const rc::Shrinkable<Case>& start, CaseResult failed,
                  const CheckOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string original = failed.c.line();
  rc::Shrinkable<Case> cur = start;
  int tries = 0, steps = 0;
  bool progressed = true;
  while (progressed && tries < 300 &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    progressed = false;
    auto seq = cur.shrinks();
    while (auto next = seq.next()) {
      if (++tries > 300) break;
      std::optional<Case> cand;
      try {
        cand = next->value();
        if (opt.rewrite) cand = opt.rewrite(*cand);
      } catch (const std::exception&) {
        continue;
      }
      if (!cand) continue;
      CaseResult r = check_case(impl, *cand, opt);
      if (r.verdict == Verdict::failed &&
          !r.invalid_case) {  // an invalid smaller case is no witness
        failed = std::move(r);
        cur = *next;
        progressed = true;
        ++steps;
        break;
      }
    }
  }
  if (steps > 0) failed.original = original;
  return failed;
}

}  // namespace

OpResult check_impl(const Impl& impl, const CheckOptions& opt,
                    const std::function<void(const CaseResult&)>& on_case) {
  const ops::OpInfo* op = ops::find_op(impl.op);
  if (!op) throw std::invalid_argument("check_impl: unknown op '" + impl.op + "'");
  check_runs(opt.runs);
  check_case_timeout(opt.case_timeout_s);
  OpResult out;
  out.op = impl.op;
  out.impl = impl.name;
  const auto t0 = std::chrono::steady_clock::now();

  std::vector<Planned> plan;
  if (opt.named && op->named) {
    for (const Case& c : op->named()) {
      std::optional<Case> r = opt.rewrite ? opt.rewrite(c) : std::optional<Case>(c);
      if (r) plan.push_back({*r, std::nullopt});
    }
  }
  int drawn = 0;
  for (int i = 0; drawn < opt.cases && i < 200 * std::max(opt.cases, 1); ++i) {
    // The size grows from 10 to 100 over the run, as the CLI always did (replays stay valid).
    const int size = 10 + (opt.cases > 1 ? drawn * 90 / (opt.cases - 1) : 0);
    rc::Shrinkable<Case> s = op->gen()(rc::Random(opt.seed * 1000003ull + i), size);
    std::optional<Case> c = opt.rewrite ? opt.rewrite(s.value()) : std::optional<Case>(s.value());
    if (!c) continue;
    ++drawn;
    plan.push_back({*c, s});
  }

  // Set once a case kills the CUDA context: later cases are not run (nor shrunk: every smaller
  // case would fail the same way, for the wrong reason).
  std::atomic<bool> lost{false};
  auto run_one = [&](size_t i) -> std::optional<CaseResult> {
    if (lost.load()) return std::nullopt;
    CaseResult r = check_case(impl, plan[i].c, opt);
    if (r.context_lost) lost.store(true);
    if (r.verdict == Verdict::failed && !r.context_lost && opt.shrink && plan[i].shrinkable)
      r = shrink(impl, *plan[i].shrinkable, std::move(r), opt);
    if (r.context_lost) lost.store(true);
    return r;
  };
  auto take = [&](std::optional<CaseResult> maybe) {
    if (!maybe) {
      ++out.not_run;
      return;
    }
    CaseResult r = std::move(*maybe);
    if (r.context_lost) out.aborted = true;
    switch (r.verdict) {
      case Verdict::passed:
        ++out.passed;
        break;
      case Verdict::failed:
        ++out.failed;
        break;
      case Verdict::not_supported:
        ++out.not_supported;
        break;
    }
    out.worst_pct = std::max(out.worst_pct, r.worst_pct);
    if (on_case) on_case(r);
    out.cases.push_back(std::move(r));
  };
  const int jobs = std::max(1, std::min<int>(opt.jobs, static_cast<int>(plan.size())));
  if (jobs == 1) {
    for (size_t i = 0; i < plan.size(); ++i) take(run_one(i));
  } else {
    // Workers take cases in order; results are reported in case order as they become ready.
    std::vector<std::optional<std::optional<CaseResult>>> results(plan.size());
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < plan.size();) {
        std::optional<CaseResult> r = run_one(i);
        std::lock_guard<std::mutex> g(mu);
        results[i] = std::move(r);
        cv.notify_all();
      }
    };
    std::vector<std::thread> pool;
    for (int j = 0; j < jobs; ++j) pool.emplace_back(work);
    for (size_t i = 0; i < plan.size(); ++i) {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return results[i].has_value(); });
      std::optional<CaseResult> r = std::move(*results[i]);
      lk.unlock();
      take(std::move(r));
    }
    for (auto& t : pool) t.join();
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace moe
