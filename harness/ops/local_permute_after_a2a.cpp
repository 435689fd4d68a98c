// Registry record of local_permute_after_a2a (SPEC §9.4), per rank of P simulated ranks.
// Inputs: x_recv [P,R,H] (the source-major receive buffers, tail rows included) and
// A = all_shards_tokens_per_expert [P,E]. Outputs: sorted_x [P,R,H], local_group_sizes [P,L],
// row_id_map [P,R]. Backward: grad x_recv [P,R,H]. Pure data movement: exact comparison.
#include "harness/core/params/ep.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/ep.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "local_permute_after_a2a";

Case base(const std::string& name, DType d, int64_t P, int64_t E, int64_t N, int64_t H, int64_t a) {
  return local_perm_case(kOp, 17, name, d, P, E, N, H, a);
}

std::vector<Case> named() {
  std::vector<Case> v;
  v.push_back(base("R3", DType::bf16, 2, 8, 32, 32, 16));
  v.push_back(base("R14_p4", DType::f32, 4, 8, 10, 3, 0));
  v.push_back(base("R14_p4_aligned", DType::f32, 4, 8, 10, 3, 4));
  v.push_back(base("p1", DType::f16, 1, 3, 7, 2, 0));
  v.push_back(base("zero_rows", DType::f32, 4, 8, 0, 2, 0).set("slack", int64_t{3}));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t P = c.i("num_ep"), E = c.i("E"), H = c.i("H"), R = local_perm_rows(c);
  TensorMap m;
  // Every row random, the tail included, so the identity on the tail is visible.
  m.emplace("input.x_recv", normal_tensor(c, c.dtype, {P, R, H}, "input.x_recv"));
  m.emplace("input.all_shards_tokens_per_expert",
            make_ep_counts(c, P, E, c.i("N"), c.i("align_size", 0),
                           "input.all_shards_tokens_per_expert"));
  m.emplace("cotangent.sorted_x", normal_tensor(c, c.dtype, {P, R, H}, "cotangent.sorted_x"));
  return m;
}

TensorMap reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const int64_t P = c.i("num_ep");
  const Tensor& A = in.at("input.all_shards_tokens_per_expert");
  const auto x = unstack(in.at("input.x_recv"));
  const auto ct = unstack(in.at("cotangent.sorted_x"));
  std::vector<Tensor> sorted, sizes, maps, grads;
  for (int64_t s = 0; s < P; ++s) {
    ref::LocalPermuteFwd f = ref::local_permute_after_a2a_fwd(x[s], A, s, P, rnd);
    grads.push_back(ref::local_permute_after_a2a_bwd(ct[s], f.row_id_map, rnd));
    sorted.push_back(std::move(f.sorted_x));
    sizes.push_back(std::move(f.local_group_sizes));
    maps.push_back(std::move(f.row_id_map));
  }
  TensorMap out;
  out.emplace("output.sorted_x", stack(sorted));
  out.emplace("output.local_group_sizes", stack(sizes));
  out.emplace("output.row_id_map", stack(maps));
  out.emplace("grad.x_recv", stack(grads));
  return out;
}

// §9.4 by independent index math: the chunk (source i, local expert l) of A[i, sL+l] rows moves
// from sum_{i'<i, any l'} + sum_{l'<l} (source-major) to sum_{l'<l, any i'} + sum_{i'<i}
// (expert-major); the tail is fixed; local_group_sizes are the column sums; the local unpermute
// with the same map restores x_recv on every row.
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const int64_t P = c.i("num_ep");
  const Tensor& A = in.at("input.all_shards_tokens_per_expert");
  const int64_t L = A.dim(1) / P;
  const auto x = unstack(in.at("input.x_recv"));
  const auto sorted = unstack(out.at("output.sorted_x"));
  const auto maps = unstack(out.at("output.row_id_map"));
  const Tensor& lgs = out.at("output.local_group_sizes");
  for (int64_t s = 0; s < P; ++s) {
    auto cnt = [&](int64_t i, int64_t l) { return static_cast<int64_t>(A.at(i, s * L + l)); };
    int64_t src = 0, total = 0;
    std::vector<int64_t> expert_start(L + 1, 0);
    for (int64_t l = 0; l < L; ++l) {
      int64_t col = 0;
      for (int64_t i = 0; i < P; ++i) col += cnt(i, l);
      if (lgs.at(s, l) != col) bad.add("rank " + std::to_string(s) + ": local_group_sizes wrong");
      expert_start[l + 1] = expert_start[l] + col;
      total += col;
    }
    for (int64_t i = 0; i < P; ++i) {
      for (int64_t l = 0; l < L; ++l) {
        int64_t dst = expert_start[l];
        for (int64_t i2 = 0; i2 < i; ++i2) dst += cnt(i2, l);
        for (int64_t o = 0; o < cnt(i, l); ++o) {
          if (maps[s].at(src + o) != dst + o) {
            bad.add("rank " + std::to_string(s) + ": row " + std::to_string(src + o) + " maps to " +
                    format_double(maps[s].at(src + o)) + ", expected " + std::to_string(dst + o));
          }
        }
        src += cnt(i, l);
      }
    }
    for (int64_t i = total; i < x[s].dim(0); ++i) {
      if (maps[s].at(i) != i) bad.add("rank " + std::to_string(s) + ": tail row not fixed");
    }
    if (!ref::local_unpermute_before_a2a_fwd(sorted[s], maps[s]).bitwise_equal(x[s])) {
      bad.add("rank " + std::to_string(s) + ": local unpermute does not restore x_recv");
    }
  }
  return bad.take();
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  const Tensor& x = in.at("input.x_recv");
  c.set("num_ep", j.at("num_ep").get<int64_t>());
  c.set("E", in.at("input.all_shards_tokens_per_expert").dim(1));
  c.set("N", int64_t{0}).set("H", x.dim(2)).set("align_size", int64_t{0}).set("R", x.dim(1));
  return c;
}

}  // namespace

const OpInfo& local_permute_after_a2a_op() {
  static const OpInfo op = [] {
    OpInfo o = op_info(kOp, "SPEC §9.4",
                       {[] { return local_perm_gen(kOp); }, named, make_inputs, reference,
                        invariants, local_perm_cost, ep_params, from_params});
#ifdef MOE_WITH_CUDA
    o.gpu = local_permute_after_a2a_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
