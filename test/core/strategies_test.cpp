// Every ShardingStrategy: parity with unsharded training, the collectives it promises per
// step (counted), and the per-rank peak memory its schedule implies (to the byte).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/reference_training.hpp"

namespace core_strategies_test {

namespace {

using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;
using test_support::bitwise_equal;
using test_support::max_difference;
using test_support::Params;
using test_support::unit_numels;

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13, hidden 7: sizes no group size divides
  c.blocks = 3;
  return c;
}

struct StepCounts {
  fsdp::CollectiveCounts world, shard, replicate;  // the mesh's three communicators, one step
};

struct Result {
  Params params;
  std::vector<StepCounts> counts;           // per rank, for the last step
  std::vector<fsdp::MemoryStats> memory;    // per rank, after training
};

// Trains `steps` AdamW steps with strategy S on a replicate x shard mesh, one sample per rank.
template <class S>
Result train(fsdp::MeshShape shape, int steps) {
  const auto c = config();
  const int world = shape.size();
  Result out;
  out.counts.resize(world);
  out.memory.resize(world);
  std::vector<Params> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    Counting counted(comm);
    fsdp::DeviceMesh<Counting> mesh(counted, shape);
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<S, fsdp::NoBackwardPrefetch>(model, mesh, device, engine::Wrap{});  // prefetch: see prefetch_test
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    for (int s = 0; s < steps; ++s) {
      counted.reset();
      mesh.shard_group().reset();
      mesh.replicate_group().reset();
      engine::sharded_step(model, sm, opt, engine::make_batch(c, s, r, 1));
    }
    out.counts[r] = {counted.counts(), mesh.shard_group().counts(), mesh.replicate_group().counts()};
    out.memory[r] = device.stats();
    per_rank[r] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  out.params = per_rank[0];
  return out;
}

// What a strategy promises, derived from its definition:
//   sharded over G ranks (shard group), replicated over R ranks, parameters freed after
//   forward or kept until the unit's backward.
struct Promise {
  bool shards, reshard_after_forward, hybrid;
};
// Stated here from the strategies' definitions (PyTorch's ShardingStrategy), not read
// from the library's tags, so a tag with a wrong flag fails these tests.
template <class S> Promise promise();
template <> Promise promise<fsdp::FullShard>() { return {.shards = true, .reshard_after_forward = true, .hybrid = false}; }
template <> Promise promise<fsdp::ShardGradOp>() { return {.shards = true, .reshard_after_forward = false, .hybrid = false}; }
template <> Promise promise<fsdp::NoShard>() { return {.shards = false, .reshard_after_forward = false, .hybrid = false}; }
template <> Promise promise<fsdp::HybridShard>() { return {.shards = true, .reshard_after_forward = true, .hybrid = true}; }
template <> Promise promise<fsdp::HybridShardZero2>() { return {.shards = true, .reshard_after_forward = false, .hybrid = true}; }

std::int64_t round_up(std::int64_t n, std::int64_t g) { return (n + g - 1) / g * g; }

// Collectives of one training step on any rank.
void check_counts(const Promise& p, fsdp::MeshShape shape, const StepCounts& got) {
  const auto units = unit_numels(config());
  const std::int64_t group = p.shards ? (p.hybrid ? shape.shard : shape.size()) : 1;
  std::uint64_t n = units.size(), gather_bytes = 0, reduce_bytes = 0, shard_bytes = 0, full_bytes = 0;
  for (auto u : units) {
    gather_bytes += 4 * static_cast<std::uint64_t>(round_up(u, group));
    shard_bytes += 4 * static_cast<std::uint64_t>(round_up(u, group) / group);
    full_bytes += 4 * static_cast<std::uint64_t>(u);
  }
  reduce_bytes = gather_bytes;
  // A group of one rank has nothing to exchange: no call at all (fsdp/unit/detail/unit_groups.hpp).
  const bool gathers = p.shards && group > 1;
  const std::uint64_t gathers_per_unit = !gathers ? 0 : (p.reshard_after_forward ? 2 : 1);
  // After the first iteration the unit backward starts with (the root) is not resharded at
  // the end of forward, so where parameters are resharded it is gathered once, not twice.
  const std::uint64_t root_gather_bytes = 4 * static_cast<std::uint64_t>(round_up(units[0], group));
  const bool root_kept = gathers && p.reshard_after_forward;
  using fsdp::Collective;
  // Where each collective runs: hybrid uses the mesh's groups, the others the world.
  const fsdp::CollectiveCounts& sharding = p.hybrid ? got.shard : got.world;
  // No order check of its own: ThreadComm checks each collective's tag (fsdp/core/collective_tag.hpp).
  CHECK(sharding[Collective::all_gather].calls == gathers_per_unit * n - (root_kept ? 1 : 0));
  CHECK(sharding[Collective::all_gather].bytes == gathers_per_unit * gather_bytes - (root_kept ? root_gather_bytes : 0));
  if (gathers) {
    CHECK(sharding[Collective::reduce_scatter].calls == n);
    CHECK(sharding[Collective::reduce_scatter].bytes == reduce_bytes);
  } else {
    CHECK(sharding[Collective::reduce_scatter].calls == 0);
  }
  // All-reduce: NoShard all-reduces whole gradients over the world; hybrid all-reduces the
  // gradient shards over the replicate group (only when there is more than one replica).
  const fsdp::CollectiveCounts& replicating = p.hybrid ? got.replicate : got.world;
  if (!p.shards && shape.size() > 1) {
    CHECK(replicating[Collective::all_reduce].calls == n);
    CHECK(replicating[Collective::all_reduce].bytes == full_bytes);
  } else if (p.hybrid && shape.replicate > 1) {
    CHECK(replicating[Collective::all_reduce].calls == n);
    CHECK(replicating[Collective::all_reduce].bytes == shard_bytes);
  } else {
    CHECK(replicating[Collective::all_reduce].calls == 0);
  }
  // Nothing else anywhere.
  for (const auto* c : {&got.world, &got.shard, &got.replicate}) {
    CHECK((*c)[Collective::broadcast].calls == 0);
    CHECK((*c)[Collective::barrier].calls == 0);
  }
  if (p.hybrid) {
    for (auto k : {Collective::all_gather, Collective::reduce_scatter, Collective::all_reduce}) CHECK(got.world[k].calls == 0);
  }
  else for (const auto* c : {&got.shard, &got.replicate}) for (auto& e : c->by_kind) CHECK(e.calls == 0);
}

// Peak bytes on rank r, by replaying the step's hook sequence under the strategy's rules:
// steady state (sharded params + grads + AdamW moments), plus unsharded parameters from
// all-gather until freed, plus an unsharded gradient from pre- to post-backward where
// parameters are sharded over more than the one rank of a one-rank world.
std::size_t expected_peak(const Promise& p, fsdp::MeshShape shape, int rank) {
  const auto units = unit_numels(config());
  const std::int64_t g = p.shards ? (p.hybrid ? shape.shard : shape.size()) : 1;
  const int shard_rank = p.shards ? (p.hybrid ? rank % shape.shard : rank) : 0;
  std::size_t steady = 0;
  std::vector<std::size_t> full(units.size());
  for (std::size_t u = 0; u < units.size(); ++u) {
    const std::int64_t shard = round_up(units[u], g) / g;
    const std::int64_t valid = std::clamp<std::int64_t>(units[u] - shard_rank * shard, 0, shard);
    steady += 4 * static_cast<std::size_t>(2 * shard + 2 * valid);
    full[u] = 4 * static_cast<std::size_t>(round_up(units[u], g));
  }
  std::size_t live = steady, peak = steady;
  std::vector<bool> gathered(units.size(), false);
  auto add = [&](std::size_t b) { live += b; peak = std::max(peak, live); };
  auto gather = [&](std::size_t u) { if (p.shards && !gathered[u]) { gathered[u] = true; add(full[u]); } };
  auto release = [&](std::size_t u) { if (gathered[u]) { gathered[u] = false; live -= full[u]; } };
  const std::size_t last = units.size() - 1;
  for (int step = 0; step < 2; ++step) {
    gather(0);  // root: forward
    for (std::size_t u = 1; u <= last; ++u) { gather(u); if (p.reshard_after_forward) release(u); }
    if (p.reshard_after_forward) release(0);
    for (std::size_t k = 0; k <= last; ++k) {  // backward: root, then layers in reverse, root ends last
      const std::size_t u = k == 0 ? 0 : last + 1 - k;
      gather(u);
      // The unsharded gradient. Replicated parameters after zero_grad accumulate straight
      // into their (replicated) gradient, as DDP does: no extra buffer. So do sharded ones
      // in a world of one rank, whose shard is the whole padded parameter.
      const std::size_t grad = p.shards && shape.size() > 1 ? full[u] : 0;
      add(grad);
      if (u != 0) { release(u); live -= grad; }
    }
    release(0);
    live -= p.shards ? full[0] : 0;
  }
  return peak;
}

template <class S>
void check_strategy(fsdp::MeshShape shape, bool bitwise) {
  CAPTURE(S::name);
  CAPTURE(shape.str());
  const int steps = 5;
  const Result got = train<S>(shape, steps);
  const Params want = test_support::reference_params(config(), steps, shape.size());
  if (bitwise) CHECK(bitwise_equal(got.params, want));
  // Otherwise partial sums are added in a different order (per shard group first, then
  // across replicas): a few float ulps, far below the ~1e-3 a wrong reduction would move.
  else CHECK(max_difference(got.params, want) <= 2e-6);
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    check_counts(promise<S>(), shape, got.counts[r]);
    CHECK(got.memory[r].peak_bytes == expected_peak(promise<S>(), shape, r));
  }
}

}  // namespace

