// fsdp::plan: the per-rank peak predicted before the first step equals, to the byte, the
// peak the Device counts over the steps that follow, per memory space, for every strategy,
// prefetch mode, precision and offload, on the reference model (units of three sizes,
// none a multiple of the rank count: padding everywhere). What the planner cannot model
// is refused.
#include <doctest/doctest.h>

#include <fsdp/async_communicator.hpp>
#include <fsdp/memory_plan.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"

namespace {

engine::ModelConfig config() {
  engine::ModelConfig c;  // root 5x13+13+13x3+3 = 120, blocks 13x7+7+7x13+13 = 202, gain 13
  c.blocks = 3;
  return c;
}

struct Run {
  bool async = false;
  int limit = 2;
  std::int64_t threshold = 0;
  int steps = 3;
  bool adamw = true;
};

struct Outcome {
  std::vector<fsdp::MemoryStats> device, host;
  std::vector<fsdp::MemoryPlan> plan;
};

// Plans, then trains `run.steps` steps (AdamW state through the same Device, counted in
// the plan as the engine's), on every rank of a `shape` mesh.
template <class... Ps>
Outcome train_and_plan(fsdp::MeshShape shape, Run run) {
  const auto c = config();
  const int world = shape.size();
  Outcome out{std::vector<fsdp::MemoryStats>(world), std::vector<fsdp::MemoryStats>(world), std::vector<fsdp::MemoryPlan>(world)};
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    fsdp::AsyncCommunicator stream(comm);
    auto go = [&](auto& communicator) {
      fsdp::DeviceMesh mesh(communicator, shape);
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<Ps...>(model, mesh, device, engine::Wrap{}, fsdp::ShardOptions{.persistence_threshold = run.threshold});
      sm.set_max_prefetched_units(run.limit);
      constexpr bool offload = fsdp::Policies<Ps...>::cpu_offload::offload;
      const auto space = offload ? fsdp::MemorySpace::host : fsdp::MemorySpace::device;
      fsdp::PlanOptions options;
      options.asynchronous = run.async;
      options.persistence_threshold = run.threshold;
      options.steps = run.steps;
      if (run.adamw)  // two f32 moments per element of each shard this rank steps
        for (const auto& v : sm.shards()) options.engine_state[static_cast<std::size_t>(space)] += 2 * 4 * static_cast<std::size_t>(v.numel);
      out.plan[comm.rank()] = fsdp::plan<Ps...>(sm, options);
      engine::DeviceAllocator<fsdp::HostDevice> alloc(device, space);
      engine::AdamW adamw({}, alloc);
      engine::Sgd sgd(0.01f);
      for (int s = 0; s < run.steps; ++s) {
        const auto batch = engine::make_batch(c, s, comm.rank(), 1);
        if (run.adamw) engine::sharded_step(model, sm, adamw, batch);
        else engine::sharded_step(model, sm, sgd, batch);
      }
      out.device[comm.rank()] = device.stats(fsdp::MemorySpace::device);
      out.host[comm.rank()] = device.stats(fsdp::MemorySpace::host);
    };
    if (run.async) go(stream);
    else go(comm);
  });
  return out;
}

template <class... Ps>
void check_plan(fsdp::MeshShape shape, Run run = {}) {
  CAPTURE(shape.str());
  CAPTURE(run.async);
  CAPTURE(run.limit);
  CAPTURE(run.threshold);
  const Outcome o = train_and_plan<Ps...>(shape, run);
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    CAPTURE(o.plan[r].describe());
    CHECK(o.plan[r].peak_bytes(fsdp::MemorySpace::device) == o.device[r].peak_bytes);
    CHECK(o.plan[r].peak_bytes(fsdp::MemorySpace::host) == o.host[r].peak_bytes);
    CHECK(o.plan[r].steady[0] == o.device[r].live_bytes);
    CHECK(o.plan[r].steady[1] == o.host[r].live_bytes);
  }
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

template <class... Ps>
void check_precisions_and_offload(fsdp::MeshShape shape, Run run = {}) {
  check_prefetch_modes<Ps...>(shape, run);
  check_prefetch_modes<Ps..., fsdp::MixedPrecision<fsdp::bf16>>(shape, run);
  check_prefetch_modes<Ps..., fsdp::OffloadParams>(shape, run);
  check_prefetch_modes<Ps..., fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>(shape, run);
}

}  // namespace

TEST_CASE("FullShard: plan == measured peak, every prefetch mode x precision x offload") {
  for (int world : {2, 3}) check_precisions_and_offload<fsdp::FullShard>({1, world});
}

TEST_CASE("ShardGradOp: plan == measured peak, every prefetch mode x precision x offload") {
  check_precisions_and_offload<fsdp::ShardGradOp>({1, 3});
}

TEST_CASE("NoShard: plan == measured peak, every prefetch mode x precision x offload") {
  check_precisions_and_offload<fsdp::NoShard>({1, 2});
}

TEST_CASE("HybridShard and HybridShardZero2: plan == measured peak") {
  check_precisions_and_offload<fsdp::HybridShard>({2, 2});
  check_prefetch_modes<fsdp::HybridShardZero2>({2, 3});
}
