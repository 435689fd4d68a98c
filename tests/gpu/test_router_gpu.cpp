// GPU tests of the router family (SPEC §1-3) beyond the registry sweep of test_registry_gpu.cpp
// (which runs check_gpu over every op's gen() and named() cases):
//  - wide shapes the registry generator does not reach: E from 71 to 4096 (every row layout of
//    the kernels: 16 and 32 lanes, 8/16/32/128 slots), grouped top-k on both group paths;
//  - the regression cases R2, R10, R13, R15 with their known answers on the GPU;
//  - every bf16 logit through the forward's sigmoid table (router and aux scores), bitwise;
//  - T*E beyond 2^31 (int64 offsets) and a large deterministic moe_aux_loss;
//  - the CUDA wrappers' error messages.
// Every GPU run goes through the registry's runner, which poisons each output with 0xFF (NaN)
// before the launch; check_gpu runs the GPU twice and demands bitwise-equal results.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/aux_loss.cuh"
#include "gpu/topk_router.cuh"
#include "harness/core/rng.h"
#include "harness/core/score_fn.h"
#include "harness/ops/check.h"
#include "harness/ops/registry.h"
#include "harness/ops/router_family.h"
#include "reference/aux_loss.h"
#include "reference/topk_router.h"

using namespace moe;
using namespace moe::ops;

namespace {

#define SKIP_WITHOUT_GPU()                                                      \
  do {                                                                          \
    if (!gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description(); \
  } while (0)

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "gpu");
}

const OpInfo& op(const char* name) {
  const OpInfo* o = find_op(name);
  if (!o) throw std::logic_error(std::string("op not registered: ") + name);
  return *o;
}

// ---- wide shapes ----------------------------------------------------------------------------

std::vector<int64_t> divisors_upto(int64_t n, int64_t cap) {
  std::vector<int64_t> d;
  for (int64_t g = 1; g <= std::min(n, cap); ++g)
    if (n % g == 0) d.push_back(g);
  return d;
}

// topk_router cases with the registry's keys over E in [71, 4096]. Grouping on about a third.
rc::Gen<Case> wide_router_case() {
  return rc::gen::exec([] {
    Case c;
    c.op = "topk_router";
    c.dtype = *rc::gen::element(DType::f32, DType::bf16, DType::f16);
    c.regime = *rc::gen::element(Regime::uniform, Regime::skewed, Regime::exact_ties,
                                 Regime::near_ties, Regime::large_magnitude, Regime::all_to_one);
    c.seed = *rc::gen::arbitrary<uint32_t>();
    const int64_t E =
        *rc::gen::oneOf(rc::gen::element<int64_t>(71, 129, 200, 256, 257, 384, 512, 513, 768, 1000,
                                                  1024, 1025, 2048, 4096),
                        rc::gen::inRange<int64_t>(71, 1100));
    int64_t K, G = 0, gk = 0;
    if (*rc::gen::element(false, false, true)) {
      const auto ds = divisors_upto(E, 64);
      G = *rc::gen::elementOf(ds);
      const int64_t per = E / G;
      gk = *rc::gen::inRange<int64_t>(1, G + 1);
      K = gk * *rc::gen::inRange<int64_t>(1, std::min<int64_t>(per, 4) + 1);
    } else {
      K = *rc::gen::oneOf(rc::gen::element<int64_t>(1, 2, 8, E),
                          rc::gen::inRange<int64_t>(1, std::min<int64_t>(E, 64) + 1));
    }
    const auto f = *rc::gen::element<std::string>("softmax", "sigmoid", "sqrtsoftplus");
    c.set("T", *rc::gen::inRange<int64_t>(1, 6)).set("E", E).set("topk", K);
    c.set("num_groups", G).set("group_topk", gk).set("score_function", f);
    c.set("use_pre_softmax", f == "softmax" && *rc::gen::arbitrary<bool>());
    c.set("expert_bias", f != "softmax" && *rc::gen::arbitrary<bool>());
    c.set("scaling_factor", *rc::gen::element(1.0, 2.5));
    c.set("routing_map_format", *rc::gen::element<std::string>("bytemap", "bitmap_u8"));
    c.set("grad_dtype", std::string(dtype_name(*rc::gen::element(c.dtype, DType::f32))));
    return c;
  });
}

