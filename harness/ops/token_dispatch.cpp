// Registry record of token_dispatch (SPEC §4): routing-map permute with optional alignment padding,
// optional probs (and the R12 zero-prob quirk) and the optional drop_overflow mode.
//
// Case keys: T, E, H, K (experts per token; with ragged=true a count in [0,K] per token),
// num_out_tokens, align_size, drop_overflow, probs_dtype (none = no probs), zero_probs (routed
// slots whose prob is exactly 0, R12) or zero_prob_token (the token whose first expert gets it).
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

constexpr const char* kOp = "token_dispatch";

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case(kOp, kRoutingRegimes);
    const int64_t E = draw_experts();
    const int64_t K = *rc::gen::inRange<int64_t>(0, E + 1);
    const int64_t T = draw_tokens(draw_no_rows(c));
    const int64_t a = draw_align_size();
    // Keep R_out*H small: the finite-difference loss sums over every element many times.
    const int64_t H = draw_hidden(a);
    const bool drop = a == 0 && *rc::gen::element(false, false, false, true);
    const int64_t routed_max = T * K;
    const int64_t n_out = drop ? *rc::gen::inRange<int64_t>(0, routed_max + 1)
                               : routed_max + *rc::gen::element<int64_t>(0, 0, 1, 5);
    c.set("T", T).set("E", E).set("K", K).set("H", H);
    c.set("ragged", *rc::gen::arbitrary<bool>());
    c.set("num_out_tokens", n_out).set("align_size", a).set("drop_overflow", drop);
    const auto pd =
        *rc::gen::element<std::string>("none", "none", "float32", "bfloat16", "float16");
    c.set("probs_dtype", pd);
    c.set("zero_probs", pd == "none" ? int64_t{0} : *rc::gen::element<int64_t>(0, 0, 1, 2));
    return c;
  });
}

