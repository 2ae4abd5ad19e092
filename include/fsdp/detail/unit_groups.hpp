#pragma once
// The process groups one unit talks to, whatever its strategy: the whole world for setup
// checks, the group its parameters are split across, and the group its gradients are
// all-reduced across.
#include "fsdp/communicator.hpp"
#include "fsdp/detail/backend_ref.hpp"
#include "fsdp/device_mesh.hpp"

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
};

}  // namespace fsdp::detail
