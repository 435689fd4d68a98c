// CUDA twins of grouped_gemm and swiglu_expert_ffn (SPEC §10) against the CPU reference, for
// every way of issuing the per-group cuBLAS products (GemmImpl: grouped, loop, streams):
//   - random cases of each record's generator and its named cases, through check_gpu (SPEC §12
//     bound per element, outputs poisoned before each launch, two runs bitwise equal). The FFN
//     is judged by each stage's §12 rule propagated through the stages (ffn_chain::ffn_bound):
//     its stages are stored rounded, so a stage whose input rounded one ulp apart from the
//     reference's differs by more than its own rule allows; the record's bound() applies each
//     rule alone, and a CPU emulation of any fp32 implementation fails it (18 of 314 cases);
//   - grouped GEMM with small-integer inputs (values=small_int): every sum is exact in fp32, so
//     the results must equal the reference exactly (the CUTLASS testbed idea);
//   - zero-token experts, an all-empty batch, zero rows and tail rows: tail rows and empty
//     groups' gradients exactly 0 (SPEC §10.1 [DECISION]), nothing left of the poison;
//   - larger shapes (cuBLAS may split K there): two runs bitwise equal;
//   - host errors and group-size errors name the parameter.
// GemmBench (MOE_GEMM_BENCH=1) runs the full-size shapes with inputs generated on the
// device: it checks sampled elements against fp64 sums, then prints TFLOP/s of each GemmImpl next
// to one dense cuBLAS GEMM of equal FLOPs measured in the same run (JSON to MOE_BENCH_JSON).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "harness/core/params/ffn.h"
#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/registry.h"
#include "reference/grouped_gemm.h"
#include "reference/swiglu_ffn.h"

#ifdef MOE_WITH_CUDA
#include "gpu/grouped_gemm.cuh"
#include "gpu/swiglu_ffn.cuh"
#endif

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

#define MOE_SKIP_WITHOUT_GPU()                                          \
  do {                                                                  \
    if (!::moe::ops::gpu_available())                                   \
      GTEST_SKIP() << "no CUDA GPU: " << ::moe::ops::gpu_description(); \
  } while (0)

