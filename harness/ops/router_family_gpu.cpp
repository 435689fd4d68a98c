// CUDA runners of the router-family records (topk_router, aux_loss_scores, moe_aux_loss):
// host tensors in, host tensors out. Every output is allocated, poisoned with 0xFF bytes (NaN for
// floats, 0xFF for maps) and only then handed to the kernels, so an element the kernel leaves
// unwritten shows up in the comparison. The backward consumes the GPU forward's own routing_map
// and saved_scores, as a training step would.
#ifdef MOE_WITH_CUDA

#include <memory>
#include <optional>

#include "gpu/aux_loss.cuh"
#include "gpu/bench_util.cuh"
#include "gpu/topk_router.cuh"
#include "harness/ops/router_family.h"

namespace moe::ops {

namespace {

constexpr uint8_t kPoison = 0xFF;

const Tensor* find(const TensorMap& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? nullptr : &it->second;
}

AuxLossParams aux_loss_params(const Case& c) {
  AuxLossParams p;
  p.topk = c.i("topk");
  p.coeff = c.f("coeff", 1e-2);
  p.num_experts = c.i("num_experts", 0);
  p.total_num_tokens = c.i("total_num_tokens", 0);
  return p;
}

// ---- topk_router ----------------------------------------------------------------------------

struct RouterState {
  RouterParams p;
  gpu::DeviceTensor logits;
  std::optional<gpu::DeviceTensor> bias;
  gpu::TopkRouterFwd out;
  std::optional<gpu::DeviceTensor> ct, grad;

  RouterState(const Case& c, const TensorMap& in) : p(router_params(c)) {
    logits = gpu::DeviceTensor::upload(in.at("input.logits"));
    if (const Tensor* b = find(in, "input.expert_bias")) bias = gpu::DeviceTensor::upload(*b);
    out = gpu::topk_router_fwd_outputs(logits.meta(), p);
    if (const Tensor* g = find(in, "cotangent.probs")) {
      ct = gpu::DeviceTensor::upload(*g);
      grad.emplace(g->dtype(), g->shape());
    }
  }
  void poison() {
    out.probs.fill_bytes(kPoison);
    out.routing_map.fill_bytes(kPoison);
    out.saved_scores.fill_bytes(kPoison);
    if (grad) grad->fill_bytes(kPoison);
  }
  void fwd(gpu::Stream s = nullptr) {
    gpu::topk_router_fwd_into(logits, bias ? &*bias : nullptr, p, out, s);
  }
  void bwd(gpu::Stream s = nullptr) {
    gpu::topk_router_bwd_into(*ct, out.routing_map, out.saved_scores, p, *grad, s);
  }
};

// ---- aux_loss_scores ------------------------------------------------------------------------

struct ScoresState {
  int64_t topk;
  ScoreFunction f;
  MapFormat fmt;
  gpu::DeviceTensor logits;
  gpu::AuxLossScoresFwd out;
  std::optional<gpu::DeviceTensor> ct, grad;

  ScoresState(const Case& c, const TensorMap& in)
      : topk(c.i("topk")),
        f(parse_score_function(c.s("score_function"))),
        fmt(parse_map_format(c.s("routing_map_format", "bytemap"))) {
    const Tensor& x = in.at("input.logits");
    logits = gpu::DeviceTensor::upload(x);
    out = gpu::aux_loss_scores_fwd_outputs(logits.meta(), fmt);
    if (const Tensor* g = find(in, "cotangent.scores")) {
      ct = gpu::DeviceTensor::upload(*g);
      grad.emplace(x.dtype(), x.shape());
    }
  }
  void poison() {
    out.scores.fill_bytes(kPoison);
    out.routing_map.fill_bytes(kPoison);
    out.saved_scores.fill_bytes(kPoison);
    if (grad) grad->fill_bytes(kPoison);
  }
  void fwd(gpu::Stream s = nullptr) { gpu::aux_loss_scores_fwd_into(logits, topk, f, fmt, out, s); }
  void bwd(gpu::Stream s = nullptr) {
    gpu::aux_loss_scores_bwd_into(*ct, out.saved_scores, f, logits.dtype(), *grad, s);
  }
};

// ---- moe_aux_loss ---------------------------------------------------------------------------

struct LossState {
  AuxLossParams p;
  gpu::DeviceTensor probs, tpe;
  gpu::MoeAuxLossFwd out;
  std::optional<gpu::DeviceTensor> ct, grad;

