#pragma once
// The machinery behind one fsdp::TcpComm: its ring links, its I/O thread and its queue.
//
// Calls from any thread take a sequence number and post the collective to the I/O
// thread's io_context under one mutex, and return a Work at once. The I/O thread runs the
// collectives one at a time in that order; between them it keeps reading both links, so
// a neighbour's ABORT is passed on even while the program computes. Once a collective
// fails the communicator is broken, as a NCCL communicator is: every queued and later
// collective fails, quoting the first failure, without touching the network.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "fsdp/asio/ring.hpp"
#include "fsdp/asio/shm_handshake.hpp"
#include "fsdp/asio/tcp_rendezvous.hpp"
#include "fsdp/asio/tcp_ring.hpp"
#include "fsdp/asio/tcp_rank_report.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/store.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp::detail {

// Completion of one collective, shared by its Work and the I/O thread.
struct TcpJobState {
  bool done = false;        // guarded by TcpCompletions::mu
  std::string error;        // set before done: the collective failed
  ErrorKind kind = ErrorKind::misuse;  // and its kind
  bool echo = false;                   // and whether it came from another rank (RingFailure::echo)
};

// A collective's outcome on the I/O thread: no error, or its message and kind.
struct TcpOutcome {
  std::string error;
  ErrorKind kind = ErrorKind::misuse;
  bool echo = false;  // another rank's failure (RingFailure::echo)
};

struct TcpCompletions {
  std::mutex mu;
  std::condition_variable cv;

  void finish(TcpJobState& job, TcpOutcome outcome) {
    {
      std::lock_guard lk(mu);
      job.error = std::move(outcome.error);
      job.kind = outcome.kind;
      job.echo = outcome.echo;
      job.done = true;
    }
    cv.notify_all();
  }
};

class TcpPending final : public Work::Pending {
 public:
  TcpPending(std::shared_ptr<TcpCompletions> c, std::shared_ptr<TcpJobState> job) : c_(std::move(c)), job_(std::move(job)) {}
  // Waits for the I/O thread, whose every step ends by the communicator's timeout.
  void wait() override {
    std::unique_lock lk(c_->mu);
    c_->cv.wait(lk, [&] { return job_->done; });
    if (!job_->error.empty()) {
      if (job_->echo) throw EchoedError(job_->kind, -1, job_->error);  // the message names the failed rank
      throw Error(job_->kind, job_->error);
    }
  }
  bool ready() override {
    std::lock_guard lk(c_->mu);
    return job_->done;
  }

 private:
  std::shared_ptr<TcpCompletions> c_;
  std::shared_ptr<TcpJobState> job_;
};

class TcpCommCore {
 public:
  // Joins the ring (blocking, by id.timeout) and starts the I/O thread.
  TcpCommCore(std::shared_ptr<Store> store, RingIdentity id)
      : store_(std::move(store)), id_(std::move(id)), planner_(id_.rank, id_.size, id_.segment_bytes),
        reports_(store_, id_.prefix, id_.rank, id_.size, id_.timeout) {
    if (id_.size > 1) {
      try {
        // First what a dead process of this prefix left (rank 0: the shared keys too).
        RingSockets links = RingJoiner(io_, *store_, id_).join([&](Store& s) { reports_.forget(s, id_.rank == 0); });
        ShmLinks shm = ShmHandshake::negotiate(io_, links, id_);
        ring_.emplace(io_, std::move(links), std::move(shm), id_);
      } catch (...) {
        forget_keys();
        throw;
      }
    }
    thread_ = std::thread([this] { loop(); });
  }

  TcpCommCore(const TcpCommCore&) = delete;
  TcpCommCore& operator=(const TcpCommCore&) = delete;

  // Runs what is queued (each collective ends by the timeout), then closes the links:
  // neighbours that still expect frames see the connection close.
  ~TcpCommCore() {
    boost::asio::post(io_, [this] { stopping_ = true; });
    thread_.join();
    if (ring_) ring_->close();
    forget_keys();
  }

