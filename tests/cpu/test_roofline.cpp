// The roofline arithmetic of `moe-harness bench` (harness/ops/roofline.h): max(flops / dense rate,
// bytes / copy bandwidth) in a bandwidth-bound and a flop-bound case, the fwd+bwd sums, the stage
// sum of a composite op (at least, and here above, the single max over its totals), % of
// roofline, and rejection of a zero or negative rate or bandwidth with an error naming it. Then
// the MoE block's per-stage cost: its stages sum to its totals, its GEMM FLOPs are the gate's and
// the FFN's, and its aux-loss stage exists only with aux_loss_coeff > 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "harness/ops/record.h"
#include "harness/ops/registry.h"
#include "harness/ops/roofline.h"

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

namespace {

// The message of the std::invalid_argument f throws ("" if none).
template <class F>
std::string invalid_argument_of(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(Roofline, BandwidthBound) {
  // 1 GFLOP at 500 TFLOP/s is 2 us; 3 GB at 3000 GB/s is 1000 us.
  const Roofline r = roofline(1e9, 3e9, 500, 3000);
  EXPECT_DOUBLE_EQ(r.us, 1000.0);
  EXPECT_FALSE(r.flop_bound);
  EXPECT_STREQ(r.bound(), "bytes");
  EXPECT_DOUBLE_EQ(roofline_us(1e9, 3e9, 500, 3000), 1000.0);
}

TEST(Roofline, FlopBound) {
  // 1 PFLOP at 800 TFLOP/s is 1.25 s; 1 GB at 2000 GB/s is 500 us.
  const Roofline r = roofline(1e15, 1e9, 800, 2000);
  EXPECT_DOUBLE_EQ(r.us, 1.25e6);
  EXPECT_TRUE(r.flop_bound);
  EXPECT_STREQ(r.bound(), "flops");
}

TEST(Roofline, NoWorkIsZero) {
  EXPECT_EQ(roofline_us(0, 0, 1, 1), 0.0);
}

TEST(Roofline, FwdBwdRowSumsForwardAndBackward) {
  const StageCost s{"ffn", /*fwd_bytes=*/2e9, /*bwd_bytes=*/4e9, /*fwd_flops=*/1e12,
                    /*bwd_flops=*/2e12};
  EXPECT_DOUBLE_EQ(row_flops(s, false), 1e12);
  EXPECT_DOUBLE_EQ(row_bytes(s, false), 2e9);
  EXPECT_DOUBLE_EQ(row_flops(s, true), 3e12);
  EXPECT_DOUBLE_EQ(row_bytes(s, true), 6e9);
  // fwd+bwd at the fwd + dgrad + wgrad rate: 3 TFLOP at 600 TFLOP/s = 5000 us, above 6 GB at
  // 3000 GB/s = 2000 us; the fwd alone at 500 TFLOP/s: 2000 us, above 2 GB = 666.7 us.
  const auto fb = stage_rooflines({s}, true, 600, 3000);
  ASSERT_EQ(fb.size(), 1u);
  EXPECT_DOUBLE_EQ(fb[0].roof.us, 5000.0);
  EXPECT_TRUE(fb[0].roof.flop_bound);
  const auto f = stage_rooflines({s}, false, 500, 3000);
  EXPECT_DOUBLE_EQ(f[0].roof.us, 2000.0);
}

TEST(Roofline, StageSumExceedsTheMaxOfTotals) {
  // At 1000 TFLOP/s and 1000 GB/s: a flop-bound stage (3 TFLOP: 3000 us; 1 GB: 1000 us) and a
  // bandwidth-bound one (1 TFLOP: 1000 us; 3 GB: 3000 us) run one after another: 6000 us. The
  // totals (4 TFLOP, 4 GB) give only max(4000 us, 4000 us): one stage cannot hide behind
  // another's bound.
  const std::vector<StageCost> stages = {{"gemm", 1e9, 0, 3e12, 0}, {"copy", 3e9, 0, 1e12, 0}};
  const auto v = stage_rooflines(stages, false, 1000, 1000);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].name, "gemm");
  EXPECT_TRUE(v[0].roof.flop_bound);
  EXPECT_DOUBLE_EQ(v[0].roof.us, 3000.0);
  EXPECT_EQ(v[1].name, "copy");
  EXPECT_FALSE(v[1].roof.flop_bound);
  EXPECT_DOUBLE_EQ(v[1].roof.us, 3000.0);
  EXPECT_DOUBLE_EQ(stage_sum_us(v), 6000.0);
  const double single = roofline_us(4e12, 4e9, 1000, 1000);
  EXPECT_DOUBLE_EQ(single, 4000.0);
  EXPECT_GT(stage_sum_us(v), single);
  // One stage: the sum is that stage's roofline.
  EXPECT_DOUBLE_EQ(stage_sum_us(stage_rooflines({stages[0]}, false, 1000, 1000)), 3000.0);
  EXPECT_EQ(stage_sum_us({}), 0.0);
}

TEST(Roofline, PercentOfRoofline) {
  EXPECT_DOUBLE_EQ(pct_of_roofline(50, 200), 25.0);
  EXPECT_DOUBLE_EQ(pct_of_roofline(200, 200), 100.0);
  EXPECT_THAT(invalid_argument_of([] { pct_of_roofline(1, 0); }), HasSubstr("median_us"));
}

