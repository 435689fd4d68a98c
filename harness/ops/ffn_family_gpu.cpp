// CUDA bindings of the grouped_gemm and swiglu_expert_ffn records; see ffn_family_gpu.h.
#ifdef MOE_WITH_CUDA

#include "harness/ops/ffn_family_gpu.h"

#include <memory>
#include <optional>

#include "gpu/grouped_gemm.cuh"
#include "gpu/swiglu_ffn.cuh"
#include "harness/core/params/ffn.h"
#include "harness/ops/device_io.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"

namespace moe::ops {

namespace {

using gpu::DeviceTensor;

gpu::GemmOptions options(const Case& c, bool poison) {
  gpu::GemmOptions o;
  if (c.has("impl")) o.impl = gpu::parse_gemm_impl(c.s("impl"));
  if (c.has("chunk_rows")) o.chunk_rows = c.i("chunk_rows");
  o.poison = poison;
  return o;
}

Activation activation(const Case& c) {
  return parse_activation(c.s("activation", "silu"));
}

struct FfnInputs {
  DeviceTensor x, gs, wi_0, wi_1, wo;
  std::optional<DeviceTensor> b0, b1, bo;
  explicit FfnInputs(const TensorMap& in)
      : x(up(in, "input.x")),
        gs(up(in, "input.group_sizes")),
        wi_0(up(in, "input.wi_0")),
        wi_1(up(in, "input.wi_1")),
        wo(up(in, "input.wo")),
        b0(up_opt(in, "input.wi_0_bias")),
        b1(up_opt(in, "input.wi_1_bias")),
        bo(up_opt(in, "input.wo_bias")) {}
  gpu::FfnWeights weights() const { return {wi_0, wi_1, wo, ptr(b0), ptr(b1), ptr(bo)}; }
};

}  // namespace

Case gemm_bench_case(const std::string& name, Regime regime, int64_t G, int64_t M, int64_t K,
                     int64_t N) {
  Case c = CaseBuilder("grouped_gemm", DType::bf16).regime(regime).seed(23);
  c.set("name", name).set("G", G).set("M_total", M).set("K_d", K).set("N", N);
  c.set("tail", int64_t{0}).set("bias", false);
  return c;
}

Case ffn_bench_case(const std::string& name, Regime regime, int64_t G, int64_t Mt, int64_t H,
                    int64_t M) {
  Case c = CaseBuilder("swiglu_expert_ffn", DType::bf16).regime(regime).seed(29);
  c.set("name", name).set("G", G).set("M_total", Mt).set("H", H).set("M", M);
  c.set("tail", int64_t{0}).set("activation", "silu");
  c.set("wi_0_bias", false).set("wi_1_bias", false).set("wo_bias", false);
  return c;
}

TensorMap grouped_gemm_gpu(const Case& c, const TensorMap& in) {
  const gpu::GemmOptions o = options(c, true);
  const DeviceTensor x = up(in, "input.x"), w = up(in, "input.w");
  const DeviceTensor gs = up(in, "input.group_sizes");
  const auto bias = up_opt(in, "input.bias");
  TensorMap out;
  put(out, "output.out", gpu::grouped_gemm_fwd(x, w, gs, ptr(bias), nullptr, o));
  if (find_tensor(in, "cotangent.out")) {
    const DeviceTensor ct = up(in, "cotangent.out");
    gpu::GroupedGemmBwd b = gpu::grouped_gemm_bwd(ct, x, w, gs, ptr(bias), nullptr, o);
    put(out, "grad.x", b.grad_x);
    put(out, "grad.w", b.grad_w);
    put(out, "grad.bias", b.grad_bias);
  }
  return out;
}

TensorMap swiglu_expert_ffn_gpu(const Case& c, const TensorMap& in) {
  const gpu::GemmOptions o = options(c, true);
  const Activation act = activation(c);
  const FfnInputs d(in);
  const gpu::FfnWeights w = d.weights();
  gpu::SwigluFfnFwd f = gpu::swiglu_expert_ffn_fwd(d.x, d.gs, w, act, nullptr, o);
  TensorMap out;
  if (find_tensor(in, "cotangent.out")) {
    const DeviceTensor ct = up(in, "cotangent.out");
    gpu::SwigluFfnBwd b = gpu::swiglu_expert_ffn_bwd(ct, d.x, d.gs, w, f.gate_proj, f.up_proj,
                                                     f.intermediate, act, nullptr, o);
    put(out, "grad.x", b.grad_x);
    put(out, "grad.wi_0", b.grad_wi_0);
    put(out, "grad.wi_1", b.grad_wi_1);
    put(out, "grad.wo", b.grad_wo);
    put(out, "grad.wi_0_bias", b.grad_wi_0_bias);
    put(out, "grad.wi_1_bias", b.grad_wi_1_bias);
    put(out, "grad.wo_bias", b.grad_wo_bias);
  }
  put(out, "output.out", f.out);
  put(out, "output.gate_proj", f.gate_proj);
  put(out, "output.up_proj", f.up_proj);
  put(out, "output.intermediate", f.intermediate);
  return out;
}

namespace {

struct GemmBench {
  DeviceTensor x, w, gs, ct, out;
  std::optional<DeviceTensor> bias;
  gpu::GroupPlan plan;
  gpu::GroupedGemmBwd b;
  gpu::GemmOptions o;
};

struct FfnBench {
  explicit FfnBench(const TensorMap& in) : d(in) {}
  FfnInputs d;
  DeviceTensor ct;
  gpu::GroupPlan plan;
  std::optional<gpu::SwigluFfnFwd> f;
  std::optional<gpu::SwigluFfnBwd> b;
  gpu::GemmOptions o;
  Activation act = Activation::silu;
};

}  // namespace

OpInfo::Bench grouped_gemm_gpu_bench(const Case& c, const TensorMap& in) {
  auto st = std::make_shared<GemmBench>();
  st->o = options(c, false);
  st->x = up(in, "input.x");
  st->w = up(in, "input.w");
  st->gs = up(in, "input.group_sizes");
  st->ct = up(in, "cotangent.out");
  st->bias = up_opt(in, "input.bias");
  st->plan = gpu::read_group_plan(st->gs, st->x.dim(0));
  st->out = gpu::grouped_gemm_fwd(st->x, st->w, st->gs, ptr(st->bias), nullptr, st->o);
  st->b = gpu::grouped_gemm_bwd(st->ct, st->x, st->w, st->gs, ptr(st->bias), nullptr, st->o);
  GemmBench* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::grouped_gemm_fwd_into(s->x, s->w, s->plan, ptr(s->bias), s->out, nullptr, s->o);
  };
  bench.bwd = [s] {
    gpu::grouped_gemm_bwd_into(s->ct, s->x, s->w, s->plan, ptr(s->bias), s->b, nullptr, s->o);
  };
  bench.state = st;
  return bench;
}

