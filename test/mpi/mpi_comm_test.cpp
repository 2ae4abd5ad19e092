// fsdp/mpi/mpi_comm.hpp: every collective of MpiComm, run as every rank of an mpirun job
// (test/mpi/mpi_comm_test.sh runs it for several world sizes). Results are checked bitwise
// against references computed here: inputs whose partial sums are exact in every dtype, so
// MPI's grouping of the terms cannot show, reduced with detail::host_combine in rank order.
// Counts 0, 1 and counts that no world size divides; NCCL's in-place forms; every dtype and
// reduce op; the Work handles (out-of-order waits, ready(), dropped handles).
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#include "fsdp/comm/async_communicator.hpp"
#include "test/mpi/mpi_test_support.hpp"

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using test_mpi::Bytes;
using test_mpi::difference;
using test_mpi::label;

constexpr std::byte kUntouched{0xEE};  // what receive buffers hold before a collective
constexpr std::size_t kGuard = 16;      // bytes after each receive buffer that must stay untouched

bool guard_intact(const Bytes& b, std::size_t used) {
  for (std::size_t i = used; i < b.size(); ++i)
    if (b[i] != kUntouched) return false;
  return true;
}

TEST_CASE("MpiSession: MPI_THREAD_MULTIPLE, and world() is MPI_COMM_WORLD's ranks") {
  auto& s = test_mpi::session();
  CHECK(s.thread_level() == MPI_THREAD_MULTIPLE);
  CHECK_FALSE(s.serialized());
  CHECK_FALSE(s.failed());
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto world = test_mpi::world();
  CHECK(world.rank() == rank);
  CHECK(world.size() == size);
  CHECK(s.world_rank() == rank);
  CHECK(world.name() == "world");
  int compare = MPI_UNEQUAL;
  MPI_Comm_compare(world.native(), MPI_COMM_WORLD, &compare);
  CHECK(compare == MPI_CONGRUENT);  // a duplicate: same ranks, its own context
  {
    fsdp::MpiSession second;  // joins the live session: MPI is initialized once
    CHECK(second.datatype(DType::bf16) == s.datatype(DType::bf16));
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  CHECK(finalized == 0);  // the first session still holds MPI
  world.barrier().wait();
}

TEST_CASE("all_gather: every dtype, counts 0, 1, 5, 13, out of place and in place") {
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank();
  for (DType t : test_mpi::kAllDTypes) {
    for (std::size_t count : test_mpi::kCounts) {
      const std::size_t chunk = count * fsdp::size_of(t);
      for (bool in_place : {false, true}) {
        Bytes recv(chunk * n + kGuard, kUntouched);
        Bytes send = test_mpi::input(me, count, t);
        if (in_place) {
          std::memcpy(recv.data() + me * chunk, send.data(), chunk);
          comm.all_gather(recv.data() + me * chunk, recv.data(), count, t).wait();
        } else {
          comm.all_gather(send.data(), recv.data(), count, t).wait();
        }
        for (int r = 0; r < n; ++r) {
          const Bytes want = test_mpi::input(r, count, t);
          CHECK_MESSAGE(difference(recv.data() + r * chunk, want.data(), count, t) == "",
                        label(comm, "all_gather", t, count, in_place), ", chunk of rank ", r, ": ",
                        difference(recv.data() + r * chunk, want.data(), count, t));
        }
        CHECK_MESSAGE(guard_intact(recv, chunk * n), label(comm, "all_gather", t, count, in_place));
      }
    }
  }
}

TEST_CASE("reduce_scatter: every dtype and op, counts 0, 1, 5, 13, out of place and in place") {
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank();
  for (DType t : test_mpi::kAllDTypes) {
    for (ReduceOp op : test_mpi::kAllOps) {
      for (std::size_t count : test_mpi::kCounts) {
        const std::size_t chunk = count * fsdp::size_of(t);
        const Bytes want = test_mpi::reference_reduce(n, me * count, count, count * n, t, op);
        for (bool in_place : {false, true}) {
          Bytes send = test_mpi::input(me, count * n, t);
          Bytes recv(chunk + kGuard, kUntouched);
          const std::byte* got = recv.data();
          if (in_place) {
            comm.reduce_scatter(send.data(), send.data() + me * chunk, count, t, op).wait();
            got = send.data() + me * chunk;
          } else {
            comm.reduce_scatter(send.data(), recv.data(), count, t, op).wait();
            CHECK(guard_intact(recv, chunk));
          }
          CHECK_MESSAGE(difference(got, want.data(), count, t) == "", label(comm, "reduce_scatter", t, count, in_place),
                        " op ", fsdp::name_of(op), ": ", difference(got, want.data(), count, t));
        }
      }
    }
  }
}

TEST_CASE("all_reduce: every dtype and op, counts 0, 1, 5, 13, out of place and in place") {
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank();
  for (DType t : test_mpi::kAllDTypes) {
    for (ReduceOp op : test_mpi::kAllOps) {
      for (std::size_t count : test_mpi::kCounts) {
        const std::size_t bytes = count * fsdp::size_of(t);
        const Bytes want = test_mpi::reference_reduce(n, 0, count, count, t, op);
        for (bool in_place : {false, true}) {
          Bytes send = test_mpi::input(me, count, t);
          Bytes recv(bytes + kGuard, kUntouched);
          const std::byte* got = recv.data();
          if (in_place) {
            comm.all_reduce(send.data(), send.data(), count, t, op).wait();
            got = send.data();
          } else {
            comm.all_reduce(send.data(), recv.data(), count, t, op).wait();
            CHECK(guard_intact(recv, bytes));
            CHECK(send == test_mpi::input(me, count, t));  // the input is only read
          }
          CHECK_MESSAGE(difference(got, want.data(), count, t) == "", label(comm, "all_reduce", t, count, in_place),
                        " op ", fsdp::name_of(op), ": ", difference(got, want.data(), count, t));
        }
      }
    }
  }
}

TEST_CASE("broadcast: every root and dtype; in place on the root; other ranks' send is never read") {
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank();
  for (int root = 0; root < n; ++root) {
    for (DType t : test_mpi::kAllDTypes) {
      for (std::size_t count : test_mpi::kCounts) {
        const std::size_t bytes = count * fsdp::size_of(t);
        const Bytes want = test_mpi::input(root, count, t);
        for (bool in_place : {false, true}) {
          Bytes recv(bytes + kGuard, kUntouched);
          Bytes send = test_mpi::input(me, count, t);
          const void* src = send.data();
          if (me != root) {
            src = nullptr;  // off the root, send may be anything
          } else if (in_place) {
            std::memcpy(recv.data(), send.data(), bytes);
            src = recv.data();
          }
          comm.broadcast(src, recv.data(), count, t, root).wait();
          CHECK_MESSAGE(difference(recv.data(), want.data(), count, t) == "",
                        label(comm, "broadcast", t, count, in_place), " root ", root);
          CHECK(guard_intact(recv, bytes));
        }
      }
    }
  }
}

TEST_CASE("ring_shift: every dtype, counts 0, 1, 5, 13 and 100000; rank r receives rank r-1's buffer") {
  static_assert(fsdp::RingShiftCommunicator<fsdp::MpiComm>);
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank(), left = (me + n - 1) % n;
  for (DType t : test_mpi::kAllDTypes) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{13}, std::size_t{100000}}) {
      const std::size_t bytes = count * fsdp::size_of(t);
      const Bytes send = test_mpi::input(me, count, t);
      Bytes recv(bytes + kGuard, kUntouched);
      comm.ring_shift(send.data(), recv.data(), count, t).wait();
      const Bytes want = test_mpi::input(left, count, t);
      CHECK_MESSAGE(difference(recv.data(), want.data(), count, t) == "", label(comm, "ring_shift", t, count, false),
                    ": ", difference(recv.data(), want.data(), count, t));
      CHECK_MESSAGE(guard_intact(recv, bytes), label(comm, "ring_shift", t, count, false));
      CHECK(send == test_mpi::input(me, count, t));
    }
  }
  // Several outstanding beside other collectives, waited in reverse order (each Work keeps
  // the count arrays MPI reads); then on one rank of a split, where it copies.
  const std::size_t count = 9;
  std::vector<Bytes> sends, recvs;
  for (int k = 0; k < 3; ++k) {
    sends.push_back(test_mpi::input(me + k, count, DType::i64));
    recvs.emplace_back(count * 8, kUntouched);
  }
  Bytes gathered(count * 8 * n);
  std::vector<fsdp::Work> works;
  for (int k = 0; k < 3; ++k) {
    works.push_back(comm.ring_shift(sends[k].data(), recvs[k].data(), count, DType::i64));
    if (k == 1) works.push_back(comm.all_gather(sends[0].data(), gathered.data(), count, DType::i64));
  }
  for (auto w = works.rbegin(); w != works.rend(); ++w) w->wait();
  for (int k = 0; k < 3; ++k)
    CHECK(difference(recvs[k].data(), test_mpi::input(left + k, count, DType::i64).data(), count, DType::i64) == "");
  auto alone = comm.split(me, 0);
  REQUIRE(alone.size() == 1);
  Bytes copy(count * 8, kUntouched);
  alone.ring_shift(sends[2].data(), copy.data(), count, DType::i64).wait();
  CHECK(copy == sends[2]);
  alone.ring_shift(copy.data(), copy.data(), count, DType::i64).wait();  // one rank: in place is allowed
  CHECK(copy == sends[2]);
}

