// fsdp/asio/tcp_process_group.hpp with ranks that are real processes: a rank killed with
// SIGKILL mid-collective, a rank that never starts, a rank that runs one collective fewer,
// a rank that stalls, a rank whose only failure is the teardown. Each must end, on every
// surviving rank, in an fsdp::Error that names the rank at fault, well within the timeout
// (and, for the teardown, in a non-zero exit); returning at all is the no-hang check.
//
// The ranks are forked from this test (forked_ranks.hpp).
#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forked_ranks.hpp"
#include "fsdp/core/exit_status.hpp"
#include "test/support/errors.hpp"

namespace asio_tcp_process_faults_test {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test_support::contains;
using test_support::rank_env;
using test_support::run_ranks;
using test_support::seconds_since;

// Like a program's main: each rank runs body(group, rank) in the scope of a
// TcpProcessGroup and exits 3 with the fsdp::Error's text on the pipe if one leaves that
// scope (the destructor's included; 86, fsdp::kEchoExitStatus, for an echo of another
// rank's failure), else 0. Returns each rank's exit status and text.
struct Exit {
  int status = -1;
  std::string error;
};
std::vector<Exit> run_to_exit(int world, const std::function<void(fsdp::TcpProcessGroup&, int)>& body) {
  const auto port = static_cast<std::uint16_t>(fsdp::launch::find_free_port());
  std::vector<Exit> exits(static_cast<std::size_t>(world));
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < world; ++r) {
    int p[2];
    REQUIRE(pipe(p) == 0);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(p[0]);
      std::string error;
      int status = 0;
      try {
        fsdp::TcpCommOptions options;
        options.timeout = 5s;
        fsdp::TcpProcessGroup group(rank_env(port, r, world), options);
        body(group, r);
      } catch (const fsdp::Error& e) {
        error = e.what();
        status = fsdp::exit_status(e, 3);  // kEchoExitStatus for an echo of another rank's failure
      }
      (void)!write(p[1], error.data(), error.size());
      _exit(status);
    }
    close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  for (int r = 0; r < world; ++r) {  // each child exits within its timeouts; the test's limit backs that up
    char buf[4096];
    ssize_t n;
    while ((n = read(fds[static_cast<std::size_t>(r)], buf, sizeof buf)) > 0)
      exits[static_cast<std::size_t>(r)].error.append(buf, static_cast<std::size_t>(n));
    close(fds[static_cast<std::size_t>(r)]);
    int status = 0;
    waitpid(pids[static_cast<std::size_t>(r)], &status, 0);
    exits[static_cast<std::size_t>(r)].status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return exits;
}

// Like a program's main that reports a collective's error itself: each rank holds a
// TcpProcessGroup (in a std::optional when `in_optional`, whose destructor cannot throw),
// runs body(comm, rank) and returns its result as the exit status; the scope ends
// normally, so the group's destructor runs with no exception in flight. An fsdp::Error
// from that destructor exits 3; std::terminate shows as 128 + SIGABRT.
int forked_main_exit(int world, int rank, std::uint16_t port, bool in_optional,
                     const std::function<int(fsdp::TcpComm&, int)>& body) {
  try {
    const fsdp::DistEnv env = rank_env(port, rank, world);
    fsdp::TcpCommOptions options;
    options.timeout = 5s;
    if (in_optional) {
      std::optional<fsdp::TcpProcessGroup> group;
      group.emplace(env, options);
      return body(group->comm(), rank);
    }
    fsdp::TcpProcessGroup group(env, options);
    return body(group.comm(), rank);
  } catch (const fsdp::Error&) {
    return 3;
  }
}
std::vector<int> run_main_exits(int world, bool in_optional, const std::function<int(fsdp::TcpComm&, int)>& body) {
  const auto port = static_cast<std::uint16_t>(fsdp::launch::find_free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) _exit(forked_main_exit(world, r, port, in_optional, body));
    pids.push_back(pid);
  }
  std::vector<int> statuses;
  for (const pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    statuses.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return statuses;
}

}  // namespace

