#pragma once
// Taking over the engine's tensors (the last step of setup): every parameter, gradient and
// cast buffer is rebound to a unit's storage or to nothing. The engine's
// tensor_traits<T>::rebind may throw; then no unit may keep half of them, nor leave a
// tensor pointing at storage about to be freed. TakeOverLog rebinds one tensor at a time
// and records it: for a type with keep/restore (fsdp::KeepsStorage), the engine's storage
// is kept alive until every unit took over (commit), so a rebind that throws anywhere
// gives every tensor its storage and values back; a type without them can only be handed
// back empty (its rebind released the storage, as the Tensor contract asks). Either way
// nothing views the units' memory afterwards, and an fsdp::Error names the unit and tensor.
// The modules' parameters_rebound hooks run after a unit took over and again after a roll
// back, so that an engine's other views of its parameters follow them both ways.
#include <algorithm>
#include <cstddef>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/unit/detail/unit_internals_fwd.hpp"

namespace fsdp::detail {

class TakeOverLog {
 public:
  explicit TakeOverLog(int rank) : rank_(rank) {}
  TakeOverLog(const TakeOverLog&) = delete;
  TakeOverLog& operator=(const TakeOverLog&) = delete;
  // Not committed (an exception on the way): everything is rolled back.
  ~TakeOverLog() { roll_back(); }

  // The unit whose tensors come next (named in an error).
  void unit(std::string_view name) { unit_ = name; }

  // Points `tensor` at `data` shown in `dtype`; `own` is the tensor's own dtype, `what`
  // names it for the message ("parameter 'a.w'"). `keep` (may be null) keeps its storage.
  // `id`: which tensor it is (ParamBinding::id; null: `tensor` itself), so that a tensor
  // tied under two names, through two handles, counts once among the lost.
  void rebind(void* tensor, RebindFn fn, KeepFn keep, void* data, DType dtype, DType own, const std::string& what,
              const void* id = nullptr) {
    // Room first: once the tensor has changed, recording it must not fail. A failure here
    // has changed nothing of it (the destructor rolls back the others).
    room_for_one(shown_);
    room_for_one(kept_);
    room_for_one(lost_);
    const char* call = "keep";
    try {
      if (keep) kept_.push_back(keep(tensor));  // before the rebind releases it
      call = "rebind";
      fn(tensor, data, dtype);
    } catch (const std::exception& e) {
      failed(call, what, e.what(), kind_of(e));  // an engine's std::bad_alloc stays out_of_memory
    } catch (...) {
      failed(call, what, "an exception that is not a std::exception", ErrorKind::misuse);
    }
    if (data || dtype != own) shown_.push_back({tensor, fn, own});
    if (!keep) lost_.push_back(id ? id : tensor);
  }

  // The parameters_rebound hooks of the modules whose tensors a unit rebinds next: run
  // again after a roll back. Before that unit's first rebind.
  void hooks(const std::vector<ReboundHook>& hooks) { hooks_.insert(hooks_.end(), hooks.begin(), hooks.end()); }

  // Every unit took over: the engine's old storage goes.
  void commit() noexcept {
    shown_.clear();
    kept_.clear();
    lost_.clear();
    hooks_.clear();
  }

  // Hands back what was pointed at a unit's storage (no storage, own dtype), then gives the
  // kept storage back, newest first, then tells the modules. Noexcept: a second throw here
  // would leave a tensor viewing memory the units free next; a hook that throws here is
  // not heard (the take-over's own error is what the caller gets).
  void roll_back() noexcept {
    for (auto it = shown_.rbegin(); it != shown_.rend(); ++it) it->fn(it->tensor, nullptr, it->own);
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) (*it)->restore();
    for (const auto& h : hooks_) {
      try {
        h();
      } catch (...) {
      }
    }
    commit();
  }

 private:
  struct Shown {
    void* tensor;
    RebindFn fn;
    DType own;
  };

  template <class V>
  static void room_for_one(V& v) {
    if (v.size() == v.capacity()) v.reserve(2 * v.size() + 16);
  }

  [[noreturn]] void failed(const char* call, const std::string& what, std::string_view why, ErrorKind kind) {
    const std::string outcome = roll_back_outcome("rebound before it");
    roll_back();
    fail_as(kind, "unit '", unit_, "' on rank ", rank_, ": tensor_traits<T>::", call,
            " threw while the unit took over ", what, ": ", why, outcome);
  }

