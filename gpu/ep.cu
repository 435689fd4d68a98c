// CUDA twin of reference/ep.cpp (SPEC §9). Kernel plan: see gpu/ep.cuh.
#include <climits>
#include <stdexcept>
#include <string>

#include "gpu/ep.cuh"
#include "gpu/perm_detail.cuh"
#include "gpu/sort_chunks.cuh"

namespace moe::gpu {

namespace {

using namespace detail;

std::string str(int64_t v) {
  return std::to_string(v);
}

// Turns a device fault of any EP piece into the reference's std::invalid_argument.
void throw_ep_fault(const DeviceError& e, int64_t shard, int64_t send_rows, int64_t recv_rows) {
  if (e.code == 0) return;
  if (e.code > 100 && e.code < 200) throw_if_a2a_fault(e, send_rows, recv_rows);
  switch (static_cast<EpFault>(e.code)) {
    case EpFault::counts_negative:
      throw std::invalid_argument("all_shards_tokens_per_expert: entry [" + str(e.a) + ", " +
                                  str(e.b >> 32) + "] is negative (" +
                                  str(static_cast<int32_t>(e.b)) + ")");
    case EpFault::offsets_range:
      throw std::invalid_argument(
          "all_shards_tokens_per_expert: row offsets exceed the int32 range");
    case EpFault::recv_overflow:
      throw std::invalid_argument("x_recv: rank " + str(shard) + " receives " + str(e.a) +
                                  " rows (sum of its split sizes), more than the receive buffer "
                                  "of R=" +
                                  str(e.b) + " rows");
  }
  throw_perm_fault(static_cast<PermFault>(e.code), e.a, e.b);
}

template <class F>
void run_checked(bool validate, Stream s, int64_t shard, int64_t send_rows, int64_t recv_rows,
                 F&& f) {
  if (!validate) {
    f(static_cast<void*>(nullptr));
    return;
  }
  ErrorFlag flag;
  f(flag.device_ptr());
  throw_ep_fault(flag.read(s), shard, send_rows, recv_rows);
}

__device__ __forceinline__ void ep_fault(void* err, EpFault f, long long a, long long b) {
  if (err) raise_error(err, static_cast<int32_t>(f), a, b);
}

__device__ __forceinline__ void check_counts(const void* A, int kind, long long n, long long E,
                                             void* err) {
  for (long long idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const long long v = load_int(A, kind, idx);
    if (v < 0) {
      ep_fault(err, EpFault::counts_negative, idx / E,
               ((idx % E) << 32) | (static_cast<long long>(v) & 0xffffffffLL));
    }
  }
}

// One CTA: the §9.2 arrays of rank s from A [P,E].
__global__ void ep_params_kernel(const void* A, int kind, long long P, long long E, long long s,
                                 bool fwd, int32_t* in_off, int32_t* send, int32_t* out_off,
                                 int32_t* recv, void* err) {
  check_counts(A, kind, P * E, E, err);
  const long long L = E / P;
  auto snd = [&](long long i, long long j) {
    long long acc = 0;
    for (long long l = 0; l < L; ++l) acc += load_int(A, kind, i * E + j * L + l);
    return acc;
  };
  for (long long j = threadIdx.x; j < P; j += blockDim.x) {
    const long long sd = fwd ? snd(s, j) : snd(j, s);
    const long long rv = fwd ? snd(j, s) : snd(s, j);
    long long oo = 0;
    for (long long i = 0; i < s; ++i) oo += fwd ? snd(i, j) : snd(j, i);
    if (oo + sd > INT_MAX) ep_fault(err, EpFault::offsets_range, s, 0);
    send[j] = static_cast<int32_t>(sd);
    recv[j] = static_cast<int32_t>(rv);
    out_off[j] = static_cast<int32_t>(oo);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long acc = 0;
    for (long long j = 0; j < P; ++j) {
      in_off[j] = static_cast<int32_t>(acc);
      acc += send[j];
    }
    if (acc > INT_MAX) ep_fault(err, EpFault::offsets_range, s, 0);
  }
}

// One CTA: split[i*L+l] = A[i, sL+l] (source-major receive layout), order[l*P+i] = i*L+l (to
// expert-major), local_group_sizes[l] = sum_i A[i, sL+l], and the R3 check sum split <= R.
__global__ void local_chunks_kernel(const void* A, int kind, long long P, long long E, long long s,
                                    long long R, long long* split, int32_t* split32, int32_t* order,
                                    int32_t* lgs, void* err) {
  check_counts(A, kind, P * E, E, err);
  const long long L = E / P;
  for (long long idx = threadIdx.x; idx < P * L; idx += blockDim.x) {
    const long long i = idx / L, l = idx % L;
    const long long v = load_int(A, kind, i * E + s * L + l);
    if (split) split[idx] = v;
    if (split32) split32[idx] = static_cast<int32_t>(v);
    order[l * P + i] = static_cast<int32_t>(idx);
  }
  for (long long l = threadIdx.x; l < L; l += blockDim.x) {
    long long acc = 0;
    for (long long i = 0; i < P; ++i) acc += load_int(A, kind, i * E + s * L + l);
    if (lgs) lgs[l] = static_cast<int32_t>(acc);
  }
  if (threadIdx.x == 0 && R >= 0) {
    long long total = 0;
    for (long long idx = 0; idx < P * L; ++idx) {
      const long long i = idx / L, l = idx % L;
      total += load_int(A, kind, i * E + s * L + l);
    }
    if (total > R) ep_fault(err, EpFault::recv_overflow, total, R);
  }
}

void require_i32(const DeviceTensor& t, const std::string& what) {
  if (t.dtype() != DType::i32) {
    throw std::invalid_argument(what + ": the CUDA exchange takes int32 arrays, got " +
                                t.describe());
  }
}

std::vector<TensorMeta> metas(const std::vector<DeviceTensor>& v) {
  std::vector<TensorMeta> m;
  for (const DeviceTensor& t : v) m.push_back(t.meta());
  return m;
}

// Copies of a one-rank list for all P ranks: with one process per rank (NCCL) every rank holds
// tensors of this rank's shapes (SPMD), so the host checks see the local metadata for every rank.
std::vector<TensorMeta> for_all_ranks(std::vector<TensorMeta> v, int64_t P) {
  if (v.size() == 1 && P > 1) v.assign(static_cast<size_t>(P), v[0]);
  return v;
}

void validate_params(const std::vector<RaggedA2AParams>& params,
                     const std::vector<TensorMeta>& operand_local,
                     const std::vector<TensorMeta>& output_local, int64_t P) {
  const std::vector<TensorMeta> operand = for_all_ranks(operand_local, P);
  const std::vector<TensorMeta> output = for_all_ranks(output_local, P);
  std::vector<TensorMeta> io, ss, oo, rs;
  for (const RaggedA2AParams& p : params) {
    io.push_back(p.input_offsets.meta());
    ss.push_back(p.send_sizes.meta());
    oo.push_back(p.output_offsets.meta());
    rs.push_back(p.recv_sizes.meta());
    require_i32(p.input_offsets, "input_offsets");
    require_i32(p.send_sizes, "send_sizes");
    require_i32(p.output_offsets, "output_offsets");
    require_i32(p.recv_sizes, "recv_sizes");
  }
  validate_ragged_all_to_all(operand, output, for_all_ranks(io, P), for_all_ranks(ss, P),
                             for_all_ranks(oo, P), for_all_ranks(rs, P), P);
}

// The ranks this process drives (all P in process, one under NCCL): one parameter set each.
std::vector<int> local_rank_ids(const Communicator& comm, size_t n) {
  std::vector<int> ranks = comm.local_ranks();
  if (n != ranks.size()) {
    throw std::invalid_argument(
        "num_ep: " + str(static_cast<int64_t>(n)) + " parameter sets for a communicator of " +
        str(comm.size()) + " ranks driving " + str(static_cast<int64_t>(ranks.size())) + " here");
  }
  return ranks;
}

int64_t row_bytes_2d(const TensorMeta& m) {
  return m.dim(1) * static_cast<int64_t>(dtype_size(m.dtype));
}

}  // namespace

RaggedA2AParams ragged_a2a_params(const DeviceTensor& a, int64_t shard_id, int64_t num_ep,
                                  A2ADirection direction, Stream s, const RunOptions& o) {
  validate_shard_id(shard_id, num_ep);
  validate_ep_counts(a.meta(), num_ep);
  const int64_t P = num_ep, E = a.dim(1);
  RaggedA2AParams p{DeviceTensor(DType::i32, {P}), DeviceTensor(DType::i32, {P}),
                    DeviceTensor(DType::i32, {P}), DeviceTensor(DType::i32, {P})};
  if (o.poison) {
    poison(p.input_offsets, s);
    poison(p.send_sizes, s);
    poison(p.output_offsets, s);
    poison(p.recv_sizes, s);
  }
  run_checked(o.validate, s, shard_id, 0, 0, [&](void* err) {
    ep_params_kernel<<<1, 256, 0, s>>>(
        a.data(), static_cast<int>(int_kind(a.dtype())), P, E, shard_id,
        direction == A2ADirection::forward, p.input_offsets.data<int32_t>(),
        p.send_sizes.data<int32_t>(), p.output_offsets.data<int32_t>(),
        p.recv_sizes.data<int32_t>(), err);
    check_launch("ep_params_kernel");
  });
  return p;
}

std::vector<DeviceTensor> ragged_all_to_all_fwd(Communicator& comm,
                                                const std::vector<DeviceTensor>& operand,
                                                const std::vector<DeviceTensor>& output_init,
                                                const std::vector<RaggedA2AParams>& params,
                                                Stream s, const RunOptions& o) {
  const std::vector<int> ids = local_rank_ids(comm, params.size());
  const int64_t P = comm.size(), n = static_cast<int64_t>(ids.size());
  if (static_cast<int64_t>(operand.size()) != n || static_cast<int64_t>(output_init.size()) != n) {
    throw std::invalid_argument("operand: expected one tensor per local rank (" + str(n) +
                                "), got " + str(static_cast<int64_t>(operand.size())) +
                                " operands and " + str(static_cast<int64_t>(output_init.size())) +
                                " outputs");
  }
  validate_params(params, metas(operand), metas(output_init), P);
  const int64_t R_in = operand[0].dim(0), R_out = output_init[0].dim(0);
  std::vector<DeviceTensor> result;
  for (int64_t d = 0; d < n; ++d) {
    result.emplace_back(output_init[d].dtype(), output_init[d].shape());
    if (result[d].nbytes() > 0) {
      MOE_CUDA_CHECK(cudaMemcpyAsync(result[d].data(), output_init[d].data(), result[d].nbytes(),
                                     cudaMemcpyDeviceToDevice, s));
    }
  }
  std::vector<RaggedA2ARank> ranks;
  for (int64_t r = 0; r < n; ++r) {
    ranks.push_back({ids[r], operand[r].data(), R_in, result[r].data(), R_out,
                     params[r].input_offsets.data<int32_t>(), params[r].send_sizes.data<int32_t>(),
                     params[r].output_offsets.data<int32_t>(),
                     params[r].recv_sizes.data<int32_t>()});
  }
  run_checked(o.validate, s, 0, R_in, R_out, [&](void* err) {
    comm.ragged_all_to_all(ranks, row_bytes_2d(operand[0].meta()), err, s);
  });
  return result;
}

std::vector<DeviceTensor> ragged_all_to_all_bwd(Communicator& comm,
                                                const std::vector<DeviceTensor>& grad_result,
                                                const std::vector<RaggedA2AParams>& params,
                                                int64_t operand_rows, Stream s,
                                                const RunOptions& o) {
  const std::vector<int> ids = local_rank_ids(comm, params.size());
  const int64_t P = comm.size(), n = static_cast<int64_t>(ids.size());
  if (operand_rows < 0) {
    throw std::invalid_argument("operand_rows: must be >= 0, got " + str(operand_rows));
  }
  if (static_cast<int64_t>(grad_result.size()) != n || grad_result.empty() ||
      grad_result[0].rank() != 2) {
    throw std::invalid_argument("grad_result: expected one [R_out, H] tensor per local rank");
  }
  const TensorMeta op_meta{grad_result[0].dtype(), {operand_rows, grad_result[0].dim(1)}};
  validate_params(params, std::vector<TensorMeta>(n, op_meta), metas(grad_result), P);
  const int64_t R_out = grad_result[0].dim(0);
  std::vector<DeviceTensor> grad;
  for (int64_t r = 0; r < n; ++r) {
    grad.emplace_back(op_meta.dtype, op_meta.shape);
    grad[r].fill_bytes(0, s);  // rows never sent get 0
  }
  // Where every chunk landed and where it came from, exchanged so each rank holds the arrays
  // of the adjoint exchange: pack (output_offsets[j], input_offsets[j]) per peer j.
  Scratch<int32_t> packed(2 * P * n, s), landed(2 * P * n, s), adj(2 * P * n, s);
  std::vector<AllToAllI32Rank> xr;
  for (int64_t r = 0; r < n; ++r) {
    int32_t* pk = packed.get() + 2 * P * r;
    MOE_CUDA_CHECK(cudaMemcpy2DAsync(pk, 8, params[r].output_offsets.data(), 4, 4, P,
                                     cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpy2DAsync(pk + 1, 8, params[r].input_offsets.data(), 4, 4, P,
                                     cudaMemcpyDeviceToDevice, s));
    xr.push_back({ids[r], pk, landed.get() + 2 * P * r});
  }
  comm.all_to_all_i32(xr, 2, s);
  std::vector<RaggedA2ARank> orig, back;
  for (int64_t r = 0; r < n; ++r) {
    int32_t* in_adj = adj.get() + 2 * P * r;  // [P]: where r's received chunks sit in r
    int32_t* out_adj = in_adj + P;            // [P]: where they came from in the source
    const int32_t* got = landed.get() + 2 * P * r;
    MOE_CUDA_CHECK(cudaMemcpy2DAsync(in_adj, 4, got, 8, 4, P, cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpy2DAsync(out_adj, 4, got + 1, 8, 4, P, cudaMemcpyDeviceToDevice, s));
    orig.push_back({ids[r], nullptr, operand_rows, nullptr, R_out,
                    params[r].input_offsets.data<int32_t>(), params[r].send_sizes.data<int32_t>(),
                    params[r].output_offsets.data<int32_t>(),
                    params[r].recv_sizes.data<int32_t>()});
    back.push_back({ids[r], grad_result[r].data(), R_out, grad[r].data(), operand_rows, in_adj,
                    params[r].recv_sizes.data<int32_t>(), out_adj,
                    params[r].send_sizes.data<int32_t>()});
  }
  const int64_t row_bytes = row_bytes_2d(grad_result[0].meta());
  // The original arrays are checked as the forward checks them (row_bytes 0: nothing moves).
  run_checked(o.validate, s, 0, operand_rows, R_out,
              [&](void* err) { comm.ragged_all_to_all(orig, 0, err, s); });
  if (!o.validate) {
    comm.ragged_all_to_all(back, row_bytes, nullptr, s);
    return grad;
  }
  ErrorFlag flag;
  comm.ragged_all_to_all(back, row_bytes, flag.device_ptr(), s);
  const DeviceError e = flag.read(s);
  if (e.code == static_cast<int32_t>(A2AFault::overlap)) {
    throw std::invalid_argument("input_offsets: rank " + str(e.a) +
                                " sends overlapping operand rows to ranks " + str(e.b >> 32) +
                                " and " + str(static_cast<int32_t>(e.b)) +
                                "; the backward cannot assign both gradients");
  }
  throw_ep_fault(e, 0, R_out, operand_rows);
  return grad;
}

LocalChunks local_chunks(const DeviceTensor& a, int64_t shard_id, int64_t num_ep, Stream s,
                         const RunOptions& o) {
  validate_shard_id(shard_id, num_ep);
  validate_ep_counts(a.meta(), num_ep);
  const int64_t P = num_ep, E = a.dim(1);
  LocalChunks c{DeviceTensor(DType::i32, {E}), DeviceTensor(DType::i32, {E})};
  if (o.poison) {
    poison(c.split_sizes, s);
    poison(c.sorted_chunk_indices, s);
  }
  if (E == 0) return c;
  run_checked(o.validate, s, shard_id, 0, 0, [&](void* err) {
    local_chunks_kernel<<<1, 256, 0, s>>>(a.data(), static_cast<int>(int_kind(a.dtype())), P, E,
                                          shard_id, -1, nullptr, c.split_sizes.data<int32_t>(),
                                          c.sorted_chunk_indices.data<int32_t>(), nullptr, err);
    check_launch("local_chunks_kernel");
  });
  return c;
}

LocalPermuteFwd local_permute_after_a2a_fwd(const DeviceTensor& x_recv, const DeviceTensor& a,
                                            int64_t shard_id, int64_t num_ep, Stream s,
                                            const RunOptions& o) {
  validate_local_permute_after_a2a(x_recv.meta(), a.meta(), shard_id, num_ep);
  const int64_t P = num_ep, E = a.dim(1), L = E / P, R = x_recv.dim(0);
  LocalPermuteFwd out{DeviceTensor(x_recv.dtype(), x_recv.shape()), DeviceTensor(DType::i32, {L}),
                      DeviceTensor(DType::i32, {R})};
  if (o.poison) {
    poison(out.sorted_x, s);
    poison(out.local_group_sizes, s);
    poison(out.row_id_map, s);
  }
  run_checked(o.validate, s, shard_id, 0, R, [&](void* err) {
    Scratch<long long> split(E, s);
    Scratch<int32_t> order(E, s);
    if (E > 0) {
      local_chunks_kernel<<<1, 256, 0, s>>>(a.data(), static_cast<int>(int_kind(a.dtype())), P, E,
                                            shard_id, R, split.get(), nullptr, order.get(),
                                            out.local_group_sizes.data<int32_t>(), err);
      check_launch("local_chunks_kernel");
    }
    int32_t* map = out.row_id_map.data<int32_t>();
    detail::chunk_sort_map(split.get(), static_cast<int>(IntKind::i64), order.get(),
                           static_cast<int>(IntKind::i32), E, R, map, err, s);
    detail::permute_rows(out.sorted_x.data(), x_recv.data(), map, R, row_bytes_2d(x_recv.meta()),
                         true, PermFault::row_id_map_perm, nullptr, nullptr, s);
  });
  return out;
}

namespace {
// The one map of R14 applied to y: gather (out[i] = y[map[i]]) or scatter.
DeviceTensor apply_map(const DeviceTensor& y, const DeviceTensor& row_id_map, bool gather, Stream s,
                       const RunOptions& o) {
  DeviceTensor out(y.dtype(), y.shape());
  if (o.poison) {
    poison(out, s);
  } else if (!gather) {
    out.fill_bytes(0, s);
  }
  run_checked(o.validate, s, 0, 0, 0,
              [&](void* err) { sort_chunks_by_map_into(y, row_id_map, gather, out, err, s); });
  return out;
}
}  // namespace

DeviceTensor local_permute_after_a2a_bwd(const DeviceTensor& grad_sorted_x,
                                         const DeviceTensor& row_id_map, Stream s,
                                         const RunOptions& o) {
  validate_local_unpermute_before_a2a(grad_sorted_x.meta(), row_id_map.meta(), true);
  return apply_map(grad_sorted_x, row_id_map, /*gather=*/true, s, o);
}

DeviceTensor local_unpermute_before_a2a_fwd(const DeviceTensor& expert_outputs,
                                            const DeviceTensor& row_id_map, Stream s,
                                            const RunOptions& o) {
  validate_local_unpermute_before_a2a(expert_outputs.meta(), row_id_map.meta());
  return apply_map(expert_outputs, row_id_map, /*gather=*/true, s, o);
}

DeviceTensor local_unpermute_before_a2a_bwd(const DeviceTensor& grad_out,
                                            const DeviceTensor& row_id_map, Stream s,
                                            const RunOptions& o) {
  validate_local_unpermute_before_a2a(grad_out.meta(), row_id_map.meta(), true);
  return apply_map(grad_out, row_id_map, /*gather=*/false, s, o);
}

}  // namespace moe::gpu
