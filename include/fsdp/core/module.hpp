#pragma once
// The Module customization point: how the library walks an engine's model.
//
//   visit_parameters(m, f)  calls f(std::string_view name, T& param, T& grad) for each of
//                           m's *own* parameters (not its children's); T models fsdp::Tensor.
//                           Or f(name, param), without a gradient tensor: the library owns
//                           that parameter's gradient and the engine writes it through
//                           Unit::gradient(param) / ShardedModel::gradient(param) during the
//                           unit's backward (for engines whose layers own no gradient
//                           tensors, as mlpack's). A module may mix both forms.
//   visit_children(m, f)    calls f(std::string_view name, Child& child) for each direct
//                           child module. Optional: a module without it is a leaf.
//   visit_buffers(m, f)     calls f(std::string_view name, T& buffer) for each of m's own
//                           non-trainable tensors (running statistics and the like).
//                           Optional: MixedPrecision casts them, sync_module_states
//                           broadcasts them.
//   parameters_rebound(m)   called (no arguments besides m) after the library re-pointed any
//                           of m's visited parameters (take-over, gather, reshard, summon,
//                           a failed take-over given back, deferred init's storage bound
//                           and freed), once per module per such pass.
//                           Optional: for engines that keep other views of a parameter's
//                           storage (mlpack's `weight` and `bias` inside `weights`) and
//                           re-point them here from the tensor they visited.
//
// While a unit is built, visit_parameters and visit_buffers are called again from inside
// a running visit of the same module (nested): that tells the module's own tensors from
// temporaries a visitor builds. A visitor must allow it (no non-recursive lock held while
// it calls f).
//
// Each as a member of the model's module adapter (fsdp::module_adapter, in
// fsdp/model/module_adapter.hpp, and ModuleUnder below: an object
// fsdp::shard keeps with the model, for adapters that need per-model state), as a static
// member of a fsdp::module_traits<M> specialization (for module types the engine does not
// own: no function has to be added to a third-party namespace), as a member
// (m.visit_parameters(f)), or as a free function found by ADL, looked up in that order. The
// library joins names with '.' into fully qualified names (FQNs) such as "blocks.3.weight",
// the keys of state dicts and checkpoints.
//
// Type-erased trees: a virtual base works when its visitors take a type-erased callback,
// e.g. virtual void visit_children(const std::function<void(std::string_view, Layer&)>&);
// children are then seen as Layer& and identified by their dynamic type (ModuleId).
#include <functional>
#include <string>
#include <string_view>
#include <typeindex>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "fsdp/core/tensor.hpp"

namespace fsdp {

// Specialize to adapt a module type without touching it. Any of (all static, optional
// except visit_parameters):
//   static void visit_parameters(M&, F&& f);   f(std::string_view, T& param, T& grad), or
//                                              f(std::string_view, T& param): gradient owned
//   static void visit_children(M&, F&& f);     f(std::string_view, Child&)
//   static void visit_buffers(M&, F&& f);      f(std::string_view, T& buffer)
//   static void parameters_rebound(M&);        its parameters were re-pointed
// The primary template is empty: a type without a specialization uses members or ADL.
// `Enable` lets one partial specialization adapt a family of types, e.g. every type
// derived from a framework's module base (fsdp/torch/module_traits.hpp:
// module_traits<M, std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>>>).
template <class M, class Enable = void>
struct module_traits {};

// Which module an object is: its address and type together (a module's first member has
// the module's address). For polymorphic types, the most derived object's address and
// dynamic type, so a child seen through its base class (Layer&) and the same child seen
// as itself (Linear&) are one module.
struct ModuleId {
  const void* address = nullptr;
  std::type_index type = typeid(void);

