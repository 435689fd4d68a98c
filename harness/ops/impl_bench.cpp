#include "harness/ops/impl_bench.h"

#include <algorithm>
#include <stdexcept>

namespace moe::ops {

namespace {

bool is_result_key(const std::string& k) {
  return k.rfind("output.", 0) == 0 || k.rfind("grad.", 0) == 0;
}

}  // namespace

OutputMetas bench_outputs(const Impl& impl, const OpInfo& op, const Case& c, const TensorMap& in,
                          const Case& small) {
  if (!op.gpu) throw std::runtime_error(op.name + ": no CUDA twin to size the outputs with");
  const TensorMap want = op.reference(small, op.make_inputs(small), false);
  const TensorMap sized = op.gpu(c, in);
  OutputMetas outs;
  for (auto& [k, w] : want) {
    if (!is_result_key(k)) continue;
    if (!impl.provides.empty() &&
        std::find(impl.provides.begin(), impl.provides.end(), k) == impl.provides.end())
      continue;
    auto it = sized.find(k);
    if (it == sized.end())
      throw std::runtime_error(op.name + ": the CUDA twin gives no " + k + " to size it with");
    outs.emplace_back(k, TensorMeta{w.dtype(), it->second.shape()});
  }
  return outs;
}

ImplBench::ImplBench(const Impl& impl, const Case& c, const TensorMap& in, const OutputMetas& outs)
    : impl_(impl),
      c_(c),
      params_([&] {
        const OpInfo* op = find_op(c.op);
        return op && op->to_params ? op->to_params(c).dump() : std::string("{}");
      }()),
      in_(in) {
  if (!impl.run)
    throw std::logic_error("implementation " + impl.name + " has no run function on call buffers");
  buffers_ = make_call_buffers(impl.memory, in, outs);
}

void ImplBench::run(void* stream) const {
  const ImplCall call{c_,
                      params_,
                      buffers_->in_views(),
                      buffers_->out_views(),
                      &in_,
                      stream ? stream : buffers_->stream()};
  impl_.run(call);
}

std::vector<std::string> ImplBench::finish() {
  TensorMap got;
  std::vector<std::string> faults;
  buffers_->finish(got, faults);
  return faults;
}

}  // namespace moe::ops
