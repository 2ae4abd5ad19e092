// fsdp/asio/tcp_comm.hpp: results. Every collective on 1..8 ranks (1..4 and 8 under a
// sanitizer; threads with their own TcpComm over loopback sockets) against the ring-order
// reference bit for bit, equality with ThreadComm on 2 ranks, run-to-run reproducibility,
// asynchrony, split and a 2x2 DeviceMesh. Failures are in tcp_comm_failure_test.cpp.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "collective_cases.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/host/thread_group.hpp"
#include "tcp_cases.hpp"
#include "test/asio/tcp_world.hpp"
#include "test/support/sanitized.hpp"

namespace asio_tcp_comm_test {

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::TcpComm;
using K = fsdp::detail::CollectiveKind;
using test_support::Bytes;
using test_support::Case;
using test_support::TcpWorld;
using test_support::check_against_reference;
using test_support::issue;
using test_support::run_cases;
using namespace std::chrono_literals;

constexpr DType kDtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

}  // namespace

// Under a sanitizer on 1 to 4 and 8 ranks (test/support/sanitized.hpp): 5 to 7 threads of
// ranks take most of the time and reach no code that 4 and 8 do not.
TEST_CASE("every collective on 1..8 ranks equals the ring-order reference, bit for bit") {
  for (int n = 1; n <= 8; ++n)
    for (int io : test_support::kIoThreads) {
      if (test_support::sanitized && n > 4 && n < 8) continue;
      CAPTURE(n);
      CAPTURE(io);
      // Small segments: the larger counts take several frames per step.
      TcpWorld world(n, test_support::ok_options(64, io));
      std::vector<Case> cases;
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n > 1 ? n - 1 : 2), std::size_t{7},
                                std::size_t{1003}})
        for (bool in_place : {false, true}) {
          cases.push_back({K::all_gather, n, count, DType::f32, ReduceOp::sum, 0, in_place});
          cases.push_back({K::reduce_scatter, n, count, DType::f32, ReduceOp::sum, 0, in_place});
          cases.push_back({K::all_reduce, n, count, DType::f32, ReduceOp::sum, 0, in_place});
          cases.push_back({K::broadcast, n, count, DType::i32, ReduceOp::sum, n - 1, in_place});
          cases.push_back({K::broadcast, n, count, DType::f64, ReduceOp::sum, 0, in_place});
        }
      cases.push_back({K::barrier, n, 0});
      check_against_reference(world, cases);
    }
}

TEST_CASE("every dtype and op, f16 and bf16 sums included") {
  for (int n : {3, 4}) {
    TcpWorld world(n, test_support::ok_options(24, n - 2));  // sending on the I/O thread / its own
    std::vector<Case> cases;
    for (DType t : kDtypes)
      for (ReduceOp op : kOps) {
        cases.push_back({K::reduce_scatter, n, 37, t, op});
        cases.push_back({K::all_reduce, n, 101, t, op, 0, true});
      }
    for (DType t : kDtypes) cases.push_back({K::all_gather, n, 13, t});
    check_against_reference(world, cases);
  }
}

TEST_CASE("the 8-bit floats: f8 in every op, e8m0 in max and min, all three gathered and broadcast") {
  const DType f8[] = {DType::f8e4m3, DType::f8e5m2}, all8[] = {DType::f8e4m3, DType::f8e5m2, DType::e8m0};
  std::vector<Case> cases;
  for (DType t : f8)
    for (ReduceOp op : kOps) {
      cases.push_back({K::reduce_scatter, 3, 37, t, op});
      cases.push_back({K::all_reduce, 3, 101, t, op, 0, true});
    }
  for (ReduceOp op : {ReduceOp::max, ReduceOp::min}) {
    cases.push_back({K::reduce_scatter, 3, 37, DType::e8m0, op});
    cases.push_back({K::all_reduce, 3, 101, DType::e8m0, op, 0, true});
  }
  for (DType t : all8) {
    cases.push_back({K::all_gather, 3, 13, t});
    cases.push_back({K::broadcast, 3, 29, t, ReduceOp::sum, 2});
  }
  TcpWorld world(3, test_support::ok_options(24, 1));  // small segments: several frames per step
  check_against_reference(world, cases);
}

