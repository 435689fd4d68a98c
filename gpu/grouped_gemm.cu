// CUDA twin of reference/grouped_gemm.cpp: grouped_gemm (SPEC §10.1). Plan: gpu/grouped_gemm.cuh.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device_util.cuh"
#include "gpu/grouped_gemm.cuh"
#include "gpu/grouped_gemm_sm90.cuh"

namespace moe::gpu {

namespace {

using gemm_detail::DevicePlan;
using gemm_detail::ResourceCounts;
using gemm_detail::Scratch;

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
constexpr int kDefaultAuxStreams = 8, kMaxAuxStreams = 32;

void check_blas(cublasStatus_t st, const char* what, const char* file, int line) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw std::runtime_error(std::string("cuBLAS error ") + cublasGetStatusName(st) + " (" +
                           cublasGetStatusString(st) + ") in " + what + " at " + file + ":" +
                           std::to_string(line));
}
#define MOE_CUBLAS_CHECK(call) check_blas((call), #call, __FILE__, __LINE__)

cudaDataType_t cuda_type(DType d) {
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
  throw std::invalid_argument("grouped_gemm: unsupported dtype " + std::string(dtype_name(d)));
}

// The forked streams of GemmImpl::streams and chunked, per thread and device (created on first
// use, up to kMaxAuxStreams).
struct AuxStreams {
  Stream streams[kMaxAuxStreams] = {};
  cudaEvent_t fork = nullptr, join[kMaxAuxStreams] = {};
  int created = 0;
  // GemmImpl::split's sm90 half (created on first use): of the greatest priority, so that the
  // kernel's clusters take SMs as soon as cuBLAS's CTAs retire; at the default priority the split
  // forward ran 26% slower (one call, docs/perf.md, session 22).
  Stream split = nullptr;
  cudaEvent_t split_join = nullptr;
};

// Pinned host staging and its device copy, reused once the event of its last upload has passed.
struct UploadSlot {
  char* host = nullptr;
  char* dev = nullptr;
  size_t cap = 0;
  cudaEvent_t done = nullptr;
};

struct UploadPool {
  std::vector<UploadSlot> slots;
  size_t oldest = 0;  // round-robin start of the search
};

// A cuBLAS handle bound to one stream, with its own workspace.
struct BlasHandle {
  cublasHandle_t h = nullptr;
  void* ws = nullptr;
};

struct Arena {
  void* p = nullptr;
  size_t cap = 0;
};

// Everything the products keep between calls on one thread: cuBLAS handles and chunked-call
// arenas per (device, stream), forked streams and upload slots per device. A thread uses its own
// without locking. The states belong to a process-wide registry, not to thread_local storage: a
// thread that exits (check -j's workers) hands its state to the next thread that needs one
// instead of leaking it (before, each worker left behind a handle, 32 MiB of workspace and
// cuBLAS's own 64 MiB per stream it had used), and release_gemm_resources() frees them all (the
// GPU tests do at exit, so compute-sanitizer's leak check sees real frees).
struct ThreadState {
  std::map<std::pair<int, Stream>, BlasHandle> handles;
  std::map<std::pair<int, Stream>, Arena> arenas;
  std::map<int, AuxStreams> aux;
  std::map<int, UploadPool> uploads;
};

// Entries keyed by a caller's stream outlive it when the caller destroys the stream (the plugin
// harness makes one per case): past this many, a new key first frees the entries of every stream
// but the forked ones (after a device synchronisation, so none is in use).
constexpr size_t kMaxStreamEntries = 16;

class StateRegistry {
 public:
  static StateRegistry& get() {
    static StateRegistry* r = new StateRegistry;  // never destroyed: threads retire into it at exit
    return *r;
  }
  ThreadState* adopt() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spare_.empty()) {
      ThreadState* t = spare_.back();
      spare_.pop_back();
      return t;
    }
    all_.push_back(std::make_unique<ThreadState>());
    return all_.back().get();
  }
  void retire(ThreadState* t) {
    std::lock_guard<std::mutex> lock(mu_);
    spare_.push_back(t);
  }
  // Frees what every state holds; the states stay (empty) with their threads.
  void release_all() noexcept;
  ResourceCounts counts() {
    std::lock_guard<std::mutex> lock(mu_);
    ResourceCounts c;
    c.states = static_cast<int64_t>(all_.size());
    for (const auto& t : all_) {
      c.blas_handles += static_cast<int64_t>(t->handles.size());
      c.arenas += static_cast<int64_t>(t->arenas.size());
      for (const auto& [dev, a] : t->aux) c.aux_streams += a.created;
      for (const auto& [dev, u] : t->uploads)
        c.upload_slots += static_cast<int64_t>(u.slots.size());
    }
    return c;
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<ThreadState>> all_;
  std::vector<ThreadState*> spare_;
};

ThreadState& thread_state() {
  struct Holder {
    ThreadState* s = nullptr;
    ~Holder() {
      if (s) StateRegistry::get().retire(s);  // no CUDA call here: this may run at process exit
    }
  };
  thread_local Holder h;
  if (!h.s) h.s = StateRegistry::get().adopt();
  return *h.s;
}

void destroy(int dev, BlasHandle& b) noexcept {
  cudaSetDevice(dev);
  if (b.h) cublasDestroy(b.h);
  if (b.ws) cudaFree(b.ws);
  b = {};
}

bool is_aux(const ThreadState& t, int dev, Stream s) {
  auto it = t.aux.find(dev);
  if (it == t.aux.end()) return false;
  for (int i = 0; i < it->second.created; ++i) {
    if (it->second.streams[i] == s) return true;
  }
  return false;
}

bool capturing(Stream s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

// Before adding a key for stream s: frees the entries of the caller streams that may be gone.
template <class Map, class Free>
void bound_entries(ThreadState& t, Map& m, Stream s, Free free_entry) {
  if (m.size() < kMaxStreamEntries || capturing(s)) return;
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto it = m.begin(); it != m.end();) {
    if (is_aux(t, it->first.first, it->first.second)) {
      ++it;
      continue;
    }
    free_entry(it->first.first, it->second);
    it = m.erase(it);
  }
  MOE_CUDA_CHECK(cudaSetDevice(dev));
}

// One handle per (thread, device, stream), bound to that stream, with its own workspace: a
// workspace shared by handles on concurrent streams would race, and a fixed workspace size keeps
// cuBLAS's algorithm choice (hence the bits) fixed. sm_target: the SM count cuBLAS's heuristics
// plan for (0: the device's; GemmImpl::split plans for the SMs its sm90 half leaves), set on every
// call, so that no call inherits another's (the algorithm, hence the bits, would follow it).
cublasHandle_t blas_for(Stream s, int sm_target = 0) {
  ThreadState& t = thread_state();
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  auto it = t.handles.find({dev, s});
  if (it != t.handles.end()) {
    MOE_CUBLAS_CHECK(cublasSetSmCountTarget(it->second.h, sm_target));
    return it->second.h;
  }
  bound_entries(t, t.handles, s, [](int d, BlasHandle& b) { destroy(d, b); });
  BlasHandle b;
  MOE_CUBLAS_CHECK(cublasCreate(&b.h));
  try {
    // cublasSetStream resets the workspace to the default pool, so the stream is set first.
    MOE_CUBLAS_CHECK(cublasSetStream(b.h, s));
    MOE_CUDA_CHECK(cudaMalloc(&b.ws, kWorkspaceBytes));
    MOE_CUBLAS_CHECK(cublasSetWorkspace(b.h, b.ws, kWorkspaceBytes));
    // fp32 accumulation throughout: no reduced-precision split-K reductions for 16-bit outputs.
    MOE_CUBLAS_CHECK(cublasSetMathMode(
        b.h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                       CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    MOE_CUBLAS_CHECK(cublasSetPointerMode(b.h, CUBLAS_POINTER_MODE_HOST));
  } catch (...) {
    destroy(dev, b);
    cudaSetDevice(dev);
    throw;
  }
  t.handles.emplace(std::make_pair(dev, s), b);
  MOE_CUBLAS_CHECK(cublasSetSmCountTarget(b.h, sm_target));
  return b.h;
}

AuxStreams& aux_streams(int count) {
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  AuxStreams& a = thread_state().aux[dev];
  if (!a.fork) MOE_CUDA_CHECK(cudaEventCreateWithFlags(&a.fork, cudaEventDisableTiming));
  for (; a.created < std::min(count, kMaxAuxStreams); ++a.created) {
    cudaStream_t st = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    a.streams[a.created] = st;
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&a.join[a.created], cudaEventDisableTiming));
  }
  return a;
}

void StateRegistry::release_all() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  int cur = 0;
  cudaGetDevice(&cur);
  for (auto& t : all_) {
    for (auto& [key, b] : t->handles) destroy(key.first, b);
    t->handles.clear();
    for (auto& [key, a] : t->arenas) {
      cudaSetDevice(key.first);
      cudaDeviceSynchronize();  // no work still uses it; its stream may be gone
      if (a.p) cudaFreeAsync(a.p, nullptr);
      cudaDeviceSynchronize();
    }
    t->arenas.clear();
    for (auto& [dev, a] : t->aux) {
      cudaSetDevice(dev);
      cudaDeviceSynchronize();
      for (int i = 0; i < a.created; ++i) {
        cudaStreamDestroy(a.streams[i]);
        cudaEventDestroy(a.join[i]);
      }
      if (a.fork) cudaEventDestroy(a.fork);
      if (a.split) cudaStreamDestroy(a.split);
      if (a.split_join) cudaEventDestroy(a.split_join);
    }
    t->aux.clear();
    for (auto& [dev, u] : t->uploads) {
      cudaSetDevice(dev);
      for (UploadSlot& sl : u.slots) {
        if (sl.done) cudaEventSynchronize(sl.done);
        if (sl.host) cudaFreeHost(sl.host);
        if (sl.dev) cudaFree(sl.dev);
        if (sl.done) cudaEventDestroy(sl.done);
      }
    }
    t->uploads.clear();
  }
  cudaSetDevice(cur);
  cudaGetLastError();  // nothing here is worth a sticky error for the caller
}

int aux_count(const GemmOptions& o) {
  return std::clamp(o.streams > 0 ? o.streams : kDefaultAuxStreams, 1, kMaxAuxStreams);
}

// Forks `used` aux streams off s; join() makes s wait for all of them.
struct Fork {
  AuxStreams& aux;
  int used;
  Stream s;
  Fork(int count, int used_, Stream s_) : aux(aux_streams(count)), used(used_), s(s_) {
    MOE_CUDA_CHECK(cudaEventRecord(aux.fork, s));
    for (int i = 0; i < used; ++i) MOE_CUDA_CHECK(cudaStreamWaitEvent(aux.streams[i], aux.fork, 0));
  }
  Stream operator[](int i) const { return aux.streams[i]; }
  void join() {
    for (int i = 0; i < used; ++i) {
      MOE_CUDA_CHECK(cudaEventRecord(aux.join[i], aux.streams[i]));
      MOE_CUDA_CHECK(cudaStreamWaitEvent(s, aux.join[i], 0));
    }
  }
};

// One column-major cuBLAS problem C[m,n] (=|+=) op(A)[m,k] op(B)[k,n].
struct Problem {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc;
  const void* a;
  const void* b;
  void* c;
};

