#pragma once
// fsdp::UnitOptions: how one unit (fsdp::Sharded) is built: its name in the model, what of
// its module's subtree it leaves out, and what happens to the parameters it takes over
// (synchronised from rank 0, initialised late, kept unsharded when tiny).
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/unit/detail/deferred_storage.hpp"
#include "fsdp/core/module.hpp"

namespace fsdp {

struct UnitOptions {
  std::string fqn;  // the module's FQN within the model ("" for the root): names parameters
  // Broadcast rank 0's parameters and buffers to every rank at construction, as FSDP's
  // sync_module_states does: ranks that initialised differently then start the same.
  bool sync_module_states = false;
  // Leave the engine's tensors alone until the model takes them over with its other units
  // (ShardedModel::take_over(), after add(); fsdp::shard builds every unit first).
  bool defer_take_over = false;
  // Parts of the module's subtree (at any depth) this unit leaves out, with the names
  // ShardOptions and FSDP use: modules that are units of their own (manual nesting: build
  // the child's unit, then the parent's with the child listed here, so the parent takes
  // what is left) and modules no unit manages; and parameters (the engine's parameter
  // tensors, by address). Nothing in this unit manages what is listed.
  std::vector<ModuleId> ignored_modules = {};
  std::vector<const void*> ignored_parameters = {};
  // Deferred init (fsdp::deferred_init sets it for fsdp::shard): parameters without storage
  // are bound to zeroed storage of the unit's, `init` fills them (it gets their tensors'
  // addresses), the unit copies its shard and frees that storage. Empty: they are an error.
  detail::InitCallback init = {};
  bool check_init_agrees = false;  // then hash every parameter and fail if ranks differ
  // A unit with fewer parameter elements than this keeps them unsharded: whole on every
  // rank, never all-gathered, their gradients all-reduced over the world (as NoShard does),
  // so tiny units (norms, biases) cost no all-gather latency. Its groups() still name the
  // model's groups. 0: every unit follows its strategy.
  std::int64_t persistence_threshold = 0;
};

}  // namespace fsdp