OpInfo::Bench swiglu_expert_ffn_gpu_bench(const Case& c, const TensorMap& in) {
  auto st = std::make_shared<FfnBench>(in);
  st->o = options(c, false);
  st->act = activation(c);
  st->ct = up(in, "cotangent.out");
  st->plan = gpu::read_group_plan(st->d.gs, st->d.x.dim(0));
  const gpu::FfnWeights w = st->d.weights();
  st->f = gpu::swiglu_expert_ffn_fwd(st->d.x, st->d.gs, w, st->act, nullptr, st->o);
  st->b = gpu::swiglu_expert_ffn_bwd(st->ct, st->d.x, st->d.gs, w, st->f->gate_proj, st->f->up_proj,
                                     st->f->intermediate, st->act, nullptr, st->o);
  FfnBench* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::swiglu_expert_ffn_fwd_into(s->d.x, s->plan, s->d.weights(), s->act, *s->f, nullptr, s->o);
  };
  bench.bwd = [s] {
    gpu::swiglu_expert_ffn_bwd_into(s->ct, s->d.x, s->plan, s->d.weights(), s->f->gate_proj,
                                    s->f->up_proj, s->f->intermediate, s->act, *s->b, nullptr,
                                    s->o);
  };
  bench.state = st;
  return bench;
}

std::vector<Case> grouped_gemm_gpu_bench_cases() {
  return {gemm_bench_case("mixtral_tp8_uniform", Regime::uniform, 8, 16384, 4096, 1792),
          gemm_bench_case("mixtral_tp8_skewed", Regime::skewed, 8, 16384, 4096, 1792),
          gemm_bench_case("deepseek_ep32_uniform", Regime::uniform, 8, 2048, 7168, 2048),
          gemm_bench_case("deepseek_ep32_skewed", Regime::skewed, 8, 2048, 7168, 2048)};
}

std::vector<Case> swiglu_expert_ffn_gpu_bench_cases() {
  return {ffn_bench_case("mixtral_tp8_uniform", Regime::uniform, 8, 16384, 4096, 1792),
          ffn_bench_case("deepseek_ep32_uniform", Regime::uniform, 8, 2048, 7168, 2048)};
}

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