CaseBuilder base(DType d, int64_t T, int64_t E, int64_t K, int64_t H, int64_t n_out, int64_t a,
                 const std::string& name) {
  CaseBuilder b(kOp, d);
  b.seed(11).name(name).set("T", T).set("E", E).set("K", K).set("H", H).set("ragged", false);
  b.set("num_out_tokens", n_out).set("align_size", a).set("drop_overflow", false);
  return b.set("probs_dtype", "none").set("zero_probs", int64_t{0});
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R11 with drop_overflow: 300 routed slots, capacity 256; rows dst >= 256 are dropped.
  v.push_back(base(DType::f32, 100, 8, 3, 16, 256, 0, "R11_drop_overflow")
                  .set("drop_overflow", true)
                  .set("probs_dtype", "float32"));
  // R12: probs[3,e] == 0 for one routed e: a zero row forward, ct still routed backward.
  v.push_back(base(DType::f32, 8, 4, 2, 8, 16, 0, "R12_zero_prob")
                  .set("probs_dtype", "float32")
                  .set("zero_prob_token", int64_t{3}));
  v.push_back(base(DType::bf16, 8, 4, 2, 8, 16, 8, "R12_zero_prob_padded")
                  .set("probs_dtype", "bfloat16")
                  .set("zero_prob_token", int64_t{3}));
  // R6/R4 shapes (T=128, E=5, K=3, a=8 -> R_out=416) and the other alignments of R6.
  for (int64_t a : {1, 8, 16, 128}) {
    v.push_back(base(DType::bf16, 128, 5, 3, 16, 384, a, "R6_a" + std::to_string(a))
                    .set("probs_dtype", "float32"));
  }
  // Catalogue.
  v.push_back(base(DType::bf16, 64, 8, 2, 64, 128, 16, "mixtral_a16"));
  v.push_back(
      base(DType::f32, 32, 32, 8, 32, 256, 0, "deepseek_probs").set("probs_dtype", "float32"));
  v.push_back(base(DType::f16, 24, 7, 3, 257, 80, 0, "odd_ragged_tail")
                  .set("ragged", true)
                  .set("probs_dtype", "float16"));
  v.push_back(base(DType::f32, 16, 4, 1, 8, 16, 128, "all_to_one_a128").regime(Regime::all_to_one));
  v.push_back(
      base(DType::bf16, 32, 16, 2, 8, 64, 8, "skewed_empty_experts").regime(Regime::skewed));
  v.push_back(base(DType::f32, 0, 4, 2, 8, 0, 0, "zero_tokens").regime(Regime::zero_tokens));
  v.push_back(
      base(DType::f32, 0, 4, 2, 8, 0, 16, "zero_tokens_padded").regime(Regime::zero_tokens));
  v.push_back(base(DType::f32, 12, 6, 6, 4, 72, 4, "k_equals_e"));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("K"), H = c.i("H");
  const TokenDispatchParams p = dispatch_params(c);
  const auto routes = make_routes(c, T, E, K, c.b("ragged", false), "input.routing_map");
  TensorMap m;
  m.emplace("input.x", normal_tensor(c, c.dtype, {T, H}, "input.x"));
  m.emplace("input.routing_map", routes_to_map(routes, E));
  const int64_t R_out = dispatch_out_rows(p.num_out_tokens, E, p.align_size);
  m.emplace("cotangent.permuted", normal_tensor(c, c.dtype, {R_out, H}, "cotangent.permuted"));
  if (const auto pd = opt_dtype(c, "probs_dtype")) {
    // TE's own tests draw probs from [0.1, 1); exact zeros only where the case asks (R12).
    Tensor probs = uniform_tensor(c, *pd, {T, E}, 0.1, 1.0, "input.probs");
    if (c.has("zero_prob_token")) {
      const int64_t t = c.i("zero_prob_token");
      if (t < T && !routes[t].empty()) probs.set(t, routes[t].front(), 0.0);
    }
    std::vector<std::pair<int64_t, int64_t>> slots;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e : routes[t]) slots.emplace_back(t, e);
    Rng rng(c.seed, "input.probs.zero");
    for (int64_t z = 0; z < c.i("zero_probs", 0) && !slots.empty(); ++z) {
      const auto [t, e] = slots[rng.below(static_cast<int64_t>(slots.size()))];
      probs.set(t, e, z % 2 ? -0.0 : 0.0);  // both signs count as zero
    }
    m.emplace("input.probs", std::move(probs));
    m.emplace("cotangent.permuted_probs",
              normal_tensor(c, *pd, {R_out}, "cotangent.permuted_probs"));
  }
  return m;
}

TensorMap run_reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Tensor* probs = find_tensor(in, "input.probs");
  ref::TokenDispatchFwd f = ref::token_dispatch_fwd(in.at("input.x"), in.at("input.routing_map"),
                                                    probs, dispatch_params(c), rnd);
  TensorMap out;
  if (const Tensor* ct = find_tensor(in, "cotangent.permuted")) {
    const Tensor* ctp = find_tensor(in, "cotangent.permuted_probs");
    ref::TokenDispatchBwd b = ref::token_dispatch_bwd(
        *ct, ctp, f.row_id_map, f.pad_offsets ? &*f.pad_offsets : nullptr, rnd);
    out.emplace("grad.x", std::move(b.grad_x));
    if (b.grad_probs) out.emplace("grad.probs", std::move(*b.grad_probs));
  }
  out.emplace("output.permuted", std::move(f.permuted));
  if (f.permuted_probs) out.emplace("output.permuted_probs", std::move(*f.permuted_probs));
  out.emplace("output.row_id_map", std::move(f.row_id_map));
  if (f.pad_offsets) out.emplace("output.pad_offsets", std::move(*f.pad_offsets));
  out.emplace("output.tokens_per_expert", std::move(f.tokens_per_expert));
  return out;
}

