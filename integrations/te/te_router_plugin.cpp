// moe-harness plugin "te": NVIDIA TransformerEngine's router-family kernels (TE 2.20, C API of
// libtransformer_engine.so, transformer_engine/fused_router.h) run through the plugin ABI
// (include/moe_harness/plugin.h), so that `moe-harness check --plugin libmoe_te_plugin.so` judges
// TE's own kernels against the CPU reference (SPEC §1-§3, issue 18).
//
// One run = TE's training step: the forward, then the backward fed with the forward's own saved
// outputs (routing_map, intermediate_output = saved_scores, Const_buf = const_buf) and the
// harness's cotangent, all on the harness's stream. Nothing is emulated: a case TE cannot take
// is NOT_SUPPORTED (naming the TE constraint), an exception TE throws for a case SPEC calls valid
// is ERROR (with TE's text). Output buffers stay as the harness poisoned them; TE's framework
// wrappers pre-initialise none of them (pytorch/csrc/extensions/router.cpp:107-112, 359-362,
// 430-431, 479-480 and pytorch/router.py:159, 387 allocate with at::empty / torch.empty; the
// JAX FFI handlers, jax/csrc/extensions/router.cpp, take XLA's uninitialised result buffers), so
// this plugin memsets nothing.
//
// TE source references are file:line in NVIDIA/TransformerEngine at d0067d0 (its
// fused_router.h and transformer_engine.h are byte-identical to the 2.20.2 wheel's headers).
//
// TE is loaded at the first run with dlopen(RTLD_LAZY | RTLD_LOCAL): the library references a
// cuBLASLt symbol newer than some installs, which an immediate-binding load refuses. Library:
// $MOE_TE_LIB, else the compiled-in MOE_TE_DEFAULT_LIB (${MOE_TE_ROOT}/lib/...), else
// libtransformer_engine.so on the loader's path. nvte_* functions throw C++ exceptions on bad
// arguments; every one is caught here, none crosses the C ABI.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <transformer_engine/fused_router.h>
#include <transformer_engine/transformer_engine.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moe_harness/plugin.h"

#ifndef MOE_TE_VERSION
#define MOE_TE_VERSION "2.20.x"
#endif
#ifndef MOE_TE_DEFAULT_LIB
#define MOE_TE_DEFAULT_LIB ""
#endif

namespace {

// ---- outcomes other than OK ---------------------------------------------------------------

struct Unsupported {  // MOE_STATUS_NOT_SUPPORTED
  std::string why;
};
struct Failure {  // MOE_STATUS_ERROR
  std::string why;
};

// ---- the TE library, loaded once ----------------------------------------------------------

struct TeApi {
  std::string path;   // the library that was loaded
  std::string error;  // non-empty: loading failed, and why
  decltype(&nvte_create_tensor) create_tensor = nullptr;
  decltype(&nvte_destroy_tensor) destroy_tensor = nullptr;
  decltype(&nvte_set_tensor_param_v2) set_tensor_param = nullptr;
  decltype(&nvte_fused_topk_with_score_function_forward_v2) topk_fwd = nullptr;
  decltype(&nvte_fused_topk_with_score_function_backward_v2) topk_bwd = nullptr;
  decltype(&nvte_fused_score_for_moe_aux_loss_forward_v2) scores_fwd = nullptr;
  decltype(&nvte_fused_score_for_moe_aux_loss_backward) scores_bwd = nullptr;
  decltype(&nvte_fused_moe_aux_loss_forward) aux_fwd = nullptr;
  decltype(&nvte_fused_moe_aux_loss_backward) aux_bwd = nullptr;
};

template <typename F>
bool bind(void* handle, const char* name, F& fn, std::string& error) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (!sym) {
    const char* e = dlerror();
    error += std::string(error.empty() ? "" : "; ") + "no symbol " + name +
             (e ? ": " + std::string(e) : "");
    return false;
  }
  fn = reinterpret_cast<F>(sym);
  return true;
}

