// Registry record of argsort_token_dispatch (SPEC §8.2), the argsort backend's permute, with the
// §8.4 cross-backend equivalence against token_dispatch checked as an invariant.
//
// Case keys: T, E, topk, H, align_size, roll_to_expert_id (absent = none), selected_experts
// (optional explicit comma list of T*K ids, row-major).
#include <cmath>

#include "harness/ops/check.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/argsort.h"
#include "reference/dispatch.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "argsort_token_dispatch";

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case(kOp, kRoutingRegimes);
    draw_argsort_shape(c);
    const int64_t E = c.i("E"), a = c.i("align_size");
    // roll_to_expert_id: absent, 0, or (without padding, R9) any id.
    const int roll_kind = *rc::gen::element(0, 0, 1, 2);
    if (roll_kind == 1) c.set("roll_to_expert_id", int64_t{0});
    if (roll_kind == 2 && a == 0) c.set("roll_to_expert_id", *rc::gen::inRange<int64_t>(0, E));
    return c;
  });
}

CaseBuilder base(DType d, int64_t T, int64_t E, int64_t K, int64_t H, int64_t a,
                 const std::string& name) {
  CaseBuilder b(kOp, d);
  b.seed(29).name(name).set("T", T).set("E", E).set("topk", K).set("H", H);
  return b.set("align_size", a);
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R9's routing: the roll alone and the padding alone are supported (together they are an
  // error, tested in tests/cpu/test_argsort.cpp).
  const std::string r9 = "0,1,1,2,2,3,0,3,1,3";
  v.push_back(base(DType::f32, 5, 4, 2, 8, 0, "R9_roll_no_padding")
                  .set("roll_to_expert_id", int64_t{1})
                  .set("selected_experts", r9));
  v.push_back(base(DType::f32, 5, 4, 2, 8, 4, "R9_padding_no_roll").set("selected_experts", r9));
  v.push_back(base(DType::bf16, 64, 8, 2, 64, 16, "mixtral_a16"));
  v.push_back(base(DType::bf16, 32, 32, 8, 32, 0, "deepseek_like"));
  v.push_back(base(DType::f16, 24, 7, 3, 257, 8, "odd_sizes"));
  v.push_back(base(DType::f32, 16, 4, 1, 8, 128, "all_to_one_a128").regime(Regime::all_to_one));
  v.push_back(base(DType::f32, 0, 4, 2, 8, 16, "zero_tokens").regime(Regime::zero_tokens));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("topk"), H = c.i("H");
  const int64_t rows = T * K + argsort_padding_size(E, c.i("align_size", 0));
  TensorMap m;
  m.emplace("input.x", normal_tensor(c, c.dtype, {T, H}, "input.x"));
  m.emplace("input.selected_experts", make_selected_experts(c, T, E, K));
  m.emplace("cotangent.sorted_x", normal_tensor(c, c.dtype, {rows, H}, "cotangent.sorted_x"));
  return m;
}

TensorMap run_reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  ref::ArgsortTokenDispatchFwd f = ref::argsort_token_dispatch_fwd(
      in.at("input.x"), in.at("input.selected_experts"), argsort_params(c), rnd);
  TensorMap out;
  if (const Tensor* ct = find_tensor(in, "cotangent.sorted_x")) {
    out.emplace("grad.x", ref::argsort_token_dispatch_bwd(*ct, f.sorted_indices, f.state, rnd));
  }
  out.emplace("output.sorted_x", std::move(f.sorted_x));
  out.emplace("output.sorted_indices", std::move(f.sorted_indices));
  out.emplace("output.group_sizes", std::move(f.group_sizes));
  return out;
}

// grad x[t] sums the K cotangent rows of the token's slots: fp32 reduction of K terms.
Tensor bound(const Case& c, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const Tensor& ref = want.at(key);
  Tensor b(DType::f64, ref.shape());
  if (key != "grad.x") return b;
  const int64_t K = c.i("topk");
  const Tensor& si = want.at("output.sorted_indices");
  const Tensor& ct = in.at("cotangent.sorted_x");
  std::vector<int64_t> inv(static_cast<size_t>(si.numel()));
  for (int64_t j = 0; j < si.numel(); ++j) inv[static_cast<int64_t>(si.at(j))] = j;
  for (int64_t t = 0; t < ref.dim(0); ++t) {
    for (int64_t h = 0; h < ref.dim(1); ++h) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += std::fabs(ct.at(inv[t * K + k], h));
      b.set(t, h, tol_bound(TolClass::reduction, ref.dtype(), ref.at(t, h), K, s));
    }
  }
  return b;
}

