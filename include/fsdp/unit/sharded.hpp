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
#include "fsdp/core/config.hpp"
#include "fsdp/unit/sharded_hooks.hpp"  // the unit class and its hooks' definitions
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/unit/make_unit.hpp"
#include "fsdp/unit/unit_setup.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/unit/shard_options.hpp"
#include "fsdp/policy/wrap_policy.hpp"

namespace fsdp {

namespace detail {
// The unit fsdp::shard builds (detail::make_unit, fsdp/unit/make_unit.hpp): a ShardedUnit whose
// module type only its visit knows. Under FSDP_SEPARATE_COMPILATION only
// fsdp/separate_compilation.hpp defines make_unit, so the unit's vtable and hooks are
// compiled there alone.
class BuiltUnit final : public ShardedUnit {
 public:
  template <class... Args>
  explicit BuiltUnit(Args&&... args) : ShardedUnit(std::forward<Args>(args)...) {}
};

#if FSDP_DEFINES_IMPLEMENTATION
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL std::unique_ptr<Unit> make_unit(const PolicyConfig& policies, const Settings& settings, ModuleId module,
                                          const ModuleVisit& visit, UnitGroups groups, DeviceRef device, std::string fqn,
                                          const ShardOptions& options, const UnitInit& init) {
  return std::make_unique<BuiltUnit>(policies, settings, module, visit, std::move(groups), device, std::move(fqn), options,
                                     init);
}
}  // namespace FSDP_MODE_NAMESPACE
#endif
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
                exclude) {
    detail::check_device_quantizes<policies, D>();
  }

  // Over a mesh: the hybrid strategies shard inside its shard groups and replicate across
  // its replicate groups; the others use its whole world as above.
  template <SplittableCommunicator C, Device D, class Exclude = wrap_types<>>
  Sharded(Module& module, DeviceMesh<C>& mesh, D& device, std::string fqn = {}, const ShardOptions& options = {},
          Exclude exclude = {})
      : Sharded(module, detail::UnitGroups::from_mesh<strategy>(mesh), detail::DeviceRef(device), std::move(fqn), options,
                {}, exclude) {
    detail::check_device_quantizes<policies, D>();
  }

 private:
  template <class Exclude>
  Sharded(Module& module, detail::UnitGroups groups, detail::DeviceRef device, std::string fqn, const ShardOptions& options,
          const detail::UnitInit& init, Exclude)
      : ShardedUnit(policy_config<policies>(), detail::policy_settings<policies>(), ModuleId::of(module),
                    detail::ModuleVisit::of<Exclude, policies::mixed_precision::enabled>(module), std::move(groups), device,
                    std::move(fqn), options, init) {}
};

}  // namespace fsdp
