#pragma once
// CountingDevice<D>: wraps a device and counts each operation the library issues on it, by
// kind. On a GPU every operation is one runtime call (an allocation, a copy, a memset, a
// kernel launch), each a few microseconds of host time, so the counts per unit and step
// are the library's device-call budget: tests pin them and benchmarks print them on a
// machine without a GPU. Whatever else D offers (a queue, unscale, quantize, per-tensor
// scaling) is passed through.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "fsdp/core/device.hpp"

namespace fsdp {

enum class DeviceOp : std::uint8_t {
  allocate, deallocate, copy, fill_zero, fill_zero_batch, scale, accumulate, cast, cast_zeroing, unscale, quantize,
  dequantize, abs_max, max_over_rows, quantize_tensor, dequantize_tensor
};
inline constexpr std::size_t device_op_kinds = 16;

constexpr std::string_view name_of(DeviceOp op) {
  constexpr std::array<std::string_view, device_op_kinds> names{
      "allocate", "deallocate", "copy", "fill_zero", "fill_zero_batch", "scale", "accumulate", "cast", "cast_zeroing",
      "unscale", "quantize", "dequantize", "abs_max", "max_over_rows", "quantize_tensor",
      "dequantize_tensor"};
  return names[static_cast<std::size_t>(op)];
}

struct DeviceOpCounts {
  std::array<std::uint64_t, device_op_kinds> by_kind{};
  std::uint64_t& operator[](DeviceOp op) { return by_kind[static_cast<std::size_t>(op)]; }
  std::uint64_t operator[](DeviceOp op) const { return by_kind[static_cast<std::size_t>(op)]; }
  std::uint64_t total() const {
    std::uint64_t n = 0;
    for (auto c : by_kind) n += c;
    return n;
  }
  friend bool operator==(const DeviceOpCounts&, const DeviceOpCounts&) = default;
};

// Operations of zero bytes or elements are not counted: the devices return before any call.
template <Device D>
class CountingDevice {
 public:
  explicit CountingDevice(D& inner) : inner_(&inner) {}

  DeviceId id() const { return inner_->id(); }
  void* allocate(std::size_t bytes, MemorySpace s) { return note(DeviceOp::allocate, bytes), inner_->allocate(bytes, s); }
  void deallocate(void* p, std::size_t bytes, MemorySpace s) {
    if (p) note(DeviceOp::deallocate, bytes);
    inner_->deallocate(p, bytes, s);
  }
  void copy(void* dst, const void* src, std::size_t bytes) { note(DeviceOp::copy, bytes), inner_->copy(dst, src, bytes); }
  void fill_zero(void* p, std::size_t bytes) { note(DeviceOp::fill_zero, bytes), inner_->fill_zero(p, bytes); }
  void scale(void* p, std::size_t n, DType t, double f) { note(DeviceOp::scale, n), inner_->scale(p, n, t, f); }
  void accumulate(void* dst, const void* src, std::size_t n, DType t) {
    note(DeviceOp::accumulate, n), inner_->accumulate(dst, src, n, t);
  }
  void cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
    note_cast(dst, to, src, from, n);
    inner_->cast(dst, to, src, from, n);
  }
  void synchronize() { inner_->synchronize(); }
  MemoryStats stats(MemorySpace s = MemorySpace::device) const { return inner_->stats(s); }
  void reset_peak(MemorySpace s = MemorySpace::device) { inner_->reset_peak(s); }

  // One call however many buffers (none: not a call).
  void fill_zero_batch(std::span<const ZeroSpan> spans)
    requires BatchZeroingDevice<D>
  {
    note(DeviceOp::fill_zero_batch, bytes_of(spans)), inner_->fill_zero_batch(spans);
  }
  // One call: the cast and the zeroing (a cast to its own dtype counts as cast does, the
  // zeroing as a batch, the two calls a device makes for them).
  void cast_zeroing(void* dst, DType to, const void* src, DType from, std::size_t n, std::span<const ZeroSpan> spans)
    requires CastZeroingDevice<D>
  {
    const std::size_t bytes = bytes_of(spans);
    if (to != from && n && bytes) note(DeviceOp::cast_zeroing, n);
    else note(DeviceOp::fill_zero_batch, bytes), note_cast(dst, to, src, from, n);
    inner_->cast_zeroing(dst, to, src, from, n, spans);
  }
  void unscale(void* p, std::size_t n, DType t, double inv)
    requires UnscalingDevice<D>
  {
    note(DeviceOp::unscale, n), inner_->unscale(p, n, t, inv);
  }
  bool found_nonfinite()
    requires UnscalingDevice<D>
  {
    return inner_->found_nonfinite();
  }
  void quantize(QuantFormat f, const float* x, std::size_t n, void* q, void* scales, std::size_t block)
    requires QuantizingDevice<D>
  {
    note(DeviceOp::quantize, n), inner_->quantize(f, x, n, q, scales, block);
  }
  void dequantize(QuantFormat f, const void* q, const void* scales, std::size_t n, float* x, std::size_t block)
    requires QuantizingDevice<D>
  {
    note(DeviceOp::dequantize, n), inner_->dequantize(f, q, scales, n, x, block);
  }
  std::optional<std::size_t> quantize_nonfinite()
    requires QuantizingDevice<D>
  {
    return inner_->quantize_nonfinite();
  }
  // abs_max is one call even over no values: it still writes its 0.
  void abs_max(const float* x, std::size_t n, float* out)
    requires TensorScalingDevice<D>
  {
    note(DeviceOp::abs_max, 1), inner_->abs_max(x, n, out);
  }
  void max_over_rows(const float* in, std::size_t rows, std::size_t n, float* out)
    requires TensorScalingDevice<D>
  {
    note(DeviceOp::max_over_rows, n), inner_->max_over_rows(in, rows, n, out);
  }
  void quantize_tensor(QuantFormat f, const float* x, std::size_t n, void* q, const float* amax)
    requires TensorScalingDevice<D>
  {
    note(DeviceOp::quantize_tensor, n), inner_->quantize_tensor(f, x, n, q, amax);
  }
  void dequantize_tensor(QuantFormat f, const void* q, std::size_t n, const float* amax, float* y)
    requires TensorScalingDevice<D>
  {
    note(DeviceOp::dequantize_tensor, n), inner_->dequantize_tensor(f, q, n, amax, y);
  }
  DeviceQueue queue() const
    requires QueuedDevice<D>
  {
    return inner_->queue();
  }

  const DeviceOpCounts& counts() const { return counts_; }
  void reset() { counts_ = {}; }

 private:
  void note(DeviceOp op, std::size_t size) {
    if (size) ++counts_[op];
  }
  static std::size_t bytes_of(std::span<const ZeroSpan> spans) {
    std::size_t bytes = 0;
    for (const ZeroSpan& s : spans) bytes += s.bytes;
    return bytes;
  }
  // A cast to its own dtype is a copy on every device (or nothing, in place).
  void note_cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
    if (to != from) note(DeviceOp::cast, n);
    else if (dst != src) note(DeviceOp::copy, n);
  }

  D* inner_;
  DeviceOpCounts counts_;
};

}  // namespace fsdp