// Under a sanitizer on 2 and 3 ranks (test/support/sanitized.hpp): both ways of sending,
// without the 4 ranks that took 40% of its 18 s under TSan.
TEST_CASE("large messages (a few MiB per rank) with the default segment size") {
  for (int n : {2, 3, 4}) {
    if (test_support::sanitized && n == 4) continue;
    TcpWorld world(n, test_support::ok_options(1 << 20, n == 3 ? 1 : 2));
    const std::size_t count = (3u << 20) / 4 + 5;  // ~3 MiB of f32: several 1 MiB segments, a ragged end
    check_against_reference(world, {{K::all_gather, n, count},
                                    {K::reduce_scatter, n, count, DType::f32, ReduceOp::sum, 0, true},
                                    {K::all_reduce, n, count + 1, DType::bf16, ReduceOp::sum},
                                    {K::broadcast, n, count, DType::f32, ReduceOp::sum, 1}});
  }
}

TEST_CASE("on 2 ranks every result equals ThreadComm's bit for bit") {
  std::vector<Case> cases;
  for (DType t : kDtypes) {
    for (ReduceOp op : kOps) {
      cases.push_back({K::reduce_scatter, 2, 333, t, op});
      cases.push_back({K::all_reduce, 2, 777, t, op, 0, true});
    }
    cases.push_back({K::all_gather, 2, 100, t});
    cases.push_back({K::broadcast, 2, 100, t, ReduceOp::sum, 1});
    cases.push_back({K::ring_shift, 2, 100, t});
  }
  TcpWorld world(2, test_support::ok_options(64, 2));
  const auto tcp = run_cases(world, cases, 5);
  std::vector<std::vector<Bytes>> thread(cases.size(), std::vector<Bytes>(2));
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    for (std::size_t i = 0; i < cases.size(); ++i) {
      test_support::RankBuffers b(cases[i], test_support::random_input(cases[i], r, 5 + static_cast<std::uint32_t>(i)), r);
      issue(comm, b.call(cases[i])).wait();
      thread[i][r] = b.result(cases[i]);
    }
  });
  for (std::size_t i = 0; i < cases.size(); ++i)
    for (int r = 0; r < 2; ++r) {
      CAPTURE(cases[i].str());
      CHECK(tcp[i][r] == thread[i][r]);
    }
}

TEST_CASE("results are bitwise the same from run to run") {
  const std::vector<Case> cases{{K::all_reduce, 5, 4099, DType::bf16, ReduceOp::sum},
                                {K::reduce_scatter, 5, 999, DType::f32, ReduceOp::avg}};
  std::vector<std::vector<std::vector<Bytes>>> runs;
  for (int io : test_support::kIoThreads) {  // different threads, timing and framing; same order
    TcpWorld world(5, test_support::ok_options(io == 1 ? 32 : 1 << 20, io));
    runs.push_back(run_cases(world, cases, 9));
  }
  CHECK(runs[0] == runs[1]);
  for (int r = 1; r < 5; ++r) CHECK(runs[0][0][r] == runs[0][0][0]);  // all_reduce: the same on every rank
}

