// Argsort-backend reference tests (SPEC §8): the §8.4 cross-backend equivalence end to end
// (router map -> both permutes -> both combines, forward and backward), regression R9 and one
// test per §8.1-8.3 error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/perm_family.h"
#include "reference/argsort.h"
#include "reference/dispatch.h"

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

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

Tensor ints(DType d, Shape s, const std::vector<int64_t>& v) {
  Tensor t(d, std::move(s));
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return t;
}

bool same_bits(double a, double b) {
  return a == b && std::signbit(a) == std::signbit(b);
}

ArgsortDispatchParams aparams(int64_t E, int64_t K, int64_t a = 0,
                              std::optional<int64_t> r = std::nullopt) {
  ArgsortDispatchParams p;
  p.num_experts = E;
  p.topk = K;
  p.align_size = a;
  p.roll_to_expert_id = r;
  return p;
}

// R9's routing: E = 4, K = 2, T = 5.
const std::vector<int64_t> kR9 = {0, 1, 1, 2, 2, 3, 0, 3, 1, 3};

}  // namespace

// SPEC §8.4: for router maps (exactly K distinct experts per row, r = 0) both backends agree:
// group sizes and dispatched rows bitwise on [0, sum chat), zero rows beyond, combine and every
// gradient within the §12 bounds. Probs are in d, so the argsort rounding of weights is exact.
RC_GTEST_PROP(ArgsortProps, CrossBackendEquivalence, ()) {
  Case c;
  c.seed = *rc::gen::arbitrary<uint32_t>();
  c.regime =
      *rc::gen::element(Regime::uniform, Regime::skewed, Regime::all_to_one, Regime::zero_tokens);
  const DType d = *rc::gen::element(DType::f32, DType::bf16, DType::f16);
  const int64_t E = *rc::gen::element<int64_t>(1, 2, 3, 4, 7, 8, 16);
  const int64_t K = *rc::gen::inRange<int64_t>(1, E + 1), T = *rc::gen::inRange<int64_t>(0, 16);
  const int64_t H = *rc::gen::element<int64_t>(1, 3, 8);
  const int64_t a = *rc::gen::element<int64_t>(0, 1, 8, 16, 128);
  RC_TAG(a);
  RC_TAG(std::string(regime_name(c.regime)));
  const int64_t N = T * K;
  const Tensor map = routes_to_map(make_routes(c, T, E, K, false, "routes"), E);
  Tensor sparse = normal_tensor(c, d, {T, E}, "sparse");
  for (int64_t i = 0; i < sparse.numel(); ++i) {
    sparse.set(i, map.at(i) != 0 ? std::fabs(sparse.at(i)) + 0.05 : 0.0);
  }
  const Tensor x = normal_tensor(c, d, {T, H}, "x");

  TokenDispatchParams kp;
  kp.num_out_tokens = N;
  kp.align_size = a;
  const auto kd = ref::token_dispatch_fwd(x, map, nullptr, kp);
  const Tensor* pad = kd.pad_offsets ? &*kd.pad_offsets : nullptr;
  const auto rs = ref::routing_map_to_selected_experts_fwd(sparse, map, K);
  const auto ad = ref::argsort_token_dispatch_fwd(x, rs.selected_experts, aparams(E, K, a));
  const int64_t R_k = kd.permuted.dim(0), R_a = ad.sorted_x.dim(0);
  RC_ASSERT(R_a == N + argsort_padding_size(E, a));

  // MUST 1-3.
  RC_ASSERT(ad.group_sizes.bitwise_equal(kd.tokens_per_expert));
  int64_t S = 0;
  for (int64_t e = 0; e < E; ++e) S += static_cast<int64_t>(ad.group_sizes.at(e));
  for (int64_t j = 0; j < std::max(R_k, R_a); ++j) {
    for (int64_t h = 0; h < H; ++h) {
      const double k = j < R_k ? kd.permuted.at(j, h) : 0.0;
      const double g = j < R_a ? ad.sorted_x.at(j, h) : 0.0;
      if (j < S) {
        RC_ASSERT(same_bits(k, g));
      } else {
        RC_ASSERT(same_bits(k, 0.0) && same_bits(g, 0.0));
      }
    }
  }

  // MUST 4: the same expert outputs on [0, S) in both layouts; beyond S each buffer holds its
  // own garbage that neither combine may read.
  const Tensor eo_a = normal_tensor(c, d, {R_a, H}, "eo_a");
  Tensor eo_k = normal_tensor(c, d, {R_k, H}, "eo_k");
  for (int64_t j = 0; j < S; ++j)
    for (int64_t h = 0; h < H; ++h) eo_k.set(j, h, eo_a.at(j, h));
  const Tensor kc = ref::token_combine_fwd(eo_k, kd.row_id_map, &sparse, pad);
  const Tensor ac = ref::argsort_token_combine_fwd(eo_a, ad.sorted_indices, rs.weights, ad.state);
  RC_ASSERT(kc.shape() == ac.shape());
  std::vector<int64_t> inv(static_cast<size_t>(R_a));
  for (int64_t j = 0; j < R_a; ++j) inv[static_cast<int64_t>(ad.sorted_indices.at(j))] = j;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += std::fabs(rs.weights.at(t, k) * eo_a.at(inv[t * K + k], h));
      RC_ASSERT(std::fabs(kc.at(t, h) - ac.at(t, h)) <=
                tol_bound(TolClass::reduction, d, ac.at(t, h), K, s));
    }
  }

  // Combine backward: grad rows and the probs gradient (through routing_map_to_selected_experts'
  // backward) agree; rows beyond S are zero in both.
  const Tensor ct = normal_tensor(c, d, {T, H}, "ct");
  const auto kb = ref::token_combine_bwd(ct, eo_k, kd.row_id_map, &sparse, pad);
  const auto ab = ref::argsort_token_combine_bwd(ct, eo_a, ad.sorted_indices, rs.weights, ad.state);
  for (int64_t j = 0; j < std::max(R_k, R_a); ++j) {
    for (int64_t h = 0; h < H; ++h) {
      const double k = j < R_k ? kb.grad_permuted.at(j, h) : 0.0;
      const double g = j < R_a ? ab.grad_expert_outputs.at(j, h) : 0.0;
      if (j < S) {
        RC_ASSERT(std::fabs(k - g) <= tol_bound(TolClass::elementwise, d, g, 1, 0));
      } else {
        RC_ASSERT(same_bits(k, 0.0) && same_bits(g, 0.0));
      }
    }
  }
  const Tensor gs =
      ref::routing_map_to_selected_experts_bwd(ab.grad_weights, rs.selected_experts, E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      if (map.at(t, e) != 0) {
        int64_t k = 0;
        while (rs.selected_experts.at(t, k) != static_cast<double>(e)) ++k;
        for (int64_t h = 0; h < H; ++h) s += std::fabs(ct.at(t, h) * eo_a.at(inv[t * K + k], h));
      }
      RC_ASSERT(std::fabs(kb.grad_merging_probs->at(t, e) - gs.at(t, e)) <=
                tol_bound(TolClass::reduction, d, gs.at(t, e), H, s));
    }
  }

  // Dispatch backward: the same cotangent on [0, S); kernel rows beyond S hold a huge value that
  // would show if the backward read an unmapped row.
  const Tensor cta = normal_tensor(c, d, {R_a, H}, "ct_sorted");
  Tensor ctk(d, {R_k, H});
  ctk.fill(6e4);
  for (int64_t j = 0; j < S; ++j)
    for (int64_t h = 0; h < H; ++h) ctk.set(j, h, cta.at(j, h));
  const auto kdb = ref::token_dispatch_bwd(ctk, nullptr, kd.row_id_map, pad);
  const Tensor adb = ref::argsort_token_dispatch_bwd(cta, ad.sorted_indices, ad.state);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += std::fabs(cta.at(inv[t * K + k], h));
      RC_ASSERT(std::fabs(kdb.grad_x.at(t, h) - adb.at(t, h)) <=
                tol_bound(TolClass::reduction, d, adb.at(t, h), K, s));
    }
  }
}