TEST(GpuRouterWide, TopkRouterAllRowLayouts) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("topk_router");
  const bool ok = rc::check("topk_router wide E: CUDA vs reference", [&o] {
    const Case c = *wide_router_case();
    RC_TAG(std::string(regime_name(c.regime)), c.i("group_topk") > 0 ? "grouped" : "ungrouped");
    const Report r = check_gpu(o, c);
    if (!r.ok()) RC_FAIL(failure(c, r));
  });
  EXPECT_TRUE(ok);
}

TEST(GpuRouterWide, AuxLossScoresAllRowLayouts) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("aux_loss_scores");
  const bool ok = rc::check("aux_loss_scores wide E: CUDA vs reference", [&o] {
    Case c = *wide_router_case();
    c.op = "aux_loss_scores";
    for (const char* k : {"num_groups", "group_topk", "use_pre_softmax", "expert_bias",
                          "scaling_factor", "grad_dtype"}) {
      c.p.erase(k);
    }
    RC_TAG(std::string(regime_name(c.regime)));
    const Report r = check_gpu(o, c);
    if (!r.ok()) RC_FAIL(failure(c, r));
  });
  EXPECT_TRUE(ok);
}

// Both group paths of the kernel on fixed shapes: groups of whole lanes (E=256, G=8: 4 lanes a
// group; E=64, G=8: one lane), groups inside a lane (E=64, G=16) and groups straddling lanes
// (E=96, G=4 with 24 experts a group; E=1000, G=8 with 125).
TEST(GpuRouterWide, GroupPathsAgree) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("topk_router");
  struct Shape_ {
    int64_t E, G, gk, K;
  };
  for (const Shape_ s :
       {Shape_{256, 8, 4, 8}, Shape_{64, 8, 2, 4}, Shape_{64, 16, 3, 6}, Shape_{96, 4, 2, 4},
        Shape_{1000, 8, 8, 16}, Shape_{512, 64, 8, 8}, Shape_{4096, 32, 4, 8}}) {
    for (Regime rg : {Regime::uniform, Regime::exact_ties}) {
      for (DType d : {DType::bf16, DType::f32}) {
        Case c;
        c.op = "topk_router";
        c.dtype = d;
        c.regime = rg;
        c.seed = 3;
        c.set("T", int64_t{33}).set("E", s.E).set("topk", s.K).set("num_groups", s.G);
        c.set("group_topk", s.gk).set("score_function", "sigmoid").set("use_pre_softmax", false);
        c.set("expert_bias", true)
            .set("scaling_factor", 2.5)
            .set("routing_map_format", "bitmap_u8");
        c.set("grad_dtype", std::string(dtype_name(d)));
        const Report r = check_gpu(o, c);
        EXPECT_TRUE(r.ok()) << failure(c, r);
      }
    }
  }
}

// The backward alone, on identical inputs: the reference's backward fed the GPU forward's own
// routing_map and saved_scores must match the GPU backward within the record's bound. (check_gpu
// compares whole runs, where the two forwards' fp32 saved scores may differ by ulps.)
TEST(GpuRouterBackward, SameInputsAsReference) {
  SKIP_WITHOUT_GPU();
  const OpInfo& router = op("topk_router");
  const OpInfo& scores = op("aux_loss_scores");
  const bool ok = rc::check("backward on the GPU forward's residuals", [&] {
    Case c = *rc::gen::oneOf(wide_router_case(), router.gen());
    const bool aux = *rc::gen::arbitrary<bool>();
    if (aux) {
      c.op = "aux_loss_scores";
      for (const char* k : {"num_groups", "group_topk", "use_pre_softmax", "expert_bias",
                            "scaling_factor", "grad_dtype"}) {
        c.p.erase(k);
      }
    }
    RC_TAG(c.op, c.s("score_function"));
    const OpInfo& o = aux ? scores : router;
    const TensorMap in = o.make_inputs(c);
    const TensorMap got = o.gpu(c, in);
    TensorMap want;
    want.emplace("output.routing_map", got.at("output.routing_map").clone());
    want.emplace("output.saved_scores", got.at("output.saved_scores").clone());
    if (aux) {
      want.emplace("grad.logits", ref::aux_loss_scores_bwd(
                                      in.at("cotangent.scores"), got.at("output.saved_scores"),
                                      parse_score_function(c.s("score_function")), c.dtype));
    } else {
      want.emplace("grad.logits",
                   ref::topk_router_bwd(in.at("cotangent.probs"), got.at("output.routing_map"),
                                        got.at("output.saved_scores"), router_params(c)));
    }
    const Tensor b = o.bound(c, "grad.logits", in, want);
    const TensorReport tr =
        compare("grad.logits", got.at("grad.logits"), want.at("grad.logits"), &b);
    if (!tr.ok()) RC_FAIL(c.line() + "\n" + tr.str() + "  replay: " + replay_line(c, "gpu"));
  });
  EXPECT_TRUE(ok);
}

