// GPU tests of the permutation and EP twins (SPEC §4-9), beyond the registry suite: every EP op
// at P in {1,2,4,8} against the reference (outputs poisoned before each launch by the binding; two
// runs bitwise equal), larger shapes for determinism, the SPEC
// regression cases R1, R3 (receive buffer), R4, R6, R7, R8, R11, R12, R14 on the device, a
// dispatch backward whose map repeats an expert in a token (last slot wins), the combine
// forward's slot groups and column chunks summed in slot order (bitwise), one test
// per data-dependent error and a tensor over 2^31 elements (int64 indexing). The benchmark is
// `moe-harness bench --op token_dispatch --op token_combine --op sort_chunks_by_index` (full-size
// inputs generated on the device, verified first).
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "gpu/argsort.cuh"
#include "gpu/comm.cuh"
#include "gpu/dispatch.cuh"
#include "gpu/ep.cuh"
#include "gpu/sort_chunks.cuh"
#include "harness/core/params/ep.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/registry.h"
#include "reference/dispatch.h"
#include "tests/gpu/scoped_env.h"

namespace {

using moe::Case;
using moe::DType;
using moe::Report;
using moe::Tensor;
using moe::TensorMap;
using moe::gpu::DeviceTensor;
using moe::ops::OpInfo;
using ::testing::HasSubstr;

#define REQUIRE_GPU() \
  if (!moe::ops::gpu_available()) GTEST_SKIP() << "no CUDA GPU: " << moe::ops::gpu_description()

const OpInfo& op_of(const std::string& name) {
  const OpInfo* op = moe::ops::find_op(name);
  if (!op) throw std::runtime_error("op " + name + " is not registered");
  return *op;
}

Case named_case(const std::string& op, const std::string& name) {
  for (const Case& c : op_of(op).named()) {
    if (c.s("name", "") == name) return c;
  }
  throw std::runtime_error("no named case " + name + " for " + op);
}

// Runs check_gpu and turns every failure into a message carrying the replay line.
std::string gpu_failures(const Case& c) {
  try {
    const Report r = moe::ops::check_gpu(op_of(c.op), c);
    if (r.ok()) return "";
    return r.str() + "  replay: " + moe::ops::replay_line(c, "gpu");
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what() + "\n  replay: " + moe::ops::replay_line(c, "gpu");
  }
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument thrown)";
}

Tensor i32(const moe::Shape& s, const std::vector<int64_t>& v) {
  Tensor t(DType::i32, s);
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return t;
}

bool rows_bitwise_equal(const Tensor& a, int64_t ra, const Tensor& b, int64_t rb) {
  const size_t bytes = static_cast<size_t>(a.row_stride()) * moe::dtype_size(a.dtype());
  return std::memcmp(a.bytes() + ra * bytes, b.bytes() + rb * bytes, bytes) == 0;
}