TEST_CASE("FullShard on 4 ranks: parity, two all-gathers and one reduce-scatter per unit, ZeRO-3 memory") {
  check_strategy<fsdp::FullShard>({1, 4}, /*bitwise=*/true);
}
TEST_CASE("ShardGradOp on 4 ranks: one all-gather per unit, parameters kept from forward to backward") {
  check_strategy<fsdp::ShardGradOp>({1, 4}, /*bitwise=*/true);
}
TEST_CASE("NoShard on 4 ranks: no all-gather, one all-reduce of each whole gradient") {
  check_strategy<fsdp::NoShard>({1, 4}, /*bitwise=*/true);  // all-reduce in rank order = sequential sum
}
TEST_CASE("HybridShard: FullShard inside shard groups, gradient shards all-reduced across replicas") {
  check_strategy<fsdp::HybridShard>({2, 2}, /*bitwise=*/false);
  check_strategy<fsdp::HybridShard>({3, 2}, /*bitwise=*/false);
  check_strategy<fsdp::HybridShard>({1, 4}, /*bitwise=*/true);  // one replica: plain FullShard
}
TEST_CASE("a group of one rank makes no collective call: one-rank runs, HSDP over shard groups of one") {
  check_strategy<fsdp::FullShard>({1, 1}, /*bitwise=*/true);
  check_strategy<fsdp::ShardGradOp>({1, 1}, /*bitwise=*/true);
  check_strategy<fsdp::NoShard>({1, 1}, /*bitwise=*/true);
  check_strategy<fsdp::HybridShard>({4, 1}, /*bitwise=*/true);  // the replicas' all-reduce only: DDP
  check_strategy<fsdp::HybridShardZero2>({3, 1}, /*bitwise=*/false);
}
TEST_CASE("HybridShardZero2: ShardGradOp inside shard groups, replicated across") {
  check_strategy<fsdp::HybridShardZero2>({2, 2}, /*bitwise=*/false);
  check_strategy<fsdp::HybridShardZero2>({3, 2}, /*bitwise=*/false);
}