// ---- regression cases -----------------------------------------------------------------------

// R2: saved_scores is f32 [T,E] (T*E*4 bytes); grad_logits takes the cotangent's dtype, is finite
// and matches the reference, for bf16/f16 logits with bf16/f16 and f32 cotangents.
TEST(GpuRouterRegression, R2_SavedScoresF32AndGradDtype) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("topk_router");
  struct Variant {
    const char* f;
    bool pre, bias;
  };
  for (DType d : {DType::bf16, DType::f16}) {
    for (const Variant v : {Variant{"softmax", true, false}, Variant{"softmax", false, false},
                            Variant{"sigmoid", false, false}, Variant{"sigmoid", false, true},
                            Variant{"sqrtsoftplus", false, false}}) {
      for (DType gd : {d, DType::f32}) {
        Case c;
        c.op = "topk_router";
        c.dtype = d;
        c.seed = 2;
        c.set("T", int64_t{2048}).set("E", int64_t{128}).set("topk", int64_t{8});
        c.set("score_function", v.f).set("use_pre_softmax", v.pre).set("expert_bias", v.bias);
        c.set("num_groups", int64_t{0}).set("group_topk", int64_t{0}).set("scaling_factor", 1.0);
        c.set("routing_map_format", "bytemap").set("grad_dtype", std::string(dtype_name(gd)));
        const TensorMap in = o.make_inputs(c);
        const TensorMap got = o.gpu(c, in);
        const Tensor& saved = got.at("output.saved_scores");
        EXPECT_EQ(saved.dtype(), DType::f32) << c.line();
        EXPECT_EQ(saved.shape(), (Shape{2048, 128})) << c.line();
        EXPECT_EQ(saved.nbytes(), size_t{2048} * 128 * 4) << c.line();
        const Tensor& g = got.at("grad.logits");
        EXPECT_EQ(g.dtype(), gd) << c.line();
        bool finite = true;
        for (int64_t i = 0; i < g.numel() && finite; ++i) finite = std::isfinite(g.at(i));
        EXPECT_TRUE(finite) << "grad_logits has a non-finite value: " << c.line();
        const Report r = check_gpu(o, c);
        EXPECT_TRUE(r.ok()) << failure(c, r);
      }
    }
  }
}

// R10: aux_loss_scores with bf16 logits writes f32 scores equal to the reference computed from
// f32(logits).
TEST(GpuRouterRegression, R10_AuxScoresAreF32) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("aux_loss_scores");
  for (const char* f : {"softmax", "sigmoid", "sqrtsoftplus"}) {
    Case c;
    c.op = "aux_loss_scores";
    c.dtype = DType::bf16;
    c.seed = 10;
    c.set("T", int64_t{128}).set("E", int64_t{32}).set("topk", int64_t{4});
    c.set("score_function", f).set("routing_map_format", "bytemap");
    const TensorMap in = o.make_inputs(c);
    const TensorMap got = o.gpu(c, in);
    EXPECT_EQ(got.at("output.scores").dtype(), DType::f32);
    EXPECT_EQ(got.at("output.scores").shape(), (Shape{128, 32}));
    // The reference on the widened logits: same values, so the same scores within tolerance.
    TensorMap in32 = clone(in);
    in32.at("input.logits") = in.at("input.logits").to(DType::f32);
    Case c32 = c;
    c32.dtype = DType::f32;
    const TensorMap want = o.reference(c32, in32, false);
    const Tensor b = o.bound(c32, "output.scores", in32, want);
    const TensorReport tr =
        compare("output.scores", got.at("output.scores"), want.at("output.scores"), &b);
    EXPECT_TRUE(tr.ok()) << c.line() << "\n" << tr.str();
  }
}

// Runs topk_router on the GPU for hand-built logits; returns the routed experts of each row.
struct RouterRun {
  std::vector<std::set<int>> sets;
  Tensor probs;
};
RouterRun run_router(const Tensor& logits, const RouterParams& p) {
  const gpu::DeviceTensor x = gpu::DeviceTensor::upload(logits);
  gpu::TopkRouterFwd out = gpu::topk_router_fwd_outputs(x.meta(), p);
  out.probs.fill_bytes(0xFF);
  out.routing_map.fill_bytes(0xFF);
  out.saved_scores.fill_bytes(0xFF);
  gpu::topk_router_fwd_into(x, nullptr, p, out);
  RouterRun r;
  const Tensor map = out.routing_map.download();
  r.probs = out.probs.download();
  for (int64_t t = 0; t < logits.dim(0); ++t) {
    std::set<int> s;
    for (int64_t e = 0; e < logits.dim(1); ++e)
      if (routing_map_get(map, t, e)) s.insert(static_cast<int>(e));
    r.sets.push_back(s);
  }
  return r;
}

