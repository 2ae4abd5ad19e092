// The persistence threshold (ShardOptions::persistence_threshold): units
// with fewer parameter elements stay unsharded, so the reference model's gain unit (dim
// elements) is never all-gathered and its gradient is all-reduced. Counted collectives per
// step, parity with unsharded training, memory, and checkpoints of such a model.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <fsdp/checkpoint/checkpoint.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "test/support/reference_training.hpp"

namespace core_persistence_threshold_test {

namespace {

using test_support::max_difference;
using test_support::Params;
using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;
using fsdp::Collective;

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13: the gain unit has 13 elements, every other unit more than 50
  c.blocks = 3;
  return c;
}

// Keeps the gain unit (c.dim elements) and nothing else unsharded.
fsdp::ShardOptions keep_gain(const engine::ModelConfig& c) { return {.persistence_threshold = c.dim + 1}; }

constexpr int kGlobalBatch = 12;  // divisible by 1, 2, 3, 4

// AdamW steps [first, last) on `world` ranks with `options`, after `before` (a load); then
// `after` (a save). Returns rank 0's full parameters.
using Hook = test_support::AdamwHook;
template <class... Ps>
Params train(int world, int first, int last, const fsdp::ShardOptions& options, std::uint64_t seed = 1,
             const Hook& before = {}, const Hook& after = {}) {
  auto c = config();
  c.seed = seed;
  return test_support::adamw_run<Ps...>(c, {.world = world, .first = first, .last = last, .global_batch = kGlobalBatch,
                                            .options = options, .before = before, .after = after});
}

// One step's collectives on rank 0 (world and sub-groups together), after a first step.
template <class... Ps>
fsdp::CollectiveCounts step_counts(int world, const fsdp::ShardOptions& options, fsdp::MeshShape mesh_shape = {}) {
  const auto c = config();
  fsdp::CollectiveCounts total;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    Counting counted(comm);
    fsdp::DeviceMesh mesh(counted, mesh_shape.size() == world ? mesh_shape : fsdp::MeshShape{1, world});
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, mesh, device, engine::Wrap{}, options);
    engine::Sgd sgd(0.01f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    engine::reset_counts(mesh);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 1, comm.rank(), 1));
    if (comm.rank() == 0) total = engine::total_counts(mesh);
  });
  return total;
}

}  // namespace

TEST_CASE("a unit under the threshold is never all-gathered: two collectives fewer per step, one all-reduce instead of a reduce-scatter") {
  const auto c = config();
  const int world = 4;
  const auto sharded = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch>(world, {});
  const auto kept = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch>(world, keep_gain(c));
  // The gain unit's all-gathers (forward and backward) are gone; its reduce-scatter is an all-reduce.
  CHECK(kept[Collective::all_gather].calls + 2 == sharded[Collective::all_gather].calls);
  CHECK(kept[Collective::reduce_scatter].calls + 1 == sharded[Collective::reduce_scatter].calls);
  CHECK(kept[Collective::all_reduce].calls == sharded[Collective::all_reduce].calls + 1);
  const std::uint64_t gain_padded_bytes = static_cast<std::uint64_t>((c.dim + world - 1) / world * world) * 4;
  CHECK(kept[Collective::all_gather].bytes + 2 * gain_padded_bytes == sharded[Collective::all_gather].bytes);
  CHECK(kept[Collective::all_reduce].bytes == sharded[Collective::all_reduce].bytes + static_cast<std::uint64_t>(c.dim) * 4);

  // Hybrid: the kept unit's one all-reduce spans the world (shard and replicate groups at once).
  const auto hybrid = step_counts<fsdp::HybridShard, fsdp::NoBackwardPrefetch>(world, {}, {2, 2});
  const auto hybrid_kept = step_counts<fsdp::HybridShard, fsdp::NoBackwardPrefetch>(world, keep_gain(c), {2, 2});
  CHECK(hybrid_kept[Collective::all_gather].calls + 2 == hybrid[Collective::all_gather].calls);
  CHECK(hybrid_kept[Collective::reduce_scatter].calls + 1 == hybrid[Collective::reduce_scatter].calls);
  CHECK(hybrid_kept[Collective::all_reduce].calls == hybrid[Collective::all_reduce].calls);  // one for one

  // A threshold above every unit: NoShard's collectives exactly.
  const auto all_kept = step_counts<fsdp::FullShard>(world, {.persistence_threshold = 1 << 30});
  CHECK(all_kept == step_counts<fsdp::NoShard>(world, {}));
}

TEST_CASE("which units are kept: fewer elements than the threshold; groups() still name the model's") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.persistence_threshold = c.dim});
    for (const auto& u : sm) CHECK(fsdp::detail::internals(*u).groups() == fsdp::detail::internals(sm.unit("")).groups());
    // Exactly dim elements is not below dim: sharded. One more, and the gain is kept.
    CHECK(sm.unit("gain").shards()[0].padded_numel == (c.dim + 1) / 2);
    engine::Model other(c);
    auto kept = fsdp::shard<fsdp::FullShard>(other, comm, device, engine::Wrap{}, keep_gain(c));
    CHECK(kept.unit("gain").shards()[0].padded_numel == c.dim);
    CHECK(kept.unit("gain").shards()[0].numel == c.dim);
    CHECK(kept.unit("blocks.0").shards()[0].padded_numel < test_support::unit_numels(c)[1]);
  });
}

