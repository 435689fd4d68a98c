#include "harness/ops/check.h"

#include <cmath>
#include <stdexcept>

namespace moe::ops {

TensorMap clone(const TensorMap& m) {
  TensorMap out;
  for (auto& [k, v] : m) out.emplace(k, v.clone());
  return out;
}

TensorMap to_f64(const TensorMap& m) {
  TensorMap out;
  for (auto& [k, v] : m) out.emplace(k, is_floating(v.dtype()) ? v.to(DType::f64) : v.clone());
  return out;
}

std::string replay_line(const Case& c, std::string_view backend) {
  return "moe-harness check --backend " + std::string(backend) + " --case '" + c.line() + "'";
}

Report compare_outputs(const OpInfo& op, const Case& c, const TensorMap& in, const TensorMap& want,
                       const TensorMap& got) {
  Report r;
  for (auto& [key, w] : want) {
    auto it = got.find(key);
    if (it == got.end()) {
      r.failures.push_back(key + ": missing from the result");
      continue;
    }
    if (is_floating(w.dtype()) && op.bound) {
      Tensor b = op.bound(c, key, in, want);
      r.tensors.push_back(compare(key, it->second, w, &b));
    } else {
      r.tensors.push_back(compare(key, it->second, w, nullptr));
    }
  }
  for (auto& [key, g] : got) {
    if (!want.count(key))
      r.failures.push_back(key + ": produced but the reference has no such tensor");
  }
  return r;
}

Report check_reference(const OpInfo& op, const Case& c, const FdOptions& fd_opt) {
  Report r;
  const TensorMap in = op.make_inputs(c);
  const TensorMap out = op.reference(c, in, false);
  if (op.invariants) {
    for (auto& f : op.invariants(c, in, out)) r.failures.push_back("invariant: " + f);
  }
  // Finite differences of the exact reference: L = sum <cotangent.n, output.n>.
  const TensorMap in64 = to_f64(in);
  const TensorMap exact = op.reference(c, in64, true);
  TensorMap grads, inputs;
  for (auto& [k, v] : exact) {
    if (k.rfind("grad.", 0) != 0) continue;
    const std::string name = k.substr(5);
    if (!in64.count("input." + name)) {
      r.failures.push_back(k + ": no input." + name);
      continue;
    }
    grads.emplace("input." + name, v.to(DType::f64));
  }
  if (grads.empty()) return r;
  TensorMap masks = op.fd_masks ? op.fd_masks(c, in) : TensorMap{};
  auto loss = [&](const TensorMap& x) {
    const TensorMap o = op.reference(c, x, true);
    double l = 0;
    for (auto& [k, ct] : x) {
      if (k.rfind("cotangent.", 0) != 0) continue;
      const Tensor& y = o.at("output." + k.substr(10));
      for (int64_t i = 0; i < y.numel(); ++i) l += ct.at(i) * y.at(i);
    }
    return l;
  };
  FdOptions opt = fd_opt;
  opt.seed = c.seed;
  for (auto& res : fd_check(loss, in64, grads, masks, opt)) {
    if (!res.ok()) r.failures.push_back("finite differences: " + res.str());
  }
  return r;
}

Report check_gpu(const OpInfo& op, const Case& c) {
  if (!op.gpu) throw std::invalid_argument("op " + op.name + " has no CUDA twin yet");
  const TensorMap in = op.make_inputs(c);
  const TensorMap want = op.reference(c, in, false);
  const TensorMap got = op.gpu(c, in);
  Report r = op.compare ? op.compare(c, in, want, got) : compare_outputs(op, c, in, want, got);
  const TensorMap again = op.gpu(c, in);
  for (auto& [k, v] : got) {
    auto it = again.find(k);
    if (it == again.end() || !it->second.bitwise_equal(v)) {
      r.failures.push_back("determinism: " + k + " differs between two GPU runs");
    }
  }
  return r;
}

}  // namespace moe::ops
