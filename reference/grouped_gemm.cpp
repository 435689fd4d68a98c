#include "reference/grouped_gemm.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "reference/perm_detail.h"

namespace moe::ref {

namespace {

using detail::MatX;

// Group g of a [G, rows, cols] tensor as a matrix of exact doubles.
MatX group_matrix(const Tensor& t, int64_t g) {
  const int64_t rows = t.dim(1), cols = t.dim(2);
  MatX m(rows, cols);
  const int64_t base = g * rows * cols;
  for (int64_t i = 0; i < rows * cols; ++i) m.data()[i] = t.at(base + i);
  return m;
}

void store_group(Tensor& t, int64_t g, const MatX& m) {
  const int64_t base = g * m.rows() * m.cols();
  for (int64_t i = 0; i < m.size(); ++i) t.set(base + i, m.data()[i]);
}

std::vector<int64_t> read_sizes(const Tensor& gs) {
  std::vector<int64_t> v(static_cast<size_t>(gs.numel()));
  for (int64_t g = 0; g < gs.numel(); ++g) v[g] = detail::int_at(gs, g);
  return v;
}

}  // namespace

Tensor grouped_gemm_fwd(const Tensor& x, const Tensor& w, const Tensor& group_sizes,
                        const Tensor* bias, Rounding r) {
  const TensorMeta bm = bias ? bias->meta() : TensorMeta{};
  const GroupedGemmShape s = validate_grouped_gemm(x.meta(), w.meta(), group_sizes.meta(),
                                                   bias ? &bm : nullptr, r == Rounding::none);
  const std::vector<int64_t> sizes = read_sizes(group_sizes);
  check_group_sizes(sizes, s.rows);
  const MatX X = detail::to_matrix(x);
  MatX out = MatX::Zero(s.rows, s.n);  // tail rows stay 0 [DECISION]
  int64_t o = 0;
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t n = sizes[g];
    if (n > 0) {
      auto block = out.middleRows(o, n);
      block.noalias() = X.middleRows(o, n) * group_matrix(w, g);
      if (bias) {
        for (int64_t c = 0; c < s.n; ++c) block.col(c).array() += bias->at(g, c);
      }
    }
    o += n;
  }
  Tensor t(out_dtype(x.dtype(), r), {s.rows, s.n});
  detail::store(t, out);
  return t;
}

GroupedGemmBwd grouped_gemm_bwd(const Tensor& grad_out, const Tensor& x, const Tensor& w,
                                const Tensor& group_sizes, const Tensor* bias, Rounding r) {
  const TensorMeta bm = bias ? bias->meta() : TensorMeta{};
  const GroupedGemmShape s = validate_grouped_gemm(x.meta(), w.meta(), group_sizes.meta(),
                                                   bias ? &bm : nullptr, r == Rounding::none);
  require_shape(grad_out.meta(), {s.rows, s.n}, "grad_out");
  if (!is_floating(grad_out.dtype())) {
    throw std::invalid_argument("grad_out: unsupported dtype " +
                                std::string(dtype_name(grad_out.dtype())));
  }
  const std::vector<int64_t> sizes = read_sizes(group_sizes);
  check_group_sizes(sizes, s.rows);
  const MatX X = detail::to_matrix(x);
  const MatX CT = detail::to_matrix(grad_out);
  MatX gx = MatX::Zero(s.rows, s.k);
  GroupedGemmBwd out;
  out.grad_w = Tensor(out_dtype(w.dtype(), r), {s.groups, s.k, s.n});  // empty groups: exactly 0
  if (bias) out.grad_bias = Tensor(out_dtype(bias->dtype(), r), {s.groups, s.n});
  int64_t o = 0;
  for (int64_t g = 0; g < s.groups; ++g) {
    const int64_t n = sizes[g];
    if (n > 0) {
      const MatX W = group_matrix(w, g);
      gx.middleRows(o, n).noalias() = CT.middleRows(o, n) * W.transpose();
      const MatX gw = X.middleRows(o, n).transpose() * CT.middleRows(o, n);
      store_group(out.grad_w, g, gw);
      if (bias) {
        const Eigen::RowVectorXd gb = CT.middleRows(o, n).colwise().sum();
        for (int64_t c = 0; c < s.n; ++c) out.grad_bias->set(g, c, gb(c));
      }
    }
    o += n;
  }
  out.grad_x = Tensor(out_dtype(x.dtype(), r), {s.rows, s.k});
  detail::store(out.grad_x, gx);
  return out;
}

}  // namespace moe::ref
