// Expert-parallel reference tests (SPEC §9): buffer sizing (§9.5) including the align_size > 0
// worst case, the dispatch -> exchange -> local permute -> back round trip over P simulated
// ranks, regression cases R3 and R14, and one test per error of §9. Random and named cases of
// the four EP records (finite differences, invariants, schema) run in test_registry.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <numeric>

#include "harness/core/params/dispatch.h"
#include "harness/core/params/ep.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "reference/ep.h"
#include "reference/sort_chunks.h"

using namespace moe;
using moe::ops::any_in;
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

Tensor counts(int64_t P, int64_t E, const std::vector<int64_t>& v) {
  Tensor t(DType::i32, {P, E});
  for (int64_t i = 0; i < P * E; ++i) t.set(i, static_cast<double>(v.at(i)));
  return t;
}

Tensor ivec(const std::vector<int64_t>& v) {
  Tensor t(DType::i32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return t;
}

std::vector<ref::RaggedA2AParams> all_params(const Tensor& A, int64_t P, A2ADirection dir) {
  std::vector<ref::RaggedA2AParams> v;
  for (int64_t s = 0; s < P; ++s) v.push_back(ref::ragged_a2a_params(A, s, P, dir));
  return v;
}

// Rank i's dispatch buffer [rows, 3] for counts A: expert-major rows tagged (rank, expert, index),
// every row past sum_e A[i,e] zero.
Tensor tagged_buffer(const Tensor& A, int64_t i, int64_t rows) {
  Tensor b(DType::f32, {rows, 3});
  int64_t r = 0;
  for (int64_t e = 0; e < A.dim(1); ++e) {
    for (int64_t o = 0; o < static_cast<int64_t>(A.at(i, e)); ++o, ++r) {
      b.set(r, 0, static_cast<double>(i + 1));
      b.set(r, 1, static_cast<double>(e));
      b.set(r, 2, static_cast<double>(o));
    }
  }
  return b;
}

std::vector<Tensor> zeros(int64_t P, int64_t rows, int64_t H, DType d = DType::f32) {
  std::vector<Tensor> v;
  for (int64_t s = 0; s < P; ++s) v.emplace_back(d, Shape{rows, H});
  return v;
}

// The R3 routing (SPEC §13): on every rank token 0 -> {0,2}, token 1 -> {1,3}, tokens 2..15 ->
// {2,3}; E = 8, a = 16. Counts per rank: (1,1,15,15,0,0,0,0), aligned (16,16,16,16,0,0,0,0).
Tensor r3_counts() {
  std::vector<int64_t> c;
  for (int s = 0; s < 2; ++s) {
    for (int64_t n : {1, 1, 15, 15, 0, 0, 0, 0}) c.push_back(dispatch_aligned_count(n, 16));
  }
  return counts(2, 8, c);
}

}  // namespace

// --- §9.5 sizing --------------------------------------------------------------------------------

TEST(EpSizing, RecvRowsFormula) {
  // R3: B = 2, S = 16, K = 2, P = 2, D = 1, E = 8, a = 16 -> 64 + 8*15 = 184.
  EXPECT_EQ(recv_rows(2, 16, 2, 2, 1, 8, 16), 184);
  EXPECT_EQ(recv_rows(2, 16, 2, 2, 1, 8, 0), 64);
  EXPECT_EQ(recv_rows(4, 16, 2, 2, 2, 8, 1), 64);  // a = 1 pads nothing: E*(a-1) = 0
  EXPECT_EQ(recv_rows(4, 3, 2, 2, 2, 8, 4), 2 * 3 * 2 + 8 * 3);
  const EpShape s{2, 16, 2, 2, 1, 8, 16};
  EXPECT_EQ(shard_rows(s), 32);
  EXPECT_EQ(pre_a2a_rows(s), 32 + 120);
  EXPECT_EQ(pre_a2a_rows(EpShape{2, 16, 2, 2, 1, 8, 0}), 32);
  // The kernel dispatch buffer never exceeds R_pre.
  EXPECT_LE(dispatch_out_rows(32, 8, 16), pre_a2a_rows(s));
}

