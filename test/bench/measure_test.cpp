// bench/collectives' harness: rows are timed and checked, a backend that returns a wrong
// result is caught on every rank, the checks find any wrong element, and the size /
// iteration plan is what the flags say.
#include <doctest/doctest.h>

#include <fsdp/host/thread_group.hpp>

#include <chrono>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "bench/collectives/fsdp_runner.hpp"
#include "bench/collectives/measure.hpp"
#include "bench/collectives/plan.hpp"

namespace {

// A backend with one bug: all_gather puts the last element of the output off by one, or
// reduce_scatter forgets one peer's contribution to element 0.
struct BrokenRunner : bench::FsdpRunner<fsdp::ThreadComm> {
  using FsdpRunner::FsdpRunner;
  void all_gather(const float* send, float* recv, std::size_t count) {
    FsdpRunner::all_gather(send, recv, count);
    recv[count * size() - 1] += 1;
  }
  const float* reduce_scatter(float* send, float* recv, std::size_t count) {
    FsdpRunner::reduce_scatter(send, recv, count);
    if (rank() == 1) recv[0] -= bench::pattern(0, count);
    return recv;
  }
};

// A correct backend whose all_gather takes 0.8 s, like 256 MiB on oversubscribed ranks.
struct SlowRunner : bench::FsdpRunner<fsdp::ThreadComm> {
  using FsdpRunner::FsdpRunner;
  int all_gathers = 0;
  void all_gather(const float* send, float* recv, std::size_t count) {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    ++all_gathers;
    FsdpRunner::all_gather(send, recv, count);
  }
};

}  // namespace

TEST_CASE("measure: a row whose calls take long runs fewer iterations, with the checked call as warmup") {
  std::vector<bench::Row> rows(2);
  std::vector<int> calls(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    SlowRunner runner(comm);
    rows[comm.rank()] = bench::measure(runner, "slow", bench::Op::all_gather, 1024, 50, 2);
    calls[comm.rank()] = runner.all_gathers;
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(rows[r].verified);
    CHECK(rows[r].iters == 1);  // 1.5 s budget / 0.8 s per call
    CHECK(calls[r] == 2);       // the checked call and one timed call: no warmup
    CHECK(rows[r].time_us >= 800000);
  }
}

TEST_CASE("measure: a correct backend gives verified rows with NCCL-tests bandwidths") {
  for (bench::Op op : {bench::Op::all_gather, bench::Op::reduce_scatter}) {
    std::vector<bench::Row> rows(3);
    fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
      bench::FsdpRunner runner(comm);
      rows[comm.rank()] = bench::measure(runner, "thread", op, 4096, 4, 1);
    });
    for (const auto& r : rows) {
      CHECK(r.verified);
      CHECK(r.op == bench::name_of(op));
      CHECK(r.world == 3);
      CHECK(r.bytes_per_rank == 4096);
      CHECK(r.iters == 4);
      CHECK(r.time_us > 0);
      CHECK(r.algbw_GBps == doctest::Approx(3 * 4096 / (r.time_us * 1e-6) / 1e9));
      CHECK(r.busbw_GBps == doctest::Approx(r.algbw_GBps * 2 / 3));
      CHECK(r.time_us == rows[0].time_us);  // every rank reports the same row
    }
  }
}

TEST_CASE("measure: a wrong result fails every rank, and the rank that saw it names the element") {
  for (bench::Op op : {bench::Op::all_gather, bench::Op::reduce_scatter}) {
    std::vector<std::string> errors(2);
    CHECK_THROWS_AS(fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
      BrokenRunner runner(comm);
      try {
        bench::measure(runner, "broken", op, 1024, 2, 1);
      } catch (const fsdp::Error& e) {
        errors[comm.rank()] = e.what();
        throw;
      }
    }), fsdp::Error);
    const std::string what = op == bench::Op::all_gather ? "element 511 is" : "element 0 is";
    CHECK(errors[1].find(what) != std::string::npos);
    CHECK(errors[1].find("broken " + std::string(bench::name_of(op)) + " of 1024 bytes per rank on 2 ranks") !=
          std::string::npos);
    if (op == bench::Op::reduce_scatter) CHECK(errors[0].find("rank 1 got a wrong result") != std::string::npos);
  }
}

TEST_CASE("plan: sizes by powers of 4, fewer iterations for big sizes, readable sizes") {
  using bench::KiB, bench::MiB;
  CHECK(bench::sizes_between(KiB, 256 * MiB) ==
        std::vector<std::size_t>{KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB});
  CHECK(bench::sizes_between(KiB, 8 * KiB) == std::vector<std::size_t>{KiB, 4 * KiB, 8 * KiB});
  CHECK(bench::iters_for(KiB, 2, 50) == 50);
  CHECK(bench::iters_for(4 * MiB, 4, 50) == 4);
  CHECK(bench::iters_for(256 * MiB, 4, 50) == 3);
  CHECK(bench::iters_for(256 * MiB, 4, 1) == 1);  // --iters 1 wins
  CHECK(bench::format_bytes(256 * MiB) == "256 MiB");
  CHECK(bench::format_bytes(1536) == "1536 B");
  CHECK(bench::row_footprint(MiB, 4) == 40 * MiB);
}

TEST_CASE("pattern: periodic fill and the first mismatch, a period at a time and across period ends") {
  const bench::Period p = bench::input_period(3);
  CHECK(p[0] == 21);  // 7 * 3
  CHECK(p[250] == 20);
  CHECK(bench::sum_period(2)[0] == 0 + 7);
  std::vector<float> v(1000);
  bench::fill_periodic(v.data(), v.size(), p, 600);
  for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == bench::pattern(3, 600 + i));
  CHECK_FALSE(bench::first_mismatch(v.data(), v.size(), p, 600));
  CHECK(bench::first_mismatch(v.data(), v.size(), p, 601) == std::size_t{0});  // shifted by one element
  for (std::size_t at : {std::size_t{0}, std::size_t{250}, std::size_t{251}, std::size_t{999}}) {
    auto w = v;
    w[at] = std::numeric_limits<float>::quiet_NaN();
    CHECK(bench::first_mismatch(w.data(), w.size(), p, 600) == at);
  }
  REQUIRE(v[132] == 0.0f);  // (21 + 600 + 132) % 251 == 0
  v[132] = -0.0f;           // equal to 0 as a float, but not what was written
  CHECK(bench::first_mismatch(v.data(), v.size(), p, 600) == std::size_t{132});
}
