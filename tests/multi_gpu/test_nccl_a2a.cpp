// The ragged all-to-all over NCCL (gpu/nccl_comm.cuh), one rank per process, against the CPU
// reference exchange (reference/ep.h). Data are formulas of (seed, tag, row, column) where tag
// is the source rank (operands), P + d (rank d's initial receive buffer) or 2P + d (rank d's
// cotangent), so every rank builds all P ranks' inputs locally, runs the reference over them and
// compares its own buffer bitwise (nccl-tests style). #wrong is reduced over ranks: every rank
// sees the same verdict. Faults must be raised on every rank, with the in-process
// communicator's message, and write no byte (canary-filled buffers).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/nccl_comm.cuh"
#include "harness/core/params/ep.h"
#include "harness/ops/check.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/registry.h"
#include "reference/ep.h"
#include "tests/multi_gpu/nccl_env.h"

namespace moe {
namespace {

using gpu::DeviceTensor;
using Arr = std::vector<std::vector<int32_t>>;  // [rank][peer]

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Integers in [-128, 128): exact in f32, bf16 and f16.
double formula(uint64_t seed, int64_t tag, int64_t row, int64_t col) {
  const uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(tag) * 0x9E3779B97F4A7C15ull ^
                                    mix(static_cast<uint64_t>(row) * 0xC2B2AE3D27D4EB4Full ^
                                        static_cast<uint64_t>(col))));
  return static_cast<double>(static_cast<int64_t>(h % 256) - 128);
}

Tensor formula_tensor(DType d, int64_t rows, int64_t H, uint64_t seed, int64_t tag) {
  Tensor t(d, {rows, H});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < H; ++c) t.set(r, c, formula(seed, tag, r, c));
  return t;
}

// The four arrays of every rank, host side.
struct HostArrays {
  Arr io, ss, oo, rs;
};

HostArrays host_arrays(const std::vector<ref::RaggedA2AParams>& p) {
  HostArrays h;
  auto vec = [](const Tensor& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<int32_t>(t.at(i));
    return v;
  };
  for (const auto& r : p) {
    h.io.push_back(vec(r.input_offsets));
    h.ss.push_back(vec(r.send_sizes));
    h.oo.push_back(vec(r.output_offsets));
    h.rs.push_back(vec(r.recv_sizes));
  }
  return h;
}

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t(DType::i32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), v[i]);
  return t;
}

std::vector<ref::RaggedA2AParams> ref_params(const HostArrays& h) {
  std::vector<ref::RaggedA2AParams> p;
  for (size_t r = 0; r < h.io.size(); ++r) {
    p.push_back(
        {i32_tensor(h.io[r]), i32_tensor(h.ss[r]), i32_tensor(h.oo[r]), i32_tensor(h.rs[r])});
  }
  return p;
}

struct DevArrays {
  DeviceTensor io, ss, oo, rs;
};
DevArrays upload(const HostArrays& h, int r, gpu::Stream s) {
  return {
      DeviceTensor::upload(i32_tensor(h.io[r]), s), DeviceTensor::upload(i32_tensor(h.ss[r]), s),
      DeviceTensor::upload(i32_tensor(h.oo[r]), s), DeviceTensor::upload(i32_tensor(h.rs[r]), s)};
}

gpu::RaggedA2ARank rank_args(int r, const void* send, int64_t send_rows, void* recv,
                             int64_t recv_rows, const DevArrays& a) {
  return {r,
          send,
          send_rows,
          recv,
          recv_rows,
          a.io.data<int32_t>(),
          a.ss.data<int32_t>(),
          a.oo.data<int32_t>(),
          a.rs.data<int32_t>()};
}

int64_t row_bytes_of(const Tensor& t) {
  return t.dim(1) * static_cast<int64_t>(dtype_size(t.dtype()));
}

// Elements of got that differ bitwise from want; the first one described in *first.
int64_t count_wrong(const Tensor& got, const Tensor& want, std::string* first) {
  if (got.dtype() != want.dtype() || got.shape() != want.shape()) {
    *first = "got " + got.describe() + ", want " + want.describe();
    return std::max<int64_t>(1, want.numel());
  }
  const size_t es = dtype_size(got.dtype());
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(got.bytes() + i * es, want.bytes() + i * es, es) != 0) {
      if (bad++ == 0) {
        const int64_t H = got.rank() == 2 ? got.dim(1) : 1;
        *first = "row " + std::to_string(i / H) + " col " + std::to_string(i % H) + ": got " +
                 std::to_string(got.at(i)) + ", want " + std::to_string(want.at(i));
      }
    }
  }
  return bad;
}

