// MpiComm's failures: each is an fsdp::Error that names the rank, the communicator and the
// collective with its sequence number. Argument errors are caught before MPI sees the call
// (where OpenMPI would crash or corrupt memory) and leave the communicator usable; a
// collective one rank skips times out, breaks its communicator and ends the job.
//
// The last case ends the MPI job (MpiSession aborts it), so mpi_comm_test.sh runs it alone
// (doctest's --test-case="teardown*") and the other runs exclude it.
#include <doctest/doctest.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "test/mpi/mpi_test_support.hpp"

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using test_mpi::contains;
using test_mpi::error_of;

TEST_CASE("collective tags: equal ones gather; different ones fail on every rank naming each rank's unit") {
  struct Names final : fsdp::UnitNames {
    std::string unit_name(int index) const override { return "block" + std::to_string(index); }
  } names;
  auto comm = test_mpi::world();
  static_assert(fsdp::TaggedCommunicator<fsdp::MpiComm>);
  std::vector<float> mine(2, static_cast<float>(comm.rank())), all(2 * comm.size());
  comm.all_gather(mine.data(), all.data(), 2, DType::f32, fsdp::CollectiveTag{3, fsdp::TagPhase::forward, 1, &names}).wait();
  for (int r = 0; r < comm.size(); ++r) CHECK(all[2 * r + 1] == static_cast<float>(r));
  if (comm.size() > 1) {
    const fsdp::CollectiveTag tag{static_cast<std::uint32_t>(comm.rank() == 1 ? 4 : 3), fsdp::TagPhase::reduce, 1, &names};
    const std::string e =
        error_of([&] { comm.all_reduce(mine.data(), mine.data(), 2, DType::f32, ReduceOp::sum, tag).wait(); });
    CHECK(contains(e, "collective mismatch"));
    CHECK(contains(e, "rank 0 called all_reduce(count=2, dtype=f32, op=sum) of unit 'block3' (gradient reduction, pass 1)"));
    CHECK(contains(e, "rank 1 called all_reduce(count=2, dtype=f32, op=sum) of unit 'block4' (gradient reduction, pass 1)"));
    // Found by ready(): the wait() after it fails too, not a silent success.
    fsdp::Work w = comm.all_reduce(mine.data(), mine.data(), 2, DType::f32, ReduceOp::sum, tag);
    const std::string polled = error_of([&] {
      while (!w.ready()) {
      }
    });
    CHECK(contains(polled, "collective mismatch"));
    CHECK(contains(error_of([&] { w.wait(); }), "collective mismatch"));
  }
  // Both calls completed on every rank: still in step, nothing broken.
  CHECK_FALSE(comm.broken());
  std::int32_t one = 1, total = 0;
  comm.all_reduce(&one, &total, 1, DType::i32, ReduceOp::sum).wait();
  CHECK(total == comm.size());
}

// Issue 35: abort_step's agreement carries the exception that left the step
// (CollectiveTag::note), which MPI's descriptors cannot: rank 0 sends it once the ranks see
// the mismatch. Here the calls differ in their tags only (rank 0's is abort_step's), so MPI
// runs one collective alike and the communicator stays in step for the next round. A Work
// polled with ready() must say what a waited one says: a poll that finds the mismatch
// before the note arrived is not the end (the first version of the exchange gave up there).
TEST_CASE("abort_step's note: every rank quotes the aborting rank's exception, waited or polled") {
  auto comm = test_mpi::world();
  if (comm.size() < 2) return;
  const auto note = std::make_shared<const std::string>("engine kernel failed");
  for (bool poll : {false, true, true}) {
    CAPTURE(poll);
    fsdp::CollectiveTag tag{2, fsdp::TagPhase::forward, 1};
    if (comm.rank() == 0) tag = fsdp::CollectiveTag{0, fsdp::TagPhase::abort_step, 0, nullptr, note};
    std::int32_t mine = 1, all = 0;
    fsdp::Work w = comm.all_reduce(&mine, &all, 1, DType::i32, ReduceOp::min, tag);
    const auto thrown = test_support::thrown_by([&] {
      if (poll)
        while (!w.ready()) {
        }
      w.wait();
    });
    const std::string& e = thrown.message;
    CAPTURE(e);
    // The others fail because rank 0 aborted: an echo of rank 0 (fsdp::exit_status: 86).
    CHECK(thrown.echo_of == (comm.rank() == 0 ? -1 : 0));
    CHECK(contains(e, "rank 0 called all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left by an "
                      "exception: \"engine kernel failed\")"));
    CHECK(contains(e, "rank 1 called all_reduce(count=1, dtype=i32, op=min) of unit #2 (forward, pass 1)"));
  }
  CHECK_FALSE(comm.broken());
  std::int32_t one = 1, total = 0;
  comm.all_reduce(&one, &total, 1, DType::i32, ReduceOp::sum).wait();
  CHECK(total == comm.size());
}

