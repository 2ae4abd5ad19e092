#pragma once
// A nonblocking MPI collective in flight, as the fsdp::Work it returns, and the state of the
// communicator it runs on.
//
// MPI has no progress thread here: a collective advances only while some MPI call runs on
// this rank. Work::wait() therefore polls MPI_Test, yielding the core between polls (ranks
// often outnumber cores), until the collective completes or MpiCommOptions::timeout has
// passed since wait() began. The deadline starts at wait(), not at the call that issued
// the collective, because until something polls it the collective has not run at all.
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/detail/collective_call.hpp"
#include "fsdp/detail/collective_mismatch.hpp"
#include "fsdp/error.hpp"
#include "fsdp/mpi/mpi_session.hpp"
#include "fsdp/work.hpp"

namespace fsdp::detail {

// One MPI communicator owned by fsdp, shared by its MpiComm and the Work it returned (so
// the communicator outlives its collectives, and MPI outlives both).
struct MpiCommState {
  MpiCommState(std::shared_ptr<MpiRuntime> rt, MPI_Comm comm, std::string name, std::chrono::milliseconds timeout)
      : rt(std::move(rt)), comm(comm), name(std::move(name)), timeout(timeout) {
    auto lk = this->rt->lock();
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);  // codes become fsdp::Errors, not exits
  }
  MpiCommState(const MpiCommState&) = delete;
  MpiCommState& operator=(const MpiCommState&) = delete;
  ~MpiCommState() {
    if (rt->has_failed()) return;  // no MPI call after a failure (see lock_for_call); the job aborts
    auto lk = rt->lock();
    MPI_Comm_free(&comm);  // deferred by MPI while a timed-out collective still uses it
  }

  // "rank 1 of MPI communicator 'world'", with the world rank when it differs.
  std::string where() const {
    std::ostringstream os;
    os << "rank " << rank << " of MPI communicator '" << name << "'";
    if (rank != rt->world_rank) os << " (world rank " << rt->world_rank << ")";
    return os.str();
  }

  // A failure that leaves this communicator out of step with its peers: later collectives
  // on it fail at once, and the session will abort the job.
  [[noreturn]] void fail_collective(const std::string& message) {
    {
      std::lock_guard lk(broken_mutex);
      if (broken.empty()) broken = message;
    }
    rt->mark_failed(message);
    fail(message);
  }
  std::string broken_by() const {
    std::lock_guard lk(broken_mutex);
    return broken;
  }

  std::shared_ptr<MpiRuntime> rt;
  MPI_Comm comm;
  std::string name;
  std::chrono::milliseconds timeout;
  int rank = 0;
  int size = 1;
  std::uint64_t seq = 0;     // collectives issued so far, for messages
  std::uint64_t splits = 0;  // split() calls so far, for names
  mutable std::mutex broken_mutex;  // a Work may be waited on by another thread
  std::string broken;               // the failure that broke it; empty while healthy
};

inline constexpr int kMpiTimedOut = -1;  // not an MPI error code (those are >= 0)

// MPI_Test on `req` until it completes (MPI_SUCCESS), fails (its MPI error code) or
// `deadline` passes (kMpiTimedOut). A deadline in the past tests exactly once.
inline int mpi_test_until(MpiRuntime& rt, MPI_Request& req, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    int done = 0;
    int rc;
    {
      auto lk = rt.lock();
      rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) return rc;
    if (done) return MPI_SUCCESS;
    if (std::chrono::steady_clock::now() >= deadline) return kMpiTimedOut;
    std::this_thread::yield();
  }
}

// Host work that finishes a collective once MPI has: moving an in-place reduce_scatter's
// result to this rank's chunk, and dividing an avg's sum by the group size.
struct MpiEpilogue {
  const std::byte* move_from = nullptr;
  std::byte* move_to = nullptr;
  std::size_t move_bytes = 0;
  void* average = nullptr;  // non-null: divide `count` elements here by `group_size`
  std::size_t count = 0;
  DType dtype = DType::f32;
  int group_size = 1;

  void run() const {
    if (move_bytes) std::memmove(move_to, move_from, move_bytes);
    if (average) finish_avg(average, count, dtype, group_size);
  }
};

// A tagged collective's tag and every rank's, gathered by an MPI_Iallgather issued right
// behind the collective (fsdp/collective_tag.hpp); on the heap, where MPI writes.
struct MpiTagExchange {
  MpiTagExchange(std::uint64_t tag, int size) : mine(tag), all(static_cast<std::size_t>(size)) {}
  std::uint64_t mine;
  std::vector<std::uint64_t> all;
  MPI_Request req = MPI_REQUEST_NULL;

  // "" when every rank's tag is this rank's; else the mismatch, each rank's call named.
  std::string mismatch(const CollectiveCall& call, const std::string& where, int rank) const {
    const std::string m = tag_mismatch(call, all, static_cast<std::size_t>(rank));
    return m.empty() ? m : where + ": " + m;
  }
};

class MpiPending final : public Work::Pending {
 public:
  MpiPending(std::shared_ptr<MpiCommState> comm, MPI_Request req, CollectiveCall call, MpiEpilogue epilogue,
             std::unique_ptr<MpiTagExchange> tags = nullptr)
      : comm_(std::move(comm)), req_(req), call_(call), epilogue_(epilogue), tags_(std::move(tags)) {}

  void wait() override { finish(true); }
  bool ready() override { return finish(false); }

 private:
  // Polls until complete (blocking: or until the timeout, a failure) or once; true once
  // complete.
  bool finish(bool blocking) {
    if (done_) {
      if (!mismatch_.empty()) fail(mismatch_);  // also on a wait() after the ready() that found it
      return true;
    }
    if (comm_->rt->has_failed()) comm_->rt->lock_for_call(comm_->where() + ": " + call_.describe());  // throws
    const auto now = std::chrono::steady_clock::now();
    int rc = mpi_test_until(*comm_->rt, req_, blocking ? now + comm_->timeout : now);
    if (rc == MPI_SUCCESS && tags_) rc = mpi_test_until(*comm_->rt, tags_->req, blocking ? now + comm_->timeout : now);
    if (rc == kMpiTimedOut) {
      if (!blocking) return false;
      std::ostringstream os;
      os << comm_->where() << ": " << call_.describe() << " timed out after " << comm_->timeout.count()
         << " ms (MpiCommOptions::timeout): a rank never joined it or called a different collective; the MPI job "
            "must be torn down (the MpiSession aborts it when it ends)";
      comm_->fail_collective(os.str());
    }
    if (rc != MPI_SUCCESS)
      comm_->fail_collective(comm_->where() + ": " + call_.describe() + " failed in MPI_Test: " + mpi_error_text(rc));
    done_ = true;
    if (tags_) {  // both completed on every rank: the communicator stays in step
      mismatch_ = tags_->mismatch(call_, comm_->where(), comm_->rank);
      if (!mismatch_.empty()) fail(mismatch_);
    }
    epilogue_.run();
    return true;
  }

  std::shared_ptr<MpiCommState> comm_;
  MPI_Request req_;
  CollectiveCall call_;
  MpiEpilogue epilogue_;
  std::unique_ptr<MpiTagExchange> tags_;  // null: untagged
  bool done_ = false;
  std::string mismatch_;  // the tags differed: the result is not used
};

}  // namespace fsdp::detail