std::set<int> range_set(int lo, int hi) {
  std::set<int> s;
  for (int i = lo; i < hi; ++i) s.insert(i);
  return s;
}

// R13: exact ties resolve by the canonical rule (value desc, index asc) on the GPU, for sigmoid
// and softmax post, in both map formats.
TEST(GpuRouterRegression, R13_TieBreaking) {
  SKIP_WITHOUT_GPU();
  struct Tc {
    const char* name;
    int64_t E, K;
    bool minus_one_at_0;
    std::set<int> want;
  };
  const Tc cases[] = {{"A", 8, 3, false, {0, 1, 2}},
                      {"B", 64, 2, true, {1, 2}},
                      {"C", 64, 16, true, range_set(1, 17)}};
  for (const Tc& tc : cases) {
    for (const char* f : {"sigmoid", "softmax"}) {
      for (MapFormat fmt : {MapFormat::bytemap, MapFormat::bitmap_u8}) {
        Tensor x(DType::f32, {4, tc.E});
        if (tc.minus_one_at_0)
          for (int64_t t = 0; t < 4; ++t) x.set(t, 0, -1.0);
        RouterParams p;
        p.topk = tc.K;
        p.score_function = parse_score_function(f);
        p.routing_map_format = fmt;
        p.scaling_factor = 1.5;
        const RouterRun r = run_router(x, p);
        for (int64_t t = 0; t < 4; ++t) {
          EXPECT_EQ(r.sets[t], tc.want) << "R13 case " << tc.name << " " << f << " row " << t;
        }
        if (std::string(tc.name) == "A" && std::string(f) == "sigmoid") {
          // sigmoid(0) = 0.5 each, normalised: scaling / 3.
          for (int e : tc.want) {
            EXPECT_NEAR(r.probs.at(0, e), 1.5 / 3.0, 2e-7) << "R13 A probs";
          }
        }
      }
    }
  }
  // Grouped: G=4, g_k=2, K=4, E=8, all equal -> groups {0,1}, experts {0,1,2,3}.
  Tensor x(DType::f32, {4, 8});
  RouterParams p;
  p.topk = 4;
  p.score_function = ScoreFunction::sigmoid;
  p.num_groups = 4;
  p.group_topk = 2;
  const RouterRun r = run_router(x, p);
  for (int64_t t = 0; t < 4; ++t) EXPECT_EQ(r.sets[t], range_set(0, 4)) << "R13 grouped row " << t;
}

// R15: a zero bias is bitwise equal to no bias; a random bias matches the reference; a bias with
// softmax is an error naming expert_bias; the backward takes no bias.
TEST(GpuRouterRegression, R15_OptionalExpertBias) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("topk_router");
  Case c;
  c.op = "topk_router";
  c.dtype = DType::f32;
  c.seed = 15;
  c.set("T", int64_t{64}).set("E", int64_t{32}).set("topk", int64_t{4});
  c.set("score_function", "sigmoid").set("use_pre_softmax", false).set("expert_bias", false);
  c.set("num_groups", int64_t{0}).set("group_topk", int64_t{0}).set("scaling_factor", 1.0);
  c.set("routing_map_format", "bytemap").set("grad_dtype", "float32");
  const TensorMap in = o.make_inputs(c);
  const TensorMap none = o.gpu(c, in);
  TensorMap in0 = clone(in);
  in0.emplace("input.expert_bias", Tensor(DType::f32, {32}));  // zeros
  Case c0 = c;
  c0.set("expert_bias", true);
  const TensorMap zero = o.gpu(c0, in0);
  for (auto& [k, v] : none) {
    EXPECT_TRUE(v.bitwise_equal(zero.at(k))) << k << " differs between no bias and a zero bias";
  }
  const Report r = check_gpu(o, c0.set("expert_bias", true));
  EXPECT_TRUE(r.ok()) << failure(c0, r);

  RouterParams p = router_params(c);
  p.score_function = ScoreFunction::softmax;
  const gpu::DeviceTensor x = gpu::DeviceTensor::upload(in.at("input.logits"));
  const gpu::DeviceTensor b = gpu::DeviceTensor::upload(in0.at("input.expert_bias"));
  try {
    gpu::topk_router_fwd(x, &b, p);
    ADD_FAILURE() << "a bias with softmax must be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expert_bias"), std::string::npos) << e.what();
  }
}

