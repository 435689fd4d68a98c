// Row kernels shared by topk_router (gpu/topk_router.cu) and aux_loss_scores (gpu/aux_loss.cu).
// CUDA-only header: include from .cu files.
//
// Layout: a row of E experts is held by LANES lanes of one warp (LANES = 1..32, a power of two, so
// a warp holds 32/LANES rows), VPT values per lane in chunks of 8 consecutive experts: slot j of
// lane l is expert (j/8)*8*LANES + 8*l + j%8 (score::row_layout). Each chunk is one 16-byte load of
// a 16-bit row (two for f32), coalesced across the lanes. For VPT <= 32 the row lives in registers
// (fully unrolled loops); the E <= 4096 variant (VPT = 128) keeps it in local memory.
//
// Top-k: every value becomes a 32-bit order-preserving key (IEEE equality: -0 and +0 share a key;
// 0 means "not a candidate"). One pick = the warp maximum key (REDUX on a full warp), then the
// smallest expert index holding it (a second REDUX), which is exactly the canonical rule of SPEC
// §1.4 (value desc, index asc). Sums use a fixed order (each lane over its slots, then an xor
// butterfly) that score::row_sum_f32 reproduces on the host, so outputs are deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gpu/device_util.cuh"
#include "harness/core/score_fn.h"

namespace moe::gpu::rowk {

inline constexpr int kBlock = 256;
inline constexpr float kEps = 1e-20f;  // SPEC §0
enum : int { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };

// ---------------------------------------------------------------------------------------------
// Keys and row reductions.

__device__ __forceinline__ uint32_t ord_key(float v) {
  uint32_t u = __float_as_uint(v);
  if (u == 0x80000000u) u = 0u;  // -0 == +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <int W>
__device__ __forceinline__ float seg_sum(float v) {
#pragma unroll
  for (int off = W / 2; off > 0; off /= 2) v = v + __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
template <int W>
__device__ __forceinline__ float seg_max(float v) {
#pragma unroll
  for (int off = W / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
template <int W>
__device__ __forceinline__ uint32_t seg_max_u32(uint32_t v) {
  if constexpr (W == 32) {
    return __reduce_max_sync(0xffffffffu, v);
  } else {
#pragma unroll
    for (int off = W / 2; off > 0; off /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
  }
}
template <int W>
__device__ __forceinline__ uint32_t seg_min_u32(uint32_t v) {
  if constexpr (W == 32) {
    return __reduce_min_sync(0xffffffffu, v);
  } else {
#pragma unroll
    for (int off = W / 2; off > 0; off /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
  }
}
// Runtime segment width w (a power of two <= 32) for the grouped fast path.
__device__ __forceinline__ uint32_t segw_max_u32(uint32_t v, int w) {
  for (int off = w / 2; off > 0; off /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ uint32_t segw_min_u32(uint32_t v, int w) {
  for (int off = w / 2; off > 0; off /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// ---------------------------------------------------------------------------------------------
// 8-element loads and stores. `vec`: all 8 present and 16-byte aligned; otherwise n (0..8) are
// accessed one by one.

template <class T>
__device__ __forceinline__ float bits16_to_f32(uint32_t b);
template <>
__device__ __forceinline__ float bits16_to_f32<__nv_bfloat16>(uint32_t b) {
  return __uint_as_float(b << 16);
}
template <>
__device__ __forceinline__ float bits16_to_f32<__half>(uint32_t b) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}
template <class T>
__device__ __forceinline__ uint32_t f32_to_bits16(float v);
template <>
__device__ __forceinline__ uint32_t f32_to_bits16<__nv_bfloat16>(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <>
__device__ __forceinline__ uint32_t f32_to_bits16<__half>(float v) {
  return __half_as_ushort(__float2half_rn(v));
}

template <class T>
__device__ __forceinline__ void load8(const T* p, bool vec, int n, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    if (vec) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p));
      const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
      v[7] = b.w;
      return;
    }
  } else {
    if (vec) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
      const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = bits16_to_f32<T>(w[i] & 0xffffu);
        v[2 * i + 1] = bits16_to_f32<T>(w[i] >> 16);
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = i < n ? to_f32<T>(p[i]) : 0.0f;
}

template <class T>
__device__ __forceinline__ void store8(T* p, bool vec, int n, const float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    if (vec) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
      return;
    }
  } else {
    if (vec) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = f32_to_bits16<T>(v[2 * i]) | (f32_to_bits16<T>(v[2 * i + 1]) << 16);
      }
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n) p[i] = from_f32<T>(v[i]);
}

// Routing map of one chunk: bit i = expert e0+i routed. bytemap: 8 bool bytes at p; bitmap: one
// byte at p (LSB first).
__device__ __forceinline__ void store_map8(uint8_t* p, bool bitmap, bool vec, int n,
                                           uint32_t bits) {
  if (bitmap) {
    *p = static_cast<uint8_t>(bits & ((1u << n) - 1u));
    return;
  }
  if (vec) {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo |= ((bits >> i) & 1u) << (8 * i);
      hi |= ((bits >> (i + 4)) & 1u) << (8 * i);
    }
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n) p[i] = static_cast<uint8_t>((bits >> i) & 1u);
}

__device__ __forceinline__ uint32_t load_map8(const uint8_t* p, bool bitmap, bool vec, int n) {
  if (bitmap) return n > 0 ? static_cast<uint32_t>(*p) & ((1u << n) - 1u) : 0u;
  uint32_t bits = 0;
  if (vec) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      bits |= (((w.x >> (8 * i)) & 0xffu) != 0u ? 1u : 0u) << i;
      bits |= (((w.y >> (8 * i)) & 0xffu) != 0u ? 1u : 0u) << (i + 4);
    }
    return bits;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n && p[i] != 0) bits |= 1u << i;
  return bits;
}

// A float of any supported dtype (the expert bias), widened exactly.
__device__ __forceinline__ float load_any_f32(const void* p, int dtype, int64_t i) {
  switch (static_cast<DType>(dtype)) {
    case DType::bf16:
      return to_f32(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16:
      return to_f32(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// One chunk of 8 as raw 16-byte words (x; y too for f32), for software prefetching: p is
// 16-byte aligned and all 8 are present.
template <class T>
__device__ __forceinline__ void ldg_raw8(const T* p, uint4& x, uint4& y) {
  x = __ldg(reinterpret_cast<const uint4*>(p));
  if constexpr (sizeof(T) == 4) y = __ldg(reinterpret_cast<const uint4*>(p) + 1);
}
template <class T>
__device__ __forceinline__ void decode8(const uint4& x, const uint4& y, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    v[0] = __uint_as_float(x.x), v[1] = __uint_as_float(x.y), v[2] = __uint_as_float(x.z),
    v[3] = __uint_as_float(x.w), v[4] = __uint_as_float(y.x), v[5] = __uint_as_float(y.y),
    v[6] = __uint_as_float(y.z), v[7] = __uint_as_float(y.w);
  } else {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = bits16_to_f32<T>(w[i] & 0xffffu);
      v[2 * i + 1] = bits16_to_f32<T>(w[i] >> 16);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (PDL, sm_90): every row kernel first waits for the grid before it
// in the stream to complete (griddepcontrol.wait, a no-op when the launch carries no PDL
// attribute), so it reads (bar the L2 prefetches below) and writes nothing early; it then lets the
// next grid launch, whose blocks fill the SMs as this grid's last blocks retire instead of after a
// full drain.

// Before the wait a kernel may prefetch its first inputs into L2 (not L1): the L2 is the device's
// point of coherence, so a line the previous grid writes afterwards is updated there, and the reads
// after the wait (which miss in L1) see the final data. The DRAM latency of the first loads then
// overlaps the previous grid's tail.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ void pdl_wait_and_trigger() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Forward: topk_router (kAux = false, SPEC §1.2) and aux_loss_scores (kAux = true, SPEC §2).

struct FwdArgs {
  const void* logits = nullptr;  // [T,E] TIn
  const void* bias = nullptr;    // [E] or null (router only)
  int bias_dtype = 0;
  void* probs = nullptr;    // router: [T,E] TIn
  float* scores = nullptr;  // aux: [T,E] f32
  uint8_t* map = nullptr;   // [T,E] bool or [T,ceil(E/8)] u8
  float* saved = nullptr;   // [T,E] f32
  int64_t T = 0;
  int E = 0, K = 0, fn = 0;
  int pre = 0;  // softmax pre (router); aux softmax always normalises
  int G = 0, gk = 0;
  float scaling = 1.0f;
  int bitmap = 0;
  int vec = 0;  // E % 8 == 0 and every pointer 16-byte aligned
  // fwd8_kernel (vec only): 1 = load the warp's next row into registers before computing this one;
  // 2 = also prefetch the row after it into L2.
  int prefetch = 0;
  int l2pf = 0;  // fwd8_kernel: prefetch the first row into L2 before the PDL wait
  // fwd8_kernel variant 2, bf16 sigmoid: the sigmoid table in device memory (sigmoid_table), or
  // null (the kernel computes it).
  const void* lut = nullptr;
};

// The 32-lane, 8-slot forward (E in 129..256, e.g. DeepSeek-V3) is capped at 64 registers so 4
// blocks fit per SM instead of 3: 5% faster on an H100 (194 -> 183 us, T=65536), a little spill.
template <class TIn, int LANES, int VPT, bool kAux>
__global__ void __launch_bounds__(kBlock, (LANES == 32 && VPT == 8) ? 4 : 1)
    fwd_kernel(const FwdArgs a) {
  pdl_wait_and_trigger();
  constexpr int RPB = kBlock / LANES;  // rows per block and step
  constexpr int NCH = VPT / 8;
  constexpr bool kRegs = VPT <= 32;
  const int lane = static_cast<int>(threadIdx.x) % LANES;
  const int E = a.E;
  const int64_t mapw = a.bitmap ? (E + 7) / 8 : E;
  const bool vec = a.vec != 0;
  const bool has_bias = !kAux && a.bias != nullptr;
  const bool grouped = !kAux && a.gk > 0;

  auto expert = [&](int j) { return (j / 8) * 8 * LANES + 8 * lane + (j % 8); };

  float bias[VPT];
#pragma unroll(kRegs ? VPT : 1)
  for (int j = 0; j < VPT; ++j) {
    const int e = expert(j);
    bias[j] = (has_bias && e < E) ? load_any_f32(a.bias, a.bias_dtype, e) : 0.0f;
  }

  // Group of each chunk of this lane (the grouped fast path); row-independent.
  uint32_t chunk_group[NCH];
#pragma unroll(kRegs ? NCH : 1)
  for (int c = 0; c < NCH; ++c) {
    chunk_group[c] = grouped ? static_cast<uint32_t>((c * 8 * LANES + 8 * lane) / (E / a.G)) : 0u;
  }

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < a.T;
       base += static_cast<int64_t>(gridDim.x) * RPB) {
    const int64_t row = base + static_cast<int64_t>(threadIdx.x) / LANES;
    const bool active = row < a.T;
    const int64_t off = row * static_cast<int64_t>(E);

    float z[VPT];
    uint32_t key[VPT];
    // Load: invalid slots (beyond E, or an inactive row) hold -inf and never become candidates.
#pragma unroll(kRegs ? NCH : 1)
    for (int c = 0; c < NCH; ++c) {
      const int e0 = c * 8 * LANES + 8 * lane;
      const int n = active ? min(max(E - e0, 0), 8) : 0;
      float v[8];
      if (n > 0) load8(static_cast<const TIn*>(a.logits) + off + e0, vec && n == 8, n, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) z[c * 8 + i] = i < n ? v[i] : -INFINITY;
    }
    auto valid = [&](int j) { return active && expert(j) < E; };
    auto store_f32_row = [&](float* dst, const float(&vals)[VPT]) {
#pragma unroll(kRegs ? NCH : 1)
      for (int c = 0; c < NCH; ++c) {
        const int e0 = c * 8 * LANES + 8 * lane;
        const int n = active ? min(max(E - e0, 0), 8) : 0;
        if (n == 0) continue;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = vals[c * 8 + i];
        store8(dst + off + e0, vec && n == 8, n, v);
      }
    };

    // Scores (step 1) and selection scores (step 2).
    const bool normalise_all = kAux || (a.fn == kSoftmax && a.pre);
    if (a.fn == kSoftmax && normalise_all) {
      float m = -INFINITY;
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) m = fmaxf(m, z[j]);
      m = seg_max<LANES>(m);
      float sum = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) {
        // Computed for every slot (invalid ones hold -inf, giving 0) so the warp never branches.
        const float ex = score::exp_f32(z[j] - m);
        z[j] = valid(j) ? ex : 0.0f;
        if (valid(j)) sum = sum + z[j];
      }
      const float inv = 1.0f / seg_sum<LANES>(sum);
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) z[j] = valid(j) ? z[j] * inv : -INFINITY;
      store_f32_row(a.saved, z);
      if (kAux) store_f32_row(a.scores, z);
    } else if (a.fn == kSigmoid || a.fn == kSqrtSoftplus) {
      if (a.fn == kSqrtSoftplus) store_f32_row(a.saved, z);  // saved = raw logits
      // One loop per function (a uniform branch), every slot evaluated: invalid slots hold -inf,
      // which both functions map to 0, so no lane branches on its data.
      if (a.fn == kSigmoid) {
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) z[j] = score::sigmoid_f32(z[j]);
      } else {
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) z[j] = score::sqrtsoftplus_f32(z[j]);
      }
      if (a.fn == kSigmoid) store_f32_row(a.saved, z);
      if (kAux) {
        float sum = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j)
          if (valid(j)) sum = sum + z[j];
        const float den = seg_sum<LANES>(sum) + kEps;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j)
          if (valid(j)) z[j] = z[j] / den;
        store_f32_row(a.scores, z);
      } else if (has_bias) {
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j)
          if (valid(j)) z[j] = z[j] + bias[j];
      }
    }
    // (softmax post: z = x, saved is written after the selection)

    // Group selection (step 3, grouped): unselected groups' keys become key(-inf).
    uint32_t gsel_lo = 0xffffffffu;  // per chunk (fast path) or per slot word (general path)
    uint32_t gsel_slot[(VPT + 31) / 32];
