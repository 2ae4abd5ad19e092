#pragma once
// A readable type name for messages ("engine::Block", not "N6engine5BlockE"). Here, in
// core, beside ModuleId (whose std::type_index the messages of fsdp::shard and ShardedModel
// print), so that every layer that names a type in an error demangles it the same way:
// the wrap policies (wrap_types<...>), the unit (its policies), the model (unit_for,
// ignored_modules, wrap_modules, deferred_init).
#include <cstdlib>
#include <memory>
#include <string>
#include <typeindex>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#endif

namespace fsdp::detail {

inline std::string type_name(std::type_index t) {
#if __has_include(<cxxabi.h>)
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> s(abi::__cxa_demangle(t.name(), nullptr, nullptr, &status), std::free);
  if (status == 0 && s) return s.get();
#endif
  return t.name();  // no demangler: the implementation's name
}

}  // namespace fsdp::detail
