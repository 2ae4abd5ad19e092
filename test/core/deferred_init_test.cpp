// Deferred initialization (fsdp/model/deferred_init.hpp): a model built from shapes and dtypes
// alone is materialized, initialized and sharded one unit at a time.
//
// Setup memory, on rank r of N under FullShard, units k in build order (root, blocks,
// gain) of n_k f32 elements: the shard and gradient shard S_k = ceil(n_k / N) * 4 bytes, and
// while unit k is built its parameters whole, T_k = n_k * 4 bytes, until its shard is
// copied. So the Device's peak during setup is max_k (sum_{j<k} 2 S_j + 2 S_k + T_k): the
// shards built so far plus one unit's full parameters, never the model. The expected
// numbers are computed here from the configuration, not read back from the library.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "test/core/layer_engine.hpp"
#include "test/support/rank_errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_deferred_init_test {

using test_support::contains;
using test_support::error_of;
using test_support::errors_per_rank;

namespace {

engine::ModelConfig config(engine::Init init) {
  engine::ModelConfig c;  // dim 13, hidden 7: sizes no world size divides
  c.blocks = 3;
  c.init = init;
  return c;
}

// Full parameters after `steps` AdamW steps of a deferred model trained sharded, one sample
// per rank; every rank must see the same.
template <class Strategy, class... Options>
test_support::Params train_deferred(int world, int steps, const Options&... options) {
  const auto c = config(engine::Init::deferred);
  std::vector<test_support::Params> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy>(model, comm, device, engine::Wrap{}, options...);
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    for (int s = 0; s < steps; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank(), 1));
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) CHECK(test_support::bitwise_equal(per_rank[r], per_rank[0]));
  return per_rank[0];
}

template <class Strategy>
void check_parity(int world) {
  CAPTURE(world);
  const auto eager = config(engine::Init::now);
  const auto init = fsdp::deferred_init(engine::reset_parameters);
  // Initial values: those of eager construction on one rank, bit for bit.
  CHECK(test_support::bitwise_equal(train_deferred<Strategy>(world, 0, init), test_support::reference_params(eager, 0, 1)));
  // Trained sharded: equal to the eager model trained unsharded on the same global batches.
  CHECK(test_support::bitwise_equal(train_deferred<Strategy>(world, 3, init),
                                    test_support::reference_params(eager, 3, world)));
}

// Counts what the engine itself holds.
struct CountingAllocator final : engine::Allocator {
  std::size_t live = 0, peak = 0;
  void* allocate(std::size_t bytes) override {
    live += bytes;
    peak = std::max(peak, live);
    return engine::heap().allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) override {
    live -= bytes;
    engine::heap().deallocate(p, bytes);
  }
};

bool has_no_storage(engine::Model& model) {
  for (auto& p : engine::named_parameters(model))
    if (p.param->raw() || p.grad->raw()) return false;
  return true;
}

// Init callbacks that misbehave on one module, after initializing it properly.
template <class Misstep>
auto init_then(std::string target, Misstep misstep) {
  return fsdp::deferred_init([target, misstep](auto& m, std::string_view fqn) {
    engine::reset_parameters(m, fqn);
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(m)>, engine::Linear>)
      if (fqn == target) misstep(m);
  });
}

}  // namespace

TEST_CASE("a model built deferred and trained sharded equals one built eagerly and trained unsharded, bit for bit") {
  SUBCASE("FullShard, 2 ranks") { check_parity<fsdp::FullShard>(2); }
  SUBCASE("FullShard, 4 ranks") { check_parity<fsdp::FullShard>(4); }
  SUBCASE("ShardGradOp, 2 ranks") { check_parity<fsdp::ShardGradOp>(2); }
  SUBCASE("NoShard, 2 ranks") { check_parity<fsdp::NoShard>(2); }
}

