#pragma once
// Deferred initialization inside one unit. Parameters built from a shape and a dtype alone
// (data() null, elements > 0) are bound to zeroed storage the unit allocates through its
// Device, exactly the unit's missing elements; the engine's init callback fills them; they
// are checked; the unit copies its shard from them; then the storage is freed and the
// tensors have none again. So a rank holds at most one unit's full parameters beyond its
// shards while a model is sharded (see fsdp/model/deferred_init.hpp).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

// The parameter tensors a unit bound to fresh storage for its init callback, by
// fsdp::tensor_identity (their addresses, or what handles point to).
using MaterializedTensors = std::unordered_set<const void*>;
// The init of one unit: given those tensors and what the unit leaves out of its subtree
// (the SkipSet it collected its parameters with, so the init walks the same modules).
using InitCallback = std::function<void(const MaterializedTensors&, const SkipSet&)>;

class DeferredStorage {
 public:
  explicit DeferredStorage(DeviceRef device) : device_(device) {}
  DeferredStorage(const DeferredStorage&) = delete;
  DeferredStorage& operator=(const DeferredStorage&) = delete;
  ~DeferredStorage() { release(); }

  // Binds each parameter without storage to zeroed storage of its own (zero, so that what an
  // init leaves unwritten is the same on every rank). Returns whether any was bound.
  bool bind(std::vector<CollectedParam>& params) {
    for (auto& p : params) {
      if (!p.lacks_storage()) continue;
      const std::size_t bytes = static_cast<std::size_t>(p.info.numel) * size_of(p.dtype);
      void* data = device_.allocate(bytes, MemorySpace::device);
      bound_.push_back({p.binding.param, p.binding.rebind, p.dtype, data, bytes, p.binding.handles});
      device_.fill_zero(data, bytes);
      p.binding.rebind(p.binding.param, data, p.dtype);
      tensors_.insert(p.binding.id);
      if (p.binding.rebound.call && std::find(hooks_.begin(), hooks_.end(), p.binding.rebound) == hooks_.end())
        hooks_.push_back(p.binding.rebound);
    }
    // The modules' other views of those parameters (parameters_rebound) follow before the
    // init callback writes through them.
    for (const auto& h : hooks_) h();
    return !bound_.empty();
  }
  const MaterializedTensors& tensors() const { return tensors_; }

  // After the init callback: every parameter has storage, and its shape and dtype as built;
  // `params` and `buffers` are pointed at the storage the tensors show now (an init may have
  // given a tensor storage of its own).
  void check(std::vector<CollectedParam>& params, std::vector<CollectedBuffer>& buffers, std::string_view unit,
             int rank) const {
    for (auto& p : params) {
      const TensorState now = p.read(p.binding.param);
      if (now.shape != p.info.shape || now.dtype != p.dtype)
        fail("unit '", unit, "' on rank ", rank, ": deferred init changed parameter '", p.info.fqn, "' from ",
             format_shape(p.info.shape), " ", name_of(p.dtype), " to ", format_shape(now.shape), " ",
             name_of(now.dtype), "; an init callback fills parameters, it does not reshape them");
      if (p.info.numel > 0 && now.data == nullptr)
        fail("unit '", unit, "' on rank ", rank, ": deferred init left parameter '", p.info.fqn,
             "' without storage; an init callback writes into the storage the parameter shows");
      p.data = now.data;
    }
    for (auto& b : buffers) {
      b.data = b.data_of(b.tensor);
      if (b.numel > 0 && b.data == nullptr)
        fail("unit '", unit, "' on rank ", rank, ": buffer '", b.fqn,
             "' has no storage after deferred init; buffers stay the engine's, so give them storage when the "
             "model is built or in the init callback");
    }
  }

  // The tensors bound here back to no storage, and the storage freed. Idempotent.
  void release() noexcept {
    if (bound_.empty()) return;
    for (auto& b : bound_) b.rebind(b.tensor, nullptr, b.dtype);
    // No view of the engine's may keep pointing at storage freed below.
    for (const auto& h : hooks_) {
      try {
        h();
      } catch (...) {  // called from a destructor: a hook's error is not heard
      }
    }
    for (auto& b : bound_) device_.deallocate(b.data, b.bytes, MemorySpace::device);
    bound_.clear();
    hooks_.clear();
  }

 private:
  struct Bound {
    void* tensor;
    RebindFn rebind;
    DType dtype;
    void* data;
    std::size_t bytes;
    std::shared_ptr<void> handles;  // a handle type's copies, which `tensor` points into
  };
  DeviceRef device_;
  std::vector<Bound> bound_;
  std::vector<ReboundHook> hooks_;  // the bound parameters' modules' hooks, each once
  MaterializedTensors tensors_;
};

// Whether every rank's init gave every parameter of the unit the same values: one hash per
// parameter, all-gathered over `world` (every rank hashes all of the unit's parameters, so
// the collective is the same on each). Fails on every rank naming the first parameter that
// differs and the ranks that differ from rank 0.
inline void check_init_agrees(const std::vector<CollectedParam>& params, const CommRef& world, const DeviceRef& device,
                              std::string_view unit, int rank) {
  const auto n = params.size();
  if (world.size() == 1 || n == 0) return;
  std::vector<std::uint64_t> mine(n), all(n * static_cast<std::size_t>(world.size()));
  std::vector<std::byte> host;
  for (std::size_t i = 0; i < n; ++i) {
    host.resize(static_cast<std::size_t>(params[i].info.numel) * size_of(params[i].dtype));
    if (!host.empty()) device.copy(host.data(), params[i].data, host.size());
    Fingerprint f;
    f.add_bytes(host.data(), host.size());
    mine[i] = f.value();
  }
  world.all_gather(mine.data(), all.data(), n, DType::i64).wait();
  for (std::size_t i = 0; i < n; ++i) {
    std::ostringstream differ;
    for (std::size_t r = 1; r < static_cast<std::size_t>(world.size()); ++r)
      if (all[r * n + i] != all[i]) differ << (differ.tellp() ? ", " : "") << r;
    if (differ.tellp())
      fail_as(
          ErrorKind::mismatch, "unit '", unit, "' on rank ", rank, ": deferred init gave parameter '",
          params[i].info.fqn, "' other values on rank(s) ", differ.str(),
          " than on rank 0; the init callback must give every rank "
          "the same values (seed it by FQN, not by rank), or set ShardOptions::sync_module_states to take rank 0's");
  }
}

// The whole deferred step of a unit's construction: bind, init, check; then, if asked,
// compare the values across ranks. `storage` keeps the bound storage until the caller has
// copied its shard.
inline void run_deferred_init(const InitCallback& init, const SkipSet& skip, bool check_agrees, DeferredStorage& storage,
                              std::vector<CollectedParam>& params, std::vector<CollectedBuffer>& buffers,
                              const CommRef& world, const DeviceRef& device, std::string_view unit, int rank) {
  if (storage.bind(params)) {
    init(storage.tensors(), skip);
    storage.check(params, buffers, unit, rank);
  }
  if (check_agrees) check_init_agrees(params, world, device, unit, rank);
}

}  // namespace fsdp::detail