bool row_is_plus_zero(const Tensor& a, int64_t r) {
  const size_t bytes = static_cast<size_t>(a.row_stride()) * moe::dtype_size(a.dtype());
  for (size_t i = 0; i < bytes; ++i)
    if (a.bytes()[r * bytes + i] != std::byte{0}) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// The generic registry suite (tests/gpu/test_registry_gpu.cpp, AllGpuOps/RegistryGpu.*) runs
// check_gpu over op.gen() and every op.named() case of each op below; this file adds the EP size
// sweep, larger shapes, the regression cases, the device-detected errors and int64 indexing.

// Every EP op at P in {1, 2, 4, 8}, with and without alignment, both directions, zero-token
// experts (zero_tokens regime) and an all-to-one routing.
TEST(DispatchGpuEp, EverySizeP1248) {
  REQUIRE_GPU();
  for (int64_t P : {1, 2, 4, 8}) {
    for (const char* op : {"ragged_a2a_params", "ragged_all_to_all", "local_permute_after_a2a",
                           "local_unpermute_before_a2a"}) {
      for (int64_t a : {0, 4}) {
        for (auto regime :
             {moe::Regime::uniform, moe::Regime::zero_tokens, moe::Regime::all_to_one}) {
          for (const char* dir : {"forward", "reverse"}) {
            Case c;
            c.op = op;
            c.dtype = P == 4 ? DType::f32 : DType::bf16;
            c.regime = regime;
            c.seed = static_cast<uint64_t>(100 + P * 10 + a);
            c.set("num_ep", P).set("E", 2 * P).set("N", int64_t{11}).set("H", int64_t{5});
            c.set("align_size", a).set("slack", int64_t{2}).set("direction", dir);
            c.set("output_init", "random");
            const std::string f = gpu_failures(c);
            EXPECT_TRUE(f.empty()) << c.line() << "\n" << f;
          }
        }
      }
    }
  }
}

// Larger shapes than the generators use: many CTAs per launch, so determinism (check_gpu runs
// every case twice) is exercised where scheduling varies.
TEST(DispatchGpuDeterminism, LargerShapes) {
  REQUIRE_GPU();
  std::vector<Case> cases;
  for (const char* op : {"token_dispatch", "token_combine"}) {
    // a = 128 at E = 64: a third of the rows are padding or tail, so the dispatch forward's single
    // pass grid-strides over token and zero-row items mixed (more items than resident CTAs).
    for (int64_t a : {0, 16, 128}) {
      Case c;
      c.op = op;
      c.dtype = DType::bf16;
      c.seed = 41;
      c.set("T", int64_t{2048}).set("E", int64_t{64}).set("K", int64_t{8}).set("H", int64_t{520});
      c.set("ragged", false).set("num_out_tokens", int64_t{2048 * 8}).set("align_size", a);
      c.set("drop_overflow", false).set("probs_dtype", "float32").set("zero_probs", int64_t{0});
      c.set("merging_dtype", "float32");
      cases.push_back(c);
    }
  }
  // Rows of 16400 bytes (f32, H = 4100): the bulk-copy kernels' rows in several chunks
  // (dispatch: 8208 + 8192 bytes; combine: 5 x 3280), with padding rows, and for the
  // dispatch both signs of zero probs (R12) and a capacity below the routed count (dropped
  // slots), ~8 chunks a dispatch warp on an H100 (its 4-stage ring wraps).
  for (const char* op : {"token_dispatch", "token_combine"}) {
    for (int64_t a : {0, 32}) {
      Case c;
      c.op = op;
      c.dtype = DType::f32;
      c.seed = 47;
      c.set("T", int64_t{1024}).set("E", int64_t{16}).set("K", int64_t{4}).set("H", int64_t{4100});
      c.set("ragged", false).set("align_size", a);
      if (std::string(op) == "token_dispatch") {
        c.set("num_out_tokens", int64_t{a ? 1024 * 4 : 3800}).set("drop_overflow", a == 0);
        c.set("probs_dtype", "float32").set("zero_probs", int64_t{6});
      } else {
        c.set("num_out_tokens", int64_t{1024 * 4}).set("merging_dtype", "float32");
      }
      cases.push_back(c);
    }
  }
  for (const char* op : {"argsort_token_dispatch", "argsort_token_combine"}) {
    Case c;
    c.op = op;
    c.dtype = DType::f16;
    c.seed = 43;
    c.set("T", int64_t{1024}).set("E", int64_t{32}).set("topk", int64_t{4});
    c.set("H", int64_t{264}).set("align_size", int64_t{8}).set("weights_dtype", "float32");
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    const std::string f = gpu_failures(c);
    EXPECT_TRUE(f.empty()) << c.line() << "\n" << f;
  }
}

// ---------------------------------------------------------------------------------------------
// Regression cases (SPEC §13) on the device.

TEST(DispatchGpuRegression, R1_SortChunksPaddingRows) {
  REQUIRE_GPU();
  const OpInfo& op = op_of("sort_chunks_by_index");
  for (const char* dn : {"float32", "bfloat16"}) {
    const Case c = named_case(op.name, std::string("R1_") + dn);
    const TensorMap in = op.make_inputs(c);
    const TensorMap got = op.gpu(c, in);
    const Tensor& x = in.at("input.x");
    const Tensor& sorted = got.at("output.sorted");
    const Tensor& map = got.at("output.row_id_map");
    const Tensor& ct = in.at("cotangent.sorted");
    const Tensor& gx = got.at("grad.x");
    for (int64_t i = 60; i < 100; ++i) {
      EXPECT_TRUE(rows_bitwise_equal(sorted, i, x, i))
          << "padding row " << i << " moved; " << moe::ops::replay_line(c, "gpu");
      EXPECT_EQ(map.at(i), static_cast<double>(i)) << moe::ops::replay_line(c, "gpu");
    }
    // Chunks 2, 0, 3, 1 of sizes 20, 7, 33, 0 (x[i] = i + 1).
    std::vector<int64_t> src;
    for (int64_t i = 7; i < 27; ++i) src.push_back(i);
    for (int64_t i = 0; i < 7; ++i) src.push_back(i);
    for (int64_t i = 27; i < 60; ++i) src.push_back(i);
    for (int64_t j = 0; j < 60; ++j) {
      EXPECT_EQ(sorted.at(j, 0), static_cast<double>(src[j] + 1))
          << moe::ops::replay_line(c, "gpu");
    }
    for (int64_t i = 0; i < 100; ++i) {
      const auto dst = static_cast<int64_t>(map.at(i));
      EXPECT_TRUE(rows_bitwise_equal(gx, i, ct, dst)) << "grad x row " << i;
    }
    for (const char* suffix : {"_V0", "_V_eq_N"}) {
      const std::string f = gpu_failures(named_case(op.name, std::string("R1_") + dn + suffix));
      EXPECT_TRUE(f.empty()) << f;
    }
  }
}

// A = [16,16,16,16,0,0,0,0] on both sources: every aligned row goes to shard 0, 128 rows.
Tensor r3_counts() {
  Tensor A(DType::i32, {2, 8});
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t e = 0; e < 4; ++e) A.set(i, e, 16.0);
  return A;
}

TEST(DispatchGpuRegression, R3_UndersizedReceiveBuffer) {
  REQUIRE_GPU();
  const int64_t P = 2, H = 32;
  EXPECT_EQ(moe::recv_rows(2, 16, 2, 2, 1, 8, 16), 184);
  const DeviceTensor A = DeviceTensor::upload(r3_counts());
  std::vector<moe::gpu::RaggedA2AParams> params;
  for (int64_t s = 0; s < P; ++s) {
    params.push_back(moe::gpu::ragged_a2a_params(A, s, P, moe::A2ADirection::forward));
  }
  const int64_t R_pre = 32 + 8 * 15;
  Tensor op_host(DType::bf16, {R_pre, H});
  op_host.fill(1.5);
  std::vector<DeviceTensor> operand, init184, init64;
  for (int64_t r = 0; r < P; ++r) {
    operand.push_back(DeviceTensor::upload(op_host));
    init184.push_back(DeviceTensor::upload(Tensor(DType::bf16, {184, H})));
    init64.push_back(DeviceTensor::upload(Tensor(DType::bf16, {64, H})));
  }
  moe::gpu::InProcessCommunicator comm(P);
  // The fixed size: no overflow, 128 rows land on shard 0.
  const auto ok = moe::gpu::ragged_all_to_all_fwd(comm, operand, init184, params);
  const Tensor r0 = ok[0].download();
  for (int64_t i = 0; i < 184; ++i) EXPECT_EQ(r0.at(i, 0), i < 128 ? 1.5 : 0.0) << "row " << i;
  // The unfixed size (B/D)*S*K = 64: an error naming the receive sizes, nothing written.
  const std::string msg =
      message_of([&] { moe::gpu::ragged_all_to_all_fwd(comm, operand, init64, params); });
  EXPECT_THAT(msg, HasSubstr("recv_sizes"));
  EXPECT_THAT(msg, HasSubstr("receive buffer of 64 rows"));
  // Through the communicator directly: canary receive buffers stay untouched.
  std::vector<DeviceTensor> canary;
  std::vector<moe::gpu::RaggedA2ARank> ranks;
  for (int64_t r = 0; r < P; ++r) {
    canary.emplace_back(DType::bf16, moe::Shape{64, H});
    canary.back().fill_bytes(0xA5);
    ranks.push_back({static_cast<int>(r), operand[r].data(), R_pre, canary[r].data(), 64,
                     params[r].input_offsets.data<int32_t>(), params[r].send_sizes.data<int32_t>(),
                     params[r].output_offsets.data<int32_t>(),
                     params[r].recv_sizes.data<int32_t>()});
  }
  moe::gpu::ErrorFlag flag;
  comm.ragged_all_to_all(ranks, H * 2, flag.device_ptr(), nullptr);
  EXPECT_EQ(flag.read().code, static_cast<int32_t>(moe::gpu::A2AFault::recv_total));
  for (const DeviceTensor& t : canary) {
    const Tensor h = t.download();
    for (size_t i = 0; i < h.nbytes(); ++i) ASSERT_EQ(h.bytes()[i], std::byte{0xA5}) << i;
  }
  // The local permute names its receive buffer the same way.
  Tensor x64(DType::bf16, {64, H}), x184(DType::bf16, {184, H});
  EXPECT_THAT(message_of([&] {
                moe::gpu::local_permute_after_a2a_fwd(DeviceTensor::upload(x64), A, 0, P);
              }),
              HasSubstr("x_recv"));
  EXPECT_NO_THROW(moe::gpu::local_permute_after_a2a_fwd(DeviceTensor::upload(x184), A, 0, P));
}

