// CUDA binding of the moe_block record; see block_gpu.h.
#ifdef MOE_WITH_CUDA

#include "harness/ops/block_gpu.h"

#include <algorithm>
#include <memory>
#include <optional>

#include "gpu/moe_block.cuh"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"

namespace moe::ops {

namespace {

using gpu::DeviceTensor;

std::optional<DeviceTensor> up_opt(const TensorMap& in, const std::string& key) {
  const Tensor* t = find_tensor(in, key);
  if (!t) return std::nullopt;
  return DeviceTensor::upload(*t);
}

template <class T>
const T* ptr(const std::optional<T>& t) {
  return t ? &*t : nullptr;
}

// The block's inputs on the device.
struct DeviceInputs {
  DeviceTensor x, gate_kernel, wi_0, wi_1, wo;
  std::optional<DeviceTensor> wi_0_bias, wi_1_bias, wo_bias, expert_bias, ct_y, ct_aux;
  explicit DeviceInputs(const TensorMap& in)
      : x(DeviceTensor::upload(in.at("input.x"))),
        gate_kernel(DeviceTensor::upload(in.at("input.gate_kernel"))),
        wi_0(DeviceTensor::upload(in.at("input.wi_0"))),
        wi_1(DeviceTensor::upload(in.at("input.wi_1"))),
        wo(DeviceTensor::upload(in.at("input.wo"))),
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

void put(TensorMap& out, const std::string& key, const DeviceTensor& t) {
  out.emplace(key, t.download());
}
void put(TensorMap& out, const std::string& key, const std::optional<DeviceTensor>& t) {
  if (t) out.emplace(key, t->download());
}

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

OpInfo::Bench moe_block_gpu_bench(const Case& c, const TensorMap& in) {
  struct State {
    MoeBlockParams p;
    DeviceInputs d;
    std::optional<gpu::MoeBlockFwd> saved;  // the forward state the backward consumes
    State(const Case& c, const TensorMap& in) : p(moe_block_params(c)), d(in) {}
  };
  auto st = std::make_shared<State>(c, in);
  const gpu::RunOptions fast{/*validate=*/false, /*poison=*/false};
  st->saved.emplace(gpu::moe_block_fwd(st->d.view(), st->p, nullptr, fast));
  OpInfo::Bench b;
  b.fwd = [st, fast] { gpu::moe_block_fwd(st->d.view(), st->p, nullptr, fast); };
  b.bwd = [st, fast] {
    gpu::moe_block_bwd(*st->d.ct_y, ptr(st->d.ct_aux), st->d.view(), *st->saved, st->p, nullptr,
                       fast);
  };
  b.state = st;
  return b;
}

std::vector<Case> moe_block_gpu_bench_cases() {
  auto base = [](const std::string& name, int64_t B, int64_t H, int64_t M, int64_t E, int64_t K) {
    Case c;
    c.op = "moe_block";
    c.dtype = DType::bf16;
    c.seed = 7;
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
