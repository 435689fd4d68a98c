// token_dispatch / token_combine reference tests (SPEC §4, §5): targeted properties on top of the
// registry-driven checks of test_registry.cpp (alignment sweep, capacities below the routed count,
// round trips), the regression cases R4, R6, R8, R11, R12, and one test per error of §4.5 / §5.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <numeric>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/perm_family.h"
#include "reference/dispatch.h"

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

namespace {

const OpInfo& dispatch_op() {
  return *find_op("token_dispatch");
}
const OpInfo& combine_op() {
  return *find_op("token_combine");
}

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

std::string failure(const Case& c, const Report& r) {
  return c.line() + "\n" + r.str() + "  replay: " + replay_line(c, "reference");
}

// A [T,E] bool map from per-token expert lists.
Tensor map_of(int64_t E, const std::vector<std::vector<int64_t>>& routes) {
  return routes_to_map(routes, E);
}

Tensor normal(DType d, Shape s, const char* name, uint64_t seed = 5) {
  Tensor t(d, std::move(s));
  Rng rng(seed, name);
  fill_normal(t, rng, 1.0);
  return t;
}

TokenDispatchParams dparams(int64_t n_out, int64_t a = 0, bool drop = false) {
  TokenDispatchParams p;
  p.num_out_tokens = n_out;
  p.align_size = a;
  p.drop_overflow = drop;
  return p;
}

// The R4/R6 routing: T = 128, E = 5, K = 3 (384 routed slots), token t -> {t%5, (t+1)%5,
// (t+3)%5}, so every expert gets a count that is not a multiple of 8.
std::vector<std::vector<int64_t>> r4_routes() {
  std::vector<std::vector<int64_t>> r(128);
  for (int64_t t = 0; t < 128; ++t) {
    r[t] = {t % 5, (t + 1) % 5, (t + 3) % 5};
    std::sort(r[t].begin(), r[t].end());
  }
  return r;
}

}  // namespace

// --- Properties
// -----------------------------------------------------------------------------------

// Every alignment size of SPEC §12 on random routings, through the full reference check
// (invariants, layout, finite differences of both backwards).
RC_GTEST_PROP(TokenDispatchProps, AlignmentSizesPassReferenceChecks, ()) {
  for (const OpInfo* op : {&dispatch_op(), &combine_op()}) {
    Case c = *op->gen();
    const int64_t a = *rc::gen::element<int64_t>(0, 1, 8, 16, 128);
    c.set("align_size", a);
    if (a > 0) c.set("drop_overflow", false);
    if (a >= 16) c.set("H", std::min<int64_t>(c.i("H"), 3));
    c.set("num_out_tokens", std::max(c.i("num_out_tokens"), c.i("T") * c.i("K")));
    RC_TAG(a);
    const Report r = check_reference(*op, c);
    if (!r.ok()) RC_FAIL(failure(c, r));
  }
}

// Capacities below the routed count: an error without drop_overflow; with it exactly the first
// N_out rows of the expert-major order are kept and every check passes.
RC_GTEST_PROP(TokenDispatchProps, CapacityBelowRoutedCount, ()) {
  Case c = *dispatch_op().gen();
  const int64_t T = std::max<int64_t>(c.i("T"), 1), K = std::max<int64_t>(c.i("K"), 1);
  c.set("T", T).set("K", K).set("ragged", false).set("align_size", int64_t{0});
  c.set("num_out_tokens", *rc::gen::inRange<int64_t>(0, T * K));
  c.set("drop_overflow", false);
  const TensorMap in = dispatch_op().make_inputs(c);
  const std::string msg = error_of([&] { dispatch_op().reference(c, in, false); });
  RC_ASSERT(msg.find("num_out_tokens") != std::string::npos);
  c.set("drop_overflow", true);
  const Report r = check_reference(dispatch_op(), c);
  if (!r.ok()) RC_FAIL(failure(c, r));
  const TensorMap out = dispatch_op().reference(c, dispatch_op().make_inputs(c), false);
  const Tensor& tpe = out.at("output.tokens_per_expert");
  double kept = 0;
  for (int64_t e = 0; e < tpe.numel(); ++e) kept += tpe.at(e);
  RC_ASSERT(kept == static_cast<double>(c.i("num_out_tokens")));
}