TEST_CASE("deferred setup holds the shards plus one unit's full parameters at most, to the byte") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    std::vector<fsdp::MemoryStats> setup(world);
    std::vector<CountingAllocator> engine_memory(world), eager_engine_memory(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      const int r = comm.rank();
      {
        engine::Model model(config(engine::Init::deferred), engine_memory[r]);
        fsdp::HostDevice device;
        auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{},
                                               fsdp::deferred_init(engine::reset_parameters));
        setup[r] = device.stats();
        CHECK(has_no_storage(model));  // between hooks, the parameters are sharded
      }
      engine::Model eager(config(engine::Init::now), eager_engine_memory[r]);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(eager, comm, device, engine::Wrap{});
    });
    const auto c = config(engine::Init::now);
    const auto units = test_support::unit_numels(c);  // build order: root, blocks, gain
    std::size_t total = 0;
    for (auto n : units) total += static_cast<std::size_t>(n);
    const std::size_t buffers = static_cast<std::size_t>(c.dim) * 4;  // the gain's scale: the engine's
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      std::size_t shards = 0, peak = 0, largest_unit = 0;
      for (auto n : units) {
        const std::size_t S = static_cast<std::size_t>((n + world - 1) / world) * 4, T = static_cast<std::size_t>(n) * 4;
        peak = std::max(peak, shards + 2 * S + T);
        shards += 2 * S;
        largest_unit = std::max(largest_unit, T);
      }
      CHECK(setup[r].live_bytes == shards);
      CHECK(setup[r].peak_bytes == peak);
      CHECK(setup[r].peak_bytes <= shards + largest_unit);
      // The engine held only its buffers; built eagerly it held every parameter and gradient.
      CHECK(engine_memory[r].peak == buffers);
      CHECK(eager_engine_memory[r].peak == buffers + 2 * 4 * total);
    }
  }
}

TEST_CASE("a type-erased engine built deferred trains as one built eagerly") {
  const int world = 2;
  const auto reference = layers::trained_reference(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    auto net = layers::make_net(engine::Init::deferred);
    fsdp::HostDevice device;
    layers::Layer& root = *net;
    auto sm = fsdp::shard<fsdp::FullShard>(root, comm, device, fsdp::wrap_if(layers::is_residual, "residual blocks"),
                                           fsdp::deferred_init([](layers::Layer& l) { l.reset_parameters(); }));
    for (int s = 0; s < layers::steps; ++s) layers::sharded_step(*net, sm, s, comm.rank());
    auto summon = sm.summon_full_params();
    layers::check_close(*net, *reference);
  });
}

TEST_CASE("a deferred init that leaves a parameter without storage, or reshapes it, is named; the model is left as built") {
  struct Case {
    std::string name, target, message;
    std::function<void(engine::Linear&)> misstep;
  };
  const std::vector<Case> cases{
      {"no storage", "blocks.1.fc2", "unit 'blocks.1' on rank R: deferred init left parameter 'blocks.1.fc2.weight' without storage",
       [](engine::Linear& l) { l.weight.rebind(nullptr); }},
      {"shape", "head", "unit '<root>' on rank R: deferred init changed parameter 'head.bias' from [3] f32 to [2] f32",
       [](engine::Linear& l) { l.bias = engine::Tensor({2}); }},
      {"dtype", "head", "deferred init changed parameter 'head.bias' from [3] f32 to [3] bf16",
       [](engine::Linear& l) { l.bias = engine::Tensor({3}, engine::heap(), fsdp::DType::bf16); }},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    auto msgs = errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      engine::Model model(config(engine::Init::deferred));
      fsdp::HostDevice device;
      const auto msg = error_of([&] { fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, init_then(k.target, k.misstep)); });
      CHECK(has_no_storage(model));
      CHECK(device.stats().live_bytes == 0);  // every unit built so far freed what it held
      if (!msg.empty()) throw fsdp::Error(msg);
    });
    for (int r = 0; r < 2; ++r) {
      std::string expected = k.message;
      if (auto at = expected.find("rank R"); at != std::string::npos) expected.replace(at, 6, "rank " + std::to_string(r));
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], expected));
    }
  }
}

TEST_CASE("ranks whose init gives other values: found by default, overridden by sync_module_states") {
  auto rank_dependent = [](int rank) {
    return init_then("blocks.0.fc1", [rank](engine::Linear& l) { if (rank == 1) l.weight.set(5, 42.0f); });
  };
  SUBCASE("checked (the default): every rank names the parameter and the ranks") {
    auto msgs = errors_per_rank(3, [&](fsdp::ThreadComm& comm) {
      engine::Model model(config(engine::Init::deferred));
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, rank_dependent(comm.rank()));
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "unit 'blocks.0' on rank " + std::to_string(r) +
                                  ": deferred init gave parameter 'blocks.0.fc1.weight' other values on rank(s) 1 than "
                                  "on rank 0"));
    }
  }
  SUBCASE("with sync_module_states every rank starts from rank 0's values") {
    const auto eager = test_support::reference_params(config(engine::Init::now), 0, 1);
    fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(config(engine::Init::deferred));
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, fsdp::ShardOptions{.sync_module_states = true},
                                             engine::Wrap{}, rank_dependent(comm.rank()));
      CHECK(test_support::bitwise_equal(engine::gather_full_parameters(model, sm), eager));
    });
  }
  SUBCASE("turned off (InitCheck::none): not detected, as documented") {
    auto msgs = errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      engine::Model model(config(engine::Init::deferred));
      fsdp::HostDevice device;
      auto init = rank_dependent(comm.rank());
      fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, fsdp::deferred_init(init.init, fsdp::InitCheck::none));
    });
    CHECK(msgs == std::vector<std::string>{"", ""});
  }
}

