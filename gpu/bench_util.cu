#include "gpu/bench_util.cuh"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/bulk_copy.cuh"
#include "gpu/grouped_gemm.cuh"

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

// Makes st wait for the work enqueued so far on the legacy default stream (a non-blocking stream
// does not), so events on st bracket launches that went there too. No-op when st is itself null.
struct LegacyJoin {
  cudaEvent_t e = nullptr;
  LegacyJoin() { MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~LegacyJoin() { cudaEventDestroy(e); }
  LegacyJoin(const LegacyJoin&) = delete;
  LegacyJoin& operator=(const LegacyJoin&) = delete;
  void operator()(cudaStream_t st) const {
    if (st == nullptr) return;
    MOE_CUDA_CHECK(cudaEventRecord(e, cudaStreamLegacy));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(st, e, 0));
  }
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

double g_sustain_ms = 0;

// step() enqueues untimed work on st; repeated (synchronised every 4) until sustain_ms() of wall
// time has passed. At least one step when the warm-up is on.
void sustain(const std::function<void()>& step, cudaStream_t st) {
  if (g_sustain_ms <= 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  do {
    for (int j = 0; j < 4; ++j) step();
    MOE_CUDA_CHECK(cudaGetLastError());
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
  } while (
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() <
      g_sustain_ms);
}

}  // namespace

void set_sustain_ms(double ms) {
  if (!(ms >= 0) || ms > 600000)
    throw std::invalid_argument("sustain_ms: expected 0 .. 600000, got " + std::to_string(ms));
  g_sustain_ms = ms;
}

double sustain_ms() {
  return g_sustain_ms;
}

namespace {
// time_launches, with the sustained warm-up or (time_launches_auto's calibration) without.
TimingStats timed_series(const std::function<void(int)>& launch, int warmup, int samples,
                         int per_sample, Stream s, bool sustained) {
  auto st = reinterpret_cast<cudaStream_t>(s);
  int i = 0;
  for (int w = 0; w < warmup; ++w) launch(i++);
  MOE_CUDA_CHECK(cudaGetLastError());
  MOE_CUDA_CHECK(cudaStreamSynchronize(st));
  if (sustained) sustain([&] { launch(i++); }, st);
  Events ev;
  const LegacyJoin join;
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(samples));
  for (int k = 0; k < samples; ++k) {
    join(st);
    MOE_CUDA_CHECK(cudaEventRecord(ev.a, st));
    for (int j = 0; j < per_sample; ++j) launch(i++);
    join(st);
    MOE_CUDA_CHECK(cudaEventRecord(ev.b, st));
    MOE_CUDA_CHECK(cudaEventSynchronize(ev.b));
    MOE_CUDA_CHECK(cudaGetLastError());
    float e = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&e, ev.a, ev.b));
    ms.push_back(static_cast<double>(e) / per_sample);
  }
  return stats_of(std::move(ms), per_sample);
}
}  // namespace

