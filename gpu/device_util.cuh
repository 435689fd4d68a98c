// Device-side helpers shared by the kernels (CUDA-only header: include from .cu files).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "harness/core/dtype.h"

namespace moe::gpu {

struct DeviceErrorSlot {
  int32_t code;
  int32_t pad;
  long long a, b;
};

// Records the first fault; later faults are dropped so the report is deterministic enough to read.
__device__ inline void raise_error(void* flag, int32_t code, long long a, long long b) {
  auto* slot = static_cast<DeviceErrorSlot*>(flag);
  if (atomicCAS(&slot->code, 0, code) == 0) {
    slot->a = a;
    slot->b = b;
  }
}

template <class T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// Dispatches a float dtype to the matching device type: f(float{}), f(__nv_bfloat16{}),
// f(__half{}).
template <class F>
void dispatch_float(DType dt, F&& f) {
  switch (dt) {
    case DType::f32:
      f(float{});
      return;
    case DType::bf16:
      f(__nv_bfloat16{});
      return;
    case DType::f16:
      f(__half{});
      return;
    default:
      break;
  }
  throw std::invalid_argument(std::string("unsupported dtype ") + std::string(dtype_name(dt)));
}

}  // namespace moe::gpu
