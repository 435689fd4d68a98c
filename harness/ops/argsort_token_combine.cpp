// Registry record of argsort_token_combine (SPEC §8.3), the argsort backend's unpermute with
// weights rounded to d, with the §8.4 cross-backend equivalence against token_combine checked as
// an invariant when the weights are representable in d.
//
// Case keys: T, E, topk, H, align_size and roll_to_expert_id describe the argsort dispatch that
// produced sorted_indices; weights_dtype (the probs dtype p); selected_experts (optional list).
#include <cmath>

#include "harness/ops/check.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/argsort.h"
#include "reference/dispatch.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "argsort_token_combine";

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case(kOp, kRoutingRegimes);
    draw_argsort_shape(c);
    const int64_t E = c.i("E"), a = c.i("align_size");
    if (a == 0 && *rc::gen::element(false, false, true)) {
      c.set("roll_to_expert_id", *rc::gen::inRange<int64_t>(0, E));
    }
    // Weights in d (the cross-backend check applies) or in another probs dtype.
    c.set("weights_dtype", std::string(dtype_name(*rc::gen::element(c.dtype, c.dtype, DType::f32,
                                                                    DType::bf16, DType::f16))));
    return c;
  });
}

CaseBuilder base(DType d, int64_t T, int64_t E, int64_t K, int64_t H, int64_t a, DType w,
                 const std::string& name) {
  CaseBuilder b(kOp, d);
  b.seed(31).name(name).set("T", T).set("E", E).set("topk", K).set("H", H).set("align_size", a);
  return b.set("weights_dtype", std::string(dtype_name(w)));
}

std::vector<Case> named() {
  std::vector<Case> v;
  v.push_back(base(DType::bf16, 64, 8, 2, 64, 16, DType::f32, "mixtral_a16_f32_weights"));
  v.push_back(base(DType::bf16, 64, 8, 2, 64, 16, DType::bf16, "mixtral_a16_bf16_weights"));
  v.push_back(base(DType::f32, 32, 32, 8, 32, 0, DType::f32, "deepseek_like"));
  v.push_back(base(DType::f16, 24, 7, 3, 257, 8, DType::f16, "odd_sizes"));
  v.push_back(base(DType::f32, 0, 4, 2, 8, 16, DType::f32, "zero_tokens"));
  v.back().regime = Regime::zero_tokens;
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("topk"), H = c.i("H");
  const Tensor sel = make_selected_experts(c, T, E, K);
  // The perm state comes from the reference argsort dispatch of the routing (x is not needed).
  ref::ArgsortTokenDispatchFwd st =
      ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {T, 0}), sel, argsort_params(c));
  const int64_t rows = st.sorted_indices.numel();
  const DType wd = parse_dtype(c.s("weights_dtype", std::string(dtype_name(c.dtype))));
  TensorMap m;
  // Every row is non-zero, padding rows included: the combine must never read them.
  m.emplace("input.expert_outputs", normal_tensor(c, c.dtype, {rows, H}, "input.expert_outputs"));
  m.emplace("input.sorted_indices", std::move(st.sorted_indices));
  m.emplace("input.weights", uniform_tensor(c, wd, {T, K}, 0.05, 1.0, "input.weights"));
  m.emplace("cotangent.combined", normal_tensor(c, c.dtype, {T, H}, "cotangent.combined"));
  return m;
}

ArgsortPermParams state_of(const Case& c) {
  const int64_t K = c.i("topk");
  return {K, c.i("T") * K, argsort_padding_size(c.i("E"), c.i("align_size", 0))};
}

TensorMap run_reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Tensor& eo = in.at("input.expert_outputs");
  const Tensor& si = in.at("input.sorted_indices");
  const Tensor& w = in.at("input.weights");
  const ArgsortPermParams st = state_of(c);
  TensorMap out;
  out.emplace("output.combined", ref::argsort_token_combine_fwd(eo, si, w, st, rnd));
  if (const Tensor* ct = find_tensor(in, "cotangent.combined")) {
    ref::ArgsortTokenCombineBwd b = ref::argsort_token_combine_bwd(*ct, eo, si, w, st, rnd);
    out.emplace("grad.expert_outputs", std::move(b.grad_expert_outputs));
    out.emplace("grad.weights", std::move(b.grad_weights));
  }
  return out;
}

