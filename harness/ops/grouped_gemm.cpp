// Registry record of grouped_gemm (SPEC §10.1). Inputs: x [M_total,K_d], w [G,K_d,N],
// group_sizes [G] i32, bias [G,N] (optional). Output: out [M_total,N]. Backward: grad x, w, bias.
// Bounds: the SPEC §12 reduction rule per element with n = the contraction length and abs_sum =
// the same product computed on |x|, |w|, |bias| and |ct| (the reference run on absolute values).
#include <cmath>
#include <stdexcept>

#include "harness/core/params/ffn.h"
#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#ifdef MOE_WITH_CUDA
#include "harness/ops/bench_device.h"
#include "harness/ops/ffn_family_gpu.h"
#endif
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/grouped_gemm.h"

namespace moe::ops {

namespace {

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case("grouped_gemm", kSizeRegimes);
    const int64_t M = draw_no_rows(c) ? 0 : *any_in(1, 24);
    c.set("G", *any_in(1, 6)).set("M_total", M);
    c.set("K_d", *any_in(1, 9)).set("N", *any_in(1, 9));
    c.set("tail", M == 0 ? int64_t{0} : *any_in(0, M + 1) / 2);
    c.set("bias", *rc::gen::arbitrary<bool>());
    return c;
  });
}

CaseBuilder base(const std::string& name, DType d, int64_t G, int64_t M, int64_t K, int64_t N,
                 int64_t tail, bool bias) {
  CaseBuilder b("grouped_gemm", d);
  b.seed(23).name(name).set("G", G).set("M_total", M).set("K_d", K).set("N", N);
  return b.set("tail", tail).set("bias", bias);
}

std::vector<Case> named() {
  std::vector<Case> v;
  v.push_back(
      base("empty_groups", DType::bf16, 8, 40, 16, 24, 5, true).regime(Regime::zero_tokens));
  v.push_back(base("all_to_one", DType::f32, 4, 33, 8, 8, 0, false).regime(Regime::all_to_one));
  v.push_back(base("zero_rows", DType::f32, 3, 0, 4, 5, 0, true));
  v.push_back(base("odd_f16", DType::f16, 7, 257, 13, 9, 17, true));
  v.push_back(base("mixtral_like", DType::bf16, 8, 512, 64, 128, 0, false));
  // Equal groups, the first three one row longer (93 = 6 * 15 + 3): the bench's even cases, cut
  // down.
  v.push_back(base("even_groups", DType::bf16, 6, 100, 24, 40, 7, true).set("even_groups", true));
  return v;
}

std::vector<int64_t> sizes_of(const Case& c) {
  return make_group_sizes(c, c.i("G"), c.i("M_total") - c.i("tail", 0), "input.group_sizes");
}

// values=small_int: integers in [-4, 4], so every fp32 sum of products is exact and a CUDA result
// must equal the reference bitwise (the CUTLASS testbed idea). Default: values=normal.
Tensor value_tensor(const Case& c, const Shape& s, const std::string& name) {
  const std::string v = c.s("values", "normal");
  if (v == "normal") return normal_tensor(c, c.dtype, s, name);
  if (v != "small_int") {
    throw std::invalid_argument("values: unknown value '" + v + "' (expected normal or small_int)");
  }
  Tensor t(c.dtype, s);
  Rng rng(c.seed, name);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<double>(rng.below(9) - 4));
  return t;
}

TensorMap make_inputs(const Case& c) {
  const int64_t G = c.i("G"), M = c.i("M_total"), K = c.i("K_d"), N = c.i("N");
  TensorMap m;
  m.emplace("input.x", value_tensor(c, {M, K}, "input.x"));
  m.emplace("input.w", value_tensor(c, {G, K, N}, "input.w"));
  const auto sizes = sizes_of(c);
  Tensor gs(DType::i32, {G});
  for (int64_t g = 0; g < G; ++g) gs.set(g, static_cast<double>(sizes[g]));
  m.emplace("input.group_sizes", std::move(gs));
  if (c.b("bias", false)) m.emplace("input.bias", value_tensor(c, {G, N}, "input.bias"));
  m.emplace("cotangent.out", value_tensor(c, {M, N}, "cotangent.out"));
  return m;
}

TensorMap reference(const Case& /*c*/, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const Tensor& x = in.at("input.x");
  const Tensor& w = in.at("input.w");
  const Tensor& gs = in.at("input.group_sizes");
  const Tensor* bias = find_tensor(in, "input.bias");
  TensorMap out;
  out.emplace("output.out", ref::grouped_gemm_fwd(x, w, gs, bias, rnd));
  ref::GroupedGemmBwd g = ref::grouped_gemm_bwd(in.at("cotangent.out"), x, w, gs, bias, rnd);
  out.emplace("grad.x", std::move(g.grad_x));
  out.emplace("grad.w", std::move(g.grad_w));
  if (g.grad_bias) out.emplace("grad.bias", std::move(*g.grad_bias));
  return out;
}

// Per-element reduction length of grad.w / grad.bias: the rows of the element's group.
Tensor group_rows(const Tensor& gs, const Shape& shape) {
  Tensor n(DType::f64, shape);
  const int64_t per = n.numel() / std::max<int64_t>(1, shape[0]);
  for (int64_t i = 0; i < n.numel(); ++i) n.set(i, gs.at(i / std::max<int64_t>(1, per)));
  return n;
}

