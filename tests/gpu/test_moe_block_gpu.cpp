// CUDA moe_block tests (SPEC §11): sharded cases over P in {1,2,4,8} x D in {1,2} against the
// reference through check_gpu (the registry suite already runs the record's own random and named
// cases); EP invariance of the GPU block against its own P = D = 1 run within the §12 composite
// bound (routing maps and counts bitwise); regression cases R3, R5, R7 on the GPU; determinism.
// The benchmark (forward + backward tokens/s at Mixtral-like and DeepSeek-like sizes, inputs
// generated on the device) is `moe-harness bench --op moe_block`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpu/moe_block.cuh"
#include "harness/core/compare.h"
#include "harness/core/rng.h"
#include "harness/ops/block_gpu.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/registry.h"

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

namespace {

#define SKIP_WITHOUT_GPU() \
  if (!gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << gpu_description()

const OpInfo& block_op() {
  return *find_op("moe_block");
}

Case named_case(const std::string& name) {
  for (const Case& c : block_op().named())
    if (c.s("name") == name) return c;
  throw std::invalid_argument("no named moe_block case " + name);
}

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "gpu");
}

// got vs want (both GPU runs): floats (probs included) within the record's composite bound of
// want; routing maps and group sizes bitwise (§11.5-1). Probs may differ by an ulp: cuBLAS picks
// its kernel by the shard's row count, so fp32 logits need not be bitwise equal across P.
Report agree(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  Report r;
  for (auto& [key, w] : want) {
    auto it = got.find(key);
    if (it == got.end()) {
      r.failures.push_back(key + ": missing");
      continue;
    }
    if (is_floating(w.dtype())) {
      const Tensor b = block_op().bound(c, key, in, want);
      r.tensors.push_back(compare(key, it->second.to(DType::f64), w.to(DType::f64), &b));
    } else {
      r.tensors.push_back(compare(key, it->second, w, nullptr));
    }
  }
  if (got.size() != want.size()) r.failures.push_back("the two runs produce different tensors");
  return r;
}

// The CPU suite's invariance cases: E = 8, B = 16, so every P in {1,2,4,8} and D in {1,2} divides.
rc::Gen<Case> sharded_case() {
  return rc::gen::exec([] {
    Case c = *block_op().gen();
    c.set("num_experts", int64_t{8}).set("B", int64_t{16}).set("S", *any_in(1, 3));
    c.set("topk", *any_in(1, 4)).set("num_groups", int64_t{0}).set("group_topk", int64_t{0});
    c.set("ep_size", *rc::gen::element<int64_t>(1, 2, 4, 8));
    c.set("dp_size", *rc::gen::element<int64_t>(1, 2));
    c.set("aux_loss_coeff", *rc::gen::element(0.0, 0.01));
    if (c.regime == Regime::zero_tokens) c.regime = Regime::skewed;  // B is fixed at 16 here
    return c;
  });
}

struct DeviceInputs {
  gpu::DeviceTensor x, gk, w0, w1, wo;
  explicit DeviceInputs(const TensorMap& in)
      : x(gpu::DeviceTensor::upload(in.at("input.x"))),
        gk(gpu::DeviceTensor::upload(in.at("input.gate_kernel"))),
        w0(gpu::DeviceTensor::upload(in.at("input.wi_0"))),
        w1(gpu::DeviceTensor::upload(in.at("input.wi_1"))),
        wo(gpu::DeviceTensor::upload(in.at("input.wo"))) {}
  gpu::MoeBlockInputs view() const { return {x, gk, w0, w1, wo}; }
};

}  // namespace

// --- GPU vs reference on sharded cases ----------------------------------------------------------

RC_GTEST_PROP(MoeBlockGpu, ShardedCasesMatchTheReference, ()) {
  if (!gpu_available()) RC_SUCCEED("no CUDA GPU: " + gpu_description());
  const Case c = *sharded_case();
  RC_TAG(c.i("ep_size"), c.i("dp_size"));
  const Report r = check_gpu(block_op(), c);
  if (!r.ok()) RC_FAIL(failure(c, r));
}

// --- §11.5-1 on the GPU: EP invariance against the GPU's own single-rank run --------------------