// E not a multiple of 8 with every selection score negative (sigmoid or sqrtsoftplus plus a bias
// below -1): the padding slots of the last lane (score 0 there) must never count as candidates
// above the K-th value. Bitwise-equal fp32 scores on both sides, so the selections must be equal.
TEST(GpuRouterRegression, NegativeBiasWithPartialLastLane) {
  SKIP_WITHOUT_GPU();
  Rng rng(31, "neg_bias");
  for (const char* f : {"sigmoid", "sqrtsoftplus"}) {
    for (int64_t E : {5, 13, 70, 100, 250}) {
      for (int64_t K : {int64_t{1}, int64_t{2}, E}) {
        const int64_t T = 37;
        Tensor x(DType::f32, {T, E});
        for (int64_t t = 0; t < T; ++t)
          for (int64_t e = 0; e < E; ++e) x.set(t, e, rng.uniform(-3.0, 3.0));
        Tensor b(DType::f32, {E});
        for (int64_t e = 0; e < E; ++e) b.set(e, -2.0 - rng.uniform(0.0, 1.0));
        RouterParams p;
        p.topk = K;
        p.score_function = parse_score_function(f);
        const ref::TopkRouterFwd want = ref::topk_router_fwd(x, &b, p);
        const gpu::DeviceTensor dx = gpu::DeviceTensor::upload(x);
        const gpu::DeviceTensor db = gpu::DeviceTensor::upload(b);
        gpu::TopkRouterFwd got = gpu::topk_router_fwd_outputs(dx.meta(), p);
        got.routing_map.fill_bytes(0xFF);
        gpu::topk_router_fwd_into(dx, &db, p, got);
        const Tensor map = got.routing_map.download();
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t e = 0; e < E; ++e) {
            ASSERT_EQ(routing_map_get(map, t, e), routing_map_get(want.routing_map, t, e))
                << f << " E=" << E << " K=" << K << " row " << t << " expert " << e;
          }
        }
      }
    }
  }
}

