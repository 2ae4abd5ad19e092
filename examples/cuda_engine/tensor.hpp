#pragma once
// The CUDA engine's tensor: a raw device pointer, a row-major shape and a dtype (f32 or
// bf16). It may own its storage (from the engine's StreamAllocator) until fsdp rebinds it
// to storage the library owns; fsdp::tensor_traits at the bottom is the whole integration.
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/core/tensor.hpp>

#include "examples/cuda_engine/cuda_calls.hpp"

namespace cuda_engine {

class Tensor {
 public:
  Tensor() = default;
  // Shape and dtype only: storage comes later (fsdp binds gradients under sharding).
  Tensor(std::vector<std::int64_t> shape, fsdp::DType dtype, int device)
      : shape_(std::move(shape)), dtype_(dtype), device_(device) {}
  // With storage of its own, zeroed on the allocator's stream.
  Tensor(std::vector<std::int64_t> shape, fsdp::DType dtype, int device, StreamAllocator& alloc)
      : Tensor(std::move(shape), dtype, device) {
    own_ = Buffer(alloc, bytes());
    data_ = own_.get();
    if (data_) check(cudaMemsetAsync(data_, 0, bytes(), alloc.stream()), "cudaMemsetAsync(tensor, ", bytes(), " bytes)");
  }
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;

  std::span<const std::int64_t> shape() const { return shape_; }
  std::int64_t numel() const {
    return std::accumulate(shape_.begin(), shape_.end(), std::int64_t{1}, std::multiplies<>());
  }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * fsdp::size_of(dtype_); }
  fsdp::DType dtype() const { return dtype_; }
  int device() const { return device_; }
  void* data() const { return data_; }

  // A view of storage someone else owns (nullptr: none), in `dtype`; frees its own.
  void rebind(void* p, fsdp::DType dtype) {
    own_.reset();
    data_ = p;
    dtype_ = dtype;
  }

  // The storage it shows, handed to the caller (the tensor still views it): fsdp keeps it
  // while it takes over the model and gives it back if a rebind throws.
  struct Kept {
    Buffer own;
    void* data;
    fsdp::DType dtype;
  };
  Kept keep_storage() { return {std::move(own_), data_, dtype_}; }
  void restore_storage(Kept&& k) noexcept {
    own_ = std::move(k.own);
    data_ = k.data;
    dtype_ = k.dtype;
  }

 private:
  std::vector<std::int64_t> shape_;
  fsdp::DType dtype_ = fsdp::DType::f32;
  int device_ = 0;
  void* data_ = nullptr;
  Buffer own_;  // set while the tensor owns its storage
};

// The engine computes in f32 and bf16 only; where a tensor of another dtype reaches a
// kernel or a GEMM, this names it.
inline void check_dtype(const Tensor& t, fsdp::DType want, const char* what) {
  if (t.dtype() != want)
    fsdp::detail::fail("cuda_engine: ", what, " is ", fsdp::name_of(t.dtype()), ", expected ", fsdp::name_of(want));
  if (!t.data() && t.numel() > 0) fsdp::detail::fail("cuda_engine: ", what, " has no storage (not unsharded?)");
}

}  // namespace cuda_engine

template <>
struct fsdp::tensor_traits<cuda_engine::Tensor> {
  using T = cuda_engine::Tensor;
  static fsdp::DType dtype(const T& t) { return t.dtype(); }
  static std::span<const std::int64_t> shape(const T& t) { return t.shape(); }
  static void* data(T& t) { return t.data(); }
  static fsdp::DeviceId device(const T& t) { return {fsdp::DeviceKind::cuda, t.device()}; }
  static void rebind(T& t, void* p) { t.rebind(p, t.dtype()); }
  static void rebind(T& t, void* p, fsdp::DType d) { t.rebind(p, d); }  // MixedPrecision
  static T::Kept keep(T& t) { return t.keep_storage(); }  // a failed take-over loses nothing
  static void restore(T& t, T::Kept&& k) noexcept { t.restore_storage(std::move(k)); }
};
