// Bindings shared by the router-family records (topk_router, aux_loss_scores, moe_aux_loss):
// the CUDA runners live in router_family_gpu.cpp, built only with the CUDA backend.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "harness/core/params/router.h"
#include "harness/ops/registry.h"

namespace moe::ops {

#ifdef MOE_WITH_CUDA
TensorMap topk_router_gpu(const Case& c, const TensorMap& in);
TensorMap aux_loss_scores_gpu(const Case& c, const TensorMap& in);
TensorMap moe_aux_loss_gpu(const Case& c, const TensorMap& in);
OpInfo::Bench topk_router_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench aux_loss_scores_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench moe_aux_loss_gpu_bench(const Case& c, const TensorMap& in);
#endif

// Router parameters of a Case (keys: topk, score_function, use_pre_softmax, num_groups,
// group_topk, scaling_factor, routing_map_format).
RouterParams router_params(const Case& c);

// Logits [T,E] in c.dtype for the case's regime, from (c.seed, name).
Tensor make_logits(const Case& c, int64_t T, int64_t E, int64_t K, const std::string& name);

// Rows with a logit beyond this magnitude are not perturbed by finite differences: SPEC's step
// 1e-3 * max(1, |x|) would exceed the curvature scale of exp/sigmoid there.
inline constexpr double kFdMaxLogit = 10.0;
TensorMap fd_mask_large_rows(const Tensor& logits);

// Rows where two routing maps (same format) differ.
std::vector<int64_t> routing_rows_differ(const Tensor& a, const Tensor& b);

// ---- Generators that reach the edges (issue 19) ----------------------------------------------
// Expert counts at the CUDA row kernels' layout boundaries (chunks of 8, a warp of 32 lanes,
// 256 = 32 x 8, the layouts' steps up to the supported 4096) and one past each.
inline const std::vector<int64_t> kEdgeExperts = {1,   2,   7,   8,   9,    16,   17,   31,
                                                  32,  33,  63,  64,  65,   128,  129,  255,
                                                  256, 257, 512, 513, 1024, 1025, 2048, 4096};
// (E, K): an edge E and a K from {1, E, E-1, 8, 16, 32, 33, random} (K <= 32 beyond E = 1024).
rc::Gen<std::pair<int64_t, int64_t>> gen_edge_experts_topk();
// Grouped (E, K, G, g_k) near the edges: g_k = G, g_k = 1, G = 1, K/g_k = E/G, groups of 1/8/32/33.
struct GroupedShape {
  int64_t E, K, G, gk;
};
rc::Gen<GroupedShape> gen_edge_grouped();
// A row count: 0, 1, 2, 257 (one past a 256-row block) or a small random one, capped so that
// rows * cols <= 65536 (the CPU reference stays fast).
rc::Gen<int64_t> gen_edge_rows(int64_t cols);

// ---- Rounding-aware error budgets (issue 19; derivation in router_family.cpp) ----------------
// Each returns e, the absolute error (per element) of a correct kernel's fp32 value before its
// one rounding to the output dtype, measured from the exact value. make_rounded_bound
// (harness/core/compare.h) turns e into the admissible output interval.

inline constexpr double kU32 = 0x1.0p-24;       // unit roundoff of fp32
inline constexpr double kUnder32 = 0x1.0p-150;  // fp32 underflow error per rounding
// A kernel's fp32 score (exp, sigmoid, sqrtsoftplus) against the exact value: SPEC §1.4 lets two
// implementations differ by "a few ulps", so 4 ulp_f32 (<= 8u relative) plus the underflow of 4
// roundings.
double score_abs_err(double s);

// Forward of one topk_router row (SPEC §1.2). x: logits (f32-exact values); bias: null or [E];
// sel: the selection (1 = selected). probs: e of scaling * p_e (0 off the selection); saved: e of
// saved_scores (0 where saved is exact: sqrtsoftplus' raw logits, softmax-post's -inf).
struct RowErr {
  std::vector<double> probs, saved;
};
RowErr topk_router_row_err(const RouterParams& p, const double* x, const double* bias,
                           const std::vector<char>& sel);
// Forward of one aux_loss_scores row (SPEC §2): scores (f32) and saved_scores.
RowErr aux_scores_row_err(ScoreFunction f, const double* x, int64_t E);

// Backward of one row (SPEC §1.3, §2), e of grad_e. g: f32(cotangent) * scaling (exact);
// a: the reference's saved scores; da: how far a correct kernel's own saved scores may be from a;
// routed: 1 = routed (all 1 for aux_loss_scores); pre: softmax-pre semantics (every logit gets a
// gradient; aux_loss_scores' softmax); normalised: sigmoid/sqrtsoftplus divide by A (K > 1, and
// always in aux_loss_scores).
std::vector<double> grad_row_err(ScoreFunction f, bool pre, bool normalised, const double* g,
                                 const double* a, const double* da,
                                 const std::vector<char>& routed);

// ---- Self-checks that do not trust the reference's saved state -------------------------------
// The canonical top-k (value desc, index asc, IEEE equality) by repeated scanning for the first
// strict maximum: an implementation independent of the reference's stable sort. 1 = selected.
std::vector<char> scan_topk_f32(const std::vector<float>& v, int64_t k);
// SPEC §1.2 steps 1-3 in fp32 from score_fn.h (grouping included), selected by scan_topk_f32.
std::vector<char> router_select_f32(const RouterParams& p, const float* x, const float* bias,
                                    int64_t E);
// Failure lines where saved_scores[t] is not bitwise score_fn's fp32 value (SPEC §1.2 step 1):
// sigmoid_f32(x), the raw logit (sqrtsoftplus), softmax_f32 of the row (softmax pre), -inf off
// the selection (softmax post). aux=true: SPEC §2's saved scores (softmax: == scores, checked by
// the caller).
std::vector<std::string> saved_scores_self_check(const RouterParams& p, bool aux,
                                                 const Tensor& logits, const Tensor& saved,
                                                 const Tensor& map);

}  // namespace moe::ops
