// Generic drivers over a registry record: what `moe-harness check`, the property tests and
// `golden verify` run for one Case.
#pragma once

#include "harness/core/compare.h"
#include "harness/core/finite_diff.h"
#include "harness/ops/registry.h"

namespace moe::ops {

// Default comparison: every key of want must be in got; floats within op.bound, the rest exact.
Report compare_outputs(const OpInfo& op, const Case& c, const TensorMap& in, const TensorMap& want,
                       const TensorMap& got);

// The reference alone: runs it, checks the invariants and checks every grad.* by finite
// differences of the exact (f64) reference.
Report check_reference(const OpInfo& op, const Case& c, const FdOptions& fd = {});

// The CUDA twin against the reference (outputs poisoned before each launch by the twin), and
// determinism: two GPU runs bitwise equal.
Report check_gpu(const OpInfo& op, const Case& c);

// Converts every float tensor of a map to f64 (the exact-mode inputs).
TensorMap to_f64(const TensorMap& m);
TensorMap clone(const TensorMap& m);

// The command that replays c.
std::string replay_line(const Case& c, std::string_view backend);

}  // namespace moe::ops
