#pragma once
// The hooks of a unit's state machine (fsdp/unit/sharded_unit.hpp), defined out of the
// class so that it reads as its interface. This header is the whole unit: fsdp/unit/sharded.hpp
// includes it.
#include "fsdp/unit/sharded_unit.hpp"

namespace fsdp::detail {

inline void ShardedUnit::pre_forward_body() {
  HookScope scope(*this, "pre_forward");
  expect_not_failed("pre_forward");
  expect_taken_over("pre_forward");
  if (uses_.is_recompute(state_, order_ && order_->in_backward())) return begin_recompute();
  expect({TrainingState::IDLE}, "pre_forward");
  check_storage("pre_forward");
  if (order_) order_->enter(*this, order_index_, Pass::forward, group_.groups().world, policies_.forward_prefetch);
  uses_.enter_forward(order_ ? order_->forward_pass() : 0);
  // Parameters kept since a forward that no backward consumed may predate an optimizer
  // step: gather afresh.
  if (kept_) release_unsharded();
  unshard();  // a no-op where the last backward kept the parameters (reshard_after_backward off)
  kept_after_backward_ = false;
  prefetch_ahead(forward_prefetch_, Pass::forward, policies_.forward_prefetch);  // runs behind this unit's forward
  state_ = TrainingState::FORWARD;
  compute_begin_ = now_if_traced();
}

inline void ShardedUnit::post_forward_body() {
  HookScope scope(*this, "post_forward");
  expect({TrainingState::FORWARD}, "post_forward");
  if (uses_.recompute_from) return end_recompute();
  record_compute("forward");
  reshard_after_forward(!reshard_.after_forward || (order_ && order_->keeps_after_forward(*this)));
  state_ = TrainingState::IDLE;
}

inline void ShardedUnit::pre_backward_body() {
  HookScope scope(*this, "pre_backward");
  expect_not_failed("pre_backward");  // also between the backward entries of a unit used several times
  if (!uses_.awaits_backward(state_)) {
    if (state_ == TrainingState::BACKWARD_POST)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": pre_backward called after the unit's last backward ",
                   "entry of this pass (it ran forward ", uses_.forward_entries(), " time(s) and backward as often, so its ",
                   "gradient was reduced); a unit runs backward once per forward entry until finish_backward");
    expect({TrainingState::IDLE}, "pre_backward");
    expect_taken_over("pre_backward");
    if (sync_ != agreed_sync_ || reshard_ != agreed_reshard_) {  // only after a change: plain training runs no extra collective
      detail::agree_unit_settings(group_.groups().world, sync_, reshard_, local_gradients_, display_name(), rank_);
      if (reshard_.gradient_divide_factor != agreed_reshard_.gradient_divide_factor)
        group_.set_gradient_divide_factor(divide_factor(reshard_, local_gradients_));
      agreed_sync_ = sync_;
      agreed_reshard_ = reshard_;
    }
    uses_.start_backward();
  }
  if (order_)
    order_->enter(*this, order_index_, Pass::backward, group_.groups().world, policies_.backward != BackwardPrefetchMode::none);
  unshard();  // a no-op where forward left the parameters unsharded
  kept_ = false;
  // The fresh gradients are zeroed by the cast that gathers the next unit ahead, where
  // there is one (one kernel on CUDA, not a cast and a memset), else on their own.
  ZeroBatch::run([&](ZeroBatch& zeros) {
    group_.bind_gradients(grad_is_zero_, zeros);
    prefetch_ahead(backward_prefetch_, Pass::backward, policies_.backward == BackwardPrefetchMode::backward_pre, &zeros);
  });
  state_ = TrainingState::BACKWARD_PRE;
  compute_begin_ = now_if_traced();
}

inline void ShardedUnit::post_backward_body() {
  HookScope scope(*this, "post_backward");
  expect({TrainingState::BACKWARD_PRE}, "post_backward");
  record_compute("backward");
  // Parameters first, as FSDP does: their memory is free before the reduction. Kept for
  // the next forward only while the gradient is not final: a step would make them stale.
  if (reshard_.after_backward || detail::gradient_is_final(sync_, detail::plan_gradient(sync_, group_.groups())))
    release_unsharded();
  else kept_after_backward_ = true;
  if (policies_.backward == BackwardPrefetchMode::backward_post)
    if (backward_prefetch_.empty()) prefetch_next(Pass::backward);  // an explicit list ran at pre_backward
  state_ = TrainingState::BACKWARD_POST;
  if (!uses_.end_backward()) return group_.unbind_gradients();  // more entries to come: it accumulates
  // A reduction that finished inside the call is completed now; one still running
  // overlaps the next unit's backward and is completed at that unit's post_backward
  // (or at finish_backward), at the latest.
  if (start_reduction() || !order_) finish_reduction();
  else order_->reduction_issued(*this);
}

inline void ShardedUnit::prefetch_body(ZeroBatch* zeros) {
  HookScope scope(*this, "prefetch");
  if (!order_ || (state_ != TrainingState::IDLE && !uses_.awaits_backward(state_))) return;
  if (!group_.took_over()) return;  // its tensors are still the engine's (defer_take_over)
  if (prefetched_) release_unsharded();  // gathered ahead in an earlier pass: may be stale
  if (!order_->may_prefetch()) return;
  if (group_.start_gathers(tag(TagPhase::forward), zeros)) { prefetched_ = true; order_->prefetch_issued(); }
}

inline void ShardedUnit::finish_reduction_body() {
  HookScope scope(*this, "finish_reduction");
  group_.finish_reductions(waiter());
  if (!grad_hook_.take_due()) return;
  if (policies_.offload) group_.device().synchronize();  // the copy into the host-space gradient is complete
  grad_hook_.run(*this, [this] { free_shard_grads(); });
}

inline void ShardedUnit::finish_backward_body() {
  HookScope scope(*this, "finish_backward");
  expect({TrainingState::BACKWARD_POST, TrainingState::IDLE}, "finish_backward");
  if (uses_.awaits_backward(state_)) start_reduction();  // fewer backward entries than forward ones, or not known
  finish_reduction();
  // The host needs the gradients now (the optimizer step), and a collective the device
  // waited for can fail only here: the host-side check of every reduction since the last.
  if (order_ && order_->capturing)
    group_.drop_reduction_checks();  // the replays' wait checks them (CapturedStep::wait)
  else
    group_.check_reductions_on_host(waiter());
  uses_.end_pass();
  // Gathered ahead for a pass it did not run in, or kept after a forward for a backward
  // that never came (its outputs did not reach the loss): FSDP's final callback reshards too.
  if (prefetched_ || kept_) release_unsharded();
  if (policies_.offload) group_.device().synchronize();  // gradients copied to host are complete
  state_ = TrainingState::IDLE;
}

inline void ShardedUnit::abandon_step_body() {
  group_.abandon();
  if (state_ == TrainingState::SUMMON_FULL_PARAMS) buffers_.show_master(false), group_.release_summoned_gradients();
  grad_is_zero_ = true;
  grad_hook_.take_due();  // a hook armed by this step's reduction does not run
  uses_.end_pass();
  uses_.recompute_from.reset();
  if (prefetched_ && order_) order_->prefetch_consumed();
  prefetched_ = kept_ = kept_after_backward_ = false;
  state_ = TrainingState::IDLE;
}

}  // namespace fsdp::detail