#pragma unroll
    for (int w = 0; w < (VPT + 31) / 32; ++w) gsel_slot[w] = 0xffffffffu;
    // key0: the selection keys; the group phase consumes a copy.
    uint32_t key0[VPT];
#pragma unroll(kRegs ? VPT : 1)
    for (int j = 0; j < VPT; ++j) key0[j] = valid(j) ? ord_key(z[j]) : 0u;
    if (grouped) {
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) key[j] = key0[j];
      const int Eg = E / a.G, kp = a.K / a.gk;
      const int W = Eg / 8;
      if (Eg % 8 == 0 && W <= LANES && (W & (W - 1)) == 0) {
        // Fast path: every group is W whole lanes of one chunk; all groups at once.
        float gs[NCH];
        uint32_t gkey[NCH];
#pragma unroll(kRegs ? NCH : 1)
        for (int c = 0; c < NCH; ++c) {
          uint32_t b = 0;
          int bi = 0;
#pragma unroll
          for (int i = 7; i >= 0; --i) {
            if (key[c * 8 + i] >= b) {
              b = key[c * 8 + i];
              bi = i;
            }
          }
          gs[c] = 0.0f;
          for (int r = 0; r < kp; ++r) {
            const uint32_t m = segw_max_u32(b, W);
            const uint32_t cand =
                (b == m && m != 0u) ? static_cast<uint32_t>(expert(c * 8 + bi)) : 0xffffffffu;
            const bool hit = cand == segw_min_u32(cand, W);
            if (m != 0u) gs[c] = gs[c] + key_value(m);
            uint32_t nb = 0;
            int nbi = 0;
#pragma unroll
            for (int i = 7; i >= 0; --i) {
              const uint32_t k = (hit && i == bi) ? 0u : key[c * 8 + i];
              key[c * 8 + i] = k;
              if (k >= nb) {
                nb = k;
                nbi = i;
              }
            }
            b = nb;
            bi = nbi;
          }
          const int e0 = c * 8 * LANES + 8 * lane;
          gkey[c] = (active && e0 < E && (lane % W) == 0) ? ord_key(gs[c]) : 0u;
        }
        gsel_lo = 0;
        for (int r = 0; r < a.gk; ++r) {
          uint32_t b = 0;
          int bc = 0;
#pragma unroll(kRegs ? NCH : 1)
          for (int c = NCH - 1; c >= 0; --c) {
            if (gkey[c] >= b) {
              b = gkey[c];
              bc = c;
            }
          }
          const uint32_t m = seg_max_u32<LANES>(b);
          const uint32_t cand = (b == m && m != 0u) ? chunk_group[bc] : 0xffffffffu;
          const uint32_t win = seg_min_u32<LANES>(cand);
#pragma unroll(kRegs ? NCH : 1)
          for (int c = 0; c < NCH; ++c) {
            if (chunk_group[c] == win) {
              gsel_lo |= 1u << c;
              gkey[c] = 0u;
            }
          }
        }
      } else {
        // General path: groups one after another, then the top g_k of the group scores.
        float gscore[VPT];  // group g's score at lane g % LANES, slot g / LANES
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) gscore[j] = 0.0f;
        for (int g = 0; g < a.G; ++g) {
          float acc = 0.0f;
          for (int r = 0; r < kp; ++r) {
            uint32_t b = 0;
            int bj = 0;
#pragma unroll(kRegs ? VPT : 1)
            for (int j = VPT - 1; j >= 0; --j) {
              if (expert(j) / Eg == g && key[j] >= b && key[j] != 0u) {
                b = key[j];
                bj = j;
              }
            }
            const uint32_t m = seg_max_u32<LANES>(b);
            const uint32_t cand =
                (b == m && m != 0u) ? static_cast<uint32_t>(expert(bj)) : 0xffffffffu;
            const uint32_t win = seg_min_u32<LANES>(cand);
#pragma unroll(kRegs ? VPT : 1)
            for (int j = 0; j < VPT; ++j)
              if (cand == win && j == bj) key[j] = 0u;
            if (m != 0u) acc = acc + key_value(m);
          }
#pragma unroll(kRegs ? VPT : 1)
          for (int j = 0; j < VPT; ++j)
            if (lane == g % LANES && j == g / LANES) gscore[j] = acc;
        }
        uint32_t gkey[VPT];
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) {
          gkey[j] = (active && j * LANES + lane < a.G) ? ord_key(gscore[j]) : 0u;
        }
