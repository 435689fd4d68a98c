#include "reference/moe_block.h"

#include <Eigen/Dense>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "reference/argsort.h"
#include "reference/aux_loss.h"
#include "reference/dispatch.h"
#include "reference/ep.h"
#include "reference/swiglu_ffn.h"
#include "reference/topk_router.h"

namespace moe::ref {

namespace {

using MatX = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

MoeBlockShape validate(const MoeBlockInputs& in, const MoeBlockParams& p, Rounding r) {
  auto meta = [](const Tensor* t, TensorMeta& m) -> const TensorMeta* {
    if (!t) return nullptr;
    m = t->meta();
    return &m;
  };
  TensorMeta b0, b1, bo, eb;
  return validate_moe_block(in.x.meta(), in.gate_kernel.meta(), in.wi_0.meta(), in.wi_1.meta(),
                            in.wo.meta(), meta(in.wi_0_bias, b0), meta(in.wi_1_bias, b1),
                            meta(in.wo_bias, bo), meta(in.expert_bias, eb), p, r == Rounding::none);
}

// The block's casts: to d normally, to f64 (no rounding) in finite-difference mode.
Tensor cast(const Tensor& t, DType d, Rounding r) {
  return t.to(r == Rounding::none ? DType::f64 : d);
}

// Rows [from, from + n) along the leading axis, any rank.
Tensor take_rows(const Tensor& t, int64_t from, int64_t n) {
  Shape s = t.shape();
  s[0] = n;
  Tensor o(t.dtype(), s);
  const size_t row = static_cast<size_t>(t.row_stride()) * dtype_size(t.dtype());
  if (n > 0 && row > 0) std::memcpy(o.bytes(), t.bytes() + from * row, n * row);
  return o;
}

// dst rows [at, at + src rows) = src, converted element-wise when the dtypes differ.
void put_rows(Tensor& dst, int64_t at, const Tensor& src) {
  const int64_t w = src.row_stride(), n = src.numel();
  if (dst.dtype() == src.dtype()) {
    if (n > 0)
      std::memcpy(dst.bytes() + at * w * dtype_size(dst.dtype()), src.bytes(), src.nbytes());
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst.set(at * w + i, src.at(i));
}

Tensor reshape(const Tensor& t, const Shape& s) {
  Tensor o(t.dtype(), s);
  if (o.numel() != t.numel()) throw std::logic_error("reshape: element count differs");
  if (t.nbytes()) std::memcpy(o.bytes(), t.bytes(), t.nbytes());
  return o;
}

MatX matrix(const Tensor& t) {  // rank 2
  MatX m(t.dim(0), t.dim(1));
  for (int64_t i = 0; i < t.numel(); ++i) m.data()[i] = t.at(i);
  return m;
}

Tensor tensor(const MatX& m, DType d) {  // one rounding per element
  Tensor t(d, {m.rows(), m.cols()});
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, m.data()[i]);
  return t;
}

// Column sums of a [T,E] bool map as i32 counts.
Tensor column_counts(const Tensor& map) {
  const int64_t T = map.dim(0), E = map.dim(1);
  Tensor c(DType::i32, {E});
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += map.at(t, e) != 0.0;
    c.set(e, static_cast<double>(n));
  }
  return c;
}

Tensor concat_rows(const std::vector<const Tensor*>& parts, DType d) {
  int64_t rows = 0;
  for (const Tensor* t : parts) rows += t->dim(0);
  Shape s = parts.at(0)->shape();
  s[0] = rows;
  Tensor out(d, s);
  int64_t at = 0;
  for (const Tensor* t : parts) {
    put_rows(out, at, *t);
    at += t->dim(0);
  }
  return out;
}

// The weights of EP rank s's L experts, cast to d.
struct LocalWeights {
  Tensor wi_0, wi_1, wo, b0, b1, bo;
  bool has_b0 = false, has_b1 = false, has_bo = false;
  FfnWeights view() const {
    return {wi_0, wi_1, wo, has_b0 ? &b0 : nullptr, has_b1 ? &b1 : nullptr, has_bo ? &bo : nullptr};
  }
};

LocalWeights local_weights(const MoeBlockInputs& in, int64_t s, int64_t L, DType d, Rounding r) {
  LocalWeights w;
  w.wi_0 = cast(take_rows(in.wi_0, s * L, L), d, r);
  w.wi_1 = cast(take_rows(in.wi_1, s * L, L), d, r);
  w.wo = cast(take_rows(in.wo, s * L, L), d, r);
  if ((w.has_b0 = in.wi_0_bias != nullptr)) w.b0 = cast(take_rows(*in.wi_0_bias, s * L, L), d, r);
  if ((w.has_b1 = in.wi_1_bias != nullptr)) w.b1 = cast(take_rows(*in.wi_1_bias, s * L, L), d, r);
  if ((w.has_bo = in.wo_bias != nullptr)) w.bo = cast(take_rows(*in.wo_bias, s * L, L), d, r);
  return w;
}

std::optional<Tensor> expert_bias_f32(const MoeBlockInputs& in, Rounding r) {
  if (!in.expert_bias) return std::nullopt;
  return in.expert_bias->to(r == Rounding::none ? DType::f64 : DType::f32);
}

struct Dims {
  MoeBlockShape s;
  int64_t P, D, E, K, L, T, Ts, R, R_pre;
  DType d;  // activation dtype (f64 in finite-difference mode)
};

Dims dims(const MoeBlockInputs& in, const MoeBlockParams& p, Rounding r) {
  Dims k;
  k.s = validate(in, p, r);
  k.P = p.ep_size;
  k.D = p.dp_size;
  k.E = k.s.E;
  k.K = p.topk;
  k.L = k.E / k.P;
  k.T = k.s.tokens();
  k.Ts = k.T / (k.P * k.D);
  k.R = recv_rows(k.s.ep(p));
  k.R_pre = pre_a2a_rows(k.s.ep(p));
  k.d = r == Rounding::none ? DType::f64 : in.x.dtype();
  return k;
}

}  // namespace