int as_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(v) +
                                " exceeds the int range of the cuBLAS interface");
  }
  return static_cast<int>(v);
}

const char* byte_ptr(const void* p, int64_t elems, size_t es) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(es);
}

// Row-major products as column-major cuBLAS problems (C^T = B^T A^T); see gemm_detail::
// grouped_product for the roles. Problems that write nothing (m or n = 0) are dropped; problems
// with k = 0 go to zero_k (their C is cleared by the caller unless accumulating).
void build_problems(GemmRole role, const GroupPlan& plan, size_t es_ab, const void* a,
                    const void* b, size_t es_c, void* c, int64_t K, int64_t N,
                    std::vector<Problem>& out, std::vector<Problem>& zero_k) {
  const int64_t G = plan.groups();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n_g = plan.sizes[g], o_g = plan.offsets[g];
    Problem p{};
    switch (role) {
      case GemmRole::fwd:  // C^T[N, n_g] = B_g^T[N, K] . A^T[K, n_g]
        p = {CUBLAS_OP_N,
             CUBLAS_OP_N,
             as_int(N, "N"),
             as_int(n_g, "group size"),
             as_int(K, "K"),
             as_int(std::max<int64_t>(N, 1), "N"),
             as_int(std::max<int64_t>(K, 1), "K"),
             as_int(std::max<int64_t>(N, 1), "N"),
             byte_ptr(b, g * K * N, es_ab),
             byte_ptr(a, o_g * K, es_ab),
             const_cast<char*>(byte_ptr(c, o_g * N, es_c))};
        break;
      case GemmRole::dgrad:  // C^T[K, n_g] = B_g[K, N] . A^T[N, n_g]
        p = {CUBLAS_OP_T,
             CUBLAS_OP_N,
             as_int(K, "K"),
             as_int(n_g, "group size"),
             as_int(N, "N"),
             as_int(std::max<int64_t>(N, 1), "N"),
             as_int(std::max<int64_t>(N, 1), "N"),
             as_int(std::max<int64_t>(K, 1), "K"),
             byte_ptr(b, g * K * N, es_ab),
             byte_ptr(a, o_g * N, es_ab),
             const_cast<char*>(byte_ptr(c, o_g * K, es_c))};
        break;
      case GemmRole::wgrad:  // C_g^T[N, K] = B^T[N, n_g] . A[n_g, K]
        p = {CUBLAS_OP_N,
             CUBLAS_OP_T,
             as_int(N, "N"),
             as_int(K, "K"),
             as_int(n_g, "group size"),
             as_int(std::max<int64_t>(N, 1), "N"),
             as_int(std::max<int64_t>(K, 1), "K"),
             as_int(std::max<int64_t>(N, 1), "N"),
             byte_ptr(b, o_g * N, es_ab),
             byte_ptr(a, o_g * K, es_ab),
             const_cast<char*>(byte_ptr(c, g * K * N, es_c))};
        break;
    }
    if (p.m == 0 || p.n == 0) continue;
    (p.k == 0 ? zero_k : out).push_back(p);
  }
}

// MOE_CUBLAS_PREFILL=zero (scripts/gpu_sanitize.sh sets it under initcheck only; default off).
// initcheck does not see what cuBLAS stores (docs/experiments/cublas-initcheck-probe.cu), so it
// would report every read of a cuBLAS output: of the fp32 accumulators, of chunked's slabs. Under
// the knob the bytes a cuBLAS call is about to overwrite (each product's C, beta = 0) are zeroed
// first on its stream, so initcheck counts them as written, while bytes no call writes still read
// as uninitialised. Same bits either way (GemmGpuKnobs.CublasPrefillGivesTheSameBits). NVTX marks
// are the tool's own way, but here they took no effect (docs/experiments/initcheck-marks.patch).
using gemm_detail::ByteRange;

size_t cuda_type_size(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
    default:
      throw std::logic_error("cuda_type_size: unexpected cudaDataType_t");
  }
}

// The bytes product p writes: its column-major C, m elements in each of its n columns, ldc apart.
void add_written(const Problem& p, cudaDataType_t tc, std::vector<ByteRange>& out) {
  const size_t es = cuda_type_size(tc);
  const size_t col = static_cast<size_t>(p.m) * es, ld = static_cast<size_t>(p.ldc) * es;
  if (p.ldc == p.m) {
    out.push_back({p.c, col * static_cast<size_t>(p.n)});
    return;
  }
  for (int j = 0; j < p.n; ++j) out.push_back({static_cast<char*>(p.c) + j * ld, col});
}

std::atomic<int64_t> g_prefill_memsets{0};

// Zeroes the ranges on s, one memset per run of gemm_detail::prefill_runs, never a byte between
// two ranges.
void prefill(std::vector<ByteRange> r, Stream s) {
  for (const ByteRange& run : gemm_detail::prefill_runs(std::move(r))) {
    MOE_CUDA_CHECK(cudaMemsetAsync(run.p, 0, run.n, s));
    g_prefill_memsets.fetch_add(1, std::memory_order_relaxed);
  }
}

void gemm_ex(cublasHandle_t h, const Problem& p, cudaDataType_t tab, cudaDataType_t tc,
             float beta) {
  if (beta == 0.0f && gemm_detail::cublas_prefill_setting()) {
    cudaStream_t s = nullptr;
    MOE_CUBLAS_CHECK(cublasGetStream(h, &s));
    std::vector<ByteRange> r;
    add_written(p, tc, r);
    prefill(std::move(r), s);
  }
  const float alpha = 1.0f;
  MOE_CUBLAS_CHECK(cublasGemmEx(h, p.ta, p.tb, p.m, p.n, p.k, &alpha, p.a, tab, p.lda, p.b, tab,
                                p.ldb, &beta, p.c, tc, p.ldc, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}

void run_loop(const std::vector<Problem>& ps, cudaDataType_t tab, cudaDataType_t tc, float beta,
              Stream s, int sm_target = 0) {
  cublasHandle_t h = blas_for(s, sm_target);
  for (const Problem& p : ps) gemm_ex(h, p, tab, tc, beta);
}

// Round-robin over `count` forked streams.
void run_streams(const std::vector<Problem>& ps, cudaDataType_t tab, cudaDataType_t tc, float beta,
                 Stream s, int count, int sm_target = 0) {
  if (ps.size() <= 1 || count <= 1) return run_loop(ps, tab, tc, beta, s, sm_target);
  Fork f(count, static_cast<int>(std::min<size_t>(ps.size(), count)), s);
  for (size_t j = 0; j < ps.size(); ++j) {
    const Stream st = f[static_cast<int>(j % count)];
    gemm_ex(blas_for(st, sm_target), ps[j], tab, tc, beta);
  }
  f.join();
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void run_grouped(const std::vector<Problem>& ps, cudaDataType_t tab, cudaDataType_t tc, float beta,
                 Stream s) {
  if (ps.empty()) return;
  // cublasGemmGroupedBatchedEx takes C in the operands' type only (no bf16/f16 -> fp32), and
  // 16-bit operands need aligned pointers (a misaligned one is a sticky launch fault). Such
  // problem sets go through per-group cublasGemmEx, which handles both.
  bool ok = tab == tc;
  for (const Problem& p : ps) ok = ok && aligned16(p.a) && aligned16(p.b) && aligned16(p.c);
  if (!ok) return run_streams(ps, tab, tc, beta, s, kDefaultAuxStreams);
  const size_t P = ps.size();
  std::vector<cublasOperation_t> ta(P), tb(P);
  std::vector<int> m(P), n(P), k(P), lda(P), ldb(P), ldc(P), group_size(P, 1);
  std::vector<float> alpha(P, 1.0f), betas(P, beta);
  std::vector<const void*> ptrs(3 * P);  // A pointers, then B, then C
  for (size_t i = 0; i < P; ++i) {
    const Problem& p = ps[i];
    ta[i] = p.ta;
    tb[i] = p.tb;
    m[i] = p.m;
    n[i] = p.n;
    k[i] = p.k;
    lda[i] = p.lda;
    ldb[i] = p.ldb;
    ldc[i] = p.ldc;
    ptrs[i] = p.a;
    ptrs[P + i] = p.b;
    ptrs[2 * P + i] = p.c;
  }
  // The pointer arrays live on the device. A pageable source is staged before the call returns,
  // so the host vector may go out of scope at once.
  Scratch dptrs(ptrs.size() * sizeof(void*), s);
  MOE_CUDA_CHECK(cudaMemcpyAsync(dptrs.get(), ptrs.data(), ptrs.size() * sizeof(void*),
                                 cudaMemcpyHostToDevice, s));
  auto** d = dptrs.as<const void*>();
  if (beta == 0.0f && gemm_detail::cublas_prefill_setting()) {
    std::vector<ByteRange> r;
    for (const Problem& p : ps) add_written(p, tc, r);
    prefill(std::move(r), s);
  }
  MOE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      blas_for(s), ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), d, tab,
      lda.data(), d + P, tab, ldb.data(), betas.data(), const_cast<void* const*>(d + 2 * P), tc,
      ldc.data(), static_cast<int>(P), group_size.data(), CUBLAS_COMPUTE_32F));
}

// ---------------------------------------------------------------------------------------------
// Kernels

constexpr int kThreads = 256;

// Group of row r: the g with offsets[g] <= r < offsets[g + 1] (empty groups have equal offsets).
__device__ __forceinline__ int group_of(const int64_t* offsets, int G, int64_t r) {
  int lo = 0, hi = G;  // first index j in [0, G] with offsets[j] > r, minus one
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] > r) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo - 1;
}

// One block per row: out[r, :] = rnd(acc[r, :] + bias[g(r), :]).
template <class TO, class TB>
__global__ void bias_epilogue_kernel(const float* __restrict__ acc, const TB* __restrict__ bias,
                                     TO* __restrict__ out, const int64_t* __restrict__ offsets,
                                     int G, int64_t N) {
  const int64_t r = blockIdx.x;
  const TB* brow = nullptr;
  if (bias) brow = bias + static_cast<int64_t>(group_of(offsets, G, r)) * N;
  const float* a = acc + r * N;
  TO* o = out + r * N;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {
    float v = a[j];
    if (brow) v += to_f32(brow[j]);
    o[j] = from_f32<TO>(v);
  }
}

// Per-group column sums. Block (32, 8) per (32 columns, group): thread (tx, ty) sums rows
// ty, ty + 8, ... of its column in order, then a fixed-order tree over ty; no atomics, so the
// result is deterministic.
template <class TS, class TD>
__global__ void column_sums_kernel(const TS* __restrict__ src, TD* __restrict__ dst,
                                   const int64_t* __restrict__ offsets, int64_t N) {
  __shared__ float part[8][33];
  const int g = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = offsets[g], r1 = offsets[g + 1];
  float sum = 0.0f;
  if (col < N) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) sum += to_f32(src[r * N + col]);
  }
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  for (int step = 4; step > 0; step >>= 1) {
    if (threadIdx.y < step) part[threadIdx.y][threadIdx.x] += part[threadIdx.y + step][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < N)
    dst[static_cast<int64_t>(g) * N + col] = from_f32<TD>(part[0][threadIdx.x]);
}

