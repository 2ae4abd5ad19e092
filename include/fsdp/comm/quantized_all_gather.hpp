#pragma once
// A quantized all-gather (issue 38): each rank's shard of f32 values crosses the wire as
// one-byte codes and one scale per block (fsdp/core/quantize.hpp's formats: int8, E4M3 or
// E5M2 blocks with f32 scales, MXFP8 with e8m0 scales), about a quarter of the f32 bytes, and
// every rank turns the gathered codes back into f32. Each rank quantizes its own shard,
// its blocks cut from its own first value, so no block spans two ranks and the ranks need
// not agree on any scale first (DeepSpeed ZeRO++ gathers int8 weights this way, qwZ).
//
// One all-gather moves, per rank, a slot: a status word (the rank's first inf or NaN, if
// any), its scales, its codes. A quantized all-gather must never turn an inf or NaN into a
// number, and a rank that found one cannot simply stop (its peers would wait in the
// gather): so every rank reads every rank's status, and if any found one, every rank
// throws an fsdp::Error naming the lowest such rank and its element. Nothing is
// dequantized then. Other failures (an allocation, the device, the communicator) take
// the communicator's own failure path, as any collective's do: the peers' gather fails
// naming the rank. For an engine's own gathers: a unit under a block-format CommPrecision
// (fsdp/policy/policies.hpp) does not call it. The unit's slots carry no status word, and a block
// holding an inf or NaN arrives as a block of NaNs, since a unit does not wait for the
// device to read a status on its hot path (docs/precision_and_offload.md).
//
// The per-tensor formats (QuantFormat::f8e4m3_tensor, f8e5m2_tensor) scale the whole
// gathered tensor with one scale: the ranks first agree on its amax (an all-gather of one
// f32 per rank, and the largest), then the slots carry a status word and codes only. They need a
// TensorScalingDevice (refused with an fsdp::Error on a device without it); `block` is
// unused for them.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/quantize.hpp"