TEST_CASE("a rank that catches a collective's error and returns 1 exits 1: the destructor does not throw it again") {
  for (const bool in_optional : {false, true}) {
    CAPTURE(in_optional);
    const auto t0 = Clock::now();
    const auto statuses = run_main_exits(2, in_optional, [](fsdp::TcpComm& comm, int r) {
      double x = 1, y = 0;
      try {  // rank 0 runs an all_reduce where rank 1 runs a barrier: both fail
        if (r == 0) comm.all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
        else comm.barrier().wait();
      } catch (const fsdp::Error&) {
        return 1;  // reported; the broken communicator's teardown barrier fails at once
      }
      return 0;
    });
    CHECK(seconds_since(t0) < 10.0);
    CHECK(statuses[0] == 1);  // not 3 (the destructor threw) nor 134 (std::terminate)
    CHECK(statuses[1] == 1);
  }
}

TEST_CASE("a rank whose only failure is the teardown barrier exits non-zero, with or without finish()") {
  for (const bool explicit_finish : {false, true}) {
    CAPTURE(explicit_finish);
    const auto t0 = Clock::now();
    const auto exits = run_to_exit(2, [&](fsdp::TcpProcessGroup& group, int r) {
      double x = 1, y = 0;
      if (r == 0) {  // rank 1 skips this all_reduce and goes straight to the teardown
        try {
          group.comm().all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
        } catch (const fsdp::Error&) {
          std::this_thread::sleep_for(1s);  // keep the store up while rank 1 learns why
          throw;
        }
      }
      if (explicit_finish) group.finish();
    });
    CHECK(seconds_since(t0) < 10.0);
    CAPTURE(exits[0].error);
    CAPTURE(exits[1].error);
    CHECK(exits[0].status == 3);
    CHECK(contains(exits[0].error, "all_reduce"));
    CHECK(exits[1].status == 3);
    CHECK(contains(exits[1].error, "fsdp: TcpProcessGroup teardown on rank 1: the ranks did not end together (its final barrier failed): "));
    CHECK(contains(exits[1].error, "all_reduce"));
  }
  // Ranks that agree exit 0 either way.
  const auto exits = run_to_exit(2, [](fsdp::TcpProcessGroup& group, int r) {
    double x = 1, y = 0;
    group.comm().all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
    if (r == 1) group.finish();
  });
  CHECK(exits[0].status == 0);
  CHECK(exits[1].status == 0);
  CHECK(exits[0].error == "");
}

TEST_CASE("a rank that leaves with its own exception between collectives: its peers echo it, none blames another") {
  // Rank 1 fails outside any collective while ranks 0 and 2 wait in the next all_reduce.
  // Its group's teardown must not run a barrier (which rank 2 would find mismatched with
  // its all_reduce, failing "on its own account"): it closes its links, and the others'
  // errors are echoes naming rank 1, so fsdp_run would report rank 1 first.
  const auto t0 = Clock::now();
  const auto exits = run_to_exit(3, [](fsdp::TcpProcessGroup& group, int r) {
    double x = 1, y = 0;
    group.comm().all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
    if (r == 1) throw fsdp::Error("rank 1's own failure, outside any collective");
    group.comm().all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
  });
  CHECK(seconds_since(t0) < 10.0);
  CAPTURE(exits[0].error);
  CAPTURE(exits[2].error);
  CHECK(exits[1].status == 3);
  CHECK(exits[1].error == "fsdp: rank 1's own failure, outside any collective");
  for (int r : {0, 2}) {
    CHECK(exits[static_cast<std::size_t>(r)].status == fsdp::kEchoExitStatus);
    CHECK(contains(exits[static_cast<std::size_t>(r)].error, "rank 1"));
    CHECK_FALSE(contains(exits[static_cast<std::size_t>(r)].error, "mismatch"));
  }
}

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
