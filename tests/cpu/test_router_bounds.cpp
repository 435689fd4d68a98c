// Issue 19 for the router family: the rounding-aware bounds accept emulated correct fp32 kernels
// (score_fn.h's functions and, separately, correctly rounded libm ones) and reject a kernel whose
// normaliser is rounded to bf16; the self-checks catch corrupted saved state; the generators
// reach the edges; edge_classes names them; make_rounded_bound's interval.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <set>

#include "harness/core/score_fn.h"
#include "harness/ops/check.h"
#include "harness/ops/edges.h"
#include "harness/ops/router_family.h"
#include "reference/aux_loss.h"
#include "reference/topk_router.h"

using namespace moe;
using namespace moe::ops;

namespace {

// How an emulated kernel computes its fp32 values.
enum class Flavor {
  score_fn,   // harness/core/score_fn.h (the project's exp/log1p, as the CUDA twins)
  libm_cr,    // correctly rounded fp32 from double libm (a different, correct implementation)
  bf16_norm,  // the mutant: score_fn, but the normaliser (top-k sum) rounded to bf16
  // score_fn, but sigma evaluated literally in fp32 with the host's expf (TE's sigmoid_scalar):
  // 0 once exp(-x) overflows, where the exact value is a subnormal (SPEC §0: admissible).
  fp32_literal,
};
const char* flavor_name(Flavor f) {
  return f == Flavor::score_fn       ? "score_fn"
         : f == Flavor::libm_cr      ? "libm_cr"
         : f == Flavor::fp32_literal ? "fp32_literal"
                                     : "bf16_norm";
}

float exp_f(Flavor fl, float x) {
  return fl == Flavor::libm_cr ? static_cast<float>(std::exp(double(x))) : score::exp_f32(x);
}
float sigmoid_f(Flavor fl, float x) {
  if (fl == Flavor::fp32_literal) return 1.0f / (1.0f + std::exp(-x));
  return fl == Flavor::libm_cr ? static_cast<float>(1.0 / (1.0 + std::exp(-double(x))))
                               : score::sigmoid_f32(x);
}
float sqrtsoftplus_f(Flavor fl, float x) {
  if (fl != Flavor::libm_cr) return score::sqrtsoftplus_f32(x);
  const double xd = x;
  return static_cast<float>(std::sqrt(xd > 20 ? xd : std::log1p(std::exp(xd))));
}
// The normaliser as the kernel holds it: fp32, or (mutant) rounded to bf16.
float norm(Flavor fl, float s) {
  return fl == Flavor::bf16_norm ? static_cast<float>(round_to(DType::bf16, s)) : s;
}
float score_of(Flavor fl, ScoreFunction f, float x) {
  return f == ScoreFunction::sigmoid ? sigmoid_f(fl, x) : sqrtsoftplus_f(fl, x);
}

// fp32 backward of SPEC §1.3/§2 for one row: g (already scaled), saved a, routed r.
void backward_row(Flavor fl, ScoreFunction f, bool pre, bool normalised,
                  const std::vector<float>& g, const std::vector<float>& a,
                  const std::vector<char>& r, std::vector<float>& out) {
  const size_t E = g.size();
  out.assign(E, 0.0f);
  if (f == ScoreFunction::softmax) {
    float dot = 0.0f;
    for (size_t e = 0; e < E; ++e)
      if (r[e]) dot = dot + g[e] * a[e];
    for (size_t e = 0; e < E; ++e) {
      if (!r[e] && !pre) continue;
      out[e] = a[e] * ((r[e] ? g[e] : 0.0f) - dot);
    }
    return;
  }
  const bool sig = f == ScoreFunction::sigmoid;
  std::vector<float> y(E);
  for (size_t e = 0; e < E; ++e) y[e] = sig ? a[e] : sqrtsoftplus_f(fl, a[e]);
  float A = 0.0f, B = 0.0f;
  for (size_t e = 0; e < E; ++e)
    if (r[e]) {
      A = A + y[e];
      B = B + g[e] * y[e];
    }
  const float Ae = A + kRouterEps;
  for (size_t e = 0; e < E; ++e) {
    if (!r[e]) continue;
    const float gp = normalised ? g[e] / Ae - B / (Ae * Ae) : g[e];
    if (sig) {
      out[e] = gp * a[e] * (1.0f - a[e]);
    } else {
      const float sg = a[e] > 20.0f ? 1.0f : sigmoid_f(fl, a[e]);
      out[e] = gp * (sg / (2.0f * y[e] + kRouterEps));
    }
  }
}

// topk_router as an fp32 kernel following SPEC §1.2 step by step, under want's selection.
TensorMap emulate_topk_router(const Case& c, const TensorMap& in, const TensorMap& want,
                              Flavor fl) {
  const RouterParams p = router_params(c);
  const Tensor& logits = in.at("input.logits");
  const Tensor& map = want.at("output.routing_map");
  const auto bit = in.find("input.expert_bias");
  const Tensor& ct = in.at("cotangent.probs");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  TensorMap out;
  Tensor probs(logits.dtype(), {T, E}), saved(DType::f32, {T, E}), grad(ct.dtype(), {T, E});
  const float sf = static_cast<float>(p.scaling_factor);
  std::vector<float> x(E), s(E), v(E), a(E), g(E), ge;
  std::vector<char> sel(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      x[e] = static_cast<float>(logits.at(t, e));
      sel[e] = routing_map_get(map, t, e);
    }
    std::vector<float> pe(E, 0.0f);
    if (p.score_function == ScoreFunction::softmax) {
      const bool pre = p.use_pre_softmax;
      float m = -INFINITY;
      for (int64_t e = 0; e < E; ++e)
        if (pre || sel[e]) m = std::max(m, x[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e)
        if (pre || sel[e]) {
          s[e] = exp_f(fl, x[e] - m);
          sum = sum + s[e];
        }
      const float inv = 1.0f / norm(fl, sum);
      for (int64_t e = 0; e < E; ++e) {
        const float q = (pre || sel[e]) ? s[e] * inv : 0.0f;
        if (sel[e]) pe[e] = q;
        a[e] = pre ? q : (sel[e] ? q : -INFINITY);
      }
    } else {
      const Tensor* bias = bit == in.end() ? nullptr : &bit->second;
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        s[e] = score_of(fl, p.score_function, x[e]);
        a[e] = p.score_function == ScoreFunction::sigmoid ? s[e] : x[e];
        if (!sel[e]) continue;
        const float b = bias ? static_cast<float>(bias->at(e)) : 0.0f;
        v[e] = bias ? (s[e] + b) - b : s[e];
        sum = sum + v[e];
      }
      const float den = norm(fl, sum) + kRouterEps;
      for (int64_t e = 0; e < E; ++e)
        if (sel[e]) pe[e] = p.topk > 1 ? v[e] / den : v[e];
    }
    for (int64_t e = 0; e < E; ++e) {
      if (sel[e]) probs.set(t, e, double(sf * pe[e]));  // fp32 multiply, one rounding to d
      saved.set(t, e, a[e]);
      g[e] = static_cast<float>(ct.at(t, e)) * sf;
    }
    const bool pre = p.score_function == ScoreFunction::softmax && p.use_pre_softmax;
    backward_row(fl, p.score_function, pre, p.topk > 1, g, a, sel, ge);
    for (int64_t e = 0; e < E; ++e) grad.set(t, e, ge[e]);
  }
  out.emplace("output.probs", std::move(probs));
  out.emplace("output.routing_map", map.clone());
  out.emplace("output.saved_scores", std::move(saved));
  out.emplace("grad.logits", std::move(grad));
  return out;
}