Tensor bound(const Case& /*c*/, const std::string& key, const TensorMap& in,
             const TensorMap& want) {
  const Tensor& ref = want.at(key);
  const Tensor& gs = in.at("input.group_sizes");
  const Tensor ax = abs_f64(in.at("input.x")), aw = abs_f64(in.at("input.w"));
  const Tensor* bias = find_tensor(in, "input.bias");
  const Tensor ab = bias ? abs_f64(*bias) : Tensor();
  const Tensor* abp = bias ? &ab : nullptr;
  if (key == "output.out") {
    const Tensor s = ref::grouped_gemm_fwd(ax, aw, gs, abp, ref::Rounding::none);
    return reduction_bound(ref.dtype(), ref, s, ax.dim(1) + (bias ? 1 : 0));
  }
  const ref::GroupedGemmBwd s =
      ref::grouped_gemm_bwd(abs_f64(in.at("cotangent.out")), ax, aw, gs, abp, ref::Rounding::none);
  if (key == "grad.x") return reduction_bound(ref.dtype(), ref, s.grad_x, aw.dim(2));
  const Tensor n = group_rows(gs, ref.shape());
  if (key == "grad.w") return reduction_bound(ref.dtype(), ref, s.grad_w, 0, &n);
  return reduction_bound(ref.dtype(), ref, *s.grad_bias, 0, &n);
}

// Tail rows are exactly 0 in out and grad x, empty groups give exactly 0 in grad w and grad bias
// (SPEC §10.1 [DECISION]), and every grouped output row matches a plain triple loop within one
// ulp of d (a second oracle that shares no code with the Eigen product).
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const Tensor& x = in.at("input.x");
  const Tensor& w = in.at("input.w");
  const Tensor* bias = find_tensor(in, "input.bias");
  const auto sizes = int_values(in.at("input.group_sizes"));
  const Tensor& y = out.at("output.out");
  const Tensor& gx = out.at("grad.x");
  const Tensor& gw = out.at("grad.w");
  const int64_t K = x.dim(1), N = w.dim(2);
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t r = row; r < row + sizes[g]; ++r) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = bias ? bias->at(static_cast<int64_t>(g), n) : 0.0;
        for (int64_t k = 0; k < K; ++k)
          acc += x.at(r, k) * w.at((static_cast<int64_t>(g) * K + k) * N + n);
        if (std::fabs(y.at(r, n) - acc) > ulp(c.dtype, acc)) {
          bad.add("out(" + std::to_string(r) + ", " + std::to_string(n) +
                  ") = " + format_double(y.at(r, n)) + ", triple loop gives " + format_double(acc));
        }
      }
    }
    if (sizes[g] == 0) {
      for (int64_t i = 0; i < K * N; ++i) {
        if (gw.at(static_cast<int64_t>(g) * K * N + i) != 0.0) {
          bad.add("grad w of empty group " + std::to_string(g) + " is not exactly 0");
          break;
        }
      }
      if (const Tensor* gb = find_tensor(out, "grad.bias")) {
        for (int64_t n = 0; n < N; ++n)
          if (gb->at(static_cast<int64_t>(g), n) != 0.0) bad.add("grad bias of empty group != 0");
      }
    }
    row += sizes[g];
  }
  for (int64_t r = row; r < x.dim(0); ++r) {
    for (int64_t n = 0; n < N; ++n)
      if (y.at(r, n) != 0.0) bad.add("tail row " + std::to_string(r) + " of out is not 0");
    for (int64_t k = 0; k < K; ++k)
      if (gx.at(r, k) != 0.0) bad.add("tail row " + std::to_string(r) + " of grad x is not 0");
  }
  return bad.take();
}

Case from_params(const nlohmann::json&, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder("grouped_gemm", d).seed(seed);
  const Tensor& x = in.at("input.x");
  const Tensor& w = in.at("input.w");
  int64_t used = 0;
  const Tensor& gs = in.at("input.group_sizes");
  for (int64_t g = 0; g < gs.numel(); ++g) used += static_cast<int64_t>(gs.at(g));
  c.set("G", w.dim(0)).set("M_total", x.dim(0)).set("K_d", x.dim(1)).set("N", w.dim(2));
  c.set("tail", x.dim(0) - used).set("bias", in.count("input.bias") != 0);
  return c;
}

Cost cost(const Case& c) {
  const double G = static_cast<double>(c.i("G")), M = static_cast<double>(c.i("M_total"));
  const double K = static_cast<double>(c.i("K_d")), N = static_cast<double>(c.i("N"));
  const double e = static_cast<double>(dtype_size(c.dtype));
  const double V = M - static_cast<double>(c.i("tail", 0));
  Cost k;
  k.fwd_bytes = (M * K + G * K * N + M * N) * e + G * 4;
  k.bwd_bytes = 2 * (M * K + G * K * N + M * N) * e + G * 4;
  k.fwd_flops = 2 * V * K * N;
  k.bwd_flops = 4 * V * K * N;
  return k;
}

std::vector<Case> bench_cases() {
  std::vector<Case> v;
  v.push_back(base("g8_m8192_k2048_n2048", DType::bf16, 8, 8192, 2048, 2048, 0, false));
  v.push_back(base("g32_m8192_k2048_n1024", DType::bf16, 32, 8192, 2048, 1024, 0, false));
  return v;
}

}  // namespace

const OpInfo& grouped_gemm_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info("grouped_gemm", "SPEC §10.1",
                {gen, named, make_inputs, reference, invariants, cost, no_params, from_params});
    o.bound = bound;
    o.bench_cases = bench_cases;
#ifdef MOE_WITH_CUDA
    // `moe-harness bench` runs the full shapes with device-generated inputs.
    set_gpu(o, {grouped_gemm_gpu, grouped_gemm_gpu_bench, grouped_gemm_gpu_bench_device,
                grouped_gemm_bench_verify_case, grouped_gemm_full_bench_cases});
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
