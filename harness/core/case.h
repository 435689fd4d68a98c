// A Case is one fully specified run of one op: op name, activation dtype, routing regime, seed and
// every shape and parameter as key=value. It prints as one line and parses back to an equal Case:
//
//   op=topk_router dtype=bfloat16 regime=uniform seed=42 E=32 K=4 T=64 score_function=sigmoid
//
// `moe-harness check --case '<line>'` replays it. Values are strings; typed getters parse them and
// name the key in any error.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "harness/core/dtype.h"

namespace moe {

// Named input regimes (STYLE 9). Each op's input generator interprets them.
enum class Regime : uint8_t {
  uniform,          // i.i.d. values, routing spread over experts
  skewed,           // a few experts take most tokens
  exact_ties,       // bitwise-equal scores at the k-th boundary
  near_ties,        // scores within a few ulps at the k-th boundary
  large_magnitude,  // logits of magnitude ~1e2..1e4 (saturating exp / sigmoid)
  zero_tokens,      // T = 0, or experts with no tokens
  all_to_one,       // every token routes to the same expert(s)
  every_pattern,    // router family: every finite 16-bit pattern of the dtype in turn (f32: bf16's)
};
std::string_view regime_name(Regime r);
Regime parse_regime(std::string_view s);  // throws std::invalid_argument

struct Case {
  std::string op;
  DType dtype = DType::f32;
  Regime regime = Regime::uniform;
  uint64_t seed = 0;
  std::map<std::string, std::string> p;  // shapes and parameters, printed in key order

  std::string line() const;
  static Case parse(std::string_view line);  // throws std::invalid_argument naming the token

  bool has(const std::string& key) const { return p.count(key) != 0; }
  int64_t i(const std::string& key) const;
  int64_t i(const std::string& key, int64_t dflt) const { return has(key) ? i(key) : dflt; }
  double f(const std::string& key) const;
  double f(const std::string& key, double dflt) const { return has(key) ? f(key) : dflt; }
  bool b(const std::string& key) const;
  bool b(const std::string& key, bool dflt) const { return has(key) ? b(key) : dflt; }
  const std::string& s(const std::string& key) const;
  std::string s(const std::string& key, const std::string& dflt) const {
    return has(key) ? s(key) : dflt;
  }

  Case& set(const std::string& key, int64_t v);
  Case& set(const std::string& key, int v) { return set(key, static_cast<int64_t>(v)); }
  Case& set(const std::string& key, double v);  // shortest round-trip, always with '.' or 'e'
  Case& set(const std::string& key, bool v);
  Case& set(const std::string& key, const std::string& v);
  Case& set(const std::string& key, const char* v) { return set(key, std::string(v)); }

  bool operator==(const Case& o) const = default;
};

// Shortest round-trip decimal that always carries '.' or an exponent ("1.0", "2.5e-07").
std::string format_double(double v);

// s with XML's five special characters as entities and the control characters XML 1.0 cannot
// carry (all below 0x20 but tab, newline, return) as '?': text and attribute values of the JUnit
// reports of `check` and `golden verify`.
std::string xml_escape(const std::string& s);

}  // namespace moe
