// Shared by every reference op: the rounding mode and small helpers. No Eigen in this header.
#pragma once

#include "harness/core/tensor.h"

namespace moe::ref {

// to_dtype: outputs are rounded to their SPEC dtype (normal use).
// none: finite-difference mode; float inputs may be f64 and outputs stay f64, unrounded.
enum class Rounding { to_dtype, none };

// The dtype an output gets: `d` normally, f64 in finite-difference mode.
inline DType out_dtype(DType d, Rounding r) {
  return r == Rounding::none ? DType::f64 : d;
}

}  // namespace moe::ref
