// ShardedModel::summon_full_params: every parameter whole in the engine's tensors, in its
// master dtype, under every strategy; writeback keeps edits and the default drops them;
// rank0_only leaves nothing on the other ranks; offload_to_host keeps the full parameters
// in host memory and at most one unit's on the device; the documented restriction
// (writeback with rank0_only) is an error, not a silent no-op.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_model_summon_test {

namespace {

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  c.seed = 5;
  return c;
}

// What the engine's tensors show now, by FQN.
test_support::Params shown(engine::Model& model) {
  test_support::Params out;
  for (auto& p : engine::named_parameters(model)) {
    std::vector<float> v(static_cast<std::size_t>(p.param->numel()));
    for (std::int64_t i = 0; i < p.param->numel(); ++i) v[static_cast<std::size_t>(i)] = p.param->get(i);
    out.emplace_back(p.fqn, std::move(v));
  }
  return out;
}

// The unsharded model's parameters: what a summon must show before any training.
test_support::Params initial() {
  engine::Model model(config());
  return shown(model);
}

bool all_idle(fsdp::ShardedModel& sm) {
  return std::all_of(sm.begin(), sm.end(), [](auto& u) { return u->state() == fsdp::TrainingState::IDLE; });
}

}  // namespace

TEST_CASE_TEMPLATE("a model summon shows every parameter whole, in f32, under every strategy and precision", Strategy,
                   fsdp::FullShard, fsdp::ShardGradOp, fsdp::NoShard, fsdp::HybridShard) {
  const auto expected = initial();
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{2, 2});
    engine::Model a(config()), b(config());
    fsdp::HostDevice device;
    auto plain = fsdp::shard<Strategy>(a, mesh, device, engine::Wrap{});
    auto mixed = fsdp::shard<Strategy, fsdp::MixedPrecision<fsdp::bf16>>(b, mesh, device, engine::Wrap{});
    {
      auto s = plain.summon_full_params();
      CHECK(test_support::max_difference(shown(a), expected) == 0.0);
    }
    {
      auto s = mixed.summon_full_params();
      CHECK(test_support::max_difference(shown(b), expected) == 0.0);  // the f32 masters, not bf16 copies
    }
    CHECK(all_idle(plain));
    CHECK(all_idle(mixed));
  });
}

TEST_CASE("writeback keeps edits made on every rank; without it, or when the scope ends by exception, they are dropped") {
  const auto expected = initial();
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto edit = [&] {
      for (auto& p : engine::named_parameters(model))
        for (std::int64_t i = 0; i < p.param->numel(); ++i) p.param->set(i, p.param->get(i) + 1.0f);
    };
    {
      auto s = sm.summon_full_params();
      edit();
    }
    {
      auto s = sm.summon_full_params();
      CHECK(test_support::max_difference(shown(model), expected) == 0.0);
    }
    CHECK_THROWS_AS(([&] {
                      auto s = sm.summon_full_params({.writeback = true});
                      edit();
                      throw std::runtime_error("the engine failed halfway");
                    }()),
                    std::runtime_error);
    CHECK(all_idle(sm));
    {
      auto s = sm.summon_full_params({.writeback = true});
      CHECK(test_support::max_difference(shown(model), expected) == 0.0);
      edit();
    }
    auto s = sm.summon_full_params();
    const auto now = shown(model);
    for (std::size_t k = 0; k < now.size(); ++k)
      for (std::size_t i = 0; i < now[k].second.size(); ++i) REQUIRE(now[k].second[i] == expected[k].second[i] + 1.0f);
  });
}

TEST_CASE("rank0_only: rank 0 sees the full parameters, the other ranks hold none of them") {
  const auto expected = initial();
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    const auto before = device.stats().live_bytes;
    auto s = sm.summon_full_params({.rank0_only = true});
    if (comm.rank() == 0) {
      CHECK(test_support::max_difference(shown(model), expected) == 0.0);
      CHECK(device.stats().live_bytes > before);
    } else {
      CHECK(device.stats().live_bytes == before);
      CHECK(model.blocks[0].fc1.weight.raw() == nullptr);
      CHECK(test_support::contains(test_support::error_of([&] { sm[0].full_parameter(0); }), "rank0_only"));
    }
  });
}

TEST_CASE("writeback with rank0_only is refused on every rank before anything is gathered") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    const auto error = test_support::error_of([&] { auto s = sm.summon_full_params({.writeback = true, .rank0_only = true}); });
    CHECK(test_support::contains(error, "writeback and rank0_only"));
    CHECK(test_support::contains(error, "on rank " + std::to_string(comm.rank())));
    CHECK(all_idle(sm));
    auto s = sm.summon_full_params();  // the model is usable afterwards
  });
}

TEST_CASE("offload_to_host: the full parameters in host memory, at most one unit's on the device at a time") {
  const auto expected = initial();
  const auto c = config();
  const auto units = test_support::unit_numels(c);
  const auto largest = static_cast<std::size_t>(*std::max_element(units.begin(), units.end()));
  std::int64_t total = 0;
  for (auto n : units) total += n;
  const int world = 2;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    const auto dev_before = device.stats(fsdp::MemorySpace::device).live_bytes;
    const auto host_before = device.stats(fsdp::MemorySpace::host).live_bytes;
    device.reset_peak();
    {
      auto s = sm.summon_full_params({.writeback = true, .offload_to_host = true});
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == dev_before);
      const auto host_now = device.stats(fsdp::MemorySpace::host).live_bytes;
      // Each unit's flat parameter, padded to a multiple of the world size.
      CHECK(host_now - host_before >= static_cast<std::size_t>(total) * sizeof(float));
      CHECK(host_now - host_before < (static_cast<std::size_t>(total) + units.size() * world) * sizeof(float));
      CHECK(device.stats(fsdp::MemorySpace::device).peak_bytes - dev_before < (largest + world) * sizeof(float) + 1);
      CHECK(test_support::max_difference(shown(model), expected) == 0.0);
      model.gain.gain.set(0, 42.0f);  // through host memory, written back to the shard
    }
    CHECK(device.stats(fsdp::MemorySpace::host).live_bytes == host_before);
    auto s = sm.summon_full_params();
    CHECK(model.gain.gain.get(0) == 42.0f);
  });
}

