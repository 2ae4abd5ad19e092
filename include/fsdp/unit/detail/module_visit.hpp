#pragma once
// What of a unit depends on the types it was built with, as values a unit built elsewhere
// can take: the walk of its module's subtree (ModuleVisit, the one step of construction
// that depends on the module's type) and its policies as the settings every rank must
// choose alike (policy_settings). fsdp::shard makes both in the engine's file and hands
// them to the unit (fsdp/unit/make_unit.hpp), so the rest of the unit compiles once.
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/policy/wrap_policy.hpp"
#include "fsdp/unit/detail/param_collection.hpp"

namespace fsdp::detail {

// A policy for messages: its type without the namespace ("FullShard",
// "MixedPrecision<bf16, float, bf16, false>").
inline std::string policy_name(const std::type_info& policy) {
  std::string s = type_name(policy);
  for (std::size_t at; (at = s.find("fsdp::")) != std::string::npos;) s.erase(at, 6);
  return s;
}

// The policies of a configuration, as the settings every rank must choose alike, from the
// policies' types in the order of Policies<Ps...>: strategy, mixed precision,
// communication precision, backward prefetch, forward prefetch, CPU offload.
inline Settings policy_settings_of(const std::type_info* const (&policies)[6]) {
  static constexpr const char* kNames[6] = {"sharding strategy", "mixed precision", "communication precision",
                                            "backward prefetch", "forward prefetch", "cpu offload"};
  Settings p;
  for (int i = 0; i < 6; ++i) p.add(kNames[i], policy_name(*policies[i]));
  return p;
}
template <class Config>
const Settings& policy_settings() {
  static const Settings policies = policy_settings_of(  // the same for every unit of a configuration
      {&typeid(typename Config::strategy), &typeid(typename Config::mixed_precision),
       &typeid(typename Config::comm_precision), &typeid(typename Config::backward_prefetch),
       &typeid(typename Config::forward_prefetch), &typeid(typename Config::cpu_offload)});
  return policies;
}

// The one step of a unit's construction that depends on the module's type: walking its
// subtree for parameters and buffers. Everything after it works on what it collected, so
// the rest of a unit (its setup, its hooks) compiles once, not once per module type.
// `adapter`: the model's module adapter (fsdp::module_adapter; empty without one), which the
// unit built from this visit keeps (its rebound hooks point into it).
struct ModuleVisit {
  void* module = nullptr;
  std::shared_ptr<void> adapter;
  void (*collect)(void* module, void* adapter, const std::string& prefix,
                  std::vector<CollectedParam>& params, std::vector<CollectedBuffer>& buffers, const SkipSet& skip,
                  bool check_temporaries) = nullptr;

  template <class Exclude, bool ChangesDtype, class M, class A = NoModuleAdapter>
  static ModuleVisit of(M& module, const std::shared_ptr<A>& adapter = {}) {
    return {&module, adapter,
            [](void* m, void* a, const std::string& prefix, std::vector<CollectedParam>& params,
               std::vector<CollectedBuffer>& buffers, const SkipSet& skip, bool check_temporaries) {
              collect_parameters<Exclude, ChangesDtype>(*static_cast<M*>(m), prefix, params, buffers, skip,
                                                        check_temporaries, static_cast<A*>(a));
            }};
  }
  // check_temporaries: the nested visit of collect_parameters' TemporaryCheck (the first
  // collection of a unit; the second is compared with it instead).
  void operator()(const std::string& prefix, std::vector<CollectedParam>& params, std::vector<CollectedBuffer>& buffers,
                  const SkipSet& skip, bool check_temporaries = true) const {
    collect(module, adapter.get(), prefix, params, buffers, skip, check_temporaries);
  }
};

}  // namespace fsdp::detail
