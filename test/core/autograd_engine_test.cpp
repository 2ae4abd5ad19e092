// Engines with autograd drive the hooks from their own backward, and some hooks never fire:
// a unit's input-side hook does not run when its inputs need no gradient (the first layer),
// and a unit whose outputs do not reach the loss runs no backward at all. The model-level
// ShardedModel::finish_backward (FSDP's queued final callback) completes what is pending.
// Gradients an engine would create lazily are refused, naming the parameter.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "test/support/rank_errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_autograd_engine_test {

using test_support::contains;
using test_support::error_of;

namespace {

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

// The reference engine's hooks, minus the post_backward calls of the modules listed: as an
// autograd engine whose post-backward hook sits on a unit's inputs would miss them.
struct MissingPostBackward : engine::UnitHooks {
  std::set<const void*> skip;
  bool all = false;
  template <class M> void after_backward(const M* m) {
    if (!all && !skip.count(m)) engine::UnitHooks::after_backward(m);
  }
};

// Trains `steps` AdamW steps with the hooks `make_hooks(model, sm)` gives, on the thread
// ranks directly or through an AsyncCommunicator (reductions left in flight); returns the
// full parameters (the same on every rank).
template <bool Async, class MakeHooks>
test_support::Params train(int world, int steps, MakeHooks make_hooks) {
  const auto c = config();
  std::vector<test_support::Params> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& thread_comm) {
    auto run = [&](auto& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
      engine::AdamW opt({}, alloc);
      for (int s = 0; s < steps; ++s) {
        sm.zero_grad();
        auto hooks = make_hooks(model, sm);
        const auto b = engine::make_batch(c, s, thread_comm.rank(), 1);
        engine::Mat dout;
        engine::mse(model.forward(b.x, hooks), b.y, dout);
        model.backward(dout, hooks);
        sm.finish_backward();
        for (auto& u : sm) CHECK(u->state() == fsdp::TrainingState::IDLE);
        opt.step(engine::slots(sm));
      }
      per_rank[thread_comm.rank()] = engine::gather_full_parameters(model, sm);
    };
    if constexpr (Async) {
      fsdp::AsyncCommunicator async(thread_comm);
      run(async);
    } else {
      run(thread_comm);
    }
  });
  for (int r = 1; r < world; ++r) CHECK(test_support::bitwise_equal(per_rank[r], per_rank[0]));
  return per_rank[0];
}

template <bool Async>
void check_pending_completed(int world) {
  CAPTURE(world);
  const auto reference = test_support::reference_params(config(), 3, world);
  // The root's inputs need no gradient: its post_backward never fires.
  CHECK(test_support::bitwise_equal(train<Async>(world, 3, [](engine::Model& m, fsdp::ShardedModel& sm) {
    return MissingPostBackward{{sm}, {&m}};
  }), reference));
  // No post_backward fires at all: the engine tracks nothing.
  CHECK(test_support::bitwise_equal(train<Async>(world, 3, [](engine::Model&, fsdp::ShardedModel& sm) {
    return MissingPostBackward{{sm}, {}, true};
  }), reference));
}

// Two heads on one input; only `used` reaches the loss.
struct TwoHeads {
  engine::Linear used{4, 3, 7}, unused{4, 2, 9};
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) {
    f("used", used);
    f("unused", unused);
  }
};

struct LazyGrad {  // a gradient with no shape until a first backward would create it
  fsdp::HostTensor w{{2, 3}}, w_grad{};
  template <class F> void visit_parameters(F&& f) { f("w", w, w_grad); }
};

}  // namespace

TEST_CASE("finish_backward runs the post_backward a unit's hooks never fired; training equals unsharded training") {
  SUBCASE("synchronous, 2 ranks") { check_pending_completed<false>(2); }
  SUBCASE("synchronous, 4 ranks") { check_pending_completed<false>(4); }
  SUBCASE("asynchronous, 2 ranks") { check_pending_completed<true>(2); }
}

TEST_CASE("a unit whose outputs reach no loss is resharded at finish_backward, its gradient untouched") {
  const int world = 2;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    TwoHeads m;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::ShardGradOp>(m, comm, device, fsdp::wrap_types<engine::Linear>{});
    auto& used = sm.unit("used");
    auto& unused = sm.unit("unused");
    // Bytes computed from the shapes: shards of both, and `unused`'s full (padded) parameters.
    auto shard_bytes = [&](std::int64_t n) { return static_cast<std::size_t>((n + world - 1) / world) * 4; };
    const std::size_t steady = 2 * shard_bytes(4 * 3 + 3) + 2 * shard_bytes(4 * 2 + 2);
    const std::size_t unused_full = shard_bytes(4 * 2 + 2) * world;
    for (int step = 0; step < 2; ++step) {
      sm.zero_grad();
      const auto b = engine::make_batch(engine::ModelConfig{.in = 4}, step, comm.rank(), 1);
      engine::Mat y, dout;
      { auto s = used.forward_scope(); y = m.used.forward(b.x); }
      { auto s = unused.forward_scope(); m.unused.forward(b.x); }  // logged, say; no loss uses it
      engine::mse(y, engine::Mat(1, 3), dout);
      { auto s = used.backward_scope(); m.used.backward(dout); }
      CHECK(device.stats().live_bytes == steady + unused_full);  // ShardGradOp kept it for a backward
      sm.finish_backward();
      CHECK(unused.state() == fsdp::TrainingState::IDLE);
      CHECK(device.stats().live_bytes == steady);
      const auto& g = unused.shards()[0];
      const auto* grad = static_cast<const float*>(g.grad);
      CHECK(std::all_of(grad, grad + g.numel, [](float v) { return v == 0.0f; }));
      const auto& gu = used.shards()[0];
      const auto* used_grad = static_cast<const float*>(gu.grad);
      CHECK(std::any_of(used_grad, used_grad + gu.numel, [](float v) { return v != 0.0f; }));
    }
  });
}

TEST_CASE("finish_backward refuses a unit still in forward before completing anything") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    sm.unit("gain").pre_forward();
    sm.unit("blocks.0").pre_backward();
    CHECK(contains(error_of([&] { sm.finish_backward(); }),
                   "unit 'gain' on rank 0: finish_backward called in state FORWARD; expected BACKWARD_POST or IDLE"));
    CHECK(sm.unit("blocks.0").state() == fsdp::TrainingState::BACKWARD_PRE);  // nothing reduced
    sm.unit("gain").post_forward();
    sm.finish_backward();
    CHECK(sm.unit("blocks.0").state() == fsdp::TrainingState::IDLE);
  });
}

TEST_CASE("a gradient created lazily (no shape at setup) is refused, naming the parameter") {
  const auto msgs = test_support::errors_per_rank(2, [](fsdp::ThreadComm& comm) {
    LazyGrad m;
    fsdp::HostDevice device;
    fsdp::shard<fsdp::FullShard>(m, comm, device);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "unit '<root>' on rank " + std::to_string(r) +
                                ": the gradient of parameter 'w' does not have the parameter's shape and dtype "
                                "(parameter [2, 3] f32, gradient [] f32); gradients created lazily by the first "
                                "backward are not supported"));
  }
}

}  // namespace core_autograd_engine_test
