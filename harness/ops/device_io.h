// Host <-> device moves shared by the records' CUDA runners (*_gpu.cpp, bench_device.cpp): a
// runner uploads the case's input.* / cotangent.* tensors, calls the twin and downloads what it
// returns under the output.* / grad.* keys. CUDA builds only.
#pragma once

#ifdef MOE_WITH_CUDA

#include <optional>
#include <string>
#include <vector>

#include "gpu/runtime.cuh"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"

namespace moe::ops {

using gpu::DeviceTensor;

inline DeviceTensor up(const TensorMap& in, const std::string& key) {
  return DeviceTensor::upload(in.at(key));
}

// An optional input (an absent key) stays absent on the device.
inline std::optional<DeviceTensor> up_opt(const TensorMap& in, const std::string& key) {
  const Tensor* t = find_tensor(in, key);
  if (!t) return std::nullopt;
  return DeviceTensor::upload(*t);
}

// The twins take optional tensors as pointers (null = absent).
template <class T>
const T* ptr(const std::optional<T>& t) {
  return t ? &*t : nullptr;
}

inline void put(TensorMap& out, const std::string& key, const DeviceTensor& t) {
  out.emplace(key, t.download());
}
inline void put(TensorMap& out, const std::string& key, const std::optional<DeviceTensor>& t) {
  if (t) out.emplace(key, t->download());
}

// EP tensors: one device tensor per rank of the stacked [P, ...] host tensor, and back.
inline std::vector<DeviceTensor> up_ranks(const TensorMap& in, const std::string& key) {
  std::vector<DeviceTensor> v;
  for (const Tensor& t : unstack(in.at(key))) v.push_back(DeviceTensor::upload(t));
  return v;
}
inline Tensor down_stack(const std::vector<DeviceTensor>& v) {
  std::vector<Tensor> h;
  for (const DeviceTensor& t : v) h.push_back(t.download());
  return stack(h);
}

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
