#pragma once
// The reference engine's own tensor: row-major, storage from an engine Allocator, elements
// of a runtime dtype — f32 (the default), f16 or bf16. Layers read elements with get() and
// accumulate with add(), which convert to and from float; f32 code may also use data() and
// operator[] directly. It knows nothing of fsdp beyond fsdp::DType and its conversions;
// the tensor_traits specialization at the bottom is the whole integration, and is what a
// real engine would write for its own type.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/core/tensor.hpp>

namespace engine {

// Where the engine gets memory. The default is plain new/delete; tests pass a counting one.
struct Allocator {
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) = 0;
};

struct HeapAllocator final : Allocator {
  void* allocate(std::size_t bytes) override { return bytes ? ::operator new(bytes) : nullptr; }
  void deallocate(void* p, std::size_t) override { ::operator delete(p); }
};

inline HeapAllocator& heap() {
  static HeapAllocator h;
  return h;
}

// The dtypes the engine computes with; any other is refused where a tensor gets its dtype.
inline bool supported(fsdp::DType t) {
  return t == fsdp::DType::f32 || t == fsdp::DType::f16 || t == fsdp::DType::bf16;
}

inline fsdp::DType check_supported(fsdp::DType t) {
  if (!supported(t))
    throw std::invalid_argument("engine::Tensor: dtype " + std::string(fsdp::name_of(t)) +
                                " is not supported (f32, f16 and bf16 are)");
  return t;
}

// v rounded to the nearest value of dtype t (ties to even), as a float. f64 is exact for
// any float, so it is the identity too (a reduce dtype of f64 is meaningful).
inline float round_to(fsdp::DType t, float v) {
  switch (t) {
    case fsdp::DType::f32: case fsdp::DType::f64: return v;
    case fsdp::DType::f16: return fsdp::f16_bits_to_float(fsdp::float_to_f16_bits(v));
    case fsdp::DType::bf16: return fsdp::bf16_bits_to_float(fsdp::float_to_bf16_bits(v));
    default: break;
  }
  throw std::invalid_argument("engine::round_to: " + std::string(fsdp::name_of(t)) + " is not a floating dtype");
}

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::vector<std::int64_t> shape, Allocator& alloc = heap(), fsdp::DType dtype = fsdp::DType::f32)
      : shape_(std::move(shape)), dtype_(check_supported(dtype)) {
    const std::size_t bytes = static_cast<std::size_t>(numel()) * fsdp::size_of(dtype_);
    data_ = alloc.allocate(bytes);
    alloc_ = &alloc;
    bytes_ = bytes;
    if (bytes_) std::memset(data_, 0, bytes_);  // all-zero bits are +0 in every supported dtype
  }
  // A shape and a dtype, no storage yet (deferred initialization: fsdp binds storage to it
  // and the model's reset_parameters() fills it; see fsdp::deferred_init).
  static Tensor without_storage(std::vector<std::int64_t> shape, fsdp::DType dtype = fsdp::DType::f32) {
    Tensor t;
    t.shape_ = std::move(shape);
    t.dtype_ = check_supported(dtype);
    return t;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&& o) noexcept { *this = std::move(o); }
  Tensor& operator=(Tensor&& o) noexcept {
    release();
    shape_ = std::move(o.shape_);
    data_ = o.data_;
    alloc_ = o.alloc_;
    bytes_ = o.bytes_;
    dtype_ = o.dtype_;
    o.data_ = nullptr;
    o.alloc_ = nullptr;
    o.bytes_ = 0;
    return *this;
  }
  ~Tensor() { release(); }

  std::span<const std::int64_t> shape() const { return shape_; }
  std::int64_t numel() const {
    return std::accumulate(shape_.begin(), shape_.end(), std::int64_t{1}, std::multiplies<>());
  }
  fsdp::DType dtype() const { return dtype_; }
  void* raw() { return data_; }
  const void* raw() const { return data_; }

  // f32 only: the elements as floats. Other dtypes throw std::logic_error; use get/set/add.
  float* data() { return static_cast<float*>(f32_storage()); }
  const float* data() const { return static_cast<const float*>(f32_storage()); }
  float& operator[](std::int64_t i) { return data()[i]; }
  float operator[](std::int64_t i) const { return data()[i]; }

  // Any dtype: element i as a float; v rounded to the dtype (nearest, ties to even);
  // element i += v, the sum taken in float and rounded to the dtype once, which is how a
  // gradient held in a low-precision dtype accumulates. For f32 these are exactly x,
  // x = v and x += v.
  float get(std::int64_t i) const {
    switch (dtype_) {
      case fsdp::DType::f32: return static_cast<const float*>(data_)[i];
      case fsdp::DType::f16: return fsdp::f16_bits_to_float(static_cast<const std::uint16_t*>(data_)[i]);
      default: return fsdp::bf16_bits_to_float(static_cast<const std::uint16_t*>(data_)[i]);
    }
  }
  void set(std::int64_t i, float v) {
    switch (dtype_) {
      case fsdp::DType::f32: static_cast<float*>(data_)[i] = v; return;
      case fsdp::DType::f16: static_cast<std::uint16_t*>(data_)[i] = fsdp::float_to_f16_bits(v); return;
      default: static_cast<std::uint16_t*>(data_)[i] = fsdp::float_to_bf16_bits(v); return;
    }
  }
  void add(std::int64_t i, float v) {
    if (dtype_ == fsdp::DType::f32) static_cast<float*>(data_)[i] += v;
    else set(i, get(i) + v);
  }

  // Becomes a view of storage someone else owns (or of nothing: p == nullptr), keeping its
  // shape; frees its own. The first form keeps the dtype, the second takes `dtype`.
  void rebind(void* p) {
    release();
    data_ = p;
  }
  void rebind(void* p, fsdp::DType dtype) {
    check_supported(dtype);
    release();
    data_ = p;
    dtype_ = dtype;
  }

  // The storage the tensor shows, handed to the caller: freed when the Kept is destroyed,
  // unless restore_storage takes it back. The tensor still views it meanwhile. fsdp keeps
  // the storage of every tensor while it takes over a model, so a failed take-over (a
  // rebind that throws) gives every tensor its storage and values back.
  class Kept {
   public:
    Kept(Kept&& o) noexcept
        : alloc_(std::exchange(o.alloc_, nullptr)), data_(o.data_), bytes_(o.bytes_), dtype_(o.dtype_) {}
    Kept& operator=(Kept&&) = delete;
    ~Kept() {
      if (alloc_ && bytes_) alloc_->deallocate(data_, bytes_);
    }

   private:
    friend class Tensor;
    Kept(Allocator* alloc, void* data, std::size_t bytes, fsdp::DType dtype)
        : alloc_(alloc), data_(data), bytes_(bytes), dtype_(dtype) {}
    Allocator* alloc_;  // null: the tensor was a view, nothing to free
    void* data_;
    std::size_t bytes_;
    fsdp::DType dtype_;
  };
  Kept keep_storage() { return Kept(std::exchange(alloc_, nullptr), data_, std::exchange(bytes_, 0), dtype_); }
  void restore_storage(Kept&& k) noexcept {
    release();
    data_ = k.data_;
    alloc_ = std::exchange(k.alloc_, nullptr);
    bytes_ = k.bytes_;
    dtype_ = k.dtype_;
  }

 private:
  void* f32_storage() const {
    if (dtype_ != fsdp::DType::f32) [[unlikely]] throw_not_f32();
    return data_;
  }
  [[noreturn]] void throw_not_f32() const {
    throw std::logic_error("engine::Tensor: data()/operator[] need an f32 tensor; this one is " +
                           std::string(fsdp::name_of(dtype_)) + " (use get/set/add)");
  }
  void release() {
    if (alloc_ && bytes_) alloc_->deallocate(data_, bytes_);
    alloc_ = nullptr;
    bytes_ = 0;
    data_ = nullptr;
  }
  std::vector<std::int64_t> shape_;
  void* data_ = nullptr;
  Allocator* alloc_ = nullptr;  // set while the tensor owns its storage
  std::size_t bytes_ = 0;
  fsdp::DType dtype_ = fsdp::DType::f32;
};