// The adjoint arrays of rank me (SPEC §9.3 backward) from its own arrays, learning where its
// chunks landed with all_to_all_i32: (output_offsets[j], input_offsets[j]) go to rank j.
HostArrays adjoint_arrays(gpu::NcclCommunicator& comm, const HostArrays& h, int me) {
  const int P = comm.size();
  const gpu::Stream s = comm.stream();
  Tensor packed(DType::i32, {2 * P});
  for (int j = 0; j < P; ++j) {
    packed.set(2 * j, h.oo[me][j]);
    packed.set(2 * j + 1, h.io[me][j]);
  }
  const DeviceTensor d_send = DeviceTensor::upload(packed, s);
  DeviceTensor d_recv(DType::i32, {2 * P});
  comm.all_to_all_i32({{me, d_send.data<int32_t>(), d_recv.data<int32_t>()}}, 2, s);
  const Tensor got = d_recv.download(s);
  HostArrays a;
  a.io.assign(P, {});
  a.ss = a.oo = a.rs = a.io;
  for (int s2 = 0; s2 < P; ++s2) {
    a.ss[me].push_back(h.rs[me][s2]);
    a.rs[me].push_back(h.ss[me][s2]);
    a.io[me].push_back(static_cast<int32_t>(got.at(2 * s2)));      // where s2's chunk landed here
    a.oo[me].push_back(static_cast<int32_t>(got.at(2 * s2 + 1)));  // where it came from in s2
  }
  return a;  // only this rank's entry is filled: the others' arrays are theirs to learn
}

// One exchange on this rank: result = init with the received rows (forward), or the adjoint
// exchange of ct into zeros (backward). Returns the device fault (code 0: none).
gpu::DeviceError run_exchange(gpu::NcclCommunicator& comm, const Tensor& send, int64_t send_rows,
                              Tensor* recv_inout, const HostArrays& h, int me) {
  const gpu::Stream s = comm.stream();
  const DeviceTensor d_send = DeviceTensor::upload(send, s);
  DeviceTensor d_recv = DeviceTensor::upload(*recv_inout, s);
  const DevArrays a = upload(h, me, s);
  gpu::ErrorFlag flag;
  flag.reset(s);
  comm.ragged_all_to_all(
      {rank_args(me, d_send.data(), send_rows, d_recv.data(), recv_inout->dim(0), a)},
      row_bytes_of(send), flag.device_ptr(), s);
  const gpu::DeviceError e = flag.read(s);
  *recv_inout = d_recv.download(s);
  return e;
}

struct Verdict {
  int64_t wrong = 0;
  std::string first;
};

// Forward and backward of one case on this rank against the reference over all ranks' inputs.
// operand/init/ct hold every rank's tensor (index = rank); the reference sees all of them.
void check_case(gpu::NcclCommunicator& comm, const std::string& what,
                const std::vector<Tensor>& operand, const std::vector<Tensor>& init,
                const std::vector<Tensor>& ct, const std::vector<ref::RaggedA2AParams>& params,
                const Tensor* want_fwd_override = nullptr,
                const Tensor* want_bwd_override = nullptr) {
  const int P = comm.size(), me = comm.rank();
  const ref::SimComm sim(P);
  const HostArrays h = host_arrays(params);
  const int64_t R_in = operand[0].dim(0);

  // Forward.
  const auto want_fwd = ref::ragged_all_to_all_fwd(sim, operand, init, params);
  Tensor got = init[me].clone();
  const gpu::DeviceError ef = run_exchange(comm, operand[me], R_in, &got, h, me);
  Verdict fwd;
  fwd.wrong = count_wrong(got, want_fwd_override ? *want_fwd_override : want_fwd[me], &fwd.first);
  EXPECT_EQ(ef.code, 0) << what << ": forward raised fault " << ef.code;
  EXPECT_EQ(fwd.wrong, 0) << what << ": rank " << me << " forward, first: " << fwd.first;

  // Backward: the adjoint exchange of ct into zeros, arrays learnt through all_to_all_i32.
  const auto want_bwd = ref::ragged_all_to_all_bwd(sim, ct, params, R_in);
  const HostArrays adj = adjoint_arrays(comm, h, me);
  Tensor grad(ct[me].dtype(), {R_in, ct[me].dim(1)});
  const gpu::DeviceError eb = run_exchange(comm, ct[me], ct[me].dim(0), &grad, adj, me);
  Verdict bwd;
  bwd.wrong = count_wrong(grad, want_bwd_override ? *want_bwd_override : want_bwd[me], &bwd.first);
  EXPECT_EQ(eb.code, 0) << what << ": backward raised fault " << eb.code;
  EXPECT_EQ(bwd.wrong, 0) << what << ": rank " << me << " backward, first: " << bwd.first;

  const int64_t total =
      comm.all_reduce_sum(fwd.wrong + bwd.wrong + (ef.code != 0) + (eb.code != 0));
  EXPECT_EQ(total, 0) << what << ": #wrong over all ranks (forward + backward + faults)";
}

