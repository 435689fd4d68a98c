// Router-family reference tests: known exact-tie answers (R13), R2, R10, R15, the metamorphic
// invariants of SPEC §12, the tie-aware comparison of §1.4, and one test per error of §1.5/§2/§3.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <set>

#include "harness/core/rng.h"
#include "harness/core/score_fn.h"
#include "harness/ops/check.h"
#include "harness/ops/router_family.h"
#include "reference/aux_loss.h"
#include "reference/topk_router.h"

using namespace moe;
using ::testing::HasSubstr;

namespace {

RouterParams params(int64_t k, ScoreFunction f = ScoreFunction::sigmoid) {
  RouterParams p;
  p.topk = k;
  p.score_function = f;
  return p;
}

std::set<int> selected(const Tensor& map, int64_t t) {
  std::set<int> s;
  const int64_t E = map.dtype() == DType::u8 ? map.dim(1) * 8 : map.dim(1);
  for (int64_t e = 0; e < E; ++e)
    if (routing_map_get(map, t, e)) s.insert(static_cast<int>(e));
  return s;
}

std::set<int> range(int a, int b) {
  std::set<int> s;
  for (int i = a; i < b; ++i) s.insert(i);
  return s;
}

// Runs fn and returns the std::invalid_argument message ("" if none was thrown).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// --- R13: exact ties resolve by (value desc, index asc) ------------------------------------------

TEST(Regression, R13_A_SmallEAllEqual) {
  const Tensor logits(DType::f32, {4, 8});
  for (auto f : {ScoreFunction::sigmoid, ScoreFunction::softmax}) {
    RouterParams p = params(3, f);
    p.scaling_factor = 1.5;
    const auto out = ref::topk_router_fwd(logits, nullptr, p);
    for (int64_t t = 0; t < 4; ++t) {
      EXPECT_EQ(selected(out.routing_map, t), (std::set<int>{0, 1, 2}))
          << "TE naive would pick {0,4,2}";
      for (int e : {0, 1, 2}) EXPECT_FLOAT_EQ(out.probs.at(t, e), 1.5f / 3);
    }
  }
}

TEST(Regression, R13_B_LargeE) {
  Tensor logits(DType::f32, {3, 64});
  for (int64_t t = 0; t < 3; ++t) logits.set(t, 0, -1.0);
  for (auto f : {ScoreFunction::sigmoid, ScoreFunction::softmax}) {
    const auto out = ref::topk_router_fwd(logits, nullptr, params(2, f));
    for (int64_t t = 0; t < 3; ++t) EXPECT_EQ(selected(out.routing_map, t), (std::set<int>{1, 2}));
  }
}

TEST(Regression, R13_C_RadixPathK16) {
  Tensor logits(DType::f32, {3, 64});
  for (int64_t t = 0; t < 3; ++t) logits.set(t, 0, -1.0);
  for (auto f : {ScoreFunction::sigmoid, ScoreFunction::softmax}) {
    const auto out = ref::topk_router_fwd(logits, nullptr, params(16, f));
    for (int64_t t = 0; t < 3; ++t) EXPECT_EQ(selected(out.routing_map, t), range(1, 17));
  }
}

TEST(Regression, R13_GroupedAllEqual) {
  const Tensor logits(DType::f32, {2, 8});
  RouterParams p = params(4);
  p.num_groups = 4;
  p.group_topk = 2;
  const auto out = ref::topk_router_fwd(logits, nullptr, p);
  for (int64_t t = 0; t < 2; ++t) EXPECT_EQ(selected(out.routing_map, t), range(0, 4));
}

TEST(Router, NegativeZeroTiesWithPositiveZero) {
  Tensor logits = Tensor::from(DType::f32, {1, 3}, {-0.0, 0.0, -1.0});
  const auto out = ref::topk_router_fwd(logits, nullptr, params(1, ScoreFunction::softmax));
  EXPECT_EQ(selected(out.routing_map, 0), (std::set<int>{0}));  // IEEE equality: index wins
}

TEST(Router, SelectionIsOnFp32Scores) {
  // sigmoid(17) and sigmoid(18) are both 1.0f: an exact fp32 tie, resolved by index.
  Tensor logits = Tensor::from(DType::f32, {1, 3}, {17.0, 18.0, 0.0});
  const auto out = ref::topk_router_fwd(logits, nullptr, params(1));
  EXPECT_EQ(selected(out.routing_map, 0), (std::set<int>{0}));
}

// The fp32 score functions (harness/core/score_fn.h), shared bit for bit by the reference's
// selection and the CUDA kernels, against double over their whole range, including the logits
// below about -87 where e^x (and so sigma(x) and softplus(x)) is subnormal in fp32: sigma(x) must
// stay accurate down to its subnormal results, and sqrt(softplus(x)) = e^(x/2) (which is normal
// down to x = -174) must not inherit the underflow of softplus(x).
double ulp_f32_of(double v) {
  int e = 0;
  std::frexp(std::fabs(v), &e);
  return std::ldexp(1.0, std::max(e - 24, -149));  // subnormal ulp below 2^-126
}

TEST(ScoreFn, SigmoidAndSqrtSoftplusAccurateIncludingDeepNegativeLogits) {
  Rng rng(5, "score_fn");
  double worst_sig = 0, worst_ssp = 0;
  for (int i = 0; i < 400000; ++i) {
    const float x =
        static_cast<float>(i % 2 == 0 ? rng.uniform(-200.0, 40.0) : rng.uniform(-120.0, -80.0));
    const double xd = x;
    const double sig = xd >= 0 ? 1.0 / (1.0 + std::exp(-xd)) : std::exp(xd) / (1.0 + std::exp(xd));
    const double sp = xd > 20.0 ? xd : std::log1p(std::exp(xd));
    const double ssp = std::sqrt(sp);
    const double es = std::fabs(score::sigmoid_f32(x) - sig) / ulp_f32_of(sig);
    const double eq = std::fabs(score::sqrtsoftplus_f32(x) - ssp) / ulp_f32_of(ssp);
    worst_sig = std::max(worst_sig, es);
    worst_ssp = std::max(worst_ssp, eq);
    ASSERT_LE(es, 3.0) << "sigmoid_f32(" << x << ") = " << score::sigmoid_f32(x) << ", want "
                       << sig;
    ASSERT_LE(eq, 2.0) << "sqrtsoftplus_f32(" << x << ") = " << score::sqrtsoftplus_f32(x)
                       << ", want " << ssp;
  }
  // Deep negative logits: normal, non-zero results where e^x itself is subnormal or zero.
  EXPECT_GT(score::sqrtsoftplus_f32(-150.0f), 0.0f);
  EXPECT_NEAR(score::sqrtsoftplus_f32(-150.0f), std::exp(-75.0), 2 * ulp_f32_of(std::exp(-75.0)));
  EXPECT_GT(score::sigmoid_f32(-100.0f), 0.0f);  // e^-100 = 3.7e-44, a subnormal float
  RecordProperty("sigmoid_max_ulp", std::to_string(worst_sig));
  RecordProperty("sqrtsoftplus_max_ulp", std::to_string(worst_ssp));
}

// sigmoid_f32 (the sign of |x| from sigmoid_pair_f32) within 3 ulp of sigma in double for both
// signs of every finite bf16 pattern (the router's table, gpu/router_row.cuh) and of every 97th
// fp32 pattern: the random draws above cover [-200, 40] only.
TEST(ScoreFn, SigmoidOfBothSignsOfEveryBf16AndEvery97thFp32Pattern) {
  // The first failure ends the test (not one failure per pattern of 22 million).
  auto ok = [](uint32_t bits) {
    const float ax = score::bits_float(bits);
    for (const float x : {ax, -ax}) {
      const double xd = x;
      const double sig =
          xd >= 0 ? 1.0 / (1.0 + std::exp(-xd)) : std::exp(xd) / (1.0 + std::exp(xd));
      const float got = score::sigmoid_f32(x);
      if (std::fabs(got - sig) > 3.0 * ulp_f32_of(sig)) {
        ADD_FAILURE() << "sigmoid_f32(" << x << ") = " << got << ", want " << sig;
        return false;
      }
    }
    return true;
  };
  for (uint32_t b = 0; b < 0x7f80u; ++b)
    if (!ok(b << 16)) return;
  for (uint32_t b = 0; b < 0x7f800000u; b += 97)
    if (!ok(b)) return;
}

// aux_loss_scores selects on the fp32 scores the kernel computes (score_fn.h, row_sum_f32 order,
// fp32 normalisation), not on rounded double scores: the reference's routing_map is the canonical
// top-K of exactly those values.
TEST(AuxLossScores, SelectsOnKernelFp32Scores) {
  Rng rng(9, "aux_sel");
  for (ScoreFunction f :
       {ScoreFunction::softmax, ScoreFunction::sigmoid, ScoreFunction::sqrtsoftplus}) {
    const int64_t T = 64, E = 40, K = 5;
    Tensor logits(DType::bf16, {T, E});
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) logits.set(t, e, std::round(rng.uniform(-4.0, 4.0) * 4) / 4);
    const auto out = ref::aux_loss_scores_fwd(logits, K, f, MapFormat::bytemap);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> x(E), s(E);
      for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits.at(t, e));
      if (f == ScoreFunction::softmax) {
        score::softmax_f32(x.data(), s.data(), E);
      } else {
        for (int64_t e = 0; e < E; ++e)
          s[e] = f == ScoreFunction::sigmoid ? score::sigmoid_f32(x[e])
                                             : score::sqrtsoftplus_f32(x[e]);
        const float den = score::row_sum_f32(s.data(), E) + kRouterEps;
        for (int64_t e = 0; e < E; ++e) s[e] = s[e] / den;
      }
      std::vector<int> idx(E);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
      std::set<int> want(idx.begin(), idx.begin() + K);
      ASSERT_EQ(selected(out.routing_map, t), want) << score_function_name(f) << " row " << t;
    }
  }
}

