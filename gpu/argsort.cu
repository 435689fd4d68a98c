// CUDA twin of reference/argsort.cpp (SPEC §8). Kernel plan: see gpu/argsort.cuh.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "gpu/argsort.cuh"
#include "gpu/perm_detail.cuh"

namespace moe::gpu {

namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kSlotCap = 256;
constexpr unsigned kFull = 0xffffffffu;

unsigned warp_grid(int64_t items) {
  return grid_for(items, kThreads / 32, 32);
}
unsigned token_grid(int64_t T) {
  return grid_for(T, 1, 16);
}

// ---------------------------------------------------------------------------------------------
// routing_map_to_selected_experts

// One warp per token: experts ascending, 32 at a time; a ballot gives each routed lane its slot.
// A row with other than K set entries is a fault (reported unless the row had a bad value, so
// the value fault names the real problem).
__global__ void rm2se_fwd_kernel(const void* probs, int pcode, const void* map, int kind,
                                 long long T, long long E, long long K, int32_t* sel, void* w,
                                 void* err) {
  const int lane = threadIdx.x & 31;
  for (long long t = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; t < T;
       t += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    long long n = 0;
    bool bad = false;
    for (long long base = 0; base < E; base += 32) {
      const long long e = base + lane;
      const long long v = e < E ? load_int(map, kind, t * E + e) : 0;
      if (v != 0 && v != 1) {
        fault(err, PermFault::routing_map_value, t * E + e, v);
        bad = true;
      }
      const bool routed = v == 1;
      const unsigned m = __ballot_sync(kFull, routed);
      if (routed) {
        const long long k = n + __popc(m & ((1u << lane) - 1u));
        if (k < K) {
          sel[t * K + k] = static_cast<int32_t>(e);
          copy_elem(w, t * K + k, probs, t * E + e, pcode);
        }
      }
      n += __popc(m);
    }
    bad = __any_sync(kFull, bad);
    if (lane == 0 && n != K && !bad) fault(err, PermFault::routing_map_row_count, t, n);
  }
}

// One warp per token: the row is zeroed, the ids checked (range, repeats), then lane 0 writes
// ct_weights[t,k] at (t, sel[t,k]) in k order (a repeat keeps the last, as the reference).
__global__ void rm2se_bwd_kernel(const void* gw, int code, const void* sel, int kind, long long T,
                                 long long E, long long K, void* g, void* err) {
  const int lane = threadIdx.x & 31;
  for (long long t = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; t < T;
       t += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    for (long long e = lane; e < E; e += 32) zero_elem(g, t * E + e, code);
    for (long long k = lane; k < K; k += 32) {
      const long long e = load_int(sel, kind, t * K + k);
      if (e < 0 || e >= E) {
        fault(err, PermFault::expert_id_range, t * K + k, e);
        continue;
      }
      for (long long k2 = 0; k2 < k; ++k2) {
        if (load_int(sel, kind, t * K + k2) == e) {
          fault(err, PermFault::expert_id_duplicate, t, e);
          break;
        }
      }
    }
    __syncwarp();
    if (lane != 0) continue;
    for (long long k = 0; k < K; ++k) {
      const long long e = load_int(sel, kind, t * K + k);
      if (e >= 0 && e < E) copy_elem(g, t * E + e, gw, t * K + k, code);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// argsort_token_dispatch

// Column bitmap of the selected experts (bits pre-zeroed); checks ids for range and repeats
// within a row (a repeat finds its bit already set).
__global__ void sel_bits_kernel(const void* sel, int kind, long long T, long long E, long long K,
                                uint32_t* bits, void* err) {
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < T * K;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long t = i / K, e = load_int(sel, kind, i);
    if (e < 0 || e >= E) {
      fault(err, PermFault::expert_id_range, i, e);
      continue;
    }
    const uint32_t bit = 1u << (t & 31);
    if (atomicOr(bits + (t >> 5) * E + e, bit) & bit) {
      fault(err, PermFault::expert_id_duplicate, t, e);
    }
  }
}

// One CTA over the experts in tiles. Rolled key kappa holds expert e = (kappa + r) mod E:
//   need_e = (a - c_e mod a) mod a, group_sizes[kappa] = c_e + need_e,
//   estart[e] = sum_{kappa' < kappa} group_sizes[kappa'] (the overflow placeholders all sit in
//   the last group, so they shift no start), ovf_before[e] = sum_{e' < e} (a - 1 - need_e').
__global__ void __launch_bounds__(1024)
    argsort_layout_kernel(const long long* count, long long E, long long a, long long r,
                          long long* estart, long long* need, long long* ovf_before,
                          int32_t* group_sizes) {
  using Scan = cub::BlockScan<long long, 1024>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ long long carry[2];
  if (threadIdx.x == 0) carry[0] = carry[1] = 0;
  __syncthreads();
  for (long long base = 0; base < E; base += 1024) {
    const long long i = base + threadIdx.x;
    const long long e = i < E ? (i + r) % E : 0;  // expert of rolled key i
    const long long ne = i < E && a > 0 ? (a - count[e] % a) % a : 0;
    const long long g = i < E ? count[e] + ne : 0;
    // Placeholders of owner i (keyed by expert id, not rolled: rolling with a > 0 is refused).
    const long long ni = i < E && a > 0 ? (a - count[i] % a) % a : 0;
    const long long ov = i < E && a > 0 ? a - 1 - ni : 0;
    long long st, tot_g, ob, tot_o;
    Scan(tmp).ExclusiveSum(g, st, tot_g);
    __syncthreads();
    Scan(tmp).ExclusiveSum(ov, ob, tot_o);
    __syncthreads();
    if (i < E) {
      estart[e] = carry[0] + st;
      group_sizes[i] = static_cast<int32_t>(g);
      need[i] = ni;
      ovf_before[i] = carry[1] + ob;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry[0] += tot_g;
      carry[1] += tot_o;
    }
    __syncthreads();
  }
}

// One CTA per token: item (t,k) of expert e goes to estart[e] + rank(t,e); x[t] is read once and
// written to its K rows; sorted_indices[pos] = t*K + k.
template <int VB>
__global__ void __launch_bounds__(kThreads)
    argsort_real_kernel(const uint8_t* x, const void* sel, int kind, const uint32_t* bits,
                        const int32_t* woff, const long long* estart, long long T, long long E,
                        long long K, long long rows, long long row_bytes, uint8_t* out,
                        int32_t* sorted_indices) {
  __shared__ long long s_pos[kSlotCap];
  using V = VecT<VB>;
  constexpr int U = 4;
  const long long nvec = row_bytes / VB;
  auto position = [&](long long t, long long k) -> long long {
    const long long e = load_int(sel, kind, t * K + k);
    if (e < 0 || e >= E) return -1;
    bool routed;
    const long long pos = estart[e] + column_rank(bits, woff, E, t, e, &routed);
    return pos < rows ? pos : -1;
  };
  for (long long t = blockIdx.x; t < T; t += gridDim.x) {
    for (long long k = threadIdx.x; k < K; k += blockDim.x) {
      const long long pos = position(t, k);
      if (pos >= 0) sorted_indices[pos] = static_cast<int32_t>(t * K + k);
      if (k < kSlotCap) s_pos[k] = pos;
    }
    __syncthreads();
    const V* src = reinterpret_cast<const V*>(x + t * row_bytes);
    for (long long b = threadIdx.x; b < nvec; b += static_cast<long long>(blockDim.x) * U) {
      V v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long i = b + static_cast<long long>(u) * blockDim.x;
        if (i < nvec) v[u] = src[i];
      }
      for (long long k = 0; k < K; ++k) {
        const long long pos = k < kSlotCap ? s_pos[k] : position(t, k);
        if (pos < 0) continue;
        V* dst = reinterpret_cast<V*>(out + pos * row_bytes);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long i = b + static_cast<long long>(u) * blockDim.x;
          if (i < nvec) dst[i] = v[u];
        }
      }
    }
    __syncthreads();
  }
}

// One warp per padding position N + q (owner e = q/(a-1), offset o = q%(a-1)): a zero row and
// sorted_indices[pos] = N + q, pos as in gpu/argsort.cuh.
template <int VB>
__global__ void argsort_pad_kernel(const long long* count, const long long* estart,
                                   const long long* need, const long long* ovf_before, long long E,
                                   long long a, long long N, long long P_pad, long long rows,
                                   long long row_bytes, uint8_t* out, int32_t* sorted_indices) {
  const int lane = threadIdx.x & 31;
  for (long long q = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       q < P_pad; q += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    const long long e = q / (a - 1), o = q % (a - 1);
    long long pos;
    const long long last = estart[E - 1] + count[E - 1];
    if (e == E - 1) {
      pos = last + ovf_before[E - 1] + o;  // every slot of the last owner is keyed E-1
    } else if (o < need[e]) {
      pos = estart[e] + count[e] + o;
    } else {
      pos = last + ovf_before[e] + (o - need[e]);  // overflow placeholder, key E-1
    }
    if (pos < 0 || pos >= rows) continue;
    if (lane == 0) sorted_indices[pos] = static_cast<int32_t>(N + q);
    move_row<VB>(out + pos * row_bytes, nullptr, row_bytes / VB, lane, 32);
  }
}

// ---------------------------------------------------------------------------------------------
// Gathers through inv (argsort dispatch backward, argsort combine forward)

// One CTA per token: out[t] = rnd(sum_{k<K} w_k * f32(src[inv[t*K+k]])), k ascending; w_k =
// rnd_T(weights[t,k]) (TE rounds the weights to the activation dtype first) or 1.
template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    argsort_gather_kernel(const T* src, const int32_t* inv, const void* wts, int wcode, T* out,
                          long long Tn, long long K, long long H) {
  using VT = Vec<T, N>;
  constexpr int U = 4;
  const long long nvec = H / N;
  for (long long t = blockIdx.x; t < Tn; t += gridDim.x) {
    VT* dst = reinterpret_cast<VT*>(out + t * H);
    for (long long b = threadIdx.x; b < nvec; b += static_cast<long long>(blockDim.x) * U) {
      float acc[U][N];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) acc[u][j] = 0.0f;
      for (long long k = 0; k < K; ++k) {
        const long long row = inv[t * K + k];
        if (row < 0) continue;  // not a permutation: already a fault
        const float w = wts ? to_f32(from_f32<T>(load_f(wts, wcode, t * K + k))) : 1.0f;
        const VT* r = reinterpret_cast<const VT*>(src + row * H);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long i = b + static_cast<long long>(u) * blockDim.x;
          if (i < nvec) {
            const VT v = r[i];
#pragma unroll
            for (int j = 0; j < N; ++j) acc[u][j] += to_f32(v.v[j]) * w;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long i = b + static_cast<long long>(u) * blockDim.x;
        if (i < nvec) {
          VT v;
#pragma unroll
          for (int j = 0; j < N; ++j) v.v[j] = from_f32<T>(acc[u][j]);
          dst[i] = v;
        }
      }
    }
  }
}

// Combine backward, one CTA per token, k ascending:
//   ge[inv[t*K+k]] = rnd(f32(ct[t]) * rnd_T(w[t,k])),  gw[t,k] = rnd_p(sum_h f32(ct[t,h]) *
//   f32(eo[inv[t*K+k],h])) with a fixed-shape block reduction (deterministic).
template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    argsort_combine_bwd_kernel(const T* ct, const T* eo, const int32_t* inv, const void* wts,
                               int wcode, T* ge, void* gw, long long Tn, long long K, long long H) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  using VT = Vec<T, N>;
  const long long nvec = H / N;
  for (long long t = blockIdx.x; t < Tn; t += gridDim.x) {
    const VT* c = reinterpret_cast<const VT*>(ct + t * H);
    for (long long k = 0; k < K; ++k) {
      const long long row = inv[t * K + k];
      const float w = to_f32(from_f32<T>(load_f(wts, wcode, t * K + k)));
      float part = 0.0f;
      if (row >= 0) {
        const VT* x = reinterpret_cast<const VT*>(eo + row * H);
        VT* dst = reinterpret_cast<VT*>(ge + row * H);
#pragma unroll 4
        for (long long i = threadIdx.x; i < nvec; i += blockDim.x) {
          const VT cv = c[i];
          const VT xv = x[i];
          VT g;
#pragma unroll
          for (int j = 0; j < N; ++j) {
            const float cf = to_f32(cv.v[j]);
            g.v[j] = from_f32<T>(cf * w);
            part += cf * to_f32(xv.v[j]);
          }
          dst[i] = g;
        }
      }
      const float dot = Reduce(tmp).Sum(part);
      if (threadIdx.x == 0) store_f(gw, wcode, t * K + k, dot);
      __syncthreads();
    }
  }
}

