// Parameters and host-side validation of moe_block (SPEC §11), shared by the CPU reference and
// the CUDA wrapper (C++17: .cu files may include it).
//
// Shapes: x [B,S,H]; gate_kernel [H,E]; wi_0, wi_1 [E,H,M]; wo [E,M,H]; wi_0_bias, wi_1_bias
// [E,M] and wo_bias [E,H] (optional); expert_bias [E] (optional, sigmoid/sqrtsoftplus only).
// Sharding: P = ep_size EP ranks times D = dp_size data-parallel ranks; the batch is split into
// P*D shards of B/(P*D) rows, shard k = dp*P + ep (data-parallel major, EP minor); EP rank s owns
// experts [sL, (s+1)L), L = E/P.
#pragma once

#include <cstdint>
#include <string_view>

#include "harness/core/params/ep.h"
#include "harness/core/params/ffn.h"
#include "harness/core/params/router.h"

namespace moe {

// kernel = TE TRITON (token_dispatch/token_combine), argsort = TE PURE_JAX (§8).
enum class MoeBackend : uint8_t { kernel, argsort };
std::string_view moe_backend_name(MoeBackend b);
MoeBackend parse_moe_backend(std::string_view s);  // throws naming backend

// float32 (HEAD, the default): logits widened to f32 before the router; input (d1920cf52): the
// router sees the logits in d.
enum class RouterLogitsDtype : uint8_t { float32, input };
std::string_view router_logits_dtype_name(RouterLogitsDtype r);
RouterLogitsDtype parse_router_logits_dtype(std::string_view s);  // throws naming it

// SPEC §11.1 parameters.
struct MoeBlockParams {
  int64_t num_experts = 1;
  int64_t topk = 1;
  Activation activation = Activation::silu;
  ScoreFunction score_function = ScoreFunction::softmax;
  bool use_pre_softmax = false;
  int64_t num_groups = 0;
  int64_t group_topk = 0;
  double scaling_factor = 1.0;
  double aux_loss_coeff = 0.0;  // 0 turns the aux loss off
  MoeBackend backend = MoeBackend::kernel;
  int64_t align_size = 0;
  int64_t ep_size = 1;
  int64_t dp_size = 1;
  DType probs_dtype = DType::f32;
  RouterLogitsDtype router_logits_dtype = RouterLogitsDtype::float32;

  bool aux_loss() const { return aux_loss_coeff > 0.0; }
  // The §1 router parameters (bytemap routing maps).
  RouterParams router() const;
};

struct MoeBlockShape {
  int64_t B = 0, S = 0, H = 0, M = 0, E = 0;
  int64_t tokens() const { return B * S; }
  // The §9.5 sizing inputs of this block.
  EpShape ep(const MoeBlockParams& p) const;
};

// §11.1 host checks (shapes, dtypes, parameter ranges, the router and dispatch parameter errors,
// E % P, B % (P*D), expert_bias with softmax). Returns the shape. allow_f64: finite-difference
// mode of the reference.
MoeBlockShape validate_moe_block(const TensorMeta& x, const TensorMeta& gate_kernel,
                                 const TensorMeta& wi_0, const TensorMeta& wi_1,
                                 const TensorMeta& wo, const TensorMeta* wi_0_bias,
                                 const TensorMeta* wi_1_bias, const TensorMeta* wo_bias,
                                 const TensorMeta* expert_bias, const MoeBlockParams& p,
                                 bool allow_f64 = false);

}  // namespace moe