TEST_CASE("parity with unsharded training, whatever the strategy, precision or offload") {
  const auto c = config();
  const Params reference = test_support::reference_params(config(), 4, kGlobalBatch);
  const Params sharded = train<fsdp::FullShard>(4, 0, 4, {});
  const Params kept = train<fsdp::FullShard>(4, 0, 4, keep_gain(c));
  CHECK(max_difference(sharded, reference) < 2e-5);
  CHECK(max_difference(kept, reference) < 2e-5);
  CHECK(max_difference(train<fsdp::ShardGradOp, fsdp::OffloadParams>(3, 0, 4, keep_gain(c)), reference) < 2e-5);
  CHECK(max_difference(train<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>(2, 0, 4, keep_gain(c)), reference) < 2e-5);
  // Under CommPrecision a kept unit is never gathered and its all-reduce runs in bf16; under
  // MixedPrecision its shard is cast, not gathered. Against the same precision without
  // kept units: only the gain's bf16 sums are rounded at other points (AdamW's normalised
  // steps make any rounding show, so not against the f32 reference).
  using B = fsdp::CommPrecision<fsdp::bf16>;
  using M = fsdp::MixedPrecision<fsdp::bf16>;
  CHECK(max_difference(train<fsdp::FullShard, B>(4, 0, 4, keep_gain(c)), train<fsdp::FullShard, B>(4, 0, 4, {})) < 5e-3);
  CHECK(max_difference(train<fsdp::FullShard, M>(4, 0, 4, keep_gain(c)), train<fsdp::FullShard, M>(4, 0, 4, {})) < 5e-3);
}

TEST_CASE("a kept unit costs its whole parameters and gradient on every rank, and no gather buffer") {
  const auto c = config();
  const int world = 4;
  std::vector<std::size_t> live_sharded(world), live_kept(world);
  for (bool keep : {false, true})
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, keep ? keep_gain(c) : fsdp::ShardOptions{});
      (keep ? live_kept : live_sharded)[comm.rank()] = device.stats().live_bytes;
    });
  const std::size_t shard = static_cast<std::size_t>((c.dim + world - 1) / world);
  for (int r = 0; r < world; ++r) CHECK(live_kept[r] == live_sharded[r] - 2 * shard * 4 + 2 * static_cast<std::size_t>(c.dim) * 4);
}

TEST_CASE("checkpoints of a model with kept units save and load, across thresholds, ranks and strategies") {
  const auto c = config();
  const auto tmp = std::filesystem::temp_directory_path() / ("fsdp-persistence-" + std::to_string(::getpid()));
  std::filesystem::remove_all(tmp);
  std::filesystem::create_directories(tmp);
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  auto save_sharded = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::save_sharded_checkpoint(tmp / "sharded", sm, &st); };
  auto save_full = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::save_full_checkpoint(tmp / "full.safetensors", sm, &st); };
  train<fsdp::FullShard>(4, 0, 3, keep_gain(c), 1, {}, save_sharded);
  train<fsdp::FullShard>(2, 0, 3, keep_gain(c), 1, {}, save_full);
  auto load_sharded = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::load_sharded_checkpoint(tmp / "sharded", sm, &st); };
  auto load_full = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::load_full_checkpoint(tmp / "full.safetensors", sm, &st); };
  // Seed 7: the fresh model starts elsewhere, so only the load brings it back.
  CHECK(max_difference(train<fsdp::FullShard>(4, 3, 6, keep_gain(c), 7, load_sharded), uninterrupted) < 2e-5);
  CHECK(max_difference(train<fsdp::ShardGradOp>(3, 3, 6, {}, 7, load_sharded), uninterrupted) < 2e-5);
  CHECK(max_difference(train<fsdp::FullShard>(2, 3, 6, keep_gain(c), 7, load_full), uninterrupted) < 2e-5);
  CHECK(max_difference(train<fsdp::FullShard>(1, 3, 6, {}, 7, load_full), uninterrupted) < 2e-5);
  // And the other way: a checkpoint without kept units loads into a model with them.
  train<fsdp::FullShard>(2, 0, 3, {}, 1, {}, save_sharded);
  CHECK(max_difference(train<fsdp::FullShard>(4, 3, 6, keep_gain(c), 7, load_sharded), uninterrupted) < 2e-5);
  // The full state dict shows the kept unit's parameter whole, like a sharded one's.
  const engine::Model fresh(c);
  train<fsdp::FullShard>(4, 0, 0, keep_gain(c), 1, {}, [&](fsdp::ShardedModel& sm, engine::AdamWState&) {
    const auto state = fsdp::full_state_dict(sm);
    const auto& gain = state.tensors.at("gain.gain");
    REQUIRE(gain.numel() == c.dim);
    CHECK(std::memcmp(gain.data.data(), fresh.gain.gain.data(), static_cast<std::size_t>(c.dim) * 4) == 0);
    CHECK(state.tensors.at("blocks.0.fc1.weight").numel() == c.dim * c.hidden);
  });
  std::filesystem::remove_all(tmp);
}

}  // namespace core_persistence_threshold_test