// --- R15: optional expert bias -------------------------------------------------------------------

TEST(Regression, R15_ZeroBiasIsBitwiseNoBias) {
  Tensor logits(DType::f32, {64, 32});
  Rng rng(15, "logits");
  fill_normal(logits, rng, 1.0);
  const Tensor zero(DType::f32, {32});
  const RouterParams p = params(4);
  const auto a = ref::topk_router_fwd(logits, nullptr, p);
  const auto b = ref::topk_router_fwd(logits, &zero, p);
  EXPECT_TRUE(a.probs.bitwise_equal(b.probs));
  EXPECT_TRUE(a.routing_map.bitwise_equal(b.routing_map));
  EXPECT_TRUE(a.saved_scores.bitwise_equal(b.saved_scores));
  // A random bias changes the selection only, never the gradient's definition: there is no bias
  // gradient, and the record emits no grad.expert_bias.
  const ops::OpInfo& op = *ops::find_op("topk_router");
  for (const Case& c : op.named()) {
    const TensorMap out = op.reference(c, op.make_inputs(c), false);
    EXPECT_EQ(out.count("grad.expert_bias"), 0u) << c.line();
  }
}

TEST(Regression, R15_BiasWithSoftmaxIsAnError) {
  const Tensor logits(DType::f32, {2, 4}), bias(DType::f32, {4});
  EXPECT_THAT(
      error_of([&] { ref::topk_router_fwd(logits, &bias, params(2, ScoreFunction::softmax)); }),
      HasSubstr("expert_bias"));
}

