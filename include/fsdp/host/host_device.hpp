#pragma once
// HostDevice: plain host memory with exact byte accounting per memory space. Both spaces
// are host RAM here; keeping them apart lets host-only tests measure what offloading to
// "host" saves on "device", as it would on a GPU.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <utility>

#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/detail/memory_counter.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/error.hpp"
#if FSDP_DEFINES_IMPLEMENTATION  // only the quantize members, compiled once under FSDP_SEPARATE_COMPILATION
#include "fsdp/core/quantize.hpp"
#endif

namespace fsdp {

class HostDevice {
 public:
  static constexpr std::size_t alignment = 64;  // cache line; also what vector loads want

  DeviceId id() const { return {DeviceKind::cpu, 0}; }

  void* allocate(std::size_t bytes, MemorySpace space = MemorySpace::device) {
    if (bytes == 0) return nullptr;
    void* p = ::operator new(bytes, std::align_val_t{alignment}, std::nothrow);
    if (!p)
      detail::fail_as(ErrorKind::out_of_memory, "HostDevice: out of memory allocating ", bytes, " bytes in ",
                      name_of(space), " space");
    counter_.allocated(bytes, space);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, MemorySpace space = MemorySpace::device) {
    if (!p) return;
    counter_.check_free(bytes, space, "HostDevice");
    counter_.freed(bytes, space);
    ::operator delete(p, std::align_val_t{alignment});
  }

  void copy(void* dst, const void* src, std::size_t bytes) { if (bytes) std::memmove(dst, src, bytes); }
  void fill_zero(void* p, std::size_t bytes) { if (bytes) std::memset(p, 0, bytes); }
  void fill_zero_batch(std::span<const ZeroSpan> spans) {
    for (const ZeroSpan& s : spans) fill_zero(s.data, s.bytes);
  }
  void scale(void* p, std::size_t n, DType t, double f) { detail::host_scale(p, n, t, f); }
  void accumulate(void* dst, const void* src, std::size_t n, DType t) {
    detail::host_combine(dst, src, n, t, ReduceOp::sum);
  }
  void cast(void* dst, DType to, const void* src, DType from, std::size_t n) { detail::host_cast(dst, to, src, from, n); }
  void cast_zeroing(void* dst, DType to, const void* src, DType from, std::size_t n, std::span<const ZeroSpan> spans) {
    detail::zero_then_cast(*this, dst, to, src, from, n, spans);
  }
  void synchronize() {}
  // ShardedGradScaler's unscale (see UnscalingDevice).
  void unscale(void* p, std::size_t n, DType t, double inv_scale) {
    if (!is_floating(t)) detail::fail("HostDevice: unscale needs a floating dtype, got ", name_of(t));
    nonfinite_ |= detail::host_unscale(p, n, t, inv_scale);
  }
  bool found_nonfinite() { return std::exchange(nonfinite_, false); }

  // Block quantization (see QuantizingDevice): fsdp/core/quantize.hpp's functions, with a
  // block holding an inf or NaN written as a NaN block and remembered, as CudaDevice's
  // kernel does.
  void quantize(QuantFormat f, const float* x, std::size_t n, void* q, void* scales, std::size_t block);
  void dequantize(QuantFormat f, const void* q, const void* scales, std::size_t n, float* x, std::size_t block);
  std::optional<std::size_t> quantize_nonfinite() { return std::exchange(first_bad_, std::nullopt); }
  // Per-tensor scaling (see TensorScalingDevice): fsdp/core/quantize.hpp's
  // detail::abs_max_or_inf, max_over_rows, quantize_tensor_with_amax and
  // dequantize_tensor_with_amax.
  void abs_max(const float* x, std::size_t n, float* out);
  void max_over_rows(const float* in, std::size_t rows, std::size_t n, float* out);
  void quantize_tensor(QuantFormat f, const float* x, std::size_t n, void* q, const float* amax);
  void dequantize_tensor(QuantFormat f, const void* q, std::size_t n, const float* amax, float* y);

  MemoryStats stats(MemorySpace space = MemorySpace::device) const { return counter_.stats(space); }
  void reset_peak(MemorySpace space = MemorySpace::device) { counter_.reset_peak(space); }

 private:
  detail::MemoryCounter counter_;
  bool nonfinite_ = false;  // an unscale since the last found_nonfinite() saw inf/NaN
  std::optional<std::size_t> first_bad_;  // a quantize's lowest inf/NaN since the last quantize_nonfinite()
};

static_assert(UnscalingDevice<HostDevice>);
static_assert(QuantizingDevice<HostDevice>);
static_assert(TensorScalingDevice<HostDevice>);

#if FSDP_DEFINES_IMPLEMENTATION
FSDP_DECL void HostDevice::quantize(QuantFormat f, const float* x, std::size_t n, void* q, void* scales,
                                    std::size_t block) {
  check_quant_block(f, block, "HostDevice::quantize");
  if (const auto bad = detail::quantize_poisoning_nonfinite(f, x, n, q, scales, block))
    first_bad_ = first_bad_ ? std::min(*first_bad_, *bad) : *bad;
}

FSDP_DECL void HostDevice::dequantize(QuantFormat f, const void* q, const void* scales, std::size_t n, float* x,
                                      std::size_t block) {
  check_quant_block(f, block, "HostDevice::dequantize");
  detail::dequantize_any(f, q, scales, n, x, block);
}

FSDP_DECL void HostDevice::abs_max(const float* x, std::size_t n, float* out) { *out = detail::abs_max_or_inf(x, n); }

FSDP_DECL void HostDevice::max_over_rows(const float* in, std::size_t rows, std::size_t n, float* out) {
  detail::max_over_rows(in, rows, n, out);
}

FSDP_DECL void HostDevice::quantize_tensor(QuantFormat f, const float* x, std::size_t n, void* q, const float* amax) {
  detail::quantize_tensor_with_amax(f, x, n, static_cast<std::uint8_t*>(q), *amax);
}

FSDP_DECL void HostDevice::dequantize_tensor(QuantFormat f, const void* q, std::size_t n, const float* amax, float* y) {
  detail::dequantize_tensor_with_amax(f, static_cast<const std::uint8_t*>(q), n, *amax, y);
}
#endif  // FSDP_DEFINES_IMPLEMENTATION

}  // namespace fsdp