__host__ __device__ inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__host__ __device__ inline double hash_unit(uint64_t seed, int64_t i) {
  return static_cast<double>(splitmix64(seed + static_cast<uint64_t>(i)) >> 40) * 0x1p-24;
}

template <class T>
__device__ __forceinline__ T from_f64(double v);
template <>
__device__ __forceinline__ float from_f64<float>(double v) {
  return __double2float_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f64<__nv_bfloat16>(double v) {
  return __double2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_f64<__half>(double v) {
  return __double2half(v);
}

template <class T>
__global__ void fill_hash_kernel(T* __restrict__ t, int64_t n, uint64_t seed, double lo,
                                 double hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    t[i] = from_f64<T>(lo + (hi - lo) * hash_unit(seed, i));
  }
}

template <class T>
__global__ void gather_kernel(const T* __restrict__ t, const int64_t* __restrict__ index,
                              double* __restrict__ out, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = static_cast<double>(to_f32(t[index[i]]));
}

int grid_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 16));
}

void check_launch() {
  MOE_CUDA_CHECK(cudaGetLastError());
}

// Two-dtype dispatch.
template <class F>
void dispatch_float2(DType a, DType b, F&& f) {
  dispatch_float(a, [&](auto ta) { dispatch_float(b, [&](auto tb) { f(ta, tb); }); });
}

// ---------------------------------------------------------------------------------------------
// GemmImpl::chunked

// The pointer arrays and row-copy records of a chunked call reach the device through a pool of
// upload slots per (thread, device): a pinned host buffer (one asynchronous copy per call), a
// device buffer, and an event recorded after the last kernel that reads the slot. A call takes
// the first slot whose event has passed (cudaEventQuery: the host never blocks, and no
// synchronisation trims the stream-ordered memory pool) or adds a slot; past kMaxUploadSlots
// in flight it waits for the oldest. Slots grow to the largest call seen and, like the handles,
// live until the process exits.
constexpr size_t kMaxUploadSlots = 256;

std::atomic<int64_t> g_chunked_calls{0};

UploadSlot& acquire_upload(size_t bytes) {
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  UploadPool& pool = thread_state().uploads[dev];
  UploadSlot* slot = nullptr;
  const size_t n = pool.slots.size();
  for (size_t j = 0; j < n && !slot; ++j) {
    UploadSlot& c = pool.slots[(pool.oldest + j) % n];
    const cudaError_t q = cudaEventQuery(c.done);
    if (q == cudaSuccess) {
      slot = &c;
      pool.oldest = (pool.oldest + j + 1) % n;
    } else if (q != cudaErrorNotReady) {
      MOE_CUDA_CHECK(q);
    }
  }
  if (!slot && n >= kMaxUploadSlots) {
    slot = &pool.slots[pool.oldest];
    MOE_CUDA_CHECK(cudaEventSynchronize(slot->done));
    pool.oldest = (pool.oldest + 1) % n;
  }
  if (!slot) {
    pool.slots.emplace_back();
    slot = &pool.slots.back();
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming));
  }
  if (slot->cap < bytes) {
    size_t cap = 4096;
    while (cap < bytes) cap *= 2;
    if (slot->host) MOE_CUDA_CHECK(cudaFreeHost(slot->host));
    if (slot->dev) MOE_CUDA_CHECK(cudaFree(slot->dev));  // its event has passed
    slot->host = slot->dev = nullptr;
    slot->cap = 0;
    MOE_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&slot->host), cap));
    MOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slot->dev), cap));
    slot->cap = cap;
  }
  return *slot;
}

// Scratch of the chunked calls on one stream (slabs of the shorter chunks, the staged rows): one
// buffer per (thread, device, stream), reused by every call on that stream (calls on one stream
// run in order) and regrown in stream order when a call needs more, so a steady state allocates
// nothing.
void* stream_arena(size_t bytes, Stream s) {
  ThreadState& t = thread_state();
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (!t.arenas.count({dev, s})) {
    bound_entries(t, t.arenas, s, [](int d, Arena& a) {
      cudaSetDevice(d);
      if (a.p) cudaFreeAsync(a.p, nullptr);  // after the device synchronisation
    });
  }
  Arena& a = t.arenas[{dev, s}];
  if (a.cap < bytes) {
    if (a.p) MOE_CUDA_CHECK(cudaFreeAsync(a.p, s));
    a.p = nullptr;
    a.cap = 0;
    a.p = malloc_async(bytes, s);
    a.cap = bytes;
  }
  return a.p;
}

// A partial chunk's rows: `rows` rows of row_bytes at out, and its C-row slab.
struct RowCopy {
  char* out;
  char* slab;
  int64_t rows;
};

// Block (record, row): copies one row between out and the slab (to_out: slab -> out, else
// out -> slab), in words of W bytes (row_bytes and every row start are multiples of W).
template <class W>
__global__ void copy_rows_kernel(const RowCopy* __restrict__ recs, int64_t row_bytes, bool to_out) {
  const RowCopy rc = recs[blockIdx.x];
  const int64_t r = blockIdx.y;
  if (r >= rc.rows) return;
  W* o = reinterpret_cast<W*>(rc.out + r * row_bytes);
  W* sl = reinterpret_cast<W*>(rc.slab + r * row_bytes);
  const int64_t n = row_bytes / static_cast<int64_t>(sizeof(W));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (to_out) {
      o[i] = sl[i];
    } else {
      sl[i] = o[i];
    }
  }
}

void copy_rows(const RowCopy* d_recs, int64_t count, int64_t chunk, int64_t row_bytes, bool to_out,
               Stream s) {
  if (count == 0 || row_bytes == 0) return;
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(chunk));
  if (row_bytes % 16 == 0) {
    copy_rows_kernel<uint4><<<grid, kThreads, 0, s>>>(d_recs, row_bytes, to_out);
  } else if (row_bytes % 8 == 0) {
    copy_rows_kernel<uint2><<<grid, kThreads, 0, s>>>(d_recs, row_bytes, to_out);
  } else if (row_bytes % 4 == 0) {
    copy_rows_kernel<uint32_t><<<grid, kThreads, 0, s>>>(d_recs, row_bytes, to_out);
  } else {
    copy_rows_kernel<uint16_t><<<grid, kThreads, 0, s>>>(d_recs, row_bytes, to_out);
  }
  check_launch();
}

