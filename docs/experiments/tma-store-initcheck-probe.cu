// Does compute-sanitizer initcheck see global memory written by TMA tensor stores
// (cp.async.bulk.tensor, shared -> global), the sm90 kernels' epilogue stores? The plain bulk copy
// is not seen (bulk-initcheck-probe.cu), and neither are cuBLAS's stores
// (cublas-initcheck-probe.cu). `tma` fills a 64 x 64 fp32 matrix with one TMA store of a shared
// box, `plain` with ordinary stores; a kernel reads it and checks the sum.
//
//   nvcc -O2 -arch=sm_90a docs/experiments/tma-store-initcheck-probe.cu -o /tmp/tip
//   for c in plain tma; do
//     compute-sanitizer --tool initcheck --print-limit 1 /tmp/tip $c | grep -E "SUMMARY|sum"
//   done
//
// If `tma` reports, the gemm and block families' initcheck runs need the sm90 kernels'
// ordinary-store epilogues (MOE_SM90_ROW_STORE=sync, MOE_SM90_WGRAD_STORE=sync), as the dispatch
// has its lsu twins. Not run yet (session 47 wrote it with no device time left).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

constexpr int kN = 64;  // rows = columns = box side

__global__ void tma_write(const __grid_constant__ CUtensorMap map) {
  __shared__ alignas(128) float box[kN * kN];
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) box[i] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(box));
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(&map),
        "r"(src), "r"(0), "r"(0)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

__global__ void plain_write(float* dst) {
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) dst[i] = 1.0f;
}

__global__ void read_sum(const float* src, float* out) {
  float s = 0;
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) s += src[i];
  atomicAdd(out, s);
}

int main(int argc, char** argv) {
  const bool tma = argc > 1 && std::strcmp(argv[1], "tma") == 0;
  float *c, *sum;
  cudaMalloc(&c, kN * kN * sizeof(float));
  cudaMalloc(&sum, sizeof(float));
  cudaMemset(sum, 0, sizeof(float));
  if (tma) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
    if (q != cudaDriverEntryPointSuccess || !f) {
      std::printf("cuTensorMapEncodeTiled not available\n");
      return 2;
    }
    const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    CUtensorMap map{};
    const cuuint64_t dims[2] = {kN, kN}, strides[1] = {kN * sizeof(float)};
    const cuuint32_t box[2] = {kN, kN}, estrides[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, c, dims, strides, box,
                              estrides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      std::printf("cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
      return 2;
    }
    tma_write<<<1, 256>>>(map);
  } else {
    plain_write<<<1, 256>>>(c);
  }
  read_sum<<<1, 256>>>(c, sum);
  float h = 0;
  cudaMemcpy(&h, sum, sizeof(float), cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  std::printf("%s: sum %.0f (want %d), %s\n", tma ? "tma" : "plain", h, kN * kN,
              cudaGetErrorString(e));
  return h == kN * kN && e == cudaSuccess ? 0 : 1;
}
