// The swiglu_expert_ffn record's bound (SPEC §12 rules propagated through the stages of §10.2)
// against a CPU emulation of an fp32 implementation: every product and sum in fp32 (fmaf), each
// stage rounded to d from the emulation's own rounded stage values, act in fp32 with expf, as the
// CUDA twin does. The faithful emulation must pass on every generated and named case; planted
// bugs (activation on the wrong factor, a wrong derivative, a dropped term, the wrong expert's
// weights) must fail.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "harness/core/params/ffn.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/registry.h"

using namespace moe;

namespace {

enum class Bug { none, act_on_up, silu_grad_is_sigmoid, drop_last_term, next_expert_wo };

const char* bug_name(Bug b) {
  switch (b) {
    case Bug::none:
      return "none";
    case Bug::act_on_up:
      return "act_on_up";
    case Bug::silu_grad_is_sigmoid:
      return "silu_grad_is_sigmoid";
    case Bug::drop_last_term:
      return "drop_last_term";
    case Bug::next_expert_wo:
      return "next_expert_wo";
  }
  return "?";
}

float f32(double v) {
  return static_cast<float>(v);
}

float act_f(bool silu, float x) {
  return silu ? x * (1.0f / (1.0f + std::exp(-x))) : x;
}

float act_grad_f(bool silu, float x, Bug bug) {
  if (!silu) return 1.0f;
  const float s = 1.0f / (1.0f + std::exp(-x));
  if (bug == Bug::silu_grad_is_sigmoid) return s;
  return s * (1.0f + x * (1.0f - s));
}

// fp32 dot product of n terms a(i) * b(i) with fmaf, in the order given (forward or reversed).
template <class A, class B>
float dot(int64_t n, bool reversed, A&& a, B&& b, float acc = 0.0f) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = reversed ? n - 1 - j : j;
    acc = std::fma(a(i), b(i), acc);
  }
  return acc;
}

TensorMap emulate(const Case& c, const TensorMap& in, Bug bug) {
  const DType d = c.dtype;
  const bool silu = parse_activation(c.s("activation", "silu")) == Activation::silu;
  const bool rev = c.seed % 2 == 1;  // the summation order varies with the case
  const Tensor& x = in.at("input.x");
  const Tensor& w0 = in.at("input.wi_0");
  const Tensor& w1 = in.at("input.wi_1");
  const Tensor& wo = in.at("input.wo");
  const Tensor& ct = in.at("cotangent.out");
  const Tensor* b0 = ops::find_tensor(in, "input.wi_0_bias");
  const Tensor* b1 = ops::find_tensor(in, "input.wi_1_bias");
  const Tensor* bo = ops::find_tensor(in, "input.wo_bias");
  const std::vector<int64_t> sizes = ops::int_values(in.at("input.group_sizes"));
  const int64_t R = x.dim(0), H = x.dim(1), M = w0.dim(2), G = w0.dim(0);
  TensorMap o;
  Tensor out(d, {R, H}), gate(d, {R, M}), up(d, {R, M}), inter(d, {R, M});
  Tensor gx(d, {R, H}), gw0(d, {G, H, M}), gw1(d, {G, H, M}), gwo(d, {G, M, H});
  Tensor gb0(d, {G, M}), gb1(d, {G, M}), gbo(d, {G, H});
  Tensor d_gate(d, {R, M}), d_up(d, {R, M});
  const int64_t hk = bug == Bug::drop_last_term ? H - 1 : H;
  int64_t o_g = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = sizes[g];
    const int64_t go = bug == Bug::next_expert_wo ? (g + 1) % G : g;
    for (int64_t r = o_g; r < o_g + n; ++r) {
      for (int64_t m = 0; m < M; ++m) {
        const auto xr = [&](int64_t k) { return f32(x.at(r, k)); };
        float a0 = dot(hk, rev, xr, [&](int64_t k) { return f32(w0.at((g * H + k) * M + m)); });
        float a1 = dot(H, rev, xr, [&](int64_t k) { return f32(w1.at((g * H + k) * M + m)); });
        if (b0) a0 += f32(b0->at(g, m));
        if (b1) a1 += f32(b1->at(g, m));
        gate.set(r, m, a0);
        up.set(r, m, a1);
        const float gv = f32(gate.at(r, m)), uv = f32(up.at(r, m));
        inter.set(r, m, bug == Bug::act_on_up ? act_f(silu, uv) * gv : act_f(silu, gv) * uv);
      }
      for (int64_t h = 0; h < H; ++h) {
        float a = dot(
            M, rev, [&](int64_t m) { return f32(inter.at(r, m)); },
            [&](int64_t m) { return f32(wo.at((go * M + m) * H + h)); });
        if (bo) a += f32(bo->at(g, h));
        out.set(r, h, a);
      }
      // Backward: d_inter (stored in d), then d_up and d_gate.
      for (int64_t m = 0; m < M; ++m) {
        const float t =
            f32(round_to(d, dot(
                                H, rev, [&](int64_t h) { return f32(ct.at(r, h)); },
                                [&](int64_t h) { return f32(wo.at((g * M + m) * H + h)); })));
        const float gv = f32(gate.at(r, m)), uv = f32(up.at(r, m));
        d_up.set(r, m, t * act_f(silu, gv));
        d_gate.set(r, m, act_grad_f(silu, gv, bug) * (t * uv));
      }
    }
    // Per-row grad x: both products accumulate in one fp32 value, rounded once.
    for (int64_t r = o_g; r < o_g + n; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        float a = dot(
            M, rev, [&](int64_t m) { return f32(d_gate.at(r, m)); },
            [&](int64_t m) { return f32(w0.at((g * H + h) * M + m)); });
        a = dot(
            M, rev, [&](int64_t m) { return f32(d_up.at(r, m)); },
            [&](int64_t m) { return f32(w1.at((g * H + h) * M + m)); }, a);
        gx.set(r, h, a);
      }
    }
    // Weight and bias gradients over the group's rows (an empty group stays 0).
    const auto rows = [&](auto&& a, auto&& b) {
      return dot(
          n, rev, [&](int64_t i) { return a(o_g + i); }, [&](int64_t i) { return b(o_g + i); });
    };
    const auto one = [](int64_t) { return 1.0f; };
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t h = 0; h < H; ++h) {
        gwo.set((g * M + m) * H + h, rows([&](int64_t r) { return f32(inter.at(r, m)); },
                                          [&](int64_t r) { return f32(ct.at(r, h)); }));
        const auto xh = [&](int64_t r) { return f32(x.at(r, h)); };
        gw0.set((g * H + h) * M + m, rows(xh, [&](int64_t r) { return f32(d_gate.at(r, m)); }));
        gw1.set((g * H + h) * M + m, rows(xh, [&](int64_t r) { return f32(d_up.at(r, m)); }));
      }
      gb0.set(g, m, rows(one, [&](int64_t r) { return f32(d_gate.at(r, m)); }));
      gb1.set(g, m, rows(one, [&](int64_t r) { return f32(d_up.at(r, m)); }));
    }
    for (int64_t h = 0; h < H; ++h) {
      gbo.set(g, h, rows(one, [&](int64_t r) { return f32(ct.at(r, h)); }));
    }
    o_g += n;
  }
  o.emplace("output.out", std::move(out));
  o.emplace("output.gate_proj", std::move(gate));
  o.emplace("output.up_proj", std::move(up));
  o.emplace("output.intermediate", std::move(inter));
  o.emplace("grad.x", std::move(gx));
  o.emplace("grad.wi_0", std::move(gw0));
  o.emplace("grad.wi_1", std::move(gw1));
  o.emplace("grad.wo", std::move(gwo));
  if (b0) o.emplace("grad.wi_0_bias", std::move(gb0));
  if (b1) o.emplace("grad.wi_1_bias", std::move(gb1));
  if (bo) o.emplace("grad.wo_bias", std::move(gbo));
  return o;
}