// aux_loss_scores (SPEC §2) as an fp32 kernel.
TensorMap emulate_aux_scores(const Case& c, const TensorMap& in, const TensorMap& want, Flavor fl) {
  const ScoreFunction f = parse_score_function(c.s("score_function"));
  const Tensor& logits = in.at("input.logits");
  const Tensor& ct = in.at("cotangent.scores");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  Tensor scores(DType::f32, {T, E}), saved(DType::f32, {T, E}), grad(logits.dtype(), {T, E});
  std::vector<float> x(E), u(E), sc(E), a(E), g(E), ge;
  const std::vector<char> all(E, 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits.at(t, e));
    float sum = 0.0f;
    if (f == ScoreFunction::softmax) {
      float m = -INFINITY;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, x[e]);
      for (int64_t e = 0; e < E; ++e) {
        u[e] = exp_f(fl, x[e] - m);
        sum = sum + u[e];
      }
      const float inv = 1.0f / norm(fl, sum);
      for (int64_t e = 0; e < E; ++e) a[e] = sc[e] = u[e] * inv;
    } else {
      for (int64_t e = 0; e < E; ++e) {
        u[e] = score_of(fl, f, x[e]);
        sum = sum + u[e];
      }
      const float den = norm(fl, sum) + kRouterEps;
      for (int64_t e = 0; e < E; ++e) {
        sc[e] = u[e] / den;
        a[e] = f == ScoreFunction::sigmoid ? u[e] : x[e];
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      scores.set(t, e, sc[e]);
      saved.set(t, e, a[e]);
      g[e] = static_cast<float>(ct.at(t, e));
    }
    backward_row(fl, f, f == ScoreFunction::softmax, true, g, a, all, ge);
    for (int64_t e = 0; e < E; ++e) grad.set(t, e, ge[e]);
  }
  TensorMap out;
  out.emplace("output.scores", std::move(scores));
  out.emplace("output.routing_map", want.at("output.routing_map").clone());
  out.emplace("output.saved_scores", std::move(saved));
  out.emplace("grad.logits", std::move(grad));
  return out;
}

