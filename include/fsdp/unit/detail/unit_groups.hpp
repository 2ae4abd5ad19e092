#pragma once
// The process groups one unit talks to, whatever its strategy: the whole world for setup
// checks, the group its parameters are split across, and the group its gradients are
// all-reduced across.
#include <cstddef>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp::detail {

struct UnitGroups {
  CommRef world;      // all ranks: setup checks
  CommRef shard;      // parameters are split across it (unused when the strategy replicates)
  CommRef replicate;  // gradients are all-reduced across it (when replicate_size > 1)
  int shard_size = 1, shard_rank = 0, replicate_size = 1;
  bool shards_parameters = true;  // the strategy's, or false for a unit kept unsharded

  // The same ranks with the parameters kept whole on each (a unit under the persistence
  // threshold): no shard group; gradients all-reduced across the whole world.
  UnitGroups replicated() const {
    UnitGroups g{world, world, world};
    g.replicate_size = world.size();
    g.shards_parameters = false;
    return g;
  }

  template <class Strategy, Communicator C>
  static UnitGroups flat(C& comm) {
    static_assert(!Strategy::hybrid,
                  "fsdp: HybridShard and HybridShardZero2 shard inside one dimension of a mesh and "
                  "replicate across the other: pass an fsdp::DeviceMesh instead of a communicator");
    UnitGroups g{CommRef(comm), CommRef(comm), CommRef(comm)};
    g.shards_parameters = Strategy::shards_parameters;
    if constexpr (Strategy::shards_parameters) g.shard_size = comm.size(), g.shard_rank = comm.rank();
    else g.replicate_size = comm.size();
    return g;
  }

  template <class Strategy, class Mesh>
  static UnitGroups from_mesh(Mesh& mesh) {
    if constexpr (!Strategy::hybrid) return flat<Strategy>(mesh.world());
    else {
      UnitGroups g{CommRef(mesh.world()), CommRef(mesh.shard_group()), CommRef(mesh.replicate_group())};
      g.shard_size = mesh.shard_group().size();
      g.shard_rank = mesh.shard_group().rank();
      g.replicate_size = mesh.replicate_group().size();
      return g;
    }
  }

  int world_size() const { return shard_size * replicate_size; }

  // Whether a gradient's first reduction runs in a group of this rank alone.
  bool reduces_alone() const { return (shards_parameters ? shard_size : replicate_size) == 1; }

  // The parameters' all-gather of n elements from this rank's `mine` into `full`, across
  // the shard group. A group of one has nothing to exchange (this rank's slot is the whole
  // buffer): in place no call is made, out of place one device copy, queued with the
  // unit's other device work. A one-rank run, or HSDP over shard groups of one, so makes no
  // communicator call, event or stream switch per gather (2 to 7 us of host time each on
  // NCCL, docs/cuda.md) for an exchange with itself.
  Work all_gather(const DeviceRef& device, const void* mine, void* full, std::size_t n, DType t,
                  const CollectiveTag* tag) const {
    if (shard_size > 1) return shard.all_gather(mine, full, n, t, tag);
    if (mine != full) device.copy(full, mine, n * size_of(t));
    return Work{};
  }

  // A gradient's first reduction (sum or avg) of n elements: reduce-scatter across the
  // shard group, or all-reduce across the replicate group where parameters are replicated.
  // Across a group of one it is the input itself (copied out of place, as above).
  Work reduce(const DeviceRef& device, const void* in, void* out, std::size_t n, DType t, ReduceOp op,
              const CollectiveTag* tag) const {
    if (reduces_alone()) {
      if (in != out) device.copy(out, in, n * size_of(t));
      return Work{};
    }
    if (shards_parameters) return shard.reduce_scatter(in, out, n, t, op, tag);
    return replicate.all_reduce(in, out, n, t, op, tag);
  }
};

}  // namespace fsdp::detail
