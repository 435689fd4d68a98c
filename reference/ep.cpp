#include "reference/ep.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "reference/perm_detail.h"
#include "reference/sort_chunks.h"

namespace moe::ref {

namespace {

using Counts = std::vector<std::vector<int64_t>>;

// A as host integers, every entry checked >= 0 (data-dependent).
Counts read_counts(const Tensor& a, int64_t num_ep) {
  validate_ep_counts(a.meta(), num_ep);
  const int64_t E = a.dim(1);
  Counts c(num_ep, std::vector<int64_t>(E));
  for (int64_t i = 0; i < num_ep; ++i) {
    for (int64_t e = 0; e < E; ++e) {
      c[i][e] = detail::int_at(a, i * E + e);
      if (c[i][e] < 0) {
        throw std::invalid_argument("all_shards_tokens_per_expert: entry [" + std::to_string(i) +
                                    ", " + std::to_string(e) + "] is negative (" +
                                    std::to_string(c[i][e]) + ")");
      }
    }
  }
  return c;
}

// Snd[i][j]: rows rank i sends to rank j in the forward direction.
Counts send_matrix(const Counts& a, int64_t num_ep) {
  const int64_t L = static_cast<int64_t>(a[0].size()) / num_ep;
  Counts snd(num_ep, std::vector<int64_t>(num_ep, 0));
  for (int64_t i = 0; i < num_ep; ++i)
    for (int64_t j = 0; j < num_ep; ++j)
      for (int64_t l = 0; l < L; ++l) snd[i][j] += a[i][j * L + l];
  return snd;
}

Tensor i32_vector(const std::vector<int64_t>& v) {
  Tensor t(DType::i32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), static_cast<double>(v[i]));
  return t;
}

std::vector<int64_t> int_vector(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = detail::int_at(t, i);
  return v;
}

struct Arrays {
  Counts in_off, send, out_off, recv;
};

Arrays read_arrays(const std::vector<RaggedA2AParams>& params) {
  Arrays a;
  for (const RaggedA2AParams& p : params) {
    a.in_off.push_back(int_vector(p.input_offsets));
    a.send.push_back(int_vector(p.send_sizes));
    a.out_off.push_back(int_vector(p.output_offsets));
    a.recv.push_back(int_vector(p.recv_sizes));
  }
  return a;
}

std::vector<TensorMeta> metas(const std::vector<Tensor>& v) {
  std::vector<TensorMeta> m;
  for (const Tensor& t : v) m.push_back(t.meta());
  return m;
}

void validate_params_meta(const std::vector<RaggedA2AParams>& params,
                          const std::vector<TensorMeta>& operand,
                          const std::vector<TensorMeta>& output, int64_t P, bool allow_f64) {
  std::vector<TensorMeta> io, ss, oo, rs;
  for (const RaggedA2AParams& p : params) {
    io.push_back(p.input_offsets.meta());
    ss.push_back(p.send_sizes.meta());
    oo.push_back(p.output_offsets.meta());
    rs.push_back(p.recv_sizes.meta());
  }
  validate_ragged_all_to_all(operand, output, io, ss, oo, rs, P, allow_f64);
}

}  // namespace

SimComm::SimComm(int64_t num_ranks) : size_(num_ranks) {
  if (num_ranks < 1) {
    throw std::invalid_argument("num_ep: must be >= 1, got " + std::to_string(num_ranks));
  }
}

std::vector<Tensor> all_gather(const SimComm& comm, const std::vector<Tensor>& x) {
  const int64_t P = comm.size();
  if (static_cast<int64_t>(x.size()) != P) {
    throw std::invalid_argument("all_gather: expected one tensor per rank (" + std::to_string(P) +
                                "), got " + std::to_string(x.size()));
  }
  for (int64_t r = 1; r < P; ++r) {
    if (x[r].dtype() != x[0].dtype() || x[r].shape() != x[0].shape()) {
      throw std::invalid_argument("all_gather: rank " + std::to_string(r) + " holds " +
                                  x[r].describe() + ", rank 0 holds " + x[0].describe());
    }
  }
  Shape s{P};
  s.insert(s.end(), x[0].shape().begin(), x[0].shape().end());
  Tensor stacked(x[0].dtype(), s);
  const size_t bytes = x[0].nbytes();
  for (int64_t r = 0; r < P; ++r) {
    if (bytes) std::memcpy(stacked.bytes() + r * bytes, x[r].bytes(), bytes);
  }
  std::vector<Tensor> out;
  for (int64_t r = 0; r < P; ++r) out.push_back(stacked.clone());
  return out;
}