// moe_aux_loss (SPEC §3) as an fp32 kernel: column sums, then the tpe-weighted sum, then kappa
// (score_fn/libm_cr differ only in the order: libm_cr sums the R*C products flat, row by row).
// The mutant keeps the running sum over the columns in bf16.
TensorMap emulate_aux_loss(const Case& c, const TensorMap& in, const TensorMap& want, Flavor fl) {
  const Tensor& probs = in.at("input.probs");
  const Tensor& tpe = in.at("input.tokens_per_expert");
  const int64_t R = probs.dim(0), C = probs.dim(1);
  const float kappa = static_cast<float>(want.at("output.const_buf").at(0));
  float sum = 0.0f;
  if (fl == Flavor::libm_cr) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t col = 0; col < C; ++col)
        sum = sum + static_cast<float>(tpe.at(col)) * static_cast<float>(probs.at(r, col));
  } else {
    for (int64_t col = 0; col < C; ++col) {
      float cs = 0.0f;
      for (int64_t r = 0; r < R; ++r) cs = cs + static_cast<float>(probs.at(r, col));
      sum = norm(fl, sum + static_cast<float>(tpe.at(col)) * cs);
    }
  }
  const float loss = kappa * sum;
  TensorMap out;
  Tensor l(probs.dtype(), {}), cb(DType::f32, {2});
  l.set(0, loss);
  cb.set(0, kappa);
  cb.set(1, loss);
  const Tensor& ct = in.at("cotangent.aux_loss");
  Tensor grad(ct.dtype(), {R, C});
  const float g = static_cast<float>(ct.at(0));
  for (int64_t col = 0; col < C; ++col) {
    const float kt = kappa * static_cast<float>(tpe.at(col));
    for (int64_t r = 0; r < R; ++r) grad.set(r, col, double(kt * g));
  }
  out.emplace("output.aux_loss", std::move(l));
  out.emplace("output.const_buf", std::move(cb));
  out.emplace("grad.probs", std::move(grad));
  return out;
}

TensorMap emulate(const std::string& op, const Case& c, const TensorMap& in, const TensorMap& want,
                  Flavor fl) {
  if (op == "topk_router") return emulate_topk_router(c, in, want, fl);
  if (op == "aux_loss_scores") return emulate_aux_scores(c, in, want, fl);
  return emulate_aux_loss(c, in, want, fl);
}

Report run_emulated(const OpInfo& o, const Case& c, Flavor fl) {
  const TensorMap in = o.make_inputs(c);
  const TensorMap want = o.reference(c, in, false);
  const TensorMap got = emulate(o.name, c, in, want, fl);
  return o.compare ? o.compare(c, in, want, got) : compare_outputs(o, c, in, want, got);
}

