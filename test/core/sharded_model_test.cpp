// The root and unit behaviours around the training step: wrapping, lookup, zero-copy
// views, summon_full_params, gradient accumulation, padding, divide factors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <span>
#include <string_view>
#include <utility>

#include <fsdp/testing/counting_device.hpp>

#include "examples/engine/fsdp_integration.hpp"

namespace core_sharded_model_test {

namespace {
engine::ModelConfig small() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}
}  // namespace

TEST_CASE("shard() makes the root first, then one unit per wrapped module, depth first") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    std::vector<std::string> names;
    for (auto& u : sm) names.push_back(u->fqn());
    CHECK(names == std::vector<std::string>{"", "blocks.0", "blocks.1", "gain"});
    CHECK(&sm.unit_for(model.blocks[1]) == &sm.unit("blocks.1"));
    CHECK(sm.find_unit_for(model.embed) == nullptr);  // part of the root unit, not a unit
    CHECK_THROWS_WITH_AS(sm.unit_for(model.embed), doctest::Contains("fsdp: ShardedModel: the engine::Linear at "),
                         fsdp::Error);  // the type's name demangled, not "N6engine6LinearE"
    CHECK_THROWS_WITH_AS(sm.unit("blocks.7"), "fsdp: ShardedModel: no unit named 'blocks.7'; units are: '<root>', 'blocks.0', 'blocks.1', 'gain'", fsdp::Error);
  });
}

namespace {
struct Leaf {
  fsdp::HostTensor w{{3}}, g{{3}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
};
struct Outer {  // its first member has its address
  Leaf first, second;
  fsdp::HostTensor bias{{2}}, bias_grad{{2}};
  template <class F> void visit_parameters(F&& f) { f("bias", bias, bias_grad); }
  template <class F> void visit_children(F&& f) { f("first", first); f("second", second); }
};
}  // namespace

TEST_CASE("a module and its first member share an address but are different units") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    Outer outer;
    REQUIRE(static_cast<const void*>(&outer) == static_cast<const void*>(&outer.first));
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(outer, comm, device, fsdp::wrap_types<Leaf>{});
    CHECK(sm.unit_for(outer).fqn() == "");
    CHECK(sm.unit_for(outer.first).fqn() == "first");
    CHECK(sm.unit_for(outer.second).fqn() == "second");
  });
}

TEST_CASE("parameters are zero-copy views into the unit's unsharded buffer, and absent otherwise") {
  fsdp::ThreadGroup(3).run([](fsdp::ThreadComm& comm) {
    const auto c = small();
    engine::Model reference(c);
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& block = model.blocks[0];
    CHECK(block.fc1.weight.data() == nullptr);  // the engine's own storage was released
    CHECK(block.fc1.weight_grad.data() == nullptr);
    auto& unit = sm.unit("blocks.0");
    {
      auto scope = unit.forward_scope();
      // Back to back in visit order: the block's own adapter (0 elements), fc1.weight,
      // fc1.bias, fc2.weight, fc2.bias.
      CHECK(block.fc1.bias.data() == block.fc1.weight.data() + block.fc1.weight.numel());
      CHECK(block.fc2.weight.data() == block.fc1.bias.data() + block.fc1.bias.numel());
      CHECK(std::memcmp(block.fc2.weight.data(), reference.blocks[0].fc2.weight.data(), 4 * block.fc2.weight.numel()) == 0);
      CHECK(block.fc1.weight_grad.data() == nullptr);  // gradients exist only during backward
    }
    CHECK(block.fc1.weight.data() == nullptr);
    {
      auto scope = unit.backward_scope();
      CHECK(block.fc1.weight.data() != nullptr);
      CHECK(block.fc1.bias_grad.data() == block.fc1.weight_grad.data() + block.fc1.weight.numel());
      for (std::int64_t i = 0; i < block.fc1.weight_grad.numel(); ++i) REQUIRE(block.fc1.weight_grad[i] == 0.0f);
    }
    CHECK(block.fc1.weight_grad.data() == nullptr);
    sm.finish_backward();
  });
}

