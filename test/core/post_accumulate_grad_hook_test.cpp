// Post-accumulate-grad hooks (fsdp/policy/post_accumulate_grad_hook.hpp) and the optimizer in
// backward built on them (engine::OptimizerInBackward): when hooks run (once per unit per
// synchronized backward, after the reduction, also on an asynchronous backend; never under
// no_sync or a deferred replica all-reduce), bitwise parity of stepping in backward with
// stepping after it, the memory it saves (to the byte, from the model's configuration), and
// what it refuses.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_post_accumulate_grad_hook_test {

namespace {

using fsdp::GradientAfterHook;
using test_support::Params;
using Async = fsdp::AsyncCommunicator<fsdp::ThreadComm>;

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13, hidden 7: no unit size divisible by 2 or 4
  c.blocks = 3;
  return c;
}

// Runs f(model, sharded, device, rank) on every rank, over an AsyncCommunicator (collectives
// on a thread of their own, reductions left in flight) or the ThreadComm directly.
template <class Strategy, class... Ps, class F>
void on_ranks(int world, fsdp::MeshShape shape, bool async, F&& f) {
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    auto run = [&](auto& c) {
      fsdp::DeviceMesh mesh(c, shape);
      engine::Model model(config());
      fsdp::HostDevice device;
      auto sm = fsdp::shard<Strategy, Ps...>(model, mesh, device, engine::Wrap{});
      f(model, sm, device, mesh, comm.rank());
    };
    if (async) {
      Async a(comm);
      run(a);
    } else {
      run(comm);
    }
  });
}

void micro_batch(engine::Model& model, fsdp::ShardedModel& sm, const engine::Batch& b) {
  engine::UnitHooks hooks{sm};
  engine::Mat dout;
  engine::mse(model.forward(b.x, hooks), b.y, dout);
  model.backward(dout, hooks);
  sm.finish_backward();
}

std::vector<float> copy_grad(const fsdp::ShardView& v) {
  std::vector<float> g(static_cast<std::size_t>(v.numel));
  if (v.numel) std::memcpy(g.data(), v.grad, g.size() * sizeof(float));
  return g;
}

// `steps` steps of `k` micro-batches (all but the last under no_sync); the optimizer steps
// after backward, or inside it (OptimizerInBackward). Returns the trained parameters.
template <class Strategy, class... Ps>
Params train(int world, fsdp::MeshShape shape, bool async, bool in_backward, bool adam, int k, int steps = 3) {
  std::vector<Params> per_rank(world);
  on_ranks<Strategy, Ps...>(world, shape, async, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice&, auto&, int r) {
    const auto c = config();
    auto step_with = [&](auto make) {
      using Opt = typename decltype(make())::element_type;
      std::optional<engine::OptimizerInBackward<Opt>> inside;
      auto after = make();
      if (in_backward) inside.emplace(sm, make);
      for (int s = 0; s < steps; ++s) {
        std::vector<engine::Batch> micro;
        for (int j = 0; j < k; ++j) micro.push_back(engine::make_batch(c, s * k + j, r * 2, 2));
        if (in_backward) {
          engine::sharded_forward_backward(model, sm, micro);
        } else {
          engine::sharded_step(model, sm, *after, micro);
        }
      }
      if (inside) CHECK(inside->unit_steps() == static_cast<long>(steps * sm.size()));
    };
    if (adam) step_with([] { return std::make_unique<engine::AdamW>(engine::AdamW::Options{}); });
    else step_with([] { return std::make_unique<engine::Sgd>(0.05f); });
    per_rank[r] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  return per_rank[0];
}

template <class Strategy, class... Ps>
void check_parity(int world, fsdp::MeshShape shape) {
  for (bool async : {false, true})
    for (bool adam : {false, true})
      for (int k : {1, 2}) {
        CAPTURE(async);
        CAPTURE(adam);
        CAPTURE(k);
        const Params after = train<Strategy, Ps...>(world, shape, async, false, adam, k);
        const Params inside = train<Strategy, Ps...>(world, shape, async, true, adam, k);
        CHECK(inside == after);  // bitwise: the same element-wise arithmetic on the same gradients
      }
}

}  // namespace

