#pragma once
// CollectiveTag: which unit a collective belongs to, in which phase of which pass. The
// library passes one with every all-gather and reduction of a unit (to communicators that
// take it, see TaggedCommunicator); the backend compares the ranks' tags as it compares
// their calls, once the collective has met and before its result is used, so a rank that
// runs another unit (a swapped pair of same-sized units, an evaluation pass in another
// order, prefetch lists that differ) fails on every rank instead of computing with another
// unit's weights. The tag travels in the backend's own call descriptor (ThreadComm's
// rendezvous, CudaThreadComm's exchange of handles, TcpComm's frame header, the descriptor
// MpiComm gathers ahead of the collective; NcclComm gathers it beside the collective), not in
// the payload, where the flat layout leaves no room. NcclComm compares once the collective
// completes, which on the GPU may be after its result was used: the step then fails before
// the optimizer applies it.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "fsdp/core/communicator.hpp"

namespace fsdp {

// take_over and abort_step: the model's own agreements (unit and pass 0), at the end of
// setup and after a step left by an exception, so that a rank still elsewhere reads which
// step its peer is in.
enum class TagPhase : std::uint8_t { forward = 1, backward = 2, reduce = 3, summon = 4, abort_step = 5, take_over = 6 };

constexpr const char* name_of(TagPhase p) {
  switch (p) {
    case TagPhase::forward: return "forward";
    case TagPhase::backward: return "backward";
    case TagPhase::reduce: return "gradient reduction";
    case TagPhase::summon: return "summon";
    case TagPhase::abort_step: return "abort_step";
    case TagPhase::take_over: return "take-over";
  }
  return "?";
}

// Names a model's units in messages (fsdp::ExecutionOrder is one): a tag holds a number.
class UnitNames {
 public:
  virtual std::string unit_name(int index) const = 0;

 protected:
  ~UnitNames() = default;
};

struct CollectiveTag {
  std::uint32_t unit = 0;  // the unit's index in its model (ExecutionOrder::add_unit)
  TagPhase phase = TagPhase::forward;
  std::uint64_t step = 0;  // the model's pass number (ExecutionOrder::forward_pass)
  // In-process only (never sent, never compared): how messages name the unit. Must outlive
  // the collective; the model's ExecutionOrder does.
  const UnitNames* names = nullptr;
  // In-process only (never sent, never compared), and only on abort_step's agreement: the
  // exception that left the step on this rank (its message, at most detail::kMaxQuoted
  // bytes). Shared, so that a backend thread that describes the call late (a watchdog, a
  // slow peer formatting a mismatch) never reads a freed text. The list of every rank's
  // call in a mismatch quotes it (describe(true)): a backend that lays every rank's call
  // side by side in this process (ThreadComm, CudaThreadComm's host path) or publishes its
  // own call's words (TcpComm's reports through the store) brings it to every rank, as
  // does MpiComm, sending it after a mismatch, and NcclComm, through its store
  // (nccl/nccl_notes.hpp; reliability.md).
  std::shared_ptr<const std::string> note{};

  static constexpr int kUnitBits = 20, kStepBits = 40;

  // 4 bits of phase, 20 of unit, 40 of step (compared modulo 2^40); never 0, which is
  // "untagged" on the wire and in detail::CollectiveCall.
  std::uint64_t packed() const {
    return std::uint64_t(phase) << (kUnitBits + kStepBits) | (std::uint64_t(unit) & ((1u << kUnitBits) - 1)) << kStepBits |
           (step & ((std::uint64_t(1) << kStepBits) - 1));
  }
  static CollectiveTag unpack(std::uint64_t bits, const UnitNames* names = nullptr,
                              std::shared_ptr<const std::string> note = nullptr) {
    CollectiveTag t;
    t.phase = static_cast<TagPhase>(bits >> (kUnitBits + kStepBits));
    t.unit = static_cast<std::uint32_t>(bits >> kStepBits) & ((1u << kUnitBits) - 1);
    t.step = bits & ((std::uint64_t(1) << kStepBits) - 1);
    t.names = names;
    t.note = std::move(note);
    return t;
  }

  // "unit 'blocks.2' (forward, pass 3)"; "unit #5" where no names are known; the model's
  // own steps by their names. `with_note`: abort_step's with its note, `abort_step (the
  // step was left by an exception: "<note>")`, for a mismatch's list of every rank's call
  // (elsewhere a rank's message about its own call would repeat what its own error says).
  std::string describe(bool with_note = false) const {
    if (phase == TagPhase::abort_step)
      return with_note && note ? "abort_step (the step was left by an exception: \"" + *note + "\")"
                               : "abort_step (the step was left by an exception)";
    if (phase == TagPhase::take_over) return "the take-over of the engine's tensors (setup)";
    std::string unit_text = names ? "'" + names->unit_name(static_cast<int>(unit)) + "'" : "#" + std::to_string(unit);
    return "unit " + unit_text + " (" + name_of(phase) + ", pass " + std::to_string(step) + ")";
  }
};

// A communicator that takes a tag with its all-gathers and reductions and fails on every
// rank when the ranks' tags differ (ThreadComm, TcpComm, MpiComm, NcclComm,
// CudaThreadComm and the wrappers). The
// library uses the tagged calls where a communicator has them; a Communicator without
// them works unchanged, its passes checked as they end (docs/reliability.md).
template <class C>
concept TaggedCommunicator = Communicator<C> && requires(C& c, const void* send, void* recv, std::size_t count,
                                                         DType t, ReduceOp op, const CollectiveTag& tag) {
  { c.all_gather(send, recv, count, t, tag) } -> std::convertible_to<Work>;
  { c.reduce_scatter(send, recv, count, t, op, tag) } -> std::convertible_to<Work>;
  { c.all_reduce(send, recv, count, t, op, tag) } -> std::convertible_to<Work>;
};

}  // namespace fsdp