// Every bf16 logit pattern at least once, in rows of E (the last row wraps round), NaNs replaced
// by 0. E = 256: the DeepSeek-V3 shape; E = 200: 7 of the 32 lanes of a row hold no experts.
Tensor every_bf16_pattern(int64_t E) {
  const int64_t T = (65536 + E - 1) / E;
  Tensor x(DType::bf16, {T, E});
  uint16_t* xb = x.data<uint16_t>();
  for (int64_t i = 0; i < T * E; ++i) {
    const uint32_t b = static_cast<uint32_t>(i) & 0xffffu;
    const bool nan = (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0u;
    xb[i] = nan ? 0 : static_cast<uint16_t>(b);
  }
  return x;
}

// Runs `fwd` (downloading its outputs) with the sigmoid table uploaded and with it computed by
// the kernel (MOE_ROUTER_LUT=0), and demands bitwise-equal outputs; returns the first run's.
std::vector<Tensor> both_table_sources(const std::function<std::vector<Tensor>()>& fwd,
                                       const std::vector<std::string>& names) {
  unsetenv("MOE_ROUTER_LUT");
  std::vector<Tensor> up = fwd();
  setenv("MOE_ROUTER_LUT", "0", 1);
  const std::vector<Tensor> kernel = fwd();
  unsetenv("MOE_ROUTER_LUT");
  for (size_t k = 0; k < up.size(); ++k) {
    EXPECT_TRUE(up[k].bitwise_equal(kernel[k]))
        << names[k] << " differs between the uploaded and the kernel-computed table";
  }
  return up;
}

// Fills `outs` with 0xFF bytes (so an element the kernel does not write cannot pass), runs `run`
// and returns the outputs downloaded, in order.
std::vector<Tensor> run_poisoned(std::initializer_list<gpu::DeviceTensor*> outs,
                                 const std::function<void()>& run) {
  for (gpu::DeviceTensor* o : outs) o->fill_bytes(0xFF);
  run();
  std::vector<Tensor> v;  // Tensor is move-only: no initializer list
  for (gpu::DeviceTensor* o : outs) v.push_back(o->download());
  return v;
}

// saved[i] must be bitwise score::sigmoid_f32 of pattern x[i]; at most 10 failures reported.
void expect_saved_sigmoid(const Tensor& x, const Tensor& saved) {
  const uint16_t* xb = x.data<uint16_t>();
  const float* sv = saved.data<float>();
  int bad = 0;
  for (int64_t i = 0; i < x.numel() && bad < 10; ++i) {
    const float xf = score::bits_float(static_cast<uint32_t>(xb[i]) << 16);
    const float want = score::sigmoid_f32(xf);
    if (score::float_bits(sv[i]) != score::float_bits(want)) {
      ++bad;
      ADD_FAILURE() << "bf16 pattern 0x" << std::hex << xb[i] << std::dec << " (" << xf
                    << "): saved score " << sv[i] << ", sigmoid_f32 " << want;
    }
  }
}

// The forward's variant 2 (gpu/router_row.cuh) reads bf16 sigmoid scores from a table, uploaded
// from the host or computed by the kernel. Over every bf16 pattern: saved scores bitwise
// score::sigmoid_f32 (in the table or not), the routing map the reference's, and the two table
// sources bitwise the same in every output. E = 256 with DeepSeek-V3's groups; E = 200 ungrouped.
TEST(GpuRouterRegression, SigmoidScoreOfEveryBf16PatternIsExact) {
  SKIP_WITHOUT_GPU();
  for (const int64_t E : {int64_t{256}, int64_t{200}}) {
    SCOPED_TRACE("E = " + std::to_string(E));
    const Tensor x = every_bf16_pattern(E);
    const int64_t T = x.dim(0);
    Rng rng(41, "lut_bias");
    Tensor b(DType::f32, {E});
    for (int64_t e = 0; e < E; ++e) b.set(e, rng.uniform(-0.1, 0.1));
    RouterParams p;
    p.topk = 8;
    p.score_function = ScoreFunction::sigmoid;
    p.num_groups = E == 256 ? 8 : 0;
    p.group_topk = E == 256 ? 4 : 0;
    p.scaling_factor = 2.5;
    p.routing_map_format = MapFormat::bitmap_u8;
    const ref::TopkRouterFwd want = ref::topk_router_fwd(x, &b, p);
    const gpu::DeviceTensor dx = gpu::DeviceTensor::upload(x);
    const gpu::DeviceTensor db = gpu::DeviceTensor::upload(b);
    const std::vector<Tensor> got = both_table_sources(
        [&] {
          gpu::TopkRouterFwd o = gpu::topk_router_fwd_outputs(dx.meta(), p);
          return run_poisoned({&o.probs, &o.routing_map, &o.saved_scores},
                              [&] { gpu::topk_router_fwd_into(dx, &db, p, o); });
        },
        {"probs", "routing_map", "saved_scores"});
    expect_saved_sigmoid(x, got[2]);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(routing_map_get(got[1], t, e), routing_map_get(want.routing_map, t, e))
            << "row " << t << " expert " << e;
      }
    }
  }
}

// The same for aux_loss_scores (variant 2 with the aux scores): saved scores bitwise
// sigmoid_f32, scores bitwise the host's fp32 normalisation (row_sum_f32 order, + eps, one
// division), the routing map the reference's. At E = 200 the lanes without experts must add
// nothing to a row's sum.
TEST(GpuRouterRegression, AuxSigmoidScoresOfEveryBf16PatternAreExact) {
  SKIP_WITHOUT_GPU();
  for (const int64_t E : {int64_t{256}, int64_t{200}}) {
    SCOPED_TRACE("E = " + std::to_string(E));
    const Tensor x = every_bf16_pattern(E);
    const int64_t T = x.dim(0), K = 8;
    const MapFormat fmt = MapFormat::bytemap;
    const ref::AuxLossScoresFwd want = ref::aux_loss_scores_fwd(x, K, ScoreFunction::sigmoid, fmt);
    const gpu::DeviceTensor dx = gpu::DeviceTensor::upload(x);
    const std::vector<Tensor> got = both_table_sources(
        [&] {
          gpu::AuxLossScoresFwd o = gpu::aux_loss_scores_fwd_outputs(dx.meta(), fmt);
          return run_poisoned({&o.scores, &o.routing_map, &o.saved_scores}, [&] {
            gpu::aux_loss_scores_fwd_into(dx, K, ScoreFunction::sigmoid, fmt, o);
          });
        },
        {"scores", "routing_map", "saved_scores"});
    expect_saved_sigmoid(x, got[2]);
    const float* sv = got[2].data<float>();
    const float* sc = got[0].data<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float den = score::row_sum_f32(sv + t * E, E) + kRouterEps;
      for (int64_t e = 0; e < E; ++e) {
        const float w = sv[t * E + e] / den;
        ASSERT_EQ(score::float_bits(sc[t * E + e]), score::float_bits(w))
            << "row " << t << " expert " << e << ": score " << sc[t * E + e] << ", want " << w;
        ASSERT_EQ(routing_map_get(got[1], t, e), routing_map_get(want.routing_map, t, e))
            << "row " << t << " expert " << e;
      }
    }
  }
}