// Worst % of tolerance per (op, flavor, tensor), printed by the last test.
std::map<std::string, double>& worst() {
  static std::map<std::string, double> w;
  return w;
}
// Mutant: (mismatching, routed) elements of probs/scores per (op, dtype).
std::map<std::string, std::pair<int64_t, int64_t>>& flips() {
  static std::map<std::string, std::pair<int64_t, int64_t>> f;
  return f;
}
void print_worst(const std::string& prefix) {
  for (auto& [k, w] : worst())
    if (k.rfind(prefix, 0) == 0) std::cout << "worst % of tolerance: " << k << " " << w << "\n";
}
void record(const std::string& op, Flavor fl, DType d, const Report& r) {
  for (auto& t : r.tensors) {
    double& w = worst()[op + " " + flavor_name(fl) + " " + t.name + " " + dtype_name(d).data()];
    w = std::max(w, t.worst_pct);
  }
}

}  // namespace

// A correct fp32 kernel, with each of three score implementations, passes on the op's own random
// and named cases (edges included; the named every_pattern cases put every finite bf16 / f16
// logit through it, fp32_literal's flushed sigmoids included).
class CorrectKernel : public ::testing::TestWithParam<std::tuple<std::string, Flavor>> {};

TEST_P(CorrectKernel, PassesTheRoundingAwareBound) {
  const auto [name, fl] = GetParam();
  const OpInfo& o = *find_op(name);
  const bool ok = rc::check(name + " " + flavor_name(fl) + " emulation", [&, fl = fl] {
    const Case c = *o.gen();
    const Report r = run_emulated(o, c, fl);
    record(o.name, fl, c.dtype, r);
    if (!r.ok()) RC_FAIL(c.line() + "\n" + r.str());
  });
  EXPECT_TRUE(ok);
  for (const Case& c : o.named()) {
    if (c.i("T", 1) * c.i("E", 1) > 70000 || c.i("R", 1) * c.i("C", 1) > 70000) continue;
    const Report r = run_emulated(o, c, fl);
    record(o.name, fl, c.dtype, r);
    EXPECT_TRUE(r.ok()) << c.line() << "\n" << r.str();
  }
  print_worst(name + " " + flavor_name(fl));
}

INSTANTIATE_TEST_SUITE_P(
    Router, CorrectKernel,
    ::testing::Combine(::testing::Values("topk_router", "aux_loss_scores", "moe_aux_loss"),
                       ::testing::Values(Flavor::score_fn, Flavor::libm_cr, Flavor::fp32_literal)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + flavor_name(std::get<1>(info.param));
    });

// The bf16-normaliser mutant (about one bf16 ulp in probs/scores) fails on typical cases: every
// score function, bf16/f16/f32 outputs, several seeds; it fails on most routed elements.
TEST(Bf16Normaliser, FailsOnTypicalRouterCases) {
  for (const char* name : {"topk_router", "aux_loss_scores"}) {
    const OpInfo& o = *find_op(name);
    for (DType d : {DType::bf16, DType::f16, DType::f32}) {
      for (const char* f : {"softmax", "softmax_pre", "sigmoid", "sigmoid_bias", "sqrtsoftplus"}) {
        const std::string fs(f);
        if (o.name == "aux_loss_scores" && (fs == "softmax_pre" || fs == "sigmoid_bias")) continue;
        for (uint64_t seed : {1, 2, 3}) {
          Case c;
          c.op = o.name;
          c.dtype = d;
          c.seed = seed;
          c.set("T", int64_t{64}).set("E", int64_t{32}).set("topk", int64_t{4});
          c.set("score_function", fs.substr(0, fs.find('_')));
          c.set("routing_map_format", "bytemap");
          if (o.name == "topk_router") {
            c.set("use_pre_softmax", fs == "softmax_pre").set("expert_bias", fs == "sigmoid_bias");
            c.set("num_groups", int64_t{0}).set("group_topk", int64_t{0});
            c.set("scaling_factor", 1.0).set("grad_dtype", std::string(dtype_name(d)));
          }
          const Report r = run_emulated(o, c, Flavor::bf16_norm);
          record(o.name, Flavor::bf16_norm, c.dtype, r);
          const std::string key = o.name == "topk_router" ? "output.probs" : "output.scores";
          const auto it = std::find_if(r.tensors.begin(), r.tensors.end(),
                                       [&](const TensorReport& t) { return t.name == key; });
          ASSERT_NE(it, r.tensors.end());
          EXPECT_FALSE(it->ok()) << c.line() << ": the bf16-normaliser mutant passed " << key;
          // f32 outputs carry the whole ~2^-9 error: most routed elements (64 rows x 4; aux
          // scores: every element) fail. bf16/f16 outputs show it only where the rounding flips.
          const int64_t routed = o.name == "topk_router" ? 64 * 4 : 64 * 32;
          if (d == DType::f32) EXPECT_GT(it->mismatches, routed / 2) << c.line() << "\n" << r.str();
          auto& [bad, all] = flips()[o.name + " " + std::string(dtype_name(d))];
          bad += it->mismatches;
          all += routed;
        }
      }
    }
  }
  for (auto& [k, f] : flips())
    std::cout << "bf16 normaliser, elements outside the bound: " << k << " " << f.first << " of "
              << f.second << "\n";
  print_worst("topk_router bf16_norm");
  print_worst("aux_loss_scores bf16_norm");
}

