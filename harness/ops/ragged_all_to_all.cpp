// Registry record of ragged_all_to_all (SPEC §9.3) over P ranks simulated in one process.
// Inputs: operand [P,R_in,H], output_init [P,R_out,H], and the four [P,P] i32 arrays (row r =
// rank r's arrays, built by ragged_a2a_params from a generated A). Output: result [P,R_out,H].
// Backward: grad operand [P,R_in,H]. Pure data movement: exact comparison.
#include "harness/core/params/ep.h"
#include "harness/ops/check.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/ep.h"

namespace moe::ops {

namespace {

// Row counts of the case: the forward exchange sends the dispatch buffer (R_pre rows) into the
// receive buffer (R rows, §9.5); the reverse exchange goes the other way.
struct Rows {
  int64_t in = 0, out = 0;
};
Rows rows(const Case& c) {
  const int64_t P = c.i("num_ep"), E = c.i("E"), N = c.i("N"), a = c.i("align_size", 0);
  const int64_t pre = ep_pre_rows(E, N, a) + c.i("slack", 0);
  const int64_t recv = ep_recv_rows(P, E, N, a) + c.i("slack", 0);
  Rows r = c.s("direction", "forward") == "forward" ? Rows{pre, recv} : Rows{recv, pre};
  // Explicit row counts (cases rebuilt from golden files) override the derived ones.
  r.in = c.i("R_in", r.in);
  r.out = c.i("R_out", r.out);
  return r;
}

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    Case c = draw_case("ragged_all_to_all", kSizeRegimes);
    draw_ep_experts(c);
    c.set("N", *any_in(0, 24)).set("H", *any_in(1, 6));
    c.set("align_size", draw_ep_align_size());
    c.set("slack", *rc::gen::element<int64_t>(0, 0, 3));
    c.set("direction", *rc::gen::element<std::string>("forward", "reverse"));
    c.set("output_init", *rc::gen::element<std::string>("zeros", "random"));
    return c;
  });
}

CaseBuilder base(const std::string& name, DType d, int64_t P, int64_t E, int64_t N, int64_t H,
                 int64_t a, const std::string& dir) {
  CaseBuilder b("ragged_all_to_all", d);
  b.seed(13).name(name).set("num_ep", P).set("E", E).set("N", N).set("H", H).set("align_size", a);
  return b.set("slack", int64_t{0}).set("direction", dir).set("output_init", "zeros");
}

std::vector<Case> named() {
  std::vector<Case> v;
  // R3 shape per EP group: P = 2, E = 8, 32 rows per rank, a = 16, H = 32.
  v.push_back(base("R3_forward", DType::bf16, 2, 8, 32, 32, 16, "forward"));
  v.push_back(base("R3_reverse", DType::bf16, 2, 8, 32, 32, 16, "reverse").regime(Regime::skewed));
  v.push_back(
      base("p4_random_init", DType::f32, 4, 8, 12, 5, 0, "forward").set("output_init", "random"));
  v.push_back(
      base("p8_all_to_one", DType::f16, 8, 8, 6, 3, 2, "forward").regime(Regime::all_to_one));
  v.push_back(base("zero_rows", DType::f32, 4, 4, 0, 3, 0, "forward"));
  return v;
}