  LossState(const Case& c, const TensorMap& in) : p(aux_loss_params(c)) {
    probs = gpu::DeviceTensor::upload(in.at("input.probs"));
    tpe = gpu::DeviceTensor::upload(in.at("input.tokens_per_expert"));
    out = gpu::moe_aux_loss_fwd_outputs(probs.meta());
    if (const Tensor* g = find(in, "cotangent.aux_loss")) {
      ct = gpu::DeviceTensor::upload(*g);
      grad.emplace(g->dtype(), Shape{probs.dim(0), probs.dim(1)});
    }
  }
  void poison() {
    out.aux_loss.fill_bytes(kPoison);
    out.const_buf.fill_bytes(kPoison);
    if (grad) grad->fill_bytes(kPoison);
  }
  void fwd(gpu::Stream s = nullptr) { gpu::moe_aux_loss_fwd_into(probs, tpe, p, out, s); }
  void bwd(gpu::Stream s = nullptr) {
    gpu::moe_aux_loss_bwd_into(*ct, out.const_buf, tpe, probs.dim(0), *grad, s);
  }
};

template <class State>
OpInfo::Bench bench(const Case& c, const TensorMap& in) {
  auto st = std::make_shared<State>(c, in);
  st->poison();
  st->fwd();  // the backward's inputs (routing_map, saved scores) come from a real forward
  gpu::device_synchronize();
  OpInfo::Bench b;
  // Launches go to the benchmark stream, so the timer can capture them into a CUDA graph.
  b.fwd = [st] { st->fwd(gpu::bench_stream()); };
  if (st->ct) b.bwd = [st] { st->bwd(gpu::bench_stream()); };
  b.state = st;
  return b;
}

}  // namespace

TensorMap topk_router_gpu(const Case& c, const TensorMap& in) {
  RouterState st(c, in);
  st.poison();
  st.fwd();
  if (st.ct) st.bwd();
  TensorMap m;
  m.emplace("output.probs", st.out.probs.download());
  m.emplace("output.routing_map", st.out.routing_map.download());
  m.emplace("output.saved_scores", st.out.saved_scores.download());
  if (st.grad) m.emplace("grad.logits", st.grad->download());
  return m;
}

TensorMap aux_loss_scores_gpu(const Case& c, const TensorMap& in) {
  ScoresState st(c, in);
  st.poison();
  st.fwd();
  if (st.ct) st.bwd();
  TensorMap m;
  m.emplace("output.scores", st.out.scores.download());
  m.emplace("output.routing_map", st.out.routing_map.download());
  m.emplace("output.saved_scores", st.out.saved_scores.download());
  if (st.grad) m.emplace("grad.logits", st.grad->download());
  return m;
}

TensorMap moe_aux_loss_gpu(const Case& c, const TensorMap& in) {
  LossState st(c, in);
  st.poison();
  st.fwd();
  if (st.ct) st.bwd();
  TensorMap m;
  m.emplace("output.aux_loss", st.out.aux_loss.download());
  m.emplace("output.const_buf", st.out.const_buf.download());
  if (st.grad) m.emplace("grad.probs", st.grad->download());
  return m;
}

OpInfo::Bench topk_router_gpu_bench(const Case& c, const TensorMap& in) {
  return bench<RouterState>(c, in);
}
OpInfo::Bench aux_loss_scores_gpu_bench(const Case& c, const TensorMap& in) {
  return bench<ScoresState>(c, in);
}
OpInfo::Bench moe_aux_loss_gpu_bench(const Case& c, const TensorMap& in) {
  return bench<LossState>(c, in);
}

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