// moe_aux_loss: a bf16 running sum moves the loss outside the fp32 budget.
TEST(Bf16Normaliser, FailsOnMoeAuxLossF32) {
  const OpInfo& o = *find_op("moe_aux_loss");
  int failed = 0, total = 0;
  for (const Case& c0 : o.named()) {
    if (c0.i("R") < 2) continue;
    for (uint64_t seed : {1, 2, 3}) {
      Case c = c0;
      c.seed = seed;
      const Report r = run_emulated(o, c, Flavor::bf16_norm);
      record(o.name, Flavor::bf16_norm, c.dtype, r);
      ++total;
      failed += !r.ok();
      // The fp32 budget of an unspecified summation order is (R C + 2) u relative: well below
      // the bf16 accumulator's ~2^-8 for R C <= 4096, comparable to it at R C = 16384.
      if (c.i("R") * c.i("C") <= 4096) EXPECT_FALSE(r.ok()) << c.line();
    }
  }
  std::cout << "moe_aux_loss bf16 running sum: " << failed << " of " << total << " cases fail\n";
  print_worst("moe_aux_loss bf16_norm");
}

// The tighter bound is what catches the mutant: SPEC §12's 1-ulp_d bound let it through.
TEST(Bf16Normaliser, SpecBoundWouldHaveAcceptedIt) {
  const OpInfo& o = *find_op("topk_router");
  Case c;
  c.op = o.name;
  c.dtype = DType::bf16;
  c.seed = 5;
  c.set("T", int64_t{64}).set("E", int64_t{32}).set("topk", int64_t{4});
  c.set("score_function", "sigmoid").set("routing_map_format", "bytemap");
  const TensorMap in = o.make_inputs(c);
  const TensorMap want = o.reference(c, in, false);
  const TensorMap got = emulate_topk_router(c, in, want, Flavor::bf16_norm);
  const Tensor spec = make_bound(TolClass::reduction, DType::bf16, want.at("output.probs"), 6);
  EXPECT_TRUE(compare("p", got.at("output.probs"), want.at("output.probs"), &spec).ok());
  const Tensor tight = o.bound(c, "output.probs", in, want);
  EXPECT_FALSE(compare("p", got.at("output.probs"), want.at("output.probs"), &tight).ok());
}

