#pragma once
// AsyncCommunicator<C>: makes a communicator whose collectives complete inside the call
// (ThreadComm, a blocking MPI wrapper) asynchronous, the way a CUDA stream makes NCCL calls
// asynchronous. Each instance owns one worker thread, this rank's communication stream,
// which runs the wrapped collectives one at a time in the order they were issued. A call
// returns at once with an fsdp::Work that completes when the worker has finished it, so
// the caller computes while the collective runs.
//
//   fsdp::AsyncCommunicator stream(comm);
//   fsdp::Work w = stream.all_gather(shard, full, n, fsdp::DType::f32);
//   ...compute that does not touch `shard` or `full`...
//   w.wait();  // rethrows what the collective threw
//
// Buffers: as with NCCL, the buffers passed to a collective must stay valid, and must not
// be written (send) or read (recv) by the caller, until its Work completes. (A Work dropped
// without wait() still waits, in its destructor.)
//
// Failures: Work::wait() rethrows the wrapped call's exception as it was thrown. After a
// failure the stream is broken, as a NCCL communicator is after an error: every collective
// issued or queued later fails at wait() with an fsdp::Error that quotes the first failure,
// without running (running it could pair with a different call on the other ranks).
//
// Calls are issued from one thread at a time, as on any communicator: collectives must be
// issued in the same order on every rank. The wrapped communicator is used only by the
// worker from construction on (so it need not be thread-safe): do not call it directly
// while this object exists.
//
// Destruction finishes the queued collectives (or, after a failure, fails them without
// running them) and joins the worker. It never waits on anything but the queued
// collectives themselves; what unblocks one whose peers never come is the wrapped
// communicator's own timeout or abort (ThreadGroupOptions::timeout on the thread backend).
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/tagged_calls.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

namespace detail {

// "48 KB", "1.5 MB", "512 B": a collective's size for span names.
inline std::string format_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) { v /= 1024; ++u; }
  char buf[32];
  if (v < 10 && v != static_cast<double>(static_cast<std::size_t>(v)))
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  return buf;
}

// The message of the exception `e`, without the "fsdp: " prefix fsdp::Error adds (the
// message quoting it adds its own).
inline std::string message_of(std::exception_ptr e) {
  std::string what = "a non-standard exception";
  try { std::rethrow_exception(e); } catch (const std::exception& x) { what = x.what(); } catch (...) {}
  if (what.rfind("fsdp: ", 0) == 0) what.erase(0, 6);
  return what;
}

}  // namespace detail

// The all-gathers and reductions, plain and tagged (tags pass through to a communicator
// that takes them, fsdp/core/collective_tag.hpp), come from detail::WrappedCollectives.
template <Communicator C>
class AsyncCommunicator : public detail::WrappedCollectives<AsyncCommunicator<C>, C> {
 public:
  explicit AsyncCommunicator(C& inner, Trace* trace = nullptr)
      : rank_(inner.rank()), size_(inner.size()), trace_(trace), stream_(std::make_unique<Stream>(&inner, nullptr)) {}

  // Movable (the worker and its queue live behind a pointer and do not move), so that
  // split() can return by value and DeviceMesh can store the groups. A moved-from object
  // may only be destroyed or assigned to.
  AsyncCommunicator(AsyncCommunicator&&) noexcept = default;
  AsyncCommunicator& operator=(AsyncCommunicator&&) noexcept = default;  // the old stream drains and joins once replaced
  ~AsyncCommunicator() = default;                                         // ~Stream drains and joins

  // Cached at construction: the wrapped communicator belongs to the worker.
  int rank() const { return rank_; }
  int size() const { return size_; }

  Work broadcast(const void* s, void* r, std::size_t n, DType t, int root) {
    return issue("broadcast", n * size_of(t), [=](C& c) { c.broadcast(s, r, n, t, root).wait(); });
  }
  Work barrier() { return issue("barrier", no_size, [](C& c) { c.barrier().wait(); }); }
  // Where the wrapped communicator has it (fsdp::RingShiftCommunicator).
  template <class Inner = C>
    requires RingShiftCommunicator<Inner>
  Work ring_shift(const void* s, void* r, std::size_t n, DType t) {
    return issue("ring_shift", n * size_of(t), [=](C& c) { c.ring_shift(s, r, n, t).wait(); });
  }

