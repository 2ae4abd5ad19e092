// A communicator that fails, or stalls, at its N-th collective on one rank, for every
// strategy (the hybrid ones on a 2x2 mesh, failing in either group) and prefetch mode, at
// every collective of two training steps: every rank ends in an fsdp::Error (never a
// hang, never a crash), no rank was shown a wrong value first (every value its hooks
// returned equals a clean run's, and no rank applied the step the fault fell in), and
// every rank's Device has freed all it allocated once the model is gone (nothing leaked
// on the failing path). The same over TcpComm: tcp_faults_test.cpp; over MpiComm:
// test/mpi/mpi_faults_test.cpp. And a model destroyed with collectives in flight whose
// waits fail: their messages name the units through the model's ExecutionOrder, which
// must outlive the units (a use-after-free under tools/sanitize.sh asan otherwise).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "test/faults/faulty_training.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"

namespace faults_failing_comm_test {

namespace {

using test_support::contains;
using test_support::Fault;
using test_support::FaultMode;
using test_support::Outcome;

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
        test_support::train_with_fault<Ps...>(comm, fault, test_support::two_blocks(), 2, out.runs[static_cast<std::size_t>(comm.rank())]);
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

// ThreadComm, except that its tagged collectives are never complete inside the call (so
// the library keeps a reduction in flight after post_backward), and while `fail` is set
// their wait() throws naming the unit through its tag, as a backend does when it learns
// of a failure at the wait; the names it gave are kept in `named`.
class FailsAtWait : public fsdp::detail::WrappedCollectives<FailsAtWait, fsdp::ThreadComm> {
 public:
  struct Record {
    bool fail = false;
    std::vector<std::string> named;
  };
  FailsAtWait(fsdp::ThreadComm& inner, Record& record) : inner_(&inner), record_(&record) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  fsdp::Work broadcast(const void* s, void* r, std::size_t n, fsdp::DType t, int root) {
    return inner_->broadcast(s, r, n, t, root);
  }
  fsdp::Work barrier() { return inner_->barrier(); }

 private:
  friend class fsdp::detail::WrappedCollectives<FailsAtWait, fsdp::ThreadComm>;
  struct Pending final : fsdp::Work::Pending {
    fsdp::Work inner;
    fsdp::CollectiveTag tag;
    Record& record;
    Pending(fsdp::Work w, const fsdp::CollectiveTag& t, Record& r) : inner(std::move(w)), tag(t), record(r) {}
    void wait() override {
      inner.wait();
      if (!record.fail) return;
      record.named.push_back(tag.describe());
      fsdp::detail::fail("injected failure at the wait of ", record.named.back());
    }
    bool ready() override { return inner.ready(); }
  };
  fsdp::Work wrap(fsdp::Work w, const fsdp::CollectiveTag* tag) {
    return tag ? fsdp::Work(std::make_unique<Pending>(std::move(w), *tag, *record_)) : std::move(w);
  }
  fsdp::Work gather(const void* s, void* r, std::size_t n, fsdp::DType t, const fsdp::CollectiveTag* tag) {
    return wrap(inner_->all_gather(s, r, n, t), tag);
  }
  fsdp::Work scatter(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op,
                     const fsdp::CollectiveTag* tag) {
    return wrap(inner_->reduce_scatter(s, r, n, t, op), tag);
  }
  fsdp::Work reduce(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op,
                    const fsdp::CollectiveTag* tag) {
    return wrap(inner_->all_reduce(s, r, n, t, op), tag);
  }
  fsdp::ThreadComm* inner_;
  Record* record_;
};

}  // namespace

TEST_CASE("a model destroyed mid-backward with a collective in flight that fails at its wait: the error names the unit") {
  std::vector<FailsAtWait::Record> records(2);
  const auto errors = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    auto& record = records[static_cast<std::size_t>(comm.rank())];
    FailsAtWait failing(comm, record);
    engine::Model model(test_support::two_blocks());
    fsdp::HostDevice device;
    {
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre>(model, failing, device, engine::Wrap{});
      sm.zero_grad();
      sm.unit("").pre_forward();
      for (const char* n : {"blocks.0", "blocks.1", "gain"}) sm.unit(n).pre_forward(), sm.unit(n).post_forward();
      sm.unit("").post_forward();
      sm.unit("").pre_backward();
      sm.unit("gain").pre_backward();
      sm.unit("gain").post_backward();  // its reduction stays in flight
      record.fail = true;
    }  // the units' destructors wait, and the waits fail
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(errors[r] == "");  // a destructor's wait drops its error
    std::string named;
    for (const auto& n : records[r].named) named += n + "; ";
    CAPTURE(named);
    CHECK(std::find(records[r].named.begin(), records[r].named.end(), "unit 'gain' (gradient reduction, pass 0)") !=
          records[r].named.end());
    for (const auto& n : records[r].named) CHECK(contains(n, "unit '"));
  }
}

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
    CHECK(contains(o.errors[0], "timed out after 300 ms"));  // the wait, named
    CHECK(took < std::chrono::seconds(5));  // the stall is 0.9 s, the timeout 0.3 s: bounded, no hang
  }
}

}  // namespace faults_failing_comm_test
