#pragma once
// fsdp::plan: the per-rank peak bytes of training, per memory space, before any step.
//
// The planner replays what the library allocates and frees through its Device during
// setup and training steps (fsdp/model/detail/memory_simulation.hpp): each unit's shards and
// sharded gradients, the unsharded parameters of each all-gather (with the prefetch mode
// and limit, each unit's reshard-after-forward (partial too), the unit backward starts with keeping
// its parameters), the unsharded gradients, the reduction buffers and precision casts,
// offloaded shards in host space, MixedPrecision's buffer copies. What it needs: each
// unit's flat parameters (dtype and element count), its floating buffers, its nesting
// (FQNs) and forward order, the policies, the mesh, the prefetch limit, and whether the
// communicator is asynchronous (then one reduction stays in flight). It takes them from a
// ShardedModel (so the plan is of the very units the steps will run) or from a list of
// units, without building anything.
//
// The engine's own memory (activations, the model's tensors, optimizer state) is the
// engine's; the plan counts the library's bytes, plus what PlanOptions::engine_state
// says the engine allocates through the same Device after its first step and keeps.
//
// Assumed, per step: zero_grad, then for each of PlanOptions::micro_batches: one forward
// (units entered in `forward_order`, nested by FQN), one backward (the mirror: a unit's
// backward starts before, and ends after, those of the units nested in it, which run in
// reverse forward order), finish_backward; all micro-batches but the last with gradient
// sync off (ShardedModel::no_sync), each unit accumulating in its GradientSyncMode, or
// (PlanOptions::defer_all_reduce) with the replicate all-reduce deferred instead, each
// unit keeping its parameters between them if its reshard_after_backward is off. A unit's
// post-accumulate-grad hook (optimizer in backward) runs as its final reduction completes;
// GradientAfterHook::free then frees its sharded gradient until the next reduction.
// Explicit prefetch lists gather their units at the listing unit's pre_forward /
// pre_backward from the first pass on.
//
// Refused (an fsdp::Error): a model planned with gradient sync or the replicate all-reduce
// off (plan between steps), and a model whose views do not match the given policies, mesh
// or persistence threshold. Not modeled, so not to be planned with: summon_full_params,
// state dicts and checkpoints, deferred init's temporaries, sync_module_states, the fp16
// grad scaler, a forward-only pass (evaluation), a forward order that changes from step to
// step, a unit used twice per pass, sync off for some units only, and settings changed
// between micro-batches (each unit is planned with those it has when planned).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/model/detail/memory_simulation.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/model/sharded_model.hpp"

