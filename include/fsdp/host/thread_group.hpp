#pragma once
// ThreadGroup: N ranks as threads of one process, for tests, examples and single-host CPU
// runs. Collectives rendezvous in shared memory; each rank reads its peers' buffers
// directly and reduces in rank order 0..N-1, so results are bitwise reproducible.
//
// Nothing hangs: every collective checks that all ranks made the same call (op, count,
// dtype, reduce op, root) and fails on every rank with both calls named if not; a rank
// that throws aborts the group, a rank that returns while others wait for it is reported,
// and a wait longer than the timeout fails naming the ranks that never arrived. Aborting
// is safe while peers copy: no rank leaves a collective while a peer still reads its
// buffers (see thread_group_state.hpp). The ranks a failure aborts throw echoes of it
// (detail::EchoedError, naming the failed rank and quoting it), so run() can rethrow the
// root cause, not whichever echo got out first.
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/host/thread_group_options.hpp"
#if FSDP_DEFINES_IMPLEMENTATION  // what only ThreadComm's and ThreadGroup's compiled members use
#include <array>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "fsdp/core/detail/collective_mismatch.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/host/thread_group_state.hpp"
#endif

namespace fsdp {

class ThreadGroup;
namespace detail {
struct ThreadGroupState;  // fsdp/host/thread_group_state.hpp
}

// One rank's handle. Collectives complete before they return, so the returned Work is
// already done.
class ThreadComm : public detail::CollectiveCalls<ThreadComm> {
 public:
  static constexpr bool checks_tags = true;  // compared at the rendezvous, with the calls
  static constexpr bool shifts_ring = true;  // ring_shift(): RingShiftCommunicator

  int rank() const { return rank_; }
  int size() const;

  // MPI_Comm_split: collective over this group; ranks passing the same color form a new
  // group, ordered by (key, rank). The new group lives as long as a communicator of it.
  ThreadComm split(int color, int key);

  // Groups split (directly or not) from this communicator's ThreadGroup that are alive,
  // i.e. used by some communicator: the count returns to where it was once the
  // communicators of the splits made since are gone.
  std::size_t live_split_groups() const;

 private:
  friend class ThreadGroup;
  friend class detail::CollectiveCalls<ThreadComm>;
  ThreadComm(int rank, std::shared_ptr<detail::ThreadGroupState> s) : rank_(rank), state_(std::move(s)) {}

  static constexpr std::size_t kChunkBytes = std::size_t{1} << 20;  // reads check for an abort this often

  Work issue(detail::CollectiveCall call);

  // Reads the peers' buffers chunk by chunk; returns false, having stopped, as soon as
  // the group is aborted (a peer may be about to free what we read).
  bool execute(const detail::CollectiveCall& c, const std::vector<detail::CollectiveCall>& peers,
               std::vector<std::byte>& reduced, std::size_t& done) const;

  static std::string what_of(const std::exception_ptr& e);

  int rank_;
  std::shared_ptr<detail::ThreadGroupState> state_;
  std::uint64_t seq_ = 0;
  std::uint64_t splits_ = 0;  // split() calls so far: the same on every member
};

#if FSDP_DEFINES_IMPLEMENTATION
// ThreadComm's members that do not depend on a template argument: compiled once under
// FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp), in every file that uses them otherwise.
FSDP_DECL int ThreadComm::size() const { return state_->size; }

FSDP_DECL std::size_t ThreadComm::live_split_groups() const { return state_->root->live_splits.load(); }

FSDP_DECL ThreadComm ThreadComm::split(int color, int key) {
  if (color < 0) detail::fail("rank ", state_->world_ranks[rank_], ": ThreadComm::split color must be >= 0, got ", color);
  std::array<std::int32_t, 2> mine{color, key};
  std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size()));
  all_gather(mine.data(), all.data(), 2, DType::i32).wait();
  const std::vector<int> members = detail::split_members(all, color);
  const std::uint64_t split_number = splits_++;
  std::vector<int> world;
  int new_rank = 0;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank_) new_rank = static_cast<int>(i);
    world.push_back(state_->world_ranks[members[i]]);
  }
  std::shared_ptr<detail::ThreadGroupState> group;
  {
    std::lock_guard lk(state_->mu);  // the first member to get here creates the group
    auto& root = *state_->root;
    const auto pending = root.pending_splits.try_emplace({state_->id, split_number, color}).first;
    if (!pending->second.group) {
      auto root_ptr = state_->root_owner ? state_->root_owner : state_;
      pending->second.group =
          std::make_shared<detail::ThreadGroupState>(std::move(root_ptr), root.next_group_id++, std::move(world));
    }
    group = pending->second.group;
    if (++pending->second.picked_up == members.size()) root.pending_splits.erase(pending);  // the last member
  }
  return ThreadComm(new_rank, std::move(group));
}