TEST(MoeBlockGpu, EpAndDpShardingGiveTheSingleRankResult) {
  SKIP_WITHOUT_GPU();
  for (const char* backend : {"kernel", "argsort"}) {
    for (int64_t a : {int64_t{0}, int64_t{4}}) {
      for (DType d : {DType::f32, DType::bf16}) {
        Case c = named_case("R5_R7_a0");
        c.dtype = d;
        c.set("name", "gpu_ep_invariance").set("B", int64_t{16}).set("S", int64_t{3});
        c.set("backend", backend).set("align_size", a).set("topk", int64_t{2});
        c.set("aux_loss_coeff", 0.01).set("ep_size", int64_t{1}).set("dp_size", int64_t{1});
        c.set("wi_0_bias", true).set("wo_bias", true);
        const TensorMap in = block_op().make_inputs(c);
        const TensorMap one = moe_block_gpu(c, in);
        for (int64_t P : {int64_t{2}, int64_t{4}, int64_t{8}}) {
          for (int64_t D : {int64_t{1}, int64_t{2}}) {
            Case s = c;
            s.set("ep_size", P).set("dp_size", D);
            const Report r = agree(c, in, one, moe_block_gpu(s, in));
            EXPECT_TRUE(r.ok()) << failure(s, r);
          }
        }
      }
    }
  }
}

// --- regression cases ---------------------------------------------------------------------------

// R3: with a = 16 under EP rank 0 receives 128 aligned rows into R = 184; nothing overflows and
// the result equals the GPU's P = 1 run and the reference.
TEST(MoeBlockGpuRegression, R3_UndersizedReceiveBufferWithAlignment) {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"R3_kernel", "R3_argsort"}) {
    const Case c = named_case(name);
    const TensorMap in = block_op().make_inputs(c);
    const DeviceInputs d(in);
    const gpu::MoeBlockFwd f = gpu::moe_block_fwd(d.view(), moe_block_params(c));
    ASSERT_EQ(f.shards.size(), 2u);
    for (const gpu::MoeShardState& st : f.shards) {
      EXPECT_EQ(st.sorted_x.dim(0), 184) << replay_line(c, "gpu");
      const Tensor lgs = st.local_group_sizes.download();
      int64_t recv = 0;
      for (int64_t l = 0; l < lgs.numel(); ++l) recv += static_cast<int64_t>(lgs.at(l));
      EXPECT_EQ(recv, st.ep_rank == 0 ? 128 : 0) << replay_line(c, "gpu");
    }
    Case one = c;
    one.set("ep_size", int64_t{1});
    const Report r = agree(c, in, moe_block_gpu(one, in), moe_block_gpu(c, in));
    EXPECT_TRUE(r.ok()) << failure(c, r);
    const Report vs_ref = check_gpu(block_op(), c);
    EXPECT_TRUE(vs_ref.ok()) << failure(c, vs_ref);
  }
}

// R5: the combine backward under EP consumes eo_post [R_pre,H] (not the [R,H] receive buffer),
// and every gradient equals the GPU's P = 1 run, for both backends.
TEST(MoeBlockGpuRegression, R5_CombineBackwardUsesTheConsumedTensorUnderEp) {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"R5_R7_a0", "R5_R7_a16"}) {
    for (const char* be : {"kernel", "argsort"}) {
      Case c = named_case(name);
      c.set("backend", be);
      const TensorMap in = block_op().make_inputs(c);
      const MoeBlockParams p = moe_block_params(c);
      const DeviceInputs d(in);
      const gpu::MoeBlockFwd f = gpu::moe_block_fwd(d.view(), p);
      const EpShape es{c.i("B"),  c.i("S"),      p.topk,      p.ep_size,
                       p.dp_size, p.num_experts, p.align_size};
      for (const gpu::MoeShardState& st : f.shards) {
        EXPECT_EQ(st.eo_post.shape(), (Shape{pre_a2a_rows(es), c.i("H")})) << replay_line(c, "gpu");
        EXPECT_NE(st.eo_post.dim(0), recv_rows(es));
      }
      Case one = c;
      one.set("ep_size", int64_t{1});
      const Report r = agree(c, in, moe_block_gpu(one, in), moe_block_gpu(c, in));
      EXPECT_TRUE(r.ok()) << failure(c, r);
    }
  }
}

