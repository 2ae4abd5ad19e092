// run_agreed (fsdp/checkpoint/checkpoint_collective.hpp): whatever one rank's part throws,
// every rank reaches the agreement, so no rank waits for one that gave up; and every rank's
// error carries the cause: the failed rank's own message and kind, and ThreadGroup::run
// rethrows that rank's error, not an echo, whichever rank throws first.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/sharded_checkpoint.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/host_tensor.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/model/shard.hpp"
#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_checkpoint_collective_test {

namespace {

struct Small {
  fsdp::HostTensor w{{6}}, g{{6}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
};

struct NotStd {  // what a foreign library or a test harness might throw
  int code;
};

enum class Outcome { none, fsdp_error, not_std, other };

struct RankResult {
  Outcome outcome = Outcome::none;
  std::string message;
  int code = 0;
  std::optional<fsdp::ErrorKind> kind;
};

// Runs run_agreed on `world` ranks; `part(rank)` is each rank's part. A timeout far below
// the test's would show up as an fsdp::Error naming it, not as a hang.
template <class Part>
std::vector<RankResult> run_on_ranks(int world, Part part) {
  std::vector<RankResult> out(world);
  fsdp::ThreadGroup(world, fsdp::ThreadGroupOptions{std::chrono::milliseconds(3000)}).run([&](fsdp::ThreadComm& comm) {
    Small m;
    fsdp::HostDevice device;
    auto model = fsdp::shard<fsdp::FullShard>(m, comm, device);
    auto& r = out[comm.rank()];
    try {
      fsdp::detail::run_agreed(model, "test step", [&] { part(comm.rank()); }, "; nothing was done");
    } catch (const fsdp::Error& e) {
      r = {Outcome::fsdp_error, e.what(), 0, e.kind()};
    } catch (const NotStd& e) {
      r = {Outcome::not_std, "", e.code, std::nullopt};
    } catch (...) {
      r.outcome = Outcome::other;
    }
  });
  return out;
}

using test_support::contains;

}  // namespace

TEST_CASE("a non-std exception on one rank: every rank fails, none waits, the thrower gets its own exception back") {
  const auto start = std::chrono::steady_clock::now();
  const auto results = run_on_ranks(3, [](int rank) {
    if (rank == 1) throw NotStd{42};
  });
  // Well inside the 3 s collective timeout: the other ranks did not wait for rank 1.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(2500));
  CHECK(results[1].outcome == Outcome::not_std);
  CHECK(results[1].code == 42);
  for (int r : {0, 2}) {
    CAPTURE(results[r].message);
    CHECK(results[r].outcome == Outcome::fsdp_error);
    CHECK(results[r].message == "fsdp: test step on rank " + std::to_string(r) +
                                    ": another rank failed; rank 1 says: an exception that is not a std::exception;"
                                    " nothing was done");
  }
}

TEST_CASE("a non-std exception on every rank is rethrown on each") {
  const auto results = run_on_ranks(2, [](int rank) { throw NotStd{rank + 7}; });
  for (int r = 0; r < 2; ++r) {
    CHECK(results[r].outcome == Outcome::not_std);
    CHECK(results[r].code == r + 7);
  }
}

TEST_CASE("a std::exception on one rank is quoted there and on every other rank, naming it") {
  const auto results = run_on_ranks(3, [](int rank) {
    if (rank == 1) throw std::runtime_error("disk full");
  });
  CHECK(results[1].outcome == Outcome::fsdp_error);
  CHECK(results[1].message == "fsdp: test step on rank 1: disk full; nothing was done");
  for (int r : {0, 2}) {
    CAPTURE(results[r].message);
    CHECK(results[r].outcome == Outcome::fsdp_error);
    CHECK(results[r].message == "fsdp: test step on rank " + std::to_string(r) +
                                    ": another rank failed; rank 1 says: disk full; nothing was done");
  }
}

TEST_CASE("when several ranks fail, the others quote the lowest of them, with its kind") {
  const auto results = run_on_ranks(4, [](int rank) {
    if (rank == 1) fsdp::detail::fail_as(fsdp::ErrorKind::io, "rank 1 cannot open its file");
    if (rank == 3) fsdp::detail::fail_as(fsdp::ErrorKind::corrupt, "rank 3 found a bad checksum");
  });
  CHECK(results[1].message == "fsdp: test step on rank 1: rank 1 cannot open its file; nothing was done");
  CHECK(results[1].kind == fsdp::ErrorKind::io);
  CHECK(results[3].message == "fsdp: test step on rank 3: rank 3 found a bad checksum; nothing was done");
  CHECK(results[3].kind == fsdp::ErrorKind::corrupt);
  for (int r : {0, 2}) {
    CAPTURE(results[r].message);
    CHECK(contains(results[r].message, "on rank " + std::to_string(r) +
                                           ": another rank failed; rank 1 says: rank 1 cannot open its file"));
    CHECK(results[r].kind == fsdp::ErrorKind::io);  // the quoted rank's kind
  }
}

TEST_CASE("a long message is quoted up to 512 bytes, marked as cut") {
  const std::string long_message(2000, 'x');
  const auto results = run_on_ranks(2, [&](int rank) {
    if (rank == 0) throw std::runtime_error(long_message);
  });
  CHECK(results[0].message == "fsdp: test step on rank 0: " + long_message + "; nothing was done");
  CHECK(results[1].message == "fsdp: test step on rank 1: another rank failed; rank 0 says: " +
                                  std::string(fsdp::detail::kMaxQuoted, 'x') + " [...]; nothing was done");
}

// The reported failure (train --steps 1 --save /nonexistent/dir/ckpt on thread ranks):
// rank 0 cannot make the staging directory; rank 1, which did nothing wrong, must say why
// too, and run() must rethrow rank 0's error even when rank 1's echo leaves its function
// first (every other repetition holds rank 0 back to make sure it does).
TEST_CASE("a save that fails on rank 0 only: every rank names rank 0 and its reason; run() rethrows rank 0's") {
  test_support::TempDir tmp;
  const std::filesystem::path parent = tmp / "nonexistent";
  const std::string reason = "its parent directory '" + parent.string() + "' does not exist";
  int echoes_rethrown = 0;
  std::string last_rethrown;
  for (int rep = 0; rep < 50; ++rep) {  // bounded: 50 saves of a 6-element model, rank 0 held 5 ms in half
    std::vector<std::string> messages(2);
    std::vector<std::optional<fsdp::ErrorKind>> kinds(2);
    std::string rethrown;
    std::optional<fsdp::ErrorKind> rethrown_kind;
    try {
      fsdp::ThreadGroup(2, fsdp::ThreadGroupOptions{std::chrono::milliseconds(3000)}).run([&](fsdp::ThreadComm& comm) {
        Small m;
        fsdp::HostDevice device;
        auto model = fsdp::shard<fsdp::FullShard>(m, comm, device);
        try {
          fsdp::save_sharded_checkpoint(parent / "ckpt", model);
        } catch (const fsdp::Error& e) {
          messages[comm.rank()] = e.what();
          kinds[comm.rank()] = e.kind();
          if (comm.rank() == 0 && rep % 2 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          throw;
        }
      });
    } catch (const fsdp::Error& e) {
      rethrown = e.what();
      rethrown_kind = e.kind();
    }
    CAPTURE(rep);
    CAPTURE(messages[0]);
    CAPTURE(messages[1]);
    for (int r = 0; r < 2; ++r) {
      CHECK(contains(messages[r], reason));
      CHECK(kinds[r] == fsdp::ErrorKind::io);
    }
    CHECK(contains(messages[0], "on rank 0: "));
    CHECK(contains(messages[1], "on rank 1: another rank failed; rank 0 says: "));
    if (rethrown != messages[0]) ++echoes_rethrown, last_rethrown = rethrown;
    CHECK(rethrown_kind == fsdp::ErrorKind::io);
    if (echoes_rethrown > 0) break;  // one failed repetition says enough
  }
  CAPTURE(last_rethrown);
  CHECK(echoes_rethrown == 0);
  CHECK(test_support::names_in(tmp.path()).empty());
}

TEST_CASE("when every part succeeds nothing is thrown") {
  const auto results = run_on_ranks(2, [](int) {});
  for (const auto& r : results) CHECK(r.outcome == Outcome::none);
}

}  // namespace checkpoint_checkpoint_collective_test
