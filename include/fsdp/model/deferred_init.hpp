#pragma once
// Deferred initialization: build the model from shapes and dtypes alone, and let fsdp::shard
// materialize, initialize and shard it one unit at a time, so that no rank ever holds the
// whole model (FSDP's param_init_fn on a meta-device model).
//
// A parameter without storage is one whose tensor_traits::shape and ::dtype give its real
// shape and dtype while ::data gives null: the state the library itself leaves a resharded
// parameter in, so no new customization point is needed. Its gradient gives the same shape
// and dtype, and needs no storage either. Buffers stay the engine's and need storage.
// fsdp::HostTensor::without_storage(shape, dtype) builds such a tensor.
//
//   auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, fsdp::wrap_types<Block>{},
//                                         fsdp::deferred_init([](auto& module, std::string_view fqn) {
//                                           module.reset_parameters();  // the engine's own init
//                                         }));
//
// For each unit, in unit order, on every rank: the parameters without storage are bound to
// zeroed storage the unit allocates through its Device; init(module, fqn) (or init(module))
// runs once for each module of the unit that owns such a parameter, in pre-order, writing
// the values in place; the unit checks that every parameter still has its shape and dtype
// and has storage (errors name the FQN), copies this rank's shard and frees that storage.
// The per-rank peak while sharding is the shards built so far plus one unit's parameters.
//
// The init must give every rank the same values (seed by FQN, never by rank), as eager
// construction on one rank would. InitCheck::ranks_agree (the default) verifies it (a hash
// per parameter and one all-gather per unit, at setup only) and fails naming the first
// parameter that differs; with ShardOptions::sync_module_states, rank 0's values are
// broadcast after the init instead (and nothing is compared). InitCheck::none skips it.
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "fsdp/unit/detail/deferred_storage.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/core/detail/type_name.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/policy/wrap_policy.hpp"

namespace fsdp {

enum class InitCheck { none, ranks_agree };

template <class F>
struct DeferredInit {
  F init;
  InitCheck check = InitCheck::ranks_agree;
};

// An option of fsdp::shard (in any order among the wrap options, at most once).
template <class F>
DeferredInit<std::decay_t<F>> deferred_init(F&& init, InitCheck check = InitCheck::ranks_agree) {
  return {std::forward<F>(init), check};
}

namespace detail {
template <class T> struct is_deferred_init : std::false_type {};
template <class F> struct is_deferred_init<DeferredInit<F>> : std::true_type {};
struct NoDeferredInit {};

// The init of the unit over `module`: d.init(m, fqn) for each module m of the unit (walked as
// the unit collects its parameters, its SkipSet leaving out other units and ignored modules)
// that owns a parameter the unit materialized. A module the callback cannot be called with
// is an error only if it owns such a parameter.
template <class F, class M, class A = NoModuleAdapter>
InitCallback unit_init(const DeferredInit<F>& d, M& module, std::string fqn, std::shared_ptr<A> shared_adapter = {}) {
  return [&d, &module, fqn = std::move(fqn), shared_adapter](const MaterializedTensors& materialized, const SkipSet& skip) {
    A* adapter = shared_adapter.get();
    for_each_unit_module<wrap_types<>>(module, fqn, skip, [&](auto& m, const std::string& at) {
      bool owns = false;
      for_each_own_parameter(m, [&](std::string_view, auto& p, auto&) {
        owns = owns || materialized.count(tensor_identity(p));  // a handle: what it points to
      }, adapter);
      if (!owns) return;
      using C = std::remove_cvref_t<decltype(m)>;
      if constexpr (std::is_invocable_v<const F&, C&, std::string_view>) std::invoke(d.init, m, std::string_view(at));
      else if constexpr (std::is_invocable_v<const F&, C&>) std::invoke(d.init, m);
      else
        fail("deferred_init: the init callback cannot be called with module '", display_name(at), "' (",
             type_name(typeid(m)), "), whose parameters have no storage yet");
    }, adapter);
  };
}
}  // namespace detail

}  // namespace fsdp
