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
};

// The 32-lane, 8-slot forward (E in 129..256, e.g. DeepSeek-V3) is capped at 64 registers so 4
// blocks fit per SM instead of 3: 5% faster on an H100 (194 -> 183 us, T=65536), a little spill.
template <class TIn, int LANES, int VPT, bool kAux>
__global__ void __launch_bounds__(kBlock, (LANES == 32 && VPT == 8) ? 4 : 1)
    fwd_kernel(const FwdArgs a) {
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
};

template <class TG, class TO, int LANES, int VPT>
__global__ void __launch_bounds__(kBlock) bwd_kernel(const BwdArgs a) {
  constexpr int RPB = kBlock / LANES;
  constexpr int NCH = VPT / 8;
  constexpr bool kRegs = VPT <= 32;
  const int lane = static_cast<int>(threadIdx.x) % LANES;
  const int E = a.E;
  const int64_t mapw = a.bitmap ? (E + 7) / 8 : E;
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

int grid_for_rows(int64_t rows, int rows_per_block);  // defined in gpu/topk_router.cu

template <class TIn, bool kAux>
void launch_fwd(const FwdArgs& a, cudaStream_t s) {
  const score::RowLayout l = score::row_layout(a.E);
  auto go = [&](auto lanes_c, auto vpt_c) {
    constexpr int L = decltype(lanes_c)::value, V = decltype(vpt_c)::value;
    fwd_kernel<TIn, L, V, kAux><<<grid_for_rows(a.T, kBlock / L), kBlock, 0, s>>>(a);
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
  MOE_CUDA_CHECK(cudaGetLastError());
}

template <class TG, class TO>
void launch_bwd(const BwdArgs& a, cudaStream_t s) {
  const score::RowLayout l = score::row_layout(a.E);
  auto go = [&](auto lanes_c, auto vpt_c) {
    constexpr int L = decltype(lanes_c)::value, V = decltype(vpt_c)::value;
    bwd_kernel<TG, TO, L, V><<<grid_for_rows(a.T, kBlock / L), kBlock, 0, s>>>(a);
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
  MOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moe::gpu::rowk