TEST(EpSizing, ZeroTokensAreValid) {
  EXPECT_EQ(recv_rows(0, 16, 2, 2, 1, 8, 4), 8 * 3);
  EXPECT_EQ(shard_rows(EpShape{4, 0, 2, 2, 2, 8, 0}), 0);
}

TEST(EpSizing, ErrorBatchNotDivisibleByEpTimesDp) {
  const std::string msg = error_of([] { recv_rows(6, 16, 2, 2, 2, 8, 0); });
  EXPECT_THAT(msg, HasSubstr("batch"));
  EXPECT_THAT(msg, HasSubstr("B=6"));
}

TEST(EpSizing, ErrorExpertsNotDivisibleByEp) {
  EXPECT_THAT(error_of([] { recv_rows(4, 16, 2, 4, 1, 6, 0); }), HasSubstr("num_ep"));
}

TEST(EpSizing, ErrorNegativeAlignSize) {
  EXPECT_THAT(error_of([] { recv_rows(4, 16, 2, 2, 1, 8, -1); }), HasSubstr("align_size"));
}

TEST(EpSizing, ErrorNonPositiveEpOrDp) {
  EXPECT_THAT(error_of([] { recv_rows(4, 16, 2, 0, 1, 8, 0); }), HasSubstr("num_ep"));
  EXPECT_THAT(error_of([] { recv_rows(4, 16, 2, 2, 0, 8, 0); }), HasSubstr("dp_size"));
}

// --- §9.2 ragged_a2a_params ---------------------------------------------------------------------

TEST(RaggedA2AParams, KnownAnswerTwoRanks) {
  // A = [[1,2 | 3,4], [5,6 | 7,8]]: Snd = [[3,7],[11,15]].
  const Tensor A = counts(2, 4, {1, 2, 3, 4, 5, 6, 7, 8});
  const ref::RaggedA2AParams f1 = ref::ragged_a2a_params(A, 1, 2, A2ADirection::forward);
  EXPECT_EQ(f1.send_sizes.values(), (std::vector<double>{11, 15}));
  EXPECT_EQ(f1.input_offsets.values(), (std::vector<double>{0, 11}));
  EXPECT_EQ(f1.recv_sizes.values(), (std::vector<double>{7, 15}));
  EXPECT_EQ(f1.output_offsets.values(), (std::vector<double>{3, 7}));
  const ref::RaggedA2AParams r1 = ref::ragged_a2a_params(A, 1, 2, A2ADirection::reverse);
  EXPECT_EQ(r1.send_sizes.values(), (std::vector<double>{7, 15}));
  EXPECT_EQ(r1.input_offsets.values(), (std::vector<double>{0, 7}));
  EXPECT_EQ(r1.recv_sizes.values(), (std::vector<double>{11, 15}));
  EXPECT_EQ(r1.output_offsets.values(), (std::vector<double>{3, 11}));
  EXPECT_EQ(f1.send_sizes.dtype(), DType::i32);
}

TEST(RaggedA2AParams, ErrorExpertsNotDivisibleByEp) {
  const Tensor A(DType::i32, {2, 5});
  EXPECT_THAT(error_of([&] { ref::ragged_a2a_params(A, 0, 2, A2ADirection::forward); }),
              HasSubstr("num_ep: num_experts=5 is not divisible by num_ep=2"));
}

TEST(RaggedA2AParams, ErrorShardIdOutOfRange) {
  const Tensor A(DType::i32, {2, 4});
  EXPECT_THAT(error_of([&] { ref::ragged_a2a_params(A, 2, 2, A2ADirection::forward); }),
              HasSubstr("shard_id"));
  EXPECT_THAT(error_of([&] { ref::ragged_a2a_params(A, -1, 2, A2ADirection::forward); }),
              HasSubstr("shard_id"));
}