// --- R2: fp32 saved scores under bf16/f16 logits; grad dtype follows the cotangent -------------

TEST(Regression, R2_SavedScoresF32AndGradDtypeFollowsCotangent) {
  for (DType d : {DType::bf16, DType::f16}) {
    Tensor logits(d, {256, 128});
    Rng rng(2, "logits");
    fill_normal(logits, rng, 2.0);
    for (auto f : {ScoreFunction::softmax, ScoreFunction::sigmoid, ScoreFunction::sqrtsoftplus}) {
      const RouterParams p = params(8, f);
      const auto fw = ref::topk_router_fwd(logits, nullptr, p);
      EXPECT_EQ(fw.saved_scores.dtype(), DType::f32);
      EXPECT_EQ(fw.saved_scores.nbytes(), size_t{256} * 128 * 4);
      for (DType gd : {d, DType::f32}) {
        Tensor ct(gd, {256, 128});
        Rng rc2(3, "ct");
        fill_normal(ct, rc2, 1.0);
        const Tensor g = ref::topk_router_bwd(ct, fw.routing_map, fw.saved_scores, p);
        EXPECT_EQ(g.dtype(), gd);
        // Within the dtype budget of the exact (unrounded) gradient.
        const Tensor exact = ref::topk_router_bwd(ct.to(DType::f64), fw.routing_map,
                                                  fw.saved_scores, p, ref::Rounding::none);
        const Tensor bound = make_bound(TolClass::elementwise, gd, exact, 1);
        const TensorReport r = compare("grad.logits", g.to(DType::f64), exact, &bound);
        EXPECT_TRUE(r.ok()) << r.str();
        for (int64_t i = 0; i < g.numel(); ++i) ASSERT_TRUE(std::isfinite(g.at(i)));
      }
    }
  }
}

