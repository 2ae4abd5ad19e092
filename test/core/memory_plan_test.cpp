// fsdp::plan: the per-rank peak predicted before the first step equals, to the byte, the
// peak the Device counts over the steps that follow, per memory space, for every strategy,
// prefetch mode, precision and offload, on the reference model (units of three sizes,
// none a multiple of the rank count: padding everywhere). What the planner cannot model
// is refused.
#include <doctest/doctest.h>

#include <fsdp/comm/async_communicator.hpp>
#include <fsdp/model/memory_plan.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/sanitized.hpp"

namespace core_memory_plan_test {

namespace {

engine::ModelConfig config() {
  engine::ModelConfig c;  // root 5x13+13+13x3+3 = 120, blocks 13x7+7+7x13+13 = 202, gain 13
  c.blocks = 3;
  return c;
}

struct Run {
  int limit = 2;
  std::int64_t threshold = 0;
  int steps = 3;
  bool adamw = true;
  // Gradient accumulation: micro-batches per step (all but the last under no_sync), the
  // units' mode while sync is off, and whether they reshard after backward.
  int micro = 1;
  fsdp::GradientSyncMode mode = fsdp::GradientSyncMode::keep_unsharded;
  bool after_backward = true;
  bool defer_all_reduce = false;  // those micro-batches with set_requires_all_reduce(false) instead
  // A post-accumulate-grad hook: free, AdamW in backward (engine::OptimizerInBackward, its
  // state created in each unit's first hook); keep, a hook that only counts, AdamW after.
  std::optional<fsdp::GradientAfterHook> hook = std::nullopt;
  bool explicit_prefetch = false;  // FSDP2-style lists: two units ahead in forward, two behind in backward
  fsdp::ShardLayout layout = {};   // ShardOptions::shard_layout
};

struct Outcome {
  std::vector<fsdp::MemoryStats> device, host;
  std::vector<fsdp::MemoryPlan> plan;
};

using SyncMesh = fsdp::DeviceMesh<fsdp::ThreadComm>;
using AsyncMesh = fsdp::DeviceMesh<fsdp::AsyncCommunicator<fsdp::ThreadComm>>;

// One set of policies as the runs below use it: fsdp::shard and fsdp::plan with them, as
// function pointers. The runs take it as a value, so each compiles once, and a set of
// policies adds only these few calls (not a whole training run) to the test's build.
struct PolicySet {
  fsdp::ShardedModel (*shard)(engine::Model&, SyncMesh&, fsdp::HostDevice&, const fsdp::ShardOptions&);
  fsdp::ShardedModel (*shard_async)(engine::Model&, AsyncMesh&, fsdp::HostDevice&, const fsdp::ShardOptions&);
  fsdp::ShardedModel (*shard_deferred)(engine::Model&, SyncMesh&, fsdp::HostDevice&, const fsdp::ShardOptions&);
  fsdp::MemoryPlan (*plan)(fsdp::ShardedModel&, const fsdp::PlanOptions&);
  bool offload;
};

template <class... Ps>
PolicySet policies() {
  return {[](engine::Model& m, SyncMesh& mesh, fsdp::HostDevice& d, const fsdp::ShardOptions& o) {
            return fsdp::shard<Ps...>(m, mesh, d, engine::Wrap{}, o);
          },
          [](engine::Model& m, AsyncMesh& mesh, fsdp::HostDevice& d, const fsdp::ShardOptions& o) {
            return fsdp::shard<Ps...>(m, mesh, d, engine::Wrap{}, o);
          },
          [](engine::Model& m, SyncMesh& mesh, fsdp::HostDevice& d, const fsdp::ShardOptions& o) {
            return fsdp::shard<Ps...>(m, mesh, d, engine::Wrap{}, o, fsdp::deferred_init(engine::reset_parameters));
          },
          [](fsdp::ShardedModel& sm, const fsdp::PlanOptions& o) { return fsdp::plan<Ps...>(sm, o); },
          fsdp::Policies<Ps...>::cpu_offload::offload};
}

// The model sharded over `mesh` with the set's policies.
fsdp::ShardedModel shard_on(const PolicySet& p, engine::Model& m, SyncMesh& mesh, fsdp::HostDevice& d,
                            const fsdp::ShardOptions& o) {
  return p.shard(m, mesh, d, o);
}
fsdp::ShardedModel shard_on(const PolicySet& p, engine::Model& m, AsyncMesh& mesh, fsdp::HostDevice& d,
                            const fsdp::ShardOptions& o) {
  return p.shard_async(m, mesh, d, o);
}

// Plans, then trains `run.steps` steps (AdamW state through the same Device, counted in
// the plan as the engine's), on every rank of a `shape` mesh; through an
// AsyncCommunicator if Async (a template argument: the communicator is a type, so the run
// compiles once for each; every policy set's shard compiles for both, a few calls each).
template <bool Async>
Outcome train_and_plan_with(const PolicySet& policy, fsdp::MeshShape shape, Run run) {
  const auto c = config();
  const int world = shape.size();
  Outcome out{std::vector<fsdp::MemoryStats>(world), std::vector<fsdp::MemoryStats>(world), std::vector<fsdp::MemoryPlan>(world)};
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    fsdp::AsyncCommunicator stream(comm);
    auto go = [&](auto& communicator) {
      fsdp::DeviceMesh mesh(communicator, shape);
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = shard_on(policy, model, mesh, device,
                         fsdp::ShardOptions{.persistence_threshold = run.threshold, .shard_layout = run.layout});
      sm.set_max_prefetched_units(run.limit);
      sm.set_gradient_sync_mode(run.mode);
      if (run.explicit_prefetch) {
        auto u = [&](const char* fqn) { return &sm.unit(fqn); };
        u("blocks.0")->set_units_to_forward_prefetch({u("blocks.1"), u("blocks.2")});
        u("blocks.1")->set_units_to_forward_prefetch({u("blocks.2"), u("gain")});
        u("gain")->set_units_to_backward_prefetch({u("blocks.2"), u("blocks.1")});
        u("blocks.2")->set_units_to_backward_prefetch({u("blocks.0")});  // blocks.1 is gathered already
      }
      sm.set_reshard_after_backward(run.after_backward);
      const auto space = policy.offload ? fsdp::MemorySpace::host : fsdp::MemorySpace::device;
      fsdp::PlanOptions options;
      options.asynchronous = Async;
      options.persistence_threshold = run.threshold;
      options.steps = run.steps;
      options.micro_batches = run.micro;
      options.defer_all_reduce = run.defer_all_reduce;
      const bool in_backward = run.hook == fsdp::GradientAfterHook::free;
      if (run.adamw)  // two f32 moments per shard element: after the first step, or in each unit's first hook
        for (auto& u : sm) {
          std::size_t moments = 0;
          for (const auto& v : u->shards()) moments += 2 * 4 * static_cast<std::size_t>(v.numel);
          (in_backward ? options.engine_state_in_hook[u->fqn()] : options.engine_state)[static_cast<std::size_t>(space)] += moments;
        }
      engine::DeviceAllocator<fsdp::HostDevice> alloc(device, space);
      engine::AdamW adamw({}, alloc);
      engine::Sgd sgd(0.01f);
      int hooks_run = 0;
      std::optional<engine::OptimizerInBackward<engine::AdamW>> inside;
      if (in_backward) inside.emplace(sm, [&] { return std::make_unique<engine::AdamW>(engine::AdamW::Options{}, alloc); });
      if (run.hook == fsdp::GradientAfterHook::keep) sm.set_post_accumulate_grad_hook([&](fsdp::Unit&) { ++hooks_run; }, *run.hook);
      out.plan[comm.rank()] = policy.plan(sm, options);
      {  // the model's own report (ShardedModel::config()) plans the same, with nothing restated
        const fsdp::MemoryPlan from_config = fsdp::plan(sm, options);
        CHECK(from_config.peaks[0].bytes == out.plan[comm.rank()].peaks[0].bytes);
        CHECK(from_config.peaks[1].bytes == out.plan[comm.rank()].peaks[1].bytes);
        CHECK(from_config.steady == out.plan[comm.rank()].steady);
      }
      for (int s = 0; s < run.steps; ++s) {
        std::vector<engine::Batch> micro;
        for (int m = 0; m < run.micro; ++m) micro.push_back(engine::make_batch(c, s * run.micro + m, comm.rank(), 1));
        // All micro-batches but the last with sync off (no_sync) or the all-reduce deferred (HSDP).
        sm.zero_grad();
        for (int m = 0; m < run.micro; ++m) {
          const bool last = m + 1 == run.micro;
          if (run.defer_all_reduce) sm.set_requires_all_reduce(last);
          else sm.set_requires_gradient_sync(last);
          engine::sharded_micro_batch(model, sm, micro[static_cast<std::size_t>(m)]);
        }
        if (in_backward) continue;  // the optimizer stepped inside backward
        if (run.adamw) adamw.step(engine::slots(sm));
        else sgd.step(engine::slots(sm));
      }
      if (run.hook == fsdp::GradientAfterHook::keep) CHECK(hooks_run == run.steps * static_cast<int>(sm.size()));
      out.device[comm.rank()] = device.stats(fsdp::MemorySpace::device);
      out.host[comm.rank()] = device.stats(fsdp::MemorySpace::host);
    };
    if constexpr (Async) go(stream);
    else go(comm);
  });
  return out;
}