#pragma unroll
        for (int w = 0; w < (VPT + 31) / 32; ++w) gsel_slot[w] = 0u;
        for (int r = 0; r < a.gk; ++r) {
          uint32_t b = 0;
          int bj = 0;
#pragma unroll(kRegs ? VPT : 1)
          for (int j = VPT - 1; j >= 0; --j) {
            if (gkey[j] >= b && gkey[j] != 0u) {
              b = gkey[j];
              bj = j;
            }
          }
          const uint32_t m = seg_max_u32<LANES>(b);
          const uint32_t cand =
              (b == m && m != 0u) ? static_cast<uint32_t>(bj * LANES + lane) : 0xffffffffu;
          const uint32_t win = seg_min_u32<LANES>(cand);
#pragma unroll(kRegs ? VPT : 1)
          for (int j = 0; j < VPT; ++j) {
            if (cand == win && j == bj) gkey[j] = 0u;
            if (static_cast<uint32_t>(expert(j) / Eg) == win) gsel_slot[j / 32] |= 1u << (j % 32);
          }
        }
      }
    }

    // Top-K (step 3).
#pragma unroll(kRegs ? VPT : 1)
    for (int j = 0; j < VPT; ++j) {
      const bool in_group = (gsel_lo >> (j / 8)) & (gsel_slot[j / 32] >> (j % 32)) & 1u;
      key[j] = in_group ? key0[j] : (valid(j) ? ord_key(-INFINITY) : 0u);
    }
    // Each lane keeps its best candidate (b, bj); after a pick only the winning lane's best
    // changes, and the clear-and-rescan is one pass over the slots.
    uint32_t b = 0, first = 0;
    int bj = 0;
#pragma unroll(kRegs ? VPT : 1)
    for (int j = VPT - 1; j >= 0; --j) {
      if (key[j] >= b) {
        b = key[j];
        bj = j;
      }
    }
    for (int r = 0; r < a.K; ++r) {
      const uint32_t m = seg_max_u32<LANES>(b);
      if (r == 0) first = m;
      const uint32_t cand = (b == m && m != 0u) ? static_cast<uint32_t>(expert(bj)) : 0xffffffffu;
      const bool hit = cand == seg_min_u32<LANES>(cand);
      uint32_t nb = 0;
      int nbj = 0;
#pragma unroll(kRegs ? VPT : 1)
      for (int j = VPT - 1; j >= 0; --j) {
        const uint32_t k = (hit && j == bj) ? 0u : key[j];
        key[j] = k;
        if (k >= nb) {
          nb = k;
          nbj = j;
        }
      }
      b = nb;
      bj = nbj;
    }
    // Selected = valid and picked (its key was cleared); one bit per slot.
    uint32_t selw[(VPT + 31) / 32];
#pragma unroll
    for (int w = 0; w < (VPT + 31) / 32; ++w) selw[w] = 0u;
#pragma unroll(kRegs ? VPT : 1)
    for (int j = 0; j < VPT; ++j)
      if (valid(j) && key[j] == 0u) selw[j / 32] |= 1u << (j % 32);
    auto selected = [&](int j) { return ((selw[j / 32] >> (j % 32)) & 1u) != 0u; };

    if (!kAux) {
      // Steps 4-6: p_e on the selected experts.
      float p[VPT];
      if (a.fn == kSoftmax && !a.pre) {
        const float mx = key_value(first);
        float sum = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) {
          const float ex = score::exp_f32(z[j] - mx);  // every slot: no branch
          p[j] = selected(j) ? ex : 0.0f;
          if (selected(j)) sum = sum + p[j];
        }
        // probs are compared with the fp64 reference within SPEC §12's reduction bound, so the
        // normalisation may multiply by a reciprocal (one division per row, not per expert).
        const float inv = 1.0f / seg_sum<LANES>(sum);
        float sv[VPT];
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) {
          p[j] = selected(j) ? p[j] * inv : 0.0f;
          sv[j] = selected(j) ? p[j] : -INFINITY;
        }
        store_f32_row(a.saved, sv);
      } else if (a.fn == kSoftmax) {
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) p[j] = selected(j) ? z[j] : 0.0f;
      } else {
        float sum = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) {
          // v = fl(fl(s + b) - b): z already holds fl(s + b).
          p[j] = selected(j) ? (has_bias ? z[j] - bias[j] : z[j]) : 0.0f;
          if (selected(j)) sum = sum + p[j];
        }
        if (a.K > 1) {
          const float inv = 1.0f / (seg_sum<LANES>(sum) + kEps);
#pragma unroll(kRegs ? VPT : 1)
          for (int j = 0; j < VPT; ++j)
            if (selected(j)) p[j] = p[j] * inv;
        }
      }
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) p[j] = selected(j) ? a.scaling * p[j] : 0.0f;
#pragma unroll(kRegs ? NCH : 1)
      for (int c = 0; c < NCH; ++c) {
        const int e0 = c * 8 * LANES + 8 * lane;
        const int n = active ? min(max(E - e0, 0), 8) : 0;
        if (n == 0) continue;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = p[c * 8 + i];
        store8(static_cast<TIn*>(a.probs) + off + e0, vec && n == 8, n, v);
      }
    }
    // Routing map.
