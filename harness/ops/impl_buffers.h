// The buffers of one implementation call (harness/ops/impl.cpp): inputs copied where the
// implementation wants them (host or CUDA device), outputs allocated with guard bytes after their
// end and poisoned, all exposed as DLPack views. finish() brings the outputs back as host tensors
// and reports what the buffers reveal: writes past an output's end, modified inputs, CUDA errors.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moe_harness/impl.h"

namespace moe::ops {

inline constexpr uint8_t kOutputPoison = 0xFF;  // NaN for floats, 0xFF for ints and maps
inline constexpr uint8_t kGuardByte = 0xA5;
inline constexpr size_t kGuardBytes = 256;

class CallBuffers {
 public:
  virtual ~CallBuffers() = default;
  virtual const TensorViews& in_views() const = 0;
  virtual const TensorViews& out_views() const = 0;
  virtual void* stream() const = 0;
  // Waits for the implementation's work, downloads the outputs into got, appends faults.
  virtual void finish(TensorMap& got, std::vector<std::string>& faults) = 0;
};

std::unique_ptr<CallBuffers> make_call_buffers(
    Memory memory, const TensorMap& in,
    const std::vector<std::pair<std::string, TensorMeta>>& outs);

DLDataType dl_dtype(DType dt);
// The moe::DType of a DLPack dtype; throws std::invalid_argument naming `what` otherwise.
DType dtype_of(const DLDataType& t, const std::string& what);
// Host copies between a (compact, host) view and a Tensor of the same dtype and shape.
Tensor tensor_from_view(const DLTensor& v);
void copy_to_view(const Tensor& t, const DLTensor& v, const std::string& what);

}  // namespace moe::ops