TEST_CASE("barrier: no rank leaves before the last one arrives") {
  auto comm = test_mpi::world();
  comm.barrier().wait();  // start together
  const auto delay = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  if (comm.rank() == 0) std::this_thread::sleep_for(delay);
  comm.barrier().wait();
  const auto waited = std::chrono::steady_clock::now() - start;
  // Rank 0 slept 300 ms before joining, so everyone waited about that long (the margin
  // allows for ranks that left the first barrier up to 150 ms apart).
  CHECK(waited >= delay / 2);
}

TEST_CASE("Work: collectives stay outstanding together, complete out of order, and through ready()") {
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank();
  const std::size_t count = 7;
  Bytes gathered(count * 4 * n), reduced(count * 4), broadcast(count * 4);
  const Bytes mine = test_mpi::input(me, count, DType::f32);
  fsdp::Work a = comm.all_gather(mine.data(), gathered.data(), count, DType::f32);
  fsdp::Work b = comm.all_reduce(mine.data(), reduced.data(), count, DType::f32, ReduceOp::sum);
  fsdp::Work c = comm.broadcast(mine.data(), broadcast.data(), count, DType::f32, n - 1);
  CHECK_FALSE(a.completed_inline());  // MPI's collectives are asynchronous
  c.wait();
  a.wait();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!b.ready() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  CHECK(b.ready());
  b.wait();
  for (int r = 0; r < n; ++r)
    CHECK(difference(gathered.data() + r * count * 4, test_mpi::input(r, count, DType::f32).data(), count,
                     DType::f32) == "");
  CHECK(difference(reduced.data(), test_mpi::reference_reduce(n, 0, count, count, DType::f32, ReduceOp::sum).data(),
                   count, DType::f32) == "");
  CHECK(difference(broadcast.data(), test_mpi::input(n - 1, count, DType::f32).data(), count, DType::f32) == "");

  // A handle dropped without wait() completes in its destructor: the result is there after.
  Bytes dropped(count * 4);
  { fsdp::Work w = comm.all_reduce(mine.data(), dropped.data(), count, DType::f32, ReduceOp::sum); }
  CHECK(dropped == reduced);
}

