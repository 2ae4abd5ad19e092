#pragma once
// Wrap policies: which modules of a model become units of their own. fsdp::shard takes any
// of these options in any order, at most one of each kind; a module becomes a unit when
// any given policy selects it (see fsdp/model/shard.hpp for the walk and its order):
//   wrap_types<Ts...>{}       each outermost module whose static type is listed (FSDP's
//                             ModuleWrapPolicy); its whole subtree is that one unit
//   wrap_min_params(n)        FSDP's size_based_auto_wrap_policy: a module whose subtree still
//                             holds >= n parameter elements not in a unit yet
//   wrap_if(pred, "name")     a run-time predicate, pred(module, fqn, depth, unwrapped) -> bool;
//                             asked for each module it can be called with (a predicate taking
//                             Layer& sees the Layer children of a type-erased tree)
//   wrap_modules(a, b, ...)   these module instances (manual wrapping; nesting allowed)
// Units may nest (except inside a wrap_types unit): each parameter belongs to the innermost.
#include <cstdint>
#include <string>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

#include "fsdp/core/detail/type_name.hpp"  // detail::type_name, for describe_policy
#include "fsdp/core/module.hpp"

namespace fsdp {

// Types whose instances become units of their own (FSDP's ModuleWrapPolicy). Matches the
// static type a module is visited as: a type-erased child (Layer&) matches Layer only; use
// wrap_if with a dynamic_cast to pick derived types.
template <class... Types>
struct wrap_types {
  template <class T>
  static constexpr bool contains = (std::is_same_v<T, Types> || ...);
};

// FSDP's size_based_auto_wrap_policy: a module (not the root) becomes a unit when the
// parameter elements of its subtree not yet in a unit (nor ignored) reach `min_numel`.
struct WrapMinParams {
  std::int64_t min_numel = 100'000'000;  // FSDP's default min_num_params
};
inline WrapMinParams wrap_min_params(std::int64_t min_numel) { return {min_numel}; }

// A module (not the root) becomes a unit when pred(module, fqn, depth, unwrapped) is true:
// depth 1 for the root's children; unwrapped counts the parameter elements of its subtree
// not yet in a unit (nor ignored). `name` names the policy in errors.
template <class Pred>
struct WrapIf {
  Pred pred;
  std::string name = "predicate";
};
template <class Pred>
WrapIf<std::decay_t<Pred>> wrap_if(Pred&& pred, std::string name = "predicate") {
  return {std::forward<Pred>(pred), std::move(name)};
}

// These module instances become units (FSDP's manual wrapping). A listed module inside
// another listed one is a unit nested in it: the outer unit takes what is left.
struct WrapModules {
  std::vector<ModuleId> modules;
};
template <class... Ms>
WrapModules wrap_modules(const Ms&... modules) {
  return {{ModuleId::of(modules)...}};
}

namespace detail {
template <class T> struct is_wrap_types : std::false_type {};
template <class... Ts> struct is_wrap_types<wrap_types<Ts...>> : std::true_type {};
template <class T> struct is_wrap_if : std::false_type {};
template <class P> struct is_wrap_if<WrapIf<P>> : std::true_type {};
template <class T> struct is_min_params : std::is_same<T, WrapMinParams> {};
template <class T> struct is_wrap_modules : std::is_same<T, WrapModules> {};

template <class... Ts>
std::string describe_policy(wrap_types<Ts...>) {
  std::string s = "wrap_types<";
  ((s += type_name(typeid(Ts)) + ", "), ...);
  if (sizeof...(Ts)) s.resize(s.size() - 2);
  return s + ">";
}
}  // namespace detail

}  // namespace fsdp
