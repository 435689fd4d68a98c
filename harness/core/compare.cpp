#include "harness/core/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace moe {

// SPEC §12's rows, plus one term SPEC leaves out [DEVIATION]: fp32 underflow. The relative model
// fl(a op b) = (a op b)(1 + d) fails once a result is subnormal; the standard model adds an
// absolute error |e| <= 2^-150 per fp32 rounding (Higham, Accuracy and Stability, §2.1). So the
// elementwise row gets 4 such terms (its 4 fp32 roundings) and a reduction of n terms n + 1. At
// most n * 1.4e-45, this changes no bound of a normal result; without it a softmax gradient of a
// -100 logit (subnormal in fp32) failed by 2 subnormal steps on the GPU.
double tol_bound(TolClass cls, DType out, double ref, int64_t n, double abs_sum) {
  constexpr double kUnderflow = 0x1.0p-150;
  switch (cls) {
    case TolClass::exact:
      return 0.0;
    case TolClass::elementwise:
      return ulp(out, ref) + 4.0 * ulp(DType::f32, ref) + 4.0 * kUnderflow;
    case TolClass::reduction:
      return ulp(out, std::fabs(ref)) + 2.0 * static_cast<double>(n) * 0x1.0p-24 * abs_sum +
             static_cast<double>(n + 1) * kUnderflow;
  }
  return 0.0;
}

Tensor make_bound(TolClass cls, DType out, const Tensor& ref, int64_t n, const Tensor* abs_sum) {
  Tensor b(DType::f64, ref.shape());
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double r = ref.at(i);
    const double s = abs_sum ? abs_sum->at(i) : std::fabs(r);
    b.set(i, tol_bound(cls, out, r, n, s));
  }
  return b;
}

double rounded_bound(DType out, double want, double exact, double err) {
  if (!std::isfinite(exact) || !std::isfinite(want) || !std::isfinite(err)) return 0.0;
  const double lo = round_to(out, exact - std::fabs(err));
  const double hi = round_to(out, exact + std::fabs(err));
  if (!std::isfinite(lo) || !std::isfinite(hi)) return ulp(out, want);
  // want outside the admissible interval is itself wrong (a tampered golden file, a reference
  // or budget fault): bound 0 reports the element instead of widening the bound around it.
  if (want < lo || want > hi) return 0.0;
  return std::max(want - lo, hi - want);
}

Tensor make_rounded_bound(DType out, const Tensor& want, const Tensor& exact, const Tensor& err) {
  if (want.shape() != exact.shape() || want.shape() != err.shape()) {
    throw std::invalid_argument("make_rounded_bound: shapes " + shape_str(want.shape()) + ", " +
                                shape_str(exact.shape()) + ", " + shape_str(err.shape()) +
                                " differ");
  }
  Tensor b(DType::f64, want.shape());
  for (int64_t i = 0; i < want.numel(); ++i)
    b.set(i, rounded_bound(out, want.at(i), exact.at(i), err.at(i)));
  return b;
}

std::vector<int64_t> unravel(int64_t index, const Shape& shape) {
  std::vector<int64_t> c(shape.size(), 0);
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] == 0) break;
    c[k] = index % shape[k];
    index /= shape[k];
  }
  return c;
}

namespace {

bool same_bits(const Tensor& a, const Tensor& b, int64_t i) {
  const size_t w = dtype_size(a.dtype());
  return std::memcmp(a.bytes() + i * w, b.bytes() + i * w, w) == 0;
}

std::string coord_str(const std::vector<int64_t>& c) {
  std::string s = "(";
  for (size_t i = 0; i < c.size(); ++i) s += (i ? ", " : "") + std::to_string(c[i]);
  return s + ")";
}

std::string num(double v) {
  std::ostringstream o;
  o.precision(9);
  o << v;
  return o.str();
}

}  // namespace

TensorReport compare(const std::string& name, const Tensor& got, const Tensor& want,
                     const Tensor* bound) {
  TensorReport r;
  r.name = name;
  if (got.dtype() != want.dtype() || got.shape() != want.shape()) {
    r.error = "got " + got.describe() + ", want " + want.describe();
    return r;
  }
  if (bound && bound->shape() != want.shape()) {
    r.error = "bound shape " + shape_str(bound->shape()) + " differs from " + want.describe();
    return r;
  }
  r.count = want.numel();
  double worst_ratio = 0.0;
  for (int64_t i = 0; i < r.count; ++i) {
    const double g = got.at(i), w = want.at(i);
    const double diff = (std::isnan(g) && std::isnan(w)) ? 0.0 : std::fabs(g - w);
    bool bad;
    double ratio;
    double b = 0.0;
    if (!bound) {
      bad = !same_bits(got, want, i);
      ratio = bad ? 1.0 : 0.0;
    } else {
      b = bound->at(i);
      if (std::isinf(b)) continue;  // masked element
      const bool nan_mismatch = std::isnan(g) != std::isnan(w);
      const bool inf_mismatch = (std::isinf(g) || std::isinf(w)) && g != w;
      bad = nan_mismatch || inf_mismatch || diff > b;
      ratio = bad && (nan_mismatch || inf_mismatch)
                  ? INFINITY
                  : (b > 0 ? diff / b : (diff > 0 ? INFINITY : 0));
    }
    if (std::isfinite(diff)) {
      r.max_abs = std::max(r.max_abs, diff);
      if (w != 0) r.max_rel = std::max(r.max_rel, diff / std::fabs(w));
    }
    if (bad) {
      ++r.mismatches;
      Mismatch m{i, unravel(i, want.shape()), g, w, b};
      if (!r.first) r.first = m;
      if (!r.worst || ratio > worst_ratio) r.worst = m;
    }
    worst_ratio = std::max(worst_ratio, ratio);
  }
  r.worst_pct = 100.0 * worst_ratio;
  return r;
}

std::string TensorReport::str() const {
  std::ostringstream o;
  if (!error.empty()) {
    o << "  " << name << ": " << error << "\n";
    return o.str();
  }
  o << "  " << name << ": " << mismatches << " of " << count << " elements mismatch"
    << "; max abs err " << num(max_abs) << ", max rel err " << num(max_rel) << ", worst "
    << num(worst_pct) << "% of tolerance\n";
  auto line = [&](const char* what, const Mismatch& m) {
    o << "    " << what << " at " << coord_str(m.coord) << ": got " << num(m.got) << ", want "
      << num(m.want) << ", |diff| " << num(std::fabs(m.got - m.want)) << ", bound " << num(m.bound)
      << "\n";
  };
  if (first) line("first", *first);
  if (worst) line("worst", *worst);
  return o.str();
}

bool Report::ok() const {
  if (!failures.empty()) return false;
  for (auto& t : tensors)
    if (!t.ok()) return false;
  return true;
}

double Report::worst_pct() const {
  double w = 0;
  for (auto& t : tensors) w = std::max(w, t.worst_pct);
  return w;
}

std::string Report::str() const {
  std::string s;
  for (auto& t : tensors)
    if (!t.ok()) s += t.str();
  for (auto& f : failures) s += "  " + f + "\n";
  return s;
}

}  // namespace moe