TEST_CASE("a unit's hook runs once per synchronized backward, on its final gradient") {
  for (bool async : {false, true}) {
    CAPTURE(async);
    on_ranks<fsdp::FullShard>(2, {1, 2}, async, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice&, auto&, int r) {
      const auto c = config();
      std::vector<std::pair<std::string, std::vector<std::vector<float>>>> seen;  // unit, its gradient shards then
      sm.set_post_accumulate_grad_hook([&](fsdp::Unit& u) {
        CHECK(u.state() == fsdp::TrainingState::BACKWARD_POST);
        std::vector<std::vector<float>> g;
        for (const auto& v : u.shards()) g.push_back(copy_grad(v));
        seen.emplace_back(u.fqn(), std::move(g));
      });
      for (int s = 0; s < 2; ++s) {
        sm.zero_grad();
        {
          auto no_sync = sm.no_sync();
          micro_batch(model, sm, engine::make_batch(c, 2 * s, r, 1));
        }
        CHECK(seen.empty());  // not final yet
        sm.set_gradient_sync_mode(s == 0 ? fsdp::GradientSyncMode::keep_unsharded : fsdp::GradientSyncMode::reduce_every_microbatch);
        micro_batch(model, sm, engine::make_batch(c, 2 * s + 1, r, 1));
        // Once per unit, in backward order, each with what the unit holds after finish_backward.
        REQUIRE(seen.size() == sm.size());
        for (std::size_t i = 0; i < sm.size(); ++i) {
          CAPTURE(seen[i].first);
          const auto& u = sm.unit(seen[i].first);
          CHECK(std::count_if(seen.begin(), seen.end(), [&](auto& e) { return e.first == u.fqn(); }) == 1);
          for (std::size_t k = 0; k < u.shards().size(); ++k) CHECK(seen[i].second[k] == copy_grad(u.shards()[k]));
        }
        CHECK(seen.front().first != "");  // backward starts with the last block, ends at the root
        CHECK(seen.back().first == "");
        seen.clear();
      }
      sm.set_post_accumulate_grad_hook({});  // removed: no more calls
      micro_batch(model, sm, engine::make_batch(c, 9, r, 1));
      CHECK(seen.empty());
    });
  }
}

TEST_CASE("HybridShard: no hook while the replica all-reduce is deferred") {
  on_ranks<fsdp::HybridShard>(4, {2, 2}, false, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice&, auto&, int r) {
    int calls = 0;
    sm.set_post_accumulate_grad_hook([&](fsdp::Unit&) { ++calls; });
    sm.set_requires_all_reduce(false);
    micro_batch(model, sm, engine::make_batch(config(), 0, r, 1));
    CHECK(calls == 0);
    sm.set_requires_all_reduce(true);
    micro_batch(model, sm, engine::make_batch(config(), 1, r, 1));
    CHECK(calls == static_cast<int>(sm.size()));
  });
}

TEST_CASE("per-parameter hooks see each parameter's slice of the final gradient") {
  on_ranks<fsdp::FullShard>(3, {1, 3}, true, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice&, auto&, int r) {
    std::vector<std::string> called;
    sm.set_post_accumulate_param_hook([&](fsdp::Unit& u, const fsdp::ParamView& p) {
      called.emplace_back(p.fqn);
      CHECK(p.unit == u.fqn());
      if (p.count == 0) {
        CHECK(p.grad == nullptr);
      } else {
        CHECK(p.grad == static_cast<std::byte*>(u.shards()[p.shard].grad) + p.shard_offset * 4);
      }
    });
    micro_batch(model, sm, engine::make_batch(config(), 0, r, 1));
    std::vector<std::string> all;
    for (const auto& p : sm.parameters()) all.emplace_back(p.fqn);
    std::sort(called.begin(), called.end());
    std::sort(all.begin(), all.end());
    CHECK(called == all);  // every parameter once, on every rank
  });
}

TEST_CASE("optimizer in backward trains bit for bit as the step after backward") {
  SUBCASE("FullShard") { check_parity<fsdp::FullShard>(2, {1, 2}); }
  SUBCASE("ShardGradOp") { check_parity<fsdp::ShardGradOp>(3, {1, 3}); }
  SUBCASE("NoShard") { check_parity<fsdp::NoShard>(2, {1, 2}); }
  SUBCASE("HybridShard 2x2") { check_parity<fsdp::HybridShard>(4, {2, 2}); }
  SUBCASE("FullShard, offload") { check_parity<fsdp::FullShard, fsdp::OffloadParams>(2, {1, 2}); }
}

TEST_CASE("optimizer in backward under bf16 mixed precision matches the step after backward") {
  for (bool adam : {false, true}) {
    const auto after = train<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(2, {1, 2}, true, false, adam, 2);
    const auto inside = train<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(2, {1, 2}, true, true, adam, 2);
    CHECK(inside == after);
  }
}

