#pragma once
// The shared state behind ThreadGroup's ranks: the rendezvous of one collective, the abort
// that reaches every waiting rank, and the registry of split groups. Ranks read each
// other's buffers directly, so the rule that keeps that safe lives here: once every rank
// has posted its buffers, no rank leaves the collective (returns or throws, letting its
// caller free them) until every rank has stopped reading; a rank stops reading early at
// the next 1 MiB chunk once the group is aborted, so that wait is short and bounded.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/host/thread_group_options.hpp"

namespace fsdp {

namespace detail {

// One group: the whole ThreadGroup (the root) or a group split from it. Split groups
// share the root's mutex, abort flag and exit flags, so a failure anywhere reaches every
// rank waiting in any group. Ranks in messages are world ranks.
struct ThreadGroupState {
  // The root group of `n` ranks.
  ThreadGroupState(int n, const ThreadGroupOptions& options)
      : size(n), timeout(options.timeout), fault_hook(options.fault_hook), id(0), root(this), mu(own_mu), cv(own_cv),
        world_ranks(n), arrived_gen(n, 0), posted(n), reading(n, false), exited(n, false) {
    for (int r = 0; r < n; ++r) world_ranks[r] = r;
  }
  // A group of the root's ranks `members` (group rank i is world rank members[i]). It
  // keeps the root, whose mutex it uses, alive.
  ThreadGroupState(std::shared_ptr<ThreadGroupState> root_group, std::uint64_t group_id, std::vector<int> members)
      : size(static_cast<int>(members.size())), timeout(root_group->timeout), fault_hook(root_group->fault_hook),
        id(group_id), root_owner(std::move(root_group)), root(root_owner.get()), mu(root->own_mu), cv(root->own_cv),
        world_ranks(std::move(members)), arrived_gen(size, 0), posted(size), reading(size, false) {
    root->live_splits.fetch_add(1);
  }
  ~ThreadGroupState() {
    if (root != this) root->live_splits.fetch_sub(1);
  }
  ThreadGroupState(const ThreadGroupState&) = delete;
  ThreadGroupState& operator=(const ThreadGroupState&) = delete;

  const int size;
  const std::chrono::milliseconds timeout;
  const std::function<void(const CollectivePoint&)> fault_hook;
  const std::uint64_t id;  // 0 for the root; names the parent in the split registry
  const std::shared_ptr<ThreadGroupState> root_owner;  // null for the root
  ThreadGroupState* const root;
  std::mutex own_mu;  // used through `mu` / `cv`: the root's, for every group
  std::condition_variable own_cv;
  std::mutex& mu;
  std::condition_variable& cv;
  std::vector<int> world_ranks;
  // Phase 1 of a collective: every rank posts its call.
  std::uint64_t generation = 0;  // completed phases
  int arrived = 0;
  std::vector<std::uint64_t> arrived_gen;  // generation each rank last arrived in, plus one
  std::vector<CollectiveCall> posted;
  // Phase 2: ranks read their peers' buffers.
  int readers = 0;
  std::vector<bool> reading;
  bool incomplete = false;  // a rank stopped early or the wait timed out: every rank throws
  // Root only:
  std::vector<bool> exited;  // by world rank
  std::atomic<bool> aborted{false};  // read without the lock between chunks
  int abort_origin = -1;  // the world rank whose failure aborted the group
  std::string abort_reason;
  ErrorKind abort_kind = ErrorKind::misuse;  // what the ranks that did not fail themselves throw
  // Split groups not yet picked up by all their members, keyed by (parent id, split
  // number, color); afterwards only their communicators own them.
  struct PendingSplit {
    std::shared_ptr<ThreadGroupState> group;
    std::size_t picked_up = 0;
  };
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, PendingSplit> pending_splits;
  std::uint64_t next_group_id = 1;
  std::atomic<std::size_t> live_splits{0};

  // `kind`: a timeout, a mismatch, or peer_lost for a rank that failed (the others lost it).
  void abort(int origin_world_rank, std::string reason, ErrorKind kind) {  // caller holds mu
    if (!root->aborted) {
      root->abort_origin = origin_world_rank;
      root->abort_reason = std::move(reason);
      root->abort_kind = kind;
      root->aborted = true;
    }
    cv.notify_all();
  }
  [[noreturn]] void fail_aborted() const { fail_as(root->abort_kind, root->abort_reason); }

  void run_hook(int rank, std::uint64_t seq, CollectiveStage stage, std::size_t bytes_read) const {
    if (fault_hook) fault_hook(CollectivePoint{world_ranks[rank], seq, stage, bytes_read});
  }

