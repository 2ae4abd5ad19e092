#pragma once
// One NCCL collective in flight (its stream, its CUDA event, when it was issued, whether it
// has completed), and polling a nonblocking communicator: what fsdp::NcclComm's state
// (nccl_state.hpp), its creation (nccl_comm.hpp) and nccl_group (nccl_group.hpp) wait with;
// the collectives an open nccl_group has issued.
#include <chrono>
#include <memory>
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
};

class NcclCommState;

// The collectives issued inside the calling thread's nccl_group (see nccl_group.hpp):
// their events are recorded when the group ends, after NCCL has launched them.
struct NcclGroupFrame {
  std::vector<std::pair<std::shared_ptr<NcclCommState>, std::shared_ptr<NcclInFlight>>> issued;
};
inline thread_local NcclGroupFrame* nccl_active_group = nullptr;

}  // namespace fsdp::detail
