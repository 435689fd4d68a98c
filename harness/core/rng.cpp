#include "harness/core/rng.h"

#include <cmath>

namespace moe {

uint64_t mix_seed(uint64_t seed, std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  Rng r(seed ^ (h * 0x9E3779B97F4A7C15ull));
  return r.next();
}

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform() {
  return static_cast<double>(next() >> 11) * 0x1.0p-53;
}

double Rng::uniform(double lo, double hi) {
  return lo + (hi - lo) * uniform();
}

int64_t Rng::below(int64_t n) {
  return static_cast<int64_t>(next() % static_cast<uint64_t>(n));
}

double Rng::normal() {
  const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

void fill_uniform(Tensor& t, Rng& rng, double lo, double hi) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform(lo, hi));
}

void fill_normal(Tensor& t, Rng& rng, double sd) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, sd * rng.normal());
}

}  // namespace moe
