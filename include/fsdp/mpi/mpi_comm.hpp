#pragma once
// fsdp::MpiComm: an fsdp::Communicator over an MPI communicator (OpenMPI from Debian, MPI
// 3.1). Each collective is MPI's nonblocking one, returned as an fsdp::Work:
//
//   all_gather -> MPI_Iallgather         reduce_scatter -> MPI_Ireduce_scatter_block
//   all_reduce -> MPI_Iallreduce         broadcast -> MPI_Ibcast      barrier -> MPI_Ibarrier
//   ring_shift -> MPI_Ialltoallv with one count: to rank + 1, from rank - 1
//
// split() is MPI_Comm_split, so a DeviceMesh can be built over it. NCCL's in-place forms
// (all_gather with send == recv + rank*count, reduce_scatter with recv == send + rank*count,
// all_reduce with send == recv) become MPI_IN_PLACE; after an in-place reduce_scatter the
// other ranks' chunks of the buffer are unspecified (MPI may use them as scratch). avg is a
// sum divided by the group size once the collective completes: scaled by 1/N for floats,
// truncating integer division for integers, as ThreadComm does. Sums are grouped the way
// MPI's algorithm for the group size groups them (reproducible run to run, but beyond two
// ranks not bitwise the rank-order sum ThreadComm computes).
//
// Nothing waits forever: Work::wait() gives up after MpiCommOptions::timeout, and creating a
// communicator (world(), dup(), split()) first meets every rank in a nonblocking call with
// the same timeout. Every failure is an fsdp::Error naming the rank, the communicator, the
// collective and its sequence number, with MPI's error string. A collective that failed or
// timed out breaks its communicator (later calls on it fail at once) and makes the
// MpiSession abort the job when it ends; see mpi_session.hpp for why.
//
// Calls compared (mpi_call_check.hpp): before each collective, every rank starts a 16-byte
// MPI_Iallgather of its call's descriptor (kind, count, dtype, op, root and collective tag,
// fsdp/core/collective_tag.hpp); wait() completes it, then the collective, and compares every
// rank's call before the result is used. Ranks whose calls differ all fail with an
// fsdp::Error naming every rank's call (ThreadComm's message):
//   - only in their tags: MPI ran one collective alike on every rank; the communicator
//     stays usable;
//   - otherwise MPI paired different collectives. OpenMPI (4.1, libnbc) checks every
//     receive against the receiver's own buffer, so nothing is written out of bounds, but
//     what follows depends on the collectives' message patterns: on a rank whose collective
//     completed, the mismatch breaks this communicator only; where MPI reports an error
//     (MPI_ERR_TRUNCATE) or the wait times out, the message is still the mismatch, and the
//     job must end as after any failed collective.
//   Where one rank's call was abort_step's agreement, that rank then sends the others its
//   note, the exception that left its step (CollectiveTag::note), for their messages to
//   quote: point-to-point messages on this communicator with MPI tag 8235, waited for at
//   most 2 s and within the wait's timeout (MpiPending::share_note; best effort).
// Comparing before the collective starts would take a blocking round trip per call (and
// serialize issue with the slowest rank); OpenMPI never lets a mismatched collective write
// out of bounds, so the check rides beside the collective instead. It costs one small
// collective per call; MpiCommOptions::check_calls = false leaves it to tagged calls only.
//
// As with any communicator, every rank must issue the same collectives in the same order,
// from one thread at a time; buffers must stay untouched until the Work completes. MPI
// progresses a collective only inside MPI calls, so computing between issue and wait()
// overlaps nothing; AsyncCommunicator<MpiComm> runs collectives on a thread of their own.
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/mpi/mpi_session.hpp"
#include "fsdp/mpi/mpi_work.hpp"

namespace fsdp {

struct MpiCommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // longest wait() of one collective
  // Compare every rank's call at each collective (see the top of this file). false: only
  // tagged calls (the library's all-gathers and reductions of a unit) are compared; must be
  // the same on every rank (checked when the communicator is made).
  bool check_calls = true;
};

