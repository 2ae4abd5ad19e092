#pragma once
// fsdp::TcpProcessGroup: one rank of a multi-process job, set up from the launch
// environment in one call (what torch.distributed.init_process_group does with env://):
//
//   auto group = fsdp::TcpProcessGroup::from_env();   // RANK, WORLD_SIZE, MASTER_ADDR, ...
//   train(group.comm());                              // an fsdp::TcpComm
//
// Rank 0 hosts the rendezvous store, unless FSDP_STORE_HOST (or FSDP_STORE_EXTERNAL=1)
// says it runs elsewhere (fsdp_run hosts it by default, or a tools/fsdp_store); every rank
// connects to it, then the ring. Environment knobs beyond torchrun's:
//   FSDP_TIMEOUT_MS   longest wait in the store and in one collective (default 300000)
//   FSDP_COMM_ADDR    the IP this rank listens on for its ring neighbours; default: the
//                     local address of its connection to the store, i.e. the interface
//                     that reaches MASTER_ADDR (127.0.0.1 on one host)
// A rank lost and replaced (fsdp_run --restart-scope rank): the survivors catch the failure
// (an fsdp::Error of kind peer_lost), drop what they built on the communicator and call
// rejoin(), which waits for the launcher to announce the replacement (the store's
// fsdp/job/epoch grows) and connects a new ring under that epoch's prefix; the replacement
// starts in it (FSDP_COMM_EPOCH). A rank that fails while that ring forms never joins it:
// the others leave it when the next epoch is announced and join that one (join_ring).
// Then every rank rebuilds its model and restores it
// (fsdp::PeerCheckpoint::restore). docs/failures.md#in-memory-recovery.
// Teardown is ordered so no rank loses the store while it still needs it: the ranks meet
// in a barrier, close their rings, give their claims back and count themselves out in the
// store, and rank 0 stops the server last. The teardown barrier is the job's last collective, and it fails when
// the ranks ran different collectives (one skipped an all_reduce, say): that rank saw no
// error before, so its exit status must come from here. finish() tears down and throws
// the barrier's failure as an fsdp::Error, always: call it at the end of a run. Without
// it, the destructor does the same teardown and throws (it is noexcept(false)) only when
// the barrier is the first failure this communicator saw and no exception is already
// leaving the scope. When an earlier collective failed, that error was thrown where it
// happened and is the cause (the usual `catch (const fsdp::Error& e) { print; return 1; }`
// then exits 1); an exception leaving the scope is the cause too: the destructor swallows
// the barrier's failure in both cases. While an exception is leaving the scope the
// barrier is not run at all: the rank closes its links, so peers still inside a collective
// fail with an echo of its going ("peer rank R closed the connection"), not with a
// mismatch against a barrier it never meant to run. Held where a destructor cannot throw (a
// std::optional or std::unique_ptr), a failure the destructor would throw ends the process
// through std::terminate, its message printed; call finish() there instead.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "fsdp/asio/tcp_comm.hpp"
#include "fsdp/asio/tcp_store.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/dist_env.hpp"
#include "fsdp/core/parse.hpp"

namespace fsdp {

class TcpProcessGroup {
 public:
  // Reads the environment (fsdp::DistEnv plus the knobs above); `comm_options`' timeout
  // and address are taken from FSDP_TIMEOUT_MS / FSDP_COMM_ADDR when those are set.
  static TcpProcessGroup from_env(TcpCommOptions comm_options = {}) {
    return TcpProcessGroup(DistEnv::from_env(), std::move(comm_options));
  }

  TcpProcessGroup(const DistEnv& env, TcpCommOptions comm_options)
      : env_(env), unwinding_at_start_(std::uncaught_exceptions()) {
    if (auto ms = timeout_from_env()) comm_options.timeout = *ms;
    TcpStoreOptions store_options;
    store_options.timeout = comm_options.timeout;
    store_options.connect_timeout = comm_options.timeout;
    connection_ = connect_store(env_, store_options);
    if (const char* addr = std::getenv("FSDP_COMM_ADDR"); addr && *addr) comm_options.address = addr;
    else if (comm_options.address.empty()) comm_options.address = connection_.store->local_address();
    comm_options_ = comm_options;
    join_ring(env_.comm_epoch);
  }