  const RingIdentity& identity() const { return id_; }
  const std::shared_ptr<Store>& store() const { return store_; }
  bool shm_from_left() const { return ring_ && ring_->shm_from_left(); }
  bool shm_to_right() const { return ring_ && ring_->shm_to_right(); }
  // Whether a collective of this communicator has finished with an error (any thread).
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  Work submit(CollectiveCall call) {
    auto job = std::make_shared<TcpJobState>();
    std::lock_guard lk(submit_mu_);  // sequence numbers in posting order
    call.seq = next_seq_++;
    boost::asio::post(io_, [this, call, job] { queue_.push_back({call, job}); });
    return Work(std::make_unique<TcpPending>(completions_, std::move(job)));
  }

 private:
  struct Job {
    CollectiveCall call;
    std::shared_ptr<TcpJobState> state;
  };

  void loop() {
    for (;;) {
      while (!queue_.empty()) {
        Job job = std::move(queue_.front());
        queue_.pop_front();
        TcpOutcome outcome = execute(job.call);
        if (!outcome.error.empty()) failed_.store(true, std::memory_order_release);
        completions_->finish(*job.state, std::move(outcome));
      }
      if (stopping_) return;
      try {
        io_.run_one();  // a new collective, or a neighbour's ABORT / EOF
        if (ring_ && !broken_) broken_ = ring_->idle_failure(broken_kind_, broken_echo_);
      } catch (const std::exception& e) {  // out of memory in a handler: the ring is out of step
        if (!broken_) {
          broken_ = id_.where() + "communicator failed between collectives: " + e.what();
          broken_kind_ = kind_of(e);
          broken_echo_ = false;
        }
        if (ring_) ring_->abort_and_close(*broken_, ErrorKind::peer_lost);  // the others lost this rank
      }
    }
  }

  // Runs one collective; returns its error message (empty on success) and kind.
  TcpOutcome execute(const CollectiveCall& call) {
    const std::string where = id_.where();
    if (broken_) return {where + call.describe() + " aborted: " + *broken_, broken_kind_, broken_echo_};
    try {
      const RingPlan& plan = planner_.plan(call);
      if (!ring_) {
        for (const auto& l : plan.local) run_local(l, call.dtype, 1);
        return {};
      }
      if (auto failure = ring_->run(call, plan, reports_)) {
        broken_ = failure->cause;
        broken_kind_ = failure->kind;
        broken_echo_ = failure->echo;
        return {failure->message, failure->kind, failure->echo};
      }
      return {};
    } catch (const std::exception& e) {  // a local failure: the ring cannot go on in step
      std::string what = e.what();
      if (what.rfind("fsdp: ", 0) == 0) what.erase(0, 6);
      broken_ = what;
      broken_kind_ = kind_of(e);
      broken_echo_ = false;
      if (ring_) ring_->abort_and_close(what, ErrorKind::peer_lost);  // the others lost this rank
      return {what, broken_kind_};
    }
  }

  void forget_keys() noexcept {
    // The next communicator of this prefix (after every member of this one is gone) must
    // not find this rank's stale address. Every peer that needed it has connected. A
    // communicator of one rank published none.
    if (id_.size == 1) return;
    try {
      if (Store* bounded = reports_.store_for_cleanup()) bounded->delete_key(id_.address_key(id_.rank));
    } catch (...) {
    }
    // The reports stay: a peer may still be gathering them for its mismatch message (a
    // rank that found the mismatch first fails and is destroyed within milliseconds). The
    // next communicator of this prefix clears them before it joins.
  }

  std::shared_ptr<Store> store_;
  const RingIdentity id_;
  boost::asio::io_context io_{1};
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> keep_running_{io_.get_executor()};
  std::optional<TcpRing> ring_;
  RingPlanner planner_;
  StoreRankReport reports_;
  std::shared_ptr<TcpCompletions> completions_ = std::make_shared<TcpCompletions>();

  std::mutex submit_mu_;
  std::uint64_t next_seq_ = 0;
  std::atomic<bool> failed_{false};  // set by the I/O thread when a collective fails

  // I/O thread only:
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::optional<std::string> broken_;  // the first failure's cause
  ErrorKind broken_kind_ = ErrorKind::misuse;  // and its kind
  bool broken_echo_ = false;                    // and whether it was another rank's failure
  std::thread thread_;
};

}  // namespace fsdp::detail
