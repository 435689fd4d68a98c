// CUDA twin of reference/grouped_gemm.h: grouped_gemm (SPEC §10.1), forward and backward. Same
// names and argument order as moe::ref, DeviceTensor in place of Tensor, a trailing Stream (and
// GemmOptions). No CUDA types here.
//
// Math and layouts: see reference/grouped_gemm.h. x [M_total, K_d] d, w [G, K_d, N] d,
// group_sizes [G] i32/i64 (on the device), bias [G, N] (any float dtype), out [M_total, N] d.
// Group g owns rows [o_g, o_g + n_g); rows past sum n_g are 0 in out and grad x; an empty group's
// grad w (and grad bias) is exactly 0.
//
// Implementation (chosen by measurement: GemmBench in tests/gpu/test_gemm_gpu.cpp):
//   - The products run in cuBLAS with bf16/f16/f32 operands and fp32 accumulation
//     (CUBLAS_COMPUTE_32F, reduced-precision split-K reductions disallowed, no TF32). Each thread
//     and stream gets its own handle with its own fixed 32 MiB workspace, so the algorithm cuBLAS
//     picks, and with it every bit of the result, depends only on the problem: two runs are
//     bitwise equal (checked by tests/gpu/test_gemm_gpu.cpp).
//   - cuBLAS takes its problem sizes on the host, so the group sizes are read back once per call
//     (one small device-to-host copy and a stream synchronisation: read_group_plan). The _into
//     forms take that plan, so a caller that already holds the sizes (the FFN, whose nine products
//     share one plan; the benchmarks) pays it once or not at all. On an H100 the read-back added
//     under 0.5 ms to a 5 ms forward (mostly the pipeline drain before the copy).
//   - GemmImpl picks how the per-group products are issued. GemmBench, H100, bf16, TFLOP/s and
//     the share of one dense cuBLAS GEMM of equal FLOPs measured in the same run (forward; then
//     forward + dgrad + wgrad against the three dense products):
//       case (rows x K x N, G)                grouped     loop        streams     chunked    dense
//       Mixtral-like 32768x4096x14336, 8  fwd 277 (34%)   786 (98%)   786 (98%)   711 (88%)  804
//         uniform                         f+b 341 (46%)   709 (96%)   715 (97%)   681 (93%)  735
//         skewed                          fwd 278 (38%)   784 (106%)  783 (106%)  694 (94%)  742
//                                         f+b 345 (49%)   685 (97%)   680 (96%)   719 (101%) 709
//       DeepSeek-like 65536x7168x2048,256 fwd 247 (31%)   334 (42%)   338 (43%)   466 (59%)  786
//         uniform                         f+b 239 (35%)   353 (51%)   391 (57%)   397 (57%)  691
//         skewed                          fwd 252 (32%)   351 (45%)   438 (56%)   427 (54%)  787
//                                         f+b 251 (36%)   326 (46%)   387 (55%)   387 (55%)  702
//     Run-to-run spread is about 10%: on Mixtral-like uniform (every group above 1024 rows)
//     chunked runs exactly the `streams` products, and its forward measured 711 against 786.
//     chunked is the default: 38% faster than `streams` on the DeepSeek-like uniform forward
//     (also in an earlier run: 461 vs 337), the same within that spread elsewhere. Chunk sizes
//     128/256 and 16 streams were measured too (bench.json); none reaches 85% of dense on the
//     DeepSeek-like shape, where 85% is the ceiling: the forward must read every expert's weight
//     once (7.5 GB of 8.7 GB moved), which at the device's copy bandwidth (3030 GB/s) takes
//     2.88 ms, 85% of the dense product's speed; chunked moved 2115 GB/s there. dgrad and wgrad
//     stay near 4.2-5.8 ms (dense 2.7-2.9 ms): wgrad writes 7.5 GB of weight gradient (2.5 ms at
//     copy speed).
//   - GemmImpl::sm90 (our own TMA + wgmma kernel, gpu/grouped_gemm_sm90.cuh; wgrad as chunked
//     unless GemmOptions::sm90_wgrad: its own kernel, 8-17% faster than cuBLAS with groups of
//     up to ~2048 rows since session 16, slower on the Mixtral-like shapes, docs/perf.md),
//     GemmBench on an H100, bf16, TFLOP/s (% of the dense GEMM timed in the same run):
//                                       session 3 (two runs)         session 4 (final run)
//       Mixtral-like uniform / skewed   fwd 647 (81%), 641 (82%)     581 (72%) / 567 (77%)
//                                       / 580 (80%), 612 (83%)
//       DeepSeek-like uniform / skewed  fwd 360 (45%), 375 (47%)     438 (55%) / 373 (47%)
//                                       / 388 (49%), 394 (50%)
//     chunked, beside it in the final run: 96% / 96% and 60% / 54%, so chunked stays the default.
//     ncu (DeepSeek-like uniform forward): the session-3 kernel read 15.3 GB from DRAM for an
//     8.7 GB minimum, at 2.85 TB/s (85% of peak): the groups of 257-293 rows (sizes spread around
//     256) ran two M-pairs, one with an idle partner, and read their weight twice. N-pairs for a
//     group's odd last row tile and L2 evict_first on the streamed weight brought it to 11.7 GB
//     and 4.2-4.4 ms (454-462 TFLOP/s in the same-variant runs). The Mixtral-like forward fell
//     with that change: 566-581 in the two runs after it against 606-686 in the two before it
//     (same session, same device); not isolated (that shape has few odd tiles and no hints; the
//     producer now spills 32 bytes under its 40-register cap). Session 5 (final run, another
//     H100): sm90 536 (65%) / 548 (74%) and 442 (55%) / 373 (47%); chunked 746 (91%) / 728 (99%)
//     and 499 (62%) / 431 (54%). L2 hints on DeepSeek-like uniform (MOE_SM90_HINTS, ncu): the
//     default (weight evict_first) 11.7 GB DRAM read, 4.38 ms; no hints 12.3 GB, 4.72 ms; weight
//     evict_last 12.5 GB, 4.73 ms; both evict_first 306 TFLOP/s (worst). Session 12 (dynamic
//     tile schedule, large groups walked in bands; docs/perf.md): DeepSeek-like uniform forward
//     3.89-4.21 ms, the same as chunked within the spread of those runs; skewed 4.76 ms against
//     chunked's 4.46-4.48; Mixtral-like still below chunked. Sessions 14-15 (folded tails, a
//     mixed draw order): DeepSeek-like uniform forward 3.6-4.05 ms against chunked's 4.08-4.35 in
//     the same `bench` calls, so GemmImpl::automatic, the default since, runs such plans on sm90.
//   - PyTorch's torch._grouped_mm (torch 2.11, scripts/torch_grouped_mm_baseline.py), same
//     shapes, its own dense torch.mm alongside, two H100s: Mixtral-like 653-724 / 622-625 TFLOP/s
//     (uniform / skewed), DeepSeek-like 489-495 / 381-383 (63-68% / 49-53% of its dense mm). On
//     the H100 of the session-5 final run chunked beat it on all four (figures above).
//   - Without a bias cuBLAS writes d directly (one rounding of the fp32 accumulator). With a bias
//     it writes an fp32 buffer and one kernel adds f32(bias[g]) and rounds once, as the SPEC's
//     rnd_d(sum + bias) asks. grad bias is a deterministic per-group column sum in fp32 (fixed
//     thread-to-row assignment and a fixed-order tree; no atomics).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "gpu/runtime.cuh"
#include "harness/core/params/ffn.h"

