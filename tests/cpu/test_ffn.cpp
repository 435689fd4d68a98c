// grouped_gemm and swiglu_expert_ffn reference tests (SPEC §10): exact zeros for empty groups and
// tail rows, the fused-gate equivalence, the dtype rules, and one test per error of §10.1/§10.2.
// Random and named cases (finite differences, invariants, schema) run in test_registry.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/record.h"
#include "harness/ops/registry.h"
#include "reference/grouped_gemm.h"
#include "reference/swiglu_ffn.h"

using namespace moe;
using ::testing::HasSubstr;

namespace {

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

Tensor randn(DType d, const Shape& s, uint64_t seed, const char* name, double sd = 1.0) {
  Tensor t(d, s);
  Rng rng(seed, name);
  fill_normal(t, rng, sd);
  return t;
}

Tensor sizes(const std::vector<int64_t>& v, DType d = DType::i32) {
  Tensor t(d, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return t;
}

bool all_zero_rows(const Tensor& t, int64_t from, int64_t to) {
  const int64_t w = t.row_stride();
  for (int64_t i = from * w; i < to * w; ++i)
    if (t.at(i) != 0.0 || std::signbit(t.at(i))) return false;
  return true;
}

}  // namespace

// --- grouped_gemm -------------------------------------------------------------------------------

TEST(GroupedGemm, EmptyGroupsGiveExactlyZeroWeightGradAndTailRowsZero) {
  // Groups 0 and 2 are empty; rows 7..9 are the tail (x non-zero there).
  const Tensor x = randn(DType::bf16, {10, 5}, 1, "x");
  const Tensor w = randn(DType::bf16, {4, 5, 3}, 1, "w");
  const Tensor b = randn(DType::bf16, {4, 3}, 1, "b");
  const Tensor gs = sizes({0, 4, 0, 3});
  const Tensor ct = randn(DType::bf16, {10, 3}, 1, "ct");
  const Tensor y = ref::grouped_gemm_fwd(x, w, gs, &b);
  EXPECT_TRUE(all_zero_rows(y, 7, 10));
  EXPECT_FALSE(all_zero_rows(y, 0, 7));
  const ref::GroupedGemmBwd g = ref::grouped_gemm_bwd(ct, x, w, gs, &b);
  for (int64_t grp : {0, 2}) {
    for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(g.grad_w.at(grp * 15 + i), 0.0) << "group " << grp;
    for (int64_t n = 0; n < 3; ++n) EXPECT_EQ(g.grad_bias->at(grp, n), 0.0);
  }
  EXPECT_TRUE(all_zero_rows(g.grad_x, 7, 10));
  EXPECT_EQ(g.grad_w.dtype(), DType::bf16);
  EXPECT_EQ(g.grad_bias->dtype(), DType::bf16);
}

TEST(GroupedGemm, SingleGroupEqualsPlainProductRoundedOnce) {
  // Small integers make every product exact, so the reference must match the integer result.
  Tensor x(DType::bf16, {3, 2}), w(DType::bf16, {1, 2, 2});
  for (int64_t i = 0; i < 6; ++i) x.set(i, static_cast<double>(i - 2));
  for (int64_t i = 0; i < 4; ++i) w.set(i, static_cast<double>(i + 1));
  const Tensor y = ref::grouped_gemm_fwd(x, w, sizes({3}), nullptr);
  const double want[3][2] = {{-2 * 1 + -1 * 3, -2 * 2 + -1 * 4},
                             {0 * 1 + 1 * 3, 0 * 2 + 1 * 4},
                             {2 * 1 + 3 * 3, 2 * 2 + 3 * 4}};
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 2; ++c) EXPECT_EQ(y.at(r, c), want[r][c]);
}