TEST(RoundedBound, IsZeroAwayFromMidpointsAndOneUlpNearThem) {
  // 1 + 2^-7 is a bf16 value (ulp 2^-7 on [1, 2)); its midpoint with the next is 1 + 1.5 2^-7.
  const double v = 1.0 + 0x1.0p-7, mid = 1.0 + 1.5 * 0x1.0p-7;
  EXPECT_EQ(rounded_bound(DType::bf16, v, v + 0x1.0p-12, 0x1.0p-20), 0.0);
  EXPECT_EQ(rounded_bound(DType::bf16, v, mid - 0x1.0p-22, 0x1.0p-20), 0x1.0p-7);
  EXPECT_EQ(rounded_bound(DType::bf16, -INFINITY, -INFINITY, 1.0), 0.0);
  // A want outside the interval (a tampered golden value) does not widen the bound around it.
  EXPECT_EQ(rounded_bound(DType::bf16, v * 1.01, v, 0x1.0p-20), 0.0);
  // f32: the interval's far end, about err.
  const double b = rounded_bound(DType::f32, 1.0, 1.0, 0x1.0p-20);
  EXPECT_GE(b, 0x1.0p-20 - 0x1.0p-23);
  EXPECT_LE(b, 0x1.0p-20 + 0x1.0p-23);
  Tensor want(DType::bf16, {2}), exact(DType::f64, {2}), err(DType::f64, {2});
  want.set(0, v);
  exact.set(0, mid - 0x1.0p-22);
  err.set(0, 0x1.0p-20);
  const Tensor t = make_rounded_bound(DType::bf16, want, exact, err);
  EXPECT_EQ(t.at(0), 0x1.0p-7);
  EXPECT_EQ(t.at(1), 0.0);
}

// ---- self-checks --------------------------------------------------------------------------

namespace {
Case router_case(const std::string& f, bool pre, int64_t G = 0, int64_t gk = 0) {
  Case c;
  c.op = "topk_router";
  c.dtype = DType::f32;
  c.seed = 3;
  c.set("T", int64_t{8}).set("E", int64_t{16}).set("topk", int64_t{4}).set("score_function", f);
  c.set("use_pre_softmax", pre).set("num_groups", G).set("group_topk", gk);
  c.set("scaling_factor", 1.0).set("routing_map_format", "bytemap").set("expert_bias", false);
  c.set("grad_dtype", "float32");
  return c;
}
}  // namespace

TEST(SelfCheck, RouterSavedScoresOneUlpOffAreCaught) {
  const OpInfo& o = *find_op("topk_router");
  for (auto [f, pre] : std::vector<std::pair<std::string, bool>>{
           {"sigmoid", false}, {"softmax", true}, {"sqrtsoftplus", false}}) {
    const Case c = router_case(f, pre);
    const TensorMap in = o.make_inputs(c);
    TensorMap out = o.reference(c, in, false);
    EXPECT_TRUE(o.invariants(c, in, out).empty()) << c.line();
    Tensor& s = out.at("output.saved_scores");
    s.set(5, std::nextafter(static_cast<float>(s.at(5)), 2.0f));
    const auto bad = o.invariants(c, in, out);
    ASSERT_FALSE(bad.empty()) << c.line();
    EXPECT_NE(bad.front().find("score_fn"), std::string::npos) << bad.front();
  }
}

TEST(SelfCheck, RouterSelectionOffTheCanonicalRuleIsCaught) {
  const OpInfo& o = *find_op("topk_router");
  for (const Case& c : {router_case("sigmoid", false), router_case("softmax", false, 4, 2)}) {
    const TensorMap in = o.make_inputs(c);
    TensorMap out = o.reference(c, in, false);
    // Move row 2's selection from one selected expert to an unselected one.
    Tensor& m = out.at("output.routing_map");
    int64_t on = -1, off = -1;
    for (int64_t e = 0; e < 16; ++e) (routing_map_get(m, 2, e) ? on : off) = e;
    routing_map_set(m, 2, on, false);
    routing_map_set(m, 2, off, true);
    const auto bad = o.invariants(c, in, out);
    const bool found = std::any_of(bad.begin(), bad.end(), [](const std::string& s) {
      return s.find("independent fp32 top-K") != std::string::npos;
    });
    EXPECT_TRUE(found) << c.line();
  }
}

TEST(SelfCheck, ScanTopkFollowsTheCanonicalTieRule) {
  // Equal values: lowest indices; -0 == +0; a larger value first.
  EXPECT_EQ(scan_topk_f32({1, 1, 1, 1, 1, 1, 1, 1}, 3),
            (std::vector<char>{1, 1, 1, 0, 0, 0, 0, 0}));
  EXPECT_EQ(scan_topk_f32({-0.0f, 0.0f, -1.0f}, 1), (std::vector<char>{1, 0, 0}));
  EXPECT_EQ(scan_topk_f32({0, 2, 2, 3}, 2), (std::vector<char>{0, 1, 0, 1}));
}

