#pragma once
// One unit's post-accumulate-grad hook (fsdp/policy/post_accumulate_grad_hook.hpp): the hook,
// whether it is due (a reduction that makes the gradient final was issued), and what
// happens to the sharded gradient after it.
#include <functional>
#include <utility>

#include "fsdp/policy/post_accumulate_grad_hook.hpp"

namespace fsdp::detail {

class PostGradHookSlot {
 public:
  bool installed() const { return static_cast<bool>(hook_); }
  GradientAfterHook after() const { return after_; }
  bool frees_gradient() const { return after_ == GradientAfterHook::free; }

  // What set(hook, after) will make of `after`: no hook keeps the gradient.
  static GradientAfterHook after_of(const PostAccumulateGradHook& hook, GradientAfterHook after) {
    return hook ? after : GradientAfterHook::keep;
  }
  // Installs `hook` (none: the gradient is kept). The unit frees or reallocates its
  // sharded gradient to match.
  void set(PostAccumulateGradHook hook, GradientAfterHook after) {
    after_ = after_of(hook, after);
    hook_ = std::move(hook);
  }

  // The reduction just issued makes the gradient final (sync on, nothing of it deferred).
  void arm(bool final_gradient) { due_ = hook_ && final_gradient; }
  // Whether the hook is due, which it no longer is after this.
  bool take_due() { return std::exchange(due_, false); }

  // The engine's hook, then (GradientAfterHook::free) `free_gradient`, also when the hook throws.
  template <class FreeGradient>
  void run(Unit& unit, FreeGradient&& free_gradient) {
    try {
      hook_(unit);
    } catch (...) {
      if (frees_gradient()) free_gradient();
      throw;
    }
    if (frees_gradient()) free_gradient();
  }

 private:
  PostAccumulateGradHook hook_;
  GradientAfterHook after_ = GradientAfterHook::keep;
  bool due_ = false;
};

}  // namespace fsdp::detail
