// Router score functions in fp32 (SPEC §1.2, §2), one implementation for host and device.
//
// Selection (top-k) is defined on fp32 values (SPEC §1.4), so the CPU reference and the CUDA
// kernels must compute the same fp32 score bit for bit, or near-ties resolve differently. The
// libraries' expf/log1pf differ by ulps between glibc and CUDA, so this header implements exp and
// log1p with plain IEEE fp32 add/sub/mul/div/sqrt, rounding to an integer and integer bit
// operations only (exp: Cody-Waite reduction and Cephes' polynomial, no table), plus a correctly
// rounded reciprocal on [1, 2]. Each operation is correctly rounded on both sides, provided there
// is no FMA contraction (host: -ffp-contract=off; nvcc: --fmad=false, both set by CMakeLists.txt)
// and denormals are kept (no fast-math).
// Accuracy against double: exp_f32 0.97 ulp (4M inputs in [-104, 88.7]); sigmoid_f32 and
// sqrtsoftplus_f32 are checked over [-200, 40] including the subnormal range of e^x
// (tests/cpu/test_router.cpp, ScoreFn.*).
//
// Row sums: the CUDA row kernels hold a row as `lanes` lanes of `slots` values each (row_layout);
// each lane adds its slots in order, then the lanes combine by an xor butterfly. row_sum_f32
// reproduces that order on the host, so the fp32 softmax denominators agree bitwise too.
//
// C++17 (included by .cu files); no CUDA types.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define MOE_HD __host__ __device__ __forceinline__
#else
#define MOE_HD inline
#endif

