// A built model reports its whole configuration (ShardedModel::config(), Unit::config()):
// the policies given to fsdp::shard, the mesh, the persistence threshold and each unit's
// run-time settings as they are now, printable; fsdp::plan(model) plans from it with nothing
// restated (memory_plan_test compares it with fsdp::plan<Ps...> over every configuration it
// runs), and refuses a model whose units differ in policies.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fsdp/model/memory_plan.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace core_model_config_test {

using test_support::contains;

namespace {
engine::ModelConfig two_blocks() {
  engine::ModelConfig c;  // root 5x13+13+13x3+3 = 120 elements, blocks 202, gain 13
  c.blocks = 2;
  return c;
}
}  // namespace

TEST_CASE("a model reports the policies it was built with, its mesh and which units the threshold kept whole") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(two_blocks());
    fsdp::HostDevice device;
    using MP = fsdp::MixedPrecision<fsdp::bf16, float>;
    auto sm = fsdp::shard<fsdp::ShardGradOp, fsdp::BackwardPost, MP, fsdp::OffloadParams, fsdp::ForwardPrefetch>(
        model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.persistence_threshold = 150});
    const fsdp::ModelConfig c = sm.config();
    REQUIRE(c.units.size() == 4);
    CHECK(c.max_prefetched == 2);  // ShardedModel's default
    std::vector<std::string> fqns;
    for (const auto& u : c.units) fqns.push_back(u.fqn);
    CHECK(fqns == std::vector<std::string>{"", "blocks.0", "blocks.1", "gain"});
    for (const auto& u : c.units) {
      CAPTURE(u.fqn);
      CHECK(u.policies.strategy() == "SHARD_GRAD_OP");
      CHECK(u.policies.shards_parameters);
      CHECK_FALSE(u.policies.reshard_after_forward);
      CHECK(u.policies.backward == fsdp::BackwardPrefetchMode::backward_post);
      CHECK(u.policies.forward_prefetch);
      CHECK(u.policies.offload);
      CHECK(u.policies.precision.mixed);
      CHECK(u.policies.precision.param == fsdp::DType::bf16);
      CHECK(u.policies.precision.reduce == fsdp::DType::f32);
      CHECK_FALSE(u.policies.precision.comm);
      CHECK(u.mesh == fsdp::MeshShape{1, 2});
      CHECK(u.persistence_threshold == 150);
      CHECK_FALSE(u.reshard.after_forward);  // ShardGradOp keeps parameters from forward
      CHECK(u.reshard.after_backward);
      CHECK(u.sync == fsdp::GradientSync{});
      CHECK_FALSE(u.post_accumulate_grad_hook);
    }
    // 120 and 13 elements are under the threshold of 150, the blocks' 202 are not.
    CHECK(c.units[0].kept_unsharded);
    CHECK_FALSE(c.units[1].kept_unsharded);
    CHECK_FALSE(c.units[2].kept_unsharded);
    CHECK(c.units[3].kept_unsharded);
    // A unit reports the same as the model does for it.
    CHECK(sm.unit("blocks.1").config() == c.units[2]);
    CHECK(fsdp::to_string(c.units[1]) ==
          "'blocks.0': SHARD_GRAD_OP BACKWARD_POST forward_prefetch=on offload=on MixedPrecision<bf16, f32, bf16> "
          "mesh=1x2 local_gradients=mean reshard_after_forward=off reshard_after_backward=on gradient_divide_factor=world "
          "requires_gradient_sync=on requires_all_reduce=on gradient_sync_mode=keep_unsharded");
    CHECK(contains(fsdp::to_string(c.units[0]), "'<root>': SHARD_GRAD_OP"));
    CHECK(contains(fsdp::to_string(c.units[0]), "kept_unsharded(threshold=150)"));
    CHECK(contains(fsdp::to_string(c), "4 units, max_prefetched=2\n  '<root>': "));
  });
}

