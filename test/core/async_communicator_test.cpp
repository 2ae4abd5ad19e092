// fsdp/comm/async_communicator.hpp: a blocking communicator made asynchronous by one worker
// thread per instance. Same results as the wrapped communicator; calls return before the
// collective completes; collectives run one at a time in issue order; failures reach
// wait() and break the stream; destruction never hangs; split groups get their own
// streams, so DeviceMesh works over it; traced collectives land on the communication lane.
//
// Rank bodies never use doctest assertions (doctest's are not meant for many threads at
// once); they record what they saw in per-rank slots, checked after ThreadGroup::run.
#include <fsdp/comm/async_communicator.hpp>  // first: it must compile on its own

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fsdp/core/device_mesh.hpp>
#include <fsdp/host/thread_group.hpp>
#include <fsdp/core/trace.hpp>

namespace core_async_communicator_test {

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::ThreadComm;
using fsdp::ThreadGroup;
using fsdp::Work;
using Async = fsdp::AsyncCommunicator<ThreadComm>;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

static_assert(fsdp::Communicator<Async>);
static_assert(fsdp::SplittableCommunicator<Async>);
static_assert(std::is_same_v<fsdp::DeviceMesh<Async>::group_type, Async>);  // groups get their own streams
static_assert(std::is_nothrow_move_constructible_v<Async> && !std::is_copy_constructible_v<Async>);

// Every collective here either completes in milliseconds or is meant to fail; a bug that
// waits forever fails after this instead of hanging the suite.
const fsdp::ThreadGroupOptions kShort{2000ms};

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

std::string error_of(Work& w) {
  try {
    w.wait();
  } catch (const fsdp::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not an fsdp::Error: ") + e.what();
  }
  return "no error";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Every collective the Communicator concept has, out of place and in place, several ops
// and dtypes, issued back to back and waited for only at the end (a no-op wait for
// ThreadComm). Each op has its own buffers, so issuing all before waiting is legal.
struct Results {
  std::vector<std::vector<float>> f;
  std::vector<std::vector<std::int32_t>> i;
};

template <class Comm>
Results run_every_collective(Comm& c) {
  const int n = c.size(), r = c.rank();
  const std::size_t k = 5;  // per-rank chunk
  const std::size_t full = k * static_cast<std::size_t>(n);
  auto values = [&](std::size_t len, float salt) {
    std::vector<float> v(len);
    for (std::size_t j = 0; j < len; ++j) v[j] = static_cast<float>(r * 100 + static_cast<int>(j)) * 0.37f + salt;
    return v;
  };
  Results out;
  out.f.reserve(32);  // buffers must not move while their collectives are in flight
  out.i.reserve(8);
  std::vector<Work> works;
  auto F = [&](std::vector<float> v) -> std::vector<float>& { return out.f.emplace_back(std::move(v)); };

  auto& ag_in = F(values(k, 1));
  auto& ag_out = F(std::vector<float>(full));
  works.push_back(c.all_gather(ag_in.data(), ag_out.data(), k, DType::f32));
  auto& ag_inplace = F(std::vector<float>(full));
  for (std::size_t j = 0; j < k; ++j) ag_inplace[r * k + j] = ag_in[j] * 2;
  works.push_back(c.all_gather(ag_inplace.data() + r * k, ag_inplace.data(), k, DType::f32));

  auto& rs_in = F(values(full, 2));
  auto& rs_out = F(std::vector<float>(k));
  works.push_back(c.reduce_scatter(rs_in.data(), rs_out.data(), k, DType::f32, ReduceOp::sum));
  auto& rs_inplace = F(values(full, 3));
  works.push_back(c.reduce_scatter(rs_inplace.data(), rs_inplace.data() + r * k, k, DType::f32, ReduceOp::avg));

  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    auto& in = F(values(k, 4));
    auto& res = F(std::vector<float>(k));
    works.push_back(c.all_reduce(in.data(), res.data(), k, DType::f32, op));
  }
  auto& ar_inplace = F(values(k, 5));
  works.push_back(c.all_reduce(ar_inplace.data(), ar_inplace.data(), k, DType::f32, ReduceOp::sum));
  auto& ints = out.i.emplace_back(std::vector<std::int32_t>{r * 7 + 1, -r, 1000 + r});
  auto& ints_avg = out.i.emplace_back(3);
  works.push_back(c.all_reduce(ints.data(), ints_avg.data(), 3, DType::i32, ReduceOp::avg));

  auto& bc_in = F(values(k, 6));
  auto& bc_out = F(std::vector<float>(k));
  works.push_back(c.broadcast(bc_in.data(), bc_out.data(), k, DType::f32, n - 1));
  auto& bc_inplace = F(values(k, 7));
  works.push_back(c.broadcast(bc_inplace.data(), bc_inplace.data(), k, DType::f32, 0));
  works.push_back(c.barrier());
  for (auto& w : works) w.wait();
  return out;
}

}  // namespace

