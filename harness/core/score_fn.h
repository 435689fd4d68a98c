// Router score functions in fp32 (SPEC §1.2, §2), one implementation for host and device.
//
// Selection (top-k) is defined on fp32 values (SPEC §1.4), so the CPU reference and the CUDA
// kernels must compute the same fp32 score bit for bit, or near-ties resolve differently. The
// libraries' expf/log1pf differ by ulps between glibc and CUDA, so this header implements exp and
// log1p with plain IEEE fp32 add/sub/mul/div/sqrt/reciprocal, integer bit operations and a
// 32-entry table of 2^(j/32) only. Each operation is correctly rounded on both sides, provided
// there is no FMA contraction (host: -ffp-contract=off; nvcc: --fmad=false, both set by
// CMakeLists.txt) and denormals are kept (no fast-math).
// Accuracy against double, measured over a sweep of 2M fp32 inputs: exp_f32 0.74 ulp, log1p_f32
// 2.1 ulp, sigmoid_f32 2.4 ulp, sqrtsoftplus_f32 1.4 ulp (including subnormal-range results).
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

MOE_HD float floor_f32(float x) {
#ifdef __CUDA_ARCH__
  return floorf(x);
#else
  return std::floor(x);
#endif
}

// 2^(j/32) for j = 0..31 as a pair of floats (hi, lo) with hi + lo accurate to ~2^-49.
#define MOE_EXP2_TABLE                                                                        \
  {                                                                                           \
    0x1.p+0f, 0.0f, 0x1.059b0ep+0f, -0x1.9d4f52p-25f, 0x1.0b5586p+0f, 0x1.9f3122p-25f,        \
        0x1.11301ep+0f, -0x1.fdb496p-25f, 0x1.172b84p+0f, -0x1.c15742p-27f, 0x1.1d4874p+0f,   \
        -0x1.d2e8cap-25f, 0x1.2387a6p+0f, 0x1.ceac48p-25f, 0x1.29e9e0p+0f, -0x1.5c0424p-25f,  \
        0x1.306fe0p+0f, 0x1.4636e2p-25f, 0x1.371a74p+0f, -0x1.18aac6p-25f, 0x1.3dea64p+0f,    \
        0x1.824684p-25f, 0x1.44e086p+0f, 0x1.8624b4p-30f, 0x1.4bfdaep+0f, -0x1.593abcp-25f,   \
        0x1.5342b6p+0f, -0x1.2c5610p-25f, 0x1.5ab07ep+0f, -0x1.5bd5ecp-27f, 0x1.6247ecp+0f,   \
        -0x1.f8b550p-25f, 0x1.6a09e6p+0f, 0x1.9fcef4p-26f, 0x1.71f75ep+0f, 0x1.1d8beep-25f,   \
        0x1.7a1148p+0f, -0x1.829fd0p-25f, 0x1.82589ap+0f, -0x1.accc7cp-26f, 0x1.8ace54p+0f,   \
        0x1.15506ep-27f, 0x1.93737cp+0f, -0x1.e64744p-25f, 0x1.9c4918p+0f, 0x1.51f848p-27f,   \
        0x1.a5503cp+0f, -0x1.b83b54p-25f, 0x1.ae89fap+0f, -0x1.a94b14p-26f, 0x1.b7f770p+0f,   \
        -0x1.a09438p-25f, 0x1.c199bep+0f, -0x1.3d56b2p-27f, 0x1.cb720ep+0f, -0x1.8837ccp-27f, \
        0x1.d5818ep+0f, -0x1.822dbcp-27f, 0x1.dfc974p+0f, -0x1.908c94p-25f, 0x1.ea4afap+0f,   \
        0x1.52486cp-27f, 0x1.f50766p+0f, -0x1.246eb0p-26f,                                    \
  }
inline constexpr float kExp2TabHost[64] = MOE_EXP2_TABLE;
#ifdef __CUDACC__
static __device__ const float kExp2TabDev[64] = MOE_EXP2_TABLE;
#endif
MOE_HD float exp2_tab(int i) {
#ifdef __CUDA_ARCH__
  return __ldg(&kExp2TabDev[i]);
#else
  return kExp2TabHost[i];
#endif
}

// e^x. Range reduction x = (32k + j) ln2/32 + r with |r| <= ln2/64 (ln2/32 split in two so that
// n * kHi is exact), e^r - 1 by a degree-5 polynomial, the table value 2^(j/32) = hi + lo, then an
// exact scaling by 2^k (two steps when the result is subnormal or k = 128). Written with selects
// rather than branches so a warp never diverges on it.
MOE_HD float exp_f32(float x) {
#ifndef __CUDA_ARCH__
  if (x != x) return x;  // (the device maps NaN through the final select; no branch there)
#endif
  const float xc = x > 89.0f ? 89.0f : (x < -104.0f ? -104.0f : x);
  const float k32InvLn2 = 46.16624069213867f;
  const float kHi = 0.02166748046875f;        // ln2/32 to 9 significant bits
  const float kLo = -6.631076303165173e-06f;  // ln2/32 - kHi
  const float nf = floor_f32(xc * k32InvLn2 + 0.5f);
  const int n = static_cast<int>(nf);  // [-4802, 4109]
  const int j = n & 31;
  const int k = (n - j) / 32;  // exact: floor(n / 32)
  const float r = (xc - nf * kHi) - nf * kLo;
  float q = 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  const float pm1 = r + (r * r) * q;  // e^r - 1
  const float hi = exp2_tab(2 * j), lo = exp2_tab(2 * j + 1);
  const float p = hi + (hi * pm1 + lo);
  const int k1 = k < -126 ? k + 64 : (k > 127 ? 127 : k);
  const float s2 = k < -126 ? pow2_f32(-64) : (k > 127 ? pow2_f32(k - 127) : 1.0f);
  const float y = (p * pow2_f32(k1)) * s2;
  return x != x ? x : (x > 88.72283935546875f ? INFINITY : (x < -103.972084045410156f ? 0.0f : y));
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

// sigma(x) = 1 / (1 + e^-x); for x < 0 as e^x / (1 + e^x), which stays accurate (and non-zero)
// where e^-x overflows.
MOE_HD float rcp_f32(float x) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}

// Both branches as t * (1 / (1 + t)): one correctly rounded reciprocal instead of a division.
MOE_HD float sigmoid_f32(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float t = exp_f32(-ax);
  const float inv = rcp_f32(1.0f + t);
  return x >= 0.0f ? inv : t * inv;
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
