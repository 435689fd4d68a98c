// Session 45 probe (docs/perf.md): how fast 1.70 GB of zeros in 58 runs of 29 MB (the
// DeepSeek-like block's empty experts' gradients) are written by cudaMemsetAsync, by a kernel of
// 16-byte stores in 64 KiB chunks or in contiguous slices per CTA, with plain or streaming (.cs)
// stores; then whether a memset, a device-to-device copy or that kernel, issued on a second stream,
// runs beside a kernel that holds every SM's thread slots (if any ran on a copy engine it would
// end before the spin does).
//   nvcc -O3 -arch=sm_90a docs/experiments/zero-fill-probe.cu -o /tmp/zp && /tmp/zp
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>
#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      return 1;                                      \
    }                                                \
  } while (0)
constexpr long long kRun = 2048LL * 7168 * 2;  // 29.36 MB, one expert's gradient
constexpr int kRuns = 58;
__global__ void chunks(uint4* base, long long run_words, long long stride_words, int runs, int cs) {
  const long long chunk = 4096, per_run = (run_words + chunk - 1) / chunk, total = per_run * runs;
  for (long long c = blockIdx.x; c < total; c += gridDim.x) {
    const long long r = c / per_run, w0 = (c % per_run) * chunk, w1 = min(w0 + chunk, run_words);
    uint4* p = base + r * stride_words;
    for (long long i = w0 + threadIdx.x; i < w1; i += blockDim.x) {
      if (cs)
        __stcs(p + i, make_uint4(0, 0, 0, 0));
      else
        p[i] = make_uint4(0, 0, 0, 0);
    }
  }
}
// CTA b writes its own contiguous slice of the runs' words (flattened).
__global__ void contig(uint4* base, long long run_words, long long stride_words, int runs, int cs) {
  const long long total = run_words * runs;
  const long long a = total * blockIdx.x / gridDim.x, b = total * (blockIdx.x + 1) / gridDim.x;
  for (long long i = a + threadIdx.x; i < b; i += blockDim.x) {
    uint4* p = base + (i / run_words) * stride_words + i % run_words;
    if (cs)
      __stcs(p, make_uint4(0, 0, 0, 0));
    else
      *p = make_uint4(0, 0, 0, 0);
  }
}
// One block per SM holding all of its shared memory, spinning ~ms: nothing else fits beside it.
__global__ void spin(long long cycles, int* sink) {
  extern __shared__ int smem[];
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  if (threadIdx.x == 0) {
    smem[0] = 1;
    sink[blockIdx.x] = smem[0];
  }
}
int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char* buf = nullptr;
  const long long stride = 2 * kRun;  // empty groups every other one
  CK(cudaMalloc(&buf, stride * kRuns));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const double bytes = double(kRun) * kRuns;
  auto time = [&](const char* name, auto&& f) {
    for (int w = 0; w < 2; ++w) f();
    std::vector<float> ms;
    for (int r = 0; r < 10; ++r) {
      cudaEventRecord(e0);
      f();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float m = 0;
      cudaEventElapsedTime(&m, e0, e1);
      ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    printf("%-44s median %8.1f us  %6.0f GB/s (min %8.1f us)  err=%s\n", name, ms[5] * 1e3,
           bytes / (ms[5] * 1e-3) / 1e9, ms[0] * 1e3, cudaGetErrorString(cudaGetLastError()));
  };
  const long long rw = kRun / 16, sw = stride / 16;
  time("memset, one contiguous 1.70 GB", [&] { cudaMemsetAsync(buf, 0, kRun * kRuns); });
  time("memset, 58 runs of 29 MB (every other)", [&] {
    for (int r = 0; r < kRuns; ++r) cudaMemsetAsync(buf + r * stride, 0, kRun);
  });
  for (int cs = 0; cs < 2; ++cs) {
    for (int per : {4, 8, 16}) {
      char name[96];
      snprintf(name, sizeof name, "chunks 64K, %d x SMs x 256%s", per, cs ? ", st.cs" : "");
      time(name, [&] { chunks<<<sms * per, 256>>>((uint4*)buf, rw, sw, kRuns, cs); });
    }
    for (int per : {1, 2, 4}) {
      char name[96];
      snprintf(name, sizeof name, "contiguous slices, %d x SMs x 1024%s", per, cs ? ", st.cs" : "");
      time(name, [&] { contig<<<sms * per, 1024>>>((uint4*)buf, rw, sw, kRuns, cs); });
    }
  }
  time("chunks 64K, 8 x SMs, runs contiguous",
       [&] { chunks<<<sms * 8, 256>>>((uint4*)buf, rw, rw, kRuns, 0); });
  time("memcpy DtoD 0.85 GB (read+write 1.70 GB)", [&] {
    cudaMemcpyAsync(buf + kRun * kRuns, buf, kRun * kRuns / 2, cudaMemcpyDeviceToDevice);
  });
  // Does a memset / D2D copy on another stream run beside a kernel that fills every SM?
  {
    cudaStream_t a, b;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    int* sink = nullptr;
    CK(cudaMalloc(&sink, 4096));
    const int smem = 100 * 1024;
    CK(cudaFuncSetAttribute(spin, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaEvent_t s0, s1, m0, m1;
    cudaEventCreate(&s0);
    cudaEventCreate(&s1);
    cudaEventCreate(&m0);
    cudaEventCreate(&m1);
    for (int kind = 0; kind < 3; ++kind) {
      for (int rep = 0; rep < 2; ++rep) {
        cudaDeviceSynchronize();
        cudaEventRecord(s0, a);
        spin<<<2 * sms, 1024, smem, a>>>(1980LL * 1000 * 5, sink);  // ~5 ms at 1.98 GHz
        cudaEventRecord(s1, a);
        cudaEventRecord(m0, b);
        if (kind == 0)
          cudaMemsetAsync(buf, 0, kRun * kRuns, b);
        else if (kind == 1)
          cudaMemcpyAsync(buf + kRun * kRuns, buf, kRun * kRuns / 2, cudaMemcpyDeviceToDevice, b);
        else
          chunks<<<sms * 8, 256, 0, b>>>((uint4*)buf, rw, sw, kRuns, 0);
        cudaEventRecord(m1, b);
        cudaDeviceSynchronize();
        float spin_ms = 0, m_ms = 0, start_gap = 0;
        cudaEventElapsedTime(&spin_ms, s0, s1);
        cudaEventElapsedTime(&m_ms, m0, m1);
        cudaEventElapsedTime(&start_gap, s0, m0);
        float m_end = 0;
        cudaEventElapsedTime(&m_end, s0, m1);
        printf(
            "beside a full-SM kernel (%.2f ms): %-22s took %.2f ms, ended %.2f ms after the spin "
            "began  err=%s\n",
            spin_ms,
            kind == 0   ? "memset 1.70 GB"
            : kind == 1 ? "memcpy DtoD 0.85 GB"
                        : "zero kernel 1.70 GB",
            m_ms, m_end, cudaGetErrorString(cudaGetLastError()));
      }
    }
  }
  return 0;
}