void load(TeApi& api) {
  std::vector<std::string> candidates;
  const char* env = std::getenv("MOE_TE_LIB");
  if (env && *env) {
    candidates.emplace_back(env);  // an explicit choice: no fallback
  } else {
    const std::string built_in = MOE_TE_DEFAULT_LIB;
    if (!built_in.empty() && access(built_in.c_str(), F_OK) == 0) candidates.push_back(built_in);
    candidates.emplace_back("libtransformer_engine.so");
  }
  std::string tried;
  void* handle = nullptr;
  for (const std::string& path : candidates) {
    handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL);
    if (handle) {
      api.path = path;
      break;
    }
    const char* e = dlerror();
    tried += std::string(tried.empty() ? "" : "; ") + (e ? e : path + ": dlopen failed");
  }
  if (!handle) {
    api.error = "cannot load TransformerEngine (" + tried +
                "); set MOE_TE_LIB to libtransformer_engine.so and LD_LIBRARY_PATH to its "
                "dependencies (on the GPU machine: export LD_LIBRARY_PATH=$(bash .te/unpack_te.sh "
                ".te))";
    return;
  }
  std::string missing;
  bool ok = true;
  ok &= bind(handle, "nvte_create_tensor", api.create_tensor, missing);
  ok &= bind(handle, "nvte_destroy_tensor", api.destroy_tensor, missing);
  ok &= bind(handle, "nvte_set_tensor_param_v2", api.set_tensor_param, missing);
  ok &= bind(handle, "nvte_fused_topk_with_score_function_forward_v2", api.topk_fwd, missing);
  ok &= bind(handle, "nvte_fused_topk_with_score_function_backward_v2", api.topk_bwd, missing);
  ok &= bind(handle, "nvte_fused_score_for_moe_aux_loss_forward_v2", api.scores_fwd, missing);
  ok &= bind(handle, "nvte_fused_score_for_moe_aux_loss_backward", api.scores_bwd, missing);
  ok &= bind(handle, "nvte_fused_moe_aux_loss_forward", api.aux_fwd, missing);
  ok &= bind(handle, "nvte_fused_moe_aux_loss_backward", api.aux_bwd, missing);
  if (!ok) api.error = api.path + " is not the TransformerEngine 2.20 C API: " + missing;
  // The handle is kept for the life of the process (TE holds global state, e.g. its tensor pool).
}

const TeApi& te_api() {
  static TeApi api;
  static std::once_flag once;
  std::call_once(once, [] { load(api); });
  return api;
}

// ---- the harness's tensors ---------------------------------------------------------------

const DLTensor* find(const moe_named_tensor* ts, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    if (ts[i].name && std::strcmp(ts[i].name, name) == 0) return &ts[i].tensor;
  return nullptr;
}

std::string shape_str(const DLTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? "," : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// A tensor the op needs, on the device, compact, of rank `ndim`.
const DLTensor& need(const moe_call* c, bool input, const char* name, int ndim) {
  const DLTensor* t =
      input ? find(c->inputs, c->num_inputs, name) : find(c->outputs, c->num_outputs, name);
  if (!t) throw Failure{std::string("the harness passed no tensor ") + name};
  if (t->device.device_type != kDLCUDA)
    throw Failure{std::string(name) + " is not in CUDA device memory"};
  if (t->ndim != ndim)
    throw Failure{std::string(name) + " has rank " + std::to_string(t->ndim) + ", expected " +
                  std::to_string(ndim)};
  if (t->dtype.lanes != 1) throw Failure{std::string(name) + " has vector lanes"};
  if (t->strides) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect)
        throw Failure{std::string(name) + " is not compact row-major"};
      expect *= t->shape[i];
    }
  }
  return *t;
}

const DLTensor* optional_input(const moe_call* c, const char* name) {
  return find(c->inputs, c->num_inputs, name) ? &need(c, true, name, 1) : nullptr;
}

void expect_shape(const DLTensor& t, const char* name, std::vector<int64_t> dims) {
  bool ok = static_cast<size_t>(t.ndim) == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = t.shape[i] == dims[i];
  if (!ok) {
    std::string want = "[";
    for (size_t i = 0; i < dims.size(); ++i) want += (i ? "," : "") + std::to_string(dims[i]);
    throw Failure{std::string(name) + " has shape " + shape_str(t) + ", expected " + want + "]"};
  }
}

