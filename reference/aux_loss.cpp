// CPU reference of aux_loss_scores (SPEC §2) and moe_aux_loss (SPEC §3).
#include "reference/aux_loss.h"

#include "harness/core/score_fn.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace moe::ref {

namespace {

using Eigen::ArrayXd;
constexpr double kEps = static_cast<double>(kRouterEps);

double sp_d(double x) {
  return x > 20.0 ? x : std::log1p(std::exp(x));
}
double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

void check_grad_dtype(const Tensor& t, const char* what, Rounding r) {
  const DType d = t.dtype();
  if (d == DType::f32 || d == DType::bf16 || d == DType::f16) return;
  if (d == DType::f64 && r == Rounding::none) return;
  throw std::invalid_argument(std::string(what) + ": unsupported dtype " +
                              std::string(dtype_name(d)));
}

}  // namespace

AuxLossScoresFwd aux_loss_scores_fwd(const Tensor& logits, int64_t topk, ScoreFunction f,
                                     MapFormat fmt, Rounding r) {
  validate_aux_loss_scores(logits.meta(), topk, r == Rounding::none);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  AuxLossScoresFwd out{
      Tensor(out_dtype(DType::f32, r), {T, E}),
      Tensor(fmt == MapFormat::bytemap ? DType::boolean : DType::u8, routing_map_shape(T, E, fmt)),
      Tensor(out_dtype(DType::f32, r), {T, E})};
  ArrayXd x(E), u(E), sc(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) x[e] = logits.at(t, e);
    switch (f) {
      case ScoreFunction::softmax: {
        const ArrayXd ex = (x - x.maxCoeff()).exp();
        sc = ex / ex.sum();
        u = sc;
        break;
      }
      case ScoreFunction::sigmoid:
        u = x.unaryExpr([](double v) { return sigmoid_d(v); });
        sc = u / (u.sum() + kEps);
        // saved: the fp32 sigmoid the kernel saves (score_fn.h); the backward's a(1 - a)
        // amplifies ulp differences of a near 1.
        if (r == Rounding::to_dtype) {
          u = x.unaryExpr(
              [](double v) { return double(score::sigmoid_f32(static_cast<float>(v))); });
        }
        break;
      case ScoreFunction::sqrtsoftplus: {
        const ArrayXd y = x.unaryExpr([](double v) { return std::sqrt(sp_d(v)); });
        sc = y / (y.sum() + kEps);
        u = x;  // saved: the raw logits
        break;
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      out.scores.set(t, e, sc[e]);
      out.saved_scores.set(t, e, u[e]);
    }
    // routing_map: canonical top-K (value desc, index asc) of the fp32 scores the CUDA kernel
    // selects on, so both sides see bitwise equal values.
    const std::vector<float> s32 = aux_selection_scores(logits, t, f).scores;
    std::vector<int> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s32[a] > s32[b]; });
    for (int64_t k = 0; k < topk; ++k) routing_map_set(out.routing_map, t, idx[k], true);
  }
  return out;
}

AuxSelection aux_selection_scores(const Tensor& logits, int64_t t, ScoreFunction f) {
  const int64_t E = logits.dim(1);
  std::vector<float> x32(E);
  for (int64_t e = 0; e < E; ++e) x32[e] = static_cast<float>(logits.at(t, e));
  AuxSelection r;
  r.scores.resize(E);
  if (f == ScoreFunction::softmax) {
    score::softmax_f32(x32.data(), r.scores.data(), E);
    return r;
  }
  r.raw.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    r.raw[e] =
        f == ScoreFunction::sigmoid ? score::sigmoid_f32(x32[e]) : score::sqrtsoftplus_f32(x32[e]);
  }
  r.den = score::row_sum_f32(r.raw.data(), E) + kRouterEps;
  for (int64_t e = 0; e < E; ++e) r.scores[e] = r.raw[e] / r.den;
  return r;
}

