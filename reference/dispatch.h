// CPU reference of token_dispatch (SPEC §4) and token_combine (SPEC §5), the kernel backend's
// routing-map permute with optional alignment padding, forward and backward.
// Twin: gpu/dispatch.cuh (same names, same argument order, DeviceTensor, trailing Stream).
//
// Notation: T tokens, E experts, H hidden, a = align_size, N_out = num_out_tokens.
//   c_e        = sum_t routing_map[t,e]                      (tokens of expert e)
//   chat_e     = ceil(c_e/a)*a if a >= 1 else c_e           (0 stays 0: no padding rows)
//   rank(t,e)  = #{t' < t : routing_map[t',e] = 1}
//   pad_off_e  = sum_{e'<e} (chat_e' - c_e')
//   u(t,e)     = sum_{e'<e} c_e' + rank(t,e)                 (unpadded row id, in row_id_map)
//   dst(t,e)   = u(t,e) + pad_off_e                          (physical row in permuted)
// Layout: expert-major, ascending token within an expert, padding rows of expert e at
// sum_{e'<e} chat_e' + [c_e, chat_e). Rows not written by a routed (t,e) are zero.
//
// Tensors (row-major):
//   x                 [T,H]      d in {f32,bf16,f16} (f64 in finite-difference mode)
//   routing_map       [T,E]      bool (or u8/i32/i64) with values in {0,1}
//   probs             [T,E]      p (optional)
//   permuted          [R_out,H]  d, R_out = dispatch_out_rows(N_out, E, a)
//   permuted_probs    [R_out]    p (iff probs)
//   row_id_map        [T,2E+1]   i32: for token t with routed experts e_0 > e_1 > ... (descending)
//                                [t,k] = u(t,e_k), [t,E+k] = e_k for k < n_t, [t,2E] = n_t,
//                                every other entry -1 [DECISION]
//   pad_offsets       [E]        i32, pad_off_e; present iff a >= 1 (std::optional, R7)
//   tokens_per_expert [E]        i32, chat_e
//
// Forward: permuted[dst(t,e)] = x[t] and permuted_probs[dst(t,e)] = probs[t,e] for routed (t,e),
// except the TE quirk R12: probs[t,e] == 0 (either sign) writes a zero row instead of x[t].
// drop_overflow (a = 0 only): slots with u(t,e) >= N_out are dropped: left out of row_id_map and
// n_t, not written, not counted in tokens_per_expert.
// Backward: grad_x[t] = sum_{k<n_t} ct_permuted[dst(t,e_k)] in slot order (descending expert),
// rounded once to ct's dtype (the R12 slot still contributes); grad_probs[t,e] =
// ct_permuted_probs[dst(t,e)] for routed (t,e), else 0, in ct_permuted_probs' dtype.
//
// token_combine: src_k = row_id_map[t,k] + pad_offsets[e_k] (= dst(t,e_k)).
//   combined[t] = rnd_d( sum_{k<n_t} permuted[src_k] * w_k ), w_k = merging_probs[t,e_k] or 1,
//   summed in slot order; combined [T,H] in permuted's dtype.
// Backward (ct = grad_combined [T,H]): grad_permuted [R_in,H] in ct's dtype, R_in = rows of the
//   forward input (never recomputed from align_size, R6); rows no (t,e) maps to are 0 (R4).
//   Without merging probs grad_permuted[dst(t,e)] = ct[t] (exact copy); with them
//   rnd_d(ct[t] * merging_probs[t,e]) and grad_merging_probs[t,e] =
//   rnd_p(sum_h permuted[dst(t,e),h] * ct[t,h]) for routed (t,e), else 0 ([T,E] in p).
//
// All arithmetic is in double from the dtype-rounded inputs, with one rounding at the end
// (Rounding::none: no rounding, outputs f64). Data-dependent errors (routing_map values, capacity
// N_out < sum routing_map, bad row_id_map entries, source rows >= R_in) throw
// std::invalid_argument through throw_perm_fault.
#pragma once

#include <optional>

#include "harness/core/params/dispatch.h"
#include "reference/common.h"

namespace moe::ref {

struct TokenDispatchFwd {
  Tensor permuted;                       // [R_out,H] d
  std::optional<Tensor> permuted_probs;  // [R_out] p, iff probs
  Tensor row_id_map;                     // [T,2E+1] i32
  std::optional<Tensor> pad_offsets;     // [E] i32, iff align_size >= 1
  Tensor tokens_per_expert;              // [E] i32
};

TokenDispatchFwd token_dispatch_fwd(const Tensor& x, const Tensor& routing_map, const Tensor* probs,
                                    const TokenDispatchParams& p, Rounding r = Rounding::to_dtype);

struct TokenDispatchBwd {
  Tensor grad_x;                     // [T,H] in grad_permuted's dtype
  std::optional<Tensor> grad_probs;  // [T,E] in grad_permuted_probs' dtype, iff given
};

// grad_permuted [R_out,H]; grad_permuted_probs [R_out] (null when the forward had no probs);
// row_id_map and pad_offsets as saved by the forward.
TokenDispatchBwd token_dispatch_bwd(const Tensor& grad_permuted, const Tensor* grad_permuted_probs,
                                    const Tensor& row_id_map, const Tensor* pad_offsets,
                                    Rounding r = Rounding::to_dtype);

// combined [T,H] in permuted's dtype.
Tensor token_combine_fwd(const Tensor& permuted, const Tensor& row_id_map,
                         const Tensor* merging_probs, const Tensor* pad_offsets,
                         Rounding r = Rounding::to_dtype);

struct TokenCombineBwd {
  Tensor grad_permuted;                      // [R_in,H] in grad_combined's dtype
  std::optional<Tensor> grad_merging_probs;  // [T,E] in merging_probs' dtype, iff given
};

// permuted is the forward input exactly as consumed (R5): it fixes R_in and feeds
// grad_merging_probs.
TokenCombineBwd token_combine_bwd(const Tensor& grad_combined, const Tensor& permuted,
                                  const Tensor& row_id_map, const Tensor* merging_probs,
                                  const Tensor* pad_offsets, Rounding r = Rounding::to_dtype);

}  // namespace moe::ref
