#pragma once
// What a unit's construction does before it takes the engine's tensors over: collect the
// module's parameters and buffers, build the flat parameters, check that every rank built
// the same unit, run a deferred init, synchronise from rank 0 (sync_module_states), and
// copy this rank's shards and the buffers' copies. The engine's tensors are not touched
// here, so a failed construction loses no data.
#include <cstdint>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "fsdp/unit/detail/buffer_copies.hpp"
#include "fsdp/unit/detail/deferred_storage.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/unit/detail/module_visit.hpp"
#include "fsdp/unit/detail/param_checks.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/unit/detail/rank0_values.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/unit/unit.hpp"
#include "fsdp/unit/shard_options.hpp"
#include "fsdp/policy/wrap_policy.hpp"

namespace fsdp::detail {

// "shard group of S ranks, replicate group of R ranks": units of one model must agree.
inline std::string describe_groups(const UnitGroups& mesh) {
  return "shard group of " + std::to_string(mesh.shard_size) + " ranks, replicate group of " +
         std::to_string(mesh.replicate_size) + " ranks";
}

// What every rank must set alike for a unit besides its parameters: the policies, the
// options that change its collectives, and its buffers (sync_module_states broadcasts them
// by element count, so a shape that differs must be caught here).
inline Settings unit_settings(const Settings& policies, const ShardOptions& options, const UnitInit& init,
                              const std::vector<CollectedBuffer>& buffers) {
  Settings s = policies;
  s.add("sync_module_states", options.sync_module_states ? "true" : "false");
  s.add("persistence_threshold", std::to_string(options.persistence_threshold));
  s.add("local_gradients", std::string(name_of(options.local_gradients)));
  s.add("shard_layout", name_of(options.shard_layout));
  s.add("deferred init", !init.init ? "off" : init.check_agrees ? "on, values compared" : "on, not compared");
  for (const auto& b : buffers) s.add("buffer '" + b.fqn + "'", format_shape(b.shape) + " " + std::string(name_of(b.dtype)));
  return s;
}

struct UnitSetup {
  std::vector<ParamStorage> storage;       // each parameter's storage, for Unit::param_storage
  std::vector<CollectedBuffer> buffers;    // the module's buffers, copied into `buffer_copies`
  std::vector<std::string> deferred;       // the parameters deferred init bound storage to, by FQN
};

// Builds `group` for `unit` over the module `visit` walks (buffers: under MixedPrecision,
// cast to `buffer_cast`) and copies the shards and buffers; the caller takes over afterwards.
// `policies`: the unit's policy settings (policy_settings), compared across ranks.
template <class Group>
UnitSetup set_up_unit(const ModuleVisit& visit, Group& group, BufferCopies& buffer_copies, RankZeroValues& rank0,
                      const ShardOptions& options, const UnitInit& init, const Unit& unit, const Settings& policies,
                      std::optional<DType> buffer_cast) {
  const auto& device = group.device();
  const std::string_view name = display_name(unit.fqn());
  const int rank = internals(unit).rank();
  check_shard_options(options, name, rank);
  std::vector<CollectedParam> params;
  UnitSetup setup;
  const SkipSet skip{{options.ignored_modules.begin(), options.ignored_modules.end()},
                     {options.ignored_parameters.begin(), options.ignored_parameters.end()}};
  visit(unit.fqn(), params, setup.buffers, skip);
  {  // a visitor of temporaries, found before anything is copied (a handle type's copies in
     // `params` keep the first visit's tensors alive: a new tensor cannot take one's address)
    std::vector<CollectedParam> again;
    std::vector<CollectedBuffer> again_buffers;
    visit(unit.fqn(), again, again_buffers, skip, /*check_temporaries=*/false);
    check_visits_agree(params, setup.buffers, again, again_buffers, name, rank);
  }
  validate_collected(params, name, rank, device.id(), static_cast<bool>(init.init));
  for (auto& p : params) setup.storage.push_back({storage_key(p), p.info.fqn});
  const auto aliases = take_ties(params, name, rank);
  std::int64_t elements = 0;  // a tied tensor once
  for (const auto& p : params) elements += p.info.numel;
  if (kept_unsharded_by_threshold(group.groups().shards_parameters, elements, options.persistence_threshold))
    group.keep_unsharded();
  group.build(params, aliases, options.shard_layout);
  const std::string groups = describe_groups(group.mesh_groups());
  const Settings settings = unit_settings(policies, options, init, setup.buffers);
  Fingerprint f;
  f.add(unit.fqn());
  f.add(groups);
  group.add_to(f);
  settings.add_to(f);
  check_same_across_ranks(group.groups().world, f, [&] {  // built only on a mismatch
    return "unit '" + std::string(name) + "'";
  }, [&] { return group.describe() + " (" + groups + ")"; }, &settings);
  DeferredStorage deferred(device);  // what deferred init binds, freed however this ends
  if (init.init) {
    for (const auto& p : params)
      if (p.lacks_storage()) setup.deferred.push_back(p.info.fqn);
    run_deferred_init(init.init, skip, init.check_agrees, deferred, params, setup.buffers, group.groups().world,
                      device, name, rank);
  }
  std::vector<CollectedBuffer> rank0_buffers;  // sync_module_states: the buffers at rank 0's values
  if (options.sync_module_states) {
    rank0_buffers = setup.buffers;
    rank0.broadcast(group.groups().world, params, rank0_buffers, deferred.tensors());
  }
  group.copy_shards(params);
  buffer_copies.copy(options.sync_module_states ? rank0_buffers : setup.buffers, buffer_cast);
  rank0.release_parameters();
  return setup;  // `deferred` freed: one unit's full parameters at most, and only until here
}

}  // namespace fsdp::detail
