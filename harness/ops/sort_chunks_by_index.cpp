// Registry record of sort_chunks_by_index (SPEC §7), the chunk sort of the EP local permute.
//
// Case keys: N_rows, H, split_sizes and sorted_indices (comma lists, so a replay line carries the
// exact chunking), split_dtype (int32/int64), probs_dtype (none = no probs), x_fill (normal, or
// row_index: x[i,:] = i + 1 as in R1).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/sort_chunks.h"

namespace moe::ops {

namespace {

constexpr const char* kOp = "sort_chunks_by_index";

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case(kOp, {Regime::uniform, Regime::zero_tokens});
    const int64_t C = *rc::gen::inRange<int64_t>(1, 9);
    std::vector<int64_t> split(C);
    for (auto& s : split) {
      s = c.regime == Regime::zero_tokens ? 0 : *rc::gen::element<int64_t>(0, 0, 1, 2, 3, 5, 8);
    }
    std::vector<int64_t> order(C);
    std::iota(order.begin(), order.end(), int64_t{0});
    // A random permutation by swaps (shrinks towards the identity).
    for (int64_t i = C - 1; i > 0; --i) {
      std::swap(order[i], order[*rc::gen::inRange<int64_t>(0, i + 1)]);
    }
    const int64_t V = std::accumulate(split.begin(), split.end(), int64_t{0});
    c.set("N_rows", V + *rc::gen::element<int64_t>(0, 0, 1, 4));  // V = N_rows or padding rows
    c.set("H", *rc::gen::element<int64_t>(1, 2, 3, 8, 257));
    c.set("split_sizes", int_list(split)).set("sorted_indices", int_list(order));
    c.set("split_dtype", *rc::gen::element<std::string>("int32", "int64"));
    c.set("probs_dtype", *rc::gen::element<std::string>("none", "float32", "bfloat16", "float16"));
    c.set("x_fill", "normal");
    return c;
  });
}

CaseBuilder base(DType d, int64_t N, int64_t H, const std::string& split, const std::string& order,
                 const std::string& name) {
  CaseBuilder b(kOp, d);
  b.seed(19).name(name).set("N_rows", N).set("H", H).set("split_sizes", split);
  b.set("sorted_indices", order).set("split_dtype", "int32").set("probs_dtype", "none");
  return b.set("x_fill", "normal");
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R1: 100 rows, V = 60; rows 60..99 are padding and must stay in place.
  for (DType d : {DType::f32, DType::bf16}) {
    const std::string dn(dtype_name(d));
    v.push_back(base(d, 100, 8, "7,0,20,33", "2,0,3,1", "R1_" + dn).set("x_fill", "row_index"));
    v.push_back(
        base(d, 100, 8, "0,0,0,0", "2,0,3,1", "R1_" + dn + "_V0").set("x_fill", "row_index"));
    v.push_back(
        base(d, 60, 8, "7,0,20,33", "2,0,3,1", "R1_" + dn + "_V_eq_N").set("x_fill", "row_index"));
  }
  // EP local permute shape: P = 2 sources x L = 4 local experts, source-major to expert-major.
  v.push_back(base(DType::bf16, 96, 32, "5,0,7,9,3,12,0,4", "0,4,1,5,2,6,3,7", "ep_local_permute")
                  .set("probs_dtype", "float32"));
  v.push_back(base(DType::f32, 16, 257, "16", "0", "single_chunk"));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t N = c.i("N_rows"), H = c.i("H");
  const auto split = parse_int_list(c.s("split_sizes"), "split_sizes");
  const auto order = parse_int_list(c.s("sorted_indices"), "sorted_indices");
  TensorMap m;
  Tensor x(c.dtype, {N, H});
  if (c.s("x_fill", "normal") == "row_index") {
    for (int64_t i = 0; i < N; ++i)
      for (int64_t h = 0; h < H; ++h) x.set(i, h, static_cast<double>(i + 1));
  } else {
    x = normal_tensor(c, c.dtype, {N, H}, "input.x");
  }
  m.emplace("input.x", std::move(x));
  const DType sd = parse_dtype(c.s("split_dtype", "int32"));
  Tensor st(sd, {static_cast<int64_t>(split.size())});
  for (size_t i = 0; i < split.size(); ++i)
    st.set(static_cast<int64_t>(i), static_cast<double>(split[i]));
  m.emplace("input.split_sizes", std::move(st));
  Tensor ot(DType::i32, {static_cast<int64_t>(order.size())});
  for (size_t i = 0; i < order.size(); ++i)
    ot.set(static_cast<int64_t>(i), static_cast<double>(order[i]));
  m.emplace("input.sorted_indices", std::move(ot));
  m.emplace("cotangent.sorted", normal_tensor(c, c.dtype, {N, H}, "cotangent.sorted"));
  if (const auto pd = opt_dtype(c, "probs_dtype")) {
    m.emplace("input.probs", uniform_tensor(c, *pd, {N}, 0.0, 1.0, "input.probs"));
    m.emplace("cotangent.sorted_probs", normal_tensor(c, *pd, {N}, "cotangent.sorted_probs"));
  }
  return m;
}