TEST(SelfCheck, AuxScoresSavedAndSelectionAreCaught) {
  const OpInfo& o = *find_op("aux_loss_scores");
  for (const char* f : {"sigmoid", "softmax"}) {
    Case c;
    c.op = o.name;
    c.dtype = DType::bf16;
    c.seed = 4;
    c.set("T", int64_t{8}).set("E", int64_t{16}).set("topk", int64_t{4});
    c.set("score_function", f).set("routing_map_format", "bytemap");
    const TensorMap in = o.make_inputs(c);
    TensorMap out = o.reference(c, in, false);
    EXPECT_TRUE(o.invariants(c, in, out).empty()) << c.line();
    TensorMap bad_saved = clone(out);
    Tensor& s = bad_saved.at("output.saved_scores");
    s.set(3, std::nextafter(static_cast<float>(s.at(3)), 2.0f));
    EXPECT_FALSE(o.invariants(c, in, bad_saved).empty()) << c.line();
    TensorMap bad_map = clone(out);
    Tensor& m = bad_map.at("output.routing_map");
    int64_t on = -1, off = -1;
    for (int64_t e = 0; e < 16; ++e) (routing_map_get(m, 1, e) ? on : off) = e;
    routing_map_set(m, 1, on, false);
    routing_map_set(m, 1, off, true);
    EXPECT_FALSE(o.invariants(c, in, bad_map).empty()) << c.line();
  }
}

// SPEC §0 admits sigma = 0 where its exact value is below 2^-128 (TE's literal fp32 sigmoid), so
// a boundary between two such scores is a near tie (§1.4, project copy): a kernel that flushes
// both may pick either. Scores of ordinary size keep 16 ulp_f32, where a swap still fails.
TEST(SelfCheck, FlushedSigmoidBoundaryIsANearTie) {
  // sigma(-95.5) - sigma(-96) is ~940 subnormal ulps: beyond 16 ulp_f32, within the flush
  // allowance.
  const std::vector<double> tiny = {-95, -95.5, -96, -97, -98, -99, -100, -101};
  const std::vector<double> normal = {2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5};
  // topk_router: the reference's own margin and delta.
  Tensor x(DType::f32, {2, 8});
  for (int64_t e = 0; e < 8; ++e) x.set(0, e, tiny[e]), x.set(1, e, normal[e]);
  RouterParams p;
  p.topk = 2;
  p.score_function = ScoreFunction::sigmoid;
  const auto sel = ref::topk_router_select(x, nullptr, p);
  EXPECT_GT(sel[0].margin, 0.0);  // distinct subnormal scores: not an exact tie
  EXPECT_LE(sel[0].margin, sel[0].delta) << "flushed scores must be a near tie";
  EXPECT_GT(sel[1].margin, sel[1].delta) << "ordinary scores must not be";
  // aux_loss_scores: its comparison accepts a swapped boundary in the flushed row only.
  const OpInfo& o = *find_op("aux_loss_scores");
  Case c;
  c.op = o.name;
  c.dtype = DType::f32;
  c.seed = 5;
  c.set("T", int64_t{2}).set("E", int64_t{8}).set("topk", int64_t{2});
  c.set("score_function", "sigmoid").set("routing_map_format", "bytemap");
  TensorMap in = o.make_inputs(c);
  in.at("input.logits") = x.clone();
  const TensorMap want = o.reference(c, in, false);
  for (int64_t row : {0, 1}) {
    TensorMap got = clone(want);
    Tensor& m = got.at("output.routing_map");
    ASSERT_TRUE(routing_map_get(m, row, 1) && !routing_map_get(m, row, 2));
    routing_map_set(m, row, 1, false);  // the 2nd pick swapped for the 3rd
    routing_map_set(m, row, 2, true);
    const Report r = o.compare(c, in, want, got);
    if (row == 0) {
      EXPECT_TRUE(r.ok()) << r.str();
    } else {
      EXPECT_FALSE(r.ok()) << "a swap of ordinary scores must fail";
    }
  }
}