 public:
  // What roll_back leaves, for an error's end: "; nothing was taken over, ...". `rebound`
  // says when the tensors left without storage were rebound ("rebound before it"), `where`
  // where nothing was taken over ("" or " here either").
  std::string roll_back_outcome(std::string_view rebound, std::string_view where = "") {
    std::sort(lost_.begin(), lost_.end(), std::less<>());  // a tensor tied under two names counts once
    const auto lost = static_cast<std::size_t>(std::unique(lost_.begin(), lost_.end()) - lost_.begin());
    lost_.resize(lost);
    const std::string nothing = "; nothing was taken over" + std::string(where);
    if (!lost) return nothing + ", and every tensor keeps its storage and values";
    return nothing + ", but " + std::to_string(lost) + (lost == 1 ? " tensor " : " tensors ") +
           std::string(rebound) + (lost == 1 ? " is" : " are") +
           " left without storage (their tensor_traits<T> has no keep/restore to give it back, "
           "docs/concepts.md#tensor); the others keep theirs";
  }

 private:

  std::string unit_;
  int rank_;
  std::vector<Shown> shown_;
  std::vector<std::unique_ptr<KeptStorage>> kept_;
  std::vector<const void*> lost_;  // tensors rebound without kept storage, by identity
  std::vector<ReboundHook> hooks_;  // run after a roll back
};

// Takes over `units` (pointers to fsdp::Unit, sharing one world) as one, on every rank of
// that world together: each rebinds into one log, then the ranks agree; a rebind that
// throws in any unit on any rank gives back every unit's tensors on every rank, each of
// those units forgetting what it did. The rank that failed throws its own error; every
// other rank an echo naming that rank and quoting it (fsdp/core/detail/root_cause.hpp),
// with what its own roll back left. Units taken over by an earlier call are left alone.
// After the commit every unit finishes (writes rank 0's buffer values; a no-op where done
// before). A collective: every rank of the world calls it (fsdp::shard and
// ShardedModel::take_over do; a unit built alone, in its constructor).
template <class UnitPtrs>
void take_over_together(int rank, const UnitPtrs& units) {
  using U = std::remove_reference_t<decltype(**std::begin(units))>;
  if (std::empty(units)) return;
  TakeOverLog log(rank);
  std::vector<U*> taking;
  taking.reserve(std::size(units));  // push_back below cannot throw
  auto forget = [&]() noexcept {
    for (U* u : taking) internals(*u).forget_take_over();  // the log gives the tensors back after
  };
  std::exception_ptr failure;
  try {
    for (auto& u : units) {
      taking.push_back(&*u);  // before its take_over: a unit that throws midway forgets too
      if (!internals(*u).take_over(log)) taking.pop_back();
    }
  } catch (...) {
    failure = std::current_exception();
  }
  const auto& first = internals(**std::begin(units));
  bool agreed = false;
  try {
    agreed = first.all_ranks_agree(!failure, TagPhase::take_over, nullptr);
  } catch (...) {  // the agreement itself failed (a peer lost): nothing taken over here either
    forget();
    if (failure) std::rethrow_exception(failure);  // this rank's own error first
    throw;
  }
  if (agreed) {
    log.commit();
    for (auto& u : units) internals(*u).finish_take_over();
    return;
  }
  forget();  // first: nothing below may leave a unit that believes it took over
  const std::string outcome = log.roll_back_outcome("rebound here", " here either");
  log.roll_back();
  const OwnFailure own = own_failure(failure);
  auto root_cause = [&] {
    return agreed_root_cause(first.world_size(), rank, [&](std::int64_t v) { return first.max_over_ranks(v); },
                             own.message, own.kind);
  };
  if (failure) {  // names the unit, the tensor and what its roll back left; the others need its message first
    try {
      root_cause();
    } catch (...) {
    }
    std::rethrow_exception(failure);
  }
  const RootCause root = root_cause();
  fail_echo(root.kind, root.rank, "setup on rank ", rank, ": the take-over of the engine's tensors failed on rank ",
            root.rank, ", so no rank takes over; rank ", root.rank, " says: ", root.message, outcome);
}

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
  auto grad = [&](const ParamBinding& b, std::size_t i, bool alias) {
    if (!b.grad) {  // the library owns it: no engine tensor
      if (alias) ++next_alias[i];
      return;
    }
    log.rebind(b.grad, b.rebind, b.keep, nullptr, own, own, "the gradient of " + name(i, alias), b.grad_id);
  };
  auto param = [&](const ParamBinding& b, std::size_t i, bool alias) {
    log.rebind(b.param, b.rebind, b.keep, at(i), own, own, name(i, alias), b.id);
  };
  for (std::size_t i = 0; i < fp.bindings.size(); ++i) grad(fp.bindings[i], i, false);
  for (auto& [i, b] : fp.alias_bindings) grad(b, i, true);
  std::fill(next_alias.begin(), next_alias.end(), 0);
  for (std::size_t i = 0; i < fp.bindings.size(); ++i) param(fp.bindings[i], i, false);
  for (auto& [i, b] : fp.alias_bindings) param(b, i, true);
}

}  // namespace fsdp::detail