TEST_CASE("summon_full_params shows the full parameters; writeback keeps edits, the default drops them") {
  fsdp::ThreadGroup(4).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& unit = sm.unit("gain");
    {
      auto s = unit.summon_full_params();
      for (std::int64_t i = 0; i < model.gain.gain.numel(); ++i) model.gain.gain[i] = -1.0f;
    }
    {
      auto s = unit.summon_full_params(/*writeback=*/true);
      CHECK(model.gain.gain[0] != -1.0f);  // the edit above was dropped
      for (std::int64_t i = 0; i < model.gain.gain.numel(); ++i) model.gain.gain[i] = static_cast<float>(i);
    }
    auto s = unit.summon_full_params();
    for (std::int64_t i = 0; i < model.gain.gain.numel(); ++i) CHECK(model.gain.gain[i] == static_cast<float>(i));
    CHECK(device.stats().live_bytes > 0);
  });
}

TEST_CASE_TEMPLATE("gradients accumulate across backward passes until zero_grad", Strategy, fsdp::FullShard,
                   fsdp::ShardGradOp, fsdp::NoShard, fsdp::HybridShard) {
  const auto c = small();
  const int world = 4;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{2, 2});
    auto sm = fsdp::shard<Strategy>(model, mesh, device, engine::Wrap{});
    engine::UnitHooks hooks{sm};
    auto batch = engine::make_batch(c, 0, comm.rank(), 1);
    auto backward_once = [&] {
      engine::Mat dout;
      auto out = model.forward(batch.x, hooks);
      engine::mse(out, batch.y, dout);
      model.backward(dout, hooks);
      sm.finish_backward();
    };
    auto grads = [&] {
      std::vector<float> g;
      for (auto& v : sm.shards()) g.insert(g.end(), static_cast<float*>(v.grad), static_cast<float*>(v.grad) + v.numel);
      return g;
    };
    sm.zero_grad();
    backward_once();
    const auto once = grads();
    CHECK(std::any_of(once.begin(), once.end(), [](float x) { return x != 0.0f; }));
    backward_once();
    const auto twice = grads();
    for (std::size_t i = 0; i < once.size(); ++i) CHECK(twice[i] == once[i] + once[i]);
    sm.zero_grad();
    for (float g : grads()) CHECK(g == 0.0f);
    backward_once();
    CHECK(grads() == once);
  });
}

// One device call for a whole model's zero_grad (on CUDA one kernel launch, not one memset
// per unit); offloaded (host-space) gradients are zeroed directly. A unit that refuses
// (not IDLE) stops it with an error, and the units before it are zeroed all the same: they
// already count their gradients as zero.
TEST_CASE("zero_grad zeroes every unit's sharded gradients with one device call") {
  const auto c = small();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice host;
    fsdp::CountingDevice<fsdp::HostDevice> device(host);
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    REQUIRE(sm.size() == 4);  // the root, 2 blocks, the gain
    engine::Sgd sgd(0.05f);
    auto nonzero = [](fsdp::Unit& u) {
      std::size_t n = 0;
      for (const auto& v : u.shards())
        for (std::int64_t i = 0; i < v.numel; ++i) n += static_cast<const float*>(v.grad)[i] != 0.0f;
      return n;
    };
    auto backward = [&](int step) {
      engine::UnitHooks hooks{sm};
      auto batch = engine::make_batch(c, step, comm.rank(), 1);
      engine::Mat dout;
      auto out = model.forward(batch.x, hooks);
      engine::mse(out, batch.y, dout);
      model.backward(dout, hooks);
      sm.finish_backward();
    };
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    for (auto& u : sm) REQUIRE(nonzero(*u) > 0);
    device.reset();
    sm.zero_grad();
    CHECK(device.counts()[fsdp::DeviceOp::fill_zero_batch] == 1);
    CHECK(device.counts()[fsdp::DeviceOp::fill_zero] == 0);
    for (auto& u : sm) CHECK(nonzero(*u) == 0);

    backward(1);
    sm[2].pre_forward();  // not IDLE: its zero_grad refuses
    CHECK_THROWS_WITH_AS(sm.zero_grad(), doctest::Contains("zero_grad"), fsdp::Error);
    CHECK(nonzero(sm[0]) == 0);
    CHECK(nonzero(sm[1]) == 0);
    CHECK(nonzero(sm[2]) > 0);
    sm[2].post_forward();
    sm.zero_grad();
    for (auto& u : sm) CHECK(nonzero(*u) == 0);
  });

  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice host;
    fsdp::CountingDevice<fsdp::HostDevice> device(host);
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::OffloadParams>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    device.reset();
    sm.zero_grad();
    CHECK(device.counts()[fsdp::DeviceOp::fill_zero_batch] == 0);
    CHECK(device.counts()[fsdp::DeviceOp::fill_zero] == sm.shards().size());  // in host memory, one each
    for (const auto& v : sm.shards())
      for (std::int64_t i = 0; i < v.numel; ++i) CHECK(static_cast<const float*>(v.grad)[i] == 0.0f);
  });
}