TEST(RaggedA2AParams, ErrorCountsShape) {
  EXPECT_THAT(error_of([] {
                ref::ragged_a2a_params(Tensor(DType::i32, {3, 4}), 0, 2, A2ADirection::forward);
              }),
              HasSubstr("all_shards_tokens_per_expert: expected 2 rows"));
  EXPECT_THAT(error_of([] {
                ref::ragged_a2a_params(Tensor(DType::f32, {2, 4}), 0, 2, A2ADirection::forward);
              }),
              HasSubstr("all_shards_tokens_per_expert: unsupported dtype"));
}

TEST(RaggedA2AParams, ErrorNegativeCount) {
  const Tensor A = counts(2, 2, {1, -3, 0, 0});
  EXPECT_THAT(error_of([&] { ref::ragged_a2a_params(A, 0, 2, A2ADirection::forward); }),
              HasSubstr("all_shards_tokens_per_expert: entry [0, 1] is negative"));
}

TEST(RaggedA2AParams, ErrorUnknownDirection) {
  EXPECT_THAT(error_of([] { parse_a2a_direction("backward"); }), HasSubstr("direction"));
}

// --- §9.3 ragged_all_to_all ---------------------------------------------------------------------

TEST(RaggedAllToAll, SingleRankIsACopyIntoTheBuffer) {
  const Tensor A = counts(1, 3, {2, 0, 3});
  const ref::SimComm comm(1);
  std::vector<Tensor> op;
  op.push_back(tagged_buffer(A, 0, 7));
  std::vector<Tensor> init;
  init.push_back(Tensor::from(DType::f32, {6, 3}, std::vector<double>(18, -7.0)));
  const auto out =
      ref::ragged_all_to_all_fwd(comm, op, init, all_params(A, 1, A2ADirection::forward));
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t h = 0; h < 3; ++h) EXPECT_EQ(out[0].at(r, h), r < 5 ? op[0].at(r, h) : -7.0);
}

TEST(RaggedAllToAll, ErrorRecvSizesDisagreeWithSenders) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  auto p = all_params(A, 2, A2ADirection::forward);
  p[1].recv_sizes.set(0, p[1].recv_sizes.at(0) + 1);
  const std::string msg =
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2), p); });
  EXPECT_THAT(msg, HasSubstr("recv_sizes: rank 1 expects 3 rows from rank 0"));
}

TEST(RaggedAllToAll, ErrorSourceRangeOutOfBounds) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  const auto p = all_params(A, 2, A2ADirection::forward);
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 5, 2), zeros(2, 8, 2), p); }),
      HasSubstr("input_offsets: rank 1 sends rows"));
}

TEST(RaggedAllToAll, ErrorOverlappingDestinations) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  auto p = all_params(A, 2, A2ADirection::forward);
  p[1].output_offsets.set(0, 0);  // rank 1's chunk for rank 0 lands on rank 0's own chunk
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2), p); }),
      HasSubstr("overlap on rank 0"));
}

TEST(RaggedAllToAll, ErrorNegativeSize) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  auto p = all_params(A, 2, A2ADirection::forward);
  p[0].send_sizes.set(1, -2);
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2), p); }),
      HasSubstr("send_sizes[rank 0][1]: must be >= 0"));
}

TEST(RaggedAllToAll, ErrorNegativeOffset) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  auto p = all_params(A, 2, A2ADirection::forward);
  p[1].output_offsets.set(1, -1);
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2), p); }),
      HasSubstr("output_offsets[rank 1][1]: must be >= 0"));
}

TEST(RaggedAllToAll, ErrorOutputDtypeOrHiddenMismatch) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  const auto p = all_params(A, 2, A2ADirection::forward);
  EXPECT_THAT(error_of([&] {
                ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2, DType::bf16), p);
              }),
              HasSubstr("output_init[rank 0]: dtype bfloat16"));
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 3), p); }),
      HasSubstr("output_init[rank 0]: hidden size 3"));
}