// R7: pad_offsets absent with a = 0 and an [E] i32 tensor with a = 16, both under EP, equal to
// P = 1 and to the reference; no pad_offsets tensor reaches the outputs.
TEST(MoeBlockGpuRegression, R7_PadOffsetsAbsentVersusPresentAcrossEp) {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"R5_R7_a0", "R5_R7_a16"}) {
    const Case c = named_case(name);
    const TensorMap in = block_op().make_inputs(c);
    const DeviceInputs d(in);
    const gpu::MoeBlockFwd f = gpu::moe_block_fwd(d.view(), moe_block_params(c));
    for (const gpu::MoeShardState& st : f.shards) {
      if (c.i("align_size") == 0) {
        EXPECT_FALSE(st.pad_offsets.has_value()) << replay_line(c, "gpu");
      } else {
        ASSERT_TRUE(st.pad_offsets.has_value()) << replay_line(c, "gpu");
        EXPECT_EQ(st.pad_offsets->dtype(), DType::i32);
        EXPECT_EQ(st.pad_offsets->shape(), (Shape{c.i("num_experts")}));
      }
    }
    const TensorMap out = moe_block_gpu(c, in);
    for (auto& [k, v] : out) EXPECT_EQ(k.find("pad_offsets"), std::string::npos) << k;
    Case one = c;
    one.set("ep_size", int64_t{1});
    const Report r = agree(c, in, moe_block_gpu(one, in), out);
    EXPECT_TRUE(r.ok()) << failure(c, r);
    const Report vs_ref = check_gpu(block_op(), c);
    EXPECT_TRUE(vs_ref.ok()) << failure(c, vs_ref);
  }
}

// --- determinism ---------------------------------------------------------------------------------

TEST(MoeBlockGpu, TwoRunsAreBitwiseEqual) {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"mixtral_like", "deepseek_like"}) {
    Case c = named_case(name);
    c.set("ep_size", int64_t{2}).set("dp_size", int64_t{2});
    const TensorMap in = block_op().make_inputs(c);
    const TensorMap a = moe_block_gpu(c, in), b = moe_block_gpu(c, in);
    ASSERT_EQ(a.size(), b.size());
    for (auto& [k, v] : a) {
      ASSERT_TRUE(b.count(k)) << k;
      EXPECT_TRUE(b.at(k).bitwise_equal(v)) << k << " differs; " << replay_line(c, "gpu");
    }
  }
}

// --- the gate GEMM's gradients ------------------------------------------------------------------