// --- R10: aux scores are f32 whatever the logits dtype ------------------------------------------

TEST(Regression, R10_AuxScoresAreF32FromWidenedLogits) {
  Tensor logits(DType::bf16, {128, 32});
  Rng rng(10, "logits");
  fill_normal(logits, rng, 2.0);
  for (auto f : {ScoreFunction::softmax, ScoreFunction::sigmoid, ScoreFunction::sqrtsoftplus}) {
    const auto a = ref::aux_loss_scores_fwd(logits, 4, f, MapFormat::bytemap);
    const auto b = ref::aux_loss_scores_fwd(logits.to(DType::f32), 4, f, MapFormat::bytemap);
    EXPECT_EQ(a.scores.dtype(), DType::f32);
    EXPECT_EQ(a.scores.nbytes(), size_t{128} * 32 * 4);
    EXPECT_TRUE(a.scores.bitwise_equal(b.scores));
    EXPECT_TRUE(a.routing_map.bitwise_equal(b.routing_map));
  }
}

TEST(AuxLossScores, NormalisedOverAllExpertsEvenForK1) {
  Tensor logits = Tensor::from(DType::f32, {1, 2}, {0.0, 0.0});
  const auto a = ref::aux_loss_scores_fwd(logits, 1, ScoreFunction::sigmoid, MapFormat::bytemap);
  EXPECT_FLOAT_EQ(a.scores.at(0, 0), 0.5f);
  EXPECT_EQ(a.saved_scores.at(0, 0), 0.5);  // saved: the unnormalised sigmoid
}

TEST(MoeAuxLoss, KappaIsComputedInFp32InSpecOrder) {
  Tensor probs = Tensor::from(DType::f32, {3, 2}, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6});
  Tensor tpe = Tensor::from(DType::i32, {2}, {5, 7});
  AuxLossParams p;
  p.topk = 3;
  p.coeff = 0.1;
  const auto out = ref::moe_aux_loss_fwd(probs, tpe, p);
  float kappa = 2.0f * static_cast<float>(0.1);
  kappa = kappa / 3.0f;
  kappa = kappa / 3.0f;
  kappa = kappa / 3.0f;
  EXPECT_EQ(out.const_buf.at(0), static_cast<double>(kappa));
  const double want = double(kappa) * (5 * (double(0.1f) + double(0.3f) + double(0.5f)) +
                                       7 * (double(0.2f) + double(0.4f) + double(0.6f)));
  EXPECT_NEAR(out.aux_loss.at(0), want, 1e-7 * want);
  Tensor g = Tensor::from(DType::f32, {}, {2.0});
  const Tensor gp = ref::moe_aux_loss_bwd(g, out.const_buf, tpe, 3);
  EXPECT_EQ(gp.at(2, 1), double(kappa * 7.0f) * 2.0);
}

TEST(MoeAuxLoss, ZeroRowsGiveZeroLoss) {
  Tensor probs(DType::f32, {0, 4});
  Tensor tpe(DType::i64, {4});
  AuxLossParams p;
  p.topk = 2;
  p.total_num_tokens = 16;
  EXPECT_EQ(ref::moe_aux_loss_fwd(probs, tpe, p).aux_loss.at(0), 0.0);
  p.total_num_tokens = 0;  // defaults to R = 0: an error
  EXPECT_THAT(error_of([&] { ref::moe_aux_loss_fwd(probs, tpe, p); }),
              HasSubstr("total_num_tokens"));
}

// --- SPEC §12 metamorphic invariants
// --------------------------------------------------------------

