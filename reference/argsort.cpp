#include "reference/argsort.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "reference/perm_detail.h"

namespace moe::ref {

namespace {

using detail::MatX;

// Reads selected_experts [T,K], checking ids in [0,E) and distinct within a row (§8.2 errors).
std::vector<int64_t> read_selected(const Tensor& sel, int64_t E) {
  const int64_t T = sel.dim(0), K = sel.dim(1);
  std::vector<int64_t> v(static_cast<size_t>(T * K));
  std::vector<int64_t> seen(static_cast<size_t>(E), -1);  // last row that used expert e
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = detail::int_at(sel, t * K + k);
      if (e < 0 || e >= E) throw_perm_fault(PermFault::expert_id_range, t * K + k, e);
      if (seen[e] == t) throw_perm_fault(PermFault::expert_id_duplicate, t, e);
      seen[e] = t;
      v[t * K + k] = e;
    }
  }
  return v;
}

// inv[i] = position of i in sorted_indices, after checking it is a permutation.
std::vector<int64_t> inverse_of(const Tensor& sorted_indices) {
  const std::vector<int64_t> si =
      detail::read_permutation(sorted_indices, PermFault::argsort_indices_perm);
  std::vector<int64_t> inv(si.size());
  for (size_t j = 0; j < si.size(); ++j) inv[si[j]] = static_cast<int64_t>(j);
  return inv;
}

// The weights as the combine uses them: rounded to the activation dtype d first [TE], except in
// finite-difference mode, which rounds nothing.
MatX combine_weights(const Tensor& weights, DType d, Rounding r) {
  MatX w = detail::to_matrix(weights);
  if (r == Rounding::to_dtype) w = w.unaryExpr([d](double v) { return round_to(d, v); });
  return w;
}

}  // namespace

RoutingMapToSelectedExpertsFwd routing_map_to_selected_experts_fwd(const Tensor& sparse_probs,
                                                                   const Tensor& routing_map,
                                                                   int64_t topk, Rounding r) {
  validate_routing_map_to_selected_experts(sparse_probs.meta(), routing_map.meta(), topk,
                                           r == Rounding::none);
  const int64_t T = sparse_probs.dim(0), E = sparse_probs.dim(1);
  const std::vector<uint8_t> map = detail::read_routing_map(routing_map);
  for (int64_t t = 0; t < T; ++t) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) n += map[t * E + e];
    // TE silently picks wrong experts here; the spec makes it an error [DECISION].
    if (n != topk) throw_perm_fault(PermFault::routing_map_row_count, t, n);
  }
  RoutingMapToSelectedExpertsFwd out;
  out.selected_experts = Tensor(DType::i32, {T, topk});
  out.weights = Tensor(out_dtype(sparse_probs.dtype(), r), {T, topk});
  for (int64_t t = 0; t < T; ++t) {
    int64_t k = 0;
    for (int64_t e = 0; e < E; ++e) {  // ascending ids: the tail of a stable argsort of the bools
      if (!map[t * E + e]) continue;
      out.selected_experts.set(t, k, static_cast<double>(e));
      out.weights.set(t, k, sparse_probs.at(t, e));
      ++k;
    }
  }
  return out;
}

Tensor routing_map_to_selected_experts_bwd(const Tensor& grad_weights,
                                           const Tensor& selected_experts, int64_t num_experts,
                                           Rounding r) {
  validate_routing_map_to_selected_experts_bwd(grad_weights.meta(), selected_experts.meta(),
                                               num_experts, r == Rounding::none);
  const int64_t T = grad_weights.dim(0), K = grad_weights.dim(1);
  const std::vector<int64_t> sel = read_selected(selected_experts, num_experts);
  Tensor g(out_dtype(grad_weights.dtype(), r), {T, num_experts});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) g.set(t, sel[t * K + k], grad_weights.at(t, k));
  return g;
}

