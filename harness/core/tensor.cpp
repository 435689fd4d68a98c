#include "harness/core/tensor.h"

#include <cstring>
#include <limits>
#include <stdexcept>

namespace moe {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) throw std::invalid_argument("shape: negative dimension in " + shape_str(s));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      throw std::invalid_argument("shape: element count overflows in " + shape_str(s));
    }
    n *= d;
  }
  return n;
}

Tensor::Tensor(DType dt, Shape shape) : dtype_(dt), shape_(std::move(shape)) {
  numel_ = shape_numel(shape_);
  bytes_.assign(static_cast<size_t>(numel_) * dtype_size(dt), std::byte{0});
}

Tensor Tensor::from(DType dt, Shape shape, const std::vector<double>& values) {
  Tensor t(dt, std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel()) {
    throw std::invalid_argument("Tensor::from: " + std::to_string(values.size()) +
                                " values for shape " + shape_str(t.shape()));
  }
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, values[i]);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t(dtype_, shape_);
  if (!bytes_.empty()) std::memcpy(t.bytes_.data(), bytes_.data(), bytes_.size());
  return t;
}

Tensor Tensor::to(DType dt) const {
  Tensor t(dt, shape_);
  for (int64_t i = 0; i < numel_; ++i) t.set(i, at(i));
  return t;
}

int64_t Tensor::dim(size_t i) const {
  if (i >= shape_.size()) {
    throw std::out_of_range("Tensor::dim(" + std::to_string(i) + ") of rank " +
                            std::to_string(shape_.size()));
  }
  return shape_[i];
}

int64_t Tensor::row_stride() const {
  int64_t s = 1;
  for (size_t i = 1; i < shape_.size(); ++i) s *= shape_[i];
  return s;
}

double Tensor::at(int64_t i) const {
  const std::byte* p = bytes_.data() + i * dtype_size(dtype_);
  switch (dtype_) {
    case DType::f64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::f32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::bf16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return bf16_value(v);
    }
    case DType::f16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return f16_value(v);
    }
    case DType::i32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::i64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
    case DType::u8:
    case DType::boolean:
      return static_cast<double>(static_cast<uint8_t>(*p));
  }
  return 0.0;
}

void Tensor::set(int64_t i, double v) {
  std::byte* p = bytes_.data() + i * dtype_size(dtype_);
  switch (dtype_) {
    case DType::f64:
      std::memcpy(p, &v, 8);
      return;
    case DType::f32: {
      const float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::bf16: {
      const uint16_t b = bf16_bits(v);
      std::memcpy(p, &b, 2);
      return;
    }
    case DType::f16: {
      const uint16_t b = f16_bits(v);
      std::memcpy(p, &b, 2);
      return;
    }
    case DType::i32: {
      const auto x = static_cast<int32_t>(round_to(DType::i32, v));
      std::memcpy(p, &x, 4);
      return;
    }
    case DType::i64: {
      const auto x = static_cast<int64_t>(round_to(DType::i64, v));
      std::memcpy(p, &x, 8);
      return;
    }
    case DType::u8:
    case DType::boolean:
      *p = static_cast<std::byte>(static_cast<uint8_t>(round_to(dtype_, v)));
      return;
  }
}

std::vector<double> Tensor::values() const {
  std::vector<double> v(numel_);
  for (int64_t i = 0; i < numel_; ++i) v[i] = at(i);
  return v;
}

void Tensor::fill(double v) {
  for (int64_t i = 0; i < numel_; ++i) set(i, v);
}

void Tensor::fill_bytes(uint8_t byte) {
  std::memset(bytes_.data(), byte, bytes_.size());
}

bool Tensor::bitwise_equal(const Tensor& o) const {
  return dtype_ == o.dtype_ && shape_ == o.shape_ &&
         (bytes_.empty() || std::memcmp(bytes_.data(), o.bytes_.data(), bytes_.size()) == 0);
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_);
}

std::string TensorMeta::describe() const {
  return std::string(dtype_name(dtype)) + shape_str(shape);
}

void require_rank(const TensorMeta& t, size_t rank, const std::string& what) {
  if (t.rank() != rank) {
    throw std::invalid_argument(what + ": expected a " + std::to_string(rank) + "-D tensor, got " +
                                t.describe());
  }
}

void require_shape(const TensorMeta& t, const Shape& shape, const std::string& what) {
  if (t.shape != shape) {
    throw std::invalid_argument(what + ": expected shape " + shape_str(shape) + ", got " +
                                t.describe());
  }
}

void require_float_dtype(const TensorMeta& t, const std::string& what, bool allow_f64) {
  const DType d = t.dtype;
  if (d == DType::f32 || d == DType::bf16 || d == DType::f16) return;
  if (d == DType::f64 && allow_f64) return;
  throw std::invalid_argument(what + ": unsupported dtype " + std::string(dtype_name(d)) +
                              " (expected float32, bfloat16 or float16)");
}

void require_index_dtype(const TensorMeta& t, const std::string& what) {
  if (t.dtype == DType::i32 || t.dtype == DType::i64) return;
  throw std::invalid_argument(what + ": unsupported dtype " + std::string(dtype_name(t.dtype)) +
                              " (expected int32 or int64)");
}

}  // namespace moe