// The fwd or dgrad products of one or more (b, c) pairs sharing the row operand a, as ONE
// pointer-array cublasGemmBatchedEx: every group's rows are cut into chunks of `chunk` rows, and
// each (chunk, pair) is one batch entry with the same m, n, k. A group's last chunk, when shorter,
// still multiplies `chunk` rows (the rows after it belong to the next group or the tail; past the
// end of a they come from a zeroed staging copy of a's last rows) and writes a slab of scratch,
// from which one kernel copies its own rows out (with accumulate, the slab first receives the
// current rows, so beta = 1 sees them). No two entries write the same memory, the decomposition
// and the call depend only on the plan, so the result is deterministic. Entries are ordered
// (group, chunk, pair): the chunks of one expert run side by side and share its weight in L2.
// The caller checks chunked_aligned() first.
void run_chunked(GemmRole role, const GroupPlan& plan, size_t es_ab, const void* a,
                 const std::vector<std::pair<const void*, void*>>& bc, cudaDataType_t tab,
                 size_t es_c, cudaDataType_t tc, int64_t K, int64_t N, bool accumulate,
                 int64_t chunk, Stream s, int sm_target = 0) {
  const bool fwd = role == GemmRole::fwd;
  // Row operand width, output width; cuBLAS m = c_w, n = chunk, k = a_w (column-major C^T).
  const int64_t a_w = fwd ? K : N, c_w = fwd ? N : K;
  if (c_w == 0 || a_w == 0 || bc.empty()) return;  // k = 0: the caller zeroes
  const int64_t a_row = a_w * static_cast<int64_t>(es_ab), c_row = c_w * static_cast<int64_t>(es_c);
  const int64_t C = chunk;
  struct Chunk {
    int64_t g, row0, rows;
  };
  std::vector<Chunk> chunks;
  int64_t partial = 0;
  bool staged = false;
  for (int64_t g = 0; g < plan.groups(); ++g) {
    for (int64_t j = 0; j * C < plan.sizes[g]; ++j) {
      const Chunk ch{g, plan.offsets[g] + j * C, std::min(C, plan.sizes[g] - j * C)};
      partial += ch.rows < C;
      staged = staged || ch.row0 + C > plan.rows;
      chunks.push_back(ch);
    }
  }
  if (chunks.empty()) return;
  const int64_t np = static_cast<int64_t>(bc.size());
  const int64_t P = static_cast<int64_t>(chunks.size()) * np, Q = partial * np;
  const int64_t base = std::max<int64_t>(0, plan.rows - C);  // first row of the staged copy
  // Arena layout: the slabs, then the staged rows (2 C rows of a, 256-byte aligned).
  const size_t slab_bytes = static_cast<size_t>(Q * C * c_row);
  const size_t stage_at = (slab_bytes + 255) / 256 * 256;
  const size_t stage_bytes = staged ? static_cast<size_t>(2 * C * a_row) : 0;
  char* arena = nullptr;
  if (slab_bytes + stage_bytes > 0) {
    arena = static_cast<char*>(stream_arena(stage_at + stage_bytes, s));
  }
  char* const slabs = arena;
  char* const stage = arena ? arena + stage_at : nullptr;
  const size_t bytes = static_cast<size_t>(3 * P) * sizeof(void*) + Q * sizeof(RowCopy);
  UploadSlot& slot = acquire_upload(bytes);
  auto** hp = reinterpret_cast<const void**>(slot.host);
  auto* recs = reinterpret_cast<RowCopy*>(slot.host + 3 * P * sizeof(void*));
  int64_t i = 0, q = 0;
  for (const Chunk& ch : chunks) {
    const char* arow = ch.row0 + C > plan.rows ? stage + (ch.row0 - base) * a_row
                                               : static_cast<const char*>(a) + ch.row0 * a_row;
    for (const auto& [b, c] : bc) {
      const char* w = byte_ptr(b, ch.g * K * N, es_ab);
      char* out = static_cast<char*>(c) + ch.row0 * c_row;
      char* dst = out;
      if (ch.rows < C) {
        dst = slabs + q * C * c_row;
        recs[q++] = {out, dst, ch.rows};
      }
      hp[i] = w;
      hp[P + i] = arow;
      hp[2 * P + i] = dst;
      ++i;
    }
  }
  MOE_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, bytes, cudaMemcpyHostToDevice, s));
  if (staged) {
    MOE_CUDA_CHECK(cudaMemsetAsync(stage, 0, stage_bytes, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(stage, static_cast<const char*>(a) + base * a_row,
                                   static_cast<size_t>((plan.rows - base) * a_row),
                                   cudaMemcpyDeviceToDevice, s));
  }
  const auto* d_recs = reinterpret_cast<const RowCopy*>(slot.dev + 3 * P * sizeof(void*));
  if (accumulate) copy_rows(d_recs, Q, C, c_row, false, s);
  auto** dp = reinterpret_cast<const void**>(slot.dev);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  // Each entry writes C rows of c_w elements, whole.
  if (!accumulate && gemm_detail::cublas_prefill_setting()) {
    std::vector<ByteRange> r(static_cast<size_t>(P));
    for (int64_t j = 0; j < P; ++j)
      r[j] = {const_cast<void*>(hp[2 * P + j]), static_cast<size_t>(C * c_row)};
    prefill(std::move(r), s);
  }
  // One call (more only past the 65535 batch entries a grid's z dimension holds).
  constexpr int64_t kMaxBatch = 65535;
  for (int64_t at = 0; at < P; at += kMaxBatch) {
    const int64_t nb = std::min(kMaxBatch, P - at);
    MOE_CUBLAS_CHECK(cublasGemmBatchedEx(
        blas_for(s, sm_target), fwd ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N,
        as_int(c_w, fwd ? "N" : "K"), as_int(C, "chunk rows"), as_int(a_w, fwd ? "K" : "N"), &alpha,
        dp + at, tab, as_int(N, "N"), dp + P + at, tab, as_int(a_w, "K"), &beta,
        const_cast<void* const*>(dp + 2 * P + at), tc, as_int(c_w, "N"), static_cast<int>(nb),
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  copy_rows(d_recs, Q, C, c_row, true, s);
  MOE_CUDA_CHECK(cudaEventRecord(slot.done, s));
  g_chunked_calls.fetch_add(1, std::memory_order_relaxed);
}

// Whether every pointer of a batched call is 16-byte aligned: cuBLAS cannot check the pointers of
// a device array, and its tensor-core kernels need the alignment. The pointers are bases plus
// multiples of a row of a, b or c, of one weight ([K, N]) or of 256 bytes (scratch).
bool chunked_aligned(size_t es_ab, const void* a,
                     const std::vector<std::pair<const void*, void*>>& bc, size_t es_c, int64_t K,
                     int64_t N) {
  const auto es = static_cast<int64_t>(es_ab), ec = static_cast<int64_t>(es_c);
  bool ok =
      K * es % 16 == 0 && N * es % 16 == 0 && K * ec % 16 == 0 && N * ec % 16 == 0 && aligned16(a);
  for (const auto& [b, c] : bc) ok = ok && aligned16(b) && aligned16(c);
  return ok;
}

// Groups above kLargeRows rows fill the GPU with their own product (at N = 2048, 9+ row tiles by
// 8 column tiles): chunked issues them one cublasGemmEx each, like `streams`, beside the batched
// call of the smaller groups.
constexpr int64_t kLargeRows = 1024;

// GemmImpl::sm90: the fwd / dgrad products of every (b, c) pair on our Hopper kernel
// (gpu/grouped_gemm_sm90.cuh), the bias (fwd only) added in its epilogue. The group offsets, the
// tile table and one zeroed schedule counter per launch go up through an upload slot. Returns
// false, having issued nothing, when the kernel cannot take a product (then the caller falls back
// to chunked).
std::atomic<int64_t> g_sm90_calls{0};

// wgrad on the sm90 kernel (sm90::ColGroupedProduct): uploads the groups with rows (16-byte
// records) and, per launch, their TMA descriptors (a_g's, then b_g's), in one copy.
bool run_sm90_wgrad(const GroupPlan& plan, DType ab, const void* a,
                    const std::vector<std::pair<const void*, void*>>& bc, DType c_type, int64_t K,
                    int64_t N, bool accumulate, Stream s) {
  sm90::ColGroupedProduct w;
  w.ab = ab;
  w.a = a;
  w.rows = plan.rows;
  w.mc = K;
  w.nc = N;
  w.groups = plan.groups();
  w.c_type = c_type;
  w.accumulate = accumulate;
  for (const auto& [b, c] : bc) {
    w.b = b;
    w.c = c;
    if (!sm90::supported(w)) return false;  // also: rows fit the records' int32
  }
  std::vector<sm90::WgradGroup> groups;
  int64_t tiles = 0;
  for (int64_t g = 0; g < plan.groups(); ++g) {
    if (plan.sizes[g] == 0) continue;
    groups.push_back({static_cast<int32_t>(g), static_cast<int32_t>(plan.offsets[g]),
                      static_cast<int32_t>(plan.offsets[g + 1]), 0});
    tiles += sm90::col_tiles_of_group(plan.sizes[g], K, N);
    w.max_group_rows = std::max(w.max_group_rows, plan.sizes[g]);
  }
  if (tiles > INT_MAX) return false;
  if (tiles == 0) return true;
  const int n = static_cast<int>(groups.size());
  constexpr size_t kMap = sm90::kMapBytes;
  const size_t maps_at = (groups.size() * sizeof(sm90::WgradGroup) + kMap - 1) / kMap * kMap;
  const size_t per_launch = 2 * static_cast<size_t>(n) * kMap;
  const size_t bytes = maps_at + bc.size() * per_launch;
  UploadSlot& slot = acquire_upload(bytes);
  std::memcpy(slot.host, groups.data(), groups.size() * sizeof(sm90::WgradGroup));
  for (size_t i = 0; i < bc.size(); ++i) {
    w.b = bc[i].first;
    sm90::encode_group_maps(w, groups.data(), n, slot.host + maps_at + i * per_launch);
  }
  MOE_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, bytes, cudaMemcpyHostToDevice, s));
  w.group_list = reinterpret_cast<const sm90::WgradGroup*>(slot.dev);
  w.groups_with_rows = n;
  w.tiles = static_cast<int32_t>(tiles);
  for (size_t i = 0; i < bc.size(); ++i) {
    w.b = bc[i].first;
    w.c = bc[i].second;
    w.maps = slot.dev + maps_at + i * per_launch;
    sm90::launch(w, s);
  }
  MOE_CUDA_CHECK(cudaEventRecord(slot.done, s));
  g_sm90_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// pair2: a second (a, b) pair summed into every product (sm90::RowGroupedProduct::a2);
// max_clusters: at most that many clusters for fwd / dgrad (0: as many as fit).
bool run_sm90(GemmRole role, const GroupPlan& plan, DType ab, const void* a,
              const std::vector<std::pair<const void*, void*>>& bc, DType c_type, int64_t K,
              int64_t N, bool accumulate, const void* bias, DType bias_type, Stream s,
              std::pair<const void*, const void*> pair2 = {nullptr, nullptr},
              int max_clusters = 0) {
  if (role == GemmRole::wgrad)
    return !bias && !pair2.first && run_sm90_wgrad(plan, ab, a, bc, c_type, K, N, accumulate, s);
  const int64_t G = plan.groups();
  sm90::RowGroupedProduct p;
  p.max_clusters = max_clusters;
  p.a2 = pair2.first;
  p.b2 = pair2.second;
  p.b_k_major = role == GemmRole::dgrad;
  p.ab = ab;
  p.a = a;
  p.rows = plan.rows;
  p.kc = role == GemmRole::fwd ? K : N;
  p.nc = role == GemmRole::fwd ? N : K;
  p.groups = G;
  p.c_type = c_type;
  p.accumulate = accumulate;
  p.bias = bias;
  p.bias_type = bias_type;
  // Throws on a bad MOE_SM90_TAIL: before anything is issued. Auto: the folding kernel only where
  // it pays (sm90::fold_tail_pays); fold: wherever a group folds; kernel: always (A/B).
  const int tail = sm90::fold_tail_setting();
  p.fold_tail =
      tail == 2 || (tail == 1 ? std::any_of(plan.sizes.begin(), plan.sizes.end(), sm90::folds_tail)
                              : tail < 0 && sm90::fold_tail_pays(plan.sizes.data(), G, p.nc));
  std::vector<int64_t> tile_start(G + 1, 0);  // the kernel's tile table, G + 1 prefix sums
  for (int64_t g = 0; g < G; ++g)
    tile_start[g + 1] = tile_start[g] + sm90::tiles_of_group(plan.sizes[g], p.nc, p.fold_tail);
  const int64_t tiles = tile_start[G];
  if (tiles > INT_MAX) return false;
  for (const auto& [b, c] : bc) {
    p.b = b;
    p.c = c;
    if (!sm90::supported(p)) return false;
  }
  if (tiles == 0) return true;
  // All three throw on a bad MOE_SM90_SCHED / MOE_SM90_BAND / MOE_SM90_MIX: before anything is
  // issued.
  const bool dynamic = sm90::dynamic_schedule();
  p.band = sm90::band_setting();
  p.wide_store = sm90::wide_store_setting();
  p.row_store = sm90::row_store_setting();
  p.narrow = sm90::narrow_setting();
  const std::vector<int32_t> order =
      sm90::mix_setting() ? sm90::mixed_order(plan.sizes.data(), tile_start.data(), G)
                          : std::vector<int32_t>{};
  // Layout: offsets (int64), tile table (int32), a counter per launch (int32, zero), the draw
  // order (int32, when mixed), padded to 8.
  const size_t off_bytes = static_cast<size_t>(G + 1) * sizeof(int64_t);
  const size_t cnt_at = off_bytes + static_cast<size_t>(G + 1) * sizeof(int32_t);
  const size_t order_at = cnt_at + bc.size() * sizeof(int32_t);
  const size_t bytes = (order_at + order.size() * sizeof(int32_t) + 7) / 8 * 8;
  UploadSlot& slot = acquire_upload(bytes);
  auto* h_off = reinterpret_cast<int64_t*>(slot.host);
  auto* h_tiles = reinterpret_cast<int32_t*>(slot.host + off_bytes);
  for (int64_t g = 0; g <= G; ++g) {
    h_off[g] = plan.offsets[g];
    h_tiles[g] = static_cast<int32_t>(tile_start[g]);
  }
  std::fill(slot.host + cnt_at, slot.host + bytes, char{0});
  if (!order.empty())
    std::memcpy(slot.host + order_at, order.data(), order.size() * sizeof(int32_t));
  MOE_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, bytes, cudaMemcpyHostToDevice, s));
  p.offsets = reinterpret_cast<const int64_t*>(slot.dev);
  p.tile_start = reinterpret_cast<const int32_t*>(slot.dev + off_bytes);
  p.order = order.empty() ? nullptr : reinterpret_cast<const int32_t*>(slot.dev + order_at);
  p.tiles = static_cast<int32_t>(tiles);
  auto* counters = reinterpret_cast<int32_t*>(slot.dev + cnt_at);
  for (size_t i = 0; i < bc.size(); ++i) {
    p.b = bc[i].first;
    p.c = bc[i].second;
    p.tile_counter = dynamic ? counters + i : nullptr;
    sm90::launch(p, s);
  }
  MOE_CUDA_CHECK(cudaEventRecord(slot.done, s));
  g_sm90_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The plan with only its large (above kLargeRows) or only its small groups; the others emptied,
// offsets unchanged.
GroupPlan masked(const GroupPlan& plan, bool large) {
  GroupPlan m = plan;
  m.used = 0;
  for (int64_t g = 0; g < plan.groups(); ++g) {
    if ((plan.sizes[g] > kLargeRows) != large) m.sizes[g] = 0;
    m.used += m.sizes[g];
  }
  return m;
}

// Rows per chunk: o.chunk_rows when set, else the size of {64, 128, 256, 512} with the least
// padded rows per unit of cuBLAS efficiency. The efficiencies are the measured rates of batched
// chunks of those sizes where padding is negligible (GemmBench, H100, Mixtral-like forward:
// 0.47, 0.62, 0.98, 1 of the 512-row rate); the padded rows are the plan's (every group rounded up
// to whole chunks).
int64_t chunk_rows(const GroupPlan& plan, const GemmOptions& o) {
  if (o.chunk_rows > 0) return o.chunk_rows;
  const int64_t sizes[] = {64, 128, 256, 512};
  const double eff[] = {0.47, 0.62, 0.98, 1.0};
  int64_t best = 256;
  double best_cost = -1;
  for (int i = 0; i < 4; ++i) {
    double rows = 0;
    for (int64_t n : plan.sizes)
      rows += static_cast<double>((n + sizes[i] - 1) / sizes[i] * sizes[i]);
    const double cost = rows / eff[i];
    if (best_cost < 0 || cost < best_cost) best = sizes[i], best_cost = cost;
  }
  return best;
}

// fwd / dgrad of GemmImpl::chunked: the small groups (<= kLargeRows rows) in one chunked batched
// call on the first forked stream, each large group as its own cublasGemmEx on the others, so
// the memory-bound small products overlap the compute-bound large ones.
void run_hybrid(GemmRole role, const GroupPlan& plan, size_t es_ab, const void* a,
                const std::vector<std::pair<const void*, void*>>& bc, DType ab, DType c_type,
                int64_t K, int64_t N, float beta, Stream s, const GemmOptions& o,
                int sm_target = 0) {
  const cudaDataType_t tab = cuda_type(ab), tc = cuda_type(c_type);
  const size_t es_c = dtype_size(c_type);
  const GroupPlan small = masked(plan, false), large = masked(plan, true);
  std::vector<Problem> big, zero_k;
  for (const auto& [b, c] : bc)
    build_problems(role, large, es_ab, a, b, es_c, c, K, N, big, zero_k);
  const int64_t C = chunk_rows(small, o);
  const bool accumulate = beta != 0.0f;
  if (big.empty())
    return run_chunked(role, small, es_ab, a, bc, tab, es_c, tc, K, N, accumulate, C, s, sm_target);
  if (small.used == 0) return run_streams(big, tab, tc, beta, s, aux_count(o), sm_target);
  const int count = std::max(2, aux_count(o));
  Fork f(count, static_cast<int>(std::min<size_t>(big.size() + 1, count)), s);
  run_chunked(role, small, es_ab, a, bc, tab, es_c, tc, K, N, accumulate, C, f[0], sm_target);
  for (size_t j = 0; j < big.size(); ++j) {
    const Stream st = f[1 + static_cast<int>(j % (count - 1))];
    gemm_ex(blas_for(st, sm_target), big[j], tab, tc, beta);
  }
  f.join();
}

}  // namespace