TEST(GroupedGemm, ZeroRowsGiveEmptyOutputsAndZeroGradients) {
  const Tensor x(DType::f32, {0, 4});
  const Tensor w = randn(DType::f32, {2, 4, 3}, 2, "w");
  const Tensor gs = sizes({0, 0});
  EXPECT_EQ(ref::grouped_gemm_fwd(x, w, gs, nullptr).shape(), (Shape{0, 3}));
  const ref::GroupedGemmBwd g =
      ref::grouped_gemm_bwd(Tensor(DType::f32, {0, 3}), x, w, gs, nullptr);
  EXPECT_EQ(g.grad_x.shape(), (Shape{0, 4}));
  for (int64_t i = 0; i < g.grad_w.numel(); ++i) EXPECT_EQ(g.grad_w.at(i), 0.0);
}

TEST(GroupedGemm, ErrorGroupCountBelowOne) {
  const Tensor x(DType::f32, {2, 3}), w(DType::f32, {0, 3, 2});
  EXPECT_THAT(error_of([&] { ref::grouped_gemm_fwd(x, w, Tensor(DType::i32, {0}), nullptr); }),
              HasSubstr("group_sizes"));
}

TEST(GroupedGemm, ErrorNegativeGroupSize) {
  const Tensor x(DType::f32, {4, 3}), w(DType::f32, {2, 3, 2});
  const std::string msg = error_of([&] { ref::grouped_gemm_fwd(x, w, sizes({3, -1}), nullptr); });
  EXPECT_THAT(msg, HasSubstr("group_sizes"));
  EXPECT_THAT(msg, HasSubstr("-1"));
}

TEST(GroupedGemm, ErrorGroupSizesExceedRows) {
  const Tensor x(DType::f32, {4, 3}), w(DType::f32, {2, 3, 2});
  const std::string msg = error_of([&] { ref::grouped_gemm_fwd(x, w, sizes({3, 2}), nullptr); });
  EXPECT_THAT(msg, HasSubstr("group_sizes"));
  EXPECT_THAT(msg, HasSubstr("5"));
}

TEST(GroupedGemm, ErrorContractionMismatch) {
  const Tensor x(DType::f32, {4, 3}), w(DType::f32, {2, 5, 2});
  EXPECT_THAT(error_of([&] {
                ref::grouped_gemm_fwd(x, w, sizes({1, 1}), nullptr);
              }),
              HasSubstr("w: contraction size 5"));
}

TEST(GroupedGemm, ErrorDtypeMismatch) {
  const Tensor x(DType::f32, {4, 3}), w(DType::bf16, {2, 3, 2});
  EXPECT_THAT(error_of([&] {
                ref::grouped_gemm_fwd(x, w, sizes({1, 1}), nullptr);
              }),
              HasSubstr("w: dtype bfloat16"));
}

TEST(GroupedGemm, ErrorBiasShape) {
  const Tensor x(DType::f32, {4, 3}), w(DType::f32, {2, 3, 2}), b(DType::f32, {2, 3});
  EXPECT_THAT(error_of([&] { ref::grouped_gemm_fwd(x, w, sizes({1, 1}), &b); }), HasSubstr("bias"));
}

TEST(GroupedGemm, ErrorGroupCountMismatchWithWeights) {
  const Tensor x(DType::f32, {4, 3}), w(DType::f32, {3, 3, 2});
  EXPECT_THAT(error_of([&] {
                ref::grouped_gemm_fwd(x, w, sizes({1, 1}), nullptr);
              }),
              HasSubstr("w: expected 2 groups"));
}

TEST(GroupedGemm, ErrorF64OutsideFiniteDifferenceMode) {
  const Tensor x(DType::f64, {4, 3}), w(DType::f64, {1, 3, 2});
  EXPECT_THAT(error_of([&] { ref::grouped_gemm_fwd(x, w, sizes({4}), nullptr); }),
              HasSubstr("x: unsupported dtype float64"));
}

