// Element types and exact round-to-nearest-even conversions (SPEC §0: rnd_d).
//
// All rounding is done from double in one step, so the reference's "compute in double, round
// once" is exactly one rounding. bf16/f16 are stored as raw 16-bit patterns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe {

enum class DType : uint8_t { f64, f32, bf16, f16, i32, i64, u8, boolean };

size_t dtype_size(DType dt);
// SPEC spelling: float64, float32, bfloat16, float16, int32, int64, uint8, bool.
std::string_view dtype_name(DType dt);
// Accepts the SPEC spelling and the short forms (f32, bf16, ...). Throws std::invalid_argument.
DType parse_dtype(std::string_view s);
bool is_floating(DType dt);

// Rounds x to the nearest value representable in dt (RNE, overflow to inf). Identity for f64.
// Integer dtypes: rounds to nearest integer and saturates (used only for generated data).
double round_to(DType dt, double x);
// Spacing of dt at |x| (the ulp of the binade holding x; the smallest subnormal step at 0).
double ulp(DType dt, double x);

uint16_t bf16_bits(double x);  // round, then encode
double bf16_value(uint16_t bits);
uint16_t f16_bits(double x);
double f16_value(uint16_t bits);

}  // namespace moe
