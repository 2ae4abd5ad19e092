#pragma once
// fsdp::Work: the handle an asynchronous collective returns. A default-constructed Work is
// already complete, so a backend whose collectives finish inside the call pays nothing.
//
// A backend that runs collectives on a device queue (NCCL on CUDA streams) can also be
// waited on *by the device*: Work::wait_on(queue) makes that queue (the engine's compute
// stream) wait for the collective, and the host goes on. Backends without it (every host
// backend) return false there, and the caller waits on the host as before.
#include <memory>
#include <utility>

#include "fsdp/core/tensor.hpp"

namespace fsdp {

// A device's queue of work (a cudaStream_t on CUDA) as an opaque handle, with the device it
// belongs to, so a backend can tell whether it knows how to wait on it. A null handle:
// the device has no queue (the host device); waits happen on the host.
struct DeviceQueue {
  DeviceId device;
  void* handle = nullptr;
};

class Work {
 public:
  struct Pending {
    virtual ~Pending() = default;
    virtual void wait() = 0;        // blocks until complete; throws fsdp::Error on failure
    virtual bool ready() = 0;       // non-blocking poll
    // Makes `queue` wait for the collective on the device, without blocking the host, and
    // returns true; false when this backend cannot wait on that queue. Throws fsdp::Error
    // when the collective is already known to have failed.
    virtual bool enqueue_wait(const DeviceQueue&) { return false; }
    // After wait() threw: true when the collective is still in flight and a later wait()
    // can wait for it (a wait refused before it was launched); false when it failed.
    virtual bool still_waitable() { return false; }
  };

  Work() = default;
  explicit Work(std::unique_ptr<Pending> p) : pending_(std::move(p)) {}
  Work(Work&& o) noexcept : pending_(std::move(o.pending_)), on_device_(std::exchange(o.on_device_, false)) {}
  Work& operator=(Work&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      pending_ = std::move(o.pending_);
      on_device_ = std::exchange(o.on_device_, false);
    }
    return *this;
  }
  // A handle dropped without wait() still waits: the buffers it reads or writes may be
  // freed right after, and a use-after-free is worse than a stall. Not after wait_on: the
  // queue is ordered behind the collective then, and so is every free queued on it.
  ~Work() { finish_quietly(); }

  // A wait that throws ends the Work (the backend reports the failure), unless the backend
  // says the collective can still be waited for (a wait refused inside an nccl_group): then
  // the Work stays pending and a later wait() waits.
  void wait() {
    if (!pending_) return;
    auto p = std::move(pending_);
    on_device_ = false;
    try {
      p->wait();
    } catch (...) {
      if (p->still_waitable()) pending_ = std::move(p);
      throw;
    }
  }
  bool ready() const { return !pending_ || pending_->ready(); }
  // True when the backend finished the collective inside the call (a synchronous backend
  // always, an asynchronous one never): a property of the backend, not of timing, so the
  // library can free buffers at points that do not depend on a race.
  bool completed_inline() const { return !pending_; }

  // Makes `queue` wait for this collective on the device and returns true (the host does
  // not block), or returns false where the backend cannot (the caller then wait()s). After
  // true the Work stays pending for the host: wait() is then the host-side check (it
  // blocks until the collective completes and reports its failure), and dropping the Work
  // does not block, since what follows on the queue is already ordered behind it.
  bool wait_on(const DeviceQueue& queue) {
    if (!pending_) return true;
    if (!queue.handle || !pending_->enqueue_wait(queue)) return false;
    on_device_ = true;
    return true;
  }
  bool waited_on_device() const { return on_device_; }

 private:
  void finish_quietly() noexcept {
    if (on_device_) return pending_.reset(), void(on_device_ = false);
    try { wait(); } catch (...) {}  // the backend reports the failure on its next call
  }
  std::unique_ptr<Pending> pending_;
  bool on_device_ = false;  // a device queue waits for it (wait_on)
};

}  // namespace fsdp
