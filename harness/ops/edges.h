// Edge classes of a Case: which boundaries of the parameter space it reaches (issue 19), so a
// run can say which edges it covered. Generic over the parameter keys: row counts (T, R, N,
// N_rows, M_total), expert counts (E, num_experts, C), topk and grouping (num_groups,
// group_topk), and the other size keys (H, M, K, G, B, S, align_size, num_ep).
#pragma once

#include <string>
#include <vector>

#include "harness/core/case.h"

namespace moe::ops {

// The edge classes c hits, in a fixed order, e.g. {"T=0", "E=33 (warp+1)", "K=E", "g_k=G"}.
// Size keys: "X=0", "X=1", "X=8 (chunk)", "X=9 (chunk+1)", "X=32 (warp)", "X=33 (warp+1)",
// "X=256 (block)", "X=257 (block+1)", "X=n (pow2)" / "(pow2+1)" for other powers of two >= 16,
// "X>=1024" for expert counts (and "X=4096 (max)" at the supported maximum). Relations: "K=1",
// "K=E", "K=E-1", "K>=16 (radix path)", "grouped", "g_k=G", "g_k=1", "G=1", "E/G=1",
// "K/g_k=E/G", "C=m*E (m>1)", "T_tot>R", "align_size=1".
std::vector<std::string> edge_classes(const Case& c);

}  // namespace moe::ops