namespace moe::score {

MOE_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

MOE_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// 2^n for n in [-126, 127], built from its bits (exact).
MOE_HD float pow2_f32(int n) {
  return bits_float(static_cast<uint32_t>(n + 127) << 23);
}

MOE_HD float fmax_f32(float a, float b) {
#ifdef __CUDA_ARCH__
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}
MOE_HD float fmin_f32(float a, float b) {
#ifdef __CUDA_ARCH__
  return fminf(a, b);
#else
  return std::fmin(a, b);
#endif
}
MOE_HD float rint_f32(float x) {
#ifdef __CUDA_ARCH__
  return rintf(x);
#else
  return std::nearbyint(x);  // round to nearest even (the default rounding mode)
#endif
}

// e^x for x in [-104, 88.72283935546875] (no range checks; exp_f32 adds them). Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2/2 + tiny, with ln2 = C1 + C2 where C1 has 9 significant bits
// (n * C1 and x - n * C1 are exact for |n| <= 151); e^r = 1 + r + r^2 P(r) with Cephes' degree-5
// P; then the exact scaling by 2^n in two steps 2^(n >> 1) * 2^(n - (n >> 1)), both factors normal,
// so a subnormal result is rounded once. Table-free and branch-free: ~24 instructions on the GPU.
MOE_HD float exp_core_f32(float xc) {
  const float kInvLn2 = 1.44269502162933349609f;
  const float kC1 = 0.693359375f;
  const float kC2 = -2.12194440e-4f;
  const float nf = rint_f32(xc * kInvLn2);
  const int n = static_cast<int>(nf);  // [-150, 128]
  const float r = (xc - nf * kC1) - nf * kC2;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = (p * (r * r) + r) + 1.0f;
  const int n1 = n >> 1;  // arithmetic shift: floor(n / 2)
  return (e * pow2_f32(n1)) * pow2_f32(n - n1);
}

// e^x: +inf above 88.72283935546875 (where e^x overflows), NaN for NaN, 0 below -104 (e^-104 is
// less than half the smallest subnormal).
MOE_HD float exp_f32(float x) {
  const float y = exp_core_f32(fmin_f32(fmax_f32(x, -104.0f), 88.72283935546875f));
  return x > 88.72283935546875f ? INFINITY : (x != x ? x : y);
}

// log(1 + y) for y >= 0 (the softplus range), fdlibm's method in fp32: u = fl(1 + y) = m 2^k with
// m in [sqrt(1/2), sqrt(2)), c the rounding error of u relative to u, f = m - 1 (exact),
// log(1 + f) = f - (f^2/2 - s (f^2/2 + R(s^2))) with s = f / (2 + f), then k ln2 + c.
MOE_HD float log1p_f32(float y) {
  if (!(y < INFINITY)) return y;
  const float u = 1.0f + y;
  if (u == 1.0f) return y;
  const uint32_t b = float_bits(u);
  int k = static_cast<int>(b >> 23) - 127;
  float m = bits_float((b & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 1.41421353816986083984f) {
    m = m * 0.5f;
    k += 1;
  }
  const float c = (k > 0 ? 1.0f - (u - y) : y - (u - 1.0f)) / u;
  const float f = m - 1.0f;
  const float hfsq = (0.5f * f) * f;
  const float s = f / (2.0f + f);
  const float z = s * s;
  float q = 2.0f / 15.0f;
  q = q * z + 2.0f / 13.0f;
  q = q * z + 2.0f / 11.0f;
  q = q * z + 2.0f / 9.0f;
  q = q * z + 2.0f / 7.0f;
  q = q * z + 2.0f / 5.0f;
  q = q * z + 2.0f / 3.0f;
  const float R = z * q;
  const float kf = static_cast<float>(k);
  const float kLn2Hi = 0.693145751953125f;
  const float kLn2Lo = 1.42860676533018704e-06f;
  return kf * kLn2Hi - ((hfsq - (s * (hfsq + R) + (kf * kLn2Lo + c))) - f);
}

// 1 / x, correctly rounded, for x in [1, 2]. The device uses the fast path of __frcp_rn (an
// approximate reciprocal and one Newton step in FMA, exact IEEE rounding for normal x), without
// its slow-path test, which x in [1, 2] never takes.
MOE_HD float rcp_1to2_f32(float x) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  const float e = __fmaf_rn(x, r, -1.0f);
  return __fmaf_rn(r, -e, r);
#else
  return 1.0f / x;
#endif
}

// sigma(ax) and sigma(-ax) for ax >= 0 (not NaN): 1 / (1 + t) and t / (1 + t) with t = e^-ax
// (which stays accurate, and non-zero, where e^ax would overflow), sharing one correctly rounded
// reciprocal, no division. Both signs of a pattern at the cost of one: sigmoid_f32 and the
// router's bf16 table (gpu/router_row.cuh, variant 2's table without the upload).
struct SigmoidPair {
  float pos, neg;
};
MOE_HD SigmoidPair sigmoid_pair_f32(float ax) {
  const float t = exp_core_f32(fmax_f32(-ax, -104.0f));
  const float inv = rcp_1to2_f32(1.0f + t);
  return {inv, t * inv};
}

// sigma(x): the pair's sign of |x|. NaN gives an unspecified value (SPEC §0: non-finite inputs).
MOE_HD float sigmoid_f32(float x) {
  const SigmoidPair p = sigmoid_pair_f32(x < 0.0f ? -x : x);
  return x >= 0.0f ? p.pos : p.neg;
}

// sp(x) = x if x > 20, else log1p(exp(x)) (SPEC §1.2).
MOE_HD float softplus_f32(float x) {
  return x > 20.0f ? x : log1p_f32(exp_f32(x));
}

MOE_HD float sqrt_f32(float x) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// sqrt(sp(x)). Below x = -20, log1p(e^x) = e^x to fp32 precision, and sqrt(e^x) = e^(x/2) keeps
// full precision where e^x itself would be subnormal (x < -87).
MOE_HD float sqrtsoftplus_f32(float x) {
  return x < -20.0f ? exp_f32(0.5f * x) : sqrt_f32(softplus_f32(x));
}

// The CUDA row kernels' layout of one row of E values: `lanes` lanes (a power of two <= 32), each
// holding `slots` values in chunks of 8 consecutive experts; slot j of lane l holds expert
// (j / 8) * 8 * lanes + 8 * l + j % 8. slots == 0 means E is beyond what the kernels support.
struct RowLayout {
  int lanes = 0;
  int slots = 0;
};
inline constexpr int64_t kMaxRowExperts = 4096;
MOE_HD RowLayout row_layout(int64_t experts) {
  if (experts <= 8) return {1, 8};
  if (experts <= 16) return {2, 8};
  if (experts <= 32) return {4, 8};
  if (experts <= 64) return {8, 8};
  if (experts <= 128) return {16, 8};
  if (experts <= 256) return {32, 8};
  if (experts <= 512) return {32, 16};
  if (experts <= 1024) return {32, 32};
  if (experts <= kMaxRowExperts) return {32, 128};
  return {32, 0};
}
MOE_HD int64_t row_layout_expert(const RowLayout& l, int lane, int slot) {
  return static_cast<int64_t>(slot / 8) * 8 * l.lanes + 8 * lane + slot % 8;
}

// Sum of v[0..E) in the CUDA kernels' fp32 order. `use[e]` false drops e (null: all are used).
// Host only (a device lane holds its own slots).
inline float row_sum_f32(const float* v, int64_t experts, const bool* use = nullptr) {
  const RowLayout l = row_layout(experts);
  float part[32];
  for (int lane = 0; lane < l.lanes; ++lane) {
    float s = 0.0f;
    for (int j = 0; j < l.slots; ++j) {
      const int64_t e = row_layout_expert(l, lane, j);
      if (e < experts && (use == nullptr || use[e])) s = s + v[e];
    }
    part[lane] = s;
  }
  for (int off = l.lanes / 2; off > 0; off /= 2) {
    float next[32];
    for (int lane = 0; lane < l.lanes; ++lane) next[lane] = part[lane] + part[lane ^ off];
    for (int lane = 0; lane < l.lanes; ++lane) part[lane] = next[lane];
  }
  return part[0];
}

// Softmax pre (SPEC §1.2) of one row as the kernels compute it: m = max x, ex = exp(x - m),
// s = ex * (1 / sum ex) with the sum in row_sum_f32 order. Host only.
inline void softmax_f32(const float* x, float* s, int64_t experts) {
  float m = -INFINITY;
  for (int64_t e = 0; e < experts; ++e) m = x[e] > m ? x[e] : m;
  for (int64_t e = 0; e < experts; ++e) s[e] = exp_f32(x[e] - m);
  const float inv = 1.0f / row_sum_f32(s, experts);
  for (int64_t e = 0; e < experts; ++e) s[e] = s[e] * inv;
}

}  // namespace moe::score