RC_GTEST_PROP(RouterInvariants, TopK1IsSubsetOfTopK2, ()) {
  const int64_t E = *rc::gen::inRange<int64_t>(2, 40);
  const int64_t k1 = *rc::gen::inRange<int64_t>(1, E),
                k2 = *rc::gen::inRange<int64_t>(k1 + 1, E + 1);
  const auto f = *rc::gen::element(ScoreFunction::softmax, ScoreFunction::sigmoid,
                                   ScoreFunction::sqrtsoftplus);
  const bool ties = *rc::gen::arbitrary<bool>();
  Tensor logits(DType::bf16, {6, E});
  Rng rng(*rc::gen::arbitrary<uint32_t>(), "logits");
  for (int64_t i = 0; i < logits.numel(); ++i) {
    logits.set(i, ties ? 0.5 * double(rng.below(4)) : rng.normal());
  }
  const auto a = ref::topk_router_fwd(logits, nullptr, params(k1, f));
  const auto b = ref::topk_router_fwd(logits, nullptr, params(k2, f));
  for (int64_t t = 0; t < 6; ++t) {
    const auto s1 = selected(a.routing_map, t), s2 = selected(b.routing_map, t);
    RC_ASSERT(std::includes(s2.begin(), s2.end(), s1.begin(), s1.end()));
  }
}

RC_GTEST_PROP(RouterInvariants, SoftmaxRoutingIsShiftInvariant, ()) {
  const int64_t E = *rc::gen::inRange<int64_t>(1, 40), K = *rc::gen::inRange<int64_t>(1, E + 1);
  const bool pre = *rc::gen::arbitrary<bool>();
  const double shift = *rc::gen::element(8.0, -4.0, 0.5);
  Tensor logits(DType::bf16, {5, E});
  Rng rng(*rc::gen::arbitrary<uint32_t>(), "logits");
  fill_normal(logits, rng, 2.0);
  Tensor shifted(DType::f32, {5, E});  // x + shift is exact in f32 for bf16 x of this size
  for (int64_t i = 0; i < logits.numel(); ++i) shifted.set(i, logits.at(i) + shift);
  RouterParams p = params(K, ScoreFunction::softmax);
  p.use_pre_softmax = pre;
  const auto a = ref::topk_router_fwd(logits, nullptr, p);
  const auto b = ref::topk_router_fwd(shifted, nullptr, p);
  RC_ASSERT(a.routing_map.bitwise_equal(b.routing_map));
}

RC_GTEST_PROP(RouterInvariants, PermutingExpertsPermutesOutputs, ()) {
  const int64_t E = *rc::gen::inRange<int64_t>(2, 24), K = *rc::gen::inRange<int64_t>(1, E + 1);
  const auto f = *rc::gen::element(ScoreFunction::softmax, ScoreFunction::sigmoid,
                                   ScoreFunction::sqrtsoftplus);
  Tensor logits(DType::f32, {4, E});
  Rng rng(*rc::gen::arbitrary<uint32_t>(), "logits");
  fill_normal(logits, rng, 1.0);  // continuous values: no ties (the index rule is not equivariant)
  std::vector<int64_t> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = E - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  Tensor pl(DType::f32, {4, E});
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t e = 0; e < E; ++e) pl.set(t, e, logits.at(t, perm[e]));
  const auto a = ref::topk_router_fwd(logits, nullptr, params(K, f));
  const auto b = ref::topk_router_fwd(pl, nullptr, params(K, f));
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t e = 0; e < E; ++e) {
      RC_ASSERT(routing_map_get(b.routing_map, t, e) == routing_map_get(a.routing_map, t, perm[e]));
      RC_ASSERT(b.probs.at(t, e) == a.probs.at(t, perm[e]));
    }
}

// --- The tie-aware comparison (SPEC §1.4) must accept near ties and nothing else -----------------