// A HostDevice whose next fill_zero_batch fails, when asked.
struct FlakyZeroing : fsdp::HostDevice {
  bool fail_next = false;
  void fill_zero_batch(std::span<const fsdp::ZeroSpan> spans) {
    if (std::exchange(fail_next, false)) fsdp::detail::fail("injected: fill_zero_batch failed");
    fsdp::HostDevice::fill_zero_batch(spans);
  }
};

// The units count their gradients as zero once they joined the batch, so a zeroing call
// that fails must not leave them training on stale gradients: each is failed in
// zero_grad, its next hook asks for abort_step, and after it training goes on.
TEST_CASE("a failed zero_grad call leaves every unit failed until abort_step") {
  static_assert(fsdp::BatchZeroingDevice<FlakyZeroing>);
  const auto c = small();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    FlakyZeroing device;
    auto sm = fsdp::shard<fsdp::NoShard>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    device.fail_next = true;
    CHECK_THROWS_WITH_AS(sm.zero_grad(), doctest::Contains("injected"), fsdp::Error);
    for (auto& u : sm) CHECK(std::string_view(fsdp::detail::internals(*u).failed_hook() ? fsdp::detail::internals(*u).failed_hook() : "(none)") == "zero_grad");
    CHECK_THROWS_WITH_AS(sm[0].pre_forward(), doctest::Contains("zero_grad left by an exception"), fsdp::Error);
    sm.abort_step();
    sm.zero_grad();
    for (const auto& v : sm.shards())
      for (std::int64_t i = 0; i < v.numel; ++i) CHECK(static_cast<const float*>(v.grad)[i] == 0.0f);
    CHECK_NOTHROW(engine::sharded_step(model, sm, sgd, engine::make_batch(c, 1, comm.rank(), 1)));
  });
}

// The same when a unit throws in zero_grad (here: it is mid-forward) and the flush of what
// the units before it added fails too: the unit's error is the one reported, and the units
// before it are failed in zero_grad, not left counting stale gradients as zero.
TEST_CASE("a unit that throws in zero_grad, then a failed flush: the units before it are failed too") {
  const auto c = small();
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    FlakyZeroing device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    REQUIRE(sm.size() >= 2);
    auto& last = sm[sm.size() - 1];
    last.pre_forward();  // not IDLE: its zero_grad throws after the others joined the batch
    device.fail_next = true;
    CHECK_THROWS_WITH_AS(sm.zero_grad(), doctest::Contains("zero_grad"), fsdp::Error);
    CHECK(!device.fail_next);  // the flush ran, and failed
    for (std::size_t i = 0; i + 1 < sm.size(); ++i)
      CHECK(std::string_view(fsdp::detail::internals(sm[i]).failed_hook() ? fsdp::detail::internals(sm[i]).failed_hook() : "(none)") == "zero_grad");
    sm.abort_step();
    sm.zero_grad();
    CHECK_NOTHROW(engine::sharded_step(model, sm, sgd, engine::make_batch(c, 1, comm.rank(), 1)));
  });
}

TEST_CASE("padding never leaks into the shards the optimizer sees") {
  const auto c = small();
  for (int world : {2, 3, 8}) {
    std::vector<std::int64_t> total(world, 0);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      engine::Sgd sgd(0.1f);
      engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
      for (auto& v : sm.shards()) total[comm.rank()] += v.numel;
      // The padded tail of each shard (beyond numel) is still zero after a step.
      auto& gain = sm.unit("gain");
      const auto* layout = fsdp::detail::internals(gain).layouts().at(0);
      const auto& view = gain.shards()[0];
      for (std::int64_t i = view.numel; i < layout->shard_numel(); ++i) {
        CHECK(static_cast<float*>(view.param)[i] == 0.0f);
        CHECK(static_cast<float*>(view.grad)[i] == 0.0f);
      }
    });
    engine::Model model(c);
    std::int64_t numel = 0;
    for (auto& p : engine::named_parameters(model)) numel += p.param->numel();
    CHECK(std::accumulate(total.begin(), total.end(), std::int64_t{0}) == numel);
  }
}

