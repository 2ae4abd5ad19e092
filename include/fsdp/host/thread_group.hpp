#pragma once
// ThreadGroup: N ranks as threads of one process, for tests, examples and single-host CPU
// runs. Collectives rendezvous in shared memory; each rank reads its peers' buffers
// directly and reduces in rank order 0..N-1, so results are bitwise reproducible.
//
// Nothing hangs: every collective checks that all ranks made the same call (op, count,
// dtype, reduce op, root) and fails on every rank with both calls named if not; a rank
// that throws aborts the group, a rank that returns while others wait for it is reported,
// and a wait longer than the timeout fails naming the ranks that never arrived.
#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fsdp/communicator.hpp"
#include "fsdp/detail/collective_call.hpp"
#include "fsdp/detail/host_math.hpp"
#include "fsdp/error.hpp"

namespace fsdp {

namespace detail {

// State shared by the ranks of one group: the whole ThreadGroup (the root) or a group
// split from it. Split groups share the root's mutex, abort flag and exit flags, so a
// failure anywhere reaches every rank waiting in any group. Ranks in messages are world
// ranks.
struct ThreadGroupState {
  // The root group of `n` ranks.
  ThreadGroupState(int n, std::chrono::milliseconds timeout)
      : size(n), timeout(timeout), root(this), mu(own_mu), cv(own_cv), world_ranks(n), arrived_gen(n, 0),
        posted(n), exited(n, false) {
    for (int r = 0; r < n; ++r) world_ranks[r] = r;
  }
  // A group of the root's ranks `members` (group rank i is world rank members[i]).
  ThreadGroupState(ThreadGroupState& root_group, std::vector<int> members)
      : size(static_cast<int>(members.size())), timeout(root_group.timeout), root(&root_group), mu(root_group.own_mu),
        cv(root_group.own_cv), world_ranks(std::move(members)), arrived_gen(size, 0), posted(size) {}

  const int size;
  const std::chrono::milliseconds timeout;
  ThreadGroupState* const root;
  std::mutex own_mu;  // used through `mu` / `cv`: the root's, for every group
  std::condition_variable own_cv;
  std::mutex& mu;
  std::condition_variable& cv;
  std::vector<int> world_ranks;
  std::uint64_t generation = 0;  // completed barrier phases
  int arrived = 0;
  std::vector<std::uint64_t> arrived_gen;  // generation each rank last arrived in, plus one
  std::vector<CollectiveCall> posted;
  // Root only:
  std::vector<bool> exited;  // by world rank
  bool aborted = false;
  int abort_origin = -1;  // the world rank whose failure aborted the group
  std::string abort_reason;
  // Groups made by split(), keyed by (parent group, split number, color).
  std::map<std::tuple<const ThreadGroupState*, std::uint64_t, int>, std::shared_ptr<ThreadGroupState>> splits;

  void abort(int origin_world_rank, std::string reason) {  // caller holds mu
    if (!root->aborted) {
      root->aborted = true;
      root->abort_origin = origin_world_rank;
      root->abort_reason = std::move(reason);
    }
    cv.notify_all();
  }
  [[noreturn]] void fail_aborted() const { fail(root->abort_reason); }

  // Waits until every rank of this group has arrived in the current phase.
  void arrive_and_wait(std::unique_lock<std::mutex>& lk, int rank, const CollectiveCall& call) {
    const int me = world_ranks[rank];
    if (root->aborted) fail("rank ", me, ": ", call.describe(), " not started: ", root->abort_reason);
    const std::uint64_t gen = generation;
    arrived_gen[rank] = gen + 1;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (generation == gen) {
      if (root->aborted) fail("rank ", me, ": ", call.describe(), " aborted: ", root->abort_reason);
      for (int r = 0; r < size; ++r) {
        if (root->exited[world_ranks[r]] && arrived_gen[r] <= gen) {
          std::ostringstream os;
          os << "rank " << world_ranks[r] << " finished without joining " << call.describe() << " that rank " << me
             << " is waiting in (ranks ran different numbers of collectives)";
          abort(me, os.str());
          fail_aborted();
        }
      }
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && generation == gen && !root->aborted) {
        std::ostringstream os;
        os << "rank " << me << ": " << call.describe() << " timed out after " << timeout.count()
           << " ms; ranks that never arrived:";
        for (int r = 0; r < size; ++r) if (arrived_gen[r] <= gen) os << ' ' << world_ranks[r];
        abort(me, os.str());
        fail_aborted();
      }
    }
  }
};

}  // namespace detail

class ThreadGroup;

// One rank's handle. Collectives complete before they return, so the returned Work is
// already done.
class ThreadComm : public detail::CollectiveCalls<ThreadComm> {
 public:
  int rank() const { return rank_; }
  int size() const { return state_->size; }