// Memory, FullShard without prefetch, N ranks, unit u of n_u f32 elements: padded
// P_u = ceil(n_u/N)*N*4 bytes, shard S_u = P_u/N. Stepping after backward the sharded
// gradients live for good (steady state: sum 2*S_u, plus AdamW's state); stepping in
// backward each exists only from its reduction to the end of its hook. The peak, in the
// backward of the largest layer (the root unsharded throughout, parameters and gradient),
// is then lower by exactly sum S_u; and at each hook the live bytes are the shards, the
// root's unsharded parameters and gradient (2*P_root, unless the root is the unit hooked)
// and the hooked unit's S_u: no other unit's gradient. On one rank, stepping after
// backward, the engine adds into the sharded gradients themselves (each the whole padded
// parameter): no unsharded gradient, and the peak is lower by 2 * (P_root + max layer).
// Stepping in backward the hook frees them, so backward allocates each again for the
// engine, in place of the unsharded gradient: the same peak. Every expected number comes
// from the model's configuration.
TEST_CASE("optimizer in backward: per-rank memory, to the byte") {
  const auto c = config();
  const auto numels = test_support::unit_numels(c);
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    auto padded = [&](std::int64_t n) { return static_cast<std::size_t>((n + world - 1) / world * world) * 4; };
    std::size_t shards = 0, max_layer = 0;
    for (std::size_t i = 0; i < numels.size(); ++i) {
      shards += padded(numels[i]) / world;
      if (i > 0) max_layer = std::max(max_layer, padded(numels[i]));
    }
    const std::size_t root = padded(numels[0]);
    for (bool adam : {false, true}) {
      CAPTURE(adam);
      auto state_of = [&](int r) {  // AdamW: 2 moments per valid element of rank r's shards
        std::size_t state = 0;
        for (auto n : numels) {
          const std::int64_t s = (n + world - 1) / world;
          if (adam) state += 2 * 4 * static_cast<std::size_t>(std::clamp<std::int64_t>(n - r * s, 0, s));
        }
        return state;
      };
      std::vector<std::size_t> peak_after(world), peak_inside(world);
      for (bool in_backward : {false, true}) {
        fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
          const int r = comm.rank();
          engine::Model model(c);
          fsdp::HostDevice device;
          auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
          const std::size_t state = state_of(r);
          engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
          engine::AdamW adamw({}, alloc);
          engine::Sgd sgd(0.05f);
          std::optional<engine::OptimizerInBackward<engine::AdamW>> adam_inside;
          engine::Sgd sgd_inside(0.05f);  // stateless: one for every unit
          if (in_backward && adam) {
            adam_inside.emplace(sm, [&] { return std::make_unique<engine::AdamW>(engine::AdamW::Options{}, alloc); });
          } else if (in_backward) {
            sm.set_post_accumulate_grad_hook([&](fsdp::Unit& u) {
              std::int64_t n = 0;
              for (const auto& p : u.parameters()) n += p.numel;
              CHECK(device.stats().live_bytes == shards + (u.fqn().empty() ? 0 : 2 * root) + padded(n) / world);
              std::vector<engine::Slot> slots;
              for (const auto& v : u.shards()) slots.push_back({static_cast<float*>(v.param), static_cast<const float*>(v.grad), v.numel});
              sgd_inside.step(slots);
            }, GradientAfterHook::free);
          }
          if (in_backward) CHECK(device.stats().live_bytes == shards);  // the gradients went with the hook's setting
          device.reset_peak();  // setup held every gradient before the hook freed them
          for (int step = 0; step < 3; ++step) {
            const auto b = engine::make_batch(c, step, r, 1);
            if (!in_backward) {
              if (adam) engine::sharded_step(model, sm, adamw, b);
              else engine::sharded_step(model, sm, sgd, b);
              CHECK(device.stats().live_bytes == 2 * shards + state);
            } else {
              engine::sharded_forward_backward(model, sm, b);
              CHECK(device.stats().live_bytes == shards + state);
            }
          }
          (in_backward ? peak_inside : peak_after)[r] = device.stats().peak_bytes;
        });
      }
      for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        const std::size_t unsharded_grads = world == 1 ? 0 : root + max_layer;
        CHECK(peak_after[r] == 2 * shards + state_of(r) + root + max_layer + unsharded_grads);
        CHECK(peak_inside[r] == shards + state_of(r) + 2 * root + 2 * max_layer);
      }
    }
  }
}

TEST_CASE("on an asynchronous backend at most one more unit holds a gradient at a hook") {
  on_ranks<fsdp::FullShard>(2, {1, 2}, true, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice&, auto&, int r) {
    std::vector<fsdp::Unit*> units;
    for (auto& u : sm) units.push_back(u.get());
    int most = 0, hooks = 0;
    sm.set_post_accumulate_grad_hook([&](fsdp::Unit& u) {
      ++hooks;
      CHECK(u.shards()[0].grad != nullptr);
      const int holding = static_cast<int>(std::count_if(units.begin(), units.end(), [](fsdp::Unit* x) {
        return std::any_of(x->shards().begin(), x->shards().end(), [](auto& v) { return v.grad != nullptr; });
      }));
      most = std::max(most, holding);
    }, GradientAfterHook::free);
    for (int s = 0; s < 2; ++s) micro_batch(model, sm, engine::make_batch(config(), s, r, 1));
    CHECK(hooks == 2 * static_cast<int>(sm.size()));
    CHECK(most == 2);  // the hooked unit and the one whose reduction is in flight
  });
}

