// The implementation registry and the judge it runs (include/moe_harness/impl.h): implementations
// with a known fault must fail with that fault named, correct ones (including one that breaks exact
// ties like TransformerEngine) must pass under the tie policy that allows them.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "harness/core/params/router.h"
#include "harness/ops/call_guard.h"
#include "harness/ops/case_validation.h"
#include "harness/ops/registry.h"
#include "harness/ops/router_family.h"
#include "harness/ops/ties.h"
#include "moe_harness/impl.h"
#include "reference/topk_router.h"

using namespace moe;

namespace {

const ops::OpInfo& router() {
  return *ops::find_op("topk_router");
}

Case named_router_case(const std::string& name) {
  for (const Case& c : router().named())
    if (c.s("name", "") == name) return c;
  throw std::runtime_error("no named case " + name);
}

// The reference itself, as a host implementation: must pass.
Impl reference_copy(const std::string& name) {
  return host_impl("topk_router", name, [](const Case& c, const TensorMap& in, TensorMap& out) {
    TensorMap r = router().reference(c, in, false);
    for (auto& [k, t] : out) t = r.at(k).clone();
  });
}

CaseResult run(Impl impl, const Case& c, TiePolicy ties = TiePolicy::canonical) {
  CheckOptions opt;
  opt.ties = ties;
  return check_case(impl, c, opt);
}

}  // namespace

TEST(TiePolicy, TeNaiveRankIsReversedLaneBits) {
  // SPEC §1.4: with E = 8, K = 3 and equal scores TE's naive path picks {0, 4, 2}.
  std::vector<int64_t> order(8);
  for (int64_t e = 0; e < 8; ++e) order[e] = e;
  std::sort(order.begin(), order.end(), [](int64_t a, int64_t b) {
    return ops::tie_rank(TiePolicy::te, a, 8, 3) < ops::tie_rank(TiePolicy::te, b, 8, 3);
  });
  EXPECT_EQ((std::vector<int64_t>{order[0], order[1], order[2]}), (std::vector<int64_t>{0, 4, 2}));
  // A tie between 1 and 2: TE picks 2; the canonical rule picks 1.
  EXPECT_LT(ops::tie_rank(TiePolicy::te, 2, 8, 1), ops::tie_rank(TiePolicy::te, 1, 8, 1));
  EXPECT_LT(ops::tie_rank(TiePolicy::canonical, 1, 8, 1),
            ops::tie_rank(TiePolicy::canonical, 2, 8, 1));
  // K >= 16 (and E <= 8160) is TE's radix path: index ascending.
  EXPECT_LT(ops::tie_rank(TiePolicy::te, 1, 64, 16), ops::tie_rank(TiePolicy::te, 2, 64, 16));
}

TEST(TiePolicy, ExactTieViolationNamesThePreferredExpert) {
  auto all = [](int64_t) { return true; };
  auto same = [](int64_t) { return uint64_t{7}; };  // every input bitwise equal
  auto picked = [](std::vector<int64_t> s) {
    return [s](int64_t e) { return std::find(s.begin(), s.end(), e) != s.end(); };
  };
  EXPECT_EQ(ops::exact_tie_violation(TiePolicy::canonical, 0, 8, 3, picked({0, 1, 2}), all, same),
            "");
  EXPECT_EQ(ops::exact_tie_violation(TiePolicy::te, 0, 8, 3, picked({0, 4, 2}), all, same), "");
  const std::string v =
      ops::exact_tie_violation(TiePolicy::canonical, 0, 8, 3, picked({0, 4, 2}), all, same);
  EXPECT_NE(v.find("canonical tie rule (it prefers 1)"), std::string::npos) << v;
  EXPECT_NE(ops::exact_tie_violation(TiePolicy::te, 0, 8, 3, picked({0, 1, 2}), all, same), "");
  EXPECT_EQ(ops::exact_tie_violation(TiePolicy::any, 0, 8, 3, picked({5, 6, 7}), all, same), "");
}

TEST(ImplJudge, TheReferenceAsAnImplementationPasses) {
  for (const char* name : {"R13_A", "R13_grouped", "R2_bfloat16_sigmoid", "R15_bias"}) {
    const CaseResult r = run(reference_copy("copy"), named_router_case(name));
    EXPECT_EQ(r.verdict, Verdict::passed) << name << "\n" << r.report;
  }
}

