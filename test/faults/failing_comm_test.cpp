// A communicator that fails, or stalls, at its N-th collective on one rank, for every
// strategy and prefetch mode, at every collective of two training steps: every rank ends
// in an fsdp::Error (never a hang, never a crash), and every rank's Device has freed all
// it allocated once the model is gone (nothing leaked on the failing path).
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"

namespace {

using test_support::contains;

enum class Mode { fail, stall };

// ThreadComm, except that the collective number `at` (from 1) on this rank throws, or
// sleeps past the group's timeout first; at < 1: never.
class FaultyComm {
 public:
  FaultyComm(fsdp::ThreadComm& inner, long at, Mode mode, std::chrono::milliseconds stall)
      : inner_(inner), at_(at), mode_(mode), stall_(stall) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  long issued() const { return count_; }
  fsdp::Work all_gather(const void* s, void* r, std::size_t n, fsdp::DType t) { return next(), inner_.all_gather(s, r, n, t); }
  fsdp::Work reduce_scatter(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op) {
    return next(), inner_.reduce_scatter(s, r, n, t, op);
  }
  fsdp::Work all_reduce(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op) {
    return next(), inner_.all_reduce(s, r, n, t, op);
  }
  fsdp::Work broadcast(const void* s, void* r, std::size_t n, fsdp::DType t, int root) {
    return next(), inner_.broadcast(s, r, n, t, root);
  }
  fsdp::Work barrier() { return next(), inner_.barrier(); }

 private:
  void next() {
    if (++count_ != at_) return;
    if (mode_ == Mode::fail) throw fsdp::Error("injected failure of collective #" + std::to_string(at_));
    std::this_thread::sleep_for(stall_);
  }
  fsdp::ThreadComm& inner_;
  long at_, count_ = 0;
  Mode mode_;
  std::chrono::milliseconds stall_;
};

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}

struct Outcome {
  std::vector<std::string> errors;
  std::vector<std::size_t> live_after;  // per rank, the Device's live bytes once the model is gone
  long collectives = 0;                 // on rank 0, in a run without faults
};

// Two training steps on 2 ranks; rank `faulty` has collective `at` fail or stall.
template <class... Ps>
Outcome run(long at, Mode mode, int faulty = 1) {
  const auto timeout = std::chrono::milliseconds(mode == Mode::stall ? 300 : 2000);
  Outcome out;
  out.live_after.assign(2, 0);
  out.errors = test_support::errors_per_rank(
      2,
      [&](fsdp::ThreadComm& comm) {
        fsdp::HostDevice device;
        {
          FaultyComm faulty_comm(comm, comm.rank() == faulty ? at : 0, mode, 3 * timeout);
          engine::Model model(config());
          engine::Sgd sgd(0.05f);
          try {
            auto sm = fsdp::shard<Ps...>(model, faulty_comm, device, engine::Wrap{});
            for (int s = 0; s < 2; ++s)
              engine::sharded_step(model, sm, sgd, engine::make_batch(config(), s, comm.rank(), 1));
            if (comm.rank() == 0) out.collectives = faulty_comm.issued();
          } catch (...) {
            out.live_after[comm.rank()] = device.stats(fsdp::MemorySpace::device).live_bytes +
                                          device.stats(fsdp::MemorySpace::host).live_bytes;
            throw;
          }
        }
      },
      timeout);
  return out;
}

template <class... Ps>
void every_collective_fails() {
  const long total = run<Ps...>(0, Mode::fail).collectives;
  REQUIRE(total > 10);
  for (long at = 1; at <= total; ++at) {
    CAPTURE(at);
    const Outcome o = run<Ps...>(at, Mode::fail);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CHECK(!o.errors[r].empty());  // an error on every rank, and the run returned: no hang
      CHECK(o.live_after[r] == 0);  // everything the units allocated was freed
    }
    CHECK(contains(o.errors[1], "injected failure of collective #" + std::to_string(at)));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("a collective failing on one rank, at every collective of two steps: an error on every rank, "
                   "nothing leaked", Policies,
                   fsdp::Policies<fsdp::FullShard, fsdp::BackwardPre>, fsdp::Policies<fsdp::FullShard, fsdp::BackwardPost, fsdp::ForwardPrefetch>,
                   fsdp::Policies<fsdp::FullShard, fsdp::NoBackwardPrefetch>, fsdp::Policies<fsdp::ShardGradOp, fsdp::BackwardPre>,
                   fsdp::Policies<fsdp::NoShard, fsdp::NoBackwardPrefetch>) {
  [&]<class... Ps>(fsdp::Policies<Ps...>*) { every_collective_fails<Ps...>(); }(static_cast<Policies*>(nullptr));
}

TEST_CASE("a rank stalling inside a step: every rank ends in an error naming the wait, within the timeout") {
  for (long at : {3L, 12L, 25L}) {
    CAPTURE(at);
    const auto begin = std::chrono::steady_clock::now();
    const Outcome o = run<fsdp::FullShard, fsdp::BackwardPre>(at, Mode::stall);
    const auto took = std::chrono::steady_clock::now() - begin;
    for (int r = 0; r < 2; ++r) {
      CAPTURE(o.errors[r]);
      CHECK(!o.errors[r].empty());
      CHECK(o.live_after[r] == 0);
    }
    CHECK(took < std::chrono::seconds(5));  // the stall is 0.9 s, the timeout 0.3 s: bounded, no hang
  }
}
