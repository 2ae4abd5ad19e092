// The fault-injection cases over MpiComm, every rank of an mpirun job
// (mpi_faults_test.sh: -np 2 and 4).
//  - Ranks that swap or skip units from iteration 2 on (test/faults/unit_order_driver.hpp):
//    the tags gathered beside each collective differ, so every rank fails at the same
//    wait(), naming the units, before the engine is shown a swapped unit. The job goes on.
//  - "job-ending": rank 1's communicator fails (or stalls) at a collective of two training
//    steps (test/faults/faulty_training.hpp): the other ranks' waits time out, every rank
//    ends in an fsdp::Error, none was shown a value a clean run did not show it or applied
//    the step the fault fell in, nothing leaked. A timed-out collective ends the MPI job
//    (MpiSession aborts it), so the script runs each of these cases in a job of its own.
//  - "own job": rank 0 aborts its step while the others compute: every rank's error quotes
//    why (abort_step's note), in a job of its own, which may or may not end.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "test/faults/failing_hooks.hpp"
#include "test/faults/faulty_training.hpp"
#include "test/faults/unit_order_checks.hpp"
#include "test/mpi/mpi_test_support.hpp"

namespace {

using namespace std::chrono_literals;
using test_mpi::contains;
using test_mpi::error_of;
using test_support::FailingHooks;
using test_support::FaultMode;
using test_support::RankRun;

// The first iteration as usual, then rank 1 runs `rank1_order`: this rank's error, and
// what its hooks had shown the engine.
template <class... Ps>
std::pair<std::string, std::vector<std::string>> swap_on_rank1(const std::vector<std::string>& rank1_order) {
  engine::ModelConfig c;
  c.blocks = 3;  // blocks.0, blocks.1, blocks.2: the same sizes
  auto comm = test_mpi::world();
  std::vector<std::string> log;
  const std::string error = error_of([&] {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    test_support::iteration(sm, test_support::usual);
    test_support::iteration(sm, comm.rank() == 1 ? rank1_order : test_support::usual, log);
  });
  return {error, log};
}

// This rank's error names rank 1 and both units; no `hook` ("": none) of either unit
// returned, nor finish_backward.
void check_order_fault(const std::string& error, const std::vector<std::string>& log, const std::string& hook,
                       const std::string& unit0, const std::string& unit1) {
  CAPTURE(error);
  CHECK(contains(error, "rank 1"));
  CHECK(contains(error, "of unit '" + unit0 + "'"));
  CHECK(contains(error, "of unit '" + unit1 + "'"));
  if (!hook.empty())
    for (const auto& unit : {unit0, unit1}) CHECK(std::find(log.begin(), log.end(), hook + " " + unit) == log.end());
  CHECK(std::find(log.begin(), log.end(), "finish_backward") == log.end());
}

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}

// A clean run, then one where rank 1's collective `at(total)` fails or stalls (`total`: the
// clean run's collectives); the faulty run's checks, on this rank.
template <class... Ps, class At>
void fault_ends_the_job(At at_of_total, FaultMode mode) {
  const auto timeout = 500ms;
  auto comm = test_mpi::world(timeout);
  RankRun clean, faulty;
  REQUIRE(error_of([&] { test_support::train_with_fault<Ps...>(comm, {}, config(), 2, clean); }) == "");
  const long at = at_of_total(clean.issued_after_step.back());
  CAPTURE(at);
  const test_support::Fault fault{comm.rank() == 1 ? at : 0, mode, 2 * timeout};
  const std::string error = error_of([&] { test_support::train_with_fault<Ps...>(comm, fault, config(), 2, faulty); });
  test_support::check_faulty_rank(error, faulty, clean, test_support::step_of(at, clean.issued_after_step));
  if (comm.rank() == 1 && mode == FaultMode::fail) CHECK(contains(error, "injected failure of collective #"));
  if (comm.rank() != 1) CHECK(contains(error, "500 ms (MpiCommOptions::timeout)"));  // the wait that timed out
  // Rank 1 ends its MPI job too (a communicator its peers never make), so that every rank
  // reports through mpi_test_main's line for ranks whose job failed.
  if (!test_mpi::session().failed()) error_of([] { test_mpi::world(300ms); });
  CHECK(test_mpi::session().failed());
}

}  // namespace

