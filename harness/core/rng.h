// Deterministic random numbers without global state (STYLE 4): every tensor's values derive from
// (case seed, tensor name) through SplitMix64, so any tensor can be regenerated alone.
#pragma once

#include <cstdint>
#include <string_view>

#include "harness/core/tensor.h"

namespace moe {

uint64_t mix_seed(uint64_t seed, std::string_view name);  // FNV-1a of name, mixed into seed

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  Rng(uint64_t seed, std::string_view name) : state_(mix_seed(seed, name)) {}
  uint64_t next();
  double uniform();                      // [0, 1)
  double uniform(double lo, double hi);  // [lo, hi)
  int64_t below(int64_t n);              // [0, n), n > 0
  double normal();                       // N(0, 1), Box-Muller
  bool coin(double p_true = 0.5) { return uniform() < p_true; }

 private:
  uint64_t state_;
};

// Fills t (any float dtype) with U[lo,hi) or N(0,sd) values, rounded once to t's dtype.
void fill_uniform(Tensor& t, Rng& rng, double lo, double hi);
void fill_normal(Tensor& t, Rng& rng, double sd);

}  // namespace moe
