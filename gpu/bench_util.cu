#include "gpu/bench_util.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace moe::gpu {

namespace {

// RAII pair of events.
struct Events {
  cudaEvent_t a = nullptr, b = nullptr;
  Events() {
    MOE_CUDA_CHECK(cudaEventCreate(&a));
    MOE_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Events() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
};

TimingStats stats_of(std::vector<double> per_launch_ms, int per_sample) {
  TimingStats t;
  t.samples = static_cast<int>(per_launch_ms.size());
  t.per_sample = per_sample;
  if (per_launch_ms.empty()) return t;
  std::sort(per_launch_ms.begin(), per_launch_ms.end());
  const size_t n = per_launch_ms.size();
  t.median_ms =
      n % 2 ? per_launch_ms[n / 2] : 0.5 * (per_launch_ms[n / 2 - 1] + per_launch_ms[n / 2]);
  t.min_ms = per_launch_ms.front();
  t.max_ms = per_launch_ms.back();
  return t;
}

}  // namespace

TimingStats time_launches(const std::function<void(int)>& launch, int warmup, int samples,
                          int per_sample, Stream s) {
  auto st = reinterpret_cast<cudaStream_t>(s);
  int i = 0;
  for (int w = 0; w < warmup; ++w) launch(i++);
  MOE_CUDA_CHECK(cudaGetLastError());
  MOE_CUDA_CHECK(cudaStreamSynchronize(st));
  Events ev;
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(samples));
  for (int k = 0; k < samples; ++k) {
    MOE_CUDA_CHECK(cudaEventRecord(ev.a, st));
    for (int j = 0; j < per_sample; ++j) launch(i++);
    MOE_CUDA_CHECK(cudaEventRecord(ev.b, st));
    MOE_CUDA_CHECK(cudaEventSynchronize(ev.b));
    MOE_CUDA_CHECK(cudaGetLastError());
    float e = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&e, ev.a, ev.b));
    ms.push_back(static_cast<double>(e) / per_sample);
  }
  return stats_of(std::move(ms), per_sample);
}

Stream bench_stream() {
  static cudaStream_t st = [] {
    cudaStream_t x = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    return x;
  }();
  return reinterpret_cast<Stream>(st);
}

namespace {

// Captures per_sample launches (starting at launch index i0) into an executable graph; null when
// the capture fails or holds nothing (a launch went to another stream).
cudaGraphExec_t capture(const std::function<void(int)>& launch, int i0, int per_sample,
                        cudaStream_t st) {
  cudaGraph_t graph = nullptr;
  if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  bool threw = false;
  try {
    for (int j = 0; j < per_sample; ++j) launch(i0 + j);
  } catch (...) {
    threw = true;
  }
  const cudaError_t end = cudaStreamEndCapture(st, &graph);
  cudaGetLastError();  // a failed capture leaves a sticky-free error here; clear it
  if (threw || end != cudaSuccess || graph == nullptr) {
    if (graph) cudaGraphDestroy(graph);
    return nullptr;
  }
  size_t nodes = 0;
  cudaGraphGetNodes(graph, nullptr, &nodes);
  cudaGraphExec_t exec = nullptr;
  if (nodes == 0 || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    cudaGetLastError();
    exec = nullptr;
  }
  cudaGraphDestroy(graph);
  return exec;
}

}  // namespace

TimingStats time_launches_auto(const std::function<void(int)>& launch, int samples,
                               double min_sample_ms, int max_per_sample) {
  const Stream s = bench_stream();
  auto st = reinterpret_cast<cudaStream_t>(s);
  // Calibrate with direct launches: warm up, then time 5 launches to size the samples.
  const TimingStats cal = time_launches(launch, 3, 3, 5, s);
  const double per = std::max(cal.median_ms, 1e-4);
  const int per_sample =
      std::clamp(static_cast<int>(std::ceil(min_sample_ms / per)), 1, max_per_sample);
  samples = std::max(samples, 20);
  cudaGraphExec_t exec = capture(launch, 0, per_sample, st);
  if (exec == nullptr) return time_launches(launch, 2, samples, per_sample, s);
  TimingStats t;
  try {
    Events ev;
    std::vector<double> ms;
    for (int w = 0; w < 2; ++w) MOE_CUDA_CHECK(cudaGraphLaunch(exec, st));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    for (int k = 0; k < samples; ++k) {
      MOE_CUDA_CHECK(cudaEventRecord(ev.a, st));
      MOE_CUDA_CHECK(cudaGraphLaunch(exec, st));
      MOE_CUDA_CHECK(cudaEventRecord(ev.b, st));
      MOE_CUDA_CHECK(cudaEventSynchronize(ev.b));
      float e = 0;
      MOE_CUDA_CHECK(cudaEventElapsedTime(&e, ev.a, ev.b));
      ms.push_back(static_cast<double>(e) / per_sample);
    }
    t = stats_of(std::move(ms), per_sample);
    t.graph = true;
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return t;
}

CopyBandwidth measure_copy_bandwidth(size_t bytes, int samples, Stream s) {
  auto st = reinterpret_cast<cudaStream_t>(s);
  void *src = nullptr, *dst = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&src, bytes));
  MOE_CUDA_CHECK(cudaMalloc(&dst, bytes));
  CopyBandwidth r;
  try {
    MOE_CUDA_CHECK(cudaMemsetAsync(src, 0x5a, bytes, st));
    r.bytes = static_cast<double>(bytes);
    r.t = time_launches(
        [&](int) {
          MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
        },
        3, std::max(samples, 20), 1, s);
    r.gbps = 2.0 * r.bytes / (r.t.median_ms * 1e-3) / 1e9;
  } catch (...) {
    cudaFree(src);
    cudaFree(dst);
    throw;
  }
  MOE_CUDA_CHECK(cudaFree(src));
  MOE_CUDA_CHECK(cudaFree(dst));
  return r;
}

size_t l2_cache_bytes() {
  int dev = 0, l2 = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  return static_cast<size_t>(l2);
}

int rotation_sets(double bytes_per_set, int max_sets) {
  if (bytes_per_set <= 0) return 1;
  size_t free_b = 0, total_b = 0;
  MOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double want = std::ceil(3.0 * static_cast<double>(l2_cache_bytes()) / bytes_per_set);
  const double fit = std::floor(0.25 * static_cast<double>(free_b) / bytes_per_set);
  return static_cast<int>(std::clamp(std::min(want, fit), 1.0, static_cast<double>(max_sets)));
}

void device_synchronize() {
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace moe::gpu
