// Registry record of ragged_a2a_params (SPEC §9.2). Input: A = all_shards_tokens_per_expert
// [P,E] (identical on every rank, stored once). Outputs: the four arrays of every rank stacked
// as [P,P] (row s = the arrays computed on rank s). Pure index math: exact comparison.
#include "harness/core/params/ep.h"
#include "harness/ops/dispatch_family_gpu.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"
#include "reference/ep.h"

namespace moe::ops {

namespace {

rc::Gen<Case> gen() {
  return rc::gen::exec([] {
    // No float tensors: the dtype stays at the default.
    Case c = draw_case("ragged_a2a_params", DType::f32, kSizeRegimes);
    draw_ep_experts(c);
    c.set("N", *any_in(0, 40));
    c.set("align_size", draw_ep_align_size());
    c.set("direction", *rc::gen::element<std::string>("forward", "reverse"));
    return c;
  });
}

CaseBuilder base(const std::string& name, int64_t P, int64_t E, int64_t N, int64_t a,
                 const std::string& dir) {
  CaseBuilder b("ragged_a2a_params");
  b.seed(11).name(name).set("num_ep", P).set("E", E).set("N", N).set("align_size", a);
  return b.set("direction", dir);
}

std::vector<Case> named() {
  std::vector<Case> v;
  for (const char* dir : {"forward", "reverse"}) {
    // The R3 block shape: P = 2, E = 8, 32 rows per rank, a = 16.
    v.push_back(base(std::string("R3_") + dir, 2, 8, 32, 16, dir));
    v.push_back(base(std::string("p8_e16_") + dir, 8, 16, 24, 0, dir));
  }
  v.push_back(base("p1_identity", 1, 5, 9, 0, "forward"));
  v.push_back(base("zero_rows", 4, 8, 0, 0, "forward"));
  v.push_back(base("all_to_one", 4, 8, 20, 4, "forward").regime(Regime::all_to_one));
  return v;
}

TensorMap make_inputs(const Case& c) {
  TensorMap m;
  m.emplace("input.all_shards_tokens_per_expert",
            make_ep_counts(c, c.i("num_ep"), c.i("E"), c.i("N"), c.i("align_size", 0),
                           "input.all_shards_tokens_per_expert"));
  return m;
}

TensorMap reference(const Case& c, const TensorMap& in, bool /*exact*/) {
  const Tensor& A = in.at("input.all_shards_tokens_per_expert");
  const int64_t P = c.i("num_ep");
  const A2ADirection dir = parse_a2a_direction(c.s("direction"));
  std::vector<Tensor> io, ss, oo, rs;
  for (int64_t s = 0; s < P; ++s) {
    ref::RaggedA2AParams p = ref::ragged_a2a_params(A, s, P, dir);
    io.push_back(std::move(p.input_offsets));
    ss.push_back(std::move(p.send_sizes));
    oo.push_back(std::move(p.output_offsets));
    rs.push_back(std::move(p.recv_sizes));
  }
  TensorMap out;
  out.emplace("output.input_offsets", stack(io));
  out.emplace("output.send_sizes", stack(ss));
  out.emplace("output.output_offsets", stack(oo));
  out.emplace("output.recv_sizes", stack(rs));
  return out;
}

// §9.2/§9.3: the arrays of all ranks are consistent (receiver counts match senders, ranges in
// bounds and disjoint), each receive buffer is filled source-major without gaps, and the other
// direction's arrays are the transpose (the adjoint exchange).
std::vector<std::string> invariants(const Case& c, const TensorMap& in, const TensorMap& out) {
  FailureList bad;
  const int64_t P = c.i("num_ep");
  const Tensor& A = in.at("input.all_shards_tokens_per_expert");
  auto rows = [&](const std::string& k) {
    std::vector<std::vector<int64_t>> v(P, std::vector<int64_t>(P));
    const Tensor& t = out.at("output." + k);
    for (int64_t s = 0; s < P; ++s)
      for (int64_t j = 0; j < P; ++j) v[s][j] = static_cast<int64_t>(t.at(s, j));
    return v;
  };
  const auto io = rows("input_offsets"), ss = rows("send_sizes"), oo = rows("output_offsets"),
             rs = rows("recv_sizes");
  int64_t in_rows = 0, out_rows = 0;
  for (int64_t s = 0; s < P; ++s) {
    int64_t snd = 0, rcv = 0;
    for (int64_t j = 0; j < P; ++j) snd += ss[s][j], rcv += rs[s][j];
    in_rows = std::max(in_rows, snd);
    out_rows = std::max(out_rows, rcv);
  }
  try {
    check_ragged_a2a_arrays(io, ss, oo, rs, in_rows, out_rows);
  } catch (const std::invalid_argument& e) {
    bad.add(std::string("arrays are inconsistent: ") + e.what());
  }
  for (int64_t d = 0; d < P; ++d) {
    // Receive layout: sources in order, back to back from row 0.
    int64_t acc = 0;
    for (int64_t s = 0; s < P; ++s) {
      if (oo[s][d] != acc) {
        bad.add("rank " + std::to_string(s) + " lands at row " + std::to_string(oo[s][d]) +
                " of rank " + std::to_string(d) + ", expected " + std::to_string(acc));
      }
      acc += ss[s][d];
    }
  }
  const A2ADirection dir = parse_a2a_direction(c.s("direction"));
  for (int64_t s = 0; s < P; ++s) {
    // SPEC §9.2's table, derived here from A alone (not by the reference).
    const A2AArrays want = spec_a2a_arrays(A, s, P, dir == A2ADirection::forward);
    for (int64_t j = 0; j < P; ++j) {
      if (io[s][j] != want.input_offsets[j] || ss[s][j] != want.send_sizes[j] ||
          oo[s][j] != want.output_offsets[j] || rs[s][j] != want.recv_sizes[j]) {
        bad.add("rank " + std::to_string(s) + ", peer " + std::to_string(j) +
                ": arrays (in_off, send, out_off, recv) = (" + std::to_string(io[s][j]) + ", " +
                std::to_string(ss[s][j]) + ", " + std::to_string(oo[s][j]) + ", " +
                std::to_string(rs[s][j]) + "), SPEC §9.2 gives (" +
                std::to_string(want.input_offsets[j]) + ", " + std::to_string(want.send_sizes[j]) +
                ", " + std::to_string(want.output_offsets[j]) + ", " +
                std::to_string(want.recv_sizes[j]) + ")");
      }
    }
  }
  for (int64_t s = 0; s < P; ++s) {
    const ref::RaggedA2AParams o = ref::ragged_a2a_params(A, s, P, opposite(dir));
    for (int64_t j = 0; j < P; ++j) {
      // Adjoint: the opposite direction sends what this one receives, from where it landed.
      if (o.send_sizes.at(j) != rs[s][j] || o.recv_sizes.at(j) != ss[s][j] ||
          o.input_offsets.at(j) != oo[j][s] || o.output_offsets.at(j) != io[j][s]) {
        bad.add("the " + std::string(a2a_direction_name(opposite(dir))) + " arrays of rank " +
                std::to_string(s) + " are not the adjoint at peer " + std::to_string(j));
      }
    }
  }
  return bad.take();
}

nlohmann::json to_params(const Case& c) {
  return {{"num_ep", c.i("num_ep")}, {"direction", c.s("direction")}};
}

Case from_params(const nlohmann::json& j, DType d, uint64_t seed, const TensorMap& in) {
  Case c = CaseBuilder("ragged_a2a_params", d).seed(seed);
  const Tensor& A = in.at("input.all_shards_tokens_per_expert");
  set_params<int64_t>(c, j, {"num_ep"}).set("E", A.dim(1));
  set_params<std::string>(c, j, {"direction"});
  int64_t n = 0;
  for (int64_t i = 0; i < A.dim(0); ++i) {
    int64_t row = 0;
    for (int64_t e = 0; e < A.dim(1); ++e) row += static_cast<int64_t>(A.at(i, e));
    n = std::max(n, row);
  }
  c.set("N", n).set("align_size", int64_t{0});
  return c;
}

Cost cost(const Case& c) {
  const double P = static_cast<double>(c.i("num_ep")), E = static_cast<double>(c.i("E"));
  Cost k;
  k.fwd_bytes = P * E * 4 + 4 * P * P * 4;
  return k;
}

}  // namespace

const OpInfo& ragged_a2a_params_op() {
  static const OpInfo op = [] {
    OpInfo o =
        op_info("ragged_a2a_params", "SPEC §9.2",
                {gen, named, make_inputs, reference, invariants, cost, to_params, from_params});
#ifdef MOE_WITH_CUDA
    o.gpu = ragged_a2a_params_gpu;
#endif
    return o;
  }();
  return op;
}

}  // namespace moe::ops