TEST_CASE("every collective gives bitwise the results ThreadComm gives, on 1, 2 and 4 ranks") {
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    std::vector<Results> sync(n), async(n);
    ThreadGroup(n, kShort).run([&](ThreadComm& comm) {
      sync[comm.rank()] = run_every_collective(comm);
      Async a(comm);
      async[comm.rank()] = run_every_collective(a);
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      REQUIRE(async[r].f.size() == sync[r].f.size());
      for (std::size_t b = 0; b < sync[r].f.size(); ++b) {
        CAPTURE(b);
        CHECK(std::memcmp(async[r].f[b].data(), sync[r].f[b].data(), sync[r].f[b].size() * sizeof(float)) == 0);
      }
      CHECK(async[r].i == sync[r].i);
    }
    // And they are the collectives' results, not two equally wrong answers: the
    // all_gather output is every rank's input in rank order.
    for (int q = 0; q < n; ++q)
      for (int j = 0; j < 5; ++j)
        CHECK(async[0].f[1][q * 5 + j] == async[q].f[0][j]);
  }
}

TEST_CASE("a call returns before its collective completes; wait() is where the time goes") {
  // The last rank issues its all_gather 150 ms after the others. On the async stream rank 0's
  // call returns at once and its wait() takes about those 150 ms; on ThreadComm (the
  // control, so the measurement is known to tell the two apart) the call itself blocks.
  constexpr auto kDelay = 150ms;
  for (int n : {2, 4}) {
    CAPTURE(n);
    for (bool use_async : {true, false}) {
      CAPTURE(use_async);
      std::vector<double> issue_ms(n), wait_ms(n);
      std::vector<int> ready_at_once(n, -1);
      std::vector<std::vector<int>> gathered(n);
      ThreadGroup(n, kShort).run([&](ThreadComm& comm) {
        const int r = comm.rank();
        auto measure = [&](auto& c) {
          c.barrier().wait();  // start together
          if (r == n - 1) std::this_thread::sleep_for(kDelay);
          int mine = 10 + r;
          std::vector<int> all(n);
          const auto t0 = Clock::now();
          Work w = c.all_gather(&mine, all.data(), 1, DType::i32);
          issue_ms[r] = ms_since(t0);
          ready_at_once[r] = w.ready();
          const auto t1 = Clock::now();
          w.wait();
          wait_ms[r] = ms_since(t1);
          gathered[r] = all;
        };
        if (use_async) {
          Async a(comm);
          measure(a);
        } else {
          measure(comm);
        }
      });
      for (int r = 0; r < n; ++r) {
        std::vector<int> want;
        for (int q = 0; q < n; ++q) want.push_back(10 + q);
        CHECK(gathered[r] == want);
      }
      if (use_async) {
        CHECK(issue_ms[0] < 50);
        CHECK(ready_at_once[0] == 0);
        CHECK(wait_ms[0] >= 100);
      } else {
        CHECK(issue_ms[0] >= 100);
        CHECK(ready_at_once[0] == 1);
        CHECK(wait_ms[0] < 50);
      }
    }
  }
}

TEST_CASE("collectives issued back to back run one at a time, in issue order") {
  // Each round feeds the next through the same buffers: all_gather x into g, reduce_scatter
  // g back into x (x <- n*x), all_reduce x in place (x <- n*x). Only in-order, one-at-a-time
  // execution ends with x == n^(2*rounds). All is issued before anything is waited for.
  constexpr int kRounds = 10;
  for (int n : {1, 2, 4}) {
    CAPTURE(n);
    std::vector<double> x_end(n);
    std::vector<int> earlier_ready(n, -1);
    std::vector<std::vector<fsdp::Trace::Event>> events(n);
    ThreadGroup(n, kShort).run([&](ThreadComm& comm) {
      const int r = comm.rank();
      fsdp::Trace trace(r);
      double x = 1;
      std::vector<double> g(n);
      std::vector<Work> works;
      {
        Async a(comm, &trace);
        for (int i = 0; i < kRounds; ++i) {
          works.push_back(a.all_gather(&x, g.data(), 1, DType::f64));
          works.push_back(a.reduce_scatter(g.data(), &x, 1, DType::f64, ReduceOp::sum));
          works.push_back(a.all_reduce(&x, &x, 1, DType::f64, ReduceOp::sum));
        }
        works.back().wait();
        // Completion is in order: once the last is done, every earlier one is.
        bool all_ready = true;
        for (auto& w : works) all_ready = all_ready && w.ready();
        earlier_ready[r] = all_ready;
      }
      x_end[r] = x;
      events[r] = trace.events();
    });
    double want = 1;
    for (int i = 0; i < 2 * kRounds; ++i) want *= n;
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(x_end[r] == want);
      CHECK(earlier_ready[r] == 1);
      const auto& ev = events[r];
      REQUIRE(ev.size() == 3 * kRounds);
      const char* kinds[] = {"all_gather", "reduce_scatter", "all_reduce"};
      bool kinds_ok = true, serial = true;
      for (std::size_t i = 0; i < ev.size(); ++i) {
        kinds_ok = kinds_ok && ev[i].category == kinds[i % 3] && ev[i].lane == fsdp::Trace::Lane::communication;
        if (i > 0) serial = serial && ev[i - 1].end <= ev[i].begin;  // never two at once
      }
      CHECK(kinds_ok);
      CHECK(serial);
    }
  }
}

