// Finite-difference check of analytic gradients in double (SPEC §12 "Gradients").
//
// The loss is L(inputs) = sum over outputs of <cotangent, output>, evaluated by the caller on f64
// inputs without output rounding. For each differentiable input x with analytic gradient g, the
// checker compares d/dt L(x + t*d*s) (s_i = max(1, |x_i|), the SPEC step scale) with sum g*d*s:
//   - along a few random +-1 directions d (always), and
//   - along every single element (small tensors only).
// Central differences with Richardson extrapolation (steps h and h/2) make the truncation error
// O(h^4). Elements whose mask is 0 are never perturbed: the caller masks rows whose top-k margin is
// below 10x the step, so the selection stays fixed, and slots the SPEC excludes (R12).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "harness/core/tensor.h"

namespace moe {

struct FdOptions {
  double step = 1e-3;  // relative step of SPEC §12
  int directions = 3;
  int64_t per_element_max = 48;  // per-element checks for tensors up to this many elements
  double rtol = 2e-6;            // relative to the scale sum |g_i d_i s_i|
  double atol = 1e-9;
  uint64_t seed = 1;
};

struct FdResult {
  std::string input;
  std::string probe;  // "direction 0" or "element (3, 1)"
  double analytic = 0, numeric = 0, tol = 0;
  bool ok() const;
  std::string str() const;
};

using LossFn = std::function<double(const TensorMap& inputs)>;

// inputs: every input of the op in f64 (non-float inputs pass through unchanged). grads: analytic
// gradient per differentiable input name (f64, same shape). masks: optional per-input f64 tensors,
// 0 = do not perturb. Returns one result per probe.
std::vector<FdResult> fd_check(const LossFn& loss, const TensorMap& inputs, const TensorMap& grads,
                               const TensorMap& masks, const FdOptions& opt);

}  // namespace moe
