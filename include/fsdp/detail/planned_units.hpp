#pragma once
// fsdp::planned_units (fsdp/memory_plan.hpp): a ShardedModel's units as the
// memory planner needs them, read from the units' public views and checked against the
// policies, so that a plan made with other policies than the model's is refused rather
// than wrong.
#include <string>
#include <vector>

#include "fsdp/memory_plan.hpp"

namespace fsdp::detail {

inline std::vector<PlannedUnit> planned_units_for(const PolicyValues& policy, ShardedModel& model, PlanOptions& options) {
  if (model.size() == 0) detail::fail("fsdp::plan: the model has no units");
  options.mesh = model[0].mesh_shape();  // every unit of a model uses the same groups
  options.max_prefetched = model.execution_order().max_prefetched;
  const int shard = options.mesh.shard;
  const int shard_size = policy.hybrid ? shard : policy.shards_parameters ? options.mesh.size() : 1;
  if (shard_size != shard)
    detail::fail("fsdp::plan: the model uses a ", model[0].groups(), ", which its policies' strategy would not: plan with the "
                 "policies given to fsdp::shard");

  std::vector<PlannedUnit> out;
  for (auto& unit : model) {
    const UnitBase& u = *unit;
    const std::string name(u.display_name());
    auto refuse = [&](const std::string& why) {
      detail::fail("fsdp::plan: unit '", name, "' on rank ", u.rank(), ": ", why);
    };
    if (!u.gradient_sync().requires_sync)
      refuse("has gradient sync off; plan between steps, with sync on, and give the micro-batches per step in "
             "PlanOptions::micro_batches");
    if (!u.gradient_sync().requires_all_reduce)
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
    p.reshard_after_forward = u.reshard_settings().after_forward;
    p.post_forward_ranks = u.reshard_settings().post_forward_ranks;
    p.reshard_after_backward = u.reshard_settings().after_backward;
    p.accumulation = u.gradient_sync().mode;
    if (u.has_post_accumulate_grad_hook()) p.post_accumulate_grad_hook = u.gradient_after_hook();
    for (const UnitBase* v : u.forward_prefetch()) p.forward_prefetch.emplace_back(v->fqn());
    for (const UnitBase* v : u.backward_prefetch()) p.backward_prefetch.emplace_back(v->fqn());
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

}  // namespace fsdp::detail
