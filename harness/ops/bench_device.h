// Benchmarks at full size with inputs generated on the device (OpInfo::gpu_bench_device,
// OpInfo::bench_verify_case; see registry.h), and the pieces they share:
//   - device_uniform: a DeviceTensor of seeded uniform values (the hash RNG of
//     gpu::gemm_detail::fill_hash_uniform, seed from the case seed and the tensor name), so
//     gigabytes of operands cost milliseconds instead of minutes of host generation;
//   - the hooks of grouped_gemm and swiglu_expert_ffn (defined in bench_device.cpp) and of
//     moe_block (block_gpu.cpp), with the full-size cases of the issue and the small cases
//     `moe-harness bench` verifies first;
#pragma once

#ifdef MOE_WITH_CUDA

#include <string>
#include <string_view>
#include <vector>

#include "gpu/grouped_gemm.cuh"
#include "gpu/runtime.cuh"
#include "harness/ops/registry.h"

namespace moe::ops {

// [lo, hi) uniform values in dtype d (rounded once), from (c.seed, name); written on the legacy
// default stream (callers synchronise before timing on bench_stream()).
gpu::DeviceTensor device_uniform(const Case& c, DType d, const Shape& s, double lo, double hi,
                                 const std::string& name);

// grouped_gemm: the shapes, bf16, uniform and skewed group sizes:
//   Mixtral-like  32768 rows (16384 tokens x K 2) x K_d 4096 x N 14336, G 8
//   DeepSeek-like 65536 rows (8192 tokens x K 8)  x K_d 7168 x N 2048,  G 256
std::vector<Case> grouped_gemm_full_bench_cases();
OpInfo::Bench grouped_gemm_gpu_bench_device(const Case& c);
// G and the regime kept, 1024 rows, K_d and N cut to 128 (the CPU reference runs in a second).
Case grouped_gemm_bench_verify_case(const Case& c);

// swiglu_expert_ffn at the same shapes (H = K_d, M = N), uniform and skewed; verified with G and
// the regime kept at 512 rows, H and M cut to 64 (its stage-propagated bounds cost more).
std::vector<Case> swiglu_expert_ffn_full_bench_cases();
OpInfo::Bench swiglu_expert_ffn_gpu_bench_device(const Case& c);
Case swiglu_expert_ffn_bench_verify_case(const Case& c);

// The rows per group of the cuBLAS strided-batched yardstick of a grouped GEMM or FFN bench case
// (OpInfo::Bench::batched), else 0: the uniform regime's groups evened out (plan.used / G each,
// the same FLOPs and bytes) where they divide evenly and no tail follows them. Skewed and other
// regimes get none: their imbalance is what they measure.
int64_t batched_rows(const Case& c, const gpu::GroupPlan& plan);

// moe_block (block_gpu.cpp): the cases of moe_block_gpu_bench_cases() with device inputs; the
// verification case keeps E, K, the router and the regime with B = 1, S = 64, H = 64, M = 64.
OpInfo::Bench moe_block_gpu_bench_device(const Case& c);
Case moe_block_bench_verify_case(const Case& c);

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