// The TE dtype of a DLPack dtype; NVTEDType has no f64, uint16/32/64 or int8.
bool te_dtype(const DLDataType& d, NVTEDType& out) {
  switch (d.code) {
    case kDLFloat:
      if (d.bits == 32) return out = kNVTEFloat32, true;
      if (d.bits == 16) return out = kNVTEFloat16, true;
      return false;
    case kDLBfloat:
      if (d.bits == 16) return out = kNVTEBFloat16, true;
      return false;
    case kDLInt:
      if (d.bits == 16) return out = kNVTEInt16, true;
      if (d.bits == 32) return out = kNVTEInt32, true;
      if (d.bits == 64) return out = kNVTEInt64, true;
      return false;
    case kDLUInt:
    case MOE_DLBOOL:
      if (d.bits == 8) return out = kNVTEByte, true;  // routing maps: TE reads them as uint8_t
      return false;
    default:
      return false;
  }
}

const char* dtype_name(NVTEDType t) {
  switch (t) {
    case kNVTEFloat32:
      return "float32";
    case kNVTEFloat16:
      return "float16";
    case kNVTEBFloat16:
      return "bfloat16";
    case kNVTEInt16:
      return "int16";
    case kNVTEInt32:
      return "int32";
    case kNVTEInt64:
      return "int64";
    case kNVTEByte:
      return "uint8";
    default:
      return "other";
  }
}

std::string dl_dtype_name(const DLDataType& d) {
  NVTEDType t;
  if (te_dtype(d, t)) return dtype_name(t);
  return "DLPack(code " + std::to_string(d.code) + ", bits " + std::to_string(d.bits) + ")";
}

// TE's router kernels are instantiated for float32, float16 and bfloat16 only
// (TE_ROUTER_PROBS_TYPE_SWITCH_ALL, common/fused_router/utils.h:557-575).
NVTEDType router_dtype(const DLTensor& t, const char* name) {
  NVTEDType d;
  if (!te_dtype(t.dtype, d) || (d != kNVTEFloat32 && d != kNVTEFloat16 && d != kNVTEBFloat16))
    throw Unsupported{std::string(name) + " is " + dl_dtype_name(t.dtype) +
                      "; TE's router kernels take float32, float16 or bfloat16 only "
                      "(TE_ROUTER_PROBS_TYPE_SWITCH_ALL, common/fused_router/utils.h:557)"};
  return d;
}

void require_dtype(const DLTensor& t, const char* name, NVTEDType want, const std::string& why) {
  NVTEDType d;
  if (!te_dtype(t.dtype, d) || d != want)
    throw Unsupported{std::string(name) + " is " + dl_dtype_name(t.dtype) + ", TE needs " +
                      dtype_name(want) + ": " + why};
}

// TE's C API takes int sizes.
int as_int(int64_t v, const std::string& what) {
  if (v < INT_MIN || v > INT_MAX)
    throw Unsupported{what + " = " + std::to_string(v) +
                      " does not fit the int argument of TE's C API (fused_router.h)"};
  return static_cast<int>(v);
}

// ---- the case's parameters (SPEC §14 params JSON) -----------------------------------------