TEST(RaggedAllToAll, ErrorRankCount) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  const auto p = all_params(A, 2, A2ADirection::forward);
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(3, 8, 2), zeros(2, 8, 2), p); }),
      HasSubstr("operand: expected one tensor per rank (num_ep=2), got 3"));
  EXPECT_THAT(error_of([] { ref::SimComm bad(0); }), HasSubstr("num_ep"));
}

TEST(RaggedAllToAll, ErrorParamArrayShapeOrDtype) {
  const Tensor A = counts(2, 2, {1, 2, 3, 4});
  const ref::SimComm comm(2);
  auto p = all_params(A, 2, A2ADirection::forward);
  p[0].input_offsets = Tensor(DType::f32, {2});
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2), p); }),
      HasSubstr("input_offsets[rank 0]: unsupported dtype"));
  p = all_params(A, 2, A2ADirection::forward);
  p[1].recv_sizes = Tensor(DType::i32, {3});
  EXPECT_THAT(
      error_of([&] { ref::ragged_all_to_all_fwd(comm, zeros(2, 8, 2), zeros(2, 8, 2), p); }),
      HasSubstr("recv_sizes[rank 1]"));
}

// --- §9.4 local permute -------------------------------------------------------------------------

TEST(LocalPermute, ErrorSplitSumExceedsReceiveRows) {
  const Tensor A = counts(2, 4, {1, 2, 3, 4, 5, 6, 7, 8});  // rank 0 receives 1+2+5+6 = 14
  const std::string msg = error_of([&] {
    ref::local_permute_after_a2a_fwd(Tensor(DType::f32, {13, 2}), A, 0, 2);
  });
  EXPECT_THAT(msg, HasSubstr("x_recv: rank 0 receives 14 rows"));
  EXPECT_NO_THROW(ref::local_permute_after_a2a_fwd(Tensor(DType::f32, {14, 2}), A, 0, 2));
}

TEST(LocalPermute, ErrorBadShardOrCounts) {
  const Tensor A = counts(2, 4, std::vector<int64_t>(8, 1));
  EXPECT_THAT(error_of([&] {
                ref::local_permute_after_a2a_fwd(Tensor(DType::f32, {9, 2}), A, 2, 2);
              }),
              HasSubstr("shard_id"));
  EXPECT_THAT(error_of([&] {
                ref::local_permute_after_a2a_fwd(Tensor(DType::f32, {9, 2}),
                                                 Tensor(DType::i32, {2, 3}), 0, 2);
              }),
              HasSubstr("num_ep: num_experts=3"));
  EXPECT_THAT(error_of([&] { ref::local_permute_after_a2a_fwd(Tensor(DType::f32, {9}), A, 0, 2); }),
              HasSubstr("x_recv"));
}

TEST(LocalUnpermute, ErrorMapShapeOrDtype) {
  const Tensor y(DType::f32, {4, 2});
  EXPECT_THAT(error_of([&] {
                ref::local_unpermute_before_a2a_fwd(y, ivec({0, 1, 2}));
              }),
              HasSubstr("row_id_map"));
  EXPECT_THAT(error_of([&] { ref::local_unpermute_before_a2a_fwd(y, Tensor(DType::i64, {4})); }),
              HasSubstr("row_id_map: unsupported dtype int64"));
  EXPECT_THAT(error_of([&] {
                ref::local_unpermute_before_a2a_fwd(y, ivec({0, 0, 2, 3}));
              }),
              HasSubstr("row_id_map"));
}

// --- regression cases ---------------------------------------------------------------------------