// moe_gate_grads against fp64: d_logits with full 24-bit significands over 13 binades (so each
// of the bf16 path's three terms carries bits), x and gate_kernel in the block's dtype (bf16: the
// split path; f16: fp32 GEMMs). Every element is within SPEC §12's fp32 reduction bound of its
// contraction (the bf16 path sums 3E terms for d_x_gate, and T terms plus two accumulating adds
// for gk_grad). A bf16 path that dropped its last term would be off by up to 2^-16 of a product,
// above the bound at these sizes (E = 4, T = 12: few terms, one of which often dominates). One row
// of d_logits holds +inf in column 0 with gate_kernel's column 0 non-zero: its d_x_gate row is
// +-inf like the fp64 sums (not NaN from inf - inf in the split), as is gk_grad's column 0.
TEST(MoeBlockGpu, GateGradientsAreFp32SumsOfTheFullDLogits) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 12, H = 72, E = 4, inf_row = 7;
  Rng rng(5, "gate_grads");
  Tensor dl(DType::f32, {T, E});
  for (int64_t i = 0; i < T * E; ++i) {
    const double m = 1.0 + static_cast<double>(rng.below(int64_t{1} << 23)) / (1 << 23);
    const int e = static_cast<int>(rng.below(13)) - 10;
    dl.set(i, (rng.below(2) ? -1.0 : 1.0) * std::ldexp(m, e));
  }
  dl.set(inf_row * E, std::numeric_limits<double>::infinity());
  for (const DType d : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Tensor x(d, {T, H}), gk(d, {H, E});
    for (int64_t i = 0; i < T * H; ++i) x.set(i, round_to(d, rng.uniform(-1.0, 1.0)));
    for (int64_t i = 0; i < H * E; ++i) {
      double v = round_to(d, rng.uniform(-1.0, 1.0));
      if (i % E == 0 && v == 0) v = 0.5;  // column 0 non-zero: the inf row's products are inf
      gk.set(i, v);
    }
    gpu::DeviceTensor dx(DType::f32, {T, H}), dgk(DType::f32, {H, E});
    gpu::moe_gate_grads(gpu::DeviceTensor::upload(dl), gpu::DeviceTensor::upload(x),
                        gpu::DeviceTensor::upload(gk), dx, dgk, nullptr);
    const Tensor got_x = dx.download(), got_gk = dgk.download();
    const bool split = d == DType::bf16;
    std::vector<std::string> bad;
    auto expect = [&](const char* what, int64_t i, double got, double sum, double mag, int64_t n) {
      const bool ok =
          std::isfinite(sum)
              ? std::fabs(got - sum) <= tol_bound(TolClass::reduction, DType::f32, sum, n, mag)
              : got == sum || (std::isnan(got) && std::isnan(sum));
      if (!ok)
        bad.push_back(std::string(what) + "[" + std::to_string(i) + "] = " + format_double(got) +
                      ", want " + format_double(sum));
    };
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        double sum = 0, mag = 0;
        for (int64_t e = 0; e < E; ++e) {
          sum += dl.at(t, e) * gk.at(h, e);
          mag += std::fabs(dl.at(t, e) * gk.at(h, e));
        }
        expect("d_x_gate", t * H + h, got_x.at(t, h), sum, mag, split ? 3 * E : E);
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t e = 0; e < E; ++e) {
        double sum = 0, mag = 0;
        for (int64_t t = 0; t < T; ++t) {
          sum += x.at(t, h) * dl.at(t, e);
          mag += std::fabs(x.at(t, h) * dl.at(t, e));
        }
        expect("gk_grad", h * E + e, got_gk.at(h, e), sum, mag, split ? T + 2 : T);
      }
    }
    EXPECT_TRUE(bad.empty()) << bad.size()
                             << " elements off, first: " << (bad.empty() ? "" : bad.front());
  }
}

// moe_gate_grads checks its arguments before it issues anything: each tensor with a wrong shape
// or dtype is named in the error (x and gate_kernel fix T, H and E; the fp32 tensors follow).
TEST(MoeBlockGpu, GateGradientsNameAMisshapedArgument) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 4, H = 8, E = 2;
  const DType d = DType::bf16;
  auto message = [&](const gpu::DeviceTensor& dl, const gpu::DeviceTensor& x,
                     const gpu::DeviceTensor& gk, gpu::DeviceTensor& dx, gpu::DeviceTensor& dgk) {
    try {
      gpu::moe_gate_grads(dl, x, gk, dx, dgk, nullptr);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  gpu::DeviceTensor dl(DType::f32, {T, E}), x(d, {T, H}), gk(d, {H, E});
  gpu::DeviceTensor dx(DType::f32, {T, H}), dgk(DType::f32, {H, E});
  gpu::DeviceTensor dl_rows(DType::f32, {T + 1, E}), dl_bf16(d, {T, E}), x_1d(d, {T * H});
  gpu::DeviceTensor gk_f16(DType::f16, {H, E}), gk_cols(d, {H + 1, E});
  gpu::DeviceTensor dx_bf16(d, {T, H}), dgk_cols(DType::f32, {H, E + 1});
  EXPECT_THAT(message(dl_rows, x, gk, dx, dgk), HasSubstr("d_logits: expected shape [4, 2]"));
  EXPECT_THAT(message(dl_bf16, x, gk, dx, dgk), HasSubstr("d_logits: dtype bfloat16"));
  EXPECT_THAT(message(dl, x_1d, gk, dx, dgk), HasSubstr("x: expected a 2-D tensor"));
  EXPECT_THAT(message(dl, x, gk_f16, dx, dgk), HasSubstr("gk_d: dtype float16"));
  EXPECT_THAT(message(dl, x, gk_cols, dx, dgk), HasSubstr("gk_d: expected shape [8, 2]"));
  EXPECT_THAT(message(dl, x, gk, dx_bf16, dgk), HasSubstr("d_x_gate: dtype bfloat16"));
  EXPECT_THAT(message(dl, x, gk, dx, dgk_cols), HasSubstr("gk_grad: expected shape [8, 2]"));
}
