#pragma once
// Buffers under MixedPrecision with a Buffer dtype other than a buffer's own: the unit
// keeps the buffer in both dtypes (the master copy in its own dtype, the cast one for
// computation) and points the engine's tensor at the one in use. Other buffers stay the
// engine's and are not copied.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/unit/detail/take_over.hpp"

namespace fsdp::detail {

class BufferCopies {
 public:
  explicit BufferCopies(DeviceRef device) : device_(device) {}
  BufferCopies(const BufferCopies&) = delete;
  BufferCopies& operator=(const BufferCopies&) = delete;
  ~BufferCopies() { release(); }

  // Copies every buffer of a compute dtype (f32, f64, f16, bf16) other than `cast_to`
  // (nothing when it is empty). Integer and 8-bit float buffers (steps, e8m0 scales) stay the
  // engine's, as they are: a cast would lose their values. The engine's tensors are not
  // touched until show_cast.
  void copy(const std::vector<CollectedBuffer>& buffers, std::optional<DType> cast_to) {
    if (!cast_to) return;
    cast_dtype_ = *cast_to;
    for (auto& b : buffers) {
      if (b.dtype == cast_dtype_ || !is_compute_dtype(b.dtype)) continue;
      auto& c = copies_.emplace_back(Copy{b.fqn, b.dtype, b.numel, b.tensor, b.rebind, b.keep, b.handle});  // freed by release on failure
      c.master = device_.allocate(bytes(b.numel, b.dtype), MemorySpace::device);
      c.cast = device_.allocate(bytes(b.numel, cast_dtype_), MemorySpace::device);
      if (b.numel) device_.copy(c.master, b.data, bytes(b.numel, b.dtype));
      device_.cast(c.cast, cast_dtype_, c.master, b.dtype, static_cast<std::size_t>(b.numel));
    }
  }

  // Points the engine's tensors at the cast copies (the state during training): the take-over.
  void show_cast(TakeOverLog& log) {
    for (auto& c : copies_) log.rebind(c.tensor, c.rebind, c.keep, c.cast, cast_dtype_, c.dtype, "buffer '" + c.fqn + "'");
    shown_ = true;
  }
  // The take-over was rolled back (the log handed the tensors back).
  void forget_shown() noexcept { shown_ = false; }

  // Summon shows buffers in their own dtype; leaving it casts them back (keeping edits).
  void show_master(bool show, bool keep_edits = false) {
    for (auto& c : copies_) {
      const auto n = static_cast<std::size_t>(c.numel);
      if (show) {
        device_.cast(c.master, c.dtype, c.cast, cast_dtype_, n);  // training may have updated it
        c.rebind(c.tensor, c.master, c.dtype);
      } else {
        if (keep_edits) device_.cast(c.cast, cast_dtype_, c.master, c.dtype, n);
        c.rebind(c.tensor, c.cast, cast_dtype_);
      }
    }
  }

  // The master copy of the buffer whose engine tensor is `tensor`, brought up to date from
  // the cast copy the engine computes with; nullptr for a buffer without copies. What state
  // dicts read outside a summon.
  void* current_master(const void* tensor) const {
    for (const auto& c : copies_)
      if (c.tensor == tensor) {
        device_.cast(c.master, c.dtype, c.cast, cast_dtype_, static_cast<std::size_t>(c.numel));
        return c.master;
      }
    return nullptr;
  }

  // Sets the buffer whose engine tensor is `tensor` from `values` (its own dtype, any
  // memory): the master copy, and the cast copy the engine computes with. False for a
  // buffer without copies.
  bool load(const void* tensor, const void* values) {
    for (auto& c : copies_)
      if (c.tensor == tensor) {
        if (c.numel) device_.copy(c.master, values, bytes(c.numel, c.dtype));
        device_.cast(c.cast, cast_dtype_, c.master, c.dtype, static_cast<std::size_t>(c.numel));
        return true;
      }
    return false;
  }

  // Whether the unit keeps copies of the buffer whose engine tensor is `tensor`.
  bool has_copy(const void* tensor) const {
    for (const auto& c : copies_)
      if (c.tensor == tensor) return true;
    return false;
  }

  // Hands the engine's tensors back empty, once they were shown, and frees both copies (the
  // unit's destructor).
  void unbind_and_release() {
    if (shown_)
      for (auto& c : copies_) c.rebind(c.tensor, nullptr, c.dtype);
    release();
  }

 private:
  struct Copy {
    std::string fqn;
    DType dtype;
    std::int64_t numel;
    void* tensor;
    RebindFn rebind;
    KeepFn keep;
    std::shared_ptr<void> handle;  // a handle type's copy, which `tensor` points to
    void* master = nullptr;
    void* cast = nullptr;
  };
  static std::size_t bytes(std::int64_t n, DType t) { return static_cast<std::size_t>(n) * size_of(t); }

  void release() {
    for (auto& c : copies_) {
      if (c.master) device_.deallocate(c.master, bytes(c.numel, c.dtype), MemorySpace::device);
      if (c.cast) device_.deallocate(c.cast, bytes(c.numel, cast_dtype_), MemorySpace::device);
    }
    copies_.clear();
  }

  DeviceRef device_;
  DType cast_dtype_ = DType::f32;
  std::vector<Copy> copies_;
  bool shown_ = false;  // the engine's tensors were taken over
};

}  // namespace fsdp::detail
