// Desync at every unit, every iteration (fsdp/core/collective_tag.hpp): a rank that runs its
// units in another order after the first iteration (a swapped pair of same-sized units, an
// evaluation pass in another order, explicit prefetch lists that differ, a skipped unit)
// fails on every rank at the first collective that pairs two different units, naming the
// unit each rank ran, before the engine is shown the other unit's parameters (or, with
// NoShard, before a gradient is reduced with another unit's), for every strategy and
// prefetch mode. No collective is added: the tag travels with the call.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"
#include "test/faults/unit_order_checks.hpp"

namespace faults_collective_tag_test {

namespace {

using test_support::check_named;
using test_support::check_not_shown;
using test_support::contains;
using test_support::in_order;
using test_support::iteration;
using test_support::swapped;
using test_support::usual;
using Log = std::vector<std::string>;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;  // blocks.0, blocks.1, blocks.2: the same sizes
  return c;
}

using Outcome = test_support::OrderOutcome;

// `ranks` thread ranks, each running body(comm, log), `log` its hooks' record.
template <class Body>
Outcome run_ranks(int ranks, Body body) {
  Outcome out;
  out.logs.resize(static_cast<std::size_t>(ranks));
  out.errors = test_support::errors_per_rank(ranks, [&](fsdp::ThreadComm& comm) { body(comm, out.logs[comm.rank()]); });
  return out;
}

// Two ranks; the first iteration as usual everywhere (recorded with the first iteration's
// per-unit checks), then rank 1 runs `rank1_order` from iteration 2 on.
template <class... Ps>
Outcome swap_on_rank1(const std::vector<std::string>& rank1_order, bool backward = true) {
  return run_ranks(2, [&](fsdp::ThreadComm& comm, Log& log) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    iteration(sm, usual);
    iteration(sm, comm.rank() == 1 ? rank1_order : usual, log, backward);
  });
}

}  // namespace

TEST_CASE_TEMPLATE("a swapped pair from iteration 2 on: every rank fails at the first swapped all-gather", Prefetch,
                   fsdp::NoBackwardPrefetch, fsdp::BackwardPre, fsdp::BackwardPost) {
  const auto o = swap_on_rank1<fsdp::FullShard, Prefetch>(swapped);
  check_named(o, "forward");
  check_not_shown(o, {"pre_forward"});
}

TEST_CASE("with forward prefetch, the rank that left the recorded order says so, and the other fails too") {
  // The swapping rank sees its own departure from the order it prefetches along before any
  // collective; its peer's next all-gather then cannot complete.
  const auto o = swap_on_rank1<fsdp::FullShard, fsdp::ForwardPrefetch>(swapped);
  CHECK(contains(o.errors[1], "unit 'blocks.1' on rank 1 runs at forward step #1 where the first iteration ran 'blocks.0'"));
  CHECK(contains(o.errors[0], "'blocks.1' (forward"));
  CHECK_FALSE(o.errors[0].empty());
  check_not_shown(o, {"pre_forward"});
}

TEST_CASE("ShardGradOp: the forward all-gather is checked") {
  const auto o = swap_on_rank1<fsdp::ShardGradOp>(swapped);
  check_named(o, "forward");
  check_not_shown(o, {"pre_forward"});
}

TEST_CASE("NoShard: no gradient is reduced with another unit's") {
  // Forward runs no collective (every rank holds the parameters); the reductions are tagged.
  // Backward runs in reverse: rank 0 reduces blocks.1 where rank 1 reduces blocks.0.
  const auto o = swap_on_rank1<fsdp::NoShard, fsdp::NoBackwardPrefetch>(swapped);
  check_named(o, "gradient reduction", "blocks.1", "blocks.0");
  check_not_shown(o, {"post_backward"});
}

TEST_CASE("HybridShard: the shard group that swapped fails, and so does every other rank") {
  const auto o = run_ranks(4, [&](fsdp::ThreadComm& comm, Log& log) {
    engine::Model model(config());
    fsdp::HostDevice device;
    fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, {2, 2});
    auto sm = fsdp::shard<fsdp::HybridShard>(model, mesh, device, engine::Wrap{});
    iteration(sm, usual);
    iteration(sm, comm.rank() == 3 ? swapped : usual, log);
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(o.errors[r]);
    CHECK(contains(o.errors[r], "collective mismatch"));
    CHECK(contains(o.errors[r], "of unit 'blocks.0' (forward"));
    CHECK(contains(o.errors[r], "of unit 'blocks.1' (forward"));
  }
  check_not_shown(o, {"pre_forward"}, {2, 3});  // rank 3's shard group: nothing of the pair shown
}

TEST_CASE("an evaluation pass in another order fails at its first swapped unit") {
  const auto o = swap_on_rank1<fsdp::FullShard>(swapped, false);
  check_named(o, "forward");
  check_not_shown(o, {"pre_forward"});
}

TEST_CASE("a rank that skips a unit fails at the next all-gather, naming both") {
  // Rank 1 leaves out 'gain' (an early exit): its next all-gather is the root's for
  // backward, where rank 0 gathers 'gain' for forward.
  const auto o = swap_on_rank1<fsdp::FullShard>({"blocks.0", "blocks.1", "blocks.2"});
  for (int r = 0; r < 2; ++r) {
    CAPTURE(o.errors[r]);
    CHECK(in_order(o.errors[r], {"rank 0 called", "of unit 'gain' (forward", "rank 1 called", "of unit '<root>' (backward"}));
    CHECK(std::find(o.logs[r].begin(), o.logs[r].end(), "pre_forward gain") == o.logs[r].end());
  }
}

TEST_CASE("explicit prefetch lists that differ from iteration 2 on: the prefetch fails") {
  const auto o = run_ranks(2, [&](fsdp::ThreadComm& comm, Log& log) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
    sm.unit("").set_units_to_forward_prefetch({&sm.unit("blocks.0")});
    iteration(sm, usual);
    if (comm.rank() == 1) sm.unit("").set_units_to_forward_prefetch({&sm.unit("blocks.1")});
    iteration(sm, usual, log);
  });
  check_named(o, "forward");
  for (const auto& log : o.logs) CHECK(log.empty());  // failed inside the root's pre_forward, which issues the prefetch
}

TEST_CASE("an AsyncCommunicator passes the tags on: the mismatch is found at the wait") {
  const auto o = run_ranks(2, [&](fsdp::ThreadComm& comm, Log& log) {
    fsdp::AsyncCommunicator<fsdp::ThreadComm> async(comm);
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre>(model, async, device, engine::Wrap{});
    iteration(sm, usual);
    iteration(sm, comm.rank() == 1 ? swapped : usual, log);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(o.errors[r]);
    CHECK(contains(o.errors[r], "of unit 'blocks.0' (forward"));
    CHECK(contains(o.errors[r], "of unit 'blocks.1' (forward"));
  }
  check_not_shown(o, {"pre_forward"});
}

}  // namespace faults_collective_tag_test