  // Collective: splits the wrapped communicator (MPI_Comm_split semantics) on the worker,
  // after the collectives already queued, waits for it, and returns a new stream that owns
  // the resulting communicator and records into the same trace. Throws what the split
  // threw, or the earlier failure if this stream is broken.
  auto split(int color, int key)
    requires requires(C& c) { { c.split(color, key) } -> Communicator; }
  {
    using Sub = std::remove_cvref_t<decltype(std::declval<C&>().split(color, key))>;
    auto made = std::make_shared<std::unique_ptr<Sub>>();
    issue("split", no_size, [made, color, key](C& c) { *made = std::make_unique<Sub>(c.split(color, key)); }).wait();
    return AsyncCommunicator<Sub>(std::move(*made), trace_);
  }

  // Collectives issued from now on are recorded as spans on Trace::Lane::communication,
  // named like "all_gather 48 KB" (the full-size side: gathered output, reduce_scatter
  // input, the buffer of all_reduce and broadcast), category the collective's name, from
  // when the worker starts running one to when it finishes; a failed one is named with
  // " (failed)" appended. nullptr stops recording. Groups made by split() record into the
  // trace set here at that time; their streams run at the same time as this one, so their
  // spans may overlap this stream's on the one communication lane.
  void set_trace(Trace* t) { trace_ = t; }
  Trace* trace() const { return trace_; }

 private:
  template <Communicator>
  friend class AsyncCommunicator;

  static constexpr std::size_t no_size = static_cast<std::size_t>(-1);

  AsyncCommunicator(std::unique_ptr<C> owned, Trace* trace)
      : rank_(owned->rank()), size_(owned->size()), trace_(trace), stream_(std::make_unique<Stream>(owned.get(), std::move(owned))) {}

  // One collective's outcome, shared by the worker and the Work's Pending. Not a
  // std::promise: the worker must never hold the last reference to a failure's exception
  // (see complete()).
  struct Completion {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };

  struct Op {
    const char* what;   // the collective's name: span category, and in messages
    std::size_t bytes;  // for the span name, or no_size
    std::function<void(C&)> run;
    Trace* trace;
    std::shared_ptr<Completion> completion;

    std::string label() const { return bytes == no_size ? std::string(what) : what + (" " + detail::format_bytes(bytes)); }
  };

  // Marks the collective done and lets go of it. The waiter holds its own reference until
  // it has seen `done` (a Work waits before it lets go, even when dropped), and it cannot
  // see it before the lock is released, so dropping ours first leaves the waiter's as the
  // last: the exception object, which the waiter reads, is then freed on the waiter's
  // thread, not here (libstdc++ counts exception references in code that
  // -fsanitize=thread does not see, so freeing it here is reported as a race).
  static void complete(std::shared_ptr<Completion> c, std::exception_ptr error) {
    Completion& ref = *c;
    std::lock_guard lk(ref.mu);
    ref.error = std::move(error);
    ref.done = true;
    ref.cv.notify_all();
    c.reset();
  }

  struct Pending final : Work::Pending {
    explicit Pending(std::shared_ptr<Completion> c) : c(std::move(c)) {}
    void wait() override {
      std::exception_ptr error;
      {
        std::unique_lock lk(c->mu);
        c->cv.wait(lk, [&] { return c->done; });
        error = std::move(c->error);
      }
      if (error) std::rethrow_exception(error);
    }
    bool ready() override {
      std::lock_guard lk(c->mu);
      return c->done;
    }
    std::shared_ptr<Completion> c;
  };

  // The worker, its queue, and (for split groups) the communicator it owns. It does not
  // move, so the worker can keep `this`.
  struct Stream {
    Stream(C* inner, std::unique_ptr<C> owned) : owned(std::move(owned)), inner(inner), worker([this] { loop(); }) {}
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    ~Stream() {
      {
        std::lock_guard lk(mu);
        stopping = true;
      }
      cv.notify_all();
      worker.join();  // loop() drains the queue first: every Work completes
    }

    // The error for a collective that is not run because `failure` happened before it.
    std::exception_ptr broken(int rank, const Op& op) const {
      return std::make_exception_ptr(Error(failure_kind, "rank " + std::to_string(rank) + ": " + op.label() +
                                                             " not run: an earlier collective on this stream failed (" +
                                                             failed_op + "): " + failure));
    }

