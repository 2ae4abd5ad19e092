// fsdp/asio/ring.hpp: the ring schedules, carried out by a simulated network in which a
// frame moves only when its sender and its receiver are both ready for it (no buffering
// at all, the strictest case: a plan that finishes here finishes over any sockets), in a
// random order. Checks results against the documented ring order bit for bit, that every
// link carries each byte once, and that no plan deadlocks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "collective_cases.hpp"
#include "fsdp/asio/ring.hpp"
#include "test/support/sanitized.hpp"

namespace asio_ring_test {

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using K = fsdp::detail::CollectiveKind;
using test_support::Bytes;
using test_support::Case;

struct SimResult {
  bool finished = false;
  std::vector<Bytes> outputs;
  std::vector<std::size_t> payload_per_link;  // bytes rank r sent to rank r+1
};

SimResult simulate(const Case& c, std::size_t segment_bytes, std::uint32_t seed, std::uint32_t schedule_seed = 0) {
  const int n = c.ranks;
  const auto inputs = test_support::inputs_for(c, seed);
  std::vector<test_support::RankBuffers> bufs;
  std::vector<fsdp::detail::RingPlanner> planners;
  std::vector<const fsdp::detail::RingPlan*> plans;
  for (int r = 0; r < n; ++r) {
    bufs.emplace_back(c, inputs[r], r);
    planners.emplace_back(r, n, segment_bytes);
  }
  for (int r = 0; r < n; ++r) {
    plans.push_back(&planners[r].plan(bufs[r].call(c)));
    for (const auto& l : plans[r]->local) fsdp::detail::run_local(l, c.dtype, n);
  }
  std::vector<std::size_t> sent(n, 0), received(n, 0);
  SimResult res;
  res.payload_per_link.assign(n, 0);
  std::mt19937 rng(schedule_seed ? schedule_seed : seed);
  for (;;) {
    std::vector<int> ready;  // links r -> r+1 that can move a frame now
    bool done = true;
    for (int r = 0; r < n; ++r) {
      const auto& p = *plans[r];
      done = done && sent[r] == p.sends.size() && received[r] == p.recvs.size();
      const int to = (r + 1) % n;
      const auto& q = *plans[to];
      if (sent[r] < p.sends.size() && p.sends[sent[r]].after_recv < static_cast<std::int64_t>(received[r]) &&
          received[to] < q.recvs.size() && q.recvs[received[to]].after_send < static_cast<std::int64_t>(sent[to]))
        ready.push_back(r);
    }
    if (done) break;
    if (ready.empty()) return res;  // deadlock
    const int r = ready[std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(rng)];
    const int to = (r + 1) % n;
    const auto& s = plans[r]->sends[sent[r]++];
    const auto& f = plans[to]->recvs[received[to]++];
    REQUIRE(s.bytes == f.bytes);
    if (f.bytes) std::memcpy(f.dest, s.data, f.bytes);
    fsdp::detail::finish_recv(f, c.dtype, c.op, n);
    res.payload_per_link[r] += s.bytes;
  }
  res.finished = true;
  for (int r = 0; r < n; ++r) res.outputs.push_back(bufs[r].result(c));
  return res;
}

void check(const Case& c, std::size_t segment_bytes, std::uint32_t seed = 1) {
  CAPTURE(c.str());
  CAPTURE(segment_bytes);
  const auto res = simulate(c, segment_bytes, seed);
  REQUIRE(res.finished);
  const auto inputs = test_support::inputs_for(c, seed);
  for (int r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    CHECK(res.outputs[r] == test_support::ring_expected(c.kind, inputs, r, c.count, c.dtype, c.op, c.root));
  }
}

}  // namespace

// Under a sanitizer every 13th combination, 45 of 576 (test/support/sanitized.hpp): this is one
// thread's arithmetic, 18 s of TSan's run for all of them.
TEST_CASE("every collective matches the ring-order reference, for every world size, count and segment size") {
  std::uint64_t i = 0;
  for (int n = 1; n <= 8; ++n)
    for (std::size_t count : {0, 1, 2, 3, 5, 7, 16, 33, 100})
      for (std::size_t seg : {4, 12, 64, 1 << 20})
        for (bool in_place : {false, true}) {
          if (!test_support::sweep_takes(i++)) continue;
          check({K::all_gather, n, count, DType::f32, ReduceOp::sum, 0, in_place}, seg);
          check({K::reduce_scatter, n, count, DType::f32, ReduceOp::sum, 0, in_place}, seg);
          check({K::all_reduce, n, count, DType::f32, ReduceOp::sum, 0, in_place}, seg);
          check({K::broadcast, n, count, DType::f32, ReduceOp::sum, n - 1, in_place}, seg);
        }
}