#pragma unroll(kRegs ? NCH : 1)
    for (int c = 0; c < NCH; ++c) {
      const int e0 = c * 8 * LANES + 8 * lane;
      const int n = active ? min(max(E - e0, 0), 8) : 0;
      if (n == 0) continue;
      uint32_t bits = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) bits |= (selected(c * 8 + i) ? 1u : 0u) << i;
      uint8_t* dst = a.map + row * mapw + (a.bitmap ? e0 / 8 : e0);
      store_map8(dst, a.bitmap != 0, vec && n == 8, n, bits);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Fast forward: rows of E <= 8 * LANES experts (one chunk of 8 consecutive experts per lane, VPT
// = 8: every E <= 256) and, when grouped, groups of whole lanes (E/G % 8 == 0, E/G/8 a power of
// two). Same layout, sums and results as fwd_kernel, with a cheaper selection:
//  1. each lane sorts its 8 selection keys once, descending (19 compare-exchanges on the keys
//     alone);
//  2. grouped: group scores from the sorted heads (top-2: two values per lane merged over the
//     group's lanes by xor shuffles), then g_k rounds of (segment max, lowest lane) over the
//     group keys;
//  3. top-K: K rounds; the segment maximum of the lanes' heads, and the lowest lane holding it pops
//     its head (LANES == 1: the K-th sorted key directly). Each lane then knows how many of its
//     values were picked (c) and the last one (thr);
//  4. decode: the lane's selected slots are those with z > thr plus the first c - #{z > thr} slots
//     with z == thr in slot order, i.e. its first c by (value desc, index asc). A lane's experts
//     are consecutive and lanes are in expert order, so this is the canonical rule (SPEC §1.4).

// Order-preserving key of a float that is not -0 (2 instructions).
__device__ __forceinline__ uint32_t ord_key_nz(float v) {
  const uint32_t u = __float_as_uint(v);
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}

// Sorts 8 keys descending (a depth-6 network; checked exhaustively by the 0-1 principle).
__device__ __forceinline__ void sort8_desc(uint32_t (&k)[8]) {
  auto cx = [&](int i, int j) {
    const uint32_t a = k[i], b = k[j];
    k[i] = max(a, b);
    k[j] = min(a, b);
  };
  cx(0, 2), cx(1, 3), cx(4, 6), cx(5, 7);
  cx(0, 4), cx(1, 5), cx(2, 6), cx(3, 7);
  cx(0, 1), cx(2, 3), cx(4, 5), cx(6, 7);
  cx(2, 4), cx(3, 5);
  cx(1, 4), cx(3, 6);
  cx(1, 2), cx(3, 4), cx(5, 6);
}

// One round of "segment maximum, lowest lane holding it" over LANES-lane segments of the warp.
// Returns the maximum; *win is true in the one lane that holds it (none when it is 0).
template <int LANES>
__device__ __forceinline__ uint32_t seg_pick(uint32_t h, uint32_t segmask, uint32_t mybit,
                                             bool* win) {
  const uint32_t m = seg_max_u32<LANES>(h);
  const uint32_t b = __ballot_sync(0xffffffffu, h == m && h != 0u) & segmask;
  *win = (b & (0u - b)) == mybit;
  return m;
}

// ---------------------------------------------------------------------------------------------
// fwd8 variant 2 (kV2, MOE_ROUTER_FWD8=1; router or, since session 39, aux scores; LANES == 32,
// 16-bit logits, vec, K <= 8, not softmax post): the same arithmetic and results as variant 1 with
// fewer instructions per row:
//  - bf16 sigmoid: a per-block shared table of score::sigmoid_f32 over the bf16 inputs with |x| in
//    [2^-12, 2^4) (filled before the PDL wait: copied from a.lut, the host's table of the same
//    function, or computed here where a.lut is null; either way every entry is bitwise the value
//    the row would compute); other inputs (zeros, tiny, large, non-finite) are computed as
//    before, in a branch the warp takes only when one of its lanes has such an input;
//  - the g_k group rounds become one rank per group (groups strictly ahead by (score desc, index
//    asc), counted by ballots): the same g_k groups as the rounds pick; at most 2 compares per
//    lane (e.g. 8 groups of 4 lanes) without a loop;
//  - top-K rounds unrolled (K <= 8; a compile-time K = 8 made ptxas spill), always 8 of them with
//    r < K in the win test instead of a branch, one lane-mask test per round for the lowest lane,
//    and lanes outside the picked groups only clear their head;
//  - decode: the lane's slots with z >= thr are its picks unless the threshold value is split;
//  - the routing map's bytes from the bits by a multiply (no per-bit shifts).

// Sigmoid table: bf16 bit patterns |x| in [kSigLo, kSigLo + kSigN), indexed by the pattern's low
// 11 bits (kSigN = 2^11 consecutive patterns: one each): entry 2 i + s = sigmoid of the pattern p
// with p % kSigN == i, with sign s.
inline constexpr uint32_t kSigLo = 0x3980u;  // 2^-12
inline constexpr uint32_t kSigN = 0x800u;    // up to 2^4 (exclusive)
// The bf16 pattern of table entry pair i (|x|, positive).
__host__ __device__ constexpr uint32_t sig_pattern(uint32_t i) {
  return kSigLo + ((i - kSigLo) & (kSigN - 1u));
}

// Byte i of the result = bit i of b (b < 16), for a bytemap word.
__device__ __forceinline__ uint32_t bits4_to_bytes(uint32_t b) {
  return (b * 0x00204081u) & 0x01010101u;
}

// kPost: softmax post (the launch's a.fn == kSoftmax && !a.pre, router only), a template argument
// so the other functions keep no copy of the sorted keys through the top-K rounds.
// kV2: variant 2 (above).
template <class TIn, int LANES, bool kAux, bool kPost, bool kV2 = false>
__global__ void __launch_bounds__(kBlock, 4) fwd8_kernel(const FwdArgs a) {
  static_assert(!kV2 || (LANES == 32 && !kPost), "variant 2: 32 lanes, no softmax post");
  constexpr bool kLut = kV2 && std::is_same_v<TIn, __nv_bfloat16>;
  constexpr int RPB = kBlock / LANES;
  const int lane = static_cast<int>(threadIdx.x) % LANES;
  const int wl = static_cast<int>(threadIdx.x) % 32;
  const uint32_t mybit = 1u << wl;
  const uint32_t segmask =
      LANES == 32 ? 0xffffffffu : (((1u << LANES) - 1u) << (wl & ~(LANES - 1)));
  const int E = a.E;
  const int e0 = 8 * lane;
  const int nvalid = min(max(E - e0, 0), 8);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * RPB + threadIdx.x / LANES;
  const TIn* logits = static_cast<const TIn*>(a.logits);
  if (a.l2pf != 0 && row0 < a.T && nvalid > 0) prefetch_l2(logits + row0 * E + e0);
  // Variant 2's sigmoid table (it reads no input, so it is filled before the PDL wait). Copied
  // from the host's (16 KB, 4 loads a thread): computing all of it in each block took ~46 SASS
  // instructions an entry, ~9% of a warp's instructions at ~16 rows a warp (T = 65536,
  // DeepSeek-V3), yet only 1% of the forward's time (H200, docs/perf.md session 39).
  __shared__ __align__(16) float slut[kLut ? 2 * kSigN : 4];
  const bool use_lut = kLut && a.fn == kSigmoid;
  if (use_lut) {
    if (a.lut != nullptr) {
      constexpr int kWords = 2 * kSigN / 4 / kBlock;  // 16-byte words a thread (blockDim kBlock)
      static_assert(2 * kSigN % (4 * kBlock) == 0, "whole words a thread");
      const uint4* src = static_cast<const uint4*>(a.lut) + threadIdx.x;
      uint4 w[kWords];
#pragma unroll
      for (int k = 0; k < kWords; ++k) w[k] = __ldg(src + k * kBlock);
#pragma unroll
      for (int k = 0; k < kWords; ++k)
        reinterpret_cast<uint4*>(slut)[threadIdx.x + k * kBlock] = w[k];
    } else {
      // Both signs of a pattern from one e^-|x| and one reciprocal, bitwise sigmoid_f32's.
      for (uint32_t i = threadIdx.x; i < kSigN; i += kBlock) {
        const score::SigmoidPair s =
            score::sigmoid_pair_f32(bits16_to_f32<__nv_bfloat16>(sig_pattern(i)));  // x > 0
        reinterpret_cast<float2*>(slut)[i] = make_float2(s.pos, s.neg);
      }
    }
  }
  pdl_wait_and_trigger();
  const int64_t mapw = a.bitmap ? (E + 7) / 8 : E;
  const bool vec = a.vec != 0;
  const bool has_bias = !kAux && a.bias != nullptr;
  const bool grouped = !kAux && a.gk > 0;
  constexpr bool post = !kAux && kPost;

  // The bias, widened once per block into shared memory (0 beyond E) and read per row where it is
  // used, so it holds no registers through the selection.
  __shared__ __align__(16) float sbias[8 * LANES];
  if (has_bias) {
    for (int t = static_cast<int>(threadIdx.x); t < 8 * LANES; t += kBlock) {
      sbias[t] = t < E ? load_any_f32(a.bias, a.bias_dtype, t) : 0.0f;
    }
  }
  if (has_bias || use_lut) __syncthreads();
  auto load_bias = [&](float(&b)[8]) {
    const float4 lo = *reinterpret_cast<const float4*>(&sbias[e0]);
    const float4 hi = *reinterpret_cast<const float4*>(&sbias[e0 + 4]);
    b[0] = lo.x, b[1] = lo.y, b[2] = lo.z, b[3] = lo.w, b[4] = hi.x, b[5] = hi.y, b[6] = hi.z,
    b[7] = hi.w;
  };
  // Grouping (row-independent): the group's width in lanes, whether this lane leads a group.
  int gw = 1;
  bool leader = false;
  if (grouped) {
    const int Eg = E / a.G;
    gw = Eg / 8;
    leader = nvalid > 0 && lane % gw == 0;
  }
  // Variant 2's group ranks: this lane's group, its lanes, and the shuffles per rank (each lane of
  // a group compares the group with nrank others); used where they cost fewer than the rounds.
  const int mygroup = lane / gw;
  const uint32_t gmask = ((gw == 32 ? 0u : (1u << gw)) - 1u) << (wl & ~(gw - 1));
  const int nrank = grouped ? (a.G + gw - 1) / gw : 0;
  const bool use_rank = nrank <= 2 * a.gk;
  // Experts per group counted towards a group's score (row-independent: an integer division
  // that was computed per row).
  const int kp_pre = grouped ? a.K / a.gk : 0;

  // Prefetch (vec: every lane holds 8 experts or none): the warp's next row is loaded before this
  // one is computed, so the load latency overlaps the selection.
  const bool pf = vec && a.prefetch != 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * RPB;
  const bool pf2 = pf && a.prefetch > 1;
  uint4 nx = make_uint4(0u, 0u, 0u, 0u), ny = nx;
  if (pf && row0 < a.T && nvalid > 0) ldg_raw8(logits + row0 * E + e0, nx, ny);
  if (pf2 && row0 + stride < a.T && nvalid > 0) prefetch_l2(logits + (row0 + stride) * E + e0);

  // Variant 2 (one warp per row) steps over the warp's own rows by their offset row * E + e0,
  // which is below lim = T * E + e0 iff the row is below T: every row it sees is active, and it
  // does no 64-bit multiplies per row.
  const int64_t step = stride * E, lim = a.T * E + e0;
  int64_t off2 = row0 * E + e0;
  for (int64_t base = kV2 ? row0 : static_cast<int64_t>(blockIdx.x) * RPB;
       kV2 ? off2 < lim : base < a.T; base += stride, off2 += step) {
    const int64_t row = kV2 ? base : base + static_cast<int64_t>(threadIdx.x) / LANES;
    const bool active = kV2 || row < a.T;
    const int n = active ? nvalid : 0;
    const int64_t off = kV2 ? off2 : row * static_cast<int64_t>(E) + e0;
    const uint32_t validbits = (1u << n) - 1u;

    float z[8];
    uint4 rx = make_uint4(0u, 0u, 0u, 0u), ry = rx;  // variant 2: the row's raw words
    if constexpr (kV2) {
      if (pf) {
        rx = nx, ry = ny;
        const int64_t noff = off + step;
        if (noff < lim && nvalid > 0) ldg_raw8(logits + noff, nx, ny);
        if (pf2 && noff + step < lim && nvalid > 0) prefetch_l2(logits + noff + step);
      } else if (n > 0) {
        ldg_raw8(logits + off, rx, ry);  // vec: all 8 present
      }
      // Decoded only where the sigmoid table is not used (it reads the raw words).
      if (!use_lut) {
        float v[8];
        decode8<TIn>(rx, ry, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) z[j] = j < n ? v[j] : -INFINITY;
      }
    } else {
      float v[8];
      if (pf) {
        decode8<TIn>(nx, ny, v);
        const int64_t nrow = row + stride;
        if (nrow < a.T && nvalid > 0) ldg_raw8(logits + nrow * E + e0, nx, ny);
        if (pf2 && nrow + stride < a.T && nvalid > 0) {
          prefetch_l2(logits + (nrow + stride) * E + e0);
        }
      } else if (n > 0) {
        load8(logits + off, vec && n == 8, n, v);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) z[j] = j < n ? v[j] : -INFINITY;
    }
    auto store_row = [&](float* dst, const float(&vals)[8]) {
      if (kV2) {
        if (n > 0) store8(dst + off, true, 8, vals);  // vec: two 16-byte stores
      } else if (n > 0) {
        store8(dst + off, vec && n == 8, n, vals);
      }
    };

    // Aux scores of sigmoid / sqrtsoftplus: each score over the row's sum (+ eps), stored.
    auto aux_normalise = [&] {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < n) sum = sum + z[j];
      const float den = seg_sum<LANES>(sum) + kEps;
#pragma unroll
      for (int j = 0; j < 8; ++j) z[j] = z[j] / den;
      store_row(a.scores, z);
    };

    // Steps 1-2: scores and selection scores (invalid slots hold -inf, which every score
    // function maps to 0 without a branch; their keys are 0 below).
    if (use_lut) {
      // Variant 2, bf16 sigmoid: table lookups; the inputs outside it are computed.
      const uint32_t w[4] = {rx.x, rx.y, rx.z, rx.w};
      // Entry 2 i + s of each value as a byte offset 8 i + 4 s, from its word without extracting
      // the half: rotated left by 3, the low value's i sits at bits 3..13 and the high value's
      // sign at bit 2; rotated right by 13, the high value's i and the low value's sign. A value
      // outside the table reads some entry, overwritten below; lanes without experts (n == 0)
      // read entry 0, but their z is never stored nor selected.
      const char* lut = reinterpret_cast<const char*>(slut);
      // Misses: |p| is in the table iff bits 11..14 of p + 0x680 are 1000. Per word, both halves
      // at once; a carry out of the low half happens only for a low value that misses (p >=
      // 0xf980), so it can hide no miss. OR over the words, then one test.
      uint32_t out = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t x = w[k];
        const uint32_t l3 = __funnelshift_l(x, x, 3), r13 = __funnelshift_r(x, x, 13);
        z[2 * k] = *reinterpret_cast<const float*>(lut + ((l3 & 0x3ff8u) | (r13 & 4u)));
        z[2 * k + 1] = *reinterpret_cast<const float*>(lut + ((r13 & 0x3ff8u) | (l3 & 4u)));
        out |= (x + 0x06800680u) ^ 0x40004000u;
      }
      // Some value of this lane is outside the table (lanes without experts: none).
      const bool miss = n != 0 && (out & 0x78007800u) != 0u;
      if (__any_sync(0xffffffffu, miss)) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t b = (j & 1) ? (w[j / 2] >> 16) : (w[j / 2] & 0xffffu);
          if (miss && (b & 0x7fffu) - kSigLo >= kSigN) {
            z[j] = score::sigmoid_f32(bits16_to_f32<__nv_bfloat16>(b));
          }
        }
      }
      store_row(a.saved, z);
      if (kAux) {
        aux_normalise();
      } else if (has_bias) {
        float bias[8];
        load_bias(bias);
#pragma unroll
        for (int j = 0; j < 8; ++j) z[j] = z[j] + bias[j];
      }
    } else if (a.fn == kSoftmax && (kAux || a.pre)) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, z[j]);
      m = seg_max<LANES>(m);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        z[j] = score::exp_f32(z[j] - m);
        if (j < n) sum = sum + z[j];
      }
      const float inv = 1.0f / seg_sum<LANES>(sum);
