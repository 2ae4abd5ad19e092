// TcpComm's shared-memory links between real processes (forked_ranks.hpp): every
// collective on 2 to 4 processes against the ring-order reference bit for bit, also with
// one rank's shared memory off (a mixed ring); a rank killed with SIGKILL mid-collective
// over shared memory and a stalled rank end in errors naming it on every survivor within
// the timeout, and no segment is left in /dev/shm.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "collective_cases.hpp"
#include "forked_ranks.hpp"
#include "tcp_cases.hpp"
#include "test/support/errors.hpp"
#include "test/support/sanitized.hpp"

namespace asio_tcp_shm_process_test {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using fsdp::DType;
using fsdp::ReduceOp;
using test_support::Case;
using test_support::contains;
using test_support::run_ranks;
using test_support::seconds_since;

// Segments in /dev/shm made by one of `results`' processes (their names carry the pid).
std::vector<std::string> leftover_segments(const std::vector<test_support::RankResult>& results) {
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm"))
    for (const auto& r : results)
      if (r.pid > 0 && entry.path().filename().string().rfind("fsdp." + std::to_string(r.pid) + ".", 0) == 0)
        left.push_back(entry.path().string());
  return left;
}

// Runs `cases` on this rank and appends what differs from the reference to the report.
void run_and_check(fsdp::TcpComm& comm, int r, const std::vector<Case>& cases) {
  std::string& out = test_support::child_output();
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const auto inputs = test_support::inputs_for(c, 7 + static_cast<std::uint32_t>(i));
    test_support::RankBuffers b(c, inputs[r], r);
    test_support::issue(comm, b.call(c)).wait();
    if (b.result(c) != test_support::ring_expected(c.kind, inputs, r, c.count, c.dtype, c.op, c.root))
      out += " wrong:" + c.str();
  }
}

// Under a sanitizer the largest input and the segments are a quarter the size
// (test/support/sanitized.hpp): as many frames, and a ring that fills as often.
constexpr std::size_t kLargest = test_support::sanitized ? 75001 : 300007;
constexpr std::size_t kSegmentBytes = test_support::sanitized ? 16 * 1024 : 64 * 1024;

std::vector<Case> cases_for(int n) { return test_support::every_kind_cases(n, {0, 5, 1001, kLargest}); }

fsdp::TcpCommOptions small_segments(std::chrono::milliseconds timeout) {
  fsdp::TcpCommOptions o;
  o.timeout = timeout;
  o.segment_bytes = kSegmentBytes;  // ~1.2 MiB inputs (0.3 MiB sanitized): many frames, and a ring that fills
  o.shared_memory_bytes = 4 * o.segment_bytes;
  return o;
}

}  // namespace

TEST_CASE("every collective on 2..4 processes over shared memory equals the reference, bit for bit") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const auto results = run_ranks(n, [&] {
      std::vector<int> all;
      for (int r = 0; r < n; ++r) all.push_back(r);
      return all;
    }(), small_segments(10s), [&](fsdp::TcpComm& comm, int r) {
      test_support::child_output() = test_support::link_text(comm);
      run_and_check(comm, r, cases_for(n));
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(results[r].error == "");
      CHECK(results[r].output == "11");  // both links shared, nothing wrong
    }
    CHECK(leftover_segments(results).empty());
  }
}

TEST_CASE("a mixed ring of processes: one rank with shared memory off keeps its links on TCP, results exact") {
  constexpr int n = 4, plain = 1;
  const auto results = run_ranks(
      n, {0, 1, 2, 3}, small_segments(10s),
      [&](fsdp::TcpComm& comm, int r) {
        test_support::child_output() = test_support::link_text(comm);
        run_and_check(comm, r, cases_for(n));
      },
      20s,
      [](int r) {
        auto o = small_segments(10s);
        o.shared_memory = r != plain;
        return o;
      });
  const std::vector<std::string> expected{"10", "00", "01", "11"};
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(results[r].error == "");
    CHECK(results[r].output == expected[r]);
  }
}

TEST_CASE("a process killed with SIGKILL mid-collective over shared memory: survivors name it at once, nothing left in /dev/shm") {
  const auto results = test_support::kill_mid_all_gather(3, 1, [](fsdp::TcpComm& comm) {
    if (test_support::link_text(comm) != "11") throw fsdp::Error("links are not shared: " + test_support::link_text(comm));
  });
  for (int r : {0, 2}) {
    CAPTURE(results[r].error);
    CHECK(contains(results[r].error, "#1"));
  }
  CHECK(leftover_segments(results).empty());
}

TEST_CASE("a process that stalls with shared-memory links: the others time out naming it") {
  const auto t0 = Clock::now();
  auto options = small_segments(1500ms);
  options.segment_bytes = 64 * 1024;  // sanitized too: 16 frames of its 1 MiB before the stall
  options.shared_memory_bytes = 4 * options.segment_bytes;
  const auto results = run_ranks(3, {0, 1, 2}, options, [](fsdp::TcpComm& comm, int r) {
    if (test_support::link_text(comm) != "11") throw fsdp::Error("links are not shared: " + test_support::link_text(comm));
    std::vector<float> x(1 << 18, 1.0f), y(x.size());
    comm.all_reduce(x.data(), y.data(), x.size(), DType::f32, ReduceOp::sum).wait();
    if (r == 2) {
      std::this_thread::sleep_for(5s);  // stuck in "compute" past the others' timeout
      return;
    }
    comm.all_reduce(x.data(), y.data(), x.size(), DType::f32, ReduceOp::sum).wait();
  });
  CHECK(seconds_since(t0) < 12.0);
  for (int r : {0, 1}) {
    CAPTURE(results[r].error);
    CHECK(contains(results[r].error, "timed out"));
    CHECK(contains(results[r].error, "rank 2"));
  }
  CHECK(leftover_segments(results).empty());
}

}  // namespace asio_tcp_shm_process_test
