#pragma once
// StateKey: which tensor of a training state — a parameter or buffer by its FQN, or a
// per-element optimizer state of a parameter. One key for state dicts, load sources and
// the sharded checkpoint index, so nothing converts between names of the same tensor.
#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace fsdp {

enum class StateKind : std::uint8_t { param, buffer, optim };

// The kind as checkpoint files spell it: "param", "buffer", "optim".
constexpr std::string_view name_of(StateKind k) {
  switch (k) {
    case StateKind::param: return "param";
    case StateKind::buffer: return "buffer";
    case StateKind::optim: return "optim";
  }
  return "?";
}

inline std::optional<StateKind> state_kind_from_name(std::string_view s) {
  for (StateKind k : {StateKind::param, StateKind::buffer, StateKind::optim})
    if (name_of(k) == s) return k;
  return std::nullopt;
}

struct StateKey {
  StateKind kind = StateKind::param;
  std::string state;  // the optimizer state's name ("exp_avg") when kind == optim, else empty
  std::string fqn;

  static StateKey param(std::string fqn) { return {StateKind::param, {}, std::move(fqn)}; }
  static StateKey buffer(std::string fqn) { return {StateKind::buffer, {}, std::move(fqn)}; }
  static StateKey optim(std::string fqn, std::string state) { return {StateKind::optim, std::move(state), std::move(fqn)}; }

  friend auto operator<=>(const StateKey&, const StateKey&) = default;
  friend bool operator==(const StateKey&, const StateKey&) = default;

  // "'fc.weight'", "buffer 'bn.mean'", "optimizer state 'exp_avg' of 'fc.weight'".
  std::string describe() const {
    switch (kind) {
      case StateKind::param: return "'" + fqn + "'";
      case StateKind::buffer: return "buffer '" + fqn + "'";
      case StateKind::optim: return "optimizer state '" + state + "' of '" + fqn + "'";
    }
    return "?";
  }
};

}  // namespace fsdp
