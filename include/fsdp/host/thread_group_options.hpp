#pragma once
// ThreadGroup's options: the collective timeout and the fault hook that tests use to fail
// or slow a rank at a chosen point of a collective. Apart from the group's shared state
// (thread_group_state.hpp) so that a file that runs a ThreadGroup compiles only these
// when the state's implementation is compiled once (FSDP_SEPARATE_COMPILATION).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace fsdp {

// Where ThreadGroupOptions::fault_hook runs inside a collective.
enum class CollectiveStage : std::uint8_t {
  posted,   // every rank has posted its buffers; nothing read yet
  reading,  // before each chunk (at most 1 MiB) read from a peer's buffer
  read,     // everything read; the rank has not yet told its peers
};

struct CollectivePoint {
  int rank = 0;               // world rank
  std::uint64_t seq = 0;      // the rank's collective number in its group
  CollectiveStage stage = CollectiveStage::posted;
  std::size_t bytes_read = 0;  // from peers' buffers so far, by this rank
};

struct ThreadGroupOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // longest wait in one collective, in (0 ms, 24 h]
  // For fault-injection tests: every rank calls it at each CollectiveStage of every
  // collective. An exception it throws fails that rank at that point (the group aborts,
  // the rank rethrows it once no peer reads its buffers); sleeping models a slow rank.
  std::function<void(const CollectivePoint&)> fault_hook{};
};

}  // namespace fsdp