namespace fsdp {

// One unit as the planner needs it: its flat parameters (one per dtype, in order) and buffers.
struct PlannedUnit {
  std::string fqn;  // "" for the root; nesting is read from FQNs ("blocks.0" lies in "")
  struct Flat {
    DType dtype = DType::f32;
    std::int64_t numel = 0;  // parameter elements (a tied tensor once)
  };
  std::vector<Flat> flat;
  struct Buffer {
    DType dtype = DType::f32;
    std::int64_t numel = 0;
  };
  std::vector<Buffer> buffers;
  // Its ReshardSettings: reshard after forward (nullopt: its strategy's), and over how many
  // ranks a partial reshard keeps the parameters (0: none; else a divisor of the shard
  // group strictly between 1 and its size). Units whose parameters are not sharded ignore both.
  std::optional<bool> reshard_after_forward = std::nullopt;
  int post_forward_ranks = 0;
  // Gradient accumulation (PlanOptions::micro_batches > 1): what its backwards with sync
  // off do (set_gradient_sync_mode), and whether its parameters are freed after each
  // backward (set_reshard_after_backward; off: kept until the next forward).
  GradientSyncMode accumulation = GradientSyncMode::keep_unsharded;
  bool reshard_after_backward = true;
  // Its post-accumulate-grad hook (set_post_accumulate_grad_hook), if any: what it does
  // with the sharded gradient after running.
  std::optional<GradientAfterHook> post_accumulate_grad_hook = std::nullopt;
  // Explicit prefetch lists (set_forward_prefetch / set_backward_prefetch), by unit FQN.
  std::vector<std::string> forward_prefetch = {}, backward_prefetch = {};
};

struct PlanOptions {
  MeshShape mesh{};  // {replicate, shard}; from a ShardedModel, read from its units
  int max_prefetched = 2;  // ShardedModel::set_max_prefetched_units; from a ShardedModel, its own
  // The communicator returns pending Work (AsyncCommunicator, NCCL): each unit's reduction
  // overlaps the next unit's backward, so its buffers live one unit longer.
  bool asynchronous = false;
  std::int64_t persistence_threshold = 0;  // ShardOptions::persistence_threshold
  int steps = 2;  // steps replayed; every step after the second repeats the second
  // Forward and backward passes per step (gradient accumulation), all but the last under
  // no_sync, each ending with finish_backward.
  int micro_batches = 1;
  // Those passes run with set_requires_all_reduce(false) instead of no_sync (HSDP: each
  // reduce-scatters inside its shard group, the sums wait for the last pass's all-reduce).
  bool defer_all_reduce = false;
  // What the engine allocates through the same Device at the end of the first step and
  // keeps, per space (device, host): its optimizer state. Zero: the library's bytes only.
  std::array<std::size_t, 2> engine_state{};
  // What the engine allocates through the same Device in a unit's first post-accumulate-grad
  // hook and keeps, per space, by unit FQN ("" for the root): an optimizer stepping in
  // backward creates its state there.
  std::map<std::string, std::array<std::size_t, 2>, std::less<>> engine_state_in_hook = {};
  // Unit FQNs in the order forward enters them; empty: the units' order (fsdp::shard's
  // depth-first order, which is the forward order of a model that runs its children in
  // visit order).
  std::vector<std::string> forward_order = {};
};

struct MemoryPlan {
  struct Peak {
    std::size_t bytes = 0;
    std::string unit;   // the unit whose allocation reached it ("<root>" for the root; "" for the engine's state)
    std::string phase;  // setup, forward, backward (gradient), backward (reduction), ... (prefetch)
    int step = 0;       // 1-based; 0: setup
  };
  std::array<Peak, 2> peaks;          // per MemorySpace
  std::array<std::size_t, 2> steady{};  // live between steps (after the last one replayed)

