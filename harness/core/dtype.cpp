#include "harness/core/dtype.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace moe {

namespace {

struct FloatFormat {
  int precision;  // significand bits including the hidden one
  int emin;       // exponent of the smallest normal
  double max;     // largest finite value
};

constexpr FloatFormat kBf16{8, -126, 3.3895313892515355e38};
constexpr FloatFormat kF16{11, -14, 65504.0};
constexpr FloatFormat kF32{24, -126, 3.4028234663852886e38};

// One RNE rounding of x to the format (nearbyint uses the default round-to-nearest-even mode).
double round_format(double x, const FloatFormat& f) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const int q = std::max(e - 1, f.emin) - (f.precision - 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -q)), q);
  if (std::fabs(r) > f.max) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

double ulp_format(double x, const FloatFormat& f) {
  int e = 0;
  if (x == 0.0 || !std::isfinite(x)) return std::ldexp(1.0, f.emin - (f.precision - 1));
  std::frexp(x, &e);
  return std::ldexp(1.0, std::max(e - 1, f.emin) - (f.precision - 1));
}

}  // namespace

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::u8:
    case DType::boolean:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dt) {
  switch (dt) {
    case DType::f64:
      return "float64";
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
    case DType::boolean:
      return "bool";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  if (s == "float64" || s == "f64") return DType::f64;
  if (s == "float32" || s == "f32") return DType::f32;
  if (s == "bfloat16" || s == "bf16") return DType::bf16;
  if (s == "float16" || s == "f16") return DType::f16;
  if (s == "int32" || s == "i32") return DType::i32;
  if (s == "int64" || s == "i64") return DType::i64;
  if (s == "uint8" || s == "u8") return DType::u8;
  if (s == "bool") return DType::boolean;
  throw std::invalid_argument("dtype: unknown dtype '" + std::string(s) + "'");
}

bool is_floating(DType dt) {
  return dt == DType::f64 || dt == DType::f32 || dt == DType::bf16 || dt == DType::f16;
}

double round_to(DType dt, double x) {
  switch (dt) {
    case DType::f64:
      return x;
    case DType::f32:
      return static_cast<double>(static_cast<float>(x));  // hardware RNE, one rounding
    case DType::bf16:
      return round_format(x, kBf16);
    case DType::f16:
      return round_format(x, kF16);
    case DType::i32:
      return std::clamp(std::nearbyint(x), -2147483648.0, 2147483647.0);
    case DType::i64:
      return std::clamp(std::nearbyint(x), -9.2233720368547758e18, 9.2233720368547748e18);
    case DType::u8:
      return std::clamp(std::nearbyint(x), 0.0, 255.0);
    case DType::boolean:
      return x != 0.0 ? 1.0 : 0.0;
  }
  return x;
}

double ulp(DType dt, double x) {
  switch (dt) {
    case DType::f64:
      return std::ldexp(1.0, -52) * std::max(std::fabs(x), DBL_MIN);
    case DType::f32:
      return ulp_format(x, kF32);
    case DType::bf16:
      return ulp_format(x, kBf16);
    case DType::f16:
      return ulp_format(x, kF16);
    default:
      return 0.0;  // integers compare exactly
  }
}

uint16_t bf16_bits(double x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFFC0 : 0x7FC0;
  const float f = static_cast<float>(round_format(x, kBf16));  // exact in f32
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

double bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f = 0;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f16_bits(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7E00;
  const double r = round_format(x, kF16);
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a == 0.0) return sign;
  if (a < std::ldexp(1.0, -14)) {  // subnormal: a = m * 2^-24
    return sign | static_cast<uint16_t>(std::ldexp(a, 24));
  }
  int e = 0;
  std::frexp(a, &e);
  const int lead = e - 1;
  const auto mant = static_cast<uint16_t>(std::ldexp(a, 10 - lead) - 1024.0);
  return sign | static_cast<uint16_t>((lead + 15) << 10) | mant;
}

double f16_value(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exp = (bits >> 10) & 0x1F;
  const int mant = bits & 0x3FF;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) {
    return mant ? std::numeric_limits<double>::quiet_NaN()
                : sign * std::numeric_limits<double>::infinity();
  }
  return sign * std::ldexp(1024 + mant, exp - 25);
}

}  // namespace moe
