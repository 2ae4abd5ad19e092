// MpiComm's comparison of the ranks' calls (fsdp/mpi/mpi_call_check.hpp): the descriptor's
// packing, matching calls that pass, and calls that differ, which fail on every rank naming
// every rank's call. Rank 1 is the odd one out; each expected call is written out here.
//
// Calls whose messages have the same size and pattern (op, dtype of one size, tag) complete
// on every rank, so they run in every world size. Calls that differ in count, kind or
// root make OpenMPI fail or hang some ranks, which ends the job: those "fatal:" cases run
// one per mpirun (mpi_comm_test.sh), and the other runs exclude them.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/mpi/mpi_call_check.hpp"
#include "test/mpi/mpi_test_support.hpp"

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::detail::CollectiveCall;
using fsdp::detail::CollectiveKind;
using fsdp::detail::MpiCallDescriptor;
using test_mpi::contains;
using test_mpi::error_of;

CollectiveCall unpacked(const CollectiveCall& c, int group_size) {
  std::uint64_t words[3] = {};
  MpiCallDescriptor::pack(c, words, MpiCallDescriptor::words(group_size));
  return MpiCallDescriptor::unpack(words, MpiCallDescriptor::words(group_size), CollectiveCall{});
}

TEST_CASE("call descriptor: 16 bytes, 24 for groups past 2^24 ranks; every field survives at its limits") {
  CHECK(MpiCallDescriptor::words(1) == 2);
  CHECK(MpiCallDescriptor::words(1 << 24) == 2);
  CHECK(MpiCallDescriptor::words((1 << 24) + 1) == 3);
  const CollectiveKind kinds[] = {CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                                  CollectiveKind::all_reduce, CollectiveKind::broadcast, CollectiveKind::barrier,
                                  CollectiveKind::ring_shift};
  const std::size_t counts[] = {0, 1, 13, static_cast<std::size_t>(INT_MAX)};
  const std::uint64_t tags[] = {0, fsdp::CollectiveTag{(1u << 20) - 1, fsdp::TagPhase::summon, (1ull << 40) - 1}.packed()};
  for (auto kind : kinds)
    for (auto t : test_mpi::kAllDTypes)
      for (auto op : test_mpi::kAllOps)
        for (auto count : counts)
          for (auto tag : tags) {
            CollectiveCall c{kind, nullptr, nullptr, count, t, op, (1 << 24) - 1};
            c.tag = tag;
            CHECK(unpacked(c, 1 << 24).same_shape(c));
            c.root = INT_MAX;  // only a group past 2^24 ranks has such roots: a third word
            CHECK(unpacked(c, INT_MAX).same_shape(c));
          }
  // A field changed alone changes the descriptor.
  CollectiveCall base{CollectiveKind::all_reduce, nullptr, nullptr, 7, DType::f32, ReduceOp::sum, 0};
  auto differs = [&](CollectiveCall c) { return !unpacked(c, 8).same_shape(base); };
  CHECK(differs({CollectiveKind::reduce_scatter, nullptr, nullptr, 7, DType::f32, ReduceOp::sum, 0}));
  CHECK(differs({CollectiveKind::all_reduce, nullptr, nullptr, 8, DType::f32, ReduceOp::sum, 0}));
  CHECK(differs({CollectiveKind::all_reduce, nullptr, nullptr, 7, DType::i32, ReduceOp::sum, 0}));
  CHECK(differs({CollectiveKind::all_reduce, nullptr, nullptr, 7, DType::f32, ReduceOp::avg, 0}));
  CHECK(differs({CollectiveKind::all_reduce, nullptr, nullptr, 7, DType::f32, ReduceOp::sum, 5}));
}

// "rank R called <call> as collective #seq" for every rank, in the error every rank throws.
void check_names_every_call(const std::string& e, const fsdp::MpiComm& comm, const std::string& odd_call,
                            const std::string& usual_call, std::uint64_t seq) {
  CHECK(contains(e, "rank " + std::to_string(comm.rank()) + " of MPI communicator 'world'"));
  CHECK(contains(e, "collective mismatch:"));
  for (int r = 0; r < comm.size(); ++r)
    CHECK(contains(e, "rank " + std::to_string(r) + " called " + (r == 1 ? odd_call : usual_call) + " as collective #" +
                          std::to_string(seq)));
  CHECK(contains(e, "(seen on rank " + std::to_string(comm.rank()) + ")"));
}