namespace moe::gpu {

// How the per-group cuBLAS products are issued. All give results within the SPEC §12 bound and
// are each deterministic; they need not agree bitwise with one another (cuBLAS may pick different
// kernels for a grouped call and for a single product).
enum class GemmImpl : uint8_t {
  grouped,    // one cublasGemmGroupedBatchedEx call over the non-empty groups; products it
              // cannot take (an fp32 output from 16-bit operands: bias accumulators, the FFN's
              // grad x; or a pointer not 16-byte aligned, from odd K or N) run as `streams` does
  loop,       // one cublasGemmEx per non-empty group, in group order on the caller's stream
  streams,    // one cublasGemmEx per non-empty group, round-robin over 8 forked streams
  chunked,    // fwd, dgrad: groups of up to 1024 rows cut into chunks of chunk_rows rows (chosen
              // per plan), all chunks (of all such groups, and of the products sharing the row
              // operand: the FFN's gate and up) in ONE pointer-array cublasGemmBatchedEx; a group's
              // shorter last chunk multiplies a full chunk of rows into a scratch slab that one
              // kernel copies out. Larger groups: one cublasGemmEx each on forked streams, beside
              // the batched call. wgrad: small groups binned by size (rounded up to 64 rows), their
              // rows copied into zero-padded blocks, one batched call per bin; larger groups as
              // `streams`. Pointers not 16-byte aligned (K or N not a multiple of 8) fall back to
              // `streams`.
  sm90,       // fwd, dgrad: our own persistent TMA + wgmma kernel (gpu/grouped_gemm_sm90.cuh) on
              // sm_90 GPUs, 16-bit operands, K and N multiples of 8, with the forward bias in its
              // epilogue; wgrad on its own kernel when GemmOptions::sm90_wgrad, else, and whatever
              // the kernels cannot take, as `chunked`.
  split,      // fwd, dgrad: the groups of at most sm90::kStreamRows rows (bound by streaming their
              // weight) on the sm90 kernel with a share of the SMs (split_share), on a stream of
              // the greatest priority, while the other groups (bound by the tensor cores) run as
              // `chunked` on the SMs left, at the same time; a plan of one kind runs whole on that
              // kind's impl. wgrad as `automatic`. Where sm90 cannot take the product: `chunked`.
  automatic,  // "auto", the default: per product, `sm90` for fwd and dgrad where at least half
              // the rows are in groups of at most kAutoSm90Rows rows (each expert's weight
              // streamed for few rows, where our kernel beats cuBLAS), for wgrad (its own kernel)
              // where at least half are in groups of at most kAutoWgradRows and the gradient is
              // 16-bit and not accumulated, and a sum of two products (the FFN's grad x) on it
              // where at least half are in groups of at most kAutoPairRows, and all of them
              // where the plan mixes streaming and dense groups (kAutoRidgeRows), when the kernel
              // is available, except that fwd and dgrad run `split` where the plan mixes them
              // at a lower ratio (kAutoSplitFactor); else `chunked` (see resolve_gemm_impl,
              // resolve_pair_impl).
};
// The group size up to which GemmImpl::automatic counts a group's rows as small (sm90): about the
// H100's ridge (a group of n rows does n FLOPs per byte of its weight; the ridge is ~300), below
// which the weight's stream bounds the product. Measured (H100, session 15): with groups of 211-293
// rows (DeepSeek-like uniform) sm90's forward was 5-14% faster than chunked's (`bench`, three
// calls) and the FFN 5%; with groups of ~512 rows (GemmBench deepseek_e128) sm90's forward was 3%
// slower and the FFN's fwd+bwd 13%; with ~1024 (deepseek_e64) 8% and 20%; where 91% of the rows
// are in 6 groups of 1103-39830 rows (DeepSeek-like skewed) the FFN's fwd+bwd was 7% slower
// (session 20: 3.5% faster since; that plan now goes to sm90 by kAutoRidgeRows).
constexpr int64_t kAutoSm90Rows = 320;
// The same bound for wgrad on the sm90 kernel (its TMA-store epilogue overlaps writing each tile
// of the gradient with the next tile's products; cuBLAS's per-group products stop for it).
// Measured (H100, session 16, GemmBench wgrad, docs/perf.md): the kernel was 8-13% faster than
// chunked with groups of 211-293 rows (DeepSeek-like uniform), 12% with ~512 (deepseek_e128),
// 13-17% with ~1024 (deepseek_e64), 13% with ~2048 (deepseek_e32); tied where 91% of the rows
// are in 6 groups of 1103-39830 rows (DeepSeek-like skewed); 4-22% slower with ~4096
// (Mixtral-like uniform).
constexpr int64_t kAutoWgradRows = 2048;
// The bound for a sum of two products on the sm90 kernel (gemm_detail::grouped_product_sum: the
// FFN's grad x). Elsewhere the two products go through an fp32 buffer (written, read and written
// again, then rounded in a pass of its own: 18 bytes a grad x element, ~2.9 ms at the DeepSeek-like
// shape), which outweighs sm90's slower main loop on larger groups (per product 3% at ~512 rows,
// 8% at ~1024; Mixtral-like ~4096: 20-30%, more than the fp32 passes cost there). Measured (H100,
// session 17, `bench`, docs/perf.md): moe_block deepseek_like (under half its rows in groups of at
// most 320 rows, so its single products stay on chunked) 175k -> 188k tokens/s with this rule;
// with the pair on sm90 everywhere instead, the FFN's fwd+bwd ran 2-3% slower on DeepSeek-like
// skewed (91% of the rows in groups of 1103-39830; since session 20 kAutoRidgeRows takes it to
// sm90 as a whole) and 0-5% on both Mixtral-like shapes.
constexpr int64_t kAutoPairRows = kAutoWgradRows;
// A plan that mixes groups bound by streaming their weight (at most sm90::kStreamRows rows) with
// groups bound by the tensor cores (some above sm90::kDenseRows) runs on sm90 for every role
// (fwd, dgrad, wgrad with its TMA-store epilogue, the two-product sum) where streaming the small
// groups' weights takes at least half as long as the other groups' products at the dense rate:
// each weight is 2 K N bytes and each row 2 K N FLOPs, so with the H100's dense bf16 rate over
// its copy bandwidth (~780 TFLOP/s / ~3.0 TB/s: kAutoRidgeRows FLOPs per byte) that is
// 2 x (small groups) x kAutoRidgeRows >= (rows of the others). There sm90 draws the two kinds
// side by side (sm90::mixed_order), so the weight stream hides under the products; cuBLAS runs
// them one after the other. Measured (H100, session 20, GemmBench chunked / sm90 with its wgrad
// kernel, two rounds, docs/perf.md), the DeepSeek-like skewed product at 256, 128 and 64 experts
// (203, 114 and 52 small groups beside ~62k rows; the ratio of the two times 0.85, 0.47, 0.21):
// fwd+bwd -5%, +0.2%, +3.4% (fwd -13%, -6%, -2.5%; dgrad -5%, 0%, +6%; wgrad -2.5%, -4%, -2%); the
// FFN's fwd+bwd -3.5%, -2%, -3.4%. `bench` deepseek_skewed: grouped_gemm fwd+bwd -7%, the FFN's
// -5%. Since session 22 fwd and dgrad of such a plan run GemmImpl::split instead (each kind on
// its own engine at once, kSplitRows).
constexpr int64_t kAutoRidgeRows = 260;
// fwd and dgrad run GemmImpl::split where that ratio is at least 1 / kAutoSplitFactor (which takes
// in every plan the mixed rule above takes): split leaves the dense groups on cuBLAS, so it pays
// where the streaming groups are fewer than sm90-as-a-whole needs. Measured (H100, session 23,
// GemmBench chunked / split with split_share's clusters, two rounds, docs/perf.md), fwd, fwd+bwd
// and the FFN's fwd+bwd: DeepSeek-like skewed, 128 experts (ratio 0.47): -16%, -4%, -4 to -5%;
// 64 experts (0.21): -5 / +8%, +3 / +7%, -7 / -3%, so not split; the block's plan (moe_block
// deepseek_like, `bench`: 69 streaming groups of 3804 rows beside 61732, 22 of them dense; 0.29):
// fwd -4 to -5%, fwd+bwd -1 to -2%.
constexpr int64_t kAutoSplitFactor = 4;
// GemmImpl::split's share of the SMs for its sm90 half, chosen so that both halves end together:
// c clusters stream the g streaming groups' weights (2 K N bytes each) at beta a cluster while
// the SMs left, sms - 2 c, multiply the R other rows (2 K N FLOPs each) at phi an SM, so
// g / (beta c) = R / (phi (sms - 2 c)), i.e. c = g L sms / (R + 2 g L) with L = phi / beta in rows
// (K and N drop out). kSplitRows = L was calibrated once, on the share that measured best on the
// DeepSeek-like skewed forward (H100, session 22, GemmBench ms, docs/perf.md; cuBLAS planned for
// the SMs left unless "all": 12 clusters 5.60 (all), 16 4.38-4.48, 20 3.84, 24 3.61-3.70 (all:
// 3.88-3.91), 28 3.84, 32 4.02 (all: 3.87), 40 4.74; the whole product on sm90 3.85-3.89): 203
// groups beside 62219 rows at 24 clusters give L = 88 (phi ~6.0 TFLOP/s an SM, beta ~68 GB/s a
// cluster while both run). It predicts 16 clusters for 128 experts (114 groups beside 62630
// rows), where 16 measured best (session 23: 3.11-3.13 ms against 3.20-3.24 at 24 and 3.54-3.61
// at 12), and 8 for 64 experts (52 beside 62936).
constexpr int64_t kSplitRows = 88;
// split's share on a device of `sms` SMs for a product whose streaming groups number
// `streaming_groups` beside `other_rows` rows in the others: clusters for the sm90 half (at least
// 1, at most what leaves cuBLAS one cluster's SMs) and the SM count cuBLAS plans for
// (cublasSetSmCountTarget). MOE_GEMM_SPLIT (A/B): unset, empty or "auto" the rule above; "off"
// clusters 0 (split then runs the product whole on sm90, as automatic did before split); "c" c
// clusters, cuBLAS planned for the SMs left; "c,t" cuBLAS planned for t SMs (0: all); anything
// else throws std::invalid_argument naming it. Read on every call.
struct SplitShare {
  int clusters = 0, sm_target = 0;
};
SplitShare split_share(int sms, int64_t streaming_groups, int64_t other_rows);
std::string_view gemm_impl_name(GemmImpl impl);
GemmImpl parse_gemm_impl(std::string_view s);  // throws std::invalid_argument naming impl
// The default, chosen by the benchmark (tests/gpu/test_gemm_gpu.cpp, GemmBench): automatic, or
// the impl named by the environment variable MOE_GEMM_IMPL.
GemmImpl default_gemm_impl();
// The default for a value of MOE_GEMM_IMPL: null or empty gives automatic; a bad name throws
// std::invalid_argument naming MOE_GEMM_IMPL.
GemmImpl gemm_impl_from_env(const char* value);

// MOE_SM90_WGRAD (see GemmOptions::sm90_wgrad), read when options are made.
bool sm90_wgrad_from_env();

struct GemmOptions {
  GemmImpl impl = default_gemm_impl();
  bool poison = false;        // fill every output with 0xFF bytes (NaN) before the launch (tests)
  int64_t chunk_rows = 0;     // chunked: rows per chunk (0: chosen per plan, see chunk_rows())
  int streams = 0;            // streams, chunked: forked streams (0: 8; at most 32)
  bool batched_wgrad = true;  // chunked: small groups' wgrad as padded batched calls (else as
                              // `streams`)
  // sm90 (named, not automatic, which picks per plan): wgrad on our own kernel too
  // (sm90::ColGroupedProduct), else as chunked. Off by default: it trails cuBLAS on the
  // Mixtral-like bench shapes (docs/perf.md, sessions 13 and 16). MOE_SM90_WGRAD=kernel turns it
  // on, =cublas or unset leaves it off; anything else throws naming the variable.
  bool sm90_wgrad = sm90_wgrad_from_env();
};

// Host copy of the group sizes, checked as SPEC §10.1 asks (every size >= 0, sum <= rows; a
// violation throws std::invalid_argument naming group_sizes, like the reference).
struct GroupPlan {
  std::vector<int64_t> sizes;    // n_g
  std::vector<int64_t> offsets;  // o_g, G + 1 entries (offsets[G] = used)
  int64_t used = 0;              // sum n_g
  int64_t rows = 0;              // M_total
  int64_t groups() const { return static_cast<int64_t>(sizes.size()); }
};
// One device-to-host copy of group_sizes [G] (i32 or i64) and a synchronisation of s.
GroupPlan read_group_plan(const DeviceTensor& group_sizes, int64_t rows, Stream s = nullptr);
// The same plan from host sizes (checked the same way).
GroupPlan make_group_plan(const std::vector<int64_t>& sizes, int64_t rows);

DeviceTensor grouped_gemm_fwd(const DeviceTensor& x, const DeviceTensor& w,
                              const DeviceTensor& group_sizes, const DeviceTensor* bias,
                              Stream s = nullptr, const GemmOptions& o = {});
// Launch-only form: out [M_total, N] d preallocated; no allocation of outputs, no host sync.
void grouped_gemm_fwd_into(const DeviceTensor& x, const DeviceTensor& w, const GroupPlan& plan,
                           const DeviceTensor* bias, DeviceTensor& out, Stream s,
                           const GemmOptions& o = {});

struct GroupedGemmBwd {
  DeviceTensor grad_x;                    // [M_total, K_d] d
  DeviceTensor grad_w;                    // [G, K_d, N] d
  std::optional<DeviceTensor> grad_bias;  // [G, N] in the bias dtype, iff a bias was given
};
// bias is only read for its presence and dtype, as in the reference.
GroupedGemmBwd grouped_gemm_bwd(const DeviceTensor& grad_out, const DeviceTensor& x,
                                const DeviceTensor& w, const DeviceTensor& group_sizes,
                                const DeviceTensor* bias, Stream s = nullptr,
                                const GemmOptions& o = {});
void grouped_gemm_bwd_into(const DeviceTensor& grad_out, const DeviceTensor& x,
                           const DeviceTensor& w, const GroupPlan& plan, const DeviceTensor* bias,
                           GroupedGemmBwd& out, Stream s, const GemmOptions& o = {});

// Frees the cuBLAS handles, workspaces, forked streams and staging buffers the products keep
// between calls, on every thread; the next product makes them anew. Call only while no thread
// runs a product (the GPU tests do at exit; a long-lived host may between phases).
void release_gemm_resources() noexcept;

// Dense baselines for the benchmarks, one cuBLAS product with the same settings and layouts as
// the grouped ones (row-major, fp32 accumulation, output in c's dtype):
//   fwd:   c[M,N] = a[M,K] . b[K,N]
//   dgrad: c[M,K] = a[M,N] . b[K,N]^T
//   wgrad: c[K,N] = a[M,K]^T . b[M,N]
enum class GemmRole : uint8_t { fwd, dgrad, wgrad };
// The impl that runs a product of this role and plan: impl itself, except that automatic becomes
// sm90 where sm90::available() and at least half the plan's rows are in groups of at most
// kAutoSm90Rows rows (fwd, dgrad) or kAutoWgradRows rows (wgrad, and only with
// wgrad_tma_epilogue: a 16-bit gradient written, not accumulated), or the plan mixes
// (auto_mixes_for_sm90; wgrad again only with wgrad_tma_epilogue), else chunked; fwd and dgrad
// run split instead where auto_splits (a wider rule than the mixed one). split itself resolves
// wgrad as automatic does.
GemmImpl resolve_gemm_impl(GemmImpl impl, GemmRole role, const GroupPlan& plan,
                           bool wgrad_tma_epilogue = false);
// Whether at least half the plan's rows are in groups of at most max_rows rows (an empty plan
// counts as such): automatic's rule, without the availability of the kernel.
bool auto_prefers_sm90(const GroupPlan& plan, int64_t max_rows = kAutoSm90Rows);
// Whether the plan mixes streaming and dense groups enough for sm90 (kAutoRidgeRows): automatic's
// second rule, for every role, without the availability of the kernel.
bool auto_mixes_for_sm90(const GroupPlan& plan);
// Whether fwd and dgrad of the plan run split under automatic (kAutoSplitFactor), without the
// availability of the kernel: true wherever auto_mixes_for_sm90 is.
bool auto_splits(const GroupPlan& plan);
// The impl of a two-product sum (gemm_detail::grouped_product_sum): impl itself, except that
// automatic becomes sm90 where sm90::available() and auto_prefers_sm90(plan, kAutoPairRows) or
// auto_mixes_for_sm90(plan).
GemmImpl resolve_pair_impl(GemmImpl impl, const GroupPlan& plan);
void dense_gemm(GemmRole role, const DeviceTensor& a, const DeviceTensor& b, DeviceTensor& c,
                Stream s = nullptr);

namespace gemm_detail {

// MOE_GEMM_TRACE's line for one product: what ("product", "products", "pair"), role, K x N, the
// plan's groups and rows by size (streaming, up to sm90::kDenseRows, dense; empty; the largest)
// and the impl it resolved to (sm90 and split still fall back to chunked, or to streams on
// unaligned pointers, where the kernel cannot take the product).
std::string product_trace_line(const char* what, GemmRole role, const GroupPlan& plan, int64_t K,
                               int64_t N, GemmImpl impl);

// Plan offsets on the device (int64, G + 1 entries) for kernels that map a row to its group.
class DevicePlan {
 public:
  DevicePlan(const GroupPlan& plan, Stream s);
  ~DevicePlan();
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;
  const int64_t* offsets() const { return offsets_; }