// Rows whose sorted index is a padding position (>= N), or invalid, are zero. Warp per row.
template <int VB>
__global__ void argsort_zero_pad_kernel(uint8_t* out, const void* si, int kind, long long rows,
                                        long long N, long long row_bytes) {
  const int lane = threadIdx.x & 31;
  for (long long j = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; j < rows;
       j += (static_cast<long long>(gridDim.x) * blockDim.x) >> 5) {
    const long long v = load_int(si, kind, j);
    if (v >= 0 && v < N) continue;
    move_row<VB>(out + j * row_bytes, nullptr, row_bytes / VB, lane, 32);
  }
}

void check_same_dtype(const DeviceTensor& a, const DeviceTensor& b, const char* a_name,
                      const char* b_name) {
  if (a.dtype() != b.dtype()) {
    throw std::invalid_argument(
        std::string(a_name) + ": dtype " + std::string(dtype_name(a.dtype())) + " must equal " +
        b_name + "'s dtype " + std::string(dtype_name(b.dtype())) + " on the CUDA path");
  }
}

// inv[i] = position of i in sorted_indices (-1 where absent), checking the permutation.
void inverse_of(const DeviceTensor& sorted_indices, int32_t* inv, void* err, Stream s) {
  Scratch<int32_t> gate(1, s);
  gate.fill_bytes(0);
  check_permutation(sorted_indices.data(), int_kind(sorted_indices.dtype()), sorted_indices.dim(0),
                    PermFault::argsort_indices_perm, err, gate.get(), inv, s);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

RoutingMapToSelectedExpertsFwd routing_map_to_selected_experts_fwd(const DeviceTensor& sparse_probs,
                                                                   const DeviceTensor& routing_map,
                                                                   int64_t topk, Stream s,
                                                                   const RunOptions& o) {
  validate_routing_map_to_selected_experts(sparse_probs.meta(), routing_map.meta(), topk);
  const int64_t T = sparse_probs.dim(0), E = sparse_probs.dim(1);
  RoutingMapToSelectedExpertsFwd out;
  out.selected_experts = DeviceTensor(DType::i32, {T, topk});
  out.weights = DeviceTensor(sparse_probs.dtype(), {T, topk});
  if (o.poison) {
    poison(out.selected_experts, s);
    poison(out.weights, s);
  }
  if (T == 0) return out;
  with_validation(o.validate, s, [&](void* err) {
    rm2se_fwd_kernel<<<warp_grid(T), kThreads, 0, s>>>(
        sparse_probs.data(), fcode(sparse_probs.dtype()), routing_map.data(),
        static_cast<int>(int_kind(routing_map.dtype())), T, E, topk,
        out.selected_experts.data<int32_t>(), out.weights.data(), err);
    check_launch("rm2se_fwd_kernel");
  });
  return out;
}

DeviceTensor routing_map_to_selected_experts_bwd(const DeviceTensor& grad_weights,
                                                 const DeviceTensor& selected_experts,
                                                 int64_t num_experts, Stream s,
                                                 const RunOptions& o) {
  validate_routing_map_to_selected_experts_bwd(grad_weights.meta(), selected_experts.meta(),
                                               num_experts);
  const int64_t T = grad_weights.dim(0), K = grad_weights.dim(1);
  DeviceTensor g(grad_weights.dtype(), {T, num_experts});
  if (o.poison) poison(g, s);
  if (T == 0) return g;
  with_validation(o.validate, s, [&](void* err) {
    rm2se_bwd_kernel<<<warp_grid(T), kThreads, 0, s>>>(
        grad_weights.data(), fcode(grad_weights.dtype()), selected_experts.data(),
        static_cast<int>(int_kind(selected_experts.dtype())), T, num_experts, K, g.data(), err);
    check_launch("rm2se_bwd_kernel");
  });
  return g;
}

ArgsortTokenDispatchFwd argsort_token_dispatch_fwd(const DeviceTensor& x,
                                                   const DeviceTensor& selected_experts,
                                                   const ArgsortDispatchParams& p, Stream s,
                                                   const RunOptions& o) {
  const ArgsortPermParams st =
      validate_argsort_token_dispatch(x.meta(), selected_experts.meta(), p);
  const int64_t E = p.num_experts, K = p.topk, a = p.align_size,
                r = p.roll_to_expert_id.value_or(0);
  const int64_t T = x.dim(0), H = x.dim(1), N = st.num_real_tokens, P_pad = st.padding_size;
  const int64_t rows = N + P_pad;
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(x.dtype()));
  ArgsortTokenDispatchFwd out;
  out.state = st;
  out.sorted_x = DeviceTensor(x.dtype(), {rows, H});
  out.sorted_indices = DeviceTensor(DType::i32, {rows});
  out.group_sizes = DeviceTensor(DType::i32, {E});
  if (o.poison) {
    poison(out.sorted_x, s);
    poison(out.sorted_indices, s);
    poison(out.group_sizes, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    const int64_t words = ceil_div(T, 32);
    Scratch<uint32_t> bits(words * E, s);
    Scratch<int32_t> woff(words * E, s);
    Scratch<long long> count(E, s), estart(E, s), need(E, s), ovf(E, s);
    const int kind = static_cast<int>(int_kind(selected_experts.dtype()));
    if (T == 0) {
      count.fill_bytes(0);
    } else {
      bits.fill_bytes(0);
      sel_bits_kernel<<<grid_for(T * K, kThreads), kThreads, 0, s>>>(selected_experts.data(), kind,
                                                                     T, E, K, bits.get(), err);
      check_launch("sel_bits_kernel");
      detail::column_ranks(bits.get(), words, E, woff.get(),
                           reinterpret_cast<int64_t*>(count.get()), s);
    }
    argsort_layout_kernel<<<1, 1024, 0, s>>>(count.get(), E, a, r, estart.get(), need.get(),
                                             ovf.get(), out.group_sizes.data<int32_t>());
    check_launch("argsort_layout_kernel");
    const int vb = vec_bytes(row_bytes, {x.data(), out.sorted_x.data()});
    dispatch_vec(vb, [&](auto v) {
      constexpr int VB = decltype(v)::value;
      if (T > 0) {
        argsort_real_kernel<VB><<<token_grid(T), kThreads, 0, s>>>(
            static_cast<const uint8_t*>(x.data()), selected_experts.data(), kind, bits.get(),
            woff.get(), estart.get(), T, E, K, rows, row_bytes,
            static_cast<uint8_t*>(out.sorted_x.data()), out.sorted_indices.data<int32_t>());
        check_launch("argsort_real_kernel");
      }
      if (P_pad > 0) {
        argsort_pad_kernel<VB><<<warp_grid(P_pad), kThreads, 0, s>>>(
            count.get(), estart.get(), need.get(), ovf.get(), E, a, N, P_pad, rows, row_bytes,
            static_cast<uint8_t*>(out.sorted_x.data()), out.sorted_indices.data<int32_t>());
        check_launch("argsort_pad_kernel");
      }
    });
  });
  return out;
}