// combine(dispatch(x)) with merging weights 1/n_t on the routed entries is x (SPEC §5 edge case,
// §12), within the reduction bound; without weights it is n_t * x exactly.
RC_GTEST_PROP(TokenDispatchProps, RoundTripWithUniformWeightsIsIdentity, ()) {
  const DType d = *rc::gen::element(DType::f32, DType::bf16, DType::f16);
  const int64_t E = *rc::gen::element<int64_t>(1, 3, 7, 8), T = *rc::gen::inRange<int64_t>(0, 16);
  const int64_t K = *rc::gen::inRange<int64_t>(0, E + 1), H = *rc::gen::element<int64_t>(1, 4, 257);
  const int64_t a = *rc::gen::element<int64_t>(0, 1, 8, 16, 128);
  Case c;
  c.seed = *rc::gen::arbitrary<uint32_t>();
  const auto routes = make_routes(c, T, E, K, true, "routes");
  const Tensor map = map_of(E, routes);
  const Tensor x = normal(d, {T, H}, "x", c.seed);
  const auto f = ref::token_dispatch_fwd(x, map, nullptr, dparams(T * K, a));
  const Tensor* pad = f.pad_offsets ? &*f.pad_offsets : nullptr;
  Tensor w(DType::f32, {T, E});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e : routes[t]) w.set(t, e, 1.0 / static_cast<double>(routes[t].size()));
  const Tensor y = ref::token_combine_fwd(f.permuted, f.row_id_map, &w, pad);
  const Tensor y1 = ref::token_combine_fwd(f.permuted, f.row_id_map, nullptr, pad);
  for (int64_t t = 0; t < T; ++t) {
    const auto n = static_cast<int64_t>(routes[t].size());
    for (int64_t h = 0; h < H; ++h) {
      const double want = n ? x.at(t, h) : 0.0;
      RC_ASSERT(std::fabs(y.at(t, h) - want) <=
                tol_bound(TolClass::reduction, d, want, n, std::fabs(x.at(t, h))));
      RC_ASSERT(y1.at(t, h) == round_to(d, static_cast<double>(n) * x.at(t, h)));
    }
  }
}

// --- Edge cases named in the brief
// -----------------------------------------------------------------

