#!/usr/bin/env python3
"""Regenerates tests/mutants/*.patch and tests/mutants/INDEX from the table below.

Each mutant is one textual edit (the `occ`-th occurrence of `old` in `file` becomes `new`), turned
into a `git diff` against HEAD in a scratch clone, so the patches apply with `git apply` to a
checkout of HEAD. Run it from the repository root after the mutated code moved:

    python3 tests/mutants/regen.py            # rewrites the patches and INDEX
    python3 tests/mutants/regen.py --check    # fails if an edit no longer finds its text

It never touches the working tree outside tests/mutants/.
"""
import os
import shutil
import subprocess
import sys
import tempfile

# (id, name, class, file, occurrence (1-based), old, new, description)
M = [
    # ---- gpu/: router family -------------------------------------------------------------------
    ("001", "router_norm_in_out_dtype", "intermediate-dtype", "gpu/router_row.cuh", 2,
     "const float inv = 1.0f / (seg_sum<LANES>(sum) + kEps);",
     "const float inv = 1.0f / (to_f32(from_f32<TIn>(seg_sum<LANES>(sum))) + kEps);",
     "fast router: the top-k normaliser (sum of the picked scores) rounded to the output dtype "
     "instead of kept in fp32 (1 ulp in bf16)"),
    ("002", "router_k8_loop_bound", "edge-size", "gpu/router_row.cuh", 1,
     "for (int r = 1; r < 8; ++r)",
     "for (int r = 1; r < 7; ++r)",
     "fast router, one lane per row (E <= 8): the K-th key loop stops at 7, so K = 8 picks the "
     "wrong threshold (only E = 8, K = 8)"),
    ("003", "router_tie_slot_order", "tie-break", "gpu/router_row.cuh", 1,
     "          for (int j = 0; j < 8; ++j) {\n            const bool take",
     "          for (int j = 7; j >= 0; --j) {\n            const bool take",
     "fast router: a split tie inside a lane takes the highest expert indices first "
     "(canonical rule is index ascending)"),
    ("004", "router_bwd_norm_term", "missing-grad-term", "gpu/router_row.cuh", 1,
     "g[j] = is_r(j) ? g[j] / den - b : 0.0f;",
     "g[j] = is_r(j) ? g[j] / den : 0.0f;",
     "router backward (sigmoid/sqrtsoftplus, K > 1): the normalisation's -B/A^2 term dropped"),
    ("005", "router_bwd_softmax_dot", "missing-grad-term", "gpu/router_row.cuh", 1,
     "for (int j = 0; j < VPT; ++j) out[j] = s[j] * (g[j] - dot);",
     "for (int j = 0; j < VPT; ++j) out[j] = s[j] * g[j];",
     "router/aux-scores backward, softmax over all experts: the -dot term of the Jacobian "
     "dropped"),
    ("006", "router_bitmap_byte_offset", "offset", "gpu/router_row.cuh", 1,
     "uint8_t* dst = a.map + (kV2 ? off >> 3 : row * mapw + (a.bitmap ? e0 / 8 : e0));",
     "uint8_t* dst = a.map + (kV2 ? off : row * mapw + e0);",
     "fast router: bitmap routing map written at the expert offset instead of the byte offset"),
    ("007", "router_vec_without_e8", "alignment", "gpu/topk_router.cu", 1,
     "a.vec = (E % 8 == 0 && aligned16(a.logits) && aligned16(a.probs)",
     "a.vec = (aligned16(a.logits) && aligned16(a.probs)",
     "router forward: 16-byte vector loads enabled when E % 8 != 0 (rows not 16-byte aligned)"),
    ("008", "router_presoftmax_lane_max", "reduction-scope", "gpu/router_row.cuh", 2,
     "      m = seg_max<LANES>(m);\n",
     "",
     "fast router, softmax pre / aux scores: each lane subtracts its own max instead of the "
     "row max"),
    ("009", "router_bias_kept_in_prob", "offset", "gpu/router_row.cuh", 1,
     "p[j] = has_bias ? z[j] - bias[j] : z[j];",
     "p[j] = z[j];",
     "fast router: the expert bias is not removed from the routed probability (sigmoid)"),
    ("010", "aux_finalize_missing_sync", "race", "gpu/aux_loss.cu", 1,
     "    if (tid < s) part[tid] = part[tid] + part[tid + s];\n    __syncthreads();\n",
     "    if (tid < s) part[tid] = part[tid] + part[tid + s];\n",
     "aux loss: the shared-memory tree sum has no barrier between levels"),
    ("011", "aux_colsum_bf16_accumulator", "accumulator-dtype", "gpu/aux_loss.cu", 1,
     "acc = acc + to_f32(probs[r * C + col]);",
     "acc = to_f32(from_f32<T>(acc + to_f32(probs[r * C + col])));",
     "aux loss: column sums of probs accumulated in the probs dtype"),
    ("012", "aux_bwd_column_wrap", "index", "gpu/aux_loss.cu", 1,
     "c = c + 1 == C ? 0 : c + 1;",
     "c = c + 1;",
     "aux loss backward: the column index does not wrap at a row end inside an 8-element chunk"),
    # ---- gpu/: permutation family ---------------------------------------------------------------
    ("013", "dispatch_align_round_up", "alignment", "gpu/dispatch.cu", 1,
     "const long long al = a > 0 ? (k + a - 1) / a * a : k;",
     "const long long al = a > 0 ? (k + a) / a * a : k;",
     "dispatch layout: counts already a multiple of align_size get one extra block of padding"),
    ("014", "dispatch_pad_row_offset", "padding", "gpu/dispatch.cu", 1,
     "row = aoff[e] + kept[e] + (v - padoff[e]);",
     "row = aoff[e] + (v - padoff[e]);",
     "dispatch: padding rows zeroed at the expert's first rows instead of after its tokens"),
    ("015", "dispatch_tail_not_zeroed", "padding", "gpu/dispatch.cu", 1,
     "const long long zeros = pads + max(0LL, rows - aligned);",
     "const long long zeros = pads;",
     "dispatch: the tail rows past the aligned counts are left unwritten"),
    ("016", "dispatch_rid_slot_order", "index", "gpu/dispatch.cu", 1,
     "__popc(lane == 31 ? 0u : m >> (lane + 1))",
     "__popc(m & ((1u << lane) - 1u))",
     "row_id_map: slots within a 32-expert tile ordered by ascending expert (SPEC: descending)"),
    ("017", "dispatch_colranks_missing_sync", "race", "gpu/dispatch.cu", 1,
     "  part[warp][lane] = sum;\n  __syncthreads();\n",
     "  part[warp][lane] = sum;\n",
     "routing ranks: warps read the other warps' partial sums without a barrier"),
    ("018", "dispatch_r12_plus_zero_only", "edge-case", "gpu/dispatch.cu", 1,
     "zero = load_f(probs, pcode, t * E + s.e) == 0.0f;",
     "zero = __float_as_uint(load_f(probs, pcode, t * E + s.e)) == 0u;",
     "dispatch R12 quirk: only +0 probs write a zero row, -0 copies x"),
    ("019", "combine_bwd_dot_in_dtype", "accumulator-dtype", "gpu/dispatch.cu", 1,
     "part += to_f32(xv.v[j]) * cf;",
     "part = to_f32(from_f32<T>(part + to_f32(xv.v[j]) * cf));",
     "combine backward: grad_merging_probs dot product accumulated in the activation dtype"),
    ("020", "gather_sum_in_dtype", "accumulator-dtype", "gpu/dispatch.cu", 1,
     "acc[u][j] += to_f32(v[q][u].v[j]) * w[q];",
     "acc[u][j] = to_f32(from_f32<T>(acc[u][j] + to_f32(v[q][u].v[j]) * w[q]));",
     "combine forward / dispatch backward: the per-token sum over slots rounded to the dtype "
     "after every slot"),
    ("021", "argsort_need_without_mod", "alignment", "gpu/argsort.cu", 1,
     "(a - count[e] % a) % a : 0;",
     "(a - count[e] % a) : 0;",
     "argsort dispatch layout: an expert whose count is a multiple of align_size gets a "
     "extra padding rows"),
    ("022", "argsort_pad_position", "padding", "gpu/argsort.cu", 1,
     "pos = estart[e] + count[e] + o;",
     "pos = estart[e] + o;",
     "argsort dispatch: padding rows written over the expert's first real rows"),
    ("023", "argsort_combine_bwd_missing_sync", "race", "gpu/argsort.cu", 1,
     "      if (threadIdx.x == 0) store_f(gw, wcode, t * K + k, dot);\n      __syncthreads();\n",
     "      if (threadIdx.x == 0) store_f(gw, wcode, t * K + k, dot);\n",
     "argsort combine backward: the block reduction's shared storage reused without a barrier"),
    ("024", "argsort_weights_unrounded", "intermediate-dtype", "gpu/argsort.cu", 1,
     "const float w = wts ? to_f32(from_f32<T>(load_f(wts, wcode, t * K + k))) : 1.0f;",
     "const float w = wts ? load_f(wts, wcode, t * K + k) : 1.0f;",
     "argsort combine: f32 merging weights not rounded to the activation dtype first (TE does)"),
    ("025", "rm2se_rank_off_by_one", "index", "gpu/argsort.cu", 1,
     "const long long k = n + __popc(m & ((1u << lane) - 1u));",
     "const long long k = n + __popc(m & ((2u << lane) - 1u));",
     "routing_map_to_selected_experts: a routed lane counts itself, slots shift by one"),
    ("026", "sort_chunks_bsearch_boundary", "offset", "gpu/sort_chunks.cu", 1,
     "if (start[mid] > i) {",
     "if (start[mid] >= i) {",
     "sort_chunks: a chunk's first row is attributed to the previous chunk"),
    ("027", "ep_out_offset_inclusive", "offset", "gpu/ep.cu", 1,
     "for (long long i = 0; i < s; ++i) oo += fwd ? snd(i, j) : snd(j, i);",
     "for (long long i = 0; i <= s; ++i) oo += fwd ? snd(i, j) : snd(j, i);",
     "ragged_a2a_params: output offsets include the rank's own block"),
    ("028", "ep_local_order_transposed", "index", "gpu/ep.cu", 1,
     "order[l * P + i] = static_cast<int32_t>(idx);",
     "order[i * L + l] = static_cast<int32_t>(idx);",
     "local permute: chunk order left source-major instead of expert-major"),
    # ---- gpu/: FFN and grouped GEMM -------------------------------------------------------------
    ("029", "ffn_silu_grad_term", "missing-grad-term", "gpu/swiglu_ffn.cu", 1,
     "return s * (1.0f + x * (1.0f - s));",
     "return s;",
     "SwiGLU backward: silu'(x) without the x * s * (1 - s) term"),
    ("030", "ffn_dgate_missing_up", "missing-grad-term", "gpu/swiglu_ffn.cu", 1,
     "dg.v[k] = from_f32<T>(act_grad(silu, gv) * (dv * uv));",
     "dg.v[k] = from_f32<T>(act_grad(silu, gv) * dv);",
     "SwiGLU backward (vector kernel): d_gate misses the up-projection factor"),
    ("031", "ffn_bias_group_zero", "offset", "gpu/swiglu_ffn.cu", 1,
     "load_f32(b0, b0_kind, g * M + j)",
     "load_f32(b0, b0_kind, j)",
     "SwiGLU forward: every group uses group 0's gate bias"),
    ("032", "ffn_vec16_ignores_count", "alignment", "gpu/swiglu_ffn.cu", 1,
     "  if (n % static_cast<int64_t>(16 / elem) != 0) return false;\n",
     "",
     "SwiGLU: the 16-byte vector kernels are used when the element count is not a multiple of "
     "the vector width"),
    ("033", "gemm_group_of_boundary", "offset", "gpu/grouped_gemm.cu", 1,
     "if (offsets[mid] > r) {",
     "if (offsets[mid] >= r) {",
     "grouped GEMM bias epilogue: a group's first row gets the previous group's bias"),
    ("034", "gemm_colsum_missing_sync", "race", "gpu/grouped_gemm.cu", 1,
     "part[threadIdx.y][threadIdx.x] += part[threadIdx.y + step][threadIdx.x];\n    __syncthreads();\n",
     "part[threadIdx.y][threadIdx.x] += part[threadIdx.y + step][threadIdx.x];\n",
     "grouped GEMM bias gradient: the column-sum tree has no barrier between levels"),
    ("035", "gemm_colsum_row_bound", "edge-size", "gpu/grouped_gemm.cu", 1,
     "for (int64_t r = r0 + threadIdx.y; r < r1; r += 8)",
     "for (int64_t r = r0 + threadIdx.y; r <= r1; r += 8)",
     "grouped GEMM bias gradient: each group's sum includes the next group's first row"),
    ("036", "gemm_pad_rows_extra_row", "padding", "gpu/grouped_gemm.cu", 1,
     "d[i] = r < pc.rows ? src[i] : uint4{0, 0, 0, 0};",
     "d[i] = r <= pc.rows ? src[i] : uint4{0, 0, 0, 0};",
     "chunked wgrad: the first padding row of a bin copies the next source row instead of zeros"),
    # ---- gpu/: the MoE block --------------------------------------------------------------------
    ("037", "block_colcount_missing_sync_zero", "race", "gpu/moe_block.cu", 1,
     "local[e] = 0;\n  __syncthreads();\n",
     "local[e] = 0;\n",
     "moe_block column counts: no barrier between zeroing the shared counters and the atomics "
     "(known miss b)"),
    ("038", "block_colcount_missing_sync_read", "race", "gpu/moe_block.cu", 1,
     "  }\n  __syncthreads();\n  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {\n"
     "    if (local[e])",
     "  }\n  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {\n    if (local[e])",
     "moe_block column counts: shared counters flushed to global before every warp has added "
     "(known miss b)"),
    ("039", "block_colcount_shared_nonatomic", "missing-atomic", "gpu/moe_block.cu", 1,
     "if (map[i]) atomicAdd(&local[i % E], 1);",
     "if (map[i]) ++local[i % E];",
     "moe_block column counts: shared-memory increment without an atomic"),
    ("040", "block_colcount_global_nonatomic", "missing-atomic", "gpu/moe_block.cu", 1,
     "if (local[e]) atomicAdd(&out[e], local[e]);",
     "if (local[e]) out[e] += local[e];",
     "moe_block column counts: per-block totals added to global memory without an atomic"),
    ("041", "block_dx_gate_term", "missing-grad-term", "gpu/moe_block.cu", 1,
     "od[j] = from_f32<D>(av[j] + to_f32(bd[j]));",
     "od[j] = from_f32<D>(to_f32(bd[j]));",
     "moe_block backward: d_x misses the gate (router) path's contribution (the eight-wide kernel "
     "of 16-bit dtypes, session 45)"),
    ("042", "block_ordered_sum_last_shard", "edge-size", "gpu/moe_block.cu", 1,
     "for (int64_t k = 1; k < n_parts; ++k) acc += parts[k * stride + i];",
     "for (int64_t k = 1; k + 1 < n_parts; ++k) acc += parts[k * stride + i];",
     "moe_block backward: the gate-kernel gradient sum over shards drops the last shard"),
    # ---- reference/ -----------------------------------------------------------------------------
    ("043", "ref_topk_tie_index_desc", "tie-break", "reference/topk_router.cpp", 1,
     "[&](int a, int b) { return v[a] > v[b]; });",
     "[&](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a > b); });",
     "reference router: exact ties broken by descending expert index"),
    ("044", "ref_router_k2_not_normalised", "edge-size", "reference/topk_router.cpp", 1,
     "if (K > 1) pe /= (pe.sum() + kEps);",
     "if (K > 2) pe /= (pe.sum() + kEps);",
     "reference router: sigmoid/sqrtsoftplus probs not normalised for K = 2"),
    ("045", "ref_group_topk_one_short", "index", "reference/topk_router.cpp", 1,
     "for (int64_t i = 0; i < p.group_topk; ++i) keep[order[i]] = true;",
     "for (int64_t i = 0; i + 1 < p.group_topk; ++i) keep[order[i]] = true;",
     "reference router: grouped selection keeps one group fewer than group_topk"),
    ("046", "ref_dispatch_rid_ascending", "index", "reference/dispatch.cpp", 1,
     "const auto [e, u] = slots[n - 1 - k];",
     "const auto [e, u] = slots[k];",
     "reference dispatch: row_id_map lists the experts ascending instead of descending"),
    ("047", "ref_dispatch_pad_offset", "padding", "reference/dispatch.cpp", 1,
     "const int64_t dst = u + pad_off[e];",
     "const int64_t dst = u;",
     "reference dispatch: rows placed without the alignment padding offsets"),
    ("048", "ref_combine_bwd_no_grad_probs", "missing-grad-term", "reference/dispatch.cpp", 1,
     "        gw(t, s.e) = x.row(s.row).dot(ct.row(t));\n",
     "",
     "reference combine backward: grad_merging_probs left zero"),
    ("049", "ref_argsort_need_without_mod", "alignment", "reference/argsort.cpp", 1,
     "need[e] = (a - count[e] % a) % a;",
     "need[e] = (a - count[e] % a);",
     "reference argsort dispatch: full extra padding block for counts already aligned"),
    ("050", "ref_sort_chunks_tail_reversed", "padding", "reference/sort_chunks.cpp", 1,
     "map.set(i, static_cast<double>(i));",
     "map.set(i, static_cast<double>(num_rows - 1 - (i - V)));",
     "reference sort_chunks: rows past the chunks reversed instead of fixed points (R1)"),
    ("051", "ref_aux_scores_softmax_bwd", "missing-grad-term", "reference/aux_loss.cpp", 1,
     "out = a * (g - (g * a).sum());",
     "out = a * g;",
     "reference aux_loss_scores backward: softmax Jacobian without the -sum(g*a) term"),
    ("052", "ref_ffn_dx_missing_up", "missing-grad-term", "reference/swiglu_ffn.cpp", 1,
     "g0.grad_x.at(i) + g1.grad_x.at(i)",
     "g0.grad_x.at(i)",
     "reference SwiGLU backward: grad_x misses the up projection's contribution"),
    ("053", "ref_ep_out_offset_inclusive", "offset", "reference/ep.cpp", 1,
     "for (int64_t i = 0; i < s; ++i) out_off[j]",
     "for (int64_t i = 0; i <= s; ++i) out_off[j]",
     "reference ragged_a2a_params: output offsets include the rank's own block"),
    ("054", "ref_aux_kappa_one_division", "intermediate-dtype", "reference/aux_loss.cpp", 2,
     "  kappa = kappa / static_cast<float>(p.total_num_tokens);\n",
     "",
     "reference moe_aux_loss: kappa divided by T_tot once instead of twice"),
    # ---- harness/core/ --------------------------------------------------------------------------
    ("055", "core_compare_nan_passes", "nan-handling", "harness/core/compare.cpp", 1,
     "bad = nan_mismatch || inf_mismatch || diff > b;",
     "bad = inf_mismatch || diff > b;",
     "comparison: a NaN where a number is expected (or the reverse) passes a bounded compare"),
    ("056", "core_compare_edge_exclusive", "tolerance-edge", "harness/core/compare.cpp", 1,
     "bad = nan_mismatch || inf_mismatch || diff > b;",
     "bad = nan_mismatch || inf_mismatch || diff >= b;",
     "comparison: an error exactly at the bound fails (and exact results with bound 0 fail)"),
    ("057", "core_round_ties_away", "rounding", "harness/core/dtype.cpp", 1,
     "std::nearbyint(std::ldexp(x, -q))",
     "std::round(std::ldexp(x, -q))",
     "bf16/f16 rounding: ties away from zero instead of to even"),
    ("058", "core_fd_central_step", "formula", "harness/core/finite_diff.cpp", 1,
     "const double d1 = (eval(h) - eval(-h)) / (2 * h);",
     "const double d1 = (eval(h) - eval(-h)) / h;",
     "finite differences: the coarse central difference divided by h instead of 2h"),
    ("059", "core_tol_elementwise_out_ulp", "intermediate-dtype", "harness/core/compare.cpp", 1,
     "return ulp(out, ref) + 4.0 * ulp(DType::f32, ref)",
     "return ulp(out, ref) + 4.0 * ulp(out, ref)",
     "tolerance: the fp32 intermediate's 4 ulp measured in the output dtype (bf16: 65536x "
     "looser)"),
    ("060", "core_bitwise_equal_half", "edge-size", "harness/core/tensor.cpp", 1,
     "std::memcmp(bytes_.data(), o.bytes_.data(), bytes_.size())",
     "std::memcmp(bytes_.data(), o.bytes_.data(), bytes_.size() / 2)",
     "Tensor::bitwise_equal (determinism checks) compares only the first half of the bytes"),
    ("061", "core_ulp_subnormal", "edge-size", "harness/core/dtype.cpp", 1,
     "return std::ldexp(1.0, std::max(e - 1, f.emin) - (f.precision - 1));",
     "return std::ldexp(1.0, (e - 1) - (f.precision - 1));",
     "ulp of a subnormal computed as if normal (too small: tolerances of tiny results shrink)"),
    # ---- gpu/: added in session 10 -----------------------------------------------------------
    ("062", "dispatch_probs_first_slot_wins", "index", "gpu/dispatch.cu", 1,
     "const unsigned above = ~((2u << lane) - 1u);",
     "const unsigned above = (1u << lane) - 1u;",
     "dispatch backward grad_probs: of the slots of a chunk that name one expert, the first "
     "writes instead of the last (only a map that repeats an expert in a token)"),
    ("063", "gather_sum_bulk_in_dtype", "accumulator-dtype", "gpu/dispatch.cu", 1,
     "for (int q = 0; q < N; ++q) acc[q] += to_f32(v.v[q]) * w;",
     "for (int q = 0; q < N; ++q) acc[q] = to_f32(from_f32<T>(acc[q] + to_f32(v.v[q]) * w));",
     "combine forward / dispatch backward, bulk-copy kernel (rows of 16-byte vectors): the "
     "per-token sum over slots rounded to the dtype after every slot"),
    # ---- gpu/: added in session 12 -----------------------------------------------------------
    ("064", "sm90_sched_draw_off_by_one", "index", "gpu/grouped_gemm_sm90.cu", 1,
     "static_cast<int64_t>(atomicAdd(counter, 1)) + clusters;",
     "static_cast<int64_t>(atomicAdd(counter, 1)) + clusters + 1;",
     "sm90 GEMM, dynamic schedule: drawn entries start one late, so the first entry past the "
     "clusters' static ones never runs (only GemmImpl::sm90; starting one early instead is an "
     "equivalent mutant: one entry runs twice, with the same bits)"),
    ("065", "sm90_band_last_band_full", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "const int size = min(p.band_pairs, m_pairs - b * p.band_pairs);",
     "const int size = p.band_pairs;",
     "sm90 GEMM, banded walk: the last band of a group taken as full, so it computes M-pairs "
     "past the group (the next group's rows) and skips some of its own (only groups walked in "
     "bands: GemmImpl::sm90, row operand over 48 MiB, or MOE_SM90_BAND=n)"),
    # ---- gpu/: added in session 13 -----------------------------------------------------------
    ("066", "sm90_wgrad_map_past_group", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(n_g)};",
     "static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(p.rows - off)};",
     "sm90 GEMM, wgrad kernel: a group's TMA descriptors reach to the tensor's end instead of "
     "the group's, so a block's rows past the group (the next group's, or tail rows) join its "
     "sum (only GemmImpl::sm90 with sm90_wgrad)"),
    ("067", "sm90_wgrad_pair_one_tile", "index", "gpu/grouped_gemm_sm90.cu", 1,
     "tl.i0 = (kCluster * q + static_cast<int>(rank)) * kBM;",
     "tl.i0 = kCluster * q * kBM;",
     "sm90 GEMM, wgrad kernel: both CTAs of a cluster take the first row tile of their pair, so "
     "the second is never written (only GemmImpl::sm90 with sm90_wgrad)"),
    ("068", "sm90_tail_quarter_ignores_rank", "index", "gpu/grouped_gemm_sm90.cu", 1,
     "const int w = 2 * static_cast<int>(rank) + cw;",
     "const int w = cw;",
     "sm90 GEMM, folded tail: both CTAs of the pair take the first two quarters of the weight "
     "tile's columns, so the tail rows' last 128 columns are never written (only GemmImpl::sm90, "
     "groups of 4 m + 1 64-row slots)"),
    ("069", "sm90_tail_rows_second_half_twice", "offset", "gpu/grouped_gemm_sm90.cu", 1,
     "const int64_t t_row = tl.tail0 + 32 * rank;",
     "const int64_t t_row = tl.tail0 + 32;",
     "sm90 GEMM, folded tail: both CTAs load the tail's second 32 rows, so its first 32 rows are "
     "computed from the wrong rows of x (only GemmImpl::sm90, groups of 4 m + 1 64-row slots)"),
    # ---- gpu/: added in session 15 -----------------------------------------------------------
    ("070", "sm90_mix_stream_boundary", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "auto& kind = sizes[g] > kStreamRows ? dense : stream;",
     "auto& kind = sizes[g] >= kStreamRows ? dense : stream;",
     "sm90 GEMM, mixed draw order: a group of exactly 256 rows counted as dense, not streaming "
     "(a performance rule: results stay exact; caught by the host test of the order)"),
    ("071", "sm90_mix_order_points_at_counters", "offset", "gpu/grouped_gemm.cu", 1,
     "reinterpret_cast<const int32_t*>(slot.dev + order_at);",
     "reinterpret_cast<const int32_t*>(slot.dev + cnt_at);",
     "sm90 GEMM, mixed draw order: the kernel reads the order from the schedule counters' place "
     "in the upload, so most draws decode the wrong entries and some tiles are never written "
     "(only GemmImpl::sm90 with a dense and a streaming group)"),
    ("072", "auto_small_group_boundary", "edge-size", "gpu/grouped_gemm.cu", 1,
     "small += n <= max_rows ? n : 0;",
     "small += n < max_rows ? n : 0;",
     "GemmImpl::automatic: a group of exactly 320 rows (2048 for wgrad) not counted as small (a "
     "performance rule; caught by the host test of auto_prefers_sm90)"),
    ("073", "sm90_wgrad_tma_box_column", "offset", "gpu/grouped_gemm_sm90.cu", 1,
     "tma_store_3d(map, buf + (b - b0) * kOutBox, o.n0 + 64 * b, o.i, o.g, hint, pol);",
     "tma_store_3d(map, buf + (b - b0) * kOutBox, o.n0 + 64 * b0, o.i, o.g, hint, pol);",
     "sm90 wgrad, TMA-store epilogue: both boxes of a half stored at the half's first 64 columns, "
     "so every tile's columns 64-127 and 192-255 are never written (16-bit grad_w, GemmImpl::sm90 "
     "with sm90_wgrad or automatic)"),
    ("074", "sm90_wgrad_tma_staging_unswizzled", "layout", "gpu/grouped_gemm_sm90.cu", 1,
     "r * 128 + (((jj % 8) ^ (r % 8)) << 4)",
     "r * 128 + ((jj % 8) << 4)",
     "sm90 wgrad, TMA-store epilogue: the staging written in plain row-major order while the TMA "
     "store reads it 128-byte swizzled, so the 16-byte pieces of rows 1-7 of every 8 land in the "
     "wrong columns"),
    ("075", "sm90_second_pair_k_not_rebased", "offset", "gpu/grouped_gemm_sm90.cu", 1,
     "const int k0 = (kb - (q ? p.k_split : 0)) * kBK;",
     "const int k0 = kb * kBK;",
     "sm90 row kernel, two operand pairs (the FFN's grad x): the second pair's k-blocks keep the "
     "first pair's column offset, so they load past a2's columns (zero-filled) and its product "
     "is lost"),
    ("076", "ffn_grad_x_tail_not_zeroed", "padding", "gpu/swiglu_ffn.cu", 1,
     "    gemm_detail::zero_tail_rows(plan, out.grad_x.data(), H, es, s);\n",
     "",
     "swiglu_expert_ffn backward on the sm90 two-pair product: the tail rows of grad x are left "
     "as they were (poison) instead of zeroed"),
    ("077", "auto_pair_bound", "edge-size", "gpu/grouped_gemm.cu", 1,
     "auto_takes_sm90(plan, kAutoPairRows)",
     "auto_takes_sm90(plan, kAutoSm90Rows)",
     "GemmImpl::automatic: a two-product sum (the FFN's grad x) takes the single products' 320-row "
     "bound instead of 2048 (a performance rule; caught by the host test of resolve_pair_impl)"),
    ("078", "gate_grads_split_last_term_dropped", "rounding", "gpu/moe_block.cu", 1,
     "const __nv_bfloat16 lo = __float2bfloat16_rn(r1 - __bfloat162float(mid));",
     "const __nv_bfloat16 lo = __float2bfloat16_rn(0.0f);",
     "moe_block backward, bf16: d_logits' third bf16 term is dropped, so each product of the "
     "gate's gradients is up to 2^-16 off (within the block's composite budget; caught by the "
     "gate test)"),
    ("079", "gate_grads_split_inf_residue", "nan-handling", "gpu/moe_block.cu", 1,
     "const float r1 = isfinite(x) ? x - __bfloat162float(hi) : 0.0f;",
     "const float r1 = x - __bfloat162float(hi);",
     "moe_block backward, bf16: an infinite d_logits leaves inf - inf = NaN as its second term, "
     "so the gate's gradients turn NaN where fp32 sums give +-inf"),
    # ---- gpu/: added in session 19 -----------------------------------------------------------
    ("080", "sm90_wide_store_lane_column", "layout", "gpu/grouped_gemm_sm90.cu", 1,
     "const int col = 8 * (4 * m + q);",
     "const int col = 8 * (4 * m + (q ^ 1));",
     "sm90 row kernel, 16-byte epilogue: after the quad transpose, lanes q and q ^ 1 store their "
     "8 columns at each other's place, so every output row's 8-column groups are swapped in pairs "
     "(16-bit outputs without bias or accumulation: the forward and dgrad)"),
    ("081", "sm90_hinted_store_word_order", "layout", "gpu/grouped_gemm_sm90.cu", 1,
     '"r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "l"(pol)',
     '"r"(w[1]), "r"(w[0]), "r"(w[2]), "r"(w[3]), "l"(pol)',
     "sm90 row kernel, 16-byte epilogue with an L2 hint (the default where the weight streams): "
     "the first two 4-byte words of each piece swapped, so columns 8 j + 0..1 and 8 j + 2..3 trade "
     "places (the unhinted store is right, so only tests that run the hinted one can see it)"),
    ("082", "auto_mix_ridge_boundary", "edge-size", "gpu/grouped_gemm.cu", 1,
     "return k.count[2] > 0 && streaming > 0 && factor * streaming * kAutoRidgeRows >= other_rows;",
     "return k.count[2] > 0 && streaming > 0 && factor * streaming * kAutoRidgeRows > other_rows;",
     "automatic's mixed-plan rules: a plan whose streaming groups' weights take exactly half (a "
     "quarter, for split) as long as the other groups' products stays on chunked (the host "
     "test's boundary plans)"),
    ("083", "split_share_one_sm_per_cluster", "edge-size", "gpu/grouped_gemm.cu", 1,
     "r.sm_target = std::max(1, sms - sm90::kClusterSize * r.clusters);",
     "r.sm_target = std::max(1, sms - r.clusters);",
     "GemmImpl::split: cuBLAS is planned for the SMs left as if each sm90 cluster held one SM, not "
     "two (a performance rule; caught by the host test of split_share)"),
    # ---- gpu/: added in session 23 -----------------------------------------------------------
    ("084", "split_share_balance_one_sm_per_cluster", "edge-size", "gpu/grouped_gemm.cu", 1,
     "const double c = g * kSplitRows * sms / (rows + 2.0 * g * kSplitRows);",
     "const double c = g * kSplitRows * sms / (rows + g * kSplitRows);",
     "GemmImpl::split's balance takes one SM from cuBLAS per sm90 cluster, not two, so the sm90 "
     "half gets more clusters than balance needs (29 instead of 24 on the DeepSeek-like skewed "
     "plan; a performance rule; caught by the host test of split_share)"),
    ("085", "auto_splits_at_the_mixed_ratio", "edge-size", "gpu/grouped_gemm.cu", 1,
     "return mixes_at_least(plan, kAutoSplitFactor);",
     "return mixes_at_least(plan, 2);",
     "automatic splits fwd and dgrad only where the plan is mixed (ratio 1/2), not from 1/4: the "
     "128-expert skewed plan and the block's stay on chunked (a performance rule; caught by the "
     "host test of the rule)"),
    ("086", "sm90_wgrad_defer_second_half_lost", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "if (written < 2) store_half_tma<1>",
     "if (written < 1) store_half_tma<1>",
     "sm90 wgrad, deferred epilogue: after a one-block tile the previous block's second half "
     "(columns 128-255) is never written, since only half 0 fits in that tile's products "
     "(16-bit grad_w; GemmImpl::sm90 with sm90_wgrad or automatic)"),
    ("087", "gemm_read_plan_int64_half_copied", "offset", "gpu/grouped_gemm.cu", 1,
     "cudaMemcpyAsync(slot.host, group_sizes.data(), G * es,",
     "cudaMemcpyAsync(slot.host, group_sizes.data(), G * sizeof(int32_t),",
     "read_group_plan through the pinned slot: int64 group sizes copied with the int32 byte "
     "count, so the later half of the groups read whatever the slot held before"),
    ("088", "sm90_tail_width_too_narrow", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "return rows <= 16 ? 16 : rows <= 32 ? 32 : 64;",
     "return rows <= 16 ? 16 : rows <= 48 ? 32 : 64;",
     "sm90 folded tail: tails of 33-48 rows multiplied at width 32, so their rows 32-47 are "
     "never computed or stored (forward / dgrad of groups of 4 m + 1 64-row slots)"),
    ("089", "sm90_tail_store_row_pair", "index", "gpu/grouped_gemm_sm90.cu", 1,
     "const int r = 8 * j + 2 * (lane % 4) + e;",
     "const int r = 8 * j + 2 * (lane % 4);",
     "sm90 folded tail: the transposed accumulator's two tail rows of a register pair both "
     "stored at the first, so every odd tail row is left unwritten and the even ones hold the "
     "odd rows' sums"),
    ("090", "sm90_narrow_bound_too_wide", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "} else if (active && p.narrow && mine <= 32) {",
     "} else if (active && p.narrow && mine <= 48) {",
     "sm90 narrow warpgroup: 33-48 of a group's rows multiplied at width 32, so its rows 32-47 "
     "are never computed or stored (a group's last row tile, forward / dgrad)"),
    ("091", "sm90_stage_freed_before_products", "race", "gpu/grouped_gemm_sm90.cu", 1,
     "        done = wait_products<0>(it);  // this k-block's products are done: release its stage now\n"
     "      }\n"
     "    } else {\n"
     "      done = it + 1;  // nothing issued\n"
     "    }\n"
     "    if constexpr (kHold) {\n"
     "      if (prev >= 0) release(prev);\n"
     "      prev = it;\n"
     "    } else {\n"
     "      release(it);\n"
     "    }",
     "        release(it);\n"
     "        done = wait_products<0>(it);\n"
     "      }\n"
     "    } else {\n"
     "      done = it + 1;  // nothing issued\n"
     "    }\n"
     "    if constexpr (kHold) {\n"
     "      if (prev >= 0) release(prev);\n"
     "      prev = it;\n"
     "    } else if constexpr (!kActive) {\n"
     "      release(it);\n"
     "    }",
     "sm90 forward / dgrad consumer frees a stage as soon as its products are issued, before they "
     "are done: the producer may refill it while the tensor cores still read it"),
    ("092", "sm90_wgrad_stage_freed_before_products", "race", "gpu/grouped_gemm_sm90.cu", 1,
     "        done = wait_products<1>(it);  // the previous k-block's products are done: release its stage\n"
     "      } else {",
     "        if (prev >= 0) release(prev);\n"
     "        prev = -1;\n"
     "        done = wait_products<1>(it);\n"
     "      } else {",
     "sm90 wgrad consumer frees the previous stage before waiting for that stage's products (the "
     "held stage's release moved ahead of its wait)"),
    # ---- gpu/: the bulk-copy dispatch forward (session 32) --------------------------------------
    ("093", "dispatch_bulk_tail_not_zeroed", "padding", "gpu/dispatch.cu", 1,
     "const long long nz = pads + max(0LL, rows - aligned);",
     "const long long nz = pads;",
     "dispatch forward, bulk-copy kernel (rows of 16-byte vectors): the tail rows past the "
     "aligned counts are left unwritten"),
    ("094", "dispatch_bulk_r12_plus_zero_only", "edge-case", "gpu/dispatch.cu", 1,
     "zero = load_f(probs, pcode, t * E + sl.e) == 0.0f;",
     "zero = __float_as_uint(load_f(probs, pcode, t * E + sl.e)) == 0u;",
     "dispatch forward, bulk-copy kernel: only +0 probs write a zero row (R12), -0 copies x"),
    ("095", "dispatch_bulk_chunk_offset", "offset", "gpu/dispatch.cu", 1,
     "bulk::copy_s2g(out + sl.row * row_bytes + off,",
     "bulk::copy_s2g(out + sl.row * row_bytes,",
     "dispatch forward, bulk-copy kernel: every column chunk of x's row lands at the start of the "
     "destination row (rows over 16 KiB)"),
    # ---- tools/: the speed gate (bench-compare), CPU gates only ---------------------------------
    ("096", "benchcmp_no_noise_guard", "gate", "tools/bench_compare.cpp", 1,
     "c.ratio > 1 + opt.max_slowdown && c.best_ratio > 1",
     "c.ratio > 1 + opt.max_slowdown",
     "bench-compare: a slow median is SLOWER even when NEW's fastest sample beats OLD's median"),
    ("097", "benchcmp_copy_ratio_inverted", "formula", "tools/bench_compare.cpp", 1,
     "return metric == \"pct_copy\"   ? r.pct_copy",
     "return metric == \"pct_copy\"   ? 1.0 / r.pct_copy",
     "bench-compare: a memory-bound row's speed taken as 1 / its % of copy (slower reads "
     "faster)"),
    ("098", "benchcmp_missing_passes", "gate", "tools/bench_compare.cpp", 1,
     "        if (!o.allow_missing) return true;\n",
     "",
     "bench-compare: a row of OLD missing from NEW no longer fails the comparison"),
    ("099", "benchcmp_bytes_unchecked", "gate", "tools/bench_compare.cpp", 1,
     "!same_count(o->bytes, n.bytes) ||",
     "",
     "bench-compare: a row whose bytes changed is compared as if it were the same work"),
    ("100", "benchcmp_min_reads_medians", "formula", "tools/bench_compare.cpp", 1,
     ": metric == \"min\"      ? 1.0 / r.min_us",
     ": metric == \"min\"      ? 1.0 / r.median_us",
     "bench-compare --by min: the fastest samples' metric reads the medians"),
    # ---- the TE conformance gate and the bench's even groups -----------------------------------
    ("101", "tegate_report_ignored", "gate", "integrations/te/test_te_plugin.sh", 2,
     "rc=$?\n",
     "rc=0\n",
     "te_router_conformance: te_report.py's verdict ignored, so an untriaged TE departure passes"),
    ("102", "even_groups_remainder_dropped", "edge-size", "harness/ops/ep_family.cpp", 1,
     "sizes[g] = total / groups + (g < total % groups ? 1 : 0);",
     "sizes[g] = total / groups;",
     "even_groups: the total % groups remainder rows dropped from the groups (they become tail "
     "rows)"),
    ("103", "sm90_producer_box_column_of_rank", "offset", "gpu/grouped_gemm_sm90.cu", 1,
     "const int b_n0 = tl.n0 + 128 * r;",
     "const int b_n0 = tl.n0 + 64 * r;",
     "sm90 row kernel, lean producer (session 35): the second CTA of an M-pair loads its weight "
     "boxes from 64 columns past the tile instead of 128, so half the tile's columns multiply the "
     "wrong weight columns"),
    ("104", "sm90_row_tma_partial_block", "offset", "gpu/grouped_gemm_sm90.cu", 1,
     "if (mine >= 64) {",
     "if (mine > 0) {",
     "sm90 row kernel, TMA epilogue (session 36): a warpgroup holding a group's last rows (fewer "
     "than 64) writes a whole 64-row box, into the next group's rows or past the last group"),
    ("105", "sm90_row_defer_one_block_half", "edge-size", "gpu/grouped_gemm_sm90.cu", 1,
     "const int second = min(2, p.k_blocks - 1);",
     "const int second = 2;",
     "sm90 row kernel, deferred TMA epilogue (session 36): a tile of one or two k-blocks never "
     "reaches block 2, so the pending block's second half (columns 128-255) is dropped"),
    ("106", "sm90_wgrad_panel_one_block_half_lost", "edge-size", "gpu/grouped_gemm_sm90.cu", 2,
     "          if (written < 2) store_half_tma<1>(&tm_c, stage_out, cw, pend, packed, p.hint_c, pol);\n",
     "",
     "sm90 panel wgrad kernel (session 37): where the next tile has one k-block, the previous "
     "tile's block never gets its second half (columns 128-255) written"),
    ("107", "sm90_wgrad_panel_pairs_inner", "index", "gpu/grouped_gemm_sm90.cu", 1,
     "panel.pairs_inner = false;",
     "panel.pairs_inner = kp.pairs_inner;",
     "sm90 panel wgrad kernel (session 37): its runs decoded in the host's order, pairs inner where "
     "a group has fewer i-pairs than column tiles, so a run's tiles change i-pair under a panel "
     "loaded for the first one"),
    # ---- gpu/: the router's uploaded sigmoid table (session 39) ------------------------------------
    ("108", "router_lut_next_pattern", "offset", "gpu/topk_router.cu", 1,
     "const float x = score::bits_float(sig_pattern(i) << 16);",
     "const float x = score::bits_float((sig_pattern(i) + 1) << 16);",
     "router variant 2, bf16 sigmoid (session 39): the host's table holds each pattern's successor's "
     "sigmoid (an input one bf16 ulp too large), so every looked-up score is a little off"),
    ("109", "router_lut_copy_layout", "layout", "gpu/router_row.cuh", 1,
     "reinterpret_cast<uint4*>(slut)[threadIdx.x + k * kBlock] = w[k];",
     "reinterpret_cast<uint4*>(slut)[threadIdx.x * kWords + k] = w[k];",
     "router variant 2, bf16 sigmoid (session 39): the block's copy of the uploaded table stores "
     "thread t's word k at t * 4 + k where it loaded t + 256 k: the table's entries permuted"),
    ("110", "aux_v2_sum_empty_lanes", "edge-size", "gpu/router_row.cuh", 1,
     "        if (j < n) sum = sum + z[j];\n      const float den = seg_sum<LANES>(sum) + kEps;",
     "        sum = sum + z[j];\n      const float den = seg_sum<LANES>(sum) + kEps;",
     "aux_loss_scores on variant 2, bf16 sigmoid (session 39): the row sum also adds the table "
     "entries read by lanes without experts (E < 256), so every score of such a row is too small"),
    ("111", "wgrad_panel_first_slice_each_block", "missing-accumulation", "gpu/grouped_gemm_sm90.cu",
     2, "wgmma_m64n256k16<T, 1, 1>(acc, da, db, kb > 0 || kk > 0);",
     "wgmma_m64n256k16<T, 1, 1>(acc, da, db, kk > 0);",
     "sm90 panel wgrad kernel (session 41): the first k-slice of every k-block, not only of the "
     "tile's first, writes the accumulators, so a tile keeps only its last block's products"),
    ("112", "block_dx_gate_term_scalar", "missing-grad-term", "gpu/moe_block.cu", 1,
     "out[i] = from_f32<D>(a[i] + to_f32(b[i]));",
     "out[i] = from_f32<D>(to_f32(b[i]));",
     "moe_block backward: d_x misses the gate path's contribution in the scalar kernel (f32, or a "
     "16-bit d_x whose size or addresses do not allow eight-wide access)"),
    ("113", "wgrad_empty_groups_unwritten", "edge-case", "gpu/grouped_gemm.cu", 1,
     "    for (const auto& bc_i : bc) zero_empty_groups(plan, bc_i.second, K * N, dtype_size(c_type), s);\n",
     "",
     "grouped_product's wgrad (session 46: it, not its callers, zeroes the empty groups) leaves an "
     "empty expert's weight gradient as it was (poison in the tests, stale memory in the block)"),
    ("114", "chunked_prefill_when_accumulating", "missing-accumulation", "gpu/grouped_gemm.cu", 1,
     "  if (!accumulate && gemm_detail::cublas_prefill_setting()) {\n",
     "  if (gemm_detail::cublas_prefill_setting()) {\n",
     "chunked's initcheck prefill (MOE_CUBLAS_PREFILL=zero) also zeroes the slabs of an "
     "accumulating product, after the old output was copied in (the sum loses its addend)"),
    ("115", "prefill_joins_neighbours", "edge-case", "gpu/grouped_gemm.cu", 1,
     "for (; j < r.size() && at(r[j].p) < hi; ++j)",
     "for (; j < r.size() && at(r[j].p) <= hi; ++j)",
     "the initcheck prefill joins touching ranges into one memset, which fails with "
     "cudaErrorInvalidValue where they lie in two allocations (session 47's bug)"),

    ("116", "bench_targets_floor_exclusive", "edge-case", "tools/bench_compare.cpp", 1,
     ": res.value >= g.min ? TargetVerdict::met",
     ": res.value > g.min ? TargetVerdict::met",
     "bench-targets: a row exactly at its floor counts as missed (the floor is inclusive)"),

]