TensorMap run_reference(const Case&, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  ref::SortChunksFwd f = ref::sort_chunks_by_index_fwd(in.at("input.x"), in.at("input.split_sizes"),
                                                       in.at("input.sorted_indices"),
                                                       find_tensor(in, "input.probs"), rnd);
  TensorMap out;
  if (const Tensor* ct = find_tensor(in, "cotangent.sorted")) {
    ref::SortChunksBwd b = ref::sort_chunks_by_index_bwd(
        *ct, find_tensor(in, "cotangent.sorted_probs"), f.row_id_map, rnd);
    out.emplace("grad.x", std::move(b.grad_x));
    if (b.grad_probs) out.emplace("grad.probs", std::move(*b.grad_probs));
  }
  out.emplace("output.sorted", std::move(f.sorted));
  out.emplace("output.row_id_map", std::move(f.row_id_map));
  if (f.sorted_probs) out.emplace("output.sorted_probs", std::move(*f.sorted_probs));
  return out;
}

Report compare_fn(const Case& c, const TensorMap& in, const TensorMap& want, const TensorMap& got) {
  return compare_perm(*find_op(kOp), c, in, want, got, {});  // pure data movement: all bitwise
}

// SPEC §12 sort_chunks invariants, §7's definition of dst checked directly, and the R14 two-map
// form (TE's public local unpermute) against the one-map inverse.
std::vector<std::string> invariants(const Case&, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const Tensor& x = in.at("input.x");
  const Tensor& split_t = in.at("input.split_sizes");
  const Tensor& order_t = in.at("input.sorted_indices");
  const Tensor& sorted = out.at("output.sorted");
  const Tensor& map = out.at("output.row_id_map");
  const int64_t N = x.dim(0), C = split_t.numel();
  std::vector<int64_t> split(C), order(C), pos(C), start(C), out_start(C);
  int64_t V = 0;
  for (int64_t c = 0; c < C; ++c) {
    split[c] = static_cast<int64_t>(split_t.at(c));
    order[c] = static_cast<int64_t>(order_t.at(c));
    start[c] = V;
    V += split[c];
  }
  for (int64_t j = 0, acc = 0; j < C; ++j) {
    out_start[order[j]] = acc;
    acc += split[order[j]];
  }
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t o = 0; o < split[c]; ++o) {
      const int64_t i = start[c] + o;
      if (static_cast<int64_t>(map.at(i)) != out_start[c] + o) {
        bad.add("row_id_map[" + std::to_string(i) + "] = " + format_double(map.at(i)) +
                ", expected " + std::to_string(out_start[c] + o));
      }
    }
  }
  for (int64_t i = V; i < N; ++i) {
    if (static_cast<int64_t>(map.at(i)) != i) {
      bad.add("padding row " + std::to_string(i) +
              " is not a fixed point (R1): row_id_map = " + format_double(map.at(i)));
    }
  }
  const auto vals_equal = [](const Tensor& a, const Tensor& b) { return a.bitwise_equal(b); };
  // sorted[dst(i)] = x[i]: scattering x must reproduce `sorted` bit for bit, and the inverse
  // gather must give x back (map then inverse is the identity, padding rows included).
  if (!vals_equal(ref::sort_chunks_by_map(x, map, false), sorted)) {
    bad.add("sorted is not the scatter of x through row_id_map");
  }
  if (!vals_equal(ref::sort_chunks_by_map(sorted, map, true), x)) {
    bad.add("the inverse (sort_chunks_by_map inverse=true) of sorted is not x");
  }
  // R14: TE's second map from (split[sorted_indices], argsort(sorted_indices)) is the inverse.
  Tensor split2(DType::i64, {C}), order2(DType::i64, {C});
  for (int64_t j = 0; j < C; ++j) {
    split2.set(j, static_cast<double>(split[order[j]]));
    order2.set(order[j], static_cast<double>(j));
  }
  const Tensor map2 = ref::make_chunk_sort_map(split2, order2, N);
  for (int64_t i = 0; i < N; ++i) {
    if (static_cast<int64_t>(map2.at(static_cast<int64_t>(map.at(i)))) != i) {
      bad.add("R14: the two-map form's map2[map1[" + std::to_string(i) +
              "]] != " + std::to_string(i));
      break;
    }
  }
  if (!vals_equal(ref::sort_chunks_by_map(sorted, map2, false), x)) {
    bad.add("R14: scattering sorted with the two-map form's map does not give x");
  }
  bool identity = V == N;
  for (int64_t c = 0; c < C; ++c) identity = identity && order[c] == c;
  if (identity && !vals_equal(sorted, x))
    bad.add("V = N_rows with identity order is not the identity");
  return bad.take();
}