TEST(TokenDispatch, ZeroTokensAllToOneAndOddSizesPassReferenceChecks) {
  std::vector<Case> cases;
  for (const char* op : {"token_dispatch", "token_combine"}) {
    for (int64_t a : {0, 16}) {
      Case z;
      z.op = op;
      z.regime = Regime::zero_tokens;
      z.seed = 3;
      z.set("T", int64_t{0}).set("E", int64_t{4}).set("K", int64_t{2}).set("H", int64_t{8});
      z.set("ragged", false).set("num_out_tokens", int64_t{0}).set("align_size", a);
      z.set("drop_overflow", false).set("probs_dtype", "float32").set("merging_dtype", "float32");
      cases.push_back(z);
      Case one = z;  // every token on one expert
      one.regime = Regime::all_to_one;
      one.set("T", int64_t{9}).set("K", int64_t{1}).set("num_out_tokens", int64_t{9});
      cases.push_back(one);
      Case odd = z;  // E = 7, H = 257, empty experts, ragged rows
      odd.regime = Regime::zero_tokens;
      odd.dtype = DType::bf16;
      odd.set("T", int64_t{6}).set("E", int64_t{7}).set("K", int64_t{3}).set("H", int64_t{257});
      odd.set("ragged", true).set("num_out_tokens", int64_t{20});
      cases.push_back(odd);
    }
  }
  for (const Case& c : cases) {
    const Report r = check_reference(*find_op(c.op), c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

TEST(TokenDispatch, RowIdMapLayoutOfAKnownRouting) {
  // T = 3, E = 4: token 0 -> {1, 3}, token 1 -> {}, token 2 -> {0, 1, 3}; a = 2.
  const Tensor map = map_of(4, {{1, 3}, {}, {0, 1, 3}});
  Tensor x(DType::f32, {3, 2});
  for (int64_t i = 0; i < 6; ++i) x.set(i, static_cast<double>(i + 1));
  const auto f = ref::token_dispatch_fwd(x, map, nullptr, dparams(5, 2));
  // c = (1, 2, 0, 2), chat = (2, 2, 0, 2), pad_off = (0, 1, 1, 1); u: e0 {t2: 0}, e1 {t0: 1,
  // t2: 2}, e3 {t0: 3, t2: 4}. R_out = floor((5 + 4)/2)*2 = 8.
  const std::vector<double> rim = {3,  1,  -1, -1, 3,  1,  -1, -1, 2,  //
                                   -1, -1, -1, -1, -1, -1, -1, -1, 0,  //
                                   4,  2,  0,  -1, 3,  1,  0,  -1, 3};
  EXPECT_EQ(f.row_id_map.values(), rim);
  EXPECT_EQ(f.tokens_per_expert.values(), (std::vector<double>{2, 2, 0, 2}));
  ASSERT_TRUE(f.pad_offsets);
  EXPECT_EQ(f.pad_offsets->values(), (std::vector<double>{0, 1, 1, 1}));
  ASSERT_EQ(f.permuted.shape(), (Shape{8, 2}));
  // Rows: e0 [x2, pad], e1 [x0, x2], e3 [x0, x2], tail [0, 0].
  EXPECT_EQ(f.permuted.values(),
            (std::vector<double>{5, 6, 0, 0, 1, 2, 5, 6, 1, 2, 5, 6, 0, 0, 0, 0}));
}

// --- Regression cases (SPEC §13)
// ------------------------------------------------------------------

// R4: combine backward with merging probs and pad_offsets must zero every padding and tail row of
// grad permuted (TE left them uninitialized; JAX only zeroes NaNs).
TEST(Regression, R4_CombineBackwardZeroesUnmappedRows) {
  const auto routes = r4_routes();
  const Tensor map = map_of(5, routes);
  const Tensor x = normal(DType::f32, {128, 16}, "x");
  const auto f = ref::token_dispatch_fwd(x, map, nullptr, dparams(384, 8));
  ASSERT_EQ(f.permuted.dim(0), 416);
  Tensor mp = normal(DType::f32, {128, 5}, "merging_probs");
  // Permuted rows that combine never reads carry NaN: if the backward copied from them or left
  // them unwritten, the check below would see it.
  Tensor permuted = f.permuted.clone();
  std::vector<uint8_t> mapped(416, 0);
  for (int64_t t = 0; t < 128; ++t)
    for (int64_t k = 0; k < 3; ++k) {
      const auto e = static_cast<int64_t>(f.row_id_map.at(t, 5 + k));
      mapped[static_cast<int64_t>(f.row_id_map.at(t, k) + f.pad_offsets->at(e))] = 1;
    }
  int64_t unmapped = 0;
  for (int64_t r = 0; r < 416; ++r) {
    if (mapped[r]) continue;
    ++unmapped;
    for (int64_t h = 0; h < 16; ++h) permuted.set(r, h, std::nan(""));
  }
  EXPECT_EQ(unmapped, 416 - 384);
  const Tensor ct = normal(DType::f32, {128, 16}, "ct");
  const auto b = ref::token_combine_bwd(ct, permuted, f.row_id_map, &mp, &*f.pad_offsets);
  ASSERT_EQ(b.grad_permuted.shape(), (Shape{416, 16}));
  for (int64_t r = 0; r < 416; ++r) {
    for (int64_t h = 0; h < 16; ++h) {
      const double g = b.grad_permuted.at(r, h);
      if (mapped[r]) {
        EXPECT_TRUE(std::isfinite(g)) << "row " << r;
      } else {
        EXPECT_TRUE(g == 0.0 && !std::signbit(g)) << "padding/tail row " << r << " = " << g;
      }
    }
  }
  ASSERT_TRUE(b.grad_merging_probs);
  for (int64_t i = 0; i < b.grad_merging_probs->numel(); ++i) {
    EXPECT_TRUE(std::isfinite(b.grad_merging_probs->at(i)));
  }
  // The registry cases R4_* run the same shapes through the full reference check.
  for (const Case& c : combine_op().named()) {
    if (c.s("name").rfind("R4", 0) != 0) continue;
    const Report r = check_reference(combine_op(), c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

// R6: combine backward without merging probs returns exactly R_in rows (416 for a = 8), never a
// size recomputed from a hard-coded align_size = 128 (896 rows).
TEST(Regression, R6_CombineBackwardKeepsTheForwardRowCount) {
  const auto routes = r4_routes();
  const Tensor map = map_of(5, routes);
  const Tensor x = normal(DType::bf16, {128, 16}, "x");
  const Tensor ct = normal(DType::bf16, {128, 16}, "ct");
  const std::vector<std::pair<int64_t, int64_t>> want_rows = {
      {1, 384}, {8, 416}, {16, 448}, {128, 896}};  // a = 128: E(a-1) = 635 > N = 384
  for (auto [a, rows] : want_rows) {
    SCOPED_TRACE("align_size=" + std::to_string(a));
    EXPECT_EQ(dispatch_out_rows(384, 5, a), rows);
    const auto f = ref::token_dispatch_fwd(x, map, nullptr, dparams(384, a));
    ASSERT_EQ(f.permuted.dim(0), rows);
    const auto b = ref::token_combine_bwd(ct, f.permuted, f.row_id_map, nullptr, &*f.pad_offsets);
    ASSERT_EQ(b.grad_permuted.shape(), (Shape{rows, 16}));
    // Equals the reference: ct[t] at dst(t,e), zero elsewhere (a scatter of ct through the map).
    Tensor want(DType::bf16, {rows, 16});
    for (int64_t t = 0; t < 128; ++t)
      for (int64_t k = 0; k < 3; ++k) {
        const auto e = static_cast<int64_t>(f.row_id_map.at(t, 5 + k));
        const auto dst = static_cast<int64_t>(f.row_id_map.at(t, k) + f.pad_offsets->at(e));
        for (int64_t h = 0; h < 16; ++h) want.set(dst, h, ct.at(t, h));
      }
    EXPECT_TRUE(b.grad_permuted.bitwise_equal(want));
  }
  // The backward takes its row count from the forward input alone: any R_in works.
  const auto f = ref::token_dispatch_fwd(x, map, nullptr, dparams(384, 8));
  Tensor bigger(DType::bf16, {1000, 16});
  const auto b = ref::token_combine_bwd(ct, bigger, f.row_id_map, nullptr, &*f.pad_offsets);
  EXPECT_EQ(b.grad_permuted.dim(0), 1000);
}

// R8: num_out_tokens is checked first (before shapes, map values or any allocation); N_out = 0
// needs an all-zero map; align_size = 0 never divides by zero.
TEST(Regression, R8_NumOutTokensValidatedFirst) {
  Tensor bad_map(DType::i32, {4, 3});
  bad_map.set(0, 0, 7.0);                  // an invalid value that must not be what fails
  const Tensor x3(DType::f32, {4, 2, 2});  // and a wrong rank
  const std::string msg =
      error_of([&] { ref::token_dispatch_fwd(x3, bad_map, nullptr, dparams(-1)); });
  EXPECT_THAT(msg, HasSubstr("num_out_tokens"));
  EXPECT_THAT(msg, HasSubstr("-1"));
  EXPECT_THAT(error_of([] { dispatch_out_rows(-1, 4, 8); }), HasSubstr("num_out_tokens"));

  const Tensor x(DType::f32, {4, 2});
  Tensor map(DType::boolean, {4, 3});
  const auto empty = ref::token_dispatch_fwd(x, map, nullptr, dparams(0));
  EXPECT_EQ(empty.permuted.dim(0), 0);
  EXPECT_EQ(empty.row_id_map.at(0, 6), 0.0);  // n_t = 0
  map.set(2, 1, 1.0);
  EXPECT_THAT(error_of([&] { ref::token_dispatch_fwd(x, map, nullptr, dparams(0)); }),
              HasSubstr("num_out_tokens"));
  // a = 0 is "off": R_out = N_out, no pad_offsets, no division.
  EXPECT_EQ(dispatch_out_rows(7, 3, 0), 7);
  const auto off = ref::token_dispatch_fwd(x, map, nullptr, dparams(1, 0));
  EXPECT_FALSE(off.pad_offsets);
  EXPECT_EQ(off.permuted.dim(0), 1);
}

// R11: 300 routed slots, N_out = 256. Without drop_overflow: an error naming num_out_tokens
// (TE-JAX writes out of bounds). With it: dst >= 256 dropped and their combine contributes 0.
TEST(Regression, R11_CapacityBelowRoutedCount) {
  std::vector<std::vector<int64_t>> routes(100);
  for (int64_t t = 0; t < 100; ++t) routes[t] = {t % 8, (t + 2) % 8, (t + 5) % 8};
  for (auto& r : routes) std::sort(r.begin(), r.end());
  const Tensor map = map_of(8, routes);
  const Tensor x = normal(DType::f32, {100, 4}, "x");
  const Tensor probs = normal(DType::f32, {100, 8}, "probs");
  const std::string msg = error_of([&] { ref::token_dispatch_fwd(x, map, &probs, dparams(256)); });
  EXPECT_THAT(msg, HasSubstr("num_out_tokens"));
  EXPECT_THAT(msg, HasSubstr("300"));

  const auto f = ref::token_dispatch_fwd(x, map, &probs, dparams(256, 0, true));
  ASSERT_EQ(f.permuted.dim(0), 256);
  double kept = 0;
  for (int64_t e = 0; e < 8; ++e) kept += f.tokens_per_expert.at(e);
  EXPECT_EQ(kept, 256.0);
  // Expected kept set: u(t,e) < 256 in the expert-major order (u counts every routed slot).
  std::vector<int64_t> count(8, 0), ustart(8, 0), rank(8, 0);
  for (auto& r : routes)
    for (int64_t e : r) ++count[e];
  for (int64_t e = 1; e < 8; ++e) ustart[e] = ustart[e - 1] + count[e - 1];
  int64_t dropped_tokens = 0;
  const Tensor ct = normal(DType::f32, {100, 4}, "ct");
  const Tensor combined = ref::token_combine_fwd(f.permuted, f.row_id_map, nullptr, nullptr);
  const Tensor ctp = normal(DType::f32, {256}, "ctp");
  const auto b = ref::token_dispatch_bwd(f.permuted, &ctp, f.row_id_map, nullptr);
  for (int64_t t = 0; t < 100; ++t) {
    int64_t n_kept = 0;
    for (int64_t e : routes[t]) {
      const bool keep = ustart[e] + rank[e]++ < 256;
      n_kept += keep;
      if (!keep) EXPECT_EQ(b.grad_probs->at(t, e), 0.0) << "dropped (" << t << ", " << e << ")";
    }
    dropped_tokens += n_kept < 3;
    EXPECT_EQ(f.row_id_map.at(t, 16), static_cast<double>(n_kept)) << "token " << t;
    for (int64_t k = n_kept; k < 8; ++k) EXPECT_EQ(f.row_id_map.at(t, k), -1.0);
    for (int64_t h = 0; h < 4; ++h) {
      EXPECT_EQ(combined.at(t, h), round_to(DType::f32, n_kept * x.at(t, h)))
          << "the dropped slots must contribute 0";
    }
  }
  EXPECT_GT(dropped_tokens, 0);
  // drop_overflow is an error together with padding.
  EXPECT_THAT(error_of([&] { ref::token_dispatch_fwd(x, map, &probs, dparams(256, 8, true)); }),
              HasSubstr("drop_overflow"));
}

// R12: probs[3,e] == 0 for a routed e writes a zero row (TE compatibility); the backward still
// routes ct[dst(3,e)] into grad x[3]; finite differences exclude the slot.
TEST(Regression, R12_ZeroProbQuirk) {
  const Tensor map = map_of(4, {{0, 2}, {1}, {2, 3}, {0, 1, 3}, {3}});
  const Tensor x = normal(DType::bf16, {5, 6}, "x");
  Tensor probs(DType::f32, {5, 4});
  probs.fill(0.5);
  probs.set(3, 1, 0.0);
  probs.set(3, 3, -0.0);  // the negative zero counts too
  const auto f = ref::token_dispatch_fwd(x, map, &probs, dparams(9, 4));
  // dst(3,1) and dst(3,3): token 3 is expert 1's second token and expert 3's second token.
  const int64_t dst31 = static_cast<int64_t>(f.row_id_map.at(3, 1) + f.pad_offsets->at(1));
  const int64_t dst33 = static_cast<int64_t>(f.row_id_map.at(3, 0) + f.pad_offsets->at(3));
  const int64_t dst30 = static_cast<int64_t>(f.row_id_map.at(3, 2) + f.pad_offsets->at(0));
  ASSERT_EQ(f.row_id_map.at(3, 5), 1.0);
  ASSERT_EQ(f.row_id_map.at(3, 4), 3.0);
  for (int64_t h = 0; h < 6; ++h) {
    EXPECT_EQ(f.permuted.at(dst31, h), 0.0);
    EXPECT_EQ(f.permuted.at(dst33, h), 0.0);
    EXPECT_EQ(f.permuted.at(dst30, h), x.at(3, h));  // the non-zero slot is a real copy
  }
  EXPECT_EQ(f.permuted_probs->at(dst31), 0.0);
  // Backward: ct rows 1, 2 and 3 at the three slots; grad x[3] = their sum, quirk slots included.
  Tensor ct(DType::bf16, f.permuted.shape());
  for (int64_t h = 0; h < 6; ++h) {
    ct.set(dst31, h, 1.0);
    ct.set(dst33, h, 2.0);
    ct.set(dst30, h, 4.0);
  }
  const auto b = ref::token_dispatch_bwd(ct, nullptr, f.row_id_map, &*f.pad_offsets);
  for (int64_t h = 0; h < 6; ++h) EXPECT_EQ(b.grad_x.at(3, h), 7.0);
  // The record's finite-difference masks exclude the zero-prob slots and token 3's x row.
  TensorMap in;
  in.emplace("input.x", x.clone());
  in.emplace("input.routing_map", map.clone());
  in.emplace("input.probs", probs.clone());
  const TensorMap masks = dispatch_op().fd_masks(Case{}, in);
  EXPECT_EQ(masks.at("input.probs").at(3, 1), 0.0);
  EXPECT_EQ(masks.at("input.probs").at(3, 3), 0.0);
  EXPECT_EQ(masks.at("input.probs").at(3, 0), 1.0);
  EXPECT_EQ(masks.at("input.x").at(3, 0), 0.0);
  EXPECT_EQ(masks.at("input.x").at(2, 0), 1.0);
  for (const Case& c : dispatch_op().named()) {
    if (c.s("name").rfind("R12", 0) != 0) continue;
    const Report r = check_reference(dispatch_op(), c);
    EXPECT_TRUE(r.ok()) << failure(c, r);
  }
}

// --- Errors: one test per SPEC §4.5 / §5 error
// -----------------------------------------------------

TEST(TokenDispatchErrors, XNot2D) {
  EXPECT_THAT(error_of([] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {4}), Tensor(DType::boolean, {4, 2}),
                                        nullptr, dparams(4));
              }),
              HasSubstr("x"));
}

TEST(TokenDispatchErrors, TokenCountMismatch) {
  EXPECT_THAT(error_of([] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {4, 3}), Tensor(DType::boolean, {5, 2}),
                                        nullptr, dparams(4));
              }),
              HasSubstr("routing_map"));
}