class MpiComm : public detail::CollectiveCalls<MpiComm> {
 public:
  static constexpr bool checks_tags = true;  // every tagged call's descriptor is compared at wait()
  static constexpr bool shifts_ring = true;  // ring_shift(): RingShiftCommunicator, see shift()
  using Options = MpiCommOptions;

  // A duplicate of MPI_COMM_WORLD; collective over every rank of the job.
  static MpiComm world(const MpiSession& session, Options options = {}) {
    return dup(session, MPI_COMM_WORLD, "world", options);
  }

  // A duplicate of `parent` (any communicator this rank belongs to), called `name` in
  // messages; collective over `parent`'s ranks.
  static MpiComm dup(const MpiSession& session, MPI_Comm parent, std::string name, Options options = {}) {
    detail::check_timeout(options.timeout, "MpiComm '", name, "': timeout");
    auto& rt = session.rt_;
    const auto where = "world rank " + std::to_string(rt->world_rank) + ": MpiComm '" + name + "': ";
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    int rc;
    {
      auto lk = rt->lock_for_call(where + "making the communicator");
      rc = MPI_Comm_idup(parent, &comm, &req);
    }
    if (rc == MPI_SUCCESS) rc = detail::mpi_test_until(*rt, req, std::chrono::steady_clock::now() + options.timeout);
    if (rc == detail::kMpiTimedOut) {
      const auto message = where + "MPI_Comm_idup did not complete within " + std::to_string(options.timeout.count()) +
                           " ms (MpiCommOptions::timeout): a rank of the parent communicator never created its MpiComm";
      rt->mark_failed(message, ErrorKind::timeout);
      detail::fail_as(ErrorKind::timeout, message);
    }
    if (rc != MPI_SUCCESS) {
      const auto message = where + "MPI_Comm_idup failed: " + detail::mpi_error_text(rc);
      rt->mark_failed(message, ErrorKind::misuse);
      detail::fail(message);
    }
    auto state = std::make_shared<detail::MpiCommState>(rt, comm, std::move(name), options.timeout, options.check_calls);
    agree_on_checks(*state);
    return MpiComm(std::move(state));
  }

  MpiComm(MpiComm&&) noexcept = default;
  MpiComm& operator=(MpiComm&&) noexcept = default;

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  MPI_Comm native() const { return state_->comm; }
  const std::string& name() const { return state_->name; }
  std::chrono::milliseconds timeout() const { return state_->timeout; }
  bool checks_calls() const { return state_->check_calls; }
  // True after a collective on it failed or timed out, or MPI paired different collectives.
  bool broken() const { return !state_->broken_by().empty(); }

  // all_gather, reduce_scatter, all_reduce (plain and tagged: the tags are compared across
  // ranks at wait(), see the top of this file) and barrier come from
  // detail::CollectiveCalls, through issue() below; broadcast is MpiComm's own, so that a
  // bad root is refused naming the numbered call.
  // Only the root's `send` is read (it may equal `recv`, or be null on the other ranks).
  Work broadcast(const void* send, void* recv, std::size_t count, DType t, int root) {
    return issue({detail::CollectiveKind::broadcast, send, recv, count, t, ReduceOp::sum, root});
  }

