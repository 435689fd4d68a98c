// Pieces shared by the router-family records: parameters of a Case, logits per regime, and the
// tie-aware comparison of SPEC §1.4.
#include "harness/ops/router_family.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness/core/rng.h"

namespace moe::ops {

RouterParams router_params(const Case& c) {
  RouterParams p;
  p.topk = c.i("topk");
  p.score_function = parse_score_function(c.s("score_function", "softmax"));
  p.use_pre_softmax = c.b("use_pre_softmax", false);
  p.num_groups = c.i("num_groups", 0);
  p.group_topk = c.i("group_topk", 0);
  p.scaling_factor = c.f("scaling_factor", 1.0);
  p.routing_map_format = parse_map_format(c.s("routing_map_format", "bytemap"));
  return p;
}

Tensor make_logits(const Case& c, int64_t T, int64_t E, int64_t K, const std::string& name) {
  Tensor x(c.dtype, {T, E});
  Rng rng(c.seed, name);
  const DType d = c.dtype;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double v = 0;
      switch (c.regime) {
        case Regime::uniform:
        case Regime::zero_tokens:
          v = 2.0 * rng.normal();
          break;
        case Regime::skewed:  // the first eighth of the experts are strongly preferred
          v = rng.normal() + (e < std::max<int64_t>(1, E / 8) ? 3.0 : 0.0);
          break;
        case Regime::exact_ties:  // few distinct values: bitwise-equal scores everywhere
          v = 0.5 * static_cast<double>(rng.below(5) - 2);
          break;
        case Regime::near_ties:
          v = rng.normal();
          break;
        case Regime::large_magnitude:
          v = (rng.coin() ? 1.0 : -1.0) * rng.uniform(100.0, d == DType::f16 ? 3000.0 : 10000.0);
          break;
        case Regime::all_to_one:  // every token prefers the same K experts
          v = rng.normal() + (e < K ? 12.0 : 0.0);
          break;
      }
      x.set(t, e, v);
    }
    if (c.regime == Regime::near_ties && K < E) {
      // Put the (K+1)-th largest logit one ulp of d below the K-th: scores differ by ~1 ulp.
      std::vector<int64_t> idx(E);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(),
                       [&](int64_t a, int64_t b) { return x.at(t, a) > x.at(t, b); });
      const double kth = x.at(t, idx[K - 1]);
      x.set(t, idx[K], kth - ulp(d, kth));
    }
  }
  return x;
}

TensorMap fd_mask_large_rows(const Tensor& logits) {
  Tensor mask(DType::f64, logits.shape());
  for (int64_t t = 0; t < logits.dim(0); ++t) {
    double mx = 0;
    for (int64_t e = 0; e < logits.dim(1); ++e) mx = std::max(mx, std::fabs(logits.at(t, e)));
    for (int64_t e = 0; e < logits.dim(1); ++e) mask.set(t, e, mx <= kFdMaxLogit ? 1.0 : 0.0);
  }
  TensorMap m;
  m.emplace("input.logits", std::move(mask));
  return m;
}

std::vector<int64_t> routing_rows_differ(const Tensor& a, const Tensor& b) {
  std::vector<int64_t> rows;
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || a.rank() != 2) return rows;
  for (int64_t t = 0; t < a.dim(0); ++t) {
    for (int64_t j = 0; j < a.dim(1); ++j) {
      if (a.at(t, j) != b.at(t, j)) {
        rows.push_back(t);
        break;
      }
    }
  }
  return rows;
}

}  // namespace moe::ops
