#include "harness/ops/ties.h"

#include "harness/core/params/router.h"

#include <cstring>
#include <map>
#include <stdexcept>

namespace moe::ops {

namespace {
thread_local TiePolicy t_policy = TiePolicy::canonical;
thread_local std::vector<std::string>* t_notes = nullptr;

int64_t rev5(int64_t lane) {
  int64_t r = 0;
  for (int b = 0; b < 5; ++b) r |= ((lane >> b) & 1) << (4 - b);
  return r;
}
}  // namespace

}  // namespace moe::ops

namespace moe {

std::string_view tie_policy_name(TiePolicy p) {
  switch (p) {
    case TiePolicy::canonical:
      return "canonical";
    case TiePolicy::te:
      return "te";
    case TiePolicy::any:
      return "any";
  }
  return "?";
}

TiePolicy parse_tie_policy(std::string_view s) {
  if (s == "canonical") return TiePolicy::canonical;
  if (s == "te") return TiePolicy::te;
  if (s == "any") return TiePolicy::any;
  throw std::invalid_argument("ties: unknown tie policy '" + std::string(s) +
                              "' (allowed: canonical, te, any)");
}

}  // namespace moe

namespace moe::ops {

TiePolicy current_tie_policy() {
  return t_policy;
}

void tie_note(std::string note) {
  if (t_notes) t_notes->push_back(std::move(note));
}

TieScope::TieScope(TiePolicy p, std::vector<std::string>* notes)
    : prev_(t_policy), prev_notes_(t_notes) {
  t_policy = p;
  t_notes = notes;
}

TieScope::~TieScope() {
  t_policy = prev_;
  t_notes = prev_notes_;
}

int64_t tie_rank(TiePolicy p, int64_t e, int64_t E, int64_t K) {
  // TE picks with its naive warp top-k below NVTE_RADIX_TOPK_THRESHOLD (16) and above the radix
  // path's 8160 experts (SPEC §1.4); every lane keeps its first strict maximum and the xor
  // butterfly keeps the lower lane's value on ties, so lanes rank by their reversed bits.
  if (p == TiePolicy::te && (K < 16 || E > 8160)) return rev5(e % 32) * ((E + 31) / 32) + e / 32;
  return e;
}

std::string exact_tie_violation(TiePolicy p, int64_t row, int64_t E, int64_t K,
                                const std::function<bool(int64_t)>& selected,
                                const std::function<bool(int64_t)>& eligible,
                                const std::function<uint64_t(int64_t)>& input_key) {
  if (p == TiePolicy::any) return {};
  // Per input value: the worst-ranked selected expert and the best-ranked eligible unselected one.
  struct Extremes {
    int64_t worst_sel = -1, best_unsel = -1;
  };
  std::map<uint64_t, Extremes> by_value;
  for (int64_t e = 0; e < E; ++e) {
    const bool s = selected(e);
    if (!s && !eligible(e)) continue;
    Extremes& x = by_value[input_key(e)];
    const int64_t r = tie_rank(p, e, E, K);
    if (s && (x.worst_sel < 0 || r > tie_rank(p, x.worst_sel, E, K))) x.worst_sel = e;
    if (!s && (x.best_unsel < 0 || r < tie_rank(p, x.best_unsel, E, K))) x.best_unsel = e;
  }
  for (auto& [key, x] : by_value) {
    if (x.worst_sel < 0 || x.best_unsel < 0) continue;
    if (tie_rank(p, x.best_unsel, E, K) < tie_rank(p, x.worst_sel, E, K)) {
      return "row " + std::to_string(row) + ": exact tie between bitwise-equal inputs (experts " +
             std::to_string(x.worst_sel) + " selected, " + std::to_string(x.best_unsel) +
             " not) not resolved by the " + std::string(tie_policy_name(p)) +
             " tie rule (it prefers " + std::to_string(x.best_unsel) + ")";
    }
  }
  return {};
}

std::vector<std::string> apply_tie_policy(const Tensor& map, const Tensor& logits,
                                          const Tensor* bias, int64_t K, int64_t num_groups,
                                          int64_t group_topk, const std::vector<int64_t>& differing,
                                          const std::vector<bool>& exact) {
  const TiePolicy p = current_tie_policy();
  const int64_t T = logits.dim(0), E = logits.dim(1);
  const int64_t per = group_topk > 0 && num_groups > 0 ? E / num_groups : E;
  std::vector<std::string> failures;
  for (int64_t t = 0; t < T && failures.size() < 8; ++t) {
    std::vector<char> sel(E), group_on(E / std::max<int64_t>(per, 1) + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      sel[e] = routing_map_get(map, t, e);
      if (sel[e]) group_on[e / per] = 1;
    }
    // Bitwise-equal inputs give equal selection scores in every implementation; the key is the
    // fp32 pattern of the logit and of the bias.
    auto key = [&](int64_t e) {
      const float x = static_cast<float>(logits.at(t, e));
      const float b = bias ? static_cast<float>(bias->at(e)) : 0.0f;
      uint32_t xb, bb;
      std::memcpy(&xb, &x, 4);
      std::memcpy(&bb, &b, 4);
      return (static_cast<uint64_t>(xb) << 32) | bb;
    };
    const std::string v = exact_tie_violation(
        p, t, E, K, [&](int64_t e) { return sel[e] != 0; },
        [&](int64_t e) { return group_on[e / per] != 0; }, key);
    if (!v.empty()) failures.push_back("routing_map " + v);
  }
  // Which rows were accepted, and why, for the report.
  std::string exact_rows, near_rows;
  int n_exact = 0, n_near = 0;
  for (size_t i = 0; i < differing.size(); ++i) {
    std::string& list = exact[i] ? exact_rows : near_rows;
    int& n = exact[i] ? n_exact : n_near;
    if (n++ < 10) list += (list.empty() ? "" : ", ") + std::to_string(differing[i]);
  }
  auto more = [](int n) {
    return n > 10 ? ", ... (" + std::to_string(n) + " rows)" : std::string();
  };
  if (n_exact)
    tie_note("rows " + exact_rows + more(n_exact) +
             ": exact ties selected differently from the "
             "reference, accepted under --ties " +
             std::string(tie_policy_name(p)) +
             " and compared under the implementation's selection");
  if (n_near)
    tie_note("rows " + near_rows + more(n_near) +
             ": near ties (margin within the fp32 noise of "
             "SPEC §1.4) selected differently from the reference, compared under the "
             "implementation's selection");
  return failures;
}

}  // namespace moe::ops
