#include "harness/ops/perm_family.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "harness/core/rng.h"
#include "harness/ops/check.h"

namespace moe::ops {

namespace {

// k distinct ids out of `pool`, each pick weighted by weight[id] (sequential, without
// replacement), returned ascending.
std::vector<int64_t> pick(Rng& rng, std::vector<int64_t> pool, const std::vector<double>& weight,
                          int64_t k) {
  std::vector<int64_t> out;
  for (int64_t j = 0; j < k && !pool.empty(); ++j) {
    double total = 0;
    for (int64_t e : pool) total += weight[e];
    double x = rng.uniform() * total;
    size_t i = 0;
    for (; i + 1 < pool.size(); ++i) {
      x -= weight[pool[i]];
      if (x < 0) break;
    }
    out.push_back(pool[i]);
    pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<std::vector<int64_t>> make_routes(const Case& c, int64_t T, int64_t E, int64_t K,
                                              bool ragged, const std::string& name) {
  if (K < 0 || K > E) {
    throw std::invalid_argument("K: must be in [0, E=" + std::to_string(E) + "], got " +
                                std::to_string(K));
  }
  Rng rng(c.seed, name);
  std::vector<int64_t> all(E);
  std::iota(all.begin(), all.end(), int64_t{0});
  std::vector<double> weight(E, 1.0);
  std::vector<int64_t> pool = all;
  if (c.regime == Regime::skewed) {
    for (int64_t e = 0; e < E; ++e) weight[e] = 1.0 / static_cast<double>((e + 1) * (e + 1));
  } else if (c.regime == Regime::zero_tokens) {
    pool = pick(rng, all, weight, std::max(K, E / 2));
  }
  const std::vector<int64_t> fixed = pick(rng, all, weight, K);  // all_to_one's expert set
  std::vector<std::vector<int64_t>> routes(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = ragged ? rng.below(K + 1) : K;
    if (c.regime == Regime::all_to_one) {
      routes[t].assign(fixed.begin(), fixed.begin() + n);
    } else {
      routes[t] = pick(rng, pool, weight, n);
    }
  }
  return routes;
}

Tensor routes_to_map(const std::vector<std::vector<int64_t>>& routes, int64_t E) {
  Tensor m(DType::boolean, {static_cast<int64_t>(routes.size()), E});
  for (size_t t = 0; t < routes.size(); ++t)
    for (int64_t e : routes[t]) m.set(static_cast<int64_t>(t), e, 1.0);
  return m;
}

Tensor normal_tensor(const Case& c, DType d, const Shape& s, const std::string& name) {
  Tensor t(d, s);
  Rng rng(c.seed, name);
  fill_normal(t, rng, 1.0);
  return t;
}

Tensor uniform_tensor(const Case& c, DType d, const Shape& s, double lo, double hi,
                      const std::string& name) {
  Tensor t(d, s);
  Rng rng(c.seed, name);
  fill_uniform(t, rng, lo, hi);
  return t;
}

std::optional<DType> opt_dtype(const Case& c, const std::string& key) {
  const std::string v = c.s(key, "none");
  if (v == "none") return std::nullopt;
  try {
    return parse_dtype(v);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(key + ": unknown dtype '" + v + "'");
  }
}

std::string dtype_or_none(const std::optional<DType>& d) {
  return d ? std::string(dtype_name(*d)) : std::string("none");
}

std::vector<int64_t> parse_int_list(const std::string& s, const std::string& key) {
  std::vector<int64_t> v;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = std::min(s.find(',', pos), s.size());
    const std::string tok = s.substr(pos, end - pos);
    try {
      size_t used = 0;
      v.push_back(std::stoll(tok, &used));
      if (used != tok.size()) throw std::invalid_argument(tok);
    } catch (const std::exception&) {
      throw std::invalid_argument(key + ": bad integer '" + tok + "' in '" + s + "'");
    }
    pos = end + 1;
  }
  return v;
}

std::string int_list(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

TokenDispatchParams dispatch_params(const Case& c) {
  TokenDispatchParams p;
  p.num_out_tokens = c.i("num_out_tokens");
  p.align_size = c.i("align_size", 0);
  p.drop_overflow = c.b("drop_overflow", false);
  return p;
}

ArgsortDispatchParams argsort_params(const Case& c) {
  ArgsortDispatchParams p;
  p.num_experts = c.i("E");
  p.topk = c.i("topk");
  p.align_size = c.i("align_size", 0);
  if (c.has("roll_to_expert_id")) p.roll_to_expert_id = c.i("roll_to_expert_id");
  return p;
}

Tensor make_selected_experts(const Case& c, int64_t T, int64_t E, int64_t K) {
  Tensor sel(DType::i32, {T, K});
  if (c.has("selected_experts")) {
    const auto v = parse_int_list(c.s("selected_experts"), "selected_experts");
    if (static_cast<int64_t>(v.size()) != T * K) {
      throw std::invalid_argument("selected_experts: " + std::to_string(v.size()) +
                                  " ids for T*K = " + std::to_string(T * K));
    }
    for (int64_t i = 0; i < T * K; ++i) sel.set(i, static_cast<double>(v[i]));
    return sel;
  }
  auto routes = make_routes(c, T, E, K, false, "input.selected_experts");
  Rng rng(c.seed, "input.selected_experts.order");
  for (int64_t t = 0; t < T; ++t) {
    auto& r = routes[t];
    for (int64_t i = K - 1; i > 0; --i) std::swap(r[i], r[rng.below(i + 1)]);
    for (int64_t k = 0; k < K; ++k) sel.set(t, k, static_cast<double>(r[k]));
  }
  return sel;
}

Tensor selected_to_map(const Tensor& selected, int64_t E) {
  Tensor m(DType::boolean, {selected.dim(0), E});
  for (int64_t t = 0; t < selected.dim(0); ++t)
    for (int64_t k = 0; k < selected.dim(1); ++k)
      m.set(t, static_cast<int64_t>(selected.at(t, k)), 1.0);
  return m;
}

Report compare_perm(const OpInfo& op, const Case& c, const TensorMap& in, const TensorMap& want,
                    const TensorMap& got, const std::set<std::string>& toleranced) {
  Report r;
  for (auto& [key, w] : want) {
    auto it = got.find(key);
    if (it == got.end()) {
      r.failures.push_back(key + ": missing from the result");
      continue;
    }
    if (toleranced.count(key) && is_floating(w.dtype())) {
      const Tensor b = op.bound(c, key, in, want);
      r.tensors.push_back(compare(key, it->second, w, &b));
    } else {
      r.tensors.push_back(compare(key, it->second, w, nullptr));
    }
  }
  for (auto& [key, g] : got) {
    if (!want.count(key)) {
      r.failures.push_back(key + ": produced but the reference has no such tensor");
    }
  }
  return r;
}

const Tensor* find_tensor(const TensorMap& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? nullptr : &it->second;
}

}  // namespace moe::ops
