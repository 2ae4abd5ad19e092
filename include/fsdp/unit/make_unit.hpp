#pragma once
// How fsdp::shard builds a unit without seeing the unit's implementation: what depends on
// the module's type and the policies (the walk of its subtree, the policies as values and
// as settings) is made in the engine's file, and detail::make_unit builds the unit from
// them. It is defined with the unit (fsdp/unit/sharded.hpp): inline by default, once in
// src/fsdp_separate.cpp under FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp), where
// this header is all an engine's file compiles of it.
#include <memory>
#include <string>
#include <utility>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/policy/configuration.hpp"
#include "fsdp/policy/wrap_policy.hpp"
#include "fsdp/unit/detail/module_visit.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/unit/shard_options.hpp"
#include "fsdp/unit/unit.hpp"

namespace fsdp::detail {

// A unit over the module `visit` walks: what fsdp::Sharded<Module, Ps...> is, without its type.
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL std::unique_ptr<Unit> make_unit(const PolicyConfig& policies, const Settings& settings, ModuleId module,
                                          const ModuleVisit& visit, UnitGroups groups, DeviceRef device, std::string fqn,
                                          const ShardOptions& options, const UnitInit& init);
}  // namespace FSDP_MODE_NAMESPACE

// The groups of a unit under the resolved policies Config (Policies<Ps...>), over a
// communicator or a mesh, as fsdp::Sharded's constructors take them.
template <class Config, Communicator C>
UnitGroups groups_for(C& comm) {
  return UnitGroups::flat<typename Config::strategy>(comm);
}
template <class Config, SplittableCommunicator C>
UnitGroups groups_for(DeviceMesh<C>& mesh) {
  return UnitGroups::from_mesh<typename Config::strategy>(mesh);
}

// What building a unit under the resolved policies Config (Policies<Ps...>) needs of them,
// as values: fsdp::shard makes it once, so that its walk over the model (build_units) and
// the unit's construction compile once per module type, not once per set of policies.
struct UnitRecipe {
  PolicyConfig policies;
  const Settings* settings = nullptr;  // policy_settings<Config>()
  UnitGroups groups;

  template <class Config, class Group>
  static UnitRecipe of(Group& group) {
    return {policy_config<Config>(), &policy_settings<Config>(), groups_for<Config>(group)};
  }
};

// The unit of `module`. ChangesDtype: Config::mixed_precision::enabled (the walk's checks depend on it).
// `adapter`: the model's module adapter (fsdp::module_adapter; empty: none).
template <bool ChangesDtype, class M, Device D, class A = NoModuleAdapter>
std::unique_ptr<Unit> make_unit_from(const UnitRecipe& recipe, M& module, D& device, std::string fqn,
                                     const ShardOptions& options, const UnitInit& init,
                                     const std::shared_ptr<A>& adapter = {}) {
  return make_unit(recipe.policies, *recipe.settings, ModuleId::of(module),
                   ModuleVisit::of<wrap_types<>, ChangesDtype>(module, adapter), recipe.groups, DeviceRef(device),
                   std::move(fqn), options, init);
}

}  // namespace fsdp::detail