  std::size_t peak_bytes(MemorySpace s = MemorySpace::device) const { return peaks[static_cast<std::size_t>(s)].bytes; }
  const Peak& peak(MemorySpace s = MemorySpace::device) const { return peaks[static_cast<std::size_t>(s)]; }
  // "device: peak 123 B at unit 'blocks.2', backward (gradient), step 2; host: ..."
  std::string describe() const {
    std::ostringstream os;
    for (MemorySpace s : {MemorySpace::device, MemorySpace::host}) {
      const Peak& p = peak(s);
      os << (s == MemorySpace::device ? "device: peak " : "; host: peak ") << p.bytes << " B";
      if (p.step == 0) os << " at setup";
      else os << " at " << (p.unit.empty() ? std::string("the engine's state") : "unit '" + p.unit + "'") << ", " << p.phase
              << ", step " << p.step;
    }
    return os.str();
  }
};

namespace detail {

inline bool nests_in(const std::string& outer, const std::string& inner) {
  if (outer == inner) return false;
  return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 && inner[outer.size()] == '.');
}

inline std::string display(const std::string& fqn) { return fqn.empty() ? "<root>" : fqn; }

// The plan for policies read as values: compiled once per translation unit, however many
// policy configurations it plans (fsdp::plan<Ps...> below only converts them).
inline MemoryPlan plan_for(const PolicyConfig& policy, const std::vector<PlannedUnit>& units, const PlanOptions& options) {
  const MeshShape m = options.mesh;
  if (m.replicate < 1 || m.shard < 1) detail::fail("fsdp::plan: the mesh ", m.str(), " has no ranks; set PlanOptions::mesh");
  if (options.max_prefetched < 0) detail::fail("fsdp::plan: the prefetch limit must be >= 0, got ", options.max_prefetched);
  if (options.steps < 1) detail::fail("fsdp::plan: steps must be >= 1, got ", options.steps);
  if (options.micro_batches < 1) detail::fail("fsdp::plan: micro_batches must be >= 1, got ", options.micro_batches);
  if (units.empty()) detail::fail("fsdp::plan: no units");
  // The groups a unit uses (detail::UnitGroups): hybrid strategies shard inside the mesh's
  // shard dimension, the others across (FullShard) or over (NoShard) the whole world.
  const int world = m.size();
  const int shard = policy.hybrid ? m.shard : policy.shards_parameters ? world : 1;
  std::map<std::string_view, int> index;  // by FQN
  for (std::size_t i = 0; i < units.size(); ++i)
    if (!index.emplace(units[i].fqn, static_cast<int>(i)).second)
      detail::fail("fsdp::plan: two units named '", detail::display(units[i].fqn), "'");
  auto index_of = [&](const std::string& fqn, auto&&... what) {
    const auto it = index.find(fqn);
    if (it == index.end()) detail::fail("fsdp::plan: ", what..., " names '", detail::display(fqn), "', which is no unit");
    return it->second;
  };
  std::vector<detail::SimUnit> sim(units.size());
  for (std::size_t i = 0; i < units.size(); ++i) {
    auto& s = sim[i];
    const std::string name = detail::display(units[i].fqn);
    std::int64_t elements = 0;
    for (const auto& f : units[i].flat) {
      if (f.numel < 0) detail::fail("fsdp::plan: unit '", name, "' has a flat parameter of ", f.numel, " elements");
      s.flat.push_back({f.dtype, f.numel});
      elements += f.numel;
    }
    for (const auto& b : units[i].buffers) s.buffers.push_back({b.dtype, b.numel});
    s.kept_unsharded = detail::kept_unsharded_by_threshold(policy.shards_parameters, elements, options.persistence_threshold);
    s.reshard_after_forward = units[i].reshard_after_forward.value_or(policy.reshard_after_forward);
    const int k = units[i].post_forward_ranks;
    if (k != 0 && (k <= 1 || k >= shard || shard % k != 0))
      detail::fail("fsdp::plan: unit '", name, "' reshards after forward to groups of ", k, " ranks, which must divide the ",
                   shard, " ranks of its shard group and lie strictly between 1 and ", shard);
    if (policy.shards_parameters && !s.kept_unsharded) s.post_forward_ranks = k;
    s.reshard_after_backward = units[i].reshard_after_backward;
    s.accumulation = units[i].accumulation;
    s.hook = units[i].post_accumulate_grad_hook;
    for (const auto& f : units[i].forward_prefetch) s.forward_prefetch.push_back(index_of(f, "unit '", name, "''s forward prefetch"));
    for (const auto& f : units[i].backward_prefetch) s.backward_prefetch.push_back(index_of(f, "unit '", name, "''s backward prefetch"));
  }
  for (const auto& [fqn, bytes] : options.engine_state_in_hook) {
    auto& s = sim[static_cast<std::size_t>(index_of(fqn, "engine_state_in_hook"))];
    if (!s.hook) detail::fail("fsdp::plan: engine_state_in_hook names unit '", detail::display(fqn), "', which has no post-accumulate-grad hook");
    s.hook_engine_state = bytes;
  }
  // Forward order, then nesting: each unit's parent is the innermost open unit holding it.
  std::vector<int> forward;
  if (options.forward_order.empty()) {
    for (std::size_t i = 0; i < units.size(); ++i) forward.push_back(static_cast<int>(i));
  } else {
    for (const auto& name : options.forward_order) {
      const int found = index_of(name, "forward_order");
      if (std::find(forward.begin(), forward.end(), found) != forward.end())
        detail::fail("fsdp::plan: forward_order names '", detail::display(name), "' twice (a unit used twice per pass is not planned)");
      forward.push_back(found);
    }
    if (forward.size() != units.size()) detail::fail("fsdp::plan: forward_order names ", forward.size(), " of the ", units.size(), " units");
  }
  std::vector<int> tops, open;
  for (int u : forward) {
    while (!open.empty() && !detail::nests_in(units[static_cast<std::size_t>(open.back())].fqn, units[static_cast<std::size_t>(u)].fqn))
      open.pop_back();
    if (open.empty()) tops.push_back(u);
    else sim[static_cast<std::size_t>(open.back())].children.push_back(u);
    open.push_back(u);
  }
  detail::MemorySimulation replay(policy, shard, world, std::move(sim), std::move(forward), std::move(tops), options.max_prefetched,
                                  options.asynchronous, {options.micro_batches, options.defer_all_reduce, m.replicate});
  replay.setup();
  for (int s = 0; s < options.steps; ++s) {
    replay.step();
    if (s == 0)
      for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
        if (options.engine_state[static_cast<std::size_t>(space)])
          replay.engine_state(options.engine_state[static_cast<std::size_t>(space)], space);
  }
  MemoryPlan out;
  for (MemorySpace space : {MemorySpace::device, MemorySpace::host}) {
    const auto& p = replay.peak(space);
    const auto k = static_cast<std::size_t>(space);
    out.peaks[k] = {p.bytes, p.unit >= 0 ? detail::display(units[static_cast<std::size_t>(p.unit)].fqn) : std::string(), p.phase,
                    p.step};
    out.steady[k] = replay.live(space);
  }
  return out;
}

// fsdp::planned_units for policies read as values: a ShardedModel's units as the planner
// needs them, read from the units' public views and checked against the policies, so that
// a plan made with other policies than the model's is refused rather than wrong.
inline std::vector<PlannedUnit> planned_units_for(const PolicyConfig& policy, ShardedModel& model, PlanOptions& options) {
  if (model.size() == 0) detail::fail("fsdp::plan: the model has no units");
  options.mesh = fsdp::detail::internals(model[0]).mesh_shape();  // every unit of a model uses the same groups
  options.max_prefetched = model.execution_order().max_prefetched;
  const int shard = options.mesh.shard;
  const int shard_size = policy.hybrid ? shard : policy.shards_parameters ? options.mesh.size() : 1;
  if (shard_size != shard)
    detail::fail("fsdp::plan: the model uses a ", fsdp::detail::internals(model[0]).groups(), ", which its policies' strategy would not: plan with the "
                 "policies given to fsdp::shard");

  std::vector<PlannedUnit> out;
  for (auto& unit : model) {
    const Unit& u = *unit;
    const UnitConfig config = u.config();
    const std::string name(u.display_name());
    auto refuse = [&](const std::string& why) {
      detail::fail("fsdp::plan: unit '", name, "' on rank ", u.rank(), ": ", why);
    };
    if (!config.sync.requires_sync)
      refuse("has gradient sync off; plan between steps, with sync on, and give the micro-batches per step in "
             "PlanOptions::micro_batches");
    if (!config.sync.requires_all_reduce)
      refuse("has the replicate all-reduce off; plan between steps, with it on, and set PlanOptions::defer_all_reduce "
             "and micro_batches");
    if (u.state() != TrainingState::IDLE) refuse("is not IDLE; plan between steps");
    PlannedUnit p;
    p.fqn = u.fqn();
    const auto shards = u.shards();
    p.flat.resize(shards.size());
    for (std::size_t k = 0; k < shards.size(); ++k) p.flat[k].dtype = shards[k].dtype;
    for (const ParamView& v : u.parameters()) p.flat.at(v.shard).numel += v.numel;
    for (const BufferView& b : u.buffers()) p.buffers.push_back({b.dtype, b.numel});
    p.reshard_after_forward = config.reshard.after_forward;
    p.post_forward_ranks = config.reshard.post_forward_ranks;
    p.reshard_after_backward = config.reshard.after_backward;
    p.accumulation = config.sync.mode;
    if (config.post_accumulate_grad_hook) p.post_accumulate_grad_hook = config.after_hook;
    p.forward_prefetch = config.forward_prefetch;
    p.backward_prefetch = config.backward_prefetch;
    // What the unit holds must be what these policies (and threshold) would give it.
    std::int64_t elements = 0;
    for (const auto& f : p.flat) elements += f.numel;
    const bool kept = detail::kept_unsharded_by_threshold(policy.shards_parameters, elements, options.persistence_threshold);
    const int n = policy.shards_parameters && !kept ? shard : 1;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const ShardView& v = shards[k];
      const std::int64_t want = detail::sim_layout(v.dtype, p.flat[k].numel, n).shard_numel();
      if (v.padded_numel != want)
        refuse("its " + std::string(name_of(v.dtype)) + " shard holds " + std::to_string(v.padded_numel) + " elements where " +
               std::to_string(want) + " are planned (" + (kept ? "kept whole under" : "sharded; is") +
               " the persistence threshold " + std::to_string(options.persistence_threshold) +
               (kept ? ")" : " the one given to fsdp::shard?)"));
      const DType grad = detail::flat_param_dtypes(v.dtype, policy.precision).grad;
      if (v.grad_dtype != grad)
        refuse("its gradient is " + std::string(name_of(v.grad_dtype)) + ", the policies give " + std::string(name_of(grad)) +
               ": plan with the policies given to fsdp::shard");
      if (v.space != (policy.offload ? MemorySpace::host : MemorySpace::device))
        refuse(std::string("its shard is in ") + std::string(fsdp::name_of(v.space)) +
               " space, the policies say otherwise (CpuOffload): plan with the policies given to fsdp::shard");
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace detail

// The plan of units described by hand (nothing built): Ps are the policies fsdp::shard
// would get. options.mesh is required ({1, N} for N ranks without a hybrid strategy).
template <class... Ps>
MemoryPlan plan(const std::vector<PlannedUnit>& units, const PlanOptions& options) {
  return detail::plan_for(policy_config<Policies<Ps...>>(), units, options);
}

// The units of a sharded model as the planner needs them, checked against the policies
// (Ps: those given to fsdp::shard) and options.persistence_threshold; options.mesh and
// max_prefetched are read from the model.
template <class... Ps>
std::vector<PlannedUnit> planned_units(ShardedModel& model, PlanOptions& options) {
  return detail::planned_units_for(policy_config<Policies<Ps...>>(), model, options);
}

// The plan of `model`'s training steps, built before any step (or between steps), checked
// against the policies Ps given to fsdp::shard. fsdp::plan(model) below needs none.
template <class... Ps>
MemoryPlan plan(ShardedModel& model, PlanOptions options = {}) {
  const auto units = planned_units<Ps...>(model, options);
  return plan<Ps...>(units, options);
}

// The plan of `model`'s training steps, from what the model reports of itself
// (ShardedModel::config()): its policies, mesh, prefetch limit and persistence threshold
// are read, not restated; options.mesh, max_prefetched and persistence_threshold are
// overwritten. Every unit must have the same policies and threshold (units built by hand
// with different ones are refused: the planner replays one configuration).
inline MemoryPlan plan(ShardedModel& model, PlanOptions options = {}) {
  if (model.size() == 0) detail::fail("fsdp::plan: the model has no units");
  const ModelConfig config = model.config();
  const UnitConfig& first = config.units.front();
  for (const UnitConfig& u : config.units) {
    if (u.policies != first.policies)
      detail::fail("fsdp::plan: units '", detail::display(first.fqn), "' (", to_string(first.policies), ") and '",
                   detail::display(u.fqn), "' (", to_string(u.policies), ") on rank ", model[0].rank(),
                   " have different policies; the planner replays one configuration");
    if (u.persistence_threshold != first.persistence_threshold)
      detail::fail("fsdp::plan: units '", detail::display(first.fqn), "' and '", detail::display(u.fqn), "' on rank ",
                   model[0].rank(), " have different persistence thresholds (", first.persistence_threshold, " and ",
                   u.persistence_threshold, "); the planner replays one configuration");
  }
  options.persistence_threshold = first.persistence_threshold;
  const auto units = detail::planned_units_for(first.policies, model, options);
  return detail::plan_for(first.policies, units, options);
}

}  // namespace fsdp
