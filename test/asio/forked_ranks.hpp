#pragma once
// Ranks of a TcpProcessGroup as forked processes of a test: each runs a body on its
// communicator and reports its fsdp::Error text (and what it chose to tell, see
// child_output) through a pipe, then leaves with _exit. No launcher: fsdp_run would stop
// the survivors as soon as one rank dies, and the point is what the survivors see by
// themselves.
#include <doctest/doctest.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/asio/tcp_process_group.hpp"
#include "test/asio/tcp_world.hpp"
#include "tools/launcher/launcher.hpp"

namespace test_support {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct RankResult {
  bool reported = false;  // the child wrote a report (it did not die first)
  std::string error;      // its fsdp::Error text, "" if none
  std::string output;     // on success: what its body appended to child_output()
  int status = -1;        // waitpid status
  pid_t pid = -1;
};

// In a forked rank: text that goes back with its report when its body succeeds.
inline std::string& child_output() {
  static std::string out;
  return out;
}

// The DistEnv of rank `rank` of `world` ranks on this host, its store at `port` on the
// default address: what a launcher would give each forked rank.
inline fsdp::DistEnv rank_env(std::uint16_t port, int rank, int world) {
  fsdp::DistEnv env;
  env.master_port = port;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.local_world_size = world;
  return env;
}

// Forks one process per rank in `started` of a world of `world`; each runs body(comm, rank)
// on a TcpProcessGroup with `options` (options_for(rank) if given). Collects every
// report within `limit`, then kills what is left.
inline std::vector<RankResult> run_ranks(int world, const std::vector<int>& started, const fsdp::TcpCommOptions& options,
                                         const std::function<void(fsdp::TcpComm&, int)>& body,
                                         std::chrono::milliseconds limit = 20s,
                                         const std::function<fsdp::TcpCommOptions(int)>& options_for = {}) {
  const std::chrono::milliseconds timeout = options.timeout;
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
      std::string report;
      try {
        fsdp::TcpProcessGroup group(rank_env(port, r, world), options_for ? options_for(r) : options);
        body(group.comm(), r);
        report = "ok:" + child_output();
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
    results[r].pid = pids[r];
    kill(pids[r], SIGKILL);  // whatever is still running (rank 0 lingering for the store)
    waitpid(pids[r], &results[r].status, 0);
    results[r].reported = !text[r].empty();
    if (text[r].rfind("ok:", 0) == 0) results[r].output = text[r].substr(3);
    if (text[r].rfind("error:", 0) == 0) results[r].error = text[r].substr(6);
    else if (text[r].rfind("other:", 0) == 0) results[r].error = "non-fsdp exception: " + text[r].substr(6);
  }
  return results;
}

inline std::vector<RankResult> run_ranks(int world, const std::vector<int>& started, std::chrono::milliseconds timeout,
                                         const std::function<void(fsdp::TcpComm&, int)>& body,
                                         std::chrono::milliseconds limit = 20s) {
  fsdp::TcpCommOptions options;
  options.timeout = timeout;
  return run_ranks(world, started, options, body, limit);
}

// Forks `world` ranks (timeout 10 s) that each all_gather 16 MiB of f32 after a barrier;
// `victim` raises SIGKILL 5 ms after issuing it, so the kill lands mid-transfer. `before`,
// if set, runs first on every rank. Checks what every such case needs: the victim died of
// the signal, and every survivor failed naming it and the all_gather within 8 s (from the
// closed sockets, not the timeout). Returns the results for the case's own checks.
inline std::vector<RankResult> kill_mid_all_gather(int world, int victim,
                                                   const std::function<void(fsdp::TcpComm&)>& before = {}) {
  constexpr std::size_t kCount = 4 << 20;
  std::vector<int> all(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<std::size_t>(r)] = r;
  const auto t0 = Clock::now();
  auto results = run_ranks(world, all, 10s, [&](fsdp::TcpComm& comm, int r) {
    if (before) before(comm);
    std::vector<float> shard(kCount, static_cast<float>(r)), full(kCount * static_cast<std::size_t>(world));
    comm.barrier().wait();
    fsdp::Work w = comm.all_gather(shard.data(), full.data(), kCount, fsdp::DType::f32);
    if (r == victim) {
      std::this_thread::sleep_for(5ms);
      raise(SIGKILL);
    }
    w.wait();
  });
  CHECK(seconds_since(t0) < 8.0);
  CHECK(WIFSIGNALED(results[static_cast<std::size_t>(victim)].status));
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    const std::string& error = results[static_cast<std::size_t>(r)].error;
    CAPTURE(r);
    CAPTURE(error);
    CHECK(error.find("rank " + std::to_string(victim)) != std::string::npos);
    CHECK(error.find("all_gather") != std::string::npos);
  }
  return results;
}

}  // namespace test_support