// Physical rows dst(t,e_k) of every token's slots, from the saved state.
std::vector<std::vector<std::pair<int64_t, int64_t>>> slots_of(const TensorMap& want) {
  const Tensor& rim = want.at("output.row_id_map");
  const Tensor* pad = find_tensor(want, "output.pad_offsets");
  const int64_t T = rim.dim(0), E = (rim.dim(1) - 1) / 2;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> s(T);
  for (int64_t t = 0; t < T; ++t) {
    const auto n = static_cast<int64_t>(rim.at(t, 2 * E));
    for (int64_t k = 0; k < n; ++k) {
      const auto e = static_cast<int64_t>(rim.at(t, E + k));
      const auto u = static_cast<int64_t>(rim.at(t, k));
      s[t].emplace_back(e, u + (pad ? static_cast<int64_t>(pad->at(e)) : 0));
    }
  }
  return s;
}

Tensor bound(const Case&, const std::string& key, const TensorMap& in, const TensorMap& want) {
  const Tensor& ref = want.at(key);
  Tensor b(DType::f64, ref.shape());  // data movement: exact
  if (key != "grad.x") return b;
  // grad x[t] is an fp32 sum of n_t cotangent rows (§12 reduction row).
  const Tensor& ct = in.at("cotangent.permuted");
  const auto slots = slots_of(want);
  const int64_t H = ref.dim(1);
  for (int64_t t = 0; t < ref.dim(0); ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double abs_sum = 0;
      for (auto [e, row] : slots[t]) abs_sum += std::fabs(ct.at(row, h));
      const auto n = static_cast<int64_t>(slots[t].size());
      b.set(t, h, tol_bound(TolClass::reduction, ref.dtype(), ref.at(t, h), n, abs_sum));
    }
  }
  return b;
}

Report compare_fn(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  return compare_perm(*find_op(kOp), c, in, want, got, {"grad.x"});
}

bool bits_equal_row(const Tensor& a, int64_t ra, const Tensor& b, int64_t rb) {
  const int64_t w = a.row_stride();
  for (int64_t h = 0; h < w; ++h) {
    const double x = a.at(ra * w + h), y = b.at(rb * w + h);
    if (!(x == y && std::signbit(x) == std::signbit(y))) return false;
  }
  return true;
}

bool zero_row(const Tensor& a, int64_t r) {
  const int64_t w = a.row_stride();
  for (int64_t h = 0; h < w; ++h) {
    const double x = a.at(r * w + h);
    if (x != 0.0 || std::signbit(x)) return false;
  }
  return true;
}

