#pragma once
// fsdp::module_adapter: a module adapter with per-model state, as an option of fsdp::shard.
//
// module_traits<M> adapts a module type with static functions, so whatever an adapter has
// to remember (a layer's views into one parameter block, a table from layer to gradient,
// counters) would live in a process-wide table: shared by every model in the process, with
// a lock and a cleanup of its own, and stale entries when one model goes. An adapter object
// instead belongs to one sharded model: fsdp::shard walks that model through its members
// (fsdp/core/module.hpp says which, and their lookup order) and every unit shares it for as
// long as the unit lives. Several models, several adapters (an adapter shared by several
// models, e.g. by thread ranks, has its hooks called from each rank's thread, and must
// guard its own state).
//
//   struct MlpackAdapter {               // per-model state lives here
//     template <class F> void visit_parameters(mlpack::Layer& l, F&& f) { ... }
//     template <class F> void visit_parameters(Net&, F&&) {}   // every module needs one
//     template <class F> void visit_children(Net& n, F&& f) { ... }
//     void parameters_rebound(mlpack::Layer& l) { ... }
//   };
//   auto adapter = std::make_shared<MlpackAdapter>();
//   auto sharded = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::module_adapter(adapter));
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include "fsdp/core/module.hpp"

namespace fsdp {

// The adapter, as fsdp::shard takes it: shared, so that the engine may keep a handle to
// read or change the adapter's state while the model is sharded.
template <class A>
struct ModuleAdapter {
  std::shared_ptr<A> adapter;
};

namespace detail {
template <class T> struct shared_adapter_of { using type = void; };
template <class A> struct shared_adapter_of<std::shared_ptr<A>> { using type = A; };
// Wrappers that would hide the adapter's members.
template <class T> struct is_unusable_adapter : std::is_pointer<T> {};
template <class T> struct is_unusable_adapter<std::reference_wrapper<T>> : std::true_type {};
template <class T, class D> struct is_unusable_adapter<std::unique_ptr<T, D>> : std::true_type {};
}  // namespace detail

// module_adapter(std::make_shared<A>(...)): an adapter the engine shares (and may read while
// the model is sharded); module_adapter(A{...}): one moved in.
template <class A>
auto module_adapter(A&& adapter) {
  using Shared = typename detail::shared_adapter_of<std::remove_cvref_t<A>>::type;
  static_assert(!detail::is_unusable_adapter<std::remove_cvref_t<A>>::value && !detail::is_unusable_adapter<Shared>::value,
                "fsdp::module_adapter: pass the adapter object itself (moved in) or a std::shared_ptr to it, not a "
                "raw pointer, std::ref or std::unique_ptr: the library would look for the adapter's members on that "
                "wrapper, find none, and never call the adapter");
  static_assert(std::is_void_v<Shared> ? std::is_class_v<std::remove_cvref_t<A>> : std::is_class_v<Shared>,
                "fsdp::module_adapter: the adapter must be an object of class type, whose members visit the model");
  if constexpr (!std::is_void_v<Shared>) {
    static_assert(!std::is_const_v<Shared>, "fsdp::module_adapter: pass a shared_ptr to a non-const adapter (its "
                                            "members may keep state, and are called on a non-const object)");
    return ModuleAdapter<Shared>{std::forward<A>(adapter)};
  } else {
    static_assert(!std::is_lvalue_reference_v<A>,
                  "fsdp::module_adapter: pass the adapter as a std::shared_ptr (std::make_shared<A>(...)) to keep "
                  "a handle to its state, or move it in (fsdp::module_adapter(std::move(a)) or a temporary); a "
                  "copy of a named adapter would leave the engine's object out of the model");
    return ModuleAdapter<std::remove_cvref_t<A>>{std::make_shared<std::remove_cvref_t<A>>(std::forward<A>(adapter))};
  }
}

namespace detail {
template <class T> struct is_module_adapter : std::false_type {};
template <class A> struct is_module_adapter<ModuleAdapter<A>> : std::true_type {};
}  // namespace detail

}  // namespace fsdp
