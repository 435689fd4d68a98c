// Pieces shared by the records of SPEC §9-11 (ragged_a2a_params, ragged_all_to_all,
// local_permute_after_a2a, local_unpermute_before_a2a, grouped_gemm, swiglu_expert_ffn,
// moe_block): per-rank stacking (EP ops store per-shard values along a leading axis of length P,
// SPEC §14), generated counts per regime, and GEMM bounds.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "harness/core/params/block.h"
#include "harness/ops/registry.h"

namespace moe::ops {

// [P, ...] from P tensors of one dtype and shape, and back.
Tensor stack(const std::vector<Tensor>& v);
std::vector<Tensor> unstack(const Tensor& t);

// Sizes of `groups` buckets summing to `total`, distributed per the case's regime from
// (c.seed, name): uniform, skewed (low ids take most), zero_tokens (about half the buckets stay
// empty), all_to_one (one bucket takes everything). Case key even_groups=true overrides the regime:
// every bucket total / groups, the first total % groups one more (capacity-padded or
// expert-choice routing; the shape a strided-batched GEMM runs, bench's vendor yardstick).
std::vector<int64_t> make_group_sizes(const Case& c, int64_t groups, int64_t total,
                                      const std::string& name);

// A = all_shards_tokens_per_expert [P,E] i32: row i holds rank i's dispatch group sizes for N
// routed rows, aligned up to a multiple of align_size (non-empty experts only) when > 0.
Tensor make_ep_counts(const Case& c, int64_t P, int64_t E, int64_t N, int64_t align_size,
                      const std::string& name);

// SPEC §9.2's table for rank s, written out here from the counts alone, independently of the
// reference (reference/ep.cpp): the ragged all-to-all's checks feed these arrays to the
// implementation, and ragged_a2a_params' invariants compare every rank's output with them, so a
// wrong reference offset cannot make the checks agree with it.
struct A2AArrays {
  std::vector<int64_t> input_offsets, send_sizes, output_offsets, recv_sizes;  // [P] each
};
A2AArrays spec_a2a_arrays(const Tensor& A, int64_t s, int64_t P, bool forward);

// Row counts of §9.5 for a case with N real rows per rank: R_pre = N + E(a-1) and
// R = P*N + E(a-1) (a > 0), else N and P*N.
int64_t ep_pre_rows(int64_t E, int64_t N, int64_t a);
int64_t ep_recv_rows(int64_t P, int64_t E, int64_t N, int64_t a);

// The local (un)permute records (§9.4): receive-buffer rows R of a case (key R when set, else R
// of §9.5 for N rows per rank plus `slack` tail rows), and their random case and named-case start.
int64_t local_perm_rows(const Case& c);
rc::Gen<Case> local_perm_gen(const std::string& op);
Case local_perm_case(const std::string& op, uint64_t seed, const std::string& name, DType d,
                     int64_t P, int64_t E, int64_t N, int64_t H, int64_t a);
// Both move every row of the buffer and its map entry, forward and backward.
Cost local_perm_cost(const Case& c);

// The params object {"num_ep": P} of the EP data-movement records.
nlohmann::json ep_params(const Case& c);

// |t| element-wise, in f64.
Tensor abs_f64(const Tensor& t);

// The SPEC §12 reduction bound per element: tol_bound(reduction, out, ref[i], n[i], abs_sum[i]).
// n may be a scalar (n_scalar when n_per is null).
Tensor reduction_bound(DType out, const Tensor& ref, const Tensor& abs_sum, int64_t n_scalar,
                       const Tensor* n_per = nullptr);

// The moe_block parameters of a Case (defined with the moe_block record).
MoeBlockParams moe_block_params(const Case& c);

// A moe_block case rewritten to run with ep_size = P on one data-parallel group (dp_size 1),
// batch B rounded up to a multiple of P and "_epP" added to its name; nullopt when its experts do
// not divide by P or its routing is forced (R3's forcing is written for its own P). Cases already
// at ep_size P, dp_size 1 come back unchanged. `check --ep P` and the multi-GPU tests use it, so
// every EP size the launcher can start has cases.
std::optional<Case> moe_block_case_for_ep(const Case& c, int64_t P);

// Integer values of an index tensor.
std::vector<int64_t> int_values(const Tensor& t);

}  // namespace moe::ops
