// CUDA twin of moe_block (SPEC §11); see moe_block.cuh. Only glue lives here: every op of the
// spec is called through its gpu/ twin.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "gpu/argsort.cuh"
#include "gpu/aux_loss.cuh"
#include "gpu/device_util.cuh"
#include "gpu/dispatch.cuh"
#include "gpu/ep.cuh"
#include "gpu/grouped_gemm.cuh"
#include "gpu/moe_block.cuh"
#include "gpu/swiglu_ffn.cuh"
#include "gpu/timeline.cuh"
#include "gpu/topk_router.cuh"

namespace moe::gpu {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 8 ? b : 65535 * 8);
}

// ---- element-wise glue kernels (grid-stride, int64 indices) ------------------------------------

template <class S, class D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = from_f32<D>(to_f32(src[i]));  // widening is exact; narrowing rounds once (RNE)
  }
}

// acc[i] (+)= f32(src[i]); first = true overwrites.
template <class S>
__global__ void accumulate_kernel(float* acc, const S* src, int64_t n, bool first) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = to_f32(src[i]);
    acc[i] = first ? v : acc[i] + v;
  }
}

// out[i] = rnd_d(a[i] + f32(b[i])): d_x = rnd_d(f32(d_x_gate) + f32(d_x_dispatch)).
template <class D>
__global__ void add_round_kernel(const float* a, const D* b, D* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = from_f32<D>(a[i] + to_f32(b[i]));
  }
}

// The same for a 16-bit D, eight elements a thread (two 16-byte loads of a, one of b, one store):
// the scalar kernel's 2-byte accesses ran at half the copy bandwidth (218 / 256 us in the
// DeepSeek- / Mixtral-like block's backward, H200, session 45's timeline).
template <class D>
__global__ void add_round8_kernel(const float4* a, const uint4* b, uint4* out, int64_t n8) {
  static_assert(sizeof(D) == 2);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n8;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 a0 = a[2 * i], a1 = a[2 * i + 1];
    const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const uint4 bv = b[i];
    const D* bd = reinterpret_cast<const D*>(&bv);
    uint4 ov;
    D* od = reinterpret_cast<D*>(&ov);
#pragma unroll
    for (int j = 0; j < 8; ++j) od[j] = from_f32<D>(av[j] + to_f32(bd[j]));
    out[i] = ov;
  }
}

// d_logits [T, E] as three bf16 terms, hi + mid + lo = v exactly (each takes 8 of v's 24
// significant bits, rounded; the residues are exact in fp32; only for |v| < 2^-110 may the last
// term fall below bf16's normal range and round, by at most 2^-134), so the gate's gradients run
// as bf16 tensor-core GEMMs with fp32 accumulation instead of fp32 SIMT GEMMs: the products of x
// and rnd_d(gate_kernel) (bf16 values) by a term are exact in fp32. A non-finite v is its first
// term alone. Written twice: by_term [3][T][E] (wgrad's operands) and by_row [T][3E] (row t: its
// hi, mid, lo; dgrad's operand, one contraction of 3E against the gate kernel repeated thrice).
__global__ void split_bf16x3_kernel(const float* v, int64_t T, int64_t E, __nv_bfloat16* by_term,
                                    __nv_bfloat16* by_row) {
  const int64_t n = T * E;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = v[i];
    const __nv_bfloat16 hi = __float2bfloat16_rn(x);
    const float r1 = isfinite(x) ? x - __bfloat162float(hi) : 0.0f;
    const __nv_bfloat16 mid = __float2bfloat16_rn(r1);
    const __nv_bfloat16 lo = __float2bfloat16_rn(r1 - __bfloat162float(mid));
    by_term[i] = hi;
    by_term[n + i] = mid;
    by_term[2 * n + i] = lo;
    const int64_t t = i / E, e = i % E;
    __nv_bfloat16* row = by_row + t * 3 * E + e;
    row[0] = hi;
    row[E] = mid;
    row[2 * E] = lo;
  }
}

// out [H, 3E]: each row of g [H, E] three times.
__global__ void repeat3_cols_kernel(const __nv_bfloat16* g, int64_t H, int64_t E,
                                    __nv_bfloat16* out) {
  const int64_t n = H * 3 * E;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t h = i / (3 * E), e = i % (3 * E) % E;
    out[i] = g[h * E + e];
  }
}

// Column sums of a [T,E] bool map. Integer atomics: the result does not depend on their order.
__global__ void column_counts_kernel(const uint8_t* map, int64_t T, int64_t E, int32_t* out) {
  extern __shared__ int32_t local[];
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) local[e] = 0;
  __syncthreads();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < T * E;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (map[i]) atomicAdd(&local[i % E], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    if (local[e]) atomicAdd(&out[e], local[e]);
  }
}

// ---- host helpers
// --------------------------------------------------------------------------------

void poison_if(DeviceTensor& t, const RunOptions& o, Stream s) {
  if (o.poison && t.nbytes()) t.fill_bytes(0xFF, s);
}

void zero(DeviceTensor& t, Stream s) {
  if (t.nbytes()) MOE_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), s));
}

// dst = src converted element-wise (float dtypes), n elements from raw pointers.
void cast_raw(const void* src, DType sd, void* dst, DType dd, int64_t n, Stream s) {
  if (n <= 0) return;
  if (sd == dd) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(sd),
                                   cudaMemcpyDeviceToDevice, s));
    return;
  }
  dispatch_float(sd, [&](auto sv) {
    using S = decltype(sv);
    dispatch_float(dd, [&](auto dv) {
      using D = decltype(dv);
      cast_kernel<S, D>
          <<<blocks_for(n), kThreads, 0, s>>>(static_cast<const S*>(src), static_cast<D*>(dst), n);
    });
  });
  MOE_CUDA_CHECK(cudaGetLastError());
}

