#include "harness/core/finite_diff.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "harness/core/compare.h"
#include "harness/core/rng.h"

namespace moe {

bool FdResult::ok() const {
  return std::isfinite(numeric) && std::isfinite(analytic) && std::fabs(numeric - analytic) <= tol;
}

std::string FdResult::str() const {
  std::ostringstream o;
  o.precision(10);
  o << "grad." << input << " " << probe << ": analytic " << analytic << ", finite difference "
    << numeric << ", |diff| " << std::fabs(numeric - analytic) << ", tol " << tol;
  return o.str();
}

namespace {

TensorMap clone_map(const TensorMap& m) {
  TensorMap out;
  for (auto& [k, v] : m) out.emplace(k, v.clone());
  return out;
}

// Derivative of t -> L(x + t*dir) at 0 by Richardson-extrapolated central differences.
double directional(const LossFn& loss, TensorMap& work, const std::string& name, const Tensor& x0,
                   const Tensor& dir, double h) {
  auto eval = [&](double t) {
    Tensor& x = work.at(name);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, x0.at(i) + t * dir.at(i));
    return loss(work);
  };
  const double d1 = (eval(h) - eval(-h)) / (2 * h);
  const double d2 = (eval(h / 2) - eval(-h / 2)) / h;
  Tensor& x = work.at(name);
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, x0.at(i));
  return (4 * d2 - d1) / 3;
}

}  // namespace

std::vector<FdResult> fd_check(const LossFn& loss, const TensorMap& inputs, const TensorMap& grads,
                               const TensorMap& masks, const FdOptions& opt) {
  std::vector<FdResult> out;
  TensorMap work = clone_map(inputs);
  Rng rng(opt.seed, "fd");
  for (auto& [name, g] : grads) {
    auto it = inputs.find(name);
    if (it == inputs.end()) throw std::invalid_argument("fd_check: no input for grad " + name);
    const Tensor& x0 = it->second;
    if (x0.dtype() != DType::f64 || g.shape() != x0.shape()) {
      throw std::invalid_argument("fd_check: input " + name +
                                  " must be f64 and match its grad, got " + x0.describe() + " vs " +
                                  g.describe());
    }
    const Tensor* mask = masks.count(name) ? &masks.at(name) : nullptr;
    auto scale = [&](int64_t i) {
      if (mask && mask->at(i) == 0.0) return 0.0;
      return std::max(1.0, std::fabs(x0.at(i)));
    };
    auto probe = [&](const Tensor& dir, std::string what) {
      double ana = 0, mag = 0;
      for (int64_t i = 0; i < dir.numel(); ++i) {
        ana += g.at(i) * dir.at(i);
        mag += std::fabs(g.at(i) * dir.at(i));
      }
      FdResult r;
      r.input = name;
      r.probe = std::move(what);
      r.analytic = ana;
      r.numeric = directional(loss, work, name, x0, dir, opt.step);
      r.tol = opt.rtol * (mag + std::fabs(r.numeric)) + opt.atol;
      out.push_back(std::move(r));
    };
    bool any = false;
    for (int64_t i = 0; i < x0.numel() && !any; ++i) any = scale(i) != 0.0;
    if (!any) continue;
    for (int d = 0; d < opt.directions; ++d) {
      Tensor dir(DType::f64, x0.shape());
      for (int64_t i = 0; i < dir.numel(); ++i) dir.set(i, (rng.coin() ? 1.0 : -1.0) * scale(i));
      probe(dir, "direction " + std::to_string(d));
    }
    if (x0.numel() <= opt.per_element_max) {
      for (int64_t i = 0; i < x0.numel(); ++i) {
        if (scale(i) == 0.0) continue;
        Tensor dir(DType::f64, x0.shape());
        dir.set(i, scale(i));
        std::string c;
        for (auto v : unravel(i, x0.shape())) c += (c.empty() ? "" : ", ") + std::to_string(v);
        probe(dir, "element (" + c + ")");
      }
    }
  }
  return out;
}

}  // namespace moe