TEST_CASE("gradient divide factors follow FSDP: a power of two before, the rest after, product N") {
  // FSDP doubles the pre-factor, starting at 1, while the current factor divides N and is
  // below N / factor (so the result need not divide N: 6 gives 4).
  CHECK(fsdp::gradient_predivide_factor(1) == 1);
  CHECK(fsdp::gradient_predivide_factor(2) == 2);
  CHECK(fsdp::gradient_predivide_factor(3) == 2);
  CHECK(fsdp::gradient_predivide_factor(4) == 2);
  CHECK(fsdp::gradient_predivide_factor(8) == 4);
  CHECK(fsdp::gradient_predivide_factor(16) == 4);
  CHECK(fsdp::gradient_predivide_factor(64) == 8);
  CHECK(fsdp::gradient_predivide_factor(6) == 4);
}

TEST_CASE("units can be built by hand and added to a root") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    fsdp::HostDevice device;
    fsdp::ShardedModel sm;
    sm.emplace<fsdp::Sharded<engine::Block>>(model.blocks[0], comm, device, "blocks.0");
    sm.emplace<fsdp::Sharded<engine::Block, fsdp::FullShard>>(model.blocks[1], comm, device, "blocks.1");
    CHECK(sm.size() == 2);
    CHECK(sm.unit("blocks.1").shards()[0].numel == (13 * 7 + 7 + 7 * 13 + 13) / 2);
    CHECK_THROWS_WITH_AS(sm.emplace<fsdp::Sharded<engine::Gain>>(model.gain, comm, device, "blocks.0"),
                         doctest::Contains("two units named 'blocks.0'"), fsdp::Error);
  });
}

TEST_CASE("set_trace records each unit's forward and backward, and waits; nothing when off") {
  const auto c = small();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::Trace trace(comm.rank());
    fsdp::AsyncCommunicator stream(comm);
    auto sm = fsdp::shard<fsdp::FullShard>(model, stream, device, engine::Wrap{});
    engine::Sgd sgd(0.01f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    CHECK(trace.size() == 0);  // off by default
    sm.set_trace(&trace);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 1, comm.rank(), 1));
    sm.set_trace(nullptr);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 2, comm.rank(), 1));
    std::map<std::string, int> count;
    for (const auto& e : trace.events()) {
      CHECK(e.lane == fsdp::Trace::Lane::compute);
      CHECK(e.begin <= e.end);
      ++count[e.category + " " + e.name];
    }
    for (const char* unit : {"<root>", "blocks.0", "blocks.1", "gain"}) {
      CHECK(count[std::string("forward forward ") + unit] == 1);
      CHECK(count[std::string("backward backward ") + unit] == 1);
    }
    int waits = 0;
    for (auto& [key, n] : count) if (key.rfind("wait ", 0) == 0) waits += n;
    CHECK(waits > 0);  // an asynchronous backend is waited for somewhere
  });
}

namespace {
struct Root3 {  // root parameters + two leaf units
  fsdp::HostTensor w{{4}}, g{{4}};
  Leaf a, b;
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
  template <class F> void visit_children(F&& f) { f("a", a); f("b", b); }
};

void set_shards(fsdp::Unit& u, float value) {  // what an optimizer step does
  for (auto& v : u.shards())
    for (std::int64_t i = 0; i < v.numel; ++i) static_cast<float*>(v.param)[i] = value;
}
}  // namespace