namespace fsdp {

namespace detail {

// Runs each step even if one before it threw; the first failure is rethrown unless an
// error is already leaving (`unwinding`).
template <class... Steps>
void release_steps(bool unwinding, Steps&&... steps) {
  std::exception_ptr failed;
  auto step = [&](auto&& fn) {
    try {
      fn();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  };
  (step(steps), ...);
  if (failed && !unwinding) std::rethrow_exception(failed);
}

// The gather of both kinds of slot: writes this rank's `status` (0, or 1 + the index of its
// first inf or NaN) into its slot, gathers every rank's slot into `recv`, and fails on
// every rank naming the lowest rank that found one, before anything is dequantized.
template <Communicator C, Device D>
void gather_slots_checked(C& comm, D& device, QuantFormat f, std::size_t n, std::byte* send, std::byte* recv,
                          std::size_t slot, std::uint64_t status) {
  const std::size_t world = static_cast<std::size_t>(comm.size());
  device.copy(send, &status, sizeof status);
  device.synchronize();
  comm.all_gather(send, recv, slot, DType::u8).wait();
  std::vector<std::uint64_t> statuses(world);
  for (std::size_t r = 0; r < world; ++r) device.copy(&statuses[r], recv + r * slot, sizeof(std::uint64_t));
  device.synchronize();
  const auto first = std::find_if(statuses.begin(), statuses.end(), [](std::uint64_t s) { return s != 0; });
  if (first != statuses.end())
    fail("quantized_all_gather (", name_of(f), ", ", n, " values per rank) on rank ", comm.rank(), ": rank ",
         first - statuses.begin(), "'s shard holds an inf or NaN at element ", *first - 1,
         "; a quantized all-gather never turns one into a number, so no rank dequantized anything");
}

// quantized_all_gather of a per-tensor format: the gathered tensor (all ranks' shards) has
// one scale, from the largest |x| over every rank: each rank takes its shard's amax on the
// device (+inf for an inf or NaN), one all-gather of that f32 and its largest agree on it
// (an all-gather: every communicator gathers device memory), each rank
// quantizes with it into its slot (a status word, then codes only: no scales), one
// all-gather moves the slots, and each rank dequantizes every slot with the same amax.
// The full tensor is so, bit for bit, quantize_f8e4m3_tensor (or _f8e5m2_) of all the
// shards back to back, and back. A rank whose amax is +inf finds its first inf or NaN on
// the host (a copy of its shard, on that failure path only) for its status word, and every
// rank fails naming the lowest such rank and element, as for the block formats.
template <Communicator C, TensorScalingDevice D>
void tensor_scaled_all_gather(C& comm, D& device, QuantFormat f, const float* shard, std::size_t n, float* full) {
  const std::size_t world = static_cast<std::size_t>(comm.size());
  const auto layout = quant_slot(f, n, 0, true);
  const std::size_t codes_at = layout.codes_at, slot = layout.bytes;
  auto* send = static_cast<std::byte*>(device.allocate(slot, MemorySpace::device));
  std::byte* recv = nullptr;
  float* amax = nullptr;
  auto release = [&](bool unwinding) {
    release_steps(
        unwinding, [&] { device.synchronize(); },
        [&] { if (amax) device.deallocate(amax, (1 + world) * sizeof(float), MemorySpace::device); },
        [&] { if (recv) device.deallocate(recv, slot * world, MemorySpace::device); },
        [&] { device.deallocate(send, slot, MemorySpace::device); });
  };
  try {
    recv = static_cast<std::byte*>(device.allocate(slot * world, MemorySpace::device));
    // The agreed amax, then each rank's own (gathered: every communicator gathers device
    // memory, where not every one reduces it with max).
    amax = static_cast<float*>(device.allocate((1 + world) * sizeof(float), MemorySpace::device));
    float* const own = amax + 1 + comm.rank();
    device.fill_zero(send, slot);  // the padding: every byte on the wire is written
    device.abs_max(shard, n, own);
    float local = 0;
    device.copy(&local, own, sizeof local);
    device.synchronize();
    std::uint64_t status = 0;  // 0, or 1 + the index of this rank's first inf or NaN
    if (!std::isfinite(local)) {
      std::vector<float> host(n);
      device.copy(host.data(), shard, n * sizeof(float));
      device.synchronize();
      const auto it = std::find_if(host.begin(), host.end(), [](float v) { return !std::isfinite(v); });
      status = 1 + static_cast<std::uint64_t>(it - host.begin());
    }
    comm.all_gather(own, amax + 1, 1, DType::f32).wait();
    device.max_over_rows(amax + 1, world, 1, amax);
    device.quantize_tensor(f, shard, n, send + codes_at, amax);
    gather_slots_checked(comm, device, f, n, send, recv, slot, status);
    for (std::size_t r = 0; r < world; ++r) device.dequantize_tensor(f, recv + r * slot + codes_at, n, amax, full + r * n);
  } catch (...) {
    release(true);
    throw;
  }
  release(false);
}

}  // namespace detail

// Bytes of one rank's slot in the gather: an 8-byte status, its scales (none for a
// per-tensor format), its n codes, rounded up to 8 bytes (so every slot's status and f32
// scales stay aligned; the layout is detail::quant_slot's, which a unit's slots share
// without the status).
inline std::size_t quantized_slot_bytes(QuantFormat f, std::size_t n, std::size_t block) {
  return detail::quant_slot(f, n, block, true).bytes;
}

// full[r * n + i] = rank r's shard[i] after quantization and back, for every rank r; n
// values per rank, the same on every rank. `shard` and `full` are in the device's device
// space. Scratch: one slot to send and one per rank to receive (quantized_slot_bytes
// each), allocated from `device` and freed on every path, so the call returns with
// everything done (it waits for the quantization, the gather and the dequantization; the
// device is synchronized before the gather, so any communicator of its memory will do).
// It starts by reading the device's quantize_nonfinite(): an earlier quantize of the
// caller's whose inf or NaN was not checked yet is forgotten, so check those first. A
// per-tensor format (detail::tensor_scaled_all_gather) also allocates 4 bytes per rank and
// one more for the amaxes and gathers them before the slots; it neither reads nor clears
// quantize_nonfinite().
template <Communicator C, QuantizingDevice D>
void quantized_all_gather(C& comm, D& device, QuantFormat f, std::size_t block, const float* shard, std::size_t n,
                          float* full) {
  if (is_per_tensor(f)) {
    if constexpr (TensorScalingDevice<D>) return detail::tensor_scaled_all_gather(comm, device, f, shard, n, full);
    else
      detail::fail_as(ErrorKind::misuse, "quantized_all_gather: ", name_of(f), " scales per tensor, which needs a "
                      "device with abs_max, max_over_rows, quantize_tensor and dequantize_tensor "
                      "(fsdp::TensorScalingDevice); use a "
                      "block format here (f8e4m3_blocks or f8e5m2_blocks with a block of 128)");
  }
  check_quant_block(f, block, "quantized_all_gather");
  const std::size_t world = static_cast<std::size_t>(comm.size());
  const auto layout = detail::quant_slot(f, n, block, true);
  const std::size_t scales_at = layout.scales_at, codes_at = layout.codes_at, slot = layout.bytes;
  auto* send = static_cast<std::byte*>(device.allocate(slot, MemorySpace::device));
  std::byte* recv = nullptr;
  // Frees the scratch after a wait for what may still use it.
  auto release = [&](bool unwinding) {
    detail::release_steps(
        unwinding, [&] { device.synchronize(); },
        [&] { if (recv) device.deallocate(recv, slot * world, MemorySpace::device); },
        [&] { device.deallocate(send, slot, MemorySpace::device); });
  };
  try {
    recv = static_cast<std::byte*>(device.allocate(slot * world, MemorySpace::device));
    device.fill_zero(send, slot);  // the padding: every byte on the wire is written
    (void)device.quantize_nonfinite();  // forget what earlier quantizes found
    device.quantize(f, shard, n, send + codes_at, send + scales_at, block);
    // Status: 0, or 1 + the index of this rank's first inf or NaN.
    const auto bad = device.quantize_nonfinite();  // waits for the quantize
    detail::gather_slots_checked(comm, device, f, n, send, recv, slot, bad ? 1 + static_cast<std::uint64_t>(*bad) : 0);
    for (std::size_t r = 0; r < world; ++r)
      device.dequantize(f, recv + r * slot + codes_at, recv + r * slot + scales_at, n, full + r * n, block);
  } catch (...) {
    release(true);
    throw;
  }
  release(false);
}

}  // namespace fsdp
