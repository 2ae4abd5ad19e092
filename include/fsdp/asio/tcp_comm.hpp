#pragma once
// fsdp::TcpComm: the Communicator for CPU processes on one or many hosts, over TCP with
// Boost.Asio, bootstrapped from an fsdp::Store (TcpStore across processes, HashStore for
// ranks that are threads).
//
//   auto store = std::make_shared<fsdp::TcpStore>(...);        // or fsdp::HashStore
//   fsdp::TcpComm comm(store, rank, world_size);               // blocks until the ring is up
//   fsdp::Work w = comm.all_gather(shard, full, n, fsdp::DType::f32);   // returns at once
//   w.wait();                                                  // fsdp::Error on failure
//
// Collectives are rings (fsdp/asio/ring.hpp): every byte crosses every link once, as in
// Gloo's and NCCL's rings, cut into segments that pipeline along the ring. Reductions run
// in a fixed order (the partial for chunk c starts at rank c+1), so results are bitwise
// the same from run to run. On 2 ranks they equal ThreadComm's (rank order), as a + b ==
// b + a; max and min can differ only in which NaN or which signed zero of a tie they keep.
//
// Asynchronous: each TcpComm has its own I/O thread that runs its collectives in the order
// they were issued (and, with io_threads = 2, a second one that sends). As with NCCL,
// buffers must stay valid and untouched (send unwritten, recv unread) until the Work
// completes, and every rank issues the same collectives in the same order. Calls may come
// from any thread.
//
// Ring neighbours on the same host move their bulk bytes through shared memory instead of
// the socket (shm_link.hpp, shm_handshake.hpp); the TCP connection still carries every
// header, ABORT and the liveness of the peer, so nothing below changes, results included
// (the same plan, the same reduction order, bit for bit). Off with shared_memory = false
// or the environment variable FSDP_TCP_SHM=0 (or false, no, off; a value that is not a
// boolean is refused).
//
// Failures are fsdp::Errors on every rank, never hangs: a collective mismatch names every
// rank's call (the ranks that find it ask the others through the store, waiting at most
// 2 s; every request bounded, even when the store stopped answering); a peer that exits
// or closes its communicator is named by its neighbours and the reason travels the ring
// to the others (ABORT frames); a collective without progress for `timeout` fails naming
// the rank that is behind; a rank that never joins fails construction. After a failure
// the communicator is broken: later collectives fail.
//
// Store keys (under `prefix`): addr/<rank> while joining; ask, last/<rank> and mismatch
// after a timeout or a mismatch. A prefix names one communicator at a time on a store;
// each rank removes its address when its communicator is destroyed (unless the store
// failed to answer), after which the prefix may be used again; an address left behind
// is read again while joining until its rank replaces it. The reports stay (a peer may
// still be reading them) until the next communicator of the prefix is made, which
// removes them before it joins.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/asio/tcp_comm_core.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"
#include "fsdp/core/store.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

struct TcpCommOptions {
  // Longest time without progress in construction or in one collective.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // IP to listen on and advertise to the other ranks; empty: 127.0.0.1. Across hosts, the
  // address of the interface that reaches them (e.g. the store connection's local one).
  std::string address;
  // Store keys of this communicator live under it; split() appends /split<n>/<color>.
  std::string prefix = "fsdp/comm";
  // Ring steps move in frames of at most this many bytes (a multiple of 8, same on every
  // rank): large enough to amortise a frame's header and wake-up, small enough that a
  // reduction overlaps the next frame's transfer.
  std::size_t segment_bytes = 1 << 20;
  // SO_SNDBUF / SO_RCVBUF of the ring sockets; 0 leaves Linux's autotuning (which grows
  // to net.ipv4.tcp_wmem / tcp_rmem) in charge.
  int socket_buffer_bytes = 0;
  // Threads moving this communicator's bytes: 1, the I/O thread sends and receives; 2,
  // sending has a thread of its own, so both directions copy through the kernel on two
  // cores at once (large messages, hosts with cores to spare) at the price of a
  // cross-thread wake-up per ring step (small messages); 0, 2 where the host has at least
  // 4 hardware threads, else 1.
  int io_threads = 0;
  // Ring links to a neighbour on the same host carry payloads through a POSIX shared
  // memory segment (proven shared during the handshake, unlinked right after it), the
  // TCP connection only headers. FSDP_TCP_SHM=0 in the environment turns it off too.
  // Either side saying no keeps that link on TCP.
  bool shared_memory = true;
  // Payload bytes in flight on one shared-memory link (rounded to whole segments, at
  // least 2, at most 1024 of them): how far a sender may run ahead of its neighbour.
  std::size_t shared_memory_bytes = std::size_t{8} << 20;
  // Called every 100 ms while this rank waits for its ring neighbours (construction and
  // split()), on the joining thread, with the store the join reads (each request bounded,
  // 2 s): a reason it returns ends the join with fsdp::ErrorKind::peer_lost and that
  // reason, instead of waiting out `timeout` for a rank that will not come. A call that
  // throws, or a store that does not answer, gives no reason that time. TcpProcessGroup
  // leaves a ring whose epoch was superseded (another rank failed while it formed).
  // Empty: never.
  std::function<std::optional<std::string>(Store&)> abandon_join;
};

