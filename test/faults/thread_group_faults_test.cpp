// Fault injection into ThreadGroup's collectives: a rank that fails while its peers copy
// large buffers out of its memory must not let its caller free them while they are read.
//
// Ranks read each other's buffers directly, so every send buffer here is its own mmap,
// unmapped the moment the collective returns or throws: a peer still reading it faults
// (SIGSEGV) in any build, and ASan names the read. Failures are injected through
// ThreadGroupOptions::fault_hook at every stage of a collective (right after posting,
// between chunks, after reading), with the peers held at chosen points of their reading;
// each case checks that every rank ends with an fsdp::Error that names the failure and
// that run() returns.
#include <doctest/doctest.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/host/thread_group.hpp"
#include "test/support/errors.hpp"

namespace faults_thread_group_faults_test {

namespace {

using fsdp::CollectivePoint;
using fsdp::CollectiveStage;
using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::ThreadComm;
using fsdp::ThreadGroup;
using fsdp::ThreadGroupOptions;
using test_support::contains;
using namespace std::chrono_literals;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Host memory of its own mapping: reading it after the owner is done faults.
class Mapped {
 public:
  explicit Mapped(std::size_t bytes) : bytes_(bytes) {
    p_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p_ == MAP_FAILED) throw std::bad_alloc();
  }
  ~Mapped() { ::munmap(p_, bytes_); }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
  float* f32() const { return static_cast<float*>(p_); }