// SPEC §12 dispatch/combine invariants plus the §4.1/§4.2 layout, checked from first principles.
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const TokenDispatchParams p = dispatch_params(c);
  const Tensor& x = in.at("input.x");
  const Tensor& map = in.at("input.routing_map");
  const Tensor* probs = find_tensor(in, "input.probs");
  const Tensor& permuted = out.at("output.permuted");
  const Tensor& rim = out.at("output.row_id_map");
  const Tensor& tpe = out.at("output.tokens_per_expert");
  const Tensor* pad = find_tensor(out, "output.pad_offsets");
  const int64_t T = x.dim(0), H = x.dim(1), E = map.dim(1), a = p.align_size;
  const int64_t R_out = dispatch_out_rows(p.num_out_tokens, E, a);
  std::vector<std::string> shape_bad;
  if (permuted.shape() != Shape{R_out, H}) shape_bad.push_back("permuted: " + permuted.describe());
  if (rim.shape() != Shape{T, 2 * E + 1}) shape_bad.push_back("row_id_map: " + rim.describe());
  if (tpe.shape() != Shape{E}) shape_bad.push_back("tokens_per_expert: " + tpe.describe());
  if ((a >= 1) != (pad != nullptr)) {
    shape_bad.push_back("pad_offsets must be present iff align_size >= 1 (R7)");
  }
  if (!shape_bad.empty()) return shape_bad;

  // Expected layout: expert-major, ascending token; u counts every routed slot; with
  // drop_overflow the slots with u >= N_out are dropped.
  std::vector<int64_t> count(E, 0), kept(E, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) count[e] += map.at(t, e) != 0;
  std::vector<int64_t> ustart(E, 0), start(E, 0);
  int64_t u_acc = 0, row_acc = 0, kept_acc = 0, sum_tpe = 0;
  for (int64_t e = 0; e < E; ++e) {
    ustart[e] = u_acc;
    u_acc += count[e];
    kept[e] = std::max<int64_t>(0, std::min(count[e], p.num_out_tokens - ustart[e]));
    start[e] = row_acc;
    const auto ce = static_cast<int64_t>(tpe.at(e));
    sum_tpe += ce;
    row_acc += ce;
    if (ce != dispatch_aligned_count(kept[e], a)) {
      bad.add("tokens_per_expert[" + std::to_string(e) + "] = " + std::to_string(ce) +
              ", expected the aligned count of " + std::to_string(kept[e]));
    }
    if (a >= 1 && ce % a != 0) bad.add("tokens_per_expert[" + std::to_string(e) + "] % a != 0");
    // pad_off_e = sum_{e'<e} (chat - c) = (physical start) - (unpadded start).
    if (pad && static_cast<int64_t>(pad->at(e)) != start[e] - kept_acc) {
      bad.add("pad_offsets[" + std::to_string(e) + "] = " + format_double(pad->at(e)) +
              ", expected " + std::to_string(start[e] - kept_acc));
    }
    kept_acc += kept[e];
  }
  if (sum_tpe > R_out) bad.add("sum tokens_per_expert " + std::to_string(sum_tpe) + " > R_out");

  std::vector<uint8_t> written(static_cast<size_t>(R_out), 0);
  std::vector<int64_t> rank(E, 0);
  Tensor ones(DType::f32, {R_out, H});
  ones.fill(1.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<int64_t, int64_t>> expect;  // (e, u), ascending e
    for (int64_t e = 0; e < E; ++e) {
      if (map.at(t, e) == 0) continue;
      const int64_t u = ustart[e] + rank[e]++;
      if (u < p.num_out_tokens) expect.emplace_back(e, u);
    }
    const auto n = static_cast<int64_t>(expect.size());
    if (static_cast<int64_t>(rim.at(t, 2 * E)) != n) {
      bad.add("row_id_map[" + std::to_string(t) + ", 2E] != n_t = " + std::to_string(n));
      continue;
    }
    for (int64_t k = 0; k < E; ++k) {
      const bool used = k < n;
      const int64_t want_u = used ? expect[n - 1 - k].second : -1;
      const int64_t want_e = used ? expect[n - 1 - k].first : -1;
      if (static_cast<int64_t>(rim.at(t, k)) != want_u ||
          static_cast<int64_t>(rim.at(t, E + k)) != want_e) {
        bad.add("row_id_map row " + std::to_string(t) + " slot " + std::to_string(k) +
                ": expected (u, e) = (" + std::to_string(want_u) + ", " + std::to_string(want_e) +
                ") in descending-expert order with -1 fill");
      }
    }
    for (auto [e, u] : expect) {
      // dst = sum_{e'<e} chat + rank among kept rows of e.
      const int64_t dst = start[e] + (u - ustart[e]);
      if (dst >= R_out) {
        bad.add("dst out of range");
        continue;
      }
      written[dst] = 1;
      const bool quirk = probs && probs->at(t, e) == 0.0;
      if (quirk ? !zero_row(permuted, dst) : !bits_equal_row(permuted, dst, x, t)) {
        bad.add("permuted row " + std::to_string(dst) + " is not " +
                (quirk ? "zero (R12 quirk)" : "a bitwise copy of x[" + std::to_string(t) + "]"));
      }
      if (const Tensor* pp = find_tensor(out, "output.permuted_probs")) {
        if (pp->at(dst) != probs->at(t, e)) bad.add("permuted_probs[dst] != probs[t,e]");
      }
    }
  }
  for (int64_t r = 0; r < R_out; ++r) {
    if (!written[r] && !zero_row(permuted, r)) {
      bad.add("permuted row " + std::to_string(r) + " (padding or tail) is not +0");
    }
  }

  // grad x of dispatch with cotangent 1 is n_t; combine(dispatch(x)) without merging probs is
  // n_t * x (the R12 zero rows contribute 0).
  const ref::TokenDispatchBwd g1 = ref::token_dispatch_bwd(ones, nullptr, rim, pad);
  const Tensor comb = ref::token_combine_fwd(permuted, rim, nullptr, pad);
  for (int64_t t = 0; t < T; ++t) {
    const auto n = static_cast<int64_t>(rim.at(t, 2 * E));
    int64_t live = 0;
    for (int64_t k = 0; k < n; ++k) {
      const auto e = static_cast<int64_t>(rim.at(t, E + k));
      live += !(probs && probs->at(t, e) == 0.0);
    }
    for (int64_t h = 0; h < H; ++h) {
      if (g1.grad_x.at(t, h) != static_cast<double>(n)) {
        bad.add("grad x with cotangent 1 at (" + std::to_string(t) + ", " + std::to_string(h) +
                ") is " + format_double(g1.grad_x.at(t, h)) +
                ", expected n_t = " + std::to_string(n));
      }
      const double want = round_to(x.dtype(), static_cast<double>(live) * x.at(t, h));
      if (comb.at(t, h) != want) {
        bad.add("combine(dispatch(x)) at (" + std::to_string(t) + ", " + std::to_string(h) +
                ") is " + format_double(comb.at(t, h)) +
                ", expected n_t*x = " + format_double(want));
      }
    }
  }
  return bad.take();
}

