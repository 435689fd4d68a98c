// CUDA bindings of the permutation and EP records; see dispatch_family_gpu.h.
#ifdef MOE_WITH_CUDA

#include "harness/ops/dispatch_family_gpu.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>

#include "gpu/argsort.cuh"
#include "gpu/bench_util.cuh"
#include "gpu/comm.cuh"
#include "gpu/dispatch.cuh"
#include "gpu/ep.cuh"
#include "gpu/sort_chunks.cuh"
#include "harness/core/rng.h"
#include "harness/ops/bench_device.h"
#include "harness/ops/device_io.h"
#include "harness/ops/ep_family.h"
#include "harness/ops/perm_family.h"
#include "harness/ops/record.h"

namespace moe::ops {

namespace {

using gpu::DeviceTensor;

// Tests run the twins with every output poisoned and the device checks read back.
const gpu::RunOptions kCheck{/*validate=*/true, /*poison=*/true};

ArgsortPermParams argsort_state(const Case& c) {
  const int64_t K = c.i("topk");
  return {K, c.i("T") * K, argsort_padding_size(c.i("E"), c.i("align_size", 0))};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// §4 / §5

TensorMap token_dispatch_gpu(const Case& c, const TensorMap& in) {
  const DeviceTensor x = up(in, "input.x"), map = up(in, "input.routing_map");
  const auto probs = up_opt(in, "input.probs");
  gpu::TokenDispatchFwd f =
      gpu::token_dispatch_fwd(x, map, ptr(probs), dispatch_params(c), nullptr, kCheck);
  TensorMap out;
  if (find_tensor(in, "cotangent.permuted")) {
    const DeviceTensor ct = up(in, "cotangent.permuted");
    const auto ctp = up_opt(in, "cotangent.permuted_probs");
    gpu::TokenDispatchBwd b =
        gpu::token_dispatch_bwd(ct, ptr(ctp), f.row_id_map, ptr(f.pad_offsets), nullptr, kCheck);
    put(out, "grad.x", b.grad_x);
    put(out, "grad.probs", b.grad_probs);
  }
  put(out, "output.permuted", f.permuted);
  put(out, "output.permuted_probs", f.permuted_probs);
  put(out, "output.row_id_map", f.row_id_map);
  put(out, "output.pad_offsets", f.pad_offsets);
  put(out, "output.tokens_per_expert", f.tokens_per_expert);
  return out;
}

TensorMap token_combine_gpu(const Case&, const TensorMap& in) {
  const DeviceTensor permuted = up(in, "input.permuted"), rim = up(in, "input.row_id_map");
  const auto mp = up_opt(in, "input.merging_probs");
  const auto pad = up_opt(in, "input.pad_offsets");
  TensorMap out;
  put(out, "output.combined",
      gpu::token_combine_fwd(permuted, rim, ptr(mp), ptr(pad), nullptr, kCheck));
  if (find_tensor(in, "cotangent.combined")) {
    const DeviceTensor ct = up(in, "cotangent.combined");
    gpu::TokenCombineBwd b =
        gpu::token_combine_bwd(ct, permuted, rim, ptr(mp), ptr(pad), nullptr, kCheck);
    put(out, "grad.permuted", b.grad_permuted);
    put(out, "grad.merging_probs", b.grad_merging_probs);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// §7

TensorMap sort_chunks_by_index_gpu(const Case&, const TensorMap& in) {
  const DeviceTensor x = up(in, "input.x"), split = up(in, "input.split_sizes");
  const DeviceTensor order = up(in, "input.sorted_indices");
  const auto probs = up_opt(in, "input.probs");
  gpu::SortChunksFwd f =
      gpu::sort_chunks_by_index_fwd(x, split, order, ptr(probs), nullptr, kCheck);
  TensorMap out;
  if (find_tensor(in, "cotangent.sorted")) {
    const DeviceTensor ct = up(in, "cotangent.sorted");
    const auto ctp = up_opt(in, "cotangent.sorted_probs");
    gpu::SortChunksBwd b =
        gpu::sort_chunks_by_index_bwd(ct, ptr(ctp), f.row_id_map, nullptr, kCheck);
    put(out, "grad.x", b.grad_x);
    put(out, "grad.probs", b.grad_probs);
  }
  put(out, "output.sorted", f.sorted);
  put(out, "output.row_id_map", f.row_id_map);
  put(out, "output.sorted_probs", f.sorted_probs);
  return out;
}

// ---------------------------------------------------------------------------------------------
// §8

TensorMap routing_map_to_selected_experts_gpu(const Case& c, const TensorMap& in) {
  const DeviceTensor probs = up(in, "input.sparse_probs"), map = up(in, "input.routing_map");
  gpu::RoutingMapToSelectedExpertsFwd f =
      gpu::routing_map_to_selected_experts_fwd(probs, map, c.i("topk"), nullptr, kCheck);
  TensorMap out;
  if (find_tensor(in, "cotangent.weights")) {
    const DeviceTensor ct = up(in, "cotangent.weights");
    put(out, "grad.sparse_probs",
        gpu::routing_map_to_selected_experts_bwd(ct, f.selected_experts, probs.dim(1), nullptr,
                                                 kCheck));
  }
  put(out, "output.selected_experts", f.selected_experts);
  put(out, "output.weights", f.weights);
  return out;
}

TensorMap argsort_token_dispatch_gpu(const Case& c, const TensorMap& in) {
  const DeviceTensor x = up(in, "input.x"), sel = up(in, "input.selected_experts");
  gpu::ArgsortTokenDispatchFwd f =
      gpu::argsort_token_dispatch_fwd(x, sel, argsort_params(c), nullptr, kCheck);
  TensorMap out;
  if (find_tensor(in, "cotangent.sorted_x")) {
    const DeviceTensor ct = up(in, "cotangent.sorted_x");
    put(out, "grad.x",
        gpu::argsort_token_dispatch_bwd(ct, f.sorted_indices, f.state, nullptr, kCheck));
  }
  put(out, "output.sorted_x", f.sorted_x);
  put(out, "output.sorted_indices", f.sorted_indices);
  put(out, "output.group_sizes", f.group_sizes);
  return out;
}

TensorMap argsort_token_combine_gpu(const Case& c, const TensorMap& in) {
  const DeviceTensor eo = up(in, "input.expert_outputs"), si = up(in, "input.sorted_indices");
  const DeviceTensor w = up(in, "input.weights");
  const ArgsortPermParams st = argsort_state(c);
  TensorMap out;
  put(out, "output.combined", gpu::argsort_token_combine_fwd(eo, si, w, st, nullptr, kCheck));
  if (find_tensor(in, "cotangent.combined")) {
    const DeviceTensor ct = up(in, "cotangent.combined");
    gpu::ArgsortTokenCombineBwd b =
        gpu::argsort_token_combine_bwd(ct, eo, si, w, st, nullptr, kCheck);
    put(out, "grad.expert_outputs", b.grad_expert_outputs);
    put(out, "grad.weights", b.grad_weights);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// §9 (per-rank values stacked along a leading axis of length P, SPEC §14)

TensorMap ragged_a2a_params_gpu(const Case& c, const TensorMap& in) {
  const DeviceTensor A = up(in, "input.all_shards_tokens_per_expert");
  const int64_t P = c.i("num_ep");
  const A2ADirection dir = parse_a2a_direction(c.s("direction"));
  std::vector<Tensor> io, ss, oo, rs;
  for (int64_t s = 0; s < P; ++s) {
    gpu::RaggedA2AParams p = gpu::ragged_a2a_params(A, s, P, dir, nullptr, kCheck);
    io.push_back(p.input_offsets.download());
    ss.push_back(p.send_sizes.download());
    oo.push_back(p.output_offsets.download());
    rs.push_back(p.recv_sizes.download());
  }
  TensorMap out;
  out.emplace("output.input_offsets", stack(io));
  out.emplace("output.send_sizes", stack(ss));
  out.emplace("output.output_offsets", stack(oo));
  out.emplace("output.recv_sizes", stack(rs));
  return out;
}

TensorMap ragged_all_to_all_gpu(const Case& c, const TensorMap& in) {
  const int64_t P = c.i("num_ep");
  gpu::InProcessCommunicator comm(static_cast<int>(P));
  const auto operand = up_ranks(in, "input.operand");
  const auto init = up_ranks(in, "input.output_init");
  auto io = up_ranks(in, "input.input_offsets"), ss = up_ranks(in, "input.send_sizes");
  auto oo = up_ranks(in, "input.output_offsets"), rs = up_ranks(in, "input.recv_sizes");
  std::vector<gpu::RaggedA2AParams> params;
  for (int64_t r = 0; r < P; ++r) {
    params.push_back({std::move(io[r]), std::move(ss[r]), std::move(oo[r]), std::move(rs[r])});
  }
  TensorMap out;
  out.emplace("output.result",
              down_stack(gpu::ragged_all_to_all_fwd(comm, operand, init, params, nullptr, kCheck)));
  if (find_tensor(in, "cotangent.result")) {
    const auto ct = up_ranks(in, "cotangent.result");
    out.emplace("grad.operand", down_stack(gpu::ragged_all_to_all_bwd(
                                    comm, ct, params, operand[0].dim(0), nullptr, kCheck)));
  }
  return out;
}

TensorMap local_permute_after_a2a_gpu(const Case& c, const TensorMap& in) {
  const int64_t P = c.i("num_ep");
  const DeviceTensor A = up(in, "input.all_shards_tokens_per_expert");
  const auto x = up_ranks(in, "input.x_recv");
  const bool bwd = find_tensor(in, "cotangent.sorted_x") != nullptr;
  std::vector<DeviceTensor> ct;
  if (bwd) ct = up_ranks(in, "cotangent.sorted_x");
  std::vector<Tensor> sorted, sizes, maps, grads;
  for (int64_t s = 0; s < P; ++s) {
    gpu::LocalPermuteFwd f = gpu::local_permute_after_a2a_fwd(x[s], A, s, P, nullptr, kCheck);
    if (bwd) {
      grads.push_back(
          gpu::local_permute_after_a2a_bwd(ct[s], f.row_id_map, nullptr, kCheck).download());
    }
    sorted.push_back(f.sorted_x.download());
    sizes.push_back(f.local_group_sizes.download());
    maps.push_back(f.row_id_map.download());
  }
  TensorMap out;
  out.emplace("output.sorted_x", stack(sorted));
  out.emplace("output.local_group_sizes", stack(sizes));
  out.emplace("output.row_id_map", stack(maps));
  if (bwd) out.emplace("grad.x_recv", stack(grads));
  return out;
}

TensorMap local_unpermute_before_a2a_gpu(const Case& c, const TensorMap& in) {
  const int64_t P = c.i("num_ep");
  const auto y = up_ranks(in, "input.expert_outputs");
  const auto maps = up_ranks(in, "input.row_id_map");
  const bool bwd = find_tensor(in, "cotangent.out") != nullptr;
  std::vector<DeviceTensor> ct;
  if (bwd) ct = up_ranks(in, "cotangent.out");
  std::vector<Tensor> outs, grads;
  for (int64_t s = 0; s < P; ++s) {
    outs.push_back(gpu::local_unpermute_before_a2a_fwd(y[s], maps[s], nullptr, kCheck).download());
    if (bwd) {
      grads.push_back(
          gpu::local_unpermute_before_a2a_bwd(ct[s], maps[s], nullptr, kCheck).download());
    }
  }
  TensorMap out;
  out.emplace("output.out", stack(outs));
  if (bwd) out.emplace("grad.expert_outputs", stack(grads));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Benchmarks: inputs on the device (uploaded from make_inputs, or generated there at full size),
// one validated run on the legacy stream allocates the outputs (and proves the inputs valid);
// fwd/bwd then relaunch into them on bench_stream() with validation off, without synchronising.

namespace {

struct DispatchBench {
  DeviceTensor x, map, ct;
  std::optional<DeviceTensor> probs, ctp;
  TokenDispatchParams p;
  gpu::TokenDispatchFwd f;
  gpu::TokenDispatchBwd b;
};

struct CombineBench {
  DeviceTensor permuted, rim, ct, combined;
  std::optional<DeviceTensor> mp, pad;
  gpu::TokenCombineBwd b;
};

struct SortChunksBench {
  DeviceTensor x, split, order, ct;
  std::optional<DeviceTensor> probs, ctp;
  gpu::SortChunksFwd f;
  gpu::SortChunksBwd b;
};

Case deepseek(const std::string& op, int64_t a, const std::string& name) {
  Case c = CaseBuilder(op, DType::bf16).seed(23);
  c.set("name", name).set("T", int64_t{16384}).set("E", int64_t{256}).set("K", int64_t{8});
  c.set("H", int64_t{7168}).set("ragged", false).set("num_out_tokens", int64_t{16384 * 8});
  c.set("align_size", a);
  return c;
}

OpInfo::Bench dispatch_bench(const std::shared_ptr<DispatchBench>& st) {
  st->f = gpu::token_dispatch_fwd(st->x, st->map, ptr(st->probs), st->p);
  st->b = gpu::token_dispatch_bwd(st->ct, ptr(st->ctp), st->f.row_id_map, ptr(st->f.pad_offsets));
  gpu::device_synchronize();
  DispatchBench* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::token_dispatch_fwd_into(s->x, s->map, ptr(s->probs), s->p, s->f, nullptr,
                                 gpu::bench_stream());
  };
  bench.bwd = [s] {
    gpu::token_dispatch_bwd_into(s->ct, ptr(s->ctp), s->f.row_id_map, ptr(s->f.pad_offsets), s->b,
                                 nullptr, gpu::bench_stream());
  };
  bench.state = st;
  return bench;
}

OpInfo::Bench combine_bench(const std::shared_ptr<CombineBench>& st) {
  st->combined = gpu::token_combine_fwd(st->permuted, st->rim, ptr(st->mp), ptr(st->pad));
  st->b = gpu::token_combine_bwd(st->ct, st->permuted, st->rim, ptr(st->mp), ptr(st->pad));
  gpu::device_synchronize();
  CombineBench* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::token_combine_fwd_into(s->permuted, s->rim, ptr(s->mp), ptr(s->pad), s->combined, nullptr,
                                gpu::bench_stream());
  };
  bench.bwd = [s] {
    gpu::token_combine_bwd_into(s->ct, s->permuted, s->rim, ptr(s->mp), ptr(s->pad), s->b, nullptr,
                                gpu::bench_stream());
  };
  bench.state = st;
  return bench;
}

OpInfo::Bench sort_chunks_bench(const std::shared_ptr<SortChunksBench>& st) {
  st->f = gpu::sort_chunks_by_index_fwd(st->x, st->split, st->order, ptr(st->probs));
  st->b = gpu::sort_chunks_by_index_bwd(st->ct, ptr(st->ctp), st->f.row_id_map);
  gpu::device_synchronize();
  SortChunksBench* s = st.get();
  OpInfo::Bench bench;
  bench.fwd = [s] {
    gpu::sort_chunks_by_index_fwd_into(s->x, s->split, s->order, ptr(s->probs), s->f, nullptr,
                                       gpu::bench_stream());
  };
  bench.bwd = [s] {
    gpu::sort_chunks_by_index_bwd_into(s->ct, ptr(s->ctp), s->f.row_id_map, s->b, nullptr,
                                       gpu::bench_stream());
  };
  bench.state = st;
  return bench;
}

// The routing of make_inputs (K distinct experts per token per the regime; ragged if the case
// says), generated on the host: the [T,E] map is the only input small enough to.
Tensor bench_routing_map(const Case& c, std::vector<std::vector<int64_t>>* routes) {
  *routes = make_routes(c, c.i("T"), c.i("E"), c.i("K"), c.b("ragged", false), "input.routing_map");
  return routes_to_map(*routes, c.i("E"));
}

void require_no_zero_probs(const Case& c) {
  if (c.i("zero_probs", 0) != 0 || c.has("zero_prob_token")) {
    throw std::invalid_argument(
        "zero_probs / zero_prob_token: the device-generated benchmark inputs have no exact-zero "
        "probs (R12); benchmark such a case with host inputs");
  }
}

}  // namespace

OpInfo::Bench token_dispatch_gpu_bench(const Case& c, const TensorMap& in) {
  auto st = std::make_shared<DispatchBench>();
  st->x = up(in, "input.x");
  st->map = up(in, "input.routing_map");
  st->probs = up_opt(in, "input.probs");
  st->ct = up(in, "cotangent.permuted");
  st->ctp = up_opt(in, "cotangent.permuted_probs");
  st->p = dispatch_params(c);
  return dispatch_bench(st);
}

OpInfo::Bench token_dispatch_gpu_bench_device(const Case& c) {
  require_no_zero_probs(c);
  const int64_t T = c.i("T"), E = c.i("E"), H = c.i("H");
  auto st = std::make_shared<DispatchBench>();
  st->p = dispatch_params(c);
  const int64_t R = dispatch_out_rows(st->p.num_out_tokens, E, st->p.align_size);
  std::vector<std::vector<int64_t>> routes;
  st->map = DeviceTensor::upload(bench_routing_map(c, &routes));
  st->x = device_uniform(c, c.dtype, {T, H}, -2.0, 2.0, "input.x");
  st->ct = device_uniform(c, c.dtype, {R, H}, -2.0, 2.0, "cotangent.permuted");
  if (const auto pd = opt_dtype(c, "probs_dtype")) {
    st->probs = device_uniform(c, *pd, {T, E}, 0.1, 1.0, "input.probs");  // as make_inputs
    st->ctp = device_uniform(c, *pd, {R}, -2.0, 2.0, "cotangent.permuted_probs");
  }
  return dispatch_bench(st);
}

OpInfo::Bench token_combine_gpu_bench(const Case&, const TensorMap& in) {
  auto st = std::make_shared<CombineBench>();
  st->permuted = up(in, "input.permuted");
  st->rim = up(in, "input.row_id_map");
  st->mp = up_opt(in, "input.merging_probs");
  st->pad = up_opt(in, "input.pad_offsets");
  st->ct = up(in, "cotangent.combined");
  return combine_bench(st);
}

OpInfo::Bench token_combine_gpu_bench_device(const Case& c) {
  const int64_t T = c.i("T"), E = c.i("E"), H = c.i("H");
  auto st = std::make_shared<CombineBench>();
  std::vector<std::vector<int64_t>> routes;
  const Tensor map = bench_routing_map(c, &routes);
  {
    // permuted, row_id_map and pad_offsets from the CUDA dispatch of the same routing (as
    // make_inputs takes them from the reference's); the dispatch's x is freed after.
    const DeviceTensor x = device_uniform(c, c.dtype, {T, H}, -2.0, 2.0, "input.permuted");
    gpu::TokenDispatchFwd f =
        gpu::token_dispatch_fwd(x, DeviceTensor::upload(map), nullptr, dispatch_params(c));
    st->permuted = std::move(f.permuted);
    st->rim = std::move(f.row_id_map);
    st->pad = std::move(f.pad_offsets);
  }
  if (const auto md = opt_dtype(c, "merging_dtype")) {
    // Sparse router probs: U[0.1, 1) on the routed entries, 0 elsewhere (T*K values).
    Tensor mp(*md, {T, E});
    Rng rng(c.seed, "input.merging_probs");
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e : routes[t]) mp.set(t, e, rng.uniform(0.1, 1.0));
    st->mp = DeviceTensor::upload(mp);
  }
  st->ct = device_uniform(c, c.dtype, {T, H}, -2.0, 2.0, "cotangent.combined");
  return combine_bench(st);
}

OpInfo::Bench sort_chunks_by_index_gpu_bench(const Case&, const TensorMap& in) {
  auto st = std::make_shared<SortChunksBench>();
  st->x = up(in, "input.x");
  st->split = up(in, "input.split_sizes");
  st->order = up(in, "input.sorted_indices");
  st->probs = up_opt(in, "input.probs");
  st->ct = up(in, "cotangent.sorted");
  st->ctp = up_opt(in, "cotangent.sorted_probs");
  return sort_chunks_bench(st);
}

OpInfo::Bench sort_chunks_by_index_gpu_bench_device(const Case& c) {
  const int64_t N = c.i("N_rows"), H = c.i("H");
  const auto split = parse_int_list(c.s("split_sizes"), "split_sizes");
  const auto order = parse_int_list(c.s("sorted_indices"), "sorted_indices");
  const DType sd = parse_dtype(c.s("split_dtype", "int32"));
  auto index_tensor = [&](const std::vector<int64_t>& v) {
    Tensor t(sd, {static_cast<int64_t>(v.size())});
    for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
    return DeviceTensor::upload(t);
  };
  auto st = std::make_shared<SortChunksBench>();
  st->x = device_uniform(c, c.dtype, {N, H}, -2.0, 2.0, "input.x");
  st->split = index_tensor(split);
  st->order = index_tensor(order);
  st->ct = device_uniform(c, c.dtype, {N, H}, -2.0, 2.0, "cotangent.sorted");
  if (const auto pd = opt_dtype(c, "probs_dtype")) {
    st->probs = device_uniform(c, *pd, {N}, 0.1, 1.0, "input.probs");
    st->ctp = device_uniform(c, *pd, {N}, -2.0, 2.0, "cotangent.sorted_probs");
  }
  return sort_chunks_bench(st);
}

// 256 tokens and H <= 128 (the layout and all E experts kept): the CPU reference and the
// invariants run in about a second. num_out_tokens keeps its relation to T*K: the same extra
// tail rows, or the same dropped fraction.
Case dispatch_bench_verify_case(const Case& c) {
  Case s = c;
  const int64_t T = c.i("T"), K = c.i("K"), n = c.i("num_out_tokens");
  const int64_t Ts = std::min<int64_t>(T, 256);
  const int64_t ns = n >= T * K ? Ts * K + (n - T * K) : (T > 0 ? n * Ts / T : n);
  s.set("T", Ts).set("H", std::min<int64_t>(c.i("H"), 128)).set("num_out_tokens", ns);
  return s;
}

// Every chunk (and the tail of padding rows) shrunk by the same factor so at most ~4096 rows
// remain, H <= 128; the chunk order is kept.
Case sort_chunks_bench_verify_case(const Case& c) {
  Case s = c;
  const int64_t N = c.i("N_rows");
  auto split = parse_int_list(c.s("split_sizes"), "split_sizes");
  const int64_t f = std::max<int64_t>(1, (N + 4095) / 4096);
  int64_t V = 0, Vs = 0;
  for (auto& v : split) {
    V += v;
    v = (v + f - 1) / f;
    Vs += v;
  }
  s.set("split_sizes", int_list(split)).set("N_rows", Vs + (N - V + f - 1) / f);
  s.set("H", std::min<int64_t>(c.i("H"), 128));
  return s;
}

std::vector<Case> token_dispatch_gpu_bench_cases() {
  return {deepseek("token_dispatch", 0, "deepseek_v3")
              .set("drop_overflow", false)
              .set("probs_dtype", "float32")
              .set("zero_probs", int64_t{0}),
          deepseek("token_dispatch", 128, "deepseek_v3_a128")
              .set("drop_overflow", false)
              .set("probs_dtype", "float32")
              .set("zero_probs", int64_t{0})};
}

std::vector<Case> token_combine_gpu_bench_cases() {
  return {deepseek("token_combine", 0, "deepseek_v3").set("merging_dtype", "float32"),
          deepseek("token_combine", 128, "deepseek_v3_a128").set("merging_dtype", "float32")};
}

std::vector<Case> sort_chunks_by_index_gpu_bench_cases() {
  // The EP local permute of the dispatch rows: P = 8 sources x L = 32 local experts, 512 rows per
  // chunk (131072 = T*K rows), source-major to expert-major; the a = 128 buffer adds the
  // E*(a-1) tail rows (identity, R1).
  std::vector<int64_t> split(256, 512), order(256);
  for (int64_t l = 0; l < 32; ++l)
    for (int64_t i = 0; i < 8; ++i) order[l * 8 + i] = i * 32 + l;
  std::vector<Case> v;
  for (int64_t tail : {int64_t{0}, int64_t{256 * 127}}) {
    Case c = CaseBuilder("sort_chunks_by_index", DType::bf16).seed(29);
    c.set("name", tail ? "ep8_l32_a128" : "ep8_l32").set("N_rows", int64_t{131072} + tail);
    c.set("H", int64_t{7168}).set("split_sizes", int_list(split));
    c.set("sorted_indices", int_list(order)).set("split_dtype", "int32");
    c.set("probs_dtype", "none").set("x_fill", "normal");
    v.push_back(std::move(c));
  }
  return v;
}

}  // namespace moe::ops

#endif  // MOE_WITH_CUDA