MoeBlockFwd moe_block_fwd(const MoeBlockInputs& in, const MoeBlockParams& p, Rounding r) {
  const Dims k = dims(in, p, r);
  const bool exact = r == Rounding::none;
  const RouterParams rp = p.router();
  const Tensor x2 = cast(reshape(in.x, {k.T, k.s.H}), k.d, r);
  const Tensor gk = cast(in.gate_kernel, k.d, r);
  const std::optional<Tensor> eb = expert_bias_f32(in, r);
  const DType router_dtype =
      exact ? DType::f64 : (p.router_logits_dtype == RouterLogitsDtype::float32 ? DType::f32 : k.d);

  MoeBlockFwd out;
  out.shards.resize(k.P * k.D);
  std::vector<Tensor> buffers(k.P * k.D);
  // Steps 1, 2, 4 on every shard: gate, router, global dispatch.
  for (int64_t i = 0; i < k.P * k.D; ++i) {
    MoeShardState& st = out.shards[i];
    st.ep_rank = i % k.P;
    st.dp_rank = i / k.P;
    st.first_token = i * k.Ts;
    st.tokens = k.Ts;
    st.x2d = take_rows(x2, st.first_token, k.Ts);
    // logits = rnd_d(x @ rnd_d(gate_kernel)), then widened to the router's dtype (exact).
    st.logits = tensor(matrix(st.x2d) * matrix(gk), k.d).to(router_dtype);
    TopkRouterFwd rf = topk_router_fwd(st.logits, eb ? &*eb : nullptr, rp, r);
    st.routing_map = std::move(rf.routing_map);
    st.saved_scores = std::move(rf.saved_scores);
    st.sparse_probs = exact ? std::move(rf.probs) : rf.probs.to(p.probs_dtype);
    if (p.backend == MoeBackend::kernel) {
      TokenDispatchParams dp;
      dp.num_out_tokens = k.Ts * k.K;
      dp.align_size = p.align_size;
      TokenDispatchFwd f = token_dispatch_fwd(st.x2d, st.routing_map, nullptr, dp, r);
      buffers[i] = std::move(f.permuted);
      st.row_id_map = std::move(f.row_id_map);
      st.pad_offsets = std::move(f.pad_offsets);
      st.group_sizes = std::move(f.tokens_per_expert);
    } else {
      RoutingMapToSelectedExpertsFwd sel =
          routing_map_to_selected_experts_fwd(st.sparse_probs, st.routing_map, k.K, r);
      st.selected_experts = std::move(sel.selected_experts);
      st.weights = std::move(sel.weights);
      ArgsortDispatchParams ap;
      ap.num_experts = k.E;
      ap.topk = k.K;
      ap.align_size = p.align_size;
      ArgsortTokenDispatchFwd f = argsort_token_dispatch_fwd(st.x2d, st.selected_experts, ap, r);
      buffers[i] = std::move(f.sorted_x);
      st.sorted_indices = std::move(f.sorted_indices);
      st.group_sizes = std::move(f.group_sizes);
      st.perm = f.state;
    }
    st.dispatch_rows = buffers[i].dim(0);
  }

  // Step 3: the aux loss over the global token set (every EP and DP shard).
  if (p.aux_loss()) {
    std::vector<const Tensor*> parts;
    for (const MoeShardState& st : out.shards) parts.push_back(&st.logits);
    const Tensor global = concat_rows(parts, exact ? DType::f64 : DType::f32);
    const TopkRouterFwd gr = topk_router_fwd(global, eb ? &*eb : nullptr, rp, r);
    Tensor tpe = column_counts(gr.routing_map);
    AuxLossScoresFwd sc = aux_loss_scores_fwd(global, k.K, p.score_function, MapFormat::bytemap, r);
    AuxLossParams ap;
    ap.topk = k.K;
    ap.coeff = p.aux_loss_coeff;
    ap.num_experts = k.E;
    ap.total_num_tokens = k.T;
    MoeAuxLossFwd al = moe_aux_loss_fwd(sc.scores, tpe, ap, r);
    out.aux_loss = std::move(al.aux_loss);
    out.aux_const_buf = std::move(al.const_buf);
    out.aux_tpe = std::move(tpe);
    out.aux_saved_scores = std::move(sc.saved_scores);
  }

  // Steps 5-7 per data-parallel group of P EP ranks.
  std::vector<LocalWeights> weights;
  for (int64_t s = 0; s < k.P; ++s) weights.push_back(local_weights(in, s, k.L, k.d, r));
  const SimComm comm(k.P);
  for (int64_t dp = 0; dp < k.D; ++dp) {
    auto shard = [&](int64_t s) -> MoeShardState& { return out.shards[dp * k.P + s]; };
    std::vector<Tensor> a;
    std::vector<RaggedA2AParams> fwd_params, rev_params;
    if (k.P > 1) {
      std::vector<Tensor> gs, zeros;
      for (int64_t s = 0; s < k.P; ++s) gs.push_back(shard(s).group_sizes.clone());
      a = all_gather(comm, gs);
      std::vector<Tensor> operand;
      for (int64_t s = 0; s < k.P; ++s) {
        fwd_params.push_back(ragged_a2a_params(a[s], s, k.P, A2ADirection::forward));
        rev_params.push_back(ragged_a2a_params(a[s], s, k.P, A2ADirection::reverse));
        operand.push_back(std::move(buffers[dp * k.P + s]));
        zeros.emplace_back(k.d, Shape{k.R, k.s.H});
      }
      std::vector<Tensor> recv = ragged_all_to_all_fwd(comm, operand, zeros, fwd_params, r);
      for (int64_t s = 0; s < k.P; ++s) {
        LocalPermuteFwd lp = local_permute_after_a2a_fwd(recv[s], a[s], s, k.P, r);
        shard(s).sorted_x = std::move(lp.sorted_x);
        shard(s).local_group_sizes = std::move(lp.local_group_sizes);
        shard(s).local_row_id_map = std::move(lp.row_id_map);
        shard(s).all_shards_tokens_per_expert = std::move(a[s]);
      }
    } else {
      shard(0).sorted_x = std::move(buffers[dp]);
      shard(0).local_group_sizes = shard(0).group_sizes.clone();
    }
    std::vector<Tensor> expert_out;
    for (int64_t s = 0; s < k.P; ++s) {
      MoeShardState& st = shard(s);
      SwigluFfnFwd f = swiglu_expert_ffn_fwd(st.sorted_x, st.local_group_sizes, weights[s].view(),
                                             p.activation, r);
      st.gate_proj = std::move(f.gate_proj);
      st.up_proj = std::move(f.up_proj);
      st.intermediate = std::move(f.intermediate);
      expert_out.push_back(std::move(f.out));
    }
    if (k.P > 1) {
      std::vector<Tensor> unperm, zeros;
      for (int64_t s = 0; s < k.P; ++s) {
        // The same chunk-sort map, inverse = true (R14).
        unperm.push_back(
            local_unpermute_before_a2a_fwd(expert_out[s], *shard(s).local_row_id_map, r));
        zeros.emplace_back(k.d, Shape{k.R_pre, k.s.H});
      }
      std::vector<Tensor> back = ragged_all_to_all_fwd(comm, unperm, zeros, rev_params, r);
      for (int64_t s = 0; s < k.P; ++s) shard(s).eo_post = std::move(back[s]);
    } else {
      shard(0).eo_post = std::move(expert_out[0]);
    }
  }

  // Step 8: the global combine, and the global diagnostics.
  Tensor y2(k.d, {k.T, k.s.H});
  out.routing_map = Tensor(DType::boolean, {k.T, k.E});
  out.probs = Tensor(exact ? DType::f64 : p.probs_dtype, {k.T, k.E});
  for (const MoeShardState& st : out.shards) {
    const Tensor y =
        p.backend == MoeBackend::kernel
            ? token_combine_fwd(st.eo_post, st.row_id_map, &st.sparse_probs,
                                st.pad_offsets ? &*st.pad_offsets : nullptr, r)
            : argsort_token_combine_fwd(st.eo_post, st.sorted_indices, st.weights, st.perm, r);
    put_rows(y2, st.first_token, y);
    put_rows(out.routing_map, st.first_token, st.routing_map);
    put_rows(out.probs, st.first_token, st.sparse_probs);
  }
  out.y = reshape(y2, in.x.shape());
  out.group_sizes = column_counts(out.routing_map);
  return out;
}

