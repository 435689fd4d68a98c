// moe_block reference tests (SPEC §11): EP invariance over P in {1,2,4,8} x D in {1,2} with and
// without align padding and aux loss, kernel vs argsort (§8.4), the exact composition against the
// dense oracle, regression cases R3, R4, R5, R7, R14 at block level, §11.5-6/7, and one test per
// error of §11.1. Random and named cases (finite differences with selection margins masked,
// invariants, schema) run in test_registry.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>

#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "reference/ep.h"
#include "reference/moe_block.h"
#include "reference/sort_chunks.h"

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

namespace {

const OpInfo& block_op() {
  return *find_op("moe_block");
}

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

ref::MoeBlockInputs view(const TensorMap& in) {
  return {in.at("input.x"),
          in.at("input.gate_kernel"),
          in.at("input.wi_0"),
          in.at("input.wi_1"),
          in.at("input.wo"),
          find_tensor(in, "input.wi_0_bias"),
          find_tensor(in, "input.wi_1_bias"),
          find_tensor(in, "input.wo_bias"),
          find_tensor(in, "input.expert_bias")};
}

Case named_case(const std::string& name) {
  for (const Case& c : block_op().named())
    if (c.s("name") == name) return c;
  throw std::invalid_argument("no named moe_block case " + name);
}

// got vs want (the reference of `base`): float tensors within the record's composite bound,
// everything else bitwise (routing maps, counts; probs too when bitwise_probs).
Report agree(const Case& base, const TensorMap& in, const TensorMap& want, const TensorMap& got,
             bool bitwise_probs = true) {
  Report r;
  for (auto& [key, w] : want) {
    auto it = got.find(key);
    if (it == got.end()) {
      r.failures.push_back(key + ": missing");
      continue;
    }
    if (is_floating(w.dtype()) && !(bitwise_probs && key == "output.probs")) {
      const Tensor b = block_op().bound(base, key, in, want);
      r.tensors.push_back(compare(key, it->second.to(DType::f64), w.to(DType::f64), &b));
    } else {
      r.tensors.push_back(compare(key, it->second, w, nullptr));
    }
  }
  if (got.size() != want.size()) r.failures.push_back("the two runs produce different tensors");
  return r;
}

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "reference");
}

TensorMap run(const Case& c, const TensorMap& in) {
  return block_op().reference(c, in, false);
}

// A small block case over E = 8 experts and B = 16, so every (P, D) with P in {1,2,4,8} and
// D in {1,2} divides it.
rc::Gen<Case> invariance_case() {
  return rc::gen::exec([] {
    Case c = *block_op().gen();
    c.set("num_experts", int64_t{8}).set("B", int64_t{16}).set("S", *any_in(1, 3));
    c.set("topk", *any_in(1, 4)).set("num_groups", int64_t{0});
    c.set("group_topk", int64_t{0}).set("ep_size", int64_t{1}).set("dp_size", int64_t{1});
    c.set("align_size", *rc::gen::element<int64_t>(0, 3));
    c.set("aux_loss_coeff", *rc::gen::element(0.0, 0.01));
    if (c.regime == Regime::zero_tokens) c.regime = Regime::skewed;  // B is fixed at 16 here
    return c;
  });
}

}  // namespace

// --- §11.5-1: EP x DP invariance ----------------------------------------------------------------

RC_GTEST_PROP(MoeBlock, EpAndDpShardingGiveTheSingleRankResult, ()) {
  const Case base = *invariance_case();
  RC_TAG(base.s("backend"), base.i("align_size") > 0 ? "aligned" : "unaligned",
         base.f("aux_loss_coeff") > 0 ? "aux" : "no aux");
  const TensorMap in = block_op().make_inputs(base);
  const TensorMap want = run(base, in);
  for (int64_t P : {1, 2, 4, 8}) {
    for (int64_t D : {1, 2}) {
      if (P * D == 1) continue;
      Case c = base;
      c.set("ep_size", P).set("dp_size", D);
      const Report r = agree(base, in, want, run(c, in));
      if (!r.ok())
        RC_FAIL("ep_size=" + std::to_string(P) + " dp_size=" + std::to_string(D) + " vs 1 x 1\n" +
                failure(c, r));
    }
  }
}

