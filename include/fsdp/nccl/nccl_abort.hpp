#pragma once
// ncclCommAbort on a thread of its own, so that the rank that finds a communicator broken
// reports it at once. ncclCommAbort frees the communicator's device memory, and cudaFree
// waits for the device: while any stream of it is held (a kernel spinning on a dead peer
// that the abort has not reached yet, an engine's stream blocked behind a host callback),
// the abort does not return. Seen on an H200 with NCCL 2.28: an abort took 18 s, the time
// a held engine stream took to move, and the error that had been found within the 2 s
// timeout waited for it. The thread touches only the ncclComm_t and the device number, so
// it may outlive the communicator's state: a destructor waits for it a bounded time, then
// leaves it running rather than hang.
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "fsdp/nccl/nccl_types.hpp"

namespace fsdp::detail {

class NcclBackgroundAbort {
 public:
  NcclBackgroundAbort() = default;
  NcclBackgroundAbort(const NcclBackgroundAbort&) = delete;
  NcclBackgroundAbort& operator=(const NcclBackgroundAbort&) = delete;
  ~NcclBackgroundAbort() { finish(std::chrono::milliseconds(0)); }

  bool started() const { return thread_.joinable(); }

  // Starts aborting `comm` (once); returns at once.
  void start(ncclComm_t comm, int device) {
    if (started()) return;
    thread_ = std::thread([done = done_, comm, device] {
      cudaSetDevice(device);  // NCCL frees the communicator's device memory
      (void)ncclCommAbort(comm);  // its result has nowhere to go: the reason was recorded first
      (void)cudaGetLastError();
      std::lock_guard lk(done->mu);
      done->finished = true;
      done->cv.notify_all();
    });
  }

  // Waits up to `limit` for the abort to return, then joins or detaches its thread.
  // Returns whether it returned.
  bool finish(std::chrono::milliseconds limit) {
    if (!started()) return true;
    bool finished;
    {
      std::unique_lock lk(done_->mu);
      finished = done_->cv.wait_for(lk, limit, [&] { return done_->finished; });
    }
    if (finished) thread_.join();
    else thread_.detach();  // holds only `done_` (shared), the comm handle and the device number
    return finished;
  }

 private:
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
  };
  std::shared_ptr<Done> done_ = std::make_shared<Done>();
  std::thread thread_;
};

}  // namespace fsdp::detail