FSDP_DECL Work ThreadComm::issue(detail::CollectiveCall call) {
  auto& st = *state_;
  call.seq = seq_++;
  std::unique_lock lk(st.mu);
  st.post_and_wait(lk, rank_, call);  // phase 1: every rank has posted its buffers
  lk.unlock();
  // Phase 2: read peers' send buffers, write only our own recv buffer. Reductions land
  // in `reduced` and are copied out only at the end: an in-place all_reduce's recv is
  // its send, which the other ranks may read until every rank has finished reading.
  // Whatever happens here, this rank reports to finish_reading before it leaves.
  std::vector<std::byte> reduced;
  std::string mismatch, failed;  // why this rank aborts the group, if it does
  bool complete = false;
  std::exception_ptr failure;
  try {
    const std::vector<detail::CollectiveCall> peers = st.posted;  // fixed until every rank has finished reading
    // Every rank's call, with its tag's unit, when they differ.
    mismatch = detail::collective_mismatch(peers, static_cast<std::size_t>(rank_), state_->world_ranks);
    if (mismatch.empty()) {
      st.run_hook(rank_, call.seq, CollectiveStage::posted, 0);
      std::size_t bytes_read = 0;
      complete = execute(call, peers, reduced, bytes_read);
      if (complete) st.run_hook(rank_, call.seq, CollectiveStage::read, bytes_read);
    }
  } catch (...) {
    failure = std::current_exception();
    complete = false;
    try {
      failed = "rank " + std::to_string(st.world_ranks[rank_]) + " failed in " + call.describe() + ": " + what_of(failure);
    } catch (...) {}  // out of memory even for the message: abort without one
  }
  lk.lock();
  if (!mismatch.empty()) st.abort(st.world_ranks[rank_], mismatch, ErrorKind::mismatch);
  if (failure) st.abort(st.world_ranks[rank_], std::move(failed), ErrorKind::peer_lost);  // the others lost this rank
  const bool ok = st.finish_reading(lk, rank_, call, complete);  // nobody reads our buffers after this
  if (failure) std::rethrow_exception(failure);
  if (!mismatch.empty()) st.fail_aborted();
  if (!ok)
    detail::fail_echo(st.root->abort_kind, st.root->abort_origin, "rank ", st.world_ranks[rank_], ": ",
                      call.describe(), " aborted: ", st.root->abort_reason);
  lk.unlock();
  if (!reduced.empty()) std::memcpy(call.recv, reduced.data(), reduced.size());
  return Work{};
}

FSDP_DECL bool ThreadComm::execute(const detail::CollectiveCall& c, const std::vector<detail::CollectiveCall>& peers,
                                   std::vector<std::byte>& reduced, std::size_t& done) const {
  const std::size_t esize = size_of(c.dtype);
  const std::size_t bytes = c.count * esize;
  const std::size_t chunk = std::max<std::size_t>(1, kChunkBytes / std::max<std::size_t>(esize, 1));
  const int n = static_cast<int>(peers.size());
  auto* out = static_cast<std::byte*>(c.recv);
  auto in = [&](int r, std::size_t elem_offset) {
    return static_cast<const std::byte*>(peers[r].send) + elem_offset * esize;
  };
  auto may_read = [&] {
    state_->run_hook(rank_, c.seq, CollectiveStage::reading, done);
    return !state_->root->aborted.load();
  };
  // Copies `count` elements from rank r's buffer at `from` to `to`, a chunk at a time.
  auto copy = [&](std::byte* to, int r, std::size_t from) {
    if (in(r, from) == to) return true;  // in place: already there
    for (std::size_t i = 0; i < c.count; i += chunk) {
      if (!may_read()) return false;
      const std::size_t len = std::min(chunk, c.count - i) * esize;
      std::memcpy(to + i * esize, in(r, from + i), len);
      done += len;
    }
    return true;
  };
  switch (c.kind) {
    case detail::CollectiveKind::all_gather:
      for (int r = 0; r < n; ++r)
        if (!copy(out + r * bytes, r, 0)) return false;
      return true;
    case detail::CollectiveKind::broadcast:
      return copy(out, c.root, 0);
    case detail::CollectiveKind::ring_shift:
      return copy(out, (rank_ + n - 1) % n, 0);
    case detail::CollectiveKind::reduce_scatter:
    case detail::CollectiveKind::all_reduce: {
      const std::size_t off = c.kind == detail::CollectiveKind::reduce_scatter ? rank_ * c.count : 0;
      const ReduceOp op = c.op == ReduceOp::avg ? ReduceOp::sum : c.op;
      reduced.resize(bytes);  // scratch, so in-place calls never read a half-written output
      for (std::size_t i = 0; i < c.count; i += chunk) {
        if (!may_read()) return false;
        const std::size_t len = std::min(chunk, c.count - i);
        std::byte* acc = reduced.data() + i * esize;
        std::memcpy(acc, in(0, off + i), len * esize);
        for (int r = 1; r < n; ++r) detail::host_combine(acc, in(r, off + i), len, c.dtype, op);
        done += n * len * esize;
      }
      if (c.op == ReduceOp::avg) detail::finish_avg(reduced.data(), c.count, c.dtype, n);
      return true;
    }
    case detail::CollectiveKind::barrier:
      return true;
  }
  return true;
}