 private:
  std::size_t bytes_;
  void* p_;
};

// A one-shot signal between ranks, waited on with a bound (a test that waits forever is
// a failure of its own).
class Signal {
 public:
  void raise() {
    std::lock_guard lk(mu_);
    up_ = true;
    cv_.notify_all();
  }
  bool wait(std::chrono::milliseconds bound = 5000ms) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, bound, [&] { return up_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool up_ = false;
};

enum class Kind { all_gather, all_reduce_in_place, reduce_scatter, broadcast };
constexpr Kind kKinds[] = {Kind::all_gather, Kind::all_reduce_in_place, Kind::reduce_scatter, Kind::broadcast};
const char* name_of(Kind k) {
  switch (k) {
    case Kind::all_gather: return "all_gather";
    case Kind::all_reduce_in_place: return "all_reduce";
    case Kind::reduce_scatter: return "reduce_scatter";
    case Kind::broadcast: return "broadcast";
  }
  return "?";
}

// One large collective of `kind` on every rank, `count` f32 elements per rank's chunk,
// the send buffer its own mapping (the broadcast's root is `root`). Returns whether it
// completed.
bool large_collective(ThreadComm& c, Kind kind, std::size_t count, int root) {
  const std::size_t n = static_cast<std::size_t>(c.size());
  const std::size_t send_count = kind == Kind::all_gather || kind == Kind::broadcast ? count : n * count;
  Mapped send(send_count * sizeof(float));
  for (std::size_t i = 0; i < send_count; i += 1024) send.f32()[i] = static_cast<float>(c.rank() + 1);
  switch (kind) {
    case Kind::all_gather: {
      Mapped recv(n * count * sizeof(float));
      c.all_gather(send.f32(), recv.f32(), count, DType::f32).wait();
      return true;
    }
    case Kind::all_reduce_in_place:
      c.all_reduce(send.f32(), send.f32(), send_count, DType::f32, ReduceOp::sum).wait();
      return true;
    case Kind::reduce_scatter: {
      Mapped recv(count * sizeof(float));
      c.reduce_scatter(send.f32(), recv.f32(), count, DType::f32, ReduceOp::sum).wait();
      return true;
    }
    case Kind::broadcast: {
      Mapped recv(count * sizeof(float));
      c.broadcast(send.f32(), recv.f32(), count, DType::f32, root).wait();
      return true;
    }
  }
  return false;
}

struct Outcome {
  std::vector<std::string> errors;  // each rank's fsdp::Error ("" if none)
  std::vector<int> completed;       // ranks whose collective returned normally
  std::string escaped;              // what run() threw, if anything
};

// Runs body on n ranks, each catching its fsdp::Error.
Outcome run_ranks(int n, ThreadGroupOptions options, const std::function<void(ThreadComm&)>& body) {
  Outcome out{std::vector<std::string>(n), std::vector<int>(n, 0), ""};
  try {
    ThreadGroup(n, std::move(options)).run([&](ThreadComm& c) {
      try {
        body(c);
        out.completed[c.rank()] = 1;
      } catch (const fsdp::Error& e) {
        out.errors[c.rank()] = e.what();
      }
    });
  } catch (const std::exception& e) {
    out.escaped = e.what();
  }
  return out;
}

// The bytes rank r reads in one of these collectives before it is done.
std::size_t bytes_to_read(Kind kind, int n, std::size_t count) {
  return (kind == Kind::broadcast ? 1 : n) * count * sizeof(float);
}

void check_everyone_failed(const Outcome& out, int failing, const std::string& origin) {
  CHECK(out.escaped.empty());
  for (std::size_t r = 0; r < out.errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(out.errors[r]);
    CHECK(out.completed[r] == 0);
    CHECK(contains(out.errors[r], origin));
    if (static_cast<int>(r) != failing) CHECK(contains(out.errors[r], "rank " + std::to_string(failing) + " failed in"));
  }
}

}  // namespace

TEST_CASE("a rank that throws right after posting waits until its peers stop reading its buffers") {
  const int n = 3;
  const std::size_t count = 4 * kMiB / sizeof(float);  // 4 MiB per rank: 4 chunks per peer buffer
  for (Kind kind : kKinds) {
    for (int failing : {0, n - 1}) {
      for (std::size_t progress_mib : {0, 2, 5}) {  // how far the watched peer has read when it fails
        const int root = failing;  // broadcast: everyone reads the failing rank's buffer
        const int watched = (failing + 1) % n;
        if (progress_mib * kMiB >= bytes_to_read(kind, n, count)) continue;
        CAPTURE(name_of(kind));
        CAPTURE(failing);
        CAPTURE(progress_mib);
        Signal peer_reading;
        ThreadGroupOptions options{5000ms};
        options.fault_hook = [&](const CollectivePoint& p) {
          if (p.rank == watched && p.stage == CollectiveStage::reading && p.bytes_read >= progress_mib * kMiB)
            peer_reading.raise();
          if (p.rank == failing && p.stage == CollectiveStage::posted) {
            peer_reading.wait();
            throw fsdp::Error("injected after posting on rank " + std::to_string(failing));
          }
        };
        const Outcome out = run_ranks(n, std::move(options), [&](ThreadComm& c) { large_collective(c, kind, count, root); });
        check_everyone_failed(out, failing, "injected after posting on rank " + std::to_string(failing));
      }
    }
  }
}

TEST_CASE("a rank that fails between chunks or after reading everything leaves only when nobody reads its buffers") {
  const int n = 4;
  const std::size_t count = 3 * kMiB / sizeof(float);
  for (Kind kind : {Kind::all_gather, Kind::all_reduce_in_place, Kind::reduce_scatter}) {
    for (int at_mib : {1, 6, -1}) {  // -1: after reading everything
      const int failing = 2;
      CAPTURE(name_of(kind));
      CAPTURE(at_mib);
      std::vector<int> slow(n, 0);
      ThreadGroupOptions options{5000ms};
      options.fault_hook = [&](const CollectivePoint& p) {
        if (p.rank == failing) {
          const bool here = at_mib < 0 ? p.stage == CollectiveStage::read
                                       : p.stage == CollectiveStage::reading && p.bytes_read >= std::size_t(at_mib) * kMiB;
          if (here) throw std::runtime_error("injected while reading on rank 2");
        } else if (p.stage == CollectiveStage::reading && p.rank % 2 == 1) {
          std::this_thread::sleep_for(1ms);  // odd peers lag, so they are mid-read when rank 2 fails
        }
      };
      Outcome out{std::vector<std::string>(n), std::vector<int>(n, 0), ""};
      try {
        ThreadGroup(n, std::move(options)).run([&](ThreadComm& c) {
          try {
            large_collective(c, kind, count, 0);
            out.completed[c.rank()] = 1;
          } catch (const fsdp::Error& e) {
            out.errors[c.rank()] = e.what();
          }
        });
      } catch (const std::runtime_error& e) {  // the failing rank's own exception, rethrown by run()
        out.escaped = e.what();
      }
      CHECK(out.escaped == "injected while reading on rank 2");
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CAPTURE(out.errors[r]);
        CHECK(out.completed[r] == 0);
        if (r != failing) {
          CHECK(contains(out.errors[r], "rank 2 failed in"));
          CHECK(contains(out.errors[r], "injected while reading on rank 2"));
        }
      }
    }
  }
}