// How the layers' loops reach elements: a plain float pointer when the tensor is f32 (the
// common case, and exactly the arithmetic of a float array), or the tensor's own
// get/add, which convert, otherwise. with_access() picks once per call, not per element.
// F32Access is inlined even where nothing else is (the tests' unoptimized builds): the
// layers' inner loops call it once per multiply-add.
struct F32Access {
  float* p;
  [[gnu::always_inline]] float get(std::int64_t i) const { return p[i]; }
  [[gnu::always_inline]] void add(std::int64_t i, float v) const { p[i] += v; }
};
struct AnyAccess {
  Tensor* t;
  float get(std::int64_t i) const { return t->get(i); }
  void add(std::int64_t i, float v) const { t->add(i, v); }
};

// f(access...) with one accessor per tensor: all F32Access when every tensor is f32, all
// AnyAccess otherwise (two instantiations of f, not one per combination of dtypes).
template <class F, class... Ts>
decltype(auto) with_access(F&& f, Ts&... ts) {
  if (((ts.dtype() == fsdp::DType::f32) && ...)) return f(F32Access{static_cast<float*>(ts.raw())}...);
  return f(AnyAccess{&ts}...);
}

}  // namespace engine

template <>
struct fsdp::tensor_traits<engine::Tensor> {
  static fsdp::DType dtype(const engine::Tensor& t) { return t.dtype(); }
  static std::span<const std::int64_t> shape(const engine::Tensor& t) { return t.shape(); }
  static void* data(engine::Tensor& t) { return t.raw(); }
  static fsdp::DeviceId device(const engine::Tensor&) { return {fsdp::DeviceKind::cpu, 0}; }
  // The parameter becomes a view of library-owned storage of its own dtype...
  static void rebind(engine::Tensor& t, void* p) { t.rebind(p); }
  // ...or, under mixed precision, of storage of another dtype (say bf16 for an f32 parameter).
  static void rebind(engine::Tensor& t, void* p, fsdp::DType d) { t.rebind(p, d); }
  // Optional: while fsdp takes over the model it keeps each tensor's storage, and gives it
  // back if a rebind throws (so a failed fsdp::shard loses no values).
  static engine::Tensor::Kept keep(engine::Tensor& t) { return t.keep_storage(); }
  static void restore(engine::Tensor& t, engine::Tensor::Kept&& k) noexcept { t.restore_storage(std::move(k)); }
};
