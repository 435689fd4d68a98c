// Host tensor: dtype, shape and contiguous row-major bytes. Copying is explicit (clone()), so a
// tensor is never duplicated behind the caller's back. Element access goes through double, which
// holds every value of every supported dtype exactly (i64 beyond 2^53 aside, which no op uses).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "harness/core/dtype.h"

namespace moe {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "[64, 32]"
int64_t shape_numel(const Shape& s);    // throws std::invalid_argument on a negative dim/overflow

// dtype + shape, the part of a tensor that host-side validation looks at. Host tensors and
// gpu::DeviceTensor both produce one with meta(), so the reference and the CUDA wrappers share
// one validation function per op.
struct TensorMeta {
  DType dtype = DType::f32;
  Shape shape;
  size_t rank() const { return shape.size(); }
  int64_t dim(size_t i) const { return shape.at(i); }
  std::string describe() const;
};

class Tensor {
 public:
  Tensor() = default;             // float32 scalar-less empty tensor of shape [0]
  Tensor(DType dt, Shape shape);  // zero-filled
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  // Builds a tensor from values, rounding each to dt (RNE).
  static Tensor from(DType dt, Shape shape, const std::vector<double>& values);
  Tensor clone() const;
  // Element-wise conversion with one RNE rounding per element.
  Tensor to(DType dt) const;

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  size_t rank() const { return shape_.size(); }
  int64_t dim(size_t i) const;  // throws if i >= rank
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return bytes_.size(); }
  std::byte* bytes() { return bytes_.data(); }
  const std::byte* bytes() const { return bytes_.data(); }
  template <class T>
  T* data() {
    return reinterpret_cast<T*>(bytes_.data());
  }
  template <class T>
  const T* data() const {
    return reinterpret_cast<const T*>(bytes_.data());
  }

  double at(int64_t i) const;     // flat index
  void set(int64_t i, double v);  // rounds to dtype
  double at(int64_t r, int64_t c) const { return at(r * row_stride() + c); }
  void set(int64_t r, int64_t c, double v) { set(r * row_stride() + c, v); }
  int64_t row_stride() const;  // product of dims after the first
  std::vector<double> values() const;
  void fill(double v);
  void fill_bytes(uint8_t byte);  // poison (NaN patterns, 0xFF canaries)

  bool bitwise_equal(const Tensor& o) const;
  std::string describe() const;  // "bfloat16[64, 32]"
  TensorMeta meta() const { return {dtype_, shape_}; }

 private:
  DType dtype_ = DType::f32;
  Shape shape_{0};
  int64_t numel_ = 0;
  std::vector<std::byte> bytes_;
};

// Named tensors of one op run, keyed as in the golden schema (SPEC §14): "input.logits",
// "cotangent.probs", "output.probs", "grad.logits", ...
using TensorMap = std::map<std::string, Tensor>;

// Throws std::invalid_argument("<what>: expected ... got ...") unless t has the given rank.
void require_rank(const TensorMeta& t, size_t rank, const std::string& what);
void require_shape(const TensorMeta& t, const Shape& shape, const std::string& what);
// Throws std::invalid_argument("<what>: unsupported dtype D (expected float32, bfloat16 or
// float16)") unless t is one of those, or float64 where allow_f64 (the reference's own runs).
void require_float_dtype(const TensorMeta& t, const std::string& what, bool allow_f64);
// The same for index tensors: int32 or int64.
void require_index_dtype(const TensorMeta& t, const std::string& what);

}  // namespace moe