TEST_CASE("collectives return at once and complete in order on the communicator's thread") {
  TcpWorld world(3, test_support::ok_options(1 << 20, 2));
  std::atomic<bool> issued{false};
  std::vector<int> ok(3, 0);
  const auto errors = world.each([&](TcpComm& comm, int r) {
    std::vector<float> in(1000, static_cast<float>(r + 1)), out(1000, 0);
    if (r == 0) {
      // Issued before any peer calls: it cannot have completed, yet the call returned.
      const auto t0 = std::chrono::steady_clock::now();
      fsdp::Work w = comm.all_reduce(in.data(), out.data(), in.size(), DType::f32, ReduceOp::sum);
      const bool returned_fast = std::chrono::steady_clock::now() - t0 < 100ms;
      const bool pending = !w.ready();
      issued = true;
      w.wait();
      ok[r] = returned_fast && pending && out[999] == 6.0f;
    } else {
      while (!issued) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(50ms);
      comm.all_reduce(in.data(), out.data(), in.size(), DType::f32, ReduceOp::sum).wait();
      ok[r] = out[0] == 6.0f;
    }
    // Several outstanding at once, waited in reverse order.
    constexpr int kCalls = 6;
    std::vector<std::vector<std::int32_t>> bufs(kCalls, std::vector<std::int32_t>(3 * 64));
    std::vector<std::int32_t> mine(64 * kCalls);
    std::vector<fsdp::Work> works;
    for (int i = 0; i < kCalls; ++i) {
      for (int k = 0; k < 64; ++k) mine[i * 64 + k] = r * 1000 + i;
      works.push_back(comm.all_gather(mine.data() + i * 64, bufs[i].data(), 64, DType::i32));
    }
    bool in_order = true;
    for (int i = kCalls - 1; i >= 0; --i) {
      works[i].wait();
      for (int j = 0; j < i; ++j) in_order = in_order && works[j].ready();  // earlier ones finished first
      for (int q = 0; q < 3; ++q) in_order = in_order && bufs[i][q * 64 + 5] == q * 1000 + i;
    }
    ok[r] = ok[r] && in_order;
  });
  for (int r = 0; r < 3; ++r) {
    CHECK_MESSAGE(errors[r].empty(), errors[r]);
    CHECK_MESSAGE(ok[r], "rank ", r);
  }
}

// 1003 f32 / i64 / bf16 elements in 64-byte segments: 63, 126 and 32 frames; over shared
// memory and over the sockets alone.
TEST_CASE("ring_shift on 1..4 ranks: each rank receives its left neighbour's buffer, across many segments") {
  static_assert(fsdp::RingShiftCommunicator<TcpComm>);
  for (int n = 1; n <= 4; ++n)
    for (int io : test_support::kIoThreads)
      for (bool shm : {true, false}) {
        CAPTURE(n);
        CAPTURE(io);
        CAPTURE(shm);
        auto o = test_support::ok_options(64, io);
        o.shared_memory = shm;
        TcpWorld world(n, o);
        std::vector<Case> cases;
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1003}})
          cases.push_back({K::ring_shift, n, count, DType::f32});
        cases.push_back({K::ring_shift, n, 1003, DType::i64});
        cases.push_back({K::ring_shift, n, 1003, DType::bf16});
        cases.push_back({K::all_gather, n, 5, DType::f32});  // the ring stays in step after it
        check_against_reference(world, cases);
      }
}

TEST_CASE("ring_shift: recv holds rank r-1's values, send and the bytes past recv are untouched") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    TcpWorld world(n, test_support::ok_options(48, 1));
    const std::size_t count = 1000;  // 84 frames of 12 f32, 167 of 6 i64: ragged ends
    std::vector<int> bad(n, -1);
    const auto errors = world.each([&](TcpComm& comm, int r) {
      std::vector<float> send(count), recv(count + 3, -1.0f);
      std::vector<std::int64_t> send64(count), recv64(count + 3, -1);
      for (std::size_t i = 0; i < count; ++i) {
        send[i] = static_cast<float>(1000 * r + static_cast<int>(i));
        send64[i] = (std::int64_t{1} << 40) * r + static_cast<std::int64_t>(i);  // the high word too
      }
      const auto sent = send;
      const auto sent64 = send64;
      comm.ring_shift(send.data(), recv.data(), count, DType::f32).wait();
      comm.ring_shift(send64.data(), recv64.data(), count, DType::i64).wait();
      const int left = (r + n - 1) % n;
      int b = send != sent || send64 != sent64;
      for (std::size_t i = 0; i < count; ++i) {
        b += recv[i] != static_cast<float>(1000 * left + static_cast<int>(i));
        b += recv64[i] != (std::int64_t{1} << 40) * left + static_cast<std::int64_t>(i);
      }
      for (std::size_t i = count; i < count + 3; ++i) b += recv[i] != -1.0f || recv64[i] != -1;
      bad[r] = b;
    });
    for (int r = 0; r < n; ++r) {
      CHECK_MESSAGE(errors[r].empty(), errors[r]);
      CHECK_MESSAGE(bad[r] == 0, "rank ", r);
    }
  }
}