// An implementation that selects exact ties by TE's naive rule (same fp32 scores otherwise).
TEST(ImplJudge, TeTieBreakingPassesUnderTeOnly) {
  Impl te =
      host_impl("topk_router", "te-like", [](const Case& c, const TensorMap& in, TensorMap& out) {
        const RouterParams p = ops::router_params(c);
        const Tensor& logits = in.at("input.logits");
        const TensorMap r = router().reference(c, in, false);
        const Tensor& scores = r.at("output.saved_scores");  // sigmoid: the fp32 scores
        const int64_t T = logits.dim(0), E = logits.dim(1);
        Tensor map(DType::boolean, {T, E});
        for (int64_t t = 0; t < T; ++t) {
          std::vector<int64_t> order(E);
          for (int64_t e = 0; e < E; ++e) order[e] = e;
          std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
            if (scores.at(t, a) != scores.at(t, b)) return scores.at(t, a) > scores.at(t, b);
            return ops::tie_rank(TiePolicy::te, a, E, p.topk) <
                   ops::tie_rank(TiePolicy::te, b, E, p.topk);
          });
          for (int64_t i = 0; i < p.topk; ++i) map.set(t, order[i], 1.0);
        }
        ref::TopkRouterFwd f = ref::topk_router_fwd_forced(logits, nullptr, p, map);
        out.at("output.probs") = std::move(f.probs);
        out.at("output.routing_map") = f.routing_map.clone();
        out.at("output.saved_scores") = f.saved_scores.clone();
        out.at("grad.logits") =
            ref::topk_router_bwd(in.at("cotangent.probs"), f.routing_map, f.saved_scores, p);
      });
  // R13_A (sigmoid, E = 8, K = 3, exact ties) at the first seed where the two rules disagree.
  Case c = named_router_case("R13_A");
  for (c.seed = 1; c.seed < 500; ++c.seed) {
    const TensorMap in = router().make_inputs(c);
    CheckOptions opt;
    if (check_case(te, c, opt).verdict == Verdict::failed) break;
  }
  ASSERT_LT(c.seed, 500u) << "no exact tie where TE's rule and the canonical one differ";
  const CaseResult canonical = run(te, c, TiePolicy::canonical);
  EXPECT_EQ(canonical.verdict, Verdict::failed);
  EXPECT_NE(canonical.report.find("not resolved by the canonical tie rule"), std::string::npos)
      << canonical.report;
  const CaseResult under_te = run(te, c, TiePolicy::te);
  EXPECT_EQ(under_te.verdict, Verdict::passed) << under_te.report;
  ASSERT_FALSE(under_te.notes.empty());
  EXPECT_NE(under_te.notes[0].find("accepted under --ties te"), std::string::npos);
  EXPECT_EQ(run(te, c, TiePolicy::any).verdict, Verdict::passed);
  // The reference (canonical) fails the te rule on the same rows.
  EXPECT_EQ(run(reference_copy("copy"), c, TiePolicy::te).verdict, Verdict::failed);
}

TEST(ImplJudge, AnUnwrittenOutputIsCaughtByThePoison) {
  Impl lazy =
      host_impl("topk_router", "lazy", [](const Case& c, const TensorMap& in, TensorMap& out) {
        TensorMap r = router().reference(c, in, false);
        for (auto& [k, t] : out) {
          if (k != "grad.logits") {
            t = r.at(k).clone();
            continue;
          }
          for (int64_t i = 0; i + 1 < t.numel(); ++i) t.set(i, r.at(k).at(i));  // not the last one
        }
      });
  const CaseResult r = run(lazy, named_router_case("R15_bias"));
  EXPECT_EQ(r.verdict, Verdict::failed);
  EXPECT_NE(r.report.find("grad.logits: 1 of"), std::string::npos) << r.report;
}

// A raw implementation that writes through the DLPack views.
Impl raw(const std::string& name, std::function<void(const ImplCall&, const TensorMap&)> after) {
  Impl impl;
  impl.op = "topk_router";
  impl.name = name;
  impl.origin = "C++";
  impl.run = [after](const ImplCall& call) {
    TensorMap r = router().reference(call.c, *call.host_in, false);
    for (auto& [k, v] : call.out) std::memcpy(v.data, r.at(k).bytes(), r.at(k).nbytes());
    after(call, r);
  };
  return impl;
}

