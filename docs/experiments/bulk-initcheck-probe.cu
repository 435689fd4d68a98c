// Does compute-sanitizer initcheck see global memory written by cp.async.bulk (shared -> global)?
// bulk_write fills a with a bulk copy, plain_write fills b with ordinary stores; read_sum reads
// each. Session 46, H200, CUDA 13 compute-sanitizer: both sums right (523776), and initcheck
// reported 1016 "Uninitialized __global__ memory read" in read_sum (fewer than a's 1024 elements;
// the 100 printed all in a): the tool does not track bulk-copy stores. Hence
// scripts/gpu_sanitize.sh runs the dispatch and combine forwards' ordinary-store twins under
// initcheck (MOE_DISPATCH_ROWS=lsu, MOE_GATHER_SUM=lsu).
//
//   nvcc -O2 -arch=sm_90a docs/experiments/bulk-initcheck-probe.cu -o /tmp/bip
//   compute-sanitizer --tool initcheck /tmp/bip
#include <cstdio>

__global__ void bulk_write(float* dst, int n) {
  __shared__ alignas(128) float buf[1024];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = static_cast<float>(i);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(static_cast<unsigned>(__cvta_generic_to_shared(buf))), "r"(n * 4)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

__global__ void plain_write(float* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = static_cast<float>(i);
}

__global__ void read_sum(const float* src, float* out, int n) {
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += src[i];
  atomicAdd(out, s);
}

int main() {
  const int n = 1024;
  float *a, *b, *sa, *sb;
  cudaMalloc(&a, n * 4);
  cudaMalloc(&b, n * 4);
  cudaMalloc(&sa, 4);
  cudaMalloc(&sb, 4);
  cudaMemset(sa, 0, 4);
  cudaMemset(sb, 0, 4);
  bulk_write<<<1, 256>>>(a, n);
  plain_write<<<1, 256>>>(b, n);
  read_sum<<<1, 256>>>(a, sa, n);
  read_sum<<<1, 256>>>(b, sb, n);
  float ha = 0, hb = 0;
  cudaMemcpy(&ha, sa, 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(&hb, sb, 4, cudaMemcpyDeviceToHost);
  std::printf("bulk-written sum %.0f, plain-written sum %.0f (both %d expected): %s\n", ha, hb,
              n * (n - 1) / 2, cudaGetErrorString(cudaGetLastError()));
  return ha == hb && hb == n * (n - 1) / 2 ? 0 : 1;
}