TEST_CASE("no unsharded copy outlives an optimizer step: kept or prefetched parameters are gathered afresh") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    Root3 m;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(m, comm, device, fsdp::wrap_types<Leaf>{});
    auto& root = sm.unit("");
    auto& a = sm.unit("a");
    auto& b = sm.unit("b");
    auto forward = [&] { root.pre_forward(); a.pre_forward(); a.post_forward(); b.pre_forward(); b.post_forward(); root.post_forward(); };
    auto backward = [&] { root.pre_backward(); b.pre_backward(); b.post_backward(); a.pre_backward(); a.post_backward(); root.post_backward(); sm.finish_backward(); };
    forward();
    backward();  // records the order: backward starts with the root, which then keeps its parameters after forward
    forward();   // a forward with no backward (evaluation): the root keeps its gathered parameters
    set_shards(root, 7.0f);
    root.pre_forward();
    for (int i = 0; i < 4; ++i) CHECK(m.w.as<float>()[i] == 7.0f);
    root.post_forward();
    sm.reshard();

    // A unit gathered ahead that does not run, then an optimizer step.
    root.set_units_to_forward_prefetch({&b});
    root.pre_forward();  // prefetches b
    a.pre_forward();
    a.post_forward();
    root.post_forward();  // b skipped in this pass
    root.pre_backward();
    a.pre_backward();
    a.post_backward();
    root.post_backward();
    sm.finish_backward();  // drops b's unused copy
    set_shards(b, 5.0f);
    root.pre_forward();
    b.pre_forward();
    for (int i = 0; i < 3; ++i) CHECK(m.b.w.as<float>()[i] == 5.0f);
    b.post_forward();
    root.post_forward();
    sm.reshard();
    CHECK(device.stats().live_bytes == 2 * 4 * (2 + 2 + 2));  // only the shards: 3 units x (params + grads), 2 floats each
  });
}

}  // namespace core_sharded_model_test

namespace core_sharded_model_test {

TEST_CASE("scopes move and start empty: one call for a layer that may or may not be a unit") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    fsdp::Unit& block = sm.unit_for(model.blocks[0]);
    {  // a module that is not a unit: nothing opens; one that is: its forward is open
      fsdp::Unit::ForwardScope none, some;
      if (auto* u = sm.find_unit_for(model.embed)) none = u->forward_scope();
      if (auto* u = sm.find_unit_for(model.blocks[0])) some = u->forward_scope();
      CHECK(block.state() == fsdp::TrainingState::FORWARD);
      // Moving the scope moves who ends it: the moved-from one ends nothing.
      fsdp::Unit::ForwardScope moved = std::move(some);
      some = {};
      CHECK(block.state() == fsdp::TrainingState::FORWARD);
    }
    CHECK(block.state() == fsdp::TrainingState::IDLE);  // ended once, by `moved`
    {
      // Assigning to an open scope ends it after the new one has begun (the right side runs
      // first): for a moment both units are gathered, one unit's parameters more than
      // ending it first (`s = {}`) holds.
      const std::size_t bytes = 4 * ((13 * 7 + 7 + 7 * 13 + 13 + 1) / 2 * 2);  // a block's padded parameters, f32
      device.reset_peak();
      {
        auto s = sm.unit("blocks.0").forward_scope();
        s = {};
        s = sm.unit("blocks.1").forward_scope();
      }
      const std::size_t one_at_a_time = device.stats().peak_bytes;
      device.reset_peak();
      {
        auto s = sm.unit("blocks.0").forward_scope();
        s = sm.unit("blocks.1").forward_scope();
        CHECK(block.state() == fsdp::TrainingState::IDLE);
        CHECK(sm.unit("blocks.1").state() == fsdp::TrainingState::FORWARD);
      }
      CHECK(device.stats().peak_bytes == one_at_a_time + bytes);
    }
    CHECK(sm.unit("blocks.1").state() == fsdp::TrainingState::IDLE);
    {  // the same for backward and summon
      fsdp::Unit::BackwardScope b;
      b = block.backward_scope();
      CHECK(block.state() == fsdp::TrainingState::BACKWARD_PRE);
      b = {};
      CHECK(block.state() == fsdp::TrainingState::BACKWARD_POST);
      sm.finish_backward();
      fsdp::Unit::SummonScope summon;
      summon = block.summon_full_params();
      CHECK(block.state() == fsdp::TrainingState::SUMMON_FULL_PARAMS);
      auto held = std::move(summon);
      summon = {};
      CHECK(block.state() == fsdp::TrainingState::SUMMON_FULL_PARAMS);
    }
    CHECK(block.state() == fsdp::TrainingState::IDLE);
    {  // a hook that throws while a scope ends reaches the caller (std::optional would terminate)
      fsdp::Unit::ForwardScope s = block.forward_scope();
      block.post_forward();  // behind the scope's back: its own post_forward now finds IDLE
      CHECK_THROWS_WITH_AS(s = {}, doctest::Contains("post_forward called in state IDLE"), fsdp::Error);
      block.abort_step();
    }
    CHECK(block.state() == fsdp::TrainingState::IDLE);
  });
}