// With roll r and no padding, rolled group i holds exactly expert (i + r) mod E's rows.
RC_GTEST_PROP(ArgsortProps, RolledGroupsHoldTheRolledExpert, ()) {
  Case c;
  c.seed = *rc::gen::arbitrary<uint32_t>();
  const int64_t E = *rc::gen::inRange<int64_t>(1, 9), K = *rc::gen::inRange<int64_t>(1, E + 1);
  const int64_t T = *rc::gen::inRange<int64_t>(0, 12), r = *rc::gen::inRange<int64_t>(0, E);
  const Tensor sel = make_selected_experts(c, T, E, K);
  Tensor x(DType::f32, {T, 1});
  for (int64_t t = 0; t < T; ++t) x.set(t, 0, static_cast<double>(t));
  const auto ad = ref::argsort_token_dispatch_fwd(x, sel, aparams(E, K, 0, r));
  int64_t row = 0;
  for (int64_t i = 0; i < E; ++i) {
    const int64_t e = (i + r) % E;
    std::vector<double> tokens;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (sel.at(t, k) == static_cast<double>(e)) tokens.push_back(static_cast<double>(t));
    RC_ASSERT(ad.group_sizes.at(i) == static_cast<double>(tokens.size()));
    for (double t : tokens) RC_ASSERT(ad.sorted_x.at(row++, 0) == t);
  }
}

