// run_agreed (fsdp/checkpoint/checkpoint_collective.hpp): whatever one rank's part throws,
// every rank reaches the agreement, so no rank waits for one that gave up.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/host_tensor.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/model/shard.hpp"
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
      r = {Outcome::fsdp_error, e.what()};
    } catch (const NotStd& e) {
      r = {Outcome::not_std, "", e.code};
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
                                    ": another rank failed (its error says why); nothing was done");
  }
}

TEST_CASE("a non-std exception on every rank is rethrown on each") {
  const auto results = run_on_ranks(2, [](int rank) { throw NotStd{rank + 7}; });
  for (int r = 0; r < 2; ++r) {
    CHECK(results[r].outcome == Outcome::not_std);
    CHECK(results[r].code == r + 7);
  }
}

TEST_CASE("a std::exception on one rank is quoted there; the others name another rank") {
  const auto results = run_on_ranks(2, [](int rank) {
    if (rank == 0) throw std::runtime_error("disk full");
  });
  CHECK(results[0].outcome == Outcome::fsdp_error);
  CHECK(results[0].message == "fsdp: test step on rank 0: disk full; nothing was done");
  CHECK(results[1].outcome == Outcome::fsdp_error);
  CHECK(contains(results[1].message, "another rank failed"));
}

TEST_CASE("when every part succeeds nothing is thrown") {
  const auto results = run_on_ranks(2, [](int) {});
  for (const auto& r : results) CHECK(r.outcome == Outcome::none);
}

}  // namespace checkpoint_checkpoint_collective_test