TEST(ImplJudge, WritesPastTheEndAndModifiedInputsAreFaults) {
  const Case c = named_router_case("R15_bias");
  const CaseResult past = run(raw("past",
                                  [](const ImplCall& call, const TensorMap& r) {
                                    auto& v = call.out.at("output.probs");
                                    static_cast<uint8_t*>(v.data)[r.at("output.probs").nbytes()] =
                                        0;
                                  }),
                              c);
  EXPECT_EQ(past.verdict, Verdict::failed);
  EXPECT_NE(past.report.find("output.probs: written past the end"), std::string::npos)
      << past.report;
  const CaseResult in_place = run(raw("in-place",
                                      [](const ImplCall& call, const TensorMap&) {
                                        static_cast<float*>(call.in.at("input.logits").data)[0] +=
                                            1;
                                      }),
                                  c);
  EXPECT_EQ(in_place.verdict, Verdict::failed);
  EXPECT_NE(in_place.report.find("input.logits: the implementation modified an input"),
            std::string::npos)
      << in_place.report;
}

TEST(ImplJudge, NonDeterminismIsAFailureUnlessDeclared) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  Impl flaky = raw("flaky", [calls](const ImplCall& call, const TensorMap&) {
    if (++*calls % 2 == 0) static_cast<float*>(call.out.at("output.saved_scores").data)[0] += 1e-3f;
  });
  const Case c = named_router_case("R15_no_bias");
  CaseResult r = run(flaky, c);
  EXPECT_EQ(r.verdict, Verdict::failed);
  EXPECT_NE(r.report.find("determinism: output.saved_scores differs between two runs"),
            std::string::npos)
      << r.report;
  flaky.deterministic = false;
  r = run(flaky, c);
  EXPECT_EQ(r.verdict, Verdict::passed) << r.report;
  ASSERT_FALSE(r.notes.empty());
}

// CheckOptions::runs: a race that shows on a case's 5th call passes the default two calls and
// fails six, which stop at the call that differs; a non-deterministic implementation is called
// twice whatever runs says; runs outside kMinRuns..kMaxRuns is a usage error naming it.
TEST(ImplJudge, MoreRunsCatchARaceThatShowsNowAndThen) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  Impl flaky = raw("now-and-then", [calls](const ImplCall& call, const TensorMap&) {
    if (++*calls == 5) static_cast<float*>(call.out.at("output.saved_scores").data)[0] += 1e-3f;
  });
  const Case c = named_router_case("R15_no_bias");
  CheckOptions opt;
  CaseResult r = check_case(flaky, c, opt);
  EXPECT_EQ(r.verdict, Verdict::passed) << r.report;
  EXPECT_EQ(calls->load(), 2);
  calls->store(0);
  opt.runs = 6;
  r = check_case(flaky, c, opt);
  EXPECT_EQ(r.verdict, Verdict::failed);
  EXPECT_NE(r.report.find("determinism: output.saved_scores differs between runs 1 and 5 (of 6)"),
            std::string::npos)
      << r.report;
  EXPECT_EQ(calls->load(), 5) << "the runs stop at the first that differs";
  calls->store(0);
  flaky.deterministic = false;
  r = check_case(flaky, c, opt);
  EXPECT_EQ(r.verdict, Verdict::passed) << r.report;
  EXPECT_EQ(calls->load(), 2);
  for (int bad : {1, kMaxRuns + 1}) {
    opt.runs = bad;
    try {
      check_case(flaky, c, opt);
      ADD_FAILURE() << "runs = " << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("runs: expected 2..10000 calls per case, got " +
                                           std::to_string(bad)),
                std::string::npos)
          << e.what();
    }
  }
}