// SPEC §12 rule of each FFN stage, propagated through the stages (first order in the stage
// errors): a stage whose inputs are themselves rounded stage values may differ from the
// reference by its own rounding bound plus the sensitivity of the stage to its inputs times their
// bounds. The record's bound() applies each stage's own rule alone, which no fp32 implementation
// meets once an upstream stage rounds differently.
namespace {
namespace ffn_chain {

using ref::Rounding;

double act_v(bool silu, double x) {
  return silu ? x / (1.0 + std::exp(-x)) : x;
}
double act_d(bool silu, double x) {
  if (!silu) return 1.0;
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s * (1.0 + x * (1.0 - s));
}
constexpr double kSiluCurvature = 0.5;  // max |silu''|, at 0

Tensor elementwise(DType d, const Tensor& ref) {
  return make_bound(TolClass::elementwise, d, ref, 1);
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor o(DType::f64, a.shape());
  for (int64_t i = 0; i < o.numel(); ++i) o.set(i, a.at(i) + b.at(i));
  return o;
}

const Tensor* opt_abs(const TensorMap& in, const std::string& key, Tensor& store) {
  const Tensor* t = find_tensor(in, key);
  if (!t) return nullptr;
  store = abs_f64(*t);
  return &store;
}

Tensor per_group_rows(const Tensor& gs, const Shape& shape) {
  Tensor n(DType::f64, shape);
  const int64_t per = shape[0] > 0 ? n.numel() / shape[0] : 1;
  for (int64_t i = 0; i < n.numel(); ++i) n.set(i, gs.at(i / std::max<int64_t>(1, per)));
  return n;
}

Tensor ffn_bound(const Case& c, const std::string& key, const TensorMap& in,
                 const TensorMap& want) {
  const DType d = want.at(key).dtype();
  const bool silu = c.s("activation", "silu") == "silu";
  const Tensor& gs = in.at("input.group_sizes");
  const Tensor& x = in.at("input.x");
  const int64_t H = x.dim(1), M = in.at("input.wi_0").dim(2);
  const Tensor ax = abs_f64(x), aw0 = abs_f64(in.at("input.wi_0")),
               aw1 = abs_f64(in.at("input.wi_1")), awo = abs_f64(in.at("input.wo")),
               act_ = abs_f64(in.at("cotangent.out"));
  Tensor s0, s1, so;
  const Tensor* ab0 = opt_abs(in, "input.wi_0_bias", s0);
  const Tensor* ab1 = opt_abs(in, "input.wi_1_bias", s1);
  const Tensor* abo = opt_abs(in, "input.wo_bias", so);
  const auto none = Rounding::none;
  const Tensor& gate = want.at("output.gate_proj");
  const Tensor& up = want.at("output.up_proj");
  const Tensor& inter = want.at("output.intermediate");
  const Tensor b_gate =
      reduction_bound(d, gate, ref::grouped_gemm_fwd(ax, aw0, gs, ab0, none), H + (ab0 ? 1 : 0));
  const Tensor b_up =
      reduction_bound(d, up, ref::grouped_gemm_fwd(ax, aw1, gs, ab1, none), H + (ab1 ? 1 : 0));
  if (key == "output.gate_proj") return b_gate.clone();
  if (key == "output.up_proj") return b_up.clone();
  Tensor b_inter = elementwise(d, inter);
  for (int64_t i = 0; i < b_inter.numel(); ++i) {
    const double g = gate.at(i), u = up.at(i), bg = b_gate.at(i), bu = b_up.at(i);
    const double curv = silu ? kSiluCurvature : 0.0;
    b_inter.set(i, b_inter.at(i) + std::fabs(act_d(silu, g) * u) * bg +
                       (std::fabs(act_v(silu, g)) + std::fabs(act_d(silu, g)) * bg) * bu +
                       0.5 * curv * bg * bg * std::fabs(u));
  }
  if (key == "output.intermediate") return b_inter;
  const Tensor ainter = abs_f64(inter);
  const Tensor n = per_group_rows(gs, want.at(key).shape());
  if (key == "output.out") {
    return add(reduction_bound(d, want.at(key), ref::grouped_gemm_fwd(ainter, awo, gs, abo, none),
                               M + (abo ? 1 : 0)),
               ref::grouped_gemm_fwd(b_inter, awo, gs, nullptr, none));
  }
  if (key == "grad.wo" || key == "grad.wo_bias") {
    const ref::GroupedGemmBwd s = ref::grouped_gemm_bwd(act_, ainter, awo, gs, abo, none);
    if (key == "grad.wo_bias") return reduction_bound(d, want.at(key), *s.grad_bias, 0, &n);
    const ref::GroupedGemmBwd p = ref::grouped_gemm_bwd(act_, b_inter, awo, gs, nullptr, none);
    return add(reduction_bound(d, want.at(key), s.grad_w, 0, &n), p.grad_w);
  }
  // Backward stages: d_inter = rnd(ct wo^T), then d_up and d_gate elementwise.
  const Activation a = parse_activation(c.s("activation", "silu"));
  const ref::FfnWeights w{in.at("input.wi_0"),
                          in.at("input.wi_1"),
                          in.at("input.wo"),
                          find_tensor(in, "input.wi_0_bias"),
                          find_tensor(in, "input.wi_1_bias"),
                          find_tensor(in, "input.wo_bias")};
  const ref::SwigluFfnBwd b =
      ref::swiglu_expert_ffn_bwd(in.at("cotangent.out"), x, gs, w, gate, up, inter, a);
  const ref::GroupedGemmBwd di =
      ref::grouped_gemm_bwd(in.at("cotangent.out"), inter, in.at("input.wo"), gs, nullptr);
  const Tensor& d_inter = di.grad_x;
  const Tensor b_di = reduction_bound(
      d, d_inter, ref::grouped_gemm_bwd(act_, ainter, awo, gs, nullptr, none).grad_x, H);
  Tensor b_du = elementwise(d, b.d_up), b_dg = elementwise(d, b.d_gate);
  for (int64_t i = 0; i < b_du.numel(); ++i) {
    const double g = gate.at(i), u = up.at(i), t = d_inter.at(i);
    const double bg = b_gate.at(i), bu = b_up.at(i), bt = b_di.at(i);
    const double curv = silu ? kSiluCurvature : 0.0;
    const double ad = std::fabs(act_d(silu, g));
    b_du.set(i, b_du.at(i) + std::fabs(act_v(silu, g)) * bt +
                    (std::fabs(t) + bt) * (ad * bg + 0.5 * curv * bg * bg));
    b_dg.set(i, b_dg.at(i) + ad * (std::fabs(u) * bt + (std::fabs(t) + bt) * bu) +
                    curv * (std::fabs(t) + bt) * (std::fabs(u) + bu) * bg);
  }
  const Tensor adg = abs_f64(b.d_gate), adu = abs_f64(b.d_up);
  const Tensor& ref_v = want.at(key);
  if (key == "grad.x") {
    const ref::GroupedGemmBwd g0 = ref::grouped_gemm_bwd(adg, ax, aw0, gs, nullptr, none);
    const ref::GroupedGemmBwd g1 = ref::grouped_gemm_bwd(adu, ax, aw1, gs, nullptr, none);
    const ref::GroupedGemmBwd p0 = ref::grouped_gemm_bwd(b_dg, ax, aw0, gs, nullptr, none);
    const ref::GroupedGemmBwd p1 = ref::grouped_gemm_bwd(b_du, ax, aw1, gs, nullptr, none);
    return add(reduction_bound(d, ref_v, add(g0.grad_x, g1.grad_x), 2 * M),
               add(p0.grad_x, p1.grad_x));
  }
  const bool is0 = key == "grad.wi_0" || key == "grad.wi_0_bias";
  const Tensor bias_shape(DType::f64, {gs.dim(0), M});  // only its presence and shape matter
  const ref::GroupedGemmBwd s =
      ref::grouped_gemm_bwd(is0 ? adg : adu, ax, is0 ? aw0 : aw1, gs, &bias_shape, none);
  const ref::GroupedGemmBwd p =
      ref::grouped_gemm_bwd(is0 ? b_dg : b_du, ax, is0 ? aw0 : aw1, gs, &bias_shape, none);
  if (key == "grad.wi_0" || key == "grad.wi_1") {
    return add(reduction_bound(d, ref_v, s.grad_w, 0, &n), p.grad_w);
  }
  return add(reduction_bound(d, ref_v, *s.grad_bias, 0, &n), *p.grad_bias);
}

}  // namespace ffn_chain
}  // namespace

namespace {

const char* const kImpls[] = {"grouped", "loop", "streams"};

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "gpu");
}

Case gemm_case(const std::string& name, DType d, Regime regime, int64_t G, int64_t M, int64_t K,
               int64_t N, int64_t tail, bool bias) {
  Case c;
  c.op = "grouped_gemm";
  c.dtype = d;
  c.regime = regime;
  c.seed = 41;
  c.set("name", name).set("G", G).set("M_total", M).set("K_d", K).set("N", N);
  c.set("tail", tail).set("bias", bias);
  return c;
}

