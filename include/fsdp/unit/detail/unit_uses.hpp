#pragma once
// UnitUses: how often a unit is used in one pass. A unit may be entered several times per
// pass (a tied embedding used at both ends of a model, a block applied twice): each
// forward entry is counted, and the first backward entry starts a countdown from that
// count; the unit's gradient accumulates across its backward entries and is reduced after
// the last (at finish_backward when the count is not known: backward ran without a
// forward entry, or a forward-only pass was not ended). A forward entered during the
// model's backward is a recomputation (activation checkpointing): not counted.
#include <cstdint>
#include <optional>

#include "fsdp/core/training_state.hpp"

namespace fsdp::detail {

class UnitUses {
 public:
  int forward_entries() const { return forward_; }
  // Backward entries still expected before the reduction; -1 when not known.
  int backward_left() const { return left_; }

  // A forward entry in the model's forward pass number `pass` (a unit outside a model
  // passes 0: its passes end at finish_backward and reshard).
  void enter_forward(std::uint64_t pass) {
    if (pass != pass_) forward_ = 0, pass_ = pass;
    ++forward_;
  }
  // The first backward entry of the pass.
  void start_backward() { left_ = forward_ > 0 ? forward_ : -1; }
  // A backward entry ended; returns whether its gradient is to be reduced now.
  bool end_backward() {
    if (left_ > 0) --left_;
    return left_ == 0;
  }
  // Whether, in `state`, the unit still awaits backward entries (its gradient unreduced).
  bool awaits_backward(TrainingState state) const { return state == TrainingState::BACKWARD_POST && left_ != 0; }
  void reduced() { left_ = 0; }
  void end_forward_pass() { forward_ = 0; }
  void end_pass() { forward_ = left_ = 0; }

  // Whether a forward entered in `state` is a recomputation: inside the unit's own
  // backward, between its backward entries, or while the model is in backward.
  bool is_recompute(TrainingState state, bool model_in_backward) const {
    return state == TrainingState::BACKWARD_PRE || awaits_backward(state) ||
           (state == TrainingState::IDLE && model_in_backward);
  }
  // In a recomputed forward: the state it returns to.
  std::optional<TrainingState> recompute_from;

 private:
  int forward_ = 0, left_ = 0;
  std::uint64_t pass_ = 0;
};

}  // namespace fsdp::detail