TEST_CASE("argument errors: refused before MPI, named, and the communicator stays in step") {
  auto comm = test_mpi::world();
  const std::string me = "rank " + std::to_string(comm.rank()) + " of MPI communicator 'world'";
  std::vector<float> a(8), b(8 * comm.size());
  const std::size_t too_many = static_cast<std::size_t>(INT_MAX) + 1;

  // Collective #0: more elements than an MPI 3.1 count holds (no buffer is touched).
  std::string e = error_of([&] { comm.all_reduce(a.data(), b.data(), too_many, DType::f32, ReduceOp::sum); });
  CHECK(contains(e, me));
  CHECK(contains(e, "all_reduce(count=2147483648, dtype=f32, op=sum) as collective #0"));
  CHECK(contains(e, "count exceeds INT_MAX (2147483647) elements"));
  e = error_of([&] { comm.all_gather(a.data(), b.data(), too_many, DType::bf16); });
  CHECK(contains(e, "all_gather(count=2147483648, dtype=bf16) as collective #1: count exceeds INT_MAX"));

  // Null buffers (OpenMPI would dereference them) and aliasing that is not an in-place form.
  e = error_of([&] { comm.all_gather(nullptr, b.data(), 4, DType::f32); });
  CHECK(contains(e, "as collective #2: send buffer is null"));
  e = error_of([&] { comm.reduce_scatter(b.data(), nullptr, 1, DType::f32, ReduceOp::sum); });
  CHECK(contains(e, "receive buffer is null"));
  e = error_of([&] { comm.all_reduce(b.data(), b.data() + 1, 4, DType::f32, ReduceOp::max); });
  CHECK(contains(e, "send and receive buffers overlap without being the in-place form (send == recv)"));
  if (comm.size() > 1) {
    e = error_of([&] { comm.all_gather(b.data() + 1, b.data(), 2, DType::f32); });
    CHECK(contains(e, "in-place form (send == recv + rank*count)"));
  }
  e = error_of([&] { comm.broadcast(a.data(), a.data(), 8, DType::f32, comm.size()); });
  CHECK(contains(e, "broadcast(count=8, dtype=f32, root=" + std::to_string(comm.size()) + ")"));
  CHECK(contains(e, "root " + std::to_string(comm.size()) + " is outside [0, " + std::to_string(comm.size()) + ")"));

  // ring_shift: a null buffer; overlapping buffers, refused before the call is numbered.
  e = error_of([&] { comm.ring_shift(nullptr, b.data(), 4, DType::f32); });
  CHECK(contains(e, me));
  CHECK(contains(e, "ring_shift(count=4, dtype=f32) as collective #"));
  CHECK(contains(e, "send buffer is null"));
  if (comm.size() > 1) {
    e = error_of([&] { comm.ring_shift(b.data(), b.data() + 2, 4, DType::f32); });
    CHECK(contains(e, "rank " + std::to_string(comm.rank()) + ": ring_shift(count=4, dtype=f32): its send and recv "
                      "buffers overlap"));
  }

  // Nothing reached MPI: the ranks are still in step, and nothing is broken.
  CHECK_FALSE(comm.broken());
  std::int32_t one = 1, total = 0;
  comm.all_reduce(&one, &total, 1, DType::i32, ReduceOp::sum).wait();
  CHECK(total == comm.size());
  CHECK_FALSE(test_mpi::session().failed());
}

TEST_CASE("timeouts outside (0 ms, 24 h] are refused") {
  using std::chrono::milliseconds;
  for (milliseconds bad : {milliseconds(0), milliseconds(-5), milliseconds(std::chrono::hours(25))}) {
    const std::string e = error_of([&] { test_mpi::world(bad); });
    CHECK(contains(e, "MpiComm 'world': timeout must be in (0 ms, 24 h], got " + std::to_string(bad.count()) + " ms"));
  }
}

TEST_CASE("teardown: a world() and a barrier that rank 0 skips time out on the others, and end the job") {
  using namespace std::chrono_literals;
  auto comm = test_mpi::world(500ms);
  if (comm.rank() == 0) return;  // the missing rank: it goes on to the end and waits there
  // Making a communicator meets every rank within the timeout.
  const auto start = std::chrono::steady_clock::now();
  const std::string dup = error_of([&] { test_mpi::world(300ms); });
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(contains(dup, "world rank " + std::to_string(test_mpi::session().world_rank()) + ": MpiComm 'world': "
                      "MPI_Comm_idup did not complete within 300 ms"));
  CHECK(waited >= 300ms);
  CHECK(waited < 10s);
  // The session ends the job at its end (MPI_Abort) instead of finalizing beside a live
  // collective; mpi_comm_test.sh checks that this run ends that way.
  CHECK(test_mpi::session().failed());
  CHECK(contains(test_mpi::session().failure(), "MPI_Comm_idup did not complete"));
  // From now on fsdp makes no MPI call (one could progress the timed-out collective into
  // freed buffers): every collective is refused at once, naming the first failure.
  const auto t1 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { comm.barrier().wait(); });
  CHECK(std::chrono::steady_clock::now() - t1 < 100ms);
  CHECK(contains(e, "rank " + std::to_string(comm.rank()) + " of MPI communicator 'world'"));
  CHECK(contains(e, "barrier as collective #0: not started: the MPI job already failed (world rank"));
  CHECK(contains(e, "fsdp makes no further MPI calls"));
}

}  // namespace
