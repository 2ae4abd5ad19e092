#pragma once
// One NCCL collective in flight (its stream, its CUDA event, when it was issued, whether it
// has completed), and polling a nonblocking communicator: what fsdp::NcclComm's state
// (nccl_state.hpp), its creation (nccl_comm.hpp) and nccl_group (nccl_group.hpp) wait with;
// the collectives an open nccl_group has issued.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/nccl/nccl_types.hpp"

namespace fsdp::detail {

using NcclClock = std::chrono::steady_clock;

// A communicator's asynchronous state (ncclInProgress while a nonblocking call is under
// way), or why it could not be read.
inline ncclResult_t nccl_async_state(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
  return r != ncclSuccess ? r : state;
}

// Polls a nonblocking communicator until it leaves ncclInProgress or `deadline` passes.
// Returns its state then (ncclInProgress: the deadline passed).
inline ncclResult_t nccl_settle(ncclComm_t comm, NcclClock::time_point deadline) {
  for (int spins = 0;; ++spins) {
    const ncclResult_t state = nccl_async_state(comm);
    if (state != ncclInProgress) return state;
    if (NcclClock::now() >= deadline) return ncclInProgress;
    cuda_poll_backoff(spins);
  }
}

struct NcclCapture;

struct NcclInFlight {
  NcclInFlight() = default;
  NcclInFlight(const NcclInFlight&) = delete;
  NcclInFlight& operator=(const NcclInFlight&) = delete;
  ~NcclInFlight() {
    if (event) cudaEventDestroy(event);
  }
  CollectiveCall call;
  cudaStream_t stream = nullptr;  // where it runs, and its event is recorded
  cudaEvent_t event = nullptr;  // handed back to the communicator for reuse once complete
  NcclClock::time_point issued;
  bool recorded = false;  // its event is on the stream (inside an nccl_group: once the group ends)
  bool complete = false;  // and, when tagged, every rank's tag equals call.tag
  bool retired = false;   // complete, and so is every collective issued before it (tags compared)
  int tag_slot = -1;      // where its tag was gathered (NcclTagRing), or -1: untagged
  // Its place among the collectives this rank has enqueued on the communicator (the same
  // on every rank while they are in step: NCCL pairs calls by it); where word of a peer's
  // abort_step is looked for (nccl_notes.hpp).
  std::uint64_t launch = 0;
  // Recorded into a CUDA graph (NcclCommState::begin_capture): it runs at each replay, and
  // has no state of its own on the host: only its replays are tracked and waited for.
  bool captured = false;
  std::shared_ptr<const NcclCapture> captured_by;  // the capture it was recorded in
  // A replay of a captured step (NcclCommState::track_replay): what it is called in
  // messages, and the captured tags to compare once it has completed.
  std::string label;
  std::shared_ptr<const NcclCapture> replay_of;
  std::string describe() const { return label.empty() ? call.describe() : label; }
};

// The collectives one capture recorded, for its replays: their tags' slots (mapped pinned
// memory of their own, gathered again by every replay and reused by no eager collective),
// each slot's call (to name it in a mismatch), and how many collectives there were.
struct NcclCapture {
  NcclCapture() = default;
  NcclCapture(const NcclCapture&) = delete;
  NcclCapture& operator=(const NcclCapture&) = delete;
  ~NcclCapture() {
    if (host) cudaFreeHost(host);
  }
  std::uint64_t* host = nullptr;    // slot i holds every rank's tag at [i * ranks, (i + 1) * ranks)
  std::uint64_t* device = nullptr;  // the same memory as the GPU addresses it
  std::size_t capacity = 0, ranks = 0, rank = 0;
  std::vector<CollectiveCall> tagged;  // slot i's call
  std::size_t collectives = 0;
  std::uint64_t first_seq = 0, last_seq = 0;
  // The capture failed and is dropped: its collectives never run, and nothing waits for them.
  bool abandoned = false;
};

class NcclCommState;

// The collectives issued inside the calling thread's nccl_group (see nccl_group.hpp):
// their events are recorded when the group ends, after NCCL has launched them.
struct NcclGroupFrame {
  std::vector<std::pair<std::shared_ptr<NcclCommState>, std::shared_ptr<NcclInFlight>>> issued;
};
inline thread_local NcclGroupFrame* nccl_active_group = nullptr;

}  // namespace fsdp::detail