TEST(RoutingMapToSelectedExperts, AscendingIdsAndGatheredWeights) {
  Tensor map(DType::boolean, {2, 5});
  Tensor probs(DType::f32, {2, 5});
  for (int64_t e : {4, 1, 3}) {
    map.set(0, e, 1.0);
    probs.set(0, e, 0.1 * static_cast<double>(e + 1));
  }
  for (int64_t e : {0, 2, 4}) {
    map.set(1, e, 1.0);
    probs.set(1, e, 0.5);
  }
  const auto f = ref::routing_map_to_selected_experts_fwd(probs, map, 3);
  EXPECT_EQ(f.selected_experts.values(), (std::vector<double>{1, 3, 4, 0, 2, 4}));
  EXPECT_EQ(f.weights.values(), (std::vector<double>{0.2f, 0.4f, 0.5f, 0.5, 0.5, 0.5}));
  Tensor ct(DType::f32, {2, 3});
  for (int64_t i = 0; i < 6; ++i) ct.set(i, static_cast<double>(i + 1));
  const Tensor g = ref::routing_map_to_selected_experts_bwd(ct, f.selected_experts, 5);
  EXPECT_EQ(g.values(), (std::vector<double>{0, 1, 0, 2, 3, 4, 0, 5, 0, 6}));
}

// R9: roll_to_expert_id with align_size > 0 is an error (TE's overflow placeholders keep key E-1
// before the roll and land inside rolled group 3). The roll alone and the padding alone work.
TEST(Regression, R9_RollWithPaddingIsAnError) {
  const Tensor sel = ints(DType::i32, {5, 2}, kR9);
  Tensor x(DType::f32, {5, 2});
  for (int64_t t = 0; t < 5; ++t) {
    x.set(t, 0, t + 1.0);
    x.set(t, 1, -(t + 1.0));
  }
  const std::string msg =
      error_of([&] { ref::argsort_token_dispatch_fwd(x, sel, aparams(4, 2, 4, 1)); });
  EXPECT_THAT(msg, HasSubstr("roll_to_expert_id"));
  EXPECT_THAT(msg, HasSubstr("align_size"));

  // Padding alone: counts (2,3,2,3) align to 4 each; expert 0's real tokens 0 and 3 come first,
  // and all 6 overflow placeholders sort behind group 3 (rows 16..21 are zero).
  const auto pad = ref::argsort_token_dispatch_fwd(x, sel, aparams(4, 2, 4));
  EXPECT_EQ(pad.group_sizes.values(), (std::vector<double>{4, 4, 4, 4}));
  ASSERT_EQ(pad.sorted_x.dim(0), 10 + 12);
  const std::vector<double> col0 = {1, 4, 0, 0, 1, 2, 5, 0, 2, 3, 0,
                                    0, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = 0; j < 22; ++j) EXPECT_EQ(pad.sorted_x.at(j, 0), col0[j]) << "row " << j;

  // Roll alone (r = 1): group i holds expert (i + 1) mod 4's rows.
  const auto roll = ref::argsort_token_dispatch_fwd(x, sel, aparams(4, 2, 0, 1));
  EXPECT_EQ(roll.group_sizes.values(), (std::vector<double>{3, 2, 3, 2}));
  const std::vector<double> rolled = {1, 2, 5, 2, 3, 3, 4, 5, 1, 4};
  for (int64_t j = 0; j < 10; ++j) EXPECT_EQ(roll.sorted_x.at(j, 0), rolled[j]) << "row " << j;
}

// --- Errors: one test per SPEC §8 error
// ------------------------------------------------------------

TEST(RoutingMapToSelectedExpertsErrors, ShapeMismatch) {
  EXPECT_THAT(error_of([] {
                ref::routing_map_to_selected_experts_fwd(Tensor(DType::f32, {3, 4}),
                                                         Tensor(DType::boolean, {3, 5}), 2);
              }),
              HasSubstr("routing_map"));
}

TEST(RoutingMapToSelectedExpertsErrors, TopkOutOfRange) {
  for (int64_t k : {0, 5}) {
    EXPECT_THAT(error_of([&] {
                  ref::routing_map_to_selected_experts_fwd(Tensor(DType::f32, {3, 4}),
                                                           Tensor(DType::boolean, {3, 4}), k);
                }),
                HasSubstr("topk"));
  }
}

