#pragma once
// The Device concept: every byte the library allocates goes through it, so it can count
// live and peak bytes per memory space; plus the few element-wise operations the library
// runs on its own buffers (zeroing, scaling by the divide factors, accumulating gradients),
// and the optional capabilities the library uses where a device has them (unscaling,
// block and per-tensor quantization, batched zeroing, a queue).
#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <string_view>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/quant_format.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

// "device" is where computation happens (GPU memory on CUDA, plain host memory on the
// host device); "host" is the offload target (pinned memory on CUDA).
enum class MemorySpace : std::uint8_t { device, host };

constexpr std::string_view name_of(MemorySpace s) { return s == MemorySpace::device ? "device" : "host"; }

struct MemoryStats {
  std::size_t live_bytes = 0;
  std::size_t peak_bytes = 0;
  std::size_t allocations = 0;  // allocate() calls of one byte or more, for tests and benchmarks
};

template <class D>
concept Device = requires(D& d, std::size_t bytes, std::size_t count, void* p, const void* cp,
                          MemorySpace s, DType t, double factor) {
  { d.id() } -> std::convertible_to<DeviceId>;
  { d.allocate(bytes, s) } -> std::convertible_to<void*>;
  d.deallocate(p, bytes, s);
  d.copy(p, cp, bytes);                 // any direction between this device's spaces
  d.fill_zero(p, bytes);
  d.scale(p, count, t, factor);         // p[i] *= factor
  d.accumulate(p, cp, count, t);        // p[i] += cp[i]; like copy, either may be in either space
  d.cast(p, t, cp, t, count);           // p[i] = cp[i] converted between dtypes (to, from);
                                        // like copy, the source may be in either space
  d.synchronize();                      // all queued work on this device is done
  { d.stats(s) } -> std::convertible_to<MemoryStats>;
  d.reset_peak(s);                      // peak := live
};

template <class D>
constexpr void check_device() {
  static_assert(Device<D>,
                "fsdp: this type is not an fsdp::Device. It needs id(), allocate(bytes, space), "
                "deallocate(ptr, bytes, space), copy(dst, src, bytes), fill_zero(ptr, bytes), "
                "scale(ptr, count, dtype, factor), accumulate(dst, src, count, dtype), "
                "cast(dst, dst_dtype, src, src_dtype, count), "
                "synchronize(), stats(space) and reset_peak(space). See docs/concepts.md#device.");
}

// A Device that can also run ShardedGradScaler's unscale where the gradients are:
//   d.unscale(p, count, t, inv_scale)  p[i] *= inv_scale for f32/f64/f16/bf16, the product
//                                      taken in double and rounded once; queued like the
//                                      other operations, and remembers any inf/NaN result
//   d.found_nonfinite()                waits for the queued unscales; whether any of them
//                                      since the last call produced inf/NaN; forgets it
// so a step's shards are unscaled with one wait, not one per shard.
template <class D>
concept UnscalingDevice = Device<D> && requires(D& d, void* p, std::size_t n, DType t, double f) {
  d.unscale(p, n, t, f);
  { d.found_nonfinite() } -> std::convertible_to<bool>;
};

// A Device that block-quantizes f32 values (fsdp/core/quantize.hpp's formats, QuantFormat):
//   d.quantize(f, x, n, q, scales, block)    n values of x into n one-byte codes and one
//                                            scale per block (scale_bytes(f) each), queued;
//                                            a block holding an inf or NaN is written as a
//                                            NaN block: zero codes, a NaN scale (0xff in
//                                            e8m0), so it dequantizes to NaNs, never numbers
//   d.dequantize(f, q, scales, n, y, block)  n codes back into f32 values, queued
//   d.quantize_nonfinite()                   waits for the queued quantizes; the lowest
//                                            index of an inf or NaN one of them met since
//                                            the last call, or nullopt; forgets it
// HostDevice and CudaDevice compute the same codes and scales, bit for bit.
template <class D>
concept QuantizingDevice = Device<D> && requires(D& d, QuantFormat f, const float* x, std::size_t n, void* q,
                                                 void* s, float* y) {
  d.quantize(f, x, n, q, s, n);
  d.dequantize(f, q, s, n, y, n);
  { d.quantize_nonfinite() } -> std::same_as<std::optional<std::size_t>>;
};