def run(cmd, cwd, **kw):
    return subprocess.run(cmd, cwd=cwd, check=True, text=True, capture_output=True, **kw).stdout


def main():
    check_only = "--check" in sys.argv
    root = run(["git", "rev-parse", "--show-toplevel"], os.getcwd()).strip()
    outdir = os.path.join(root, "tests", "mutants")
    ids = [m[0] for m in M]
    assert len(ids) == len(set(ids)), "duplicate mutant ids"
    tmp = tempfile.mkdtemp(prefix="mutants-")
    try:
        # A scratch clone of HEAD: the diffs name HEAD's blobs, and the real tree is untouched.
        run(["git", "clone", "--quiet", "--shared", "--no-checkout", root, tmp], root)
        run(["git", "checkout", "--quiet", run(["git", "rev-parse", "HEAD"], root).strip()], tmp)
        bad = 0
        index = []
        patches = {}
        for mid, name, cls, path, occ, old, new, desc in M:
            full = os.path.join(tmp, path)
            with open(full) as f:
                text = f.read()
            pos = -1
            for _ in range(occ):
                pos = text.find(old, pos + 1)
                if pos < 0:
                    break
            if pos < 0:
                print(f"{mid} {name}: occurrence {occ} of its text not found in {path}")
                bad += 1
                continue
            with open(full, "w") as f:
                f.write(text[:pos] + new + text[pos + len(old):])
            diff = run(["git", "diff", "--", path], tmp)
            run(["git", "checkout", "--quiet", "--", path], tmp)
            if not diff:
                print(f"{mid} {name}: empty diff")
                bad += 1
                continue
            patches[f"{mid}_{name}.patch"] = diff
            index.append(f"{mid}\t{cls}\t{path}\t{desc}")
        if bad or check_only:
            print(f"{len(M) - bad} of {len(M)} mutants found their text")
            return 1 if bad else 0
        for fn in os.listdir(outdir):
            if fn.endswith(".patch"):
                os.remove(os.path.join(outdir, fn))
        for fn, diff in patches.items():
            with open(os.path.join(outdir, fn), "w") as f:
                f.write(diff)
        with open(os.path.join(outdir, "INDEX"), "w") as f:
            f.write("# id\tclass\tfile\tdescription (one mutant per line; patch: NNN_*.patch)\n")
            f.write("\n".join(index) + "\n")
        print(f"wrote {len(patches)} patches and INDEX to {outdir}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