TimingStats time_launches(const std::function<void(int)>& launch, int warmup, int samples,
                          int per_sample, Stream s) {
  return timed_series(launch, warmup, samples, per_sample, s, true);
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
                               double min_sample_ms, int max_per_sample, bool allow_graph) {
  const Stream s = bench_stream();
  auto st = reinterpret_cast<cudaStream_t>(s);
  // Calibrate with direct launches: warm up, time one launch, and where that is shorter than a
  // sample, 3 x 5 more to size the samples (a launch of milliseconds needs no more).
  // (The calibration runs without the sustained warm-up: the samples below get it.)
  const TimingStats one = timed_series(launch, 2, 1, 1, s, false);
  const double per =
      std::max(one.median_ms >= min_sample_ms ? one.median_ms
                                              : timed_series(launch, 1, 3, 5, s, false).median_ms,
               1e-4);
  const int per_sample =
      std::clamp(static_cast<int>(std::ceil(min_sample_ms / per)), 1, max_per_sample);
  samples = std::max(samples, 20);
  cudaGraphExec_t exec = allow_graph ? capture(launch, 0, per_sample, st) : nullptr;
  if (exec == nullptr) return time_launches(launch, 2, samples, per_sample, s);
  TimingStats t;
  try {
    Events ev;
    std::vector<double> ms;
    for (int w = 0; w < 2; ++w) MOE_CUDA_CHECK(cudaGraphLaunch(exec, st));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    sustain([&] { MOE_CUDA_CHECK(cudaGraphLaunch(exec, st)); }, st);
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

namespace {

// The copy kernel of copy_kernel / time_copy_of: bulk copies through shared memory, one CTA an
// SM, one thread issuing. Chunks of kCopyChunk bytes (the last one shorter), chunk c to CTA
// c mod grid, in a ring of kCopyStages: a chunk's global -> shared copy completes on its stage's
// barrier, its shared -> global copy goes out as a bulk group, and the stage takes the chunk
// kCopyStages later once the copy out two chunks back has read it. On an H100 (session 32) this
// moved 1 GiB at 2890 GB/s, a grid-stride copy of 16-byte vectors (four in flight a thread, the
// kernel here before) at 2790-2815, the driver's cudaMemcpyAsync at 2970-2995.
constexpr int kCopyStages = 6, kCopyChunk = 32 * 1024;
constexpr int kCopySmem = kCopyStages * kCopyChunk;

__global__ void __launch_bounds__(32, 1)
    copy_bulk_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t bytes) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[kCopyStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kCopyStages; ++s) bulk::mbar_init(&full[s], 1);
  bulk::mbar_init_fence();
  const int64_t chunks = (bytes + kCopyChunk - 1) / kCopyChunk, G = gridDim.x;
  const int64_t mine = chunks > blockIdx.x ? (chunks - blockIdx.x + G - 1) / G : 0;
  const uint64_t pol = bulk::evict_first_policy();  // read once
  auto size_of = [&](int64_t c) {
    return static_cast<uint32_t>(min(static_cast<int64_t>(kCopyChunk), bytes - c * kCopyChunk));
  };
  auto load = [&](int64_t j) {  // this CTA's j-th chunk into stage j mod kCopyStages
    const int s = static_cast<int>(j % kCopyStages);
    const int64_t c = blockIdx.x + j * G;
    bulk::mbar_arrive_expect_tx(&full[s], size_of(c));
    bulk::copy_g2s(ring + s * kCopyChunk, src + c * kCopyChunk, size_of(c), &full[s], pol);
  };
  for (int64_t j = 0; j < kCopyStages && j < mine; ++j) load(j);
  for (int64_t j = 0; j < mine; ++j) {
    const int s = static_cast<int>(j % kCopyStages);
    bulk::mbar_wait(&full[s], static_cast<uint32_t>((j / kCopyStages) & 1));
    const int64_t c = blockIdx.x + j * G;
    bulk::copy_s2g(dst + c * kCopyChunk, ring + s * kCopyChunk, size_of(c));
    bulk::commit_group();
    bulk::wait_group_read<2>();  // the copy out of chunk j - 2 has read its stage
    if (j >= 2 && j - 2 + kCopyStages < mine) load(j - 2 + kCopyStages);
  }
  bulk::wait_group_all();
}

void launch_copy_bulk(const void* src, void* dst, size_t bytes, cudaStream_t st) {
  static const int sms = [] {
    int dev = 0, n = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    MOE_CUDA_CHECK(cudaFuncSetAttribute(copy_bulk_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kCopySmem));
    return n;
  }();
  const int64_t chunks = (static_cast<int64_t>(bytes) + kCopyChunk - 1) / kCopyChunk;
  if (chunks == 0) return;
  const int grid = static_cast<int>(std::min<int64_t>(sms, chunks));
  copy_bulk_kernel<<<grid, 32, kCopySmem, st>>>(
      static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), static_cast<int64_t>(bytes));
  MOE_CUDA_CHECK(cudaGetLastError());
}

// The floor of time_copy_of: a kernel that moves nothing. It waits for its predecessor
// (griddepcontrol.wait) and is launched with programmatic dependent launch, the cheapest chaining
// the op kernels use (the router's, gpu/router_row.cuh).
__global__ void empty_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace

void copy_kernel(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    throw std::invalid_argument("copy_kernel: bytes (" + std::to_string(bytes) +
                                ") and both addresses must be multiples of 16");
  }
  launch_copy_bulk(src, dst, bytes, reinterpret_cast<cudaStream_t>(s));
}

