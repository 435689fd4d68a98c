#include "harness/ops/impl_buffers.h"

#include <cstring>
#include <stdexcept>

#ifdef MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::ops {

DLDataType dl_dtype(DType dt) {
  switch (dt) {
    case DType::f64:
      return {kDLFloat, 64, 1};
    case DType::f32:
      return {kDLFloat, 32, 1};
    case DType::bf16:
      return {kDLBfloat, 16, 1};
    case DType::f16:
      return {kDLFloat, 16, 1};
    case DType::i32:
      return {kDLInt, 32, 1};
    case DType::i64:
      return {kDLInt, 64, 1};
    case DType::u8:
      return {kDLUInt, 8, 1};
    case DType::boolean:
      return {kMoeDLBool, 8, 1};
  }
  throw std::invalid_argument("dl_dtype: unknown dtype");
}

DType dtype_of(const DLDataType& t, const std::string& what) {
  for (DType d : {DType::f64, DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64,
                  DType::u8, DType::boolean}) {
    const DLDataType x = dl_dtype(d);
    if (x.code == t.code && x.bits == t.bits && x.lanes == t.lanes) return d;
  }
  throw std::invalid_argument(what + ": unsupported DLPack dtype (code " + std::to_string(t.code) +
                              ", bits " + std::to_string(t.bits) + ", lanes " +
                              std::to_string(t.lanes) + ")");
}

namespace {

Shape shape_of(const DLTensor& v) {
  return Shape(v.shape, v.shape + v.ndim);
}

void require_compact(const DLTensor& v, const std::string& what) {
  if (!v.strides) return;
  int64_t expect = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (v.shape[d] != 1 && v.strides[d] != expect)
      throw std::invalid_argument(what + ": only compact row-major tensors are supported");
    expect *= v.shape[d];
  }
}

// Reports guard bytes that changed, as the write past the end of name.
void check_guard(const std::string& name, const uint8_t* guard, std::vector<std::string>& faults) {
  for (size_t i = 0; i < kGuardBytes; ++i) {
    if (guard[i] != kGuardByte) {
      faults.push_back(name + ": written past the end of its buffer (guard byte " +
                       std::to_string(i) + " changed)");
      return;
    }
  }
}

// One buffer: data followed by kGuardBytes guard bytes; its DLTensor points at the data.
struct Slot {
  std::string name;
  TensorMeta meta;
  size_t nbytes = 0;
  void* ptr = nullptr;  // host or device
  std::vector<int64_t> shape;
};

class BuffersBase : public CallBuffers {
 public:
  const TensorViews& in_views() const override { return in_views_; }
  const TensorViews& out_views() const override { return out_views_; }

 protected:
  void add_view(TensorViews& views, Slot& s, DLDevice dev) {
    DLTensor t{};
    t.data = s.ptr;
    t.device = dev;
    t.ndim = static_cast<int>(s.shape.size());
    t.dtype = dl_dtype(s.meta.dtype);
    t.shape = s.shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    views.emplace(s.name, t);
  }
  static Slot slot(const std::string& name, const TensorMeta& meta) {
    Slot s;
    s.name = name;
    s.meta = meta;
    s.nbytes = static_cast<size_t>(shape_numel(meta.shape)) * dtype_size(meta.dtype);
    s.shape = meta.shape;
    return s;
  }
  // The host copy `bytes` (data, then guard) of an input must be unchanged and its guard intact.
  void check_input(const Slot& s, const uint8_t* bytes, const TensorMap& in,
                   std::vector<std::string>& faults) const {
    if (s.nbytes && std::memcmp(bytes, in.at(s.name).bytes(), s.nbytes) != 0)
      faults.push_back(s.name + ": the implementation modified an input");
    check_guard(s.name, bytes + s.nbytes, faults);
  }
  // The host copy of an output becomes a tensor of got; its guard must be intact.
  void take_output(const Slot& s, const uint8_t* bytes, TensorMap& got,
                   std::vector<std::string>& faults) const {
    Tensor t(s.meta.dtype, s.meta.shape);
    if (s.nbytes) std::memcpy(t.bytes(), bytes, s.nbytes);
    check_guard(s.name, bytes + s.nbytes, faults);
    got.emplace(s.name, std::move(t));
  }
  std::vector<Slot> ins_, outs_;
  TensorViews in_views_, out_views_;
};