SplitShare split_share(int sms, int64_t streaming_groups, int64_t other_rows) {
  SplitShare r;
  const char* e = std::getenv("MOE_GEMM_SPLIT");
  if (e && std::strcmp(e, "off") == 0) return r;  // clusters 0: no split
  if (e && *e && std::strcmp(e, "auto") != 0) {
    // "c" or "c,t", decimal, nothing else.
    auto number = [](const char* p, char** end) {
      const bool digit = *p >= '0' && *p <= '9';
      const long v = digit ? std::strtol(p, end, 10) : -1;
      return v >= 0 && v <= INT_MAX ? static_cast<int>(v) : -1;
    };
    char* end = nullptr;
    r.clusters = number(e, &end);
    bool ok = r.clusters >= 1;
    const bool both = ok && *end == ',';
    if (both) {
      r.sm_target = number(end + 1, &end);
      ok = r.sm_target >= 0;
    }
    if (!ok || *end != '\0')
      throw std::invalid_argument(std::string("MOE_GEMM_SPLIT: expected auto, off, clusters "
                                              "or clusters,sms with clusters >= 1, got '") +
                                  e + "'");
    if (both) return r;
  } else {
    // In doubles (no overflow to mind), rounded to the nearest.
    const double g = static_cast<double>(std::max<int64_t>(streaming_groups, 0));
    const double rows = static_cast<double>(std::max<int64_t>(other_rows, 0));
    const double c = g * kSplitRows * sms / (rows + 2.0 * g * kSplitRows);
    const int most = std::max(1, sms / sm90::kClusterSize - 1);
    r.clusters = std::clamp(static_cast<int>(c + 0.5), 1, most);
  }
  r.sm_target = std::max(1, sms - sm90::kClusterSize * r.clusters);
  return r;
}

namespace {

// GemmImpl::split, fwd / dgrad: the streaming groups (at most sm90::kStreamRows rows) on the sm90
// kernel with split_share's clusters on the high-priority stream, the others at the same time
// through chunked's hybrid (run_hybrid: cuBLAS, planned for the SMs left). Each output row is
// written by one of the two, each deterministic: so is the whole. A plan of one kind runs whole
// on that kind's impl; where the kernel cannot take the product, everything runs as chunked.
void run_split(GemmRole role, const GroupPlan& plan, DType ab, const void* a,
               const std::vector<std::pair<const void*, void*>>& bc, DType c_type, int64_t K,
               int64_t N, bool accumulate, Stream s, const GemmOptions& o) {
  int dev = 0, sms = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  GroupPlan st = plan, rest = plan;  // the streaming groups; the others
  st.used = rest.used = 0;
  int64_t streaming = 0;
  for (int64_t g = 0; g < plan.groups(); ++g) {
    (plan.sizes[g] <= sm90::kStreamRows ? rest : st).sizes[g] = 0;
    streaming += st.sizes[g] > 0;
    st.used += st.sizes[g];
    rest.used += rest.sizes[g];
  }
  // Throws on a bad MOE_GEMM_SPLIT: nothing issued yet.
  const SplitShare share = split_share(sms, streaming, rest.used);
  const size_t es_ab = dtype_size(ab);
  const float beta = accumulate ? 1.0f : 0.0f;
  if (st.used == 0) return run_hybrid(role, plan, es_ab, a, bc, ab, c_type, K, N, beta, s, o);
  if ((rest.used == 0 || share.clusters == 0) &&
      run_sm90(role, plan, ab, a, bc, c_type, K, N, accumulate, nullptr, DType::f32, s))
    return;
  AuxStreams& aux = aux_streams(aux_count(o));
  if (!aux.split) {
    int least = 0, greatest = 0;
    MOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t x = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithPriority(&x, cudaStreamNonBlocking, greatest));
    aux.split = x;
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&aux.split_join, cudaEventDisableTiming));
  }
  MOE_CUDA_CHECK(cudaEventRecord(aux.fork, s));
  MOE_CUDA_CHECK(cudaStreamWaitEvent(aux.split, aux.fork, 0));
  // Issued first, so that its clusters hold their SMs before cuBLAS's grid fills the rest.
  if (!run_sm90(role, st, ab, a, bc, c_type, K, N, accumulate, nullptr, DType::f32, aux.split, {},
                share.clusters))
    return run_hybrid(role, plan, es_ab, a, bc, ab, c_type, K, N, beta, s, o);
  run_hybrid(role, rest, es_ab, a, bc, ab, c_type, K, N, beta, s, o, share.sm_target);
  MOE_CUDA_CHECK(cudaEventRecord(aux.split_join, aux.split));
  MOE_CUDA_CHECK(cudaStreamWaitEvent(s, aux.split_join, 0));
}

// A copy of `rows` rows of row_bytes from src into dst, then zero rows up to `total`.
struct PadCopy {
  char* dst;
  const char* src;
  int64_t rows, total, row_bytes;
};

// Block (record, row); 16-byte words (every row_bytes here is a multiple of 16).
__global__ void pad_rows_kernel(const PadCopy* __restrict__ recs) {
  const PadCopy pc = recs[blockIdx.x];
  const int64_t r = blockIdx.y;
  if (r >= pc.total) return;
  uint4* d = reinterpret_cast<uint4*>(pc.dst + r * pc.row_bytes);
  const uint4* src = reinterpret_cast<const uint4*>(pc.src + r * pc.row_bytes);
  const int64_t n = pc.row_bytes / 16;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    d[i] = r < pc.rows ? src[i] : uint4{0, 0, 0, 0};
}

