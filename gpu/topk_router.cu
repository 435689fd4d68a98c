// CUDA twin of reference/topk_router.cpp (SPEC §1). Host wrappers: the shared validation of
// harness/core/params/router.h, output checks, then one row-kernel launch (gpu/router_row.cuh).
#include "gpu/topk_router.cuh"

#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/router_row.cuh"

namespace moe::gpu {

static_assert(kMaxExperts <= score::kMaxRowExperts,
              "the row kernels hold at most score::kMaxRowExperts experts per row");

namespace rowk {

int grid_for_rows(int64_t rows, int rows_per_block, int blocks_per_sm) {
  static const int sms = [] {
    int dev = 0, n = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const int64_t cap = static_cast<int64_t>(sms) * blocks_per_sm;
  const int64_t need = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(need < cap ? need : cap);
}

namespace {
bool env_flag(const char* name, bool def) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  return std::string(v) != "0";
}
}  // namespace

bool launch_pdl() {
  static const bool on = env_flag("MOE_ROUTER_PDL", true);
  return on;
}
bool use_fast_fwd() {
  static const bool on = env_flag("MOE_ROUTER_FAST", true);
  return on;
}
int prefetch_level() {
  static const int level = [] {
    const char* v = std::getenv("MOE_ROUTER_PREFETCH");
    if (v == nullptr || *v == '\0') return 2;
    const int x = std::atoi(v);
    return x < 0 ? 0 : (x > 2 ? 2 : x);
  }();
  return level;
}
bool use_l2_prefetch() {
  static const bool on = env_flag("MOE_ROUTER_L2PF", true);
  return on;
}
int fwd8_variant() {
  static const int v = [] {
    const char* e = std::getenv("MOE_ROUTER_FWD8");
    if (e == nullptr || *e == '\0') return 1;
    const std::string x(e);
    if (x == "0") return 0;
    if (x == "1") return 1;
    throw std::invalid_argument("MOE_ROUTER_FWD8: expected 0 or 1, got '" + x + "'");
  }();
  return v;
}

// Module memory (one copy per device context), so nothing to free: a cudaMalloc'd table was still
// held at exit, which compute-sanitizer's leak check reports.
__device__ __align__(16) float g_sigmoid_table[2 * kSigN];

const float* sigmoid_table(cudaStream_t s) {
  const char* e = std::getenv("MOE_ROUTER_LUT");
  if (e != nullptr && std::string(e) == "0") return nullptr;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  static std::mutex mu;
  static std::map<int, const float*> tables;  // per device: the uploaded table's address
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = tables.find(dev); it != tables.end()) return it->second;
  if (cap != cudaStreamCaptureStatusNone) return nullptr;  // uploaded by a later, plain call
  std::vector<float> host(2 * kSigN);
  for (uint32_t i = 0; i < kSigN; ++i) {
    const float x = score::bits_float(sig_pattern(i) << 16);  // bf16 -> f32: the high half
    host[2 * i] = score::sigmoid_f32(x);
    host[2 * i + 1] = score::sigmoid_f32(-x);
  }
  // Synchronous, on a stream of its own: the table is complete before any launch reads it, on
  // any stream.
  void* d = nullptr;
  cudaStream_t up = nullptr;
  MOE_CUDA_CHECK(cudaGetSymbolAddress(&d, g_sigmoid_table));
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&up, cudaStreamNonBlocking));
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, up));
  MOE_CUDA_CHECK(cudaStreamSynchronize(up));
  MOE_CUDA_CHECK(cudaStreamDestroy(up));
  tables[dev] = static_cast<const float*>(d);
  return tables[dev];
}

}  // namespace rowk

namespace {

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

void require_out(const DeviceTensor& t, DType dt, const Shape& shape, const char* what) {
  if (t.dtype() != dt || t.shape() != shape) {
    bad(std::string(what) + ": expected " + std::string(dtype_name(dt)) + shape_str(shape) +
        ", got " + t.describe());
  }
}

int score_fn_code(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::softmax:
      return rowk::kSoftmax;
    case ScoreFunction::sigmoid:
      return rowk::kSigmoid;
    case ScoreFunction::sqrtsoftplus:
      return rowk::kSqrtSoftplus;
  }
  return rowk::kSoftmax;
}

DType map_dtype(MapFormat f) {
  return f == MapFormat::bytemap ? DType::boolean : DType::u8;
}

}  // namespace

TopkRouterFwd topk_router_fwd_outputs(const TensorMeta& logits, const RouterParams& p) {
  require_rank(logits, 2, "logits");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  return TopkRouterFwd{
      DeviceTensor(logits.dtype, {T, E}),
      DeviceTensor(map_dtype(p.routing_map_format), routing_map_shape(T, E, p.routing_map_format)),
      DeviceTensor(DType::f32, {T, E})};
}