DeviceTensor argsort_token_dispatch_bwd(const DeviceTensor& grad_sorted_x,
                                        const DeviceTensor& sorted_indices,
                                        const ArgsortPermParams& p, Stream s, const RunOptions& o) {
  validate_argsort_token_dispatch_bwd(grad_sorted_x.meta(), sorted_indices.meta(), p);
  const int64_t K = p.topk, T = p.num_real_tokens / K, H = grad_sorted_x.dim(1);
  DeviceTensor gx(grad_sorted_x.dtype(), {T, H});
  if (o.poison) poison(gx, s);
  with_validation(o.validate, s, [&](void* err) {
    Scratch<int32_t> inv(sorted_indices.dim(0), s);
    inverse_of(sorted_indices, inv.get(), err, s);
    if (T == 0 || H == 0) return;
    dispatch_typed(
        grad_sorted_x.dtype(), H, {grad_sorted_x.data(), gx.data()}, [&](auto tag, auto n) {
          using T_ = decltype(tag);
          argsort_gather_kernel<T_, decltype(n)::value><<<token_grid(T), kThreads, 0, s>>>(
              grad_sorted_x.data<T_>(), inv.get(), nullptr, 0, gx.data<T_>(), T, K, H);
          check_launch("argsort_gather_kernel");
        });
  });
  return gx;
}