SizedCopy time_copy_of(double bytes, int samples) {
  const size_t half = (static_cast<size_t>(std::ceil(std::max(bytes, 2.0) / 2.0)) + 15) / 16 * 16;
  const int sets = rotation_sets(2.0 * static_cast<double>(half));
  auto st = reinterpret_cast<cudaStream_t>(bench_stream());
  std::vector<void*> bufs;
  SizedCopy r;
  try {
    for (int k = 0; k < 2 * sets; ++k) {
      void* b = nullptr;
      MOE_CUDA_CHECK(cudaMalloc(&b, half));
      bufs.push_back(b);
      MOE_CUDA_CHECK(cudaMemsetAsync(b, 0x5a, half, st));
    }
    // Direct launches: captured into a graph, a 1 GiB memcpy ran at 2390 GB/s against 2990
    // launched directly (H100, session 32; launched, it waits for a kernel that fills the SMs).
    r.memcpy = time_launches_auto(
        [&](int i) {
          const size_t k = static_cast<size_t>(i % sets);
          MOE_CUDA_CHECK(
              cudaMemcpyAsync(bufs[2 * k + 1], bufs[2 * k], half, cudaMemcpyDeviceToDevice, st));
        },
        samples, 1.0, 1000, /*allow_graph=*/false);
    r.kernel = time_launches_auto(
        [&](int i) {
          const size_t k = static_cast<size_t>(i % sets);
          launch_copy_bulk(bufs[2 * k], bufs[2 * k + 1], half, st);
        },
        samples);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(32);
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    r.empty = time_launches_auto(
        [&](int) { MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, empty_kernel)); }, samples);
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
  } catch (...) {
    for (void* b : bufs) cudaFree(b);
    throw;
  }
  for (void* b : bufs) MOE_CUDA_CHECK(cudaFree(b));
  r.median_ms = std::min(r.memcpy.median_ms, r.kernel.median_ms);
  return r;
}

namespace {

void check_blas(cublasStatus_t st, const char* what, int line) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw std::runtime_error(std::string("cuBLAS error ") + cublasGetStatusName(st) + " in " + what +
                           " at " + __FILE__ + ":" + std::to_string(line));
}
#define MOE_BENCH_BLAS(call) check_blas((call), #call, __LINE__)

cudaDataType_t blas_type(DType d) {
  switch (d) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      break;
  }
  throw std::invalid_argument("dense GEMM: unsupported dtype " + std::string(dtype_name(d)));
}

// v as a cuBLAS int; `what` names it in the error ("dense GEMM: m", "batched GEMM: product 1 k").
int blas_int(int64_t v, const std::string& what) {
  if (v < 1 || v > INT_MAX) {
    throw std::invalid_argument(what + " = " + std::to_string(v) + " outside [1, INT_MAX]");
  }
  return static_cast<int>(v);
}