Tensor aux_loss_scores_bwd(const Tensor& grad_scores, const Tensor& saved_scores, ScoreFunction f,
                           DType logits_dtype, Rounding r) {
  require_rank(grad_scores.meta(), 2, "grad_scores");
  if (!(grad_scores.dtype() == DType::f32 ||
        (r == Rounding::none && grad_scores.dtype() == DType::f64))) {
    throw std::invalid_argument("grad_scores: must be float32, got " + grad_scores.describe());
  }
  const int64_t T = grad_scores.dim(0), E = grad_scores.dim(1);
  require_shape(saved_scores.meta(), {T, E}, "saved_scores");
  if (!(logits_dtype == DType::f32 || logits_dtype == DType::bf16 || logits_dtype == DType::f16 ||
        (logits_dtype == DType::f64 && r == Rounding::none))) {
    throw std::invalid_argument("logits_dtype: unsupported dtype " +
                                std::string(dtype_name(logits_dtype)));
  }
  Tensor grad(out_dtype(logits_dtype, r), {T, E});
  ArrayXd g(E), a(E), out(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      g[e] = grad_scores.at(t, e);
      a[e] = saved_scores.at(t, e);
    }
    switch (f) {
      case ScoreFunction::softmax:
        out = a * (g - (g * a).sum());
        break;
      case ScoreFunction::sigmoid:
      case ScoreFunction::sqrtsoftplus: {
        const bool sig = f == ScoreFunction::sigmoid;
        ArrayXd y(E), c(E);
        for (int64_t e = 0; e < E; ++e) {
          if (sig) {
            y[e] = a[e];
            c[e] = a[e] * (1.0 - a[e]);
          } else {
            y[e] = std::sqrt(sp_d(a[e]));
            c[e] = (a[e] > 20.0 ? 1.0 : sigmoid_d(a[e])) / (2.0 * y[e] + kEps);
          }
        }
        const double A = y.sum(), B = (g * y).sum();
        out = (g / (A + kEps) - B / ((A + kEps) * (A + kEps))) * c;
        break;
      }
    }
    for (int64_t e = 0; e < E; ++e) grad.set(t, e, out[e]);
  }
  return grad;
}

MoeAuxLossFwd moe_aux_loss_fwd(const Tensor& probs, const Tensor& tokens_per_expert,
                               const AuxLossParams& params, Rounding r) {
  const AuxLossParams p =
      validate_moe_aux_loss(probs.meta(), tokens_per_expert.meta(), params, r == Rounding::none);
  const int64_t R = probs.dim(0), C = probs.dim(1);
  // kappa = fl(fl(fl(fl(E * coeff) / K) / T_tot) / T_tot), every step in fp32, in this order.
  float kappa = static_cast<float>(p.num_experts) * static_cast<float>(p.coeff);
  kappa = kappa / static_cast<float>(p.topk);
  kappa = kappa / static_cast<float>(p.total_num_tokens);
  kappa = kappa / static_cast<float>(p.total_num_tokens);
  double sum = 0;
  for (int64_t c = 0; c < C; ++c) {
    double col = 0;
    for (int64_t row = 0; row < R; ++row) col += probs.at(row, c);
    sum += static_cast<double>(static_cast<float>(tokens_per_expert.at(c))) * col;
  }
  const double loss = static_cast<double>(kappa) * sum;
  MoeAuxLossFwd out{Tensor(out_dtype(probs.dtype(), r), {}), Tensor(out_dtype(DType::f32, r), {2})};
  out.aux_loss.set(0, loss);
  out.const_buf.set(0, kappa);
  out.const_buf.set(1, loss);
  return out;
}

Tensor moe_aux_loss_bwd(const Tensor& grad_aux_loss, const Tensor& const_buf,
                        const Tensor& tokens_per_expert, int64_t num_rows, Rounding r) {
  check_grad_dtype(grad_aux_loss, "grad_aux_loss", r);
  require_shape(grad_aux_loss.meta(), {}, "grad_aux_loss");
  require_shape(const_buf.meta(), {2}, "const_buf");
  require_rank(tokens_per_expert.meta(), 1, "tokens_per_expert");
  if (num_rows < 0)
    throw std::invalid_argument("num_rows: must be >= 0, got " + std::to_string(num_rows));
  const int64_t C = tokens_per_expert.dim(0);
  const auto kappa = static_cast<float>(const_buf.at(0));
  const double g = grad_aux_loss.at(0);
  Tensor grad(out_dtype(grad_aux_loss.dtype(), r), {num_rows, C});
  for (int64_t c = 0; c < C; ++c) {
    // fl(kappa * f32(tpe_c)) in fp32, then times g (one rounding to d).
    const float kt = kappa * static_cast<float>(tokens_per_expert.at(c));
    for (int64_t row = 0; row < num_rows; ++row) grad.set(row, c, static_cast<double>(kt) * g);
  }
  return grad;
}

}  // namespace moe::ref