  // Phase 1: posts this rank's call and waits until every rank of the group has. Throws
  // (having read nothing) if the group aborts, a peer exits, or the timeout passes first.
  void post_and_wait(std::unique_lock<std::mutex>& lk, int rank, const CollectiveCall& call);

  // Phase 2's end: this rank has stopped reading (`complete`: it read everything). Waits
  // until every rank has, so that no peer still reads this rank's buffers when it
  // leaves. A wait past the timeout aborts the group, which stops the readers at their
  // next chunk; that wait is bounded by the timeout again. Returns whether the
  // collective succeeded on every rank.
  bool finish_reading(std::unique_lock<std::mutex>& lk, int rank, const CollectiveCall& call, bool complete);

  std::string still_reading() const;
};

#if FSDP_DEFINES_IMPLEMENTATION
// ThreadGroupState's members that do not depend on a template argument: compiled once under
// FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp), in every file that uses them otherwise.
FSDP_DECL void ThreadGroupState::post_and_wait(std::unique_lock<std::mutex>& lk, int rank, const CollectiveCall& call) {
  const int me = world_ranks[rank];
  if (root->aborted)  // another rank's failure: an echo of it
    fail_echo(root->abort_kind, root->abort_origin, "rank ", me, ": ", call.describe(), " not started: ",
              root->abort_reason);
  posted[rank] = call;
  const std::uint64_t gen = generation;
  arrived_gen[rank] = gen + 1;
  if (++arrived == size) {  // the last to arrive opens phase 2
    arrived = 0;
    readers = size;
    reading.assign(size, true);
    incomplete = false;
    ++generation;
    cv.notify_all();
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (generation == gen) {
    if (root->aborted)
      fail_echo(root->abort_kind, root->abort_origin, "rank ", me, ": ", call.describe(), " aborted: ",
                root->abort_reason);
    for (int r = 0; r < size; ++r) {
      if (root->exited[world_ranks[r]] && arrived_gen[r] <= gen) {
        std::ostringstream os;
        os << "rank " << world_ranks[r] << " finished without joining " << call.describe() << " that rank " << me
           << " is waiting in (ranks ran different numbers of collectives)";
        abort(me, os.str(), ErrorKind::mismatch);
        fail_aborted();
      }
    }
    if (cv.wait_until(lk, deadline) == std::cv_status::timeout && generation == gen && !root->aborted) {
      std::ostringstream os;
      os << "rank " << me << ": " << call.describe() << " timed out after " << timeout.count()
         << " ms; ranks that never arrived:";
      for (int r = 0; r < size; ++r) if (arrived_gen[r] <= gen) os << ' ' << world_ranks[r];
      abort(me, os.str(), ErrorKind::timeout);
      fail_aborted();
    }
  }
}

FSDP_DECL bool ThreadGroupState::finish_reading(std::unique_lock<std::mutex>& lk, int rank, const CollectiveCall& call,
                                               bool complete) {
  const int me = world_ranks[rank];
  incomplete |= !complete;
  reading[rank] = false;
  if (--readers == 0) cv.notify_all();
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool extended = false;
  while (readers > 0) {
    if (cv.wait_until(lk, deadline) == std::cv_status::no_timeout || readers == 0) continue;
    if (extended) {
      // A reader ran no chunk for a whole timeout after the abort (a thread not
      // scheduled at all): leave rather than hang, and say so.
      std::ostringstream os;
      os << "rank " << me << ": " << call.describe() << " aborted: " << root->abort_reason << " (left after "
         << 2 * timeout.count() << " ms with ranks still reading:" << still_reading() << ")";
      fail_as(ErrorKind::timeout, os.str());
    }
    if (!root->aborted) {
      std::ostringstream os;
      os << "rank " << me << ": " << call.describe() << " timed out after " << timeout.count()
         << " ms; ranks still reading their peers' buffers:" << still_reading();
      abort(me, os.str(), ErrorKind::timeout);
    }
    incomplete = true;
    deadline = std::chrono::steady_clock::now() + timeout;
    extended = true;
  }
  return !incomplete;
}

FSDP_DECL std::string ThreadGroupState::still_reading() const {
  std::string s;
  for (int r = 0; r < size; ++r) if (reading[r]) s += ' ' + std::to_string(world_ranks[r]);
  return s;
}
#endif  // FSDP_DEFINES_IMPLEMENTATION

}  // namespace detail
}  // namespace fsdp
