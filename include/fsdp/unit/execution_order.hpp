#pragma once
// ExecutionOrder: what the root knows about the order its units run in. The first
// iteration (up to the first finish_backward) records the forward and the backward order,
// checking at every unit that all ranks run the same unit at the same place — a rank
// that diverges is an fsdp::Error on every rank, naming what each rank ran, before any
// mismatched collective can pair wrong buffers or hang. Later iterations prefetch along
// the recorded order, and a prefetching unit that runs out of that order is reported (a
// unit gathered ahead that does not run is dropped at finish_backward). A unit used several
// times per pass appears once per use; a forward-only pass before the first backward ends
// with reshard(), or the next pass is recorded as more of the same one. A first iteration
// whose forward was started over (an engine error between plain hooks, caught, and the step
// run again without abort_step) records the abandoned start too; the second iteration runs
// the pass alone, and where it first parts from the record the record drops that start
// (aborted_start(), below), under forward prefetching only: where a prefetching unit would
// otherwise fail the order check, or where backward begins after one whole pass of a record
// of two (the last unit gathered the record's next one in vain). In every iteration each
// all-gather and reduction of a unit carries its tag (tag(): unit, phase, pass), which a
// TaggedCommunicator compares across ranks; over a communicator without tags every pass is
// checked as it ends instead (fsdp/unit/detail/pass_check.hpp): one 8-byte all-gather.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/pass_check.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

class Unit;
class Trace;

enum class Pass : std::uint8_t { forward, backward };

class ExecutionOrder final : public UnitNames {
 public:
  // At most this many units gathered ahead of the one computing (FSDP's limit_all_gathers).
  int max_prefetched = 2;
  Trace* trace = nullptr;  // where units record their spans; null: no tracing
  // A step being captured into a CUDA graph (fsdp/graph/captured_step.hpp): the hooks run
  // once, to be recorded, and finish_backward checks no reduction on the host (it would
  // wait inside the capture); each replay's wait does instead.
  bool capturing = false;
  // Whether the first iteration, which records the order and agrees on it across ranks,
  // has ended (a capture needs it: its agreements wait on the host).
  bool iteration_recorded() const { return backward_recorded_; }

  // The tag of unit `index`'s collectives now (fsdp/core/collective_tag.hpp): its all-gathers
  // are tagged forward or backward by the pass the model is in (a prefetch by the pass of
  // the unit that issues it), reductions as such; every rank doing the same makes the same.
  CollectiveTag tag(int index, TagPhase phase) const {
    if (phase == TagPhase::forward && in_backward_) phase = TagPhase::backward;
    return {static_cast<std::uint32_t>(index), phase, forward_pass_, this};
  }
  std::string unit_name(int index) const override { return name_of(index); }
  // Every unit, in the root's order: a step left by an exception fails them all (Unit::mark_failed).
  const std::vector<Unit*>& units() const { return units_; }

  // Registers a unit; returns its index, which the unit passes back to enter().
  int add_unit(Unit* u) {
    units_.push_back(u);
    return static_cast<int>(units_.size()) - 1;
  }

  // Called by a unit as it enters a pass, before any collective of its own. While the
  // pass is being recorded, checks across `world` that every rank enters the same unit;
  // afterwards, when the unit prefetches, that the unit runs where it ran before.
  void enter(Unit& u, int index, Pass pass, const detail::CommRef& world, bool prefetching);

  // The unit that runs after the one that just entered `pass`, per the recorded order
  // (null: the pass is still being recorded, or it was the last unit).
  Unit* next(Pass pass) const {
    if (!backward_recorded_) return nullptr;
    const auto& order = pass == Pass::forward ? forward_ : backward_;
    const std::size_t at = pass == Pass::forward ? forward_step_ : backward_step_;  // already past the unit
    return at < order.size() ? units_[order[at]] : nullptr;
  }

  // Whether `u`, leaving forward now, is the unit backward starts with: it then keeps its
  // parameters (freeing and re-gathering them back to back would only cost an all-gather;
  // FSDP2 does the same for its root).
  bool keeps_after_forward(const Unit& u) const {
    return backward_recorded_ && first_backward_ == &u && forward_step_ == forward_.size();
  }

  // Prefetch accounting: units whose all-gather was issued ahead of their own hook.
  bool may_prefetch() const { return prefetched_ < max_prefetched; }
  void prefetch_issued() { ++prefetched_; }
  void prefetch_consumed() { --prefetched_; }

  // Asynchronous reductions: at most one unit's reduction stays in flight, so issuing one
  // completes the one before it.
  void reduction_issued(Unit& u);
  void finish_reductions();

