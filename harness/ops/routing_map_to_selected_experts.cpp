// Registry record of routing_map_to_selected_experts (SPEC §8.1): the argsort backend's
// conversion of a routing map with exactly K set entries per row into expert ids and weights.
//
// Case keys: T, E, topk. sparse_probs are in the case dtype (the probs dtype p).
#include <cmath>

#include "harness/ops/check.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/argsort.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "routing_map_to_selected_experts";

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case(kOp, kRoutingRegimes);
    const int64_t E = *rc::gen::element<int64_t>(1, 2, 3, 4, 5, 7, 8, 16, 33);
    c.set("T", draw_tokens(draw_no_rows(c)));
    c.set("E", E).set("topk", *rc::gen::inRange<int64_t>(1, E + 1));
    return c;
  });
}

CaseBuilder base(DType d, int64_t T, int64_t E, int64_t K, const std::string& name) {
  return CaseBuilder(kOp, d).seed(23).name(name).set("T", T).set("E", E).set("topk", K);
}

std::vector<Case> named() {
  std::vector<Case> v;
  v.push_back(base(DType::f32, 64, 8, 2, "mixtral"));
  v.push_back(base(DType::bf16, 32, 256, 8, "deepseek_v3"));
  v.push_back(base(DType::f32, 8, 7, 7, "k_equals_e"));
  v.push_back(base(DType::f32, 0, 8, 2, "zero_tokens").regime(Regime::zero_tokens));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), K = c.i("topk");
  const auto routes = make_routes(c, T, E, K, false, "input.routing_map");
  Tensor map = routes_to_map(routes, E);
  // Router-like sparse probs: non-zero exactly on the routed entries.
  Tensor probs = uniform_tensor(c, c.dtype, {T, E}, 0.05, 1.0, "input.sparse_probs");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      if (map.at(t, e) == 0) probs.set(t, e, 0.0);
  TensorMap m;
  m.emplace("input.sparse_probs", std::move(probs));
  m.emplace("input.routing_map", std::move(map));
  m.emplace("cotangent.weights", normal_tensor(c, c.dtype, {T, K}, "cotangent.weights"));
  return m;
}

TensorMap run_reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Tensor& probs = in.at("input.sparse_probs");
  ref::RoutingMapToSelectedExpertsFwd f =
      ref::routing_map_to_selected_experts_fwd(probs, in.at("input.routing_map"), c.i("topk"), rnd);
  TensorMap out;
  if (const Tensor* ct = find_tensor(in, "cotangent.weights")) {
    out.emplace("grad.sparse_probs", ref::routing_map_to_selected_experts_bwd(
                                         *ct, f.selected_experts, probs.dim(1), rnd));
  }
  out.emplace("output.selected_experts", std::move(f.selected_experts));
  out.emplace("output.weights", std::move(f.weights));
  return out;
}

Report compare_fn(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  return compare_perm(*find_op(kOp), c, in, want, got, {});  // gathers and scatters: bitwise
}

std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const Tensor& probs = in.at("input.sparse_probs");
  const Tensor& map = in.at("input.routing_map");
  const Tensor& sel = out.at("output.selected_experts");
  const Tensor& w = out.at("output.weights");
  const int64_t T = probs.dim(0), E = probs.dim(1), K = c.i("topk");
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const auto e = static_cast<int64_t>(sel.at(t, k));
      if (e < 0 || e >= E || map.at(t, e) == 0) {
        bad.add("selected_experts[" + std::to_string(t) + ", " + std::to_string(k) +
                "] = " + std::to_string(e) + " is not a routed expert");
        continue;
      }
      if (k > 0 && sel.at(t, k - 1) >= sel.at(t, k)) {
        bad.add("selected_experts row " + std::to_string(t) + " is not strictly ascending");
      }
      const double a = w.at(t, k), b = probs.at(t, e);
      if (a != b || std::signbit(a) != std::signbit(b)) {
        bad.add("weights[" + std::to_string(t) + ", " + std::to_string(k) +
                "] is not sparse_probs at the selected expert");
      }
    }
  }
  if (const Tensor* g = find_tensor(out, "grad.sparse_probs")) {
    const Tensor& ct = in.at("cotangent.weights");
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k)
          if (static_cast<int64_t>(sel.at(t, k)) == e) want = ct.at(t, k);
        if (g->at(t, e) != want) {
          bad.add("grad.sparse_probs[" + std::to_string(t) + ", " + std::to_string(e) +
                  "] is not the scattered cotangent");
        }
      }
    }
  }
  return bad.take();
}

Cost cost(const Case& c) {
  const double T = static_cast<double>(c.i("T")), E = static_cast<double>(c.i("E"));
  const double K = static_cast<double>(c.i("topk"));
  const double p = static_cast<double>(dtype_size(c.dtype));
  // Forward reads the map (and the K selected probs), writes ids and weights; backward reads the
  // ids and cotangent and writes the dense [T,E] gradient.
  return Cost{T * E + T * K * p + T * K * (4 + p), T * K * (4 + p) + T * E * p, 0, 0};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  const Tensor& probs = in.at("input.sparse_probs");
  c.set("T", probs.dim(0)).set("E", probs.dim(1)).set("topk", j.at("topk").get<int64_t>());
  return c;
}

}  // namespace

const OpInfo& routing_map_to_selected_experts_op() {
  static const OpInfo op = [] {
    OpInfo o = op_info(kOp, "SPEC §8.1",
                       {gen, named, make_inputs, run_reference, invariants, cost,
                        [](const Case& c) { return int_params(c, {"topk"}); }, from_params});
    o.bound = exact_bound;
    o.compare = compare_fn;
    o.bench_cases = [] {
      return std::vector<Case>{base(DType::f32, 65536, 256, 8, "deepseek_v3_t64k")};
    };
#ifdef MOE_WITH_CUDA
    o.gpu = routing_map_to_selected_experts_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
