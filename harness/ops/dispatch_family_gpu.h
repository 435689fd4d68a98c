// CUDA bindings of the permutation and EP records (SPEC §4-9): token_dispatch, token_combine,
// sort_chunks_by_index, routing_map_to_selected_experts, argsort_token_dispatch,
// argsort_token_combine, ragged_a2a_params, ragged_all_to_all, local_permute_after_a2a and
// local_unpermute_before_a2a. Each <op>_gpu uploads the inputs, runs the twin forward (and
// backward when cotangents are present) with every output poisoned first and validation on,
// and returns output.* / grad.* under the SPEC §14 keys the reference uses. The benchmarks
// upload once and launch the launch-only (_into) forms, which neither allocate nor synchronise.
#pragma once

#ifdef MOE_WITH_CUDA

#include <vector>

#include "harness/ops/registry.h"

namespace moe::ops {

TensorMap token_dispatch_gpu(const Case& c, const TensorMap& in);
TensorMap token_combine_gpu(const Case& c, const TensorMap& in);
TensorMap sort_chunks_by_index_gpu(const Case& c, const TensorMap& in);
TensorMap routing_map_to_selected_experts_gpu(const Case& c, const TensorMap& in);
TensorMap argsort_token_dispatch_gpu(const Case& c, const TensorMap& in);
TensorMap argsort_token_combine_gpu(const Case& c, const TensorMap& in);
TensorMap ragged_a2a_params_gpu(const Case& c, const TensorMap& in);
TensorMap ragged_all_to_all_gpu(const Case& c, const TensorMap& in);
TensorMap local_permute_after_a2a_gpu(const Case& c, const TensorMap& in);
TensorMap local_unpermute_before_a2a_gpu(const Case& c, const TensorMap& in);

OpInfo::Bench token_dispatch_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench token_combine_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench sort_chunks_by_index_gpu_bench(const Case& c, const TensorMap& in);

// The same benchmarks with inputs generated on the device (OpInfo::gpu_bench_device): float
// tensors from the seeded hash RNG in make_inputs' ranges (probs U[0.1, 1)); the routing map,
// the merging probs (T*K values) and the chunk lists come from the host, as make_inputs builds
// them; token_combine takes permuted / row_id_map / pad_offsets from the CUDA dispatch of that
// routing. Cases with exact-zero probs (R12) are refused (std::invalid_argument).
OpInfo::Bench token_dispatch_gpu_bench_device(const Case& c);
OpInfo::Bench token_combine_gpu_bench_device(const Case& c);
OpInfo::Bench sort_chunks_by_index_gpu_bench_device(const Case& c);

// The cases `moe-harness bench` verifies first (OpInfo::bench_verify_case): dispatch and combine
// with T <= 256, H <= 128 and every expert kept; the chunk sort with every chunk shrunk by one
// factor to about 4096 rows, H <= 128.
Case dispatch_bench_verify_case(const Case& c);
Case sort_chunks_bench_verify_case(const Case& c);

// The benchmark shapes of the issue: T = 16384, H = 7168, E = 256, K = 8, bf16, with and
// without align_size = 128 (chunk sort: the EP local permute of those rows, P = 8, L = 32).
std::vector<Case> token_dispatch_gpu_bench_cases();
std::vector<Case> token_combine_gpu_bench_cases();
std::vector<Case> sort_chunks_by_index_gpu_bench_cases();

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