// A Device that quantizes with one scale per tensor (QuantFormat::f8e4m3_tensor,
// f8e5m2_tensor: CommPrecision<F8E4M3Tensor, ...>), the scale agreed by the ranks first.
// Every pointer is in device space, and the amaxes are read and written by the device, so
// the host never waits on one:
//   d.abs_max(x, n, out)                    *out = max |x[i]| over n values (n may be 0:
//                                           writes 0); +inf when any is inf or NaN, never
//                                           NaN; queued
//   d.max_over_rows(in, rows, n, out)       out[i] = the largest of in[r * n + i] over the
//                                           rows (the ranks' amaxes, gathered rank by
//                                           rank, into the agreed ones); queued
//   d.quantize_tensor(f, x, n, q, amax)     n codes encode(x / scale_for(*amax, qmax)),
//                                           zero codes when that scale is 0 or *amax is
//                                           not finite; queued
//   d.dequantize_tensor(f, q, n, amax, y)   n codes back into f32 with that scale; every
//                                           element NaN when *amax is not finite; queued
// fsdp/core/quantize.hpp's detail::abs_max_or_inf, max_over_rows, quantize_tensor_with_amax
// and dequantize_tensor_with_amax say what each computes; HostDevice and CudaDevice agree bit
// for bit. A device without them still gathers in the block formats.
template <class D>
concept TensorScalingDevice = Device<D> && requires(D& d, QuantFormat f, const float* x, std::size_t n, float* out,
                                                    void* q, const void* cq, const float* amax, float* y) {
  d.abs_max(x, n, out);
  d.max_over_rows(amax, n, n, out);
  d.quantize_tensor(f, x, n, q, amax);
  d.dequantize_tensor(f, cq, n, amax, y);
};

// One buffer to zero: fill_zero's arguments.
struct ZeroSpan {
  void* data;
  std::size_t bytes;
};

// A Device that zeroes many device-space buffers with one call:
//   d.fill_zero_batch(spans)   each spans[i] zeroed, queued like fill_zero
// (CudaDevice: one kernel launch per 128 buffers instead of a cudaMemsetAsync each).
// ShardedModel::zero_grad zeroes every unit's sharded gradients with it; on other devices
// the library calls fill_zero once per buffer.
template <class D>
concept BatchZeroingDevice = Device<D> && requires(D& d, std::span<const ZeroSpan> spans) {
  d.fill_zero_batch(spans);
};

// A Device that zeroes device-space buffers in the same call as a cast:
//   d.cast_zeroing(dst, to, src, from, n, spans)   cast(dst, to, src, from, n), and each
//                                                  span zeroed; none overlaps the cast's
// (CudaDevice: one kernel launch, not a cast and a memset). A unit's pre_backward zeroes
// its fresh gradients in the cast that gathers the next unit ahead; elsewhere the library
// zeroes them through detail::zero_spans.
template <class D>
concept CastZeroingDevice = Device<D> && requires(D& d, void* p, const void* cp, DType t, std::size_t n,
                                                  std::span<const ZeroSpan> spans) {
  d.cast_zeroing(p, t, cp, t, n, spans);
};

// A Device whose operations run in order on one device queue (CudaDevice: the engine's
// compute stream), handed out as d.queue(). A collective's Work that can wait on that
// queue (Work::wait_on) is waited for there, not on the host, and buffers freed through
// the device after such a wait are freed behind the collective in queue order. Devices
// without it (HostDevice) keep host waits.
template <class D>
concept QueuedDevice = Device<D> && requires(D& d) {
  { d.queue() } -> std::convertible_to<DeviceQueue>;
};

namespace detail {

// The zeroing capabilities above written out for any device: its own batch where it has
// one, else a fill_zero per buffer; and the zeroing, then the cast, as two calls.
template <Device D>
void zero_spans(D& d, std::span<const ZeroSpan> spans) {
  if constexpr (BatchZeroingDevice<D>) d.fill_zero_batch(spans);
  else
    for (const ZeroSpan& s : spans) d.fill_zero(s.data, s.bytes);
}
template <Device D>
void zero_then_cast(D& d, void* dst, DType to, const void* src, DType from, std::size_t n, std::span<const ZeroSpan> spans) {
  zero_spans(d, spans);
  d.cast(dst, to, src, from, n);
}

}  // namespace detail

}  // namespace fsdp