// The type an engine holds has what engines call and no more (docs/concepts.md, "Units and
// the sharded model"): summon is a scope, and the unit's rank and display name are internal.
template <class U> concept begins_summon_by_hand = requires(U& u) { u.begin_summon_full_params(fsdp::SummonOptions{}); };
template <class U> concept ends_summon_by_hand = requires(U& u) { u.end_summon_full_params(true); };
template <class U> concept tells_rank = requires(const U& u) { u.rank(); };
template <class U> concept tells_display_name = requires(const U& u) { u.display_name(); };
static_assert(!begins_summon_by_hand<fsdp::Unit> && !ends_summon_by_hand<fsdp::Unit>);
static_assert(!tells_rank<fsdp::Unit> && !tells_display_name<fsdp::Unit>);
using TypedUnit = fsdp::Sharded<engine::Block, fsdp::FullShard>;
static_assert(!begins_summon_by_hand<TypedUnit> && !ends_summon_by_hand<TypedUnit>);
static_assert(!tells_rank<TypedUnit> && !tells_display_name<TypedUnit>);
// One way to open a scope: the unit's call; an empty scope is default-constructed.
static_assert(!std::is_constructible_v<fsdp::Unit::ForwardScope, fsdp::Unit&>);
static_assert(!std::is_constructible_v<fsdp::Unit::BackwardScope, fsdp::Unit&>);
static_assert(!std::is_constructible_v<fsdp::Unit::SummonScope, fsdp::Unit&, const fsdp::SummonOptions&>);
static_assert(std::is_default_constructible_v<fsdp::Unit::ForwardScope> &&
              std::is_default_constructible_v<fsdp::Unit::SummonScope>);
// The setters' base is no object of its own: a unit or a model does not slice into one.
static_assert(!std::is_constructible_v<fsdp::RunTimeSettings<fsdp::Unit>, fsdp::Unit&>);
static_assert(!std::is_constructible_v<fsdp::RunTimeSettings<fsdp::ShardedModel>, fsdp::ShardedModel&&>);

TEST_CASE("the model's setters are the unit's: one call changes every unit, or none while a unit is not IDLE") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto every_unit = [&](auto holds) {
      bool all = true;
      for (auto& u : sm) all = all && holds(u->config());
      return all;
    };
    // The same call on a unit and on the model (RunTimeSettings<Self>).
    auto configure = [](auto& target) {
      target.set_reshard_after_backward(false);
      target.set_gradient_divide_factor(4.0);
      target.set_gradient_sync_mode(fsdp::GradientSyncMode::reduce_every_microbatch);
    };
    configure(sm.unit("blocks.1"));
    CHECK(sm.unit("blocks.0").config().reshard.after_backward);  // untouched
    CHECK_FALSE(sm.unit("blocks.1").config().reshard.after_backward);
    configure(sm);
    CHECK(every_unit([](const fsdp::UnitConfig& c) {
      return !c.reshard.after_backward && c.reshard.gradient_divide_factor == 4.0 &&
             c.sync.mode == fsdp::GradientSyncMode::reduce_every_microbatch;
    }));

    // The last unit is in FORWARD: the model refuses, naming it, and no unit changed (before,
    // the units ahead of it were changed and the rest were not).
    auto& gain = sm.unit("gain");
    gain.pre_forward();
    const std::string refusal = "fsdp: unit 'gain' on rank " + std::to_string(comm.rank()) +
                                ": set_requires_gradient_sync called in state FORWARD; expected IDLE";
    CHECK_THROWS_WITH_AS(sm.set_requires_gradient_sync(false), refusal.c_str(), fsdp::Error);
    CHECK(every_unit([](const fsdp::UnitConfig& c) { return c.sync.requires_sync; }));
    gain.post_forward();
    gain.reshard();
    // A refused value changes no unit either.
    CHECK_THROWS_AS(sm.set_gradient_divide_factor(-1.0), fsdp::Error);
    CHECK(every_unit([](const fsdp::UnitConfig& c) { return c.reshard.gradient_divide_factor == 4.0; }));
    sm.set_requires_gradient_sync(false);
    CHECK(every_unit([](const fsdp::UnitConfig& c) { return !c.sync.requires_sync; }));
  });
}