// ---------------------------------------------------------------------------------------------
// Counts

// A [P, E=2P] i32 by regime; aligned up to a multiple of `align` (non-empty experts only).
Tensor make_counts(const std::string& regime, int P, int64_t align, uint64_t seed) {
  const int E = 2 * P, L = 2;
  Tensor A(DType::i32, {P, E});
  for (int i = 0; i < P; ++i) {
    for (int e = 0; e < E; ++e) {
      const int owner = e / L;
      int64_t c = static_cast<int64_t>(mix(seed + 31 * i + e) % 7);
      if (regime == "uniform") c = 5;
      if (regime == "skewed") c = owner == 0 ? 9 + 2 * c : c % 3;  // rank 0's experts are hot
      // No chunk from i to its right neighbour; rank P-1 sends nothing at all.
      if (regime == "zero_peers" && (owner == (i + 1) % P || i == P - 1)) c = 0;
      if (align > 0 && c > 0) c = (c + align - 1) / align * align;
      A.set(i, e, static_cast<double>(c));
    }
  }
  return A;
}

struct Layout {
  std::vector<ref::RaggedA2AParams> params;
  int64_t R_in = 0, R_out = 0;
};

// The §9.2 arrays of every rank and buffers that fit them plus `slack` rows.
Layout layout(const Tensor& A, int P, A2ADirection dir, int64_t slack) {
  Layout l;
  for (int s = 0; s < P; ++s) l.params.push_back(ref::ragged_a2a_params(A, s, P, dir));
  const HostArrays h = host_arrays(l.params);
  for (int r = 0; r < P; ++r) {
    int64_t sent = 0, got = 0;
    for (int j = 0; j < P; ++j) {
      sent += h.ss[r][j];
      got += h.rs[r][j];
    }
    l.R_in = std::max(l.R_in, sent);
    l.R_out = std::max(l.R_out, got);
  }
  l.R_in += slack;
  l.R_out += slack;
  return l;
}

struct FormulaCase {
  const char* regime;
  DType dtype;
  int64_t H, align, slack;
  A2ADirection dir;
};

// ---------------------------------------------------------------------------------------------

TEST(NcclRaggedA2A, FormulaCasesMatchReference) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size();
  const FormulaCase cases[] = {
      {"uniform", DType::bf16, 64, 0, 0, A2ADirection::forward},
      {"skewed", DType::bf16, 7168, 16, 3, A2ADirection::forward},  // R3 alignment padding
      {"skewed", DType::bf16, 33, 16, 0, A2ADirection::reverse},
      {"zero_peers", DType::f32, 5, 4, 2, A2ADirection::forward},
      {"zero_peers", DType::f16, 3, 0, 0, A2ADirection::reverse},
      {"random", DType::bf16, 1, 0, 5, A2ADirection::forward},  // 2-byte rows
      {"random", DType::f32, 17, 8, 0, A2ADirection::reverse},
  };
  uint64_t seed = 100;
  for (const FormulaCase& fc : cases) {
    ++seed;
    const Tensor A = make_counts(fc.regime, P, fc.align, seed);
    const Layout l = layout(A, P, fc.dir, fc.slack);
    std::vector<Tensor> operand, init, ct;
    for (int r = 0; r < P; ++r) {
      operand.push_back(formula_tensor(fc.dtype, l.R_in, fc.H, seed, r));
      init.push_back(formula_tensor(fc.dtype, l.R_out, fc.H, seed, P + r));
      ct.push_back(formula_tensor(fc.dtype, l.R_out, fc.H, seed, 2 * P + r));
    }
    const std::string what = std::string(fc.regime) + " " + std::string(dtype_name(fc.dtype)) +
                             " H=" + std::to_string(fc.H) + " a=" + std::to_string(fc.align) + " " +
                             std::string(a2a_direction_name(fc.dir));
    check_case(comm, what, operand, init, ct, l.params);
  }
}

