// The comparison step of check_case (harness/ops/impl.cpp), shared with `golden verify --impl`,
// which brings its own inputs and expected outputs from a file.
#pragma once

#include <string>
#include <vector>

#include "harness/core/compare.h"
#include "moe_harness/impl.h"

namespace moe::ops {

// Runs impl `runs` times (CheckOptions::runs; a non-deterministic implementation twice) on
// (c, in) with poisoned, guarded outputs shaped like want's output.*/grad.*, and compares the
// first run with want under the op's bounds and the tie policy, and every later run with the
// first bitwise (stopping at the first that differs); determinism, buffer faults and notes (tie
// resolutions, keys not provided) are added to the report / notes. got, when given, receives the
// first run's outputs.
Report compare_impl(const Impl& impl, const Case& c, const TensorMap& in, const TensorMap& want,
                    TiePolicy ties, std::vector<std::string>& notes, TensorMap* got = nullptr,
                    int runs = 2);

}  // namespace moe::ops