namespace {

// An all_gather on 3 ranks in which rank 1, before reading its fourth MiB, waits until
// ranks 0 and 2 have read everything and then stalls for `stall`, under a collective
// timeout of `timeout` (so the timing is relative to the peers' wait, however loaded the
// machine is).
Outcome all_gather_with_stalled_reader(std::chrono::milliseconds timeout, std::chrono::milliseconds stall) {
  ThreadGroupOptions options{timeout};
  auto peers_done = std::make_shared<std::atomic<int>>(0);
  auto both_done = std::make_shared<Signal>();
  options.fault_hook = [=](const CollectivePoint& p) {
    if (p.rank != 1 && p.stage == CollectiveStage::read && ++*peers_done == 2) both_done->raise();
    if (p.rank == 1 && p.stage == CollectiveStage::reading && p.bytes_read >= 3 * kMiB && p.bytes_read < 4 * kMiB) {
      both_done->wait();
      std::this_thread::sleep_for(stall);
    }
  };
  const std::size_t count = 2 * kMiB / sizeof(float);
  Outcome out = run_ranks(3, std::move(options), [&](ThreadComm& c) { large_collective(c, Kind::all_gather, count, 0); });
  CHECK(out.escaped.empty());
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CAPTURE(out.errors[r]);
    CHECK(out.completed[r] == 0);
    CHECK(contains(out.errors[r], "timed out after " + std::to_string(timeout.count()) +
                                      " ms; ranks still reading their peers' buffers: 1"));
  }
  return out;
}

}  // namespace

TEST_CASE("a slow reader makes its peers time out; they leave once it has stopped reading") {
  SUBCASE("the slow rank sees the abort at its next chunk") {
    // Past the timeout and within twice it, by 500 ms either way: a peer late by 200 ms (a
    // loaded machine under TSan) must not end the case either way.
    const Outcome out = all_gather_with_stalled_reader(1000ms, 1500ms);
    CHECK(contains(out.errors[1], "rank 1: all_gather(count=524288, dtype=f32) as collective #0 aborted"));
  }
  SUBCASE("a reader that does not move for twice the timeout: its peers leave anyway, and it reads nothing more") {
    const Outcome out = all_gather_with_stalled_reader(150ms, 1200ms);  // the peers leave 900 ms before it wakes
    for (int r : {0, 2}) CHECK(contains(out.errors[r], "(left after 300 ms with ranks still reading: 1)"));
  }
}

TEST_CASE("a rank failing outside the collective aborts a split group's large all_gather safely") {
  const int n = 3;
  const std::size_t count = 8 * kMiB / sizeof(float);
  for (std::size_t progress_mib : {0, 3, 9}) {
    CAPTURE(progress_mib);
    Signal copying, throwing;
    std::vector<std::atomic<bool>> split_done(n);  // the hook acts in the large all_gather only
    ThreadGroupOptions options{5000ms};
    options.fault_hook = [&](const CollectivePoint& p) {
      if (p.stage != CollectiveStage::reading || p.rank == 2 || !split_done[p.rank] || p.bytes_read < progress_mib * kMiB)
        return;
      copying.raise();
      throwing.wait();  // hold the copy here until rank 2 throws, then give the abort time to land
      std::this_thread::sleep_for(20ms);
    };
    std::vector<std::string> errors(n);
    std::string rethrown;
    try {
      ThreadGroup(n, std::move(options)).run([&](ThreadComm& c) {
        ThreadComm pair = c.split(c.rank() == 2 ? 1 : 0, c.rank());
        split_done[c.rank()] = true;
        if (c.rank() == 2) {
          copying.wait();
          throwing.raise();
          throw std::runtime_error("rank 2 gave up");
        }
        try {
          large_collective(pair, Kind::all_gather, count, 0);
        } catch (const fsdp::Error& e) {
          errors[c.rank()] = e.what();
        }
      });
    } catch (const std::runtime_error& e) {
      rethrown = e.what();
    }
    CHECK(rethrown == "rank 2 gave up");
    for (int r : {0, 1}) {
      CAPTURE(r);
      CAPTURE(errors[r]);
      CHECK(contains(errors[r], "all_gather(count=2097152, dtype=f32) as collective #0 aborted: rank 2 failed: rank 2 gave up"));
    }
  }
}