Case ffn_case(const std::string& name, DType d, Regime regime, int64_t G, int64_t Mt, int64_t H,
              int64_t M, int64_t tail, bool biases) {
  Case c;
  c.op = "swiglu_expert_ffn";
  c.dtype = d;
  c.regime = regime;
  c.seed = 43;
  c.set("name", name).set("G", G).set("M_total", Mt).set("H", H).set("M", M).set("tail", tail);
  c.set("activation", "silu").set("wi_0_bias", biases).set("wi_1_bias", biases);
  c.set("wo_bias", biases);
  return c;
}

// Edge cases of both ops: zero-token experts with tail rows, an all-empty batch (every row is a
// tail row), zero rows, and one group owning every row.
std::vector<Case> edge_cases(const std::string& op) {
  if (op == "grouped_gemm") {
    return {gemm_case("empty_groups", DType::bf16, Regime::zero_tokens, 8, 40, 16, 24, 5, true),
            gemm_case("all_empty", DType::f16, Regime::uniform, 4, 12, 8, 8, 12, true),
            gemm_case("zero_rows", DType::f32, Regime::uniform, 3, 0, 4, 5, 0, true),
            gemm_case("one_group", DType::bf16, Regime::uniform, 1, 33, 8, 16, 0, false)};
  }
  return {ffn_case("empty_groups", DType::bf16, Regime::zero_tokens, 8, 40, 32, 48, 6, true),
          ffn_case("all_empty", DType::f16, Regime::uniform, 4, 12, 8, 8, 12, true),
          ffn_case("zero_rows", DType::f32, Regime::uniform, 3, 0, 8, 8, 0, true),
          ffn_case("one_group", DType::bf16, Regime::uniform, 1, 21, 16, 24, 0, false)};
}

// Shapes that span several tensor-core tiles, with odd sizes, skew, tail rows and biases.
std::vector<Case> medium_cases(const std::string& op) {
  if (op == "grouped_gemm") {
    return {gemm_case("medium_bf16", DType::bf16, Regime::skewed, 5, 1000, 136, 200, 37, true),
            gemm_case("medium_f16", DType::f16, Regime::zero_tokens, 7, 777, 96, 130, 0, true),
            gemm_case("medium_f32", DType::f32, Regime::uniform, 4, 513, 257, 65, 13, false)};
  }
  return {ffn_case("medium_bf16", DType::bf16, Regime::skewed, 4, 600, 96, 160, 20, true),
          ffn_case("medium_f32", DType::f32, Regime::zero_tokens, 6, 300, 72, 40, 9, false)};
}

int64_t used_rows(const TensorMap& in) {
  int64_t used = 0;
  for (int64_t v : int_values(in.at("input.group_sizes"))) used += v;
  return used;
}

// Rows past sum(group_sizes) of every per-row tensor (outputs and grad x) and the gradients of
// empty groups (weights, biases: leading axis G) are exactly 0; returns failure lines.
std::vector<std::string> zero_tail_and_empty_groups(const TensorMap& in, const TensorMap& got) {
  std::vector<std::string> bad;
  const auto sizes = int_values(in.at("input.group_sizes"));
  const int64_t used = used_rows(in);
  for (auto& [key, t] : got) {
    if (t.numel() == 0) continue;
    const bool per_row = key.rfind("output.", 0) == 0 || key == "grad.x";
    const int64_t per = t.row_stride();
    if (per_row) {
      for (int64_t i = used * per; i < t.numel(); ++i) {
        if (t.at(i) != 0.0) {
          bad.push_back(key + ": tail element " + std::to_string(i) + " = " +
                        format_double(t.at(i)) + ", want 0");
          break;
        }
      }
      continue;
    }
    for (size_t g = 0; g < sizes.size(); ++g) {
      if (sizes[g] != 0) continue;
      for (int64_t i = 0; i < per; ++i) {
        const double v = t.at(static_cast<int64_t>(g) * per + i);
        if (v != 0.0) {
          bad.push_back(key + ": empty group " + std::to_string(g) + " has " + format_double(v) +
                        ", want exactly 0");
          break;
        }
      }
    }
  }
  return bad;
}

// Every float tensor of want equals got exactly (|got - want| <= 0: -0.0 == +0.0).
Report exact_report(const TensorMap& want, const TensorMap& got) {
  Report r;
  for (auto& [key, w] : want) {
    auto it = got.find(key);
    if (it == got.end()) {
      r.failures.push_back(key + ": missing from the GPU result");
      continue;
    }
    Tensor zero(DType::f64, w.shape());
    r.tensors.push_back(compare(key, it->second, w, is_floating(w.dtype()) ? &zero : nullptr));
  }
  return r;
}

std::vector<std::string> bitwise_differences(const TensorMap& a, const TensorMap& b) {
  std::vector<std::string> bad;
  for (auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || !it->second.bitwise_equal(v)) bad.push_back(k + " differs");
  }
  return bad;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (auto& l : v) s += "  " + l + "\n";
  return s;
}

// The records, with the FFN judged by the propagated stage bound (ffn_chain::ffn_bound).
const OpInfo& checked_op(const std::string& name) {
  static const OpInfo ffn = [] {
    OpInfo o = *find_op("swiglu_expert_ffn");
    o.bound = ffn_chain::ffn_bound;
    return o;
  }();
  return name == "swiglu_expert_ffn" ? ffn : *find_op(name);
}