// --- §11.5-2 / §8.4: kernel vs argsort ----------------------------------------------------------

RC_GTEST_PROP(MoeBlock, KernelAndArgsortBackendsAgree, ()) {
  Case c = *block_op().gen();
  c.set("backend", "kernel");
  Case a = c;
  a.set("backend", "argsort");
  const TensorMap in = block_op().make_inputs(c);
  const MoeBlockParams pk = moe_block_params(c), pa = moe_block_params(a);
  const ref::MoeBlockFwd fk = ref::moe_block_fwd(view(in), pk);
  const ref::MoeBlockFwd fa = ref::moe_block_fwd(view(in), pa);
  RC_ASSERT(fk.routing_map.bitwise_equal(fa.routing_map));
  for (size_t i = 0; i < fk.shards.size(); ++i) {
    const ref::MoeShardState &k = fk.shards[i], &g = fa.shards[i];
    // MUST 1: identical (aligned) group sizes; MUST 2/3: the FFN input rows bitwise on
    // [0, sum local sizes), zero beyond in both.
    RC_ASSERT(k.group_sizes.bitwise_equal(g.group_sizes));
    RC_ASSERT(k.local_group_sizes.bitwise_equal(g.local_group_sizes));
    int64_t used = 0;
    for (int64_t l = 0; l < k.local_group_sizes.numel(); ++l)
      used += static_cast<int64_t>(k.local_group_sizes.at(l));
    const int64_t H = k.sorted_x.dim(1);
    for (int64_t r = 0; r < std::max(k.sorted_x.dim(0), g.sorted_x.dim(0)); ++r) {
      for (int64_t h = 0; h < H; ++h) {
        const double vk = r < k.sorted_x.dim(0) ? k.sorted_x.at(r, h) : 0.0;
        const double va = r < g.sorted_x.dim(0) ? g.sorted_x.at(r, h) : 0.0;
        if (r < used) {
          if (vk != va)
            RC_FAIL("FFN input row " + std::to_string(r) + " differs\n" +
                    replay_line(c, "reference"));
        } else if (vk != 0.0 || va != 0.0) {
          RC_FAIL("row " + std::to_string(r) + " beyond the grouped rows is not zero\n" +
                  replay_line(c, "reference"));
        }
      }
    }
  }
  const Report r = agree(c, in, run(c, in), run(a, in));
  if (!r.ok()) RC_FAIL(failure(a, r));
}

// --- the exact composition against the dense oracle ---------------------------------------------

// With no rounding anywhere (finite-difference mode), the composed block and the dense form
// y = sum_e p_te FFN_e(x_t) are the same function: they agree to double precision, gradients
// included, for every backend, EP/DP split, alignment and option.
RC_GTEST_PROP(MoeBlock, ExactCompositionEqualsTheDenseOracle, ()) {
  const Case c = *block_op().gen();
  const TensorMap in = to_f64(block_op().make_inputs(c));
  const TensorMap got = block_op().reference(c, in, true);
  const ref::MoeBlockDense dn =
      ref::moe_block_dense(view(in), moe_block_params(c), in.at("cotangent.y"),
                           find_tensor(in, "cotangent.aux_loss"), true);
  auto close = [&](const std::string& key, const Tensor& want) {
    const Tensor& g = got.at(key);
    double scale = 1.0;
    for (int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::fabs(want.at(i)));
    for (int64_t i = 0; i < want.numel(); ++i) {
      if (std::fabs(g.at(i) - want.at(i)) > 1e-11 * scale) {
        RC_FAIL(key + " element " + std::to_string(i) + ": composed " + format_double(g.at(i)) +
                ", dense " + format_double(want.at(i)) + "\n" + replay_line(c, "reference"));
      }
    }
  };
  close("output.y", dn.y);
  if (dn.aux_loss) close("output.aux_loss", *dn.aux_loss);
  close("grad.x", dn.grads.x);
  close("grad.gate_kernel", dn.grads.gate_kernel);
  close("grad.wi_0", dn.grads.wi_0);
  close("grad.wi_1", dn.grads.wi_1);
  close("grad.wo", dn.grads.wo);
  if (dn.grads.wi_0_bias) close("grad.wi_0_bias", *dn.grads.wi_0_bias);
  if (dn.grads.wi_1_bias) close("grad.wi_1_bias", *dn.grads.wi_1_bias);
  if (dn.grads.wo_bias) close("grad.wo_bias", *dn.grads.wo_bias);
  RC_ASSERT(got.at("output.routing_map").bitwise_equal(dn.routing_map));
}

