#pragma once
// Taking over the engine's tensors (the last step of a unit's construction): every
// parameter, gradient and cast buffer is rebound to the unit's storage or to nothing. The
// engine's tensor_traits<T>::rebind may throw; then the unit must not keep half of them,
// nor leave a tensor pointing at storage it is about to free. TakeOverLog rebinds one
// tensor at a time and remembers those it pointed at the unit's storage (or showed in
// another dtype); if a rebind throws, it hands those back (no storage, their own dtype)
// and throws an fsdp::Error naming the unit and the tensor. Tensors not reached keep their
// storage and values. A tensor already rebound cannot get its old storage back: its rebind
// released it, as the Tensor contract asks (docs/concepts.md).
#include <algorithm>
#include <cstddef>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/detail/flat_param_storage.hpp"
#include "fsdp/error.hpp"

namespace fsdp::detail {

class TakeOverLog {
 public:
  TakeOverLog(std::string_view unit, int rank) : unit_(unit), rank_(rank) {}
  TakeOverLog(const TakeOverLog&) = delete;
  TakeOverLog& operator=(const TakeOverLog&) = delete;

  // Points `tensor` at `data` shown in `dtype`; `own` is the tensor's own dtype, `what`
  // names it for the message ("parameter 'a.w'").
  void rebind(void* tensor, RebindFn fn, void* data, DType dtype, DType own, const std::string& what) {
    try {
      fn(tensor, data, dtype);
    } catch (const std::exception& e) {
      failed(what, e.what());
    } catch (...) {
      failed(what, "an exception that is not a std::exception");
    }
    if (data || dtype != own) shown_.push_back({tensor, fn, own});
  }

 private:
  struct Shown {
    void* tensor;
    RebindFn fn;
    DType own;
  };

  // Hands back what was pointed at the unit's storage, newest first. Noexcept: a second
  // throw here would leave a tensor viewing memory the unit frees next.
  void hand_back() noexcept {
    for (auto it = shown_.rbegin(); it != shown_.rend(); ++it) it->fn(it->tensor, nullptr, it->own);
    shown_.clear();
  }

  [[noreturn]] void failed(const std::string& what, std::string_view why) {
    hand_back();
    fail("unit '", unit_, "' on rank ", rank_, ": tensor_traits<T>::rebind threw while the unit took over ", what,
         ": ", why, "; the unit took over nothing (tensors rebound before it are left without storage, the others "
         "as they were)");
  }

  std::string_view unit_;
  int rank_;
  std::vector<Shown> shown_;
};

// Take-over of one flat parameter: gradients to nothing, parameters to `params_at` (the
// replicated shard for good) or to nothing, each tied name with its parameter.
inline void take_over_tensors(FlatParam& fp, void* params_at, TakeOverLog& log) {
  const DType own = fp.master();
  const auto& infos = fp.layout.params();
  auto at = [&](std::size_t i) -> void* {
    return params_at ? static_cast<std::byte*>(params_at) + infos[i].offset * size_of(own) : nullptr;
  };
  std::vector<std::size_t> next_alias(infos.size(), 0);  // alias_bindings follow infos[i].aliases
  auto name = [&](std::size_t i, bool alias) {
    return "parameter '" + (alias ? infos[i].aliases.at(next_alias[i]++) : infos[i].fqn) + "'";
  };
  for (std::size_t i = 0; i < fp.bindings.size(); ++i)
    log.rebind(fp.bindings[i].grad, fp.bindings[i].rebind, nullptr, own, own, "the gradient of " + name(i, false));
  for (auto& [i, b] : fp.alias_bindings) log.rebind(b.grad, b.rebind, nullptr, own, own, "the gradient of " + name(i, true));
  std::fill(next_alias.begin(), next_alias.end(), 0);
  for (std::size_t i = 0; i < fp.bindings.size(); ++i)
    log.rebind(fp.bindings[i].param, fp.bindings[i].rebind, at(i), own, own, name(i, false));
  for (auto& [i, b] : fp.alias_bindings) log.rebind(b.param, b.rebind, at(i), own, own, name(i, true));
}

}  // namespace fsdp::detail