TEST(Roofline, RejectsZeroOrNegativeRateOrBandwidth) {
  for (double bad : {0.0, -1.0}) {
    EXPECT_THAT(invalid_argument_of([bad] { roofline(1, 1, bad, 1000); }), HasSubstr("tflops"));
    EXPECT_THAT(invalid_argument_of([bad] { roofline(1, 1, 500, bad); }), HasSubstr("gbps"));
    EXPECT_THAT(invalid_argument_of([bad] {
                  stage_rooflines({{"s", 1, 1, 1, 1}}, true, bad, 1);
                }),
                HasSubstr("tflops"));
    EXPECT_THAT(invalid_argument_of([bad] {
                  stage_rooflines({{"s", 1, 1, 1, 1}}, true, 1, bad);
                }),
                HasSubstr("gbps"));
  }
  EXPECT_THAT(invalid_argument_of([] { roofline(-1, 1, 1, 1); }), HasSubstr("flops"));
  EXPECT_THAT(invalid_argument_of([] { roofline(1, -1, 1, 1); }), HasSubstr("bytes"));
}

// --- the MoE block's stages ----------------------------------------------------------------------

Case block_case(int64_t B, int64_t S, int64_t H, int64_t M, int64_t E, int64_t K, double aux) {
  Case c = CaseBuilder("moe_block", DType::bf16).seed(7);
  c.set("name", "roofline").set("B", B).set("S", S).set("H", H).set("M", M);
  c.set("num_experts", E).set("topk", K).set("num_groups", int64_t{0});
  c.set("group_topk", int64_t{0}).set("score_function", "softmax");
  c.set("use_pre_softmax", false).set("expert_bias", false).set("scaling_factor", 1.0);
  c.set("activation", "silu").set("aux_loss_coeff", aux).set("backend", "kernel");
  c.set("align_size", int64_t{0}).set("ep_size", int64_t{1}).set("dp_size", int64_t{1});
  c.set("probs_dtype", "float32").set("router_logits_dtype", "float32");
  c.set("wi_0_bias", false).set("wi_1_bias", false).set("wo_bias", false);
  return c;
}

std::vector<std::string> stage_names(const Cost& k) {
  std::vector<std::string> v;
  for (const StageCost& s : k.stages) v.push_back(s.name);
  return v;
}

TEST(RooflineMoeBlock, StagesSumToTheTotals) {
  const OpInfo& op = *find_op("moe_block");
  std::vector<Case> cases = op.named();
  cases.push_back(block_case(4, 4096, 4096, 14336, 8, 2, 0.0));    // Mixtral-like
  cases.push_back(block_case(2, 4096, 7168, 2048, 256, 8, 0.01));  // DeepSeek-like, aux loss
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line());
    const Cost k = op.cost(c);
    ASSERT_FALSE(k.stages.empty());
    double fb = 0, bb = 0, ff = 0, bf = 0;
    for (const StageCost& s : k.stages) {
      EXPECT_GE(s.fwd_bytes, 0);
      EXPECT_GE(s.bwd_bytes, 0);
      fb += s.fwd_bytes, bb += s.bwd_bytes, ff += s.fwd_flops, bf += s.bwd_flops;
    }
    EXPECT_DOUBLE_EQ(k.fwd_bytes, fb);
    EXPECT_DOUBLE_EQ(k.bwd_bytes, bb);
    EXPECT_DOUBLE_EQ(k.fwd_flops, ff);
    EXPECT_DOUBLE_EQ(k.bwd_flops, bf);
    // The GEMM FLOPs: the gate T x H x E and the FFN's three T*K x H x M products (x 2 backward).
    const double T = static_cast<double>(c.i("B") * c.i("S")), H = static_cast<double>(c.i("H"));
    const double M = static_cast<double>(c.i("M")), E = static_cast<double>(c.i("num_experts"));
    const double K = static_cast<double>(c.i("topk"));
    EXPECT_DOUBLE_EQ(k.fwd_flops, 2 * T * H * E + 6 * T * K * H * M);
    EXPECT_DOUBLE_EQ(k.bwd_flops, 2 * k.fwd_flops);
    // Every expert's weights are read by the forward: 3*E*H*M elements.
    for (const StageCost& s : k.stages) {
      if (s.name == "expert_ffn") EXPECT_GE(s.fwd_bytes, 3 * E * H * M * 2);
    }
  }
}

TEST(RooflineMoeBlock, StageNamesAndAuxLoss) {
  const OpInfo& op = *find_op("moe_block");
  const std::vector<std::string> base = {"gate", "router", "dispatch", "expert_ffn", "combine"};
  EXPECT_EQ(stage_names(op.cost(block_case(1, 64, 32, 48, 8, 2, 0.0))), base);
  std::vector<std::string> with_aux = base;
  with_aux.push_back("aux_loss");
  EXPECT_EQ(stage_names(op.cost(block_case(1, 64, 32, 48, 8, 2, 0.01))), with_aux);
}

TEST(RooflineMoeBlock, MixtralLikeFfnIsFlopBoundAndItsRooflineIsTheStageSum) {
  // At 700 TFLOP/s and 3000 GB/s (illustrative rates, not a measurement) the FFN stage is bound by
  // its FLOPs and the permutation stages by their bytes; the block's roofline is their sum, above
  // the single max over its totals.
  const Cost k = find_op("moe_block")->cost(block_case(4, 4096, 4096, 14336, 8, 2, 0.0));
  const auto v = stage_rooflines(k.stages, false, 700, 3000);
  for (const StageRoofline& s : v) {
    SCOPED_TRACE(s.name);
    EXPECT_EQ(s.roof.flop_bound, s.name == "expert_ffn");
  }
  EXPECT_GT(stage_sum_us(v), roofline_us(k.fwd_flops, k.fwd_bytes, 700, 3000));
}

}  // namespace
