// Tests of harness/core: rounding, tensors, cases, tolerances, comparison reports and the
// finite-difference checker (which must be able to fail).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "harness/core/case.h"
#include "harness/core/compare.h"
#include "harness/core/finite_diff.h"
#include "harness/core/rng.h"
#include "harness/core/score_fn.h"
#include "harness/core/tensor.h"

using namespace moe;
using ::testing::HasSubstr;

TEST(DType, F16EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const double v = f16_value(static_cast<uint16_t>(b));
    if (std::isnan(v)) continue;
    ASSERT_EQ(f16_bits(v), b) << "f16 pattern " << std::hex << b << " value " << v;
  }
}

TEST(DType, Bf16EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const double v = bf16_value(static_cast<uint16_t>(b));
    if (std::isnan(v)) continue;
    ASSERT_EQ(bf16_bits(v), b) << "bf16 pattern " << std::hex << b;
    float f;
    const uint32_t u = b << 16;
    std::memcpy(&f, &u, 4);
    ASSERT_EQ(static_cast<double>(f), v);
  }
}

TEST(DType, RoundsToNearestEven) {
  EXPECT_EQ(round_to(DType::f16, 1.0 + std::ldexp(1.0, -11)), 1.0);  // tie -> even
  EXPECT_EQ(round_to(DType::f16, 1.0 + 3 * std::ldexp(1.0, -11)), 1.0 + std::ldexp(1.0, -9));
  EXPECT_EQ(round_to(DType::bf16, 1.0 + std::ldexp(1.0, -8)), 1.0);
  EXPECT_EQ(round_to(DType::bf16, 1.0 + std::ldexp(1.0, -8) + 1e-9), 1.0 + std::ldexp(1.0, -7));
  EXPECT_EQ(round_to(DType::f16, 65504.0), 65504.0);
  EXPECT_EQ(round_to(DType::f16, 65519.0), 65504.0);
  EXPECT_TRUE(std::isinf(round_to(DType::f16, 65520.0)));      // rounds past max
  EXPECT_EQ(round_to(DType::f16, std::ldexp(1.0, -25)), 0.0);  // half the smallest: even
  EXPECT_EQ(round_to(DType::f16, std::ldexp(1.5, -25)), std::ldexp(1.0, -24));
  EXPECT_EQ(round_to(DType::f32, 1.0 + std::ldexp(1.0, -24)), 1.0);
  EXPECT_EQ(ulp(DType::bf16, 1.0), std::ldexp(1.0, -7));
  EXPECT_EQ(ulp(DType::f16, 0.0), std::ldexp(1.0, -24));
  EXPECT_EQ(ulp(DType::f32, 3.0), std::ldexp(1.0, -22));
}

TEST(DType, ParseNamesParameter) {
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("f16"), DType::f16);
  try {
    parse_dtype("float8");
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("float8"));
  }
}

TEST(Tensor, ExplicitCopiesAndConversion) {
  Tensor t = Tensor::from(DType::bf16, {2, 3}, {1, 2, 3, 4, 5, 1.0 / 3});
  EXPECT_EQ(t.nbytes(), 12u);
  EXPECT_EQ(t.at(1, 2), bf16_value(bf16_bits(1.0 / 3)));
  Tensor c = t.clone();
  EXPECT_TRUE(c.bitwise_equal(t));
  c.set(0, 7.0);
  EXPECT_FALSE(c.bitwise_equal(t));
  EXPECT_EQ(t.to(DType::f32).at(5), t.at(5));  // widening is exact
  EXPECT_THROW(Tensor(DType::f32, {2, -1}), std::invalid_argument);
  EXPECT_THROW(Tensor::from(DType::f32, {2}, {1.0}), std::invalid_argument);
  static_assert(!std::is_copy_constructible_v<Tensor>, "copies must be explicit");
}

