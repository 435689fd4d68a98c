#include "harness/ops/case_validation.h"

#include <charconv>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

#include "harness/ops/registry.h"

namespace moe::ops {

namespace {

enum class Kind { integer, number, boolean, int_list, enumeration, free };

struct KeyInfo {
  Kind kind = Kind::integer;
  std::set<std::string> values;  // every value seen
};

bool is_int(const std::string& v) {
  int64_t x;
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
}
bool is_number(const std::string& v) {
  if (v == "inf" || v == "-inf" || v == "nan") return true;
  double x;
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
}
bool is_bool(const std::string& v) {
  return v == "true" || v == "false";
}
bool is_int_list(const std::string& v) {  // "3,1,8,2" (split sizes, chunk orders)
  size_t start = 0;
  while (true) {
    const size_t comma = v.find(',', start);
    if (!is_int(v.substr(start, comma == std::string::npos ? std::string::npos : comma - start)))
      return false;
    if (comma == std::string::npos) return true;
    start = comma + 1;
  }
}
// Keys with more distinct string values than this are free-form, not enumerations.
constexpr size_t kMaxEnumValues = 16;

using Keys = std::map<std::string, KeyInfo>;

Keys learn(const OpInfo& op) {
  Keys keys;
  auto add = [&](const Case& c) {
    for (auto& [k, v] : c.p) keys[k].values.insert(v);
  };
  if (op.named)
    for (const Case& c : op.named()) add(c);
  if (op.bench_cases)
    for (const Case& c : op.bench_cases()) add(c);
  for (int i = 0; i < 400; ++i) add(op.gen()(rc::Random(0x5eed0000ull + i), 10 + i % 91).value());
  for (auto& [k, info] : keys) {
    bool ints = true, nums = true, bools = true, lists = true;
    for (auto& v : info.values) {
      ints &= is_int(v);
      lists &= is_int_list(v);
      nums &= is_number(v);
      bools &= is_bool(v) || v == "0" || v == "1";
    }
    if (k == "name") {
      info.kind = Kind::free;
    } else if (bools && std::any_of(info.values.begin(), info.values.end(), is_bool)) {
      info.kind = Kind::boolean;
    } else if (ints) {
      info.kind = Kind::integer;
    } else if (nums) {
      info.kind = Kind::number;
    } else if (lists) {
      info.kind = Kind::int_list;
    } else if (info.values.size() > kMaxEnumValues) {
      info.kind = Kind::free;
    } else {
      info.kind = Kind::enumeration;
    }
  }
  return keys;
}

const Keys& keys_of(const OpInfo& op) {
  static std::mutex mu;
  static std::map<std::string, Keys> cache;
  std::lock_guard<std::mutex> g(mu);
  auto it = cache.find(op.name);
  if (it == cache.end()) it = cache.emplace(op.name, learn(op)).first;
  return it->second;
}

std::string join(const std::set<std::string>& s) {
  std::string out;
  for (auto& v : s) out += (out.empty() ? "" : ", ") + v;
  return out;
}

}  // namespace

void validate_case(const Case& c) {
  const OpInfo* op = find_op(c.op);
  if (!op) {
    std::set<std::string> names;
    for (const OpInfo* o : all_ops()) names.insert(o->name);
    throw std::invalid_argument("unknown op '" + c.op + "' (ops: " + join(names) + ")");
  }
  const Keys& keys = keys_of(*op);
  for (auto& [k, v] : c.p) {
    auto it = keys.find(k);
    if (it == keys.end()) {
      std::set<std::string> names;
      for (auto& [n, info] : keys) names.insert(n);
      throw std::invalid_argument("unknown key '" + k + "' for " + c.op +
                                  " (keys: op, dtype, regime, seed, " + join(names) + ")");
    }
    const KeyInfo& info = it->second;
    const std::string bad = c.op + ": " + k + "=" + v + " is not ";
    switch (info.kind) {
      case Kind::integer:
        if (!is_int(v)) throw std::invalid_argument(bad + "an integer");
        break;
      case Kind::number:
        if (!is_number(v)) throw std::invalid_argument(bad + "a number");
        break;
      case Kind::boolean:
        if (!is_bool(v) && v != "0" && v != "1") throw std::invalid_argument(bad + "true or false");
        break;
      case Kind::int_list:
        if (!is_int_list(v))
          throw std::invalid_argument(bad + "a comma-separated list of integers");
        break;
      case Kind::enumeration:
        if (!info.values.count(v))
          throw std::invalid_argument(bad + "allowed (allowed: " + join(info.values) + ")");
        break;
      case Kind::free:
        break;
    }
  }
}

Case parse_case_for_op(std::string_view line) {
  Case c = Case::parse(line);
  validate_case(c);
  return c;
}

}  // namespace moe::ops