TEST(DispatchGpuRegression, R4_CombineBackwardZeroesUnmappedRows) {
  REQUIRE_GPU();
  const OpInfo& op = op_of("token_combine");
  for (const char* name : {"R4_merging_padded", "R4_merging_padded_bf16"}) {
    const Case c = named_case(op.name, name);
    const TensorMap in = op.make_inputs(c);
    const DeviceTensor ct = DeviceTensor::upload(in.at("cotangent.combined"));
    const DeviceTensor permuted = DeviceTensor::upload(in.at("input.permuted"));
    const DeviceTensor rim = DeviceTensor::upload(in.at("input.row_id_map"));
    const DeviceTensor mp = DeviceTensor::upload(in.at("input.merging_probs"));
    const DeviceTensor pad = DeviceTensor::upload(in.at("input.pad_offsets"));
    const Tensor& rim_h = in.at("input.row_id_map");
    const Tensor& pad_h = in.at("input.pad_offsets");
    const int64_t T = rim_h.dim(0), E = (rim_h.dim(1) - 1) / 2, R_in = permuted.dim(0);
    std::vector<bool> mapped(R_in, false);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < static_cast<int64_t>(rim_h.at(t, 2 * E)); ++k) {
        const auto e = static_cast<int64_t>(rim_h.at(t, E + k));
        mapped[static_cast<int64_t>(rim_h.at(t, k) + pad_h.at(e))] = true;
      }
    }
    // Poison with NaN, then with 1e30, before the launch.
    for (double poison : {std::nan(""), 1e30}) {
      moe::gpu::TokenCombineBwd out;
      out.grad_permuted = DeviceTensor::upload([&] {
        Tensor t(ct.dtype(), {R_in, ct.dim(1)});
        t.fill(poison);
        return t;
      }());
      out.grad_merging_probs = DeviceTensor(mp.dtype(), {T, E});
      moe::gpu::ErrorFlag flag;
      moe::gpu::token_combine_bwd_into(ct, permuted, rim, &mp, &pad, out, flag.device_ptr(),
                                       nullptr);
      EXPECT_EQ(flag.read().code, 0);
      const Tensor g = out.grad_permuted.download();
      for (int64_t r = 0; r < R_in; ++r) {
        if (!mapped[r]) {
          EXPECT_TRUE(row_is_plus_zero(g, r))
              << "row " << r << " poison " << poison << "; " << moe::ops::replay_line(c, "gpu");
        }
      }
    }
    const std::string f = gpu_failures(c);
    EXPECT_TRUE(f.empty()) << f;
  }
}

TEST(DispatchGpuRegression, R6_CombineBackwardKeepsForwardRows) {
  REQUIRE_GPU();
  const OpInfo& op = op_of("token_combine");
  for (int64_t a : {1, 8, 16, 128}) {
    const Case c = named_case(op.name, "R6_a" + std::to_string(a));
    const TensorMap in = op.make_inputs(c);
    const TensorMap got = op.gpu(c, in);
    const int64_t R = moe::dispatch_out_rows(384, 5, a);
    if (a == 8) EXPECT_EQ(R, 416);
    EXPECT_EQ(got.at("grad.permuted").dim(0), R) << moe::ops::replay_line(c, "gpu");
    const std::string f = gpu_failures(c);
    EXPECT_TRUE(f.empty()) << f;
  }
}

TEST(DispatchGpuRegression, R7_PadOffsetsAbsentOrPresent) {
  REQUIRE_GPU();
  const OpInfo& op = op_of("token_dispatch");
  for (int64_t a : {0, 16}) {
    Case c;
    c.op = op.name;
    c.dtype = DType::bf16;
    c.seed = 5;
    c.set("T", int64_t{32}).set("E", int64_t{8}).set("K", int64_t{2}).set("H", int64_t{16});
    c.set("ragged", false).set("num_out_tokens", int64_t{64}).set("align_size", a);
    c.set("drop_overflow", false).set("probs_dtype", "none").set("zero_probs", int64_t{0});
    const TensorMap got = op.gpu(c, op.make_inputs(c));
    if (a == 0) {
      EXPECT_EQ(got.count("output.pad_offsets"), 0u) << moe::ops::replay_line(c, "gpu");
    } else {
      ASSERT_EQ(got.count("output.pad_offsets"), 1u) << moe::ops::replay_line(c, "gpu");
      EXPECT_EQ(got.at("output.pad_offsets").dtype(), DType::i32);
      EXPECT_EQ(got.at("output.pad_offsets").shape(), moe::Shape{8});
    }
    const std::string f = gpu_failures(c);
    EXPECT_TRUE(f.empty()) << f;
  }
}