RaggedA2AParams ragged_a2a_params(const Tensor& a, int64_t shard_id, int64_t num_ep,
                                  A2ADirection direction) {
  validate_shard_id(shard_id, num_ep);
  const Counts counts = read_counts(a, num_ep);
  const Counts snd = send_matrix(counts, num_ep);
  const bool fwd = direction == A2ADirection::forward;
  const int64_t s = shard_id, P = num_ep;
  std::vector<int64_t> send(P), in_off(P), recv(P), out_off(P, 0);
  int64_t acc = 0;
  for (int64_t j = 0; j < P; ++j) {
    send[j] = fwd ? snd[s][j] : snd[j][s];
    recv[j] = fwd ? snd[j][s] : snd[s][j];
    in_off[j] = acc;
    acc += send[j];
    for (int64_t i = 0; i < s; ++i) out_off[j] += fwd ? snd[i][j] : snd[j][i];
  }
  constexpr int64_t kMax = INT32_MAX;
  for (int64_t j = 0; j < P; ++j) {
    if (in_off[j] + send[j] > kMax || out_off[j] + send[j] > kMax) {
      throw std::invalid_argument(
          "all_shards_tokens_per_expert: row offsets exceed the int32 range");
    }
  }
  return {i32_vector(in_off), i32_vector(send), i32_vector(out_off), i32_vector(recv)};
}

std::vector<Tensor> ragged_all_to_all_fwd(const SimComm& comm, const std::vector<Tensor>& operand,
                                          const std::vector<Tensor>& output_init,
                                          const std::vector<RaggedA2AParams>& params, Rounding r) {
  const int64_t P = comm.size();
  if (static_cast<int64_t>(params.size()) != P) {
    throw std::invalid_argument("num_ep: " + std::to_string(params.size()) +
                                " parameter sets for a communicator of " + std::to_string(P) +
                                " ranks");
  }
  validate_params_meta(params, metas(operand), metas(output_init), P, r == Rounding::none);
  const Arrays a = read_arrays(params);
  const int64_t R_in = operand[0].dim(0), R_out = output_init[0].dim(0);
  check_ragged_a2a_arrays(a.in_off, a.send, a.out_off, a.recv, R_in, R_out);
  std::vector<Tensor> out;
  for (int64_t d = 0; d < P; ++d) {
    out.push_back(r == Rounding::none ? output_init[d].to(DType::f64) : output_init[d].clone());
  }
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t d = 0; d < P; ++d) {
      for (int64_t k = 0; k < a.send[s][d]; ++k) {
        detail::copy_row(out[d], a.out_off[s][d] + k, operand[s], a.in_off[s][d] + k);
      }
    }
  }
  return out;
}

std::vector<Tensor> ragged_all_to_all_bwd(const SimComm& comm,
                                          const std::vector<Tensor>& grad_result,
                                          const std::vector<RaggedA2AParams>& params,
                                          int64_t operand_rows, Rounding r) {
  const int64_t P = comm.size();
  if (static_cast<int64_t>(params.size()) != P) {
    throw std::invalid_argument("num_ep: " + std::to_string(params.size()) +
                                " parameter sets for a communicator of " + std::to_string(P) +
                                " ranks");
  }
  if (operand_rows < 0) {
    throw std::invalid_argument("operand_rows: must be >= 0, got " + std::to_string(operand_rows));
  }
  if (static_cast<int64_t>(grad_result.size()) != P || grad_result.empty() ||
      grad_result[0].rank() != 2) {
    throw std::invalid_argument("grad_result: expected one [R_out, H] tensor per rank");
  }
  // The gradient buffers play the operand's role: [operand_rows, H] in grad_result's dtype.
  const TensorMeta op_meta{grad_result[0].dtype(), {operand_rows, grad_result[0].dim(1)}};
  validate_params_meta(params, std::vector<TensorMeta>(P, op_meta), metas(grad_result), P,
                       r == Rounding::none);
  const Arrays a = read_arrays(params);
  check_ragged_a2a_arrays(a.in_off, a.send, a.out_off, a.recv, operand_rows, grad_result[0].dim(0));
  std::vector<Tensor> grad;
  for (int64_t s = 0; s < P; ++s) {
    grad.emplace_back(out_dtype(grad_result[0].dtype(), r), op_meta.shape);  // unsent rows 0
  }
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t d = 0; d < P; ++d) {
      for (int64_t k = 0; k < a.send[s][d]; ++k) {
        detail::copy_row(grad[s], a.in_off[s][d] + k, grad_result[d], a.out_off[s][d] + k);
      }
    }
  }
  return grad;
}

