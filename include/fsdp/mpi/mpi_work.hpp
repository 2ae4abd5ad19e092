#pragma once
// A nonblocking MPI collective in flight, as the fsdp::Work it returns, and the state of the
// communicator it runs on.
//
// MPI has no progress thread here: a collective advances only while some MPI call runs on
// this rank. Work::wait() therefore polls MPI_Test, yielding the core between polls (ranks
// often outnumber cores), until the collective completes or MpiCommOptions::timeout has
// passed since wait() began. The deadline starts at wait(), not at the call that issued
// the collective, because until something polls it the collective has not run at all.
// With its call descriptors (mpi_call_check.hpp), wait() first completes their exchange,
// then the collective, and compares the ranks' calls before the result is used.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/mpi/mpi_call_check.hpp"
#include "fsdp/mpi/mpi_session.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp::detail {

// One MPI communicator owned by fsdp, shared by its MpiComm and the Work it returned (so
// the communicator outlives its collectives, and MPI outlives both).
struct MpiCommState {
  MpiCommState(std::shared_ptr<MpiRuntime> rt, MPI_Comm comm, std::string name, std::chrono::milliseconds timeout,
               bool check_calls)
      : rt(std::move(rt)), comm(comm), name(std::move(name)), timeout(timeout), check_calls(check_calls) {
    auto lk = this->rt->lock();
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);  // codes become fsdp::Errors, not exits
    // A group other than the world's ranks in order: messages name its ranks' world ranks.
    std::vector<int> mine(static_cast<std::size_t>(size)), world(mine.size());
    for (int r = 0; r < size; ++r) mine[static_cast<std::size_t>(r)] = r;
    MPI_Group group, world_group;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_translate_ranks(group, size, mine.data(), world_group, world.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    if (world != mine || size != this->rt->world_size) world_ranks = std::move(world);
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
  // `kind`: timeout, mismatch, or misuse for an MPI error (MPI says no more). `echo_of`:
  // the rank whose abort_step this failure follows (its error is an echo), or -1.
  [[noreturn]] void fail_collective(const std::string& message, ErrorKind kind, int echo_of = -1) {
    {
      std::lock_guard lk(broken_mutex);
      if (broken.empty()) {
        broken = message;
        broken_kind = kind;
        broken_echo_of = echo_of;
      }
    }
    rt->mark_failed(message, kind, echo_of);
    fail_echo_if(echo_of, kind, message);
  }
  // MPI paired different collectives here, which completed on this rank: its buffers are
  // safe, but later collectives on it could meet leftover messages, so it takes no more.
  // The job goes on (a peer still waiting in them times out and fails it).
  void break_comm(const std::string& message, int echo_of = -1) {
    std::lock_guard lk(broken_mutex);
    if (!broken.empty()) return;
    broken = message;
    broken_kind = ErrorKind::mismatch;
    broken_echo_of = echo_of;
  }
  int broken_by_echo_of() const {
    std::lock_guard lk(broken_mutex);
    return broken_echo_of;
  }
  std::string broken_by() const {
    std::lock_guard lk(broken_mutex);
    return broken;
  }
  ErrorKind broken_by_kind() const {
    std::lock_guard lk(broken_mutex);
    return broken_kind;
  }

  std::shared_ptr<MpiRuntime> rt;
  MPI_Comm comm;
  std::string name;
  std::chrono::milliseconds timeout;
  bool check_calls;  // MpiCommOptions::check_calls, the same on every rank
  int rank = 0;
  int size = 1;
  std::uint64_t seq = 0;     // collectives issued so far, for messages
  std::uint64_t descriptor_exchanges = 0;  // started so far (under the MPI lock): each one's number
  // A note whose send had not completed when its exchange gave up (MpiPending::share_note):
  // MPI may still read it, so it lives as long as the communicator.
  std::vector<std::unique_ptr<std::string>> unsent_notes;
  std::uint64_t splits = 0;  // split() calls so far, for names
  std::vector<int> world_ranks;  // world rank of each rank; empty for the world's own order
  mutable std::mutex broken_mutex;  // a Work may be waited on by another thread
  std::string broken;               // the failure that broke it; empty while healthy
  ErrorKind broken_kind = ErrorKind::misuse;  // and its kind
  int broken_echo_of = -1;                    // and the rank it echoes (fail_collective), or -1
};

inline constexpr int kMpiTimedOut = -1;  // not an MPI error code (those are >= 0)

// MPI_Test on `req` until it completes (MPI_SUCCESS), fails (its MPI error code) or
// `deadline` passes (kMpiTimedOut). A deadline in the past tests exactly once. `status`:
// where the completed request's status goes (a receive's count), or MPI_STATUS_IGNORE.
inline int mpi_test_until(MpiRuntime& rt, MPI_Request& req, std::chrono::steady_clock::time_point deadline,
                          MPI_Status* status = MPI_STATUS_IGNORE) {
  for (;;) {
    int done = 0;
    int rc;
    {
      auto lk = rt.lock();
      rc = MPI_Test(&req, &done, status);
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

class MpiPending final : public Work::Pending {
 public:
  // How long wait() still gives a collective whose ranks' calls are known to differ.
  static constexpr std::chrono::milliseconds kMismatchGrace{2000};

  // `args`: arrays MPI reads until `req` completes (MpiComm's ring_shift counts), or null.
  MpiPending(std::shared_ptr<MpiCommState> comm, MPI_Request req, CollectiveCall call, MpiEpilogue epilogue,
             std::optional<MpiCallCheck> check = std::nullopt, std::unique_ptr<int[]> args = nullptr)
      : comm_(std::move(comm)), req_(req), call_(call), epilogue_(epilogue), check_(std::move(check)),
        args_(std::move(args)) {}

  void wait() override { finish(true); }
  bool ready() override { return finish(false); }

 private:
  // Polls the call descriptors' exchange, then the collective, until both complete
  // (blocking: or until the timeout, a failure) or once each; true once complete.
  bool finish(bool blocking) {
    if (done_) {
      if (!mismatch_.empty())
        fail_echo_if(echo_of_, ErrorKind::mismatch, mismatch_);  // also on a wait() after the ready() that found it
      return true;
    }
    if (comm_->rt->has_failed()) comm_->rt->lock_for_call(comm_->where() + ": " + call_.describe());  // throws
    const auto now = std::chrono::steady_clock::now();
    const auto deadline = blocking ? now + comm_->timeout : now;
    const int calls_rc = check_ ? mpi_test_until(*comm_->rt, check_->req, deadline) : MPI_SUCCESS;
    // Known once the descriptors met, even when the collective itself does not complete.
    std::string mismatch = check_ && calls_rc == MPI_SUCCESS ? check_->mismatch(call_, comm_->rank, comm_->world_ranks) : "";
    if (!mismatch.empty())  // a rank's abort_step: its note, to every rank's message
      if (const int root = check_->abort_root(); root >= 0) {
        if (!note_deadline_)  // the note's wait begins when this rank first sees the mismatch
          note_deadline_ = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(comm_->timeout, kMismatchGrace);
        auto note = share_note(root, std::min(deadline, *note_deadline_));
        // A poll (ready()) that found no note yet is not the end: the next poll looks again,
        // until the note's wait is over, so a polled Work says what a waited one says.
        if (!blocking && root != comm_->rank && !note_received_ && !comm_->rt->has_failed() &&
            std::chrono::steady_clock::now() < *note_deadline_)
          return false;
        if (note && root != comm_->rank)
          mismatch = check_->mismatch(call_, comm_->rank, comm_->world_ranks, root, std::move(note));
        // This rank fails because `root` aborted its step, unless it aborted its own too.
        // (Named by its world rank, as the message names it.)
        if (root != comm_->rank && CollectiveTag::unpack(call_.tag).phase != TagPhase::abort_step)
          echo_of_ = comm_->world_ranks.empty() ? root : comm_->world_ranks[static_cast<std::size_t>(root)];
      }
    // Collectives that differ in more than their tags often never complete: waiting the
    // whole timeout for them only delays an error already known (known now, not when
    // wait() began: the descriptors may have taken most of the timeout to meet).
    const auto collective_deadline = blocking && !mismatch.empty() && !check_->tags_only()
                                         ? std::min(deadline, std::chrono::steady_clock::now() + kMismatchGrace)
                                         : deadline;
    const int rc = calls_rc == MPI_SUCCESS ? mpi_test_until(*comm_->rt, req_, collective_deadline) : calls_rc;
    if (rc == kMpiTimedOut && !blocking) return false;
    const std::string at = comm_->where() + ": ";
    if (rc == kMpiTimedOut)
      comm_->fail_collective(at + timed_out(calls_rc, mismatch),
                             mismatch.empty() ? ErrorKind::timeout : ErrorKind::mismatch, echo_of_);
    if (rc != MPI_SUCCESS) {
      const char* in = calls_rc != MPI_SUCCESS ? "MPI_Test of the call descriptors' MPI_Iallgather" : "MPI_Test";
      comm_->fail_collective(at + (mismatch.empty() ? "" : mismatch + "; MPI paired the different collectives: ") +
                                 call_.describe() + " failed in " + in + ": " + mpi_error_text(rc),
                             mismatch.empty() ? ErrorKind::misuse : ErrorKind::mismatch, echo_of_);
    }
    done_ = true;
    if (!mismatch.empty()) {  // the result is not used
      mismatch_ = at + mismatch;
      if (!check_->tags_only()) {
        mismatch_ += "; MPI paired the different collectives, so this communicator takes no more collectives";
        comm_->break_comm(mismatch_, echo_of_);
      }
      fail_echo_if(echo_of_, ErrorKind::mismatch, mismatch_);
    }
    epilogue_.run();
    return true;
  }

  // abort_step's note (CollectiveTag::note) from `root`, the lowest rank whose call is that
  // agreement, to every other rank, once every rank's descriptor shows the mismatch: the
  // descriptors have no room for a text, and the communicator's collectives are out of step
  // now, so point-to-point messages on it (which MPI never matches with a collective):
  // [the descriptor exchange's number (8 bytes), the note]. The root sends once per Work;
  // a rank that is sent one may try again at every poll of the Work until it has it (then
  // keeps it for the Work's later polls),
  // discarding older messages (left by an exchange it gave up on), so no rank ever quotes
  // another mismatch's note. Best effort, bounded: a receiver waits at most until
  // `deadline` (finish(): the Work's own, and kMismatchGrace, or the timeout if shorter,
  // from the first poll that saw the mismatch), then cancels its receive (which MPI
  // completes at once); the root waits for its sends as long, then leaves any still in
  // flight to MPI, keeping its text with the communicator. Returns the note (the root's own
  // too); null if none arrived, or after a failure of the job.
  std::shared_ptr<const std::string> share_note(int root, std::chrono::steady_clock::time_point deadline) {
    auto& s = *comm_;
    if (s.rt->has_failed()) return nullptr;  // no MPI call after a failure (mpi_session.hpp)
    const std::uint64_t number = check_->number();
    constexpr int kNoteTag = 8235;  // within the 32767 every MPI allows
    auto test_until = [&](MPI_Request& req, MPI_Status* status) {  // true: completed
      return mpi_test_until(*s.rt, req, deadline, status) == MPI_SUCCESS;
    };
    if (s.rank == root) {
      if (note_sent_) return call_.note;
      note_sent_ = true;
      auto message = std::make_unique<std::string>(sizeof number, '\0');
      std::memcpy(message->data(), &number, sizeof number);
      if (call_.note) *message += *call_.note;
      std::vector<MPI_Request> sends;
      {
        auto lk = s.rt->lock();
        for (int r = 0; r < s.size; ++r)
          if (r != root) {
            MPI_Request req = MPI_REQUEST_NULL;
            if (MPI_Isend(message->data(), static_cast<int>(message->size()), MPI_BYTE, r, kNoteTag, s.comm, &req) ==
                MPI_SUCCESS)
              sends.push_back(req);
          }
      }
      bool in_flight = false;
      for (auto& req : sends)
        if (!test_until(req, MPI_STATUS_IGNORE)) {
          auto lk = s.rt->lock();
          if (req != MPI_REQUEST_NULL) MPI_Request_free(&req);  // MPI completes it later, reading `message`
          in_flight = true;
        }
      if (in_flight) {
        auto lk = s.rt->lock();
        s.unsent_notes.push_back(std::move(message));
      }
      return call_.note;
    }
    if (note_received_) return received_note_;  // an earlier poll of this Work received it
    std::vector<char> in(sizeof number + kMaxQuoted + 16);  // a note is at most kMaxQuoted bytes and " [...]"
    for (;;) {  // until this exchange's message, or the deadline
      MPI_Request req = MPI_REQUEST_NULL;
      MPI_Status status{};
      {
        auto lk = s.rt->lock();
        if (MPI_Irecv(in.data(), static_cast<int>(in.size()), MPI_BYTE, root, kNoteTag, s.comm, &req) != MPI_SUCCESS)
          return nullptr;
      }
      if (!test_until(req, &status)) {
        auto lk = s.rt->lock();
        if (req != MPI_REQUEST_NULL) {
          MPI_Cancel(&req);                    // a receive's cancel completes at once
          MPI_Wait(&req, MPI_STATUS_IGNORE);
        }
        return nullptr;
      }
      int got = 0;
      MPI_Get_count(&status, MPI_BYTE, &got);
      std::uint64_t theirs = 0;
      if (got < static_cast<int>(sizeof number)) return nullptr;
      std::memcpy(&theirs, in.data(), sizeof number);
      if (theirs < number) continue;  // left by an earlier exchange this rank gave up on
      if (theirs > number) return nullptr;  // a later one's (its Work waited first): this one's never comes
      note_received_ = true;
      if (got > static_cast<int>(sizeof number))  // else the root had no note
        received_note_ = std::make_shared<const std::string>(in.data() + sizeof number,
                                                             static_cast<std::size_t>(got) - sizeof number);
      return received_note_;
    }
  }

  std::string timed_out(int calls_rc, const std::string& mismatch) const {
    std::ostringstream os;
    if (!mismatch.empty())
      os << mismatch << "; MPI paired the different collectives, and " << call_.describe()
         << " did not complete within "
         << std::chrono::duration_cast<std::chrono::milliseconds>(std::min(comm_->timeout, kMismatchGrace)).count()
         << " ms of the mismatch being known";
    else
      os << call_.describe() << " timed out after " << comm_->timeout.count() << " ms (MpiCommOptions::timeout)";
    if (!check_)
      os << ": a rank never joined it or called a different collective";
    else if (calls_rc != MPI_SUCCESS)
      os << ": a rank never issued it (its call descriptor never arrived)";
    else if (mismatch.empty())
      os << ": every rank issued this same call, but a rank has not polled it since (MPI progresses a collective "
            "only inside MPI calls on every rank)";
    os << "; the MPI job must be torn down (the MpiSession aborts it when it ends)";
    return os.str();
  }

  std::shared_ptr<MpiCommState> comm_;
  MPI_Request req_;
  CollectiveCall call_;
  MpiEpilogue epilogue_;
  std::optional<MpiCallCheck> check_;  // empty: the ranks' calls are not compared
  std::unique_ptr<int[]> args_;        // what MPI reads until req_ completes, or null
  bool done_ = false;
  bool note_sent_ = false;  // share_note: this rank, the root, sent its note for this Work
  bool note_received_ = false;  // share_note: the root's message for this Work arrived here
  std::shared_ptr<const std::string> received_note_;  // its note (null: it had none)
  std::optional<std::chrono::steady_clock::time_point> note_deadline_;  // set when the mismatch is first seen
  std::string mismatch_;  // the ranks' calls differed: the result is not used
  int echo_of_ = -1;      // the world rank whose abort_step the mismatch is (this rank's error echoes it), or -1
};

}  // namespace fsdp::detail
