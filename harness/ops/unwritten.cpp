#include "harness/ops/unwritten.h"

#include <cstring>
#include <stdexcept>

#include "harness/ops/perm_family.h"

namespace moe {

std::string_view unwritten_rows_name(UnwrittenRows u) {
  return u == UnwrittenRows::te ? "te" : "zeros";
}

UnwrittenRows parse_unwritten_rows(std::string_view s) {
  if (s == "zeros") return UnwrittenRows::zeros;
  if (s == "te") return UnwrittenRows::te;
  throw std::invalid_argument("unwritten: unknown policy '" + std::string(s) +
                              "' (allowed: zeros, te)");
}

namespace ops {

namespace {

// Row r of got takes want's bytes (same dtype and shape, else nothing is masked: the comparison
// reports the shape itself).
bool copy_row(const Tensor& want, Tensor& got, int64_t r) {
  if (got.dtype() != want.dtype() || got.shape() != want.shape() || r >= got.dim(0)) return false;
  const size_t row = want.nbytes() / static_cast<size_t>(want.dim(0));
  std::memcpy(got.bytes() + r * row, want.bytes() + r * row, row);
  return true;
}

// The implementation's tensor, to be masked (find_tensor is the read-only lookup).
Tensor* find_mut(TensorMap& m, const std::string& k) {
  auto it = m.find(k);
  return it == m.end() ? nullptr : &it->second;
}

}  // namespace

std::string mask_unwritten(UnwrittenRows policy, const Case& c, const TensorMap& in,
                           const TensorMap& want, TensorMap& got) {
  if (policy != UnwrittenRows::te) return {};
  // With padding TE allocates permuted and grad.permuted zeroed; row_id_map is stale either way.
  const bool padded = c.i("align_size", 0) > 0;
  int64_t rows = 0, entries = 0;
  if (c.op == "token_dispatch") {
    // §4.3: without padding TE leaves the tail past the sum of the routing map uninitialised;
    // §4.2: and row_id_map past each token's n_t entries (stale, or uninitialised in PyTorch).
    const Tensor* map = find_tensor(in, "input.routing_map");
    if (!map) return {};
    int64_t routed = 0;
    for (int64_t i = 0; i < map->numel(); ++i) routed += map->at(i) != 0;
    for (const char* k : {"output.permuted", "output.permuted_probs"}) {
      const Tensor* w = find_tensor(want, k);
      Tensor* g = find_mut(got, k);
      if (padded || !w || !g || w->rank() < 1) continue;
      for (int64_t r = routed; r < w->dim(0); ++r) rows += copy_row(*w, *g, r);
    }
    const Tensor* w = find_tensor(want, "output.row_id_map");
    Tensor* g = find_mut(got, "output.row_id_map");
    if (w && g && w->rank() == 2 && g->shape() == w->shape() && g->dtype() == w->dtype()) {
      const int64_t E = (w->dim(1) - 1) / 2;
      for (int64_t t = 0; t < w->dim(0); ++t) {
        const int64_t n = static_cast<int64_t>(w->at(t, 2 * E));
        for (int64_t k = n; k < E; ++k) {
          g->set(t, k, w->at(t, k));
          g->set(t, E + k, w->at(t, E + k));
          entries += 2;
        }
      }
    }
  } else if (c.op == "token_combine") {
    // §5 backward without merging probs: rows of grad.permuted that no routed slot reads.
    // With merging probs SPEC demands zeros (R4: TE leaving them is a bug, not masked).
    if (padded || find_tensor(in, "input.merging_probs") || find_tensor(in, "input.pad_offsets"))
      return {};
    const Tensor* rim = find_tensor(in, "input.row_id_map");
    const Tensor* w = find_tensor(want, "grad.permuted");
    Tensor* g = find_mut(got, "grad.permuted");
    if (!rim || !w || !g || w->rank() < 1) return {};
    std::vector<char> owned(static_cast<size_t>(w->dim(0)), 0);
    const int64_t E = (rim->dim(1) - 1) / 2;
    for (int64_t t = 0; t < rim->dim(0); ++t) {
      const int64_t n = static_cast<int64_t>(rim->at(t, 2 * E));
      for (int64_t k = 0; k < n && k < E; ++k) {
        const int64_t r = static_cast<int64_t>(rim->at(t, k));
        if (r >= 0 && r < w->dim(0)) owned[static_cast<size_t>(r)] = 1;
      }
    }
    for (int64_t r = 0; r < w->dim(0); ++r)
      if (!owned[static_cast<size_t>(r)]) rows += copy_row(*w, *g, r);
  }
  if (rows == 0 && entries == 0) return {};
  std::string note = "unwritten=te (SPEC §0): not compared:";
  if (rows) note += " " + std::to_string(rows) + " row(s) no routed slot owns";
  if (entries)
    note += std::string(rows ? "," : "") + " " + std::to_string(entries) +
            " row_id_map entries past n_t";
  return note;
}

}  // namespace ops
}  // namespace moe
