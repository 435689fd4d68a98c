#include "harness/ops/ep_family.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"

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
  if (c.b("even_groups", false)) {
    for (int64_t g = 0; g < groups; ++g) sizes[g] = total / groups + (g < total % groups ? 1 : 0);
    return sizes;
  }
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

A2AArrays spec_a2a_arrays(const Tensor& A, int64_t s, int64_t P, bool forward) {
  const int64_t L = A.dim(1) / P;
  // Snd[i][j]: rows rank i sends to rank j in the forward exchange (j's experts of A's row i).
  auto snd = [&](int64_t i, int64_t j) {
    int64_t n = 0;
    for (int64_t l = 0; l < L; ++l) n += static_cast<int64_t>(A.at(i, j * L + l));
    return n;
  };
  A2AArrays a;
  int64_t in_acc = 0;
  for (int64_t j = 0; j < P; ++j) {
    const int64_t send = forward ? snd(s, j) : snd(j, s);
    int64_t out = 0;
    for (int64_t i = 0; i < s; ++i) out += forward ? snd(i, j) : snd(j, i);
    a.send_sizes.push_back(send);
    a.input_offsets.push_back(in_acc);
    a.recv_sizes.push_back(forward ? snd(j, s) : snd(s, j));
    a.output_offsets.push_back(out);
    in_acc += send;
  }
  return a;
}

int64_t ep_pre_rows(int64_t E, int64_t N, int64_t a) {
  return a > 0 ? N + E * (a - 1) : N;
}

int64_t ep_recv_rows(int64_t P, int64_t E, int64_t N, int64_t a) {
  return a > 0 ? P * N + E * (a - 1) : P * N;
}

int64_t local_perm_rows(const Case& c) {
  return c.i(
      "R", ep_recv_rows(c.i("num_ep"), c.i("E"), c.i("N"), c.i("align_size", 0)) + c.i("slack", 0));
}

rc::Gen<Case> local_perm_gen(const std::string& op) {
  return rc::gen::exec([op] {
    Case c = draw_case(op, kSizeRegimes);
    draw_ep_experts(c);
    c.set("N", *any_in(0, 16)).set("H", *any_in(1, 5));
    c.set("align_size", draw_ep_align_size());
    c.set("slack", *rc::gen::element<int64_t>(0, 0, 5));
    return c;
  });
}

Cost local_perm_cost(const Case& c) {
  const double P = static_cast<double>(c.i("num_ep")), H = static_cast<double>(c.i("H"));
  const double R = static_cast<double>(local_perm_rows(c));
  const double e = static_cast<double>(dtype_size(c.dtype));
  Cost k;
  k.fwd_bytes = P * R * (2 * H * e + 4);
  k.bwd_bytes = P * R * (2 * H * e + 4);
  return k;
}

nlohmann::json ep_params(const Case& c) {
  return int_params(c, {"num_ep"});
}

Case local_perm_case(const std::string& op, uint64_t seed, const std::string& name, DType d,
                     int64_t P, int64_t E, int64_t N, int64_t H, int64_t a) {
  CaseBuilder b(op, d);
  b.seed(seed).name(name).set("num_ep", P).set("E", E).set("N", N).set("H", H);
  return b.set("align_size", a).set("slack", int64_t{0});
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
