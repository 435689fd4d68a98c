// Helpers for writing a registry record (registry.h): the plumbing every record used to repeat
// (case construction, the opening draws of a random case, golden params, OpInfo assembly), so
// that a record states only its own op's facts. A new op needs none of it, but reads shorter with
// it:
//
//   rc::Gen<Case> gen() {
//     return rc::gen::exec([] {
//       Case c = draw_case("my_op", kRoutingRegimes);  // dtype, regime, seed
//       c.set("T", draw_tokens(draw_no_rows(c)));
//       return c;
//     });
//   }
//   CaseBuilder("my_op", DType::bf16).seed(7).name("R6_a16").set("T", 128)  // a named case
//   OpInfo o = op_info("my_op", "SPEC §4", {gen, named, make_inputs, reference, invariants,
//                                            cost, no_params, from_params});
#pragma once

#include <rapidcheck.h>

#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "harness/ops/registry.h"

namespace moe::ops {

// Sets `keys` of c from a golden file's params object, read as T (the type to_params wrote).
template <class T>
Case& set_params(Case& c, const nlohmann::json& j, std::initializer_list<const char*> keys) {
  for (const char* k : keys) c.set(k, j.at(k).template get<T>());
  return c;
}

// A Case built in one expression; it converts to a Case wherever one is expected.
class CaseBuilder {
 public:
  explicit CaseBuilder(std::string op, DType d = DType::f32) {
    c_.op = std::move(op);
    c_.dtype = d;
  }
  CaseBuilder& seed(uint64_t s) {
    c_.seed = s;
    return *this;
  }
  CaseBuilder& regime(Regime r) {
    c_.regime = r;
    return *this;
  }
  CaseBuilder& name(const std::string& n) { return set("name", n); }
  template <class V>
  CaseBuilder& set(const std::string& key, V&& v) {
    c_.set(key, std::forward<V>(v));
    return *this;
  }
  template <class T>
  CaseBuilder& params(const nlohmann::json& j, std::initializer_list<const char*> keys) {
    set_params<T>(c_, j, keys);
    return *this;
  }
  const Case& get() const { return c_; }
  operator Case() const { return c_; }  // NOLINT: implicit by design (push_back, return)

 private:
  Case c_;
};

// --- Random cases. These draw, so they may only be called inside rc::gen::exec; the order of the
// draws is part of every generated case (reordering them changes the random cases).

// Regime lists of the generators, in their draw order: the routing records (dispatch, combine,
// argsort) and the size-driven records (EP, GEMM, FFN).
inline const std::vector<Regime> kRoutingRegimes{Regime::uniform, Regime::skewed,
                                                 Regime::all_to_one, Regime::zero_tokens};
inline const std::vector<Regime> kSizeRegimes{Regime::uniform, Regime::skewed, Regime::zero_tokens,
                                              Regime::all_to_one};

// A random case of `op`: its dtype (f32, bf16 or f16), regime (one of `regimes`) and seed, drawn
// in that order.
Case draw_case(const std::string& op, const std::vector<Regime>& regimes);
// The same with the dtype fixed (an op without float tensors): regime and seed drawn.
Case draw_case(const std::string& op, DType d, const std::vector<Regime>& regimes);
// Whether the case runs with no tokens at all: a coin drawn only in the zero_tokens regime (the
// other regimes draw nothing here).
bool draw_no_rows(const Case& c);

// Shapes of the routing records: T in [1, 20) (0 when none, without a draw), E, the alignment,
// and H (only 1..3 under a >= 16, whose padding makes R_out * H large for finite differences).
int64_t draw_tokens(bool none);
int64_t draw_experts();
int64_t draw_align_size();
int64_t draw_hidden(int64_t align_size);
// The argsort records' shape (their dispatch): sets T, E, topk, align_size and H.
void draw_argsort_shape(Case& c);

// Shapes of the EP records: sets num_ep = P and E = P * L (L local experts per rank); the EP
// alignment in {0, 1, 4}.
void draw_ep_experts(Case& c);
int64_t draw_ep_align_size();

// --- Golden params (OpInfo::to_params / from_params).

// The params object of an op whose SPEC params are empty.
nlohmann::json no_params(const Case&);
// {"key": c.i(key), ...}.
nlohmann::json int_params(const Case& c, std::initializer_list<const char*> keys);

// --- Bounds.

// All-zero bound (every output exact: data movement, indices, counts).
Tensor exact_bound(const Case&, const std::string& key, const TensorMap&, const TensorMap& want);

// --- OpInfo assembly.

// The functions every record defines; op_info() copies them into its OpInfo, and the record sets
// what else it has (bound, compare, fd_masks, the CUDA twin, benchmarks) on the result.
struct RecordFns {
  decltype(OpInfo::gen) gen;
  decltype(OpInfo::named) named;
  decltype(OpInfo::make_inputs) make_inputs;
  decltype(OpInfo::reference) reference;
  decltype(OpInfo::invariants) invariants;
  decltype(OpInfo::cost) cost;
  decltype(OpInfo::to_params) to_params;
  decltype(OpInfo::from_params) from_params;
};
OpInfo op_info(std::string name, std::string spec, RecordFns f);

// The CUDA twin and its benchmark, for the records that have one (set under MOE_WITH_CUDA);
// bench_cases replaces the record's own list.
struct GpuFns {
  decltype(OpInfo::gpu) gpu;
  decltype(OpInfo::gpu_bench) gpu_bench;
  decltype(OpInfo::gpu_bench_device) gpu_bench_device;
  decltype(OpInfo::bench_verify_case) bench_verify_case;
  decltype(OpInfo::bench_cases) bench_cases;
};
void set_gpu(OpInfo& o, GpuFns f);
// f with `adjust` applied to every Bench its benchmarks return (e.g. a second byte count).
GpuFns adjust_bench(GpuFns f, std::function<OpInfo::Bench(const Case&, OpInfo::Bench)> adjust);

}  // namespace moe::ops
