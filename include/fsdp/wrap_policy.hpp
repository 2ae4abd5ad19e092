#pragma once
// Wrap policies: which modules of a model become units of their own.
#include <type_traits>

namespace fsdp {

// Types whose instances become units of their own (FSDP's ModuleWrapPolicy).
template <class... Types>
struct wrap_types {
  template <class T>
  static constexpr bool contains = (std::is_same_v<T, Types> || ...);
};

}  // namespace fsdp