TEST_CASE("matching calls pass, checked or not; the setting must agree across ranks") {
  for (bool checked : {true, false}) {
    auto comm = fsdp::MpiComm::world(test_mpi::session(), fsdp::MpiCommOptions{std::chrono::seconds(20), checked});
    CHECK(comm.checks_calls() == checked);
    const int n = comm.size();
    std::vector<std::int32_t> mine(3, comm.rank()), all(3 * static_cast<std::size_t>(n)), sum(3);
    comm.all_gather(mine.data(), all.data(), 3, DType::i32).wait();
    for (int r = 0; r < n; ++r) CHECK(all[3 * static_cast<std::size_t>(r) + 2] == r);
    comm.all_reduce(mine.data(), sum.data(), 3, DType::i32, ReduceOp::sum).wait();
    CHECK(sum[1] == n * (n - 1) / 2);
    comm.reduce_scatter(all.data(), sum.data(), 3, DType::i32, ReduceOp::max).wait();
    CHECK(sum[0] == comm.rank());  // chunk r of every rank's gathered buffer holds r
    std::int32_t root_value = comm.rank() == n - 1 ? 42 : -1;
    comm.broadcast(&root_value, &root_value, 1, DType::i32, n - 1).wait();
    CHECK(root_value == 42);
    comm.barrier().wait();
    CHECK_FALSE(comm.broken());
  }
  if (test_mpi::session().world_size() > 1) {
    const bool mine = test_mpi::session().world_rank() != 1;
    const std::string e = error_of(
        [&] { fsdp::MpiComm::world(test_mpi::session(), fsdp::MpiCommOptions{std::chrono::seconds(20), mine}); });
    CHECK(contains(e, "MpiCommOptions::check_calls must be the same on every rank"));
    CHECK(contains(e, test_mpi::session().world_rank() == 1 ? "rank 0 has true and this rank false"
                                                             : "rank 1 has false and this rank true"));
  }
}

TEST_CASE("same-size calls that differ in op or dtype fail on every rank, naming every rank's call") {
  if (test_mpi::session().world_size() < 2) return;
  std::vector<float> a(8, 1.0f), b(8 * static_cast<std::size_t>(test_mpi::session().world_size()));
  {
    auto comm = test_mpi::world();
    const ReduceOp op = comm.rank() == 1 ? ReduceOp::max : ReduceOp::sum;
    const std::string e = error_of([&] { comm.all_reduce(a.data(), b.data(), 4, DType::f32, op).wait(); });
    check_names_every_call(e, comm, "all_reduce(count=4, dtype=f32, op=max)", "all_reduce(count=4, dtype=f32, op=sum)", 0);
    // MPI paired two different collectives: the communicator takes no more, the job goes on.
    CHECK(comm.broken());
    CHECK(contains(error_of([&] { comm.barrier(); }), "barrier as collective #1 not started: the communicator broke"));
  }
  {
    auto comm = test_mpi::world();
    comm.barrier().wait();  // collective #0
    const DType t = comm.rank() == 1 ? DType::i32 : DType::f32;  // 4 bytes each
    const std::string e = error_of([&] { comm.reduce_scatter(b.data(), a.data(), 1, t, ReduceOp::avg).wait(); });
    check_names_every_call(e, comm, "reduce_scatter(count=1, dtype=i32, op=avg)",
                           "reduce_scatter(count=1, dtype=f32, op=avg)", 1);
    CHECK(comm.broken());
  }
  {
    auto comm = test_mpi::world();
    const DType t = comm.rank() == 1 ? DType::u8 : DType::i8;
    const std::string e = error_of([&] { comm.all_gather(a.data(), b.data(), 3, t).wait(); });
    check_names_every_call(e, comm, "all_gather(count=3, dtype=u8)", "all_gather(count=3, dtype=i8)", 0);
  }
  {  // Found by ready(); the wait() after it fails too.
    auto comm = test_mpi::world();
    const DType t = comm.rank() == 1 ? DType::i64 : DType::f64;
    fsdp::Work w = comm.broadcast(b.data(), b.data(), 2, t, 0);
    const std::string polled = error_of([&] {
      while (!w.ready()) {
      }
    });
    check_names_every_call(polled, comm, "broadcast(count=2, dtype=i64, root=0)", "broadcast(count=2, dtype=f64, root=0)", 0);
    CHECK(contains(error_of([&] { w.wait(); }), "collective mismatch"));
  }
  CHECK_FALSE(test_mpi::session().failed());
}

TEST_CASE("a tagged call against untagged ones fails on every rank; tags alone leave the communicator usable") {
  if (test_mpi::session().world_size() < 2) return;
  auto comm = test_mpi::world();
  std::vector<float> a(2, 1.0f), b(2);
  const fsdp::CollectiveTag tag{9, fsdp::TagPhase::backward, 3};
  const std::string e = error_of([&] {
    (comm.rank() == 1 ? comm.all_reduce(a.data(), b.data(), 2, DType::f32, ReduceOp::sum, tag)
                      : comm.all_reduce(a.data(), b.data(), 2, DType::f32, ReduceOp::sum))
        .wait();
  });
  check_names_every_call(e, comm, "all_reduce(count=2, dtype=f32, op=sum) of unit #9 (backward, pass 3)",
                         "all_reduce(count=2, dtype=f32, op=sum)", 0);
  CHECK_FALSE(comm.broken());
  comm.all_reduce(a.data(), b.data(), 2, DType::f32, ReduceOp::sum).wait();
  CHECK(b[1] == static_cast<float>(comm.size()));
}

