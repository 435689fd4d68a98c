// Parameters and host-side validation of the grouped GEMM and the gated expert FFN (SPEC §10),
// shared by the CPU reference and the CUDA wrappers.
//
// grouped_gemm: x [M_total, K_d], w [G, K_d, N], group_sizes [G] int, bias [G, N] (optional).
// swiglu_expert_ffn: x [M_total, H], group_sizes [G], wi_0/wi_1 [G, H, M], wo [G, M, H],
// wi_0_bias/wi_1_bias [G, M], wo_bias [G, H] (optional).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "harness/core/tensor.h"

namespace moe {

// §10.2: act(gate) multiplies up. silu(x) = x*sigmoid(x); linear(x) = x.
enum class Activation : uint8_t { silu, linear };
std::string_view activation_name(Activation a);
Activation parse_activation(std::string_view s);  // throws naming activation

struct GroupedGemmShape {
  int64_t rows = 0, k = 0, n = 0, groups = 0;  // M_total, K_d, N, G
};
// §10.1 host checks; returns the shape. allow_f64: the reference's finite-difference mode.
GroupedGemmShape validate_grouped_gemm(const TensorMeta& x, const TensorMeta& w,
                                       const TensorMeta& group_sizes, const TensorMeta* bias,
                                       bool allow_f64 = false);

struct FfnShape {
  int64_t rows = 0, hidden = 0, inter = 0, groups = 0;  // M_total, H, M, G
};
// §10.2 host checks; returns the shape.
FfnShape validate_swiglu_expert_ffn(const TensorMeta& x, const TensorMeta& group_sizes,
                                    const TensorMeta& wi_0, const TensorMeta& wi_1,
                                    const TensorMeta& wo, const TensorMeta* wi_0_bias,
                                    const TensorMeta* wi_1_bias, const TensorMeta* wo_bias,
                                    bool allow_f64 = false);

// Data-dependent checks of the group sizes (host copy): every size >= 0 and the sum <= rows.
// Returns the sum. Throws std::invalid_argument naming group_sizes.
int64_t check_group_sizes(const std::vector<int64_t>& group_sizes, int64_t rows);

}  // namespace moe
