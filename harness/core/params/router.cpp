#include "harness/core/params/router.h"

#include <cmath>
#include <stdexcept>

namespace moe {

namespace {
[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

}  // namespace

std::string_view score_function_name(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::softmax:
      return "softmax";
    case ScoreFunction::sigmoid:
      return "sigmoid";
    case ScoreFunction::sqrtsoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}

ScoreFunction parse_score_function(std::string_view s) {
  if (s == "softmax") return ScoreFunction::softmax;
  if (s == "sigmoid") return ScoreFunction::sigmoid;
  if (s == "sqrtsoftplus") return ScoreFunction::sqrtsoftplus;
  bad("score_function: unknown value '" + std::string(s) +
      "' (expected softmax, sigmoid or sqrtsoftplus)");
}

std::string_view map_format_name(MapFormat f) {
  return f == MapFormat::bytemap ? "bytemap" : "bitmap_u8";
}

MapFormat parse_map_format(std::string_view s) {
  if (s == "bytemap") return MapFormat::bytemap;
  if (s == "bitmap_u8") return MapFormat::bitmap_u8;
  bad("routing_map_format: unknown value '" + std::string(s) + "' (expected bytemap or bitmap_u8)");
}

void validate_topk_router(const TensorMeta& logits, const TensorMeta* bias, const RouterParams& p,
                          bool allow_f64) {
  require_rank(logits, 2, "logits");
  require_float_dtype(logits, "logits", allow_f64);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  if (E <= 0) bad("num_experts: must be > 0, got " + std::to_string(E));
  if (E > kMaxExperts) {
    bad("num_experts: " + std::to_string(E) + " exceeds the supported maximum " +
        std::to_string(kMaxExperts));
  }
  if (T > 0 && T > INT64_C(0x7fffffffffff) / E) bad("logits: T*E overflows");
  if (p.topk < 1 || p.topk > E) {
    bad("topk: must be in [1, num_experts=" + std::to_string(E) + "], got " +
        std::to_string(p.topk));
  }
  if (!std::isfinite(p.scaling_factor)) {
    bad("scaling_factor: must be finite, got " + std::to_string(p.scaling_factor));
  }
  if (p.grouped()) {
    const int64_t G = p.num_groups, gk = p.group_topk;
    if (G <= 0) bad("num_groups: must be > 0 when group_topk > 0, got " + std::to_string(G));
    if (E % G != 0) {
      bad("num_groups: num_experts=" + std::to_string(E) +
          " is not divisible by num_groups=" + std::to_string(G));
    }
    if (p.topk % gk != 0) {
      bad("group_topk: topk=" + std::to_string(p.topk) +
          " is not divisible by group_topk=" + std::to_string(gk));
    }
    if (gk > G) {
      bad("group_topk: " + std::to_string(gk) + " exceeds num_groups=" + std::to_string(G));
    }
    if (p.topk / gk > E / G) {
      bad("topk: topk/group_topk=" + std::to_string(p.topk / gk) +
          " exceeds the experts per group " + std::to_string(E / G));
    }
  }
  if (bias) {
    if (p.score_function == ScoreFunction::softmax) {
      bad("expert_bias: a bias is only allowed with sigmoid or sqrtsoftplus, not softmax");
    }
    require_shape(*bias, {E}, "expert_bias");
    require_float_dtype(*bias, "expert_bias", allow_f64);
  }
}

void validate_aux_loss_scores(const TensorMeta& logits, int64_t topk, bool allow_f64) {
  require_rank(logits, 2, "logits");
  require_float_dtype(logits, "logits", allow_f64);
  const int64_t E = logits.dim(1);
  if (E <= 0) bad("num_experts: must be > 0, got " + std::to_string(E));
  if (E > kMaxExperts) {
    bad("num_experts: " + std::to_string(E) + " exceeds the supported maximum " +
        std::to_string(kMaxExperts));
  }
  if (topk < 1 || topk > E) {
    bad("topk: must be in [1, num_experts=" + std::to_string(E) + "], got " + std::to_string(topk));
  }
}

AuxLossParams validate_moe_aux_loss(const TensorMeta& probs, const TensorMeta& tpe,
                                    const AuxLossParams& p, bool allow_f64) {
  require_rank(probs, 2, "probs");
  require_float_dtype(probs, "probs", allow_f64);
  AuxLossParams r = p;
  const int64_t R = probs.dim(0), C = probs.dim(1);
  if (r.num_experts == 0) r.num_experts = C;
  if (r.total_num_tokens == 0) r.total_num_tokens = R;
  if (p.topk <= 0) bad("topk: must be >= 1, got " + std::to_string(p.topk));
  if (!std::isfinite(p.coeff)) bad("coeff: must be finite, got " + std::to_string(p.coeff));
  if (r.num_experts < 1) bad("num_experts: must be >= 1, got " + std::to_string(r.num_experts));
  if (C % r.num_experts != 0) {
    bad("num_experts: the column count " + std::to_string(C) +
        " is not divisible by num_experts=" + std::to_string(r.num_experts));
  }
  if (r.total_num_tokens <= 0) {
    bad("total_num_tokens: must be > 0, got " + std::to_string(r.total_num_tokens));
  }
  require_rank(tpe, 1, "tokens_per_expert");
  if (tpe.dim(0) != C) {
    bad("tokens_per_expert: length " + std::to_string(tpe.dim(0)) +
        " differs from the column count " + std::to_string(C));
  }
  const DType d = tpe.dtype;
  if (!(d == DType::i32 || d == DType::i64 || d == DType::f32 || d == DType::bf16 ||
        (d == DType::f64 && allow_f64))) {
    bad("tokens_per_expert: unsupported dtype " + std::string(dtype_name(d)));
  }
  return r;
}

Shape routing_map_shape(int64_t tokens, int64_t experts, MapFormat f) {
  if (f == MapFormat::bytemap) return {tokens, experts};
  return {tokens, (experts + 7) / 8};
}

bool routing_map_get(const Tensor& map, int64_t t, int64_t e) {
  if (map.dtype() == DType::u8) {
    const auto byte = static_cast<uint8_t>(map.at(t, e / 8));
    return (byte >> (e % 8)) & 1;
  }
  return map.at(t, e) != 0.0;
}

void routing_map_set(Tensor& map, int64_t t, int64_t e, bool v) {
  if (map.dtype() == DType::u8) {
    auto byte = static_cast<uint8_t>(map.at(t, e / 8));
    const auto bit = static_cast<uint8_t>(1u << (e % 8));
    byte = v ? (byte | bit) : (byte & ~bit);
    map.set(t, e / 8, byte);
    return;
  }
  map.set(t, e, v ? 1.0 : 0.0);
}

}  // namespace moe
