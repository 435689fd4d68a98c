// CUDA twin of reference/aux_loss.cpp: aux_loss_scores (SPEC §2) and moe_aux_loss (SPEC §3).
#include "gpu/aux_loss.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "gpu/router_row.cuh"

namespace moe::gpu {

namespace {

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

void require_out(const DeviceTensor& t, DType dt, const Shape& shape, const char* what) {
  if (t.dtype() != dt || t.shape() != shape) {
    bad(std::string(what) + ": expected " + std::string(dtype_name(dt)) + shape_str(shape) +
        ", got " + t.describe());
  }
}

int score_fn_code(ScoreFunction f) {
  return f == ScoreFunction::softmax
             ? rowk::kSoftmax
             : (f == ScoreFunction::sigmoid ? rowk::kSigmoid : rowk::kSqrtSoftplus);
}

void check_logits_dtype(DType d, const char* what) {
  if (!(d == DType::f32 || d == DType::bf16 || d == DType::f16)) {
    bad(std::string(what) + ": unsupported dtype " + std::string(dtype_name(d)));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// aux_loss_scores

AuxLossScoresFwd aux_loss_scores_fwd_outputs(const TensorMeta& logits, MapFormat fmt) {
  require_rank(logits, 2, "logits");
  const int64_t T = logits.dim(0), E = logits.dim(1);
  return AuxLossScoresFwd{DeviceTensor(DType::f32, {T, E}),
                          DeviceTensor(fmt == MapFormat::bytemap ? DType::boolean : DType::u8,
                                       routing_map_shape(T, E, fmt)),
                          DeviceTensor(DType::f32, {T, E})};
}

void aux_loss_scores_fwd_into(const DeviceTensor& logits, int64_t topk, ScoreFunction f,
                              MapFormat fmt, AuxLossScoresFwd& out, Stream s) {
  validate_aux_loss_scores(logits.meta(), topk);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  // Scores are f32 whatever the logits' dtype (R10): sized from the schema, never the input.
  require_out(out.scores, DType::f32, {T, E}, "scores");
  require_out(out.routing_map, fmt == MapFormat::bytemap ? DType::boolean : DType::u8,
              routing_map_shape(T, E, fmt), "routing_map");
  require_out(out.saved_scores, DType::f32, {T, E}, "saved_scores");
  if (T == 0) return;
  rowk::FwdArgs a;
  a.logits = logits.data();
  a.scores = out.scores.data<float>();
  a.map = out.routing_map.data<uint8_t>();
  a.saved = out.saved_scores.data<float>();
  a.T = T;
  a.E = static_cast<int>(E);
  a.K = static_cast<int>(topk);
  a.fn = score_fn_code(f);
  a.bitmap = fmt == MapFormat::bitmap_u8 ? 1 : 0;
  a.vec = (E % 8 == 0 && aligned16(a.logits) && aligned16(a.scores) && aligned16(a.map) &&
           aligned16(a.saved))
              ? 1
              : 0;
  dispatch_float(logits.dtype(), [&](auto tag) {
    rowk::launch_fwd<decltype(tag), true>(a, reinterpret_cast<cudaStream_t>(s));
  });
}

AuxLossScoresFwd aux_loss_scores_fwd(const DeviceTensor& logits, int64_t topk, ScoreFunction f,
                                     MapFormat fmt, Stream s) {
  validate_aux_loss_scores(logits.meta(), topk);
  AuxLossScoresFwd out = aux_loss_scores_fwd_outputs(logits.meta(), fmt);
  aux_loss_scores_fwd_into(logits, topk, f, fmt, out, s);
  return out;
}

namespace {
void validate_scores_bwd(const DeviceTensor& grad_scores, const DeviceTensor& saved_scores,
                         DType logits_dtype) {
  require_rank(grad_scores.meta(), 2, "grad_scores");
  if (grad_scores.dtype() != DType::f32) {
    bad("grad_scores: must be float32, got " + grad_scores.describe());
  }
  const int64_t T = grad_scores.dim(0), E = grad_scores.dim(1);
  require_shape(saved_scores.meta(), {T, E}, "saved_scores");
  if (saved_scores.dtype() != DType::f32) {
    bad("saved_scores: must be float32, got " + saved_scores.describe());
  }
  check_logits_dtype(logits_dtype, "logits_dtype");
  if (E > kMaxExperts) {
    bad("num_experts: " + std::to_string(E) + " exceeds the supported maximum " +
        std::to_string(kMaxExperts));
  }
}
}  // namespace

void aux_loss_scores_bwd_into(const DeviceTensor& grad_scores, const DeviceTensor& saved_scores,
                              ScoreFunction f, DType logits_dtype, DeviceTensor& grad_logits,
                              Stream s) {
  validate_scores_bwd(grad_scores, saved_scores, logits_dtype);
  const int64_t T = grad_scores.dim(0), E = grad_scores.dim(1);
  require_out(grad_logits, logits_dtype, {T, E}, "grad_logits");
  if (T == 0 || E == 0) return;
  rowk::BwdArgs a;
  a.grad = grad_scores.data();
  a.saved = saved_scores.data<float>();
  a.out = grad_logits.data();
  a.T = T;
  a.E = static_cast<int>(E);
  a.K = static_cast<int>(E);
  a.fn = score_fn_code(f);
  a.pre = 1;
  a.aux = 1;
  a.scaling = 1.0f;
  a.vec = (E % 8 == 0 && aligned16(a.grad) && aligned16(a.saved) && aligned16(a.out)) ? 1 : 0;
  dispatch_float(logits_dtype, [&](auto tag) {
    rowk::launch_bwd<float, decltype(tag)>(a, reinterpret_cast<cudaStream_t>(s));
  });
}

DeviceTensor aux_loss_scores_bwd(const DeviceTensor& grad_scores, const DeviceTensor& saved_scores,
                                 ScoreFunction f, DType logits_dtype, Stream s) {
  validate_scores_bwd(grad_scores, saved_scores, logits_dtype);
  DeviceTensor grad(logits_dtype, grad_scores.shape());
  aux_loss_scores_bwd_into(grad_scores, saved_scores, f, logits_dtype, grad, s);
  return grad;
}

// ---------------------------------------------------------------------------------------------
// moe_aux_loss

namespace {

constexpr int kChunkRows = 256;  // rows per partial column sum (fixed: the order is part of the op)
constexpr int kTileCols = 32;
constexpr int kRowLanes = 8;  // 256 threads = 8 row lanes x 32 columns

__device__ __forceinline__ float load_tpe(const void* p, int dtype, int64_t i) {
  switch (static_cast<DType>(dtype)) {
    case DType::i32:
      return static_cast<float>(static_cast<const int32_t*>(p)[i]);
    case DType::i64:
      return static_cast<float>(static_cast<const long long*>(p)[i]);
    case DType::bf16:
      return to_f32(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// partial[chunk, c] = sum of probs[r, c] over the chunk's rows: row lane y adds rows y, y+8, ...
// in order, then lane 0 adds the 8 lane sums in order.
template <class T>
__global__ void __launch_bounds__(256)
    colsum_partial(const T* __restrict__ probs, int64_t R, int64_t C, float* __restrict__ partial) {
  __shared__ float part[kRowLanes][kTileCols + 1];
  const int tx = static_cast<int>(threadIdx.x) % kTileCols,
            ty = static_cast<int>(threadIdx.x) / kTileCols;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kTileCols + tx;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kChunkRows;
  const int64_t r1 = R < r0 + kChunkRows ? R : r0 + kChunkRows;
  float acc = 0.0f;
  if (col < C) {
    for (int64_t r = r0 + ty; r < r1; r += kRowLanes) acc = acc + to_f32(probs[r * C + col]);
  }
  part[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < C) {
    float s = part[0][tx];
#pragma unroll
    for (int y = 1; y < kRowLanes; ++y) s = s + part[y][tx];
    partial[static_cast<int64_t>(blockIdx.x) * C + col] = s;
  }
}

// terms[c] = f32(tpe_c) * (sum over chunks of partial[chunk, c]), chunks summed like rows above.
__global__ void __launch_bounds__(256)
    colsum_final(const float* __restrict__ partial, int64_t nchunks, int64_t C, const void* tpe,
                 int tpe_dtype, float* __restrict__ terms) {
  __shared__ float part[kRowLanes][kTileCols + 1];
  const int tx = static_cast<int>(threadIdx.x) % kTileCols,
            ty = static_cast<int>(threadIdx.x) / kTileCols;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + tx;
  float acc = 0.0f;
  if (col < C) {
    for (int64_t b = ty; b < nchunks; b += kRowLanes) acc = acc + partial[b * C + col];
  }
  part[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < C) {
    float s = part[0][tx];
#pragma unroll
    for (int y = 1; y < kRowLanes; ++y) s = s + part[y][tx];
    terms[col] = load_tpe(tpe, tpe_dtype, col) * s;
  }
}

// loss_f32 = kappa * sum_c terms[c]: thread i adds terms i, i+256, ..., then a fixed tree.
template <class T>
__global__ void __launch_bounds__(256)
    aux_loss_finalize(const float* __restrict__ terms, int64_t C, float kappa, T* __restrict__ loss,
                      float* __restrict__ const_buf) {
  __shared__ float part[256];
  const int tid = static_cast<int>(threadIdx.x);
  float acc = 0.0f;
  for (int64_t c = tid; c < C; c += 256) acc = acc + terms[c];
  part[tid] = acc;
  __syncthreads();
  for (int s = 128; s > 0; s /= 2) {
    if (tid < s) part[tid] = part[tid] + part[tid + s];
    __syncthreads();
  }
  if (tid == 0) {
    const float l = kappa * part[0];
    const_buf[0] = kappa;
    const_buf[1] = l;
    *loss = from_f32<T>(l);
  }
}

// grad[r, c] = rnd(fl(kappa * f32(tpe_c)) * f32(g)); 8 consecutive elements per thread.
template <class T>
__global__ void __launch_bounds__(256)
    aux_loss_bwd_kernel(const T* __restrict__ g, const float* __restrict__ const_buf,
                        const void* tpe, int tpe_dtype, int64_t R, int64_t C, int vec,
                        T* __restrict__ out) {
  const float kappa = const_buf[0];
  const float gv = to_f32(*g);
  const int64_t n = R * C;
  for (int64_t i0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i0 < n;
       i0 += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
    float v[8];
    const int cnt = n - i0 < 8 ? static_cast<int>(n - i0) : 8;
    int64_t c = i0 % C;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = i < cnt ? (kappa * load_tpe(tpe, tpe_dtype, c)) * gv : 0.0f;
      c = c + 1 == C ? 0 : c + 1;
    }
    rowk::store8(out + i0, vec != 0 && cnt == 8, cnt, v);
  }
}

void check_tpe_dtype(DType d) {
  if (!(d == DType::i32 || d == DType::i64 || d == DType::f32 || d == DType::bf16)) {
    bad("tokens_per_expert: unsupported dtype " + std::string(dtype_name(d)));
  }
}

}  // namespace

MoeAuxLossFwd moe_aux_loss_fwd_outputs(const TensorMeta& probs) {
  return MoeAuxLossFwd{DeviceTensor(probs.dtype, {}), DeviceTensor(DType::f32, {2})};
}

void moe_aux_loss_fwd_into(const DeviceTensor& probs, const DeviceTensor& tokens_per_expert,
                           const AuxLossParams& params, MoeAuxLossFwd& out, Stream s) {
  const AuxLossParams p = validate_moe_aux_loss(probs.meta(), tokens_per_expert.meta(), params);
  check_tpe_dtype(tokens_per_expert.dtype());
  require_out(out.aux_loss, probs.dtype(), {}, "aux_loss");
  require_out(out.const_buf, DType::f32, {2}, "const_buf");
  const int64_t R = probs.dim(0), C = probs.dim(1);
  const int64_t ntiles = (C + kTileCols - 1) / kTileCols;
  if (ntiles > 65535) bad("probs: " + std::to_string(C) + " columns exceed the supported 2097120");
  // kappa = fl(fl(fl(fl(E * coeff) / K) / T_tot) / T_tot) in fp32, in this order (SPEC §3).
  float kappa = static_cast<float>(p.num_experts) * static_cast<float>(p.coeff);
  kappa = kappa / static_cast<float>(p.topk);
  kappa = kappa / static_cast<float>(p.total_num_tokens);
  kappa = kappa / static_cast<float>(p.total_num_tokens);

  auto st = reinterpret_cast<cudaStream_t>(s);
  const int64_t nchunks = (R + kChunkRows - 1) / kChunkRows;
  float* work = nullptr;
  work = static_cast<float*>(malloc_async(static_cast<size_t>(nchunks * C + C) * sizeof(float), s));
  float* partial = work;
  float* terms = work + nchunks * C;
  dispatch_float(probs.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (nchunks > 0) {
      colsum_partial<T>
          <<<dim3(static_cast<unsigned>(nchunks), static_cast<unsigned>(ntiles)), 256, 0, st>>>(
              probs.data<T>(), R, C, partial);
      MOE_CUDA_CHECK(cudaGetLastError());
    }
    colsum_final<<<static_cast<unsigned>(ntiles), 256, 0, st>>>(
        partial, nchunks, C, tokens_per_expert.data(), static_cast<int>(tokens_per_expert.dtype()),
        terms);
    MOE_CUDA_CHECK(cudaGetLastError());
    aux_loss_finalize<T>
        <<<1, 256, 0, st>>>(terms, C, kappa, out.aux_loss.data<T>(), out.const_buf.data<float>());
    MOE_CUDA_CHECK(cudaGetLastError());
  });
  MOE_CUDA_CHECK(cudaFreeAsync(work, st));
}

MoeAuxLossFwd moe_aux_loss_fwd(const DeviceTensor& probs, const DeviceTensor& tokens_per_expert,
                               const AuxLossParams& p, Stream s) {
  validate_moe_aux_loss(probs.meta(), tokens_per_expert.meta(), p);
  MoeAuxLossFwd out = moe_aux_loss_fwd_outputs(probs.meta());
  moe_aux_loss_fwd_into(probs, tokens_per_expert, p, out, s);
  return out;
}

namespace {
void validate_loss_bwd(const DeviceTensor& grad_aux_loss, const DeviceTensor& const_buf,
                       const DeviceTensor& tokens_per_expert, int64_t num_rows) {
  check_logits_dtype(grad_aux_loss.dtype(), "grad_aux_loss");
  require_shape(grad_aux_loss.meta(), {}, "grad_aux_loss");
  require_shape(const_buf.meta(), {2}, "const_buf");
  if (const_buf.dtype() != DType::f32)
    bad("const_buf: must be float32, got " + const_buf.describe());
  require_rank(tokens_per_expert.meta(), 1, "tokens_per_expert");
  check_tpe_dtype(tokens_per_expert.dtype());
  if (num_rows < 0) bad("num_rows: must be >= 0, got " + std::to_string(num_rows));
}
}  // namespace

void moe_aux_loss_bwd_into(const DeviceTensor& grad_aux_loss, const DeviceTensor& const_buf,
                           const DeviceTensor& tokens_per_expert, int64_t num_rows,
                           DeviceTensor& grad_probs, Stream s) {
  validate_loss_bwd(grad_aux_loss, const_buf, tokens_per_expert, num_rows);
  const int64_t C = tokens_per_expert.dim(0);
  require_out(grad_probs, grad_aux_loss.dtype(), {num_rows, C}, "grad_probs");
  const int64_t n = num_rows * C;
  if (n == 0) return;
  auto st = reinterpret_cast<cudaStream_t>(s);
  const int64_t blocks = std::min<int64_t>((n + 8 * 256 - 1) / (8 * 256), 132 * 64);
  const int vec = aligned16(grad_probs.data()) ? 1 : 0;
  dispatch_float(grad_aux_loss.dtype(), [&](auto tag) {
    using T = decltype(tag);
    aux_loss_bwd_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, st>>>(
        grad_aux_loss.data<T>(), const_buf.data<float>(), tokens_per_expert.data(),
        static_cast<int>(tokens_per_expert.dtype()), num_rows, C, vec, grad_probs.data<T>());
    MOE_CUDA_CHECK(cudaGetLastError());
  });
}

DeviceTensor moe_aux_loss_bwd(const DeviceTensor& grad_aux_loss, const DeviceTensor& const_buf,
                              const DeviceTensor& tokens_per_expert, int64_t num_rows, Stream s) {
  validate_loss_bwd(grad_aux_loss, const_buf, tokens_per_expert, num_rows);
  DeviceTensor grad(grad_aux_loss.dtype(), {num_rows, tokens_per_expert.dim(0)});
  moe_aux_loss_bwd_into(grad_aux_loss, const_buf, tokens_per_expert, num_rows, grad, s);
  return grad;
}

}  // namespace moe::gpu
