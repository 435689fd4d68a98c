// Registry record of token_combine (SPEC §5): the kernel backend's unpermute with optional merging
// probs and unpadding.
//
// Case keys: T, E, H, K, ragged, num_out_tokens and align_size describe the token_dispatch that
// produced row_id_map / pad_offsets (R_in = dispatch_out_rows(num_out_tokens, E, align_size));
// merging_dtype (none = no merging probs). The SPEC params object is empty.
#include <algorithm>
#include <cmath>
#include <string>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/dispatch.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "token_combine";

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case(kOp, kRoutingRegimes);
    const int64_t E = draw_experts();
    const int64_t K = *rc::gen::inRange<int64_t>(0, E + 1);
    const int64_t T = draw_tokens(draw_no_rows(c));
    const int64_t a = draw_align_size();
    const int64_t H = draw_hidden(a);
    c.set("T", T).set("E", E).set("K", K).set("H", H);
    c.set("ragged", *rc::gen::arbitrary<bool>());
    c.set("num_out_tokens", T * K + *rc::gen::element<int64_t>(0, 0, 1, 5));
    c.set("align_size", a);
    c.set("merging_dtype",
          *rc::gen::element<std::string>("none", "float32", "float32", "bfloat16", "float16"));
    return c;
  });
}

CaseBuilder base(DType d, int64_t T, int64_t E, int64_t K, int64_t H, int64_t n_out, int64_t a,
                 const std::string& merging, const std::string& name) {
  CaseBuilder b(kOp, d);
  b.seed(17).name(name).set("T", T).set("E", E).set("K", K).set("H", H).set("ragged", false);
  return b.set("num_out_tokens", n_out).set("align_size", a).set("merging_dtype", merging);
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R4: merging probs and pad_offsets; every padding and tail row of grad permuted must be 0.
  v.push_back(base(DType::f32, 128, 5, 3, 16, 384, 8, "float32", "R4_merging_padded"));
  v.push_back(base(DType::bf16, 128, 5, 3, 16, 384, 8, "bfloat16", "R4_merging_padded_bf16"));
  // R6: no merging probs; grad permuted has exactly R_in rows (416 for a = 8), for a in
  // {1, 8, 16, 128} (E(a-1) > N for a = 128).
  for (int64_t a : {1, 8, 16, 128}) {
    v.push_back(base(DType::bf16, 128, 5, 3, 16, 384, a, "none", "R6_a" + std::to_string(a)));
  }
  v.push_back(base(DType::bf16, 64, 8, 2, 64, 128, 16, "float32", "mixtral_a16"));
  v.push_back(
      base(DType::f16, 24, 7, 3, 257, 80, 0, "float16", "odd_ragged_tail").set("ragged", true));
  v.push_back(base(DType::f32, 12, 6, 6, 4, 72, 4, "float32", "k_equals_e"));
  v.push_back(
      base(DType::f32, 0, 4, 2, 8, 0, 16, "float32", "zero_tokens").regime(Regime::zero_tokens));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("K"), H = c.i("H");
  TokenDispatchParams p;
  p.num_out_tokens = c.i("num_out_tokens");
  p.align_size = c.i("align_size", 0);
  const auto routes = make_routes(c, T, E, K, c.b("ragged", false), "input.routing_map");
  const Tensor map = routes_to_map(routes, E);
  // The state comes from the reference dispatch of the same routing (x itself is not needed).
  ref::TokenDispatchFwd st = ref::token_dispatch_fwd(Tensor(DType::f32, {T, 0}), map, nullptr, p);
  const int64_t R_in = st.permuted.dim(0);
  TensorMap m;
  // Every row is non-zero, padding rows included: combine must never read them.
  m.emplace("input.permuted", normal_tensor(c, c.dtype, {R_in, H}, "input.permuted"));
  m.emplace("input.row_id_map", std::move(st.row_id_map));
  if (st.pad_offsets) m.emplace("input.pad_offsets", std::move(*st.pad_offsets));
  if (const auto md = opt_dtype(c, "merging_dtype")) {
    // Sparse router probs: non-zero only on routed entries.
    Tensor mp = uniform_tensor(c, *md, {T, E}, 0.1, 1.0, "input.merging_probs");
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        if (map.at(t, e) == 0) mp.set(t, e, 0.0);
    m.emplace("input.merging_probs", std::move(mp));
  }
  m.emplace("cotangent.combined", normal_tensor(c, c.dtype, {T, H}, "cotangent.combined"));
  return m;
}

TensorMap run_reference(const Case&, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Tensor& permuted = in.at("input.permuted");
  const Tensor& rim = in.at("input.row_id_map");
  const Tensor* mp = find_tensor(in, "input.merging_probs");
  const Tensor* pad = find_tensor(in, "input.pad_offsets");
  TensorMap out;
  out.emplace("output.combined", ref::token_combine_fwd(permuted, rim, mp, pad, rnd));
  if (const Tensor* ct = find_tensor(in, "cotangent.combined")) {
    ref::TokenCombineBwd b = ref::token_combine_bwd(*ct, permuted, rim, mp, pad, rnd);
    out.emplace("grad.permuted", std::move(b.grad_permuted));
    if (b.grad_merging_probs) out.emplace("grad.merging_probs", std::move(*b.grad_merging_probs));
  }
  return out;
}