struct Params {
  nlohmann::json j;
  explicit Params(const char* text) {
    if (!text) throw Failure{"no params_json"};
    try {
      j = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      throw Failure{std::string("params_json does not parse: ") + e.what()};
    }
    if (!j.is_object()) throw Failure{"params_json is not an object"};
  }
  // A null or absent optional parameter is its default (SPEC §14).
  bool has(const char* k) const { return j.contains(k) && !j.at(k).is_null(); }
  int64_t integer(const char* k) const {
    if (!has(k)) throw Failure{std::string("params_json has no ") + k};
    const auto& v = j.at(k);
    if (!v.is_number_integer()) throw Failure{std::string("params_json ") + k + " is no integer"};
    return v.get<int64_t>();
  }
  int64_t integer(const char* k, int64_t dflt) const { return has(k) ? integer(k) : dflt; }
  double number(const char* k) const {
    if (!has(k)) throw Failure{std::string("params_json has no ") + k};
    const auto& v = j.at(k);
    if (!v.is_number()) throw Failure{std::string("params_json ") + k + " is no number"};
    return v.get<double>();
  }
  double number(const char* k, double dflt) const {
    if (!has(k)) return dflt;
    const auto& v = j.at(k);
    if (!v.is_number()) throw Failure{std::string("params_json ") + k + " is no number"};
    return v.get<double>();
  }
  bool boolean(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    const auto& v = j.at(k);
    if (!v.is_boolean()) throw Failure{std::string("params_json ") + k + " is no bool"};
    return v.get<bool>();
  }
  std::string string(const char* k, const char* dflt) const {
    if (!has(k)) {
      if (dflt) return dflt;
      throw Failure{std::string("params_json has no ") + k};
    }
    const auto& v = j.at(k);
    if (!v.is_string()) throw Failure{std::string("params_json ") + k + " is no string"};
    return v.get<std::string>();
  }
};

// TE's score_function codes: 0 sigmoid, 1 softmax, 2 sqrtsoftplus (fused_router.h, the
// \param score_function of every router entry point; pytorch/csrc/extensions/router.cpp:14-15).
int score_function_code(const std::string& f) {
  if (f == "sigmoid") return 0;
  if (f == "softmax") return 1;
  if (f == "sqrtsoftplus") return 2;
  throw Failure{"score_function=" + f + " is not sigmoid, softmax or sqrtsoftplus"};
}

struct MapFormat {
  NVTERoutingMapFormat te;
  bool bitmap;
};

MapFormat map_format(const std::string& f) {
  if (f == "bytemap") return {NVTE_ROUTING_MAP_FORMAT_BYTEMAP, false};
  if (f == "bitmap_u8") return {NVTE_ROUTING_MAP_FORMAT_BITMAP_U8, true};
  throw Failure{"routing_map_format=" + f + " is not bytemap or bitmap_u8"};
}

// routing_map: [T,E] bool/uint8 (bytemap) or [T,ceil(E/8)] uint8 (bitmap_u8), which TE reads and
// writes as uint8_t whatever the NVTETensor's dtype (fused_topk_with_score_function.cu:1020).
const DLTensor& routing_map_output(const moe_call* c, int64_t T, int64_t E, MapFormat f) {
  const DLTensor& m = need(c, false, "output.routing_map", 2);
  expect_shape(m, "output.routing_map", {T, f.bitmap ? (E + 7) / 8 : E});
  const bool byte = m.dtype.bits == 8 && (m.dtype.code == kDLUInt || m.dtype.code == MOE_DLBOOL);
  if (!byte || (f.bitmap && m.dtype.code != kDLUInt))
    throw Failure{"output.routing_map is " + dl_dtype_name(m.dtype) + ", expected " +
                  (f.bitmap ? "uint8" : "bool or uint8")};
  return m;
}

// ---- NVTETensor views of the harness's buffers ---------------------------------------------

class TeTensor {
 public:
  explicit TeTensor(const TeApi& api)
      : api_(api), t_(api.create_tensor(NVTE_DELAYED_TENSOR_SCALING)) {}
  TeTensor(const TeApi& api, const DLTensor& v, NVTEDType dtype) : TeTensor(api) {
    NVTEBasicTensor b{};
    b.data_ptr = v.data ? static_cast<char*>(v.data) + v.byte_offset : nullptr;
    b.dtype = dtype;
    b.shape.ndim = static_cast<size_t>(v.ndim);
    for (int i = 0; i < v.ndim; ++i) b.shape.data[i] = static_cast<size_t>(v.shape[i]);
    api_.set_tensor_param(t_, kNVTERowwiseData, &b, sizeof(b));
  }
  TeTensor(const TeTensor&) = delete;
  TeTensor& operator=(const TeTensor&) = delete;
  ~TeTensor() {
    try {
      if (t_) api_.destroy_tensor(t_);
    } catch (...) {
      // TE's pool check failed: nothing to do in a destructor.
    }
  }
  NVTETensor get() const { return t_; }

