// SPEC §12 tolerances and the per-element comparison that reports where two tensors differ.
//
// There is exactly one tolerance rule (tol_bound). An op's registry record turns it into a
// per-element bound tensor; compare() then checks |got - want| <= bound element by element and
// reports the tensor, the mismatch count, the first and worst mismatch at their coordinates,
// max abs/rel error and the share of the tolerance used. A null bound means exact: bitwise for
// floats (so -0.0 != +0.0 and NaN patterns count), value equality for integers and bools.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "harness/core/tensor.h"

namespace moe {

enum class TolClass : uint8_t {
  exact,        // data movement, indices, counts, routing maps
  elementwise,  // one fp32 expression rounded once to d: 1 ulp_d(ref) + 4 ulp_f32
  reduction,    // fp32 sum of n terms rounded to d: 1 ulp_d(|ref|) + 2 n 2^-24 sum|x_i|
};

// Per-element absolute bound of SPEC §12. abs_sum is sum|x_i| of the reduced terms; pass |ref|
// where the terms are not known (a relative bound of 2 n 2^-24).
double tol_bound(TolClass cls, DType out, double ref, int64_t n, double abs_sum);

// Bound tensor (f64, same shape as ref) for every element of ref; abs_sum may be null (|ref|).
Tensor make_bound(TolClass cls, DType out, const Tensor& ref, int64_t n,
                  const Tensor* abs_sum = nullptr);

// Rounding-aware bound [DEVIATION: tighter than SPEC §12's 1 ulp_d]. Where SPEC fixes a kernel's
// arithmetic as fp32 steps followed by ONE rounding to `out`, a correct result is rnd_out(y) for
// some y within err of the exact value x, so the admissible results are exactly
// {rnd_out(v) : v in [x - err, x + err]}, an interval of `out` values (rnd is monotone). The bound
// of element i is the distance from want to the far end of that interval:
//   max(|rnd_out(x - err) - want|, |rnd_out(x + err) - want|),
// 0 for bf16/f16 unless x lies within err of a rounding midpoint (then 1 ulp_out), so an error of
// even one ulp_out elsewhere fails. exact: f64 unrounded values x; err: f64 absolute error of the
// fp32 computation (the caller's derivation, fp32 underflow included); want: the reference's
// rounded output, same shape. Non-finite x or want: bound 0 (must match exactly); an end that
// overflows `out` gives 1 ulp_out(want); want outside the interval (itself inadmissible): 0.
Tensor make_rounded_bound(DType out, const Tensor& want, const Tensor& exact, const Tensor& err);
// One element of make_rounded_bound.
double rounded_bound(DType out, double want, double exact, double err);

struct Mismatch {
  int64_t index = 0;
  std::vector<int64_t> coord;
  double got = 0, want = 0, bound = 0;
};

struct TensorReport {
  std::string name;
  std::string error;  // structural fault (missing tensor, dtype/shape mismatch); empty if none
  int64_t count = 0, mismatches = 0;
  std::optional<Mismatch> first, worst;
  double max_abs = 0, max_rel = 0;
  double worst_pct = 0;  // max |got - want| / bound, in percent (exact: 0 or 100)
  bool ok() const { return error.empty() && mismatches == 0; }
  std::string str() const;  // multi-line report
};

// Compares got against want. bound: f64 tensor of want's shape (+inf masks an element), or null
// for exact comparison.
TensorReport compare(const std::string& name, const Tensor& got, const Tensor& want,
                     const Tensor* bound);

struct Report {
  std::vector<TensorReport> tensors;
  std::vector<std::string> failures;  // failures that are not a tensor mismatch (invariants, ...)
  bool ok() const;
  double worst_pct() const;
  std::string str() const;  // reports of the failing tensors and the failure lines
};

std::vector<int64_t> unravel(int64_t index, const Shape& shape);

}  // namespace moe