TEST(TieAwareCompare, AcceptsNearTieRejectsClearMarginAndExactTieFlip) {
  const ops::OpInfo& op = *ops::find_op("topk_router");
  Case c;
  c.op = "topk_router";
  c.dtype = DType::f32;
  c.set("T", int64_t{3}).set("E", int64_t{4}).set("topk", int64_t{1});
  c.set("score_function", "sigmoid").set("grad_dtype", "float32");
  TensorMap in;
  // Row 0: near tie (1 ulp apart); row 1: clear margin; row 2: exact tie of equal inputs.
  const float x = 0.5f, x_next = std::nextafter(x, 0.0f);
  in.emplace("input.logits",
             Tensor::from(DType::f32, {3, 4}, {x, x_next, -3, -3, 2, 0, -3, -3, 1, 1, -3, -3}));
  Tensor ct(DType::f32, {3, 4});
  ct.fill(1.0);
  in.emplace("cotangent.probs", std::move(ct));
  const TensorMap want = op.reference(c, in, false);
  ASSERT_TRUE(op.compare(c, in, want, ops::clone(want)).ok());

  auto flipped = [&](int64_t row) {
    // An "implementation" that picks expert 1 instead of 0 on one row, computed under its own
    // selection, so only the selection itself is wrong.
    Tensor map = want.at("output.routing_map").clone();
    map.set(row, 0, 0.0);
    map.set(row, 1, 1.0);
    TensorMap in2 = ops::clone(in);
    const RouterParams p = ops::router_params(c);
    auto f = ref::topk_router_fwd_forced(in.at("input.logits"), nullptr, p, map);
    TensorMap got;
    got.emplace("grad.logits",
                ref::topk_router_bwd(in.at("cotangent.probs"), f.routing_map, f.saved_scores, p));
    got.emplace("output.probs", std::move(f.probs));
    got.emplace("output.routing_map", std::move(f.routing_map));
    got.emplace("output.saved_scores", std::move(f.saved_scores));
    return op.compare(c, in, want, got);
  };
  EXPECT_TRUE(flipped(0).ok()) << flipped(0).str();
  const Report clear = flipped(1);
  EXPECT_FALSE(clear.ok());
  EXPECT_THAT(clear.str(), HasSubstr("outside a near tie"));
  const Report exact = flipped(2);
  EXPECT_FALSE(exact.ok());
  EXPECT_THAT(exact.str(), HasSubstr("not resolved by the canonical"));
}

// --- One test per error (SPEC §1.5, §2, §3) ------------------------------------------------------

struct ErrorCase {
  const char* name;
  const char* expect;  // the parameter the message must name
  std::function<void()> run;
};

class RouterErrors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(RouterErrors, NamesTheParameter) {
  const std::string msg = error_of(GetParam().run);
  ASSERT_FALSE(msg.empty()) << GetParam().name << ": no std::invalid_argument";
  EXPECT_THAT(msg, HasSubstr(GetParam().expect)) << msg;
}

RouterParams grouped(int64_t k, int64_t g, int64_t gk) {
  RouterParams p = params(k);
  p.num_groups = g;
  p.group_topk = gk;
  return p;
}

const Tensor& logits_4x8() {
  static const Tensor t(DType::f32, {4, 8});
  return t;
}