template <bool Async, class... Ps>
Outcome train_and_plan(fsdp::MeshShape shape, Run run) {
  return train_and_plan_with<Async>(policies<Ps...>(), shape, run);
}

// The plan equals what the run measured, on every rank; returns the run.
Outcome check_plan_with(bool async, const PolicySet& policy, fsdp::MeshShape shape, Run run) {
  CAPTURE(shape.str());
  CAPTURE(async);
  CAPTURE(run.limit);
  CAPTURE(run.threshold);
  CAPTURE(run.micro);
  CAPTURE(fsdp::name_of(run.mode));
  CAPTURE(run.after_backward);
  CAPTURE(run.defer_all_reduce);
  CAPTURE(run.hook ? std::string(fsdp::name_of(*run.hook)) : std::string("none"));
  CAPTURE(run.explicit_prefetch);
  CAPTURE(fsdp::name_of(run.layout));
  const Outcome o = async ? train_and_plan_with<true>(policy, shape, run) : train_and_plan_with<false>(policy, shape, run);
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    CAPTURE(o.plan[r].describe());
    CHECK(o.plan[r].peak_bytes(fsdp::MemorySpace::device) == o.device[r].peak_bytes);
    CHECK(o.plan[r].peak_bytes(fsdp::MemorySpace::host) == o.host[r].peak_bytes);
    CHECK(o.plan[r].steady[0] == o.device[r].live_bytes);
    CHECK(o.plan[r].steady[1] == o.host[r].live_bytes);
  }
  return o;
}

template <bool Async, class... Ps>
Outcome check_plan_on(fsdp::MeshShape shape, Run run) {
  return check_plan_with(Async, policies<Ps...>(), shape, run);
}

template <class... Ps>
void check_plan(fsdp::MeshShape shape, Run run = {}) {
  check_plan_on<false, Ps...>(shape, run);
}
template <class... Ps>
Outcome check_async_plan(fsdp::MeshShape shape, Run run = {}) {
  return check_plan_on<true, Ps...>(shape, run);
}

// Every prefetch combination under one strategy, precision and offload.
template <class... Ps>
void check_prefetch_modes(fsdp::MeshShape shape, Run run = {}) {
  check_plan<Ps..., fsdp::NoBackwardPrefetch>(shape, run);
  check_plan<Ps..., fsdp::BackwardPre>(shape, run);
  check_plan<Ps..., fsdp::BackwardPost>(shape, run);
  check_plan<Ps..., fsdp::NoBackwardPrefetch, fsdp::ForwardPrefetch>(shape, run);
  check_plan<Ps..., fsdp::BackwardPre, fsdp::ForwardPrefetch>(shape, run);
  check_plan<Ps..., fsdp::BackwardPost, fsdp::ForwardPrefetch>(shape, run);
}

// The two most used prefetch settings (the others: FullShard's test).
template <class... Ps>
void check_common_prefetch(fsdp::MeshShape shape, Run run = {}) {
  check_plan<Ps..., fsdp::NoBackwardPrefetch>(shape, run);
  check_plan<Ps..., fsdp::BackwardPre, fsdp::ForwardPrefetch>(shape, run);
}