// The backward is the same call with the reverse-direction arrays: the adjoint arrays a rank
// learns through all_to_all_i32 are exactly ragged_a2a_params(A, s, P, reverse) for §9.2 layouts.
TEST(NcclRaggedA2A, AdjointArraysAreTheReverseDirection) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size(), me = comm.rank();
  int64_t mismatches = 0;
  for (const char* regime : {"skewed", "zero_peers", "random"}) {
    const Tensor A = make_counts(regime, P, 16, 7);
    const Layout fwd = layout(A, P, A2ADirection::forward, 0);
    const HostArrays adj = adjoint_arrays(comm, host_arrays(fwd.params), me);
    const ref::RaggedA2AParams rev = ref::ragged_a2a_params(A, me, P, A2ADirection::reverse);
    auto vec = [](const Tensor& t) {
      std::vector<int32_t> v;
      for (int64_t i = 0; i < t.numel(); ++i) v.push_back(static_cast<int32_t>(t.at(i)));
      return v;
    };
    const bool same = adj.io[me] == vec(rev.input_offsets) && adj.ss[me] == vec(rev.send_sizes) &&
                      adj.oo[me] == vec(rev.output_offsets) && adj.rs[me] == vec(rev.recv_sizes);
    EXPECT_TRUE(same) << regime << ": rank " << me << "'s adjoint arrays differ from reverse";
    mismatches += !same;
  }
  EXPECT_EQ(comm.all_reduce_sum(mismatches), 0);
}

TEST(NcclRaggedA2A, AllToAllI32) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size(), me = comm.rank();
  const gpu::Stream s = comm.stream();
  const int64_t count = 3;
  Tensor send(DType::i32, {P * count});
  for (int j = 0; j < P; ++j)
    for (int c = 0; c < count; ++c) send.set(j * count + c, 1000 * me + 10 * j + c);
  const DeviceTensor d_send = DeviceTensor::upload(send, s);
  DeviceTensor d_recv(DType::i32, {P * count});
  d_recv.fill_bytes(0x7F, s);
  comm.all_to_all_i32({{me, d_send.data<int32_t>(), d_recv.data<int32_t>()}}, count, s);
  const Tensor got = d_recv.download(s);
  int64_t wrong = 0;
  for (int j = 0; j < P; ++j)
    for (int c = 0; c < count; ++c) wrong += got.at(j * count + c) != 1000 * j + 10 * me + c;
  EXPECT_EQ(wrong, 0) << "rank " << me;
  EXPECT_EQ(comm.all_reduce_sum(wrong), 0);
  EXPECT_THROW(
      comm.all_to_all_i32({{(me + 1) % (P + 1), d_send.data<int32_t>(), d_recv.data<int32_t>()}},
                          count, s),
      std::invalid_argument);
}

