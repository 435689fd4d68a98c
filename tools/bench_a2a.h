// The ragged all-to-all benchmark over NCCL (tools/bench_a2a.cpp), nccl-tests style: one process
// per GPU under `moe-harness launch`, every row verified (#wrong) before it is timed.
//
//   moe-harness launch -n 2 -- moe_multi_gpu_tests --bench [--max-tokens 4096 ...]
//   moe-harness launch -n 2 -- moe-harness bench --op ragged_all_to_all [--max-tokens 4096 ...]
#pragma once

#include <cstdint>
#include <string>

namespace moe::tools {

struct RaggedA2ABenchOptions {
  int64_t hidden = 7168;                        // bf16 columns per row
  int64_t topk = 8;                             // rows per token
  int64_t min_tokens = 128, max_tokens = 4096;  // tokens per rank, doubling
  int warmup = 5, iters = 30;
  uint64_t seed = 1;
  std::string json;  // rank 0 writes the rows here when set
};

// Runs the sweep on this rank (every rank of the launch must call it). Prints the rows on rank
// 0. Returns 0, 1 when any row has #wrong > 0, 2 when it cannot run (no launcher environment,
// no NCCL in this build).
int run_ragged_a2a_bench(const RaggedA2ABenchOptions& o);

}  // namespace moe::tools
