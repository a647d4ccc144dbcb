// The kernel interface's operand: a typed tensor — where its elements are, their type, its shape
// and its strides (docs/design.md §6.1, "Operands"). A Tensor owns nothing: it describes memory
// a backend allocated (or host memory on a backend whose memory is the host's). Backend's public
// ops take tensors and check their types and shapes once, for every backend, before any runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace dstrain::kernels {

// Element types. Low-precision values are 16-bit patterns (uint16_t): bf16 (8-bit exponent) and
// IEEE fp16; conversions from fp32 round to nearest even. kI32 holds indices (token ids, expert
// selections, dispatch positions), kF64 the gradient norm's sum.
enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kF64 };
inline int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF64:
      return 8;
    default:
      return 4;
  }
}
inline const char* to_string(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kI32:
      return "int32";
    case DType::kF64:
      return "fp64";
  }
  return "?";
}
// fp32, bf16 or fp16: a type the floating-point ops may store.
inline bool is_float_storage(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// The element type of a C++ pointer's target (16-bit floats have none: their type is a DType).
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::kF64;
};

// A typed pointer without a shape — the engine's name for a buffer whose element type is known
// only at run time (the 16-bit compute copies, the 16-bit activations).
struct ConstView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};
struct View {
  void* data = nullptr;
  DType dtype = DType::kF32;
};
inline ConstView f32(const float* p) { return {p, DType::kF32}; }
// The view `elements` elements past v's start.
inline View offset_view(View v, int64_t elements) {
  return {static_cast<char*>(v.data) + elements * dtype_size(v.dtype), v.dtype};
}

// Up to four sizes: a tensor's shape, or its strides (in elements).
struct Dims {
  static constexpr int kMax = 4;
  Dims() = default;
  Dims(std::initializer_list<int64_t> sizes) {
    if (sizes.size() > size_t(kMax)) throw std::invalid_argument("a tensor of more than 4 dimensions");
    for (int64_t s : sizes) v_[n_++] = s;
  }
  int size() const { return n_; }
  int64_t operator[](int i) const { return v_[i]; }
  int64_t& operator[](int i) { return v_[i]; }
  int64_t product() const {
    int64_t p = 1;
    for (int i = 0; i < n_; ++i) p *= v_[i];
    return p;
  }
  bool operator==(const Dims& o) const {
    if (n_ != o.n_) return false;
    for (int i = 0; i < n_; ++i)
      if (v_[i] != o.v_[i]) return false;
    return true;
  }
  bool operator!=(const Dims& o) const { return !(*this == o); }
  // "[4, 8]"
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < n_; ++i) s += (i ? ", " : "") + std::to_string(v_[i]);
    return s + "]";
  }
  // The strides of a row-major tensor of this shape with no gaps.
  Dims contiguous_strides() const {
    Dims st;
    st.n_ = n_;
    int64_t s = 1;
    for (int i = n_ - 1; i >= 0; --i) st.v_[i] = s, s *= v_[i];
    return st;
  }

 private:
  int n_ = 0;
  int64_t v_[kMax] = {};
};

// A tensor over memory of type Ptr (void* or const void*). Built from a typed pointer and a shape
// ({x, {rows, H}}: fp32 from a float*, int32 from an int32_t*, fp64 from a double*), from a View
// and a shape (the view's type), or with explicit strides; row-major and gap-free unless strides
// say otherwise. A default-built tensor is absent (no data): the ops' optional operands.
template <class Ptr>
struct BasicTensor {
  static constexpr bool kConst = std::is_same_v<Ptr, const void*>;

  Ptr data = nullptr;
  DType dtype = DType::kF32;
  Dims shape;
  Dims strides;

  BasicTensor() = default;
  BasicTensor(Ptr p, DType t, Dims s) : data(p), dtype(t), shape(s), strides(s.contiguous_strides()) {}
  BasicTensor(Ptr p, DType t, Dims s, Dims st) : data(p), dtype(t), shape(s), strides(st) {
    if (st.size() != s.size())
      throw std::invalid_argument("a tensor of shape " + s.str() + " given strides " + st.str());
  }
  template <class T, class = std::enable_if_t<std::is_convertible_v<T*, Ptr>>,
            class = decltype(dtype_of<std::remove_const_t<T>>::value)>
  BasicTensor(T* p, Dims s) : BasicTensor(p, dtype_of<std::remove_const_t<T>>::value, s) {}
  template <class T, class = std::enable_if_t<std::is_convertible_v<T*, Ptr>>,
            class = decltype(dtype_of<std::remove_const_t<T>>::value)>
  BasicTensor(T* p, Dims s, Dims st) : BasicTensor(p, dtype_of<std::remove_const_t<T>>::value, s, st) {}
  BasicTensor(View v, Dims s) : BasicTensor(v.data, v.dtype, s) {}
  BasicTensor(View v, Dims s, Dims st) : BasicTensor(v.data, v.dtype, s, st) {}
  template <class P = Ptr, class = std::enable_if_t<std::is_same_v<P, const void*>>>
  BasicTensor(ConstView v, Dims s) : BasicTensor(v.data, v.dtype, s) {}
  template <class P = Ptr, class = std::enable_if_t<std::is_same_v<P, const void*>>>
  BasicTensor(ConstView v, Dims s, Dims st) : BasicTensor(v.data, v.dtype, s, st) {}
  // A writable tensor is a readable one.
  template <class P = Ptr, class = std::enable_if_t<std::is_same_v<P, const void*>>>
  BasicTensor(const BasicTensor<void*>& t) : data(t.data), dtype(t.dtype), shape(t.shape), strides(t.strides) {}

  int rank() const { return shape.size(); }
  int64_t size(int i) const { return shape[i]; }
  int64_t stride(int i) const { return strides[i]; }
  int64_t numel() const { return rank() ? shape.product() : 0; }  // an absent tensor has none
  bool present() const { return data != nullptr; }
  bool contiguous() const { return strides == shape.contiguous_strides(); }
  template <class T>
  auto as() const {
    if constexpr (kConst)
      return static_cast<const T*>(data);
    else
      return static_cast<T*>(data);
  }
  // "fp32 [4, 8]"
  std::string str() const { return std::string(to_string(dtype)) + " " + shape.str(); }
};
using Tensor = BasicTensor<void*>;
using ConstTensor = BasicTensor<const void*>;

}  // namespace dstrain::kernels