// R12: routed slots with an exactly-zero prob are excluded from finite differences (forward and
// backward disagree there by design), together with the whole x row of that token.
TensorMap fd_masks(const Case&, const TensorMap& in) {
  TensorMap m;
  const Tensor* probs = find_tensor(in, "input.probs");
  if (!probs) return m;
  const Tensor& x = in.at("input.x");
  const Tensor& map = in.at("input.routing_map");
  Tensor mp(DType::f64, probs->shape()), mx(DType::f64, x.shape());
  mp.fill(1.0);
  mx.fill(1.0);
  for (int64_t t = 0; t < map.dim(0); ++t) {
    for (int64_t e = 0; e < map.dim(1); ++e) {
      if (map.at(t, e) == 0 || probs->at(t, e) != 0.0) continue;
      mp.set(t, e, 0.0);
      for (int64_t h = 0; h < x.dim(1); ++h) mx.set(t, h, 0.0);
    }
  }
  m.emplace("input.probs", std::move(mp));
  m.emplace("input.x", std::move(mx));
  return m;
}

// Bytes of the forward other than the rows of `permuted` (and permuted_probs): x and the map
// (and probs) in, row_id_map and the counts out.
double dispatch_fixed_bytes(const Case& c) {
  const double T = static_cast<double>(c.i("T")), E = static_cast<double>(c.i("E"));
  const double H = static_cast<double>(c.i("H"));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const auto pd = opt_dtype(c, "probs_dtype");
  const double p = pd ? static_cast<double>(dtype_size(*pd)) : 0.0;
  return T * H * d + T * E + T * E * p + T * (2 * E + 1) * 4 + E * 8;
}

double routed_rows(const Case& c) {
  return std::min(static_cast<double>(c.i("T")) * static_cast<double>(c.i("K")),
                  static_cast<double>(c.i("num_out_tokens")));
}

double row_bytes_of(const Case& c) {
  const auto pd = opt_dtype(c, "probs_dtype");
  return static_cast<double>(c.i("H")) * static_cast<double>(dtype_size(c.dtype)) +
         (pd ? static_cast<double>(dtype_size(*pd)) : 0.0);
}

