#pragma once
// Helpers shared by the tests that train the reference engine: the unsharded reference
// run, sharded SGD and AdamW runs, comparisons of full parameters, and the engine model's
// unit sizes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "test/support/full_params.hpp"

namespace test_support {

// `steps` AdamW steps of the unsharded model on global batches of `global_batch` samples.
inline Params reference_params(const engine::ModelConfig& c, int steps, int global_batch) {
  engine::Model model(c);
  engine::AdamW opt({});
  for (int s = 0; s < steps; ++s) engine::unsharded_step(model, opt, engine::make_batch(c, s, 0, global_batch));
  Params p;
  for (auto& np : engine::named_parameters(model))
    p.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  return p;
}

// Largest absolute difference; infinity when names or sizes differ.
inline double max_difference(const Params& a, const Params& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.size() != b[i].second.size()) return INFINITY;
    for (std::size_t k = 0; k < a[i].second.size(); ++k)
      worst = std::max(worst, std::fabs(double(a[i].second[k]) - b[i].second[k]));
  }
  return worst;
}

// Element counts of the reference model's units, in forward order: the root (embed +
// head), the blocks, the gain.
inline std::vector<std::int64_t> unit_numels(const engine::ModelConfig& c) {
  std::vector<std::int64_t> u{c.in * c.dim + c.dim + c.dim * c.out + c.out};
  for (int i = 0; i < c.blocks; ++i) u.push_back(c.dim * c.hidden + c.hidden + c.hidden * c.dim + c.dim);
  u.push_back(c.dim);
  return u;
}

// Trains the reference model sharded with Ps on `world` thread ranks, `steps` SGD steps
// (SGD: its update is proportional to the gradient, so a collective that rounds shows):
// the global (mean over the ranks) loss of each step, and the full parameters after
// (every rank must gather the same).
struct SgdRun {
  Params params;
  std::vector<double> losses;
};
template <class... Ps>
SgdRun sgd_run(const engine::ModelConfig& c, int world, int steps) {
  std::vector<Params> per_rank(world);
  SgdRun run;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < steps; ++s) {
      double local = engine::sharded_step(model, sm, sgd, engine::make_batch(c, s, comm.rank(), 1)), global = 0;
      comm.all_reduce(&local, &global, 1, fsdp::DType::f64, fsdp::ReduceOp::avg).wait();
      if (comm.rank() == 0) run.losses.push_back(global);
    }
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r)
    if (per_rank[r] != per_rank[0]) fsdp::detail::fail("sgd_run: rank ", r, " gathered other parameters than rank 0");
  run.params = per_rank[0];
  return run;
}

// AdamW steps [first, last) of the reference model (`c`, its seed among them) sharded with
// Ps and `options` on `world` thread ranks, over a `mesh` mesh ({1, world} when left
// empty), on global batches of `global_batch` samples; `before` runs first (a load),
// `after` last (a save). Returns the full parameters, which every rank must gather alike.
using AdamwHook = std::function<void(fsdp::ShardedModel&, engine::AdamWState&)>;
struct AdamwRun {
  int world = 1, first = 0, last = 0, global_batch = 12;
  fsdp::ShardOptions options = {};
  AdamwHook before = {}, after = {};
  fsdp::MeshShape mesh = {};
};
template <class... Ps>
Params adamw_run(const engine::ModelConfig& c, const AdamwRun& run) {
  std::vector<Params> out(static_cast<std::size_t>(run.world));
  fsdp::ThreadGroup(run.world).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh mesh(comm, run.mesh.size() == run.world ? run.mesh : fsdp::MeshShape{1, run.world});
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, mesh, device, engine::Wrap{}, run.options);
    constexpr bool offloaded = fsdp::Policies<Ps...>::cpu_offload::offload;
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device, offloaded ? fsdp::MemorySpace::host : fsdp::MemorySpace::device);
    engine::AdamW opt({}, alloc);
    engine::AdamWState state(opt, sm);
    if (run.before) run.before(sm, state);
    const int local = run.global_batch / run.world;
    for (int s = run.first; s < run.last; ++s)
      engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
    if (run.after) run.after(sm, state);
    out[static_cast<std::size_t>(comm.rank())] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < run.world; ++r)
    if (out[static_cast<std::size_t>(r)] != out[0]) fsdp::detail::fail("adamw_run: rank ", r, " gathered other parameters than rank 0");
  return out[0];
}

// One step's collectives on rank 0 of `world` thread ranks, after a first step (so the
// execution order is known), the reference model sharded with Ps and `wrap`: parameters
// and gradients only (ThreadComm checks the order with tags, no collective).
template <class... Ps, class WrapPolicy = engine::Wrap>
fsdp::CollectiveCounts step_collectives(const engine::ModelConfig& c, int world, WrapPolicy wrap = {}) {
  fsdp::CollectiveCounts counts;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    fsdp::CountingCommunicator<fsdp::ThreadComm> counted(comm);
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, counted, device, wrap);
    engine::Sgd sgd(0.01f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    counted.reset();
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 1, comm.rank(), 1));
    if (comm.rank() == 0) counts = counted.counts();
  });
  return counts;
}

// The reference engine sharded over `comm` with the policies Ps: over a mesh of `shape`
// built into `mesh` when the strategy (the first policy) is hybrid, else over `comm` itself.
template <class Strategy, class... Ps, class C>
fsdp::ShardedModel shard_engine(engine::Model& model, C& comm, std::optional<fsdp::DeviceMesh<C>>& mesh,
                                fsdp::MeshShape shape, fsdp::HostDevice& device) {
  if constexpr (Strategy::hybrid) {
    mesh.emplace(comm, shape);
    return fsdp::shard<Strategy, Ps...>(model, *mesh, device, engine::Wrap{});
  } else {
    return fsdp::shard<Strategy, Ps...>(model, comm, device, engine::Wrap{});
  }
}

}  // namespace test_support