Tensor routing_map(int64_t T, int64_t E, int64_t K) {
  Tensor m(DType::boolean, {T, E});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) m.set(t, (t + 3 * k) % E, 1.0);
  return m;
}

TEST(DispatchGpuRegression, R8_NumOutTokensValidation) {
  REQUIRE_GPU();
  const DeviceTensor x = DeviceTensor::upload(Tensor(DType::f32, {4, 8}));
  const DeviceTensor map = DeviceTensor::upload(routing_map(4, 4, 2));
  const DeviceTensor empty = DeviceTensor::upload(Tensor(DType::boolean, {4, 4}));
  moe::TokenDispatchParams p;
  p.num_out_tokens = -1;
  EXPECT_THAT(message_of([&] { moe::gpu::token_dispatch_fwd(x, map, nullptr, p); }),
              HasSubstr("num_out_tokens"));
  p.num_out_tokens = 0;
  EXPECT_THAT(message_of([&] { moe::gpu::token_dispatch_fwd(x, map, nullptr, p); }),
              HasSubstr("num_out_tokens"));
  const auto f = moe::gpu::token_dispatch_fwd(x, empty, nullptr, p);
  EXPECT_EQ(f.permuted.dim(0), 0);
  for (int64_t e = 0; e < 4; ++e) EXPECT_EQ(f.tokens_per_expert.download().at(e), 0.0);
  // align_size = 0 means off: no division by zero anywhere.
  p.num_out_tokens = 8;
  p.align_size = 0;
  EXPECT_NO_THROW(moe::gpu::token_dispatch_fwd(x, map, nullptr, p));
}

TEST(DispatchGpuRegression, R11_CapacityBelowRoutedCount) {
  REQUIRE_GPU();
  const int64_t T = 100, E = 8, K = 3, H = 16, N_out = 256, guard = 64;
  Tensor xh(DType::f32, {T, H});
  xh.fill(2.0);
  const DeviceTensor x = DeviceTensor::upload(xh);
  const DeviceTensor map = DeviceTensor::upload(routing_map(T, E, K));  // 300 routed slots
  const DeviceTensor probs = DeviceTensor::upload([&] {
    Tensor t(DType::f32, {T, E});
    t.fill(0.5);
    return t;
  }());
  moe::TokenDispatchParams p;
  p.num_out_tokens = N_out;
  EXPECT_THAT(message_of([&] { moe::gpu::token_dispatch_fwd(x, map, &probs, p); }),
              HasSubstr("num_out_tokens"));
  // Outputs with a guard band past the R_out rows: the band keeps its canary bytes.
  moe::gpu::TokenDispatchFwd out;
  out.permuted = DeviceTensor(DType::f32, {N_out + guard, H});
  out.permuted_probs = DeviceTensor(DType::f32, {N_out + guard});
  out.row_id_map = DeviceTensor(DType::i32, {T, 2 * E + 1});
  out.tokens_per_expert = DeviceTensor(DType::i32, {E});
  out.permuted.fill_bytes(0xA5);
  out.permuted_probs->fill_bytes(0xA5);
  moe::gpu::ErrorFlag flag;
  moe::gpu::token_dispatch_fwd_into(x, map, &probs, p, out, flag.device_ptr(), nullptr);
  const moe::gpu::DeviceError e = flag.read();
  EXPECT_EQ(e.code, static_cast<int32_t>(moe::PermFault::capacity));
  EXPECT_EQ(e.a, 300);
  EXPECT_EQ(e.b, N_out);
  const Tensor band = out.permuted.download(), band_p = out.permuted_probs->download();
  for (size_t i = N_out * H * 4; i < band.nbytes(); ++i) {
    ASSERT_EQ(band.bytes()[i], std::byte{0xA5}) << "guard byte " << i << " written";
  }
  for (size_t i = N_out * 4; i < band_p.nbytes(); ++i) {
    ASSERT_EQ(band_p.bytes()[i], std::byte{0xA5}) << "probs guard byte " << i << " written";
  }
  // drop_overflow keeps the first 256 rows (the named case compares against the reference).
  const std::string f = gpu_failures(named_case("token_dispatch", "R11_drop_overflow"));
  EXPECT_TRUE(f.empty()) << f;
}

TEST(DispatchGpuRegression, R12_ZeroProbQuirk) {
  REQUIRE_GPU();
  const OpInfo& op = op_of("token_dispatch");
  for (const char* name : {"R12_zero_prob", "R12_zero_prob_padded"}) {
    const Case c = named_case(op.name, name);
    const TensorMap in = op.make_inputs(c);
    const TensorMap got = op.gpu(c, in);
    const Tensor& probs = in.at("input.probs");
    const Tensor& rim = got.at("output.row_id_map");
    const Tensor* pad = moe::ops::find_tensor(got, "output.pad_offsets");
    const int64_t E = (rim.dim(1) - 1) / 2;
    bool found = false;
    for (int64_t k = 0; k < static_cast<int64_t>(rim.at(3, 2 * E)); ++k) {
      const auto e = static_cast<int64_t>(rim.at(3, E + k));
      if (probs.at(3, e) != 0.0) continue;
      found = true;
      const auto dst = static_cast<int64_t>(rim.at(3, k) + (pad ? pad->at(e) : 0.0));
      EXPECT_TRUE(row_is_plus_zero(got.at("output.permuted"), dst))
          << moe::ops::replay_line(c, "gpu");
    }
    EXPECT_TRUE(found) << "the case has no zero-prob slot on token 3";
    // The backward still routes the slot's cotangent into grad x[3] (the reference says so).
    const std::string f = gpu_failures(c);
    EXPECT_TRUE(f.empty()) << f;
  }
}