struct Slot {
  int64_t e, row;
};
std::vector<std::vector<Slot>> slots_of(const TensorMap& in) {
  const Tensor& rim = in.at("input.row_id_map");
  const Tensor* pad = find_tensor(in, "input.pad_offsets");
  const int64_t T = rim.dim(0), E = (rim.dim(1) - 1) / 2;
  std::vector<std::vector<Slot>> s(T);
  for (int64_t t = 0; t < T; ++t) {
    const auto n = static_cast<int64_t>(rim.at(t, 2 * E));
    for (int64_t k = 0; k < n; ++k) {
      const auto e = static_cast<int64_t>(rim.at(t, E + k));
      const auto u = static_cast<int64_t>(rim.at(t, k));
      s[t].push_back({e, u + (pad ? static_cast<int64_t>(pad->at(e)) : 0)});
    }
  }
  return s;
}

Tensor bound(const Case&, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const Tensor& ref = want.at(key);
  Tensor b(DType::f64, ref.shape());
  const Tensor& x = in.at("input.permuted");
  const Tensor* mp = find_tensor(in, "input.merging_probs");
  const auto slots = slots_of(in);
  if (key == "output.combined") {  // fp32 sum over the n_t slots of x[src] * w
    for (int64_t t = 0; t < ref.dim(0); ++t) {
      for (int64_t h = 0; h < ref.dim(1); ++h) {
        double s = 0;
        for (const Slot& sl : slots[t])
          s += std::fabs(x.at(sl.row, h) * (mp ? mp->at(t, sl.e) : 1.0));
        const auto n = static_cast<int64_t>(slots[t].size());
        b.set(t, h, tol_bound(TolClass::reduction, ref.dtype(), ref.at(t, h), n, s));
      }
    }
  } else if (key == "grad.permuted" && mp) {  // one fp32 product rounded to d
    return make_bound(TolClass::elementwise, ref.dtype(), ref, 1);
  } else if (key == "grad.merging_probs") {  // fp32 sum over H of x[src,h] * ct[t,h]
    const Tensor& ct = in.at("cotangent.combined");
    const int64_t H = x.dim(1);
    for (int64_t t = 0; t < ref.dim(0); ++t) {
      for (const Slot& sl : slots[t]) {
        double s = 0;
        for (int64_t h = 0; h < H; ++h) s += std::fabs(x.at(sl.row, h) * ct.at(t, h));
        b.set(t, sl.e, tol_bound(TolClass::reduction, ref.dtype(), ref.at(t, sl.e), H, s));
      }
    }
  }
  return b;
}

Report compare_fn(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  std::set<std::string> tol = {"output.combined", "grad.merging_probs"};
  if (in.count("input.merging_probs")) tol.insert("grad.permuted");  // else an exact copy
  return compare_perm(*find_op(kOp), c, in, want, got, tol);
}

bool zero_row(const Tensor& a, int64_t r) {
  for (int64_t h = 0; h < a.row_stride(); ++h) {
    const double v = a.at(r, h);
    if (v != 0.0 || std::signbit(v)) return false;
  }
  return true;
}