DeviceTensor cast(const DeviceTensor& t, DType d, Stream s) {
  DeviceTensor o(d, t.shape());
  cast_raw(t.data(), t.dtype(), o.data(), d, t.numel(), s);
  return o;
}

// Rows [from, from + n) of t seen as [numel / width, width], as an [n, width] tensor in d
// (x and grad_y are [B,S,H]: rows are tokens).
DeviceTensor take_rows(const DeviceTensor& t, int64_t width, int64_t from, int64_t n, DType d,
                       Stream s) {
  DeviceTensor o(d, {n, width});
  cast_raw(static_cast<const char*>(t.data()) + from * width * dtype_size(t.dtype()), t.dtype(),
           o.data(), d, n * width, s);
  return o;
}

// Rows [from, from + n) of t along its leading axis, converted to d (the other axes kept).
DeviceTensor take_rows(const DeviceTensor& t, int64_t from, int64_t n, DType d, Stream s) {
  Shape sh = t.shape();
  sh[0] = n;
  int64_t width = 1;
  for (size_t i = 1; i < sh.size(); ++i) width *= sh[i];
  DeviceTensor o(d, sh);
  cast_raw(static_cast<const char*>(t.data()) + from * width * dtype_size(t.dtype()), t.dtype(),
           o.data(), d, n * width, s);
  return o;
}

void accumulate(DeviceTensor& acc, int64_t first_row, const DeviceTensor& g, bool first, Stream s) {
  const int64_t n = g.numel();
  if (n == 0) return;
  const int64_t row = g.dim(0) > 0 ? n / g.dim(0) : 0;
  float* dst = acc.data<float>() + first_row * row;
  dispatch_float(g.dtype(), [&](auto v) {
    using S = decltype(v);
    accumulate_kernel<S><<<blocks_for(n), kThreads, 0, s>>>(dst, g.data<S>(), n, first);
  });
  MOE_CUDA_CHECK(cudaGetLastError());
}

DeviceTensor column_counts(const DeviceTensor& map, Stream s) {
  const int64_t T = map.dim(0), E = map.dim(1);
  DeviceTensor c(DType::i32, {E});
  zero(c, s);
  if (T * E > 0) {
    column_counts_kernel<<<std::min(blocks_for(T * E), 1024), kThreads, E * sizeof(int32_t), s>>>(
        map.data<uint8_t>(), T, E, c.data<int32_t>());
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  return c;
}

GroupPlan one_group(int64_t rows) {
  return make_group_plan({rows}, rows);
}

struct Dims {
  MoeBlockShape s;
  int64_t P, D, E, K, L, T, Ts, R, R_pre;
  DType d;
};

const TensorMeta* meta_of(const DeviceTensor* t, TensorMeta& m) {
  if (!t) return nullptr;
  m = t->meta();
  return &m;
}

Dims dims(const MoeBlockInputs& in, const MoeBlockParams& p) {
  TensorMeta b0, b1, bo, eb;
  Dims k;
  k.s = validate_moe_block(in.x.meta(), in.gate_kernel.meta(), in.wi_0.meta(), in.wi_1.meta(),
                           in.wo.meta(), meta_of(in.wi_0_bias, b0), meta_of(in.wi_1_bias, b1),
                           meta_of(in.wo_bias, bo), meta_of(in.expert_bias, eb), p);
  k.P = p.ep_size;
  k.D = p.dp_size;
  k.E = k.s.E;
  k.K = p.topk;
  k.L = k.E / k.P;
  k.T = k.s.tokens();
  k.Ts = k.T / (k.P * k.D);
  k.R = recv_rows(k.s.ep(p));
  k.R_pre = pre_a2a_rows(k.s.ep(p));
  k.d = in.x.dtype();
  return k;
}

GemmOptions gemm_options(const RunOptions& o) {
  GemmOptions g;
  g.poison = o.poison;
  return g;
}

}  // namespace

// ---- local weights ------------------------------------------------------------------------------

LocalExpertWeights::LocalExpertWeights(const MoeBlockInputs& in, int64_t ep_rank, int64_t L,
                                       DType d, Stream s) {
  const DeviceTensor* src[6] = {&in.wi_0, &in.wi_1, &in.wo, in.wi_0_bias, in.wi_1_bias, in.wo_bias};
  for (int i = 0; i < 6; ++i) {
    if (!src[i]) continue;
    if (src[i]->dim(0) == L && src[i]->dtype() == d) {
      src_[i] = src[i];  // P = 1 and already in d: no copy of the (large) weights
    } else {
      own_[i] = take_rows(*src[i], ep_rank * L, L, d, s);
    }
  }
}

const DeviceTensor* LocalExpertWeights::get(int i) const {
  return own_[i] ? &*own_[i] : src_[i];
}

FfnWeights LocalExpertWeights::view() const {
  return {*get(0), *get(1), *get(2), get(3), get(4), get(5)};
}

// ---- EP part of one data-parallel group ---------------------------------------------------------

namespace {

void check_ranks(const Communicator& comm, size_t n, const char* what) {
  if (comm.local_ranks().size() != n) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(n) +
                                " shards for a communicator driving " +
                                std::to_string(comm.local_ranks().size()) + " ranks");
  }
}

std::vector<RaggedA2AParams> a2a_params(const Communicator& comm,
                                        const std::vector<const DeviceTensor*>& A, int64_t P,
                                        A2ADirection dir, Stream s, const RunOptions& o) {
  const std::vector<int> ranks = comm.local_ranks();
  std::vector<RaggedA2AParams> v;
  for (size_t i = 0; i < ranks.size(); ++i) {
    v.push_back(ragged_a2a_params(*A[i], ranks[i], P, dir, s, o));
  }
  return v;
}

}  // namespace