INSTANTIATE_TEST_SUITE_P(
    Spec, RouterErrors,
    ::testing::Values(
        ErrorCase{"ZeroExperts", "num_experts",
                  [] {
                    ref::topk_router_fwd(Tensor(DType::f32, {2, 0}), nullptr, params(1));
                  }},
        ErrorCase{
            "TooManyExperts", "num_experts",
            [] {
              ref::topk_router_fwd(Tensor(DType::f32, {1, kMaxExperts + 1}), nullptr, params(1));
            }},
        ErrorCase{"TopkZero", "topk",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, params(0)); }},
        ErrorCase{"TopkAboveE", "topk",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, params(9)); }},
        ErrorCase{"UnknownScoreFunction", "score_function", [] { parse_score_function("relu"); }},
        ErrorCase{"UnknownMapFormat", "routing_map_format", [] { parse_map_format("bits"); }},
        ErrorCase{"GroupsNotDividingE", "num_groups",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, grouped(2, 3, 1)); }},
        ErrorCase{"NonPositiveGroups", "num_groups",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, grouped(2, 0, 1)); }},
        ErrorCase{"TopkNotDivisibleByGroupTopk", "group_topk",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, grouped(3, 4, 2)); }},
        ErrorCase{"GroupTopkAboveGroups", "group_topk",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, grouped(4, 2, 4)); }},
        ErrorCase{"PerGroupTopkAboveGroupSize", "topk",
                  [] { ref::topk_router_fwd(logits_4x8(), nullptr, grouped(6, 4, 2)); }},
        ErrorCase{"BiasShape", "expert_bias",
                  [] {
                    const Tensor b(DType::f32, {7});
                    ref::topk_router_fwd(logits_4x8(), &b, params(2));
                  }},
        ErrorCase{"LogitsNot2D", "logits",
                  [] { ref::topk_router_fwd(Tensor(DType::f32, {8}), nullptr, params(1)); }},
        ErrorCase{"LogitsF64", "logits",
                  [] {
                    ref::topk_router_fwd(Tensor(DType::f64, {2, 8}), nullptr, params(1));
                  }},
        ErrorCase{"LogitsInt", "logits",
                  [] {
                    ref::topk_router_fwd(Tensor(DType::i32, {2, 8}), nullptr, params(1));
                  }},
        ErrorCase{"ScalingNotFinite", "scaling_factor",
                  [] {
                    RouterParams p = params(1);
                    p.scaling_factor = INFINITY;
                    ref::topk_router_fwd(logits_4x8(), nullptr, p);
                  }},
        ErrorCase{"BwdSavedScoresNotF32", "saved_scores",
                  [] {
                    ref::topk_router_bwd(Tensor(DType::f32, {4, 8}), Tensor(DType::boolean, {4, 8}),
                                         Tensor(DType::bf16, {4, 8}), params(1));
                  }},
        ErrorCase{"BwdMapShape", "routing_map",
                  [] {
                    ref::topk_router_bwd(Tensor(DType::f32, {4, 8}), Tensor(DType::boolean, {4, 7}),
                                         Tensor(DType::f32, {4, 8}), params(1));
                  }},
        ErrorCase{"AuxScoresTopk", "topk",
                  [] {
                    ref::aux_loss_scores_fwd(logits_4x8(), 9, ScoreFunction::softmax,
                                             MapFormat::bytemap);
                  }},
        ErrorCase{"AuxScoresLogitsDtype", "logits",
                  [] {
                    ref::aux_loss_scores_fwd(Tensor(DType::i64, {2, 8}), 1, ScoreFunction::softmax,
                                             MapFormat::bytemap);
                  }},
        ErrorCase{"AuxLossTotalTokens", "total_num_tokens",
                  [] {
                    AuxLossParams p;
                    p.topk = 1;
                    p.total_num_tokens = -1;
                    ref::moe_aux_loss_fwd(Tensor(DType::f32, {2, 4}), Tensor(DType::i32, {4}), p);
                  }},
        ErrorCase{"AuxLossTopk", "topk",
                  [] {
                    AuxLossParams p;
                    p.topk = 0;
                    ref::moe_aux_loss_fwd(Tensor(DType::f32, {2, 4}), Tensor(DType::i32, {4}), p);
                  }},
        ErrorCase{"AuxLossColumnsNotMultipleOfE", "num_experts",
                  [] {
                    AuxLossParams p;
                    p.topk = 1;
                    p.num_experts = 3;
                    ref::moe_aux_loss_fwd(Tensor(DType::f32, {2, 4}), Tensor(DType::i32, {4}), p);
                  }},
        ErrorCase{"AuxLossTpeLength", "tokens_per_expert",
                  [] {
                    AuxLossParams p;
                    p.topk = 1;
                    ref::moe_aux_loss_fwd(Tensor(DType::f32, {2, 4}), Tensor(DType::i32, {5}), p);
                  }},
        ErrorCase{"AuxLossProbsNot2D", "probs",
                  [] {
                    AuxLossParams p;
                    p.topk = 1;
                    ref::moe_aux_loss_fwd(Tensor(DType::f32, {4}), Tensor(DType::i32, {4}), p);
                  }},
        ErrorCase{"AuxLossCoeffNotFinite", "coeff",
                  [] {
                    AuxLossParams p;
                    p.topk = 1;
                    p.coeff = NAN;
                    ref::moe_aux_loss_fwd(Tensor(DType::f32, {2, 4}), Tensor(DType::i32, {4}), p);
                  }}),
    [](const auto& info) { return std::string(info.param.name); });