#pragma unroll
      for (int j = 0; j < 8; ++j) z[j] = j < n ? z[j] * inv : -INFINITY;
      store_row(a.saved, z);
      if (kAux) store_row(a.scores, z);
    } else if (a.fn == kSigmoid || a.fn == kSqrtSoftplus) {
      if (a.fn == kSqrtSoftplus) store_row(a.saved, z);  // saved = raw logits
      if (a.fn == kSigmoid) {
#pragma unroll
        for (int j = 0; j < 8; ++j) z[j] = score::sigmoid_f32(z[j]);
        store_row(a.saved, z);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) z[j] = score::sqrtsoftplus_f32(z[j]);
      }
      if (kAux) {
        aux_normalise();
      } else if (has_bias) {
        float bias[8];
        load_bias(bias);
#pragma unroll
        for (int j = 0; j < 8; ++j) z[j] = z[j] + bias[j];
      }
    }
    // (softmax post: z = x; saved is written after the selection)

    // Keys. Only raw logits (softmax post) can be -0, which must tie with +0: z + 0 maps it to
    // +0 (sigmoid, sqrtsoftplus and softmax scores, biased or not, are never -0).
    if (post) {
#pragma unroll
      for (int j = 0; j < 8; ++j) z[j] = z[j] + 0.0f;
    }
    uint32_t sk[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) sk[j] = (kV2 || j < n) ? ord_key_nz(z[j]) : 0u;
    sort8_desc(sk);
    if constexpr (kV2) {
      // An empty asm per key: the compiler then sorts once, instead of a partial sort for the
      // group scores and the full sort again after the group selection.
#pragma unroll
      for (int j = 0; j < 8; ++j) asm("" : "+r"(sk[j]));
    }
    // Variant 2: whether this lane's keys take part in the top-K (its head is cleared otherwise;
    // a lane without experts, n == 0, is in no group).
    bool keep = n > 0;

    // Step 3, grouped: group scores, then the top g_k groups; lanes of other groups drop out.
    if (grouped) {
      const int kp = kV2 ? kp_pre : a.K / a.gk;
      float acc = 0.0f;
      if (gw == 1) {
#pragma unroll
        for (int r = 0; r < 8; ++r)
          if (r < kp) acc = acc + key_value(sk[r]);
      } else if (kp <= 2) {
        uint32_t t1 = sk[0], t2 = kp == 2 ? sk[1] : 0u;
        // Unrolled (gw <= 32): no loop counter per level.
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
          if (o >= gw) break;
          const uint32_t u1 = __shfl_xor_sync(0xffffffffu, t1, o);
          const uint32_t u2 = __shfl_xor_sync(0xffffffffu, t2, o);
          const uint32_t hi = max(t1, u1);
          t2 = max(min(t1, u1), max(t2, u2));
          t1 = hi;
        }
        acc = acc + key_value(t1);
        if (kp == 2) acc = acc + key_value(t2);
      } else {
        // kp rounds over a copy of the sorted keys, in the gw-lane group segment.
        uint32_t c[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = sk[j];
        const uint32_t gmask = ((gw == 32 ? 0u : (1u << gw)) - 1u) << (wl & ~(gw - 1));
        for (int r = 0; r < kp; ++r) {
          const uint32_t m = segw_max_u32(c[0], gw);
          const uint32_t b = __ballot_sync(0xffffffffu, c[0] == m && m != 0u) & gmask;
          if ((b & (0u - b)) == mybit) {
#pragma unroll
            for (int j = 0; j < 7; ++j) c[j] = c[j + 1];
            c[7] = 0u;
          }
          acc = acc + key_value(m);
        }
      }
      bool in_group;
      if (kV2 && use_rank) {
        // Every lane of a group holds its score. Group g is picked iff fewer than g_k groups are
        // ahead of it by (key desc, index asc), i.e. iff a round would pick it; key 0 (a NaN
        // score's) is never picked, as in the rounds.
        const uint32_t kg = mygroup < a.G ? ord_key_nz(acc) : 0u;
        int rank = 0;
        if (nrank <= 2) {
          // The loop below unrolled (nrank <= 2, e.g. 8 groups of 4 lanes): both iterations
          // always, a group o >= G (e.g. i >= nrank) replaced by the lane's own group, which is
          // never ahead of itself (so it counts nothing, as o < G did). This saves the loop
          // control of a runtime trip count; `|` and `&` (no short circuit) give the same bool.
          int o = lane & (gw - 1);
#pragma unroll
          for (int i = 0; i < 2; ++i, o += gw) {
            const bool exists = o < a.G;
            const uint32_t ko = __shfl_sync(0xffffffffu, kg, (exists ? o : mygroup) * gw);
            const bool ahead = (ko > kg) | ((ko == kg) & exists & (o < mygroup));
            rank += __popc(__ballot_sync(0xffffffffu, ahead) & gmask);
          }
        } else {
          for (int i = 0; i < nrank; ++i) {
            const int o = (lane & (gw - 1)) + i * gw;
            const uint32_t ko = __shfl_sync(0xffffffffu, kg, (o < a.G ? o : 0) * gw);
            const bool ahead = o < a.G && (ko > kg || (ko == kg && o < mygroup));
            rank += __popc(__ballot_sync(0xffffffffu, ahead) & gmask);
          }
        }
        in_group = kg != 0u && rank < a.gk;
      } else {
        uint32_t gkey = (active && leader) ? ord_key_nz(acc) : 0u;  // 0 + ...: never -0
        uint32_t gsel = 0;
        for (int r = 0; r < a.gk; ++r) {
          bool win;
          seg_pick<LANES>(gkey, segmask, mybit, &win);
          const uint32_t b = __ballot_sync(0xffffffffu, win);
          gsel |= b;
          if (win) gkey = 0u;
        }
        // This lane's group was picked iff its leader lane won a round.
        in_group = ((gsel >> (wl & ~(gw - 1))) & 1u) != 0u;
      }
      if constexpr (kV2) {
        keep = in_group;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) sk[j] = in_group ? sk[j] : 0u;
      }
    }

    // Step 3: top-K.
    uint32_t so[8];  // softmax post: the sorted keys, kept for the exponentials below
