#pragma once
// The reference engine's own tensor: f32, row-major, storage from an engine Allocator.
// It knows nothing of fsdp; the tensor_traits specialization at the bottom is the whole
// integration, and is what a real engine would write for its own type.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

#include <fsdp/tensor.hpp>

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

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::vector<std::int64_t> shape, Allocator& alloc = heap()) : shape_(std::move(shape)), alloc_(&alloc) {
    bytes_ = static_cast<std::size_t>(numel()) * sizeof(float);
    data_ = static_cast<float*>(alloc_->allocate(bytes_));
    if (bytes_) std::memset(data_, 0, bytes_);
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
  float* data() { return data_; }
  const float* data() const { return data_; }
  float& operator[](std::int64_t i) { return data_[i]; }
  float operator[](std::int64_t i) const { return data_[i]; }

  // Becomes a view of storage someone else owns (or of nothing); frees its own.
  void rebind(float* p) {
    release();
    data_ = p;
  }

 private:
  void release() {
    if (alloc_ && bytes_) alloc_->deallocate(data_, bytes_);
    alloc_ = nullptr;
    bytes_ = 0;
    data_ = nullptr;
  }
  std::vector<std::int64_t> shape_;
  float* data_ = nullptr;
  Allocator* alloc_ = nullptr;  // set while the tensor owns its storage
  std::size_t bytes_ = 0;
};

}  // namespace engine

template <>
struct fsdp::tensor_traits<engine::Tensor> {
  static fsdp::DType dtype(const engine::Tensor&) { return fsdp::DType::f32; }
  static std::span<const std::int64_t> shape(const engine::Tensor& t) { return t.shape(); }
  static void* data(engine::Tensor& t) { return t.data(); }
  static fsdp::DeviceId device(const engine::Tensor&) { return {fsdp::DeviceKind::cpu, 0}; }
  static void rebind(engine::Tensor& t, void* p) { t.rebind(static_cast<float*>(p)); }
};