TEST_CASE("the expected peaks really differ between strategies (the memory checks above discriminate)") {
  const fsdp::MeshShape four{1, 4};
  const auto full = expected_peak(promise<fsdp::FullShard>(), four, 0);
  const auto zero2 = expected_peak(promise<fsdp::ShardGradOp>(), four, 0);
  const auto ddp = expected_peak(promise<fsdp::NoShard>(), four, 0);
  CHECK(full < zero2);
  CHECK(zero2 < ddp);
}

TEST_CASE("ShardGradOp keeps parameters after a forward-only pass until reshard()") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    const auto c = config();
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::ShardGradOp>(model, comm, device, engine::Wrap{});
    const auto steady = device.stats().live_bytes;
    engine::UnitHooks hooks{sm};
    model.forward(engine::make_batch(c, 0, comm.rank(), 1).x, hooks);
    CHECK(model.blocks[0].fc1.weight.data() != nullptr);
    CHECK(device.stats().live_bytes > steady);
    sm.reshard();
    CHECK(model.blocks[0].fc1.weight.data() == nullptr);
    CHECK(device.stats().live_bytes == steady);
  });
}

TEST_CASE("NoShard uses exactly the memory of unsharded training: parameters, gradients, optimizer state") {
  const auto c = config();
  fsdp::HostDevice unsharded_device;
  {
    engine::DeviceAllocator<fsdp::HostDevice> alloc(unsharded_device);
    engine::Model model(c, alloc);
    engine::AdamW opt({}, alloc);
    for (int s = 0; s < 2; ++s) engine::unsharded_step(model, opt, engine::make_batch(c, s, 0, 2));
  }
  std::vector<std::size_t> peak(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::NoShard>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    for (int s = 0; s < 2; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank(), 1));
    peak[comm.rank()] = device.stats().peak_bytes;
  });
  // The unsharded run also allocates the model's buffer (the gain's scale, `dim` floats)
  // from the counting device; the sharded run leaves buffers to the engine.
  const std::size_t buffer_bytes = 4 * static_cast<std::size_t>(c.dim);
  CHECK(peak[0] == unsharded_device.stats().peak_bytes - buffer_bytes);
  CHECK(peak[1] == unsharded_device.stats().peak_bytes - buffer_bytes);
}

