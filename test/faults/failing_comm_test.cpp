// A communicator that fails, or stalls, at its N-th collective on one rank, for every
// strategy (the hybrid ones on a 2x2 mesh, failing in either group) and prefetch mode, at
// every collective of two training steps: every rank ends in an fsdp::Error (never a
// hang, never a crash), no rank was shown a wrong value first (every value its hooks
// returned equals a clean run's, and no rank applied the step the fault fell in), and
// every rank's Device has freed all it allocated once the model is gone (nothing leaked
// on the failing path). The same over TcpComm: tcp_faults_test.cpp; over MpiComm:
// test/mpi/mpi_faults_test.cpp.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include "test/faults/faulty_training.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"

namespace {

using test_support::contains;
using test_support::Fault;
using test_support::FaultMode;
using test_support::RankRun;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}

struct Outcome {
  std::vector<std::string> errors;
  std::vector<RankRun> runs;
};

// Two training steps on 2 ranks (4 as a 2x2 mesh for the hybrid strategies); rank `faulty`
// has collective `at` fail or stall.
template <class... Ps>
Outcome run(long at, FaultMode mode, int faulty = 1) {
  const auto timeout = std::chrono::milliseconds(mode == FaultMode::stall ? 300 : 2000);
  const int world = test_support::hybrid<Ps...> ? 4 : 2;
  Outcome out;
  out.runs.resize(static_cast<std::size_t>(world));
  out.errors = test_support::errors_per_rank(
      world,
      [&](fsdp::ThreadComm& comm) {
        const Fault fault{comm.rank() == faulty ? at : 0, mode, 3 * timeout};
        test_support::train_with_fault<Ps...>(comm, fault, config(), 2, out.runs[static_cast<std::size_t>(comm.rank())]);
      },
      timeout);
  return out;
}

// Every rank failed, was shown nothing a clean run did not show it, applied no step from
// the one the fault fell in, and freed everything. On a mesh (`every_collective_spans_all`
// false) the ranks outside the failing collective's group may finish that step, on true
// values (which the first check covers): the step check is left out there.
void check_faulty_run(const Outcome& o, const Outcome& clean, long at, bool every_collective_spans_all = true,
                      int faulty = 1) {
  const int fault_step = test_support::step_of(at, clean.runs[static_cast<std::size_t>(faulty)].issued_after_step);
  for (std::size_t r = 0; r < o.errors.size(); ++r) {
    CAPTURE(r);
    test_support::check_faulty_rank(o.errors[r], o.runs[r], clean.runs[r], fault_step, every_collective_spans_all);
  }
}

template <class... Ps>
void every_collective_fails() {
  const Outcome clean = run<Ps...>(0, FaultMode::fail);
  for (const auto& e : clean.errors) REQUIRE(e.empty());
  for (const auto& r : clean.runs) REQUIRE(r.steps == 2);
  const long total = clean.runs[1].issued_after_step.back();
  REQUIRE(total > 10);
  for (long at = 1; at <= total; ++at) {
    CAPTURE(at);
    const Outcome o = run<Ps...>(at, FaultMode::fail);
    check_faulty_run(o, clean, at, !test_support::hybrid<Ps...>);
    CHECK(contains(o.errors[1], "injected failure of collective #" + std::to_string(at)));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("a collective failing on one rank, at every collective of two steps: an error on every rank, "
                   "no wrong value first, nothing leaked", Policies,
                   fsdp::Policies<fsdp::FullShard, fsdp::BackwardPre>, fsdp::Policies<fsdp::FullShard, fsdp::BackwardPost, fsdp::ForwardPrefetch>,
                   fsdp::Policies<fsdp::FullShard, fsdp::NoBackwardPrefetch>, fsdp::Policies<fsdp::ShardGradOp, fsdp::BackwardPre>,
                   fsdp::Policies<fsdp::NoShard, fsdp::NoBackwardPrefetch>, fsdp::Policies<fsdp::HybridShard, fsdp::BackwardPre>,
                   fsdp::Policies<fsdp::HybridShardZero2, fsdp::BackwardPost>) {
  [&]<class... Ps>(fsdp::Policies<Ps...>*) { every_collective_fails<Ps...>(); }(static_cast<Policies*>(nullptr));
}

TEST_CASE("a rank stalling inside a step: every rank ends in an error naming the wait, within the timeout") {
  const Outcome clean = run<fsdp::FullShard, fsdp::BackwardPre>(0, FaultMode::stall);
  for (long at : {3L, 12L, 25L}) {
    CAPTURE(at);
    const auto begin = std::chrono::steady_clock::now();
    const Outcome o = run<fsdp::FullShard, fsdp::BackwardPre>(at, FaultMode::stall);
    const auto took = std::chrono::steady_clock::now() - begin;
    check_faulty_run(o, clean, at);
    CHECK(took < std::chrono::seconds(5));  // the stall is 0.9 s, the timeout 0.3 s: bounded, no hang
  }
}