template <class... Ps>
void check_precisions_and_offload(fsdp::MeshShape shape, Run run = {}) {
  check_common_prefetch<Ps...>(shape, run);
  check_common_prefetch<Ps..., fsdp::MixedPrecision<fsdp::bf16>>(shape, run);
  check_common_prefetch<Ps..., fsdp::OffloadParams>(shape, run);
  check_common_prefetch<Ps..., fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>(shape, run);
}

}  // namespace

TEST_CASE("FullShard: plan == measured peak, every prefetch mode x precision x offload") {
  check_prefetch_modes<fsdp::FullShard>({1, 3});
  check_prefetch_modes<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 3});
  check_prefetch_modes<fsdp::FullShard, fsdp::OffloadParams>({1, 2});
  check_prefetch_modes<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({1, 2});
}

TEST_CASE("FullShard: plan == measured on 1 to 4 ranks, with SGD (no engine state), and at every prefetch limit") {
  for (int world : {1, 2, 4}) check_plan<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>({1, world});
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.adamw = false});
  for (int limit : {0, 1, 3}) check_plan<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>({1, 3}, {.limit = limit});
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.steps = 1});  // the first step prefetches nothing
  // CommPrecision: the narrower gather buffer lives until it is widened; the bf16 gradient copy until reduced.
  check_plan<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch, fsdp::CommPrecision<fsdp::bf16>>({1, 3});
  check_plan<fsdp::NoShard, fsdp::BackwardPre, fsdp::CommPrecision<fsdp::bf16>, fsdp::OffloadParams>({1, 2});
}

// Alone in the reducing group (one rank, HSDP over shard groups of one), a gradient of
// another dtype than the reduction's is cast straight into the sharded gradient: no
// buffer of the reduce dtype, unless sums are kept, deferred or offloaded.
TEST_CASE("a group of one: plan == measured where the reduction is a cast into the sharded gradient") {
  using MP = fsdp::MixedPrecision<fsdp::bf16, float>;
  check_prefetch_modes<fsdp::FullShard, MP>({1, 1});
  check_common_prefetch<fsdp::FullShard, MP, fsdp::OffloadParams>({1, 1});
  check_precisions_and_offload<fsdp::FullShard>({1, 1});
  check_precisions_and_offload<fsdp::NoShard>({1, 1});
  check_common_prefetch<fsdp::NoShard, MP>({1, 1});
  check_precisions_and_offload<fsdp::HybridShard>({2, 1});
  check_common_prefetch<fsdp::HybridShard, MP>({3, 1});
  check_common_prefetch<fsdp::HybridShardZero2, MP>({2, 1});
  check_plan<fsdp::FullShard, fsdp::BackwardPre, MP>({1, 1}, {.threshold = 150});
  for (auto mode : {fsdp::GradientSyncMode::keep_unsharded, fsdp::GradientSyncMode::reduce_every_microbatch})
    check_common_prefetch<fsdp::FullShard, MP>({1, 1}, {.micro = 3, .mode = mode});
  check_common_prefetch<fsdp::HybridShard, MP>({2, 1}, {.micro = 2, .defer_all_reduce = true});
  check_plan<fsdp::FullShard, fsdp::BackwardPre, MP>({1, 1}, {.hook = fsdp::GradientAfterHook::free});  // allocated again, then cast into
  // An asynchronous communicator: a reduction with no peers completes inside the call.
  check_async_plan<fsdp::FullShard, fsdp::NoBackwardPrefetch>({1, 1});
  check_async_plan<fsdp::FullShard, fsdp::BackwardPre, MP>({1, 1});
  check_async_plan<fsdp::HybridShard, fsdp::BackwardPre>({2, 1});
}

TEST_CASE("a block format's all-gather: plan == measured peak, its slots, the f32 buffer under bf16, the staged offloaded shard") {
  using Int8 = fsdp::CommPrecision<fsdp::Int8Blocks<16>, float>;
  check_common_prefetch<fsdp::FullShard, Int8>({1, 3});
  check_common_prefetch<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::CommPrecision<fsdp::MXFP8, fsdp::bf16>>({1, 3});
  check_common_prefetch<fsdp::FullShard, Int8, fsdp::OffloadParams>({1, 2});
  check_plan<fsdp::HybridShard, fsdp::CommPrecision<fsdp::F8E4M3Blocks<16>, float>>({2, 2});
  check_plan<fsdp::FullShard, fsdp::CommPrecision<fsdp::F8E5M2Blocks<16>, float>, fsdp::OffloadParams>({1, 2});
}

TEST_CASE("a per-tensor format's all-gather: plan == measured peak, its slots and its amaxes, the f32 buffer under bf16") {
  using E4 = fsdp::CommPrecision<fsdp::F8E4M3Tensor, float>;
  check_common_prefetch<fsdp::FullShard, E4>({1, 3});
  check_common_prefetch<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::CommPrecision<fsdp::F8E5M2Tensor, fsdp::bf16>>({1, 3});
  check_common_prefetch<fsdp::FullShard, E4, fsdp::OffloadParams>({1, 2});
  check_plan<fsdp::HybridShard, fsdp::CommPrecision<fsdp::F8E5M2Tensor, float>>({2, 2});
  check_common_prefetch<fsdp::FullShard, E4>({1, 3}, {.layout = fsdp::ShardLayout::block_aligned(8)});
}

TEST_CASE("ShardGradOp and NoShard: plan == measured peak, per precision x offload") {
  check_precisions_and_offload<fsdp::ShardGradOp>({1, 3});
  check_precisions_and_offload<fsdp::NoShard>({1, 2});
}

TEST_CASE("HybridShard and HybridShardZero2: plan == measured peak") {
  check_precisions_and_offload<fsdp::HybridShard>({2, 2});
  check_common_prefetch<fsdp::HybridShardZero2>({2, 3});
}

TEST_CASE("an asynchronous communicator: one reduction in flight, planned to the byte") {
  const Outcome o = check_async_plan<fsdp::FullShard, fsdp::NoBackwardPrefetch>({1, 3});
  check_async_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3});  // examples/train's configuration
  check_async_plan<fsdp::FullShard, fsdp::BackwardPost, fsdp::MixedPrecision<fsdp::bf16>>({1, 3});
  check_async_plan<fsdp::HybridShard, fsdp::BackwardPre, fsdp::OffloadParams>({2, 2});
  // Planned synchronously, the async run peaks higher: the option is not a no-op.
  CHECK(o.device[0].peak_bytes > train_and_plan<false, fsdp::FullShard, fsdp::NoBackwardPrefetch>({1, 3}, {}).plan[0].peak_bytes());
}

