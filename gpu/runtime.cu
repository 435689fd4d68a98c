#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

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

std::string context_error() noexcept {
  if (device_count() == 0) return {};
  if (cudaDeviceSynchronize() == cudaSuccess) return {};
  cudaGetLastError();  // a non-sticky error is cleared by this; a sticky one is not
  const cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) return {};
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

void check_cuda(int err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return;
  // A failed call also leaves its error as the thread's last error, which the next launch check
  // (cudaGetLastError) would report again at an unrelated site, in a later test (session 48: a
  // memset's cudaErrorInvalidValue, thrown here, came back from two launches afterwards). Clear
  // it; a sticky error fails every later call anyway.
  cudaGetLastError();
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(cudaError_t(err)) + " (" +
                           cudaGetErrorString(cudaError_t(err)) + ") in " + what + " at " + file +
                           ":" + std::to_string(line));
}

namespace {

// Freed device buffers kept for reuse: the block, the FFN and the benchmarks allocate gigabytes
// per call, and cudaMalloc/cudaFree are slow where it matters: cudaFree waits for the device and
// then unmaps (0.15-0.5 ms per call in the block's timeline on an H100, the GPU idle meanwhile),
// and cudaMalloc maps (0.06-0.18 ms). A freed buffer is kept under its exact byte size (so
// memcheck bounds stay exact) and handed to the next allocation of that size. Freeing synchronises
// the device first, as cudaFree does, so a reused buffer is never still in use by a kernel on any
// stream; without the unmapping that costs about 10-25 us of GPU idle (measured: deferring the
// synchronisation to the reuse gained nothing).
//
// Two budgets: buffers of at least kLarge bytes up to 60% of the device memory (the
// DeepSeek-like block's weight gradients alone are 22.5 GB), smaller ones up to kSmallBudget (a
// test run's many distinct small shapes must not pile up). Past a budget the cache frees its
// largest buffers down to half of it. release_buffer_cache() empties it (the benchmark does
// between cases); an allocation that runs out of memory empties it and the stream-ordered pool,
// then tries once more. Off (plain cudaMalloc/cudaFree) with MOE_GPU_NO_CACHE=1, which the
// sanitizer scripts set (initcheck only tracks fresh allocations, and the leak check must see
// real frees), or when CUDA_INJECTION64_PATH names an injected tool.
class BufferCache {
 public:
  static BufferCache& get() {
    static BufferCache* c = new BufferCache;  // never destroyed: frees may run at exit
    return *c;
  }

  static constexpr size_t kLarge = size_t{32} << 20;
  static constexpr size_t kSmallBudget = size_t{512} << 20;

  void* alloc(size_t n) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (enabled_) {
      std::lock_guard<std::mutex> lock(mu_);
      Pool& pl = pool(n);
      auto it = pl.free.find({dev, n});
      if (it != pl.free.end()) {
        void* p = it->second;
        pl.free.erase(it);
        pl.cached -= n;
        return p;
      }
    }
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, n);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: clear it and retry with every cache emptied
      release_all();
      e = cudaMalloc(&p, n);
    }
    MOE_CUDA_CHECK(e);
    return p;
  }

  void release(void* p, size_t n) noexcept {
    if (!enabled_) {
      cudaFree(p);
      return;
    }
    cudaDeviceSynchronize();  // what cudaFree would have waited for
    int dev = 0;
    cudaGetDevice(&dev);
    std::lock_guard<std::mutex> lock(mu_);
    Pool& pl = pool(n);
    pl.free.emplace(std::make_pair(dev, n), p);
    pl.cached += n;
    if (pl.cached > pl.limit) trim_locked(pl, pl.limit / 2);
  }

  // Every cache emptied, and the stream-ordered pool's unused memory (after an out-of-memory).
  void release_all() noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      trim_locked(large_, 0);
      trim_locked(small_, 0);
    }
    int dev = 0;
    cudaMemPool_t mp = nullptr;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetDefaultMemPool(&mp, dev) == cudaSuccess) {
      cudaDeviceSynchronize();
      cudaMemPoolTrimTo(mp, 0);
    }
    cudaGetLastError();
  }

 private:
  // Buffers keyed (device, bytes), and their total.
  struct Pool {
    std::multimap<std::pair<int, size_t>, void*> free;
    size_t cached = 0;
    size_t limit = 0;
  };

  BufferCache() {
    const char* off = std::getenv("MOE_GPU_NO_CACHE");
    const char* tool = std::getenv("CUDA_INJECTION64_PATH");
    enabled_ = !(off && *off && std::strcmp(off, "0") != 0) && !(tool && *tool);
    size_t free_b = 0, total = 0;
    large_.limit = size_t{8} << 30;
    if (cudaMemGetInfo(&free_b, &total) == cudaSuccess) large_.limit = total / 10 * 6;
    small_.limit = kSmallBudget;
    cudaGetLastError();
  }

  Pool& pool(size_t n) { return n >= kLarge ? large_ : small_; }

  // Frees the largest buffers of pl until at most `keep` bytes stay cached.
  void trim_locked(Pool& pl, size_t keep) noexcept {
    while (pl.cached > keep && !pl.free.empty()) {
      auto it = std::prev(pl.free.end());
      int dev = 0;
      cudaGetDevice(&dev);
      cudaSetDevice(it->first.first);
      cudaFree(it->second);
      cudaSetDevice(dev);
      pl.cached -= it->first.second;
      pl.free.erase(it);
    }
  }

  std::mutex mu_;
  Pool large_, small_;
  bool enabled_ = true;
};