 private:
  const TeApi& api_;
  NVTETensor t_;
};

// A message quoting which nvte_* call threw what.
struct TeThrew {
  std::string fn, what;
};

template <typename F>
void te_call(const char* fn, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    throw TeThrew{fn, e.what()};
  } catch (...) {
    throw TeThrew{fn, "an exception that is no std::exception"};
  }
}

// TE checks its shared memory against the device's opt-in limit and throws naming num_experts
// (check_shared_memory_capacity_num_experts, common/fused_router/utils.h:44-53). SPEC §1.5 lets
// an implementation stop at a clear error beyond the E <= 1024 it must support, so beyond 1024
// that throw is NOT_SUPPORTED; at or below 1024 it stays an ERROR.
bool beyond_supported_experts(const TeThrew& t, int64_t E) {
  return E > 1024 && t.what.find("exceeds device capacity") != std::string::npos;
}

Unsupported experts_unsupported(const TeThrew& t, int64_t E) {
  return Unsupported{"E=" + std::to_string(E) +
                     " needs more shared memory than this device has for TE's kernels "
                     "(check_shared_memory_capacity_num_experts, common/fused_router/utils.h:44; "
                     "SPEC §1.5 requires E <= 1024): " +
                     t.fn + " threw: " + t.what};
}

int32_t after_kernels() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Failure{std::string("CUDA error after TE's kernels: ") + cudaGetErrorName(e) + ": " +
                  cudaGetErrorString(e)};
  return MOE_STATUS_OK;
}

// ---- topk_router (SPEC §1) ----------------------------------------------------------------

int32_t topk_router(const moe_call* c, const TeApi& api) {
  const Params p(c->params_json);
  const DLTensor& logits = need(c, true, "input.logits", 2);
  const int64_t T = logits.shape[0], E = logits.shape[1];
  const DLTensor* bias = optional_input(c, "input.expert_bias");
  const DLTensor& ct = need(c, true, "cotangent.probs", 2);
  const DLTensor& probs = need(c, false, "output.probs", 2);
  const DLTensor& saved = need(c, false, "output.saved_scores", 2);
  const DLTensor& grad = need(c, false, "grad.logits", 2);
  expect_shape(ct, "cotangent.probs", {T, E});
  expect_shape(probs, "output.probs", {T, E});
  expect_shape(saved, "output.saved_scores", {T, E});
  expect_shape(grad, "grad.logits", {T, E});
  if (bias) expect_shape(*bias, "input.expert_bias", {E});

  const std::string f = p.string("score_function", nullptr);
  const int sf = score_function_code(f);
  const MapFormat fmt = map_format(p.string("routing_map_format", "bytemap"));
  const DLTensor& map = routing_map_output(c, T, E, fmt);
  const int K = as_int(p.integer("topk"), "topk");
  // TE's frameworks pass use_pre_softmax only for softmax (pytorch/csrc/extensions/router.cpp:
  // 92-94 forces false otherwise; SPEC §1.1: ignored for sigmoid and sqrtsoftplus).
  const int use_pre_softmax = (sf == 1 && p.boolean("use_pre_softmax", false)) ? 1 : 0;
  // Grouping is on iff group_topk > 0 (SPEC §1.1); off, TE's frameworks pass num_groups =
  // group_topk = -1 (pytorch/csrc/extensions/router.cpp:103-104, jax/router.py:90-91) and the
  // kernel tests group_topk > 0 (fused_topk_with_score_function.cu:219, 679).
  const int64_t gk = p.integer("group_topk", 0);
  const int num_groups = gk > 0 ? as_int(p.integer("num_groups", 0), "num_groups") : -1;
  const int group_topk = gk > 0 ? as_int(gk, "group_topk") : -1;
  const float scaling = static_cast<float>(p.number("scaling_factor", 1.0));
  // SPEC §1.2 step 2: a bias with softmax is an error; TE's PyTorch frontend raises the same
  // (pytorch/csrc/extensions/router.cpp:82-84), its kernel would silently ignore the bias.
  if (bias && sf == 1) throw Failure{"expert_bias with score_function=softmax (SPEC §1.2 step 2)"};

  // dtypes TE can take.
  const NVTEDType d = router_dtype(logits, "input.logits");
  require_dtype(
      probs, "output.probs", d,
      "TE writes probs in the logits dtype (fused_topk_with_score_function.cu:1009-1010, 1019)");
  require_dtype(
      saved, "output.saved_scores", kNVTEFloat32,
      "TE writes intermediate_output as float32 (fused_topk_with_score_function.cu:1021)");
  const NVTEDType bias_dtype = bias ? router_dtype(*bias, "input.expert_bias") : kNVTEFloat32;
  const NVTEDType g = router_dtype(grad, "grad.logits");
  require_dtype(ct, "cotangent.probs", g,
                "TE's backward reads grad_probs in grad_logits' dtype "
                "(fused_topk_with_score_function.cu:1535-1543)");
  // TE uses int offsets and checks T*E <= INT_MAX (fused_topk_with_score_function.cu:674-676).
  as_int(T, "T");
  as_int(E, "E");
  as_int(T * E, "T*E");

  try {
    TeTensor te_logits(api, logits, d), te_probs(api, probs, d), te_map(api, map, kNVTEByte);
    TeTensor te_saved(api, saved, kNVTEFloat32), te_ct(api, ct, g), te_grad(api, grad, g);
    // No bias: an NVTETensor without data, as TE's wrappers pass (TensorWrapper(),
    // pytorch/csrc/extensions/router.cpp:134); the kernel then gets nullptr (cu:1011, 1023-1031).
    TeTensor te_bias = bias ? TeTensor(api, *bias, bias_dtype) : TeTensor(api);
    cudaStream_t s = static_cast<cudaStream_t>(c->stream);
    te_call("nvte_fused_topk_with_score_function_forward_v2", [&] {
      api.topk_fwd(te_logits.get(), static_cast<int>(T), static_cast<int>(E), K, use_pre_softmax,
                   num_groups, group_topk, scaling, sf, te_bias.get(), te_probs.get(), te_map.get(),
                   fmt.te, te_saved.get(), s);
    });
    te_call("nvte_fused_topk_with_score_function_backward_v2", [&] {
      api.topk_bwd(te_map.get(), fmt.te, te_saved.get(), te_ct.get(), static_cast<int>(T),
                   static_cast<int>(E), K, use_pre_softmax, scaling, sf, te_grad.get(), s);
    });
  } catch (const TeThrew& t) {
    if (beyond_supported_experts(t, E)) throw experts_unsupported(t, E);
    throw;
  }
  return after_kernels();
}