TEST_CASE("a split group's mismatch names its ranks by their world ranks") {
  if (test_mpi::session().world_size() < 2) return;
  auto world = test_mpi::world();
  auto group = world.split(0, world.size() - world.rank());  // every rank, in reverse order
  REQUIRE(group.rank() == world.size() - 1 - world.rank());
  const ReduceOp op = world.rank() == 1 ? ReduceOp::min : ReduceOp::sum;
  std::int64_t one = 1, out = 0;
  const std::string e = error_of([&] { group.all_reduce(&one, &out, 1, DType::i64, op).wait(); });
  CHECK(contains(e, "rank " + std::to_string(group.rank()) + " of MPI communicator 'world/split#0(color 0)'"));
  for (int w = 0; w < world.size(); ++w)
    CHECK(contains(e, "rank " + std::to_string(w) + " called all_reduce(count=1, dtype=i64, op=" +
                          (w == 1 ? "min" : "sum") + ") as collective #0"));
  CHECK(contains(e, "(seen on rank " + std::to_string(world.rank()) + ")"));
  CHECK(group.broken());
  CHECK_FALSE(world.broken());
}

// The fatal cases: every rank's error names every rank's call whether MPI completed,
// failed (MPI_ERR_TRUNCATE) or hung on it; no buffer is written past its end.
constexpr float kGuard = -7.5f;

void check_guards(const std::vector<float>& buffer, std::size_t used) {
  for (std::size_t i = used; i < buffer.size(); ++i) CHECK(buffer[i] == kGuard);
}

TEST_CASE("fatal: all_reduce counts that differ name every rank's call") {
  using namespace std::chrono_literals;
  auto comm = test_mpi::world(500ms);
  REQUIRE(comm.size() > 1);  // mpi_comm_test.sh runs these on 2 ranks or more
  const std::size_t count = comm.rank() == 1 ? 2048 : 1024;
  std::vector<float> send(count, 1.0f), recv(4096, kGuard);
  const std::string e = error_of([&] { comm.all_reduce(send.data(), recv.data(), count, DType::f32, ReduceOp::sum).wait(); });
  check_names_every_call(e, comm, "all_reduce(count=2048, dtype=f32, op=sum)", "all_reduce(count=1024, dtype=f32, op=sum)", 0);
  check_guards(recv, count);
}

TEST_CASE("fatal: all_gather against all_reduce names every rank's call") {
  using namespace std::chrono_literals;
  auto comm = test_mpi::world(500ms);
  REQUIRE(comm.size() > 1);  // mpi_comm_test.sh runs these on 2 ranks or more
  const std::size_t n = static_cast<std::size_t>(comm.size());
  std::vector<float> send(4 * n, 1.0f), recv(8 * n, kGuard);  // 4*n floats received either way
  const std::string e = error_of([&] {
    (comm.rank() == 1 ? comm.all_gather(send.data(), recv.data(), 4, DType::f32)
                      : comm.all_reduce(send.data(), recv.data(), 4 * n, DType::f32, ReduceOp::sum))
        .wait();
  });
  check_names_every_call(e, comm, "all_gather(count=4, dtype=f32)",
                         "all_reduce(count=" + std::to_string(4 * n) + ", dtype=f32, op=sum)", 0);
  check_guards(recv, 4 * n);
}

TEST_CASE("fatal: broadcast roots that differ name every rank's call") {
  using namespace std::chrono_literals;
  auto comm = test_mpi::world(500ms);
  REQUIRE(comm.size() > 1);  // mpi_comm_test.sh runs these on 2 ranks or more
  const int root = comm.rank() == 1 ? 1 : 0;
  const std::size_t count = 1 << 18;  // 1 MiB: past OpenMPI's eager limits
  std::vector<float> buffer(count + 16, kGuard);
  std::fill_n(buffer.begin(), count, static_cast<float>(comm.rank()));
  const std::string e = error_of([&] { comm.broadcast(buffer.data(), buffer.data(), count, DType::f32, root).wait(); });
  const std::string call = "broadcast(count=" + std::to_string(count) + ", dtype=f32, root=";
  check_names_every_call(e, comm, call + "1)", call + "0)", 0);
  check_guards(buffer, count);
}

// A mismatch known from the descriptors ends wait() within MpiPending::kMismatchGrace (2 s),
// not after the communicator's timeout (here a minute): the same broadcast as above, which
// OpenMPI does not complete on every rank.
TEST_CASE("fatal: a known mismatch ends within the grace, not the timeout") {
  using namespace std::chrono_literals;
  auto comm = test_mpi::world(60s);
  REQUIRE(comm.size() > 1);
  const int root = comm.rank() == 1 ? 1 : 0;
  const std::size_t count = 1 << 18;
  std::vector<float> buffer(count + 16, kGuard);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { comm.broadcast(buffer.data(), buffer.data(), count, DType::f32, root).wait(); });
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took < 15s);  // the grace plus slack for an oversubscribed machine; the timeout is 60 s
  CHECK(contains(e, "collective mismatch"));
  CHECK_FALSE(contains(e, "60000 ms"));
  check_guards(buffer, count);
}

}  // namespace