TEST(SelfCheck, AuxLossCoefficientReadBackFromConstBufIsCaught) {
  const OpInfo& o = *find_op("moe_aux_loss");
  for (const Case& c : o.named()) {
    const TensorMap in = o.make_inputs(c);
    TensorMap out = o.reference(c, in, false);
    EXPECT_TRUE(o.invariants(c, in, out).empty()) << c.line();
    // A wrong kappa, saved and read back by the backward: consistent for finite differences.
    TensorMap bad = clone(out);
    const float wrong = 2.0f * static_cast<float>(out.at("output.const_buf").at(0));
    bad.at("output.const_buf").set(0, wrong);
    if (c.i("R") > 0) {
      bad.at("grad.probs") =
          ref::moe_aux_loss_bwd(in.at("cotangent.aux_loss"), bad.at("output.const_buf"),
                                in.at("input.tokens_per_expert"), c.i("R"));
    }
    const auto lines = o.invariants(c, in, bad);
    ASSERT_FALSE(lines.empty()) << c.line();
    EXPECT_NE(lines.front().find("kappa"), std::string::npos) << lines.front();
  }
}

// ---- generators and edge classes ----------------------------------------------------------

TEST(Edges, ClassesOfACase) {
  Case c;
  c.op = "topk_router";
  c.set("T", int64_t{0}).set("E", int64_t{33}).set("topk", int64_t{33});
  c.set("num_groups", int64_t{3}).set("group_topk", int64_t{3});
  const auto v = edge_classes(c);
  for (const char* want : {"T=0", "E=33 (warp+1)", "K=E", "grouped", "g_k=G", "K/g_k=E/G"})
    EXPECT_NE(std::find(v.begin(), v.end(), want), v.end()) << want;
  Case d;
  d.set("R", int64_t{257}).set("C", int64_t{8192}).set("num_experts", int64_t{4096});
  d.set("topk", int64_t{1});
  const auto w = edge_classes(d);
  for (const char* want :
       {"R=257 (block+1)", "num_experts>=1024", "num_experts=4096 (max)", "K=1", "C=m*E (m>1)"})
    EXPECT_NE(std::find(w.begin(), w.end(), want), w.end()) << want;
  Case e;
  e.set("E", int64_t{20}).set("topk", int64_t{3});
  EXPECT_TRUE(edge_classes(e).empty());
}

// Each generator reaches its edges within a few hundred cases (fixed seed).
TEST(Edges, GeneratorsReachTheEdges) {
  const std::map<std::string, std::vector<std::string>> need = {
      {"topk_router",
       {"K=1", "K=E", "T=0", "T=1", "g_k=G", "E>=1024", "E=8 (chunk)", "E=33 (warp+1)",
        "E=257 (block+1)", "topk=32 (warp)", "K>=16 (radix path)", "K/g_k=E/G"}},
      {"aux_loss_scores", {"K=1", "K=E", "T=0", "E>=1024", "E=33 (warp+1)", "E=256 (block)"}},
      {"moe_aux_loss", {"K=1", "K=E", "R=0", "R=1", "num_experts>=1024"}},
  };
  for (auto& [name, classes] : need) {
    const OpInfo& o = *find_op(name);
    std::set<std::string> seen;
    bool e8k8 = false;
    for (int i = 0; i < 600; ++i) {
      const Case c = o.gen()(rc::Random(1000 + i), rc::kNominalSize).value();
      for (auto& s : edge_classes(c)) seen.insert(s);
      if (c.has("E") && c.i("E") == 8 && c.i("topk") == 8) e8k8 = true;
      const int64_t rows = c.has("T") ? c.i("T") : c.i("R");
      const int64_t cols = c.has("E") ? c.i("E") : c.i("C");
      EXPECT_LE(rows * cols, 70000) << c.line();
    }
    for (auto& s : classes) EXPECT_TRUE(seen.count(s)) << name << " never hit " << s;
    if (name != "moe_aux_loss") EXPECT_TRUE(e8k8) << name << " never hit E = K = 8";
  }
}

TEST(Edges, NamedCasesHaveKEqualsE8) {
  for (const char* name : {"topk_router", "aux_loss_scores"}) {
    std::set<std::string> fns;
    for (const Case& c : find_op(name)->named())
      if (c.i("E") == 8 && c.i("topk") == 8)
        fns.insert(c.s("score_function") + (c.b("use_pre_softmax", false) ? "_pre" : ""));
    EXPECT_GE(fns.size(), 3u) << name;
  }
}