LocalChunks local_chunks(const Tensor& a, int64_t shard_id, int64_t num_ep) {
  validate_shard_id(shard_id, num_ep);
  const Counts counts = read_counts(a, num_ep);
  const int64_t P = num_ep, L = a.dim(1) / P, s = shard_id;
  std::vector<int64_t> split(P * L), order(P * L);
  for (int64_t i = 0; i < P; ++i) {
    for (int64_t l = 0; l < L; ++l) {
      split[i * L + l] = counts[i][s * L + l];
      order[l * P + i] = i * L + l;  // source-major to expert-major
    }
  }
  return {i32_vector(split), i32_vector(order)};
}

LocalPermuteFwd local_permute_after_a2a_fwd(const Tensor& x_recv, const Tensor& a, int64_t shard_id,
                                            int64_t num_ep, Rounding r) {
  validate_local_permute_after_a2a(x_recv.meta(), a.meta(), shard_id, num_ep, r == Rounding::none);
  const LocalChunks chunks = local_chunks(a, shard_id, num_ep);
  const int64_t P = num_ep, L = a.dim(1) / P;
  int64_t total = 0;
  std::vector<int64_t> local(L, 0);
  for (int64_t i = 0; i < P; ++i) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t n = detail::int_at(chunks.split_sizes, i * L + l);
      local[l] += n;
      total += n;
    }
  }
  // The receive-buffer overflow of R3, named as the EP op sees it.
  if (total > x_recv.dim(0)) {
    throw std::invalid_argument("x_recv: rank " + std::to_string(shard_id) + " receives " +
                                std::to_string(total) +
                                " rows (sum of its split sizes), more than "
                                "the receive buffer of R=" +
                                std::to_string(x_recv.dim(0)) + " rows");
  }
  SortChunksFwd sc =
      sort_chunks_by_index_fwd(x_recv, chunks.split_sizes, chunks.sorted_chunk_indices, nullptr, r);
  return {std::move(sc.sorted), i32_vector(local), std::move(sc.row_id_map)};
}

Tensor local_permute_after_a2a_bwd(const Tensor& grad_sorted_x, const Tensor& row_id_map,
                                   Rounding r) {
  validate_local_unpermute_before_a2a(grad_sorted_x.meta(), row_id_map.meta(), true);
  return sort_chunks_by_map(grad_sorted_x, row_id_map, /*inverse=*/true, r);
}

Tensor local_unpermute_before_a2a_fwd(const Tensor& expert_outputs, const Tensor& row_id_map,
                                      Rounding r) {
  validate_local_unpermute_before_a2a(expert_outputs.meta(), row_id_map.meta(),
                                      r == Rounding::none);
  // The block's one map with inverse=true (R14): out[i] = y[dst(i)].
  return sort_chunks_by_map(expert_outputs, row_id_map, /*inverse=*/true, r);
}

Tensor local_unpermute_before_a2a_bwd(const Tensor& grad_out, const Tensor& row_id_map,
                                      Rounding r) {
  validate_local_unpermute_before_a2a(grad_out.meta(), row_id_map.meta(), true);
  return sort_chunks_by_map(grad_out, row_id_map, /*inverse=*/false, r);
}

}  // namespace moe::ref