#pragma unroll
    for (int j = 0; j < 8; ++j) so[j] = post ? sk[j] : 0u;
    uint32_t first, thr;
    int c;
    if constexpr (kV2) {
      // A lane that does not take part never holds the maximum (its head is 0), so it never pops
      // and the rest of its keys are never read.
      sk[0] = keep ? sk[0] : 0u;
      first = 0u;
      thr = 0u;
      c = 0;
      const uint32_t lemask = (mybit - 1u) | mybit;  // lanes up to this one
      uint32_t wins = 0;  // bit r: this lane won round r (one bit per round, counted once)
      // Always 8 rounds, without a branch (a branch around each round made ptxas re-check the
      // warp's convergence before every REDUX): a round r >= K finds no winner (r < a.K is part of
      // the win test), so it changes nothing; its REDUX and ballot are pure.
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const uint32_t h = sk[0];
        const uint32_t m = __reduce_max_sync(0xffffffffu, h);
        const bool eq = h == m && h != 0u;
        const uint32_t b = __ballot_sync(0xffffffffu, eq);
        // The lowest lane holding the maximum (b has this lane's bit and none below it: one
        // three-input test), in a round r < K.
        const bool win = ((b ^ mybit) & lemask) == 0u && r < a.K;
        thr = win ? h : thr;
        wins |= win ? 1u << r : 0u;
#pragma unroll
        for (int j = 0; j < 7; ++j) sk[j] = win ? sk[j + 1] : sk[j];
        sk[7] = win ? 0u : sk[7];
      }
      c = __popc(wins);
    } else if constexpr (LANES == 1) {
      first = sk[0];
      thr = sk[0];
#pragma unroll
      for (int r = 1; r < 8; ++r)
        if (r == a.K - 1) thr = sk[r];
      c = a.K;
    } else {
      first = 0u;
      thr = 0u;
      c = 0;
      for (int r = 0; r < a.K; ++r) {
        bool win;
        const uint32_t m = seg_pick<LANES>(sk[0], segmask, mybit, &win);
        if (r == 0) first = m;
        if (win) {
          thr = sk[0];
          ++c;
#pragma unroll
          for (int j = 0; j < 7; ++j) sk[j] = sk[j + 1];
          sk[7] = 0u;
        }
      }
    }
    // Step 3, decode (see above). thr_f = NaN selects nothing. Slots beyond E are masked out
    // before counting: their z is a score function's value of -inf (0 for sigmoid and
    // sqrtsoftplus), which can exceed a negative biased thr.
    uint32_t selbits = 0;
    {
      const float thr_f = c > 0 ? key_value(thr) : __uint_as_float(0x7fffffffu);
      bool done = false;
      if constexpr (kV2) {
        // z >= thr: every pick, and exactly the picks unless the threshold value is split (then
        // the walk below). Slots beyond E: none (vec).
        uint32_t geb = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) geb |= z[j] >= thr_f ? (1u << j) : 0u;
        if (__popc(geb) == c) {
          selbits = geb;
          done = true;
        }
      }
      if (!done) {
        uint32_t gtb = 0, eqb = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          gtb |= z[j] > thr_f ? (1u << j) : 0u;
          eqb |= z[j] == thr_f ? (1u << j) : 0u;
        }
        gtb &= validbits;
        eqb &= validbits;
        int need = c - __popc(gtb);
        // need <= popc(eqb) (the lane's picks are its first c sorted keys); all ties are taken
        // unless the threshold value is split, which needs the slot-order walk.
        if (need == __popc(eqb)) {
          selbits = eqb | gtb;
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const bool take = ((eqb >> j) & 1u) != 0u && need > 0;
            need -= take ? 1 : 0;
            selbits |= take ? (1u << j) : 0u;
          }
          selbits |= gtb;
        }
      }
    }
    auto selected = [&](int j) { return ((selbits >> j) & 1u) != 0u; };

    if (!kAux) {
      // Steps 4-6.
      float p[8];
      if constexpr (post) {
        // exp(z - max) for the lane's picked values only (the first c sorted keys; their
        // warp-wide maximum count bounds a uniform loop), then mapped back to the slots by value.
        const float mx = key_value(first);
        const int cmax = LANES == 1 ? a.K : static_cast<int>(__reduce_max_sync(0xffffffffu, c));
        float ex[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) ex[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (i < cmax) {
            const float v = key_value(so[i]);
            const float e = score::exp_f32(v - mx);
#pragma unroll
            for (int j = 0; j < 8; ++j) ex[j] = z[j] == v ? e : ex[j];
          }
        }
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (selected(j)) sum = sum + ex[j];
        const float inv = 1.0f / seg_sum<LANES>(sum);
        float sv[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          p[j] = selected(j) ? ex[j] * inv : 0.0f;
          sv[j] = selected(j) ? p[j] : -INFINITY;
        }
        store_row(a.saved, sv);
      } else if (a.fn == kSoftmax) {
#pragma unroll
        for (int j = 0; j < 8; ++j) p[j] = selected(j) ? z[j] : 0.0f;
      } else {
        float sum = 0.0f;
        float bias[8];
        if (has_bias) load_bias(bias);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          // v = fl(fl(s + b) - b): z already holds fl(s + b). Unselected slots are zeroed below.
          p[j] = has_bias ? z[j] - bias[j] : z[j];
          if (selected(j)) sum = sum + p[j];
        }
        if (a.K > 1) {
          const float inv = 1.0f / (seg_sum<LANES>(sum) + kEps);
#pragma unroll
          for (int j = 0; j < 8; ++j) p[j] = p[j] * inv;
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) p[j] = selected(j) ? a.scaling * p[j] : 0.0f;
      if (n > 0) store8(static_cast<TIn*>(a.probs) + off, kV2 || (vec && n == 8), n, p);
    }
    if (n > 0) {
      if (kV2 && a.bitmap == 0) {  // vec: 8 bytes, 8-byte aligned
        *reinterpret_cast<uint2*>(a.map + off) =
            make_uint2(bits4_to_bytes(selbits & 0xfu), bits4_to_bytes(selbits >> 4));
      } else {
        // Variant 2 (vec: E % 8 == 0): a bitmap row's byte offset is off / 8.
        uint8_t* dst = a.map + (kV2 ? off >> 3 : row * mapw + (a.bitmap ? e0 / 8 : e0));
        store_map8(dst, a.bitmap != 0, vec && n == 8, n, selbits);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: topk_router (SPEC §1.3; TG = TO = the cotangent's dtype) and aux_loss_scores (§2;
// TG = f32, TO = the logits' dtype; every expert counts as routed and sums always normalise).

struct BwdArgs {
  const void* grad = nullptr;    // [T,E] TG
  const uint8_t* map = nullptr;  // router only
  const float* saved = nullptr;  // [T,E] f32
  void* out = nullptr;           // [T,E] TO
  int64_t T = 0;
  int E = 0, K = 0, fn = 0, pre = 0, bitmap = 0, vec = 0, aux = 0;
  float scaling = 1.0f;
  int l2pf = 0;  // prefetch the first row's first chunk into L2 before the PDL wait
};

template <class TG, class TO, int LANES, int VPT>
__global__ void __launch_bounds__(kBlock) bwd_kernel(const BwdArgs a) {
  constexpr int RPB = kBlock / LANES;
  constexpr int NCH = VPT / 8;
  constexpr bool kRegs = VPT <= 32;
  const int lane = static_cast<int>(threadIdx.x) % LANES;
  const int E = a.E;
  const int64_t mapw = a.bitmap ? (E + 7) / 8 : E;
  if (a.l2pf != 0) {
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * RPB + threadIdx.x / LANES;
    const int e0 = 8 * lane;
    if (row0 < a.T && e0 < E) {
      const int64_t off = row0 * static_cast<int64_t>(E) + e0;
      prefetch_l2(static_cast<const TG*>(a.grad) + off);
      prefetch_l2(a.saved + off);
      if (!a.aux) prefetch_l2(a.map + row0 * mapw + (a.bitmap ? e0 / 8 : e0));
    }
  }
  pdl_wait_and_trigger();
  const bool vec = a.vec != 0;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < a.T;
       base += static_cast<int64_t>(gridDim.x) * RPB) {
    const int64_t row = base + static_cast<int64_t>(threadIdx.x) / LANES;
    const bool active = row < a.T;
    const int64_t off = row * static_cast<int64_t>(E);
    float g[VPT], s[VPT];
    uint32_t routed[NCH];
#pragma unroll(kRegs ? NCH : 1)
    for (int c = 0; c < NCH; ++c) {
      const int e0 = c * 8 * LANES + 8 * lane;
      const int n = active ? min(max(E - e0, 0), 8) : 0;
      float gv[8], sv[8];
      routed[c] = 0;
      if (n > 0) {
        const bool v8 = vec && n == 8;
        load8(static_cast<const TG*>(a.grad) + off + e0, v8, n, gv);
        load8(a.saved + off + e0, v8, n, sv);
        routed[c] =
            a.aux ? (1u << n) - 1u
                  : load_map8(a.map + row * mapw + (a.bitmap ? e0 / 8 : e0), a.bitmap != 0, v8, n);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        g[c * 8 + i] = i < n ? gv[i] * a.scaling : 0.0f;
        s[c * 8 + i] = i < n ? sv[i] : 0.0f;
      }
    }
    auto is_r = [&](int j) { return ((routed[j / 8] >> (j % 8)) & 1u) != 0u; };

    float out[VPT];
    if (a.fn == kSoftmax) {
      if (a.pre || a.aux) {
        float dot = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) {
          g[j] = is_r(j) ? g[j] : 0.0f;
          if (is_r(j)) dot = dot + g[j] * s[j];
        }
        dot = seg_sum<LANES>(dot);
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) out[j] = s[j] * (g[j] - dot);
      } else {
        // Non-selected saved values are -inf and are never multiplied.
        float dot = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j)
          if (is_r(j)) dot = dot + g[j] * s[j];
        dot = seg_sum<LANES>(dot);
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) out[j] = is_r(j) ? s[j] * (g[j] - dot) : 0.0f;
      }
    } else {
      const bool sig = a.fn == kSigmoid;
      float y[VPT];
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) {
        const float yj = sig ? s[j] : score::sqrtsoftplus_f32(s[j]);
        y[j] = is_r(j) ? yj : 0.0f;
      }
      if (a.aux || a.K > 1) {
        float A = 0.0f, B = 0.0f;
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) {
          if (is_r(j)) {
            A = A + y[j];
            B = B + g[j] * y[j];
          }
        }
        const float den = seg_sum<LANES>(A) + kEps;
        const float b = seg_sum<LANES>(B) / (den * den);