// A handed-in row_id_map that names one expert in several slots of a token: grad_probs[t, e]
// ends as the last such slot's cotangent (the reference's sequential write), whether the slots
// fall in one 32-slot chunk of the warp that writes them or in two. Two runs are bitwise equal.
TEST(DispatchGpuRegression, DispatchBackwardRepeatedExpertLastSlotWins) {
  REQUIRE_GPU();
  const int64_t T = 2, E = 64, H = 8, R = 100, W = 2 * E + 1;
  Tensor rim(DType::i32, {T, W});
  for (int64_t i = 0; i < T * W; ++i) rim.set(i, -1.0);
  // Token 0: 40 slots, slot k -> row k, expert k, except slot 12 -> expert 10 (chunk 0 twice),
  // slot 37 -> expert 5 (chunks 0 and 1) and slot 38 -> expert 33 (chunk 1 twice).
  const int64_t n0 = 40;
  for (int64_t k = 0; k < n0; ++k) {
    const int64_t e = k == 12 ? 10 : k == 37 ? 5 : k == 38 ? 33 : k;
    rim.set(0, k, static_cast<double>(k));
    rim.set(0, E + k, static_cast<double>(e));
  }
  rim.set(0, 2 * E, static_cast<double>(n0));
  for (int64_t k = 0; k < 3; ++k) {  // token 1: three plain slots
    rim.set(1, k, static_cast<double>(50 + k));
    rim.set(1, E + k, static_cast<double>(7 * k));
  }
  rim.set(1, 2 * E, 3.0);
  Tensor gp(DType::bf16, {R, H});
  Tensor gpp(DType::f32, {R});
  for (int64_t r = 0; r < R; ++r) gpp.set(r, 0.5 + static_cast<double>(r));
  const auto want = moe::ref::token_dispatch_bwd(gp, &gpp, rim, nullptr);
  ASSERT_TRUE(want.grad_probs.has_value());
  EXPECT_EQ(want.grad_probs->at(0, 10), 12.5);
  EXPECT_EQ(want.grad_probs->at(0, 5), 37.5);
  EXPECT_EQ(want.grad_probs->at(0, 33), 38.5);
  const DeviceTensor d_gp = DeviceTensor::upload(gp), d_gpp = DeviceTensor::upload(gpp);
  const DeviceTensor d_rim = DeviceTensor::upload(rim);
  const auto a = moe::gpu::token_dispatch_bwd(d_gp, &d_gpp, d_rim, nullptr);
  const auto b = moe::gpu::token_dispatch_bwd(d_gp, &d_gpp, d_rim, nullptr);
  ASSERT_TRUE(a.grad_probs.has_value() && b.grad_probs.has_value());
  const Tensor ga = a.grad_probs->download(), gb = b.grad_probs->download();
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_TRUE(rows_bitwise_equal(ga, t, *want.grad_probs, t)) << "token " << t;
    EXPECT_TRUE(rows_bitwise_equal(ga, t, gb, t)) << "token " << t;
  }
}

// The bulk-copy gather-sum (rows of 16-byte vectors): tokens of 0 to 40 slots (slot groups of 8:
// none, partial, full, up to five groups; over 32 slots the producer decodes each slot where it
// is used instead of once a token), rows of two unequal column chunks (4112 and
// 4120 bytes: chunks of 2064 + 2048 and 2064 + 2056 bytes), more tokens than the grid has CTAs on
// small GPUs. Each output must be bitwise the fp32 sum the kernel specifies: acc = 0, then
// acc = fp32(acc + fp32(f32(row_k) * w_k)) in slot order, rounded once (emulated in double, exact
// for these products and sums), and two runs must agree.
TEST(DispatchGpuRegression, CombineForwardSlotGroupsAndChunksSumInSlotOrder) {
  REQUIRE_GPU();
  for (const auto& [d, H] : std::vector<std::pair<DType, int64_t>>{
           {DType::bf16, 2056}, {DType::f16, 2056}, {DType::f32, 1030}}) {
    const int64_t T = 400, E = 64, R = 997, W = 2 * E + 1;
    Tensor rim(DType::i32, {T, W});
    for (int64_t i = 0; i < T * W; ++i) rim.set(i, -1.0);
    Tensor mp(DType::f32, {T, E});
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = t % 41;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t e = (t * 7 + 3 * k) % E;  // 3 is prime to 64: n <= 40 distinct experts
        rim.set(t, k, static_cast<double>((t * 20 + 37 * k) % R));
        rim.set(t, E + k, static_cast<double>(e));
      }
      rim.set(t, 2 * E, static_cast<double>(n));
      for (int64_t e = 0; e < E; ++e)
        mp.set(t, e, std::ldexp(static_cast<double>((t * 31 + e * 17) % 255 + 1), -7));
    }
    Tensor perm(d, {R, H});
    for (int64_t i = 0; i < R * H; ++i)
      perm.set(i, std::ldexp(static_cast<double>((i * 2654435761LL) % 2001 - 1000), -9));
    const DeviceTensor d_perm = DeviceTensor::upload(perm), d_rim = DeviceTensor::upload(rim);
    const DeviceTensor d_mp = DeviceTensor::upload(mp);
    const Tensor a = moe::gpu::token_combine_fwd(d_perm, d_rim, &d_mp, nullptr).download();
    const Tensor b = moe::gpu::token_combine_fwd(d_perm, d_rim, &d_mp, nullptr).download();
    Tensor want(d, {T, H});
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = t % 41;
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t k = 0; k < n; ++k) {
          const int64_t row = static_cast<int64_t>(rim.at(t, k));
          const double w = mp.at(t, static_cast<int64_t>(rim.at(t, E + k)));
          const auto p = static_cast<float>(perm.at(row, h) * w);
          acc = static_cast<float>(static_cast<double>(acc) + static_cast<double>(p));
        }
        want.set(t, h, acc);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_TRUE(rows_bitwise_equal(a, t, want, t))
          << moe::dtype_name(d) << " token " << t << " (" << t % 41 << " slots)";
      EXPECT_TRUE(rows_bitwise_equal(a, t, b, t)) << moe::dtype_name(d) << " token " << t;
    }
  }
}