class GemmGpu : public ::testing::TestWithParam<std::tuple<const char*, const char*>> {
 protected:
  const OpInfo& op() const { return checked_op(std::get<0>(GetParam())); }
  std::string impl() const { return std::get<1>(GetParam()); }
  Case with_impl(Case c) const { return c.set("impl", impl()); }
};

}  // namespace

TEST_P(GemmGpu, RandomCasesMatchTheReference) {
  MOE_SKIP_WITHOUT_GPU();
  const OpInfo& o = op();
  ASSERT_TRUE(o.gpu) << o.name << " has no CUDA twin bound";
  const bool ok = rc::check(o.name + " [" + impl() + "]: CUDA vs reference", [&] {
    const Case c = with_impl(*o.gen());
    RC_TAG(std::string(regime_name(c.regime)));
    RC_CLASSIFY(c.dtype == DType::bf16, "bf16");
    RC_CLASSIFY(c.i("tail", 0) > 0, "tail rows");
    const Report r = check_gpu(o, c);
    if (!r.ok()) RC_FAIL(failure(c, r));
  });
  EXPECT_TRUE(ok);
}

TEST_P(GemmGpu, NamedCasesMatchTheReference) {
  MOE_SKIP_WITHOUT_GPU();
  const OpInfo& o = op();
  ASSERT_TRUE(o.gpu && o.named) << o.name;
  for (const Case& named : o.named()) {
    const Case c = with_impl(named);
    const Report r = check_gpu(o, c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

TEST_P(GemmGpu, MediumShapesMatchTheReference) {
  MOE_SKIP_WITHOUT_GPU();
  const OpInfo& o = op();
  for (const Case& m : medium_cases(o.name)) {
    const Case c = with_impl(m);
    const Report r = check_gpu(o, c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

TEST_P(GemmGpu, TailRowsAndEmptyGroupsAreExactlyZero) {
  MOE_SKIP_WITHOUT_GPU();
  const OpInfo& o = op();
  for (const Case& e : edge_cases(o.name)) {
    const Case c = with_impl(e);
    const TensorMap in = o.make_inputs(c);
    const TensorMap got = o.gpu(c, in);  // every output poisoned with NaN first
    const auto bad = zero_tail_and_empty_groups(in, got);
    EXPECT_TRUE(bad.empty()) << c.line() << "\n"
                             << joined(bad) << "  replay: " << replay_line(c, "gpu");
    const Report r = check_gpu(o, c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

TEST_P(GemmGpu, LargerShapesAreBitwiseDeterministic) {
  MOE_SKIP_WITHOUT_GPU();
  const OpInfo& o = op();
  const Case c =
      with_impl(o.name == "grouped_gemm"
                    ? gemm_case("det", DType::bf16, Regime::skewed, 8, 4096, 1024, 1024, 100, true)
                    : ffn_case("det", DType::bf16, Regime::skewed, 8, 2048, 512, 1024, 64, true));
  const TensorMap in = o.make_inputs(c);
  const TensorMap a = o.gpu(c, in);
  const TensorMap b = o.gpu(c, in);
  const auto bad = bitwise_differences(a, b);
  EXPECT_TRUE(bad.empty()) << c.line() << "\n" << joined(bad);
  EXPECT_TRUE(zero_tail_and_empty_groups(in, a).empty()) << c.line();
}

INSTANTIATE_TEST_SUITE_P(Ffn, GemmGpu,
                         ::testing::Combine(::testing::Values("grouped_gemm", "swiglu_expert_ffn"),
                                            ::testing::ValuesIn(kImpls)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

// Grouped GEMM alone (silu makes the FFN inexact on integers), per GemmImpl.
class GroupedGemmGpu : public ::testing::TestWithParam<const char*> {
 protected:
  Case with_impl(Case c) const { return c.set("impl", std::string(GetParam())); }
};

TEST_P(GroupedGemmGpu, SmallIntegerInputsGiveExactResults) {
  MOE_SKIP_WITHOUT_GPU();
  const OpInfo& o = *find_op("grouped_gemm");
  // The multi-tile shapes, the named cases and generated ones, all with integer values.
  std::vector<Case> cases = medium_cases(o.name);
  for (Case& n : o.named()) cases.push_back(std::move(n));
  for (const Case& m : cases) {
    const Case c = with_impl(m).set("values", "small_int");
    const TensorMap in = o.make_inputs(c);
    const Report r = exact_report(o.reference(c, in, false), o.gpu(c, in));
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
  const bool ok = rc::check(
      std::string("grouped_gemm [") + GetParam() + "]: small integers give exact results", [&] {
        const Case c = with_impl(*o.gen()).set("values", "small_int");
        RC_TAG(std::string(regime_name(c.regime)));
        const TensorMap in = o.make_inputs(c);
        const Report r = exact_report(o.reference(c, in, false), o.gpu(c, in));
        if (!r.ok()) RC_FAIL(failure(c, r));
      });
  EXPECT_TRUE(ok);
}

INSTANTIATE_TEST_SUITE_P(Gemm, GroupedGemmGpu, ::testing::ValuesIn(kImpls),
                         [](const auto& info) { return std::string(info.param); });

// --- errors -------------------------------------------------------------------------------------

#ifdef MOE_WITH_CUDA

namespace {

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

gpu::DeviceTensor dev(DType d, const Shape& s) {
  Tensor t(d, s);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<double>(i % 5) - 2.0);
  return gpu::DeviceTensor::upload(t);
}

gpu::DeviceTensor dev_sizes(const std::vector<int64_t>& v) {
  Tensor t(DType::i32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return gpu::DeviceTensor::upload(t);
}

}  // namespace

TEST(GemmGpuErrors, NegativeGroupSizeNamesGroupSizes) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::bf16, {10, 4}), w = dev(DType::bf16, {3, 4, 6});
  const auto gs = dev_sizes({3, -1, 2});
  std::string msg = error_of([&] { gpu::grouped_gemm_fwd(x, w, gs, nullptr); });
  EXPECT_THAT(msg, HasSubstr("group_sizes"));
  EXPECT_THAT(msg, HasSubstr("-1"));
  const auto ct = dev(DType::bf16, {10, 6});
  msg = error_of([&] { gpu::grouped_gemm_bwd(ct, x, w, gs, nullptr); });
  EXPECT_THAT(msg, HasSubstr("group_sizes"));
}

TEST(GemmGpuErrors, GroupSizesAboveRowsNameGroupSizes) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::f32, {10, 4}), w = dev(DType::f32, {3, 4, 6});
  const std::string msg = error_of([&] {
    gpu::grouped_gemm_fwd(x, w, dev_sizes({5, 4, 3}), nullptr);
  });
  EXPECT_THAT(msg, HasSubstr("group_sizes"));
  EXPECT_THAT(msg, HasSubstr("12"));
}

TEST(GemmGpuErrors, ContractionMismatchNamesW) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::bf16, {10, 4}), w = dev(DType::bf16, {3, 5, 6});
  EXPECT_THAT(error_of([&] {
                gpu::grouped_gemm_fwd(x, w, dev_sizes({3, 3, 3}), nullptr);
              }),
              HasSubstr("w: contraction size 5"));
}

TEST(GemmGpuErrors, BiasShapeNamesBias) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::bf16, {10, 4}), w = dev(DType::bf16, {3, 4, 6});
  const auto bias = dev(DType::bf16, {3, 5});
  EXPECT_THAT(error_of([&] {
                gpu::grouped_gemm_fwd(x, w, dev_sizes({3, 3, 3}), &bias);
              }),
              HasSubstr("bias"));
}

TEST(GemmGpuErrors, CotangentDtypeMismatchNamesGradOut) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::bf16, {10, 4}), w = dev(DType::bf16, {3, 4, 6});
  const auto ct = dev(DType::f32, {10, 6});
  EXPECT_THAT(error_of([&] {
                gpu::grouped_gemm_bwd(ct, x, w, dev_sizes({3, 3, 3}), nullptr);
              }),
              HasSubstr("grad_out"));
}

TEST(GemmGpuErrors, UnknownImplNamesImpl) {
  EXPECT_THAT(error_of([] { gpu::parse_gemm_impl("cutlass"); }), HasSubstr("impl"));
}

TEST(GemmGpuErrors, FfnGroupSizeErrorsNameGroupSizes) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::bf16, {10, 4});
  const auto w0 = dev(DType::bf16, {2, 4, 6}), w1 = dev(DType::bf16, {2, 4, 6});
  const auto wo = dev(DType::bf16, {2, 6, 4});
  const gpu::FfnWeights w{w0, w1, wo};
  for (const auto& sizes : {std::vector<int64_t>{4, -2}, std::vector<int64_t>{6, 5}}) {
    EXPECT_THAT(
        error_of([&] { gpu::swiglu_expert_ffn_fwd(x, dev_sizes(sizes), w, Activation::silu); }),
        HasSubstr("group_sizes"));
  }
}

