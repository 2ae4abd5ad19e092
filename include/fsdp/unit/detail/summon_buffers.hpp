#pragma once
// What summon_full_params and checkpoints do with a unit's flat parameters beyond training's
// gather (fsdp/unit/flat_param_group.hpp): move the full parameters to host memory, gather the
// reduced gradients whole, hash the full parameters, write this rank's slice back into its
// shard, and gather any array laid out like a shard into host memory.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"

namespace fsdp::detail {

// Elements of an unsharded buffer: the padded flat parameter, or one (whole) replicated shard.
inline std::int64_t full_numel(const FlatParam& fp, const UnitGroups& groups) {
  return groups.shards_parameters ? fp.layout.padded_numel() : fp.layout.shard_numel();
}

// All-gathers an array laid out like a flat parameter's shard (its valid elements, in the
// shard's space) into host memory: `packed`, the parameters' elements back to back in
// parameter order (param_numel() elements: what state dicts read); else the flat
// parameter's first numel() elements, the gaps of a block-aligned or parameter-atomic
// layout included (what a summon's gradient views point into). Where device memory is
// host memory and the gathered buffer is already that, straight from `mine` into
// `full_host` (no buffer: a full save gathers every flat parameter three times); else
// through device buffers (a collective backend may need device memory).
inline void gather_array(const FlatParamLayout& L, const UnitGroups& groups, const DeviceRef& device, const void* mine,
                         void* full_host, DType dtype, bool packed) {
  const std::size_t valid = FlatParam::bytes(L.valid_shard_numel(groups.shard_rank), dtype);
  const std::size_t S = FlatParam::bytes(L.shard_numel(), dtype);
  const std::size_t total = groups.shards_parameters ? FlatParam::bytes(L.padded_numel(), dtype) : S;
  const bool host_memory = device.id().kind == DeviceKind::cpu;
  const bool moved_apart = packed && !L.back_to_back();  // parameters to pick out of the gathered buffer
  if (host_memory && !moved_apart && L.padded_numel() == L.numel() && valid == S) {
    if (groups.shards_parameters)
      groups.shard.all_gather(mine, full_host, S / size_of(dtype), dtype).wait();
    else if (S)
      device.copy(full_host, mine, S);
    return;
  }
  // Both buffers freed however this ends.
  std::unique_ptr<void, std::function<void(void*)>> in(nullptr, [&](void* p) { device.deallocate(p, S, MemorySpace::device); });
  std::unique_ptr<void, std::function<void(void*)>> out(nullptr, [&](void* p) { device.deallocate(p, total, MemorySpace::device); });
  in.reset(device.allocate(S, MemorySpace::device));
  out.reset(device.allocate(total, MemorySpace::device));
  if (valid < S) device.fill_zero(static_cast<std::byte*>(in.get()) + valid, S - valid);
  if (valid) device.copy(in.get(), mine, valid);
  if (groups.shards_parameters) groups.shard.all_gather(in.get(), out.get(), S / size_of(dtype), dtype).wait();
  else device.copy(out.get(), in.get(), S);
  if (!moved_apart) {
    if (L.numel()) device.copy(full_host, out.get(), FlatParam::bytes(L.numel(), dtype));
    return;
  }
  std::size_t at = 0;
  for (const auto& p : L.params()) {
    const std::size_t n = FlatParam::bytes(p.numel, dtype);
    if (n) device.copy(static_cast<std::byte*>(full_host) + at, static_cast<const std::byte*>(out.get()) + FlatParam::bytes(p.offset, dtype), n);
    at += n;
  }
}

// Moves the unsharded parameters into host memory and shows them there (a summon's
// offload_to_host). Parameters that are their own shard stay where they are. Returns
// whether it rebound any (the modules' parameters_rebound hooks are then due).
inline bool move_unsharded_to_host(std::vector<FlatParam>& flat, const UnitGroups& groups, const DeviceRef& device) {
  bool moved = false;
  for (auto& fp : flat) {
    if (!fp.full || fp.full == fp.shard || fp.full_space == MemorySpace::host) continue;
    const std::size_t n = FlatParam::bytes(full_numel(fp, groups), fp.full_dtype);
    void* host = device.allocate(n, MemorySpace::host);
    device.copy(host, fp.full, n);
    device.deallocate(fp.full, n, MemorySpace::device);
    fp.full = host;
    fp.full_space = MemorySpace::host;
    bind_tensors(fp, host, &ParamBinding::param, fp.full_dtype);
    moved = true;
  }
  return moved;
}

// The reduced gradients whole, in the engine's gradient tensors, in the gradient dtype (a
// summon's with_grads; a collective). A replicated gradient is already whole.
inline void unshard_gradients(std::vector<FlatParam>& flat, const UnitGroups& groups, const DeviceRef& device) {
  for (auto& fp : flat) {
    void* whole = fp.shard_grad;
    if (!fp.direct) {
      fp.summoned_grad = device.allocate(FlatParam::bytes(fp.layout.numel(), fp.grad), MemorySpace::device);
      gather_array(fp.layout, groups, device, fp.shard_grad, fp.summoned_grad, fp.grad, /*packed=*/false);
      whole = fp.summoned_grad;
    }
    bind_tensors(fp, whole, &ParamBinding::grad, fp.grad);
  }
}

inline void release_summoned_gradients(std::vector<FlatParam>& flat, const DeviceRef& device) {
  for (auto& fp : flat) {
    if (!fp.summoned_grad && !fp.direct) continue;
    bind_tensors(fp, nullptr, &ParamBinding::grad, fp.master());
    release_buffer(device, fp.summoned_grad, FlatParam::bytes(fp.layout.numel(), fp.grad), MemorySpace::device);
  }
}

// Adds the unsharded parameters' bytes to `f` (a summon's writeback check) and returns
// whether any of them are their own shard (edited in place, so already kept).
inline bool hash_unsharded(const std::vector<FlatParam>& flat, const DeviceRef& device, Fingerprint& f) {
  bool in_place = false;
  std::vector<std::byte> host;
  for (const auto& fp : flat) {
    if (!fp.full) continue;
    in_place = in_place || fp.full == fp.shard;
    host.resize(FlatParam::bytes(fp.layout.numel(), fp.full_dtype));
    if (!host.empty()) device.copy(host.data(), fp.full, host.size());
    f.add_bytes(host.data(), host.size());
  }
  return in_place;
}

// Keeps edits made to summoned full parameters: this rank's slice back into its shard.
inline void write_back(std::vector<FlatParam>& flat, const UnitGroups& groups, const DeviceRef& device) {
  for (auto& fp : flat) {
    const auto& L = fp.layout;
    if (fp.full == fp.shard) continue;  // replicated in place: edits are already there
    const void* mine = static_cast<std::byte*>(fp.full) + groups.shard_rank * L.shard_bytes();
    device.copy(fp.shard, mine, static_cast<std::size_t>(L.valid_shard_numel(groups.shard_rank)) * size_of(fp.master()));
  }
}

}  // namespace fsdp::detail