TEST(Case, LineRoundTripsAndReportsBadTokens) {
  Case c;
  c.op = "topk_router";
  c.dtype = DType::bf16;
  c.regime = Regime::near_ties;
  c.seed = 18446744073709551615ull;
  c.set("T", int64_t{5}).set("scaling_factor", 2.5).set("score_function", "sigmoid");
  c.set("use_pre_softmax", false).set("tiny", 1e-30).set("one", 1.0);
  const Case back = Case::parse(c.line());
  EXPECT_EQ(back, c) << c.line();
  EXPECT_EQ(back.s("one"), "1.0");
  EXPECT_EQ(back.f("tiny"), 1e-30);
  EXPECT_THAT(c.line(), HasSubstr("op=topk_router dtype=bfloat16 regime=near_ties"));
  EXPECT_THROW(Case::parse("dtype=float32"), std::invalid_argument);  // no op
  try {
    Case::parse("op=x T=abc").i("T");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("T='abc'"));
  }
  EXPECT_THROW(Case::parse("op=x regime=bogus"), std::invalid_argument);
  EXPECT_THROW(Case::parse("op=x noequals"), std::invalid_argument);
}

TEST(Rng, DerivesFromSeedAndName) {
  Rng a(42, "input.x"), b(42, "input.x"), c(42, "input.y");
  const uint64_t va = a.next();
  EXPECT_EQ(va, b.next());
  EXPECT_NE(va, c.next());
}

TEST(Tolerance, FollowsSpecRules) {
  EXPECT_EQ(tol_bound(TolClass::exact, DType::f32, 1.0, 1, 1.0), 0.0);
  EXPECT_EQ(tol_bound(TolClass::elementwise, DType::bf16, 1.0, 1, 1.0),
            std::ldexp(1.0, -7) + 4 * std::ldexp(1.0, -23) + 4 * std::ldexp(1.0, -150));
  EXPECT_EQ(
      tol_bound(TolClass::reduction, DType::f32, 1.0, 10, 3.0),
      std::ldexp(1.0, -23) + 2.0 * 10 * std::ldexp(1.0, -24) * 3.0 + 11 * std::ldexp(1.0, -150));
}

// The fp32 underflow term (compare.cpp): a subnormal result may be off by the absolute error of
// each fp32 rounding, 2^-150, and by nothing more.
TEST(Tolerance, SubnormalResultsGetTheUnderflowTermOnly) {
  const double sub = std::ldexp(1.0, -140);  // subnormal in fp32
  const double one_step = std::ldexp(1.0, -149);
  const double b = tol_bound(TolClass::reduction, DType::f32, sub, 1024, sub);
  EXPECT_GE(b, 2 * one_step);  // two subnormal steps of a 1024-term softmax gradient
  EXPECT_LT(b, 1e-40);         // still far below the smallest normal fp32 (1.2e-38)
  EXPECT_EQ(tol_bound(TolClass::elementwise, DType::f32, 0.0, 1, 0.0),
            std::ldexp(1.0, -149) + 4 * std::ldexp(1.0, -149) + 4 * std::ldexp(1.0, -150));
}