// wgrad of GemmImpl::chunked. The large groups: one cublasGemmEx each on forked streams. The small
// ones are binned by their size rounded up to a multiple of 64 rows (kc); per bin, their rows of a
// and of every b are copied into zero-padded [kc, .] blocks, and ONE pointer-array
// cublasGemmBatchedEx computes c_g = a_pad^T b_pad (the zero rows add exact zeros, so each group's
// sum is that of its own rows; the contraction length is kc for every group of a bin). Each group
// is in exactly one call, the bins and the call order depend only on the plan: deterministic.
void run_wgrad_batched(const GroupPlan& plan, size_t es_ab, const void* a,
                       const std::vector<std::pair<const void*, void*>>& bc, DType ab, DType c_type,
                       int64_t K, int64_t N, float beta, Stream s, const GemmOptions& o) {
  const cudaDataType_t tab = cuda_type(ab), tc = cuda_type(c_type);
  const size_t es_c = dtype_size(c_type);
  const GroupPlan small = masked(plan, false), large = masked(plan, true);
  std::vector<Problem> big, zero_k;
  for (const auto& [b, c] : bc)
    build_problems(GemmRole::wgrad, large, es_ab, a, b, es_c, c, K, N, big, zero_k);
  if (small.used == 0 || K == 0 || N == 0) return run_streams(big, tab, tc, beta, s, aux_count(o));
  constexpr int64_t kBin = 64;
  std::map<int64_t, std::vector<int64_t>> bins;  // kc -> groups
  for (int64_t g = 0; g < small.groups(); ++g) {
    if (small.sizes[g] > 0) bins[(small.sizes[g] + kBin - 1) / kBin * kBin].push_back(g);
  }
  const int64_t np = static_cast<int64_t>(bc.size());
  const int64_t a_row = K * static_cast<int64_t>(es_ab), b_row = N * static_cast<int64_t>(es_ab);
  // Scratch: per bin, the padded blocks of a, then of each b.
  size_t bytes = 0, entries = 0, copies = 0;
  for (const auto& [kc, gs] : bins) {
    const auto n = static_cast<size_t>(gs.size());
    bytes += n * static_cast<size_t>(kc * (a_row + np * b_row));
    entries += n * np;
    copies += n * (1 + np);
  }
  const int count = std::max(2, aux_count(o));
  Fork f(count, big.empty() ? 1 : static_cast<int>(std::min<size_t>(big.size() + 1, count)), s);
  const Stream st = f[0];
  char* pad = static_cast<char*>(stream_arena(bytes, st));
  const size_t up_bytes = 3 * entries * sizeof(void*) + copies * sizeof(PadCopy);
  UploadSlot& slot = acquire_upload(up_bytes);
  auto** hp = reinterpret_cast<const void**>(slot.host);
  auto* recs = reinterpret_cast<PadCopy*>(slot.host + 3 * entries * sizeof(void*));
  size_t at = 0, e = 0, q = 0;
  std::vector<std::pair<int64_t, size_t>> calls;  // (kc, first entry)
  for (const auto& [kc, gs] : bins) {
    calls.push_back({kc, e});
    for (int64_t g : gs) {
      const int64_t o_g = small.offsets[g], n_g = small.sizes[g];
      char* ap = pad + at;
      at += static_cast<size_t>(kc * a_row);
      recs[q++] = {ap, static_cast<const char*>(a) + o_g * a_row, n_g, kc, a_row};
      for (int64_t p = 0; p < np; ++p) {
        char* bp = pad + at;
        at += static_cast<size_t>(kc * b_row);
        recs[q++] = {bp, static_cast<const char*>(bc[p].first) + o_g * b_row, n_g, kc, b_row};
        // Column-major C_g^T [N, K] = b_pad^T [N, kc] . a_pad [kc, K].
        hp[e] = bp;
        hp[entries + e] = ap;
        hp[2 * entries + e] =
            static_cast<char*>(bc[p].second) + g * K * N * static_cast<int64_t>(es_c);
        ++e;
      }
    }
  }
  MOE_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, up_bytes, cudaMemcpyHostToDevice, st));
  const auto* d_recs = reinterpret_cast<const PadCopy*>(slot.dev + 3 * entries * sizeof(void*));
  const int64_t max_kc = bins.rbegin()->first;
  pad_rows_kernel<<<dim3(static_cast<unsigned>(q), static_cast<unsigned>(max_kc)), kThreads, 0,
                    st>>>(d_recs);
  check_launch();
  auto** dp = reinterpret_cast<const void**>(slot.dev);
  // Each entry writes its group's whole [K, N] c.
  if (beta == 0.0f && gemm_detail::cublas_prefill_setting()) {
    std::vector<ByteRange> r(e);
    for (size_t j = 0; j < e; ++j)
      r[j] = {const_cast<void*>(hp[2 * entries + j]), static_cast<size_t>(K * N) * es_c};
    prefill(std::move(r), st);
  }
  const float alpha = 1.0f;
  for (size_t i = 0; i < calls.size(); ++i) {
    const int64_t kc = calls[i].first;
    const size_t first = calls[i].second,
                 n = (i + 1 < calls.size() ? calls[i + 1].second : e) - first;
    for (size_t done = 0; done < n; done += 65535) {
      const size_t nb = std::min<size_t>(65535, n - done);
      const size_t x = first + done;
      MOE_CUBLAS_CHECK(cublasGemmBatchedEx(
          blas_for(st), CUBLAS_OP_N, CUBLAS_OP_T, as_int(N, "N"), as_int(K, "K"),
          as_int(kc, "rows"), &alpha, dp + x, tab, as_int(N, "N"), dp + entries + x, tab,
          as_int(K, "K"), &beta, const_cast<void* const*>(dp + 2 * entries + x), tc, as_int(N, "N"),
          static_cast<int>(nb), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }
  MOE_CUDA_CHECK(cudaEventRecord(slot.done, st));
  g_chunked_calls.fetch_add(1, std::memory_order_relaxed);
  for (size_t j = 0; j < big.size(); ++j) {
    const Stream sj = f[1 + static_cast<int>(j % (count - 1))];
    gemm_ex(blas_for(sj), big[j], tab, tc, beta);
  }
  f.join();
}

void require_same_dtype(const DeviceTensor& t, DType d, const char* what) {
  if (t.dtype() != d) {
    throw std::invalid_argument(
        std::string(what) + ": dtype " + std::string(dtype_name(t.dtype())) + " differs from x's " +
        std::string(dtype_name(d)) + " (the CUDA twin multiplies operands of one dtype)");
  }
}

GroupedGemmShape validate(const DeviceTensor& x, const DeviceTensor& w, const DeviceTensor& gs,
                          const DeviceTensor* bias) {
  const TensorMeta bm = bias ? bias->meta() : TensorMeta{};
  return validate_grouped_gemm(x.meta(), w.meta(), gs.meta(), bias ? &bm : nullptr);
}

GroupedGemmShape validate_plan(const DeviceTensor& x, const DeviceTensor& w, const GroupPlan& plan,
                               const DeviceTensor* bias) {
  const TensorMeta bm = bias ? bias->meta() : TensorMeta{};
  const TensorMeta gm{DType::i64, {plan.groups()}};
  const GroupedGemmShape sh = validate_grouped_gemm(x.meta(), w.meta(), gm, bias ? &bm : nullptr);
  if (plan.rows != sh.rows) {
    throw std::invalid_argument("group_sizes: the plan is for " + std::to_string(plan.rows) +
                                " rows, x has " + std::to_string(sh.rows));
  }
  return sh;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string_view gemm_impl_name(GemmImpl impl) {
  switch (impl) {
    case GemmImpl::grouped:
      return "grouped";
    case GemmImpl::loop:
      return "loop";
    case GemmImpl::streams:
      return "streams";
    case GemmImpl::chunked:
      return "chunked";
    case GemmImpl::sm90:
      return "sm90";
    case GemmImpl::split:
      return "split";
    case GemmImpl::automatic:
      return "auto";
  }
  return "?";
}

GemmImpl parse_gemm_impl(std::string_view s) {
  if (s == "grouped") return GemmImpl::grouped;
  if (s == "loop") return GemmImpl::loop;
  if (s == "streams") return GemmImpl::streams;
  if (s == "chunked") return GemmImpl::chunked;
  if (s == "sm90") return GemmImpl::sm90;
  if (s == "split") return GemmImpl::split;
  if (s == "auto") return GemmImpl::automatic;
  throw std::invalid_argument("impl: unknown value '" + std::string(s) +
                              "' (expected grouped, loop, streams, chunked, sm90, split or auto)");
}

// automatic: chunked was 38% faster than streams on the DeepSeek-like uniform forward, within the
// run-to-run spread (about 10%) of the fastest elsewhere in GemmBench on an H100 (see
// gpu/grouped_gemm.cuh); cublasGemmGroupedBatchedEx ran at 31-38% of dense cuBLAS; sm90 beats
// chunked where the groups are small (kAutoSm90Rows).
GemmImpl gemm_impl_from_env(const char* value) {
  if (!value || !*value) return GemmImpl::automatic;
  try {
    return parse_gemm_impl(value);
  } catch (const std::invalid_argument& err) {
    throw std::invalid_argument(std::string("MOE_GEMM_IMPL: ") + err.what());
  }
}

bool auto_prefers_sm90(const GroupPlan& plan, int64_t max_rows) {
  int64_t small = 0;  // rows in groups of at most max_rows rows
  for (const int64_t n : plan.sizes) small += n <= max_rows ? n : 0;
  return 2 * small >= plan.used;
}

namespace {
// A plan's non-empty groups by kind: 0 streaming (at most sm90::kStreamRows rows), 1 up to
// sm90::kDenseRows, 2 dense; their counts and rows, the empty groups and the largest.
struct PlanKinds {
  int64_t count[3] = {0, 0, 0}, rows[3] = {0, 0, 0}, empty = 0, largest = 0;
};
PlanKinds plan_kinds(const GroupPlan& plan) {
  PlanKinds k;
  for (const int64_t n : plan.sizes) {
    k.largest = std::max(k.largest, n);
    if (n == 0) {
      ++k.empty;
      continue;
    }
    const int i = n <= sm90::kStreamRows ? 0 : n <= sm90::kDenseRows ? 1 : 2;
    ++k.count[i];
    k.rows[i] += n;
  }
  return k;
}

// Whether the plan has a dense group and streaming ones whose weights take at least 1 / factor
// as long to stream as the others' products at the dense rate: factor x (streaming groups) x
// kAutoRidgeRows >= (other rows).
bool mixes_at_least(const GroupPlan& plan, int64_t factor) {
  const PlanKinds k = plan_kinds(plan);
  const int64_t streaming = k.count[0], other_rows = k.rows[1] + k.rows[2];
  return k.count[2] > 0 && streaming > 0 && factor * streaming * kAutoRidgeRows >= other_rows;
}
}  // namespace

bool auto_mixes_for_sm90(const GroupPlan& plan) {
  return mixes_at_least(plan, 2);
}

bool auto_splits(const GroupPlan& plan) {
  return mixes_at_least(plan, kAutoSplitFactor);
}

namespace {
// automatic's two rules for one role, without the availability of the kernel.
bool auto_takes_sm90(const GroupPlan& plan, int64_t max_rows) {
  return auto_prefers_sm90(plan, max_rows) || auto_mixes_for_sm90(plan);
}
}  // namespace

GemmImpl resolve_gemm_impl(GemmImpl impl, GemmRole role, const GroupPlan& plan,
                           bool wgrad_tma_epilogue) {
  if (impl == GemmImpl::split && role == GemmRole::wgrad) impl = GemmImpl::automatic;
  if (impl != GemmImpl::automatic) return impl;
  if (!sm90::available()) return GemmImpl::chunked;
  if (role == GemmRole::wgrad)
    return wgrad_tma_epilogue && auto_takes_sm90(plan, kAutoWgradRows) ? GemmImpl::sm90
                                                                       : GemmImpl::chunked;
  if (auto_splits(plan)) return GemmImpl::split;
  return auto_prefers_sm90(plan, kAutoSm90Rows) ? GemmImpl::sm90 : GemmImpl::chunked;
}

GemmImpl resolve_pair_impl(GemmImpl impl, const GroupPlan& plan) {
  if (impl != GemmImpl::automatic) return impl;
  return sm90::available() && auto_takes_sm90(plan, kAutoPairRows) ? GemmImpl::sm90
                                                                   : GemmImpl::chunked;
}

bool sm90_wgrad_from_env() {
  const char* e = std::getenv("MOE_SM90_WGRAD");
  if (!e || !*e || std::strcmp(e, "cublas") == 0) return false;
  if (std::strcmp(e, "kernel") == 0) return true;
  throw std::invalid_argument(std::string("MOE_SM90_WGRAD: expected kernel or cublas, got '") + e +
                              "'");
}

GemmImpl default_gemm_impl() {
  // Read once: MOE_GEMM_IMPL runs the FFN or the block, whose callers take the default, on
  // another impl.
  static const GemmImpl d = gemm_impl_from_env(std::getenv("MOE_GEMM_IMPL"));
  return d;
}

GroupPlan make_group_plan(const std::vector<int64_t>& sizes, int64_t rows) {
  GroupPlan p;
  p.used = check_group_sizes(sizes, rows);
  p.rows = rows;
  p.sizes = sizes;
  p.offsets.assign(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) p.offsets[g + 1] = p.offsets[g] + sizes[g];
  return p;
}

GroupPlan read_group_plan(const DeviceTensor& group_sizes, int64_t rows, Stream s) {
  require_rank(group_sizes.meta(), 1, "group_sizes");
  const int64_t G = group_sizes.dim(0);
  const bool i64 = group_sizes.dtype() == DType::i64;
  if (!i64 && group_sizes.dtype() != DType::i32) {
    throw std::invalid_argument("group_sizes: unsupported dtype " +
                                std::string(dtype_name(group_sizes.dtype())) +
                                " (expected int32 or int64)");
  }
  std::vector<int64_t> sizes(static_cast<size_t>(G));
  if (G == 0) {
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    return make_group_plan(sizes, rows);
  }
  // Into pinned memory (an upload slot, free once acquired), not pageable memory, which the
  // driver stages through a buffer of its own; the device idles while the host waits here. The
  // host times (GemmBench.HostTimeOfOneCall, 18-49 us a read either way on the H100) vary more
  // than this changes them (docs/perf.md, session 25).
  const size_t es = i64 ? sizeof(int64_t) : sizeof(int32_t);
  UploadSlot& slot = acquire_upload(static_cast<size_t>(G) * es);
  MOE_CUDA_CHECK(cudaMemcpyAsync(slot.host, group_sizes.data(), G * es, cudaMemcpyDeviceToHost, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  for (int64_t g = 0; g < G; ++g) {
    sizes[g] = i64 ? reinterpret_cast<const int64_t*>(slot.host)[g]
                   : reinterpret_cast<const int32_t*>(slot.host)[g];
  }
  return make_group_plan(sizes, rows);
}

void release_gemm_resources() noexcept {
  StateRegistry::get().release_all();
}

namespace {
const char* role_name(GemmRole r) {
  switch (r) {
    case GemmRole::fwd:
      return "fwd";
    case GemmRole::dgrad:
      return "dgrad";
    case GemmRole::wgrad:
      return "wgrad";
  }
  return "?";
}

// MOE_GEMM_TRACE=1: each distinct product (gemm_detail::product_trace_line) is printed once to
// stderr, for finding which impl a layer's products take; unset, empty or 0: nothing. Anything
// else throws std::invalid_argument naming the variable, before any work.
void trace_product(const char* what, GemmRole role, const GroupPlan& plan, int64_t K, int64_t N,
                   GemmImpl impl) {
  const char* e = std::getenv("MOE_GEMM_TRACE");
  if (!e || !*e || std::strcmp(e, "0") == 0) return;
  if (std::strcmp(e, "1") != 0)
    throw std::invalid_argument(std::string("MOE_GEMM_TRACE: expected 0 or 1, got '") + e + "'");
  const std::string line = gemm_detail::product_trace_line(what, role, plan, K, N, impl);
  static std::mutex m;
  static std::set<std::string> seen;
  const std::lock_guard<std::mutex> lock(m);
  if (seen.insert(line).second) std::fprintf(stderr, "%s\n", line.c_str());
}
}  // namespace

namespace gemm_detail {

std::string product_trace_line(const char* what, GemmRole role, const GroupPlan& plan, int64_t K,
                               int64_t N, GemmImpl impl) {
  const PlanKinds kinds = plan_kinds(plan);
  auto bucket = [&](const std::string& name, int k) {
    return name + " " + std::to_string(kinds.count[k]) + " (" + std::to_string(kinds.rows[k]) +
           " rows)";
  };
  return std::string("moe gemm: ") + what + " " + role_name(role) + " K=" + std::to_string(K) +
         " N=" + std::to_string(N) + " rows=" + std::to_string(plan.used) +
         " groups=" + std::to_string(plan.groups()) + ": " +
         bucket("<=" + std::to_string(sm90::kStreamRows), 0) + ", " +
         bucket("<=" + std::to_string(sm90::kDenseRows), 1) + ", " + bucket("dense", 2) +
         ", empty " + std::to_string(kinds.empty) + ", largest " + std::to_string(kinds.largest) +
         "; impl=" + std::string(gemm_impl_name(impl));
}

DevicePlan::DevicePlan(const GroupPlan& plan, Stream s) : s_(s) {
  const size_t bytes = plan.offsets.size() * sizeof(int64_t);
  offsets_ = static_cast<int64_t*>(malloc_async(bytes, s));
  MOE_CUDA_CHECK(cudaMemcpyAsync(offsets_, plan.offsets.data(), bytes, cudaMemcpyHostToDevice, s));
}

DevicePlan::~DevicePlan() {
  if (offsets_) cudaFreeAsync(offsets_, s_);
}

Scratch::Scratch(size_t bytes, Stream s) : s_(s) {
  if (bytes > 0) p_ = malloc_async(bytes, s);
}

Scratch::~Scratch() {
  if (p_) cudaFreeAsync(p_, s_);
}

void grouped_products(GemmRole role, const GroupPlan& plan, DType ab, const void* a,
                      const std::vector<std::pair<const void*, void*>>& bc, DType c_type, int64_t K,
                      int64_t N, bool accumulate, Stream s, const GemmOptions& o) {
  // automatic sends wgrad to the sm90 kernel only where its TMA-store epilogue runs: a 16-bit
  // gradient written, not accumulated.
  const GemmImpl impl = resolve_gemm_impl(o.impl, role, plan, c_type == ab && !accumulate);
  trace_product(bc.size() > 1 ? "products" : "product", role, plan, K, N, impl);
  // wgrad writes every group's c_g, an empty group's as exactly 0 [DECISION]: one memset per run
  // of empty groups, before any path (no kernel or cuBLAS call is asked to write them). As zero
  // tiles in the sm90 kernel's table they made the DeepSeek-like block 2.4% slower, and no faster
  // placed last (docs/experiments/wgrad-zero-tiles.patch; docs/perf.md, session 46).
  if (!accumulate && role == GemmRole::wgrad) {
    for (const auto& bc_i : bc) zero_empty_groups(plan, bc_i.second, K * N, dtype_size(c_type), s);
  }
  // sm90 first: its own tables; cuBLAS's problem list (one entry a group) only where it falls
  // back. Empty contractions (K or N 0) are never the kernel's.
  if (impl == GemmImpl::sm90 && K > 0 && N > 0 &&
      (role != GemmRole::wgrad || o.sm90_wgrad || o.impl == GemmImpl::automatic ||
       o.impl == GemmImpl::split) &&
      run_sm90(role, plan, ab, a, bc, c_type, K, N, accumulate, nullptr, DType::f32, s))
    return;
  const cudaDataType_t tab = cuda_type(ab), tc = cuda_type(c_type);
  const float beta = accumulate ? 1.0f : 0.0f;
  std::vector<Problem> ps, zero_k;
  for (const auto& [b, c] : bc) {
    build_problems(role, plan, dtype_size(ab), a, b, dtype_size(c_type), c, K, N, ps, zero_k);
  }
  if (!accumulate && role != GemmRole::wgrad) {
    // An empty contraction (K = 0 or N = 0) writes C = 0; cuBLAS may return without touching C.
    // wgrad's empty contractions are the empty groups, zeroed above.
    const size_t es = dtype_size(c_type);
    for (const Problem& p : zero_k) {
      MOE_CUDA_CHECK(cudaMemset2DAsync(p.c, static_cast<size_t>(p.ldc) * es, 0,
                                       static_cast<size_t>(p.m) * es, static_cast<size_t>(p.n), s));
    }
  }
  if (ps.empty()) return;
  switch (impl) {
    case GemmImpl::grouped:
      return run_grouped(ps, tab, tc, beta, s);
    case GemmImpl::loop:
      return run_loop(ps, tab, tc, beta, s);
    case GemmImpl::streams:
      return run_streams(ps, tab, tc, beta, s, aux_count(o));
    case GemmImpl::split:  // fwd, dgrad (wgrad resolves as automatic)
      if (chunked_aligned(dtype_size(ab), a, bc, dtype_size(c_type), K, N))
        return run_split(role, plan, ab, a, bc, c_type, K, N, accumulate, s, o);
      return run_streams(ps, tab, tc, beta, s, aux_count(o));
    case GemmImpl::sm90:  // where the kernel does not take the product (tried above)
      [[fallthrough]];
    case GemmImpl::automatic:  // resolved above; not reached
    case GemmImpl::chunked:
      if (!chunked_aligned(dtype_size(ab), a, bc, dtype_size(c_type), K, N)) {
        return run_streams(ps, tab, tc, beta, s, aux_count(o));
      }
      if (role != GemmRole::wgrad) {
        return run_hybrid(role, plan, dtype_size(ab), a, bc, ab, c_type, K, N, beta, s, o);
      }
      if (o.batched_wgrad) {
        return run_wgrad_batched(plan, dtype_size(ab), a, bc, ab, c_type, K, N, beta, s, o);
      }
      return run_streams(ps, tab, tc, beta, s, aux_count(o));
  }
}

void grouped_product(GemmRole role, const GroupPlan& plan, DType ab, const void* a, const void* b,
                     DType c_type, void* c, int64_t K, int64_t N, bool accumulate, Stream s,
                     const GemmOptions& o) {
  grouped_products(role, plan, ab, a, {{b, c}}, c_type, K, N, accumulate, s, o);
}

bool grouped_product_sum(GemmRole role, const GroupPlan& plan, DType ab, const void* a,
                         const void* b, const void* a2, const void* b2, DType c_type, void* c,
                         int64_t K, int64_t N, Stream s, const GemmOptions& o) {
  if (role == GemmRole::wgrad || K <= 0 || N <= 0) return false;
  // split takes the sum whole on sm90: cuBLAS has no product of two operand pairs.
  const GemmImpl impl = resolve_pair_impl(o.impl, plan);
  if (impl != GemmImpl::sm90 && impl != GemmImpl::split) return false;
  trace_product("pair", role, plan, K, N, impl);
  return run_sm90(role, plan, ab, a, {{b, c}}, c_type, K, N, false, nullptr, DType::f32, s,
                  {a2, b2});
}

void grouped_product(GemmRole role, const GroupPlan& plan, DType ab, const void* a, const void* b,
                     DType c_type, void* c, int64_t K, int64_t N, bool accumulate, Stream s,
                     GemmImpl impl) {
  GemmOptions o;
  o.impl = impl;
  grouped_product(role, plan, ab, a, b, c_type, c, K, N, accumulate, s, o);
}

void bias_epilogue(const GroupPlan& plan, const DevicePlan& dplan, const float* acc,
                   const void* bias, DType bias_dtype, void* out, DType out_dtype, int64_t N,
                   Stream s) {
  zero_tail_rows(plan, out, N, dtype_size(out_dtype), s);
  if (plan.used == 0 || N == 0) return;
  dispatch_float2(out_dtype, bias ? bias_dtype : DType::f32, [&](auto to, auto tb) {
    using TO = decltype(to);
    using TB = decltype(tb);
    bias_epilogue_kernel<TO, TB><<<static_cast<unsigned>(plan.used), kThreads, 0, s>>>(
        acc, static_cast<const TB*>(bias), static_cast<TO*>(out), dplan.offsets(),
        static_cast<int>(plan.groups()), N);
  });
  check_launch();
}

void group_column_sums(const GroupPlan& plan, const DevicePlan& dplan, const void* src,
                       DType src_dtype, int64_t N, void* dst, DType dst_dtype, Stream s) {
  const int64_t G = plan.groups();
  if (G == 0 || N == 0) return;
  const dim3 grid(static_cast<unsigned>((N + 31) / 32), static_cast<unsigned>(G));
  dispatch_float2(src_dtype, dst_dtype, [&](auto ts, auto td) {
    using TS = decltype(ts);
    using TD = decltype(td);
    column_sums_kernel<TS, TD><<<grid, dim3(32, 8), 0, s>>>(
        static_cast<const TS*>(src), static_cast<TD*>(dst), dplan.offsets(), N);
  });
  check_launch();
}

void zero_empty_groups(const GroupPlan& plan, void* t, int64_t per_group, size_t elem_size,
                       Stream s) {
  const int64_t G = plan.groups();
  const size_t bytes = static_cast<size_t>(per_group) * elem_size;
  if (bytes == 0) return;
  for (int64_t g = 0; g < G;) {  // one memset per run of consecutive empty groups
    if (plan.sizes[g] != 0) {
      ++g;
      continue;
    }
    int64_t e = g;
    while (e < G && plan.sizes[e] == 0) ++e;
    MOE_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t) + g * bytes, 0, (e - g) * bytes, s));
    g = e;
  }
}

void zero_tail_rows(const GroupPlan& plan, void* t, int64_t cols, size_t elem_size, Stream s) {
  const size_t row = static_cast<size_t>(cols) * elem_size;
  const int64_t tail = plan.rows - plan.used;
  if (tail <= 0 || row == 0) return;
  MOE_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t) + plan.used * row, 0, tail * row, s));
}