// MOE_DISPATCH_ROWS=lsu and MOE_GATHER_SUM=lsu swap the dispatch forward's and the combine
// forward's bulk-copy kernels for their twins of ordinary stores (scripts/gpu_sanitize.sh sets
// both for initcheck, which does not see bulk-copy stores): every output of every named case of
// both ops bitwise equal under bulk and lsu, padding and tail rows included (outputs poisoned
// first by the registry's GPU run), some of them with 16-byte rows (the bulk kernels' rows); a
// value other than bulk or lsu names the variable where a bulk kernel would take the rows.
TEST(DispatchGpuKnobs, LsuTwinsOfTheBulkKernelsGiveTheSameBits) {
  REQUIRE_GPU();
  int wide = 0;
  for (const char* op_name : {"token_dispatch", "token_combine"}) {
    const OpInfo& op = op_of(op_name);
    const ScopedEnv env(std::strcmp(op_name, "token_dispatch") == 0 ? "MOE_DISPATCH_ROWS"
                                                                    : "MOE_GATHER_SUM");
    for (const Case& c : op.named()) {
      const TensorMap in = op.make_inputs(c);
      const bool rows16 =
          c.i("H") * static_cast<int64_t>(moe::dtype_size(c.dtype)) % 16 == 0 && c.i("T") > 0;
      wide += rows16;
      env.set("bulk");
      const TensorMap bulk = op.gpu(c, in);
      env.set("lsu");
      const TensorMap lsu = op.gpu(c, in);
      ASSERT_EQ(bulk.size(), lsu.size()) << moe::ops::replay_line(c, "gpu");
      for (const auto& [key, t] : bulk) {
        ASSERT_EQ(lsu.count(key), 1u) << key;
        EXPECT_TRUE(t.bitwise_equal(lsu.at(key)))
            << env.name() << ": " << key << " differs, " << moe::ops::replay_line(c, "gpu");
      }
      if (rows16) {  // the knob is read where a bulk kernel would take the rows
        env.set("ldg");
        EXPECT_THAT(message_of([&] { op.gpu(c, in); }),
                    HasSubstr(std::string(env.name()) + ": expected bulk or lsu, got 'ldg'"))
            << moe::ops::replay_line(c, "gpu");
      }
    }
  }
  EXPECT_GE(wide, 4) << "too few named cases with 16-byte rows";
}

TEST(DispatchGpuRegression, R14_OneMapAndTheTwoMapForm) {
  REQUIRE_GPU();
  for (const char* name : {"R14_p4", "R14_p4_aligned"}) {
    const Case c = named_case("local_permute_after_a2a", name);
    const TensorMap in = op_of(c.op).make_inputs(c);
    const int64_t P = c.i("num_ep");
    const DeviceTensor A = DeviceTensor::upload(in.at("input.all_shards_tokens_per_expert"));
    const auto x = moe::ops::unstack(in.at("input.x_recv"));
    for (int64_t s = 0; s < P; ++s) {
      const DeviceTensor xs = DeviceTensor::upload(x[s]);
      const int64_t R = xs.dim(0);
      const auto f = moe::gpu::local_permute_after_a2a_fwd(xs, A, s, P);
      const auto ch = moe::gpu::local_chunks(A, s, P);
      const Tensor split = ch.split_sizes.download(), sci = ch.sorted_chunk_indices.download();
      const int64_t C = split.numel();
      std::vector<int64_t> split2(C), order2(C);
      for (int64_t j = 0; j < C; ++j) {
        split2[j] = static_cast<int64_t>(split.at(static_cast<int64_t>(sci.at(j))));
        order2[static_cast<int64_t>(sci.at(j))] = j;  // argsort of a permutation
      }
      const Tensor map2 = moe::gpu::make_chunk_sort_map(DeviceTensor::upload(i32({C}, split2)),
                                                        DeviceTensor::upload(i32({C}, order2)), R)
                              .download();
      const Tensor map1 = f.row_id_map.download();
      for (int64_t i = 0; i < R; ++i) {
        EXPECT_EQ(map2.at(static_cast<int64_t>(map1.at(i))), static_cast<double>(i))
            << "rank " << s << " row " << i << "; " << moe::ops::replay_line(c, "gpu");
      }
      // The block's one map (inverse gather) and TE's second map (scatter) agree on all R rows.
      const Tensor one =
          moe::gpu::local_unpermute_before_a2a_fwd(f.sorted_x, f.row_id_map).download();
      const Tensor two =
          moe::gpu::sort_chunks_by_map(f.sorted_x, DeviceTensor::upload(map2), false).download();
      EXPECT_TRUE(one.bitwise_equal(two)) << "rank " << s;
      EXPECT_TRUE(one.bitwise_equal(x[s])) << "rank " << s << ": unpermute(permute(x)) != x";
    }
    const std::string f = gpu_failures(c);
    EXPECT_TRUE(f.empty()) << f;
  }
}

// ---------------------------------------------------------------------------------------------
// Data-dependent errors: detected on the device, thrown naming the parameter.

