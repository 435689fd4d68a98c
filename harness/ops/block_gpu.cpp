// CUDA binding of the moe_block record; see block_gpu.h.
#ifdef MOE_WITH_CUDA

#include "harness/ops/block_gpu.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include "gpu/bench_util.cuh"
#include "gpu/moe_block.cuh"
#include "harness/ops/bench_device.h"
#include "harness/ops/device_io.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"

namespace moe::ops {

namespace {

using gpu::DeviceTensor;

// The block's inputs on the device.
struct DeviceInputs {
  DeviceTensor x, gate_kernel, wi_0, wi_1, wo;
  std::optional<DeviceTensor> wi_0_bias, wi_1_bias, wo_bias, expert_bias, ct_y, ct_aux;
  explicit DeviceInputs(const TensorMap& in)
      : x(up(in, "input.x")),
        gate_kernel(up(in, "input.gate_kernel")),
        wi_0(up(in, "input.wi_0")),
        wi_1(up(in, "input.wi_1")),
        wo(up(in, "input.wo")),
        wi_0_bias(up_opt(in, "input.wi_0_bias")),
        wi_1_bias(up_opt(in, "input.wi_1_bias")),
        wo_bias(up_opt(in, "input.wo_bias")),
        expert_bias(up_opt(in, "input.expert_bias")),
        ct_y(up_opt(in, "cotangent.y")),
        ct_aux(up_opt(in, "cotangent.aux_loss")) {}
  gpu::MoeBlockInputs view() const {
    return {x,
            gate_kernel,
            wi_0,
            wi_1,
            wo,
            ptr(wi_0_bias),
            ptr(wi_1_bias),
            ptr(wo_bias),
            ptr(expert_bias)};
  }
};

gpu::Communicator* g_block_comm = nullptr;

}  // namespace

void set_block_communicator(gpu::Communicator* comm) {
  g_block_comm = comm;
}
gpu::Communicator* block_communicator() {
  return g_block_comm;
}

TensorMap moe_block_gpu(const Case& c, const TensorMap& in) {
  const MoeBlockParams p = moe_block_params(c);
  const DeviceInputs d(in);
  const gpu::MoeBlockInputs v = d.view();
  const gpu::RunOptions check{/*validate=*/true, /*poison=*/true};
  std::optional<gpu::InProcessCommunicator> own;
  if (!g_block_comm) own.emplace(static_cast<int>(std::max<int64_t>(p.ep_size, 1)));
  gpu::Communicator& comm = g_block_comm ? *g_block_comm : *own;
  gpu::MoeBlockFwd f = gpu::moe_block_fwd(comm, v, p, nullptr, check);
  TensorMap out;
  put(out, "output.y", f.y);
  put(out, "output.aux_loss", f.aux_loss);
  put(out, "output.routing_map", f.routing_map);
  put(out, "output.probs", f.probs);
  put(out, "output.group_sizes", f.group_sizes);
  if (d.ct_y) {
    gpu::MoeBlockGrads g =
        gpu::moe_block_bwd(comm, *d.ct_y, ptr(d.ct_aux), v, f, p, nullptr, check);
    put(out, "grad.x", g.x);
    put(out, "grad.gate_kernel", g.gate_kernel);
    put(out, "grad.wi_0", g.wi_0);
    put(out, "grad.wi_1", g.wi_1);
    put(out, "grad.wo", g.wo);
    put(out, "grad.wi_0_bias", g.wi_0_bias);
    put(out, "grad.wi_1_bias", g.wi_1_bias);
    put(out, "grad.wo_bias", g.wo_bias);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Benchmarks

namespace {

// The block's inputs on the device and one forward's state (what the backward consumes).
struct BlockBench {
  MoeBlockParams p;
  DeviceTensor x, gate_kernel, wi_0, wi_1, wo, ct_y;
  std::optional<DeviceTensor> wi_0_bias, wi_1_bias, wo_bias, expert_bias, ct_aux;
  std::optional<gpu::MoeBlockFwd> saved;
  gpu::MoeBlockInputs view() const {
    return {x,
            gate_kernel,
            wi_0,
            wi_1,
            wo,
            ptr(wi_0_bias),
            ptr(wi_1_bias),
            ptr(wo_bias),
            ptr(expert_bias)};
  }
};

// fwd() runs the forward, bwd() the backward on the saved forward state, both on bench_stream()
// without validation. The block allocates its outputs and reads group sizes back (it
// synchronises), so it is timed by direct launches, not a CUDA graph.
OpInfo::Bench block_bench(const std::shared_ptr<BlockBench>& st, const Case& c) {
  const gpu::RunOptions fast{/*validate=*/false, /*poison=*/false};
  st->saved.emplace(gpu::moe_block_fwd(st->view(), st->p, nullptr, fast));
  gpu::device_synchronize();
  BlockBench* s = st.get();
  OpInfo::Bench b;
  b.fwd = [s, fast] { gpu::moe_block_fwd(s->view(), s->p, gpu::bench_stream(), fast); };
  b.bwd = [s, fast] {
    gpu::moe_block_bwd(s->ct_y, ptr(s->ct_aux), s->view(), *s->saved, s->p, gpu::bench_stream(),
                       fast);
  };
  b.state = st;
  b.tokens = static_cast<double>(c.i("B") * c.i("S"));
  // The rate of the block's roofline (bench times it; the row stays token-level): the expert
  // FFN's equal-FLOP dense GEMM, its three [T*K, H] x [H, M] products as one [T*K, H] x [H, 3M]
  // (as swiglu_expert_ffn's benchmark does).
  b.dense_m = c.i("B") * c.i("S") * st->p.topk;
  b.dense_k = c.i("H");
  b.dense_n = 3 * c.i("M");
  b.graph = false;
  return b;
}

}  // namespace

OpInfo::Bench moe_block_gpu_bench(const Case& c, const TensorMap& in) {
  auto st = std::make_shared<BlockBench>();
  st->p = moe_block_params(c);
  st->x = DeviceTensor::upload(in.at("input.x"));
  st->gate_kernel = DeviceTensor::upload(in.at("input.gate_kernel"));
  st->wi_0 = DeviceTensor::upload(in.at("input.wi_0"));
  st->wi_1 = DeviceTensor::upload(in.at("input.wi_1"));
  st->wo = DeviceTensor::upload(in.at("input.wo"));
  st->wi_0_bias = up_opt(in, "input.wi_0_bias");
  st->wi_1_bias = up_opt(in, "input.wi_1_bias");
  st->wo_bias = up_opt(in, "input.wo_bias");
  st->expert_bias = up_opt(in, "input.expert_bias");
  st->ct_y = DeviceTensor::upload(in.at("cotangent.y"));
  st->ct_aux = up_opt(in, "cotangent.aux_loss");
  return block_bench(st, c);
}

// Device inputs in the ranges of make_inputs: x and the cotangent U(-1,1), fan-in scaled
// U(-sqrt(3/fan_in), sqrt(3/fan_in)) weights (variance 1/fan_in), expert bias U(-0.3,0.3) in f32.
OpInfo::Bench moe_block_gpu_bench_device(const Case& c) {
  auto st = std::make_shared<BlockBench>();
  st->p = moe_block_params(c);
  const int64_t B = c.i("B"), S = c.i("S"), H = c.i("H"), M = c.i("M"), E = st->p.num_experts;
  const DType d = c.dtype;
  const double sh = std::sqrt(3.0 / static_cast<double>(H));
  const double sm = std::sqrt(3.0 / static_cast<double>(M));
  st->x = device_uniform(c, d, {B, S, H}, -1.0, 1.0, "input.x");
  st->gate_kernel = device_uniform(c, d, {H, E}, -sh, sh, "input.gate_kernel");
  st->wi_0 = device_uniform(c, d, {E, H, M}, -sh, sh, "input.wi_0");
  st->wi_1 = device_uniform(c, d, {E, H, M}, -sh, sh, "input.wi_1");
  st->wo = device_uniform(c, d, {E, M, H}, -sm, sm, "input.wo");
  if (c.b("wi_0_bias", false)) {
    st->wi_0_bias = device_uniform(c, d, {E, M}, -0.5, 0.5, "input.wi_0_bias");
  }
  if (c.b("wi_1_bias", false)) {
    st->wi_1_bias = device_uniform(c, d, {E, M}, -0.5, 0.5, "input.wi_1_bias");
  }
  if (c.b("wo_bias", false)) st->wo_bias = device_uniform(c, d, {E, H}, -0.5, 0.5, "input.wo_bias");
  if (c.b("expert_bias", false)) {
    st->expert_bias = device_uniform(c, DType::f32, {E}, -0.3, 0.3, "input.expert_bias");
  }
  st->ct_y = device_uniform(c, d, {B, S, H}, -1.0, 1.0, "cotangent.y");
  if (st->p.aux_loss()) {
    st->ct_aux = device_uniform(c, DType::f32, {}, 0.5, 1.5, "cotangent.aux_loss");
  }
  return block_bench(st, c);
}

Case moe_block_bench_verify_case(const Case& c) {
  Case s = c;
  s.set("B", int64_t{1}).set("S", std::min<int64_t>(c.i("S"), 64));
  s.set("H", std::min<int64_t>(c.i("H"), 64)).set("M", std::min<int64_t>(c.i("M"), 64));
  return s;
}

std::vector<Case> moe_block_gpu_bench_cases() {
  auto base = [](const std::string& name, int64_t B, int64_t H, int64_t M, int64_t E, int64_t K) {
    Case c = CaseBuilder("moe_block", DType::bf16).seed(7);
    c.set("name", name).set("B", B).set("S", int64_t{4096}).set("H", H).set("M", M);
    c.set("num_experts", E).set("topk", K).set("num_groups", int64_t{0});
    c.set("group_topk", int64_t{0}).set("score_function", "softmax");
    c.set("use_pre_softmax", false).set("expert_bias", false).set("scaling_factor", 1.0);
    c.set("activation", "silu").set("aux_loss_coeff", 0.0).set("backend", "kernel");
    c.set("align_size", int64_t{0}).set("ep_size", int64_t{1}).set("dp_size", int64_t{1});
    c.set("probs_dtype", "float32").set("router_logits_dtype", "float32");
    c.set("wi_0_bias", false).set("wi_1_bias", false).set("wo_bias", false);
    return c;
  };
  std::vector<Case> v;
  v.push_back(base("mixtral_like", 4, 4096, 14336, 8, 2));
  v.push_back(base("deepseek_like", 2, 7168, 2048, 256, 8)
                  .set("score_function", "sigmoid")
                  .set("expert_bias", true)
                  .set("num_groups", int64_t{8})
                  .set("group_topk", int64_t{4})
                  .set("scaling_factor", 2.5));
  return v;
}

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
