#include "reference/dispatch.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/perm_detail.h"

namespace moe::ref {

namespace {

using detail::MatX;

// One routed slot k < n_t of a token: its expert e_k and physical row src_k = u + pad_off[e_k].
struct Slot {
  int64_t e;
  int64_t row;
};

// Decodes row_id_map [T,2E+1] (plus pad_offsets) into the slots of every token, in slot order
// (descending expert). Every entry the consumers read is checked: n_t in [0,E], e_k in [0,E),
// u >= 0 and the physical row inside [0, rows) (SPEC §5 errors, data-dependent).
std::vector<std::vector<Slot>> read_slots(const Tensor& row_id_map, const Tensor* pad_offsets,
                                          int64_t rows) {
  const int64_t T = row_id_map.dim(0), W = row_id_map.dim(1), E = (W - 1) / 2;
  std::vector<std::vector<Slot>> slots(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = detail::int_at(row_id_map, t * W + 2 * E);
    if (n < 0 || n > E) throw_perm_fault(PermFault::row_id_map_entry, t * W + 2 * E, n);
    slots[t].reserve(static_cast<size_t>(n));
    for (int64_t k = 0; k < n; ++k) {
      const int64_t u = detail::int_at(row_id_map, t * W + k);
      const int64_t e = detail::int_at(row_id_map, t * W + E + k);
      if (e < 0 || e >= E) throw_perm_fault(PermFault::row_id_map_entry, t * W + E + k, e);
      if (u < 0) throw_perm_fault(PermFault::row_id_map_entry, t * W + k, u);
      const int64_t row = u + (pad_offsets ? detail::int_at(*pad_offsets, e) : 0);
      if (row < 0 || row >= rows) throw_perm_fault(PermFault::source_row, row, rows);
      slots[t].push_back({e, row});
    }
  }
  return slots;
}

}  // namespace

TokenDispatchFwd token_dispatch_fwd(const Tensor& x, const Tensor& routing_map, const Tensor* probs,
                                    const TokenDispatchParams& p, Rounding r) {
  const TensorMeta probs_meta = probs ? probs->meta() : TensorMeta{};
  const DispatchDims d = validate_token_dispatch(
      x.meta(), routing_map.meta(), probs ? &probs_meta : nullptr, p, r == Rounding::none);
  const int64_t T = d.T, H = d.H, E = d.E, a = p.align_size, n_out = p.num_out_tokens;

  // Counts and the capacity check come before any output is allocated (R8, R11).
  const std::vector<uint8_t> map = detail::read_routing_map(routing_map);
  std::vector<int64_t> count(E, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) count[e] += map[t * E + e];
  int64_t routed = 0;
  for (int64_t c : count) routed += c;
  if (!p.drop_overflow && routed > n_out) throw_perm_fault(PermFault::capacity, routed, n_out);

  // u(t,e) starts at ustart[e]; with drop_overflow only u < N_out is kept, a prefix of the
  // expert-major order, so expert e keeps clamp(N_out - ustart[e], 0, c_e) rows.
  std::vector<int64_t> ustart(E, 0), kept(E, 0), aligned(E, 0), pad_off(E, 0);
  int64_t acc = 0, pad_acc = 0, total = 0;
  for (int64_t e = 0; e < E; ++e) {
    ustart[e] = acc;
    acc += count[e];
    kept[e] = p.drop_overflow ? std::clamp<int64_t>(n_out - ustart[e], 0, count[e]) : count[e];
    aligned[e] = dispatch_aligned_count(kept[e], a);
    pad_off[e] = pad_acc;
    pad_acc += aligned[e] - kept[e];
    total += aligned[e];
  }
  if (total > d.R_out) {
    throw std::logic_error("token_dispatch: sum of aligned counts " + std::to_string(total) +
                           " exceeds R_out=" + std::to_string(d.R_out));
  }

  TokenDispatchFwd out;
  out.permuted = Tensor(out_dtype(x.dtype(), r), {d.R_out, H});  // zero rows by default
  if (probs) out.permuted_probs = Tensor(out_dtype(probs->dtype(), r), {d.R_out});
  out.row_id_map = Tensor(DType::i32, {T, 2 * E + 1});
  out.row_id_map.fill(-1);
  out.tokens_per_expert = Tensor(DType::i32, {E});
  if (a >= 1) out.pad_offsets = Tensor(DType::i32, {E});
  for (int64_t e = 0; e < E; ++e) {
    out.tokens_per_expert.set(e, static_cast<double>(aligned[e]));
    if (out.pad_offsets) out.pad_offsets->set(e, static_cast<double>(pad_off[e]));
  }

  std::vector<int64_t> rank(E, 0);
  std::vector<std::pair<int64_t, int64_t>> slots;  // (e, u) of one token, ascending e
  for (int64_t t = 0; t < T; ++t) {
    slots.clear();
    for (int64_t e = 0; e < E; ++e) {
      if (!map[t * E + e]) continue;
      const int64_t u = ustart[e] + rank[e]++;
      if (u >= n_out) continue;  // dropped (drop_overflow only; otherwise u < routed <= N_out)
      slots.emplace_back(e, u);
      const int64_t dst = u + pad_off[e];
      if (probs) {
        const double pr = probs->at(t, e);
        out.permuted_probs->set(dst, pr);
        // TE quirk (R12): an exactly-zero prob (either sign) marks routing-map padding and writes
        // a zero row; the row was allocated zero, so nothing is copied.
        if (pr == 0.0) continue;
      }
      detail::copy_row(out.permuted, dst, x, t);
    }
    // row_id_map lists the token's experts in descending order.
    const int64_t n = static_cast<int64_t>(slots.size());
    for (int64_t k = 0; k < n; ++k) {
      const auto [e, u] = slots[n - 1 - k];
      out.row_id_map.set(t, k, static_cast<double>(u));
      out.row_id_map.set(t, E + k, static_cast<double>(e));
    }
    out.row_id_map.set(t, 2 * E, static_cast<double>(n));
  }
  return out;
}

TokenDispatchBwd token_dispatch_bwd(const Tensor& grad_permuted, const Tensor* grad_permuted_probs,
                                    const Tensor& row_id_map, const Tensor* pad_offsets,
                                    Rounding r) {
  const TensorMeta gpp_meta = grad_permuted_probs ? grad_permuted_probs->meta() : TensorMeta{};
  const TensorMeta pad_meta = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const DispatchDims d = validate_token_dispatch_bwd(
      grad_permuted.meta(), grad_permuted_probs ? &gpp_meta : nullptr, row_id_map.meta(),
      pad_offsets ? &pad_meta : nullptr, r == Rounding::none);
  const auto slots = read_slots(row_id_map, pad_offsets, d.R_out);

  const MatX ct = detail::to_matrix(grad_permuted);
  MatX gx = MatX::Zero(d.T, d.H);
  TokenDispatchBwd out;
  if (grad_permuted_probs) {
    out.grad_probs = Tensor(out_dtype(grad_permuted_probs->dtype(), r), {d.T, d.E});
  }
  for (int64_t t = 0; t < d.T; ++t) {
    // Slot order k = 0.. (descending expert), as the kernel accumulates. The R12 zero-row slot
    // still contributes: TE's backward ignores the forward quirk.
    for (const Slot& s : slots[t]) {
      if (d.H > 0) gx.row(t) += ct.row(s.row);
      if (out.grad_probs) out.grad_probs->set(t, s.e, grad_permuted_probs->at(s.row));
    }
  }
  out.grad_x = Tensor(out_dtype(grad_permuted.dtype(), r), {d.T, d.H});
  detail::store(out.grad_x, gx);
  return out;
}

Tensor token_combine_fwd(const Tensor& permuted, const Tensor& row_id_map,
                         const Tensor* merging_probs, const Tensor* pad_offsets, Rounding r) {
  const TensorMeta mp_meta = merging_probs ? merging_probs->meta() : TensorMeta{};
  const TensorMeta pad_meta = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const CombineDims d =
      validate_token_combine(permuted.meta(), row_id_map.meta(), merging_probs ? &mp_meta : nullptr,
                             pad_offsets ? &pad_meta : nullptr, r == Rounding::none);
  const auto slots = read_slots(row_id_map, pad_offsets, d.R_in);

  const MatX x = detail::to_matrix(permuted);
  MatX y = MatX::Zero(d.T, d.H);
  for (int64_t t = 0; t < d.T; ++t) {
    for (const Slot& s : slots[t]) {  // slot order: descending expert
      const double w = merging_probs ? merging_probs->at(t, s.e) : 1.0;
      if (d.H > 0) y.row(t) += x.row(s.row) * w;
    }
  }
  Tensor out(out_dtype(permuted.dtype(), r), {d.T, d.H});
  detail::store(out, y);
  return out;
}

TokenCombineBwd token_combine_bwd(const Tensor& grad_combined, const Tensor& permuted,
                                  const Tensor& row_id_map, const Tensor* merging_probs,
                                  const Tensor* pad_offsets, Rounding r) {
  const TensorMeta mp_meta = merging_probs ? merging_probs->meta() : TensorMeta{};
  const TensorMeta pad_meta = pad_offsets ? pad_offsets->meta() : TensorMeta{};
  const CombineDims d = validate_token_combine_bwd(
      grad_combined.meta(), permuted.meta(), row_id_map.meta(), merging_probs ? &mp_meta : nullptr,
      pad_offsets ? &pad_meta : nullptr, r == Rounding::none);
  const auto slots = read_slots(row_id_map, pad_offsets, d.R_in);

  const MatX ct = detail::to_matrix(grad_combined);
  const MatX x = merging_probs ? detail::to_matrix(permuted) : MatX();
  // Every row starts at zero: padding rows, the tail and rows no (t,e) maps to stay 0 (R4). The
  // row count is the forward input's R_in, never recomputed from align_size (R6).
  MatX gp = MatX::Zero(d.R_in, d.H);
  MatX gw = MatX::Zero(d.T, d.E);
  for (int64_t t = 0; t < d.T; ++t) {
    for (const Slot& s : slots[t]) {
      if (!merging_probs) {
        if (d.H > 0) gp.row(s.row) = ct.row(t);  // exact copy
        continue;
      }
      const double w = merging_probs->at(t, s.e);
      if (d.H > 0) {
        gp.row(s.row) = ct.row(t) * w;
        gw(t, s.e) = x.row(s.row).dot(ct.row(t));
      }
    }
  }
  TokenCombineBwd out;
  out.grad_permuted = Tensor(out_dtype(grad_combined.dtype(), r), {d.R_in, d.H});
  detail::store(out.grad_permuted, gp);
  if (merging_probs) {
    out.grad_merging_probs = Tensor(out_dtype(merging_probs->dtype(), r), {d.T, d.E});
    detail::store(*out.grad_merging_probs, gw);
  }
  return out;
}

}  // namespace moe::ref