std::vector<int64_t> inverse(const Tensor& si) {
  std::vector<int64_t> inv(static_cast<size_t>(si.numel()));
  for (int64_t j = 0; j < si.numel(); ++j) inv[static_cast<int64_t>(si.at(j))] = j;
  return inv;
}

Tensor bound(const Case& c, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const Tensor& ref = want.at(key);
  if (key == "grad.expert_outputs") return make_bound(TolClass::elementwise, ref.dtype(), ref, 1);
  Tensor b(DType::f64, ref.shape());
  const Tensor& eo = in.at("input.expert_outputs");
  const Tensor& w = in.at("input.weights");
  const auto inv = inverse(in.at("input.sorted_indices"));
  const int64_t K = c.i("topk"), T = w.dim(0), H = eo.dim(1);
  if (key == "output.combined") {  // fp32 sum over k of rnd_d(w) * u
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += std::fabs(w.at(t, k) * eo.at(inv[t * K + k], h));
        b.set(t, h, tol_bound(TolClass::reduction, ref.dtype(), ref.at(t, h), K, s));
      }
    }
  } else if (key == "grad.weights") {  // fp32 sum over H of ct * u
    const Tensor& ct = in.at("cotangent.combined");
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        double s = 0;
        for (int64_t h = 0; h < H; ++h) s += std::fabs(ct.at(t, h) * eo.at(inv[t * K + k], h));
        b.set(t, k, tol_bound(TolClass::reduction, ref.dtype(), ref.at(t, k), H, s));
      }
    }
  }
  return b;
}

Report compare_fn(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  return compare_perm(*find_op(kOp), c, in, want, got,
                      {"output.combined", "grad.expert_outputs", "grad.weights"});
}

// First element where |a - b| exceeds bound, or -1.
int64_t first_outside(const Tensor& a, const Tensor& b, const Tensor& bound) {
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!(std::fabs(a.at(i) - b.at(i)) <= bound.at(i))) return i;
  return -1;
}

