// Can one cudaMemsetAsync cover two allocations that sit side by side? gpu/grouped_gemm.cu's
// initcheck prefill (MOE_CUBLAS_PREFILL=zero) first merged touching byte ranges into one memset,
// and on the H200 that failed with cudaErrorInvalidValue where two outputs were neighbours. This
// allocates pairs of small buffers (cudaMalloc, then cudaMallocAsync from the default pool), finds
// a pair whose second starts where the first ends, and memsets each alone and both at once.
//
//   nvcc -O2 docs/experiments/memset-span-probe.cu -o /tmp/msp && /tmp/msp
//
// Prints, per allocator, whether an adjacent pair was found and each memset's cudaError_t; exits 1
// if a single-buffer memset fails (the probe itself is wrong).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

int probe(const char* name, bool async, cudaStream_t s) {
  constexpr size_t kBytes = 512;
  std::vector<void*> bufs;
  void* a = nullptr;
  void* b = nullptr;
  for (int i = 0; i < 64 && !b; ++i) {
    void* p = nullptr;
    const cudaError_t e = async ? cudaMallocAsync(&p, kBytes, s) : cudaMalloc(&p, kBytes);
    if (e != cudaSuccess) {
      std::printf("%s: allocation failed: %s\n", name, cudaGetErrorString(e));
      return 1;
    }
    for (void* q : bufs) {
      if (reinterpret_cast<uintptr_t>(q) + kBytes == reinterpret_cast<uintptr_t>(p)) a = q, b = p;
    }
    bufs.push_back(p);
  }
  int rc = 0;
  if (!b) {
    std::printf("%s: no adjacent pair among %zu buffers of %zu bytes\n", name, bufs.size(), kBytes);
  } else {
    const cudaError_t ea = cudaMemsetAsync(a, 0, kBytes, s);
    const cudaError_t eb = cudaMemsetAsync(b, 0, kBytes, s);
    const cudaError_t both = cudaMemsetAsync(a, 0, 2 * kBytes, s);
    cudaGetLastError();  // clear it: the next case must not see this one's error
    std::printf("%s: adjacent pair at %p, %p; memset first: %s, second: %s, both at once: %s\n",
                name, a, b, cudaGetErrorName(ea), cudaGetErrorName(eb), cudaGetErrorName(both));
    rc = ea != cudaSuccess || eb != cudaSuccess;
  }
  cudaStreamSynchronize(s);
  for (void* p : bufs) async ? cudaFreeAsync(p, s) : cudaFree(p);
  cudaStreamSynchronize(s);
  return rc;
}

}  // namespace

int main() {
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return 1;
  int rc = probe("cudaMalloc", false, s);
  rc |= probe("cudaMallocAsync", true, s);
  return rc;
}