TEST(RoutingMapToSelectedExpertsErrors, RowWithoutExactlyKEntries) {
  Tensor map(DType::boolean, {2, 4});
  map.set(0, 0, 1.0);
  map.set(0, 1, 1.0);
  map.set(1, 2, 1.0);  // row 1 has one entry
  const std::string msg = error_of([&] {
    ref::routing_map_to_selected_experts_fwd(Tensor(DType::f32, {2, 4}), map, 2);
  });
  EXPECT_THAT(msg, HasSubstr("routing_map"));
  EXPECT_THAT(msg, HasSubstr("row 1"));
}

TEST(ArgsortTokenDispatchErrors, TopkDiffersFromColumns) {
  EXPECT_THAT(error_of([] {
                ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}),
                                                ints(DType::i32, {5, 2}, kR9), aparams(4, 3));
              }),
              HasSubstr("topk"));
}

TEST(ArgsortTokenDispatchErrors, NonPositiveNumExperts) {
  EXPECT_THAT(error_of([] {
                ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}),
                                                ints(DType::i32, {5, 2}, kR9), aparams(0, 2));
              }),
              HasSubstr("num_experts"));
}

TEST(ArgsortTokenDispatchErrors, NegativeAlignSize) {
  EXPECT_THAT(error_of([] {
                ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}),
                                                ints(DType::i32, {5, 2}, kR9), aparams(4, 2, -2));
              }),
              HasSubstr("align_size"));
}

TEST(ArgsortTokenDispatchErrors, RollOutOfRange) {
  for (int64_t r : {-1, 4}) {
    EXPECT_THAT(error_of([&] {
                  ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}),
                                                  ints(DType::i32, {5, 2}, kR9),
                                                  aparams(4, 2, 0, r));
                }),
                HasSubstr("roll_to_expert_id"));
  }
}

TEST(ArgsortTokenDispatchErrors, RollWithPadding) {
  EXPECT_THAT(error_of([] {
                ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}),
                                                ints(DType::i32, {5, 2}, kR9), aparams(4, 2, 4, 2));
              }),
              HasSubstr("roll_to_expert_id"));
}

TEST(ArgsortTokenDispatchErrors, ExpertIdOutOfRange) {
  std::vector<int64_t> ids = kR9;
  ids[3] = 4;
  const std::string msg = error_of([&] {
    ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}), ints(DType::i32, {5, 2}, ids),
                                    aparams(4, 2));
  });
  EXPECT_THAT(msg, HasSubstr("selected_experts"));
  EXPECT_THAT(msg, HasSubstr("4"));
}

TEST(ArgsortTokenDispatchErrors, ExpertIdDuplicatedInARow) {
  std::vector<int64_t> ids = kR9;
  ids[5] = 2;  // row 2 = {2, 2}
  const std::string msg = error_of([&] {
    ref::argsort_token_dispatch_fwd(Tensor(DType::f32, {5, 2}), ints(DType::i32, {5, 2}, ids),
                                    aparams(4, 2));
  });
  EXPECT_THAT(msg, HasSubstr("selected_experts"));
  EXPECT_THAT(msg, HasSubstr("row 2"));
}

TEST(ArgsortTokenCombineErrors, ExpertOutputRows) {
  const ArgsortPermParams st{2, 10, 12};
  EXPECT_THAT(error_of([&] {
                ref::argsort_token_combine_fwd(Tensor(DType::f32, {21, 3}),
                                               Tensor(DType::i32, {22}), Tensor(DType::f32, {5, 2}),
                                               st);
              }),
              HasSubstr("expert_outputs"));
}

TEST(ArgsortTokenCombineErrors, WeightsShape) {
  const ArgsortPermParams st{2, 10, 0};
  EXPECT_THAT(error_of([&] {
                ref::argsort_token_combine_fwd(Tensor(DType::f32, {10, 3}),
                                               Tensor(DType::i32, {10}), Tensor(DType::f32, {2, 5}),
                                               st);
              }),
              HasSubstr("weights"));
}

TEST(ArgsortTokenCombineErrors, SortedIndicesNotAPermutation) {
  const ArgsortPermParams st{2, 4, 0};
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{0, 1, 1, 3}, {0, 1, 2, 4}}) {
    EXPECT_THAT(error_of([&] {
                  ref::argsort_token_combine_fwd(Tensor(DType::f32, {4, 3}),
                                                 ints(DType::i32, {4}, bad),
                                                 Tensor(DType::f32, {2, 2}), st);
                }),
                HasSubstr("sorted_indices"));
    EXPECT_THAT(error_of([&] {
                  ref::argsort_token_dispatch_bwd(Tensor(DType::f32, {4, 3}),
                                                  ints(DType::i32, {4}, bad), st);
                }),
                HasSubstr("sorted_indices"));
  }
}