// ---- aux_loss_scores (SPEC §2) ------------------------------------------------------------

int32_t aux_loss_scores(const moe_call* c, const TeApi& api) {
  const Params p(c->params_json);
  const DLTensor& logits = need(c, true, "input.logits", 2);
  const int64_t T = logits.shape[0], E = logits.shape[1];
  const DLTensor& ct = need(c, true, "cotangent.scores", 2);
  const DLTensor& scores = need(c, false, "output.scores", 2);
  const DLTensor& saved = need(c, false, "output.saved_scores", 2);
  const DLTensor& grad = need(c, false, "grad.logits", 2);
  expect_shape(ct, "cotangent.scores", {T, E});
  expect_shape(scores, "output.scores", {T, E});
  expect_shape(saved, "output.saved_scores", {T, E});
  expect_shape(grad, "grad.logits", {T, E});
  const int sf = score_function_code(p.string("score_function", nullptr));
  const MapFormat fmt = map_format(p.string("routing_map_format", "bytemap"));
  const DLTensor& map = routing_map_output(c, T, E, fmt);
  const int K = as_int(p.integer("topk"), "topk");

  const NVTEDType d = router_dtype(logits, "input.logits");
  require_dtype(scores, "output.scores", kNVTEFloat32,
                "TE writes scores as float32 (fused_score_for_moe_aux_loss.cu:442)");
  require_dtype(saved, "output.saved_scores", kNVTEFloat32,
                "TE writes intermediate_output as float32 (fused_score_for_moe_aux_loss.cu:444)");
  require_dtype(ct, "cotangent.scores", kNVTEFloat32,
                "TE's backward reads grad_scores as float32 (fused_score_for_moe_aux_loss.cu:656)");
  const NVTEDType g = router_dtype(grad, "grad.logits");
  as_int(T, "T");
  as_int(E, "E");
  as_int(T * E, "T*E");  // fused_score_for_moe_aux_loss.cu:328-330

  try {
    TeTensor te_logits(api, logits, d), te_scores(api, scores, kNVTEFloat32);
    TeTensor te_map(api, map, kNVTEByte), te_saved(api, saved, kNVTEFloat32);
    TeTensor te_ct(api, ct, kNVTEFloat32), te_grad(api, grad, g);
    cudaStream_t s = static_cast<cudaStream_t>(c->stream);
    te_call("nvte_fused_score_for_moe_aux_loss_forward_v2", [&] {
      api.scores_fwd(te_logits.get(), static_cast<int>(T), static_cast<int>(E), K, sf,
                     te_scores.get(), te_map.get(), fmt.te, te_saved.get(), s);
    });
    te_call("nvte_fused_score_for_moe_aux_loss_backward", [&] {
      api.scores_bwd(te_saved.get(), te_ct.get(), static_cast<int>(T), static_cast<int>(E), K, sf,
                     te_grad.get(), s);
    });
  } catch (const TeThrew& t) {
    if (beyond_supported_experts(t, E)) throw experts_unsupported(t, E);
    throw;
  }
  return after_kernels();
}

