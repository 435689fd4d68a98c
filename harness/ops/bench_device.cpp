// Device-input benchmarks of grouped_gemm and swiglu_expert_ffn, device_uniform and the table of
// hooks the records do not set yet; see bench_device.h.
#ifdef MOE_WITH_CUDA

#include "harness/ops/bench_device.h"

#include "harness/ops/ffn_family_gpu.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include "gpu/bench_util.cuh"
#include "gpu/grouped_gemm.cuh"
#include "gpu/swiglu_ffn.cuh"
#include "harness/core/params/ffn.h"
#include "harness/core/rng.h"
#include "harness/ops/block_gpu.h"
#include "harness/ops/device_io.h"
#include "harness/ops/ep_family.h"

namespace moe::ops {

using gpu::DeviceTensor;

DeviceTensor device_uniform(const Case& c, DType d, const Shape& s, double lo, double hi,
                            const std::string& name) {
  DeviceTensor t(d, s);
  gpu::gemm_detail::fill_hash_uniform(t, mix_seed(c.seed, name), lo, hi, nullptr);
  return t;
}

namespace {

gpu::GemmOptions gemm_options(const Case& c) {
  gpu::GemmOptions o;
  if (c.has("impl")) o.impl = gpu::parse_gemm_impl(c.s("impl"));
  if (c.has("chunk_rows")) o.chunk_rows = c.i("chunk_rows");
  return o;
}

// Group sizes from the case's regime (the generator make_inputs uses), as a host plan and an i32
// tensor on the device.
gpu::GroupPlan plan_of(const Case& c, int64_t rows, DeviceTensor* gs) {
  const int64_t G = c.i("G");
  const auto sizes = make_group_sizes(c, G, rows - c.i("tail", 0), "input.group_sizes");
  Tensor h(DType::i32, {G});
  for (int64_t g = 0; g < G; ++g) h.set(g, static_cast<double>(sizes[g]));
  *gs = DeviceTensor::upload(h);
  return gpu::make_group_plan(sizes, rows);
}

// The row cut of the GEMM family's verification cases: G, the regime and the options kept,
// at most `max_rows` rows (the tail scaled with them).
Case cut_rows(const Case& c, int64_t max_rows) {
  Case s = c;
  const int64_t rows = c.i("M_total"), tail = c.i("tail", 0);
  const int64_t r = std::min<int64_t>(rows, max_rows);
  s.set("M_total", r).set("tail", rows > 0 ? tail * r / rows : int64_t{0});
  return s;
}

// 256 groups of exactly 256 rows: the work of the uniform case without its ragged tails, and of
// cuBLAS's strided-batched yardstick, so the two compare kernel to kernel.
Case even(Case c) {
  c.set("even_groups", true);
  return c;
}

}  // namespace

int64_t batched_rows(const Case& c, const gpu::GroupPlan& p) {
  const int64_t G = p.groups();
  if (c.regime != Regime::uniform || G < 1 || p.used != p.rows || p.used % G != 0) return 0;
  return p.used / G;
}

// ---------------------------------------------------------------------------------------------
// grouped_gemm

std::vector<Case> grouped_gemm_full_bench_cases() {
  return {gemm_bench_case("mixtral_uniform", Regime::uniform, 8, 32768, 4096, 14336),
          gemm_bench_case("mixtral_skewed", Regime::skewed, 8, 32768, 4096, 14336),
          gemm_bench_case("deepseek_uniform", Regime::uniform, 256, 65536, 7168, 2048),
          gemm_bench_case("deepseek_skewed", Regime::skewed, 256, 65536, 7168, 2048),
          even(gemm_bench_case("deepseek_even", Regime::uniform, 256, 65536, 7168, 2048))};
}

Case grouped_gemm_bench_verify_case(const Case& c) {
  Case s = cut_rows(c, 1024);
  s.set("K_d", std::min<int64_t>(c.i("K_d"), 128)).set("N", std::min<int64_t>(c.i("N"), 128));
  return s;
}

OpInfo::Bench grouped_gemm_gpu_bench_device(const Case& c) {
  struct State {
    DeviceTensor x, w, gs, ct, out;
    std::optional<DeviceTensor> bias;
    gpu::GroupPlan plan;
    std::optional<gpu::GroupedGemmBwd> b;
    gpu::GemmOptions o;
  };
  const int64_t G = c.i("G"), M = c.i("M_total"), K = c.i("K_d"), N = c.i("N");
  const DType d = c.dtype;
  auto st = std::make_shared<State>();
  st->o = gemm_options(c);
  // Values of the GemmBench test: U(-1,1) operands (fp32 accumulation makes their scale moot).
  st->x = device_uniform(c, d, {M, K}, -1.0, 1.0, "input.x");
  st->w = device_uniform(c, d, {G, K, N}, -1.0, 1.0, "input.w");
  if (c.b("bias", false)) st->bias = device_uniform(c, d, {G, N}, -1.0, 1.0, "input.bias");
  st->ct = device_uniform(c, d, {M, N}, -1.0, 1.0, "cotangent.out");
  st->plan = plan_of(c, M, &st->gs);
  st->out = DeviceTensor(d, {M, N});
  st->b.emplace(gpu::GroupedGemmBwd{
      DeviceTensor(d, {M, K}), DeviceTensor(d, {G, K, N}),
      st->bias ? std::optional<DeviceTensor>(DeviceTensor(d, {G, N})) : std::nullopt});
  gpu::device_synchronize();
  State* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::grouped_gemm_fwd_into(s->x, s->w, s->plan, ptr(s->bias), s->out, gpu::bench_stream(),
                               s->o);
  };
  bench.bwd = [s] {
    gpu::grouped_gemm_bwd_into(s->ct, s->x, s->w, s->plan, ptr(s->bias), *s->b, gpu::bench_stream(),
                               s->o);
  };
  bench.state = st;
  // Equal FLOPs: one [V, K] x [K, N] product, V = the rows the groups hold.
  bench.dense_m = st->plan.used;
  bench.dense_k = K;
  bench.dense_n = N;
  if (const int64_t m = batched_rows(c, st->plan); m > 0 && !st->bias) {
    bench.batched = {{G, m, K, N}};
  }
  return bench;
}