Report compare_fn(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  return compare_perm(*find_op(kOp), c, in, want, got, {"grad.x"});
}

bool same_bits(double a, double b) {
  return a == b && std::signbit(a) == std::signbit(b);
}

bool row_is(const Tensor& a, int64_t ra, const Tensor* b, int64_t rb) {
  for (int64_t h = 0; h < a.row_stride(); ++h) {
    if (!same_bits(a.at(ra, h), b ? b->at(rb, h) : 0.0)) return false;
  }
  return true;
}

std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const ArgsortDispatchParams p = argsort_params(c);
  const Tensor& x = in.at("input.x");
  const Tensor& sel = in.at("input.selected_experts");
  const Tensor& sx = out.at("output.sorted_x");
  const Tensor& si = out.at("output.sorted_indices");
  const Tensor& gs = out.at("output.group_sizes");
  const int64_t T = x.dim(0), H = x.dim(1), E = p.num_experts, K = p.topk, a = p.align_size;
  const int64_t N = T * K, P = argsort_padding_size(E, a), r = p.roll_to_expert_id.value_or(0);
  if (sx.shape() != Shape{N + P, H} || si.shape() != Shape{N + P} || gs.shape() != Shape{E}) {
    return {"output shapes: sorted_x " + sx.describe() + ", sorted_indices " + si.describe() +
            ", group_sizes " + gs.describe()};
  }
  // Group i holds expert (i + r) mod E: its tokens in ascending order, then need_e zero rows.
  std::vector<std::vector<int64_t>> tokens(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) tokens[static_cast<int64_t>(sel.at(t, k))].push_back(t);
  int64_t row = 0;
  for (int64_t i = 0; i < E; ++i) {
    const int64_t e = (i + r) % E, ce = static_cast<int64_t>(tokens[e].size());
    const int64_t need = a > 0 ? (a - ce % a) % a : 0;
    if (static_cast<int64_t>(gs.at(i)) != ce + need) {
      bad.add("group_sizes[" + std::to_string(i) + "] = " + format_double(gs.at(i)) +
              ", expected c + need = " + std::to_string(ce + need) + " of expert " +
              std::to_string(e));
      return bad.take();
    }
    if (a > 0 && (ce + need) % a != 0) bad.add("group_sizes[" + std::to_string(i) + "] % a != 0");
    for (int64_t q = 0; q < ce; ++q, ++row) {
      if (!row_is(sx, row, &x, tokens[e][q])) {
        bad.add("sorted_x row " + std::to_string(row) + " is not x[" +
                std::to_string(tokens[e][q]) + "] (group " + std::to_string(i) + ", expert " +
                std::to_string(e) + ")");
      }
    }
    for (int64_t q = 0; q < need; ++q, ++row) {
      if (!row_is(sx, row, nullptr, 0)) bad.add("padding row " + std::to_string(row) + " is not 0");
    }
  }
  for (; row < N + P; ++row) {
    if (!row_is(sx, row, nullptr, 0))
      bad.add("row " + std::to_string(row) + " beyond sum(group_sizes) is not 0");
  }
  // grad x with cotangent 1 is K for every token.
  Tensor ones(DType::f32, {N + P, H});
  ones.fill(1.0);
  const ArgsortPermParams st{K, N, P};
  const Tensor g1 = ref::argsort_token_dispatch_bwd(ones, si, st);
  for (int64_t i = 0; i < g1.numel(); ++i) {
    if (g1.at(i) != static_cast<double>(K)) {
      bad.add("grad x with cotangent 1 is " + format_double(g1.at(i)) + ", expected K");
      break;
    }
  }

  // §8.4 cross-backend equivalence (r = 0): the kernel backend's dispatch of the same routing.
  if (r != 0) return bad.take();
  TokenDispatchParams kp;
  kp.num_out_tokens = N;
  kp.align_size = a;
  const ref::TokenDispatchFwd kd = ref::token_dispatch_fwd(x, selected_to_map(sel, E), nullptr, kp);
  int64_t S = 0;
  for (int64_t e = 0; e < E; ++e) {
    S += static_cast<int64_t>(gs.at(e));
    if (kd.tokens_per_expert.at(e) != gs.at(e)) {
      bad.add("§8.4: group_sizes[" + std::to_string(e) + "] differs from token_dispatch's " +
              "tokens_per_expert");
    }
  }
  const int64_t R_out = kd.permuted.dim(0);
  for (int64_t j = 0; j < std::max(R_out, N + P); ++j) {
    if (j < S) {
      if (!row_is(kd.permuted, j, &sx, j)) {
        bad.add("§8.4: dispatched row " + std::to_string(j) + " differs between the backends");
      }
    } else {
      if (j < R_out && !row_is(kd.permuted, j, nullptr, 0))
        bad.add("§8.4: kernel row beyond sum is not 0");
      if (j < N + P && !row_is(sx, j, nullptr, 0)) bad.add("§8.4: argsort row beyond sum is not 0");
    }
  }
  if (const Tensor* gx = find_tensor(out, "grad.x")) {
    // The same cotangent in the kernel layout; rows no (t,e) maps to carry a huge value that
    // would show if either backward read them.
    const Tensor& ct = in.at("cotangent.sorted_x");
    Tensor ctk(ct.dtype(), {R_out, H});
    ctk.fill(1e30);
    for (int64_t j = 0; j < S; ++j)
      for (int64_t h = 0; h < H; ++h) ctk.set(j, h, ct.at(j, h));
    const ref::TokenDispatchBwd kb = ref::token_dispatch_bwd(
        ctk, nullptr, kd.row_id_map, kd.pad_offsets ? &*kd.pad_offsets : nullptr);
    const Tensor b = bound(c, "grad.x", in, out);
    for (int64_t i = 0; i < gx->numel(); ++i) {
      if (!(std::fabs(kb.grad_x.at(i) - gx->at(i)) <= b.at(i))) {
        bad.add("§8.4: grad x differs between the backends at flat index " + std::to_string(i) +
                ": kernel " + format_double(kb.grad_x.at(i)) + ", argsort " +
                format_double(gx->at(i)));
        break;
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
  Cost k;
  k.fwd_bytes = T * H * d + T * K * 4 + rows * (H * d + 4);  // every row written (padding = 0)
  k.bwd_bytes = T * K * H * d + rows * 4 + T * H * d;
  k.bwd_flops = T * K * H;
  return k;
}

nlohmann::json to_params(const Case& c) {
  const ArgsortDispatchParams p = argsort_params(c);
  return {{"num_experts", p.num_experts},
          {"topk", p.topk},
          {"align_size", p.align_size},
          {"roll_to_expert_id",
           p.roll_to_expert_id ? nlohmann::json(*p.roll_to_expert_id) : nlohmann::json(nullptr)}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  // SPEC §14: a null parameter is an absent optional one, i.e. its default.
  auto get_or = [&j](const char* k, auto dflt) {
    const nlohmann::json& v = j.at(k);
    return v.is_null() ? dflt : v.get<decltype(dflt)>();
  };
  const Tensor& x = in.at("input.x");
  c.set("T", x.dim(0)).set("H", x.dim(1)).set("E", j.at("num_experts").get<int64_t>());
  set_params<int64_t>(c, j, {"topk"});
  c.set("align_size", get_or("align_size", int64_t{0}));
  if (!j.at("roll_to_expert_id").is_null()) {
    c.set("roll_to_expert_id", j.at("roll_to_expert_id").get<int64_t>());
  }
  return c;
}

}  // namespace

const OpInfo& argsort_token_dispatch_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info(kOp, "SPEC §8.2",
                {gen, named, make_inputs, run_reference, invariants, cost, to_params, from_params});
    o.bound = bound;
    o.compare = compare_fn;
    o.bench_cases = [] {
      return std::vector<Case>{base(DType::bf16, 16384, 8, 2, 4096, 0, "mixtral_t16k"),
                               base(DType::bf16, 4096, 64, 8, 2048, 16, "e64_a16")};
    };
#ifdef MOE_WITH_CUDA
    o.gpu = argsort_token_dispatch_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