  // MPI_Comm_split: collective over this communicator; ranks passing the same color form a
  // new one, ordered by (key, rank). Colors must be >= 0: every rank first learns every
  // rank's color (an all_gather bounded by the timeout), so a bad color fails on all ranks
  // alike instead of leaving the others waiting in MPI_Comm_split.
  MpiComm split(int color, int key) {
    std::array<std::int32_t, 2> mine{color, key};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size()));
    all_gather(mine.data(), all.data(), 2, DType::i32).wait();
    for (int r = 0; r < size(); ++r)
      if (all[2 * r] < 0)
        detail::fail(where(), ": MpiComm::split color must be >= 0, but rank ", r, r == rank() ? " (this rank)" : "",
                     " passed color ", all[2 * r]);
    const std::uint64_t id = state_->splits++;
    MPI_Comm comm = MPI_COMM_NULL;
    int rc;
    {
      auto lk = state_->rt->lock_for_call(where() + ": split");
      rc = MPI_Comm_split(state_->comm, color, key, &comm);  // every rank is known to be here
    }
    if (rc != MPI_SUCCESS)
      state_->fail_collective(where() + ": MPI_Comm_split(color " + std::to_string(color) + ", key " +
                                  std::to_string(key) + ") failed: " + detail::mpi_error_text(rc),
                              ErrorKind::misuse);
    auto name = state_->name + "/split#" + std::to_string(id) + "(color " + std::to_string(color) + ")";
    return MpiComm(
        std::make_shared<detail::MpiCommState>(state_->rt, comm, std::move(name), state_->timeout, state_->check_calls));
  }

 private:
  friend class detail::CollectiveCalls<MpiComm>;
  explicit MpiComm(std::shared_ptr<detail::MpiCommState> state) : state_(std::move(state)) {}

  Work issue(detail::CollectiveCall call) {
    call = next(call);
    switch (call.kind) {
      case detail::CollectiveKind::all_gather: return gather(call);
      case detail::CollectiveKind::reduce_scatter: return scatter(call);
      case detail::CollectiveKind::all_reduce: return reduce(call);
      case detail::CollectiveKind::broadcast: return bcast(call);
      case detail::CollectiveKind::ring_shift: return shift(call);
      case detail::CollectiveKind::barrier: break;
    }
    return start(call, "MPI_Ibarrier", [&](MPI_Request* req) { return MPI_Ibarrier(state_->comm, req); });
  }

  Work gather(const detail::CollectiveCall& call) {
    const void* send = call.send;
    void* recv = call.recv;
    const std::size_t chunk = call.count * size_of(call.dtype);
    const bool in_place = address(send) == address(recv) + rank() * chunk;
    check(call, send, chunk, recv, chunk * size(), in_place, "send == recv + rank*count");
    const int n = static_cast<int>(call.count);
    const MPI_Datatype type = types().datatype(call.dtype);
    return start(call, "MPI_Iallgather", [&](MPI_Request* req) {
      return MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, type, recv, n, type, state_->comm, req);
    });
  }

  Work scatter(const detail::CollectiveCall& call) {
    const void* send = call.send;
    void* recv = call.recv;
    const std::size_t chunk = call.count * size_of(call.dtype);
    const bool in_place = address(recv) == address(send) + rank() * chunk;
    check(call, send, chunk * size(), recv, chunk, in_place, "recv == send + rank*count");
    // In place, MPI reads the whole buffer and leaves the result in its first chunk.
    auto* buffer = static_cast<std::byte*>(const_cast<void*>(send));
    auto epilogue = average(call);
    if (in_place && chunk && rank() > 0) {
      epilogue.move_from = buffer;
      epilogue.move_to = static_cast<std::byte*>(recv);
      epilogue.move_bytes = chunk;
    }
    const int n = static_cast<int>(call.count);
    const MPI_Datatype type = types().datatype(call.dtype);
    const MPI_Op mpi_op = reduction(call);
    return start(
        call, "MPI_Ireduce_scatter_block",
        [&](MPI_Request* req) {
          return in_place ? MPI_Ireduce_scatter_block(MPI_IN_PLACE, buffer, n, type, mpi_op, state_->comm, req)
                          : MPI_Ireduce_scatter_block(send, recv, n, type, mpi_op, state_->comm, req);
        },
        epilogue);
  }

  Work reduce(const detail::CollectiveCall& call) {
    const std::size_t bytes = call.count * size_of(call.dtype);
    const bool in_place = call.send == call.recv;
    check(call, call.send, bytes, call.recv, bytes, in_place, "send == recv");
    const int n = static_cast<int>(call.count);
    const MPI_Datatype type = types().datatype(call.dtype);
    const MPI_Op mpi_op = reduction(call);
    return start(
        call, "MPI_Iallreduce",
        [&](MPI_Request* req) {
          return MPI_Iallreduce(in_place ? MPI_IN_PLACE : call.send, call.recv, n, type, mpi_op, state_->comm, req);
        },
        average(call));
  }

  Work bcast(const detail::CollectiveCall& call) {
    const int root = call.root;
    if (root < 0 || root >= size())
      detail::fail(where(), ": ", call.describe(), ": root ", root, " is outside [0, ", size(), ")");
    const std::size_t bytes = call.count * size_of(call.dtype);
    const bool is_root = rank() == root;
    check(call, is_root ? call.send : call.recv, bytes, call.recv, bytes, true, "");
    if (is_root && call.send != call.recv && bytes) std::memmove(call.recv, call.send, bytes);
    const int n = static_cast<int>(call.count);
    const MPI_Datatype type = types().datatype(call.dtype);
    return start(call, "MPI_Ibcast",
                 [&](MPI_Request* req) { return MPI_Ibcast(call.recv, n, type, root, state_->comm, req); });
  }

  // ring_shift as one nonblocking collective, so that it is ordered, compared and waited
  // for as the others are: an MPI_Ialltoallv whose only counts are `count` to rank + 1 and
  // from rank - 1. MPI reads the count arrays until it completes, so its Work keeps them.
  // On one rank the copy is made here (send may then be recv) and MPI moves nothing.
  Work shift(const detail::CollectiveCall& call) {
    const int n = size();
    const std::size_t bytes = call.count * size_of(call.dtype);
    check(call, call.send, bytes, call.recv, bytes, n == 1, "one rank");
    if (n == 1 && bytes && call.send != call.recv) std::memmove(call.recv, call.send, bytes);
    const auto un = static_cast<std::size_t>(n);
    // Send counts, send displacements, receive counts, receive displacements: zeros but two.
    auto args = std::make_unique<int[]>(4 * un);
    int* const counts = args.get();
    if (n > 1) {
      counts[static_cast<std::size_t>((rank() + 1) % n)] = static_cast<int>(call.count);
      counts[2 * un + static_cast<std::size_t>((rank() + n - 1) % n)] = static_cast<int>(call.count);
    }
    const MPI_Datatype type = types().datatype(call.dtype);
    return start(
        call, "MPI_Ialltoallv",
        [&](MPI_Request* req) {
          return MPI_Ialltoallv(call.send, counts, counts + un, type, call.recv, counts + 2 * un, counts + 3 * un, type,
                                state_->comm, req);
        },
        {}, std::move(args));
  }

  // Ranks that disagree on MpiCommOptions::check_calls would pair one rank's descriptor
  // exchange with another's collective: every rank learns every rank's setting first.
  static void agree_on_checks(detail::MpiCommState& s) {
    const std::int32_t mine = s.check_calls;
    std::vector<std::int32_t> all(static_cast<std::size_t>(s.size));
    MPI_Request req = MPI_REQUEST_NULL;
    int rc;
    {
      auto lk = s.rt->lock_for_call(s.where() + ": agreeing on MpiCommOptions::check_calls");
      rc = MPI_Iallgather(&mine, 1, MPI_INT32_T, all.data(), 1, MPI_INT32_T, s.comm, &req);
    }
    if (rc == MPI_SUCCESS) rc = detail::mpi_test_until(*s.rt, req, std::chrono::steady_clock::now() + s.timeout);
    if (rc != MPI_SUCCESS)
      s.fail_collective(s.where() + ": agreeing on MpiCommOptions::check_calls " +
                            (rc == detail::kMpiTimedOut ? "timed out" : "failed: " + detail::mpi_error_text(rc)),
                        rc == detail::kMpiTimedOut ? ErrorKind::timeout : ErrorKind::misuse);
    for (int r = 0; r < s.size; ++r)
      if (all[static_cast<std::size_t>(r)] != mine)
        detail::fail_as(ErrorKind::mismatch, s.where(),
                        ": MpiCommOptions::check_calls must be the same on every rank, but rank ", r, " has ",
                        all[static_cast<std::size_t>(r)] ? "true" : "false", " and this rank ",
                        mine ? "true" : "false");
  }

  static std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  const detail::MpiTypes& types() const { return state_->rt->types; }
  std::string where() const { return state_->where(); }

  // Numbers the call; refuses it on a broken communicator.
  detail::CollectiveCall next(detail::CollectiveCall call) {
    call.seq = state_->seq++;
    const auto broken_by = state_->broken_by();
    if (!broken_by.empty())
      detail::fail_echo_if(state_->broken_by_echo_of(), state_->broken_by_kind(), where(), ": ", call.describe(),
                           " not started: the communicator broke earlier: ", broken_by);
    return call;
  }

  // Checks made before MPI sees the call (MPI itself would crash or corrupt memory).
  void check(const detail::CollectiveCall& call, const void* send, std::size_t send_bytes, const void* recv,
             std::size_t recv_bytes, bool in_place, const char* in_place_form) const {
    if (call.count > static_cast<std::size_t>(INT_MAX))
      detail::fail(where(), ": ", call.describe(), ": count exceeds INT_MAX (", INT_MAX,
                   ") elements, the most an MPI 3.1 collective takes (OpenMPI 4.1 has no large-count "
                   "MPI_*_c calls); split the buffer");
    if (send_bytes && !send) detail::fail(where(), ": ", call.describe(), ": send buffer is null");
    if (recv_bytes && !recv) detail::fail(where(), ": ", call.describe(), ": receive buffer is null");
    const bool overlap = send_bytes && recv_bytes && address(send) < address(recv) + recv_bytes &&
                         address(recv) < address(send) + send_bytes;
    if (overlap && !in_place)
      detail::fail(where(), ": ", call.describe(), ": send and receive buffers overlap without being the in-place form (",
                   in_place_form, "); MPI forbids aliased buffers");
  }

  // The MPI_Op that computes the call's op (avg: the sum, divided by the epilogue).
  MPI_Op reduction(const detail::CollectiveCall& call) const {
    return types().op(call.dtype, call.op == ReduceOp::avg ? ReduceOp::sum : call.op);
  }

  detail::MpiEpilogue average(const detail::CollectiveCall& call) const {
    detail::MpiEpilogue e;
    if (call.op == ReduceOp::avg) {
      e.average = call.recv;
      e.count = call.count;
      e.dtype = call.dtype;
      e.group_size = size();
    }
    return e;
  }

  // Issues the MPI call under the MPI lock, behind its call descriptor's exchange when the
  // calls are compared; its Work polls both.
  // `mpi_args`: arrays the MPI call reads until it completes (kept by the Work).
  template <class Issue>
  Work start(const detail::CollectiveCall& call, const char* mpi_function, Issue&& issue,
             detail::MpiEpilogue epilogue = {}, std::unique_ptr<int[]> mpi_args = nullptr) {
    MPI_Request req = MPI_REQUEST_NULL;
    std::optional<detail::MpiCallCheck> check;
    if (size() > 1 && (state_->check_calls || call.tag)) check.emplace(call, size());
    int rc = MPI_SUCCESS;
    {
      auto lk = state_->rt->lock_for_call([&] { return where() + ": " + call.describe(); });
      if (check) rc = check->start(state_->comm, state_->descriptor_exchanges++);  // first, on every rank alike
      if (rc == MPI_SUCCESS)
        rc = issue(&req);
      else
        mpi_function = "MPI_Iallgather (the call descriptors)";
    }
    if (rc != MPI_SUCCESS)
      state_->fail_collective(
          where() + ": " + call.describe() + " failed in " + mpi_function + ": " + detail::mpi_error_text(rc),
          ErrorKind::misuse);
    return Work(std::make_unique<detail::MpiPending>(state_, req, call, epilogue, std::move(check), std::move(mpi_args)));
  }

  std::shared_ptr<detail::MpiCommState> state_;
};

static_assert(Communicator<MpiComm>);
static_assert(SplittableCommunicator<MpiComm>);
static_assert(RingShiftCommunicator<MpiComm>);

}  // namespace fsdp