// R3: with align_size > 0 the receive buffer needs (B/D)*S*K + E(a-1) rows. Rank 0 receives
// 2*64 = 128 aligned rows; the unfixed size (B/D)*S*K = 64 must be reported, never overrun.
TEST(Regression, R3_ReceiveBufferSizingWithAlignment) {
  const Tensor A = r3_counts();
  const int64_t R = recv_rows(2, 16, 2, 2, 1, 8, 16);
  const int64_t R_pre = pre_a2a_rows(EpShape{2, 16, 2, 2, 1, 8, 16});
  ASSERT_EQ(R, 184);
  const ref::SimComm comm(2);
  std::vector<Tensor> buf;
  for (int64_t s = 0; s < 2; ++s) buf.push_back(tagged_buffer(A, s, R_pre));
  const auto fwd = all_params(A, 2, A2ADirection::forward);
  int64_t recv0 = 0;
  for (int64_t j = 0; j < 2; ++j) recv0 += static_cast<int64_t>(fwd[0].recv_sizes.at(j));
  EXPECT_EQ(recv0, 128);
  EXPECT_NO_THROW(ref::ragged_all_to_all_fwd(comm, buf, zeros(2, R, 3), fwd));
  const int64_t unfixed = 2 / 1 * 16 * 2;
  const std::string msg =
      error_of([&] { ref::ragged_all_to_all_fwd(comm, buf, zeros(2, unfixed, 3), fwd); });
  EXPECT_THAT(msg, HasSubstr("recv_sizes: rank 0 receives 128 rows"));
  EXPECT_THAT(msg, HasSubstr("64"));
  EXPECT_THAT(error_of([&] {
                ref::local_permute_after_a2a_fwd(Tensor(DType::f32, {unfixed, 3}), A, 0, 2);
              }),
              HasSubstr("receives 128 rows"));
}

// R14: the block's one map with inverse=true equals TE's public two-map form on all R rows (tail
// included), and the second map is the inverse of the first.
RC_GTEST_PROP(Regression, R14_OneLocalPermuteMapMatchesTheTwoMapForm, ()) {
  const int64_t P = *rc::gen::element<int64_t>(1, 2, 3, 4, 8);
  const int64_t L = *any_in(1, 4);
  const int64_t s = *any_in(0, P);
  std::vector<int64_t> c(P * P * L);
  for (auto& v : c) v = *any_in(0, 5);
  const Tensor A = counts(P, P * L, c);
  int64_t recv = 0;
  for (int64_t i = 0; i < P; ++i)
    for (int64_t l = 0; l < L; ++l) recv += c[i * P * L + s * L + l];
  const int64_t R = recv + *any_in(0, 6);
  Tensor x(DType::f32, {R, 2});
  for (int64_t i = 0; i < 2 * R; ++i) x.set(i, static_cast<double>(i + 1));
  const ref::LocalPermuteFwd f = ref::local_permute_after_a2a_fwd(x, A, s, P);
  const Tensor one_map = ref::local_unpermute_before_a2a_fwd(f.sorted_x, f.row_id_map);
  RC_ASSERT(one_map.bitwise_equal(x));
  // TE: map2 from (split[sorted_chunk_indices], argsort(sorted_chunk_indices)), then a scatter.
  const ref::LocalChunks ch = ref::local_chunks(A, s, P);
  const int64_t C = P * L;
  std::vector<int64_t> split2(C), inv(C);
  for (int64_t j = 0; j < C; ++j) {
    const auto idx = static_cast<int64_t>(ch.sorted_chunk_indices.at(j));
    split2[j] = static_cast<int64_t>(ch.split_sizes.at(idx));
    inv[idx] = j;
  }
  const Tensor map2 = ref::make_chunk_sort_map(ivec(split2), ivec(inv), R);
  const Tensor two_map = ref::sort_chunks_by_map(f.sorted_x, map2, /*inverse=*/false);
  RC_ASSERT(two_map.bitwise_equal(one_map));
  for (int64_t i = 0; i < R; ++i) {
    RC_ASSERT(map2.at(static_cast<int64_t>(f.row_id_map.at(i))) == static_cast<double>(i));
  }
}

// --- the EP pipeline ----------------------------------------------------------------------------