TEST_CASE("a mismatched collective fails at wait() on every rank; the stream then fails fast, quoting it") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    std::vector<std::string> first(n), queued(n), later(n), split_error(n);
    std::vector<int> later_ready_at_once(n, -1);
    ThreadGroup(n, kShort).run([&](ThreadComm& comm) {
      const int r = comm.rank();
      Async a(comm);
      float x[3] = {1, 2, 3}, y[4];  // y: room for an all_gather of one float from 4 ranks
      const std::size_t count = r == n - 1 ? 3 : 2;  // the last rank disagrees on the count
      Work bad = a.all_reduce(x, y, count, DType::f32, ReduceOp::sum);
      Work behind = a.barrier();  // issued before the failure is known
      first[r] = error_of(bad);
      queued[r] = error_of(behind);
      Work after = a.all_gather(x, y, 1, DType::f32);  // issued once it is known
      later_ready_at_once[r] = after.ready();
      later[r] = error_of(after);
      try {
        (void)a.split(0, r);
      } catch (const fsdp::Error& e) {
        split_error[r] = e.what();
      }
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CAPTURE(first[r]);
      CAPTURE(queued[r]);
      CAPTURE(later[r]);
      CHECK(contains(first[r], "fsdp: "));
      CHECK(contains(first[r], "collective mismatch"));
      CHECK(contains(queued[r], "barrier not run: an earlier collective on this stream failed"));
      CHECK(contains(queued[r], "collective mismatch"));  // quotes the failure
      CHECK(later_ready_at_once[r] == 1);
      CHECK(contains(later[r], "rank " + std::to_string(r) + ": all_gather " + std::to_string(4 * n) + " B not run"));
      CHECK(contains(later[r], "collective mismatch"));
      CHECK(contains(split_error[r], "split not run"));
    }
  }
}

namespace {

// One rank whose all_reduce waits at a gate the test opens, then throws a non-fsdp
// exception if told to: the test decides what the worker is doing and when.
struct ScriptedComm {
  std::atomic<int> ran{0};
  std::promise<void> open;
  std::shared_future<void> gate = open.get_future().share();
  bool all_reduce_throws = true;

  int rank() const { return 0; }
  int size() const { return 1; }
  Work all_gather(const void*, void*, std::size_t, DType) { ++ran; return {}; }
  Work reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp) { ++ran; return {}; }
  Work all_reduce(const void*, void*, std::size_t, DType, ReduceOp) {
    ++ran;
    gate.wait();
    if (all_reduce_throws) throw std::logic_error("injected failure");
    return {};
  }
  Work broadcast(const void*, void*, std::size_t, DType, int) { ++ran; return {}; }
  Work barrier() { ++ran; return {}; }
};
static_assert(fsdp::Communicator<ScriptedComm>);

}  // namespace