MoeBlockGrads moe_block_bwd(const Tensor& grad_y, const Tensor* grad_aux_loss,
                            const MoeBlockInputs& in, const MoeBlockFwd& fwd,
                            const MoeBlockParams& p, Rounding r) {
  const Dims k = dims(in, p, r);
  const bool exact = r == Rounding::none;
  require_shape(grad_y.meta(), in.x.shape(), "grad_y");
  if (!is_floating(grad_y.dtype())) {
    throw std::invalid_argument("grad_y: unsupported dtype " +
                                std::string(dtype_name(grad_y.dtype())));
  }
  if (static_cast<int64_t>(fwd.shards.size()) != k.P * k.D) {
    throw std::invalid_argument("fwd: the saved state has " + std::to_string(fwd.shards.size()) +
                                " shards, expected ep_size*dp_size=" + std::to_string(k.P * k.D));
  }
  const RouterParams rp = p.router();
  const DType f32 = exact ? DType::f64 : DType::f32;
  const Tensor ct2 = cast(reshape(grad_y, {k.T, k.s.H}), k.d, r);
  const Tensor gk = cast(in.gate_kernel, k.d, r);
  const int64_t NS = k.P * k.D;

  // Aux-loss backward over the global token set (§11.3 step 7).
  std::optional<Tensor> d_logits_aux;
  if (p.aux_loss()) {
    if (!fwd.aux_const_buf) throw std::invalid_argument("fwd: no aux-loss state saved");
    Tensor g(f32, {});
    if (grad_aux_loss) {
      require_shape(grad_aux_loss->meta(), {}, "grad_aux_loss");
      g.set(0, grad_aux_loss->at(0));
    }
    const Tensor gp = moe_aux_loss_bwd(g, *fwd.aux_const_buf, *fwd.aux_tpe, k.T, r);
    d_logits_aux = aux_loss_scores_bwd(gp, *fwd.aux_saved_scores, p.score_function, f32, r);
  }

  // Step 1: combine backward per shard.
  std::vector<Tensor> d_eo_post(NS), d_sparse(NS);
  for (int64_t i = 0; i < NS; ++i) {
    const MoeShardState& st = fwd.shards[i];
    const Tensor ct = take_rows(ct2, st.first_token, st.tokens);
    if (p.backend == MoeBackend::kernel) {
      TokenCombineBwd b = token_combine_bwd(ct, st.eo_post, st.row_id_map, &st.sparse_probs,
                                            st.pad_offsets ? &*st.pad_offsets : nullptr, r);
      d_eo_post[i] = std::move(b.grad_permuted);
      d_sparse[i] = std::move(*b.grad_merging_probs);
    } else {
      ArgsortTokenCombineBwd b =
          argsort_token_combine_bwd(ct, st.eo_post, st.sorted_indices, st.weights, st.perm, r);
      d_eo_post[i] = std::move(b.grad_expert_outputs);
      d_sparse[i] =
          routing_map_to_selected_experts_bwd(b.grad_weights, st.selected_experts, k.E, r);
    }
  }

  // Steps 2-4 per data-parallel group; FFN weight gradients summed over the DP shards.
  const SimComm comm(k.P);
  std::vector<LocalWeights> weights;
  for (int64_t s = 0; s < k.P; ++s) weights.push_back(local_weights(in, s, k.L, k.d, r));
  auto zeros_like = [](const Tensor& t) { return Tensor(DType::f64, t.shape()); };
  Tensor acc_wi_0 = zeros_like(in.wi_0), acc_wi_1 = zeros_like(in.wi_1), acc_wo = zeros_like(in.wo);
  Tensor acc_b0 = in.wi_0_bias ? zeros_like(*in.wi_0_bias) : Tensor();
  Tensor acc_b1 = in.wi_1_bias ? zeros_like(*in.wi_1_bias) : Tensor();
  Tensor acc_bo = in.wo_bias ? zeros_like(*in.wo_bias) : Tensor();
  auto accumulate = [](Tensor& acc, int64_t first_row, const Tensor& g) {
    const int64_t base = first_row * acc.row_stride();
    for (int64_t j = 0; j < g.numel(); ++j) acc.set(base + j, acc.at(base + j) + g.at(j));
  };
  std::vector<Tensor> d_buffer(NS);
  for (int64_t dp = 0; dp < k.D; ++dp) {
    auto st = [&](int64_t s) -> const MoeShardState& { return fwd.shards[dp * k.P + s]; };
    std::vector<RaggedA2AParams> fwd_params, rev_params;
    std::vector<Tensor> d_expert_out;
    if (k.P > 1) {
      std::vector<Tensor> ct_back;
      for (int64_t s = 0; s < k.P; ++s) {
        const Tensor& a = *st(s).all_shards_tokens_per_expert;
        fwd_params.push_back(ragged_a2a_params(a, s, k.P, A2ADirection::forward));
        rev_params.push_back(ragged_a2a_params(a, s, k.P, A2ADirection::reverse));
        ct_back.push_back(std::move(d_eo_post[dp * k.P + s]));
      }
      // The reverse exchange's backward: a forward-direction exchange into zeros [R,H].
      std::vector<Tensor> d_unperm = ragged_all_to_all_bwd(comm, ct_back, rev_params, k.R, r);
      for (int64_t s = 0; s < k.P; ++s) {
        d_expert_out.push_back(
            local_unpermute_before_a2a_bwd(d_unperm[s], *st(s).local_row_id_map, r));
      }
    } else {
      d_expert_out.push_back(std::move(d_eo_post[dp]));
    }
    std::vector<Tensor> d_recv;
    for (int64_t s = 0; s < k.P; ++s) {
      const MoeShardState& sh = st(s);
      SwigluFfnBwd b = swiglu_expert_ffn_bwd(d_expert_out[s], sh.sorted_x, sh.local_group_sizes,
                                             weights[s].view(), sh.gate_proj, sh.up_proj,
                                             sh.intermediate, p.activation, r);
      accumulate(acc_wi_0, s * k.L, b.grad_wi_0);
      accumulate(acc_wi_1, s * k.L, b.grad_wi_1);
      accumulate(acc_wo, s * k.L, b.grad_wo);
      if (b.grad_wi_0_bias) accumulate(acc_b0, s * k.L, *b.grad_wi_0_bias);
      if (b.grad_wi_1_bias) accumulate(acc_b1, s * k.L, *b.grad_wi_1_bias);
      if (b.grad_wo_bias) accumulate(acc_bo, s * k.L, *b.grad_wo_bias);
      d_recv.push_back(k.P > 1 ? local_permute_after_a2a_bwd(b.grad_x, *sh.local_row_id_map, r)
                               : std::move(b.grad_x));
    }
    if (k.P > 1) {
      // The forward exchange's backward: the reverse exchange into zeros [dispatch rows, H].
      std::vector<Tensor> back =
          ragged_all_to_all_bwd(comm, d_recv, fwd_params, st(0).dispatch_rows, r);
      for (int64_t s = 0; s < k.P; ++s) d_buffer[dp * k.P + s] = std::move(back[s]);
    } else {
      d_buffer[dp] = std::move(d_recv[0]);
    }
  }

  // Steps 5, 6, 8 per shard: dispatch and router backward, the gate GEMM's gradients.
  Tensor dx2(exact ? DType::f64 : in.x.dtype(), {k.T, k.s.H});
  MatX acc_gk = MatX::Zero(k.s.H, k.E);
  const MatX GK = matrix(gk);
  for (int64_t i = 0; i < NS; ++i) {
    const MoeShardState& st = fwd.shards[i];
    const Tensor d_x_dispatch =
        p.backend == MoeBackend::kernel
            ? token_dispatch_bwd(d_buffer[i], nullptr, st.row_id_map,
                                 st.pad_offsets ? &*st.pad_offsets : nullptr, r)
                  .grad_x
            : argsort_token_dispatch_bwd(d_buffer[i], st.sorted_indices, st.perm, r);
    // grad_probs = f32(d_sparse_probs); the router backward gives d_logits in f32.
    Tensor d_logits = topk_router_bwd(d_sparse[i].to(f32), st.routing_map, st.saved_scores, rp, r);
    if (d_logits_aux) {
      const Tensor slice = take_rows(*d_logits_aux, st.first_token, st.tokens);
      for (int64_t j = 0; j < d_logits.numel(); ++j) d_logits.set(j, d_logits.at(j) + slice.at(j));
    }
    const MatX DL = matrix(d_logits);
    const Tensor d_x_gate = tensor(DL * GK.transpose(), f32);  // fp32 results
    const Tensor d_gk = tensor(matrix(st.x2d).transpose() * DL, f32);
    for (int64_t j = 0; j < d_gk.numel(); ++j) acc_gk.data()[j] += d_gk.at(j);
    Tensor dx(dx2.dtype(), {st.tokens, k.s.H});
    for (int64_t j = 0; j < dx.numel(); ++j) dx.set(j, d_x_gate.at(j) + d_x_dispatch.at(j));
    put_rows(dx2, st.first_token, dx);
  }

  MoeBlockGrads g;
  g.x = reshape(dx2, in.x.shape());
  auto finish = [&](const Tensor& acc, const Tensor& param) {
    return acc.to(exact ? DType::f64 : param.dtype());  // one rounding of the shard sum
  };
  g.gate_kernel = finish(tensor(acc_gk, DType::f64), in.gate_kernel);
  g.wi_0 = finish(acc_wi_0, in.wi_0);
  g.wi_1 = finish(acc_wi_1, in.wi_1);
  g.wo = finish(acc_wo, in.wo);
  if (in.wi_0_bias) g.wi_0_bias = finish(acc_b0, *in.wi_0_bias);
  if (in.wi_1_bias) g.wi_1_bias = finish(acc_b1, *in.wi_1_bias);
  if (in.wo_bias) g.wo_bias = finish(acc_bo, *in.wo_bias);
  return g;
}