ArgsortTokenDispatchFwd argsort_token_dispatch_fwd(const Tensor& x, const Tensor& selected_experts,
                                                   const ArgsortDispatchParams& p, Rounding r) {
  const ArgsortPermParams st =
      validate_argsort_token_dispatch(x.meta(), selected_experts.meta(), p, r == Rounding::none);
  const int64_t E = p.num_experts, K = p.topk, a = p.align_size;
  const int64_t N = st.num_real_tokens, P = st.padding_size, H = x.dim(1);
  const std::vector<int64_t> sel = read_selected(selected_experts, E);

  std::vector<int64_t> key(static_cast<size_t>(N + P)), count(E, 0), need(E, 0);
  for (int64_t i = 0; i < N; ++i) {
    key[i] = sel[i];
    ++count[sel[i]];
  }
  if (a > 0) {
    for (int64_t e = 0; e < E; ++e) need[e] = (a - count[e] % a) % a;
    // E slots of (a-1) positions; slot e's first need_e positions pad expert e, the rest are
    // overflow placeholders keyed E-1 so they sort behind every real group.
    for (int64_t q = 0; q < P; ++q) {
      const int64_t owner = q / (a - 1), o = q % (a - 1);
      key[N + q] = o < need[owner] ? owner : E - 1;
    }
  }
  const int64_t roll = p.roll_to_expert_id.value_or(0);
  if (roll != 0) {
    for (auto& k : key) k = ((k - roll) % E + E) % E;
  }
  std::vector<int64_t> order(key.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t i, int64_t j) { return key[i] < key[j]; });

  ArgsortTokenDispatchFwd out;
  out.state = st;
  out.sorted_x = Tensor(out_dtype(x.dtype(), r), {N + P, H});  // padding rows stay 0
  out.sorted_indices = Tensor(DType::i32, {N + P});
  for (int64_t j = 0; j < N + P; ++j) {
    out.sorted_indices.set(j, static_cast<double>(order[j]));
    if (order[j] < N) detail::copy_row(out.sorted_x, j, x, order[j] / K);
  }
  // group_sizes is c_e + need_e, not a bincount of the keys (placeholders are not counted).
  out.group_sizes = Tensor(DType::i32, {E});
  for (int64_t i = 0; i < E; ++i) {
    const int64_t e = (i + roll) % E;
    out.group_sizes.set(i, static_cast<double>(count[e] + need[e]));
  }
  return out;
}

Tensor argsort_token_dispatch_bwd(const Tensor& grad_sorted_x, const Tensor& sorted_indices,
                                  const ArgsortPermParams& p, Rounding r) {
  validate_argsort_token_dispatch_bwd(grad_sorted_x.meta(), sorted_indices.meta(), p,
                                      r == Rounding::none);
  const int64_t K = p.topk, N = p.num_real_tokens, T = N / K, H = grad_sorted_x.dim(1);
  const std::vector<int64_t> inv = inverse_of(sorted_indices);
  const MatX ct = detail::to_matrix(grad_sorted_x);
  MatX gx = MatX::Zero(T, H);
  if (H > 0) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) gx.row(t) += ct.row(inv[t * K + k]);
  }
  Tensor out(out_dtype(grad_sorted_x.dtype(), r), {T, H});
  detail::store(out, gx);
  return out;
}

Tensor argsort_token_combine_fwd(const Tensor& expert_outputs, const Tensor& sorted_indices,
                                 const Tensor& weights, const ArgsortPermParams& p, Rounding r) {
  validate_argsort_token_combine(expert_outputs.meta(), sorted_indices.meta(), weights.meta(), p,
                                 r == Rounding::none);
  const int64_t K = p.topk, T = p.num_real_tokens / K, H = expert_outputs.dim(1);
  const std::vector<int64_t> inv = inverse_of(sorted_indices);
  const MatX eo = detail::to_matrix(expert_outputs);
  const MatX w = combine_weights(weights, expert_outputs.dtype(), r);
  MatX y = MatX::Zero(T, H);
  if (H > 0) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) y.row(t) += w(t, k) * eo.row(inv[t * K + k]);
  }
  Tensor out(out_dtype(expert_outputs.dtype(), r), {T, H});
  detail::store(out, y);
  return out;
}

ArgsortTokenCombineBwd argsort_token_combine_bwd(const Tensor& grad_combined,
                                                 const Tensor& expert_outputs,
                                                 const Tensor& sorted_indices,
                                                 const Tensor& weights, const ArgsortPermParams& p,
                                                 Rounding r) {
  validate_argsort_token_combine_bwd(grad_combined.meta(), expert_outputs.meta(),
                                     sorted_indices.meta(), weights.meta(), p, r == Rounding::none);
  const int64_t K = p.topk, N = p.num_real_tokens, T = N / K, H = expert_outputs.dim(1);
  const int64_t rows = N + p.padding_size;
  const std::vector<int64_t> inv = inverse_of(sorted_indices);
  const MatX eo = detail::to_matrix(expert_outputs);
  const MatX ct = detail::to_matrix(grad_combined);
  const MatX w = combine_weights(weights, expert_outputs.dtype(), r);
  MatX ge = MatX::Zero(rows, H);  // padding positions (sorted_indices >= N) stay 0
  MatX gw = MatX::Zero(T, K);
  if (H > 0) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = inv[t * K + k];
        ge.row(j) = ct.row(t) * w(t, k);
        gw(t, k) = ct.row(t).dot(eo.row(j));
      }
    }
  }
  ArgsortTokenCombineBwd out;
  out.grad_expert_outputs = Tensor(out_dtype(grad_combined.dtype(), r), {rows, H});
  detail::store(out.grad_expert_outputs, ge);
  out.grad_weights = Tensor(out_dtype(weights.dtype(), r), {T, K});
  detail::store(out.grad_weights, gw);
  return out;
}

}  // namespace moe::ref
