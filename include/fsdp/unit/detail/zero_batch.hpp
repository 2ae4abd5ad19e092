#pragma once
// Zeroing gathered into fewer device calls:
//   - ShardedModel::zero_grad collects every unit's sharded gradients and zeroes the
//     device-space ones of one device with one fill_zero_batch (one kernel launch on
//     CUDA, not one memset per unit);
//   - pre_backward collects the gradients it binds fresh (unsharded ones, or a sharded one
//     a hook freed where the engine adds into it), and the cast that gathers the next unit
//     ahead zeroes them too (cast_zeroing: one launch, not two).
// Host-space buffers (offloaded) are zeroed at once. Whoever fills a batch flushes it, also
// when leaving by exception: the units already count those buffers as zero.
#include <array>
#include <optional>
#include <span>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/unit_internals_fwd.hpp"

namespace fsdp::detail {

class ZeroBatch {
 public:
  ZeroBatch() = default;
  ~ZeroBatch() {  // left by an exception (or never flushed): what was added is still zeroed
    try {
      flush();
    } catch (...) {  // the caller is already failing with an error of its own
    }
  }
  ZeroBatch(const ZeroBatch&) = delete;
  ZeroBatch& operator=(const ZeroBatch&) = delete;

  void add(const DeviceRef& device, void* p, std::size_t bytes, MemorySpace space) {
    if (!p || bytes == 0) return;
    if (space == MemorySpace::host) return device.fill_zero(p, bytes);
    if (device_ && device_->address() != device.address()) flush();  // one batch per device
    device_.emplace(device);
    push({p, bytes});
  }

  // A cast on `device` that also zeroes what waits for that device, in one call where it
  // can. The cast's buffers are not the batch's (they belong to another unit).
  void cast(const DeviceRef& device, void* dst, DType to, const void* src, DType from, std::size_t n) {
    if (count_ == 0 || to == from || n == 0 || device_->address() != device.address())
      return device.cast(dst, to, src, from, n);
    device.cast_zeroing(dst, to, src, from, n, spans());
    clear();
  }

  // Empty afterwards, also when the device call throws. A lone buffer goes the same way:
  // the device knows best how to zero it (CudaDevice: a memset).
  void flush() {
    if (count_ == 0) return;
    struct EmptyAfter {
      ZeroBatch& b;
      ~EmptyAfter() { b.clear(); }
    } empty_after{*this};
    device_->fill_zero_batch(spans());
  }

  std::size_t pending() const { return count_; }
  void reserve(std::size_t buffers) {  // for a model's many: one allocation, not one per doubling
    if (buffers > inline_.size()) more_.reserve(buffers);
  }

  // fill(batch), then the flush; when the flush throws, on_flush_error runs first. When
  // fill throws, what it added is flushed too and fill's error goes on (a flush failing
  // then runs on_flush_error as well: what was added already counts as zero).
  template <class Fill, class OnFlushError = void (*)()>
  static void run(Fill&& fill, OnFlushError on_flush_error = [] {}) {
    ZeroBatch batch;
    auto flush = [&] {
      try {
        batch.flush();
      } catch (...) {
        on_flush_error();
        throw;
      }
    };
    try {
      fill(batch);
    } catch (...) {
      try {
        flush();
      } catch (...) {  // fill's error is the one to report
      }
      throw;
    }
    flush();
  }

 private:
  // A unit's few buffers stay inline (no allocation per hook); a model's go to the heap.
  std::span<const ZeroSpan> spans() const {
    return count_ <= inline_.size() ? std::span<const ZeroSpan>(inline_.data(), count_) : std::span<const ZeroSpan>(more_);
  }
  void push(ZeroSpan z) {
    if (count_ < inline_.size()) inline_[count_] = z;
    else {
      if (count_ == inline_.size()) more_.assign(inline_.begin(), inline_.end());
      more_.push_back(z);
    }
    ++count_;
  }
  void clear() {
    count_ = 0;
    more_.clear();
    device_.reset();
  }

  std::optional<DeviceRef> device_;
  std::array<ZeroSpan, 4> inline_{};
  std::size_t count_ = 0;
  std::vector<ZeroSpan> more_;
};

// Each unit's zero_grad(batch), then one flush. The units count
// their gradients as zero once they added them, so a flush that fails marks each of them
// failed (`mark`), as a hook that throws does: its next hook asks for abort_step instead of
// training on stale gradients. When a unit throws, the ones before it are zeroed and its
// error goes on. `units`: a range of pointers to units (raw or owning).
template <class Units, class MarkFailed>
void zero_grads(const Units& units, MarkFailed mark) {
  ZeroBatch::run(
      [&](ZeroBatch& batch) {
        batch.reserve(std::size(units));  // a buffer per flat parameter: at least one per unit
        for (const auto& u : units) internals(*u).zero_grad(batch);
      },
      [&] { for (const auto& u : units) mark(*u); });
}

}  // namespace fsdp::detail