FSDP_DECL std::string ThreadComm::what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return std::string(detail::message_of(x));  // the abort message adds its own "fsdp: "
  } catch (...) {
    return "a non-standard exception";
  }
}
#endif  // FSDP_DEFINES_IMPLEMENTATION

static_assert(Communicator<ThreadComm>);
static_assert(RingShiftCommunicator<ThreadComm>);

class ThreadGroup {
 public:
  using Options = ThreadGroupOptions;

  explicit ThreadGroup(int size, Options options = {}) : size_(size), options_(std::move(options)) {
    if (size < 1) detail::fail("ThreadGroup: size must be at least 1, got ", size);
    detail::check_timeout(options_.timeout, "ThreadGroup: timeout");
  }
  int size() const { return size_; }

  // Runs fn(ThreadComm&) on `size` threads, one per rank, and joins them. If any rank
  // threw, rethrows the root cause: the failure that aborted the group if it was that
  // rank's own, else the first rank's own failure to leave its function, never an echo
  // (detail::EchoedError: "another rank failed", a collective aborted by a peer) while
  // some rank threw an error of its own; an echo only when every rank's error is one. If
  // a thread cannot be started, the ranks already running are aborted and joined, and an
  // fsdp::Error says so.
  template <class Fn>
  void run(Fn&& fn) {
    // Only this thunk depends on fn's type; the threads, the abort and the choice of the
    // error to rethrow compile once (run_ranks), not once per lambda a program passes.
    using F = std::remove_reference_t<Fn>;
    if constexpr (std::is_function_v<F>) {  // a function, not an object: called through a lambda
      run([&fn](ThreadComm& comm) { fn(comm); });
    } else {
      run_ranks(const_cast<void*>(static_cast<const void*>(std::addressof(fn))),
                [](void* f, ThreadComm& comm) { (*static_cast<F*>(f))(comm); });
    }
  }

 private:
  // run(fn) with fn as an address and a function that calls it.
  FSDP_DECL void run_ranks(void* fn, void (*call)(void* fn, ThreadComm& comm));

  // Which error run() rethrows (see run): `order` lists the ranks that failed, first first;
  // `origin` is the rank whose failure aborted the group (-1: none).
  static std::exception_ptr root_cause(const std::vector<std::exception_ptr>& errors, const std::vector<int>& order,
                                       int origin) {
    const bool origin_failed = origin >= 0 && origin < static_cast<int>(errors.size()) && errors[origin];
    if (origin_failed && !detail::is_echo(errors[origin])) return errors[origin];
    for (int r : order)
      if (!detail::is_echo(errors[r])) return errors[r];
    if (origin_failed) return errors[origin];
    return order.empty() ? nullptr : errors[order.front()];
  }

  int size_;
  Options options_;
};

#if FSDP_DEFINES_IMPLEMENTATION
FSDP_DECL void ThreadGroup::run_ranks(void* fn, void (*call)(void* fn, ThreadComm& comm)) {
  auto state = std::make_shared<detail::ThreadGroupState>(size_, options_);
  std::vector<std::exception_ptr> errors(size_);
  std::vector<int> failed_in_order;  // ranks, as their errors left fn (under state->mu)
  auto body = [&](int rank) {
    ThreadComm comm(rank, state);
    try {
      call(fn, comm);
    } catch (...) {
      errors[rank] = std::current_exception();
      std::lock_guard lk(state->mu);
      failed_in_order.push_back(rank);
      state->abort(rank, "rank " + std::to_string(rank) + " failed: " + ThreadComm::what_of(errors[rank]),
                   ErrorKind::peer_lost);
    }
    std::lock_guard lk(state->mu);
    state->exited[rank] = true;
    state->cv.notify_all();
  };
  std::vector<std::thread> threads;
  threads.reserve(size_);
  std::string start_failure;
  ErrorKind start_kind = ErrorKind::misuse;
  for (int r = 1; r < size_ && start_failure.empty(); ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (const std::exception& e) {  // e.g. a thread limit: stop the ranks already running
      std::ostringstream os;
      os << "ThreadGroup: could not start the thread of rank " << r << " of " << size_ << " (" << e.what()
         << "); the " << r - 1 << " rank(s) already started were aborted and joined";
      start_failure = os.str();
      std::lock_guard lk(state->mu);
      start_kind = kind_of(e);  // a thread limit: a std::system_error (io)
      state->abort(r, start_failure, start_kind);
    }
  }
  if (start_failure.empty()) body(0);  // rank 0 on the calling thread: one fewer thread, and debuggers stop there
  for (auto& t : threads) t.join();
  state->pending_splits.clear();  // splits some member never picked up (they keep the root alive)
  if (!start_failure.empty()) throw Error(start_kind, start_failure);
  if (const std::exception_ptr root = root_cause(errors, failed_in_order, state->abort_origin))
    std::rethrow_exception(root);
}
#endif  // FSDP_DEFINES_IMPLEMENTATION

}  // namespace fsdp