TEST(TokenDispatchErrors, RoutingMapValueOutsideZeroOne) {
  Tensor map(DType::i32, {3, 2});
  map.set(1, 1, 2.0);
  const std::string msg = error_of([&] {
    ref::token_dispatch_fwd(Tensor(DType::f32, {3, 2}), map, nullptr, dparams(6));
  });
  EXPECT_THAT(msg, HasSubstr("routing_map"));
  EXPECT_THAT(msg, HasSubstr("2"));
}

TEST(TokenDispatchErrors, ProbsShape) {
  const Tensor probs(DType::f32, {3, 3});
  EXPECT_THAT(error_of([&] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {3, 2}), Tensor(DType::boolean, {3, 2}),
                                        &probs, dparams(6));
              }),
              HasSubstr("probs"));
}

TEST(TokenDispatchErrors, NegativeAlignSize) {
  EXPECT_THAT(error_of([] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {3, 2}), Tensor(DType::boolean, {3, 2}),
                                        nullptr, dparams(6, -1));
              }),
              HasSubstr("align_size"));
}

TEST(TokenDispatchErrors, CapacityBelowRoutedCount) {
  Tensor map(DType::boolean, {3, 2});
  map.fill(1.0);
  EXPECT_THAT(error_of([&] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {3, 2}), map, nullptr, dparams(5));
              }),
              HasSubstr("num_out_tokens"));
}