Cost cost(const Case& c) {
  const double N = static_cast<double>(c.i("N_rows")), H = static_cast<double>(c.i("H"));
  const double d = static_cast<double>(dtype_size(c.dtype));
  const auto pd = opt_dtype(c, "probs_dtype");
  const double p = pd ? static_cast<double>(dtype_size(*pd)) : 0.0;
  const double C = static_cast<double>(parse_int_list(c.s("split_sizes"), "split_sizes").size());
  Cost k;
  k.fwd_bytes = 2 * N * (H * d + p) + N * 4 + C * 8;  // rows in and out, the map out
  k.bwd_bytes = 2 * N * (H * d + p) + N * 4;
  return k;
}

Case from_params(const nlohmann::json&, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder(kOp, d).seed(seed);
  const Tensor& x = in.at("input.x");
  const Tensor& st = in.at("input.split_sizes");
  const Tensor& ot = in.at("input.sorted_indices");
  std::vector<int64_t> split, order;
  for (int64_t i = 0; i < st.numel(); ++i) split.push_back(static_cast<int64_t>(st.at(i)));
  for (int64_t i = 0; i < ot.numel(); ++i) order.push_back(static_cast<int64_t>(ot.at(i)));
  c.set("N_rows", x.dim(0)).set("H", x.dim(1)).set("split_sizes", int_list(split));
  c.set("sorted_indices", int_list(order)).set("split_dtype", std::string(dtype_name(st.dtype())));
  const Tensor* probs = find_tensor(in, "input.probs");
  c.set("probs_dtype", probs ? std::string(dtype_name(probs->dtype())) : std::string("none"));
  c.set("x_fill", "normal");
  return c;
}

std::vector<Case> bench_cases() {
  // EP local permute after the A2A: P = 8 sources x L = 32 local experts, 64 rows each.
  std::vector<int64_t> split(256, 64), order(256);
  for (int64_t l = 0; l < 32; ++l)
    for (int64_t i = 0; i < 8; ++i) order[l * 8 + i] = i * 32 + l;
  return {base(DType::bf16, 16384 + 4096, 7168, int_list(split), int_list(order), "ep8_l32")};
}

}  // namespace

const OpInfo& sort_chunks_by_index_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info(kOp, "SPEC §7",
                {gen, named, make_inputs, run_reference, invariants, cost, no_params, from_params});
    o.bound = exact_bound;
    o.compare = compare_fn;
    o.bench_cases = bench_cases;
#ifdef MOE_WITH_CUDA
    set_gpu(o, {sort_chunks_by_index_gpu, sort_chunks_by_index_gpu_bench,
                sort_chunks_by_index_gpu_bench_device, sort_chunks_bench_verify_case,
                sort_chunks_by_index_gpu_bench_cases});
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