TEST(GemmGpuErrors, FfnWeightShapeNamesTheWeight) {
  MOE_SKIP_WITHOUT_GPU();
  const auto x = dev(DType::bf16, {10, 4});
  const auto w0 = dev(DType::bf16, {2, 4, 6}), w1 = dev(DType::bf16, {2, 4, 6});
  const auto wo = dev(DType::bf16, {2, 5, 4});
  EXPECT_THAT(error_of([&] {
                gpu::swiglu_expert_ffn_fwd(x, dev_sizes({5, 5}), {w0, w1, wo}, Activation::silu);
              }),
              HasSubstr("wo"));
}

// --- benchmark ----------------------------------------------------------------------------------

namespace {

constexpr uint64_t kSeedX = 11, kSeedW = 12, kSeedCt = 13, kSeedW1 = 14, kSeedWo = 15;

double tflops(double flops, double ms) {
  return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0;
}

// Samples of a grouped product checked against fp64 sums of the hash-generated operands, with
// the SPEC §12 reduction bound. value(t, i) gives operand elements; got from the device.
struct Sampler {
  const gpu::GroupPlan& plan;
  int64_t K, N;
  std::vector<std::string> bad;

  int64_t group_of(int64_t r) const {
    int64_t g = 0;
    while (plan.offsets[g + 1] <= r) ++g;
    return g;
  }
  void check(const std::string& what, int64_t idx, double got, double want, int64_t n,
             double abs_sum) {
    const double b = tol_bound(TolClass::reduction, DType::bf16, want, n, abs_sum);
    if (!(std::fabs(got - want) <= b)) {
      bad.push_back(what + "[" + std::to_string(idx) + "] = " + format_double(got) + ", want " +
                    format_double(want) + " (bound " + format_double(b) + ")");
    }
  }
};

double hv(uint64_t seed, int64_t i) {
  return gpu::gemm_detail::hash_uniform_value(DType::bf16, seed, i, -1.0, 1.0);
}

// out[r,n] = sum_k x[r,k] w[g,k,n]; grad_x[r,k] = sum_n ct[r,n] w[g,k,n];
// grad_w[g,k,n] = sum_{r in g} x[r,k] ct[r,n].
std::vector<std::string> verify_gemm(const gpu::GroupPlan& plan, int64_t K, int64_t N,
                                     const gpu::DeviceTensor& out, const gpu::DeviceTensor* grad_x,
                                     const gpu::DeviceTensor* grad_w) {
  Sampler s{plan, K, N, {}};
  Rng rng(7, "samples");
  const int kSamples = 24;
  std::vector<int64_t> idx;
  std::vector<std::array<int64_t, 3>> at;
  if (plan.used > 0) {
    for (int i = 0; i < kSamples; ++i) {
      const int64_t r = rng.below(plan.used), n = rng.below(N);
      idx.push_back(r * N + n);
      at.push_back({r, n, 0});
    }
    const auto got = gpu::gemm_detail::gather_values(out, idx);
    for (size_t i = 0; i < idx.size(); ++i) {
      const int64_t r = at[i][0], n = at[i][1], g = s.group_of(r);
      double want = 0, abs = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = hv(kSeedX, r * K + k) * hv(kSeedW, (g * K + k) * N + n);
        want += p;
        abs += std::fabs(p);
      }
      s.check("out", idx[i], got[i], round_to(DType::bf16, want), K, abs);
    }
  }
  if (grad_x && plan.used > 0) {
    idx.clear();
    at.clear();
    for (int i = 0; i < kSamples; ++i) {
      const int64_t r = rng.below(plan.used), k = rng.below(K);
      idx.push_back(r * K + k);
      at.push_back({r, k, 0});
    }
    const auto got = gpu::gemm_detail::gather_values(*grad_x, idx);
    for (size_t i = 0; i < idx.size(); ++i) {
      const int64_t r = at[i][0], k = at[i][1], g = s.group_of(r);
      double want = 0, abs = 0;
      for (int64_t n = 0; n < N; ++n) {
        const double p = hv(kSeedCt, r * N + n) * hv(kSeedW, (g * K + k) * N + n);
        want += p;
        abs += std::fabs(p);
      }
      s.check("grad_x", idx[i], got[i], round_to(DType::bf16, want), N, abs);
    }
  }
  if (grad_w) {
    idx.clear();
    at.clear();
    const int64_t G = plan.groups();
    for (int i = 0; i < kSamples; ++i) {
      const int64_t g = i < 4 ? 0 : rng.below(G), k = rng.below(K), n = rng.below(N);
      idx.push_back((g * K + k) * N + n);
      at.push_back({g, k, n});
    }
    const auto got = gpu::gemm_detail::gather_values(*grad_w, idx);
    for (size_t i = 0; i < idx.size(); ++i) {
      const int64_t g = at[i][0], k = at[i][1], n = at[i][2];
      double want = 0, abs = 0;
      for (int64_t r = plan.offsets[g]; r < plan.offsets[g + 1]; ++r) {
        const double p = hv(kSeedX, r * K + k) * hv(kSeedCt, r * N + n);
        want += p;
        abs += std::fabs(p);
      }
      s.check("grad_w", idx[i], got[i], round_to(DType::bf16, want), plan.sizes[g], abs);
    }
  }
  return s.bad;
}