// Every registry case of ragged_all_to_all with num_ep == P (named ones and random ones), each
// rank taking its slice of the case's stacked inputs and outputs.
TEST(NcclRaggedA2A, RegistryCases) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size(), me = comm.rank();
  const ops::OpInfo* op = ops::find_op("ragged_all_to_all");
  ASSERT_NE(op, nullptr);  // the same on every rank: no collective skipped on one rank only
  std::vector<Case> cases;
  for (const Case& c : op->named()) {
    if (c.i("num_ep") == P) cases.push_back(c);
  }
  const int want_random = 24;
  int random = 0;
  for (uint64_t i = 0; i < 4000 && random < want_random; ++i) {
    Case c =
        op->gen()(rc::Random(20261122ull * 1000003ull + i), 10 + static_cast<int>(i % 60)).value();
    if (c.i("num_ep") != P) continue;
    cases.push_back(std::move(c));
    ++random;
  }
  int64_t checked = 0;
  for (const Case& c : cases) {
    const TensorMap in = op->make_inputs(c);
    const TensorMap want = op->reference(c, in, false);
    auto operand = ops::unstack(in.at("input.operand"));
    auto init = ops::unstack(in.at("input.output_init"));
    auto ct = ops::unstack(in.at("cotangent.result"));
    auto io = ops::unstack(in.at("input.input_offsets")),
         ss = ops::unstack(in.at("input.send_sizes"));
    auto oo = ops::unstack(in.at("input.output_offsets")),
         rs = ops::unstack(in.at("input.recv_sizes"));
    std::vector<ref::RaggedA2AParams> params;
    for (int r = 0; r < P; ++r) {
      params.push_back({std::move(io[r]), std::move(ss[r]), std::move(oo[r]), std::move(rs[r])});
    }
    const auto want_fwd = ops::unstack(want.at("output.result"));
    const auto want_bwd = ops::unstack(want.at("grad.operand"));
    check_case(comm, c.line() + "\n  in-process replay: " + ops::replay_line(c, "gpu"), operand,
               init, ct, params, &want_fwd[me], &want_bwd[me]);
    ++checked;
  }
  EXPECT_GE(checked, 3) << "too few registry cases with num_ep == " << P;
  std::printf("[rank %d] %lld registry cases of ragged_all_to_all checked over NCCL\n", me,
              static_cast<long long>(checked));
}

// ---------------------------------------------------------------------------------------------
// Faults

struct Mutation {
  const char* name;
  const char* array;  // the word the message must carry
  // Edits the arrays (every rank's) or the receive rows so that exactly one fault exists: then
  // the in-process communicator's message is deterministic and must be identical.
  void (*apply)(HostArrays& h, int64_t& recv_rows, int P);
};

const Mutation kMutations[] = {
    {"negative send size", "send_sizes",
     [](HostArrays& h, int64_t&, int P) { h.ss[0][P - 1] = -3; }},
    {"recv_sizes disagree with send_sizes", "recv_sizes",
     [](HostArrays& h, int64_t&, int P) { h.rs[P - 1][0] += 1; }},
    {"source range past the operand", "input_offsets",
     [](HostArrays& h, int64_t&, int P) { h.io[0][P - 1] = 1 << 20; }},
    {"undersized receive buffer (R3)", "recv_sizes",
     [](HostArrays& h, int64_t& recv_rows, int P) {
       int64_t total0 = 0;
       for (int s = 0; s < P; ++s) total0 += h.rs[0][s];
       recv_rows = total0 - 1;  // rank 0 receives the most (hot experts): only it overflows
     }},
    {"destination range past the receive buffer", "output_offsets",
     [](HostArrays& h, int64_t& recv_rows, int) {
       h.oo[0][0] = static_cast<int32_t>(recv_rows - 1);  // rank 0's own chunk is >= 18 rows
     }},
    {"overlapping destinations", "output_offsets",
     [](HostArrays& h, int64_t&, int) { h.oo[1][0] = h.oo[0][0]; }},
};

// The message the in-process communicator gives for the same arrays, all P ranks on this GPU.
std::string in_process_message(const HostArrays& h, int64_t send_rows, int64_t recv_rows,
                               int64_t row_bytes, gpu::Stream s) {
  const int P = static_cast<int>(h.io.size());
  std::vector<DeviceTensor> send, recv;
  std::vector<DevArrays> arrays;
  std::vector<gpu::RaggedA2ARank> ranks;
  for (int r = 0; r < P; ++r) {
    send.emplace_back(DType::u8, Shape{send_rows * row_bytes});
    recv.emplace_back(DType::u8, Shape{recv_rows * row_bytes});
    arrays.push_back(upload(h, r, s));
  }
  for (int r = 0; r < P; ++r) {
    ranks.push_back(rank_args(r, send[r].data(), send_rows, recv[r].data(), recv_rows, arrays[r]));
  }
  gpu::InProcessCommunicator ip(P);
  gpu::ErrorFlag flag;
  flag.reset(s);
  ip.ragged_all_to_all(ranks, row_bytes, flag.device_ptr(), s);
  try {
    gpu::throw_if_a2a_fault(flag.read(s), send_rows, recv_rows);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no fault)";
}