void topk_router_fwd_into(const DeviceTensor& logits, const DeviceTensor* expert_bias,
                          const RouterParams& p, TopkRouterFwd& out, Stream s) {
  const TensorMeta bm = expert_bias ? expert_bias->meta() : TensorMeta{};
  validate_topk_router(logits.meta(), expert_bias ? &bm : nullptr, p);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  require_out(out.probs, logits.dtype(), {T, E}, "probs");
  require_out(out.routing_map, map_dtype(p.routing_map_format),
              routing_map_shape(T, E, p.routing_map_format), "routing_map");
  require_out(out.saved_scores, DType::f32, {T, E}, "saved_scores");
  if (T == 0) return;

  rowk::FwdArgs a;
  a.logits = logits.data();
  a.bias = expert_bias ? expert_bias->data() : nullptr;
  a.bias_dtype = expert_bias ? static_cast<int>(expert_bias->dtype()) : 0;
  a.probs = out.probs.data();
  a.map = out.routing_map.data<uint8_t>();
  a.saved = out.saved_scores.data<float>();
  a.T = T;
  a.E = static_cast<int>(E);
  a.K = static_cast<int>(p.topk);
  a.fn = score_fn_code(p.score_function);
  a.pre = p.use_pre_softmax ? 1 : 0;
  a.G = p.grouped() ? static_cast<int>(p.num_groups) : 0;
  a.gk = p.grouped() ? static_cast<int>(p.group_topk) : 0;
  a.scaling = static_cast<float>(p.scaling_factor);
  a.bitmap = p.routing_map_format == MapFormat::bitmap_u8 ? 1 : 0;
  a.vec = (E % 8 == 0 && aligned16(a.logits) && aligned16(a.probs) && aligned16(a.map) &&
           aligned16(a.saved))
              ? 1
              : 0;
  dispatch_float(logits.dtype(), [&](auto tag) {
    rowk::launch_fwd<decltype(tag), false>(a, reinterpret_cast<cudaStream_t>(s));
  });
}

TopkRouterFwd topk_router_fwd(const DeviceTensor& logits, const DeviceTensor* expert_bias,
                              const RouterParams& p, Stream s) {
  const TensorMeta bm = expert_bias ? expert_bias->meta() : TensorMeta{};
  validate_topk_router(logits.meta(), expert_bias ? &bm : nullptr, p);
  TopkRouterFwd out = topk_router_fwd_outputs(logits.meta(), p);
  topk_router_fwd_into(logits, expert_bias, p, out, s);
  return out;
}

namespace {

// The reference's backward checks (reference/topk_router.cpp), in the same order.
void validate_bwd(const DeviceTensor& grad_probs, const DeviceTensor& routing_map,
                  const DeviceTensor& saved_scores, const RouterParams& p) {
  require_rank(grad_probs.meta(), 2, "grad_probs");
  const DType dg = grad_probs.dtype();
  if (!(dg == DType::f32 || dg == DType::bf16 || dg == DType::f16)) {
    bad("grad_probs: unsupported dtype " + std::string(dtype_name(dg)));
  }
  const int64_t T = grad_probs.dim(0), E = grad_probs.dim(1);
  require_shape(saved_scores.meta(), {T, E}, "saved_scores");
  if (saved_scores.dtype() != DType::f32) {
    bad("saved_scores: must be float32, got " + saved_scores.describe());
  }
  if (routing_map.dtype() != DType::u8 && routing_map.dtype() != DType::boolean) {
    bad("routing_map: must be bool (bytemap) or uint8 (bitmap_u8), got " + routing_map.describe());
  }
  const MapFormat fmt =
      routing_map.dtype() == DType::u8 ? MapFormat::bitmap_u8 : MapFormat::bytemap;
  require_shape(routing_map.meta(), routing_map_shape(T, E, fmt), "routing_map");
  if (E <= 0) bad("num_experts: must be > 0, got " + std::to_string(E));
  if (E > kMaxExperts) {
    bad("num_experts: " + std::to_string(E) + " exceeds the supported maximum " +
        std::to_string(kMaxExperts));
  }
  if (!std::isfinite(p.scaling_factor)) {
    bad("scaling_factor: must be finite, got " + std::to_string(p.scaling_factor));
  }
}

}  // namespace

void topk_router_bwd_into(const DeviceTensor& grad_probs, const DeviceTensor& routing_map,
                          const DeviceTensor& saved_scores, const RouterParams& p,
                          DeviceTensor& grad_logits, Stream s) {
  validate_bwd(grad_probs, routing_map, saved_scores, p);
  const int64_t T = grad_probs.dim(0), E = grad_probs.dim(1);
  require_out(grad_logits, grad_probs.dtype(), {T, E}, "grad_logits");
  if (T == 0) return;
  rowk::BwdArgs a;
  a.grad = grad_probs.data();
  a.map = routing_map.data<uint8_t>();
  a.saved = saved_scores.data<float>();
  a.out = grad_logits.data();
  a.T = T;
  a.E = static_cast<int>(E);
  a.K = static_cast<int>(p.topk);
  a.fn = score_fn_code(p.score_function);
  a.pre = p.use_pre_softmax ? 1 : 0;
  a.bitmap = routing_map.dtype() == DType::u8 ? 1 : 0;
  a.aux = 0;
  a.scaling = static_cast<float>(p.scaling_factor);
  a.vec = (E % 8 == 0 && aligned16(a.grad) && aligned16(a.map) && aligned16(a.saved) &&
           aligned16(a.out))
              ? 1
              : 0;
  dispatch_float(grad_probs.dtype(), [&](auto tag) {
    using TG = decltype(tag);
    rowk::launch_bwd<TG, TG>(a, reinterpret_cast<cudaStream_t>(s));
  });
}

DeviceTensor topk_router_bwd(const DeviceTensor& grad_probs, const DeviceTensor& routing_map,
                             const DeviceTensor& saved_scores, const RouterParams& p, Stream s) {
  validate_bwd(grad_probs, routing_map, saved_scores, p);
  DeviceTensor grad(grad_probs.dtype(), grad_probs.shape());
  topk_router_bwd_into(grad_probs, routing_map, saved_scores, p, grad, s);
  return grad;
}

}  // namespace moe::gpu
