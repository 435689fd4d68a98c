// The op registry: one small record per op binds its case generator, input generator, CPU
// reference, CUDA twin, tolerance and cost. Property tests, `moe-harness check`, the golden tool
// and the benchmarks all iterate over it, so adding an op means adding one record
// (harness/ops/<op>.cpp) and one line in registry.cpp.
//
// Tensor naming follows the golden schema (SPEC §14): make_inputs returns input.* and cotangent.*,
// reference/gpu return output.* and grad.* (saved residuals are outputs).
#pragma once

#include <rapidcheck.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "harness/core/case.h"
#include "harness/core/compare.h"
#include "harness/core/tensor.h"

namespace moe::ops {

// One stage of a composite op (the MoE block's gate GEMM, router, dispatch, expert FFN, ...):
// what it computes and moves when it runs as its own kernel(s), reading its inputs from and writing
// its outputs to device memory.
struct StageCost {
  std::string name;
  double fwd_bytes = 0, bwd_bytes = 0;  // fewest bytes moved (read + written)
  double fwd_flops = 0, bwd_flops = 0;
};

struct Cost {
  double fwd_bytes = 0, bwd_bytes = 0;  // fewest bytes moved (read + written)
  double fwd_flops = 0, bwd_flops = 0;
  // Optional per-stage breakdown (empty: one stage). When present the totals above are its sums,
  // and `moe-harness bench` takes the op's roofline as the sum of the stages' rooflines
  // (harness/ops/roofline.h): stages run one after another, each bound by its own flops or bytes.
  std::vector<StageCost> stages;
};

struct OpInfo {
  std::string name;  // SPEC op name
  std::string spec;  // "SPEC §1"

  // Random valid cases over the whole parameter space; shrinks towards small cases.
  std::function<rc::Gen<Case>()> gen;
  // Named cases: regression cases (R*) and the golden catalogue. Each has a "name" parameter.
  std::function<std::vector<Case>()> named;
  // input.* and cotangent.* from (case seed, tensor name), shaped by the case's regime.
  std::function<TensorMap(const Case&)> make_inputs;
  // output.* and grad.* of the CPU reference. exact=true is the finite-difference mode: float
  // inputs arrive as f64 and outputs are not rounded.
  std::function<TensorMap(const Case&, const TensorMap& in, bool exact)> reference;
  // output.* and grad.* of the CUDA twin (host tensors in and out); empty until one exists.
  std::function<TensorMap(const Case&, const TensorMap& in)> gpu;
  // Per-element absolute bound (f64) of a float output or grad; absent means exact comparison.
  std::function<Tensor(const Case&, const std::string& key, const TensorMap& in,
                       const TensorMap& want)>
      bound;
  // Optional override of the comparison (the router's tie-aware comparison); default compares
  // every key of want with bound().
  std::function<Report(const Case&, const TensorMap& in, const TensorMap& want,
                       const TensorMap& got)>
      compare;
  // Invariants of SPEC §12 that one run must satisfy; returns failure lines (empty = pass).
  std::function<std::vector<std::string>(const Case&, const TensorMap& in, const TensorMap& out)>
      invariants;
  // Per-input masks for finite differences (0 = do not perturb); absent = perturb everything.
  std::function<TensorMap(const Case&, const TensorMap& in)> fd_masks;
  std::function<Cost(const Case&)> cost;

  // SPEC §14 `params` object of a case (exact key set of the schema table), and the way back:
  // a Case rebuilt from a golden file's params, dtype, seed and stored inputs (shapes).
  std::function<nlohmann::json(const Case&)> to_params;
  std::function<Case(const nlohmann::json& params, DType dtype, uint64_t seed, const TensorMap& in)>
      from_params;

