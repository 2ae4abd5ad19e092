// A communicator that fails, or stalls, at its N-th collective on one rank, for every
// strategy (the hybrid ones on a 2x2 mesh, failing in either group) and prefetch mode, at
// every collective of two training steps: every rank ends in an fsdp::Error (never a
// hang, never a crash), and every rank's Device has freed all it allocated once the model
// is gone (nothing leaked on the failing path).
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"

namespace {

using test_support::contains;

enum class Mode { fail, stall };

// ThreadComm, except that the collective number `at` (from 1) on this rank throws, or
// sleeps past the group's timeout first; at < 1: never. Groups split from it (a device
// mesh's) count with it: `at` numbers this rank's collectives on all of them.
class FaultyComm {
 public:
  FaultyComm(fsdp::ThreadComm& inner, long at, Mode mode, std::chrono::milliseconds stall)
      : inner_(&inner), fault_(std::make_shared<Fault>(Fault{at, mode, stall})) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  long issued() const { return fault_->count; }
  fsdp::Work all_gather(const void* s, void* r, std::size_t n, fsdp::DType t) { return next(), inner_->all_gather(s, r, n, t); }
  fsdp::Work reduce_scatter(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op) {
    return next(), inner_->reduce_scatter(s, r, n, t, op);
  }
  fsdp::Work all_reduce(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op) {
    return next(), inner_->all_reduce(s, r, n, t, op);
  }
  fsdp::Work broadcast(const void* s, void* r, std::size_t n, fsdp::DType t, int root) {
    return next(), inner_->broadcast(s, r, n, t, root);
  }
  fsdp::Work barrier() { return next(), inner_->barrier(); }
  FaultyComm split(int color, int key) {
    return FaultyComm(std::make_shared<fsdp::ThreadComm>(inner_->split(color, key)), fault_);
  }

 private:
  struct Fault {
    long at;
    Mode mode;
    std::chrono::milliseconds stall;
    long count = 0;
  };
  FaultyComm(std::shared_ptr<fsdp::ThreadComm> owned, std::shared_ptr<Fault> fault)
      : owned_(std::move(owned)), inner_(owned_.get()), fault_(std::move(fault)) {}
  void next() {
    if (++fault_->count != fault_->at) return;
    if (fault_->mode == Mode::fail) throw fsdp::Error("injected failure of collective #" + std::to_string(fault_->at));
    std::this_thread::sleep_for(fault_->stall);
  }
  std::shared_ptr<fsdp::ThreadComm> owned_;  // a split group's
  fsdp::ThreadComm* inner_;
  std::shared_ptr<Fault> fault_;
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

template <class... Ps>
constexpr bool hybrid = (std::is_same_v<Ps, fsdp::HybridShard> || ...) || (std::is_same_v<Ps, fsdp::HybridShardZero2> || ...);

// Two training steps on 2 ranks (4 as a 2x2 mesh for the hybrid strategies); rank `faulty`
// has collective `at` fail or stall.
template <class... Ps>
Outcome run(long at, Mode mode, int faulty = 1) {
  const auto timeout = std::chrono::milliseconds(mode == Mode::stall ? 300 : 2000);
  const int world = hybrid<Ps...> ? 4 : 2;
  Outcome out;
  out.live_after.assign(static_cast<std::size_t>(world), 0);
  out.errors = test_support::errors_per_rank(
      world,
      [&](fsdp::ThreadComm& comm) {
        fsdp::HostDevice device;
        {
          FaultyComm faulty_comm(comm, comm.rank() == faulty ? at : 0, mode, 3 * timeout);
          engine::Model model(config());
          engine::Sgd sgd(0.05f);
          try {
            auto train = [&](auto& group) {
              auto sm = fsdp::shard<Ps...>(model, group, device, engine::Wrap{});
              for (int s = 0; s < 2; ++s)
                engine::sharded_step(model, sm, sgd, engine::make_batch(config(), s, comm.rank(), 1));
            };
            if constexpr (hybrid<Ps...>) {
              fsdp::DeviceMesh mesh(faulty_comm, fsdp::MeshShape{2, 2});
              train(mesh);
            } else {
              train(faulty_comm);
            }
            if (comm.rank() == 0) out.collectives = faulty_comm.issued();
          } catch (...) {
            out.live_after[static_cast<std::size_t>(comm.rank())] = device.stats(fsdp::MemorySpace::device).live_bytes +
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
    for (std::size_t r = 0; r < o.errors.size(); ++r) {
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
                   fsdp::Policies<fsdp::NoShard, fsdp::NoBackwardPrefetch>, fsdp::Policies<fsdp::HybridShard, fsdp::BackwardPre>,
                   fsdp::Policies<fsdp::HybridShardZero2, fsdp::BackwardPost>) {
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