#pragma unroll(kRegs ? VPT : 1)
        for (int j = 0; j < VPT; ++j) g[j] = is_r(j) ? g[j] / den - b : 0.0f;
      }
#pragma unroll(kRegs ? VPT : 1)
      for (int j = 0; j < VPT; ++j) {
        if (!is_r(j)) {
          out[j] = 0.0f;
        } else if (sig) {
          out[j] = (g[j] * s[j]) * (1.0f - s[j]);
        } else {
          // c = sigma(a) / (2y + eps). Below a = -20, sigma(a) = e^a = y^2 to fp32 precision, and
          // y * (y / (2y + eps)) stays out of the subnormal range where sigma(a) itself would not.
          const float c = s[j] < -20.0f ? y[j] * (y[j] / (2.0f * y[j] + kEps))
                                        : (s[j] > 20.0f ? 1.0f : score::sigmoid_f32(s[j])) /
                                              (2.0f * y[j] + kEps);
          out[j] = g[j] * c;
        }
      }
    }
#pragma unroll(kRegs ? NCH : 1)
    for (int c = 0; c < NCH; ++c) {
      const int e0 = c * 8 * LANES + 8 * lane;
      const int n = active ? min(max(E - e0, 0), 8) : 0;
      if (n == 0) continue;
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = out[c * 8 + i];
      store8(static_cast<TO*>(a.out) + off + e0, vec && n == 8, n, v);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host-side launch: picks the layout for E and the grid.

// Blocks for `rows` rows at rows_per_block rows a block: enough to fill the chip (at most
// blocks_per_sm resident blocks on every SM); the kernels stride over the rest.
int grid_for_rows(int64_t rows, int rows_per_block, int blocks_per_sm = 64);  // topk_router.cu
// Launch switches (gpu/topk_router.cu), read once from the environment: MOE_ROUTER_PDL (default
// 1: launch with the programmatic-stream-serialization attribute) and MOE_ROUTER_FAST (default 1:
// fwd8_kernel where it applies; 0 forces fwd_kernel, for comparisons).
bool launch_pdl();
bool use_fast_fwd();
// MOE_ROUTER_PREFETCH (0, 1 or 2; default 2): fwd8_kernel loads a warp's next row before computing
// the current one (1), and prefetches the row after it into L2 (2). MOE_ROUTER_L2PF (default 1):
// the row kernels prefetch their first row into L2 before the PDL wait.
int prefetch_level();
bool use_l2_prefetch();
// MOE_ROUTER_FWD8 (0 or 1; default 1): 1 = fwd8_kernel's variant 2 (kV2, see there) where it
// applies, 0 = variant 1 everywhere, for A/B comparisons; any other value throws
// std::invalid_argument. H100, DeepSeek-V3 forward (T = 65536, E = 256, K = 8, bf16), same run:
// variant 1 99.6 us (50.6% of copy), variant 2 65.2 us (77.2-77.4%; 74.9 us before its per-row
// instruction cut, docs/perf.md). aux_loss_scores takes variant 2 too since session 39.
int fwd8_variant();
// Variant 2's bf16 sigmoid table (2 kSigN floats: entry 2 i + s = score::sigmoid_f32 of pattern
// sig_pattern(i) with sign s) in this device's memory, built on the host once per device (the
// score functions are bitwise the same on both sides, score_fn.h), or null where the kernel must
// compute it: MOE_ROUTER_LUT=0 (read per call, for A/B and tests) or s capturing a graph (the
// first upload would be a synchronous copy).
const float* sigmoid_table(cudaStream_t s);

template <class... KArgs>
void launch_rows(void (*kernel)(KArgs...), int64_t rows, int lanes, int blocks_per_sm,
                 cudaStream_t s, const KArgs&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid_for_rows(rows, kBlock / lanes, blocks_per_sm)));
  cfg.blockDim = dim3(kBlock);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = launch_pdl() ? 1 : 0;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Whether fwd8_kernel handles these arguments (see there).