TEST(TokenDispatchErrors, NegativeNumOutTokens) {
  EXPECT_THAT(error_of([] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {3, 2}), Tensor(DType::boolean, {3, 2}),
                                        nullptr, dparams(-4));
              }),
              HasSubstr("num_out_tokens"));
}

TEST(TokenDispatchErrors, DropOverflowWithPadding) {
  EXPECT_THAT(error_of([] {
                ref::token_dispatch_fwd(Tensor(DType::f32, {3, 2}), Tensor(DType::boolean, {3, 2}),
                                        nullptr, dparams(6, 4, true));
              }),
              HasSubstr("drop_overflow"));
}

TEST(TokenCombineErrors, RowIdMapColumnCountNotOdd) {
  EXPECT_THAT(error_of([] {
                ref::token_combine_fwd(Tensor(DType::f32, {4, 2}), Tensor(DType::i32, {3, 4}),
                                       nullptr, nullptr);
              }),
              HasSubstr("row_id_map"));
}

TEST(TokenCombineErrors, MergingProbsShape) {
  const Tensor mp(DType::f32, {3, 3});
  EXPECT_THAT(error_of([&] {
                ref::token_combine_fwd(Tensor(DType::f32, {4, 2}), Tensor(DType::i32, {3, 5}), &mp,
                                       nullptr);
              }),
              HasSubstr("merging_probs"));
}

