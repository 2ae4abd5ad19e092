#pragma once
// fsdp::Sharded<Module, Policies...>: one unit of sharding (FSDP's wrapped module). At
// construction it takes over the module's parameters (all of its subtree, except children
// whose type is listed in the `exclude` wrap_types and what ShardOptions::ignored_* name: units
// of their own, ignored modules and parameters). Module may be a polymorphic base
// (Sharded<Layer> over a Layer&): its FlatParamGroup copies this rank's slice into a flat
// shard, it checks that every rank built the same unit, and it rebinds the engine's tensors
// to "no storage". The hooks then make the parameters valid exactly while the engine
// computes with them; inside a ShardedModel they also follow its ExecutionOrder to prefetch
// and to keep one reduction in flight.
//
// Only the walk of the module's subtree depends on Module, and only the checks of the
// policies on their types: the hooks, the setup and the state-dict interface are
// fsdp/unit/sharded_unit.hpp's, which reads the policies as values and compiles once.
#include <memory>
#include <string>
#include <utility>

#include "fsdp/core/communicator.hpp"
#include "fsdp/unit/sharded_hooks.hpp"  // the unit class and its hooks' definitions
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/unit/unit_setup.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/unit/shard_options.hpp"
#include "fsdp/policy/wrap_policy.hpp"

namespace fsdp {

namespace detail {
// How fsdp::shard builds each unit: with the unit's part of a deferred init, which a unit
// built by hand does not take (Sharded's constructor that takes it is private).
struct UnitFactory {
  template <class U, class Group, class D>
  static std::unique_ptr<U> make(typename U::module_type& module, Group& group, D& device, std::string fqn,
                                 const ShardOptions& options, const UnitInit& init) {
    return std::unique_ptr<U>(new U(module, group, device, std::move(fqn), options, init));
  }
};
}  // namespace detail

template <class Module, class... Ps>
class Sharded final : public detail::ShardedUnit {
 public:
  using module_type = Module;
  using policies = Policies<Ps...>;  // the resolved policies (Unit::config() reports them as values)
  using strategy = typename policies::strategy;

  // Over one communicator: FullShard and ShardGradOp shard across it, NoShard replicates.
  // `fqn`: the module's FQN within the model ("" for the root), which names its parameters.
  // Children whose type is in `exclude` are left out (units of their own).
  template <Communicator C, Device D, class Exclude = wrap_types<>>
  Sharded(Module& module, C& comm, D& device, std::string fqn = {}, const ShardOptions& options = {}, Exclude exclude = {})
      : Sharded(module, detail::UnitGroups::flat<strategy>(comm), detail::DeviceRef(device), std::move(fqn), options, {},
                exclude) {}

  // Over a mesh: the hybrid strategies shard inside its shard groups and replicate across
  // its replicate groups; the others use its whole world as above.
  template <SplittableCommunicator C, Device D, class Exclude = wrap_types<>>
  Sharded(Module& module, DeviceMesh<C>& mesh, D& device, std::string fqn = {}, const ShardOptions& options = {},
          Exclude exclude = {})
      : Sharded(module, detail::UnitGroups::from_mesh<strategy>(mesh), detail::DeviceRef(device), std::move(fqn), options,
                {}, exclude) {}

 private:
  friend struct detail::UnitFactory;
  template <Communicator C, Device D>
  Sharded(Module& module, C& comm, D& device, std::string fqn, const ShardOptions& options, const detail::UnitInit& init)
      : Sharded(module, detail::UnitGroups::flat<strategy>(comm), detail::DeviceRef(device), std::move(fqn), options, init,
                wrap_types<>{}) {}
  template <SplittableCommunicator C, Device D>
  Sharded(Module& module, DeviceMesh<C>& mesh, D& device, std::string fqn, const ShardOptions& options,
          const detail::UnitInit& init)
      : Sharded(module, detail::UnitGroups::from_mesh<strategy>(mesh), detail::DeviceRef(device), std::move(fqn), options,
                init, wrap_types<>{}) {}

  template <class Exclude>
  Sharded(Module& module, detail::UnitGroups groups, detail::DeviceRef device, std::string fqn, const ShardOptions& options,
          const detail::UnitInit& init, Exclude)
      : ShardedUnit(policy_config<policies>(), detail::policy_settings<policies>(), ModuleId::of(module),
                    detail::ModuleVisit::of<Exclude, policies::mixed_precision::enabled>(module), std::move(groups), device,
                    std::move(fqn), options, init) {}
};

}  // namespace fsdp