void poison(DeviceTensor& t, Stream s) {
  t.fill_bytes(0xFF, s);
}

void fill_hash_uniform(DeviceTensor& t, uint64_t seed, double lo, double hi, Stream s) {
  if (t.numel() == 0) return;
  dispatch_float(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    fill_hash_kernel<T>
        <<<grid_for(t.numel()), kThreads, 0, s>>>(t.data<T>(), t.numel(), seed, lo, hi);
  });
  check_launch();
}

double hash_uniform_value(DType d, uint64_t seed, int64_t index, double lo, double hi) {
  return round_to(d, lo + (hi - lo) * hash_unit(seed, index));
}

std::vector<double> gather_values(const DeviceTensor& t, const std::vector<int64_t>& index,
                                  Stream s) {
  const int64_t n = static_cast<int64_t>(index.size());
  std::vector<double> out(index.size());
  if (n == 0) return out;
  for (int64_t i : index) {
    if (i < 0 || i >= t.numel()) {
      throw std::invalid_argument("index: " + std::to_string(i) + " outside " + t.describe());
    }
  }
  Scratch idx(n * sizeof(int64_t), s), vals(n * sizeof(double), s);
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(idx.get(), index.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice, s));
  dispatch_float(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    gather_kernel<T><<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        t.data<T>(), idx.as<int64_t>(), vals.as<double>(), n);
  });
  check_launch();
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(out.data(), vals.get(), n * sizeof(double), cudaMemcpyDeviceToHost, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return out;
}