// ---- size limits ----------------------------------------------------------------------------

// T*E > 2^31: E=256, T = 2^23 + 64 (DeepSeek-V3 parameters, bitmap). The bulk is one repeated row
// (bitwise ties everywhere: the canonical rule picks the lowest indices); the first and last 64
// rows are random and compared with the reference, forward and backward, so offsets past 2^31
// elements are exercised. Needs about 27 GB of device memory.
TEST(GpuRouterLimits, TimesEBeyondInt32) {
  SKIP_WITHOUT_GPU();
  const int64_t E = 256, T = (int64_t{1} << 23) + 64, S = 64;
  const size_t need = static_cast<size_t>(T) * E * (2 + 2 + 4 + 2 + 2) + 2 * 1024 * 1024 * 1024ull;
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  if (free_b < need) GTEST_SKIP() << "needs " << need / (1 << 30) << " GiB of device memory";
  ASSERT_GT(T * E, int64_t{1} << 31);

  const OpInfo& o = op("topk_router");
  Case c;
  c.op = "topk_router";
  c.dtype = DType::bf16;
  c.seed = 31;
  c.set("T", S).set("E", E).set("topk", int64_t{8}).set("score_function", "sigmoid");
  c.set("use_pre_softmax", false).set("expert_bias", true).set("num_groups", int64_t{8});
  c.set("group_topk", int64_t{4}).set("scaling_factor", 2.5).set("routing_map_format", "bitmap_u8");
  c.set("grad_dtype", "bfloat16");
  const TensorMap head = o.make_inputs(c);
  Case c2 = c;
  c2.seed = 32;
  const TensorMap tail = o.make_inputs(c2);
  const RouterParams p = router_params(c);

  gpu::DeviceTensor x(DType::bf16, {T, E}), ct(DType::bf16, {T, E});
  x.fill_bytes(0x3F);   // bf16 0x3F3F = 0.746...
  ct.fill_bytes(0x3E);  // bf16 0x3E3E
  const size_t row_b = static_cast<size_t>(E) * 2;
  auto put_rows = [&](gpu::DeviceTensor& dst, const Tensor& src, int64_t row0) {
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(dst.data()) + static_cast<size_t>(row0) * row_b,
                         src.bytes(), src.nbytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
  };
  put_rows(x, head.at("input.logits"), 0);
  put_rows(x, tail.at("input.logits"), T - S);
  put_rows(ct, head.at("cotangent.probs"), 0);
  put_rows(ct, tail.at("cotangent.probs"), T - S);
  // One bias for both slices (the kernel applies one bias to every row).
  const gpu::DeviceTensor bias = gpu::DeviceTensor::upload(head.at("input.expert_bias"));

  gpu::TopkRouterFwd out = gpu::topk_router_fwd_outputs(x.meta(), p);
  out.probs.fill_bytes(0xFF);
  out.routing_map.fill_bytes(0xFF);
  out.saved_scores.fill_bytes(0xFF);
  gpu::topk_router_fwd_into(x, &bias, p, out);
  gpu::DeviceTensor grad(DType::bf16, {T, E});
  grad.fill_bytes(0xFF);
  gpu::topk_router_bwd_into(ct, out.routing_map, out.saved_scores, p, grad);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  auto get_rows = [&](const gpu::DeviceTensor& src, DType dt, int64_t width, int64_t row0) {
    Tensor h(dt, {S, width});
    const size_t rb = static_cast<size_t>(width) * dtype_size(dt);
    EXPECT_EQ(cudaMemcpy(h.bytes(), static_cast<const char*>(src.data()) + row0 * rb, h.nbytes(),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  };
  for (int64_t row0 : {int64_t{0}, T / 2, T - S}) {
    TensorMap in;
    if (row0 == T / 2) {  // a slice of the repeated row
      in.emplace("input.logits", get_rows(x, DType::bf16, E, row0));
      in.emplace("cotangent.probs", get_rows(ct, DType::bf16, E, row0));
    } else {
      const TensorMap& src = row0 == 0 ? head : tail;
      in.emplace("input.logits", src.at("input.logits").clone());
      in.emplace("cotangent.probs", src.at("cotangent.probs").clone());
    }
    in.emplace("input.expert_bias", head.at("input.expert_bias").clone());
    TensorMap got;
    got.emplace("output.probs", get_rows(out.probs, DType::bf16, E, row0));
    got.emplace("output.routing_map", get_rows(out.routing_map, DType::u8, E / 8, row0));
    got.emplace("output.saved_scores", get_rows(out.saved_scores, DType::f32, E, row0));
    got.emplace("grad.logits", get_rows(grad, DType::bf16, E, row0));
    const TensorMap want = o.reference(c, in, false);
    const Report r = o.compare(c, in, want, got);
    EXPECT_TRUE(r.ok()) << "rows from " << row0 << ":\n" << r.str();
  }
}

// E beyond what the kernels hold is an error naming num_experts, before any work.
TEST(GpuRouterLimits, TooManyExpertsIsAnError) {
  SKIP_WITHOUT_GPU();
  const gpu::DeviceTensor x(DType::f32, {1, kMaxExperts + 1});
  RouterParams p;
  p.topk = 1;
  try {
    gpu::topk_router_fwd(x, nullptr, p);
    ADD_FAILURE() << "E > kMaxExperts must be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts"), std::string::npos) << e.what();
  }
  try {
    gpu::aux_loss_scores_fwd(x, 1, ScoreFunction::softmax, MapFormat::bytemap);
    ADD_FAILURE() << "E > kMaxExperts must be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts"), std::string::npos) << e.what();
  }
}