TEST_CASE("wait() rethrows the wrapped exception as thrown; work queued behind it fails without running") {
  ScriptedComm inner;
  fsdp::Trace trace(0);
  {
    fsdp::AsyncCommunicator a(inner, &trace);
    float buf[4] = {};
    Work bad = a.all_reduce(buf, buf, 2, DType::f32, ReduceOp::sum);  // held at the gate
    Work q1 = a.barrier();
    Work q2 = a.all_gather(buf, buf, 4, DType::f32);
    CHECK(!bad.ready());
    CHECK(!q1.ready());
    inner.open.set_value();
    CHECK_THROWS_WITH_AS(bad.wait(), "injected failure", std::logic_error);  // not wrapped, not converted
    CHECK(error_of(q1) ==
          "fsdp: rank 0: barrier not run: an earlier collective on this stream failed (all_reduce 8 B): injected failure");
    CHECK(contains(error_of(q2), "all_gather 16 B not run"));
    Work q3 = a.broadcast(buf, buf, 1, DType::f32, 0);
    CHECK(q3.ready());  // failed at once
    CHECK(contains(error_of(q3), "broadcast 4 B not run"));
    CHECK(inner.ran == 1);  // only the failing all_reduce ever reached the wrapped communicator
  }
  CHECK(inner.ran == 1);  // nor did destruction run anything
  const auto ev = trace.events();
  REQUIRE(ev.size() == 1);  // work that never ran is not traced
  CHECK(ev[0].name == "all_reduce 8 B (failed)");
  CHECK(ev[0].category == "all_reduce");
}

TEST_CASE("destruction finishes queued work; the Work handles outlive the communicator") {
  SUBCASE("scripted: six collectives still queued when the destructor starts all run") {
    ScriptedComm inner;
    inner.all_reduce_throws = false;
    std::vector<Work> works;
    std::thread opener;
    {
      fsdp::AsyncCommunicator a(inner);
      works.push_back(a.all_reduce(nullptr, nullptr, 0, DType::f32, ReduceOp::sum));  // held at the gate
      for (int i = 0; i < 5; ++i) works.push_back(a.barrier());
      opener = std::thread([&] {
        std::this_thread::sleep_for(50ms);
        inner.open.set_value();
      });
    }  // returns only once all six ran
    CHECK(inner.ran == 6);
    for (auto& w : works) CHECK(error_of(w) == "no error");
    opener.join();
  }
  SUBCASE("thread group: in-flight all_reduces complete with the right values") {
    constexpr int kOps = 10;
    std::vector<std::vector<double>> got(2);
    ThreadGroup(2, kShort).run([&](ThreadComm& comm) {
      std::vector<double> in(kOps), out(kOps, -1);
      std::vector<Work> works;
      {
        Async a(comm);
        for (int i = 0; i < kOps; ++i) {
          in[i] = i + comm.rank();
          works.push_back(a.all_reduce(&in[i], &out[i], 1, DType::f64, ReduceOp::sum));
        }
      }
      got[comm.rank()] = out;
    });
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < kOps; ++i) CHECK(got[r][i] == 2 * i + 1);
  }
}

TEST_CASE("destruction with a collective whose peer never comes returns when the wrapped timeout fires") {
  // Rank 1 never issues. Rank 0's destructor waits for its queued all_reduce, which
  // ThreadComm fails after 200 ms; the barrier behind it is dropped; nothing hangs.
  std::vector<double> dtor_ms(2);
  std::string first, second;
  ThreadGroup(2, fsdp::ThreadGroupOptions{200ms}).run([&](ThreadComm& comm) {
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(600ms);  // outlives rank 0's timeout: the timeout, not its exit, unblocks rank 0
      return;
    }
    double x = 1, y = 0;
    std::vector<Work> works;
    Clock::time_point t0;
    {
      Async a(comm);
      works.push_back(a.all_reduce(&x, &y, 1, DType::f64, ReduceOp::sum));
      works.push_back(a.barrier());
      t0 = Clock::now();
    }
    dtor_ms[0] = ms_since(t0);
    first = error_of(works[0]);
    second = error_of(works[1]);
  });
  CAPTURE(first);
  CAPTURE(second);
  CHECK(dtor_ms[0] >= 150);  // it did wait for the queued collective...
  CHECK(dtor_ms[0] < 550);   // ...and was released by the timeout, not by rank 1 leaving
  CHECK(contains(first, "timed out after 200 ms"));
  CHECK(contains(second, "barrier not run: an earlier collective on this stream failed (all_reduce 8 B)"));
  CHECK(contains(second, "timed out"));
}