// ---- moe_aux_loss (SPEC §3) ---------------------------------------------------------------

int32_t moe_aux_loss(const moe_call* c, const TeApi& api) {
  const Params p(c->params_json);
  const DLTensor& probs = need(c, true, "input.probs", 2);
  const int64_t R = probs.shape[0], C = probs.shape[1];
  const DLTensor& tpe = need(c, true, "input.tokens_per_expert", 1);
  const DLTensor& ct = need(c, true, "cotangent.aux_loss", 0);
  const DLTensor& loss = need(c, false, "output.aux_loss", 0);
  const DLTensor& cbuf = need(c, false, "output.const_buf", 1);
  const DLTensor& grad = need(c, false, "grad.probs", 2);
  expect_shape(tpe, "input.tokens_per_expert", {C});
  expect_shape(cbuf, "output.const_buf", {2});
  expect_shape(grad, "grad.probs", {R, C});
  const int K = as_int(p.integer("topk"), "topk");
  const float coeff = static_cast<float>(p.number("coeff"));
  // SPEC §3 defaults (num_experts = C, total_num_tokens = R); the harness always resolves them.
  const int num_experts = as_int(p.integer("num_experts", C), "num_experts");
  const int total_num_tokens = as_int(p.integer("total_num_tokens", R), "total_num_tokens");

  const NVTEDType d = router_dtype(probs, "input.probs");
  require_dtype(loss, "output.aux_loss", d,
                "TE writes aux_loss in the probs dtype (fused_moe_aux_loss.cu:123-132)");
  require_dtype(cbuf, "output.const_buf", kNVTEFloat32,
                "TE's Const_buf is float32[2] (fused_moe_aux_loss.cu:132)");
  NVTEDType tpe_dtype;
  if (!te_dtype(tpe.dtype, tpe_dtype) ||
      (tpe_dtype != kNVTEInt16 && tpe_dtype != kNVTEInt32 && tpe_dtype != kNVTEInt64 &&
       tpe_dtype != kNVTEBFloat16 && tpe_dtype != kNVTEFloat32))
    throw Unsupported{"input.tokens_per_expert is " + dl_dtype_name(tpe.dtype) +
                      "; TE takes int16, int32, int64, bfloat16 or float32 "
                      "(TE_ROUTER_INDEX_TYPE_SWITCH_ALL, common/fused_router/utils.h:577)"};
  const NVTEDType g = router_dtype(grad, "grad.probs");
  require_dtype(ct, "cotangent.aux_loss", g,
                "TE's backward reads grad_aux_loss in grad_probs' dtype "
                "(fused_moe_aux_loss.cu:266-274)");
  // TE indexes probs[row * num_cols + col] in int without a check (fused_moe_aux_loss.cu:45, 245).
  as_int(R, "R");
  as_int(C, "C");
  as_int(R * C, "R*C");

  {
    TeTensor te_probs(api, probs, d), te_tpe(api, tpe, tpe_dtype), te_loss(api, loss, d);
    TeTensor te_cbuf(api, cbuf, kNVTEFloat32), te_ct(api, ct, g), te_grad(api, grad, g);
    cudaStream_t s = static_cast<cudaStream_t>(c->stream);
    // Const_buf is written whole by TE: [0] by the kernel, [1] zeroed by TE's own memset before
    // the atomics (fused_moe_aux_loss.cu:29, 108).
    te_call("nvte_fused_moe_aux_loss_forward", [&] {
      api.aux_fwd(te_probs.get(), te_tpe.get(), total_num_tokens, num_experts, static_cast<int>(R),
                  static_cast<int>(C), K, coeff, te_loss.get(), te_cbuf.get(), s);
    });
    te_call("nvte_fused_moe_aux_loss_backward", [&] {
      api.aux_bwd(te_cbuf.get(), te_tpe.get(), static_cast<int>(R), static_cast<int>(C),
                  te_ct.get(), te_grad.get(), s);
    });
  }
  return after_kernels();
}