TEST_CASE("every dtype and op, bf16 and f16 sums in ring order") {
  for (auto t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64})
    for (auto op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
      for (int n : {2, 3, 5}) {
        check({K::reduce_scatter, n, 37, t, op}, 16);
        check({K::all_reduce, n, 101, t, op, 0, true}, 24);
      }
}

TEST_CASE("broadcast from every root; barrier") {
  for (int n = 1; n <= 6; ++n) {
    for (int root = 0; root < n; ++root) check({K::broadcast, n, 50, DType::i32, ReduceOp::sum, root}, 16);
    check({K::barrier, n, 0}, 64);
  }
}

TEST_CASE("each byte crosses each link once; many segments in flight never deadlock") {
  // 64 segments per step with only 2n scratch slots: the wavefront must reuse them.
  for (int n : {2, 3, 4, 8}) {
    const std::size_t count = 64 * 16;  // f32: 64 segments of 16 elements per chunk
    for (bool in_place : {false, true}) {
      check({K::reduce_scatter, n, count, DType::f32, ReduceOp::sum, 0, in_place}, 64, 7);
      check({K::all_reduce, n, count * n, DType::f32, ReduceOp::sum, 0, in_place}, 64, 7);
    }
    const Case ag{K::all_gather, n, count};
    const auto res = simulate(ag, 64, 3);
    REQUIRE(res.finished);
    for (int r = 0; r < n; ++r) CHECK(res.payload_per_link[r] == (n - 1) * count * 4);
    const Case ar{K::all_reduce, n, count * n};
    const auto res2 = simulate(ar, 64, 3);
    REQUIRE(res2.finished);
    for (int r = 0; r < n; ++r) CHECK(res2.payload_per_link[r] == 2 * (n - 1) * count * 4);
  }
}

TEST_CASE("ring_shift: each rank gets its left neighbour's buffer in one step, each byte once per link") {
  for (int n = 1; n <= 6; ++n)
    for (std::size_t count : {0, 1, 7, 100})
      for (std::size_t seg : {4, 12, 64, 1 << 20})
        for (DType t : {DType::f32, DType::i64, DType::bf16}) {
          const Case c{K::ring_shift, n, count, t};
          CAPTURE(c.str());
          CAPTURE(seg);
          check(c, seg);
          const auto res = simulate(c, seg, 2);
          REQUIRE(res.finished);
          for (int r = 0; r < n; ++r) CHECK(res.payload_per_link[r] == (n > 1 ? count * fsdp::size_of(t) : 0));
          // Frames: one per segment, and one (empty) for nothing, so that a neighbour in
          // another collective always meets one; none on one rank.
          fsdp::detail::RingPlanner planner(0, n, seg);
          Bytes send(count * fsdp::size_of(t)), recv(send.size());
          const auto& plan = planner.plan({K::ring_shift, send.data(), recv.data(), count, t});
          const std::size_t per_seg = std::max<std::size_t>(1, seg / fsdp::size_of(t));
          const std::size_t frames = n == 1 ? 0 : std::max<std::size_t>(1, (count + per_seg - 1) / per_seg);
          CHECK(plan.sends.size() == frames);
          CHECK(plan.recvs.size() == frames);
          if (n > 1) CHECK(plan.local.empty());
          else if (count) CHECK(plan.local.size() == 1);
        }
}

TEST_CASE("different schedules give the same bits") {
  const Case c{K::all_reduce, 5, 999, DType::bf16, ReduceOp::sum};
  const auto a = simulate(c, 32, 11, 100), b = simulate(c, 32, 11, 200);
  REQUIRE(a.finished);
  REQUIRE(b.finished);
  CHECK(a.outputs == b.outputs);
  for (int r = 1; r < 5; ++r) CHECK(a.outputs[r] == a.outputs[0]);
}

TEST_CASE("the test inputs make the summation order visible") {
  // Otherwise the bit-for-bit checks against the ring order would prove nothing about it:
  // the same bf16 / f16 sum in rank order 0..N-1 (ThreadComm's) must differ somewhere.
  for (DType t : {DType::bf16, DType::f16}) {
    const Case c{K::all_reduce, 4, 999, t, ReduceOp::sum};
    const auto inputs = test_support::inputs_for(c, 21);
    const Bytes ring = test_support::ring_expected(c.kind, inputs, 0, c.count, t, c.op, 0);
    Bytes rank_order = inputs[0];
    for (int r = 1; r < 4; ++r) fsdp::detail::host_combine(rank_order.data(), inputs[r].data(), c.count, t, c.op);
    CHECK(ring != rank_order);
  }
}

}  // namespace asio_ring_test
