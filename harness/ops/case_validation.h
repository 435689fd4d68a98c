// Validation of a case line against its op (`moe-harness check --case`, `golden record --case`):
// the op must exist, every key must be one the op's cases use, no key may repeat, and a value must
// have the kind the op's own cases give that key (an integer, a number, a bool, or one of the
// enumerated strings). The key set and kinds are learnt from the op's named cases, benchmark
// cases and a sample of its generator, so they follow the records without a second table.
#pragma once

#include <string>
#include <string_view>

#include "harness/core/case.h"

namespace moe::ops {

// Throws std::invalid_argument naming the key, the value and what is allowed.
Case parse_case_for_op(std::string_view line);
void validate_case(const Case& c);

}  // namespace moe::ops
