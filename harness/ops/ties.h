// Tie policies of top-k selection (SPEC §1.4) for the comparisons of the ops that select
// (topk_router, aux_loss_scores). The policy of the running check is thread-local, set by the
// check driver around each comparison (TieScope), so the registry's compare hooks keep their
// signature; the notes a comparison leaves (which rows were resolved under which policy) go to
// the scope's sink and into the case's report.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "harness/core/tensor.h"
#include "moe_harness/impl.h"

namespace moe::ops {

TiePolicy current_tie_policy();   // canonical outside any scope
void tie_note(std::string note);  // appended to the current scope's notes; dropped outside one

class TieScope {
 public:
  TieScope(TiePolicy p, std::vector<std::string>* notes);
  ~TieScope();
  TieScope(const TieScope&) = delete;
  TieScope& operator=(const TieScope&) = delete;

 private:
  TiePolicy prev_;
  std::vector<std::string>* prev_notes_;
};

// Rank of expert e among exactly tied candidates under a policy (lower wins) for a top-K over E.
// canonical and any: e. te: TE's naive path, (rev5(e mod 32), e div 32), when K < 16 or
// E > 8160; its radix path (index ascending) otherwise.
int64_t tie_rank(TiePolicy p, int64_t e, int64_t E, int64_t K);

// The exact-tie rule of one selected row: for every expert i the implementation selected and
// every eligible expert j it did not, with bitwise-equal inputs (same_inputs(i, j): equal
// selection scores in every implementation), the policy must prefer i. eligible(j) is false for
// experts outside the selected groups of grouped top-k. Returns one failure line per row (empty
// when the row obeys the policy; always empty for TiePolicy::any).
std::string exact_tie_violation(TiePolicy p, int64_t row, int64_t E, int64_t K,
                                const std::function<bool(int64_t)>& selected,
                                const std::function<bool(int64_t)>& eligible,
                                const std::function<uint64_t(int64_t)>& input_key);

// The tie policy over every row of an implementation's selection (routing_map, either format)
// of a top-K over logits [T,E] (+ optional bias [E]; grouped top-k when group_topk > 0, groups
// of E/num_groups experts). differing: the rows whose selection differs from the reference's and
// were accepted as near ties, with exact[i] true where the reference's boundary margin is 0.
// Returns failure lines (one per violating row, at most 8) and leaves a note saying which rows
// were resolved under which policy.
std::vector<std::string> apply_tie_policy(const Tensor& map, const Tensor& logits,
                                          const Tensor* bias, int64_t K, int64_t num_groups,
                                          int64_t group_topk, const std::vector<int64_t>& differing,
                                          const std::vector<bool>& exact);

}  // namespace moe::ops
