#include "harness/ops/record.h"

namespace moe::ops {

Case draw_case(const std::string& op, const std::vector<Regime>& regimes) {
  return draw_case(op, *rc::gen::element(DType::f32, DType::bf16, DType::f16), regimes);
}

Case draw_case(const std::string& op, DType d, const std::vector<Regime>& regimes) {
  Case c;
  c.op = op;
  c.dtype = d;
  c.regime = *rc::gen::elementOf(regimes);  // the same draw as rc::gen::element(r0, r1, ...)
  c.seed = *rc::gen::arbitrary<uint32_t>();
  return c;
}

bool draw_no_rows(const Case& c) {
  return c.regime == Regime::zero_tokens && *rc::gen::arbitrary<bool>();
}

int64_t draw_tokens(bool none) {
  return none ? 0 : *rc::gen::inRange<int64_t>(1, 20);
}

int64_t draw_experts() {
  return *rc::gen::element<int64_t>(1, 2, 3, 4, 5, 7, 8, 16);
}

int64_t draw_align_size() {
  return *rc::gen::element<int64_t>(0, 0, 1, 2, 3, 8, 16, 128);
}

int64_t draw_hidden(int64_t align_size) {
  return align_size >= 16 ? *rc::gen::element<int64_t>(1, 2, 3)
                          : *rc::gen::element<int64_t>(1, 2, 3, 8, 16, 257);
}

void draw_argsort_shape(Case& c) {
  const int64_t E = draw_experts();
  const bool zero_t = draw_no_rows(c);
  const int64_t a = draw_align_size();
  c.set("T", draw_tokens(zero_t));
  c.set("E", E).set("topk", *rc::gen::inRange<int64_t>(1, E + 1)).set("align_size", a);
  c.set("H", draw_hidden(a));
}

void draw_ep_experts(Case& c) {
  const int64_t P = *rc::gen::element<int64_t>(1, 2, 3, 4, 8);
  c.set("num_ep", P).set("E", P * *any_in(1, 4));
}

int64_t draw_ep_align_size() {
  return *rc::gen::element<int64_t>(0, 0, 1, 4);
}

nlohmann::json no_params(const Case&) {
  return nlohmann::json::object();
}

nlohmann::json int_params(const Case& c, std::initializer_list<const char*> keys) {
  nlohmann::json j = nlohmann::json::object();
  for (const char* k : keys) j[k] = c.i(k);
  return j;
}

Tensor exact_bound(const Case&, const std::string& key, const TensorMap&, const TensorMap& want) {
  return Tensor(DType::f64, want.at(key).shape());
}

OpInfo op_info(std::string name, std::string spec, RecordFns f) {
  OpInfo o;
  o.name = std::move(name);
  o.spec = std::move(spec);
  o.gen = std::move(f.gen);
  o.named = std::move(f.named);
  o.make_inputs = std::move(f.make_inputs);
  o.reference = std::move(f.reference);
  o.invariants = std::move(f.invariants);
  o.cost = std::move(f.cost);
  o.to_params = std::move(f.to_params);
  o.from_params = std::move(f.from_params);
  return o;
}

void set_gpu(OpInfo& o, GpuFns f) {
  o.gpu = std::move(f.gpu);
  o.gpu_bench = std::move(f.gpu_bench);
  o.gpu_bench_device = std::move(f.gpu_bench_device);
  o.bench_verify_case = std::move(f.bench_verify_case);
  o.bench_cases = std::move(f.bench_cases);
}

GpuFns adjust_bench(GpuFns f, std::function<OpInfo::Bench(const Case&, OpInfo::Bench)> adjust) {
  f.gpu_bench = [adjust, run = f.gpu_bench](const Case& c, const TensorMap& in) {
    return adjust(c, run(c, in));
  };
  f.gpu_bench_device = [adjust, run = f.gpu_bench_device](const Case& c) {
    return adjust(c, run(c));
  };
  return f;
}

}  // namespace moe::ops