void moe_block_experts_fwd(Communicator& comm, const std::vector<MoeShardState*>& shards,
                           std::vector<DeviceTensor>& buffers,
                           const std::vector<const LocalExpertWeights*>& weights,
                           const MoeBlockParams& p, const MoeBlockShape& shape, Stream s,
                           const RunOptions& o) {
  check_ranks(comm, shards.size(), "moe_block_experts_fwd");
  const int64_t P = p.ep_size, E = shape.E, H = shape.H;
  const std::vector<int> ranks = comm.local_ranks();
  const size_t n = shards.size();
  const DType d = buffers.empty() ? DType::f32 : buffers[0].dtype();
  if (P > 1) {
    // A = all_gather(group_sizes): every rank sends its E counts to every peer.
    std::vector<DeviceTensor> send;
    std::vector<AllToAllI32Rank> a2a;
    for (size_t i = 0; i < n; ++i) {
      send.emplace_back(DType::i32, Shape{P * E});
      for (int64_t j = 0; j < P; ++j) {
        MOE_CUDA_CHECK(cudaMemcpyAsync(send[i].data<int32_t>() + j * E,
                                       shards[i]->group_sizes.data(), E * sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, s));
      }
      shards[i]->all_shards_tokens_per_expert.emplace(DType::i32, Shape{P, E});
    }
    for (size_t i = 0; i < n; ++i) {
      a2a.push_back({ranks[i], send[i].data<int32_t>(),
                     shards[i]->all_shards_tokens_per_expert->data<int32_t>()});
    }
    comm.all_to_all_i32(a2a, E, s);
    std::vector<const DeviceTensor*> A;
    for (MoeShardState* st : shards) A.push_back(&*st->all_shards_tokens_per_expert);
    const std::vector<RaggedA2AParams> fwd_params =
        a2a_params(comm, A, P, A2ADirection::forward, s, o);
    const std::vector<RaggedA2AParams> rev_params =
        a2a_params(comm, A, P, A2ADirection::reverse, s, o);
    const EpShape es = shape.ep(p);
    std::vector<DeviceTensor> zeros;
    for (size_t i = 0; i < n; ++i) {
      zeros.emplace_back(d, Shape{recv_rows(es), H});
      zero(zeros.back(), s);
    }
    std::vector<DeviceTensor> recv = ragged_all_to_all_fwd(comm, buffers, zeros, fwd_params, s, o);
    buffers.clear();
    for (size_t i = 0; i < n; ++i) {
      LocalPermuteFwd lp = local_permute_after_a2a_fwd(recv[i], *A[i], ranks[i], P, s, o);
      shards[i]->sorted_x = std::move(lp.sorted_x);
      shards[i]->local_group_sizes = std::move(lp.local_group_sizes);
      shards[i]->local_row_id_map = std::move(lp.row_id_map);
    }
    recv.clear();
    std::vector<DeviceTensor> unperm;
    for (size_t i = 0; i < n; ++i) {
      MoeShardState& st = *shards[i];
      SwigluFfnFwd f = swiglu_expert_ffn_fwd(st.sorted_x, st.local_group_sizes, weights[i]->view(),
                                             p.activation, s, gemm_options(o));
      st.gate_proj = std::move(f.gate_proj);
      st.up_proj = std::move(f.up_proj);
      st.intermediate = std::move(f.intermediate);
      // The same chunk-sort map, inverse (R14).
      unperm.push_back(local_unpermute_before_a2a_fwd(f.out, *st.local_row_id_map, s, o));
    }
    zeros.clear();
    for (size_t i = 0; i < n; ++i) {
      zeros.emplace_back(d, Shape{pre_a2a_rows(es), H});
      zero(zeros.back(), s);
    }
    std::vector<DeviceTensor> back = ragged_all_to_all_fwd(comm, unperm, zeros, rev_params, s, o);
    for (size_t i = 0; i < n; ++i) shards[i]->eo_post = std::move(back[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    MoeShardState& st = *shards[i];
    st.sorted_x = std::move(buffers[i]);
    st.local_group_sizes = take_rows(st.group_sizes, 0, E, DType::i32, s);
    SwigluFfnFwd f = swiglu_expert_ffn_fwd(st.sorted_x, st.local_group_sizes, weights[i]->view(),
                                           p.activation, s, gemm_options(o));
    st.gate_proj = std::move(f.gate_proj);
    st.up_proj = std::move(f.up_proj);
    st.intermediate = std::move(f.intermediate);
    st.eo_post = std::move(f.out);
  }
  buffers.clear();
}

std::vector<ExpertGrads> moe_block_experts_bwd(Communicator& comm,
                                               const std::vector<const MoeShardState*>& shards,
                                               std::vector<DeviceTensor>& d_eo_post,
                                               const std::vector<const LocalExpertWeights*>& w,
                                               const MoeBlockParams& p, const MoeBlockShape& shape,
                                               Stream s, const RunOptions& o) {
  check_ranks(comm, shards.size(), "moe_block_experts_bwd");
  const int64_t P = p.ep_size;
  const size_t n = shards.size();
  std::vector<ExpertGrads> out(n);
  std::vector<RaggedA2AParams> fwd_params, rev_params;
  std::vector<DeviceTensor> d_expert_out;
  if (P > 1) {
    std::vector<const DeviceTensor*> A;
    for (const MoeShardState* st : shards) A.push_back(&*st->all_shards_tokens_per_expert);
    fwd_params = a2a_params(comm, A, P, A2ADirection::forward, s, o);
    rev_params = a2a_params(comm, A, P, A2ADirection::reverse, s, o);
    // The reverse exchange's backward: a forward-direction exchange into zeros [R,H].
    std::vector<DeviceTensor> d_unperm =
        ragged_all_to_all_bwd(comm, d_eo_post, rev_params, recv_rows(shape.ep(p)), s, o);
    d_eo_post.clear();
    for (size_t i = 0; i < n; ++i) {
      d_expert_out.push_back(
          local_unpermute_before_a2a_bwd(d_unperm[i], *shards[i]->local_row_id_map, s, o));
    }
  } else {
    d_expert_out = std::move(d_eo_post);
    d_eo_post.clear();
  }
  std::vector<DeviceTensor> d_recv;
  for (size_t i = 0; i < n; ++i) {
    const MoeShardState& st = *shards[i];
    out[i].ffn = swiglu_expert_ffn_bwd(d_expert_out[i], st.sorted_x, st.local_group_sizes,
                                       w[i]->view(), st.gate_proj, st.up_proj, st.intermediate,
                                       p.activation, s, gemm_options(o));
    d_expert_out[i] = DeviceTensor();
    // The stage values are not needed past the FFN; free them early (large at benchmark sizes).
    out[i].ffn.d_gate = DeviceTensor();
    out[i].ffn.d_up = DeviceTensor();
    if (P > 1) {
      d_recv.push_back(local_permute_after_a2a_bwd(out[i].ffn.grad_x, *st.local_row_id_map, s, o));
      out[i].ffn.grad_x = DeviceTensor();
    } else {
      out[i].d_buffer = std::move(out[i].ffn.grad_x);
    }
  }
  if (P > 1) {
    // The forward exchange's backward: the reverse exchange into zeros [dispatch rows, H].
    std::vector<DeviceTensor> back =
        ragged_all_to_all_bwd(comm, d_recv, fwd_params, shards[0]->dispatch_rows, s, o);
    for (size_t i = 0; i < n; ++i) out[i].d_buffer = std::move(back[i]);
  }
  return out;
}

// ---- the block ----------------------------------------------------------------------------------

namespace {

// out[i] = sum over k in order 0..n-1 of parts[k*stride + i], fp32: the gate-kernel gradient's
// sum over shards in one fixed order, so a run over NCCL and the in-process run agree bitwise.
__global__ void ordered_sum_kernel(const float* parts, int64_t n_parts, int64_t stride,
                                   float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < stride;
       i += int64_t{gridDim.x} * blockDim.x) {
    float acc = parts[i];
    for (int64_t k = 1; k < n_parts; ++k) acc += parts[k * stride + i];
    out[i] = acc;
  }
}

// The shards (index dp*P + ep) this process computes: every shard when comm drives all P EP ranks
// here (the in-process communicator), else the shard of comm's one rank (one process per EP rank,
// which needs D = 1: the data-parallel groups would need a communicator of their own).
std::vector<int64_t> local_shards(const Communicator& comm, const Dims& k) {
  if (comm.size() != k.P) {
    throw std::invalid_argument("comm: a communicator of " + std::to_string(comm.size()) +
                                " ranks for ep_size=" + std::to_string(k.P));
  }
  const std::vector<int> ranks = comm.local_ranks();
  std::vector<int64_t> v;
  if (static_cast<int64_t>(ranks.size()) == k.P) {
    for (int64_t i = 0; i < k.P * k.D; ++i) v.push_back(i);
    return v;
  }
  if (ranks.size() != 1) {
    throw std::invalid_argument("comm: drives " + std::to_string(ranks.size()) +
                                " ranks; the block needs all of them or exactly one");
  }
  if (k.D != 1) {
    throw std::invalid_argument("dp_size: must be 1 when each process drives one EP rank, got " +
                                std::to_string(k.D));
  }
  v.push_back(ranks[0]);
  return v;
}

// Shard local[i]'s block (bytes each) lands at global + local[i] * bytes on this process: plain
// copies when this process holds every shard, else an all-gather over comm (shard = rank, D = 1).
void gather_shards(Communicator& comm, const std::vector<int64_t>& local, int64_t n_shards,
                   const std::vector<const void*>& blocks, int64_t bytes, void* global, Stream s) {
  if (bytes <= 0) return;
  if (static_cast<int64_t>(local.size()) == n_shards) {
    for (size_t i = 0; i < local.size(); ++i) {
      MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(global) + local[i] * bytes, blocks[i],
                                     static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
    }
    return;
  }
  comm.all_gather({{static_cast<int>(local[0]), blocks[0], global}}, bytes, s);
}

// The FFN weights of the EP ranks this process drives (null for the others).
std::vector<std::unique_ptr<LocalExpertWeights>> local_weights(const MoeBlockInputs& in,
                                                               const std::vector<int64_t>& local,
                                                               const Dims& k, Stream s) {
  std::vector<std::unique_ptr<LocalExpertWeights>> w(k.P);
  for (int64_t idx : local) {
    const int64_t r = idx % k.P;
    if (!w[r]) w[r] = std::make_unique<LocalExpertWeights>(in, r, k.L, k.d, s);
  }
  return w;
}

}  // namespace

MoeBlockFwd moe_block_fwd(const MoeBlockInputs& in, const MoeBlockParams& p, Stream s,
                          const RunOptions& o) {
  InProcessCommunicator comm(static_cast<int>(std::max<int64_t>(p.ep_size, 1)));
  return moe_block_fwd(comm, in, p, s, o);
}

MoeBlockGrads moe_block_bwd(const DeviceTensor& grad_y, const DeviceTensor* grad_aux_loss,
                            const MoeBlockInputs& in, const MoeBlockFwd& fwd,
                            const MoeBlockParams& p, Stream s, const RunOptions& o) {
  InProcessCommunicator comm(static_cast<int>(std::max<int64_t>(p.ep_size, 1)));
  return moe_block_bwd(comm, grad_y, grad_aux_loss, in, fwd, p, s, o);
}

MoeBlockFwd moe_block_fwd(Communicator& comm, const MoeBlockInputs& in, const MoeBlockParams& p,
                          Stream s, const RunOptions& o) {
  const Dims k = dims(in, p);
  const std::vector<int64_t> local = local_shards(comm, k);
  const RouterParams rp = p.router();
  const int64_t H = k.s.H, E = k.E, NS = k.P * k.D;
  const int64_t NL = static_cast<int64_t>(local.size());
  const DType router_dtype = p.router_logits_dtype == RouterLogitsDtype::float32 ? DType::f32 : k.d;
  const DeviceTensor gk = [&] {
    const TimelineStage stage("gate");
    return cast(in.gate_kernel, k.d, s);
  }();
  std::optional<DeviceTensor> eb;
  if (in.expert_bias) {
    const TimelineStage stage("router");
    eb = cast(*in.expert_bias, DType::f32, s);
  }
  const GroupPlan plan = one_group(k.Ts);

  MoeBlockFwd out;
  out.shards.resize(NL);
  std::vector<DeviceTensor> buffers(NL);
  // Steps 1, 2, 4 on every local shard: gate, router, global dispatch.
  for (int64_t i = 0; i < NL; ++i) {
    MoeShardState& st = out.shards[i];
    st.ep_rank = local[i] % k.P;
    st.dp_rank = local[i] / k.P;
    st.first_token = local[i] * k.Ts;
    st.tokens = k.Ts;
    {
      const TimelineStage stage("gate");
      st.x2d = take_rows(in.x, H, st.first_token, k.Ts, k.d, s);
      DeviceTensor logits(k.d, {k.Ts, E});
      poison_if(logits, o, s);
      if (k.Ts > 0) {
        // logits = rnd_d(x @ rnd_d(gate_kernel)), fp32 accumulation.
        gemm_detail::grouped_product(GemmRole::fwd, plan, k.d, st.x2d.data(), gk.data(), k.d,
                                     logits.data(), H, E, false, s, GemmImpl::loop);
      }
      st.logits = router_dtype == k.d ? std::move(logits) : cast(logits, router_dtype, s);
    }
    {
      const TimelineStage stage("router");
      TopkRouterFwd rf = topk_router_fwd(st.logits, eb ? &*eb : nullptr, rp, s);
      st.routing_map = std::move(rf.routing_map);
      st.saved_scores = std::move(rf.saved_scores);
      st.sparse_probs = rf.probs.dtype() == p.probs_dtype ? std::move(rf.probs)
                                                          : cast(rf.probs, p.probs_dtype, s);
    }
    const TimelineStage stage("dispatch");
    if (p.backend == MoeBackend::kernel) {
      TokenDispatchParams dp;
      dp.num_out_tokens = k.Ts * k.K;
      dp.align_size = p.align_size;
      TokenDispatchFwd f = token_dispatch_fwd(st.x2d, st.routing_map, nullptr, dp, s, o);
      buffers[i] = std::move(f.permuted);
      st.row_id_map = std::move(f.row_id_map);
      st.pad_offsets = std::move(f.pad_offsets);
      st.group_sizes = std::move(f.tokens_per_expert);
    } else {
      RoutingMapToSelectedExpertsFwd sel =
          routing_map_to_selected_experts_fwd(st.sparse_probs, st.routing_map, k.K, s, o);
      st.selected_experts = std::move(sel.selected_experts);
      st.weights = std::move(sel.weights);
      ArgsortDispatchParams ap;
      ap.num_experts = E;
      ap.topk = k.K;
      ap.align_size = p.align_size;
      ArgsortTokenDispatchFwd f = argsort_token_dispatch_fwd(st.x2d, st.selected_experts, ap, s, o);
      buffers[i] = std::move(f.sorted_x);
      st.sorted_indices = std::move(f.sorted_indices);
      st.group_sizes = std::move(f.group_sizes);
      st.perm = f.state;
    }
    st.dispatch_rows = buffers[i].dim(0);
  }

  // Step 3: the aux loss over the global token set (every EP and DP shard). Under one process per
  // rank every rank gathers the f32 logits and computes the same global loss.
  if (p.aux_loss()) {
    const TimelineStage stage("aux");
    DeviceTensor global(DType::f32, {k.T, E});
    poison_if(global, o, s);
    std::vector<DeviceTensor> l32;
    std::vector<const void*> blocks;
    for (const MoeShardState& st : out.shards) {
      l32.push_back(cast(st.logits, DType::f32, s));
      blocks.push_back(l32.back().data());
    }
    gather_shards(comm, local, NS, blocks, k.Ts * E * 4, global.data(), s);
    l32.clear();
    const TopkRouterFwd gr = topk_router_fwd(global, eb ? &*eb : nullptr, rp, s);
    DeviceTensor tpe = column_counts(gr.routing_map, s);
    AuxLossScoresFwd sc = aux_loss_scores_fwd(global, k.K, p.score_function, MapFormat::bytemap, s);
    AuxLossParams ap;
    ap.topk = k.K;
    ap.coeff = p.aux_loss_coeff;
    ap.num_experts = E;
    ap.total_num_tokens = k.T;
    MoeAuxLossFwd al = moe_aux_loss_fwd(sc.scores, tpe, ap, s);
    out.aux_loss = std::move(al.aux_loss);
    out.aux_const_buf = std::move(al.const_buf);
    out.aux_tpe = std::move(tpe);
    out.aux_saved_scores = std::move(sc.saved_scores);
  }

  // Steps 5-7 per data-parallel group of P EP ranks, through the communicator.
  const auto weights = [&] {
    const TimelineStage stage("experts");
    return local_weights(in, local, k, s);
  }();
  for (int64_t dp = 0; dp < k.D; ++dp) {
    std::vector<MoeShardState*> group;
    std::vector<DeviceTensor> group_buffers;
    std::vector<const LocalExpertWeights*> w;
    for (int64_t i = 0; i < NL; ++i) {
      if (out.shards[i].dp_rank != dp) continue;
      group.push_back(&out.shards[i]);
      group_buffers.push_back(std::move(buffers[i]));
      w.push_back(weights[out.shards[i].ep_rank].get());
    }
    const TimelineStage stage("experts");
    if (!group.empty()) moe_block_experts_fwd(comm, group, group_buffers, w, p, k.s, s, o);
  }

  // Step 8: the combine per shard; y and the diagnostics gathered over every shard.
  const TimelineStage stage("combine");
  out.y = DeviceTensor(k.d, in.x.shape());
  out.routing_map = DeviceTensor(DType::boolean, {k.T, E});
  out.probs = DeviceTensor(p.probs_dtype, {k.T, E});
  poison_if(out.y, o, s);
  poison_if(out.probs, o, s);
  if (o.poison && out.routing_map.nbytes()) out.routing_map.fill_bytes(0x7f, s);
  std::vector<DeviceTensor> ys;
  std::vector<const void*> yb, mb, pb;
  for (const MoeShardState& st : out.shards) {
    ys.push_back(
        p.backend == MoeBackend::kernel
            ? token_combine_fwd(st.eo_post, st.row_id_map, &st.sparse_probs,
                                st.pad_offsets ? &*st.pad_offsets : nullptr, s, o)
            : argsort_token_combine_fwd(st.eo_post, st.sorted_indices, st.weights, st.perm, s, o));
    yb.push_back(ys.back().data());
    mb.push_back(st.routing_map.data());
    pb.push_back(st.sparse_probs.data());
  }
  gather_shards(comm, local, NS, yb, k.Ts * H * dtype_size(k.d), out.y.data(), s);
  gather_shards(comm, local, NS, mb, k.Ts * E, out.routing_map.data(), s);
  gather_shards(comm, local, NS, pb, k.Ts * E * dtype_size(p.probs_dtype), out.probs.data(), s);
  out.group_sizes = column_counts(out.routing_map, s);
  return out;
}

MoeBlockGrads moe_block_bwd(Communicator& comm, const DeviceTensor& grad_y,
                            const DeviceTensor* grad_aux_loss, const MoeBlockInputs& in,
                            const MoeBlockFwd& fwd, const MoeBlockParams& p, Stream s,
                            const RunOptions& o) {
  const Dims k = dims(in, p);
  const std::vector<int64_t> local = local_shards(comm, k);
  require_shape(grad_y.meta(), in.x.shape(), "grad_y");
  if (!is_floating(grad_y.dtype()) || grad_y.dtype() == DType::f64) {
    throw std::invalid_argument("grad_y: unsupported dtype " +
                                std::string(dtype_name(grad_y.dtype())));
  }
  const int64_t NS = k.P * k.D, H = k.s.H, E = k.E;
  const int64_t NL = static_cast<int64_t>(local.size());
  if (static_cast<int64_t>(fwd.shards.size()) != NL) {
    throw std::invalid_argument("fwd: the saved state has " + std::to_string(fwd.shards.size()) +
                                " shards, expected " + std::to_string(NL) +
                                " (the shards this process computes)");
  }
  for (int64_t i = 0; i < NL; ++i) {
    if (fwd.shards[i].ep_rank + k.P * fwd.shards[i].dp_rank != local[i]) {
      throw std::invalid_argument("fwd: saved shard " + std::to_string(i) +
                                  " belongs to another rank");
    }
  }
  const RouterParams rp = p.router();

  // Aux-loss backward over the global token set (§11.3 step 7); every process holds it whole.
  std::optional<DeviceTensor> d_logits_aux;
  if (p.aux_loss()) {
    const TimelineStage stage("aux");
    if (!fwd.aux_const_buf) throw std::invalid_argument("fwd: no aux-loss state saved");
    DeviceTensor g(DType::f32, {});
    zero(g, s);
    if (grad_aux_loss) {
      require_shape(grad_aux_loss->meta(), {}, "grad_aux_loss");
      g = cast(*grad_aux_loss, DType::f32, s);
    }
    const DeviceTensor gp = moe_aux_loss_bwd(g, *fwd.aux_const_buf, *fwd.aux_tpe, k.T, s);
    d_logits_aux = aux_loss_scores_bwd(gp, *fwd.aux_saved_scores, p.score_function, DType::f32, s);
  }

  // Step 1: combine backward per local shard.
  std::vector<DeviceTensor> d_eo_post(NL), d_sparse(NL);
  for (int64_t i = 0; i < NL; ++i) {
    const TimelineStage stage("combine");
    const MoeShardState& st = fwd.shards[i];
    const DeviceTensor ct = take_rows(grad_y, H, st.first_token, st.tokens, k.d, s);
    if (p.backend == MoeBackend::kernel) {
      TokenCombineBwd b = token_combine_bwd(ct, st.eo_post, st.row_id_map, &st.sparse_probs,
                                            st.pad_offsets ? &*st.pad_offsets : nullptr, s, o);
      d_eo_post[i] = std::move(b.grad_permuted);
      d_sparse[i] = std::move(*b.grad_merging_probs);
    } else {
      ArgsortTokenCombineBwd b =
          argsort_token_combine_bwd(ct, st.eo_post, st.sorted_indices, st.weights, st.perm, s, o);
      d_eo_post[i] = std::move(b.grad_expert_outputs);
      d_sparse[i] =
          routing_map_to_selected_experts_bwd(b.grad_weights, st.selected_experts, E, s, o);
    }
  }

  // Steps 2-4 per data-parallel group; FFN weight gradients summed over the DP shards in dp order.
  const auto weights = [&] {
    const TimelineStage stage("experts");
    return local_weights(in, local, k, s);
  }();
  const bool all_here = NL == NS;
  const bool direct = k.P == 1 && k.D == 1;  // gradients need no reduction (maybe a cast)
  const DeviceTensor* params[6] = {&in.wi_0,     &in.wi_1,     &in.wo,
                                   in.wi_0_bias, in.wi_1_bias, in.wo_bias};
  std::optional<DeviceTensor> acc[6];
  std::optional<DeviceTensor> result[6];
  std::vector<DeviceTensor> d_buffer(NL);
  for (int64_t dp = 0; dp < k.D; ++dp) {
    std::vector<const MoeShardState*> group;
    std::vector<DeviceTensor> ct;
    std::vector<const LocalExpertWeights*> w;
    std::vector<int64_t> at;  // positions in the local lists
    for (int64_t i = 0; i < NL; ++i) {
      if (fwd.shards[i].dp_rank != dp) continue;
      group.push_back(&fwd.shards[i]);
      ct.push_back(std::move(d_eo_post[i]));
      w.push_back(weights[fwd.shards[i].ep_rank].get());
      at.push_back(i);
    }
    if (group.empty()) continue;
    const TimelineStage stage("experts");
    std::vector<ExpertGrads> g = moe_block_experts_bwd(comm, group, ct, w, p, k.s, s, o);
    for (size_t gi = 0; gi < g.size(); ++gi) {
      const int64_t r = group[gi]->ep_rank;
      d_buffer[at[gi]] = std::move(g[gi].d_buffer);
      SwigluFfnBwd& f = g[gi].ffn;
      DeviceTensor* grads[6] = {&f.grad_wi_0,
                                &f.grad_wi_1,
                                &f.grad_wo,
                                f.grad_wi_0_bias ? &*f.grad_wi_0_bias : nullptr,
                                f.grad_wi_1_bias ? &*f.grad_wi_1_bias : nullptr,
                                f.grad_wo_bias ? &*f.grad_wo_bias : nullptr};
      for (int j = 0; j < 6; ++j) {
        if (!params[j] || !grads[j]) continue;
        if (direct && grads[j]->dtype() == params[j]->dtype()) {
          result[j] = std::move(*grads[j]);
          continue;
        }
        if (!all_here) {
          // One EP rank per process (D = 1): its L experts' gradients, cast once, then gathered.
          // Bitwise what the in-process path gives: f32 widening is exact, so both round once.
          result[j].emplace(params[j]->dtype(), params[j]->shape());
          const DeviceTensor mine = cast(*grads[j], params[j]->dtype(), s);
          gather_shards(comm, local, k.P, {mine.data()}, mine.nbytes(), result[j]->data(), s);
          *grads[j] = DeviceTensor();
          continue;
        }
        if (!acc[j]) acc[j].emplace(DType::f32, params[j]->shape());
        accumulate(*acc[j], r * k.L, *grads[j], dp == 0, s);
        *grads[j] = DeviceTensor();
      }
    }
  }

  // Steps 5, 6, 8 per local shard: dispatch and router backward, the gate GEMM's gradients. The
  // gate-kernel gradient of each shard goes to its own fp32 slot; the slots are summed in shard
  // order once every shard's is in (gathered across processes), so every layout sums alike.
  MoeBlockGrads out;
  out.x = DeviceTensor(in.x.dtype(), in.x.shape());
  poison_if(out.x, o, s);
  const DeviceTensor gk_d = [&] {
    const TimelineStage stage("gate");
    return cast(in.gate_kernel, k.d, s);  // rnd_d(gate_kernel)
  }();
  DeviceTensor parts(DType::f32, {NS, H, E});
  std::vector<DeviceTensor> mine_gk, mine_x;
  std::vector<const void*> gk_blocks, x_blocks;
  for (int64_t i = 0; i < NL; ++i) {
    const MoeShardState& st = fwd.shards[i];
    std::optional<TimelineStage> stage(std::in_place, "dispatch");
    DeviceTensor d_x_dispatch =
        p.backend == MoeBackend::kernel
            ? std::move(token_dispatch_bwd(d_buffer[i], nullptr, st.row_id_map,
                                           st.pad_offsets ? &*st.pad_offsets : nullptr, s, o)
                            .grad_x)
            : argsort_token_dispatch_bwd(d_buffer[i], st.sorted_indices, st.perm, s, o);
    d_buffer[i] = DeviceTensor();
    stage.reset();
    stage.emplace("router");
    // grad_probs = f32(d_sparse_probs); the router backward gives d_logits in f32.
    const DeviceTensor gp32 = cast(d_sparse[i], DType::f32, s);
    DeviceTensor d_logits = topk_router_bwd(gp32, st.routing_map, st.saved_scores, rp, s);
    if (d_logits_aux) {
      accumulate(d_logits, 0, take_rows(*d_logits_aux, st.first_token, st.tokens, DType::f32, s),
                 false, s);
    }
    stage.reset();
    stage.emplace("gate");
    mine_gk.emplace_back(DType::f32, Shape{H, E});
    mine_x.emplace_back(in.x.dtype(), Shape{k.Ts, H});
    zero(mine_gk.back(), s);
    gk_blocks.push_back(mine_gk.back().data());
    x_blocks.push_back(mine_x.back().data());
    if (k.Ts == 0) continue;
    DeviceTensor d_x_gate(DType::f32, {k.Ts, H});
    poison_if(d_x_gate, o, s);
    moe_gate_grads(d_logits, st.x2d, gk_d, d_x_gate, mine_gk.back(), s);
    const int64_t n = k.Ts * H;
    dispatch_float(k.d, [&](auto v) {
      using D = decltype(v);
      const float* a = d_x_gate.data<float>();
      const D* b = d_x_dispatch.data<D>();
      D* y = mine_x.back().data<D>();
      const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
      if constexpr (sizeof(D) == 2) {
        if (n % 8 == 0 && aligned(a) && aligned(b) && aligned(y)) {
          add_round8_kernel<D><<<blocks_for(n / 8), kThreads, 0, s>>>(
              reinterpret_cast<const float4*>(a), reinterpret_cast<const uint4*>(b),
              reinterpret_cast<uint4*>(y), n / 8);
          return;
        }
      }
      add_round_kernel<D><<<blocks_for(n), kThreads, 0, s>>>(a, b, y, n);
    });
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  const TimelineStage stage("gather");
  gather_shards(comm, local, NS, x_blocks, k.Ts * H * dtype_size(in.x.dtype()), out.x.data(), s);
  gather_shards(comm, local, NS, gk_blocks, H * E * 4, parts.data(), s);
  DeviceTensor acc_gk(DType::f32, {H, E});
  if (H * E > 0) {
    ordered_sum_kernel<<<blocks_for(H * E), kThreads, 0, s>>>(parts.data<float>(), NS, H * E,
                                                              acc_gk.data<float>());
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  out.gate_kernel = cast(acc_gk, in.gate_kernel.dtype(), s);  // one rounding of the shard sum
  for (int j = 0; j < 6; ++j) {
    if (!params[j]) continue;
    if (!result[j]) {
      if (!acc[j]) {  // no shard had rows for these experts (cannot happen with P*D >= 1)
        acc[j].emplace(DType::f32, params[j]->shape());
        zero(*acc[j], s);
      }
      result[j] = cast(*acc[j], params[j]->dtype(), s);
    }
  }
  out.wi_0 = std::move(*result[0]);
  out.wi_1 = std::move(*result[1]);
  out.wo = std::move(*result[2]);
  if (result[3]) out.wi_0_bias = std::move(*result[3]);
  if (result[4]) out.wi_1_bias = std::move(*result[4]);
  if (result[5]) out.wo_bias = std::move(*result[5]);
  return out;
}

void moe_gate_grads(const DeviceTensor& d_logits, const DeviceTensor& x, const DeviceTensor& gk_d,
                    DeviceTensor& d_x_gate, DeviceTensor& gk_grad, Stream s) {
  require_rank(x.meta(), 2, "x");
  require_rank(gk_d.meta(), 2, "gk_d");
  const int64_t T = x.dim(0), H = x.dim(1), E = gk_d.dim(1);
  const DType d = x.dtype();
  require_tensor(d_logits, DType::f32, {T, E}, "d_logits");
  require_tensor(gk_d, d, {H, E}, "gk_d");
  require_tensor(d_x_gate, DType::f32, {T, H}, "d_x_gate");
  require_tensor(gk_grad, DType::f32, {H, E}, "gk_grad");
  if (T == 0) {
    zero(gk_grad, s);
    return;
  }
  const GroupPlan plan = one_group(T);
  if (d != DType::bf16) {
    const DeviceTensor x32 = cast(x, DType::f32, s), gk32 = cast(gk_d, DType::f32, s);
    gemm_detail::grouped_product(GemmRole::dgrad, plan, DType::f32, d_logits.data(), gk32.data(),
                                 DType::f32, d_x_gate.data(), H, E, false, s, GemmImpl::loop);
    gemm_detail::grouped_product(GemmRole::wgrad, plan, DType::f32, x32.data(), d_logits.data(),
                                 DType::f32, gk_grad.data(), H, E, false, s, GemmImpl::loop);
    return;
  }
  const int64_t n = T * E;
  DeviceTensor by_term(DType::bf16, {3, T, E}), by_row(DType::bf16, {T, 3 * E});
  DeviceTensor gk3(DType::bf16, {H, 3 * E});
  if (n > 0) {
    split_bf16x3_kernel<<<blocks_for(n), kThreads, 0, s>>>(
        d_logits.data<float>(), T, E, by_term.data<__nv_bfloat16>(), by_row.data<__nv_bfloat16>());
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  if (H * E > 0) {
    repeat3_cols_kernel<<<blocks_for(3 * H * E), kThreads, 0, s>>>(gk_d.data<__nv_bfloat16>(), H, E,
                                                                   gk3.data<__nv_bfloat16>());
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  // d_x_gate: one product over the 3E terms of each row (its [T, H] fp32 output written once).
  gemm_detail::grouped_product(GemmRole::dgrad, plan, DType::bf16, by_row.data(), gk3.data(),
                               DType::f32, d_x_gate.data(), H, 3 * E, false, s, GemmImpl::loop);
  // gk_grad: term by term into its small [H, E] output, the first overwriting.
  for (int t = 0; t < 3; ++t) {
    const void* term = by_term.data<__nv_bfloat16>() + t * n;
    gemm_detail::grouped_product(GemmRole::wgrad, plan, DType::bf16, x.data(), term, DType::f32,
                                 gk_grad.data(), H, E, t > 0, s, GemmImpl::loop);
  }
}

}  // namespace moe::gpu
