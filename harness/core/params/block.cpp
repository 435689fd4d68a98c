#include "harness/core/params/block.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace moe {

namespace {

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

std::string str(int64_t v) {
  return std::to_string(v);
}

}  // namespace

std::string_view moe_backend_name(MoeBackend b) {
  return b == MoeBackend::kernel ? "kernel" : "argsort";
}

MoeBackend parse_moe_backend(std::string_view s) {
  if (s == "kernel") return MoeBackend::kernel;
  if (s == "argsort") return MoeBackend::argsort;
  bad("backend: unknown value '" + std::string(s) + "' (expected kernel or argsort)");
}

std::string_view router_logits_dtype_name(RouterLogitsDtype r) {
  return r == RouterLogitsDtype::float32 ? "float32" : "input";
}

RouterLogitsDtype parse_router_logits_dtype(std::string_view s) {
  if (s == "float32") return RouterLogitsDtype::float32;
  if (s == "input") return RouterLogitsDtype::input;
  bad("router_logits_dtype: unknown value '" + std::string(s) + "' (expected float32 or input)");
}

RouterParams MoeBlockParams::router() const {
  RouterParams r;
  r.topk = topk;
  r.score_function = score_function;
  r.use_pre_softmax = use_pre_softmax;
  r.num_groups = num_groups;
  r.group_topk = group_topk;
  r.scaling_factor = scaling_factor;
  r.routing_map_format = MapFormat::bytemap;
  return r;
}

EpShape MoeBlockShape::ep(const MoeBlockParams& p) const {
  return EpShape{B, S, p.topk, p.ep_size, p.dp_size, E, p.align_size};
}

MoeBlockShape validate_moe_block(const TensorMeta& x, const TensorMeta& gate_kernel,
                                 const TensorMeta& wi_0, const TensorMeta& wi_1,
                                 const TensorMeta& wo, const TensorMeta* wi_0_bias,
                                 const TensorMeta* wi_1_bias, const TensorMeta* wo_bias,
                                 const TensorMeta* expert_bias, const MoeBlockParams& p,
                                 bool allow_f64) {
  require_rank(x, 3, "x");
  require_float_dtype(x, "x", allow_f64);
  MoeBlockShape s;
  s.B = x.dim(0);
  s.S = x.dim(1);
  s.H = x.dim(2);
  s.E = p.num_experts;
  if (s.E < 1) bad("num_experts: must be >= 1, got " + str(s.E));
  require_rank(gate_kernel, 2, "gate_kernel");
  if (gate_kernel.dim(0) != s.H || gate_kernel.dim(1) != s.E) {
    bad("gate_kernel: expected [H, num_experts] = " + shape_str({s.H, s.E}) + ", got " +
        shape_str(gate_kernel.shape));
  }
  require_float_dtype(gate_kernel, "gate_kernel", allow_f64);
  require_rank(wi_0, 3, "wi_0");
  s.M = wi_0.dim(2);
  require_shape(wi_0, {s.E, s.H, s.M}, "wi_0");
  require_shape(wi_1, {s.E, s.H, s.M}, "wi_1");
  require_shape(wo, {s.E, s.M, s.H}, "wo");
  require_float_dtype(wi_0, "wi_0", allow_f64);
  require_float_dtype(wi_1, "wi_1", allow_f64);
  require_float_dtype(wo, "wo", allow_f64);
  if (wi_0_bias) {
    require_shape(*wi_0_bias, {s.E, s.M}, "wi_0_bias");
    require_float_dtype(*wi_0_bias, "wi_0_bias", allow_f64);
  }
  if (wi_1_bias) {
    require_shape(*wi_1_bias, {s.E, s.M}, "wi_1_bias");
    require_float_dtype(*wi_1_bias, "wi_1_bias", allow_f64);
  }
  if (wo_bias) {
    require_shape(*wo_bias, {s.E, s.H}, "wo_bias");
    require_float_dtype(*wo_bias, "wo_bias", allow_f64);
  }
  // Router errors (§1.5) as the router sees the [B*S, E] logits, expert_bias with softmax
  // included.
  validate_topk_router(TensorMeta{x.dtype, {s.tokens(), s.E}}, expert_bias, p.router(), allow_f64);
  if (!std::isfinite(p.aux_loss_coeff) || p.aux_loss_coeff < 0) {
    bad("aux_loss_coeff: must be finite and >= 0, got " + std::to_string(p.aux_loss_coeff));
  }
  if (p.probs_dtype != DType::f32 && p.probs_dtype != DType::bf16 && p.probs_dtype != DType::f16) {
    bad("probs_dtype: unsupported dtype " + std::string(dtype_name(p.probs_dtype)) +
        " (expected float32, bfloat16 or float16)");
  }
  if (p.ep_size < 1) bad("ep_size: must be >= 1, got " + str(p.ep_size));
  if (p.dp_size < 1) bad("dp_size: must be >= 1, got " + str(p.dp_size));
  if (p.align_size < 0) bad("align_size: must be >= 0, got " + str(p.align_size));
  if (s.E % p.ep_size != 0) {
    bad("ep_size: num_experts=" + str(s.E) + " is not divisible by ep_size=" + str(p.ep_size));
  }
  if (s.B % (p.ep_size * p.dp_size) != 0) {
    bad("batch: B=" + str(s.B) +
        " is not divisible by ep_size*dp_size=" + str(p.ep_size * p.dp_size) +
        " (ep_size=" + str(p.ep_size) + ", dp_size=" + str(p.dp_size) + ")");
  }
  validate_ep_shape(s.ep(p));  // the remaining §9.5 range checks
  return s;
}

}  // namespace moe
