// CUDA twin of reference/swiglu_ffn.cpp: swiglu_expert_ffn (SPEC §10.2). Plan:
// gpu/swiglu_ffn.cuh.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "gpu/device_util.cuh"
#include "gpu/swiglu_ffn.cuh"
#include "gpu/timeline.cuh"

namespace moe::gpu {

namespace {

using gemm_detail::DevicePlan;
using gemm_detail::Scratch;

constexpr int kThreads = 256;

// Float dtype codes for values read through load_f32 (biases of any float dtype).
int float_kind(DType d) {
  switch (d) {
    case DType::f32:
      return 0;
    case DType::bf16:
      return 1;
    case DType::f16:
      return 2;
    default:
      break;
  }
  throw std::invalid_argument("swiglu_expert_ffn: unsupported bias dtype " +
                              std::string(dtype_name(d)));
}

__device__ __forceinline__ float load_f32(const void* p, int kind, int64_t i) {
  switch (kind) {
    case 1:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case 2:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ int group_of(const int64_t* offsets, int G, int64_t r) {
  int lo = 0, hi = G;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] > r) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo - 1;
}

// act and act' in fp32 (silu'(x) = s(x) (1 + x (1 - s(x)))), the reference's formulas.
__device__ __forceinline__ float act_value(bool silu, float x) {
  if (!silu) return x;
  const float s = 1.0f / (1.0f + expf(-x));
  return x * s;
}

__device__ __forceinline__ float act_grad(bool silu, float x) {
  if (!silu) return 1.0f;
  const float s = 1.0f / (1.0f + expf(-x));
  return s * (1.0f + x * (1.0f - s));
}

// One block per grouped row. A projection with a bias arrives as an fp32 accumulator (acc != null):
// its value is rnd_d(acc + bias[g]) and is stored; otherwise cuBLAS already stored it in d. Then
// inter = rnd_d(act(gate) * up) from the rounded values.
template <class T>
__global__ void act_fwd_kernel(const float* __restrict__ acc0, const void* __restrict__ b0,
                               int b0_kind, const float* __restrict__ acc1,
                               const void* __restrict__ b1, int b1_kind, T* __restrict__ gate,
                               T* __restrict__ up, T* __restrict__ inter,
                               const int64_t* __restrict__ offsets, int G, int64_t M, bool silu) {
  const int64_t r = blockIdx.x;
  const int64_t g = (b0 || b1) ? group_of(offsets, G, r) : 0;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t i = r * M + j;
    float gv, uv;
    if (acc0) {
      const T t = from_f32<T>(acc0[i] + (b0 ? load_f32(b0, b0_kind, g * M + j) : 0.0f));
      gate[i] = t;
      gv = to_f32(t);
    } else {
      gv = to_f32(gate[i]);
    }
    if (acc1) {
      const T t = from_f32<T>(acc1[i] + (b1 ? load_f32(b1, b1_kind, g * M + j) : 0.0f));
      up[i] = t;
      uv = to_f32(t);
    } else {
      uv = to_f32(up[i]);
    }
    inter[i] = from_f32<T>(act_value(silu, gv) * uv);
  }
}

// The unbiased forward and the backward are elementwise over the grouped rows: these twins of
// act_fwd_kernel / act_bwd_kernel move 16 bytes per load and store (the scalar ones reached
// half the copy bandwidth on the Mixtral-like block). Same per-element arithmetic.
template <class T>
union Vec16 {
  uint4 u;
  T v[16 / sizeof(T)];
};

template <class T>
__global__ void act_fwd_vec_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                   T* __restrict__ inter, int64_t nv, bool silu) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nv;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Vec16<T> g, u, o;
    g.u = reinterpret_cast<const uint4*>(gate)[i];
    u.u = reinterpret_cast<const uint4*>(up)[i];
#pragma unroll
    for (int k = 0; k < 16 / static_cast<int>(sizeof(T)); ++k)
      o.v[k] = from_f32<T>(act_value(silu, to_f32(g.v[k])) * to_f32(u.v[k]));
    reinterpret_cast<uint4*>(inter)[i] = o.u;
  }
}

template <class T>
__global__ void act_bwd_vec_kernel(const T* __restrict__ d_inter, const T* __restrict__ gate,
                                   const T* __restrict__ up, T* __restrict__ d_gate,
                                   T* __restrict__ d_up, int64_t nv, bool silu) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nv;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Vec16<T> di, g, u, dg, du;
    di.u = reinterpret_cast<const uint4*>(d_inter)[i];
    g.u = reinterpret_cast<const uint4*>(gate)[i];
    u.u = reinterpret_cast<const uint4*>(up)[i];