    void loop() {
      for (;;) {
        std::unique_ptr<Op> op;
        bool skip = false;
        {
          std::unique_lock lk(mu);
          cv.wait(lk, [&] { return stopping || !queue.empty(); });
          if (queue.empty()) return;  // stopping, and drained
          op = std::move(queue.front());
          queue.pop_front();
          skip = is_broken;
        }
        complete(std::move(op->completion), skip ? broken(rank, *op) : execute(*op));
      }
    }

    // Runs one collective on the wrapped communicator; returns its failure, if any.
    std::exception_ptr execute(const Op& op) {
      const auto begin = Trace::Clock::now();
      std::exception_ptr error;
      try {
        op.run(*inner);
      } catch (...) {
        error = std::current_exception();
      }
      if (op.trace) {
        try {
          op.trace->add(op.label() + (error ? " (failed)" : ""), op.what, Trace::Lane::communication, begin,
                        Trace::Clock::now());
        } catch (...) {}  // a lost span must not become a failed collective
      }
      if (error) {
        std::string label, message;
        try {
          label = op.label();
          message = detail::message_of(error);
        } catch (...) {}  // out of memory: the stream still breaks, with less said
        std::lock_guard lk(mu);
        is_broken = true;
        failure_kind = kind_of(error);
        failed_op = std::move(label);
        failure = std::move(message);
      }
      return error;
    }

    std::unique_ptr<C> owned;  // null unless made by split(); outlives the worker (joined in ~Stream)
    C* inner;
    int rank = inner->rank();
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::unique_ptr<Op>> queue;
    bool stopping = false;
    bool is_broken = false;          // a collective failed: nothing more runs
    std::string failure, failed_op;  // what failed first, and its message
    ErrorKind failure_kind = ErrorKind::misuse;  // and its kind, kept by the errors that quote it
    std::thread worker;              // last: starts after everything it uses exists
  };

  // The tag is copied into the queued call: the caller's may be gone when it runs.
  friend class detail::WrappedCollectives<AsyncCommunicator, C>;
  using MaybeTag = std::optional<CollectiveTag>;
  static MaybeTag copy_of(const CollectiveTag* t) { return t ? MaybeTag(*t) : std::nullopt; }
  static const CollectiveTag* tag_of(const MaybeTag& t) { return t ? &*t : nullptr; }
  Work gather(const void* s, void* r, std::size_t n, DType t, const CollectiveTag* tag) {
    return issue("all_gather", n * static_cast<std::size_t>(size_) * size_of(t),
                 [=, tag = copy_of(tag)](C& c) { detail::all_gather(c, s, r, n, t, tag_of(tag)).wait(); });
  }
  Work scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) {
    return issue("reduce_scatter", n * static_cast<std::size_t>(size_) * size_of(t),
                 [=, tag = copy_of(tag)](C& c) { detail::reduce_scatter(c, s, r, n, t, op, tag_of(tag)).wait(); });
  }
  Work reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) {
    return issue("all_reduce", n * size_of(t),
                 [=, tag = copy_of(tag)](C& c) { detail::all_reduce(c, s, r, n, t, op, tag_of(tag)).wait(); });
  }

  Work issue(const char* what, std::size_t bytes, std::function<void(C&)> run) {
    if (!stream_) detail::fail("AsyncCommunicator: ", what, " called on a moved-from object");
    auto completion = std::make_shared<Completion>();
    // Allocated before the collective is queued: once it is queued, handing back its Work
    // must not fail, or the caller would free buffers the worker is about to use. Until
    // then a throw leaves nothing behind (a bare Pending does not wait when destroyed).
    auto pending = std::make_unique<Pending>(completion);
    auto op = std::make_unique<Op>(Op{what, bytes, std::move(run), trace_, std::move(completion)});
    Stream& s = *stream_;
    {
      std::lock_guard lk(s.mu);
      if (s.is_broken) {  // fail fast: it would not run anyway
        complete(std::move(op->completion), s.broken(rank_, *op));
        return Work(std::move(pending));
      }
      s.queue.push_back(std::move(op));
    }
    s.cv.notify_one();
    return Work(std::move(pending));
  }

  int rank_;
  int size_;
  Trace* trace_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace fsdp