// Host-checkable errors of the wrappers name the parameter (SPEC §0 error policy 1).
TEST(GpuRouterErrors, WrappersNameTheParameter) {
  SKIP_WITHOUT_GPU();
  const gpu::DeviceTensor x(DType::f32, {4, 8});
  auto expect_error = [](const std::function<void()>& f, const char* name) {
    try {
      f();
      ADD_FAILURE() << "expected an error naming " << name;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  RouterParams p;
  p.topk = 9;
  expect_error([&] { gpu::topk_router_fwd(x, nullptr, p); }, "topk");
  p.topk = 2;
  p.num_groups = 3;
  p.group_topk = 1;
  expect_error([&] { gpu::topk_router_fwd(x, nullptr, p); }, "num_groups");
  p.num_groups = 0;
  p.group_topk = 0;
  p.scaling_factor = INFINITY;
  expect_error([&] { gpu::topk_router_fwd(x, nullptr, p); }, "scaling_factor");
  p.scaling_factor = 1.0;
  const gpu::DeviceTensor x64(DType::f64, {4, 8});
  expect_error([&] { gpu::topk_router_fwd(x64, nullptr, p); }, "logits");
  gpu::TopkRouterFwd wrong = gpu::topk_router_fwd_outputs(x.meta(), p);
  wrong.saved_scores = gpu::DeviceTensor(DType::bf16, {4, 8});
  expect_error([&] { gpu::topk_router_fwd_into(x, nullptr, p, wrong); }, "saved_scores");
  const gpu::DeviceTensor probs(DType::f32, {4, 8}), tpe(DType::i32, {7});
  AuxLossParams ap;
  ap.topk = 2;
  expect_error([&] { gpu::moe_aux_loss_fwd(probs, tpe, ap); }, "tokens_per_expert");
  const gpu::DeviceTensor tpe8(DType::i32, {8});
  ap.total_num_tokens = -1;
  expect_error([&] { gpu::moe_aux_loss_fwd(probs, tpe8, ap); }, "total_num_tokens");
}

// moe_aux_loss over many rows: deterministic (check_gpu runs it twice) and within tolerance.
TEST(GpuAuxLoss, LargeDeterministic) {
  SKIP_WITHOUT_GPU();
  const OpInfo& o = op("moe_aux_loss");
  for (DType d : {DType::f32, DType::bf16}) {
    Case c;
    c.op = "moe_aux_loss";
    c.dtype = d;
    c.seed = 5;
    c.set("R", int64_t{100003}).set("C", int64_t{64}).set("num_experts", int64_t{64});
    c.set("topk", int64_t{6}).set("coeff", 1e-2).set("total_num_tokens", int64_t{100003});
    c.set("tpe_dtype", "int64");
    const Report r = check_gpu(o, c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

}  // namespace