// A call that dies of a fatal signal names its case and replay line on stderr before the process
// dies of the signal; one that outlives CheckOptions::case_timeout_s ends the process with status
// 1, naming it. Death tests: each runs in a child process.
TEST(ImplJudge, ACrashOrAHangInACallNamesTheCase) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const Case c = named_router_case("R15_no_bias");
  const Impl crasher =
      raw("crasher", [](const ImplCall&, const TensorMap&) { std::raise(SIGSEGV); });
  EXPECT_EXIT(
      check_case(crasher, c, CheckOptions{}), ::testing::KilledBySignal(SIGSEGV),
      "moe-harness: SIGSEGV in a call of implementation 'crasher' for this case; the "
      "process dies of it.\n  case: op=topk_router .*Replay:\n  moe-harness check --impl crasher "
      "--case 'op=topk_router");
  const Impl hangs = raw("hangs", [](const ImplCall&, const TensorMap&) {
    std::this_thread::sleep_for(std::chrono::seconds(30));
  });
  CheckOptions opt;
  opt.case_timeout_s = 0.2;
  EXPECT_EXIT(check_case(hangs, c, opt), ::testing::ExitedWithCode(1),
              "a call of implementation 'hangs' ran past the case timeout \\(0.2 s\\) for this "
              "case.*Replay:\n  moe-harness check --impl hangs --case 'op=topk_router");
  // The timeout hook (check's --json / --junit writers) runs after the message, with the case.
  EXPECT_EXIT(
      {
        ops::set_timeout_hook([](const ops::TimedOutCall& t) {
          std::fprintf(stderr, "hook: %s, %g s, %s | %s\n", t.impl.c_str(), t.timeout_s,
                       t.case_line.c_str(), t.replay.c_str());
        });
        check_case(hangs, c, opt);
      },
      ::testing::ExitedWithCode(1),
      "ran past the case timeout.*\nhook: hangs, 0.2 s, op=topk_router [^|]*\\| moe-harness check "
      "--impl hangs --case 'op=topk_router");
  // Calls inside the limit, and the guard gone once check_case returns.
  const Impl quick = reference_copy("quick");
  EXPECT_EQ(check_case(quick, c, opt).verdict, Verdict::passed);
  for (double bad : {-1.0, ops::kMaxCaseTimeout + 1, std::nan("")}) {
    opt.case_timeout_s = bad;
    try {
      check_case(quick, c, opt);
      ADD_FAILURE() << "case_timeout_s = " << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(
          std::string(e.what()).find("case_timeout_s: expected 0 (no limit) or seconds up to"),
          std::string::npos)
          << e.what();
    }
  }
}

TEST(ImplJudge, NotSupportedAndUnprovidedOutputs) {
  Impl partial = reference_copy("partial");
  partial.provides = {"output.probs", "output.routing_map", "grad.logits"};
  partial.unsupported = [](const Case& c) {
    return c.dtype == DType::f16 ? std::string("no float16") : std::string();
  };
  const CaseResult ok = run(partial, named_router_case("R15_bias"));
  EXPECT_EQ(ok.verdict, Verdict::passed) << ok.report;
  ASSERT_FALSE(ok.notes.empty());
  EXPECT_NE(ok.notes.back().find("not compared: output.saved_scores"), std::string::npos);
  const CaseResult ns = run(partial, named_router_case("k_equals_e_pre"));  // float16
  EXPECT_EQ(ns.verdict, Verdict::not_supported);
  EXPECT_EQ(ns.report, "no float16");
}

TEST(ImplRegistry, BuiltInsAndDuplicates) {
  EXPECT_NE(find_impl("topk_router", "reference"), nullptr);
  EXPECT_THROW(register_impl(reference_copy("reference")), std::invalid_argument);
  EXPECT_THROW(register_impl(host_impl("no_such_op", "x", {})), std::invalid_argument);
  EXPECT_THROW(register_impl(reference_copy("has space")), std::invalid_argument);
  register_impl(reference_copy("registered-once"));
  EXPECT_NE(find_impl("topk_router", "registered-once"), nullptr);
  EXPECT_THROW(register_impl(reference_copy("registered-once")), std::invalid_argument);
}