#pragma unroll
    for (int k = 0; k < 16 / static_cast<int>(sizeof(T)); ++k) {
      const float dv = to_f32(di.v[k]), gv = to_f32(g.v[k]), uv = to_f32(u.v[k]);
      du.v[k] = from_f32<T>(dv * act_value(silu, gv));
      dg.v[k] = from_f32<T>(act_grad(silu, gv) * (dv * uv));
    }
    reinterpret_cast<uint4*>(d_up)[i] = du.u;
    reinterpret_cast<uint4*>(d_gate)[i] = dg.u;
  }
}

// Whether n elements of T at every pointer can go 16 bytes at a time.
bool vec16(int64_t n, size_t elem, std::initializer_list<const void*> ptrs) {
  if (n % static_cast<int64_t>(16 / elem) != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// d_up = rnd_d(d_inter * act(gate)), d_gate = rnd_d(act'(gate) * (d_inter * up)), elementwise
// over the grouped rows.
template <class T>
__global__ void act_bwd_kernel(const T* __restrict__ d_inter, const T* __restrict__ gate,
                               const T* __restrict__ up, T* __restrict__ d_gate,
                               T* __restrict__ d_up, int64_t n, bool silu) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float di = to_f32(d_inter[i]), gv = to_f32(gate[i]), uv = to_f32(up[i]);
    d_up[i] = from_f32<T>(di * act_value(silu, gv));
    d_gate[i] = from_f32<T>(act_grad(silu, gv) * (di * uv));
  }
}

int grid_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 16));
}

const TensorMeta* meta_or_null(const DeviceTensor* t, TensorMeta& store) {
  if (!t) return nullptr;
  store = t->meta();
  return &store;
}

FfnShape validate(const DeviceTensor& x, const TensorMeta& gs, const FfnWeights& w) {
  TensorMeta b0, b1, bo;
  return validate_swiglu_expert_ffn(x.meta(), gs, w.wi_0.meta(), w.wi_1.meta(), w.wo.meta(),
                                    meta_or_null(w.wi_0_bias, b0), meta_or_null(w.wi_1_bias, b1),
                                    meta_or_null(w.wo_bias, bo));
}

FfnShape validate_plan(const DeviceTensor& x, const GroupPlan& plan, const FfnWeights& w) {
  const FfnShape sh = validate(x, TensorMeta{DType::i64, {plan.groups()}}, w);
  if (plan.rows != sh.rows) {
    throw std::invalid_argument("group_sizes: the plan is for " + std::to_string(plan.rows) +
                                " rows, x has " + std::to_string(sh.rows));
  }
  return sh;
}

void require_bias_grad(const std::optional<DeviceTensor>& g, const DeviceTensor* bias,
                       const char* what) {
  if (!bias) return;
  if (!g) throw std::invalid_argument(std::string(what) + ": missing for a given bias");
  require_tensor(*g, bias->dtype(), bias->shape(), what);
}

}  // namespace

