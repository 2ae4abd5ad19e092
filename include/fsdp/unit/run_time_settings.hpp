#pragma once
// The settings an engine changes between steps, written once for one unit and for a whole
// model: fsdp::Unit and fsdp::ShardedModel derive from RunTimeSettings<Self>, so both have
// the same setters under FSDP2's names, and a model's apply to every one of its units as
// one change (all or none: every unit is checked to be IDLE before any changes).
//
// What each setting does is documented where its value lives: gradient sync in
// fsdp/policy/gradient_sync.hpp, resharding and the divide factor in
// fsdp/policy/reshard_settings.hpp, the hook in fsdp/policy/post_accumulate_grad_hook.hpp.
// A unit's config() reports them as they are now. Every rank must make the same calls (a
// unit checks that they did at its first backward after a change).
//
// Self provides apply_setting(name, check, change, views): it checks that every unit it
// stands for is IDLE, runs check(unit) on each (which may refuse, changing nothing), then
// change(unit) on each (which does not refuse), so one unit's refusal leaves every unit as
// it was. Running out of memory is the one exception: the hook setter allocates a freed
// gradient again (before it changes that unit), and a failed allocation there leaves the
// units before it changed.
#include <optional>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/policy/gradient_sync.hpp"
#include "fsdp/policy/post_accumulate_grad_hook.hpp"
#include "fsdp/policy/reshard_settings.hpp"
#include "fsdp/unit/detail/unit_internals_fwd.hpp"

namespace fsdp {

template <class Self>
class RunTimeSettings {
 public:
  // Gradient accumulation (FSDP2's set_requires_gradient_sync, FSDP1's no_sync).
  void set_requires_gradient_sync(bool on) {
    apply("set_requires_gradient_sync", [on](auto& u) { u.sync_.requires_sync = on; });
  }
  // Hybrid strategies: whether the all-reduce across replicas runs (FSDP2's name).
  void set_requires_all_reduce(bool on) {
    apply("set_requires_all_reduce", [on](auto& u) { u.sync_.requires_all_reduce = on; });
  }
  // How a unit accumulates while its gradient sync is off (GradientSyncMode).
  void set_gradient_sync_mode(GradientSyncMode mode) {
    apply("set_gradient_sync_mode", [mode](auto& u) { u.sync_.mode = mode; });
  }

  // Between forward and backward: free the unsharded parameters (true: FullShard's
  // default) or keep them (false: ShardGradOp's). Units whose parameters are not sharded
  // (NoShard, under the persistence threshold) accept it (config() reports it) and do
  // nothing different.
  void set_reshard_after_forward(bool on) {
    apply("set_reshard_after_forward", [on](auto& u) { detail::internals(u).set_post_forward_group(std::nullopt, on); });
  }
  // A partial reshard (FSDP2's integer reshard_after_forward, ZeRO++ hpZ): keep the
  // parameters sharded over `group` between forward and backward; the group must outlive
  // the setting. Its size must divide every sharded unit's shard group.
  template <Communicator C>
  void set_reshard_after_forward(C& group) {
    apply(
        "set_reshard_after_forward",
        [&group](auto& u) { detail::internals(u).check_post_forward_group(detail::CommRef(group)); },
        [&group](auto& u) { detail::internals(u).set_post_forward_group(detail::CommRef(group), true); });
  }
  // After a backward whose gradient is not final: keep the parameters for the next forward (false).
  void set_reshard_after_backward(bool on) {
    apply("set_reshard_after_backward", [on](auto& u) { u.reshard_.after_backward = on; });
  }
  // What a synchronized reduction divides the summed gradient by: > 0. It overrides
  // ShardOptions::local_gradients, which says what is divided by until this is called: the
  // world size (mean, the default) or 1 (sum).
  void set_gradient_divide_factor(double factor) {
    apply(
        "set_gradient_divide_factor", [factor](auto& u) { detail::check_divide_factor(factor, detail::display_name(u.fqn_), u.rank_); },
        [factor](auto& u) { u.reshard_.gradient_divide_factor = factor; });
  }

  // Run `hook` once a unit's sharded gradient is final; with GradientAfterHook::free the
  // gradient is freed after it (switching to free drops the current sharded gradient, as
  // zero_grad would). An empty hook removes it (and frees nothing).
  void set_post_accumulate_grad_hook(const PostAccumulateGradHook& hook, GradientAfterHook after = GradientAfterHook::keep) {
    apply(
        "set_post_accumulate_grad_hook", [](auto& u) { detail::internals(u).check_grad_hook(); },
        [&](auto& u) { detail::internals(u).install_grad_hook(hook, after); }, /*views_change=*/true);
  }

 protected:
  RunTimeSettings() = default;
  // Not copied apart from the unit or model it belongs to (a copy would be no unit).
  RunTimeSettings(const RunTimeSettings&) = default;
  RunTimeSettings(RunTimeSettings&&) noexcept = default;
  RunTimeSettings& operator=(const RunTimeSettings&) = default;
  RunTimeSettings& operator=(RunTimeSettings&&) noexcept = default;
  ~RunTimeSettings() = default;

 private:
  template <class Change>
  void apply(const char* name, const Change& change) {
    apply(name, [](auto&) {}, change);
  }
  template <class Check, class Change>
  void apply(const char* name, const Check& check, const Change& change, bool views_change = false) {
    static_cast<Self&>(*this).apply_setting(name, check, change, views_change);
  }
};

}  // namespace fsdp
