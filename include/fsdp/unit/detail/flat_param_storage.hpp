#pragma once
// FlatParam: one flat parameter of a unit (its layout and the engine tensors that view it)
// and every buffer the unit holds for it, with the state of its collectives in flight.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/quant_format.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

// One flat parameter and the storage the unit holds for it.
struct FlatParam {
  explicit FlatParam(FlatParamLayout l) : layout(std::move(l)) {}
  FlatParamLayout layout;
  std::vector<detail::ParamBinding> bindings;  // parallel to layout.params()
  // The engine's tensors under a tied parameter's other names: (its index, their binding).
  std::vector<std::pair<std::size_t, detail::ParamBinding>> alias_bindings;
  DType compute = DType::f32;  // what the engine computes with (MixedPrecision's Param)
  DType gather = DType::f32;   // what all-gathers move (CommPrecision's Gather, else compute)
  DType accumulate = DType::f32;  // what micro-batches' gradients are summed in (MixedPrecision's Reduce, else compute)
  DType reduce = DType::f32;   // what gradients are reduced in (CommPrecision's Reduce, else accumulate)
  DType grad = DType::f32;     // what the sharded gradient is kept in
  bool direct = false;         // replicated, same dtype, not offloaded: the shard *is* the parameters
  bool grad_in_shard = false;  // the engine accumulates into shard_grad itself (grad_accumulates_in_shard)
  void* shard = nullptr;       // shard_numel master-dtype elements, this rank's (host space when offloaded)
  void* shard_grad = nullptr;  // shard_numel `grad`-dtype elements, the reduced gradient
  void* full = nullptr;        // padded_numel elements while unsharded, in the dtype asked for
  DType full_dtype = DType::f32;
  MemorySpace full_space = MemorySpace::device;  // host only while a summon offloads it
  void* wire = nullptr;        // padded_numel `gather`-dtype elements while a narrower all-gather runs,
                               // or one quantized slot per shard rank (quantized_slot_bytes each)
  // CommPrecision's Gather is a block format (detail::gathers_quantized): the all-gather
  // moves, per shard rank, a slot of its block scales then its codes (rounded up to 8 bytes).
  // A per-tensor format (is_per_tensor(quant_format)): the slot holds codes only, and
  // `amax` (device space) from the start of the gather until finish_gather has
  // dequantized: the agreed amax of each parameter of the layout, then, on a shard group
  // of several ranks, each rank's row of its slices' amaxes, which the group gathers.
  bool quantized = false;
  QuantFormat quant_format = QuantFormat::int8_blocks;
  std::size_t quant_block = 0;
  void* amax = nullptr;
  // Partial resharding: this rank's 1/k of the unsharded parameters (`gather` dtype),
  // kept from forward for the backward all-gather inside the post-forward group.
  void* post_forward = nullptr;
  std::int64_t post_forward_numel = 0;
  void* summoned_grad = nullptr;  // the reduced gradient gathered whole (a summon's with_grads)
  void* full_grad = nullptr;   // padded_numel compute-dtype elements during backward
  // What the gradients are shown in now (bind_tensors of ParamBinding::grad): the engine's
  // gradient tensors view it, and Unit::gradient hands out views of it for the gradients
  // the library owns. Null while no gradient is shown.
  void* grad_shown = nullptr;
  DType grad_shown_dtype = DType::f32;
  Work gather_work;            // the all-gather into `full`, until its first use
  bool unbound = false;        // `full` gathered (or gathering) but not yet shown to the engine
  Work reduce_work;            // the reduction, until finished
  void* reduce_in = nullptr;   // full_grad cast to `reduce`, when that differs (a kept sum when accumulate == reduce)
  void* reduce_out = nullptr;  // shard_numel `reduce`-dtype elements: where it reduces to
  bool into_shard_grad = false;
  bool reducing = false;
  // Accumulation without communication (fsdp/policy/gradient_sync.hpp):
  bool grad_kept = false;      // an unsynchronized backward kept the unsharded gradient: in
                               // full_grad when accumulate == compute, else summed in reduce_in
  bool defer_all_reduce = false;  // this reduction stops after the shard group, into `partial`
  void* partial = nullptr;     // shard_numel `accumulate`-dtype shard-group sums awaiting the replicate all-reduce

  static std::size_t bytes(std::int64_t n, DType t) { return static_cast<std::size_t>(n) * size_of(t); }
  DType master() const { return layout.dtype(); }
  detail::FlatParamDTypes dtypes() const { return {compute, gather, accumulate, reduce, grad}; }
  std::size_t shard_bytes() const { return bytes(layout.shard_numel(), master()); }
  std::size_t shard_grad_bytes() const { return bytes(layout.shard_numel(), grad); }
  std::size_t full_bytes() const { return bytes(layout.padded_numel(), compute); }
  std::size_t wire_bytes() const {
    if (!quantized) return bytes(layout.padded_numel(), gather);
    const auto S = layout.shard_numel();
    return S == 0 ? 0 : quant_slot_bytes() * static_cast<std::size_t>(layout.padded_numel() / S);
  }
  // One shard rank's slot of a quantized all-gather: its scales, then its codes, padded to
  // 8 (detail::quant_slot, with no status word).
  detail::QuantSlot quant_slot() const {
    return detail::quant_slot(quant_format, static_cast<std::size_t>(layout.shard_numel()), quant_block, false);
  }
  std::size_t quant_slot_bytes() const { return quant_slot().bytes; }
  bool scaled_per_tensor() const { return quantized && is_per_tensor(quant_format); }
  std::size_t amax_bytes() const {  // the agreed row, and one per shard rank where there are several
    const auto ranks = static_cast<std::size_t>(layout.world());
    return layout.params().size() * sizeof(float) * (ranks > 1 ? ranks + 1 : 1);
  }
  std::size_t post_forward_bytes() const { return bytes(post_forward_numel, gather); }
  std::size_t partial_bytes() const { return bytes(layout.shard_numel(), accumulate); }
  bool gather_issued() const { return full || wire; }
};