MoeBlockDense moe_block_dense(const MoeBlockInputs& in, const MoeBlockParams& p,
                              const Tensor& grad_y, const Tensor* grad_aux_loss, bool exact) {
  const Rounding none = Rounding::none;
  const MoeBlockShape s = validate(in, p, Rounding::none);
  const int64_t T = s.tokens(), H = s.H, M = s.M, E = s.E;
  const DType d = in.x.dtype();
  const Rounding defn = exact ? Rounding::none : Rounding::to_dtype;  // definitional casts
  const RouterParams rp = p.router();
  const MatX X = matrix(reshape(in.x, {T, H}));
  const MatX GK = matrix(cast(in.gate_kernel, d, defn));
  const DType router_dtype =
      exact ? DType::f64 : (p.router_logits_dtype == RouterLogitsDtype::float32 ? DType::f32 : d);
  const Tensor logits = tensor(X * GK, exact ? DType::f64 : d).to(router_dtype);
  const std::optional<Tensor> eb = expert_bias_f32(in, defn);
  const TopkRouterFwd rf = topk_router_fwd(logits, eb ? &*eb : nullptr, rp, none);

  MoeBlockDense out;
  out.routing_map = rf.routing_map.clone();
  out.probs = Tensor(DType::f64, {T, E});
  for (int64_t i = 0; i < T * E; ++i) {
    double v = rf.probs.at(i);
    if (!exact) {
      v = round_to(p.probs_dtype, round_to(router_dtype, v));
      if (p.backend == MoeBackend::argsort) v = round_to(d, v);  // §8.3 rounds weights to d
    }
    out.probs.set(i, v);
  }
  const Tensor w0 = cast(in.wi_0, d, defn), w1 = cast(in.wi_1, d, defn), wo = cast(in.wo, d, defn);
  auto bias = [&](const Tensor* b) { return b ? cast(*b, d, defn) : Tensor(DType::f64, {E, 0}); };
  const Tensor b0 = bias(in.wi_0_bias), b1 = bias(in.wi_1_bias), bo = bias(in.wo_bias);
  auto expert = [&](const Tensor& w, int64_t e, int64_t rows, int64_t cols) {
    MatX m(rows, cols);
    for (int64_t j = 0; j < rows * cols; ++j) m.data()[j] = w.at(e * rows * cols + j);
    return m;
  };
  auto bias_row = [&](const Tensor* b, const Tensor& bb, int64_t e, int64_t n) {
    Eigen::RowVectorXd v = Eigen::RowVectorXd::Zero(n);
    if (b)
      for (int64_t j = 0; j < n; ++j) v(j) = bb.at(e, j);
    return v;
  };
  const MatX CT = matrix(reshape(grad_y, {T, H}));
  MatX Y = MatX::Zero(T, H), DX = MatX::Zero(T, H);
  Tensor d_probs(DType::f64, {T, E});
  std::vector<MatX> dW0(E, MatX::Zero(H, M)), dW1(E, MatX::Zero(H, M)), dWo(E, MatX::Zero(M, H));
  MatX dB0 = MatX::Zero(E, M), dB1 = MatX::Zero(E, M), dBo = MatX::Zero(E, H);
  for (int64_t e = 0; e < E; ++e) {
    const MatX W0 = expert(w0, e, H, M), W1 = expert(w1, e, H, M), WO = expert(wo, e, M, H);
    const Eigen::RowVectorXd B0 = bias_row(in.wi_0_bias, b0, e, M);
    const Eigen::RowVectorXd B1 = bias_row(in.wi_1_bias, b1, e, M);
    const Eigen::RowVectorXd BO = bias_row(in.wo_bias, bo, e, H);
    for (int64_t t = 0; t < T; ++t) {
      if (rf.routing_map.at(t, e) == 0.0) continue;
      const Eigen::RowVectorXd xt = X.row(t);
      const Eigen::RowVectorXd g = xt * W0 + B0, u = xt * W1 + B1;
      Eigen::RowVectorXd a(M), da(M);
      for (int64_t m = 0; m < M; ++m) {
        a(m) = activation_value(p.activation, g(m));
        da(m) = activation_grad(p.activation, g(m));
      }
      const Eigen::RowVectorXd inter = a.cwiseProduct(u);
      const Eigen::RowVectorXd o = inter * WO + BO;
      const double pr = out.probs.at(t, e);
      Y.row(t) += pr * o;
      d_probs.set(t, e, CT.row(t).dot(o));
      const Eigen::RowVectorXd dout = pr * CT.row(t);
      dWo[e] += inter.transpose() * dout;
      dBo.row(e) += dout;
      const Eigen::RowVectorXd di = dout * WO.transpose();
      const Eigen::RowVectorXd du = di.cwiseProduct(a), dg = di.cwiseProduct(u).cwiseProduct(da);
      dW0[e] += xt.transpose() * dg;
      dW1[e] += xt.transpose() * du;
      dB0.row(e) += dg;
      dB1.row(e) += du;
      DX.row(t) += dg * W0.transpose() + du * W1.transpose();
    }
  }
  out.y = reshape(tensor(Y, DType::f64), {s.B, s.S, H});
  Tensor d_logits = topk_router_bwd(d_probs, rf.routing_map, rf.saved_scores, rp, none);
  if (p.aux_loss()) {
    const Tensor global = logits.to(DType::f64);
    const Tensor tpe = column_counts(rf.routing_map);
    const AuxLossScoresFwd sc =
        aux_loss_scores_fwd(global, p.topk, p.score_function, MapFormat::bytemap, none);
    AuxLossParams ap;
    ap.topk = p.topk;
    ap.coeff = p.aux_loss_coeff;
    ap.num_experts = E;
    ap.total_num_tokens = T;
    const MoeAuxLossFwd al = moe_aux_loss_fwd(sc.scores, tpe, ap, none);
    out.aux_loss = al.aux_loss.clone();
    Tensor g(DType::f64, {});
    if (grad_aux_loss) g.set(0, grad_aux_loss->at(0));
    const Tensor gp = moe_aux_loss_bwd(g, al.const_buf, tpe, T, none);
    const Tensor dla = aux_loss_scores_bwd(gp, sc.saved_scores, p.score_function, DType::f64, none);
    for (int64_t j = 0; j < d_logits.numel(); ++j) d_logits.set(j, d_logits.at(j) + dla.at(j));
  }
  const MatX DL = matrix(d_logits);
  DX += DL * GK.transpose();
  out.grads.x = reshape(tensor(DX, DType::f64), in.x.shape());
  out.grads.gate_kernel = tensor(X.transpose() * DL, DType::f64);
  auto stack3 = [](const std::vector<MatX>& v, const Shape& shape) {
    Tensor t(DType::f64, shape);
    const int64_t per = shape[1] * shape[2];
    for (size_t e = 0; e < v.size(); ++e)
      for (int64_t j = 0; j < per; ++j) t.set(static_cast<int64_t>(e) * per + j, v[e].data()[j]);
    return t;
  };
  out.grads.wi_0 = stack3(dW0, {E, H, M});
  out.grads.wi_1 = stack3(dW1, {E, H, M});
  out.grads.wo = stack3(dWo, {E, M, H});
  if (in.wi_0_bias) out.grads.wi_0_bias = tensor(dB0, DType::f64);
  if (in.wi_1_bias) out.grads.wi_1_bias = tensor(dB1, DType::f64);
  if (in.wo_bias) out.grads.wo_bias = tensor(dBo, DType::f64);
  return out;
}

}  // namespace moe::ref