TEST_CASE("a collective mismatch on large buffers fails on every rank without reading") {
  const std::size_t count = kMiB;
  std::vector<std::size_t> read(3, 0);
  ThreadGroupOptions options{5000ms};
  options.fault_hook = [&](const CollectivePoint& p) {
    if (p.stage == CollectiveStage::reading) read[p.rank] = std::max(read[p.rank], p.bytes_read + 1);
  };
  const Outcome out = run_ranks(3, std::move(options), [&](ThreadComm& c) {
    large_collective(c, c.rank() == 1 ? Kind::reduce_scatter : Kind::all_gather, count, 0);
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(out.errors[r]);
    CHECK(contains(out.errors[r], "collective mismatch"));
    CHECK(read[r] == 0);
  }
}

TEST_CASE("with the hook installed but quiet, large collectives still give the right values") {
  const int n = 3;
  const std::size_t count = 3 * kMiB / sizeof(float) + 5;  // not a whole number of chunks
  std::vector<int> bad(n, -1);
  std::vector<std::size_t> points(n, 0);
  ThreadGroupOptions options{5000ms};
  options.fault_hook = [&](const CollectivePoint& p) { ++points[p.rank]; };
  ThreadGroup(n, std::move(options)).run([&](ThreadComm& c) {
    const int r = c.rank();
    std::vector<float> send(count), gathered(n * count), summed(count);
    for (std::size_t i = 0; i < count; ++i) send[i] = static_cast<float>((i % 1000) + r);
    c.all_gather(send.data(), gathered.data(), count, DType::f32).wait();
    c.all_reduce(send.data(), summed.data(), count, DType::f32, ReduceOp::sum).wait();
    int b = 0;
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < count; i += 97) b += gathered[q * count + i] != static_cast<float>((i % 1000) + q);
    for (std::size_t i = 0; i < count; i += 97) b += summed[i] != static_cast<float>(3 * (i % 1000) + 3);
    bad[r] = b;
  });
  for (int r = 0; r < n; ++r) {
    CHECK(bad[r] == 0);
    CHECK(points[r] > 4);  // posted and read in both collectives, and reading points between
  }
}

// The root cause, not an echo: a rank that fails because another failed (a collective a peer
// aborted, a checkpoint step another rank could not do) throws a detail::EchoedError naming
// that rank, and run() rethrows a rank's own error even when an echo left its function first.
TEST_CASE("run() rethrows a rank's own error, not an echo of it that left its function first") {
  for (int rep = 0; rep < 20; ++rep) {  // bounded: rank 0 is held 10 ms behind rank 1 each time
    CAPTURE(rep);
    Signal echoed;
    std::string rethrown;
    try {
      ThreadGroup(2, ThreadGroupOptions{5000ms}).run([&](ThreadComm& c) {
        if (c.rank() == 1) {
          echoed.raise();
          fsdp::detail::fail_echo(fsdp::ErrorKind::io, 0, "rank 1: another rank failed; rank 0 says: disk full");
        }
        echoed.wait();
        std::this_thread::sleep_for(10ms);  // rank 1's echo has left its function by now
        throw std::runtime_error("rank 0: disk full");
      });
    } catch (const std::exception& e) {
      rethrown = e.what();
    }
    CHECK(rethrown == "rank 0: disk full");
    if (rethrown != "rank 0: disk full") break;
  }
}

TEST_CASE("a collective aborted by a peer's failure throws an echo naming that peer, with the failure") {
  std::vector<int> echo_of(3, -2);
  std::vector<std::string> errors(3);
  std::string rethrown;
  try {
    ThreadGroup(3, ThreadGroupOptions{5000ms}).run([&](ThreadComm& c) {
      if (c.rank() == 2) throw std::runtime_error("rank 2 gave up");
      try {
        c.barrier().wait();
      } catch (const fsdp::detail::EchoedError& e) {
        echo_of[c.rank()] = e.failed_rank();
        errors[c.rank()] = e.what();
        CHECK(e.kind() == fsdp::ErrorKind::peer_lost);
        throw;
      }
    });
  } catch (const std::exception& e) {
    rethrown = e.what();
  }
  CHECK(rethrown == "rank 2 gave up");
  for (int r : {0, 1}) {
    CAPTURE(errors[r]);
    CHECK(echo_of[r] == 2);
    CHECK(contains(errors[r], "rank 2 failed: rank 2 gave up"));
  }
}

TEST_CASE("when every rank's error is an echo, run() rethrows the one that aborted the group") {
  std::string rethrown;
  try {
    ThreadGroup(2, ThreadGroupOptions{5000ms}).run([&](ThreadComm& c) {
      if (c.rank() == 0) c.barrier().wait();  // aborted by rank 1: an echo of rank 1's echo
      fsdp::detail::fail_echo(fsdp::ErrorKind::io, 5, "rank 1: another rank failed; rank 5 says: no space");
    });
  } catch (const fsdp::Error& e) {
    rethrown = e.what();
  }
  CHECK(rethrown == "fsdp: rank 1: another rank failed; rank 5 says: no space");
}

}  // namespace faults_thread_group_faults_test
