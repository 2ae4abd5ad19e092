#pragma once
// sync_module_states without writing into the engine's tensors before the take-over. Rank
// 0's parameters and buffers are broadcast into copies the unit owns; the unit's shards and
// cast buffers are made from those copies, and a buffer that stays the engine's receives
// rank 0's values only when the unit takes over. So a shard() that fails at any unit, on
// any rank, leaves every rank's model exactly as it was, values included (the broadcast
// used to overwrite them in place before later units had passed their checks).
// Cost: one unit's parameters beyond its shards while it is built (what deferred init
// already holds), and the model's buffers until the take-over.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/deferred_storage.hpp"
#include "fsdp/unit/detail/param_collection.hpp"

namespace fsdp::detail {

class RankZeroValues {
 public:
  explicit RankZeroValues(DeviceRef device) : device_(device) {}
  RankZeroValues(const RankZeroValues&) = delete;
  RankZeroValues& operator=(const RankZeroValues&) = delete;
  ~RankZeroValues() {
    release(params_);
    release(buffers_);
  }

  // Rank 0's values in `params` and `buffers`: their `data` then points at copies holding
  // them. A parameter the unit bound itself for deferred init (`materialized`) is not the
  // engine's storage yet, so it is broadcast in place.
  void broadcast(const CommRef& world, std::vector<CollectedParam>& params, std::vector<CollectedBuffer>& buffers,
                 const MaterializedTensors& materialized) {
    for (auto& p : params) {
      if (p.info.numel <= 0) continue;
      const auto n = static_cast<std::size_t>(p.info.numel);
      void* data = materialized.count(p.binding.id) ? const_cast<void*>(p.data)
                                                       : copy_of(params_, p.data, n * size_of(p.dtype), nullptr, nullptr);
      world.broadcast(data, data, n, p.dtype, 0).wait();
      p.data = data;
    }
    for (auto& b : buffers) {
      if (b.numel <= 0) continue;
      const auto n = static_cast<std::size_t>(b.numel);
      void* data = copy_of(buffers_, b.data, n * size_of(b.dtype), b.data, b.tensor);
      world.broadcast(data, data, n, b.dtype, 0).wait();
      b.data = data;
    }
  }

  // Once the shards are copied: the parameter copies are not needed any more.
  void release_parameters() noexcept { release(params_); }

  // At the take-over: rank 0's values into the engine's buffers, except those for which
  // `copied(tensor)` is true (the unit shows its own cast copy of that tensor instead).
  template <class Copied>
  void write_engine_buffers(Copied&& copied) {
    for (auto& c : buffers_)
      if (!copied(c.tensor)) device_.copy(c.engine, c.data, c.bytes);
    release(buffers_);
  }

 private:
  struct Copy {
    void* data;
    std::size_t bytes;
    void* engine;  // buffers: the engine's storage and tensor
    const void* tensor;
  };

  void* copy_of(std::vector<Copy>& into, const void* from, std::size_t bytes, void* engine, const void* tensor) {
    into.push_back({nullptr, bytes, engine, tensor});  // listed first: nothing leaks if allocate throws
    void* data = into.back().data = device_.allocate(bytes, MemorySpace::device);
    device_.copy(data, from, bytes);
    return data;
  }
  void release(std::vector<Copy>& copies) noexcept {
    for (auto& c : copies)
      if (c.data) device_.deallocate(c.data, c.bytes, MemorySpace::device);
    copies.clear();
  }

  DeviceRef device_;
  std::vector<Copy> params_, buffers_;
};

}  // namespace fsdp::detail