TEST_CASE("block-aligned and parameter-atomic shard layouts: the padding planned to the byte") {
  const auto block = fsdp::ShardLayout::block_aligned(8);
  check_prefetch_modes<fsdp::FullShard>({1, 3}, {.layout = block});
  check_common_prefetch<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({1, 2}, {.layout = block});
  check_common_prefetch<fsdp::FullShard, fsdp::CommPrecision<fsdp::Int8Blocks<8>, float>>({1, 3}, {.layout = block});
  check_plan<fsdp::ShardGradOp, fsdp::BackwardPre>({1, 4}, {.layout = fsdp::ShardLayout::block_aligned(32)});
  check_plan<fsdp::HybridShard, fsdp::BackwardPre>({2, 2}, {.layout = block});
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.threshold = 150, .layout = block});  // kept units are not cut
  check_async_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.layout = block});
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.micro = 2, .layout = block});
  const auto atomic = fsdp::ShardLayout::param_atomic();
  check_common_prefetch<fsdp::FullShard>({1, 3}, {.layout = atomic});
  check_common_prefetch<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({1, 2}, {.layout = atomic});
  check_plan<fsdp::FullShard, fsdp::BackwardPre, fsdp::CommPrecision<fsdp::Int8Blocks<8>, float>>({1, 3},
                                                                                                 {.layout = fsdp::ShardLayout::param_atomic(8)});
  check_plan<fsdp::HybridShard, fsdp::BackwardPre>({2, 2}, {.layout = atomic});
  check_async_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 4}, {.layout = atomic});
  // The layout costs memory: the same run under element_flat peaks lower.
  const Outcome flat = train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {});
  const Outcome aligned = train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.layout = fsdp::ShardLayout::block_aligned(32)});
  CHECK(aligned.device[0].peak_bytes > flat.device[0].peak_bytes);
  CHECK(aligned.plan[0].peak_bytes() == aligned.device[0].peak_bytes);
}

TEST_CASE("planning by hand a per-tensor gather needs the parameters one by one: it keeps an amax per parameter") {
  using T = fsdp::CommPrecision<fsdp::F8E4M3Tensor, float>;
  fsdp::PlannedUnit u;
  u.flat.push_back({});
  u.flat[0].numel = 20;
  fsdp::PlanOptions o;
  o.mesh = {1, 2};
  CHECK_THROWS_WITH_AS((fsdp::plan<fsdp::FullShard, T>({u}, o)),
                       doctest::Contains("a per-tensor gather (f8e4m3_tensor) keeps an amax per parameter"), fsdp::Error);
  u.flat[0].params = {{.numel = 10}, {.numel = 10}};
  const auto planned = fsdp::plan<fsdp::FullShard, T>({u}, o);
  CHECK(planned.steady[0] == 2 * 10 * 4);  // shard + sharded gradient, as in f32
  CHECK(planned.peak_bytes() > planned.steady[0]);
}

TEST_CASE("planning by hand under a block-aligned layout needs the parameters one by one") {
  fsdp::PlannedUnit u;
  u.flat.push_back({});
  u.flat[0].numel = 20;
  fsdp::PlanOptions o;
  o.mesh = {1, 2};
  o.shard_layout = fsdp::ShardLayout::block_aligned(8);
  CHECK_THROWS_WITH_AS(fsdp::plan<fsdp::FullShard>({u}, o), doctest::Contains("list them in PlannedUnit::Flat::params"), fsdp::Error);
  // Two parameters of 10: under block:8 they start at 0 and 16 (26 elements), shards of 16.
  u.flat[0].params = {{.numel = 10}, {.numel = 10}};
  const auto aligned = fsdp::plan<fsdp::FullShard>({u}, o);
  o.shard_layout = {};
  const auto flat = fsdp::plan<fsdp::FullShard>({u}, o);  // shards of 10
  // Steady: shard + sharded gradient, 2 x 16 x 4 bytes against 2 x 10 x 4.
  CHECK(aligned.steady[0] == 2 * 16 * 4);
  CHECK(flat.steady[0] == 2 * 10 * 4);
  o.shard_layout = fsdp::ShardLayout::param_atomic();  // 10 on each rank
  CHECK(fsdp::plan<fsdp::FullShard>({u}, o).steady[0] == 2 * 10 * 4);
  u.flat[0].params = {{.numel = 12}, {.numel = 8}};  // 12 on one rank, 8 on the other: shards of 12
  CHECK(fsdp::plan<fsdp::FullShard>({u}, o).steady[0] == 2 * 12 * 4);
  u.flat[0].numel = 21;  // the totals, where given, must be the parameters'
  CHECK_THROWS_WITH_AS(fsdp::plan<fsdp::FullShard>({u}, o), doctest::Contains("give one or the other"), fsdp::Error);
}

TEST_CASE("persistence threshold: units kept whole are planned as replicated") {
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.threshold = 150});  // the gain (13) and root (120)
  check_plan<fsdp::FullShard, fsdp::BackwardPre, fsdp::MixedPrecision<fsdp::bf16>>({1, 3}, {.threshold = 150});
}