double out_rows(const Case& c) {
  return static_cast<double>(
      dispatch_out_rows(c.i("num_out_tokens"), c.i("E"), c.i("align_size", 0)));
}

Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("T")), E = static_cast<double>(c.i("E"));
  const double H = static_cast<double>(c.i("H"));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const auto pd = opt_dtype(c, "probs_dtype");
  const double p = pd ? static_cast<double>(dtype_size(*pd)) : 0.0;
  const double routed = routed_rows(c);
  Cost k;
  // Forward: every one of the R_out rows of permuted (and permuted_probs) is written: the routed
  // rows are copies of x, and SPEC §4 requires the rest (the padding rows of every expert when
  // align_size >= 1, and the tail past the aligned counts) written as +0. The formula
  // (T*H read + T*K*H written) leaves those rows out; bench reports that figure next to this one.
  k.fwd_bytes = dispatch_fixed_bytes(c) + out_rows(c) * row_bytes_of(c);
  // Backward: the routed cotangent rows and row_id_map in; grad x (and grad probs) out.
  k.bwd_bytes = routed * (H * d + p) + T * (2 * E + 1) * 4 + T * H * d + T * E * p;
  k.bwd_flops = routed * H;
  return k;
}

#ifdef MOE_WITH_CUDA
// The benchmark, with the forward's byte count by the formula (routed rows only) as the
// second figure when padding or tail rows exist.
OpInfo::Bench with_routed_bytes(const Case& c, OpInfo::Bench b) {
  if (out_rows(c) > routed_rows(c)) {
    b.alt_fwd_bytes = dispatch_fixed_bytes(c) + routed_rows(c) * row_bytes_of(c);
    b.alt_bytes_note =
        "by the issue's count (T*H read + T*K*H written, plus map, probs, row_id_map): the " +
        std::to_string(static_cast<int64_t>(out_rows(c) - routed_rows(c))) +
        " zero padding/tail rows SPEC §4 requires written left out";
  }
  return b;
}
#endif

nlohmann::json to_params(const Case& c) {
  const TokenDispatchParams p = dispatch_params(c);
  return {{"num_out_tokens", p.num_out_tokens},
          {"align_size", p.align_size},
          {"drop_overflow", p.drop_overflow}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  // SPEC §14: a null parameter is an absent optional one, i.e. its default.
  auto get_or = [&j](const char* k, auto dflt) {
    const nlohmann::json& v = j.at(k);
    return v.is_null() ? dflt : v.get<decltype(dflt)>();
  };
  const Tensor& x = in.at("input.x");
  const Tensor& map = in.at("input.routing_map");
  const int64_t T = x.dim(0), E = map.dim(1);
  int64_t kmax = 0, kmin = E;
  for (int64_t t = 0; t < T; ++t) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) n += map.at(t, e) != 0;
    kmax = std::max(kmax, n);
    kmin = std::min(kmin, n);
  }
  c.set("T", T).set("E", E).set("H", x.dim(1)).set("K", kmax).set("ragged", T > 0 && kmin != kmax);
  set_params<int64_t>(c, j, {"num_out_tokens"});
  c.set("align_size", get_or("align_size", int64_t{0}));
  c.set("drop_overflow", get_or("drop_overflow", false));
  const Tensor* probs = find_tensor(in, "input.probs");
  c.set("probs_dtype", probs ? std::string(dtype_name(probs->dtype())) : std::string("none"));
  int64_t zeros = 0;
  if (probs) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) zeros += map.at(t, e) != 0 && probs->at(t, e) == 0.0;
  }
  c.set("zero_probs", zeros);
  return c;
}

std::vector<Case> bench_cases() {
  return {base(DType::bf16, 16384, 8, 2, 4096, 32768, 0, "mixtral_t16k"),
          base(DType::bf16, 16384, 256, 8, 7168, 131072, 128, "deepseek_v3_a128")
              .set("probs_dtype", "float32"),
          base(DType::bf16, 4096, 64, 8, 2048, 32768, 16, "e64_a16")};
}

}  // namespace

const OpInfo& token_dispatch_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info(kOp, "SPEC §4",
                {gen, named, make_inputs, run_reference, invariants, cost, to_params, from_params});
    o.bound = bound;
    o.compare = compare_fn;
    o.fd_masks = fd_masks;
    o.bench_cases = bench_cases;
#ifdef MOE_WITH_CUDA
    set_gpu(o, adjust_bench(
                   {token_dispatch_gpu, token_dispatch_gpu_bench, token_dispatch_gpu_bench_device,
                    dispatch_bench_verify_case, token_dispatch_gpu_bench_cases},
                   with_routed_bytes));
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