namespace detail {

// Points every parameter's param (or grad) tensor into `base`, shown in `dtype`, or at nothing.
// Gradients the library owns (no engine tensor) are only recorded as shown there. This
// is the one place the engine's tensors are rebound during training: the caller then runs
// the modules' parameters_rebound hooks (FlatParamGroup::parameters_rebound).
inline void bind_tensors(FlatParam& fp, void* base, void* detail::ParamBinding::*which, DType dtype) {
  const std::size_t esize = size_of(dtype);
  const auto& infos = fp.layout.params();
  auto at = [&](std::size_t i) -> void* { return base ? static_cast<std::byte*>(base) + infos[i].offset * esize : nullptr; };
  if (which == &ParamBinding::grad) fp.grad_shown = base, fp.grad_shown_dtype = dtype;
  for (std::size_t i = 0; i < fp.bindings.size(); ++i)
    if (void* t = fp.bindings[i].*which) fp.bindings[i].rebind(t, at(i), dtype);
  for (auto& [i, b] : fp.alias_bindings)
    if (void* t = b.*which) b.rebind(t, at(i), dtype);
}

// Where the gradient of parameter i of `fp` is shown now (in fp.grad_shown_dtype), or
// null while none is.
inline void* shown_gradient(const FlatParam& fp, std::size_t i) {
  if (!fp.grad_shown) return nullptr;
  return static_cast<std::byte*>(fp.grad_shown) + fp.layout.params()[i].offset * size_of(fp.grad_shown_dtype);
}

// The first parameter (FQN) whose engine tensor no longer views what the library bound it
// to: `base` (+ its offset, in `dtype`), or no storage when `base` is null. "" when none
// moved. The engine replaced that tensor's storage behind the library's back: values it
// put there would be dropped at the next rebind, or never reach the shard.
inline std::string moved_storage(const FlatParam& fp, const void* base, DType dtype) {
  const std::size_t esize = size_of(dtype);
  const auto& infos = fp.layout.params();
  auto expected = [&](std::size_t i) -> const void* {
    return base ? static_cast<const std::byte*>(base) + infos[i].offset * esize : nullptr;
  };
  for (std::size_t i = 0; i < fp.bindings.size(); ++i)
    if (fp.bindings[i].data && fp.bindings[i].data(fp.bindings[i].param) != expected(i)) return infos[i].fqn;
  for (const auto& [i, b] : fp.alias_bindings)
    if (b.data && b.data(b.param) != expected(i)) return infos[i].aliases.empty() ? infos[i].fqn : infos[i].aliases.front();
  return {};
}

// Frees a buffer the unit holds, if any, and forgets it.
inline void release_buffer(const DeviceRef& device, void*& p, std::size_t n, MemorySpace space) {
  if (p) device.deallocate(p, n, space);
  p = nullptr;
}

// A device-space buffer for the length of one call (`bytes` 0: none): release() frees it
// (and reports a failure); when an exception leaves first, the destructor frees it, its own
// failure unheard, so a throwing device call leaks nothing.
struct DeviceScratch {
  DeviceScratch(DeviceRef d, std::size_t n) : device(d), bytes(n) {
    if (bytes) data = device.allocate(bytes, MemorySpace::device);
  }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    try {
      release();
    } catch (...) {  // an error is already leaving
    }
  }
  void release() { release_buffer(device, data, bytes, MemorySpace::device); }

  DeviceRef device;  // two pointers, by value: nothing to dangle
  std::size_t bytes;
  void* data = nullptr;
};

// Waits for a collective, as a span on the trace's compute lane when the model traces.
struct TracedWait {
  Trace* trace = nullptr;
  std::string_view unit;
  void operator()(Work& w, const char* what) const {
    if (!trace) return w.wait();
    const auto begin = Trace::Clock::now();
    w.wait();
    trace->add(std::string(what).append(" ").append(unit), "wait", Trace::Lane::compute, begin, Trace::Clock::now());
  }
};

// Waits for a collective before its result is used: on the device's queue when both the
// Work and the device can (a CUDA stream waits on the collective's event; the host goes
// on, and what the library queues next on the device runs after it), else on the host.
// Returns true for a wait on the device: the Work still owes the host-side check
// (Work::wait), which surfaces a failure the device cannot.
inline bool wait_for_use(Work& w, const DeviceRef& device, const TracedWait& wait, const char* what) {
  if (!w.completed_inline() && w.wait_on(device.queue())) return true;
  wait(w, what);  // also a complete one, as before: the trace shows the same spans
  return false;
}

// Before freeing buffers a collective may still read or write: their frees go through the
// device behind a wait on its queue, or, where there is none, after a host wait. Errors
// are dropped here (the backend reports them on its next call).
inline void settle_before_free(Work& w, const DeviceRef& device) noexcept {
  if (w.completed_inline()) return;  // the usual case: waited for at its first use
  try {
    w.wait_on(device.queue());
  } catch (...) {  // known to have failed: dropped below with a quiet host wait
  }
  w = Work{};  // after a device wait: dropped without blocking; else waits quietly
}

}  // namespace detail

}  // namespace fsdp