TEST(CaseValidation, NamesTheKeyAndTheAllowedValues) {
  const std::string base = "op=topk_router dtype=float32 seed=1 T=4 E=8 topk=2 ";
  auto message = [](const std::string& line) {
    try {
      ops::parse_case_for_op(line);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(base + "score_function=sigmoid"), "accepted");
  EXPECT_NE(message(base + "bogus=1").find("unknown key 'bogus' for topk_router"),
            std::string::npos);
  EXPECT_NE(message(base + "T=5").find("key 'T' repeated"), std::string::npos);
  EXPECT_NE(message(base + "score_function=relu").find("allowed: sigmoid, softmax, sqrtsoftplus"),
            std::string::npos);
  EXPECT_NE(message(base + "expert_bias=maybe").find("true or false"), std::string::npos);
  EXPECT_NE(message("op=nope").find("unknown op 'nope'"), std::string::npos);
  EXPECT_NE(message(base + "regime=odd").find("allowed: uniform"), std::string::npos);
  // Every named and random case of every op passes its own validation.
  for (const ops::OpInfo* op : ops::all_ops()) {
    for (const Case& c : op->named()) EXPECT_NO_THROW(ops::validate_case(c)) << c.line();
    for (int i = 0; i < 50; ++i)
      EXPECT_NO_THROW(ops::validate_case(op->gen()(rc::Random(977 + i), 50).value()));
  }
}

// SPEC §0 "Unwritten rows": TE leaves the unpadded dispatch tail and row_id_map past each
// token's count unwritten. Under UnwrittenRows::te exactly those are not compared; every owned
// row still is.
TEST(ImplJudge, UnwrittenRowsTeMasksOnlyTheRowsSpecLists) {
  const ops::OpInfo& op = *ops::find_op("token_dispatch");
  Case c;
  for (const Case& n : op.named())
    if (n.s("name", "") == "odd_ragged_tail") c = n;
  ASSERT_EQ(c.s("name", ""), "odd_ragged_tail");
  // Leaves what TE leaves (the poison stays), or also breaks row 0 of permuted (owned).
  auto te_like = [&op](bool break_owned) {
    Impl impl = host_impl("token_dispatch", break_owned ? "te-like-broken" : "te-like",
                          [&op, break_owned](const Case& c, const TensorMap& in, TensorMap& out) {
                            TensorMap r = op.reference(c, in, false);
                            const Tensor& map = in.at("input.routing_map");
                            int64_t routed = 0;
                            for (int64_t i = 0; i < map.numel(); ++i) routed += map.at(i) != 0;
                            for (auto& [k, t] : out) {
                              const Tensor& w = r.at(k);
                              if (k == "output.permuted" || k == "output.permuted_probs") {
                                const size_t row = w.nbytes() / static_cast<size_t>(w.dim(0));
                                std::memcpy(t.bytes(), w.bytes(),
                                            row * static_cast<size_t>(routed));  // tail unwritten
                              } else if (k == "output.row_id_map") {
                                const int64_t E = (w.dim(1) - 1) / 2;
                                for (int64_t tk = 0; tk < w.dim(0); ++tk) {
                                  const int64_t n = static_cast<int64_t>(w.at(tk, 2 * E));
                                  t.set(tk, 2 * E, n);
                                  for (int64_t j = 0; j < n; ++j)
                                    t.set(tk, j, w.at(tk, j)), t.set(tk, E + j, w.at(tk, E + j));
                                }
                              } else {
                                t = w.clone();
                              }
                            }
                            if (break_owned) out.at("output.permuted").set(0, 0, 1234.0);
                          });
    return impl;
  };
  const Tensor& map = op.make_inputs(c).at("input.routing_map");
  int64_t routed = 0;
  for (int64_t i = 0; i < map.numel(); ++i) routed += map.at(i) != 0;
  ASSERT_LT(routed, c.i("num_out_tokens")) << "the case must have an unwritten tail";

  Impl lenient = te_like(false);
  EXPECT_EQ(run(lenient, c).verdict, Verdict::failed);  // SPEC's zeros demanded
  lenient.unwritten = UnwrittenRows::te;
  const CaseResult ok = run(lenient, c);
  EXPECT_EQ(ok.verdict, Verdict::passed) << ok.report;
  bool noted = false;
  for (auto& n : ok.notes) noted |= n.find("unwritten=te") != std::string::npos;
  EXPECT_TRUE(noted);

  Impl broken = te_like(true);
  broken.unwritten = UnwrittenRows::te;
  EXPECT_EQ(run(broken, c).verdict, Verdict::failed);
  EXPECT_EQ(parse_unwritten_rows("te"), UnwrittenRows::te);
  EXPECT_THROW(parse_unwritten_rows("garbage"), std::invalid_argument);
}
