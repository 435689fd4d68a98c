// Pieces shared by the permutation-family records (token_dispatch, token_combine,
// sort_chunks_by_index, routing_map_to_selected_experts, argsort_token_dispatch,
// argsort_token_combine): routing maps per regime, case parameters, and the comparison that keeps
// data movement bitwise while reductions use the SPEC §12 bound.
#pragma once

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "harness/core/params/dispatch.h"
#include "harness/ops/registry.h"

namespace moe::ops {

// Expert lists per token (each list distinct, ascending) for the case's regime, from
// (c.seed, name):
//   uniform     K distinct experts uniformly at random
//   skewed      K distinct experts drawn with weight 1/(e+1)^2 (low ids take most tokens)
//   all_to_one  every token routes to the same K experts
//   zero_tokens only a random subset of max(K, E/2) experts is ever used, so the others get
//               no tokens whenever E/2 > K or E >= 2
// ragged = true: token t gets a uniform count in [0, K] instead of exactly K.
std::vector<std::vector<int64_t>> make_routes(const Case& c, int64_t T, int64_t E, int64_t K,
                                              bool ragged, const std::string& name);
// The [T,E] bool routing map of a route list.
Tensor routes_to_map(const std::vector<std::vector<int64_t>>& routes, int64_t E);

// Float tensors in dtype d from (c.seed, name).
Tensor normal_tensor(const Case& c, DType d, const Shape& s, const std::string& name);
Tensor uniform_tensor(const Case& c, DType d, const Shape& s, double lo, double hi,
                      const std::string& name);

// An optional dtype key: absent or "none" means the tensor is absent.
std::optional<DType> opt_dtype(const Case& c, const std::string& key);
std::string dtype_or_none(const std::optional<DType>& d);

// "7,0,20,33" <-> {7, 0, 20, 33} (empty string: empty list).
std::vector<int64_t> parse_int_list(const std::string& s, const std::string& key);
std::string int_list(const std::vector<int64_t>& v);

TokenDispatchParams dispatch_params(const Case& c);  // num_out_tokens, align_size, drop_overflow

// Argsort-backend parameters: E, topk, align_size, roll_to_expert_id (absent key = none).
ArgsortDispatchParams argsort_params(const Case& c);
// selected_experts [T,K] i32: the explicit comma list of key "selected_experts" when present,
// otherwise make_routes(...) with each row shuffled (router order is not ascending).
Tensor make_selected_experts(const Case& c, int64_t T, int64_t E, int64_t K);
// The [T,E] bool routing map of selected_experts.
Tensor selected_to_map(const Tensor& selected, int64_t E);

// Compares every key of want: keys in `toleranced` through op.bound, every other key bitwise
// (data movement, indices and counts are exact, SPEC §12).
Report compare_perm(const OpInfo& op, const Case& c, const TensorMap& in, const TensorMap& want,
                    const TensorMap& got, const std::set<std::string>& toleranced);

// Pointer to m[key] or null when absent (optional tensors are absent keys).
const Tensor* find_tensor(const TensorMap& m, const std::string& key);

// The first `max` failures are kept; the count of the rest is appended.
class FailureList {
 public:
  explicit FailureList(size_t max = 8) : max_(max) {}
  void add(const std::string& s) {
    if (lines_.size() < max_) lines_.push_back(s);
    ++total_;
  }
  std::vector<std::string> take() {
    if (total_ > lines_.size()) {
      lines_.push_back("... and " + std::to_string(total_ - lines_.size()) + " more");
    }
    return std::move(lines_);
  }

 private:
  size_t max_;
  size_t total_ = 0;
  std::vector<std::string> lines_;
};

}  // namespace moe::ops
