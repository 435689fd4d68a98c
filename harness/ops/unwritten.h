// UnwrittenRows::te (include/moe_harness/impl.h): the rows SPEC §0 lets TE leave uninitialised
// are taken from the reference before the comparison, so they compare equal and cannot fail it.
#pragma once

#include <string>
#include <vector>

#include "harness/core/case.h"
#include "harness/core/tensor.h"
#include "moe_harness/impl.h"

namespace moe::ops {

// Copies want's values into got for the rows (and row_id_map entries) SPEC says TE may leave
// unwritten in case c; returns a note naming how many were masked, or "" when none were.
std::string mask_unwritten(UnwrittenRows policy, const Case& c, const TensorMap& in,
                           const TensorMap& want, TensorMap& got);

}  // namespace moe::ops
