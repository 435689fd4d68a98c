// Parameters and host-side validation of the router family (SPEC §1-3), shared by the CPU
// reference and the CUDA wrappers so both reject the same inputs with the same messages.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "harness/core/tensor.h"

namespace moe {

enum class ScoreFunction : uint8_t { softmax, sigmoid, sqrtsoftplus };
enum class MapFormat : uint8_t { bytemap, bitmap_u8 };

std::string_view score_function_name(ScoreFunction f);
ScoreFunction parse_score_function(std::string_view s);  // throws naming score_function
std::string_view map_format_name(MapFormat f);
MapFormat parse_map_format(std::string_view s);  // throws naming routing_map_format

// SPEC §1.1.
struct RouterParams {
  int64_t topk = 1;
  ScoreFunction score_function = ScoreFunction::softmax;
  bool use_pre_softmax = false;
  int64_t num_groups = 0;  // ignored unless group_topk > 0
  int64_t group_topk = 0;  // grouping is on iff > 0
  double scaling_factor = 1.0;
  MapFormat routing_map_format = MapFormat::bytemap;

  bool grouped() const { return group_topk > 0; }
};

// Largest E the implementations support (SPEC §1.5 requires >= 1024).
inline constexpr int64_t kMaxExperts = 4096;

// §1.5 host checks for topk_router. allow_f64: the reference's finite-difference mode.
void validate_topk_router(const TensorMeta& logits, const TensorMeta* expert_bias,
                          const RouterParams& p, bool allow_f64 = false);
// §2: topk/score_function/format checks, no grouping or bias.
void validate_aux_loss_scores(const TensorMeta& logits, int64_t topk, bool allow_f64 = false);

// SPEC §3.
struct AuxLossParams {
  int64_t topk = 1;
  double coeff = 1.0;
  int64_t num_experts = 0;       // 0 = C (the column count of probs)
  int64_t total_num_tokens = 0;  // 0 = R (the row count of probs)
};
// Resolves the defaults against probs [R, C] and checks §3's errors; returns the resolved params.
AuxLossParams validate_moe_aux_loss(const TensorMeta& probs, const TensorMeta& tokens_per_expert,
                                    const AuxLossParams& p, bool allow_f64 = false);

// Routing-map shape for a format: [T, E] bool or [T, ceil(E/8)] u8.
Shape routing_map_shape(int64_t tokens, int64_t experts, MapFormat f);
// Reads routing_map[t, e] in either format.
bool routing_map_get(const Tensor& map, int64_t t, int64_t e);
void routing_map_set(Tensor& map, int64_t t, int64_t e, bool v);

inline constexpr float kRouterEps = 1e-20f;  // SPEC §0 epsilon

}  // namespace moe
