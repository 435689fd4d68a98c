// CUDA bindings of the grouped_gemm and swiglu_expert_ffn records (SPEC §10). Each <op>_gpu
// uploads the inputs, runs the twin forward and backward with every output poisoned first, and
// returns output.* / grad.* under the SPEC §14 keys the reference uses. The case parameter `impl`
// (grouped, loop, streams, chunked, sm90, split or auto; absent = gpu::default_gemm_impl()) picks
// how the per-group products are issued, so tests cover every implementation through the same
// record; `chunk_rows` sets chunked's chunk size (absent = its default).
//
// The benchmarks upload once, read the group sizes back once (the plan), and launch the _into
// forms, which neither allocate outputs nor synchronise; fwd() is the forward, bwd() the backward.
// The per-call group-size read-back that the allocating forms pay (one small copy and a stream
// synchronisation) is measured separately by the GemmBench test in tests/gpu/test_gemm_gpu.cpp.
#pragma once

#ifdef MOE_WITH_CUDA

#include <vector>

#include "harness/ops/registry.h"

namespace moe::ops {

TensorMap grouped_gemm_gpu(const Case& c, const TensorMap& in);
TensorMap swiglu_expert_ffn_gpu(const Case& c, const TensorMap& in);

OpInfo::Bench grouped_gemm_gpu_bench(const Case& c, const TensorMap& in);
OpInfo::Bench swiglu_expert_ffn_gpu_bench(const Case& c, const TensorMap& in);

// Benchmark shapes whose inputs the host generates in seconds (make_inputs runs on the host):
// Mixtral-like with the FFN split 8 ways (H = 4096, F/8 = 1792, E = 8) and DeepSeek-like on one
// of 32 EP ranks (H = 7168, F = 2048, 8 local experts), uniform and skewed group sizes. The
// full-size shapes of the issue run in GemmBench with inputs generated on the device.
std::vector<Case> grouped_gemm_gpu_bench_cases();
std::vector<Case> swiglu_expert_ffn_gpu_bench_cases();
// The bf16 benchmark cases both bench paths build from (host inputs here, device inputs in
// bench_device.cpp): G groups over M rows of a K x N product, or of an H -> M FFN.
Case gemm_bench_case(const std::string& name, Regime regime, int64_t G, int64_t M, int64_t K,
                     int64_t N);
Case ffn_bench_case(const std::string& name, Regime regime, int64_t G, int64_t Mt, int64_t H,
                    int64_t M);

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