// ---------------------------------------------------------------------------------------------
// swiglu_expert_ffn

std::vector<Case> swiglu_expert_ffn_full_bench_cases() {
  return {ffn_bench_case("mixtral_uniform", Regime::uniform, 8, 32768, 4096, 14336),
          ffn_bench_case("mixtral_skewed", Regime::skewed, 8, 32768, 4096, 14336),
          ffn_bench_case("deepseek_uniform", Regime::uniform, 256, 65536, 7168, 2048),
          ffn_bench_case("deepseek_skewed", Regime::skewed, 256, 65536, 7168, 2048),
          even(ffn_bench_case("deepseek_even", Regime::uniform, 256, 65536, 7168, 2048))};
}

Case swiglu_expert_ffn_bench_verify_case(const Case& c) {
  Case s = cut_rows(c, 512);
  s.set("H", std::min<int64_t>(c.i("H"), 64)).set("M", std::min<int64_t>(c.i("M"), 64));
  return s;
}

OpInfo::Bench swiglu_expert_ffn_gpu_bench_device(const Case& c) {
  struct State {
    DeviceTensor x, gs, wi_0, wi_1, wo, ct;
    std::optional<DeviceTensor> b0, b1, bo;
    gpu::GroupPlan plan;
    std::optional<gpu::SwigluFfnFwd> f;
    std::optional<gpu::SwigluFfnBwd> b;
    gpu::GemmOptions o;
    Activation act = Activation::silu;
    gpu::FfnWeights weights() const { return {wi_0, wi_1, wo, ptr(b0), ptr(b1), ptr(bo)}; }
  };
  const int64_t G = c.i("G"), Mt = c.i("M_total"), H = c.i("H"), M = c.i("M");
  const DType d = c.dtype;
  auto st = std::make_shared<State>();
  st->o = gemm_options(c);
  st->act = parse_activation(c.s("activation", "silu"));
  // Fan-in scaled weights keep every stage O(1), as make_inputs does.
  const double si = 1.0 / std::sqrt(static_cast<double>(H));
  const double so = 1.0 / std::sqrt(static_cast<double>(M));
  st->x = device_uniform(c, d, {Mt, H}, -1.0, 1.0, "input.x");
  st->wi_0 = device_uniform(c, d, {G, H, M}, -si, si, "input.wi_0");
  st->wi_1 = device_uniform(c, d, {G, H, M}, -si, si, "input.wi_1");
  st->wo = device_uniform(c, d, {G, M, H}, -so, so, "input.wo");
  if (c.b("wi_0_bias", false)) st->b0 = device_uniform(c, d, {G, M}, -0.5, 0.5, "input.wi_0_bias");
  if (c.b("wi_1_bias", false)) st->b1 = device_uniform(c, d, {G, M}, -0.5, 0.5, "input.wi_1_bias");
  if (c.b("wo_bias", false)) st->bo = device_uniform(c, d, {G, H}, -0.5, 0.5, "input.wo_bias");
  st->ct = device_uniform(c, d, {Mt, H}, -1.0, 1.0, "cotangent.out");
  st->plan = plan_of(c, Mt, &st->gs);
  st->f.emplace(gpu::SwigluFfnFwd{DeviceTensor(d, {Mt, H}), DeviceTensor(d, {Mt, M}),
                                  DeviceTensor(d, {Mt, M}), DeviceTensor(d, {Mt, M})});
  auto bias_grad = [&](const std::optional<DeviceTensor>& bias) {
    return bias ? std::optional<DeviceTensor>(DeviceTensor(bias->dtype(), bias->shape()))
                : std::nullopt;
  };
  st->b.emplace(gpu::SwigluFfnBwd{DeviceTensor(d, {Mt, H}), DeviceTensor(d, {G, H, M}),
                                  DeviceTensor(d, {G, H, M}), DeviceTensor(d, {G, M, H}),
                                  bias_grad(st->b0), bias_grad(st->b1), bias_grad(st->bo),
                                  DeviceTensor(d, {Mt, M}), DeviceTensor(d, {Mt, M})});
  // One forward first: the backward reads its saved stages.
  gpu::swiglu_expert_ffn_fwd_into(st->x, st->plan, st->weights(), st->act, *st->f, nullptr, st->o);
  gpu::device_synchronize();
  State* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::swiglu_expert_ffn_fwd_into(s->x, s->plan, s->weights(), s->act, *s->f, gpu::bench_stream(),
                                    s->o);
  };
  bench.bwd = [s] {
    gpu::swiglu_expert_ffn_bwd_into(s->ct, s->x, s->plan, s->weights(), s->f->gate_proj,
                                    s->f->up_proj, s->f->intermediate, s->act, *s->b,
                                    gpu::bench_stream(), s->o);
  };
  bench.state = st;
  // Equal FLOPs: the three [V, H] x [H, M] products of the forward as one [V, H] x [H, 3M].
  bench.dense_m = st->plan.used;
  bench.dense_k = H;
  bench.dense_n = 3 * M;
  // Its products alone (the activation and its gradient are left out): gate and up read one x.
  if (const int64_t m = batched_rows(c, st->plan); m > 0 && !st->b0 && !st->b1 && !st->bo) {
    bench.batched = {{G, m, H, M}, {G, m, H, M, 0}, {G, m, M, H}};
  }
  return bench;
}

// ---------------------------------------------------------------------------------------------

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
