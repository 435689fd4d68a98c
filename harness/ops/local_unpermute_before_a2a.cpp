// Registry record of local_unpermute_before_a2a (SPEC §9.4), per rank of P simulated ranks.
// Inputs: expert_outputs [P,R,H] (expert-major FFN outputs, tail included) and row_id_map [P,R]
// (the chunk-sort map of local_permute_after_a2a for a generated A). Output: out [P,R,H] with
// out[i] = expert_outputs[row_id_map[i]]. Backward: grad expert_outputs. Exact comparison.

#include "harness/core/params/ep.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/ep.h"
#include "reference/sort_chunks.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "local_unpermute_before_a2a";

Case base(const std::string& name, DType d, int64_t P, int64_t E, int64_t N, int64_t H, int64_t a) {
  return local_perm_case(kOp, 19, name, d, P, E, N, H, a);
}

std::vector<Case> named() {
  std::vector<Case> v;
  v.push_back(base("R3", DType::bf16, 2, 8, 32, 32, 16));
  v.push_back(base("R14_p4", DType::f32, 4, 8, 10, 3, 0));
  v.push_back(base("R14_p4_aligned", DType::f32, 4, 8, 10, 3, 4));
  v.push_back(base("zero_rows", DType::f32, 2, 2, 0, 2, 0).set("slack", int64_t{4}));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t P = c.i("num_ep"), E = c.i("E"), H = c.i("H"), R = local_perm_rows(c);
  const Tensor A = make_ep_counts(c, P, E, c.i("N"), c.i("align_size", 0), "counts");
  std::vector<Tensor> maps;
  for (int64_t s = 0; s < P; ++s) {
    const ref::LocalChunks ch = ref::local_chunks(A, s, P);
    maps.push_back(ref::make_chunk_sort_map(ch.split_sizes, ch.sorted_chunk_indices, R));
  }
  TensorMap m;
  m.emplace("input.expert_outputs", normal_tensor(c, c.dtype, {P, R, H}, "input.expert_outputs"));
  m.emplace("input.row_id_map", stack(maps));
  m.emplace("cotangent.out", normal_tensor(c, c.dtype, {P, R, H}, "cotangent.out"));
  return m;
}

TensorMap reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const int64_t P = c.i("num_ep");
  const auto y = unstack(in.at("input.expert_outputs"));
  const auto maps = unstack(in.at("input.row_id_map"));
  const auto ct = unstack(in.at("cotangent.out"));
  std::vector<Tensor> outs, grads;
  for (int64_t s = 0; s < P; ++s) {
    outs.push_back(ref::local_unpermute_before_a2a_fwd(y[s], maps[s], rnd));
    grads.push_back(ref::local_unpermute_before_a2a_bwd(ct[s], maps[s], rnd));
  }
  TensorMap out;
  out.emplace("output.out", stack(outs));
  out.emplace("grad.expert_outputs", stack(grads));
  return out;
}

// out[i] = y[map[i]] row by row; the forward local permute (a scatter with the same map) of out
// restores y; the backward is the scatter of the cotangent.
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const int64_t P = c.i("num_ep");
  const auto y = unstack(in.at("input.expert_outputs"));
  const auto maps = unstack(in.at("input.row_id_map"));
  const auto o = unstack(out.at("output.out"));
  const auto ct = unstack(in.at("cotangent.out"));
  const auto g = unstack(out.at("grad.expert_outputs"));
  for (int64_t s = 0; s < P; ++s) {
    const int64_t R = y[s].dim(0), H = y[s].dim(1);
    for (int64_t i = 0; i < R; ++i) {
      const auto j = static_cast<int64_t>(maps[s].at(i));
      for (int64_t h = 0; h < H; ++h) {
        if (o[s].at(i, h) != y[s].at(j, h) || g[s].at(j, h) != ct[s].at(i, h)) {
          bad.add("rank " + std::to_string(s) + " row " + std::to_string(i) +
                  ": not the gather/scatter through row_id_map");
          break;
        }
      }
    }
    if (!ref::sort_chunks_by_map(o[s], maps[s], false).bitwise_equal(y[s])) {
      bad.add("rank " + std::to_string(s) + ": the forward permute does not invert the unpermute");
    }
  }
  return bad.take();
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  const Tensor& y = in.at("input.expert_outputs");
  const int64_t P = j.at("num_ep").get<int64_t>();
  c.set("num_ep", P).set("E", P).set("N", int64_t{0}).set("H", y.dim(2));
  c.set("align_size", int64_t{0}).set("R", y.dim(1));
  return c;
}

}  // namespace

const OpInfo& local_unpermute_before_a2a_op() {
  static const OpInfo op = [] {
    OpInfo o = op_info(kOp, "SPEC §9.4",
                       {[] { return local_perm_gen(kOp); }, named, make_inputs, reference,
                        invariants, local_perm_cost, ep_params, from_params});
#ifdef MOE_WITH_CUDA
    o.gpu = local_unpermute_before_a2a_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