  // MPI_Comm_split: collective over this group; ranks passing the same color form a new
  // group, ordered by (key, rank).
  ThreadComm split(int color, int key) {
    if (color < 0) detail::fail("rank ", state_->world_ranks[rank_], ": ThreadComm::split color must be >= 0, got ", color);
    std::array<std::int32_t, 2> mine{color, key};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size()));
    all_gather(mine.data(), all.data(), 2, DType::i32).wait();
    const std::vector<int> members = detail::split_members(all, color);
    const std::uint64_t id = splits_++;
    std::vector<int> world;
    int new_rank = 0;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] == rank_) new_rank = static_cast<int>(i);
      world.push_back(state_->world_ranks[members[i]]);
    }
    std::shared_ptr<detail::ThreadGroupState> group;
    {
      std::lock_guard lk(state_->mu);  // the first member to get here creates the group
      auto& slot = state_->root->splits[{state_.get(), id, color}];
      if (!slot) slot = std::make_shared<detail::ThreadGroupState>(*state_->root, std::move(world));
      group = slot;
    }
    return ThreadComm(new_rank, std::move(group));
  }

 private:
  friend class ThreadGroup;
  friend class detail::CollectiveCalls<ThreadComm>;
  ThreadComm(int rank, std::shared_ptr<detail::ThreadGroupState> s) : rank_(rank), state_(std::move(s)) {}

  Work issue(detail::CollectiveCall call) {
    auto& st = *state_;
    call.seq = seq_++;
    std::unique_lock lk(st.mu);
    st.posted[rank_] = call;
    st.arrive_and_wait(lk, rank_, call);  // phase 1: every rank has posted its buffers
    for (int r = 0; r < st.size; ++r) {
      if (!st.posted[r].same_shape(call)) {
        std::ostringstream os;
        os << "collective mismatch: rank " << st.world_ranks[rank_] << " called " << call.describe() << " but rank "
           << st.world_ranks[r] << " called " << st.posted[r].describe();
        st.abort(st.world_ranks[rank_], os.str());
        st.fail_aborted();
      }
    }
    std::vector<detail::CollectiveCall> peers = st.posted;
    lk.unlock();
    // Read peers' send buffers, write only our own recv buffer. Reductions land in
    // `reduced` and are copied out only after phase 2: an in-place all_reduce's recv is
    // its send, which the other ranks may still be reading until then.
    std::vector<std::byte> reduced = execute(call, peers);
    lk.lock();
    st.arrive_and_wait(lk, rank_, call);  // phase 2: nobody reuses a send buffer still being read
    lk.unlock();
    if (!reduced.empty()) std::memcpy(call.recv, reduced.data(), reduced.size());
    return Work{};
  }

  std::vector<std::byte> execute(const detail::CollectiveCall& c, const std::vector<detail::CollectiveCall>& peers) const {
    const std::size_t esize = size_of(c.dtype);
    const std::size_t bytes = c.count * esize;
    const int n = static_cast<int>(peers.size());
    auto* out = static_cast<std::byte*>(c.recv);
    auto in = [&](int r, std::size_t elem_offset) {
      return static_cast<const std::byte*>(peers[r].send) + elem_offset * esize;
    };
    switch (c.kind) {
      case detail::CollectiveKind::all_gather:
        for (int r = 0; r < n; ++r)
          if (in(r, 0) != out + r * bytes) std::memcpy(out + r * bytes, in(r, 0), bytes);
        break;
      case detail::CollectiveKind::reduce_scatter:
      case detail::CollectiveKind::all_reduce: {
        const std::size_t off = c.kind == detail::CollectiveKind::reduce_scatter ? rank_ * c.count : 0;
        // Accumulate into a scratch copy so in-place calls never read a half-written output.
        std::vector<std::byte> acc(in(0, off), in(0, off) + bytes);
        const ReduceOp op = c.op == ReduceOp::avg ? ReduceOp::sum : c.op;
        for (int r = 1; r < n; ++r) detail::host_combine(acc.data(), in(r, off), c.count, c.dtype, op);
        if (c.op == ReduceOp::avg) detail::finish_avg(acc.data(), c.count, c.dtype, n);
        return acc;
      }
      case detail::CollectiveKind::broadcast:
        if (in(c.root, 0) != out && bytes) std::memcpy(out, in(c.root, 0), bytes);
        break;
      case detail::CollectiveKind::barrier:
        break;
    }
    return {};
  }

  int rank_;
  std::shared_ptr<detail::ThreadGroupState> state_;
  std::uint64_t seq_ = 0;
  std::uint64_t splits_ = 0;  // split() calls so far: the same on every member
};

static_assert(Communicator<ThreadComm>);

struct ThreadGroupOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // longest wait in one collective
};

class ThreadGroup {
 public:
  using Options = ThreadGroupOptions;

  explicit ThreadGroup(int size, Options options = {}) : size_(size), options_(options) {
    if (size < 1) detail::fail("ThreadGroup: size must be at least 1, got ", size);
  }
  int size() const { return size_; }

  // Runs fn(ThreadComm&) on `size` threads, one per rank, and joins them. If any rank
  // threw, rethrows the first failure (the one that aborted the group, not the echoes it
  // caused on the other ranks).
  template <class Fn>
  void run(Fn&& fn) {
    auto state = std::make_shared<detail::ThreadGroupState>(size_, options_.timeout);
    std::vector<std::exception_ptr> errors(size_);
    auto body = [&](int rank) {
      ThreadComm comm(rank, state);
      try {
        fn(comm);
      } catch (...) {
        errors[rank] = std::current_exception();
        std::string what = "a non-standard exception";
        try { throw; } catch (const std::exception& e) { what = e.what(); } catch (...) {}
        if (what.rfind("fsdp: ", 0) == 0) what.erase(0, 6);  // the abort message adds its own
        std::lock_guard lk(state->mu);
        state->abort(rank, "rank " + std::to_string(rank) + " failed: " + what);
      }
      std::lock_guard lk(state->mu);
      state->exited[rank] = true;
      state->cv.notify_all();
    };
    std::vector<std::thread> threads;
    threads.reserve(size_);
    for (int r = 1; r < size_; ++r) threads.emplace_back(body, r);
    body(0);  // rank 0 on the calling thread: one fewer thread, and debuggers stop there
    for (auto& t : threads) t.join();
    if (state->abort_origin >= 0 && errors[state->abort_origin]) std::rethrow_exception(errors[state->abort_origin]);
    for (auto& e : errors) if (e) std::rethrow_exception(e);
  }

 private:
  int size_;
  Options options_;
};

}  // namespace fsdp
