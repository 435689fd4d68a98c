// Private device helpers of the permutation-family twins (dispatch, sort_chunks, argsort, EP):
// stream-ordered scratch, generic integer loads, the error-flag bridge and the vectorised row
// mover every data-movement kernel is built from. CUDA-only: include from gpu/*.cu files.
//
// Row movement is dtype-agnostic: a row is row_bytes bytes, moved in the widest vector (16, 8, 4, 2
// or 1 bytes) that divides the row and both base addresses, so bf16 rows of H = 7168 move as 896
// 16-byte vectors. Element offsets are int64 everywhere (row * row_bytes can exceed 2^31).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "gpu/device_util.cuh"
#include "gpu/runtime.cuh"
#include "harness/core/params/dispatch.h"

namespace moe::gpu::detail {

// ---------------------------------------------------------------------------------------------
// Host side

// Stream-ordered scratch (cudaMallocAsync): no device synchronisation, so benchmarks that call
// an op back to back are not serialised by cudaMalloc/cudaFree.
template <class T>
class Scratch {
 public:
  Scratch(int64_t n, Stream s) : s_(s), n_(n) {
    if (n > 0) p_ = static_cast<T*>(malloc_async(static_cast<size_t>(n) * sizeof(T), s));
  }
  ~Scratch() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }
  int64_t size() const { return n_; }
  void fill_bytes(uint8_t b) {
    if (p_) MOE_CUDA_CHECK(cudaMemsetAsync(p_, b, static_cast<size_t>(n_) * sizeof(T), s_));
  }

 private:
  Stream s_;
  int64_t n_;
  T* p_ = nullptr;
};

inline int num_sms() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    return v;
  }();
  return n;
}

inline void check_launch(const char* what) {
  check_cuda(static_cast<int>(cudaGetLastError()), what, __FILE__, __LINE__);
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Grid for a grid-stride loop over n work items of `per_block` items each, capped so a launch
// never exceeds what the GPU can keep resident many times over.
inline unsigned grid_for(int64_t n, int64_t per_block, int64_t cap_per_sm = 32) {
  const int64_t want = ceil_div(n, per_block);
  const int64_t cap = static_cast<int64_t>(num_sms()) * cap_per_sm;
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

// Reads the flag after an op (synchronises s) and throws the SPEC message for the fault.
inline void throw_if_fault(const ErrorFlag& flag, Stream s) {
  const DeviceError e = flag.read(s);
  if (e.code != 0) throw_perm_fault(static_cast<PermFault>(e.code), e.a, e.b);
}

// Runs f(err) with a fresh device error flag when validating (SPEC §0 policy 2), else with null.
template <class F>
void with_validation(bool validate, Stream s, F&& f) {
  if (!validate) {
    f(static_cast<void*>(nullptr));
    return;
  }
  ErrorFlag flag;
  f(flag.device_ptr());
  throw_if_fault(flag, s);
}

// Poison pattern of an output: NaN for floats, 0x7f7f7f7f-style for integers (never a valid
// index, count or the -1 filler), so an unwritten element cannot pass a comparison.
inline void poison(DeviceTensor& t, Stream s) {
  t.fill_bytes(is_floating(t.dtype()) ? 0xFF : 0x7F, s);
}
inline void poison(std::optional<DeviceTensor>& t, Stream s) {
  if (t) poison(*t, s);
}

// Widest vector (bytes) that divides row_bytes and the alignment of every base address.
inline int vec_bytes(int64_t row_bytes, std::initializer_list<const void*> ptrs) {
  uint64_t bits = static_cast<uint64_t>(row_bytes) | 16u;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  if (bits & 1) return 1;
  if (bits & 2) return 2;
  if (bits & 4) return 4;
  if (bits & 8) return 8;
  return 16;
}

// Integer dtype codes the kernels switch on (bool and u8 are bytes).
enum class IntKind : int { u8 = 0, i32 = 1, i64 = 2 };
inline IntKind int_kind(DType d) {
  switch (d) {
    case DType::boolean:
    case DType::u8:
      return IntKind::u8;
    case DType::i32:
      return IntKind::i32;
    case DType::i64:
      return IntKind::i64;
    default:
      break;
  }
  throw std::invalid_argument("integer tensor: unsupported dtype " + std::string(dtype_name(d)));
}

// ---------------------------------------------------------------------------------------------
// Device side

__device__ __forceinline__ long long load_int(const void* p, int kind, long long i) {
  switch (kind) {
    case 0:
      return static_cast<const uint8_t*>(p)[i];
    case 1:
      return static_cast<const int32_t*>(p)[i];
    default:
      return static_cast<const long long*>(p)[i];
  }
}

__device__ __forceinline__ void fault(void* err, PermFault f, long long a, long long b) {
  if (err) raise_error(err, static_cast<int32_t>(f), a, b);
}

// The VB-byte vector type rows move in.
template <int VB>
using VecT = typename std::conditional<
    VB == 16, uint4,
    typename std::conditional<
        VB == 8, uint2,
        typename std::conditional<
            VB == 4, uint32_t,
            typename std::conditional<VB == 2, uint16_t, uint8_t>::type>::type>::type>::type;

// dst row = src row (src == nullptr: zeros), nvec vectors of VB bytes, threads lane..nvec step
// stride. Four vectors per thread are loaded before any store so enough bytes are in flight.
// kStreaming: streaming stores (st.global.cs, evict-first) for rows the op never reads back, so
// the L2 keeps the source rows other warps are about to read.
template <int VB, bool kStreaming = false>
__device__ __forceinline__ void move_row(void* dst, const void* src, long long nvec, int lane,
                                         int stride) {
  using V = VecT<VB>;
  V* d = static_cast<V*>(dst);
  const V* s = static_cast<const V*>(src);
  constexpr int U = 4;
  for (long long base = lane; base < nvec; base += static_cast<long long>(stride) * U) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + static_cast<long long>(u) * stride;
      if (i < nvec) v[u] = s ? s[i] : V{};
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + static_cast<long long>(u) * stride;
      if (i < nvec) {
        if constexpr (kStreaming) {
          __stcs(d + i, v[u]);
        } else {
          d[i] = v[u];
        }
      }
    }
  }
}