DeviceTensor argsort_token_combine_fwd(const DeviceTensor& expert_outputs,
                                       const DeviceTensor& sorted_indices,
                                       const DeviceTensor& weights, const ArgsortPermParams& p,
                                       Stream s, const RunOptions& o) {
  validate_argsort_token_combine(expert_outputs.meta(), sorted_indices.meta(), weights.meta(), p);
  const int64_t K = p.topk, T = p.num_real_tokens / K, H = expert_outputs.dim(1);
  DeviceTensor y(expert_outputs.dtype(), {T, H});
  if (o.poison) poison(y, s);
  with_validation(o.validate, s, [&](void* err) {
    Scratch<int32_t> inv(sorted_indices.dim(0), s);
    inverse_of(sorted_indices, inv.get(), err, s);
    if (T == 0 || H == 0) return;
    dispatch_typed(
        expert_outputs.dtype(), H, {expert_outputs.data(), y.data()}, [&](auto tag, auto n) {
          using T_ = decltype(tag);
          argsort_gather_kernel<T_, decltype(n)::value><<<token_grid(T), kThreads, 0, s>>>(
              expert_outputs.data<T_>(), inv.get(), weights.data(), fcode(weights.dtype()),
              y.data<T_>(), T, K, H);
          check_launch("argsort_gather_kernel");
        });
  });
  return y;
}