TensorMap make_inputs(const Case& c) {
  const int64_t P = c.i("num_ep"), E = c.i("E"), N = c.i("N"), H = c.i("H");
  const Rows r = rows(c);
  const Tensor A = make_ep_counts(c, P, E, N, c.i("align_size", 0), "counts");
  const A2ADirection dir = parse_a2a_direction(c.s("direction", "forward"));
  // The arrays come from SPEC §9.2's table (ep_family.h), not from the reference's
  // ragged_a2a_params, so the exchange is judged on offsets derived independently of it.
  auto i32 = [](const std::vector<int64_t>& v) {
    Tensor t(DType::i32, {static_cast<int64_t>(v.size())});
    for (size_t k = 0; k < v.size(); ++k) t.set(static_cast<int64_t>(k), static_cast<double>(v[k]));
    return t;
  };
  std::vector<Tensor> io, ss, oo, rs;
  for (int64_t s = 0; s < P; ++s) {
    const A2AArrays p = spec_a2a_arrays(A, s, P, dir == A2ADirection::forward);
    io.push_back(i32(p.input_offsets));
    ss.push_back(i32(p.send_sizes));
    oo.push_back(i32(p.output_offsets));
    rs.push_back(i32(p.recv_sizes));
  }
  TensorMap m;
  m.emplace("input.operand", normal_tensor(c, c.dtype, {P, r.in, H}, "input.operand"));
  if (c.s("output_init", "zeros") == "random") {
    m.emplace("input.output_init", normal_tensor(c, c.dtype, {P, r.out, H}, "input.output_init"));
  } else {
    m.emplace("input.output_init", Tensor(c.dtype, {P, r.out, H}));
  }
  m.emplace("input.input_offsets", stack(io));
  m.emplace("input.send_sizes", stack(ss));
  m.emplace("input.output_offsets", stack(oo));
  m.emplace("input.recv_sizes", stack(rs));
  m.emplace("cotangent.result", normal_tensor(c, c.dtype, {P, r.out, H}, "cotangent.result"));
  return m;
}

std::vector<ref::RaggedA2AParams> params_of(const TensorMap& in) {
  auto io = unstack(in.at("input.input_offsets")), ss = unstack(in.at("input.send_sizes"));
  auto oo = unstack(in.at("input.output_offsets")), rs = unstack(in.at("input.recv_sizes"));
  std::vector<ref::RaggedA2AParams> p;
  for (size_t r = 0; r < io.size(); ++r) {
    p.push_back({std::move(io[r]), std::move(ss[r]), std::move(oo[r]), std::move(rs[r])});
  }
  return p;
}

// The adjoint exchange's arrays (§9.3 backward): rank d sends back what it received from s, from
// where it landed, to where it came from.
std::vector<ref::RaggedA2AParams> adjoint_params(const std::vector<ref::RaggedA2AParams>& p) {
  const int64_t P = static_cast<int64_t>(p.size());
  std::vector<ref::RaggedA2AParams> a;
  for (int64_t d = 0; d < P; ++d) {
    ref::RaggedA2AParams q{Tensor(DType::i32, {P}), Tensor(DType::i32, {P}),
                           Tensor(DType::i32, {P}), Tensor(DType::i32, {P})};
    for (int64_t s = 0; s < P; ++s) {
      q.send_sizes.set(s, p[d].recv_sizes.at(s));
      q.recv_sizes.set(s, p[d].send_sizes.at(s));
      q.input_offsets.set(s, p[s].output_offsets.at(d));
      q.output_offsets.set(s, p[s].input_offsets.at(d));
    }
    a.push_back(std::move(q));
  }
  return a;
}

TensorMap reference(const Case& c, const TensorMap& in, bool exact) {
  const auto rnd = exact ? ref::Rounding::none : ref::Rounding::to_dtype;
  const int64_t P = c.i("num_ep");
  const ref::SimComm comm(P);
  const auto params = params_of(in);
  const auto result = ref::ragged_all_to_all_fwd(comm, unstack(in.at("input.operand")),
                                                 unstack(in.at("input.output_init")), params, rnd);
  const auto grad = ref::ragged_all_to_all_bwd(comm, unstack(in.at("cotangent.result")), params,
                                               in.at("input.operand").dim(1), rnd);
  TensorMap out;
  out.emplace("output.result", stack(result));
  out.emplace("grad.operand", stack(grad));
  return out;
}