TEST_CASE("a model's report follows its run-time settings") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(two_blocks());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    const fsdp::ModelConfig before = sm.config();
    CHECK(before.units[1].policies.strategy() == "FULL_SHARD");
    CHECK(before.units[1].reshard.after_forward);
    CHECK(before.units[1].policies.backward == fsdp::BackwardPrefetchMode::backward_pre);
    CHECK(fsdp::to_string(before.units[1].policies) == "FULL_SHARD BACKWARD_PRE forward_prefetch=off offload=off FullPrecision");

    sm.set_max_prefetched_units(1);
    sm.set_reshard_after_backward(false);
    sm.set_gradient_sync_mode(fsdp::GradientSyncMode::reduce_every_microbatch);
    sm.unit("blocks.1").set_reshard_after_forward(false);
    sm.unit("blocks.1").set_gradient_divide_factor(4.0);
    sm.unit("blocks.0").set_units_to_forward_prefetch({&sm.unit("blocks.1"), &sm.unit("gain")});
    sm.set_post_accumulate_grad_hook([](fsdp::Unit&) {}, fsdp::GradientAfterHook::free);
    sm.set_requires_gradient_sync(false);

    const fsdp::ModelConfig after = sm.config();
    CHECK(after != before);
    CHECK(after.max_prefetched == 1);
    for (const auto& u : after.units) {
      CAPTURE(u.fqn);
      CHECK_FALSE(u.reshard.after_backward);
      CHECK(u.sync.mode == fsdp::GradientSyncMode::reduce_every_microbatch);
      CHECK_FALSE(u.sync.requires_sync);
      CHECK(u.post_accumulate_grad_hook);
      CHECK(u.after_hook == fsdp::GradientAfterHook::free);
      CHECK(u.policies == before.units[0].policies);  // policies are compile-time: unchanged
    }
    CHECK_FALSE(after.units[2].reshard.after_forward);
    CHECK(after.units[1].reshard.after_forward);
    CHECK(after.units[2].reshard.gradient_divide_factor == 4.0);
    CHECK(after.units[1].units_to_forward_prefetch == std::vector<std::string>{"blocks.1", "gain"});
    const std::string line = fsdp::to_string(after.units[2]);
    CAPTURE(line);
    CHECK(contains(line, "reshard_after_forward=off reshard_after_backward=off gradient_divide_factor=4"));
    CHECK(contains(line, "requires_gradient_sync=off requires_all_reduce=on gradient_sync_mode=reduce_every_microbatch "
                             "post_accumulate_grad_hook(free)"));
    CHECK(contains(fsdp::to_string(after.units[1]), "units_to_forward_prefetch=['blocks.1', 'gain']"));
  });
}

TEST_CASE("fsdp::plan(model) needs no policies restated, and refuses units whose policies differ") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(two_blocks());
    fsdp::HostDevice device;
    using MP = fsdp::MixedPrecision<fsdp::bf16, float>;
    fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{1, 2});
    auto sm = fsdp::shard<fsdp::HybridShard, MP, fsdp::BackwardPost>(model, mesh, device, engine::Wrap{});
    // The model's own report plans exactly what restating its policies does.
    const fsdp::MemoryPlan mine = fsdp::plan(sm);
    const fsdp::MemoryPlan restated = fsdp::plan<fsdp::HybridShard, MP, fsdp::BackwardPost>(sm);
    CHECK(mine.peak_bytes(fsdp::MemorySpace::device) == restated.peak_bytes(fsdp::MemorySpace::device));
    CHECK(mine.peak_bytes(fsdp::MemorySpace::host) == restated.peak_bytes(fsdp::MemorySpace::host));
    CHECK(mine.steady == restated.steady);
    CHECK(mine.describe() == restated.describe());

    // Units built by hand with different policies: the planner replays one configuration.
    engine::Model other(two_blocks());
    fsdp::ShardedModel mixed;
    mixed.emplace<fsdp::Sharded<engine::Block, fsdp::FullShard>>(other.blocks[0], comm, device, "blocks.0");
    auto& by_hand = mixed.emplace<fsdp::Sharded<engine::Block, fsdp::ShardGradOp>>(other.blocks[1], comm, device,
                                                                                   "blocks.1");
    CHECK(by_hand.config().policies.strategy() == "SHARD_GRAD_OP");  // on the typed unit too, not only through Unit&
    const std::string error = test_support::error_of([&] { fsdp::plan(mixed); });
    CAPTURE(error);
    CHECK(contains(error, "units 'blocks.0' (FULL_SHARD"));
    CHECK(contains(error, "'blocks.1' (SHARD_GRAD_OP"));
    CHECK(contains(error, "have different policies"));
  });
}

}  // namespace core_model_config_test
