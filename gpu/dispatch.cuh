// CUDA twin of reference/dispatch.h: token_dispatch (SPEC §4) and token_combine (SPEC §5), the
// kernel backend's routing-map permute with optional alignment padding, forward and backward.
// Same names and argument order as moe::ref, DeviceTensor in place of Tensor, a trailing Stream.
// No CUDA types here: host C++ includes this header.
//
// Layouts and math: see reference/dispatch.h (row_id_map [T,2E+1] i32, expert-major `permuted`,
// padding rows and the tail zero, R12 zero-prob quirk, drop_overflow).
//
// Kernels (gpu/dispatch.cu):
//   routing ranks  routing_map -> column bitmap (32 tokens per word) -> per-word prefix counts ->
//                  one CTA scans the E experts: c_e, u-start, aligned counts, pad_offsets, the
//                  capacity check (R11) -> one warp per token writes its row_id_map row
//                  (descending experts by ballot compaction).
//   dispatch fwd   one pass writes every row of `permuted` (dispatch_rows_kernel): work items
//                  are tokens (one CTA, one warp per slot: warp k copies x[t] to dst(t,e_k) in
//                  16-byte vectors, the CTA's warps sharing one HBM read of x[t] through the
//                  cache) and groups of the rows no slot writes (padding rows of every expert,
//                  then the tail: one zero row per warp), grid-strided over one wave of resident
//                  CTAs, with streaming stores.
//   dispatch bwd / combine fwd
//                  each token's n_t source rows are gathered through row_id_map and summed in
//                  fp32 in slot order (descending expert): a gather, no atomics, deterministic.
//                  Rows of 16-byte vectors: two CTAs an SM, each with a producer warp that
//                  bulk-copies row chunks (cp.async.bulk) into a shared-memory ring ahead of the
//                  summing threads; other rows: one CTA per token, loads from registers.
//   combine bwd    the owner of each row of grad_permuted (the last slot mapping to it, as the
//                  reference's sequential writes leave it) is found with an integer atomicMax;
//                  then one warp per slot writes the row its slot owns (ct[t], times w_k with
//                  merging probs) and, with merging probs, the slot's dot product (a fixed
//                  shuffle butterfly); rows nobody owns are zeroed (R4).
//
// Data-dependent faults (routing_map values, capacity, row_id_map entries, source rows) are
// detected on the device and, with RunOptions::validate (the default), read back after the op
// and thrown as std::invalid_argument through throw_perm_fault, the reference's messages. Every
// write is bounds-checked, so an invalid input never writes outside an output.
#pragma once

#include <optional>

#include "gpu/runtime.cuh"
#include "harness/core/params/dispatch.h"

namespace moe::gpu {

// How a wrapper runs; shared by the dispatch, sort_chunks, argsort and EP twins.
struct RunOptions {
  bool validate = true;  // read the device error flag back (synchronises the stream) and throw
  bool poison = false;   // fill every output with NaN / 0x7f bytes first (tests)
};

struct TokenDispatchFwd {
  DeviceTensor permuted;                       // [R_out,H] d
  std::optional<DeviceTensor> permuted_probs;  // [R_out] p, iff probs
  DeviceTensor row_id_map;                     // [T,2E+1] i32
  std::optional<DeviceTensor> pad_offsets;     // [E] i32, iff align_size >= 1
  DeviceTensor tokens_per_expert;              // [E] i32
};

TokenDispatchFwd token_dispatch_fwd(const DeviceTensor& x, const DeviceTensor& routing_map,
                                    const DeviceTensor* probs, const TokenDispatchParams& p,
                                    Stream s = nullptr, const RunOptions& o = {});
// Launch-only form into outputs allocated by a previous call (benchmarks): err is a device
// error flag (ErrorFlag::device_ptr) or null; nothing is synchronised.
void token_dispatch_fwd_into(const DeviceTensor& x, const DeviceTensor& routing_map,
                             const DeviceTensor* probs, const TokenDispatchParams& p,
                             TokenDispatchFwd& out, void* err, Stream s);

struct TokenDispatchBwd {
  DeviceTensor grad_x;                     // [T,H] in grad_permuted's dtype
  std::optional<DeviceTensor> grad_probs;  // [T,E] in grad_permuted_probs' dtype, iff given
};

TokenDispatchBwd token_dispatch_bwd(const DeviceTensor& grad_permuted,
                                    const DeviceTensor* grad_permuted_probs,
                                    const DeviceTensor& row_id_map, const DeviceTensor* pad_offsets,
                                    Stream s = nullptr, const RunOptions& o = {});
void token_dispatch_bwd_into(const DeviceTensor& grad_permuted,
                             const DeviceTensor* grad_permuted_probs,
                             const DeviceTensor& row_id_map, const DeviceTensor* pad_offsets,
                             TokenDispatchBwd& out, void* err, Stream s);

// combined [T,H] in permuted's dtype.
DeviceTensor token_combine_fwd(const DeviceTensor& permuted, const DeviceTensor& row_id_map,
                               const DeviceTensor* merging_probs, const DeviceTensor* pad_offsets,
                               Stream s = nullptr, const RunOptions& o = {});
void token_combine_fwd_into(const DeviceTensor& permuted, const DeviceTensor& row_id_map,
                            const DeviceTensor* merging_probs, const DeviceTensor* pad_offsets,
                            DeviceTensor& combined, void* err, Stream s);

struct TokenCombineBwd {
  DeviceTensor grad_permuted;                      // [R_in,H] in grad_combined's dtype
  std::optional<DeviceTensor> grad_merging_probs;  // [T,E] in merging_probs' dtype, iff given
};

TokenCombineBwd token_combine_bwd(const DeviceTensor& grad_combined, const DeviceTensor& permuted,
                                  const DeviceTensor& row_id_map, const DeviceTensor* merging_probs,
                                  const DeviceTensor* pad_offsets, Stream s = nullptr,
                                  const RunOptions& o = {});
void token_combine_bwd_into(const DeviceTensor& grad_combined, const DeviceTensor& permuted,
                            const DeviceTensor& row_id_map, const DeviceTensor* merging_probs,
                            const DeviceTensor* pad_offsets, TokenCombineBwd& out, void* err,
                            Stream s);

}  // namespace moe::gpu