TEST(DispatchGpuErrors, DispatchAndCombine) {
  REQUIRE_GPU();
  const DeviceTensor x = DeviceTensor::upload(Tensor(DType::bf16, {4, 8}));
  Tensor bad_map = routing_map(4, 4, 2).to(DType::u8);
  bad_map.set(2, 1, 2.0);
  moe::TokenDispatchParams p;
  p.num_out_tokens = 8;
  EXPECT_THAT(message_of([&] {
                moe::gpu::token_dispatch_fwd(x, DeviceTensor::upload(bad_map), nullptr, p);
              }),
              HasSubstr("routing_map"));
  const auto f =
      moe::gpu::token_dispatch_fwd(x, DeviceTensor::upload(routing_map(4, 4, 2)), nullptr, p);
  // A source row beyond R_in, a bad expert id and a bad count in a handed-in row_id_map.
  for (int which = 0; which < 3; ++which) {
    Tensor rim = f.row_id_map.download();
    if (which == 0) rim.set(1, 0, 100.0);
    if (which == 1) rim.set(1, 4, 9.0);
    if (which == 2) rim.set(1, 8, 7.0);
    const DeviceTensor r = DeviceTensor::upload(rim);
    EXPECT_THAT(message_of([&] { moe::gpu::token_combine_fwd(f.permuted, r, nullptr, nullptr); }),
                HasSubstr("row_id_map"))
        << which;
    EXPECT_THAT(
        message_of([&] { moe::gpu::token_combine_bwd(x, f.permuted, r, nullptr, nullptr); }),
        HasSubstr("row_id_map"))
        << which;
    EXPECT_THAT(message_of([&] { moe::gpu::token_dispatch_bwd(f.permuted, nullptr, r, nullptr); }),
                HasSubstr("row_id_map"))
        << which;
  }
}

TEST(DispatchGpuErrors, SortChunks) {
  REQUIRE_GPU();
  const DeviceTensor x = DeviceTensor::upload(Tensor(DType::f32, {10, 4}));
  auto run = [&](const std::vector<int64_t>& split, const std::vector<int64_t>& order) {
    const int64_t C = static_cast<int64_t>(split.size());
    return message_of([&] {
      moe::gpu::sort_chunks_by_index_fwd(x, DeviceTensor::upload(i32({C}, split)),
                                         DeviceTensor::upload(i32({C}, order)), nullptr);
    });
  };
  EXPECT_THAT(run({3, -1, 2}, {0, 1, 2}), HasSubstr("split_sizes"));
  EXPECT_THAT(run({6, 5, 2}, {0, 1, 2}), HasSubstr("split_sizes"));
  EXPECT_THAT(run({3, 1, 2}, {0, 2, 2}), HasSubstr("sorted_indices"));
  EXPECT_THAT(run({3, 1, 2}, {0, 3, 1}), HasSubstr("sorted_indices"));
  const DeviceTensor not_bijection =
      DeviceTensor::upload(i32({10}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 8}));
  for (bool inverse : {false, true}) {
    EXPECT_THAT(message_of([&] { moe::gpu::sort_chunks_by_map(x, not_bijection, inverse); }),
                HasSubstr("row_id_map"));
  }
  EXPECT_THAT(message_of([&] { moe::gpu::sort_chunks_by_index_bwd(x, nullptr, not_bijection); }),
              HasSubstr("row_id_map"));
}

TEST(DispatchGpuErrors, ArgsortBackend) {
  REQUIRE_GPU();
  const DeviceTensor probs = DeviceTensor::upload(Tensor(DType::f32, {4, 6}));
  EXPECT_THAT(message_of([&] {
                moe::gpu::routing_map_to_selected_experts_fwd(
                    probs, DeviceTensor::upload(routing_map(4, 6, 2)), 3);
              }),
              HasSubstr("routing_map"));
  const DeviceTensor x = DeviceTensor::upload(Tensor(DType::bf16, {3, 8}));
  moe::ArgsortDispatchParams p;
  p.num_experts = 4;
  p.topk = 2;
  p.align_size = 4;
  EXPECT_THAT(message_of([&] {
                moe::gpu::argsort_token_dispatch_fwd(
                    x, DeviceTensor::upload(i32({3, 2}, {0, 1, 2, 4, 1, 3})), p);
              }),
              HasSubstr("selected_experts"));
  EXPECT_THAT(message_of([&] {
                moe::gpu::argsort_token_dispatch_fwd(
                    x, DeviceTensor::upload(i32({3, 2}, {0, 1, 2, 2, 1, 3})), p);
              }),
              HasSubstr("selected_experts"));
  EXPECT_THAT(message_of([&] {
                moe::gpu::routing_map_to_selected_experts_bwd(
                    DeviceTensor::upload(Tensor(DType::f32, {3, 2})),
                    DeviceTensor::upload(i32({3, 2}, {0, 1, 3, 3, 1, 2})), 4);
              }),
              HasSubstr("selected_experts"));
  const moe::ArgsortPermParams st{2, 6, 0};
  std::vector<int64_t> bad(6);
  std::iota(bad.begin(), bad.end(), 0);
  bad[5] = 4;
  const DeviceTensor si = DeviceTensor::upload(i32({6}, bad));
  const DeviceTensor eo = DeviceTensor::upload(Tensor(DType::bf16, {6, 8}));
  const DeviceTensor w = DeviceTensor::upload(Tensor(DType::f32, {3, 2}));
  EXPECT_THAT(message_of([&] { moe::gpu::argsort_token_combine_fwd(eo, si, w, st); }),
              HasSubstr("sorted_indices"));
  EXPECT_THAT(message_of([&] { moe::gpu::argsort_token_dispatch_bwd(eo, si, st); }),
              HasSubstr("sorted_indices"));
}

