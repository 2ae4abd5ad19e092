// Over a communicator without tags (a user's own; here UntaggedCommunicator), every pass,
// not only the first iteration, is checked across ranks as it ends
// (fsdp/unit/detail/pass_check.hpp): a rank that swaps two same-sized units (whose collectives
// would pair silently), or runs an evaluation pass in another order, is an error on every
// rank at finish_backward / reshard(), before any optimizer step, naming what each rank ran.
// Plain training pays one 8-byte all-gather per pass. Tagged communicators check every
// collective instead (test/faults/collective_tag_test.cpp) and pay nothing here.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fsdp/testing/untagged_communicator.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/faults/unit_order_driver.hpp"
#include "test/support/rank_errors.hpp"

namespace core_pass_check_test {

namespace {

using test_support::contains;
using Untagged = fsdp::UntaggedCommunicator<fsdp::ThreadComm>;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;  // blocks.0, blocks.1, blocks.2: the same sizes
  return c;
}

using test_support::iteration;
using test_support::swapped;
using test_support::usual;

// Each rank's error ("" for none) from run(model, rank) over an untagged communicator.
template <class Strategy = fsdp::FullShard, class Run>
std::vector<std::string> errors_untagged(Run run) {
  return test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    Untagged untagged(comm);
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy, fsdp::NoBackwardPrefetch>(model, untagged, device, engine::Wrap{});
    run(sm, comm.rank());
  });
}

// The collectives this rank issues in a second plain iteration over `comm` (NoShard: its
// units gather nothing, so what is left is the pass check).
template <class C>
fsdp::CollectiveCounts second_iteration_counts(C& comm) {
  fsdp::CountingCommunicator<C> counted(comm);
  engine::Model model(config());
  fsdp::HostDevice device;
  auto sm = fsdp::shard<fsdp::NoShard, fsdp::NoBackwardPrefetch>(model, counted, device, engine::Wrap{});
  iteration(sm, usual);
  counted.reset();
  iteration(sm, usual);
  return counted.counts();
}

}  // namespace

TEST_CASE("a rank that swaps two same-sized units at iteration 3: an error on every rank at finish_backward") {
  const auto msgs = errors_untagged([](fsdp::ShardedModel& sm, int rank) {
    iteration(sm, usual);
    iteration(sm, usual);
    iteration(sm, rank == 1 ? swapped : usual);  // the all-gathers pair silently: same sizes
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "ranks ran units in different orders in this pass (checked as it ended, before any optimizer "
                            "step; its gradients and outputs are wrong): at entry #1, rank 0 ran the forward of "
                            "'blocks.0'; rank 1 ran the forward of 'blocks.1'"));
  }
}

TEST_CASE("after the error every unit asks for abort_step; after it, training goes on") {
  const auto msgs = errors_untagged([](fsdp::ShardedModel& sm, int rank) {
    iteration(sm, usual);
    try {
      iteration(sm, rank == 0 ? swapped : usual);
      FAIL("no error");
    } catch (const fsdp::Error&) {
    }
    CHECK_THROWS_WITH_AS(sm.zero_grad(), doctest::Contains("call abort_step()"), fsdp::Error);
    sm.abort_step();
    iteration(sm, usual);  // no error: the ranks agree again
    iteration(sm, usual);
  });
  for (int r = 0; r < 2; ++r) CHECK(msgs[r].empty());
}

TEST_CASE("an evaluation pass in another order: an error at reshard()") {
  const auto msgs = errors_untagged([](fsdp::ShardedModel& sm, int rank) {
    iteration(sm, usual);
    iteration(sm, usual, false);
    iteration(sm, rank == 0 ? usual : swapped, false);
  });
  for (int r = 0; r < 2; ++r) CHECK(contains(msgs[r], "at entry #1, rank 0 ran the forward of 'blocks.0'; rank 1 ran the forward of 'blocks.1'"));
}

TEST_CASE("a rank that skips a unit in an evaluation pass: named as having ended its pass") {
  // NoShard: forward runs no collective of its own, so only the pass check can see it.
  const auto msgs = errors_untagged<fsdp::NoShard>([](fsdp::ShardedModel& sm, int rank) {
    iteration(sm, usual);
    iteration(sm, rank == 0 ? usual : std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2"}, false);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "rank 0 ran the forward of 'gain'; rank 1 ran nothing (its pass had ended)"));
  }
}

TEST_CASE("plain training over an untagged communicator pays one 8-byte all-gather per pass") {
  std::vector<fsdp::CollectiveCounts> counts(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Untagged untagged(comm);
    counts[comm.rank()] = second_iteration_counts(untagged);
  });
  for (const auto& c : counts) {
    CHECK(c[fsdp::Collective::all_gather].calls == 1);  // NoShard gathers nothing: only the check
    CHECK(c[fsdp::Collective::all_gather].bytes == 16);  // 8 bytes from each of 2 ranks
  }
}

TEST_CASE("a tagged communicator has no check at the end of the pass") {
  std::vector<fsdp::CollectiveCounts> counts(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) { counts[comm.rank()] = second_iteration_counts(comm); });
  for (const auto& c : counts) CHECK(c[fsdp::Collective::all_gather].calls == 0);  // NoShard gathers nothing
}

}  // namespace core_pass_check_test