class HostBuffers : public BuffersBase {
 public:
  HostBuffers(const TensorMap& in, const std::vector<std::pair<std::string, TensorMeta>>& outs)
      : in_(in) {
    const DLDevice dev{kDLCPU, 0};
    storage_.reserve(in.size() + outs.size());
    for (auto& [k, t] : in) {
      ins_.push_back(slot(k, t.meta()));
      Slot& s = ins_.back();
      storage_.emplace_back(s.nbytes + kGuardBytes, kGuardByte);
      s.ptr = storage_.back().data();
      if (s.nbytes) std::memcpy(s.ptr, t.bytes(), s.nbytes);
      add_view(in_views_, s, dev);
    }
    for (auto& [k, meta] : outs) {
      outs_.push_back(slot(k, meta));
      Slot& s = outs_.back();
      storage_.emplace_back(s.nbytes + kGuardBytes, kGuardByte);
      s.ptr = storage_.back().data();
      std::memset(s.ptr, kOutputPoison, s.nbytes);
      add_view(out_views_, s, dev);
    }
  }
  void* stream() const override { return nullptr; }
  void finish(TensorMap& got, std::vector<std::string>& faults) override {
    for (const Slot& s : ins_) check_input(s, static_cast<const uint8_t*>(s.ptr), in_, faults);
    for (const Slot& s : outs_) take_output(s, static_cast<const uint8_t*>(s.ptr), got, faults);
  }

 private:
  const TensorMap& in_;
  std::vector<std::vector<uint8_t>> storage_;
};

#ifdef MOE_WITH_CUDA
void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(e));
}

class DeviceBuffers : public BuffersBase {
 public:
  DeviceBuffers(const TensorMap& in, const std::vector<std::pair<std::string, TensorMeta>>& outs)
      : in_(in) {
    int dev = 0;
    cuda_ok(cudaGetDevice(&dev), "cudaGetDevice");
    const DLDevice d{kDLCUDA, dev};
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (auto& [k, t] : in) {
      ins_.push_back(slot(k, t.meta()));
      Slot& s = ins_.back();
      alloc(s);
      if (s.nbytes)
        cuda_ok(cudaMemcpy(s.ptr, t.bytes(), s.nbytes, cudaMemcpyHostToDevice), "upload " + k);
      add_view(in_views_, s, d);
    }
    for (auto& [k, meta] : outs) {
      outs_.push_back(slot(k, meta));
      Slot& s = outs_.back();
      alloc(s);
      cuda_ok(cudaMemset(s.ptr, kOutputPoison, s.nbytes), "poison " + k);
      add_view(out_views_, s, d);
    }
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize before the call");
  }
  ~DeviceBuffers() override {
    for (Slot* s : all()) cudaFree(s->ptr);
    if (stream_) cudaStreamDestroy(stream_);
  }
  void* stream() const override { return stream_; }
  void finish(TensorMap& got, std::vector<std::string>& faults) override {
    // The implementation may have launched on its stream or the legacy default stream.
    cuda_ok(cudaDeviceSynchronize(), "the implementation's CUDA work");
    cuda_ok(cudaGetLastError(), "the implementation's CUDA launches");
    std::vector<uint8_t> host;
    auto download = [&](const Slot& s) {
      host.resize(s.nbytes + kGuardBytes);
      cuda_ok(cudaMemcpy(host.data(), s.ptr, host.size(), cudaMemcpyDeviceToHost),
              "download " + s.name);
      return host.data();
    };
    for (const Slot& s : ins_) check_input(s, download(s), in_, faults);
    for (const Slot& s : outs_) take_output(s, download(s), got, faults);
  }

 private:
  void alloc(Slot& s) {
    cuda_ok(cudaMalloc(&s.ptr, s.nbytes + kGuardBytes), "cudaMalloc for " + s.name);
    cuda_ok(cudaMemset(static_cast<uint8_t*>(s.ptr) + s.nbytes, kGuardByte, kGuardBytes),
            "guard of " + s.name);
  }
  std::vector<Slot*> all() {
    std::vector<Slot*> v;
    for (Slot& s : ins_) v.push_back(&s);
    for (Slot& s : outs_) v.push_back(&s);
    return v;
  }
  const TensorMap& in_;
  cudaStream_t stream_ = nullptr;
};
#endif

}  // namespace

std::unique_ptr<CallBuffers> make_call_buffers(
    Memory memory, const TensorMap& in,
    const std::vector<std::pair<std::string, TensorMeta>>& outs) {
  if (memory == Memory::host) return std::make_unique<HostBuffers>(in, outs);
#ifdef MOE_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    throw NotSupported("no CUDA GPU for a device-memory implementation");
  }
  return std::make_unique<DeviceBuffers>(in, outs);
#else
  throw NotSupported("this build has no CUDA backend");
#endif
}

Tensor tensor_from_view(const DLTensor& v) {
  require_compact(v, "tensor_from_view");
  Tensor t(dtype_of(v.dtype, "tensor_from_view"), shape_of(v));
  if (t.nbytes())
    std::memcpy(t.bytes(), static_cast<const std::byte*>(v.data) + v.byte_offset, t.nbytes());
  return t;
}

void copy_to_view(const Tensor& t, const DLTensor& v, const std::string& what) {
  if (t.dtype() != dtype_of(v.dtype, what) || t.shape() != shape_of(v))
    throw std::runtime_error(what + ": expected " +
                             std::string(dtype_name(dtype_of(v.dtype, what))) +
                             shape_str(shape_of(v)) + ", the implementation left " + t.describe());
  if (t.nbytes())
    std::memcpy(static_cast<std::byte*>(v.data) + v.byte_offset, t.bytes(), t.nbytes());
}

}  // namespace moe::ops
