#include "harness/ops/ep_family.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "harness/ops/perm_family.h"

namespace moe::ops {

Tensor stack(const std::vector<Tensor>& v) {
  if (v.empty()) throw std::invalid_argument("stack: no tensors");
  Shape s{static_cast<int64_t>(v.size())};
  s.insert(s.end(), v[0].shape().begin(), v[0].shape().end());
  Tensor out(v[0].dtype(), s);
  const size_t bytes = v[0].nbytes();
  for (size_t r = 0; r < v.size(); ++r) {
    if (v[r].dtype() != v[0].dtype() || v[r].shape() != v[0].shape()) {
      throw std::invalid_argument("stack: rank " + std::to_string(r) + " holds " + v[r].describe() +
                                  ", rank 0 holds " + v[0].describe());
    }
    if (bytes) std::memcpy(out.bytes() + r * bytes, v[r].bytes(), bytes);
  }
  return out;
}

std::vector<Tensor> unstack(const Tensor& t) {
  if (t.rank() < 1) throw std::invalid_argument("unstack: expected a leading rank axis");
  const Shape s(t.shape().begin() + 1, t.shape().end());
  std::vector<Tensor> v;
  for (int64_t r = 0; r < t.dim(0); ++r) {
    Tensor x(t.dtype(), s);
    if (x.nbytes()) std::memcpy(x.bytes(), t.bytes() + r * x.nbytes(), x.nbytes());
    v.push_back(std::move(x));
  }
  return v;
}

std::vector<int64_t> make_group_sizes(const Case& c, int64_t groups, int64_t total,
                                      const std::string& name) {
  std::vector<int64_t> sizes(groups, 0);
  if (groups == 0) return sizes;
  // One route per row (K = 1) through the shared regime generator.
  for (const auto& r : make_routes(c, total, groups, 1, false, name)) ++sizes[r.at(0)];
  return sizes;
}

Tensor make_ep_counts(const Case& c, int64_t P, int64_t E, int64_t N, int64_t a,
                      const std::string& name) {
  Tensor A(DType::i32, {P, E});
  for (int64_t i = 0; i < P; ++i) {
    const auto sizes = make_group_sizes(c, E, N, name + "#rank" + std::to_string(i));
    for (int64_t e = 0; e < E; ++e) {
      A.set(i, e, static_cast<double>(dispatch_aligned_count(sizes[e], a)));
    }
  }
  return A;
}

int64_t ep_pre_rows(int64_t E, int64_t N, int64_t a) {
  return a > 0 ? N + E * (a - 1) : N;
}

int64_t ep_recv_rows(int64_t P, int64_t E, int64_t N, int64_t a) {
  return a > 0 ? P * N + E * (a - 1) : P * N;
}

Tensor abs_f64(const Tensor& t) {
  Tensor out(DType::f64, t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) out.set(i, std::fabs(t.at(i)));
  return out;
}

Tensor reduction_bound(DType out, const Tensor& ref, const Tensor& abs_sum, int64_t n_scalar,
                       const Tensor* n_per) {
  Tensor b(DType::f64, ref.shape());
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const int64_t n = n_per ? static_cast<int64_t>(n_per->at(i)) : n_scalar;
    b.set(i, tol_bound(TolClass::reduction, out, ref.at(i), n, abs_sum.at(i)));
  }
  return b;
}

std::vector<int64_t> int_values(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<int64_t>(t.at(i));
  return v;
}

}  // namespace moe::ops
