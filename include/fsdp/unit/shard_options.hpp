#pragma once
// fsdp::ShardOptions: the options of sharding, one struct for fsdp::shard (which applies
// them to every unit it builds) and for a unit built by hand (fsdp::Sharded's constructor):
// what of a module's subtree is left out, what happens to the parameters taken over
// (synchronised from rank 0, kept unsharded when tiny, taken over later), and what the
// engine's gradients are over its local batch. Its values are checked where a unit's
// construction first reads them (check_shard_options, called by set_up_unit): a negative
// threshold is refused, naming the option, not read as 0.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/unit/detail/deferred_storage.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/policy/reshard_settings.hpp"

namespace fsdp {

struct ShardOptions {
  // Broadcast rank 0's parameters and buffers to every rank first (FSDP's
  // sync_module_states): ranks that initialised differently then start the same.
  bool sync_module_states = false;
  // FSDP's ignored_modules / ignored_states: left out of the unit (with fsdp::shard: out of
  // every unit), so never sharded, gathered, cast or reduced; the engine's tensors keep
  // their storage and values, their gradients stay this rank's own, and the engine steps
  // (and, if it wants, all-reduces) them itself. Modules with their subtrees, at any depth
  // (ModuleId::of(m)); parameters by the address of the engine's tensor. Built by hand,
  // a parent unit lists here the children that are units of their own (manual nesting:
  // build the child's unit first), so it takes what is left.
  std::vector<ModuleId> ignored_modules = {};
  std::vector<const void*> ignored_parameters = {};
  // DeepSpeed's stage3_param_persistence_threshold: a unit with fewer parameter elements
  // than this keeps them unsharded: whole on every rank, never all-gathered, their
  // gradients all-reduced over the world (as NoShard does), so tiny units (norms, biases)
  // cost no all-gather latency. 0: every unit follows its strategy.
  std::int64_t persistence_threshold = 0;
  // Leave the engine's tensors alone until ShardedModel::take_over() takes over every unit
  // of the model as one, on every rank together (all or none: a failure on any rank gives
  // every tensor back on every rank). fsdp::shard builds every unit this way anyway and then
  // takes them over, unless this is set: then the returned model's take_over() is the
  // engine's to call, on every rank. A unit built by hand with it set
  // is taken over by its model's take_over(), after ShardedModel::add. Until then the unit
  // refuses its hooks (but zero_grad and finish_backward), reshard, summon and a
  // post-accumulate-grad hook, naming itself: its tensors are still the engine's.
  bool defer_take_over = false;
  // What the engine's gradients are over this rank's local batch, and so what a synchronized
  // reduction divides the gradient summed over ranks by (fsdp/policy/reshard_settings.hpp):
  // mean (the default; the loss is a mean over the local batch): by the world size, every
  // rank holding a shard or a replica (the hybrid strategies' shard group times replicate
  // group), so the optimizer sees the gradient of the global batch's mean; sum (the loss is
  // a sum, as mlpack's gradients are): by 1, so the optimizer sees the gradient of the
  // global batch's sum, as the engine unsharded would. For every strategy, units kept
  // unsharded by persistence_threshold, gradient accumulation and every precision. A
  // unit's set_gradient_divide_factor overrides it. Every rank must choose alike (checked
  // when the unit is built). docs/training_loop.md#what-the-engines-gradients-mean.
  LocalGradients local_gradients = LocalGradients::mean;
  // How each flat parameter is cut into shards (fsdp/core/flat_param.hpp): element_flat()
  // (the default: parameters back to back, any element a boundary); block_aligned(K):
  // every parameter starts on a multiple of K elements and every shard holds a multiple of
  // K, so no K-element block of a parameter is split between ranks (a block format's
  // scales, CommPrecision<Int8Blocks<K>>, then each cover one parameter's elements), for
  // fewer than K padding elements per parameter plus the rounding of the shard; or
  // param_atomic(K): each parameter whole on one rank (matrix optimizers such as Muon),
  // the ranks balanced greedily, the shard the largest rank's load.
  // Units whose parameters are replicated (NoShard, persistence_threshold) are not cut.
  // Every rank must choose alike (checked when the unit is built).
  ShardLayout shard_layout = ShardLayout::element_flat();
};

namespace detail {
// Refuses option values that mean nothing, naming the option, the unit and the rank.
inline void check_shard_options(const ShardOptions& options, std::string_view unit, int rank) {
  if (options.persistence_threshold < 0)
    fail("unit '", unit, "' on rank ", rank, ": ShardOptions::persistence_threshold must be >= 0 (0: every unit follows "
         "its strategy), got ", options.persistence_threshold);
  check_shard_layout(options.shard_layout, "unit '" + std::string(unit) + "' on rank " + std::to_string(rank) +
                                               ": ShardOptions::shard_layout");
  if (options.local_gradients != LocalGradients::mean && options.local_gradients != LocalGradients::sum)
    fail("unit '", unit, "' on rank ", rank, ": ShardOptions::local_gradients must be LocalGradients::mean or ",
         "LocalGradients::sum, got the value ", static_cast<int>(options.local_gradients));
}

// A unit's part of a deferred init (fsdp/model/deferred_init.hpp), which fsdp::shard hands
// to each unit it builds: parameters without storage are bound to zeroed storage of the
// unit's, `init` fills them (it gets their tensors' addresses), the unit copies its shard
// and frees that storage. Empty: such parameters are an error.
struct UnitInit {
  InitCallback init = {};
  bool check_agrees = false;  // then hash every parameter and fail if ranks differ
};
}  // namespace detail

}  // namespace fsdp