// --- §11.5-6, §11.5-7 ---------------------------------------------------------------------------

TEST(MoeBlock, NoGradientForExpertBias) {
  Case c = named_case("deepseek_like");
  const TensorMap in = block_op().make_inputs(c);
  ASSERT_TRUE(in.count("input.expert_bias"));
  const TensorMap out = run(c, in);
  EXPECT_FALSE(out.count("grad.expert_bias")) << replay_line(c, "reference");
  // An all-zero bias is bitwise the same as none: (s + 0) - 0 = s, so only selection could change.
  TensorMap zero = clone(in);
  zero.at("input.expert_bias").fill(0.0);
  TensorMap none = clone(in);
  none.erase("input.expert_bias");
  const TensorMap a = run(c, zero), b = run(c, none);
  for (auto& [k, v] : a)
    EXPECT_TRUE(v.bitwise_equal(b.at(k))) << k << " " << replay_line(c, "reference");
}

TEST(MoeBlock, AuxLossAloneHasAGateGradient) {
  Case c = named_case("mixtral_like");
  ASSERT_GT(c.f("aux_loss_coeff"), 0.0);
  TensorMap in = block_op().make_inputs(c);
  in.at("cotangent.y").fill(0.0);
  in.at("cotangent.aux_loss").fill(1.0);
  const TensorMap out = run(c, in);
  double gate = 0, ffn = 0;
  for (double v : out.at("grad.gate_kernel").values()) gate += std::fabs(v);
  for (double v : out.at("grad.wi_0").values()) ffn += std::fabs(v);
  EXPECT_GT(gate, 0.0) << replay_line(c, "reference");
  EXPECT_EQ(ffn, 0.0) << replay_line(c, "reference");
}

// --- regression cases ---------------------------------------------------------------------------