struct BenchShape {
  std::string name;
  int64_t tokens, topk, H, F, E;
  Regime regime;
};

const std::vector<BenchShape>& bench_shapes() {
  static const std::vector<BenchShape> v = {
      {"mixtral_uniform", 16384, 2, 4096, 14336, 8, Regime::uniform},
      {"mixtral_skewed", 16384, 2, 4096, 14336, 8, Regime::skewed},
      {"deepseek_uniform", 8192, 8, 7168, 2048, 256, Regime::uniform},
      {"deepseek_skewed", 8192, 8, 7168, 2048, 256, Regime::skewed}};
  return v;
}

gpu::GroupPlan bench_plan(const BenchShape& b) {
  Case c;
  c.op = "grouped_gemm";
  c.regime = b.regime;
  c.seed = 23;
  const int64_t rows = b.tokens * b.topk;
  return gpu::make_group_plan(make_group_sizes(c, b.E, rows, "input.group_sizes"), rows);
}

gpu::DeviceTensor filled(const Shape& s, uint64_t seed) {
  gpu::DeviceTensor t(DType::bf16, s);
  gpu::gemm_detail::fill_hash_uniform(t, seed, -1.0, 1.0);
  return t;
}

std::string skew_summary(const gpu::GroupPlan& p) {
  int64_t mx = 0, empty = 0;
  for (int64_t v : p.sizes) {
    mx = std::max(mx, v);
    empty += v == 0;
  }
  return "largest group " + std::to_string(mx) + " rows, " + std::to_string(empty) + " empty";
}

}  // namespace