std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const Tensor& eo = in.at("input.expert_outputs");
  const Tensor& si = in.at("input.sorted_indices");
  const Tensor& w = in.at("input.weights");
  const ArgsortPermParams st = state_of(c);
  const int64_t K = st.topk, N = st.num_real_tokens, T = N / K, H = eo.dim(1);
  const int64_t E = c.i("E"), a = c.i("align_size", 0);
  const Tensor* ge = find_tensor(out, "grad.expert_outputs");
  if (ge) {
    for (int64_t j = 0; j < si.numel(); ++j) {
      if (si.at(j) < static_cast<double>(N)) continue;
      for (int64_t h = 0; h < H; ++h) {
        if (ge->at(j, h) != 0.0 || std::signbit(ge->at(j, h))) {
          bad.add("grad.expert_outputs row " + std::to_string(j) +
                  " (a padding position) is not 0");
          break;
        }
      }
    }
  }
  // §8.4 cross-backend: with r = 0 and weights exactly representable in d, token_combine of the
  // same rows in the kernel layout agrees within the §12 bounds.
  if (c.i("roll_to_expert_id", 0) != 0) return bad.take();
  const DType d = eo.dtype();
  for (int64_t i = 0; i < w.numel(); ++i)
    if (round_to(d, w.at(i)) != w.at(i)) return bad.take();
  // Rebuild the routing from the case's generator; inputs from elsewhere (a golden file) whose
  // sorted_indices do not match it skip this cross-check.
  const Tensor sel = make_selected_experts(c, T, E, K);
  const ref::ArgsortTokenDispatchFwd ad =
      ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {T, 0}), sel, argsort_params(c));
  if (!ad.sorted_indices.bitwise_equal(si)) return bad.take();
  TokenDispatchParams kp;
  kp.num_out_tokens = N;
  kp.align_size = a;
  const ref::TokenDispatchFwd kd =
      ref::token_dispatch_fwd(Tensor(DType::f32, {T, 0}), selected_to_map(sel, E), nullptr, kp);
  const int64_t R_out = kd.permuted.dim(0);
  int64_t S = 0;
  for (int64_t e = 0; e < E; ++e) S += static_cast<int64_t>(kd.tokens_per_expert.at(e));
  Tensor permuted(d, {R_out, H});
  for (int64_t j = 0; j < S; ++j)
    for (int64_t h = 0; h < H; ++h) permuted.set(j, h, eo.at(j, h));
  Tensor mp(w.dtype(), {T, E});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) mp.set(t, static_cast<int64_t>(sel.at(t, k)), w.at(t, k));
  const Tensor* pad = kd.pad_offsets ? &*kd.pad_offsets : nullptr;
  const Tensor kc = ref::token_combine_fwd(permuted, kd.row_id_map, &mp, pad);
  const Tensor& comb = out.at("output.combined");
  if (first_outside(kc, comb, bound(c, "output.combined", in, out)) >= 0) {
    bad.add("§8.4: combined differs between the backends beyond the §12 bound");
  }
  const Tensor* ct = find_tensor(in, "cotangent.combined");
  if (!ct || !ge) return bad.take();
  const ref::TokenCombineBwd kb = ref::token_combine_bwd(*ct, permuted, kd.row_id_map, &mp, pad);
  const Tensor gb = bound(c, "grad.expert_outputs", in, out);
  for (int64_t j = 0; j < std::max(R_out, si.numel()); ++j) {
    for (int64_t h = 0; h < H; ++h) {
      const double gk = j < R_out ? kb.grad_permuted.at(j, h) : 0.0;
      const double ga = j < si.numel() ? ge->at(j, h) : 0.0;
      const double tol = j < si.numel() ? gb.at(j, h) : 0.0;
      if (!(std::fabs(gk - ga) <= tol)) {
        bad.add("§8.4: grad of the dispatched rows differs between the backends at row " +
                std::to_string(j));
        j = R_out + si.numel();
        break;
      }
    }
  }
  const Tensor& gw = out.at("grad.weights");
  const Tensor wb = bound(c, "grad.weights", in, out);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const double gk = kb.grad_merging_probs->at(t, static_cast<int64_t>(sel.at(t, k)));
      if (!(std::fabs(gk - gw.at(t, k)) <= wb.at(t, k))) {
        bad.add("§8.4: grad weights differ between the backends at (" + std::to_string(t) + ", " +
                std::to_string(k) + ")");
      }
    }
  }
  return bad.take();
}

Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("T")), K = static_cast<double>(c.i("topk"));
  const double H = static_cast<double>(c.i("H"));
  const double rows =
      T * K + static_cast<double>(argsort_padding_size(c.i("E"), c.i("align_size", 0)));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const double p = static_cast<double>(
      dtype_size(parse_dtype(c.s("weights_dtype", std::string(dtype_name(c.dtype))))));
  Cost k;
  k.fwd_bytes = T * K * H * d + rows * 4 + T * K * p + T * H * d;
  k.fwd_flops = 2 * T * K * H;
  // Backward: ct, the saved rows, the map and weights in; every row of the gradient (padding
  // rows as zeros) and grad weights out.
  k.bwd_bytes = T * H * d + T * K * H * d + rows * 4 + T * K * p + rows * H * d + T * K * p;
  k.bwd_flops = 4 * T * K * H;
  return k;
}

nlohmann::json to_params(const Case& c) {
  const ArgsortPermParams st = state_of(c);
  return {{"topk", st.topk},
          {"num_real_tokens", st.num_real_tokens},
          {"padding_size", st.padding_size}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  const int64_t K = j.at("topk").get<int64_t>(), N = j.at("num_real_tokens").get<int64_t>();
  const int64_t P = j.at("padding_size").get<int64_t>();
  const Tensor& eo = in.at("input.expert_outputs");
  // E and align_size are not in the file; E = P_pad with a = 2 (or E = K, a = 0) reproduces
  // padding_size exactly (a real dispatch has E >= K, so P_pad >= K whenever it is > 0).
  c.set("T", N / K).set("topk", K).set("H", eo.dim(1));
  c.set("E", P > 0 ? P : K).set("align_size", P > 0 ? int64_t{2} : int64_t{0});
  c.set("weights_dtype", std::string(dtype_name(in.at("input.weights").dtype())));
  return c;
}

}  // namespace

const OpInfo& argsort_token_combine_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info(kOp, "SPEC §8.3",
                {gen, named, make_inputs, run_reference, invariants, cost, to_params, from_params});
    o.bound = bound;
    o.compare = compare_fn;
    o.bench_cases = [] {
      return std::vector<Case>{base(DType::bf16, 16384, 8, 2, 4096, 0, DType::f32, "mixtral_t16k"),
                               base(DType::bf16, 4096, 64, 8, 2048, 16, DType::f32, "e64_a16")};
    };
#ifdef MOE_WITH_CUDA
    o.gpu = argsort_token_combine_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