// R3: with a = 16 under EP, rank 0 receives 2*64 = 128 aligned rows; the receive buffer has
// R = 64 + 8*15 = 184 rows, nothing overflows, and y and every gradient equal the P = 1 run.
TEST(Regression, R3_UndersizedReceiveBufferWithAlignment) {
  for (const char* be : {"R3_kernel", "R3_argsort"}) {
    const Case c = named_case(be);
    const TensorMap in = block_op().make_inputs(c);
    const ref::MoeBlockFwd f = ref::moe_block_fwd(view(in), moe_block_params(c));
    ASSERT_EQ(f.shards.size(), 2u);
    for (const ref::MoeShardState& st : f.shards) {
      EXPECT_EQ(st.sorted_x.dim(0), 184) << replay_line(c, "reference");
      int64_t recv = 0;
      for (int64_t l = 0; l < 4; ++l) recv += static_cast<int64_t>(st.local_group_sizes.at(l));
      EXPECT_EQ(recv, st.ep_rank == 0 ? 128 : 0) << replay_line(c, "reference");
    }
    Case one = c;
    one.set("ep_size", int64_t{1});
    const Report r = agree(c, in, run(c, in), run(one, in));
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

// R4 at block level: FFN biases with a = 16 give finite bias gradients equal to the a = 0 run
// (padding rows have non-zero FFN outputs, which combine never reads).
TEST(Regression, R4_BiasGradientsWithPaddingEqualUnpadded) {
  const Case c = named_case("R4_bias_a16");
  const TensorMap in = block_op().make_inputs(c);
  Case a0 = c;
  a0.set("align_size", int64_t{0});
  const TensorMap out = run(c, in);
  for (const char* k : {"grad.wi_0_bias", "grad.wi_1_bias", "grad.wo_bias"}) {
    for (double v : out.at(k).values()) ASSERT_TRUE(std::isfinite(v)) << k;
  }
  const Report r = agree(c, in, out, run(a0, in));
  EXPECT_TRUE(r.ok()) << failure(c, r);
}

// R5: the combine backward under EP uses the tensor combine consumed ([R_pre, H]), and every
// gradient equals the P = 1 run, for both backends.
TEST(Regression, R5_CombineBackwardUsesTheConsumedTensorUnderEp) {
  for (const char* name : {"R5_R7_a0", "R5_R7_a16"}) {
    for (const char* be : {"kernel", "argsort"}) {
      Case c = named_case(name);
      c.set("backend", be);
      const TensorMap in = block_op().make_inputs(c);
      const MoeBlockParams p = moe_block_params(c);
      const ref::MoeBlockFwd f = ref::moe_block_fwd(view(in), p);
      const EpShape es{c.i("B"),  c.i("S"),      p.topk,      p.ep_size,
                       p.dp_size, p.num_experts, p.align_size};
      for (const ref::MoeShardState& st : f.shards) {
        EXPECT_EQ(st.eo_post.shape(), (Shape{pre_a2a_rows(es), c.i("H")}))
            << replay_line(c, "reference");
        EXPECT_NE(st.eo_post.dim(0), recv_rows(es));
      }
      Case one = c;
      one.set("ep_size", int64_t{1});
      const Report r = agree(c, in, run(c, in), run(one, in));
      EXPECT_TRUE(r.ok()) << failure(c, r);
    }
  }
}

// R7: pad_offsets is absent (std::optional) with a = 0 and an [E] i32 tensor with a = 16; both
// run under EP and equal P = 1; no pad_offsets tensor reaches the block's outputs.
TEST(Regression, R7_PadOffsetsAbsentVersusPresentAcrossEp) {
  for (const char* name : {"R5_R7_a0", "R5_R7_a16"}) {
    const Case c = named_case(name);
    const TensorMap in = block_op().make_inputs(c);
    const ref::MoeBlockFwd f = ref::moe_block_fwd(view(in), moe_block_params(c));
    for (const ref::MoeShardState& st : f.shards) {
      if (c.i("align_size") == 0) {
        EXPECT_FALSE(st.pad_offsets.has_value()) << replay_line(c, "reference");
      } else {
        ASSERT_TRUE(st.pad_offsets.has_value()) << replay_line(c, "reference");
        EXPECT_EQ(st.pad_offsets->dtype(), DType::i32);
        EXPECT_EQ(st.pad_offsets->shape(), (Shape{c.i("num_experts")}));
      }
    }
    const TensorMap out = run(c, in);
    for (auto& [k, v] : out) EXPECT_EQ(k.find("pad_offsets"), std::string::npos) << k;
    Case one = c;
    one.set("ep_size", int64_t{1});
    const Report r = agree(c, in, out, run(one, in));
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

// R14: each EP shard keeps one chunk-sort map; TE's second map, built from
// (split[sorted_chunk_indices], argsort(sorted_chunk_indices)), is its inverse on all R rows.
TEST(Regression, R14_BlockKeepsOneLocalPermuteMap) {
  const Case c = named_case("R5_R7_a16");
  const TensorMap in = block_op().make_inputs(c);
  const ref::MoeBlockFwd f = ref::moe_block_fwd(view(in), moe_block_params(c));
  for (const ref::MoeShardState& st : f.shards) {
    ASSERT_TRUE(st.local_row_id_map && st.all_shards_tokens_per_expert);
    const int64_t P = c.i("ep_size"), R = st.local_row_id_map->numel();
    const ref::LocalChunks ch = ref::local_chunks(*st.all_shards_tokens_per_expert, st.ep_rank, P);
    const int64_t C = ch.split_sizes.numel();
    Tensor split2(DType::i32, {C}), inv(DType::i32, {C});
    for (int64_t j = 0; j < C; ++j) {
      const auto idx = static_cast<int64_t>(ch.sorted_chunk_indices.at(j));
      split2.set(j, ch.split_sizes.at(idx));
      inv.set(idx, static_cast<double>(j));
    }
    const Tensor map2 = ref::make_chunk_sort_map(split2, inv, R);
    for (int64_t i = 0; i < R; ++i) {
      ASSERT_EQ(map2.at(static_cast<int64_t>(st.local_row_id_map->at(i))), i)
          << replay_line(c, "reference");
    }
  }
}

// --- §11.1 errors -------------------------------------------------------------------------------

namespace {

struct BlockFixture {
  Tensor x, gk, wi_0, wi_1, wo, b;
  MoeBlockParams p;
  BlockFixture()
      : x(DType::f32, {4, 2, 6}),
        gk(DType::f32, {6, 4}),
        wi_0(DType::f32, {4, 6, 3}),
        wi_1(DType::f32, {4, 6, 3}),
        wo(DType::f32, {4, 3, 6}),
        b(DType::f32, {4}) {
    p.num_experts = 4;
    p.topk = 2;
    p.ep_size = 2;
    p.dp_size = 2;
  }
  std::string error(const MoeBlockParams& q, const Tensor* bias = nullptr) const {
    return error_of([&] {
      ref::moe_block_fwd({x, gk, wi_0, wi_1, wo, nullptr, nullptr, nullptr, bias}, q);
    });
  }
};

}  // namespace

TEST(MoeBlockErrors, ValidFixtureRuns) {
  BlockFixture f;
  EXPECT_EQ(f.error(f.p), "");
}

TEST(MoeBlockErrors, ExpertsNotDivisibleByEpSize) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.ep_size = 4;
  q.dp_size = 1;
  EXPECT_EQ(f.error(q), "");  // 4 % 4 == 0
  q.ep_size = 3;
  EXPECT_THAT(f.error(q), HasSubstr("ep_size: num_experts=4 is not divisible by ep_size=3"));
}

TEST(MoeBlockErrors, BatchNotDivisibleByEpTimesDp) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.dp_size = 4;
  EXPECT_THAT(f.error(q), HasSubstr("batch: B=4 is not divisible by ep_size*dp_size=8"));
}

TEST(MoeBlockErrors, NonPositiveEpOrDpSize) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.dp_size = 0;
  EXPECT_THAT(f.error(q), HasSubstr("dp_size"));
  q = f.p;
  q.ep_size = 0;
  EXPECT_THAT(f.error(q), HasSubstr("ep_size"));
}

TEST(MoeBlockErrors, UnknownBackend) {
  EXPECT_THAT(error_of([] { parse_moe_backend("triton"); }),
              HasSubstr("backend: unknown value 'triton'"));
}

TEST(MoeBlockErrors, UnknownRouterLogitsDtype) {
  EXPECT_THAT(error_of([] { parse_router_logits_dtype("bfloat16"); }),
              HasSubstr("router_logits_dtype"));
}

TEST(MoeBlockErrors, ExpertBiasWithSoftmax) {
  BlockFixture f;
  EXPECT_THAT(f.error(f.p, &f.b), HasSubstr("expert_bias"));
  MoeBlockParams q = f.p;
  q.score_function = ScoreFunction::sigmoid;
  EXPECT_EQ(f.error(q, &f.b), "");
}

TEST(MoeBlockErrors, NegativeOrNonFiniteAuxCoeff) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.aux_loss_coeff = -0.5;
  EXPECT_THAT(f.error(q), HasSubstr("aux_loss_coeff"));
  q.aux_loss_coeff = INFINITY;
  EXPECT_THAT(f.error(q), HasSubstr("aux_loss_coeff"));
}