inline bool fast_fwd_applies(const FwdArgs& a) {
  if (score::row_layout(a.E).slots != 8 || !use_fast_fwd()) return false;
  if (a.gk <= 0) return true;
  const int Eg = a.E / a.G;
  const int W = Eg / 8;
  return Eg % 8 == 0 && (W & (W - 1)) == 0;
}

template <class TIn, bool kAux>
void launch_fwd(const FwdArgs& a, cudaStream_t s) {
  const score::RowLayout l = score::row_layout(a.E);
  const bool fast = fast_fwd_applies(a);
  auto go = [&](auto lanes_c, auto vpt_c) {
    constexpr int L = decltype(lanes_c)::value, V = decltype(vpt_c)::value;
    if constexpr (V == 8) {
      if (fast) {
        // One wave of resident blocks (__launch_bounds__(kBlock, minb)): each warp then handles
        // several rows, so the per-block setup (bias, groups) is paid once per wave, not per row.
        FwdArgs b = a;
        b.prefetch = prefetch_level();
        b.l2pf = use_l2_prefetch() && launch_pdl() ? 1 : 0;
        auto launch8 = [&](auto post_c) {
          constexpr bool P = decltype(post_c)::value;
          launch_rows(fwd8_kernel<TIn, L, kAux, P>, a.T, L, 4, s, b);
        };
        const bool post = !kAux && a.fn == kSoftmax && !a.pre;
        // Variant 2: 16-bit logits only (at f32, and with a compile-time K = 8, ptxas spills
        // under the 64-register cap).
        if constexpr (L == 32 && sizeof(TIn) == 2) {
          if (fwd8_variant() == 1 && !post && a.vec != 0 && a.K <= 8) {
            if (std::is_same_v<TIn, __nv_bfloat16> && a.fn == kSigmoid) b.lut = sigmoid_table(s);
            launch_rows(fwd8_kernel<TIn, L, kAux, false, true>, a.T, L, 4, s, b);
            return;
          }
        }
        if (post)
          launch8(std::integral_constant<bool, !kAux>{});
        else
          launch8(std::false_type{});
        return;
      }
    }
    launch_rows(fwd_kernel<TIn, L, V, kAux>, a.T, L, 64, s, a);
  };
  using std::integral_constant;
  if (l.lanes == 1)
    go(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  else if (l.lanes == 2)
    go(integral_constant<int, 2>{}, integral_constant<int, 8>{});
  else if (l.lanes == 4)
    go(integral_constant<int, 4>{}, integral_constant<int, 8>{});
  else if (l.lanes == 8)
    go(integral_constant<int, 8>{}, integral_constant<int, 8>{});
  else if (l.lanes == 16)
    go(integral_constant<int, 16>{}, integral_constant<int, 8>{});
  else if (l.slots == 8)
    go(integral_constant<int, 32>{}, integral_constant<int, 8>{});
  else if (l.slots == 16)
    go(integral_constant<int, 32>{}, integral_constant<int, 16>{});
  else if (l.slots == 32)
    go(integral_constant<int, 32>{}, integral_constant<int, 32>{});
  else
    go(integral_constant<int, 32>{}, integral_constant<int, 128>{});
}

template <class TG, class TO>
void launch_bwd(const BwdArgs& a, cudaStream_t s) {
  const score::RowLayout l = score::row_layout(a.E);
  BwdArgs b = a;
  b.l2pf = use_l2_prefetch() && launch_pdl() ? 1 : 0;
  auto go = [&](auto lanes_c, auto vpt_c) {
    constexpr int L = decltype(lanes_c)::value, V = decltype(vpt_c)::value;
    launch_rows(bwd_kernel<TG, TO, L, V>, a.T, L, 64, s, b);
  };
  using std::integral_constant;
  if (l.lanes == 1)
    go(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  else if (l.lanes == 2)
    go(integral_constant<int, 2>{}, integral_constant<int, 8>{});
  else if (l.lanes == 4)
    go(integral_constant<int, 4>{}, integral_constant<int, 8>{});
  else if (l.lanes == 8)
    go(integral_constant<int, 8>{}, integral_constant<int, 8>{});
  else if (l.lanes == 16)
    go(integral_constant<int, 16>{}, integral_constant<int, 8>{});
  else if (l.slots == 8)
    go(integral_constant<int, 32>{}, integral_constant<int, 8>{});
  else if (l.slots == 16)
    go(integral_constant<int, 32>{}, integral_constant<int, 16>{});
  else if (l.slots == 32)
    go(integral_constant<int, 32>{}, integral_constant<int, 32>{});
  else
    go(integral_constant<int, 32>{}, integral_constant<int, 128>{});
}

}  // namespace moe::gpu::rowk
