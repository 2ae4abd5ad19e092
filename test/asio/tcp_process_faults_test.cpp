// fsdp/asio/tcp_process_group.hpp with ranks that are real processes: a rank killed with
// SIGKILL mid-collective, a rank that never starts, a rank that runs one collective fewer,
// a rank that stalls. Each must end, on every surviving rank, in an fsdp::Error that names
// the rank at fault, well within the timeout; returning at all is the no-hang check.
//
// The ranks are forked from this test (forked_ranks.hpp).
#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "forked_ranks.hpp"
#include "test/support/errors.hpp"

namespace asio_tcp_process_faults_test {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test_support::contains;
using test_support::run_ranks;
using test_support::seconds_since;

}  // namespace

TEST_CASE("a rank killed with SIGKILL mid-collective: every survivor fails naming it, without waiting for the timeout") {
  const auto results = test_support::kill_mid_all_gather(4, 2);
  CHECK_FALSE(results[2].reported);
}

TEST_CASE("a rank that never starts: the others fail joining, naming it, within the timeout") {
  const auto t0 = Clock::now();
  auto results = run_ranks(3, {0, 1}, 1500ms, [](fsdp::TcpComm& comm, int) { comm.barrier().wait(); });
  CHECK(seconds_since(t0) < 10.0);
  for (int r : {0, 1}) {
    CAPTURE(results[r].error);
    // Rank 0 hosts the store: if it gives up first, rank 1 sees the store fail meanwhile.
    CHECK((contains(results[r].error, "rank 2 never joined") || contains(results[r].error, "rank 2 had not joined")));
  }
}

TEST_CASE("a rank that runs one collective fewer: both ranks fail naming both calls") {
  auto results = run_ranks(2, {0, 1}, 5s, [](fsdp::TcpComm& comm, int r) {
    double x = 1, y = 0;
    const int calls = r == 1 ? 2 : 3;  // rank 1 skips the last all_reduce and moves on
    for (int i = 0; i < calls; ++i) comm.all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
    comm.barrier().wait();
  });
  for (int r : {0, 1}) {
    CAPTURE(results[r].error);
    CHECK(contains(results[r].error, "collective mismatch"));
    CHECK(contains(results[r].error, "all_reduce"));
    CHECK(contains(results[r].error, "barrier"));
    CHECK(contains(results[r].error, "#2"));
  }
}

TEST_CASE("a rank that stalls outside fsdp: the waiting ranks time out and say which rank is behind") {
  const auto t0 = Clock::now();
  auto results = run_ranks(3, {0, 1, 2}, 1500ms, [](fsdp::TcpComm& comm, int r) {
    double x = 1, y = 0;
    comm.all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
    if (r == 1) {  // stuck in "compute" for longer than the others' timeout (bounded)
      std::this_thread::sleep_for(6s);
      return;
    }
    comm.all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
  });
  CHECK(seconds_since(t0) < 15.0);
  for (int r : {0, 2}) {
    CAPTURE(results[r].error);
    CHECK(contains(results[r].error, "timed out"));
    CHECK(contains(results[r].error, "rank 1"));
  }
}

}  // namespace asio_tcp_process_faults_test