// The bound is the §12 reduction rule: a result perturbed by more than it must fail.
TEST(GroupedGemm, BoundRejectsAnErrorOfTwoUlps) {
  const ops::OpInfo& op = *ops::find_op("grouped_gemm");
  Case c = op.named().front();
  const TensorMap in = op.make_inputs(c);
  const TensorMap want = op.reference(c, in, false);
  Tensor got = want.at("output.out").clone();
  const int64_t i = 3;
  got.set(i, got.at(i) + 2.5 * ulp(c.dtype, got.at(i)) + 1e-3 * std::fabs(got.at(i)));
  const Tensor b = op.bound(c, "output.out", in, want);
  const TensorReport r = compare("output.out", got, want.at("output.out"), &b);
  EXPECT_EQ(r.mismatches, 1) << ops::replay_line(c, "reference");
}

// --- swiglu_expert_ffn --------------------------------------------------------------------------

struct FfnInputs {
  Tensor x, wi_0, wi_1, wo, b0, b1, bo, gs, ct;
  ref::FfnWeights weights(bool bias) const {
    return {wi_0, wi_1, wo, bias ? &b0 : nullptr, bias ? &b1 : nullptr, bias ? &bo : nullptr};
  }
};

FfnInputs ffn_inputs(DType d, const std::vector<int64_t>& groups, int64_t rows, int64_t H,
                     int64_t M, uint64_t seed) {
  const int64_t G = static_cast<int64_t>(groups.size());
  return {randn(d, {rows, H}, seed, "x"),         randn(d, {G, H, M}, seed, "wi_0", 0.5),
          randn(d, {G, H, M}, seed, "wi_1", 0.5), randn(d, {G, M, H}, seed, "wo", 0.5),
          randn(d, {G, M}, seed, "b0"),           randn(d, {G, M}, seed, "b1"),
          randn(d, {G, H}, seed, "bo"),           sizes(groups),
          randn(d, {rows, H}, seed, "ct")};
}

TEST(SwigluFfn, ActivationAppliesToWi0AndUpIsWi1) {
  // One row, H = M = 1: out = silu(x*w0) * (x*w1) * wo exactly as SPEC §10.2 orders the factors.
  Tensor x = Tensor::from(DType::f32, {1, 1}, {1.5});
  Tensor w0 = Tensor::from(DType::f32, {1, 1, 1}, {2.0});
  Tensor w1 = Tensor::from(DType::f32, {1, 1, 1}, {-0.5});
  Tensor wo = Tensor::from(DType::f32, {1, 1, 1}, {1.0});
  const ref::SwigluFfnFwd f = ref::swiglu_expert_ffn_fwd(x, sizes({1}), {w0, w1, wo},
                                                         Activation::silu, ref::Rounding::none);
  const double g = 3.0, u = -0.75;
  EXPECT_DOUBLE_EQ(f.out.at(0), g / (1 + std::exp(-g)) * u);
  const ref::SwigluFfnFwd lin = ref::swiglu_expert_ffn_fwd(x, sizes({1}), {w0, w1, wo},
                                                           Activation::linear, ref::Rounding::none);
  EXPECT_DOUBLE_EQ(lin.out.at(0), g * u);
}

TEST(SwigluFfn, EqualsTheFusedGateUpGemm) {
  // TE fuses gate and up into one GEMM against concat(wi_0, wi_1) along N; the split result is
  // identical.
  const FfnInputs in = ffn_inputs(DType::bf16, {3, 0, 4}, 9, 6, 5, 3);
  const ref::SwigluFfnFwd f =
      ref::swiglu_expert_ffn_fwd(in.x, in.gs, in.weights(true), Activation::silu);
  Tensor wcat(DType::bf16, {3, 6, 10}), bcat(DType::bf16, {3, 10});
  for (int64_t g = 0; g < 3; ++g) {
    for (int64_t h = 0; h < 6; ++h)
      for (int64_t m = 0; m < 5; ++m) {
        wcat.set((g * 6 + h) * 10 + m, in.wi_0.at((g * 6 + h) * 5 + m));
        wcat.set((g * 6 + h) * 10 + 5 + m, in.wi_1.at((g * 6 + h) * 5 + m));
      }
    for (int64_t m = 0; m < 5; ++m) {
      bcat.set(g, m, in.b0.at(g, m));
      bcat.set(g, 5 + m, in.b1.at(g, m));
    }
  }
  const Tensor fused = ref::grouped_gemm_fwd(in.x, wcat, in.gs, &bcat);
  for (int64_t r = 0; r < 9; ++r)
    for (int64_t m = 0; m < 5; ++m) {
      EXPECT_EQ(fused.at(r, m), f.gate_proj.at(r, m));
      EXPECT_EQ(fused.at(r, 5 + m), f.up_proj.at(r, m));
    }
}