 private:
  int64_t* offsets_ = nullptr;
  Stream s_;
};

// Stream-ordered scratch memory (cudaMallocAsync / cudaFreeAsync on s): no implicit device
// synchronisation, unlike cudaFree.
class Scratch {
 public:
  Scratch(size_t bytes, Stream s);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  Stream s_;
};

// The per-group products of one role over a plan (row-major, a/b/c raw device pointers):
//   fwd:   c[o_g.., N] = a[o_g.., K] . b_g[K, N]
//   dgrad: c[o_g.., K] = a[o_g.., N] . b_g[K, N]^T
//   wgrad: c_g[K, N]   = a[o_g.., K]^T . b[o_g.., N]   (an empty group's c_g = 0, or += 0)
// a and b have dtype ab; c has dtype c_type (ab or f32). accumulate: c += product (else c =).
void grouped_product(GemmRole role, const GroupPlan& plan, DType ab, const void* a, const void* b,
                     DType c_type, void* c, int64_t K, int64_t N, bool accumulate, Stream s,
                     const GemmOptions& o);
void grouped_product(GemmRole role, const GroupPlan& plan, DType ab, const void* a, const void* b,
                     DType c_type, void* c, int64_t K, int64_t N, bool accumulate, Stream s,
                     GemmImpl impl);
// fwd or dgrad: c = rnd_c(a . B_g + a2 . B2_g), each pair as grouped_product's (a, b), both summed
// in one fp32 accumulator and rounded once, on the sm90 kernel (RowGroupedProduct::a2) where the
// impl resolves to it (resolve_pair_impl) and the kernel takes the product. Otherwise returns false
// having issued nothing: the caller sums another way. Rows past the groups are not written.
bool grouped_product_sum(GemmRole role, const GroupPlan& plan, DType ab, const void* a,
                         const void* b, const void* a2, const void* b2, DType c_type, void* c,
                         int64_t K, int64_t N, Stream s, const GemmOptions& o);
// Several products of one role sharing the row operand a, each (b, c) pair as grouped_product
// does; GemmImpl::chunked issues all of them in one batched call (the FFN's gate and up).
void grouped_products(GemmRole role, const GroupPlan& plan, DType ab, const void* a,
                      const std::vector<std::pair<const void*, void*>>& bc, DType c_type, int64_t K,
                      int64_t N, bool accumulate, Stream s, const GemmOptions& o);

// out[r, :] = rnd_out(acc[r, :] + f32(bias[g(r), :])) for r < used (bias may be null), and 0 for
// the tail rows [used, rows).
void bias_epilogue(const GroupPlan& plan, const DevicePlan& dplan, const float* acc,
                   const void* bias, DType bias_dtype, void* out, DType out_dtype, int64_t N,
                   Stream s);
// dst[g, :] = rnd_dst(sum over the rows of group g of f32(src[r, :])); 0 for an empty group.
void group_column_sums(const GroupPlan& plan, const DevicePlan& dplan, const void* src,
                       DType src_dtype, int64_t N, void* dst, DType dst_dtype, Stream s);
// Zeroes the [per_group] elements of every empty group of a [G, ...] tensor.
void zero_empty_groups(const GroupPlan& plan, void* t, int64_t per_group, size_t elem_size,
                       Stream s);
// Zeroes rows [plan.used, plan.rows) of a [rows, cols] tensor.
void zero_tail_rows(const GroupPlan& plan, void* t, int64_t cols, size_t elem_size, Stream s);
void poison(DeviceTensor& t, Stream s);

// Benchmark inputs generated on the device as a formula of (seed, index), so huge operands need
// no host generation and a host check can recompute any element (nccl-tests style):
// value(i) = rnd_d(lo + (hi - lo) * u), u = top 24 bits of splitmix64(seed + i) / 2^24.
void fill_hash_uniform(DeviceTensor& t, uint64_t seed, double lo, double hi, Stream s = nullptr);
double hash_uniform_value(DType d, uint64_t seed, int64_t index, double lo, double hi);
// Values of t at the given flat indices (one gather kernel and one small copy back).
std::vector<double> gather_values(const DeviceTensor& t, const std::vector<int64_t>& index,
                                  Stream s = nullptr);
// cudaMemcpyAsync device to device (the benchmark's bandwidth reference).
void copy_device(void* dst, const void* src, size_t bytes, Stream s = nullptr);
// What the products keep between calls, over every thread's state (tests check its bounds;
// read it while no other thread runs a product).
struct ResourceCounts {
  int64_t states = 0;        // per-thread states ever made (a retired thread's is reused)
  int64_t blas_handles = 0;  // cuBLAS handles, each with its own workspace
  int64_t arenas = 0;
  int64_t aux_streams = 0;
  int64_t upload_slots = 0;
};
ResourceCounts resource_counts();
// MOE_CUBLAS_PREFILL: `zero` true (each cuBLAS call's output bytes zeroed just before it, for
// initcheck: gpu/grouped_gemm.cu says why), unset, empty or `off` false; anything else throws
// std::invalid_argument naming the variable and its value.
bool cublas_prefill_setting();
// Number of memsets that setting has issued in this process (tests check the knob takes effect).
int64_t cublas_prefill_memsets();
// Bytes of device memory from p.
struct ByteRange {
  void* p;
  size_t n;
};
// The memsets that setting issues for the ranges one cuBLAS call writes: by address, overlapping
// ranges joined, empty ones dropped. Ranges that only touch stay apart: they may lie in two
// allocations, and one memset across an allocation's end is cudaErrorInvalidValue.
std::vector<ByteRange> prefill_runs(std::vector<ByteRange> r);
// Number of batched cuBLAS calls GemmImpl::chunked has issued in this process (tests check that
// the batched path ran rather than its `streams` fallback).
int64_t chunked_batched_calls();
// Number of grouped products GemmImpl::sm90 has run on its own kernel in this process.
int64_t sm90_kernel_calls();
// Median time in ms of fn() over reps runs on s (CUDA events around each run, after warmup runs).
double median_ms(const std::function<void()>& fn, int warmup, int reps, Stream s = nullptr);

}  // namespace gemm_detail

}  // namespace moe::gpu
