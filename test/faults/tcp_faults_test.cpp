// The fault-injection cases over TcpComm: ranks are threads of this process, each with its
// own TcpComm over loopback sockets (and shared memory) made inside its thread, so that a
// rank that throws closes its links on the way out, as a process does when it exits.
//  - a communicator that fails or stalls at its N-th collective on one rank (a spread of
//    N over two steps; FullShard with BackwardPre and with ForwardPrefetch, ShardGradOp,
//    NoShard): an fsdp::Error on every rank, the peers' naming the rank that left or is
//    behind, no hang, no wrong value shown first (faulty_training.hpp), nothing leaked;
//  - a rank that swaps or skips units from iteration 2 on (unit_order_driver.hpp): every
//    rank fails naming the units, and no swapped unit's hook returns.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fsdp/asio/tcp_comm.hpp"
#include "test/asio/tcp_world.hpp"
#include "test/faults/faulty_training.hpp"
#include "test/faults/unit_order_checks.hpp"

namespace faults_tcp_faults_test {

namespace {

using namespace std::chrono_literals;
using test_support::contains;
using test_support::FaultMode;
using test_support::Outcome;

// Two training steps on 2 TcpComm ranks; rank 1 has collective `at` fail, or stall for
// three times the timeout.
template <class... Ps>
Outcome run(long at, FaultMode mode) {
  fsdp::TcpCommOptions options = test_support::ok_options();
  options.timeout = mode == FaultMode::stall ? 300ms : 5s;
  const auto store = std::make_shared<fsdp::HashStore>();
  Outcome out;
  out.runs.resize(2);
  out.errors = test_support::on_threads(2, [&](int r) {
    fsdp::TcpComm comm(store, r, 2, options);
    const test_support::Fault fault{r == 1 ? at : 0, mode, 3 * options.timeout};
    test_support::train_with_fault<Ps...>(comm, fault, test_support::two_blocks(), 2, out.runs[static_cast<std::size_t>(r)]);
  });
  return out;
}

// Collectives 1, 2 and the last, and about every fifth between.
std::set<long> spread(long total) {
  std::set<long> at{1, 2, total};
  for (long k = 1; k < 5; ++k) at.insert(total * k / 5 + k % 2);
  return at;
}

template <class... Ps>
void faults_at_a_spread(FaultMode mode) {
  const Outcome clean = run<Ps...>(0, FaultMode::fail);
  for (const auto& e : clean.errors) REQUIRE(e.empty());
  const long total = clean.runs[1].issued_after_step.back();
  REQUIRE(total > 10);
  for (long at : mode == FaultMode::fail ? spread(total) : std::set<long>{2, total / 2 + 1}) {
    CAPTURE(at);
    const auto begin = std::chrono::steady_clock::now();
    const Outcome o = run<Ps...>(at, mode);
    const auto took = std::chrono::steady_clock::now() - begin;
    const int fault_step = test_support::step_of(at, clean.runs[1].issued_after_step);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      test_support::check_faulty_rank(o.errors[r], o.runs[r], clean.runs[r], fault_step);
    }
    if (mode == FaultMode::fail) {
      CHECK(contains(o.errors[1], "injected failure of collective #" + std::to_string(at)));
      CHECK(contains(o.errors[0], "rank 1"));  // the peer that left, named
      CHECK(took < 5s);                         // found from the closed link, not by the timeout
    } else {
      CHECK(contains(o.errors[0], "behind: rank 1"));  // the rank that is behind, named
      CHECK(took < 3s);                         // the stall is 0.9 s, the timeout 0.3 s
    }
  }
}

using test_support::OrderOutcome;

// Two TcpComm ranks; the first iteration as usual everywhere, then rank 1 runs
// `rank1_order` (unit_order_driver.hpp) from iteration 2 on.
template <class... Ps>
OrderOutcome swap_on_rank1(const std::vector<std::string>& rank1_order, bool backward = true) {
  engine::ModelConfig c;
  c.blocks = 3;  // blocks.0, blocks.1, blocks.2: the same sizes
  const auto store = std::make_shared<fsdp::HashStore>();
  OrderOutcome out;
  out.logs.resize(2);
  out.errors = test_support::on_threads(2, [&](int r) {
    fsdp::TcpComm comm(store, r, 2, test_support::ok_options());
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    test_support::iteration(sm, test_support::usual);
    test_support::iteration(sm, r == 1 ? rank1_order : test_support::usual, out.logs[static_cast<std::size_t>(r)], backward);
  });
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("TcpComm: a collective failing on one rank, at a spread of collectives: an error on every rank, "
                   "no wrong value first, nothing leaked", Policies,
                   fsdp::Policies<fsdp::FullShard, fsdp::BackwardPre>,
                   fsdp::Policies<fsdp::FullShard, fsdp::BackwardPost, fsdp::ForwardPrefetch>,
                   fsdp::Policies<fsdp::ShardGradOp, fsdp::BackwardPre>, fsdp::Policies<fsdp::NoShard>) {
  [&]<class... Ps>(fsdp::Policies<Ps...>*) { faults_at_a_spread<Ps...>(FaultMode::fail); }(static_cast<Policies*>(nullptr));
}

TEST_CASE_TEMPLATE("TcpComm: a rank stalling inside a step: every rank fails within the timeout, naming the rank behind",
                   Policies, fsdp::Policies<fsdp::FullShard, fsdp::BackwardPre>,
                   fsdp::Policies<fsdp::FullShard, fsdp::BackwardPost, fsdp::ForwardPrefetch>) {
  [&]<class... Ps>(fsdp::Policies<Ps...>*) { faults_at_a_spread<Ps...>(FaultMode::stall); }(static_cast<Policies*>(nullptr));
}

TEST_CASE_TEMPLATE("TcpComm: a swapped pair from iteration 2 on: every rank fails at the first swapped all-gather",
                   Prefetch, fsdp::NoBackwardPrefetch, fsdp::BackwardPre, fsdp::BackwardPost) {
  const auto o = swap_on_rank1<fsdp::FullShard, Prefetch>(test_support::swapped);
  test_support::check_named(o, "forward");
  test_support::check_not_shown(o, {"pre_forward"});
}

TEST_CASE("TcpComm: with forward prefetch, the swapping rank says so, and its peer fails naming it") {
  const auto o = swap_on_rank1<fsdp::FullShard, fsdp::ForwardPrefetch>(test_support::swapped);
  CHECK(contains(o.errors[1], "unit 'blocks.1' on rank 1 runs at forward step #1 where the first iteration ran 'blocks.0'"));
  CHECK(contains(o.errors[0], "rank 1"));
  // Rank 0 may be shown blocks.0, which both ranks prefetched after the root (true values:
  // its pre_forward returns before the news of rank 1 arrives over the socket); never
  // blocks.1, which rank 1 entered out of order.
  test_support::check_not_shown(o, {"pre_forward"}, {1});
  CHECK(std::find(o.logs[0].begin(), o.logs[0].end(), "pre_forward blocks.1") == o.logs[0].end());
}

TEST_CASE("TcpComm: ShardGradOp and NoShard: the first collective of a swapped unit fails") {
  auto o = swap_on_rank1<fsdp::ShardGradOp>(test_support::swapped);
  test_support::check_named(o, "forward");
  test_support::check_not_shown(o, {"pre_forward"});
  // NoShard's reductions are asynchronous here: post_backward may return before the
  // mismatch is found, but no reduced gradient is shown (finish_backward never returns).
  o = swap_on_rank1<fsdp::NoShard, fsdp::NoBackwardPrefetch>(test_support::swapped);
  test_support::check_named(o, "gradient reduction", "blocks.1", "blocks.0");
  test_support::check_not_shown(o, {});
}

TEST_CASE("TcpComm: an evaluation pass in another order fails at its first swapped unit") {
  const auto o = swap_on_rank1<fsdp::FullShard>(test_support::swapped, false);
  test_support::check_named(o, "forward");
  test_support::check_not_shown(o, {"pre_forward"});
}

TEST_CASE("TcpComm: a rank that skips a unit fails at the next all-gather, naming both") {
  using namespace std::chrono_literals;
  const auto start = std::chrono::steady_clock::now();
  const auto o = swap_on_rank1<fsdp::FullShard>({"blocks.0", "blocks.1", "blocks.2"});
  // Both ranks are in a collective, so each finds the other's report at once: well under
  // the 2 s the reports are waited for at most (a rank destroyed first must leave its own).
  CHECK(std::chrono::steady_clock::now() - start < 1500ms);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(o.errors[r]);
    CHECK(contains(test_support::call_of(o.errors[r], 0), "of unit 'gain' (forward"));
    CHECK(contains(test_support::call_of(o.errors[r], 1), "of unit '<root>' (backward"));
    CHECK(std::find(o.logs[r].begin(), o.logs[r].end(), "pre_forward gain") == o.logs[r].end());
  }
}

}  // namespace faults_tcp_faults_test
