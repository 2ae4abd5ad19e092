#pragma once
// fsdp::Work: the handle an asynchronous collective returns. A default-constructed Work is
// already complete, so a backend whose collectives finish inside the call pays nothing.
#include <memory>
#include <utility>

namespace fsdp {

class Work {
 public:
  struct Pending {
    virtual ~Pending() = default;
    virtual void wait() = 0;        // blocks until complete; throws fsdp::Error on failure
    virtual bool ready() = 0;       // non-blocking poll
  };

  Work() = default;
  explicit Work(std::unique_ptr<Pending> p) : pending_(std::move(p)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&& o) noexcept {
    if (this != &o) { finish_quietly(); pending_ = std::move(o.pending_); }
    return *this;
  }
  // A handle dropped without wait() still waits: the buffers it reads or writes may be
  // freed right after, and a use-after-free is worse than a stall.
  ~Work() { finish_quietly(); }

  void wait() {
    if (!pending_) return;
    auto p = std::move(pending_);
    p->wait();
  }
  bool ready() const { return !pending_ || pending_->ready(); }
  // True when the backend finished the collective inside the call (a synchronous backend
  // always, an asynchronous one never): a property of the backend, not of timing, so the
  // library can free buffers at points that do not depend on a race.
  bool completed_inline() const { return !pending_; }

 private:
  void finish_quietly() noexcept {
    try { wait(); } catch (...) {}  // the backend reports the failure on its next call
  }
  std::unique_ptr<Pending> pending_;
};

}  // namespace fsdp
