// What a memory-bound kernel can reach on this GPU: 1 GiB moved by the driver's memcpy (launched
// and captured in a graph), by copy kernels of several shapes (grid-stride vectors, one contiguous
// slab a CTA, bulk copies through shared memory), by reads alone and by writes alone, each timed
// like bench's copy bandwidth (one event pair a launch, median of 30). docs/perf.md, session 32,
// has an H100's figures. `ce` instead asks whether the driver's memcpy needs the SMs: it times
// one behind a kernel that fills every SM for ~40 ms on another stream.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90a scripts/memory_ceilings.cu -o /tmp/memory_ceilings
// Use:   /tmp/memory_ceilings [ce]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      std::printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

__global__ void copy16(const int4* __restrict__ src, int4* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

__device__ __forceinline__ int4 ld_na(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void st_cs(int4* p, int4 v) {
  asm volatile("st.global.cs.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// 8 vectors a thread in flight; kind 0 plain stores, 1 .cs stores. Block-contiguous: block b
// walks tiles of blockDim * 8 vectors, tile b, b + grid, ...
template <int kKind>
__global__ void copy8(const int4* __restrict__ src, int4* __restrict__ dst, int64_t n) {
  const int64_t tile = static_cast<int64_t>(blockDim.x) * 8;
  for (int64_t base = blockIdx.x * tile; base < n; base += static_cast<int64_t>(gridDim.x) * tile) {
    int4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = base + k * blockDim.x + threadIdx.x;
      if (i < n) v[k] = ld_na(src + i);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = base + k * blockDim.x + threadIdx.x;
      if (i < n) {
        if (kKind == 1) {
          st_cs(dst + i, v[k]);
        } else {
          dst[i] = v[k];
        }
      }
    }
  }
}

// Each CTA copies one contiguous slab of n / grid vectors, 8 a thread in flight, .cs stores.
__global__ void copy8_slab(const int4* __restrict__ src, int4* __restrict__ dst, int64_t n) {
  const int64_t per = (n + gridDim.x - 1) / gridDim.x;
  const int64_t beg = blockIdx.x * per, end = min(n, beg + per);
  const int64_t tile = static_cast<int64_t>(blockDim.x) * 8;
  for (int64_t base = beg; base < end; base += tile) {
    int4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = base + k * blockDim.x + threadIdx.x;
      if (i < end) v[k] = ld_na(src + i);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = base + k * blockDim.x + threadIdx.x;
      if (i < end) st_cs(dst + i, v[k]);
    }
  }
}

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void read8(const int4* __restrict__ src, int64_t n, int* sink) {
  const int64_t tile = static_cast<int64_t>(blockDim.x) * 8;
  int acc = 0;
  for (int64_t base = blockIdx.x * tile; base < n; base += static_cast<int64_t>(gridDim.x) * tile) {
    int4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = base + k * blockDim.x + threadIdx.x;
      v[k] = i < n ? ld_na(src + i) : int4{0, 0, 0, 0};
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x12345678) sink[0] = acc;
}

__global__ void write8(int4* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = int4{1, 2, 3, 4};
}

// Bulk copies: one thread a CTA, kS stages of kChunk bytes: g2s on an mbarrier, s2g as a bulk
// group.
constexpr int kS = 6, kChunk = 32 * 1024;
__device__ __forceinline__ uint32_t sa(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__global__ void copy_bulk(const uint8_t* src, uint8_t* dst, int64_t bytes, bool slab) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ uint64_t full[kS];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kS; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int64_t chunks = bytes / kChunk;  // bytes a multiple of kChunk here
  const int64_t G = slab ? 1 : gridDim.x;
  const int64_t per = (chunks + gridDim.x - 1) / gridDim.x;
  const int64_t first = slab ? blockIdx.x * per : blockIdx.x;
  // This CTA's chunks: first + j * G, j = 0, 1, ...
  const int64_t mine = slab ? max(int64_t{0}, min(chunks, first + per) - first)
                            : (chunks > blockIdx.x ? (chunks - blockIdx.x + G - 1) / G : 0);
  auto load = [&](int64_t j) {
    const int s = static_cast<int>(j % kS);
    const int64_t c = first + j * G;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[s])),
                 "r"(kChunk)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(sa(sm + s * kChunk)),
        "l"(src + c * kChunk), "r"(kChunk), "r"(sa(&full[s]))
        : "memory");
  };
  for (int64_t j = 0; j < kS && j < mine; ++j) load(j);
  for (int64_t j = 0; j < mine; ++j) {
    const int s = static_cast<int>(j % kS);
    const uint32_t parity = static_cast<uint32_t>((j / kS) & 1);
    uint32_t done = 0;
    do {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          "selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(sa(&full[s])), "r"(parity)
          : "memory");
    } while (!done);
    const int64_t c = first + j * G;
    asm volatile(
        "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * kChunk),
        "r"(sa(sm + s * kChunk)), "r"(kChunk)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Store j - 2 has read its stage: load j - 2 + kS into it.
    asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory");
    if (j >= 2 && j - 2 + kS < mine) load(j - 2 + kS);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

static double time_one(const std::function<void()>& f, int reps = 30) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t bytes = size_t{1} << 30;
  const int64_t n = bytes / 16;
  void *src, *dst;
  int* sink;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(src, 0x5a, bytes));
  CK(cudaMemset(dst, 0, bytes));
  if (argc > 1 && std::string(argv[1]) == "ce") {
    // Does the driver's D2D memcpy need the SMs? Fill every SM with spinning CTAs (~40 ms) on one
    // stream, then time a memcpy on another.
    cudaStream_t a, b;
    CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, e2;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e2));
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b));
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < 3; ++r) {
      CK(cudaEventRecord(e0, a));
      spin<<<sms * 32, 64, 0, a>>>(80000000LL);  // 32 CTAs an SM, ~40 ms at 2 GHz
      CK(cudaEventRecord(e1, b));
      CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b));
      CK(cudaEventRecord(e2, b));
      CK(cudaDeviceSynchronize());
      float spin_ms = 0, copy_ms = 0;
      CK(cudaEventElapsedTime(&copy_ms, e1, e2));
      CK(cudaEventElapsedTime(&spin_ms, e0, e2));
      std::printf(
          "memcpy while SMs spin: memcpy %.3f ms (%.1f GB/s); spin start to memcpy end %.3f ms\n",
          copy_ms, 2.0 * bytes / (copy_ms * 1e-3) / 1e9, spin_ms);
      copy16<<<sms * 4, 512, 0, b>>>((const int4*)src, (int4*)dst, n);
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(e0, a));
      spin<<<sms * 32, 64, 0, a>>>(80000000LL);
      CK(cudaEventRecord(e1, b));
      copy16<<<sms * 4, 512, 0, b>>>((const int4*)src, (int4*)dst, n);
      CK(cudaEventRecord(e2, b));
      CK(cudaDeviceSynchronize());
      CK(cudaEventElapsedTime(&copy_ms, e1, e2));
      std::printf("copy16 while SMs spin: %.3f ms from its record to its end\n", copy_ms);
    }
    return 0;
  }
  auto rep = [&](const char* name, double moved, double ms) {
    std::printf("%-44s %8.3f ms  %7.1f GB/s\n", name, ms, moved / (ms * 1e-3) / 1e9);
  };
  const double two = 2.0 * bytes;
  for (int round = 0; round < 2; ++round) {
    std::printf("round %d (%d SMs)\n", round, sms);
    rep("cudaMemcpyAsync D2D 1 GiB", two,
        time_one([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }));
    {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      rep("memcpy in a graph", two, time_one([&] {
            CK(cudaGraphLaunch(ge, s));
            CK(cudaStreamSynchronize(s));
          }));
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      CK(cudaStreamDestroy(s));
    }
    rep("copy16 (bench's before session 32), 4 x SMs x 512", two,
        time_one([&] { copy16<<<sms * 4, 512>>>((const int4*)src, (int4*)dst, n); }));
    for (int per : {1, 2, 4}) {
      char name[96];
      std::snprintf(name, sizeof name, "copy8 plain, %d x SMs x 512", per);
      rep(name, two,
          time_one([&] { copy8<0><<<sms * per, 512>>>((const int4*)src, (int4*)dst, n); }));
      std::snprintf(name, sizeof name, "copy8 .cs stores, %d x SMs x 512", per);
      rep(name, two,
          time_one([&] { copy8<1><<<sms * per, 512>>>((const int4*)src, (int4*)dst, n); }));
    }
    CK(cudaFuncSetAttribute(copy_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, kS * kChunk));
    rep("copy_bulk 6 x 32 KiB, 1 CTA an SM", two, time_one([&] {
          copy_bulk<<<sms, 32, kS * kChunk>>>((const uint8_t*)src, (uint8_t*)dst, (int64_t)bytes,
                                              false);
        }));
    rep("copy_bulk 6 x 32 KiB, slabs", two, time_one([&] {
          copy_bulk<<<sms, 32, kS * kChunk>>>((const uint8_t*)src, (uint8_t*)dst, (int64_t)bytes,
                                              true);
        }));
    for (int per : {1, 2, 4}) {
      for (int thr : {512, 1024}) {
        char name[96];
        std::snprintf(name, sizeof name, "copy8_slab .cs, %d x SMs x %d", per, thr);
        rep(name, two,
            time_one([&] { copy8_slab<<<sms * per, thr>>>((const int4*)src, (int4*)dst, n); }));
      }
    }
    rep("read8 (read only, 1 GiB)", bytes,
        time_one([&] { read8<<<sms * 2, 512>>>((const int4*)src, n, sink); }));
    rep("read8 (read only, 1 GiB), 4 x SMs", bytes,
        time_one([&] { read8<<<sms * 4, 512>>>((const int4*)src, n, sink); }));
    rep("write8 (write only, 1 GiB)", bytes,
        time_one([&] { write8<<<sms * 4, 512>>>((int4*)dst, n); }));
    rep("cudaMemsetAsync 1 GiB", bytes, time_one([&] { CK(cudaMemsetAsync(dst, 1, bytes)); }));
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  // The bulk copy (slabs) must have produced the source: check the last MiB.
  copy_bulk<<<sms, 32, kS * kChunk>>>((const uint8_t*)src, (uint8_t*)dst, (int64_t)bytes, true);
  CK(cudaDeviceSynchronize());
  std::vector<unsigned char> h(1 << 20);
  CK(cudaMemcpy(h.data(), (uint8_t*)dst + bytes - h.size(), h.size(), cudaMemcpyDeviceToHost));
  bool ok = std::all_of(h.begin(), h.end(), [](unsigned char c) { return c == 0x5a; });
  std::printf("copy_bulk tail check: %s\n", ok ? "ok" : "WRONG");
  return 0;
}