TEST(DispatchGpuErrors, ExpertParallel) {
  REQUIRE_GPU();
  Tensor A = r3_counts();
  A.set(1, 2, -3.0);
  EXPECT_THAT(message_of([&] {
                moe::gpu::ragged_a2a_params(DeviceTensor::upload(A), 0, 2,
                                            moe::A2ADirection::forward);
              }),
              HasSubstr("all_shards_tokens_per_expert"));
  // Hand-made arrays for P = 2, 4 rows per buffer.
  moe::gpu::InProcessCommunicator comm(2);
  auto arrays = [](std::vector<int64_t> io, std::vector<int64_t> ss, std::vector<int64_t> oo,
                   std::vector<int64_t> rs) {
    return moe::gpu::RaggedA2AParams{
        DeviceTensor::upload(i32({2}, io)), DeviceTensor::upload(i32({2}, ss)),
        DeviceTensor::upload(i32({2}, oo)), DeviceTensor::upload(i32({2}, rs))};
  };
  std::vector<DeviceTensor> operand, init;
  for (int r = 0; r < 2; ++r) {
    operand.push_back(DeviceTensor::upload(Tensor(DType::f32, {4, 3})));
    init.push_back(DeviceTensor::upload(Tensor(DType::f32, {4, 3})));
  }
  auto msg = [&](std::vector<moe::gpu::RaggedA2AParams> p) {
    return message_of([&] { moe::gpu::ragged_all_to_all_fwd(comm, operand, init, p); });
  };
  {  // rank 1 expects 2 rows from rank 0, which sends 1
    std::vector<moe::gpu::RaggedA2AParams> p;
    p.push_back(arrays({0, 1}, {1, 1}, {0, 0}, {1, 1}));
    p.push_back(arrays({0, 1}, {1, 1}, {1, 1}, {2, 1}));
    EXPECT_THAT(msg(std::move(p)), HasSubstr("recv_sizes"));
  }
  {  // both sources write row 0 of rank 0
    std::vector<moe::gpu::RaggedA2AParams> p;
    p.push_back(arrays({0, 1}, {1, 1}, {0, 0}, {1, 1}));
    p.push_back(arrays({0, 1}, {1, 1}, {0, 1}, {1, 1}));
    EXPECT_THAT(msg(std::move(p)), HasSubstr("output_offsets"));
  }
  {  // rank 0 reads past its operand
    std::vector<moe::gpu::RaggedA2AParams> p;
    p.push_back(arrays({0, 3}, {1, 2}, {0, 0}, {1, 1}));
    p.push_back(arrays({0, 1}, {1, 1}, {1, 2}, {2, 1}));
    EXPECT_THAT(msg(std::move(p)), HasSubstr("input_offsets"));
  }
  {  // a negative size
    std::vector<moe::gpu::RaggedA2AParams> p;
    p.push_back(arrays({0, 1}, {-1, 1}, {0, 0}, {-1, 1}));
    p.push_back(arrays({0, 1}, {1, 1}, {1, 1}, {1, 1}));
    EXPECT_THAT(msg(std::move(p)), HasSubstr("send_sizes"));
  }
}

// ---------------------------------------------------------------------------------------------
// int64 indexing: `permuted` has more than 2^31 elements (rows * H > 2^31), so every element
// offset must be 64-bit. All tokens route to all 8 experts: dst(t,e) = e*T + t.

TEST(DispatchGpuInt64, TensorOver2e31Elements) {
  REQUIRE_GPU();
  const int64_t T = 65536, E = 8, H = 4104, R = T * E;
  ASSERT_GT(R * H, int64_t{1} << 31);
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  const size_t need = static_cast<size_t>(R * H * 2) * 3 + static_cast<size_t>(T * H * 2) * 3;
  if (free_b < need + (size_t{2} << 30)) {
    GTEST_SKIP() << "needs " << need / (1 << 20) << " MiB of device memory, " << free_b / (1 << 20)
                 << " MiB free";
  }
  Tensor xh(DType::bf16, {T, H});
  auto* xb = xh.data<uint16_t>();
  for (int64_t i = 0; i < T * H; ++i) {
    // Finite bf16 values with varied bits: sign, exponent in [120, 131], any mantissa.
    const uint32_t v = static_cast<uint32_t>(i * 2654435761u);
    xb[i] = static_cast<uint16_t>(((v >> 16) & 0x8000u) | ((120u + (v % 12u)) << 7) | (v & 0x7fu));
  }
  const DeviceTensor x = DeviceTensor::upload(xh);
  Tensor map(DType::boolean, {T, E});
  map.fill(1.0);
  moe::TokenDispatchParams p;
  p.num_out_tokens = R;
  const auto f = moe::gpu::token_dispatch_fwd(x, DeviceTensor::upload(map), nullptr, p);
  ASSERT_EQ(f.permuted.numel(), R * H);
  auto row_of = [&](const DeviceTensor& t, int64_t r) {
    Tensor h(t.dtype(), {1, t.dim(1)});
    const size_t bytes = h.nbytes();
    EXPECT_EQ(cudaMemcpy(h.bytes(), static_cast<const char*>(t.data()) + r * bytes, bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  };
  // Rows whose byte offsets lie past 2^31 and 2^32 bytes, and the last one.
  for (int64_t t : {int64_t{0}, int64_t{12345}, T - 1}) {
    for (int64_t e : {int64_t{0}, int64_t{3}, int64_t{5}, E - 1}) {
      const Tensor got = row_of(f.permuted, e * T + t);
      EXPECT_TRUE(rows_bitwise_equal(got, 0, xh, t))
          << "permuted row of (t, e) = (" << t << ", " << e << ")";
    }
  }
  // Backward (gather over 8 slots) and combine: 8*x exactly (a power-of-two scale).
  const auto b = moe::gpu::token_dispatch_bwd(f.permuted, nullptr, f.row_id_map, nullptr);
  const DeviceTensor comb = moe::gpu::token_combine_fwd(f.permuted, f.row_id_map, nullptr, nullptr);
  for (int64_t t : {int64_t{1}, T / 2, T - 1}) {
    const Tensor g = row_of(b.grad_x, t), cb = row_of(comb, t);
    for (int64_t h = 0; h < H; h += 97) {
      EXPECT_EQ(g.at(0, h), 8.0 * xh.at(t, h)) << t << "," << h;
      EXPECT_EQ(cb.at(0, h), 8.0 * xh.at(t, h)) << t << "," << h;
    }
  }
  // Combine backward without merging probs scatters x back to every slot.
  const DeviceTensor xt = DeviceTensor::upload(xh);
  const auto cbw = moe::gpu::token_combine_bwd(xt, f.permuted, f.row_id_map, nullptr, nullptr);
  for (int64_t e : {int64_t{6}, E - 1}) {
    const Tensor got = row_of(cbw.grad_permuted, e * T + T - 1);
    EXPECT_TRUE(rows_bitwise_equal(got, 0, xh, T - 1)) << "grad permuted row, e = " << e;
  }
}

}  // namespace
