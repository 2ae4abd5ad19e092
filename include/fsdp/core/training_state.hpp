#pragma once
// The per-unit training state machine. Every hook checks it (always on, never assert): a
// hook called out of order is a bug in the engine's integration, and the message has to
// say which unit, which state it was in and which states the hook expects.
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string_view>

#include "fsdp/core/error.hpp"

namespace fsdp {

enum class TrainingState : std::uint8_t { IDLE, FORWARD, BACKWARD_PRE, BACKWARD_POST, SUMMON_FULL_PARAMS };

constexpr std::string_view name_of(TrainingState s) {
  switch (s) {
    case TrainingState::IDLE: return "IDLE";
    case TrainingState::FORWARD: return "FORWARD";
    case TrainingState::BACKWARD_PRE: return "BACKWARD_PRE";
    case TrainingState::BACKWARD_POST: return "BACKWARD_POST";
    case TrainingState::SUMMON_FULL_PARAMS: return "SUMMON_FULL_PARAMS";
  }
  return "?";
}

namespace detail {
// A unit's FQN as messages, traces and plans show it: "<root>" for the root (FQN "").
constexpr std::string_view display_name(std::string_view fqn) { return fqn.empty() ? std::string_view("<root>") : fqn; }

// `hint`, when given, follows the expected states in parentheses: a likely cause.
inline void expect_state(TrainingState actual, std::initializer_list<TrainingState> expected,
                         std::string_view hook, std::string_view unit, int rank, std::string_view hint = {}) {
  for (auto s : expected) if (s == actual) return;
  std::ostringstream os;
  os << "unit '" << display_name(unit) << "' on rank " << rank << ": " << hook
     << " called in state " << name_of(actual) << "; expected ";
  bool first = true;
  for (auto s : expected) { os << (first ? "" : " or ") << name_of(s); first = false; }
  if (!hint.empty()) os << " (" << hint << ")";
  throw Error(os.str());
}
}  // namespace detail

}  // namespace fsdp
