#include "harness/core/case.h"

#include <charconv>
#include <cmath>
#include <set>
#include <sstream>
#include <stdexcept>

namespace moe {

namespace {
constexpr std::pair<Regime, std::string_view> kRegimes[] = {
    {Regime::uniform, "uniform"},
    {Regime::skewed, "skewed"},
    {Regime::exact_ties, "exact_ties"},
    {Regime::near_ties, "near_ties"},
    {Regime::large_magnitude, "large_magnitude"},
    {Regime::zero_tokens, "zero_tokens"},
    {Regime::all_to_one, "all_to_one"},
    {Regime::every_pattern, "every_pattern"},
};
}  // namespace

std::string_view regime_name(Regime r) {
  for (auto& [k, v] : kRegimes)
    if (k == r) return v;
  return "?";
}

Regime parse_regime(std::string_view s) {
  for (auto& [k, v] : kRegimes)
    if (v == s) return k;
  std::string all;
  for (auto& [k, v] : kRegimes) all += (all.empty() ? "" : ", ") + std::string(v);
  throw std::invalid_argument("regime: unknown regime '" + std::string(s) + "' (allowed: " + all +
                              ")");
}

std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (unsigned char ch : s) {
    switch (ch) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        // XML 1.0 forbids most control characters even as references.
        o += ch < 0x20 && ch != '\n' && ch != '\t' && ch != '\r' ? '?' : static_cast<char>(ch);
    }
  }
  return o;
}

std::string Case::line() const {
  std::string out = "op=" + op + " dtype=" + std::string(dtype_name(dtype)) +
                    " regime=" + std::string(regime_name(regime)) + " seed=" + std::to_string(seed);
  for (auto& [k, v] : p) out += " " + k + "=" + v;
  return out;
}

Case Case::parse(std::string_view line) {
  Case c;
  bool have_op = false;
  std::istringstream in{std::string(line)};
  std::string tok;
  std::set<std::string> seen;
  while (in >> tok) {
    const auto eq = tok.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw std::invalid_argument("case: token '" + tok + "' is not key=value");
    }
    const std::string key = tok.substr(0, eq), val = tok.substr(eq + 1);
    // A repeated key would silently override the first: the line would not say what runs.
    if (!seen.insert(key).second) throw std::invalid_argument("case: key '" + key + "' repeated");
    if (key == "op") {
      c.op = val;
      have_op = true;
    } else if (key == "dtype") {
      c.dtype = parse_dtype(val);
    } else if (key == "regime") {
      c.regime = parse_regime(val);
    } else if (key == "seed") {
      uint64_t s = 0;
      auto r = std::from_chars(val.data(), val.data() + val.size(), s);
      if (r.ec != std::errc() || r.ptr != val.data() + val.size()) {
        throw std::invalid_argument("case: seed '" + val + "' is not a u64");
      }
      c.seed = s;
    } else {
      c.p[key] = val;
    }
  }
  if (!have_op) throw std::invalid_argument("case: missing op=NAME in '" + std::string(line) + "'");
  return c;
}

const std::string& Case::s(const std::string& key) const {
  auto it = p.find(key);
  if (it == p.end())
    throw std::invalid_argument("case " + op + ": missing parameter '" + key + "'");
  return it->second;
}

int64_t Case::i(const std::string& key) const {
  const std::string& v = s(key);
  int64_t x = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  if (r.ec != std::errc() || r.ptr != v.data() + v.size()) {
    throw std::invalid_argument("case " + op + ": parameter " + key + "='" + v +
                                "' is not an integer");
  }
  return x;
}

double Case::f(const std::string& key) const {
  const std::string& v = s(key);
  if (v == "inf") return INFINITY;
  if (v == "-inf") return -INFINITY;
  if (v == "nan") return NAN;
  double x = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  if (r.ec != std::errc() || r.ptr != v.data() + v.size()) {
    throw std::invalid_argument("case " + op + ": parameter " + key + "='" + v +
                                "' is not a number");
  }
  return x;
}

bool Case::b(const std::string& key) const {
  const std::string& v = s(key);
  if (v == "1" || v == "true") return true;
  if (v == "0" || v == "false") return false;
  throw std::invalid_argument("case " + op + ": parameter " + key + "='" + v + "' is not a bool");
}

Case& Case::set(const std::string& key, int64_t v) {
  p[key] = std::to_string(v);
  return *this;
}
Case& Case::set(const std::string& key, double v) {
  p[key] = format_double(v);
  return *this;
}
Case& Case::set(const std::string& key, bool v) {
  p[key] = v ? "true" : "false";
  return *this;
}
Case& Case::set(const std::string& key, const std::string& v) {
  if (v.find_first_of(" \t\n=") != std::string::npos) {
    throw std::invalid_argument("case: value '" + v + "' of " + key + " has a space or '='");
  }
  p[key] = v;
  return *this;
}

}  // namespace moe