void swiglu_expert_ffn_fwd_into(const DeviceTensor& x, const GroupPlan& plan, const FfnWeights& w,
                                Activation act, SwigluFfnFwd& out, Stream s, const GemmOptions& o) {
  const FfnShape sh = validate_plan(x, plan, w);
  const DType d = x.dtype();
  require_tensor(out.out, d, {sh.rows, sh.hidden}, "out");
  require_tensor(out.gate_proj, d, {sh.rows, sh.inter}, "gate_proj");
  require_tensor(out.up_proj, d, {sh.rows, sh.inter}, "up_proj");
  require_tensor(out.intermediate, d, {sh.rows, sh.inter}, "intermediate");
  if (o.poison) {
    for (DeviceTensor* t : {&out.out, &out.gate_proj, &out.up_proj, &out.intermediate}) {
      gemm_detail::poison(*t, s);
    }
  }
  const size_t es = dtype_size(d);
  for (DeviceTensor* t : {&out.gate_proj, &out.up_proj, &out.intermediate}) {
    gemm_detail::zero_tail_rows(plan, t->data(), sh.inter, es, s);
  }
  if (plan.used > 0 && sh.inter > 0) {
    std::optional<TimelineStage> stage(std::in_place, "ffn.gate_up");
    // A biased projection goes through an fp32 accumulator so bias and rounding happen once, in
    // the activation kernel; an unbiased one is written in d by cuBLAS.
    const size_t acc_bytes = static_cast<size_t>(plan.used * sh.inter) * sizeof(float);
    Scratch acc0(w.wi_0_bias ? acc_bytes : 0, s), acc1(w.wi_1_bias ? acc_bytes : 0, s);
    const DType t0 = w.wi_0_bias ? DType::f32 : d, t1 = w.wi_1_bias ? DType::f32 : d;
    void* c0 = w.wi_0_bias ? acc0.get() : out.gate_proj.data();
    void* c1 = w.wi_1_bias ? acc1.get() : out.up_proj.data();
    if (t0 == t1) {  // gate and up share x: one launch where the impl batches (chunked)
      gemm_detail::grouped_products(GemmRole::fwd, plan, d, x.data(),
                                    {{w.wi_0.data(), c0}, {w.wi_1.data(), c1}}, t0, sh.hidden,
                                    sh.inter, false, s, o);
    } else {
      gemm_detail::grouped_product(GemmRole::fwd, plan, d, x.data(), w.wi_0.data(), t0, c0,
                                   sh.hidden, sh.inter, false, s, o);
      gemm_detail::grouped_product(GemmRole::fwd, plan, d, x.data(), w.wi_1.data(), t1, c1,
                                   sh.hidden, sh.inter, false, s, o);
    }
    stage.reset();
    stage.emplace("ffn.act");
    const DevicePlan dplan(plan, s);
    const bool silu = act == Activation::silu;
    const int64_t n = plan.used * sh.inter;
    const bool vec =
        !w.wi_0_bias && !w.wi_1_bias &&
        vec16(n, es, {out.gate_proj.data(), out.up_proj.data(), out.intermediate.data()});
    dispatch_float(d, [&](auto tag) {
      using T = decltype(tag);
      if (vec) {
        const int64_t nv = n / static_cast<int64_t>(16 / sizeof(T));
        act_fwd_vec_kernel<T><<<grid_for(nv), kThreads, 0, s>>>(
            out.gate_proj.data<T>(), out.up_proj.data<T>(), out.intermediate.data<T>(), nv, silu);
        return;
      }
      act_fwd_kernel<T><<<static_cast<unsigned>(plan.used), kThreads, 0, s>>>(
          acc0.as<float>(), w.wi_0_bias ? w.wi_0_bias->data() : nullptr,
          w.wi_0_bias ? float_kind(w.wi_0_bias->dtype()) : 0, acc1.as<float>(),
          w.wi_1_bias ? w.wi_1_bias->data() : nullptr,
          w.wi_1_bias ? float_kind(w.wi_1_bias->dtype()) : 0, out.gate_proj.data<T>(),
          out.up_proj.data<T>(), out.intermediate.data<T>(), dplan.offsets(),
          static_cast<int>(plan.groups()), sh.inter, silu);
    });
    MOE_CUDA_CHECK(cudaGetLastError());
  }
  GemmOptions inner = o;
  inner.poison = false;
  const TimelineStage stage("ffn.down");
  grouped_gemm_fwd_into(out.intermediate, w.wo, plan, w.wo_bias, out.out, s, inner);
}

SwigluFfnFwd swiglu_expert_ffn_fwd(const DeviceTensor& x, const DeviceTensor& group_sizes,
                                   const FfnWeights& w, Activation act, Stream s,
                                   const GemmOptions& o) {
  const FfnShape sh = validate(x, group_sizes.meta(), w);
  const GroupPlan plan = [&] {
    const TimelineStage stage("ffn.plan");  // group sizes to the host: a wait on the stream
    return read_group_plan(group_sizes, sh.rows, s);
  }();
  const DType d = x.dtype();
  SwigluFfnFwd out{DeviceTensor(d, {sh.rows, sh.hidden}), DeviceTensor(d, {sh.rows, sh.inter}),
                   DeviceTensor(d, {sh.rows, sh.inter}), DeviceTensor(d, {sh.rows, sh.inter})};
  swiglu_expert_ffn_fwd_into(x, plan, w, act, out, s, o);
  return out;
}

