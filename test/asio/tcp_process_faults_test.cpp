// fsdp/asio/tcp_process_group.hpp with ranks that are real processes: a rank killed with
// SIGKILL mid-collective, a rank that never starts, a rank that runs one collective fewer,
// a rank that stalls. Each must end, on every surviving rank, in an fsdp::Error that names
// the rank at fault, well within the timeout; returning at all is the no-hang check.
//
// The ranks are forked from this test (no launcher: fsdp_run would stop the survivors as
// soon as one rank dies, and the point is what the survivors see by themselves). Each
// child reports its error text through a pipe and leaves with _exit.
#include <doctest/doctest.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/asio/tcp_process_group.hpp"
#include "test/support/errors.hpp"
#include "tools/launcher/launcher.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using test_support::contains;

struct RankResult {
  bool reported = false;  // the child wrote a report (it did not die first)
  std::string error;      // its fsdp::Error text, "" if none
  int status = -1;        // waitpid status
};

// Forks one process per rank in `started` of a world of `world`; each runs body(comm, rank)
// on a TcpProcessGroup with `timeout`. Collects every report within `limit`, then kills
// what is left.
std::vector<RankResult> run_ranks(int world, const std::vector<int>& started, std::chrono::milliseconds timeout,
                                  const std::function<void(fsdp::TcpComm&, int)>& body,
                                  std::chrono::milliseconds limit = 20s) {
  const auto port = static_cast<std::uint16_t>(fsdp::launch::find_free_port());
  std::vector<RankResult> results(static_cast<std::size_t>(world));
  std::vector<pid_t> pids(static_cast<std::size_t>(world), -1);
  std::vector<int> fds(static_cast<std::size_t>(world), -1);
  for (int r : started) {
    int p[2];
    REQUIRE(pipe(p) == 0);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(p[0]);
      std::string report = "ok:";
      try {
        fsdp::DistEnv env;
        env.master_port = port;
        env.rank = r;
        env.world_size = world;
        env.local_rank = r;
        env.local_world_size = world;
        fsdp::TcpCommOptions options;
        options.timeout = timeout;
        fsdp::TcpProcessGroup group(env, options);
        body(group.comm(), r);
      } catch (const fsdp::Error& e) {
        report = std::string("error:") + e.what();
      } catch (const std::exception& e) {
        report = std::string("other:") + e.what();
      }
      // Report, then leave without running destructors: a failed group cannot tear down
      // in order, and rank 0 must keep its store up for the others' reports meanwhile.
      (void)!write(p[1], report.data(), report.size());
      close(p[1]);
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(timeout.count() * 2));
      _exit(0);
    }
    close(p[1]);
    pids[static_cast<std::size_t>(r)] = pid;
    fds[static_cast<std::size_t>(r)] = p[0];
  }
  // Read every report (a child's pipe closes when it exits or dies).
  const auto deadline = Clock::now() + limit;
  std::vector<std::string> text(static_cast<std::size_t>(world));
  for (;;) {
    std::vector<pollfd> polled;
    for (int fd : fds)
      if (fd >= 0) polled.push_back({fd, POLLIN, 0});
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (polled.empty() || left <= 0) break;
    if (poll(polled.data(), polled.size(), static_cast<int>(left)) <= 0) continue;
    for (auto& pf : polled) {
      if (!(pf.revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      const ssize_t n = read(pf.fd, buf, sizeof buf);
      const auto r = static_cast<std::size_t>(std::find(fds.begin(), fds.end(), pf.fd) - fds.begin());
      if (n > 0) {
        text[r].append(buf, static_cast<std::size_t>(n));
      } else {
        close(pf.fd);
        fds[r] = -1;
      }
    }
  }
  for (std::size_t r = 0; r < pids.size(); ++r) {
    if (fds[r] >= 0) close(fds[r]);
    if (pids[r] < 0) continue;
    kill(pids[r], SIGKILL);  // whatever is still running (rank 0 lingering for the store)
    waitpid(pids[r], &results[r].status, 0);
    results[r].reported = !text[r].empty();
    if (text[r].rfind("error:", 0) == 0) results[r].error = text[r].substr(6);
    else if (text[r].rfind("other:", 0) == 0) results[r].error = "non-fsdp exception: " + text[r].substr(6);
  }
  return results;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

TEST_CASE("a rank killed with SIGKILL mid-collective: every survivor fails naming it, without waiting for the timeout") {
  constexpr int kWorld = 4, kVictim = 2;
  constexpr std::size_t kCount = 4 << 20;  // 16 MiB of f32 per rank: the kill lands mid-transfer
  const auto t0 = Clock::now();
  auto results = run_ranks(kWorld, {0, 1, 2, 3}, 10s, [&](fsdp::TcpComm& comm, int r) {
    std::vector<float> shard(kCount, static_cast<float>(r)), full(kCount * kWorld);
    comm.barrier().wait();
    fsdp::Work w = comm.all_gather(shard.data(), full.data(), kCount, fsdp::DType::f32);
    if (r == kVictim) {
      std::this_thread::sleep_for(5ms);
      raise(SIGKILL);
    }
    w.wait();
  });
  CHECK(seconds_since(t0) < 8.0);  // detected from the closed sockets, not the 10 s timeout
  CHECK(WIFSIGNALED(results[kVictim].status));
  CHECK_FALSE(results[kVictim].reported);
  for (int r = 0; r < kWorld; ++r) {
    if (r == kVictim) continue;
    CAPTURE(r);
    CAPTURE(results[r].error);
    CHECK(results[r].reported);
    CHECK(contains(results[r].error, "rank 2"));
    CHECK(contains(results[r].error, "all_gather"));
  }
}

TEST_CASE("a rank that never starts: the others fail joining, naming it, within the timeout") {
  const auto t0 = Clock::now();
  auto results = run_ranks(3, {0, 1}, 1500ms, [](fsdp::TcpComm& comm, int) { comm.barrier().wait(); });
  CHECK(seconds_since(t0) < 10.0);
  for (int r : {0, 1}) {
    CAPTURE(results[r].error);
    CHECK(contains(results[r].error, "rank 2 never joined"));
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
