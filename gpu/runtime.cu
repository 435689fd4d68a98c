#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

#include "gpu/device_util.cuh"
#include "gpu/runtime.cuh"

namespace moe::gpu {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string device_description() {
  if (device_count() == 0) return "no CUDA device visible";
  int dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return "device properties unavailable";
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %d SMs, %.1f GiB)", p.name, p.major, p.minor,
                p.multiProcessorCount, p.totalGlobalMem / 1073741824.0);
  return buf;
}

void check_cuda(int err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(cudaError_t(err)) + " (" +
                           cudaGetErrorString(cudaError_t(err)) + ") in " + what + " at " + file +
                           ":" + std::to_string(line));
}

DeviceTensor::DeviceTensor(DType dt, Shape shape) : dtype_(dt), shape_(std::move(shape)) {
  numel_ = shape_numel(shape_);
  if (nbytes() > 0) MOE_CUDA_CHECK(cudaMalloc(&ptr_, nbytes()));
}

DeviceTensor::~DeviceTensor() {
  if (ptr_) cudaFree(ptr_);
}

DeviceTensor::DeviceTensor(DeviceTensor&& o) noexcept
    : dtype_(o.dtype_), shape_(std::move(o.shape_)), numel_(o.numel_), ptr_(o.ptr_) {
  o.ptr_ = nullptr;
  o.numel_ = 0;
}

DeviceTensor& DeviceTensor::operator=(DeviceTensor&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    dtype_ = o.dtype_;
    shape_ = std::move(o.shape_);
    numel_ = o.numel_;
    ptr_ = o.ptr_;
    o.ptr_ = nullptr;
    o.numel_ = 0;
  }
  return *this;
}

DeviceTensor DeviceTensor::upload(const Tensor& host, Stream s) {
  DeviceTensor d(host.dtype(), host.shape());
  if (d.nbytes() > 0) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(d.ptr_, host.bytes(), d.nbytes(), cudaMemcpyHostToDevice, s));
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return d;
}

Tensor DeviceTensor::download(Stream s) const {
  Tensor h(dtype_, shape_);
  if (nbytes() > 0) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(h.bytes(), ptr_, nbytes(), cudaMemcpyDeviceToHost, s));
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}

void DeviceTensor::fill_bytes(uint8_t byte, Stream s) {
  if (nbytes() > 0) MOE_CUDA_CHECK(cudaMemsetAsync(ptr_, byte, nbytes(), s));
}

ErrorFlag::ErrorFlag() {
  MOE_CUDA_CHECK(cudaMalloc(&ptr_, sizeof(DeviceErrorSlot)));
  MOE_CUDA_CHECK(cudaMemset(ptr_, 0, sizeof(DeviceErrorSlot)));
}

ErrorFlag::~ErrorFlag() {
  if (ptr_) cudaFree(ptr_);
}

void ErrorFlag::reset(Stream s) {
  MOE_CUDA_CHECK(cudaMemsetAsync(ptr_, 0, sizeof(DeviceErrorSlot), s));
}

DeviceError ErrorFlag::read(Stream s) const {
  DeviceErrorSlot slot{};
  MOE_CUDA_CHECK(cudaMemcpyAsync(&slot, ptr_, sizeof slot, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return DeviceError{slot.code, slot.a, slot.b};
}

}  // namespace moe::gpu