TEST(SwigluFfn, PaddingRowsWithBiasAreNonZeroButTailRowsAreZero) {
  // Group 0 holds 2 real rows and 2 zero "padding" rows; rows 4..5 are the tail.
  FfnInputs in = ffn_inputs(DType::f32, {4, 0}, 6, 3, 4, 5);
  for (int64_t r = 2; r < 6; ++r)
    for (int64_t h = 0; h < 3; ++h) in.x.set(r, h, 0.0);
  const ref::SwigluFfnFwd f =
      ref::swiglu_expert_ffn_fwd(in.x, in.gs, in.weights(true), Activation::silu);
  EXPECT_FALSE(all_zero_rows(f.out, 2, 4));  // SPEC §10.2: biases make padding rows non-zero
  EXPECT_TRUE(all_zero_rows(f.out, 4, 6));
  EXPECT_TRUE(all_zero_rows(f.intermediate, 4, 6));
  const ref::SwigluFfnBwd b =
      ref::swiglu_expert_ffn_bwd(in.ct, in.x, in.gs, in.weights(true), f.gate_proj, f.up_proj,
                                 f.intermediate, Activation::silu);
  EXPECT_TRUE(all_zero_rows(b.grad_x, 4, 6));
  for (int64_t i = 0; i < 12; ++i) {
    EXPECT_EQ(b.grad_wi_0.at(12 + i), 0.0);  // group 1 is empty
    EXPECT_EQ(b.grad_wo.at(12 + i), 0.0);
  }
}

TEST(SwigluFfn, StageValuesAreStoredInTheActivationDtype) {
  const FfnInputs in = ffn_inputs(DType::f16, {2, 3}, 5, 4, 6, 7);
  const ref::SwigluFfnFwd f =
      ref::swiglu_expert_ffn_fwd(in.x, in.gs, in.weights(false), Activation::silu);
  for (const Tensor* t : {&f.out, &f.gate_proj, &f.up_proj, &f.intermediate}) {
    EXPECT_EQ(t->dtype(), DType::f16);
  }
  // intermediate = rnd_d(act(gate)*up) from the rounded gate and up (SPEC §10.2 [DECISION]).
  for (int64_t i = 0; i < f.intermediate.numel(); ++i) {
    const double g = f.gate_proj.at(i), u = f.up_proj.at(i);
    EXPECT_EQ(f.intermediate.at(i), round_to(DType::f16, g / (1 + std::exp(-g)) * u));
  }
}

TEST(SwigluFfn, ErrorUnknownActivation) {
  EXPECT_THAT(error_of([] { parse_activation("gelu"); }),
              HasSubstr("activation: unknown value 'gelu'"));
}

TEST(SwigluFfn, ErrorWeightShapeMismatch) {
  FfnInputs in = ffn_inputs(DType::f32, {2, 1}, 3, 4, 5, 1);
  const Tensor bad(DType::f32, {2, 4, 6});
  EXPECT_THAT(error_of([&] {
                ref::swiglu_expert_ffn_fwd(in.x, in.gs, {in.wi_0, bad, in.wo}, Activation::silu);
              }),
              HasSubstr("wi_1"));
  const Tensor bad_wo(DType::f32, {2, 4, 5});
  EXPECT_THAT(
      error_of([&] {
        ref::swiglu_expert_ffn_fwd(in.x, in.gs, {in.wi_0, in.wi_1, bad_wo}, Activation::silu);
      }),
      HasSubstr("wo"));
}