TEST_CASE("NoShard parameters stay valid between steps and every rank holds all of them") {
  fsdp::ThreadGroup(3).run([](fsdp::ThreadComm& comm) {
    const auto c = config();
    engine::Model model(c);
    engine::Model fresh(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::NoShard>(model, comm, device, engine::Wrap{});
    REQUIRE(model.head.weight.data() != nullptr);
    CHECK(std::memcmp(model.head.weight.data(), fresh.head.weight.data(), 4 * fresh.head.weight.numel()) == 0);
    std::int64_t total = 0;
    for (auto& v : sm.shards()) total += v.numel;
    std::int64_t numel = 0;
    for (auto& p : engine::named_parameters(fresh)) numel += p.param->numel();
    CHECK(total == numel);
  });
}

TEST_CASE("hybrid strategies need a mesh; a mesh needs a shape that fits the world") {
  auto msgs = std::vector<std::string>(4);
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    try {
      fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{3, 2});
    } catch (const fsdp::Error& e) {
      msgs[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 4; ++r) CHECK(msgs[r] == "fsdp: device mesh on rank " + std::to_string(r) + ": shape 3x2 (replicate x shard) needs 6 ranks but the communicator has 4");
}

TEST_CASE("units of one model must agree on their groups") {
  fsdp::ThreadGroup(4).run([](fsdp::ThreadComm& comm) {
    const auto c = config();
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{2, 2});
    fsdp::ShardedModel sm;
    sm.emplace<fsdp::Sharded<engine::Block, fsdp::HybridShard>>(model.blocks[0], mesh, device, "blocks.0");
    using FullBlock = fsdp::Sharded<engine::Block, fsdp::FullShard>;
    CHECK_THROWS_WITH_AS(sm.emplace<FullBlock>(model.blocks[1], comm, device, "blocks.1"),
                         doctest::Contains("unit 'blocks.1' uses a shard group of 4 ranks, replicate group of 1 ranks but unit 'blocks.0' a shard group of 2 ranks, replicate group of 2 ranks"),
                         fsdp::Error);
  });
}

}  // namespace core_strategies_test