TEST(GemmBench, GroupedVsDenseCublasAtEqualFlops) {
  MOE_SKIP_WITHOUT_GPU();
  if (!std::getenv("MOE_GEMM_BENCH")) {
    GTEST_SKIP() << "full-size benchmark: set MOE_GEMM_BENCH=1 (needs ~55 GB of GPU memory)";
  }
  const int kWarm = 2, kReps = 10;
  nlohmann::json rows = nlohmann::json::array();
  std::printf("device: %s\n", gpu_description().c_str());
  std::printf("%-18s %-8s %9s %8s %8s %6s | %9s %8s %8s %6s | %9s\n", "case", "impl", "fwd_ms",
              "TFLOP/s", "dense", "ratio", "fb_ms", "TFLOP/s", "dense", "ratio", "fwd+read");
  for (const BenchShape& b : bench_shapes()) {
    const gpu::GroupPlan plan = bench_plan(b);
    const int64_t R = plan.rows, K = b.H, N = b.F, G = b.E;
    const double fwd_flops = 2.0 * R * K * N, fb_flops = 3 * fwd_flops;
    gpu::DeviceTensor x = filled({R, K}, kSeedX), w = filled({G, K, N}, kSeedW);
    gpu::DeviceTensor ct = filled({R, N}, kSeedCt);
    Tensor gs_host(DType::i32, {G});
    for (int64_t g = 0; g < G; ++g) gs_host.set(g, static_cast<double>(plan.sizes[g]));
    const gpu::DeviceTensor gs = gpu::DeviceTensor::upload(gs_host);
    gpu::DeviceTensor out(DType::bf16, {R, N});
    gpu::GroupedGemmBwd grads{gpu::DeviceTensor(DType::bf16, {R, K}),
                              gpu::DeviceTensor(DType::bf16, {G, K, N}), std::nullopt};

    // Dense baseline of equal FLOPs: one [R,K] x [K,N] product and its two gradients.
    gpu::DeviceTensor w2 = filled({K, N}, kSeedW), dw2(DType::bf16, {K, N});
    const double dense_fwd = gpu::gemm_detail::median_ms(
        [&] { gpu::dense_gemm(gpu::GemmRole::fwd, x, w2, out); }, kWarm, kReps);
    const double dense_fb = gpu::gemm_detail::median_ms(
        [&] {
          gpu::dense_gemm(gpu::GemmRole::fwd, x, w2, out);
          gpu::dense_gemm(gpu::GemmRole::dgrad, ct, w2, grads.grad_x);
          gpu::dense_gemm(gpu::GemmRole::wgrad, x, ct, dw2);
        },
        kWarm, kReps);

    for (const char* name : kImpls) {
      gpu::GemmOptions o;
      o.impl = gpu::parse_gemm_impl(name);
      // Verify, then time.
      gpu::grouped_gemm_fwd_into(x, w, plan, nullptr, out, nullptr, o);
      gpu::grouped_gemm_bwd_into(ct, x, w, plan, nullptr, grads, nullptr, o);
      const auto bad = verify_gemm(plan, K, N, out, &grads.grad_x, &grads.grad_w);
      EXPECT_TRUE(bad.empty()) << b.name << " [" << name << "]\n" << joined(bad);
      const double fwd = gpu::gemm_detail::median_ms(
          [&] { gpu::grouped_gemm_fwd_into(x, w, plan, nullptr, out, nullptr, o); }, kWarm, kReps);
      const double fb = gpu::gemm_detail::median_ms(
          [&] {
            gpu::grouped_gemm_fwd_into(x, w, plan, nullptr, out, nullptr, o);
            gpu::grouped_gemm_bwd_into(ct, x, w, plan, nullptr, grads, nullptr, o);
          },
          kWarm, kReps);
      // The same forward paying the group-size read-back (device-resident sizes, as in the block).
      const double fwd_read = gpu::gemm_detail::median_ms(
          [&] {
            const gpu::GroupPlan p = gpu::read_group_plan(gs, R);
            gpu::grouped_gemm_fwd_into(x, w, p, nullptr, out, nullptr, o);
          },
          kWarm, kReps);
      std::printf("%-18s %-8s %9.3f %8.1f %8.1f %5.0f%% | %9.3f %8.1f %8.1f %5.0f%% | %9.3f\n",
                  b.name.c_str(), name, fwd, tflops(fwd_flops, fwd), tflops(fwd_flops, dense_fwd),
                  100 * dense_fwd / fwd, fb, tflops(fb_flops, fb), tflops(fb_flops, dense_fb),
                  100 * dense_fb / fb, fwd_read);
      std::fflush(stdout);
      rows.push_back({{"op", "grouped_gemm"},
                      {"case", b.name},
                      {"impl", name},
                      {"groups", skew_summary(plan)},
                      {"rows", R},
                      {"K", K},
                      {"N", N},
                      {"G", G},
                      {"fwd_ms", fwd},
                      {"fwd_tflops", tflops(fwd_flops, fwd)},
                      {"dense_fwd_ms", dense_fwd},
                      {"dense_fwd_tflops", tflops(fwd_flops, dense_fwd)},
                      {"fwd_bwd_ms", fb},
                      {"fwd_bwd_tflops", tflops(fb_flops, fb)},
                      {"dense_fwd_bwd_ms", dense_fb},
                      {"dense_fwd_bwd_tflops", tflops(fb_flops, dense_fb)},
                      {"fwd_with_readback_ms", fwd_read},
                      {"verified", bad.empty()}});
    }
    std::printf("%-18s groups: %s\n", b.name.c_str(), skew_summary(plan).c_str());
  }

  // The FFN at the same shapes (3 products forward, 6 backward), with the default impl and the
  // others; checked by sampled stage values.
  std::printf("%-18s %-8s %9s %8s | %9s %8s\n", "ffn case", "impl", "fwd_ms", "TFLOP/s", "fb_ms",
              "TFLOP/s");
  for (const BenchShape& b : bench_shapes()) {
    const gpu::GroupPlan plan = bench_plan(b);
    const int64_t R = plan.rows, H = b.H, M = b.F, G = b.E;
    const double fwd_flops = 6.0 * R * H * M, fb_flops = 3 * fwd_flops;
    gpu::DeviceTensor x = filled({R, H}, kSeedX), ct = filled({R, H}, kSeedCt);
    // Fan-in scaled weights keep every stage O(1): U(-1,1)/sqrt(fan_in) via the bounds.
    gpu::DeviceTensor wi_0(DType::bf16, {G, H, M}), wi_1(DType::bf16, {G, H, M});
    gpu::DeviceTensor wo(DType::bf16, {G, M, H});
    const double si = 1.0 / std::sqrt(static_cast<double>(H));
    const double so = 1.0 / std::sqrt(static_cast<double>(M));
    gpu::gemm_detail::fill_hash_uniform(wi_0, kSeedW, -si, si);
    gpu::gemm_detail::fill_hash_uniform(wi_1, kSeedW1, -si, si);
    gpu::gemm_detail::fill_hash_uniform(wo, kSeedWo, -so, so);
    const gpu::FfnWeights w{wi_0, wi_1, wo};
    gpu::SwigluFfnFwd f{
        gpu::DeviceTensor(DType::bf16, {R, H}), gpu::DeviceTensor(DType::bf16, {R, M}),
        gpu::DeviceTensor(DType::bf16, {R, M}), gpu::DeviceTensor(DType::bf16, {R, M})};
    gpu::SwigluFfnBwd g{gpu::DeviceTensor(DType::bf16, {R, H}),
                        gpu::DeviceTensor(DType::bf16, {G, H, M}),
                        gpu::DeviceTensor(DType::bf16, {G, H, M}),
                        gpu::DeviceTensor(DType::bf16, {G, M, H}),
                        std::nullopt,
                        std::nullopt,
                        std::nullopt,
                        gpu::DeviceTensor(DType::bf16, {R, M}),
                        gpu::DeviceTensor(DType::bf16, {R, M})};
    for (const char* name : kImpls) {
      gpu::GemmOptions o;
      o.impl = gpu::parse_gemm_impl(name);
      gpu::swiglu_expert_ffn_fwd_into(x, plan, w, Activation::silu, f, nullptr, o);
      gpu::swiglu_expert_ffn_bwd_into(ct, x, plan, w, f.gate_proj, f.up_proj, f.intermediate,
                                      Activation::silu, g, nullptr, o);
      // Stage checks: gate[r,m] = x[r] . wi_0[g][:,m]; out[r,h] = inter_gpu[r] . wo[g][:,h].
      std::vector<std::string> bad;
      Rng rng(9, "ffn samples");
      Sampler s{plan, H, M, {}};
      for (int i = 0; i < 8 && plan.used > 0; ++i) {
        const int64_t r = rng.below(plan.used), m = rng.below(M), h = rng.below(H);
        const int64_t gr = s.group_of(r);
        double want = 0, abs = 0;
        for (int64_t k = 0; k < H; ++k) {
          const double p =
              hv(kSeedX, r * H + k) * gpu::gemm_detail::hash_uniform_value(
                                          DType::bf16, kSeedW, (gr * H + k) * M + m, -si, si);
          want += p;
          abs += std::fabs(p);
        }
        s.check("gate", r * M + m, gpu::gemm_detail::gather_values(f.gate_proj, {r * M + m})[0],
                round_to(DType::bf16, want), H, abs);
        std::vector<int64_t> row(static_cast<size_t>(M));
        for (int64_t j = 0; j < M; ++j) row[j] = r * M + j;
        const auto inter = gpu::gemm_detail::gather_values(f.intermediate, row);
        want = abs = 0;
        for (int64_t j = 0; j < M; ++j) {
          const double p = inter[j] * gpu::gemm_detail::hash_uniform_value(
                                          DType::bf16, kSeedWo, (gr * M + j) * H + h, -so, so);
          want += p;
          abs += std::fabs(p);
        }
        s.check("out", r * H + h, gpu::gemm_detail::gather_values(f.out, {r * H + h})[0],
                round_to(DType::bf16, want), M, abs);
      }
      bad = s.bad;
      EXPECT_TRUE(bad.empty()) << "ffn " << b.name << " [" << name << "]\n" << joined(bad);
      const double fwd = gpu::gemm_detail::median_ms(
          [&] { gpu::swiglu_expert_ffn_fwd_into(x, plan, w, Activation::silu, f, nullptr, o); },
          kWarm, kReps);
      const double fb = gpu::gemm_detail::median_ms(
          [&] {
            gpu::swiglu_expert_ffn_fwd_into(x, plan, w, Activation::silu, f, nullptr, o);
            gpu::swiglu_expert_ffn_bwd_into(ct, x, plan, w, f.gate_proj, f.up_proj, f.intermediate,
                                            Activation::silu, g, nullptr, o);
          },
          kWarm, kReps);
      std::printf("%-18s %-8s %9.3f %8.1f | %9.3f %8.1f\n", b.name.c_str(), name, fwd,
                  tflops(fwd_flops, fwd), fb, tflops(fb_flops, fb));
      std::fflush(stdout);
      rows.push_back({{"op", "swiglu_expert_ffn"},
                      {"case", b.name},
                      {"impl", name},
                      {"rows", R},
                      {"H", H},
                      {"M", M},
                      {"G", G},
                      {"fwd_ms", fwd},
                      {"fwd_tflops", tflops(fwd_flops, fwd)},
                      {"fwd_bwd_ms", fb},
                      {"fwd_bwd_tflops", tflops(fb_flops, fb)},
                      {"verified", bad.empty()}});
    }
  }
  if (const char* path = std::getenv("MOE_BENCH_JSON")) {
    std::ofstream(path) << nlohmann::json{{"device", gpu_description()}, {"rows", rows}}.dump(2)
                        << "\n";
  }
}

#endif  // MOE_WITH_CUDA