// Which of this rank's ring links carry payloads through shared memory.
struct TcpCommLinks {
  bool from_left = false;  // from rank - 1
  bool to_right = false;   // to rank + 1
};

class TcpComm : public detail::CollectiveCalls<TcpComm> {
 public:
  static constexpr bool checks_tags = true;  // in each frame's header, against the receiver's call
  static constexpr bool shifts_ring = true;  // ring_shift(): one ring step (fsdp/asio/ring.hpp)
  using Options = TcpCommOptions;

  // Collective over `size` ranks sharing `store`: blocks until this rank is connected to
  // both ring neighbours, at most options.timeout.
  TcpComm(std::shared_ptr<Store> store, int rank, int size, Options options = {}) {
    if (!store) detail::fail("TcpComm on rank ", rank, ": the store is null");
    if (size < 1 || rank < 0 || rank >= size) detail::fail("TcpComm: rank ", rank, " is outside a world of size ", size);
    detail::check_timeout(options.timeout, "TcpComm on rank ", rank, ": timeout");
    if (options.segment_bytes < 8 || options.segment_bytes % 8 || options.segment_bytes > (std::size_t{1} << 30))
      detail::fail("TcpComm on rank ", rank, ": segment_bytes must be a multiple of 8 in [8, 1 GiB], got ",
                   options.segment_bytes);
    if (options.prefix.empty() || options.prefix.size() > detail::Hello::kMaxPrefix)
      detail::fail("TcpComm on rank ", rank, ": prefix must have 1 to ", detail::Hello::kMaxPrefix, " characters");
    if (options.socket_buffer_bytes < 0)
      detail::fail("TcpComm on rank ", rank, ": socket_buffer_bytes must be >= 0, got ", options.socket_buffer_bytes);
    if (options.io_threads < 0 || options.io_threads > 2)
      detail::fail("TcpComm on rank ", rank, ": io_threads must be 0 (automatic), 1 or 2, got ", options.io_threads);
    const int io_threads = options.io_threads ? options.io_threads : std::thread::hardware_concurrency() >= 4 ? 2 : 1;
    if (options.address.empty()) options.address = "127.0.0.1";
    options_ = options;
    // FSDP_TCP_SHM: 0/false/no/off turns shared memory off; anything but a boolean is refused.
    const bool shm = options.shared_memory && detail::env_bool("FSDP_TCP_SHM").value_or(true);
    core_ = std::make_unique<detail::TcpCommCore>(
        std::move(store), detail::RingIdentity{options.prefix, rank, size, options.address, options.segment_bytes,
                                               options.socket_buffer_bytes, io_threads == 2, shm,
                                               options.shared_memory_bytes, options.timeout, options.abandon_join});
  }

  TcpComm(TcpComm&&) noexcept = default;
  TcpComm& operator=(TcpComm&&) noexcept = default;
  ~TcpComm() = default;  // runs what is queued, then closes the links

  int rank() const { return core().identity().rank; }
  int size() const { return core().identity().size; }
  const Options& options() const { return options_; }
  TcpCommLinks links() const { return {core().shm_from_left(), core().shm_to_right()}; }
  // Whether a collective of this communicator has already failed (and so has reported
  // the failure to whoever waited on it): the communicator is then broken.
  bool failed() const { return core_ && core_->failed(); }

  // MPI_Comm_split: collective over this communicator; ranks passing the same color form
  // a new one, ordered by (key, rank), with prefix <prefix>/split<n>/<color>. The new
  // communicator is independent (its own thread and sockets).
  TcpComm split(int color, int key) {
    if (color < 0) detail::fail("rank ", rank(), ": TcpComm::split color must be >= 0, got ", color);
    const std::array<std::int32_t, 2> mine{color, key};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size()));
    all_gather(mine.data(), all.data(), 2, DType::i32).wait();
    const std::vector<int> members = detail::split_members(all, color);
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    Options o = options_;
    o.prefix = options_.prefix + "/split" + std::to_string(splits_++) + "/" + std::to_string(color);
    return TcpComm(core().store(), new_rank, static_cast<int>(members.size()), o);
  }

 private:
  friend class detail::CollectiveCalls<TcpComm>;
  const detail::TcpCommCore& core() const {
    if (!core_) detail::fail("TcpComm used after it was moved from");
    return *core_;
  }
  Work issue(detail::CollectiveCall call) {
    core();
    return core_->submit(call);
  }

  Options options_;
  std::unique_ptr<detail::TcpCommCore> core_;
  std::uint64_t splits_ = 0;  // split() calls so far: the same on every member
};

static_assert(Communicator<TcpComm>);
static_assert(SplittableCommunicator<TcpComm>);
static_assert(RingShiftCommunicator<TcpComm>);

}  // namespace fsdp