// §9 end to end over P simulated ranks (SPEC §12 "A2A"): dispatch buffers (expert-major, rows
// tagged with (rank, expert, index)) -> forward exchange into zero [R] buffers -> local permute
// (expert-major per rank: every chunk lands where the expert-major layout puts it) -> identity
// experts -> local unpermute -> reverse exchange into zero [R_pre] buffers reproduces the dispatch
// buffers on every row; sum recv_sizes = sum local_group_sizes <= R.
RC_GTEST_PROP(EpPipeline, ExchangePermuteAndBackIsTheIdentity, ()) {
  const int64_t P = *rc::gen::element<int64_t>(1, 2, 3, 4, 8);
  const int64_t L = *any_in(1, 4), E = P * L;
  const int64_t N = *any_in(0, 12);
  const int64_t a = *rc::gen::element<int64_t>(0, 1, 3);
  const bool one_expert = *rc::gen::element(false, false, true);
  std::vector<int64_t> c(P * E, 0);
  for (int64_t i = 0; i < P; ++i) {
    const int64_t hot = *any_in(0, E);
    for (int64_t n = 0; n < N; ++n) ++c[i * E + (one_expert ? hot : *any_in(0, E))];
    for (int64_t e = 0; e < E; ++e) c[i * E + e] = dispatch_aligned_count(c[i * E + e], a);
  }
  const Tensor A = counts(P, E, c);
  const int64_t R_pre = a > 0 ? N + E * (a - 1) : N;
  const int64_t R = a > 0 ? P * N + E * (a - 1) : P * N;
  const ref::SimComm comm(P);
  std::vector<Tensor> buf;
  for (int64_t s = 0; s < P; ++s) buf.push_back(tagged_buffer(A, s, R_pre));
  const auto recv = ref::ragged_all_to_all_fwd(comm, buf, zeros(P, R, 3),
                                               all_params(A, P, A2ADirection::forward));
  std::vector<Tensor> back_in;
  for (int64_t s = 0; s < P; ++s) {
    const ref::LocalPermuteFwd f = ref::local_permute_after_a2a_fwd(recv[s], A, s, P);
    int64_t row = 0, total = 0;
    for (int64_t l = 0; l < L; ++l) {
      total += static_cast<int64_t>(f.local_group_sizes.at(l));
      for (int64_t i = 0; i < P; ++i) {
        for (int64_t o = 0; o < c[i * E + s * L + l]; ++o, ++row) {
          RC_ASSERT(f.sorted_x.at(row, 0) == static_cast<double>(i + 1));
          RC_ASSERT(f.sorted_x.at(row, 1) == static_cast<double>(s * L + l));
          RC_ASSERT(f.sorted_x.at(row, 2) == static_cast<double>(o));
        }
      }
    }
    RC_ASSERT(row == total);
    RC_ASSERT(total <= R);
    const ref::RaggedA2AParams p = ref::ragged_a2a_params(A, s, P, A2ADirection::forward);
    int64_t rs = 0;
    for (int64_t j = 0; j < P; ++j) rs += static_cast<int64_t>(p.recv_sizes.at(j));
    RC_ASSERT(rs == total);
    back_in.push_back(ref::local_unpermute_before_a2a_fwd(f.sorted_x, f.row_id_map));
    RC_ASSERT(back_in.back().bitwise_equal(recv[s]));
  }
  const auto back = ref::ragged_all_to_all_fwd(comm, back_in, zeros(P, R_pre, 3),
                                               all_params(A, P, A2ADirection::reverse));
  for (int64_t s = 0; s < P; ++s) RC_ASSERT(back[s].bitwise_equal(buf[s]));
  // The backward of the forward exchange is the reverse exchange (SPEC §9.3).
  const auto g =
      ref::ragged_all_to_all_bwd(comm, recv, all_params(A, P, A2ADirection::forward), R_pre);
  for (int64_t s = 0; s < P; ++s) RC_ASSERT(g[s].bitwise_equal(back[s]));
}
