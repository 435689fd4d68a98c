// Timing helpers for `moe-harness bench` and any op's benchmark (STYLE 11: verify, then time with
// CUDA events after warm-up, report the median and the ratio to a limit measured in the same
// run). No CUDA types in this header.
//
// Methodology:
//  - launch(i) enqueues one run of the op on the given stream; i counts launches so the caller can
//    rotate among several input/output sets whose total exceeds the L2 cache (small cases would
//    otherwise be timed out of L2, which real training steps do not enjoy);
//  - one sample = `per_sample` back-to-back launches between two events (so launch gaps are
//    amortised as in a training step, and sub-microsecond event resolution does not matter);
//    time_launches_auto captures those launches into a CUDA graph on bench_stream() and times its
//    replays, so microsecond kernels are timed on the GPU rather than at the CPU's launch rate
//    (the benchmark's launch functions must enqueue on bench_stream(); where one does not, the
//    capture is empty or fails and timing falls back to direct launches);
//  - the statistic is over >= 20 samples, per launch: median, min, max;
//  - each sample's events also wait for the legacy default stream, so a launch function that
//    enqueues there (stream nullptr) is still timed, by direct launches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu/runtime.cuh"

namespace moe::gpu {

struct TimingStats {
  double median_ms = 0, min_ms = 0, max_ms = 0;  // per launch
  int samples = 0, per_sample = 0;
  bool graph = false;  // timed as CUDA graph replays
};

// The stream benchmark launches go to (created on first use, non-blocking).
Stream bench_stream();

// Sustained warm-up, process-wide (`bench --sustain-ms`): before the samples of every helper
// below, the launches run untimed, synchronised every few, until `ms` of wall time has passed
// (0, the default: the fixed warm-up launches alone). An H100 at its 700 W limit runs a burst
// faster than a sustained load: the DeepSeek-like grouped forward's median read 3.48 ms right
// after idle and 3.62-3.86 ms a few seconds later, the same code in one call (docs/perf.md,
// session 25). Samples taken after a sustained warm-up are what a training step sees.
void set_sustain_ms(double ms);
double sustain_ms();

// Times launch(i). warmup launches first (not timed), then `samples` samples of `per_sample`
// launches each.
TimingStats time_launches(const std::function<void(int)>& launch, int warmup, int samples,
                          int per_sample, Stream s = nullptr);

// On bench_stream(), per_sample chosen so that one sample lasts at least min_sample_ms (from a
// short calibration run, capped at max_per_sample), each sample one replay of a CUDA graph of
// per_sample launches when capture works (see above), direct launches otherwise. allow_graph =
// false: direct launches only (a launch function that may synchronise or allocate, such as a
// plugin's run, must not be captured).
TimingStats time_launches_auto(const std::function<void(int)>& launch, int samples = 25,
                               double min_sample_ms = 1.0, int max_per_sample = 1000,
                               bool allow_graph = true);

// Device-to-device copy bandwidth, counting bytes read plus bytes written (cudaMemcpyAsync of a
// `bytes` buffer into another; the source is filled first so nothing reads uninitialised memory).
struct CopyBandwidth {
  double gbps = 0;  // (2 * bytes) / median time, in 1e9 bytes per second
  double bytes = 0;
  TimingStats t;
};
CopyBandwidth measure_copy_bandwidth(size_t bytes = size_t{1} << 30, int samples = 25,
                                     Stream s = nullptr);

// The copy kernel of time_copy_of (bulk copies through shared memory, sm_90): `bytes` from src to
// dst on stream s. bytes and both addresses must be multiples of 16 (else invalid_argument).
void copy_kernel(void* dst, const void* src, size_t bytes, Stream s = nullptr);

// A copy of an op's size, timed as the op is: `bytes` moved in all (bytes / 2 read, bytes / 2
// written, rounded up to 16 bytes) over rotation_sets(bytes) buffer pairs, two ways:
// cudaMemcpyAsync launched directly (captured in a CUDA graph it ran 20% slower on an H100), and
// copy_kernel with time_launches_auto (graph replays).
// The faster of the two is what a memory-bound kernel of that size can be held to: launch,
// ramp-up and tail cost it as they cost the op, which the 1 GiB copy above hides. `empty` times
// a kernel that moves nothing, chained by programmatic dependent launch (one block; the floor of
// any kernel's time in this harness). Its buffers are freed before it returns.
struct SizedCopy {
  TimingStats memcpy, kernel, empty;
  double median_ms = 0;  // the smaller of memcpy's and kernel's medians
};
SizedCopy time_copy_of(double bytes, int samples = 25);

// The dense baseline of GEMM-like ops: one cublasGemmEx of m x k x n in dtype d (row-major, fp32
// accumulation, no reduced-precision split-K reductions and a fixed 32 MiB workspace: the settings
// of gpu/grouped_gemm.cuh), operands filled with seeded uniform values, timed on bench_stream()
// with time_launches_auto:
//   fwd      c[m,n] = a[m,k] . b[k,n]                                               2mkn FLOPs
//   fwd_bwd  fwd, then dgrad da[m,k] = g[m,n] . b^T and wgrad db[k,n] = a^T . g     6mkn FLOPs
// Its buffers (a few GB at the issue's shapes) are freed before it returns.
struct DenseGemmTiming {
  int64_t m = 0, k = 0, n = 0;
  TimingStats fwd, fwd_bwd;  // fwd_bwd.samples == 0 when not measured
  double fwd_tflops = 0, fwd_bwd_tflops = 0;
};
DenseGemmTiming time_dense_gemm(DType d, int64_t m, int64_t k, int64_t n, bool with_bwd,
                                int samples = 25);

// The vendor's time for the products of a uniform grouped GEMM (every group the same rows): each
// product is one cublasGemmStridedBatchedEx over `batch` row-major pairs a[m,k] . b[k,n] -> c[m,n]
// (the settings above), batches contiguous: the layout of grouped_gemm's x [batch * m, k], w
// [batch, k, n] and out when each group holds m rows. a_from >= 0 makes a product read product
// a_from's a (the FFN's two input products read one x; their dgrads then sum into one da, the
// later with beta = 1).
//   fwd  every product's c                                                 2 batch m k n FLOPs each
//   bwd  each product's dgrad da = g . b^T and wgrad db = a^T . g (g: a seeded cotangent of c)
// Operands seeded uniform in [-1, 1] on bench_stream(), where fwd and bwd also run; bad shapes
// throw invalid_argument naming the product and field.
struct BatchedProduct {
  int64_t batch = 0, m = 0, k = 0, n = 0;
  int a_from = -1;
};
class BatchedGemms {
 public:
  BatchedGemms(DType d, std::vector<BatchedProduct> products, bool with_bwd);
  ~BatchedGemms();
  BatchedGemms(const BatchedGemms&) = delete;
  BatchedGemms& operator=(const BatchedGemms&) = delete;
  void fwd();
  void bwd();  // logic_error unless made with_bwd
  double fwd_flops() const { return fwd_flops_; }
  // Product p's operands and results (a, da: its owner's where it shares them).
  const DeviceTensor& a(size_t p) const { return bufs_.at(owner(p)).a; }
  const DeviceTensor& b(size_t p) const { return bufs_.at(p).b; }
  const DeviceTensor& c(size_t p) const { return bufs_.at(p).c; }
  const DeviceTensor& g(size_t p) const { return bufs_.at(p).g; }
  const DeviceTensor& da(size_t p) const { return bufs_.at(owner(p)).da; }
  const DeviceTensor& db(size_t p) const { return bufs_.at(p).db; }

 private:
  struct Bufs {
    DeviceTensor a, b, c, g, da, db;  // a and da empty where the product shares its owner's
  };
  struct Blas;
  size_t owner(size_t p) const;
  DType d_;
  std::vector<BatchedProduct> products_;
  std::vector<Bufs> bufs_;
  std::unique_ptr<Blas> blas_;
  double fwd_flops_ = 0;
};
// time_launches_auto of fwd, and of fwd then bwd; the buffers are freed before it returns. With
// one product of batch 1 it times what time_dense_gemm does.
struct BatchedGemmTiming {
  TimingStats fwd, fwd_bwd;  // fwd_bwd.samples == 0 when not measured
  double fwd_flops = 0;      // sum of 2 batch m k n
};
BatchedGemmTiming time_batched_gemms(DType d, const std::vector<BatchedProduct>& products,
                                     bool with_bwd, int samples = 25);

// How many input/output sets of `bytes_per_set` to rotate among so their total is at least three
// times the L2 cache, capped at max_sets and at a quarter of the free device memory.
int rotation_sets(double bytes_per_set, int max_sets = 64);

size_t l2_cache_bytes();
void device_synchronize();

}  // namespace moe::gpu