TEST(SwigluFfn, ErrorWeightDtypeMismatch) {
  FfnInputs in = ffn_inputs(DType::f32, {2, 1}, 3, 4, 5, 1);
  const Tensor wo16 = in.wo.to(DType::bf16);
  EXPECT_THAT(error_of([&] {
                ref::swiglu_expert_ffn_fwd(in.x, in.gs, {in.wi_0, in.wi_1, wo16}, Activation::silu);
              }),
              HasSubstr("wo: dtype bfloat16"));
}

TEST(SwigluFfn, ErrorBiasShape) {
  FfnInputs in = ffn_inputs(DType::f32, {2, 1}, 3, 4, 5, 1);
  const Tensor bad(DType::f32, {2, 4});  // wo_bias must be [G, H] = [2, 4]; wi_0_bias [2, 5]
  EXPECT_THAT(
      error_of([&] {
        ref::swiglu_expert_ffn_fwd(in.x, in.gs, {in.wi_0, in.wi_1, in.wo, &bad}, Activation::silu);
      }),
      HasSubstr("wi_0_bias"));
}

TEST(SwigluFfn, ErrorNegativeGroupSize) {
  FfnInputs in = ffn_inputs(DType::f32, {2, 1}, 3, 4, 5, 1);
  EXPECT_THAT(
      error_of([&] {
        ref::swiglu_expert_ffn_fwd(in.x, sizes({4, -1}), in.weights(false), Activation::silu);
      }),
      HasSubstr("group_sizes"));
}

// even_groups=true (the bench's deepseek_even cases): every group total / G rows, the first
// total % G one more, whatever the regime; the named cases run it through both ops' inputs.
TEST(GroupSizes, EvenGroupsSplitTheRowsEquallyWithTheRemainderFirst) {
  for (const char* op : {"grouped_gemm", "swiglu_expert_ffn"}) {
    const ops::OpInfo* info = ops::find_op(op);
    ASSERT_NE(info, nullptr) << op;
    bool seen = false;
    for (const Case& c : info->named()) {
      if (!c.b("even_groups", false)) continue;
      seen = true;
      const TensorMap in = info->make_inputs(c);
      const Tensor& gs = in.at("input.group_sizes");
      const int64_t G = c.i("G"), used = c.i("M_total") - c.i("tail");
      ASSERT_EQ(gs.numel(), G) << op;
      for (int64_t g = 0; g < G; ++g) {
        EXPECT_EQ(gs.at(g), static_cast<double>(used / G + (g < used % G ? 1 : 0)))
            << op << " group " << g << " of " << c.line();
      }
      EXPECT_GT(used % G, 0) << op << ": the case should exercise the remainder";
    }
    EXPECT_TRUE(seen) << op << " has no named even_groups case";
  }
  // The regime's draw for the same case without the key is not even: the key is what decides.
  Case c = ops::CaseBuilder("grouped_gemm", DType::bf16).seed(23).set("G", int64_t{8});
  c.set("M_total", int64_t{800}).set("K_d", int64_t{4}).set("N", int64_t{4});
  const TensorMap drawn_in = ops::find_op("grouped_gemm")->make_inputs(c);
  const Tensor& drawn = drawn_in.at("input.group_sizes");
  bool uneven = false;
  for (int64_t g = 0; g < 8; ++g) uneven |= drawn.at(g) != 100.0;
  EXPECT_TRUE(uneven);
  c.set("even_groups", true);
  const TensorMap even_in = ops::find_op("grouped_gemm")->make_inputs(c);
  const Tensor& even = even_in.at("input.group_sizes");
  for (int64_t g = 0; g < 8; ++g) EXPECT_EQ(even.at(g), 100.0) << g;
}