TEST(TokenCombineErrors, PadOffsetsLength) {
  const Tensor pad(DType::i32, {3});
  EXPECT_THAT(error_of([&] {
                ref::token_combine_fwd(Tensor(DType::f32, {4, 2}), Tensor(DType::i32, {3, 5}),
                                       nullptr, &pad);
              }),
              HasSubstr("pad_offsets"));
}

TEST(TokenCombineErrors, SourceRowBeyondInput) {
  const Tensor map = map_of(2, {{0, 1}, {1}});
  const auto f = ref::token_dispatch_fwd(Tensor(DType::f32, {2, 2}), map, nullptr, dparams(3, 4));
  // R_out = 8, but a permuted of 5 rows cannot hold expert 1's rows (physical rows 4 and 5).
  const std::string msg = error_of([&] {
    ref::token_combine_fwd(Tensor(DType::f32, {5, 2}), f.row_id_map, nullptr, &*f.pad_offsets);
  });
  EXPECT_THAT(msg, HasSubstr("row_id_map"));
  EXPECT_THAT(msg, HasSubstr("R_in=5"));
  EXPECT_THAT(error_of([&] {
                ref::token_combine_bwd(Tensor(DType::f32, {2, 2}), Tensor(DType::f32, {5, 2}),
                                       f.row_id_map, nullptr, &*f.pad_offsets);
              }),
              HasSubstr("row_id_map"));
}

TEST(TokenCombineErrors, CotangentShape) {
  const Tensor map = map_of(2, {{0, 1}, {1}});
  const auto f = ref::token_dispatch_fwd(Tensor(DType::f32, {2, 2}), map, nullptr, dparams(3));
  EXPECT_THAT(error_of([&] {
                ref::token_combine_bwd(Tensor(DType::f32, {3, 2}), f.permuted, f.row_id_map,
                                       nullptr, nullptr);
              }),
              HasSubstr("grad_combined"));
}