void copy_device(void* dst, const void* src, size_t bytes, Stream s) {
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
}

int64_t sm90_kernel_calls() {
  return g_sm90_calls.load();
}

ResourceCounts resource_counts() {
  return StateRegistry::get().counts();
}

bool cublas_prefill_setting() {
  return !two_way_setting("MOE_CUBLAS_PREFILL", "off", "zero");
}

int64_t cublas_prefill_memsets() {
  return g_prefill_memsets.load(std::memory_order_relaxed);
}

// Overlapping ranges share a byte, so they lie in one allocation and one memset may cover them;
// touching ones may not (small cudaMallocs and a pool's blocks sit side by side:
// docs/experiments/memset-span-probe.cu, session 48, H200).
std::vector<ByteRange> prefill_runs(std::vector<ByteRange> r) {
  const auto at = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  std::sort(r.begin(), r.end(),
            [&](const ByteRange& a, const ByteRange& b) { return at(a.p) < at(b.p); });
  std::vector<ByteRange> runs;
  for (size_t i = 0; i < r.size();) {
    const uintptr_t lo = at(r[i].p);
    uintptr_t hi = lo + r[i].n;
    size_t j = i + 1;
    for (; j < r.size() && at(r[j].p) < hi; ++j) hi = std::max(hi, at(r[j].p) + r[j].n);
    if (hi > lo) runs.push_back({r[i].p, static_cast<size_t>(hi - lo)});
    i = j;
  }
  return runs;
}

int64_t chunked_batched_calls() {
  return g_chunked_calls.load(std::memory_order_relaxed);
}

double median_ms(const std::function<void()>& fn, int warmup, int reps, Stream s) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(reps));
  for (auto& e : ev) MOE_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    MOE_CUDA_CHECK(cudaEventRecord(ev[2 * i], s));
    fn();
    MOE_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], s));
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> ms(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return reps > 0 ? ms[ms.size() / 2] : 0.0;
}

}  // namespace gemm_detail

// ---------------------------------------------------------------------------------------------
// grouped_gemm

void grouped_gemm_fwd_into(const DeviceTensor& x, const DeviceTensor& w, const GroupPlan& plan,
                           const DeviceTensor* bias, DeviceTensor& out, Stream s,
                           const GemmOptions& o) {
  const GroupedGemmShape sh = validate_plan(x, w, plan, bias);
  require_shape(out.meta(), {sh.rows, sh.n}, "out");
  require_same_dtype(out, x.dtype(), "out");
  if (o.poison) gemm_detail::poison(out, s);
  if (out.numel() == 0) return;
  if (!bias) {
    gemm_detail::zero_tail_rows(plan, out.data(), sh.n, dtype_size(out.dtype()), s);
    gemm_detail::grouped_product(GemmRole::fwd, plan, x.dtype(), x.data(), w.data(), out.dtype(),
                                 out.data(), sh.k, sh.n, false, s, o);
    return;
  }
  // rnd_d(sum + bias) with one rounding: in the sm90 kernel's epilogue, or an fp32 accumulator
  // and the bias epilogue. split runs a biased forward whole on sm90 (cuBLAS would need the fp32
  // accumulator and a pass over it).
  const GemmImpl impl = resolve_gemm_impl(o.impl, GemmRole::fwd, plan);
  if (impl == GemmImpl::sm90 || impl == GemmImpl::split) {
    gemm_detail::zero_tail_rows(plan, out.data(), sh.n, dtype_size(out.dtype()), s);
    if (run_sm90(GemmRole::fwd, plan, x.dtype(), x.data(), {{w.data(), out.data()}}, out.dtype(),
                 sh.k, sh.n, false, bias->data(), bias->dtype(), s))
      return;
  }
  Scratch acc(static_cast<size_t>(plan.used * sh.n) * sizeof(float), s);
  gemm_detail::grouped_product(GemmRole::fwd, plan, x.dtype(), x.data(), w.data(), DType::f32,
                               acc.get(), sh.k, sh.n, false, s, o);
  const DevicePlan dplan(plan, s);
  gemm_detail::bias_epilogue(plan, dplan, acc.as<float>(), bias->data(), bias->dtype(), out.data(),
                             out.dtype(), sh.n, s);
}

DeviceTensor grouped_gemm_fwd(const DeviceTensor& x, const DeviceTensor& w,
                              const DeviceTensor& group_sizes, const DeviceTensor* bias, Stream s,
                              const GemmOptions& o) {
  const GroupedGemmShape sh = validate(x, w, group_sizes, bias);
  const GroupPlan plan = read_group_plan(group_sizes, sh.rows, s);
  DeviceTensor out(x.dtype(), {sh.rows, sh.n});
  grouped_gemm_fwd_into(x, w, plan, bias, out, s, o);
  return out;
}

void grouped_gemm_bwd_into(const DeviceTensor& grad_out, const DeviceTensor& x,
                           const DeviceTensor& w, const GroupPlan& plan, const DeviceTensor* bias,
                           GroupedGemmBwd& out, Stream s, const GemmOptions& o) {
  const GroupedGemmShape sh = validate_plan(x, w, plan, bias);
  require_shape(grad_out.meta(), {sh.rows, sh.n}, "grad_out");
  require_same_dtype(grad_out, x.dtype(), "grad_out");
  require_shape(out.grad_x.meta(), {sh.rows, sh.k}, "grad_x");
  require_shape(out.grad_w.meta(), {sh.groups, sh.k, sh.n}, "grad_w");
  if (bias) {
    if (!out.grad_bias) throw std::invalid_argument("grad_bias: missing for a biased product");
    require_shape(out.grad_bias->meta(), {sh.groups, sh.n}, "grad_bias");
  }
  if (o.poison) {
    gemm_detail::poison(out.grad_x, s);
    gemm_detail::poison(out.grad_w, s);
    if (out.grad_bias) gemm_detail::poison(*out.grad_bias, s);
  }
  const DType d = x.dtype();
  if (out.grad_x.numel() > 0) {
    gemm_detail::zero_tail_rows(plan, out.grad_x.data(), sh.k, dtype_size(d), s);
    gemm_detail::grouped_product(GemmRole::dgrad, plan, d, grad_out.data(), w.data(), d,
                                 out.grad_x.data(), sh.k, sh.n, false, s, o);
  }
  if (out.grad_w.numel() > 0) {
    // An empty group's gradient is exactly 0 [DECISION], written by grouped_product.
    gemm_detail::grouped_product(GemmRole::wgrad, plan, d, x.data(), grad_out.data(), d,
                                 out.grad_w.data(), sh.k, sh.n, false, s, o);
  }
  if (bias && out.grad_bias->numel() > 0) {
    const DevicePlan dplan(plan, s);
    gemm_detail::group_column_sums(plan, dplan, grad_out.data(), d, sh.n, out.grad_bias->data(),
                                   out.grad_bias->dtype(), s);
  }
}

GroupedGemmBwd grouped_gemm_bwd(const DeviceTensor& grad_out, const DeviceTensor& x,
                                const DeviceTensor& w, const DeviceTensor& group_sizes,
                                const DeviceTensor* bias, Stream s, const GemmOptions& o) {
  const GroupedGemmShape sh = validate(x, w, group_sizes, bias);
  require_shape(grad_out.meta(), {sh.rows, sh.n}, "grad_out");
  require_same_dtype(grad_out, x.dtype(), "grad_out");
  const GroupPlan plan = read_group_plan(group_sizes, sh.rows, s);
  GroupedGemmBwd out;
  out.grad_x = DeviceTensor(x.dtype(), {sh.rows, sh.k});
  out.grad_w = DeviceTensor(w.dtype(), {sh.groups, sh.k, sh.n});
  if (bias) out.grad_bias = DeviceTensor(bias->dtype(), {sh.groups, sh.n});
  grouped_gemm_bwd_into(grad_out, x, w, plan, bias, out, s, o);
  return out;
}

void dense_gemm(GemmRole role, const DeviceTensor& a, const DeviceTensor& b, DeviceTensor& c,
                Stream s) {
  require_rank(a.meta(), 2, "a");
  require_rank(b.meta(), 2, "b");
  require_rank(c.meta(), 2, "c");
  require_same_dtype(b, a.dtype(), "b");
  int64_t M = 0, K = 0, N = 0;
  switch (role) {
    case GemmRole::fwd:  // a [M,K], b [K,N], c [M,N]
      M = a.dim(0), K = a.dim(1), N = b.dim(1);
      require_shape(b.meta(), {K, N}, "b");
      require_shape(c.meta(), {M, N}, "c");
      break;
    case GemmRole::dgrad:  // a [M,N], b [K,N], c [M,K]
      M = a.dim(0), N = a.dim(1), K = b.dim(0);
      require_shape(b.meta(), {K, N}, "b");
      require_shape(c.meta(), {M, K}, "c");
      break;
    case GemmRole::wgrad:  // a [M,K], b [M,N], c [K,N]
      M = a.dim(0), K = a.dim(1), N = b.dim(1);
      require_shape(b.meta(), {M, N}, "b");
      require_shape(c.meta(), {K, N}, "c");
      break;
  }
  const GroupPlan one = make_group_plan({M}, M);
  gemm_detail::grouped_product(role, one, a.dtype(), a.data(), b.data(), c.dtype(), c.data(), K, N,
                               false, s, GemmImpl::loop);
}

}  // namespace moe::gpu