TEST_CASE("the frame header carries ring_shift, and refuses the kind code past it") {
  std::array<std::byte, fsdp::detail::FrameHeader::kSize> bytes{};
  fsdp::detail::CollectiveCall c{K::ring_shift, nullptr, nullptr, 7, DType::bf16};
  c.seq = 3;
  fsdp::detail::FrameHeader::data_for(c, 2, 14).encode(bytes.data());
  std::string problem;
  const auto back = fsdp::detail::FrameHeader::decode(bytes.data(), problem);
  CAPTURE(problem);
  REQUIRE(back);
  CHECK(back->kind == K::ring_shift);
  CHECK(back->matches(c));
  CHECK(back->call().describe() == "ring_shift(count=7, dtype=bf16) as collective #3");
  bytes[5] = std::byte{static_cast<unsigned char>(static_cast<int>(K::ring_shift) + 1)};  // the kind's byte
  CHECK_FALSE(fsdp::detail::FrameHeader::decode(bytes.data(), problem));
  CHECK(problem == "frame names an unknown collective, dtype or op");
}

TEST_CASE("split: MPI_Comm_split semantics; a 2x2 DeviceMesh over TcpComm") {
  TcpWorld world(4, test_support::ok_options(64, 2));
  std::vector<std::vector<int>> seen(4);
  const auto errors = world.each([&](TcpComm& comm, int r) {
    // Colors 0 / 1 by parity, ordered by descending key: group ranks reverse world order.
    TcpComm half = comm.split(r % 2, -r);
    std::vector<std::int32_t> mine{r}, all(2);
    half.all_gather(mine.data(), all.data(), 1, DType::i32).wait();
    fsdp::DeviceMesh<TcpComm> mesh(comm, {2, 2});
    std::vector<float> shard{static_cast<float>(r)}, full(2);
    mesh.shard_group().all_gather(shard.data(), full.data(), 1, DType::f32).wait();
    std::vector<float> grad{static_cast<float>(r)}, sum(1);
    mesh.replicate_group().all_reduce(grad.data(), sum.data(), 1, DType::f32, ReduceOp::sum).wait();
    TcpComm moved = std::move(half);  // movable, still working
    moved.barrier().wait();
    seen[r] = {moved.rank(), moved.size(), all[0], all[1], static_cast<int>(full[0]), static_cast<int>(full[1]),
               static_cast<int>(sum[0]), mesh.shard_group().rank(), mesh.replicate_group().rank()};
  });
  for (int r = 0; r < 4; ++r) REQUIRE_MESSAGE(errors[r].empty(), errors[r]);
  // world 0,2 -> color 0 in order (2, 0); world 1,3 -> color 1 in order (3, 1).
  CHECK(seen[0] == std::vector<int>{1, 2, 2, 0, 0, 1, 2, 0, 0});
  CHECK(seen[1] == std::vector<int>{1, 2, 3, 1, 0, 1, 4, 1, 0});
  CHECK(seen[2] == std::vector<int>{0, 2, 2, 0, 2, 3, 2, 0, 1});
  CHECK(seen[3] == std::vector<int>{0, 2, 3, 1, 2, 3, 4, 1, 1});
}

}  // namespace asio_tcp_comm_test
