// CPU reference of grouped_gemm (SPEC §10.1), forward and backward. Twin: gpu/grouped_gemm.cuh.
//
// Layouts (row-major): x [M_total, K_d] in d; w [G, K_d, N] in d; group_sizes [G] int (i32/i64);
// bias [G, N] (optional, any float dtype); out [M_total, N] in d.
// Group g owns rows [o_g, o_g + n_g) with o_g = sum_{g'<g} n_g'. For those rows
//   out[r] = rnd_d( sum_k x[r,k] * w[g,k,:] + bias[g] ),
// computed in double from the stored inputs and rounded once. Tail rows r >= sum n_g are 0.
// Backward with ct = grad out [M_total, N]:
//   grad_x[r]   = rnd_d( ct[r] * w[g]^T )       (tail rows 0)
//   grad_w[g]   = rnd_d( x_g^T * ct_g )         [K_d, N]; an empty group gives exactly 0
//   grad_bias[g] = rnd_b( sum_{r in g} ct[r] )  in the bias dtype
// Errors (std::invalid_argument, SPEC §10.1): G < 1, a negative group size, sum > M_total, K_d or
// dtype mismatch between x and w, bias shape != [G, N].
#pragma once

#include <optional>

#include "harness/core/params/ffn.h"
#include "reference/common.h"

namespace moe::ref {

Tensor grouped_gemm_fwd(const Tensor& x, const Tensor& w, const Tensor& group_sizes,
                        const Tensor* bias, Rounding r = Rounding::to_dtype);

struct GroupedGemmBwd {
  Tensor grad_x;                    // [M_total, K_d] in d
  Tensor grad_w;                    // [G, K_d, N] in d
  std::optional<Tensor> grad_bias;  // [G, N] in the bias dtype, present iff a bias was given
};
// bias is only read for its presence and dtype (the bias gradient does not depend on its value).
GroupedGemmBwd grouped_gemm_bwd(const Tensor& grad_out, const Tensor& x, const Tensor& w,
                                const Tensor& group_sizes, const Tensor* bias,
                                Rounding r = Rounding::to_dtype);

}  // namespace moe::ref