TEST(MoeBlockErrors, NegativeAlignSize) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.align_size = -4;
  EXPECT_THAT(f.error(q), HasSubstr("align_size"));
}

TEST(MoeBlockErrors, TopkOutOfRange) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.topk = 5;
  EXPECT_THAT(f.error(q), HasSubstr("topk"));
}

TEST(MoeBlockErrors, GroupingConstraints) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.num_groups = 3;
  q.group_topk = 1;
  EXPECT_THAT(f.error(q), HasSubstr("num_groups"));
}

TEST(MoeBlockErrors, ProbsDtype) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.probs_dtype = DType::i32;
  EXPECT_THAT(f.error(q), HasSubstr("probs_dtype"));
}

TEST(MoeBlockErrors, InconsistentShapes) {
  BlockFixture f;
  MoeBlockParams q = f.p;
  q.num_experts = 8;  // gate_kernel has 4 columns: a duplicated axis shows up as inconsistent sizes
  EXPECT_THAT(f.error(q), HasSubstr("gate_kernel"));
  const Tensor wo_bad(DType::f32, {4, 6, 3});
  EXPECT_THAT(error_of([&] {
                ref::moe_block_fwd({f.x, f.gk, f.wi_0, f.wi_1, wo_bad}, f.p);
              }),
              HasSubstr("wo"));
  const Tensor x2(DType::f32, {8, 6});
  EXPECT_THAT(error_of([&] {
                ref::moe_block_fwd({x2, f.gk, f.wi_0, f.wi_1, f.wo}, f.p);
              }),
              HasSubstr("x"));
}

