#pragma once
// HostTensor: a minimal tensor for host-only engines and tests. It owns its storage until
// the library rebinds it to a view of library-owned storage (keep/restore give it back if
// that take-over fails). HostTensor::without_storage(shape, dtype) builds one with a shape
// and a dtype but no storage, for a model built for fsdp::deferred_init.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "fsdp/core/tensor.hpp"

namespace fsdp {

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(std::vector<std::int64_t> shape, DType dtype = DType::f32)
      : shape_(std::move(shape)), dtype_(dtype) {
    std::int64_t n = 1;
    for (auto d : shape_) n *= d;
    owned_.assign(static_cast<std::size_t>(n) * size_of(dtype_), std::byte{0});
    data_ = owned_.empty() ? nullptr : owned_.data();
  }
  // A shape and a dtype, no storage (data() null, owns_storage() false): a parameter or
  // gradient of a model built from shapes and dtypes alone, which fsdp::deferred_init binds
  // to storage unit by unit (fsdp/model/deferred_init.hpp).
  static HostTensor without_storage(std::vector<std::int64_t> shape, DType dtype = DType::f32) {
    HostTensor t;
    t.shape_ = std::move(shape);
    t.dtype_ = dtype;
    return t;
  }

  std::span<const std::int64_t> shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape_) n *= d;
    return n;
  }
  void* data() { return data_; }
  const void* data() const { return data_; }
  template <class T> T* as() { return static_cast<T*>(data_); }
  template <class T> const T* as() const { return static_cast<const T*>(data_); }
  bool owns_storage() const { return !owned_.empty(); }

  // Becomes a view of `p` (nullptr: no storage); drops any storage it owned.
  void rebind(void* p) {
    owned_.clear();
    owned_.shrink_to_fit();
    data_ = p;
  }

  // The storage it shows, handed to the caller (the tensor still views it, without owning
  // it): fsdp keeps it while it takes over a model, so that a failed take-over loses nothing.
  struct Kept {
    std::vector<std::byte> owned;
    void* data;
  };
  Kept keep_storage() { return {std::move(owned_), data_}; }
  // Owns and shows that storage again.
  void restore_storage(Kept&& k) noexcept {
    owned_ = std::move(k.owned);
    data_ = k.data;
  }

 private:
  std::vector<std::int64_t> shape_;
  DType dtype_ = DType::f32;
  std::vector<std::byte> owned_;
  void* data_ = nullptr;
};

template <>
struct tensor_traits<HostTensor> {
  static DType dtype(const HostTensor& t) { return t.dtype(); }
  static std::span<const std::int64_t> shape(const HostTensor& t) { return t.shape(); }
  static void* data(HostTensor& t) { return t.data(); }
  static DeviceId device(const HostTensor&) { return {DeviceKind::cpu, 0}; }
  static void rebind(HostTensor& t, void* p) { t.rebind(p); }
  static HostTensor::Kept keep(HostTensor& t) { return t.keep_storage(); }
  static void restore(HostTensor& t, HostTensor::Kept&& k) noexcept { t.restore_storage(std::move(k)); }
};

static_assert(Tensor<HostTensor> && KeepsStorage<HostTensor>);

}  // namespace fsdp