// §9.3 and §12 "A2A": unwritten rows keep their initial values; the exchange followed by the
// adjoint exchange reproduces the sent operand rows (zeros elsewhere); the backward equals the
// adjoint exchange of the cotangent into a zero buffer; sum recv <= R_out on every rank.
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const int64_t P = c.i("num_ep");
  const ref::SimComm comm(P);
  const auto params = params_of(in);
  const auto adj = adjoint_params(params);
  const auto operand = unstack(in.at("input.operand"));
  const auto init = unstack(in.at("input.output_init"));
  const auto result = unstack(out.at("output.result"));
  const int64_t R_in = operand[0].dim(0), R_out = init[0].dim(0), H = operand[0].dim(1);
  for (int64_t d = 0; d < P; ++d) {
    std::vector<bool> written(R_out, false);
    int64_t total = 0;
    for (int64_t s = 0; s < P; ++s) {
      total += static_cast<int64_t>(params[d].recv_sizes.at(s));
      const int64_t lo = static_cast<int64_t>(params[s].output_offsets.at(d));
      for (int64_t k = 0; k < static_cast<int64_t>(params[s].send_sizes.at(d)); ++k) {
        written[lo + k] = true;
      }
    }
    if (total > R_out) bad.add("rank " + std::to_string(d) + ": sum recv_sizes > R_out");
    for (int64_t i = 0; i < R_out; ++i) {
      if (written[i]) continue;
      for (int64_t h = 0; h < H; ++h) {
        if (result[d].at(i, h) != init[d].at(i, h)) {
          bad.add("rank " + std::to_string(d) + " row " + std::to_string(i) +
                  ": an unwritten row lost its initial value");
          break;
        }
      }
    }
  }
  std::vector<Tensor> zeros_in;
  for (int64_t s = 0; s < P; ++s) zeros_in.emplace_back(c.dtype, Shape{R_in, H});
  const auto back = ref::ragged_all_to_all_fwd(comm, result, zeros_in, adj);
  for (int64_t s = 0; s < P; ++s) {
    Tensor want(c.dtype, {R_in, H});
    for (int64_t d = 0; d < P; ++d) {
      const int64_t lo = static_cast<int64_t>(params[s].input_offsets.at(d));
      for (int64_t k = 0; k < static_cast<int64_t>(params[s].send_sizes.at(d)); ++k)
        for (int64_t h = 0; h < H; ++h) want.set(lo + k, h, operand[s].at(lo + k, h));
    }
    if (!back[s].bitwise_equal(want)) {
      bad.add("rank " + std::to_string(s) +
              ": exchange then adjoint exchange does not give back "
              "the sent operand rows");
    }
  }
  const auto adj_ct =
      ref::ragged_all_to_all_fwd(comm, unstack(in.at("cotangent.result")), zeros_in, adj);
  if (!stack(adj_ct).bitwise_equal(out.at("grad.operand"))) {
    bad.add("grad operand differs from the adjoint exchange of the cotangent");
  }
  return bad.take();
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder("ragged_all_to_all", d).seed(seed);
  const Tensor& op = in.at("input.operand");
  const Tensor& init = in.at("input.output_init");
  const int64_t P = j.at("num_ep").get<int64_t>();
  // The stored arrays drive the reference; the buffers' row counts are explicit.
  c.set("num_ep", P).set("E", P).set("N", int64_t{0}).set("H", op.dim(2));
  c.set("align_size", int64_t{0}).set("R_in", op.dim(1)).set("R_out", init.dim(1));
  c.set("direction", "forward").set("output_init", "random");
  return c;
}

Cost cost(const Case& c) {
  const Rows r = rows(c);
  const double P = static_cast<double>(c.i("num_ep")), H = static_cast<double>(c.i("H"));
  const double e = static_cast<double>(dtype_size(c.dtype));
  const double moved = P * static_cast<double>(std::min(r.in, r.out)) * H * e;
  Cost k;
  k.fwd_bytes = 2 * moved;  // every sent row read once and written once
  k.bwd_bytes = 2 * moved + P * static_cast<double>(r.in) * H * e;  // plus zero-filling
  return k;
}

}  // namespace

const OpInfo& ragged_all_to_all_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info("ragged_all_to_all", "SPEC §9.3",
                {gen, named, make_inputs, reference, invariants, cost, ep_params, from_params});
#ifdef MOE_WITH_CUDA
    o.gpu = ragged_all_to_all_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