TEST(Compare, ReportsFirstAndWorstMismatchWithCoordinates) {
  Tensor want = Tensor::from(DType::f32, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor got = want.clone();
  got.set(0, 2, 3.5);
  got.set(1, 1, 9.0);
  Tensor bound = make_bound(TolClass::elementwise, DType::f32, want, 1);
  const TensorReport r = compare("output.probs", got, want, &bound);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.mismatches, 2);
  EXPECT_EQ(r.first->coord, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(r.worst->coord, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(r.max_abs, 4.0);
  EXPECT_THAT(r.str(), HasSubstr("output.probs: 2 of 6 elements mismatch"));
  EXPECT_THAT(r.str(), HasSubstr("worst at (1, 1): got 9, want 5"));
}

TEST(Compare, ToleranceEdgeIsInclusiveAndOneUlpBeyondFails) {
  Tensor want = Tensor::from(DType::f32, {1}, {1.0});
  Tensor bound = make_bound(TolClass::elementwise, DType::bf16, want, 1);
  Tensor got = Tensor::from(DType::f32, {1}, {1.0 + bound.at(0)});
  EXPECT_TRUE(compare("x", got, want, &bound).ok());
  got.set(0, 1.0 + 2 * bound.at(0));
  EXPECT_FALSE(compare("x", got, want, &bound).ok());
}

TEST(Compare, ExactIsBitwiseAndNanAware) {
  Tensor a = Tensor::from(DType::f32, {2}, {0.0, NAN});
  Tensor b = Tensor::from(DType::f32, {2}, {-0.0, NAN});
  EXPECT_FALSE(compare("x", a, b, nullptr).ok());  // -0 and +0 differ bitwise
  Tensor bound(DType::f64, {2});
  EXPECT_TRUE(compare("x", a, b, &bound).ok());  // equal values, NaN matches NaN
  Tensor c = Tensor::from(DType::f32, {2}, {0.0, 1.0});
  EXPECT_FALSE(compare("x", c, b, &bound).ok());  // a number where NaN is expected
  Tensor i = Tensor::from(DType::i32, {2}, {1, 2});
  EXPECT_FALSE(compare("x", i, b, nullptr).ok());
  EXPECT_THAT(compare("x", i, b, nullptr).error, HasSubstr("int32[2]"));
}

TEST(FiniteDiff, AcceptsTheRightGradientAndRejectsAWrongOne) {
  // L(x) = sum sin(x_i) * w_i.
  TensorMap in;
  in.emplace("x", Tensor::from(DType::f64, {4}, {0.1, -1.2, 2.0, 30.0}));
  const std::vector<double> w{1.0, -2.0, 0.5, 3.0};
  auto loss = [&](const TensorMap& m) {
    double l = 0;
    for (int i = 0; i < 4; ++i) l += std::sin(m.at("x").at(i)) * w[i];
    return l;
  };
  TensorMap good, bad, masks;
  good.emplace("x", Tensor(DType::f64, {4}));
  bad.emplace("x", Tensor(DType::f64, {4}));
  for (int i = 0; i < 4; ++i) {
    good.at("x").set(i, std::cos(in.at("x").at(i)) * w[i]);
    bad.at("x").set(i, std::cos(in.at("x").at(i)) * w[i] * (i == 2 ? 1.001 : 1.0));
  }
  for (auto& r : fd_check(loss, in, good, masks, {})) EXPECT_TRUE(r.ok()) << r.str();
  int failed = 0;
  for (auto& r : fd_check(loss, in, bad, masks, {})) failed += !r.ok();
  EXPECT_GT(failed, 0) << "a 0.1% gradient error must be caught";
  // Masked elements are never probed.
  masks.emplace("x", Tensor::from(DType::f64, {4}, {1, 1, 0, 1}));
  for (auto& r : fd_check(loss, in, bad, masks, {})) {
    EXPECT_THAT(r.probe, ::testing::Not(HasSubstr("(2)")));
  }
}

TEST(ScoreFn, ExpAndLog1pWithinTwoUlpsOfDouble) {
  Rng rng(3, "score");
  for (int i = 0; i < 200000; ++i) {
    const float x = static_cast<float>(rng.uniform(-100.0, 88.0));
    const double want = std::exp(static_cast<double>(x));
    const float got = score::exp_f32(x);
    ASSERT_LE(std::fabs(got - want), 2 * ulp(DType::f32, want)) << "exp(" << x << ")";
    const float y = static_cast<float>(rng.uniform(0.0, 1e6));
    const double want_l = std::log1p(static_cast<double>(y));
    ASSERT_LE(std::fabs(score::log1p_f32(y) - want_l), 2 * ulp(DType::f32, want_l))
        << "log1p(" << y << ")";
  }
}

// Both determinism checks rest on bitwise_equal: every byte counts, and so does the sign of zero.
TEST(Tensor, BitwiseEqualSeesEveryByte) {
  Tensor a(DType::f32, {2, 3}), b(DType::f32, {2, 3});
  for (int64_t i = 0; i < 6; ++i) a.set(i, double(i)), b.set(i, double(i));
  EXPECT_TRUE(a.bitwise_equal(b));
  b.set(5, 5.5);  // the last element only
  EXPECT_FALSE(a.bitwise_equal(b));
  a.set(5, 0.0), b.set(5, -0.0);  // equal values, different bits
  EXPECT_FALSE(a.bitwise_equal(b));
}