  // Benchmarks: inputs uploaded once; fwd()/bwd() launch the CUDA twin on device-resident data
  // (no host transfers) and return without synchronising. bwd may be empty.
  struct Bench {
    std::function<void()> fwd, bwd;
    std::shared_ptr<void> state;  // keeps the device buffers alive
    // Optional report hints for `moe-harness bench`. By default an op is memory-bound: GB/s from
    // OpInfo::cost bytes against the copy bandwidth, fwd and bwd rows.
    //  - GEMM-like ops: a dense m x k x n GEMM whose FLOPs equal the forward's (2mkn =
    //    cost.fwd_flops); bench times it in the same run (fwd, and fwd + dgrad + wgrad for the
    //    fwd+bwd row) and reports TFLOP/s from cost flops and the ratio, and the roofline
    //    max(flops / that rate, bytes / copy bandwidth) (harness/ops/roofline.h); fwd and fwd+bwd
    //    rows.
    int64_t dense_m = 0, dense_k = 0, dense_n = 0;
    //    A uniform case's products as strided-batched GEMMs of equal groups (the same FLOPs and
    //    bytes, its groups evened out): bench times cuBLAS on them in the same run
    //    (gpu::time_batched_gemms) and reports the row's time against it, the vendor's time for
    //    the same work at balanced shapes. Empty: none.
    struct BatchedProduct {
      int64_t batch = 0, m = 0, k = 0, n = 0;  // batch x ([m, k] . [k, n])
      int a_from = -1;                         // >= 0: reads that earlier product's a
    };
    std::vector<BatchedProduct> batched;
    //  - Token-level ops (the MoE block): tokens one fwd processes; tokens/s, fwd and fwd+bwd rows.
    //    Such an op may set dense_m/k/n too (e.g. its FFN's equal-FLOP GEMM): bench then times
    //    that GEMM only for the rate of the row's roofline; the row stays token-level (no %dense).
    double tokens = 0;
    //  - A second byte count reported next to cost()'s (GB/s and % of copy), and what it counts:
    //    e.g. an issue's formula that leaves out rows the SPEC requires written. 0 = none.
    double alt_fwd_bytes = 0, alt_bwd_bytes = 0;
    std::string alt_bytes_note;
    //  - false: fwd/bwd allocate or synchronise (not capturable into a CUDA graph); timed by
    //    direct launches on gpu::bench_stream().
    bool graph = true;
  };
  std::function<Bench(const Case&, const TensorMap& in)> gpu_bench;
  std::function<std::vector<Case>()> bench_cases;
  // Optional: the benchmark with its inputs generated on the device (a seeded hash RNG in the
  // case's value ranges; only small index tensors such as routing maps and group sizes come from
  // the host), for the full-size cases whose host inputs would take minutes or not fit in host
  // memory. When set, `moe-harness bench` uses it instead of make_inputs + gpu_bench. Launches go
  // to gpu::bench_stream().
  std::function<Bench(const Case&)> gpu_bench_device;
  // Optional: the case `moe-harness bench` verifies with check_gpu before timing c (the same
  // parameters at a size the CPU reference runs in seconds). Absent: c with its row count (T or
  // R) cut to --verify-rows.
  std::function<Case(const Case&)> bench_verify_case;
};

// A size-independent integer in [lo, hi) for case generators that still shrinks towards lo.
// rapidcheck's inRange scales its range with the generation size, which under a small
// max_size would confine shapes to their smallest values.
inline rc::Gen<int64_t> any_in(int64_t lo, int64_t hi) {
  return rc::gen::resize(rc::kNominalSize, rc::gen::inRange<int64_t>(lo, hi));
}

const std::vector<const OpInfo*>& all_ops();
const OpInfo* find_op(std::string_view name);  // null if unknown

// Whether this build has the CUDA backend and a GPU is visible.
bool gpu_available();
// Empty while the CUDA context is usable (always, without the CUDA backend); else the sticky
// error that killed it (gpu/runtime.cuh: gpu::context_error).
std::string gpu_context_error();
std::string gpu_description();  // "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)" or why none

}  // namespace moe::ops