TEST_CASE("a model without storage needs deferred_init, and an init that cannot take a module holding one is named") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    engine::Model model(config(engine::Init::deferred));
    fsdp::HostDevice device;
    CHECK(contains(error_of([&] { fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}); }),
                   "unit '<root>' on rank 0: parameter 'embed.weight' has no storage; is it already managed by another "
                   "unit? (A model built from shapes and dtypes alone needs fsdp::deferred_init.)"));
    const auto linear_only = fsdp::deferred_init([](engine::Linear& l) { l.reset_parameters(); });
    CHECK(contains(error_of([&] { fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, linear_only); }),
                   "deferred_init: the init callback cannot be called with module 'gain' (engine::Gain), whose "
                   "parameters have no storage yet"));
    CHECK(has_no_storage(model));
    CHECK(device.stats().live_bytes == 0);
  });
}

TEST_CASE("an init that gives a parameter storage of its own is copied from, and that storage released") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(config(engine::Init::deferred));
    CountingAllocator own;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, init_then("head", [&](engine::Linear& l) {
      l.bias = engine::Tensor({3}, own);
      l.bias.set(1, 7.0f);
    }));
    CHECK(own.peak == 3 * 4);
    CHECK(own.live == 0);  // released once the root's shard was copied
    const auto full = engine::gather_full_parameters(model, sm);
    const auto bias = std::find_if(full.begin(), full.end(), [](auto& p) { return p.first == "head.bias"; });
    REQUIRE(bias != full.end());
    CHECK(bias->second == std::vector<float>{0.0f, 7.0f, 0.0f});
  });
}

namespace {
// A model on fsdp::HostTensor, built as an engine without a tensor type of its own builds
// one for deferred init: every parameter and gradient from a shape and a dtype alone.
struct HostDense {
  fsdp::HostTensor w = fsdp::HostTensor::without_storage({3, 5}), w_grad = fsdp::HostTensor::without_storage({3, 5});
  fsdp::HostTensor b = fsdp::HostTensor::without_storage({3}), b_grad = fsdp::HostTensor::without_storage({3});
  template <class F> void visit_parameters(F&& f) {
    f("w", w, w_grad);
    f("b", b, b_grad);
  }
};
struct HostNet {
  HostDense first, second;
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) {
    f("first", first);
    f("second", second);
  }
};
// The value of element i of a parameter, from its FQN (the same on every rank).
float host_value(std::string_view fqn, std::int64_t i) {
  return static_cast<float>(i) + (fqn.starts_with("second") ? 100.0f : 0.0f) + (fqn.ends_with(".b") ? 50.0f : 0.0f);
}
}  // namespace

TEST_CASE("HostTensor::without_storage: a shape and a dtype, no storage; a HostTensor model built so is initialized and sharded") {
  const auto t = fsdp::HostTensor::without_storage({2, 3}, fsdp::DType::bf16);
  CHECK(std::vector<std::int64_t>(t.shape().begin(), t.shape().end()) == std::vector<std::int64_t>{2, 3});
  CHECK(t.dtype() == fsdp::DType::bf16);
  CHECK(t.numel() == 6);
  CHECK(t.data() == nullptr);
  CHECK_FALSE(t.owns_storage());
  CHECK(fsdp::HostTensor::without_storage({4}).dtype() == fsdp::DType::f32);

  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    HostNet net;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<HostDense>{},
                                           fsdp::deferred_init([](HostDense& d, std::string_view fqn) {
                                             for (auto [p, name] : {std::pair{&d.w, ".w"}, std::pair{&d.b, ".b"}})
                                               for (std::int64_t i = 0; i < p->numel(); ++i)
                                                 p->as<float>()[i] = host_value(std::string(fqn) + name, i);
                                           }));
    CHECK(sm.size() == 3);
    CHECK(net.first.w.data() == nullptr);  // sharded: between hooks, no storage
    CHECK(net.second.b_grad.data() == nullptr);
    auto summon = sm.summon_full_params();
    for (auto [d, fqn] : {std::pair{&net.first, "first"}, std::pair{&net.second, "second"}}) {
      for (std::int64_t i = 0; i < d->w.numel(); ++i) REQUIRE(d->w.as<float>()[i] == host_value(std::string(fqn) + ".w", i));
      for (std::int64_t i = 0; i < d->b.numel(); ++i) REQUIRE(d->b.as<float>()[i] == host_value(std::string(fqn) + ".b", i));
    }
  });
}

}  // namespace core_deferred_init_test