  template <class M>
  static ModuleId of(const M& m) {
    if constexpr (std::is_polymorphic_v<M>) return {dynamic_cast<const void*>(&m), typeid(m)};
    else return {static_cast<const void*>(&m), typeid(M)};
  }
  friend bool operator==(const ModuleId&, const ModuleId&) = default;
  friend bool operator<(const ModuleId& a, const ModuleId& b) {
    return a.address != b.address ? std::less<const void*>()(a.address, b.address) : a.type < b.type;
  }
};

namespace detail {
struct param_visitor_archetype {
  template <class T> void operator()(std::string_view, T&, T&) const {}
  template <class T> void operator()(std::string_view, T&) const {}  // the library owns the gradient
};
struct child_visitor_archetype {
  template <class C> void operator()(std::string_view, C&) const {}
};

template <class M, class F>
concept traits_param_visit = requires(M& m, F f) { module_traits<M>::visit_parameters(m, f); };
template <class M, class F>
concept traits_child_visit = requires(M& m, F f) { module_traits<M>::visit_children(m, f); };
template <class M, class F>
concept traits_buffer_visit = requires(M& m, F f) { module_traits<M>::visit_buffers(m, f); };
template <class M, class F>
concept member_param_visit = requires(M& m, F f) { m.visit_parameters(f); };
template <class M, class F>
concept adl_param_visit = requires(M& m, F f) { visit_parameters(m, f); };
template <class M, class F>
concept member_child_visit = requires(M& m, F f) { m.visit_children(f); };
template <class M, class F>
concept adl_child_visit = requires(M& m, F f) { visit_children(m, f); };
}  // namespace detail

template <class M>
concept Module = detail::traits_param_visit<M, detail::param_visitor_archetype> ||
                 detail::member_param_visit<M, detail::param_visitor_archetype> ||
                 detail::adl_param_visit<M, detail::param_visitor_archetype>;

// A module adapter with per-model state: an object whose members are looked up before
// module_traits<M>, for the modules they accept (any of, as for module_traits):
//   void visit_parameters(M&, F&& f);   void visit_children(M&, F&& f);
//   void visit_buffers(M&, F&& f);      void parameters_rebound(M&);
// Non-static members (usually templates over M or F), so one adapter holds what a
// static module_traits<M> would keep in a process-wide table: per-layer views, a map from
// layer to its block, counters. fsdp::shard(model, group, device, fsdp::module_adapter(a))
// walks the model through it, and every unit keeps it alive for as long as the unit lives
// (tensors the adapter owns and hands to the library stay valid; parameters_rebound is
// called until the last unit goes); see docs/engines/owned_gradients.md.
// NoModuleAdapter: none (every lookup falls through to module_traits, members and ADL).
struct NoModuleAdapter {};

namespace detail {
template <class A, class M, class F>
concept adapter_param_visit = requires(A& a, M& m, F f) { a.visit_parameters(m, f); };
template <class A, class M, class F>
concept adapter_child_visit = requires(A& a, M& m, F f) { a.visit_children(m, f); };
template <class A, class M, class F>
concept adapter_buffer_visit = requires(A& a, M& m, F f) { a.visit_buffers(m, f); };
template <class A, class M>
concept adapter_rebound_hook = requires(A& a, M& m) { a.parameters_rebound(m); };
}  // namespace detail

// M is a module as adapter A sees it: A visits its parameters, or M is a Module by itself.
template <class M, class A>
concept ModuleUnder = detail::adapter_param_visit<A, M, detail::param_visitor_archetype> || Module<M>;

// Own parameters of m: f(name, param, grad), `grad` a T* lvalue: the engine's gradient
// tensor, or nullptr where the visitor passed none (f(name, param): the library owns it).
// `adapter`: the model's module adapter, asked first (null with A = NoModuleAdapter).
template <class M, class F, class A = NoModuleAdapter>
void for_each_own_parameter(M& m, F&& f, A* adapter = nullptr) {
  static_assert(ModuleUnder<M, A>,
                "fsdp: this type is not an fsdp::Module. Provide visit_parameters(M&, F) (member, "
                "free function found by ADL, static member of a fsdp::module_traits<M> "
                "specialization, or member of the fsdp::module_adapter given to fsdp::shard) that calls "
                "f(std::string_view name, T& param, T& grad) (or f(name, param) when the library is to own "
                "the gradient) for each of the module's own parameters. See docs/concepts.md#module.");
  (void)adapter;  // null, and unused, unless A visits M
  auto checked = [&](std::string_view name, auto& param, auto&... grad) {
    using P = std::remove_cvref_t<decltype(param)>;
    static_assert(sizeof...(grad) <= 1,
                  "fsdp: visit_parameters called f with too many arguments; write f(name, param, grad), or "
                  "f(name, param) when the library is to own the gradient");
    static_assert(Tensor<P>, "fsdp: visit_parameters passed a parameter whose type does not "
                             "satisfy fsdp::Tensor (specialize fsdp::tensor_traits for it)");
    static_assert((std::is_same_v<P, std::remove_cvref_t<decltype(grad)>> && ...),
                  "fsdp: a parameter and its gradient must have the same tensor type");
    // The library rebinds both tensors (tensor_traits<T>::rebind takes T&), so a const one
    // could only fail deep inside the unit; say what to change instead.
    constexpr bool const_param = std::is_const_v<std::remove_reference_t<decltype(param)>>;
    constexpr bool const_grad = (std::is_const_v<std::remove_reference_t<decltype(grad)>> || ...);
    static_assert(!const_param,
                  "fsdp: visit_parameters passed a const parameter; the library rebinds parameters, so "
                  "pass it as T& (a visit_parameters that is a const member function, or takes const M&, "
                  "sees the module's tensors as const: make it non-const)");
    static_assert(!const_grad,
                  "fsdp: visit_parameters passed a const gradient; the library rebinds gradients too, so "
                  "pass it as T&, as the parameter (f(name, param, grad) with both non-const)");
    if constexpr (!const_param && !const_grad) {  // else only the message above
      P* grad_or_null = nullptr;  // null: a two-argument visit, the library owns the gradient
      ((grad_or_null = &grad), ...);
      f(name, param, grad_or_null);
    }
  };
  if constexpr (detail::adapter_param_visit<A, M, decltype(checked)>) adapter->visit_parameters(m, checked);
  else if constexpr (detail::traits_param_visit<M, decltype(checked)>) module_traits<M>::visit_parameters(m, checked);
  else if constexpr (detail::member_param_visit<M, decltype(checked)>) m.visit_parameters(checked);
  else if constexpr (ModuleUnder<M, A>) visit_parameters(m, checked);  // else only the message above
}

// Direct children of m: f(name, child). Leaves have none.
template <class M, class F, class A = NoModuleAdapter>
void for_each_child(M& m, F&& f, A* adapter = nullptr) {
  (void)adapter;
  if constexpr (detail::adapter_child_visit<A, M, detail::child_visitor_archetype>) adapter->visit_children(m, f);
  else if constexpr (detail::traits_child_visit<M, detail::child_visitor_archetype>) module_traits<M>::visit_children(m, f);
  else if constexpr (detail::member_child_visit<M, detail::child_visitor_archetype>) m.visit_children(f);
  else if constexpr (detail::adl_child_visit<M, detail::child_visitor_archetype>) visit_children(m, f);
}

namespace detail {
struct buffer_visitor_archetype {
  template <class T> void operator()(std::string_view, T&) const {}
};
template <class M, class F>
concept member_buffer_visit = requires(M& m, F f) { m.visit_buffers(f); };
template <class M, class F>
concept adl_buffer_visit = requires(M& m, F f) { visit_buffers(m, f); };
}  // namespace detail

// Own buffers of m: f(name, buffer). Modules without visit_buffers have none.
template <class M, class F, class A = NoModuleAdapter>
void for_each_own_buffer(M& m, F&& f, A* adapter = nullptr) {
  (void)adapter;
  auto checked = [&](std::string_view name, auto& buffer) {
    static_assert(Tensor<std::remove_cvref_t<decltype(buffer)>>,
                  "fsdp: visit_buffers passed a buffer whose type does not satisfy fsdp::Tensor");
    f(name, buffer);
  };
  if constexpr (detail::adapter_buffer_visit<A, M, detail::buffer_visitor_archetype>) adapter->visit_buffers(m, checked);
  else if constexpr (detail::traits_buffer_visit<M, detail::buffer_visitor_archetype>) module_traits<M>::visit_buffers(m, checked);
  else if constexpr (detail::member_buffer_visit<M, detail::buffer_visitor_archetype>) m.visit_buffers(checked);
  else if constexpr (detail::adl_buffer_visit<M, detail::buffer_visitor_archetype>) visit_buffers(m, checked);
}

namespace detail {
template <class M>
concept traits_rebound_hook = requires(M& m) { module_traits<M>::parameters_rebound(m); };
template <class M>
concept member_rebound_hook = requires(M& m) { m.parameters_rebound(); };
template <class M>
concept adl_rebound_hook = requires(M& m) { parameters_rebound(m); };

// Whether M has a parameters_rebound hook (member of adapter A, static member of
// module_traits<M>, member, or ADL, looked up in that order as the visitors are).
template <class M, class A = NoModuleAdapter>
inline constexpr bool has_parameters_rebound =
    adapter_rebound_hook<A, M> || traits_rebound_hook<M> || member_rebound_hook<M> || adl_rebound_hook<M>;

// Calls m's parameters_rebound hook; a no-op for a module without one.
template <class M, class A = NoModuleAdapter>
void call_parameters_rebound(M& m, A* adapter = nullptr) {
  (void)adapter;
  if constexpr (adapter_rebound_hook<A, M>) adapter->parameters_rebound(m);
  else if constexpr (traits_rebound_hook<M>) module_traits<M>::parameters_rebound(m);
  else if constexpr (member_rebound_hook<M>) m.parameters_rebound();
  else if constexpr (adl_rebound_hook<M>) parameters_rebound(m);
}
}  // namespace detail

inline std::string join_fqn(std::string_view prefix, std::string_view name) {
  if (prefix.empty()) return std::string(name);
  std::string s;
  s.reserve(prefix.size() + 1 + name.size());
  s.append(prefix).append(".").append(name);
  return s;
}

}  // namespace fsdp