const ops::OpInfo& ffn() {
  return *ops::find_op("swiglu_expert_ffn");
}

Report check_emulation(const Case& c, Bug bug) {
  const ops::OpInfo& op = ffn();
  const TensorMap in = op.make_inputs(c);
  const TensorMap want = op.reference(c, in, false);
  return ops::compare_outputs(op, c, in, want, emulate(c, in, bug));
}

// Larger cases than the generator's (several hundred terms per sum), with biases and skew, in
// every dtype and both summation orders.
std::vector<Case> cases() {
  std::vector<Case> v = ffn().named();
  const struct {
    DType d;
    Regime regime;
    int64_t G, rows, H, M, tail;
    bool bias;
    uint64_t seed;
  } shapes[] = {{DType::bf16, Regime::skewed, 4, 120, 96, 160, 20, true, 43},
                {DType::f32, Regime::zero_tokens, 6, 90, 72, 40, 9, false, 44},
                {DType::f16, Regime::uniform, 3, 64, 256, 48, 0, true, 45},
                {DType::bf16, Regime::uniform, 2, 40, 300, 200, 5, false, 46}};
  for (const auto& s : shapes) {
    Case c;
    c.op = "swiglu_expert_ffn";
    c.dtype = s.d;
    c.regime = s.regime;
    c.seed = s.seed;
    c.set("G", s.G).set("M_total", s.rows).set("H", s.H).set("M", s.M).set("tail", s.tail);
    c.set("activation", "silu").set("wi_0_bias", s.bias).set("wi_1_bias", s.bias);
    c.set("wo_bias", s.bias);
    v.push_back(c);
  }
  return v;
}

}  // namespace

TEST(FfnBound, Fp32EmulationPassesNamedAndLargerCases) {
  for (const Case& c : cases()) {
    const Report r = check_emulation(c, Bug::none);
    EXPECT_TRUE(r.ok()) << c.line() << "\n" << r.str();
  }
}

RC_GTEST_PROP(FfnBound, Fp32EmulationPassesGeneratedCases, ()) {
  const Case c = *ffn().gen();
  RC_TAG(std::string(dtype_name(c.dtype)));
  const Report r = check_emulation(c, Bug::none);
  if (!r.ok()) RC_FAIL(c.line() + "\n" + r.str());
}

// Each planted bug fails on some of the cases (a bug that only shows with silu, or with several
// experts, passes on the others, so the test asks for at least one failure per bug).
TEST(FfnBound, PlantedBugsFail) {
  for (Bug bug :
       {Bug::act_on_up, Bug::silu_grad_is_sigmoid, Bug::drop_last_term, Bug::next_expert_wo}) {
    int failed = 0, total = 0;
    for (const Case& c : cases()) {
      ++total;
      failed += !check_emulation(c, bug).ok();
    }
    EXPECT_GT(failed, 0) << bug_name(bug) << " passed all " << total << " cases";
    std::printf("planted bug %-22s failed %d of %d cases\n", bug_name(bug), failed, total);
  }
}