TEST_CASE("a partial reshard one unit refuses changes no unit, not even those it does not concern") {
  fsdp::ThreadGroup(4).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    fsdp::HostDevice device;
    // The root (embed and head: 5 * 13 + 13 + 13 * 3 + 3 = 120 elements) and the gain (13)
    // are kept whole under the threshold; the blocks (202 each) are sharded over 4 ranks.
    auto sm = fsdp::shard<fsdp::ShardGradOp>(model, comm, device, engine::Wrap{},
                                             fsdp::ShardOptions{.persistence_threshold = 150});
    REQUIRE(sm.config().units[0].kept_unsharded);
    REQUIRE_FALSE(sm.config().units[1].kept_unsharded);
    // A group of the shard group's own size is no partial reshard: blocks.0 refuses it. The
    // root, first in unit order and indifferent to the group, was switched on before.
    const std::string refusal = "unit 'blocks.0' on rank " + std::to_string(comm.rank()) +
                                ": set_reshard_after_forward(group of 4 ranks)";
    CHECK_THROWS_WITH_AS(sm.set_reshard_after_forward(comm), doctest::Contains(refusal.c_str()), fsdp::Error);
    for (auto& u : sm) CHECK_FALSE(u->config().reshard.after_forward);  // ShardGradOp's default, everywhere
  });
}

TEST_CASE("shard with ShardOptions::defer_take_over builds every unit and leaves take_over() to the caller") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(small());
    const void* weight = model.blocks[0].fc1.weight.raw();
    const float first = static_cast<const float*>(weight)[0];
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.defer_take_over = true});
    CHECK(sm.size() == 4);  // every unit built, its shard copied
    CHECK(model.blocks[0].fc1.weight.raw() == weight);  // the engine's tensor untouched
    CHECK(sm.config().units[1].fqn == "blocks.0");
    // No unit computes before the take-over: its tensors are still the engine's own.
    auto& block = sm.unit("blocks.0");
    const std::string early = "fsdp: unit 'blocks.0' on rank " + std::to_string(comm.rank()) +
                              ": pre_forward before the unit took the engine's tensors over (it was built with "
                              "ShardOptions::defer_take_over); call ShardedModel::take_over() first";
    CHECK_THROWS_WITH_AS(block.pre_forward(), early.c_str(), fsdp::Error);
    CHECK_THROWS_WITH_AS((void)block.summon_full_params(), doctest::Contains("summon_full_params before the unit took"),
                         fsdp::Error);
    CHECK(block.state() == fsdp::TrainingState::IDLE);  // a misuse: nothing changed, nothing to abort
    // Nor does one free, or switch to a hook, what is not its own yet (before, a reshard
    // stripped the engine's tensors and the hook setter threw std::out_of_range).
    CHECK_THROWS_WITH_AS(sm.reshard(), doctest::Contains("reshard before the unit took"), fsdp::Error);
    CHECK(model.blocks[0].fc1.weight.raw() == weight);
    CHECK_THROWS_WITH_AS(sm.set_post_accumulate_grad_hook([](fsdp::Unit&) {}, fsdp::GradientAfterHook::free),
                         doctest::Contains("set_post_accumulate_grad_hook before the unit took"), fsdp::Error);
    for (auto& u : sm) CHECK_FALSE(u->config().post_accumulate_grad_hook);
    sm.take_over();
    CHECK(model.blocks[0].fc1.weight.raw() == nullptr);  // FullShard: no storage between passes
    auto summoned = sm.summon_full_params();
    CHECK(static_cast<const float*>(model.blocks[0].fc1.weight.raw())[0] == first);
  });
}

}  // namespace core_sharded_model_test
