// A user's implementation (include/moe_harness/impl.h) called at a benchmark's size, for
// `moe-harness bench --impl NAME` (tools/bench_cmd.cpp). Its buffers are the ones `check` hands it
// (impl_buffers.h: inputs copied where it wants them, outputs poisoned and followed by guard
// bytes), allocated once; every run() calls it again on the same buffers (later calls overwrite
// the outputs, nothing is re-poisoned), and finish() reports what the buffers reveal (writes past
// an output's end, a modified input, CUDA errors). Outputs are not compared at this size: bench
// verifies the implementation on a small case of the same parameters first (check_case).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "harness/ops/impl_buffers.h"
#include "harness/ops/registry.h"
#include "moe_harness/impl.h"

namespace moe::ops {

using OutputMetas = std::vector<std::pair<std::string, TensorMeta>>;

// The output.* and grad.* buffers impl is handed at case c with inputs in (c's full size): the
// keys of the reference's outputs at `small` (the same parameters at a size the CPU reference
// runs quickly) that impl provides, each with the dtype the reference gives it and the shape the
// CUDA twin (OpInfo::gpu) gives it at c, since the reference may take hours at a benchmark's
// size. Throws std::runtime_error when the op has no CUDA twin or its outputs lack a key.
OutputMetas bench_outputs(const Impl& impl, const OpInfo& op, const Case& c, const TensorMap& in,
                          const Case& small);

class ImplBench {
 public:
  // Allocates the call's buffers (make_call_buffers with impl.memory). `in` must outlive this
  // object (finish() compares the inputs with it).
  ImplBench(const Impl& impl, const Case& c, const TensorMap& in, const OutputMetas& outs);
  ImplBench(const ImplBench&) = delete;
  ImplBench& operator=(const ImplBench&) = delete;

  // One impl.run on the buffers, told to launch on `stream` (a cudaStream_t; nullptr: the
  // buffers' own stream, as check gives). Returns without waiting for the device; throws what
  // impl.run throws (NotSupported, an error).
  void run(void* stream = nullptr) const;
  // Waits for the implementation's work; the faults the buffers reveal (empty: none).
  std::vector<std::string> finish();

 private:
  const Impl& impl_;
  const Case c_;
  const std::string params_;
  const TensorMap& in_;
  std::unique_ptr<CallBuffers> buffers_;
};

}  // namespace moe::ops
