// sort_chunks_by_index reference tests (SPEC §7): the map/inverse properties of §12, the R14
// two-map form, regression R1 and one test per §7 error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <numeric>

#include "harness/core/rng.h"
#include "harness/ops/check.h"
#include "harness/ops/perm_family.h"
#include "reference/sort_chunks.h"

using namespace moe;
using namespace moe::ops;
using ::testing::HasSubstr;

namespace {

const OpInfo& op() {
  return *find_op("sort_chunks_by_index");
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

Tensor ints(DType d, const std::vector<int64_t>& v) {
  Tensor t(d, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return t;
}

Tensor row_index_x(DType d, int64_t N, int64_t H) {
  Tensor x(d, {N, H});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h) x.set(i, h, static_cast<double>(i + 1));
  return x;
}

}  // namespace

// Random chunkings: map then inverse is the identity (padding rows included), rows >= V are fixed
// points, the backward is the gather through the same map, and TE's two-map form (R14) agrees.
RC_GTEST_PROP(SortChunksProps, MapInverseAndTwoMapForm, ()) {
  const int64_t C = *rc::gen::inRange<int64_t>(1, 10);
  std::vector<int64_t> split(C), order(C);
  for (auto& s : split) s = *rc::gen::inRange<int64_t>(0, 7);
  std::iota(order.begin(), order.end(), int64_t{0});
  for (int64_t i = C - 1; i > 0; --i)
    std::swap(order[i], order[*rc::gen::inRange<int64_t>(0, i + 1)]);
  const int64_t V = std::accumulate(split.begin(), split.end(), int64_t{0});
  const int64_t N = V + *rc::gen::inRange<int64_t>(0, 6);
  const DType d = *rc::gen::element(DType::f32, DType::bf16, DType::f16);
  Tensor x(d, {N, 3});
  Rng rng(*rc::gen::arbitrary<uint32_t>(), "x");
  fill_normal(x, rng, 1.0);
  Tensor probs(DType::f32, {N});
  fill_uniform(probs, rng, 0.0, 1.0);
  const auto f =
      ref::sort_chunks_by_index_fwd(x, ints(DType::i64, split), ints(DType::i32, order), &probs);
  RC_ASSERT(ref::sort_chunks_by_map(f.sorted, f.row_id_map, true).bitwise_equal(x));
  RC_ASSERT(ref::sort_chunks_by_map(*f.sorted_probs, f.row_id_map, true).bitwise_equal(probs));
  for (int64_t i = V; i < N; ++i) RC_ASSERT(f.row_id_map.at(i) == static_cast<double>(i));
  // Backward: grad x[i] = ct[dst(i)] with ct = arange.
  Tensor ct(DType::f32, {N, 1});
  for (int64_t i = 0; i < N; ++i) ct.set(i, static_cast<double>(i));
  const auto b = ref::sort_chunks_by_index_bwd(ct, nullptr, f.row_id_map);
  for (int64_t i = 0; i < N; ++i) RC_ASSERT(b.grad_x.at(i) == f.row_id_map.at(i));
  // R14: map2 from (split[sorted_indices], argsort(sorted_indices)) is the inverse of map1.
  std::vector<int64_t> split2(C), order2(C);
  for (int64_t j = 0; j < C; ++j) {
    split2[j] = split[order[j]];
    order2[order[j]] = j;
  }
  const Tensor map2 =
      ref::make_chunk_sort_map(ints(DType::i32, split2), ints(DType::i32, order2), N);
  for (int64_t i = 0; i < N; ++i) {
    RC_ASSERT(map2.at(static_cast<int64_t>(f.row_id_map.at(i))) == static_cast<double>(i));
  }
  RC_ASSERT(ref::sort_chunks_by_map(f.sorted, map2, false).bitwise_equal(x));
}

TEST(SortChunks, IdentityOrderWithoutPaddingIsIdentity) {
  const Tensor x = row_index_x(DType::bf16, 12, 4);
  const auto f = ref::sort_chunks_by_index_fwd(x, ints(DType::i32, {5, 0, 7}),
                                               ints(DType::i32, {0, 1, 2}), nullptr);
  EXPECT_TRUE(f.sorted.bitwise_equal(x));
  const auto one = ref::sort_chunks_by_index_fwd(x, ints(DType::i32, {12}), ints(DType::i32, {0}),
                                                 nullptr);  // C = 1
  EXPECT_TRUE(one.sorted.bitwise_equal(x));
}

// R1 (PR-A): padding rows i >= V map to themselves. Before the fix they went to i - V and
// overwrote valid rows 0..39.
TEST(Regression, R1_SortChunksPaddingRows) {
  for (DType d : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    const Tensor x = row_index_x(d, 100, 8);
    const auto f = ref::sort_chunks_by_index_fwd(x, ints(DType::i32, {7, 0, 20, 33}),
                                                 ints(DType::i32, {2, 0, 3, 1}), nullptr);
    // Chunks: 0 = rows [0,7), 1 = [], 2 = [7,27), 3 = [27,60). Emitted as 2, 0, 3, 1.
    std::vector<int64_t> src;
    for (int64_t i = 7; i < 27; ++i) src.push_back(i);
    for (int64_t i = 0; i < 7; ++i) src.push_back(i);
    for (int64_t i = 27; i < 60; ++i) src.push_back(i);
    for (int64_t i = 60; i < 100; ++i) src.push_back(i);
    for (int64_t j = 0; j < 100; ++j)
      for (int64_t h = 0; h < 8; ++h) ASSERT_EQ(f.sorted.at(j, h), src[j] + 1.0) << "row " << j;
    for (int64_t i = 60; i < 100; ++i) EXPECT_EQ(f.row_id_map.at(i), static_cast<double>(i));
    // Backward with ct = arange: grad x[i] = ct[dst(i)], and grad x[60:] = ct[60:].
    Tensor ct(d, {100, 8});
    for (int64_t i = 0; i < 100; ++i)
      for (int64_t h = 0; h < 8; ++h) ct.set(i, h, static_cast<double>(i));
    const auto b = ref::sort_chunks_by_index_bwd(ct, nullptr, f.row_id_map);
    for (int64_t i = 0; i < 100; ++i) {
      const double want = i >= 60 ? static_cast<double>(i) : f.row_id_map.at(i);
      for (int64_t h = 0; h < 8; ++h) ASSERT_EQ(b.grad_x.at(i, h), want) << "row " << i;
    }
    // V = 0 is the identity; V = N_rows has no padding rows.
    const auto v0 = ref::sort_chunks_by_index_fwd(x, ints(DType::i32, {0, 0, 0, 0}),
                                                  ints(DType::i32, {2, 0, 3, 1}), nullptr);
    EXPECT_TRUE(v0.sorted.bitwise_equal(x));
    const Tensor x60 = row_index_x(d, 60, 8);
    const auto full = ref::sort_chunks_by_index_fwd(x60, ints(DType::i32, {7, 0, 20, 33}),
                                                    ints(DType::i32, {2, 0, 3, 1}), nullptr);
    for (int64_t j = 0; j < 60; ++j) EXPECT_EQ(full.sorted.at(j, 0), src[j] + 1.0);
  }
  for (const Case& c : op().named()) {
    if (c.s("name").rfind("R1", 0) != 0) continue;
    const Report r = check_reference(op(), c);
    EXPECT_TRUE(r.ok()) << c.line() << "\n" << r.str() << replay_line(c, "reference");
  }
}

// --- Errors: one test per SPEC §7 error
// -----------------------------------------------------------

TEST(SortChunksErrors, NegativeSplitSize) {
  const std::string msg = error_of([] {
    ref::sort_chunks_by_index_fwd(Tensor(DType::f32, {8, 2}), ints(DType::i32, {3, -1}),
                                  ints(DType::i32, {1, 0}), nullptr);
  });
  EXPECT_THAT(msg, HasSubstr("split_sizes"));
  EXPECT_THAT(msg, HasSubstr("-1"));
}

TEST(SortChunksErrors, SplitSumBeyondRows) {
  const std::string msg = error_of([] {
    ref::sort_chunks_by_index_fwd(Tensor(DType::f32, {8, 2}), ints(DType::i64, {5, 4}),
                                  ints(DType::i32, {1, 0}), nullptr);
  });
  EXPECT_THAT(msg, HasSubstr("split_sizes"));
  EXPECT_THAT(msg, HasSubstr("9"));
}

TEST(SortChunksErrors, SortedIndicesNotAPermutation) {
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{0, 0, 2}, {0, 1, 3}, {-1, 1, 2}}) {
    EXPECT_THAT(error_of([&] {
                  ref::sort_chunks_by_index_fwd(Tensor(DType::f32, {8, 2}),
                                                ints(DType::i32, {1, 2, 3}), ints(DType::i32, bad),
                                                nullptr);
                }),
                HasSubstr("sorted_indices"));
  }
}

TEST(SortChunksErrors, LengthMismatch) {
  EXPECT_THAT(error_of([] {
                ref::sort_chunks_by_index_fwd(Tensor(DType::f32, {8, 2}),
                                              ints(DType::i32, {1, 2, 3}), ints(DType::i32, {1, 0}),
                                              nullptr);
              }),
              HasSubstr("sorted_indices"));
}

TEST(SortChunksErrors, ProbsLength) {
  const Tensor probs(DType::f32, {7});
  EXPECT_THAT(error_of([&] {
                ref::sort_chunks_by_index_fwd(Tensor(DType::f32, {8, 2}), ints(DType::i32, {4}),
                                              ints(DType::i32, {0}), &probs);
              }),
              HasSubstr("probs"));
}

TEST(SortChunksErrors, MapNotABijection) {
  EXPECT_THAT(
      error_of([] {
        ref::sort_chunks_by_map(Tensor(DType::f32, {3, 2}), ints(DType::i32, {0, 2, 2}), true);
      }),
      HasSubstr("row_id_map"));
}