TEST_CASE("gradient accumulation: plan == measured peak, both modes, every strategy, precision and offload") {
  using fsdp::GradientSyncMode;
  // Two and three micro-batches; under a sanitizer three only (test/support/sanitized.hpp).
  const std::vector<int> micros = test_support::sanitized ? std::vector<int>{3} : std::vector<int>{2, 3};
  for (auto mode : {GradientSyncMode::keep_unsharded, GradientSyncMode::reduce_every_microbatch}) {
    for (int micro : micros) {
      const Run run{.micro = micro, .mode = mode};
      check_prefetch_modes<fsdp::FullShard>({1, 3}, run);
      check_precisions_and_offload<fsdp::ShardGradOp>({1, 3}, run);
      check_precisions_and_offload<fsdp::NoShard>({1, 2}, run);
    }
    const Run run{.micro = 3, .mode = mode};
    check_prefetch_modes<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 3}, run);
    check_prefetch_modes<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({1, 2}, run);
    // Reduce in f32 under bf16 compute: the kept sums are f32 (the accumulate dtype), each
    // backward's bf16 gradient cast and added through a temporary.
    check_prefetch_modes<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>>({1, 3}, run);
    check_common_prefetch<fsdp::HybridShard, fsdp::MixedPrecision<fsdp::bf16, float>, fsdp::OffloadParams>({2, 2}, run);
    check_common_prefetch<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16>>({1, 3}, run);
    check_precisions_and_offload<fsdp::HybridShard>({2, 2}, run);
    check_common_prefetch<fsdp::HybridShardZero2>({2, 3}, run);
    check_plan_on<true, fsdp::FullShard, fsdp::BackwardPre, fsdp::MixedPrecision<fsdp::bf16>>({1, 3}, run);
    check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.threshold = 150, .micro = 3, .mode = mode});
    // Parameters kept between micro-batches (FSDP2's set_reshard_after_backward(false)).
    check_common_prefetch<fsdp::FullShard>({1, 3}, {.micro = 3, .mode = mode, .after_backward = false});
    check_common_prefetch<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 3}, {.micro = 2, .mode = mode, .after_backward = false});
  }
  // HSDP's deferred replicate all-reduce: the shard-group sums wait in a buffer of their
  // own (in the accumulate dtype: CommPrecision's sums are added in f32).
  for (int micro : micros) {
    const Run run{.micro = micro, .defer_all_reduce = true};
    check_precisions_and_offload<fsdp::HybridShard>({2, 2}, run);
    check_common_prefetch<fsdp::HybridShardZero2>({2, 3}, run);
    check_common_prefetch<fsdp::HybridShard, fsdp::CommPrecision<fsdp::bf16>>({2, 2}, run);
    check_common_prefetch<fsdp::HybridShard, fsdp::MixedPrecision<fsdp::bf16, float>>({2, 2}, run);
    check_plan_on<true, fsdp::HybridShard, fsdp::BackwardPre>({2, 2}, run);
    check_plan<fsdp::HybridShard, fsdp::BackwardPre>({2, 2}, {.threshold = 150, .micro = micro, .defer_all_reduce = true});
    check_plan<fsdp::HybridShard, fsdp::BackwardPre>({2, 2}, {.micro = micro, .after_backward = false, .defer_all_reduce = true});
    check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, run);  // no replicas: every pass reduces whole
  }
  // What accumulation costs, as planned: keeping unsharded gradients peaks higher than
  // reducing every micro-batch, which peaks as a step without accumulation does.
  const auto kept = train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.micro = 3});
  const auto every =
      train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.micro = 3, .mode = fsdp::GradientSyncMode::reduce_every_microbatch});
  const auto single = train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {});
  CHECK(kept.plan[0].peak_bytes() > every.plan[0].peak_bytes());
  CHECK(every.plan[0].peak_bytes() >= single.plan[0].peak_bytes());
}

TEST_CASE("the optimizer in backward: hooks that free the gradient, and the engine's state created in them, planned to the byte") {
  using fsdp::GradientAfterHook;
  for (auto after : {GradientAfterHook::free, GradientAfterHook::keep}) {
    const Run run{.hook = after};
    check_prefetch_modes<fsdp::FullShard>({1, 3}, run);
    check_precisions_and_offload<fsdp::ShardGradOp>({1, 3}, run);
    check_precisions_and_offload<fsdp::NoShard>({1, 2}, run);
    check_precisions_and_offload<fsdp::HybridShard>({2, 2}, run);
    check_common_prefetch<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 3}, run);
    check_common_prefetch<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16>>({1, 3}, run);
    check_plan_on<true, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, run);
    check_plan_on<true, fsdp::HybridShard, fsdp::BackwardPre, fsdp::MixedPrecision<fsdp::bf16>>({2, 2}, run);
    check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.threshold = 150, .hook = after});
    check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.micro = 3, .hook = after});  // hooks run in the last pass only
    check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.micro = 3, .mode = fsdp::GradientSyncMode::reduce_every_microbatch, .hook = after});
    check_plan<fsdp::HybridShard, fsdp::BackwardPre>({2, 2}, {.micro = 2, .defer_all_reduce = true, .hook = after});
  }
  // Stepping in backward and freeing each gradient lowers the planned peak.
  const auto inside = train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.hook = GradientAfterHook::free});
  const auto after = train_and_plan<false, fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {});
  CHECK(inside.plan[0].peak_bytes() < after.plan[0].peak_bytes());
}

TEST_CASE("explicit prefetch lists: gathered from the first pass on, under the limit, planned to the byte") {
  const Run run{.explicit_prefetch = true};
  check_prefetch_modes<fsdp::FullShard>({1, 3}, run);
  check_prefetch_modes<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 3}, run);
  check_common_prefetch<fsdp::ShardGradOp>({1, 3}, run);
  check_common_prefetch<fsdp::HybridShard, fsdp::OffloadParams>({2, 2}, run);
  for (int limit : {0, 1, 3}) check_plan<fsdp::FullShard, fsdp::BackwardPost>({1, 3}, {.limit = limit, .explicit_prefetch = true});
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.steps = 1, .explicit_prefetch = true});
  check_plan<fsdp::FullShard, fsdp::BackwardPre>({1, 3}, {.micro = 2, .hook = fsdp::GradientAfterHook::free, .explicit_prefetch = true});
  check_plan_on<true, fsdp::FullShard, fsdp::NoBackwardPrefetch>({1, 3}, run);
  // The lists gather more ahead than the order's next unit: a higher planned peak.
  const auto listed = train_and_plan<false, fsdp::FullShard, fsdp::NoBackwardPrefetch>({1, 3}, run);
  const auto plain = train_and_plan<false, fsdp::FullShard, fsdp::NoBackwardPrefetch>({1, 3}, {});
  CHECK(listed.plan[0].peak_bytes() > plain.plan[0].peak_bytes());
  using test_support::contains;
  using test_support::error_of;
  std::vector<fsdp::PlannedUnit> by_hand(2);
  by_hand[0].flat = by_hand[1].flat = {{fsdp::DType::f32, 4}};
  by_hand[1].fqn = "a";
  by_hand[1].units_to_forward_prefetch = {"b"};
  CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(by_hand, {.mesh = {1, 2}}); }),
                 "unit 'a''s forward prefetch names 'b', which is no unit"));
}