TEST_CASE("split: a 2x2 DeviceMesh over async streams, one stream per group") {
  // all_reduce of world ranks: shard group g = {2g, 2g+1} sums to 4g+1, replicate group
  // j = {j, j+2} to 2j+2. Rank 1 issues its shard-group collective 150 ms late; rank 0's
  // replicate-group collective, issued after its shard-group one, still completes at once,
  // which it could not if the groups shared a stream.
  std::vector<int> shard_sum(4, -1), replicate_sum(4, -1), shard_size(4), replicate_size(4);
  std::vector<double> replicate_ms(4), shard_ms(4);
  std::vector<int> traced_all_reduce(4), traced_split(4);
  ThreadGroup(4, kShort).run([&](ThreadComm& comm) {
    const int r = comm.rank();
    fsdp::Trace trace(r);
    Async world(comm, &trace);
    fsdp::DeviceMesh<Async> mesh(world, fsdp::MeshShape{2, 2});
    shard_size[r] = mesh.shard_group().size();
    replicate_size[r] = mesh.replicate_group().size();
    mesh.shard_group().barrier().wait();
    mesh.replicate_group().barrier().wait();
    if (r == 1) std::this_thread::sleep_for(150ms);
    int me = r, s = -1, p = -1;
    const auto t0 = Clock::now();
    Work ws = mesh.shard_group().all_reduce(&me, &s, 1, DType::i32, ReduceOp::sum);
    Work wr = mesh.replicate_group().all_reduce(&me, &p, 1, DType::i32, ReduceOp::sum);
    wr.wait();
    replicate_ms[r] = ms_since(t0);
    ws.wait();
    shard_ms[r] = ms_since(t0);
    shard_sum[r] = s;
    replicate_sum[r] = p;
    for (const auto& e : trace.events()) {  // split groups record into the world's trace
      traced_all_reduce[r] += e.category == "all_reduce";
      traced_split[r] += e.category == "split";
    }
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(shard_size[r] == 2);
    CHECK(replicate_size[r] == 2);
    CHECK(shard_sum[r] == 4 * (r / 2) + 1);
    CHECK(replicate_sum[r] == 2 * (r % 2) + 2);
    CHECK(traced_all_reduce[r] == 2);
    CHECK(traced_split[r] == 2);
  }
  CHECK(replicate_ms[0] < 75);  // its partner, rank 2, was on time
  CHECK(shard_ms[0] >= 100);    // its partner, rank 1, was 150 ms late
}

TEST_CASE("set_trace: one communication span per collective, named by kind and size, while it runs") {
  std::vector<std::vector<fsdp::Trace::Event>> events(2);
  std::vector<Clock::time_point> issued(2), done(2);
  ThreadGroup(2, kShort).run([&](ThreadComm& comm) {
    const int r = comm.rank();
    fsdp::Trace trace(r);
    Async a(comm);
    a.barrier().wait();  // before set_trace: not recorded
    a.set_trace(&trace);
    std::vector<float> shard(6144), full(12288), v(256);
    std::vector<double> d(200), dr(100);
    std::uint8_t bytes[3] = {1, 2, 3};
    issued[r] = Clock::now();
    std::vector<Work> works;
    works.push_back(a.all_gather(shard.data(), full.data(), 6144, DType::f32));                  // 48 KB gathered
    works.push_back(a.reduce_scatter(d.data(), dr.data(), 100, DType::f64, ReduceOp::sum));      // 1600 B in
    works.push_back(a.all_reduce(v.data(), v.data(), 256, DType::f32, ReduceOp::max));           // 1 KB
    works.push_back(a.broadcast(bytes, bytes, 3, DType::u8, 1));                                 // 3 B
    works.push_back(a.barrier());
    for (auto& w : works) w.wait();
    done[r] = Clock::now();
    a.set_trace(nullptr);
    a.barrier().wait();  // after set_trace(nullptr): not recorded
    events[r] = trace.events();
  });
  const std::vector<std::pair<std::string, std::string>> want = {{"all_gather 48 KB", "all_gather"},
                                                                 {"reduce_scatter 1.6 KB", "reduce_scatter"},
                                                                 {"all_reduce 1 KB", "all_reduce"},
                                                                 {"broadcast 3 B", "broadcast"},
                                                                 {"barrier", "barrier"}};
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE(events[r].size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      const auto& e = events[r][i];
      CHECK(e.name == want[i].first);
      CHECK(e.category == want[i].second);
      CHECK(e.lane == fsdp::Trace::Lane::communication);
      CHECK(issued[r] <= e.begin);
      CHECK(e.begin <= e.end);
      CHECK(e.end <= done[r]);
    }
  }
}

TEST_CASE("a moved-from communicator refuses calls instead of crashing; the moved-to one works") {
  std::string err;
  int sum = 0;
  ThreadGroup(1, kShort).run([&](ThreadComm& comm) {
    Async a(comm);
    Async b = std::move(a);
    try {
      (void)a.barrier();  // NOLINT(bugprone-use-after-move): that is the point
    } catch (const fsdp::Error& e) {
      err = e.what();
    }
    int one = 1;
    b.all_reduce(&one, &sum, 1, DType::i32, ReduceOp::sum).wait();
  });
  CHECK(contains(err, "moved-from"));
  CHECK(sum == 1);
}

}  // namespace core_async_communicator_test