TEST_CASE("gradients freed by the hook: clipping and with_grads summons are refused, naming the unit") {
  on_ranks<fsdp::FullShard>(2, {1, 2}, false, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice& device, auto& mesh, int r) {
    engine::OptimizerInBackward<engine::Sgd> inside(sm, [] { return std::make_unique<engine::Sgd>(0.05f); });
    micro_batch(model, sm, engine::make_batch(config(), 0, r, 1));
    for (const auto& v : sm.shards()) CHECK(v.grad == nullptr);
    for (const auto& p : sm.parameters()) CHECK(p.grad == nullptr);
    const std::string clip = test_support::error_of([&] { fsdp::clip_grad_norm(sm, mesh, device, {.max_norm = 1.0}); });
    CHECK(test_support::contains(clip, "post-accumulate-grad hook"));
    CHECK(test_support::contains(clip, "unit '"));
    const std::string summon = test_support::error_of([&] { auto s = sm.summon_full_params({.with_grads = true}); });
    CHECK(test_support::contains(summon, "GradientAfterHook::free"));
    CHECK(sm[0].state() == fsdp::TrainingState::IDLE);
  });
}

TEST_CASE("hooks change only between steps; removing a freeing hook brings back zeroed gradients") {
  on_ranks<fsdp::FullShard>(2, {1, 2}, false, [&](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice& device, auto&, int r) {
    const std::size_t before = device.stats().live_bytes;
    sm.set_post_accumulate_grad_hook([](fsdp::Unit&) {}, GradientAfterHook::free);
    const std::size_t freed = before - device.stats().live_bytes;
    CHECK(freed > 0);
    std::string mid;  // from inside a hook: the unit is mid-backward
    sm.set_post_accumulate_grad_hook([&](fsdp::Unit&) {
      if (mid.empty()) mid = test_support::error_of([&] { sm.set_post_accumulate_grad_hook({}); });
    }, GradientAfterHook::free);
    micro_batch(model, sm, engine::make_batch(config(), 0, r, 1));
    CHECK(test_support::contains(mid, "BACKWARD"));
    sm.set_post_accumulate_grad_hook({});
    CHECK(device.stats().live_bytes == before);
    for (const auto& v : sm.shards()) {
      const auto g = copy_grad(v);
      CHECK(std::all_of(g.begin(), g.end(), [](float x) { return x == 0; }));
    }
    micro_batch(model, sm, engine::make_batch(config(), 1, r, 1));
    CHECK(device.stats().live_bytes == before);
  });
}

// A freeing hook set between the micro-batches of a step: what the unsynchronized ones kept
// stays, and the hooks see the same final gradients as with the hook set before the step.
// On one rank (and under NoShard) the kept sum is in the sharded gradient itself, which
// the engine adds into; freeing it would lose the sum (and the engine would write into
// freed memory), so it becomes the kept unsharded gradient instead. After the step the
// device holds what it holds with the hook set before: the shards alone.
TEST_CASE_TEMPLATE("a freeing hook set between no_sync micro-batches keeps what they summed", Strategy, fsdp::FullShard,
                   fsdp::NoShard) {
  for (int world : {1, 2}) {
    CAPTURE(world);
    auto run = [&](bool set_between) {
      std::vector<std::vector<float>> seen;  // rank 0's hooks, in order
      std::size_t live_after = 0;
      on_ranks<Strategy>(world, {1, world}, false, [&](engine::Model& model, fsdp::ShardedModel& sm,
                                                       fsdp::HostDevice& device, auto&, int r) {
        auto hook = [&](fsdp::Unit& u) {
          if (r != 0) return;
          for (const auto& v : u.shards()) seen.push_back(copy_grad(v));
        };
        if (!set_between) sm.set_post_accumulate_grad_hook(hook, GradientAfterHook::free);
        sm.zero_grad();
        {
          auto unsynchronized = sm.no_sync();
          micro_batch(model, sm, engine::make_batch(config(), 0, r, 1));
        }
        if (set_between) sm.set_post_accumulate_grad_hook(hook, GradientAfterHook::free);
        micro_batch(model, sm, engine::make_batch(config(), 1, r, 1));
        if (r == 0) live_after = device.stats().live_bytes;
      });
      return std::pair{seen, live_after};
    };
    const auto [want, want_live] = run(false);
    const auto [got, got_live] = run(true);
    REQUIRE(!want.empty());
    CHECK(got == want);
    CHECK(got_live == want_live);
  }
}

}  // namespace core_post_accumulate_grad_hook_test