TEST_CASE("what the planner does not model is refused, naming the unit and why") {
  using test_support::contains;
  using test_support::error_of;
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    CHECK(fsdp::plan<fsdp::FullShard>(sm).peak_bytes() > 0);
    auto other_policy = error_of([&] { fsdp::plan<fsdp::FullShard, fsdp::OffloadParams>(sm); });
    CHECK(contains(other_policy, "unit '<root>'"));
    CHECK(contains(other_policy, "CpuOffload"));
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::NoShard>(sm); }), "policies given to fsdp::shard"));
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(sm, {.persistence_threshold = 150}); }), "persistence threshold 150"));
    sm.set_requires_gradient_sync(false);
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(sm); }), "has gradient sync off; plan between steps"));
    sm.set_requires_gradient_sync(true);
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(sm, {.micro_batches = 0}); }), "micro_batches must be >= 1"));
    sm.set_requires_all_reduce(false);
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(sm); }), "set PlanOptions::defer_all_reduce"));
    sm.set_requires_all_reduce(true);
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(sm, {.engine_state_in_hook = {{"gain", {8, 0}}}}); }),
                   "names unit 'gain', which has no post-accumulate-grad hook"));
    sm.set_post_accumulate_grad_hook([](fsdp::Unit&) {}, fsdp::GradientAfterHook::free);
    CHECK(fsdp::plan<fsdp::FullShard>(sm).peak_bytes() > 0);
    CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(sm, {.engine_state_in_hook = {{"nowhere", {8, 0}}}}); }),
                   "names 'nowhere', which is no unit"));
    sm.set_post_accumulate_grad_hook({});
    sm.unit("blocks.0").set_units_to_backward_prefetch({&sm.unit("gain")});
    CHECK(fsdp::plan<fsdp::FullShard>(sm).peak_bytes() > 0);
  });
  CHECK(contains(error_of([] { fsdp::plan<fsdp::FullShard>(std::vector<fsdp::PlannedUnit>{{"", {{fsdp::DType::f32, 4}}, {}}}, {.mesh = {0, 0}}); }),
                 "set PlanOptions::mesh"));
}

TEST_CASE("planning by hand, without a model: the FullShard formula of sharded_memory_test") {
  // Units of n = 10, 7 and 3 f32 elements on 4 ranks, no prefetch: shard S = ceil(n/4),
  // padded P = 4 S. Steady: 2 * sum S * 4 bytes; peak (backward of the root with a layer):
  // steady + 2 P_root + 2 max P_layer, in the second step the root kept since forward.
  const std::vector<fsdp::PlannedUnit> units{{"", {{fsdp::DType::f32, 10}}, {}},
                                             {"a", {{fsdp::DType::f32, 7}}, {}},
                                             {"b", {{fsdp::DType::f32, 3}}, {}}};
  const auto p = fsdp::plan<fsdp::FullShard, fsdp::NoBackwardPrefetch>(units, {.mesh = {1, 4}});
  const std::size_t steady = 2 * (3 + 2 + 1) * 4, root = 12 * 4, layer = 8 * 4;
  CHECK(p.steady[0] == steady);
  CHECK(p.peak_bytes() == steady + 2 * root + 2 * layer);
  CHECK(p.peak_bytes(fsdp::MemorySpace::host) == 0);
  CHECK(p.peak().unit == "a");
  CHECK(p.peak().phase == "pre_backward");  // the hook that allocated it: its gradient, with its own parameters and the root's kept
}

}  // namespace core_memory_plan_test

namespace core_memory_plan_test {

namespace {

// Setup as fsdp::shard runs it (plain, sync_module_states, deferred init), then two SGD
// steps (no engine state) and, if given, a summon: what the Device measured at each point.
struct SetupRun {
  bool sync_module_states = false;
  bool deferred = false;
  bool partly = false;  // deferred, but each block's first weight built with storage
  std::optional<fsdp::SummonOptions> summon = std::nullopt;
  fsdp::ShardLayout layout = {};  // ShardOptions::shard_layout
};
struct SetupOutcome {
  std::size_t setup_peak = 0, setup_host_peak = 0, peak = 0, host_peak = 0, live = 0;
  std::array<std::size_t, 2> summon_peak{};  // from the summon's start (device, host)
  fsdp::MemoryPlan plan;
  fsdp::ModelConfig config;
};

SetupOutcome run_setup_with(const PolicySet& policy, fsdp::MeshShape shape, SetupRun run, int rank_to_report) {
  engine::ModelConfig c = config();
  if (run.deferred) c.init = engine::Init::deferred;
  std::vector<SetupOutcome> out(static_cast<std::size_t>(shape.size()));
  fsdp::ThreadGroup(shape.size()).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh mesh(comm, shape);
    engine::Model model(c);
    if (run.partly)
      for (auto& b : model.blocks) b.fc1.weight = engine::Tensor({c.hidden, c.dim}, engine::heap(), fsdp::DType::f32);
    fsdp::HostDevice device;
    const fsdp::ShardOptions options{.sync_module_states = run.sync_module_states, .shard_layout = run.layout};
    auto sm = run.deferred ? policy.shard_deferred(model, mesh, device, options) : policy.shard(model, mesh, device, options);
    auto& mine = out[static_cast<std::size_t>(comm.rank())];
    mine.setup_peak = device.stats().peak_bytes;
    mine.setup_host_peak = device.stats(fsdp::MemorySpace::host).peak_bytes;
    mine.config = sm.config();
    mine.plan = fsdp::plan(sm, {.summon = run.summon});
    engine::Sgd sgd(0.01f);
    for (int s = 0; s < 2; ++s) {
      sm.zero_grad();
      engine::sharded_micro_batch(model, sm, engine::make_batch(c, s, comm.rank(), 1));
      sgd.step(engine::slots(sm));
    }
    mine.live = device.stats().live_bytes;
    mine.peak = device.stats().peak_bytes;
    mine.host_peak = device.stats(fsdp::MemorySpace::host).peak_bytes;
    if (run.summon) {
      device.reset_peak(fsdp::MemorySpace::device), device.reset_peak(fsdp::MemorySpace::host);
      { auto summoned = sm.summon_full_params(*run.summon); }
      mine.summon_peak = {device.stats().peak_bytes, device.stats(fsdp::MemorySpace::host).peak_bytes};
      mine.peak = std::max(mine.peak, mine.summon_peak[0]);
      mine.host_peak = std::max(mine.host_peak, mine.summon_peak[1]);
    }
  });
  return out[static_cast<std::size_t>(rank_to_report)];
}

