#include "harness/ops/edges.h"

#include <cstdint>
#include <optional>

#include "harness/core/params/router.h"

namespace moe::ops {

namespace {

std::optional<int64_t> int_of(const Case& c, const std::string& key) {
  auto it = c.p.find(key);
  if (it == c.p.end()) return std::nullopt;
  try {
    size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used != it->second.size()) return std::nullopt;
    return static_cast<int64_t>(v);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool pow2(int64_t v) {
  return v > 0 && (v & (v - 1)) == 0;
}

// The size classes of one value. The labels name the CUDA row kernels' layout (score_fn.h
// row_layout: chunks of 8 experts, a warp of 32 lanes, 256 = 32 lanes x 8).
void size_classes(const std::string& k, int64_t v, bool experts, std::vector<std::string>& out) {
  const std::string kv = k + "=" + std::to_string(v);
  if (v == 0)
    out.push_back(kv);
  else if (v == 1)
    out.push_back(kv);
  else if (v == 8)
    out.push_back(kv + " (chunk)");
  else if (v == 9)
    out.push_back(kv + " (chunk+1)");
  else if (v == 32)
    out.push_back(kv + " (warp)");
  else if (v == 33)
    out.push_back(kv + " (warp+1)");
  else if (v == 256)
    out.push_back(kv + " (block)");
  else if (v == 257)
    out.push_back(kv + " (block+1)");
  else if (v >= 16 && pow2(v))
    out.push_back(kv + " (pow2)");
  else if (v >= 17 && pow2(v - 1))
    out.push_back(kv + " (pow2+1)");
  if (experts && v >= 1024) out.push_back(k + ">=1024");
  if (experts && v == kMaxExperts) out.push_back(kv + " (max)");
}

}  // namespace

std::vector<std::string> edge_classes(const Case& c) {
  std::vector<std::string> out;
  // Size keys, rows first, then experts, then the rest.
  for (const char* k : {"T", "R", "N", "N_rows", "M_total"})
    if (auto v = int_of(c, k)) size_classes(k, *v, false, out);
  for (const char* k : {"E", "num_experts", "C"})
    if (auto v = int_of(c, k)) size_classes(k, *v, true, out);
  for (const char* k : {"H", "M", "K", "G", "B", "S", "num_ep"})
    if (auto v = int_of(c, k)) size_classes(k, *v, false, out);
  // topk against the expert count.
  std::optional<int64_t> E = int_of(c, "E");
  if (!E) E = int_of(c, "num_experts");
  if (!E) E = int_of(c, "C");
  if (auto K = int_of(c, "topk")) {
    size_classes("topk", *K, false, out);
    if (*K == 1) out.push_back("K=1");
    if (E && *K == *E) out.push_back("K=E");
    if (E && *E > 2 && *K == *E - 1) out.push_back("K=E-1");
    if (*K >= 16) out.push_back("K>=16 (radix path)");
    // Grouped top-k (SPEC §1.1: on iff group_topk > 0).
    const int64_t gk = int_of(c, "group_topk").value_or(0);
    const int64_t G = int_of(c, "num_groups").value_or(0);
    if (gk > 0 && G > 0) {
      out.push_back("grouped");
      if (gk == G) out.push_back("g_k=G");
      if (gk == 1) out.push_back("g_k=1");
      if (G == 1) out.push_back("G=1");
      if (E && *E == G) out.push_back("E/G=1");
      if (E && *E % G == 0 && *K % gk == 0 && *K / gk == *E / G) out.push_back("K/g_k=E/G");
    }
  }
  // moe_aux_loss: the sequence-level variant and a token total beyond the rows.
  const auto C = int_of(c, "C"), ne = int_of(c, "num_experts");
  if (C && ne && *ne > 0 && *C != *ne) out.push_back("C=m*E (m>1)");
  const auto R = int_of(c, "R"), tot = int_of(c, "total_num_tokens");
  if (R && tot && *tot > *R) out.push_back("T_tot>R");
  if (auto a = int_of(c, "align_size"); a && *a == 1) out.push_back("align_size=1");
  return out;
}

}  // namespace moe::ops