// A cuBLAS handle on s with the grouped GEMM's settings and its own workspace.
struct BenchBlas {
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  cublasHandle_t h = nullptr;
  void* ws = nullptr;
  explicit BenchBlas(cudaStream_t s) {
    MOE_BENCH_BLAS(cublasCreate(&h));
    MOE_BENCH_BLAS(cublasSetStream(h, s));  // before the workspace: SetStream resets it
    MOE_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
    MOE_BENCH_BLAS(cublasSetWorkspace(h, ws, kWorkspaceBytes));
    MOE_BENCH_BLAS(cublasSetMathMode(
        h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    MOE_BENCH_BLAS(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  }
  ~BenchBlas() {
    cublasDestroy(h);
    cudaFree(ws);
  }
  BenchBlas(const BenchBlas&) = delete;
  BenchBlas& operator=(const BenchBlas&) = delete;
  // Column-major C[m,n] = op(A) op(B), fp32 accumulation.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a, int lda,
            const void* b, int ldb, void* c, int ldc, cudaDataType_t t) const {
    const float alpha = 1.0f, beta = 0.0f;
    MOE_BENCH_BLAS(cublasGemmEx(h, ta, tb, m, n, k, &alpha, a, t, lda, b, t, ldb, &beta, c, t, ldc,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // The same, `batch` times, operand i at a + i * sa (and so on), beta given.
  void gemm_batched(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a,
                    int lda, long long sa, const void* b, int ldb, long long sb, float beta,
                    void* c, int ldc, long long sc, int batch, cudaDataType_t t) const {
    const float alpha = 1.0f;
    MOE_BENCH_BLAS(cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, &alpha, a, t, lda, sa, b, t, ldb,
                                              sb, &beta, c, t, ldc, sc, batch, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT));
  }
};

}  // namespace

DenseGemmTiming time_dense_gemm(DType d, int64_t m, int64_t k, int64_t n, bool with_bwd,
                                int samples) {
  const int M = blas_int(m, "dense GEMM: m"), K = blas_int(k, "dense GEMM: k"),
            N = blas_int(n, "dense GEMM: n");
  const cudaDataType_t t = blas_type(d);
  auto st = reinterpret_cast<cudaStream_t>(bench_stream());
  DenseGemmTiming r;
  r.m = m;
  r.k = k;
  r.n = n;
  const BenchBlas blas(st);
  DeviceTensor a(d, {m, k}), b(d, {k, n}), c(d, {m, n});
  gemm_detail::fill_hash_uniform(a, 0xA11CE, -1.0, 1.0, bench_stream());
  gemm_detail::fill_hash_uniform(b, 0xB0B, -1.0, 1.0, bench_stream());
  // Row-major c = a . b is column-major c^T[n,m] = b^T[n,k] . a^T[k,m].
  const auto fwd = [&] {
    blas.gemm(CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, b.data(), N, a.data(), K, c.data(), N, t);
  };
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
  r.fwd = time_launches_auto([&](int) { fwd(); }, samples);
  r.fwd_tflops = flops / (r.fwd.median_ms * 1e-3) / 1e12;
  if (with_bwd) {
    DeviceTensor g(d, {m, n}), da(d, {m, k}), db(d, {k, n});
    gemm_detail::fill_hash_uniform(g, 0x6EAD, -1.0, 1.0, bench_stream());
    r.fwd_bwd = time_launches_auto(
        [&](int) {
          fwd();
          // da[m,k] = g . b^T: column-major da^T[k,m] = b[k,n] (b^T stored, op T) . g^T[n,m].
          blas.gemm(CUBLAS_OP_T, CUBLAS_OP_N, K, M, N, b.data(), N, g.data(), N, da.data(), K, t);
          // db[k,n] = a^T . g: column-major db^T[n,k] = g^T[n,m] . a[m,k] (a^T stored, op T).
          blas.gemm(CUBLAS_OP_N, CUBLAS_OP_T, N, K, M, g.data(), N, a.data(), K, db.data(), N, t);
        },
        samples);
    r.fwd_bwd_tflops = 3.0 * flops / (r.fwd_bwd.median_ms * 1e-3) / 1e12;
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(st));
  return r;
}

struct BatchedGemms::Blas {
  BenchBlas blas;
  explicit Blas(cudaStream_t s) : blas(s) {}
};

BatchedGemms::BatchedGemms(DType d, std::vector<BatchedProduct> products, bool with_bwd)
    : d_(d), products_(std::move(products)) {
  if (products_.empty()) throw std::invalid_argument("batched GEMM: no products");
  blas_type(d);
  for (size_t p = 0; p < products_.size(); ++p) {
    const BatchedProduct& q = products_[p];
    const std::string at = "batched GEMM: product " + std::to_string(p) + " ";
    for (const auto& [v, f] : {std::pair{q.batch, "batch"}, std::pair{q.m, "m"},
                               std::pair{q.k, "k"}, std::pair{q.n, "n"}}) {
      blas_int(v, at + f);
    }
    if (q.a_from < -1 || q.a_from >= static_cast<int>(p)) {
      throw std::invalid_argument("batched GEMM: product " + std::to_string(p) + " a_from = " +
                                  std::to_string(q.a_from) + " is not an earlier product");
    }
    if (q.a_from >= 0) {
      const BatchedProduct& o = products_[static_cast<size_t>(q.a_from)];
      if (o.batch != q.batch || o.m != q.m || o.k != q.k || o.a_from != -1) {
        throw std::invalid_argument("batched GEMM: product " + std::to_string(p) +
                                    " shares a with a product of another batch, m or k");
      }
    }
  }
  uint64_t seed = 0xBA7C4ED;
  const auto filled = [&](const Shape& s) {
    DeviceTensor t(d, s);
    gemm_detail::fill_hash_uniform(t, seed++, -1.0, 1.0, bench_stream());
    return t;
  };
  bufs_.resize(products_.size());
  for (size_t p = 0; p < products_.size(); ++p) {
    const BatchedProduct& q = products_[p];
    Bufs& B = bufs_[p];
    if (q.a_from < 0) B.a = filled({q.batch * q.m, q.k});
    B.b = filled({q.batch, q.k, q.n});
    B.c = DeviceTensor(d, {q.batch * q.m, q.n});
    if (with_bwd) {
      B.g = filled({q.batch * q.m, q.n});
      if (q.a_from < 0) B.da = DeviceTensor(d, {q.batch * q.m, q.k});
      B.db = DeviceTensor(d, {q.batch, q.k, q.n});
    }
    fwd_flops_ += 2.0 * static_cast<double>(q.batch) * static_cast<double>(q.m) *
                  static_cast<double>(q.k) * static_cast<double>(q.n);
  }
  blas_ = std::make_unique<Blas>(reinterpret_cast<cudaStream_t>(bench_stream()));
}

BatchedGemms::~BatchedGemms() = default;

size_t BatchedGemms::owner(size_t p) const {
  const int f = products_.at(p).a_from;
  return f < 0 ? p : static_cast<size_t>(f);
}

// Row-major c = a . b per batch is column-major c^T[n,m] = b^T[n,k] . a^T[k,m] (as above).
void BatchedGemms::fwd() {
  const cudaDataType_t t = blas_type(d_);
  for (size_t p = 0; p < products_.size(); ++p) {
    const BatchedProduct& q = products_[p];
    const int M = static_cast<int>(q.m), K = static_cast<int>(q.k), N = static_cast<int>(q.n);
    blas_->blas.gemm_batched(CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, bufs_[p].b.data(), N, q.k * q.n,
                             a(p).data(), K, q.m * q.k, 0.0f, bufs_[p].c.data(), N, q.m * q.n,
                             static_cast<int>(q.batch), t);
  }
}

void BatchedGemms::bwd() {
  if (bufs_.front().db.numel() == 0) throw std::logic_error("BatchedGemms: made without bwd");
  const cudaDataType_t t = blas_type(d_);
  for (size_t p = 0; p < products_.size(); ++p) {
    const BatchedProduct& q = products_[p];
    const int M = static_cast<int>(q.m), K = static_cast<int>(q.k), N = static_cast<int>(q.n),
              G = static_cast<int>(q.batch);
    Bufs& B = bufs_[p];
    // dgrad da[m,k] = g . b^T (column-major da^T[k,m] = b[k,n] op T . g^T[n,m]); a product that
    // shares a adds its dgrad into the first one's da (issued after it: a_from < p).
    const bool shared = q.a_from >= 0;
    blas_->blas.gemm_batched(CUBLAS_OP_T, CUBLAS_OP_N, K, M, N, B.b.data(), N, q.k * q.n,
                             B.g.data(), N, q.m * q.n, shared ? 1.0f : 0.0f,
                             bufs_[owner(p)].da.data(), K, q.m * q.k, G, t);
    // wgrad db[k,n] = a^T . g (column-major db^T[n,k] = g^T[n,m] . a[m,k] op T).
    blas_->blas.gemm_batched(CUBLAS_OP_N, CUBLAS_OP_T, N, K, M, B.g.data(), N, q.m * q.n,
                             a(p).data(), K, q.m * q.k, 0.0f, B.db.data(), N, q.k * q.n, G, t);
  }
}

BatchedGemmTiming time_batched_gemms(DType d, const std::vector<BatchedProduct>& products,
                                     bool with_bwd, int samples) {
  BatchedGemms g(d, products, with_bwd);
  BatchedGemmTiming r;
  r.fwd_flops = g.fwd_flops();
  r.fwd = time_launches_auto([&](int) { g.fwd(); }, samples);
  if (with_bwd) {
    r.fwd_bwd = time_launches_auto(
        [&](int) {
          g.fwd();
          g.bwd();
        },
        samples);
  }
  device_synchronize();
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