  // Not movable: from_env() returns it by guaranteed copy elision.
  TcpProcessGroup(TcpProcessGroup&&) = delete;
  TcpProcessGroup& operator=(TcpProcessGroup&&) = delete;

  // Tears down in order (see the top) and throws the teardown barrier's failure, if any
  // (even when an earlier collective failed): the ranks did not end in agreement. Later
  // calls, and the destructor, do nothing.
  void finish() {
    if (auto failure = tear_down().failure) std::rethrow_exception(failure);
  }

  // Throws only a failure nobody has reported yet (see the top).
  ~TcpProcessGroup() noexcept(false) {
    auto [failure, failed_before] = tear_down();
    if (failure && !failed_before && std::uncaught_exceptions() <= unwinding_at_start_)
      std::rethrow_exception(failure);
  }

  // After a peer was lost: closes this rank's ring (no teardown barrier: a peer is gone),
  // waits until the launcher has started a replacement (fsdp/job/epoch in the store beyond
  // this rank's epoch, at most the communicator's timeout) and connects the ring of that
  // epoch with it and the other survivors. comm() is then the new communicator; anything
  // built on the old one (streams, meshes, the sharded model) must be built again. Throws
  // fsdp::Error (peer_lost) when no replacement is announced in time: a job that is not
  // restarting ranks (fsdp_run --restart-scope rank) never announces one. When another
  // rank fails while that ring forms, it joins the next epoch's instead (see join_ring);
  // returns how many rings it left so: failures it survived beyond the one it was called for.
  // A rank whose neighbours both joined may finish joining a ring that others leave: its
  // first collective then fails with peer_lost, so keep calling rejoin() on that error.
  int rejoin() {
    if (!comm_) detail::fail("TcpProcessGroup::rejoin on rank ", env_.rank, ": the group was torn down (finish() ran)");
    comm_.reset();  // closes the links: peers still in a collective fail at once
    const auto deadline = std::chrono::steady_clock::now() + comm_options_.timeout;
    std::int64_t announced = 0;
    for (;;) {
      announced = announced_epoch(*connection_.store);
      if (announced > epoch_) break;
      if (std::chrono::steady_clock::now() >= deadline)
        detail::fail_as(ErrorKind::peer_lost, "TcpProcessGroup::rejoin on rank ", env_.rank, ": no replacement rank was announced within ",
                        comm_options_.timeout.count(), " ms (the store's ", kEpochKey, " stayed at ", announced,
                        "); only fsdp_run --restart-scope rank starts one");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return join_ring(static_cast<int>(announced));
  }
  // Which rebuild of the communicator comm() is: 0 at the start, the launcher's count after
  // a rejoin() or in a replacement.
  int epoch() const { return epoch_; }

  TcpComm& comm() { return *comm_; }
  Store& store() { return *connection_.store; }
  const DistEnv& env() const { return env_; }

 private:
  static constexpr const char* done_key = "fsdp/process_group/done";
  // The launcher's count of replacements (kEpochKey), 0 before the first: read without
  // writing, so a job that replaces nothing keeps no such key.
  static std::int64_t announced_epoch(Store& store) {
    const auto text = store.try_get(kEpochKey);
    return text ? detail::parse_integer<std::int64_t>(*text, kEpochKey, 0, 1 << 20) : 0;
  }
  // Connects the ring of `epoch`, or of a later one: a rank that fails while the ring
  // forms never joins it, and the launcher announces the epoch of its replacement (the
  // store's kEpochKey grows). The ranks waiting in the superseded ring leave it
  // (TcpCommOptions::abandon_join) and join the newest. Bounded: each pass needs a new
  // epoch, which only a replacement the launcher starts brings, and each waits at most the
  // communicator's timeout.
  // Returns how many rings it left.
  int join_ring(int epoch) {
    for (int left = 0;; ++left) {
      epoch_ = epoch;
      TcpCommOptions options = comm_options_;
      options.prefix = prefix_of(options.prefix, epoch);
      if (!options.abandon_join)
        options.abandon_join = [epoch](Store& store) -> std::optional<std::string> {
          const std::int64_t announced = announced_epoch(store);
          if (announced <= epoch) return std::nullopt;
          return "the launcher announced epoch " + std::to_string(announced) + " (a rank failed while epoch " +
                 std::to_string(epoch) + "'s ring formed, and was replaced)";
        };
      try {
        comm_.emplace(connection_.store, env_.rank, env_.world_size, std::move(options));
        return left;
      } catch (const Error& e) {
        // A join that timed out as the next epoch came is superseded all the same.
        if ((e.kind() != ErrorKind::peer_lost && e.kind() != ErrorKind::timeout) || comm_options_.abandon_join) throw;
        std::int64_t announced = 0;
        try {
          announced = announced_epoch(*connection_.store);
        } catch (const Error&) {  // the store is gone too: the join's own error says more
        }
        if (announced <= epoch) throw;
        epoch = static_cast<int>(announced);
      }
    }
  }
  // Each epoch (kEpochKey) has its ring under a prefix of its own, so no key of an earlier ring is read.
  static std::string prefix_of(const std::string& prefix, int epoch) {
    return epoch == 0 ? prefix : prefix + "/e" + std::to_string(epoch);
  }

  struct Teardown {
    std::exception_ptr failure;  // the teardown barrier's, or null
    bool failed_before = false;  // a collective had failed before the barrier
  };
  Teardown tear_down() noexcept {
    if (!comm_) return {};
    const auto timeout = comm_->options().timeout;
    const bool failed_before = comm_->failed();
    // Left by an exception of this rank's own: its peers may still be inside a collective,
    // which a teardown barrier would pair with (a "collective mismatch" on a peer, blaming
    // it). Closing the links instead tells them this rank is gone, and their errors echo
    // its failure (fsdp::exit_status), so a launcher reports this rank first.
    if (std::uncaught_exceptions() > unwinding_at_start_) {
      comm_.reset();
      return {nullptr, failed_before};
    }
    std::exception_ptr failure;
    try {
      comm_->barrier().wait();  // nobody tears down while a peer still talks to it
    } catch (const Error& e) {
      try {
        std::string_view cause = e.what();
        if (cause.substr(0, 6) == "fsdp: ") cause.remove_prefix(6);
        if (const auto* echo = dynamic_cast<const detail::EchoedError*>(&e))  // a peer's failure, still not this rank's
          detail::fail_echo(e.kind(), echo->failed_rank(), "TcpProcessGroup teardown on rank ", env_.rank,
                            ": the ranks did not end together (its final barrier failed): ", cause);
        detail::fail_as(e.kind(), "TcpProcessGroup teardown on rank ", env_.rank,
                        ": the ranks did not end together (its final barrier failed): ", cause);
      } catch (...) {
        failure = std::current_exception();
      }
    } catch (...) {
      failure = std::current_exception();
    }
    comm_.reset();
    if (failure) return {failure, failed_before};  // some rank may be dead: do not wait for it
    try {
      connection_.release_place(env_.rank);
      connection_.store->add(done_key, 1);
      if (connection_.server) {  // keep serving until every rank has counted itself out
        const auto deadline = std::chrono::steady_clock::now() + std::min(timeout, std::chrono::milliseconds(10000));
        while (connection_.store->add(done_key, 0) < env_.world_size && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (...) {
    }
    return {};
  }

  static std::optional<std::chrono::milliseconds> timeout_from_env() {
    const auto ms = DistEnv::number("FSDP_TIMEOUT_MS", 1, 24LL * 3600 * 1000, false);
    if (!ms) return std::nullopt;
    return std::chrono::milliseconds(*ms);
  }

  DistEnv env_;
  int unwinding_at_start_ = 0;  // std::uncaught_exceptions() when constructed
  StoreConnection connection_;
  TcpCommOptions comm_options_;  // as the environment left them, the prefix without its epoch
  int epoch_ = 0;
  std::optional<TcpComm> comm_;
};

}  // namespace fsdp