void swiglu_expert_ffn_bwd_into(const DeviceTensor& grad_out, const DeviceTensor& x,
                                const GroupPlan& plan, const FfnWeights& w,
                                const DeviceTensor& gate_proj, const DeviceTensor& up_proj,
                                const DeviceTensor& intermediate, Activation act, SwigluFfnBwd& out,
                                Stream s, const GemmOptions& o) {
  const FfnShape sh = validate_plan(x, plan, w);
  const DType d = x.dtype();
  const int64_t R = sh.rows, H = sh.hidden, M = sh.inter, G = sh.groups;
  require_tensor(grad_out, d, {R, H}, "grad_out");
  require_tensor(gate_proj, d, {R, M}, "gate_proj");
  require_tensor(up_proj, d, {R, M}, "up_proj");
  require_tensor(intermediate, d, {R, M}, "intermediate");
  require_tensor(out.grad_x, d, {R, H}, "grad_x");
  require_tensor(out.grad_wi_0, d, {G, H, M}, "grad_wi_0");
  require_tensor(out.grad_wi_1, d, {G, H, M}, "grad_wi_1");
  require_tensor(out.grad_wo, d, {G, M, H}, "grad_wo");
  require_tensor(out.d_gate, d, {R, M}, "d_gate");
  require_tensor(out.d_up, d, {R, M}, "d_up");
  require_bias_grad(out.grad_wi_0_bias, w.wi_0_bias, "grad_wi_0_bias");
  require_bias_grad(out.grad_wi_1_bias, w.wi_1_bias, "grad_wi_1_bias");
  require_bias_grad(out.grad_wo_bias, w.wo_bias, "grad_wo_bias");
  std::optional<DeviceTensor>* bias_grads[] = {&out.grad_wi_0_bias, &out.grad_wi_1_bias,
                                               &out.grad_wo_bias};
  if (o.poison) {
    for (DeviceTensor* t :
         {&out.grad_x, &out.grad_wi_0, &out.grad_wi_1, &out.grad_wo, &out.d_gate, &out.d_up}) {
      gemm_detail::poison(*t, s);
    }
    for (auto* g : bias_grads) {
      if (*g) gemm_detail::poison(**g, s);
    }
  }
  const size_t es = dtype_size(d);
  const DevicePlan dplan = [&] {  // the group offsets on the device (bias sums)
    const TimelineStage stage("ffn.plan");
    return DevicePlan(plan, s);
  }();

  // Output projection: d_inter (stored in d between stages, SPEC §10.2), grad wo, grad bo.
  std::optional<TimelineStage> stage(std::in_place, "ffn.down_dgrad");
  Scratch d_inter(static_cast<size_t>(plan.used * M) * es, s);
  gemm_detail::grouped_product(GemmRole::dgrad, plan, d, grad_out.data(), w.wo.data(), d,
                               d_inter.get(), M, H, false, s, o);
  stage.reset();
  stage.emplace("ffn.down_wgrad");
  gemm_detail::grouped_product(GemmRole::wgrad, plan, d, intermediate.data(), grad_out.data(), d,
                               out.grad_wo.data(), M, H, false, s, o);
  if (w.wo_bias) {
    gemm_detail::group_column_sums(plan, dplan, grad_out.data(), d, H, out.grad_wo_bias->data(),
                                   out.grad_wo_bias->dtype(), s);
  }

  // Activation backward over the grouped rows; tail rows of the stage values are 0.
  stage.reset();
  stage.emplace("ffn.act");
  gemm_detail::zero_tail_rows(plan, out.d_gate.data(), M, es, s);
  gemm_detail::zero_tail_rows(plan, out.d_up.data(), M, es, s);
  const int64_t n = plan.used * M;
  if (n > 0) {
    const bool silu = act == Activation::silu;
    const bool vec = vec16(
        n, es,
        {d_inter.get(), gate_proj.data(), up_proj.data(), out.d_gate.data(), out.d_up.data()});
    dispatch_float(d, [&](auto tag) {
      using T = decltype(tag);
      if (vec) {
        const int64_t nv = n / static_cast<int64_t>(16 / sizeof(T));
        act_bwd_vec_kernel<T><<<grid_for(nv), kThreads, 0, s>>>(
            d_inter.as<T>(), gate_proj.data<T>(), up_proj.data<T>(), out.d_gate.data<T>(),
            out.d_up.data<T>(), nv, silu);
        return;
      }
      act_bwd_kernel<T><<<grid_for(n), kThreads, 0, s>>>(d_inter.as<T>(), gate_proj.data<T>(),
                                                         up_proj.data<T>(), out.d_gate.data<T>(),
                                                         out.d_up.data<T>(), n, silu);
    });
    MOE_CUDA_CHECK(cudaGetLastError());
  }

  // grad x = rnd_d(d_gate wi_0^T + d_up wi_1^T): on the sm90 kernel both products sum in its
  // accumulators (one pass, rounded once); else they accumulate in one fp32 buffer, rounded in a
  // pass of its own.
  stage.reset();
  stage.emplace("ffn.grad_x");
  if (out.grad_x.numel() > 0 &&
      gemm_detail::grouped_product_sum(GemmRole::dgrad, plan, d, out.d_gate.data(), w.wi_0.data(),
                                       out.d_up.data(), w.wi_1.data(), d, out.grad_x.data(), H, M,
                                       s, o)) {
    gemm_detail::zero_tail_rows(plan, out.grad_x.data(), H, es, s);
  } else if (out.grad_x.numel() > 0) {
    Scratch acc(static_cast<size_t>(plan.used * H) * sizeof(float), s);
    gemm_detail::grouped_product(GemmRole::dgrad, plan, d, out.d_gate.data(), w.wi_0.data(),
                                 DType::f32, acc.get(), H, M, false, s, o);
    gemm_detail::grouped_product(GemmRole::dgrad, plan, d, out.d_up.data(), w.wi_1.data(),
                                 DType::f32, acc.get(), H, M, true, s, o);
    gemm_detail::bias_epilogue(plan, dplan, acc.as<float>(), nullptr, DType::f32, out.grad_x.data(),
                               d, H, s);
  }

  // Input projections' weight and bias gradients.
  stage.reset();
  stage.emplace("ffn.wi_wgrad");
  // Both share x: one problem list (on `streams`, 16 products in flight instead of 8).
  gemm_detail::grouped_products(
      GemmRole::wgrad, plan, d, x.data(),
      {{out.d_gate.data(), out.grad_wi_0.data()}, {out.d_up.data(), out.grad_wi_1.data()}}, d, H, M,
      false, s, o);
  if (w.wi_0_bias) {
    gemm_detail::group_column_sums(plan, dplan, out.d_gate.data(), d, M, out.grad_wi_0_bias->data(),
                                   out.grad_wi_0_bias->dtype(), s);
  }
  if (w.wi_1_bias) {
    gemm_detail::group_column_sums(plan, dplan, out.d_up.data(), d, M, out.grad_wi_1_bias->data(),
                                   out.grad_wi_1_bias->dtype(), s);
  }
}