// The stream-ordered pool (cudaMallocAsync: the GEMM scratch, the plans) keeps what it has
// mapped: with the default release threshold of 0 it unmapped at every synchronisation and
// mapped again at the next allocation, 1-3 ms of GPU idle per block iteration in the timeline.
// An out-of-memory empties it (BufferCache::release_all).
void keep_pool_memory() {
  static std::mutex mu;
  static std::map<int, bool> done;
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (done[dev]) return;
  cudaMemPool_t mp = nullptr;
  MOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&mp, dev));
  uint64_t threshold = UINT64_MAX;
  MOE_CUDA_CHECK(cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReleaseThreshold, &threshold));
  done[dev] = true;
}

}  // namespace

void release_buffer_cache() noexcept {
  BufferCache::get().release_all();
}

bool two_way_setting(const char* name, const char* on, const char* off) {
  const char* e = std::getenv(name);
  if (!e || !*e || std::strcmp(e, on) == 0) return true;
  if (std::strcmp(e, off) == 0) return false;
  throw std::invalid_argument(std::string(name) + ": expected " + on + " or " + off + ", got '" +
                              e + "'");
}

void* malloc_async(size_t bytes, Stream s) {
  keep_pool_memory();
  void* p = nullptr;
  if (cudaMallocAsync(&p, bytes, s) == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky
    release_buffer_cache();
    MOE_CUDA_CHECK(cudaMallocAsync(&p, bytes, s));
  }
  MOE_CUDA_CHECK(cudaGetLastError());
  return p;
}

DeviceTensor::DeviceTensor(DType dt, Shape shape) : dtype_(dt), shape_(std::move(shape)) {
  numel_ = shape_numel(shape_);
  if (nbytes() > 0) ptr_ = BufferCache::get().alloc(nbytes());
}

DeviceTensor::~DeviceTensor() {
  if (ptr_) BufferCache::get().release(ptr_, nbytes());
}

DeviceTensor::DeviceTensor(DeviceTensor&& o) noexcept
    : dtype_(o.dtype_), shape_(std::move(o.shape_)), numel_(o.numel_), ptr_(o.ptr_) {
  o.ptr_ = nullptr;
  o.numel_ = 0;
}

DeviceTensor& DeviceTensor::operator=(DeviceTensor&& o) noexcept {
  if (this != &o) {
    if (ptr_) BufferCache::get().release(ptr_, nbytes());
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

void require_tensor(const DeviceTensor& t, DType d, const Shape& shape, const char* what) {
  require_shape(t.meta(), shape, what);
  if (t.dtype() != d) {
    throw std::invalid_argument(std::string(what) + ": dtype " +
                                std::string(dtype_name(t.dtype())) + ", expected " +
                                std::string(dtype_name(d)));
  }
}

}  // namespace moe::gpu
