#include "harness/core/params/ffn.h"

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

void check_group_sizes_meta(const TensorMeta& gs) {
  require_rank(gs, 1, "group_sizes");
  require_index_dtype(gs, "group_sizes");
  if (gs.dim(0) < 1) bad("group_sizes: num_groups must be >= 1, got " + str(gs.dim(0)));
}

}  // namespace

std::string_view activation_name(Activation a) {
  return a == Activation::silu ? "silu" : "linear";
}

Activation parse_activation(std::string_view s) {
  if (s == "silu") return Activation::silu;
  if (s == "linear") return Activation::linear;
  bad("activation: unknown value '" + std::string(s) + "' (expected silu or linear)");
}

GroupedGemmShape validate_grouped_gemm(const TensorMeta& x, const TensorMeta& w,
                                       const TensorMeta& group_sizes, const TensorMeta* bias,
                                       bool allow_f64) {
  require_rank(x, 2, "x");
  require_rank(w, 3, "w");
  require_float_dtype(x, "x", allow_f64);
  require_float_dtype(w, "w", allow_f64);
  check_group_sizes_meta(group_sizes);
  GroupedGemmShape s{x.dim(0), x.dim(1), w.dim(2), group_sizes.dim(0)};
  if (w.dim(0) != s.groups) {
    bad("w: expected " + str(s.groups) + " groups (the length of group_sizes), got shape " +
        shape_str(w.shape));
  }
  if (w.dim(1) != s.k) {
    bad("w: contraction size " + str(w.dim(1)) + " differs from x's " + str(s.k) + " (x " +
        shape_str(x.shape) + ", w " + shape_str(w.shape) + ")");
  }
  if (w.dtype != x.dtype) {
    bad("w: dtype " + std::string(dtype_name(w.dtype)) + " differs from x's " +
        std::string(dtype_name(x.dtype)));
  }
  if (bias) {
    require_shape(*bias, {s.groups, s.n}, "bias");
    require_float_dtype(*bias, "bias", allow_f64);
  }
  return s;
}

FfnShape validate_swiglu_expert_ffn(const TensorMeta& x, const TensorMeta& group_sizes,
                                    const TensorMeta& wi_0, const TensorMeta& wi_1,
                                    const TensorMeta& wo, const TensorMeta* wi_0_bias,
                                    const TensorMeta* wi_1_bias, const TensorMeta* wo_bias,
                                    bool allow_f64) {
  require_rank(x, 2, "x");
  require_float_dtype(x, "x", allow_f64);
  check_group_sizes_meta(group_sizes);
  require_rank(wi_0, 3, "wi_0");
  FfnShape s{x.dim(0), x.dim(1), wi_0.dim(2), group_sizes.dim(0)};
  require_shape(wi_0, {s.groups, s.hidden, s.inter}, "wi_0");
  require_shape(wi_1, {s.groups, s.hidden, s.inter}, "wi_1");
  require_shape(wo, {s.groups, s.inter, s.hidden}, "wo");
  const std::pair<const TensorMeta*, const char*> ws[] = {
      {&wi_0, "wi_0"}, {&wi_1, "wi_1"}, {&wo, "wo"}};
  for (auto [m, name] : ws) {
    require_float_dtype(*m, name, allow_f64);
    if (m->dtype != x.dtype) {
      bad(std::string(name) + ": dtype " + std::string(dtype_name(m->dtype)) +
          " differs from x's " + std::string(dtype_name(x.dtype)));
    }
  }
  if (wi_0_bias) {
    require_shape(*wi_0_bias, {s.groups, s.inter}, "wi_0_bias");
    require_float_dtype(*wi_0_bias, "wi_0_bias", allow_f64);
  }
  if (wi_1_bias) {
    require_shape(*wi_1_bias, {s.groups, s.inter}, "wi_1_bias");
    require_float_dtype(*wi_1_bias, "wi_1_bias", allow_f64);
  }
  if (wo_bias) {
    require_shape(*wo_bias, {s.groups, s.hidden}, "wo_bias");
    require_float_dtype(*wo_bias, "wo_bias", allow_f64);
  }
  return s;
}

int64_t check_group_sizes(const std::vector<int64_t>& gs, int64_t rows) {
  int64_t sum = 0;
  for (size_t g = 0; g < gs.size(); ++g) {
    if (gs[g] < 0) {
      bad("group_sizes: group " + str(static_cast<int64_t>(g)) + " has negative size " +
          str(gs[g]));
    }
    sum += gs[g];
  }
  if (sum > rows) {
    bad("group_sizes: the sizes sum to " + str(sum) + ", more than the " + str(rows) +
        " rows of x (M_total)");
  }
  return sum;
}

}  // namespace moe