SwigluFfnBwd swiglu_expert_ffn_bwd(const DeviceTensor& grad_out, const DeviceTensor& x,
                                   const DeviceTensor& group_sizes, const FfnWeights& w,
                                   const DeviceTensor& gate_proj, const DeviceTensor& up_proj,
                                   const DeviceTensor& intermediate, Activation act, Stream s,
                                   const GemmOptions& o) {
  const FfnShape sh = validate(x, group_sizes.meta(), w);
  const DType d = x.dtype();
  const int64_t R = sh.rows, H = sh.hidden, M = sh.inter, G = sh.groups;
  require_tensor(grad_out, d, {R, H}, "grad_out");
  const GroupPlan plan = [&] {
    const TimelineStage stage("ffn.plan");
    return read_group_plan(group_sizes, R, s);
  }();
  SwigluFfnBwd out{DeviceTensor(d, {R, H}),
                   DeviceTensor(d, {G, H, M}),
                   DeviceTensor(d, {G, H, M}),
                   DeviceTensor(d, {G, M, H}),
                   std::nullopt,
                   std::nullopt,
                   std::nullopt,
                   DeviceTensor(d, {R, M}),
                   DeviceTensor(d, {R, M})};
  if (w.wi_0_bias) out.grad_wi_0_bias = DeviceTensor(w.wi_0_bias->dtype(), {G, M});
  if (w.wi_1_bias) out.grad_wi_1_bias = DeviceTensor(w.wi_1_bias->dtype(), {G, M});
  if (w.wo_bias) out.grad_wo_bias = DeviceTensor(w.wo_bias->dtype(), {G, H});
  swiglu_expert_ffn_bwd_into(grad_out, x, plan, w, gate_proj, up_proj, intermediate, act, out, s,
                             o);
  return out;
}

}  // namespace moe::gpu