TEST(NcclRaggedA2A, FaultsRaiseOnEveryRankAndWriteNothing) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size(), me = comm.rank();
  if (P < 2) GTEST_SKIP() << "the fault cases need 2 or more ranks";
  const gpu::Stream s = comm.stream();
  const int64_t H = 8, row_bytes = H * 2, guard = 64;
  const Tensor A = make_counts("skewed", P, 0, 3);
  const Layout l = layout(A, P, A2ADirection::forward, 0);
  const Tensor operand = formula_tensor(DType::bf16, l.R_in, H, 3, me);
  const DeviceTensor d_send = DeviceTensor::upload(operand, s);
  for (const Mutation& m : kMutations) {
    HostArrays h = host_arrays(l.params);
    int64_t recv_rows = l.R_out;
    m.apply(h, recv_rows, P);
    // The receive buffer is recv_rows rows plus a guard band, all canary bytes.
    DeviceTensor d_recv(DType::u8, {(recv_rows + guard) * row_bytes});
    d_recv.fill_bytes(0xA5, s);
    const DevArrays a = upload(h, me, s);
    gpu::ErrorFlag flag;
    flag.reset(s);
    comm.ragged_all_to_all({rank_args(me, d_send.data(), l.R_in, d_recv.data(), recv_rows, a)},
                           row_bytes, flag.device_ptr(), s);
    std::string msg;
    try {
      gpu::throw_if_a2a_fault(flag.read(s), l.R_in, recv_rows);
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    const Tensor after = d_recv.download(s);
    int64_t touched = 0;
    for (int64_t i = 0; i < after.numel(); ++i) {
      touched += std::to_integer<uint8_t>(after.bytes()[i]) != 0xA5;
    }
    const std::string want = in_process_message(h, l.R_in, recv_rows, row_bytes, s);
    EXPECT_FALSE(msg.empty()) << m.name << ": rank " << me << " raised nothing";
    EXPECT_NE(msg.find(m.array), std::string::npos) << m.name << ": message: " << msg;
    EXPECT_EQ(msg, want) << m.name << ": NCCL and in-process messages differ";
    EXPECT_EQ(touched, 0) << m.name << ": rank " << me << " had " << touched
                          << " receive-buffer bytes written (guard band included)";
    const int64_t raised = comm.all_reduce_sum(msg.empty() ? 0 : 1);
    EXPECT_EQ(raised, P) << m.name << ": raised on " << raised << " of " << P << " ranks";
    EXPECT_EQ(comm.all_reduce_sum(touched), 0) << m.name;
  }
}

// Caller errors that only one rank makes are still seen by all (they travel in the control
// packet), so every rank throws instead of one rank waiting for a peer that gave up.
TEST(NcclRaggedA2A, OneRankCallerErrorsThrowOnEveryRank) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size(), me = comm.rank();
  const gpu::Stream s = comm.stream();
  const Tensor A = make_counts("uniform", P, 0, 5);
  const Layout l = layout(A, P, A2ADirection::forward, 0);
  const HostArrays h = host_arrays(l.params);
  const DevArrays a = upload(h, me, s);
  const int64_t H = 4, row_bytes = 2 * H;
  DeviceTensor d_send(DType::bf16, {l.R_in, H}), d_recv(DType::bf16, {l.R_out, H});
  struct Variant {
    const char* name;
    const char* word;
    bool null_recv;
    int64_t row_bytes;
  };
  const Variant variants[] = {
      {"rank 0 moves wider rows", "row_bytes", false, me == 0 ? row_bytes + 2 : row_bytes},
      {"the last rank passes a null receive buffer", "recv", me == P - 1, row_bytes},
  };
  for (const Variant& v : variants) {
    std::string msg;
    try {
      comm.ragged_all_to_all(
          {rank_args(me, d_send.data(), l.R_in, v.null_recv ? nullptr : d_recv.data(), l.R_out, a)},
          v.row_bytes, nullptr, s);
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(v.word), std::string::npos)
        << v.name << ": rank " << me << ": '" << msg << "'";
    EXPECT_EQ(comm.all_reduce_sum(msg.empty() ? 0 : 1), P) << v.name;
  }
  // A check-only call (row_bytes 0, no buffers: how gpu/ep.cu validates the forward arrays
  // before a backward) moves nothing and raises nothing.
  gpu::ErrorFlag flag;
  flag.reset(s);
  comm.ragged_all_to_all({rank_args(me, nullptr, l.R_in, nullptr, l.R_out, a)}, 0,
                         flag.device_ptr(), s);
  EXPECT_EQ(flag.read(s).code, 0);
}