TEST(MoeBlockErrors, ZeroTokensWithAuxLoss) {
  // B = 0 is valid; with the aux loss on, moe_aux_loss gets T_tot = 0, its error.
  BlockFixture f;
  f.x = Tensor(DType::f32, {0, 2, 6});
  EXPECT_EQ(f.error(f.p), "");
  MoeBlockParams q = f.p;
  q.aux_loss_coeff = 0.01;
  EXPECT_THAT(f.error(q), HasSubstr("total_num_tokens"));
}

// `check --ep P` and the multi-GPU tests rewrite cases to the launcher's EP size.
TEST(MoeBlockCaseForEp, RewritesDivisibleCasesAndSkipsTheRest) {
  const ops::OpInfo& op = *ops::find_op("moe_block");
  int rewritten = 0;
  for (const Case& c : op.named()) {
    for (int64_t P : {2, 4, 8}) {
      const std::optional<Case> e = ops::moe_block_case_for_ep(c, P);
      if (c.has("forcing") && c.i("ep_size") != P) {
        EXPECT_FALSE(e) << c.line();
        continue;
      }
      if (c.i("num_experts") % P != 0) {
        EXPECT_FALSE(e) << c.line();
        continue;
      }
      ASSERT_TRUE(e) << c.line();
      EXPECT_EQ(e->i("ep_size"), P);
      EXPECT_EQ(e->i("dp_size"), 1);
      EXPECT_EQ(e->i("B") % P, 0);
      EXPECT_GE(e->i("B"), c.i("B"));
      // The rewritten case is valid: the reference runs it.
      if (P == 8 && rewritten < 3) {
        EXPECT_NO_THROW(op.reference(*e, op.make_inputs(*e), false)) << e->line();
        ++rewritten;
      }
    }
  }
  EXPECT_GT(rewritten, 0);
}