TEST_CASE("AsyncCommunicator<MpiComm>: collectives and split on a worker thread (MPI_THREAD_MULTIPLE)") {
  auto comm = test_mpi::world();
  const int n = comm.size(), me = comm.rank();
  const std::size_t count = 5;
  {
    fsdp::AsyncCommunicator<fsdp::MpiComm> stream(comm);
    const Bytes mine = test_mpi::input(me, count, DType::bf16);
    Bytes sum(count * 2), gathered(count * 2 * n);
    fsdp::Work a = stream.all_reduce(mine.data(), sum.data(), count, DType::bf16, ReduceOp::sum);
    fsdp::Work b = stream.all_gather(mine.data(), gathered.data(), count, DType::bf16);
    b.wait();
    a.wait();
    CHECK(difference(sum.data(), test_mpi::reference_reduce(n, 0, count, count, DType::bf16, ReduceOp::sum).data(),
                     count, DType::bf16) == "");
    CHECK(difference(gathered.data() + (n - 1) * count * 2, test_mpi::input(n - 1, count, DType::bf16).data(), count,
                     DType::bf16) == "");
    auto halves = stream.split(me < n / 2 ? 0 : 1, me);
    std::int32_t one = 1, members = 0;
    halves.all_reduce(&one, &members, 1, DType::i32, ReduceOp::sum).wait();
    CHECK(members == (me < n / 2 ? n / 2 : n - n / 2));
  }
  comm.barrier().wait();  // usable again once the stream is gone
}

}  // namespace