// Large rows on device-side pattern data (the benchmark's checker), and the checker itself
// catching a single wrong word.
TEST(NcclRaggedA2A, PatternExchangeLargeRows) {
  MOE_NCCL_OR_SKIP(comm);
  const int P = comm.size(), me = comm.rank();
  const gpu::Stream s = comm.stream();
  const int64_t H = 7168, row_bytes = 2 * H;
  const uint64_t seed = 77;
  for (const char* regime : {"uniform", "skewed"}) {
    // Thousands of 14 KiB rows per rank, 16-row alignment padding (times 64).
    Tensor A(DType::i32, {P, 2 * P});
    const Tensor shape = make_counts(regime, P, 16, 9);
    for (int i = 0; i < P; ++i)
      for (int e = 0; e < 2 * P; ++e) A.set(i, e, shape.at(i, e) * 64);
    const Layout l = layout(A, P, A2ADirection::forward, 0);
    const HostArrays h = host_arrays(l.params);
    const DevArrays a = upload(h, me, s);
    DeviceTensor d_send(DType::bf16, {l.R_in, H}), d_recv(DType::bf16, {l.R_out, H});
    gpu::a2a_pattern_fill(d_send.data(), l.R_in, row_bytes, seed, me, s);
    gpu::a2a_pattern_fill(d_recv.data(), l.R_out, row_bytes, seed, P + me, s);
    gpu::ErrorFlag flag;
    flag.reset(s);
    comm.ragged_all_to_all({rank_args(me, d_send.data(), l.R_in, d_recv.data(), l.R_out, a)},
                           row_bytes, flag.device_ptr(), s);
    EXPECT_EQ(flag.read(s).code, 0);
    std::vector<gpu::A2AChunk> chunks;
    for (int src = 0; src < P; ++src) {
      chunks.push_back({src, h.io[src][me], h.oo[src][me], h.ss[src][me]});
    }
    const int64_t wrong =
        gpu::a2a_pattern_count_wrong(d_recv.data(), l.R_out, row_bytes, seed, me, P, chunks, s);
    EXPECT_EQ(wrong, 0) << regime << ": rank " << me;
    EXPECT_EQ(comm.all_reduce_sum(wrong), 0) << regime;
    if (std::string(regime) == "uniform" && l.R_out > 0) {
      // One flipped bit in the last row must be counted.
      Tensor host = d_recv.download(s);
      host.bytes()[host.nbytes() - 1] ^= std::byte{0x01};
      const DeviceTensor bad = DeviceTensor::upload(host, s);
      EXPECT_EQ(
          gpu::a2a_pattern_count_wrong(bad.data(), l.R_out, row_bytes, seed, me, P, chunks, s), 1);
    }
  }
}

TEST(NcclBootstrap, BadEnvironmentNamesTheVariable) {
  // Pure host parsing; restores the launcher's variables afterwards.
  const char* names[] = {"MOE_RANK", "MOE_WORLD_SIZE", "MOE_LOCAL_RANK", "MOE_NCCL_ID",
                         "MOE_NCCL_ID_FILE"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
    unsetenv(n);
  }
  auto message = [] {
    try {
      gpu::NcclBootstrap::from_env();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message().find("MOE_WORLD_SIZE"), std::string::npos);
  setenv("MOE_WORLD_SIZE", "2", 1);
  setenv("MOE_RANK", "2", 1);
  EXPECT_NE(message().find("MOE_RANK"), std::string::npos);
  setenv("MOE_RANK", "1", 1);
  EXPECT_NE(message().find("MOE_NCCL_ID_FILE"), std::string::npos);  // no id source for 2 ranks
  setenv("MOE_NCCL_ID_FILE", "/nonexistent/id", 1);
  setenv("MOE_LOCAL_RANK", "x", 1);
  EXPECT_NE(message().find("MOE_LOCAL_RANK"), std::string::npos);
  setenv("MOE_LOCAL_RANK", "1", 1);
  const gpu::NcclBootstrap b = gpu::NcclBootstrap::from_env();
  EXPECT_EQ(b.rank, 1);
  EXPECT_EQ(b.world_size, 2);
  EXPECT_EQ(b.local_rank, 1);
  EXPECT_EQ(b.id_file, "/nonexistent/id");
  for (const char* n : names) unsetenv(n);
  for (const auto& [k, v] : saved) setenv(k.c_str(), v.c_str(), 1);
}

}  // namespace
}  // namespace moe