TEST_CASE("writeback with edits made on one rank only is an error on every rank, and nothing is written back") {
  const auto expected = initial();
  std::vector<std::string> errors(3);
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    errors[static_cast<std::size_t>(comm.rank())] = test_support::error_of([&] {
      auto s = sm.summon_full_params({.writeback = true});
      if (comm.rank() == 1) model.blocks[1].fc2.bias.set(0, 7.0f);  // rank 1 only
    });
    CHECK(all_idle(sm));
    {
      auto s = sm.summon_full_params();
      CHECK(test_support::max_difference(shown(model), expected) == 0.0);  // no slice kept the edit
    }
    // The check can be turned off: then each rank keeps its own slice's edits, as FSDP does.
    auto s = sm.summon_full_params({.writeback = true, .check_writeback = false});
    if (comm.rank() == 1) model.blocks[1].fc2.bias.set(0, 7.0f);
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto& e = errors[static_cast<std::size_t>(r)];
    CHECK(test_support::contains(e, "unit 'blocks.1' on rank " + std::to_string(r)));
    CHECK(test_support::contains(e, "differ across ranks (rank(s) 1 differ from rank 0)"));
    CHECK(test_support::contains(e, "nothing was written back"));
  }
}

TEST_CASE("a summon ended with writeback on some ranks only is an error on every rank, not a hang") {
  const auto expected = initial();
  std::vector<std::string> errors(3);
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& u = sm.unit("blocks.0");
    fsdp::detail::internals(u).begin_summon_full_params({});  // unscoped: the end's flag differs by rank
    model.blocks[0].fc1.bias.set(0, 9.0f);  // the same edit everywhere; only the decision differs
    errors[static_cast<std::size_t>(comm.rank())] =
        test_support::error_of([&] { fsdp::detail::internals(u).end_summon_full_params(/*writeback=*/comm.rank() != 2); });
    CHECK(all_idle(sm));
    auto s = sm.summon_full_params();
    CHECK(test_support::max_difference(shown(model), expected) == 0.0);  // written back nowhere
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto& e = errors[static_cast<std::size_t>(r)];
    CHECK(test_support::contains(e, "unit 'blocks.0': the writeback flag at the end of summon_full_params differs"));
    CHECK(test_support::contains(e, "rank 0 has writeback=true; rank 2 has writeback=false"));
  }
}

TEST_CASE("NoShard edits in place: a one-rank edit is still reported, saying the ranks now differ") {
  std::vector<std::string> errors(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::NoShard>(model, comm, device, engine::Wrap{});
    errors[static_cast<std::size_t>(comm.rank())] = test_support::error_of([&] {
      auto s = sm.summon_full_params({.writeback = true});
      if (comm.rank() == 0) model.gain.gain.set(0, 3.0f);
    });
  });
  for (const auto& e : errors) {
    CHECK(test_support::contains(e, "unit 'gain'"));
    CHECK(test_support::contains(e, "parameters replicated in place kept each rank's own edits"));
  }
}

TEST_CASE_TEMPLATE("with_grads: after a backward the engine's gradient tensors show the whole reduced gradients", Strategy,
                   fsdp::FullShard, fsdp::ShardGradOp, fsdp::NoShard, fsdp::HybridShard) {
  // The unsharded engine's gradients of the same global batch (the mean over it, as the
  // sharded reduction averages the ranks' means).
  const auto c = config();
  const int world = 4, local = 2;
  engine::Model reference(c);
  engine::zero_grads(reference);
  {
    const auto batch = engine::make_batch(c, 0, 0, world * local);
    engine::Mat dout;
    engine::mse(reference.forward(batch.x), batch.y, dout);
    reference.backward(dout);
  }
  test_support::Params expected;
  for (auto& p : engine::named_parameters(reference))
    expected.emplace_back(p.fqn, std::vector<float>(p.grad->data(), p.grad->data() + p.grad->numel()));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{2, 2});
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy>(model, mesh, device, engine::Wrap{});
    engine::sharded_forward_backward(model, sm, engine::make_batch(c, 0, comm.rank() * local, local));
    const auto live = device.stats().live_bytes;
    {
      auto s = sm.summon_full_params({.with_grads = true});
      test_support::Params grads;
      for (auto& p : engine::named_parameters(model)) {
        REQUIRE(p.grad->raw() != nullptr);
        grads.emplace_back(p.fqn, std::vector<float>(p.grad->data(), p.grad->data() + p.grad->numel()));
      }
      CHECK(test_support::max_difference(grads, expected) < 1e-6);
    }
    CHECK(model.blocks[0].fc1.weight_grad.raw() == nullptr);  // unbound again
    CHECK(device.stats().live_bytes == live);                 // and freed
  });
}

}  // namespace core_model_summon_test
