// Does compute-sanitizer initcheck see global memory written by cuBLAS, and does an NVTX
// "mark initialized" make up for it? Each case multiplies bf16 operands (all ones) into a fresh
// (never written) fp32 C with cuBLAS, optionally marks C as initialised, then a kernel reads all
// of C and checks the sum. Every element of C is an output of the product, so any report is one
// the tool should not make. Cases: plain (C filled by a kernel: the control), gemm
// (cublasGemmEx, m=256 n=128 k=64), batched (cublasGemmBatchedEx, 8 of those), and with
// _marked: C marked on the legacy default stream; _stream: everything on a created non-blocking
// stream (C marked on it); _async: C from cudaMallocAsync, as the library's scratch and fp32
// accumulators are.
//
//   nvcc -O2 -arch=sm_90a docs/experiments/cublas-initcheck-probe.cu -lcublas -ldl -o /tmp/cip
//   for c in plain gemm batched gemm_marked batched_marked gemm_marked_stream \
//            gemm_marked_async gemm_marked_stream_async; do
//     compute-sanitizer --tool initcheck --print-limit 1 /tmp/cip $c | grep -E "SUMMARY|sum"
//   done
//
// Session 47, H200, CUDA 13 compute-sanitizer (the first five cases): plain 0 errors; gemm 32768
// and batched 262144 errors, one per element of C; gemm_marked and batched_marked 0; all sums
// right. So initcheck does not track cuBLAS's stores, and a mark on the default stream over
// cudaMalloc memory silences exactly those reads. docs/experiments/initcheck-marks.patch puts such
// marks after every cuBLAS call of gpu/grouped_gemm.cu, yet the gemm family under initcheck still
// gave 810,490 reports, as many as without it: the library's accumulators come from
// cudaMallocAsync, and many of its products run on created (forked) streams. The last three cases
// tell which (not run yet); the probe also prints whether NVTX found a tool (a non-null domain).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

__global__ void read_sum(const float* src, float* out, long n) {
  float s = 0;
  for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    s += src[i];
  atomicAdd(out, s);
}

__global__ void fill_bf16(__nv_bfloat16* p, long n) {
  for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(1.0f);
}

__global__ void fill_f32(float* p, long n, float v) {
  for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    p[i] = v;
}

static nvtxDomainHandle_t domain() {
  static nvtxDomainHandle_t d = nvtxDomainCreateA("cublas-initcheck-probe");
  return d;
}

static void mark(void* p, size_t bytes, cudaStream_t s) {
  nvtxMemVirtualRangeDesc_t r{};
  r.size = bytes;
  r.ptr = p;
  nvtxMemMarkInitializedBatch_t b{};
  b.extCompatID = NVTX_EXT_COMPATID_MEM;
  b.structSize = sizeof(b);
  b.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  b.regionDescCount = 1;
  b.regionDescElementSize = sizeof(r);
  b.regionDescElements = &r;
  nvtxMemCudaMarkInitialized(domain(), s, 0, &b);
}

int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "gemm";
  const bool batched = std::strncmp(what, "batched", 7) == 0;
  const bool marked = std::strstr(what, "_marked") != nullptr;
  const bool plain = std::strcmp(what, "plain") == 0;
  const bool on_stream = std::strstr(what, "_stream") != nullptr;
  const bool async = std::strstr(what, "_async") != nullptr;
  const int m = 256, n = 128, k = 64, batch = batched ? 8 : 1;
  const long na = long{k} * m * batch, nb = long{k} * n * batch, nc = long{m} * n * batch;
  cudaFree(nullptr);  // NVTX needs the runtime up
  const char* inj = std::getenv("NVTX_INJECTION64_PATH");
  std::printf("NVTX_INJECTION64_PATH=%s, domain %s\n", inj ? inj : "(unset)",
              domain() ? "non-null (a tool is attached)" : "null");
  cudaStream_t st0 = nullptr;
  if (on_stream) cudaStreamCreateWithFlags(&st0, cudaStreamNonBlocking);
  __nv_bfloat16 *a, *b;
  float *c, *sum;
  cudaMalloc(&a, na * 2);
  cudaMalloc(&b, nb * 2);
  if (async) {
    cudaMallocAsync(reinterpret_cast<void**>(&c), nc * 4, st0);
  } else {
    cudaMalloc(&c, nc * 4);
  }
  cudaMalloc(&sum, 4);
  cudaMemset(sum, 0, 4);
  cudaDeviceSynchronize();  // st0 does not wait for the legacy stream
  fill_bf16<<<64, 256, 0, st0>>>(a, na);
  fill_bf16<<<64, 256, 0, st0>>>(b, nb);
  cublasHandle_t h;
  cublasCreate(&h);
  cublasSetStream(h, st0);
  const float alpha = 1, beta = 0;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  if (plain) {
    fill_f32<<<64, 256, 0, st0>>>(c, nc, static_cast<float>(k));
  } else if (!batched) {
    // Column-major C [m, n] = A^T B, A [k, m], B [k, n].
    st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a, CUDA_R_16BF, k, b,
                      CUDA_R_16BF, k, &beta, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
  } else {
    std::vector<const void*> ptrs(3 * batch);
    for (int i = 0; i < batch; ++i) {
      ptrs[i] = a + long{i} * k * m;
      ptrs[batch + i] = b + long{i} * k * n;
      ptrs[2 * batch + i] = c + long{i} * m * n;
    }
    void** dp;
    cudaMalloc(&dp, ptrs.size() * sizeof(void*));
    cudaMemcpy(dp, ptrs.data(), ptrs.size() * sizeof(void*),
               cudaMemcpyHostToDevice);  // synchronous
    st = cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, dp, CUDA_R_16BF, k,
                             dp + batch, CUDA_R_16BF, k, &beta, dp + 2 * batch, CUDA_R_32F, m,
                             batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  if (marked) mark(c, nc * 4, st0);
  read_sum<<<64, 256, 0, st0>>>(c, sum, nc);
  float h_sum = 0;
  cudaStreamSynchronize(st0);
  cudaMemcpy(&h_sum, sum, 4, cudaMemcpyDeviceToHost);
  const double want = static_cast<double>(nc) * k;
  const bool ok = st == CUBLAS_STATUS_SUCCESS && h_sum == static_cast<float>(want);
  std::printf("%s: sum %.0f (want %.0f) %s\n", what, h_sum, want, ok ? "ok" : "WRONG");
  cublasDestroy(h);
  return ok ? 0 : 1;
}
