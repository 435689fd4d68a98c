// CUDA runtime glue shared by every gpu/ op: device tensors, error checks, the device error flag.
// This header has no CUDA types, so host C++ (harness/ops, tools) can include it.
#pragma once

#include <cstdint>
#include <string>

#include "harness/core/tensor.h"

struct CUstream_st;

namespace moe::gpu {

using Stream = CUstream_st*;  // same type as cudaStream_t; nullptr = the default stream

int device_count();                // 0 when there is no GPU or driver; never throws
std::string device_description();  // "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)"

// Empty while the CUDA context is usable; else the sticky error that killed it (an illegal or
// misaligned address, a launch failure, a device assert: "cudaErrorIllegalAddress: ..."). After
// such an error every CUDA call of this process fails, so a checker must stop, not go on.
// Non-sticky errors pending on the device are cleared. Never throws.
std::string context_error() noexcept;

// Throws std::runtime_error naming the call, file and line when err != cudaSuccess.
void check_cuda(int err, const char* what, const char* file, int line);
#define MOE_CUDA_CHECK(call) \
  ::moe::gpu::check_cuda(static_cast<int>(call), #call, __FILE__, __LINE__)

// Owning device buffer with a dtype and a shape. Move-only; memory comes from a cache of freed
// buffers or cudaMalloc (gpu/runtime.cu says why and when it is off) and is left
// uninitialised (ops write every element they own; tests poison buffers first).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dt, Shape shape);
  ~DeviceTensor();
  DeviceTensor(DeviceTensor&& o) noexcept;
  DeviceTensor& operator=(DeviceTensor&& o) noexcept;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  static DeviceTensor upload(const Tensor& host, Stream s = nullptr);
  Tensor download(Stream s = nullptr) const;  // synchronises s
  void fill_bytes(uint8_t byte, Stream s = nullptr);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  size_t rank() const { return shape_.size(); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  void* data() { return ptr_; }
  const void* data() const { return ptr_; }
  template <class T>
  T* data() {
    return static_cast<T*>(ptr_);
  }
  template <class T>
  const T* data() const {
    return static_cast<const T*>(ptr_);
  }
  TensorMeta meta() const { return {dtype_, shape_}; }
  std::string describe() const { return std::string(dtype_name(dtype_)) + shape_str(shape_); }

 private:
  DType dtype_ = DType::f32;
  Shape shape_{0};
  int64_t numel_ = 0;
  void* ptr_ = nullptr;
};

// Throws std::invalid_argument naming `what` unless t has this shape and dtype.
void require_tensor(const DeviceTensor& t, DType d, const Shape& shape, const char* what);

// Frees every device buffer the DeviceTensor cache holds (gpu/runtime.cu): between benchmark cases
// of different shapes, and before retrying a stream-ordered allocation that ran out of memory.
void release_buffer_cache() noexcept;
// cudaMallocAsync on s that, when the device is out of memory, empties that cache and tries once
// more (the cache may hold what a stream-ordered allocation needs). Throws on failure.
void* malloc_async(size_t bytes, Stream s);
// A two-way environment knob (benchmark and sanitizer switches): unset, empty or `on` true, `off`
// false; anything else throws std::invalid_argument naming the variable and its value.
bool two_way_setting(const char* name, const char* on, const char* off);

// Device-side error flag for data-dependent faults (SPEC §0 error policy 2). Kernels record the
// first fault with atomicCAS (code, then up to two values); read() synchronises and returns it.
struct DeviceError {
  int32_t code = 0;  // 0 = none; op-specific codes otherwise
  int64_t a = 0, b = 0;
};
class ErrorFlag {
 public:
  ErrorFlag();
  ~ErrorFlag();
  ErrorFlag(const ErrorFlag&) = delete;
  ErrorFlag& operator=(const ErrorFlag&) = delete;
  void reset(Stream s = nullptr);
  DeviceError read(Stream s = nullptr) const;
  // Device pointer to {int32 code, pad, int64 a, int64 b} (see gpu/device_util.cuh).
  void* device_ptr() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

}  // namespace moe::gpu
