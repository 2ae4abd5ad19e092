#pragma once
// The memory planner's replay of one flat parameter's gradient buffers: what
// GradientReduction (fsdp/unit/detail/gradient_reduction.hpp) allocates and frees to bind, keep,
// reduce and accumulate a unit's gradients, counted in the replay's ledger. It mirrors
// that code on purpose, as MemorySimulation (fsdp/model/detail/memory_simulation.hpp) mirrors
// the units' hooks: a change there that moves a byte must change this too, or
// memory_plan_test fails.
#include <utility>

#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/model/detail/simulated_unit.hpp"
#include "fsdp/core/device.hpp"

namespace fsdp::detail {

class SimulatedGradients {
 public:
  SimulatedGradients(SimLedger& ledger, const PolicyConfig& p) : ledger_(ledger), p_(p) {}

  // zero_grad: frees what accumulation kept (nothing once a synchronized backward reduced it).
  void zero_grad(SimFlatState& f) {
    if (f.reduce_in_alive) ledger_.sub(f.padded, f.reduce, MemorySpace::device), f.reduce_in_alive = false;
    if (f.partial_alive) ledger_.sub(f.shard, f.accumulate, MemorySpace::device), f.partial_alive = false;
    release_full_grad(f);
  }

  // bind_gradients: a zeroed unsharded gradient, or the sharded one itself right after
  // zero_grad where the engine accumulates into it (grad_accumulates_in_shard); one a
  // backward with sync off kept is added into.
  void bind(int u, SimFlatState& f, bool grad_is_zero) {
    if (f.full_grad_alive || f.full_grad_alias) return;
    if (f.grad_in_shard && grad_is_zero) ensure_shard_grad(u, f, "backward (gradient)"), f.full_grad_alias = true;
    else ledger_.add(f.padded, f.compute, MemorySpace::device, u, "backward (gradient)"), f.full_grad_alive = true;
  }

  // keep_unsharded: a backward with sync off keeps its gradient in the accumulate dtype.
  void keep(int u, SimFlatState& f) {
    if (f.accumulate != f.compute) to_reduce_dtype(u, f, "backward (accumulation)");
  }

  // start_reduction; `reduces_alone`: UnitGroups::reduces_alone.
  void start(int u, SimFlatState& f, bool reduces_alone, bool grad_is_zero, bool defer) {
    if (casts_into_shard_grad(reduces_alone, f.dtypes(), f.reduce_in_alive, grad_is_zero, defer, p_.offload)) {
      ensure_shard_grad(u, f, "backward (reduction)");
      release_full_grad(f);
    } else if (f.reduce != f.compute) {
      to_reduce_dtype(u, f, "backward (reduction)");
    }
    if (!defer) ensure_shard_grad(u, f, "backward (reduction)");  // where a hook freed it
    f.deferred = defer;
    if (defer && !f.partial_alive && f.accumulate == f.reduce) {  // the first deferred sum is reduced into `partial`
      ledger_.add(f.shard, f.accumulate, MemorySpace::device, u, "backward (reduction)"), f.partial_alive = true;
    } else {
      const bool into_shard_grad = !defer && grad_is_zero && !p_.offload && f.grad == f.reduce;
      if (!into_shard_grad)
        ledger_.add(f.shard, f.reduce, MemorySpace::device, u, "backward (reduction)"), f.reduce_out_alive = true;
    }
    f.reducing = true;
  }

  // finish_reductions, for one flat parameter.
  void finish(int u, SimFlatState& f) {
    if (!f.reducing) return;
    f.reducing = false;
    if (f.deferred) {  // the sum waits in `partial` for a later all-reduce
      if (f.reduce_out_alive)
        add_into_partial(u, f), ledger_.sub(f.shard, f.reduce, MemorySpace::device), f.reduce_out_alive = false;
      if (f.reduce_in_alive) ledger_.sub(f.padded, f.reduce, MemorySpace::device), f.reduce_in_alive = false;
      return release_full_grad(f);
    }
    if (f.partial_alive) {  // earlier deferred sums join this reduction
      add_into_partial(u, f);
      ledger_.sub(f.shard, f.accumulate, MemorySpace::device), f.partial_alive = false;
    }
    if (f.reduce_out_alive && f.grad != f.reduce) {  // the result cast to the gradient's dtype
      ledger_.add(f.shard, f.grad, MemorySpace::device, u, "backward (reduction)");
      ledger_.sub(f.shard, f.grad, MemorySpace::device);
    }
    if (f.reduce_out_alive) ledger_.sub(f.shard, f.reduce, MemorySpace::device), f.reduce_out_alive = false;
    if (f.reduce_in_alive) ledger_.sub(f.padded, f.reduce, MemorySpace::device), f.reduce_in_alive = false;
    release_full_grad(f);
  }

  void release_shard_grad(SimFlatState& f) {
    if (std::exchange(f.shard_grad_alive, false)) ledger_.sub(f.shard, f.grad, p_.shard_space());
  }

 private:
  void ensure_shard_grad(int u, SimFlatState& f, const char* phase) {
    if (!f.shard_grad_alive) ledger_.add(f.shard, f.grad, p_.shard_space(), u, phase), f.shard_grad_alive = true;
  }

  // A shard-group sum in the reduce dtype added into `partial` (the accumulate dtype):
  // cast through a buffer of its own where the two differ, or cast into a new `partial`.
  void add_into_partial(int u, SimFlatState& f) {
    if (f.accumulate == f.reduce) return;
    ledger_.add(f.shard, f.accumulate, MemorySpace::device, u, "backward (reduction)");
    if (f.partial_alive) ledger_.sub(f.shard, f.accumulate, MemorySpace::device);
    f.partial_alive = true;
  }
  // The compute-dtype gradient cast to the reduce dtype (added into what earlier backwards
  // kept there, through a temporary), then freed.
  void to_reduce_dtype(int u, SimFlatState& f, const char* phase) {
    ledger_.add(f.padded, f.reduce, MemorySpace::device, u, phase);
    if (f.reduce_in_alive) ledger_.sub(f.padded, f.reduce, MemorySpace::device);
    f.reduce_in_alive = true;
    release_full_grad(f);
  }
  void release_full_grad(SimFlatState& f) {
    if (f.full_grad_alive) ledger_.sub(f.padded, f.compute, MemorySpace::device);
    f.full_grad_alive = f.full_grad_alias = false;
  }

  SimLedger& ledger_;
  const PolicyConfig& p_;
};

}  // namespace fsdp::detail