// Calls f.template operator()<VB>() for the runtime vector width vb.
template <class F>
void dispatch_vec(int vb, F&& f) {
  switch (vb) {
    case 16:
      f(std::integral_constant<int, 16>{});
      return;
    case 8:
      f(std::integral_constant<int, 8>{});
      return;
    case 4:
      f(std::integral_constant<int, 4>{});
      return;
    case 2:
      f(std::integral_constant<int, 2>{});
      return;
    default:
      f(std::integral_constant<int, 1>{});
      return;
  }
}

// ---------------------------------------------------------------------------------------------
// Typed helpers

// Float element access with the dtype known only at run time (probs and weights: one value per
// slot, so a uniform switch costs nothing next to the row traffic). 0 = f32, 1 = bf16, 2 = f16.
inline int fcode(DType d) {
  switch (d) {
    case DType::f32:
      return 0;
    case DType::bf16:
      return 1;
    case DType::f16:
      return 2;
    default:
      break;
  }
  throw std::invalid_argument("unsupported float dtype " + std::string(dtype_name(d)));
}

__device__ __forceinline__ float load_f(const void* p, int code, long long i) {
  switch (code) {
    case 0:
      return static_cast<const float*>(p)[i];
    case 1:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return __half2float(static_cast<const __half*>(p)[i]);
  }
}

__device__ __forceinline__ void store_f(void* p, int code, long long i, float v) {
  switch (code) {
    case 0:
      static_cast<float*>(p)[i] = v;
      return;
    case 1:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      return;
    default:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      return;
  }
}

// Bitwise element copy (2 or 4 bytes).
__device__ __forceinline__ void copy_elem(void* dst, long long di, const void* src, long long si,
                                          int code) {
  if (code == 0) {
    static_cast<uint32_t*>(dst)[di] = static_cast<const uint32_t*>(src)[si];
  } else {
    static_cast<uint16_t*>(dst)[di] = static_cast<const uint16_t*>(src)[si];
  }
}

__device__ __forceinline__ void zero_elem(void* dst, long long di, int code) {
  if (code == 0) {
    static_cast<uint32_t*>(dst)[di] = 0;
  } else {
    static_cast<uint16_t*>(dst)[di] = 0;
  }
}

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Calls f(T{}, integral_constant<N>) for float dtype d with N = 16 bytes / sizeof(T) when every
// row and base address is 16-byte aligned, else N = 1.
template <class F>
void dispatch_typed(DType d, int64_t H, std::initializer_list<const void*> ptrs, F&& f) {
  dispatch_float(d, [&](auto tag) {
    using T = decltype(tag);
    const int vb = vec_bytes(H * static_cast<int64_t>(sizeof(T)), ptrs);
    if (vb == 16) {
      f(tag, std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      f(tag, std::integral_constant<int, 1>{});
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Shared launchers (defined in gpu/dispatch.cu and gpu/sort_chunks.cu)

// Row permutation by an int32 map of `rows` entries, rows of row_bytes bytes:
//   gather  (scatter = false): dst[i] = src[map[i]]
//   scatter (scatter = true):  dst[map[i]] = src[i]
// A map value outside [0, src/dst rows) raises `bad` with (i, value) and moves nothing for i
// (gather writes a zero row). gate (device int, may be null): when nonzero nothing is written,
// the guard against racing writes after a failed bijection check.
void permute_rows(void* dst, const void* src, const int32_t* map, int64_t rows, int64_t row_bytes,
                  bool scatter, PermFault bad, void* err, const int32_t* gate, Stream s);

// Checks that map [n] (int32 or int64 by kind) is a permutation of [0, n): raises `bad` with
// (position, value) and sets *gate = 1 on the first out-of-range or repeated value. inv (may be
// null, n int32) receives the inverse permutation. gate must be zeroed by the caller.
void check_permutation(const void* map, IntKind kind, int64_t n, PermFault bad, void* err,
                       int32_t* gate, int32_t* inv, Stream s);

// Routing ranks from a column bitmap (dispatch and argsort dispatch): bits[w*E + e] holds
// routing_map[32w .. 32w+31, e] (bit i = token 32w+i). Produces woff[w*E + e] = sum of the
// popcounts of bits[w' < w, e] (int32) and count[e] (int64).
void column_ranks(const uint32_t* bits, int64_t words, int64_t E, int32_t* woff, int64_t* count,
                  Stream s);

// bits from a [T,E] routing map of int kind (values other than 0/1 raise routing_map_value).
void routing_map_bits(const void* map, IntKind kind, int64_t T, int64_t E, uint32_t* bits,
                      void* err, Stream s);

// rank(t,e) = #{t' < t routed to e} from the bitmap and its word offsets.
__device__ __forceinline__ long long column_rank(const uint32_t* bits, const int32_t* woff,
                                                 long long E, long long t, long long e,
                                                 bool* routed) {
  const long long w = t >> 5;
  const uint32_t word = bits[w * E + e];
  const int bit = static_cast<int>(t & 31);
  *routed = (word >> bit) & 1u;
  return woff[w * E + e] + __popc(word & ((1u << bit) - 1u));
}

}  // namespace moe::gpu::detail