std::vector<std::string> invariants(const Case&, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const Tensor& x = in.at("input.permuted");
  const Tensor& comb = out.at("output.combined");
  const Tensor* mp = find_tensor(in, "input.merging_probs");
  const auto slots = slots_of(in);
  const int64_t T = static_cast<int64_t>(slots.size()), R_in = x.dim(0), H = x.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t].empty() && !zero_row(comb, t)) {
      bad.add("combined row " + std::to_string(t) + " has n_t = 0 but is not +0");
    }
  }
  const Tensor* gp = find_tensor(out, "grad.permuted");
  if (!gp) return bad.take();
  if (gp->shape() != Shape{R_in, H}) {  // R6: the forward input's row count, never recomputed
    bad.add("grad.permuted has shape " + gp->describe() +
            ", expected [R_in, H] = " + shape_str({R_in, H}) + " (R6)");
    return bad.take();
  }
  const Tensor& ct = in.at("cotangent.combined");
  std::vector<uint8_t> mapped(static_cast<size_t>(R_in), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (const Slot& s : slots[t]) {
      mapped[s.row] = 1;
      if (mp) continue;
      for (int64_t h = 0; h < H; ++h) {
        const double g = gp->at(s.row, h), w = ct.at(t, h);
        if (g != w || std::signbit(g) != std::signbit(w)) {
          bad.add("grad.permuted row " + std::to_string(s.row) + " is not an exact copy of ct[" +
                  std::to_string(t) + "]");
          break;
        }
      }
    }
  }
  for (int64_t r = 0; r < R_in; ++r) {
    if (!mapped[r] && !zero_row(*gp, r)) {
      bad.add("grad.permuted row " + std::to_string(r) +
              " is mapped by no (t,e) but is not 0 (R4)");
    }
  }
  if (const Tensor* gm = find_tensor(out, "grad.merging_probs")) {
    for (int64_t t = 0; t < T; ++t) {
      std::vector<uint8_t> routed(static_cast<size_t>(gm->dim(1)), 0);
      for (const Slot& s : slots[t]) routed[s.e] = 1;
      for (int64_t e = 0; e < gm->dim(1); ++e) {
        if (!routed[e] && gm->at(t, e) != 0.0) {
          bad.add("grad.merging_probs[" + std::to_string(t) + ", " + std::to_string(e) +
                  "] is non-zero at an unrouted entry");
        }
      }
    }
  }
  return bad.take();
}

Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("T")), E = static_cast<double>(c.i("E"));
  const double H = static_cast<double>(c.i("H"));
  const double R_in =
      static_cast<double>(dispatch_out_rows(c.i("num_out_tokens"), c.i("E"), c.i("align_size", 0)));
  const double routed = std::min(T * static_cast<double>(c.i("K")), R_in);
  const double d = static_cast<double>(dtype_size(c.dtype));
  const auto md = opt_dtype(c, "merging_dtype");
  const double p = md ? static_cast<double>(dtype_size(*md)) : 0.0;
  const double rim = T * (2 * E + 1) * 4;
  Cost k;
  k.fwd_bytes = routed * H * d + rim + routed * p + T * H * d;
  k.fwd_flops = 2 * routed * H;
  // Backward: ct and the map in (plus the saved permuted rows and probs for the probs gradient);
  // every row of grad permuted out (padding and tail rows are written as zeros).
  k.bwd_bytes = T * H * d + rim + R_in * H * d + (md ? routed * (H * d + 2 * p) : 0.0);
  k.bwd_flops = md ? 3 * routed * H : 0.0;
  return k;
}

#ifdef MOE_WITH_CUDA
// The benchmark, with the backward's byte count over the routed rows of grad permuted only as
// the second figure when padding or tail rows exist (cost() counts every row: SPEC §5 and R4
// require the rows no slot owns written as zeros).
OpInfo::Bench with_routed_bytes(const Case& c, OpInfo::Bench b) {
  const double H = static_cast<double>(c.i("H")), d = static_cast<double>(dtype_size(c.dtype));
  const double R_in =
      static_cast<double>(dispatch_out_rows(c.i("num_out_tokens"), c.i("E"), c.i("align_size", 0)));
  const double routed =
      std::min(static_cast<double>(c.i("T")) * static_cast<double>(c.i("K")), R_in);
  if (R_in > routed) {
    b.alt_bwd_bytes = cost(c).bwd_bytes - (R_in - routed) * H * d;
    b.alt_bytes_note = "counting the routed rows of grad permuted only: the " +
                       std::to_string(static_cast<int64_t>(R_in - routed)) +
                       " zero padding/tail rows SPEC §5 requires written left out";
  }
  return b;
}
#endif

Case from_params(const nlohmann::json&, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  const Tensor& x = in.at("input.permuted");
  const Tensor& rim = in.at("input.row_id_map");
  const int64_t T = rim.dim(0), E = (rim.dim(1) - 1) / 2;
  int64_t kmax = 0, kmin = E;
  for (int64_t t = 0; t < T; ++t) {
    const auto n = static_cast<int64_t>(rim.at(t, 2 * E));
    kmax = std::max(kmax, n);
    kmin = std::min(kmin, n);
  }
  // The file does not say which (num_out_tokens, align_size) produced R_in; these reproduce the
  // shapes: a = 1 (pad_offsets present, R_out = N_out) or a = 0.
  c.set("T", T).set("E", E).set("H", x.dim(1)).set("K", kmax).set("ragged", T > 0 && kmin != kmax);
  c.set("num_out_tokens", x.dim(0));
  c.set("align_size", in.count("input.pad_offsets") ? int64_t{1} : int64_t{0});
  const Tensor* mp = find_tensor(in, "input.merging_probs");
  c.set("merging_dtype", mp ? std::string(dtype_name(mp->dtype())) : std::string("none"));
  return c;
}

std::vector<Case> bench_cases() {
  return {base(DType::bf16, 16384, 8, 2, 4096, 32768, 0, "float32", "mixtral_t16k"),
          base(DType::bf16, 16384, 256, 8, 7168, 131072, 128, "float32", "deepseek_v3_a128"),
          base(DType::bf16, 4096, 64, 8, 2048, 32768, 16, "none", "e64_a16_no_probs")};
}

}  // namespace

const OpInfo& token_combine_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info(kOp, "SPEC §5",
                {gen, named, make_inputs, run_reference, invariants, cost, no_params, from_params});
    o.bound = bound;
    o.compare = compare_fn;
    o.bench_cases = bench_cases;
#ifdef MOE_WITH_CUDA
    set_gpu(
        o, adjust_bench({token_combine_gpu, token_combine_gpu_bench, token_combine_gpu_bench_device,
                         dispatch_bench_verify_case, token_combine_gpu_bench_cases},
                        with_routed_bytes));
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