// ---- the C ABI ---------------------------------------------------------------------------

int32_t reply(const moe_call* c, int32_t status, const std::string& msg) {
  if (c && c->message && c->message_size > 0)
    std::snprintf(c->message, c->message_size, "%s", msg.c_str());
  return status;
}

int32_t guarded(const moe_call* c, int32_t (*op)(const moe_call*, const TeApi&)) {
  if (!c) return MOE_STATUS_ERROR;
  try {
    if (c->abi_version != MOE_PLUGIN_ABI_VERSION)
      return reply(c, MOE_STATUS_ERROR, "plugin ABI version mismatch");
    const TeApi& api = te_api();
    if (!api.error.empty()) return reply(c, MOE_STATUS_ERROR, api.error);
    return op(c, api);
  } catch (const Unsupported& u) {
    return reply(c, MOE_STATUS_NOT_SUPPORTED, "TransformerEngine: " + u.why);
  } catch (const Failure& f) {
    return reply(c, MOE_STATUS_ERROR, f.why);
  } catch (const TeThrew& t) {
    return reply(c, MOE_STATUS_ERROR, "TransformerEngine " + t.fn + " threw: " + t.what);
  } catch (const std::exception& e) {
    return reply(c, MOE_STATUS_ERROR, std::string("te plugin: ") + e.what());
  } catch (...) {
    return reply(c, MOE_STATUS_ERROR, "te plugin: unknown exception");
  }
}

int32_t run_topk_router(const moe_call* c) {
  return guarded(c, topk_router);
}
int32_t run_aux_loss_scores(const moe_call* c) {
  return guarded(c, aux_loss_scores);
}
int32_t run_moe_aux_loss(const moe_call* c) {
  return guarded(c, moe_aux_loss);
}

const moe_plugin_op kOps[] = {
    {"topk_router", kDLCUDA, nullptr, 1, run_topk_router},
    {"aux_loss_scores", kDLCUDA, nullptr, 1, run_aux_loss_scores},
    // TE accumulates the loss with one fp32 atomicAdd per block (fused_moe_aux_loss.cu:69), in
    // an order that varies between runs (SPEC §3, §12): its last bits are not reproducible.
    {"moe_aux_loss", kDLCUDA, nullptr, 0, run_moe_aux_loss},
};

const moe_plugin kPlugin = {"te",
                            "TransformerEngine " MOE_TE_VERSION
                            " C API (fused_router.h), libtransformer_engine.so loaded at the "
                            "first run",
                            3, kOps};

}  // namespace

extern "C" {
MOE_PLUGIN_EXPORT uint32_t moe_plugin_abi_version(void) {
  return MOE_PLUGIN_ABI_VERSION;
}
MOE_PLUGIN_EXPORT const moe_plugin* moe_plugin_describe(void) {
  return &kPlugin;
}
}
