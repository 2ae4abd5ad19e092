// Recovery after an exception inside a step (ShardedModel::abort_step): an engine error
// inside a unit's forward or backward, or a failed allocation inside a hook, on every rank;
// abort_step frees what the step held and the following steps train exactly the model a
// run without the failed batch trains. Without abort_step the next call says what to call;
// a rank that aborts alone ends in an error on every rank, not a hang.
#include <doctest/doctest.h>

#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"

namespace faults_abort_step_test {

namespace {

using test_support::contains;
using Params = std::vector<std::pair<std::string, std::vector<float>>>;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

// A HostDevice whose allocation number `fail_at` (counted from arm()) throws std::bad_alloc.
struct FailingDevice {
  fsdp::HostDevice host;
  long fail_at = -1, count = 0;
  void arm(long n) { fail_at = n, count = 0; }
  fsdp::DeviceId id() const { return host.id(); }
  void* allocate(std::size_t bytes, fsdp::MemorySpace s) {
    if (fail_at >= 0 && ++count == fail_at) throw std::bad_alloc();
    return host.allocate(bytes, s);
  }
  void deallocate(void* p, std::size_t bytes, fsdp::MemorySpace s) { host.deallocate(p, bytes, s); }
  void copy(void* d, const void* s, std::size_t n) { host.copy(d, s, n); }
  void fill_zero(void* p, std::size_t n) { host.fill_zero(p, n); }
  void scale(void* p, std::size_t n, fsdp::DType t, double f) { host.scale(p, n, t, f); }
  void accumulate(void* d, const void* s, std::size_t n, fsdp::DType t) { host.accumulate(d, s, n, t); }
  void cast(void* d, fsdp::DType to, const void* s, fsdp::DType from, std::size_t n) { host.cast(d, to, s, from, n); }
  void synchronize() {}
  fsdp::MemoryStats stats(fsdp::MemorySpace s) const { return host.stats(s); }
  void reset_peak(fsdp::MemorySpace s) { host.reset_peak(s); }
};

// The engine's hooks, failing like an engine whose kernel throws: right after the n-th
// unit hook of the step (counting before/after forward and backward), inside that unit's
// scope. n < 0: never.
struct FailingHooks {
  engine::UnitHooks inner;
  int fail_after = -1, calls = 0;
  void maybe_fail() {
    if (++calls == fail_after) throw std::runtime_error("engine kernel failed");
  }
  template <class M> void before_forward(const M* m) { inner.before_forward(m), maybe_fail(); }
  template <class M> void after_forward(const M* m) { inner.after_forward(m), maybe_fail(); }
  template <class M> void before_backward(const M* m) { inner.before_backward(m), maybe_fail(); }
  template <class M> void after_backward(const M* m) { inner.after_backward(m), maybe_fail(); }
};

enum class Fault { none, engine, allocation };

// Steps 0..4 of SGD on 2 ranks; at step `failing` the fault hits every rank at point `at`
// and the step is aborted (with `skip` = true, that step's batch is simply not run).
template <class... Ps>
Params train(int failing, Fault fault, int at, bool skip, std::vector<std::size_t>* live_around = nullptr) {
  const auto c = config();
  std::vector<Params> per_rank(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    FailingDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < 5; ++s) {
      if (s == failing && skip) continue;
      const auto batch = engine::make_batch(c, s, comm.rank(), 1);
      const std::size_t live_before = device.stats(fsdp::MemorySpace::device).live_bytes;
      if (s == failing && fault != Fault::none) {
        bool failed = false;
        try {
          sm.zero_grad();
          FailingHooks hooks{{sm}, fault == Fault::engine ? at : -1};
          if (fault == Fault::allocation) device.arm(at);
          engine::Mat dout;
          engine::mse(model.forward(batch.x, hooks), batch.y, dout);
          model.backward(dout, hooks);
          sm.finish_backward();
        } catch (const std::exception&) {
          failed = true;
        }
        device.arm(-1);
        REQUIRE(failed);  // the fault point lies inside the step
        sm.abort_step();
        for (auto& u : sm) CHECK(u->state() == fsdp::TrainingState::IDLE);
        if (live_around && comm.rank() == 0)
          live_around->assign({live_before, device.stats(fsdp::MemorySpace::device).live_bytes});
        continue;
      }
      engine::sharded_step(model, sm, sgd, std::span<const engine::Batch>(&batch, 1));
    }
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  CHECK(per_rank[0] == per_rank[1]);
  return per_rank[0];
}

}  // namespace

TEST_CASE_TEMPLATE("an engine error inside a unit's forward or backward on every rank: abort_step, then training as if "
                   "the batch had been skipped", Strategy, fsdp::FullShard, fsdp::ShardGradOp) {
  // 5 units (root, 3 blocks, gain): 10 forward hook calls, then 10 backward ones.
  for (int failing : {0, 2}) {  // in the first iteration (the order is being recorded), and later
    const Params skipped = train<Strategy, fsdp::BackwardPre, fsdp::ForwardPrefetch>(failing, Fault::none, 0, true);
    for (int at : {1, 4, 9, 11, 14, 19}) {
      CAPTURE(failing);
      CAPTURE(at);
      std::vector<std::size_t> live;
      const Params got = train<Strategy, fsdp::BackwardPre, fsdp::ForwardPrefetch>(failing, Fault::engine, at, false, &live);
      CHECK(got == skipped);
      REQUIRE(live.size() == 2);
      CHECK(live[1] == live[0]);  // everything the step held is freed
    }
  }
  const Params plain = train<Strategy>(-1, Fault::none, 0, false);
  CHECK(plain != train<Strategy>(2, Fault::none, 0, true));  // skipping a batch changes training: the check can fail
}

TEST_CASE("a failed allocation inside a hook on every rank: abort_step, then training as if the batch had been skipped") {
  const Params skipped = train<fsdp::FullShard, fsdp::BackwardPost>(2, Fault::none, 0, true);
  for (int at : {1, 2, 5, 9, 13}) {  // all-gathers in forward, gradients and reductions in backward
    CAPTURE(at);
    CHECK(train<fsdp::FullShard, fsdp::BackwardPost>(2, Fault::allocation, at, false) == skipped);
  }
}

TEST_CASE("without abort_step the next call says what to call; a rank aborting alone is an error on every rank") {
  const auto c = config();
  SUBCASE("a hook left by an exception") {
    const auto msgs = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      FailingDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      device.arm(1);
      CHECK_THROWS_AS(sm[0].pre_forward(), std::bad_alloc);
      device.arm(-1);
      sm.zero_grad();
    });
    CHECK(contains(msgs[0], "unit '<root>' on rank 0: zero_grad called after pre_forward left by an exception; call "
                            "abort_step() (ShardedModel::abort_step) on every rank first"));
  }
  SUBCASE("an engine error between hooks leaves a unit in FORWARD") {
    const auto msgs = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      sm[0].pre_forward();
      sm.zero_grad();
    });
    CHECK(contains(msgs[0], "zero_grad called in state FORWARD; expected IDLE"));  // docs: call abort_step()
  }
  SUBCASE("one rank aborts while the other computes") {
    const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
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
      } catch (const std::runtime_error&) {
        sm.abort_step();
      }
    });
    for (int r = 0; r < 2; ++r) CHECK(!msgs[r].empty());
  }
}

TEST_CASE("a unit outside a model: its own abort_step frees what it held and agrees across its world") {
  const auto c = config();
  const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    FailingDevice device;
    fsdp::Sharded<engine::Model> unit(model, comm, device);
    const std::size_t live = device.stats(fsdp::MemorySpace::device).live_bytes;
    unit.pre_forward();  // the engine fails inside the unit's forward
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes > live);
    unit.abort_step();
    CHECK(unit.state() == fsdp::TrainingState::IDLE);
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == live);
    unit.pre_forward();  // usable again
    unit.post_forward();
  });
  for (int r = 0; r < 2; ++r) CHECK(msgs[r].empty());
}

}  // namespace faults_abort_step_test