template <class... Ps>
SetupOutcome run_setup(fsdp::MeshShape shape, SetupRun run, int rank_to_report = 1) {
  return run_setup_with(policies<Ps...>(), shape, run, rank_to_report);
}

void check_setup_with(const PolicySet& policy, fsdp::MeshShape shape, SetupRun run) {
  CAPTURE(shape.str());
  CAPTURE(run.sync_module_states);
  CAPTURE(run.deferred);
  const SetupOutcome o = run_setup_with(policy, shape, run, 1);
  CAPTURE(o.plan.describe());
  CHECK(o.plan.setup_peak[0] == o.setup_peak);
  CHECK(o.plan.setup_peak[1] == o.setup_host_peak);
  CHECK(o.plan.peak_bytes() == o.peak);
  CHECK(o.plan.peak_bytes(fsdp::MemorySpace::host) == o.host_peak);
  CHECK(o.plan.steady[0] == o.live);
  for (const auto& u : o.config.units) {  // the model reports how it was built, and the plan replays it
    CHECK(u.sync_module_states == run.sync_module_states);
    CHECK(u.deferred_parameters.empty() != run.deferred);
    if (run.partly && u.fqn.starts_with("blocks."))
      CHECK(std::find(u.deferred_parameters.begin(), u.deferred_parameters.end(), u.fqn + ".fc1.weight") == u.deferred_parameters.end());
  }
}

template <class... Ps>
void check_setups(fsdp::MeshShape shape) {
  const PolicySet policy = policies<Ps...>();
  check_setup_with(policy, shape, {});
  check_setup_with(policy, shape, {.sync_module_states = true});
  check_setup_with(policy, shape, {.deferred = true});
  check_setup_with(policy, shape, {.sync_module_states = true, .deferred = true});
  check_setup_with(policy, shape, {.deferred = true, .partly = true});  // the root and gain deferred whole, each block in part
}

}  // namespace

TEST_CASE("setup is planned by running it: sync_module_states and deferred init, every strategy, to the byte") {
  check_setups<fsdp::FullShard>({1, 3});
  check_setups<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 2});
  check_setups<fsdp::FullShard, fsdp::OffloadParams>({1, 2});
  check_setups<fsdp::ShardGradOp>({1, 2});
  check_setups<fsdp::NoShard>({1, 2});
  check_setups<fsdp::NoShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 3});
  check_setups<fsdp::HybridShard>({2, 2});
  check_setups<fsdp::HybridShardZero2>({2, 2});
}

TEST_CASE("block-aligned and parameter-atomic layouts: setup, deferred init (a block's parameters in part) and a summon, to the byte") {
  const auto block = fsdp::ShardLayout::block_aligned(8);
  for (bool deferred : {false, true})
    check_setup_with(policies<fsdp::FullShard>(), {1, 3}, {.deferred = deferred, .partly = deferred, .layout = block});
  check_setup_with(policies<fsdp::FullShard>(), {1, 3}, {.sync_module_states = true, .layout = block});
  for (bool deferred : {false, true})
    check_setup_with(policies<fsdp::FullShard>(), {1, 3},
                     {.deferred = deferred, .partly = deferred, .layout = fsdp::ShardLayout::param_atomic()});
  check_setup_with(policies<fsdp::FullShard>(), {1, 3},
                   {.summon = fsdp::SummonOptions{.writeback = true, .with_grads = true}, .layout = block});
}

TEST_CASE("NoShard with sync_module_states: setup holds rank 0's copy of one unit's parameters, and the plan says so") {
  // Units of 120 (root), 3 x 202 (blocks) and 13 (gain) f32 elements, replicated on 2
  // ranks: a shard and a gradient of each (steady = 2 x 739 x 4 = 5,912 bytes). While a
  // unit is built with sync_module_states it also holds rank 0's values of its parameters
  // until its shard is copied: the last block's 808 bytes on top of the units built so far
  // (root and three blocks: 2 x (120 + 3 x 202) x 4 = 5,808), 6,616 in all, where a plain
  // setup peaks at the steady figure. Figures from the configuration, not the library.
  const std::size_t steady = 2 * (120 + 3 * 202 + 13) * 4;
  const SetupOutcome plain = run_setup<fsdp::NoShard>({1, 2}, {});
  const SetupOutcome synced = run_setup<fsdp::NoShard>({1, 2}, {.sync_module_states = true});
  CHECK(plain.setup_peak == steady);
  CHECK(plain.plan.setup_peak[0] == steady);
  CHECK(synced.setup_peak == 2 * (120 + 3 * 202) * 4 + 202 * 4);
  CHECK(synced.plan.setup_peak[0] == synced.setup_peak);
  CHECK(synced.plan.steady[0] == steady);
}

TEST_CASE("a summon after the steps is planned to the byte, with each of its options") {
  for (const fsdp::SummonOptions& summon :
       {fsdp::SummonOptions{}, fsdp::SummonOptions{.writeback = true}, fsdp::SummonOptions{.rank0_only = true},
        fsdp::SummonOptions{.offload_to_host = true}, fsdp::SummonOptions{.with_grads = true}}) {
    CAPTURE(summon.writeback);
    CAPTURE(summon.rank0_only);
    CAPTURE(summon.offload_to_host);
    CAPTURE(summon.with_grads);
    for (int rank : {0, 1}) {
      CAPTURE(rank);
      const SetupOutcome o = run_setup<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({1, 2}, {.summon = summon}, rank);
      CHECK(o.plan.peak_bytes() == o.peak);
      CHECK(o.plan.peak_bytes(fsdp::MemorySpace::host) == o.host_peak);
      // The summon's own peak, from its start (the steady bytes) over its events.
      std::array<std::size_t, 2> planned = o.plan.steady;
      for (const auto& e : o.plan.timeline)
        if (e.phase == "summon_full_params")
          for (std::size_t k = 0; k < 2; ++k) planned[k] = std::max(planned[k], e.live[k]);
      CHECK(planned == o.summon_peak);
    }
  }
  // In the timeline: every unit's full parameters at once, 4 x (120 + 3 x 202 + 13) bytes
  // padded to 2 ranks (740 elements) above the steady bytes, freed at its end.
  const SetupOutcome o = run_setup<fsdp::FullShard>({1, 2}, {.summon = fsdp::SummonOptions{}});
  std::size_t summoned = 0;
  for (const auto& e : o.plan.timeline)
    if (e.phase == "summon_full_params") summoned = std::max(summoned, e.live[0]);
  CHECK(summoned == o.plan.steady[0] + 4 * (120 + 3 * 202 + 14));
  CHECK(o.summon_peak[0] == summoned);
  CHECK(o.plan.timeline.back().live[0] == o.plan.steady[0]);
}