TEST_CASE_TEMPLATE("a swapped pair from iteration 2 on: every rank fails at the same wait, nothing shown", Policies,
                   fsdp::Policies<fsdp::FullShard, fsdp::BackwardPre>, fsdp::Policies<fsdp::ShardGradOp>) {
  if (test_mpi::session().world_size() < 2) return;
  const auto [error, log] = [&]<class... Ps>(fsdp::Policies<Ps...>*) {
    return swap_on_rank1<Ps...>(test_support::swapped);
  }(static_cast<Policies*>(nullptr));
  check_order_fault(error, log, "pre_forward", "blocks.0", "blocks.1");
}

TEST_CASE("NoShard, a swapped pair: no gradient is reduced with another unit's") {
  if (test_mpi::session().world_size() < 2) return;
  const auto [error, log] = swap_on_rank1<fsdp::NoShard, fsdp::NoBackwardPrefetch>(test_support::swapped);
  // Reductions are waited for at finish_backward: post_backward may return, but no reduced
  // gradient is shown.
  check_order_fault(error, log, "", "blocks.1", "blocks.0");
}

TEST_CASE("a rank that skips a unit: every rank fails at its next all-gather, naming both") {
  if (test_mpi::session().world_size() < 2) return;
  // Rank 1 leaves out blocks.0: it gathers blocks.1 where the others gather blocks.0.
  const auto [error, log] = swap_on_rank1<fsdp::FullShard>({"blocks.1", "blocks.2", "gain"});
  check_order_fault(error, log, "pre_forward", "blocks.0", "blocks.1");
}

TEST_CASE("job-ending: rank 1's first collective fails") {
  fault_ends_the_job<fsdp::FullShard, fsdp::BackwardPre>([](long) { return 1L; }, FaultMode::fail);
}

TEST_CASE("job-ending: rank 1's middle collective fails (ShardGradOp)") {
  fault_ends_the_job<fsdp::ShardGradOp>([](long total) { return total / 2 + 1; }, FaultMode::fail);
}

TEST_CASE("job-ending: rank 1's last collective fails") {
  fault_ends_the_job<fsdp::FullShard, fsdp::BackwardPost, fsdp::ForwardPrefetch>([](long total) { return total; },
                                                                                FaultMode::fail);
}

TEST_CASE("job-ending: rank 1 stalls in a collective of the second step") {
  fault_ends_the_job<fsdp::FullShard, fsdp::BackwardPre>([](long total) { return total * 3 / 4; }, FaultMode::stall);
}

// Issue 35: rank 0's engine fails inside a forward and rank 0 aborts the step while the
// other ranks compute on. Its agreement meets their next collective: every rank's error
// names rank 0's call as abort_step's and quotes the exception that left its step (the
// descriptors have no room for it: rank 0 sends it once the mismatch is known). MPI paired
// different collectives: on 2 ranks they completed (the communicator breaks, the job goes
// on), on 4 one timed out or failed (the job ends), so the case runs in a job of its own.
TEST_CASE("own job: rank 0 aborts its step while the others compute: every rank's error quotes why") {
  const auto timeout = 5000ms;  // the note's wait is 2 s of it: room for a slow root on a loaded machine
  auto comm = test_mpi::world(timeout);
  engine::ModelConfig c = config();
  const auto thrown = test_support::thrown_by([&] {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    const auto batch = engine::make_batch(c, 0, comm.rank(), 1);
    try {
      FailingHooks hooks{{sm}, comm.rank() == 0 ? 3 : -1};
      engine::Mat dout;
      engine::mse(model.forward(batch.x, hooks), batch.y, dout);
      model.backward(dout, hooks);
      sm.finish_backward();
    } catch (const std::runtime_error&) {  // the engine's error, or the mismatch (fsdp::Error)
      sm.abort_step();
    }
  });
  const std::string& error = thrown.message;
  CAPTURE(error);
  // Rank 0's error is its own; the others' echo it (fsdp::exit_status gives 86, and their
  // MpiSession lets rank 0 abort the job first, so mpirun names rank 0).
  CHECK(thrown.echo_of == (comm.rank() == 0 ? -1 : 0));
  CHECK(contains(error, "rank 0 called all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left by an "
                        "exception: \"engine kernel failed\")"));
}