ArgsortTokenCombineBwd argsort_token_combine_bwd(const DeviceTensor& grad_combined,
                                                 const DeviceTensor& expert_outputs,
                                                 const DeviceTensor& sorted_indices,
                                                 const DeviceTensor& weights,
                                                 const ArgsortPermParams& p, Stream s,
                                                 const RunOptions& o) {
  validate_argsort_token_combine_bwd(grad_combined.meta(), expert_outputs.meta(),
                                     sorted_indices.meta(), weights.meta(), p);
  check_same_dtype(grad_combined, expert_outputs, "grad_combined", "expert_outputs");
  const int64_t K = p.topk, N = p.num_real_tokens, T = N / K, H = expert_outputs.dim(1);
  const int64_t rows = N + p.padding_size;
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(grad_combined.dtype()));
  ArgsortTokenCombineBwd out;
  out.grad_expert_outputs = DeviceTensor(grad_combined.dtype(), {rows, H});
  out.grad_weights = DeviceTensor(weights.dtype(), {T, K});
  if (o.poison) {
    poison(out.grad_expert_outputs, s);
    poison(out.grad_weights, s);
  }
  with_validation(o.validate, s, [&](void* err) {
    Scratch<int32_t> inv(rows, s);
    inverse_of(sorted_indices, inv.get(), err, s);
    if (T > 0) {
      dispatch_typed(
          grad_combined.dtype(), H,
          {grad_combined.data(), expert_outputs.data(), out.grad_expert_outputs.data()},
          [&](auto tag, auto n) {
            using T_ = decltype(tag);
            argsort_combine_bwd_kernel<T_, decltype(n)::value><<<token_grid(T), kThreads, 0, s>>>(
                grad_combined.data<T_>(), expert_outputs.data<T_>(), inv.get(), weights.data(),
                fcode(weights.dtype()), out.grad_expert_outputs.data<T_>(), out.grad_weights.data(),
                T, K, H);
            check_launch("argsort_combine_bwd_kernel");
          });
    }
    if (rows > 0 && row_bytes > 0) {
      const int vb = vec_bytes(row_bytes, {out.grad_expert_outputs.data()});
      dispatch_vec(vb, [&](auto v) {
        constexpr int VB = decltype(v)::value;
        argsort_zero_pad_kernel<VB><<<warp_grid(rows), kThreads, 0, s>>>(
            static_cast<uint8_t*>(out.grad_expert_outputs.data()), sorted_indices.data(),
            static_cast<int>(int_kind(sorted_indices.dtype())), rows, N, row_bytes);
        check_launch("argsort_zero_pad_kernel");
      });
    }
  });
  return out;
}

}  // namespace moe::gpu