TEST_CASE("settings changed between micro-batches are planned by making the same calls on the planning model") {
  // Three micro-batches: the first two keep each unit's parameters after backward and
  // accumulate in the sharded gradient; the last reshards and syncs as usual.
  auto settings = [](fsdp::ShardedModel& sm, bool last) {
    sm.set_reshard_after_backward(last);
    sm.set_gradient_sync_mode(last ? fsdp::GradientSyncMode::keep_unsharded : fsdp::GradientSyncMode::reduce_every_microbatch);
  };
  const auto c = config();
  std::vector<std::size_t> measured(2), planned(2), planned_fixed(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre>(model, comm, device, engine::Wrap{});
    const auto r = static_cast<std::size_t>(comm.rank());
    planned[r] = fsdp::plan(sm, {.micro_batches = 3, .before_pass = [&](fsdp::ShardedModel& m, const fsdp::PlanPass& p) {
                                   settings(m, p.last);
                                 }}).peak_bytes();
    planned_fixed[r] = fsdp::plan(sm, {.micro_batches = 3}).peak_bytes();
    for (int s = 0; s < 2; ++s) {
      sm.zero_grad();
      for (int m = 0; m < 3; ++m) {
        const bool last = m == 2;
        sm.set_requires_gradient_sync(last);
        settings(sm, last);
        engine::sharded_micro_batch(model, sm, engine::make_batch(c, s * 3 + m, comm.rank(), 1));
      }
    }
    measured[r] = device.stats().peak_bytes;
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(planned[static_cast<std::size_t>(r)] == measured[static_cast<std::size_t>(r)]);
    CHECK(planned_fixed[static_cast<std::size_t>(r)] != measured[static_cast<std::size_t>(r)]);  // the settings matter here
  }
}

TEST_CASE("the timeline: every allocation and free in order, adding up to the peak and the steady bytes") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::OffloadParams>(model, comm, device, engine::Wrap{});
    const fsdp::MemoryPlan p = fsdp::plan(sm, {.steps = 2});
    REQUIRE(!p.timeline.empty());
    std::array<std::int64_t, 2> live{};
    std::array<std::size_t, 2> max{};
    int step = 0;
    bool named_prefetch = false;
    for (const auto& e : p.timeline) {
      const auto k = static_cast<std::size_t>(e.space);
      live[k] += e.delta;
      CHECK(live[k] >= 0);
      CHECK(static_cast<std::size_t>(live[k]) == e.live[k]);
      max[k] = std::max(max[k], e.live[k]);
      CHECK(e.step >= step);  // in order: setup (0), then step 1, 2
      step = e.step;
      if (e.step == 0) CHECK(e.phase == "setup");
      CHECK(!e.unit.empty());  // no engine state given: every byte is a unit's
      named_prefetch = named_prefetch || e.phase.find(" of '") != std::string::npos;
    }
    CHECK(step == 2);
    CHECK(max[0] == p.peak_bytes());
    CHECK(max[1] == p.peak_bytes(fsdp::MemorySpace::host));
    CHECK(static_cast<std::size_t>(live[0]) == p.steady[0]);
    CHECK(static_cast<std::size_t>(live[1]) == p.steady[1]);
    CHECK(p.steady[1] > 0);  // the offloaded shards
    CHECK(named_prefetch);   // BackwardPre (the default) prefetches: another unit's hook allocates
    CHECK(fsdp::plan(sm, {.timeline = false}).timeline.empty());
  });
}

}  // namespace core_memory_plan_test

namespace core_memory_plan_test {

TEST_CASE("on one rank a persistence threshold other than the model's is refused by what it changes") {
  // One rank: a unit kept whole and a sharded one hold shards of the same size, so only
  // whether it was kept tells the thresholds apart (units of 120, 202 and 13 elements).
  using test_support::contains;
  using test_support::error_of;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.persistence_threshold = 1000});
    CHECK(fsdp::plan(sm).peak_bytes() > 0);  // read from the model: right
    const std::string error = error_of([&] { fsdp::plan<fsdp::FullShard>(sm); });
    CAPTURE(error);
    CHECK(contains(error, "unit '<root>' on rank 0: is kept whole where the plan shards it under the persistence threshold 0"));
    CHECK(fsdp::plan<fsdp::FullShard>(sm, {.persistence_threshold = 1000}).peak_bytes() == fsdp::plan(sm).peak_bytes());
  });
}

TEST_CASE("the planning device reports the model's device: a summon's gradients go through device buffers on CUDA") {
  // With with_grads, each flat gradient is gathered into host memory: straight on a host
  // device when nothing is padded, through a shard-sized and a full-sized device buffer
  // on CUDA (two allocations and two frees more per flat parameter).
  const std::vector<fsdp::PlannedUnit> units{{"", {{fsdp::DType::f32, 16}}, {}}};
  auto summon_events = [&](fsdp::DeviceId device) {
    const auto p = fsdp::plan<fsdp::FullShard>(units, {.mesh = {1, 2}, .summon = fsdp::SummonOptions{.with_grads = true},
                                                       .device = device});
    std::vector<std::int64_t> deltas;
    for (const auto& e : p.timeline)
      if (e.phase == "summon_full_params") deltas.push_back(e.delta);
    return deltas;
  };
  const auto host = summon_events({fsdp::DeviceKind::cpu, 0});
  const auto cuda = summon_events({fsdp::DeviceKind::cuda, 0});
  CHECK(cuda.size() == host.size() + 4);
  CHECK(std::count(cuda.begin(), cuda.end(), 8 * 4) == std::count(host.begin(), host.end(), 8 * 4) + 1);  // S: 8 of 16 elements
}

}  // namespace core_memory_plan_test