  // The end of a pass (finish_backward, or reshard() after a forward-only pass): every rank
  // ran the same units in the same order, or an error on every rank naming where not. Only
  // over a communicator without tags (which check each collective instead).
  void check_pass() {
    passes_.check([this](int i) { return name_of(i); });
  }

  // End of an iteration (the root's finish_backward).
  void end_iteration() {
    const bool recording = !backward_recorded_;
    if (!backward_.empty()) forward_recorded_ = backward_recorded_ = true;  // recording ends
    aborted_start_ = recording && backward_recorded_ ? aborted_start() : 0;  // decided by the next iteration
    forward_step_ = backward_step_ = 0;
    in_backward_ = false;
    ++forward_pass_;
  }

  // A step abandoned (ShardedModel::abort_step): nothing is in flight or gathered ahead any
  // more, and an order still being recorded is recorded afresh by the next iteration.
  void abort_pass() {
    if (!backward_recorded_) forward_.clear(), backward_.clear(), forward_recorded_ = false, first_backward_ = nullptr;
    forward_step_ = backward_step_ = 0;
    in_backward_ = false;
    ++forward_pass_;
    prefetched_ = 0;
    reducing_ = nullptr;
    passes_.clear();
    aborted_start_ = 0;
  }

  // End of a forward-only pass (the root's reshard()): the next forward is a new pass.
  void end_forward_pass() {
    if (in_backward_) return;
    if (!forward_.empty()) forward_recorded_ = true;
    if (forward_step_ == forward_.size()) aborted_start_ = 0;  // the record ran whole: it stands
    forward_step_ = 0;
    ++forward_pass_;
  }

  // From the first pre_backward of a pass to finish_backward: a forward entry then is a
  // recomputation (activation checkpointing), not a use of the unit in a new pass.
  bool in_backward() const { return in_backward_; }
  // Which forward pass the model is in: a unit counts its forward entries per pass. A pass
  // ends at finish_backward, at reshard(), and (once the order is recorded) when the
  // recorded forward order starts over.
  std::uint64_t forward_pass() const { return forward_pass_; }

 private:
  std::string name_of(int index) const;
  // The length of the first iteration's recorded forward that reads as started and
  // abandoned, or 0. Such a start ran forward without backward: its entries are exactly
  // the units' surplus of forward over backward entries, it lies before the pass's last
  // start (where the order returns to its first unit), and each piece of it that begins with
  // that unit begins the pass that follows. A legal model can record the same (a use of a
  // unit that does not reach the loss, a no_grad forward through the first units): the
  // second iteration tells them apart, since it repeats a legal record (the candidate is
  // then forgotten: at a pass that runs the record whole) and parts from a restarted one.
  // Only under forward prefetching is the start dropped: where the old record would fail
  // the order check (a prefetching unit off the record), or where the abandoned start is one
  // whole pass (backward begins at the middle of the record, after the last forward unit
  // prefetched the record's next one in vain). Otherwise the record is kept, so a model
  // whose steps differ in shape on purpose (which forward prefetching does not support)
  // counts each unit's uses per pass as before: a shorter record would end a pass inside a
  // later step of the longer shape, and a unit used on both sides of that end would count
  // its uses wrong.
  std::size_t aborted_start() const;
  // Called once in the second iteration, where its forward first parts from the record: at
  // forward step `step`, entering unit `idx`, or (idx < 0) ending the forward there as the
  // backward begins. Drops the aborted start when the rest of the record is what this
  // iteration ran and runs now (idx < 0: and the start is as long as the rest); returns
  // whether it did. Forgets the candidate either way.
  bool drop_aborted_start(std::size_t step, int idx);

  std::vector<Unit*> units_;  // in the root's order
  const Unit* first_backward_ = nullptr;
  std::vector<int> forward_, backward_;  // recorded on the first iteration
  std::size_t forward_step_ = 0, backward_step_ = 0;
  // The backward order is recorded at the end of the first iteration with a backward: until
  // then the model is recording; the forward one also at the first backward or reshard().
  bool forward_recorded_ = false, backward_recorded_ = false;
  bool in_backward_ = false;
  std::uint64_t forward_pass_ = 0;
  int prefetched_ = 0;
  Unit* reducing_ = nullptr;  // the unit whose reduction is in flight
  detail::PassRecord passes_;  // this pass's entries, checked across ranks as it ends
  std::size_t aborted_start_ = 0;  // in the second iteration, until its forward parts from the record
  bool last_forward_prefetching_ = false;  // whether the unit that entered forward last prefetches
};

}  // namespace fsdp
