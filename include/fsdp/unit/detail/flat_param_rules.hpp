#pragma once
// The rules that decide how a unit holds its flat parameters and what it does with their
// gradients, written once: the units follow them (fsdp/unit/unit_setup.hpp,
// fsdp/unit/flat_param_group.hpp, fsdp/unit/detail/gradient_reduction.hpp), and so does the
// memory planner, which runs the units themselves (fsdp/model/memory_plan.hpp).
#include <cstdint>
#include <optional>
#include <type_traits>

#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/policy/gradient_sync.hpp"
#include "fsdp/policy/configuration.hpp"  // PolicyConfig: the policies as values
#include "fsdp/policy/policies.hpp"

namespace fsdp::detail {

// Whether a unit keeps its parameters whole on every rank (ShardOptions::persistence_threshold):
// only a strategy that shards has something to keep unsharded.
inline bool kept_unsharded_by_threshold(bool shards_parameters, std::int64_t elements, std::int64_t threshold) {
  return shards_parameters && elements < threshold;
}

// The dtypes of one flat parameter whose master (sharded) dtype is `master`.
struct FlatParamDTypes {
  DType compute;     // what the engine computes with (MixedPrecision's Param)
  DType gather;      // what all-gathers move (CommPrecision's Gather, else compute)
  DType accumulate;  // what unsynchronized backwards sum the unsharded gradient in, and
                     // deferred shard-group sums wait in (MixedPrecision's Reduce, else compute)
  DType reduce;      // what the reduction moves (CommPrecision's Reduce, else accumulate)
  DType grad;        // what the sharded gradient is kept in
};

// A CommPrecision dtype applies only where it has fewer bytes than the compute dtype; it
// changes what the collectives move, never what anything accumulates in.
inline FlatParamDTypes flat_param_dtypes(DType master, const PrecisionConfig& p) {
  FlatParamDTypes t{master, master, master, master, master};
  if (p.mixed) {
    t.compute = p.param;
    t.accumulate = t.reduce = p.reduce;
    t.grad = p.keep_low_precision_grads ? p.reduce : master;
  }
  t.gather = t.compute;
  if (p.comm) {
    if (!p.comm_quantized && size_of(p.comm_gather) < size_of(t.compute)) t.gather = p.comm_gather;
    if (size_of(p.comm_reduce) < size_of(t.compute)) t.reduce = p.comm_reduce;
  }
  return t;
}

// Whether the all-gathers of a flat parameter whose master dtype is `master` move block
// codes and scales (CommPrecision's Gather a block format): only where there is an
// all-gather, and only from f32 (what the quantizers read). Its `gather` dtype stays the
// compute dtype, which a partial reshard's all-gather moves.
inline bool gathers_quantized(DType master, bool shards_parameters, const PrecisionConfig& p) {
  return p.comm_quantized && shards_parameters && master == DType::f32;
}

// Replicated, in its own dtype and device-resident: the shard *is* the parameters, and the
// engine accumulates straight into the sharded gradient.
inline bool flat_param_is_direct(bool shards, bool offload, DType master, const FlatParamDTypes& t) {
  return !shards && !offload && t.compute == master && t.reduce == master;
}

// Where the engine's backward accumulates straight into the sharded gradient, as DDP does:
// no unsharded gradient buffer, no zeroing of one, no copy out of it. Replicated
// parameters in their own dtype (`direct`), and a rank alone in the world (FSDP1 runs
// FULL_SHARD as NO_SHARD there): its shard is the whole padded parameter, so where every
// gradient dtype is the compute dtype and the shard is device-resident, the reduction has
// nothing to do to the gradient. Only in the world: a replica group, even with shard
// groups of one, still averages, and may defer that into another buffer.
inline bool grad_accumulates_in_shard(bool direct, bool alone_in_world, bool offload, const FlatParamDTypes& t) {
  return direct ||
         (alone_in_world && !offload && t.accumulate == t.compute && t.reduce == t.compute && t.grad == t.compute);
}

// Alone in its reducing group (UnitGroups::reduces_alone), a gradient of another dtype than
// the reduction's needs no buffer of the reduce dtype: the cast writes the sharded gradient
// itself, where the reduction would have put it. Only where that is the reduction's place:
// zero since zero_grad, device-resident, of the reduce dtype, with no earlier sums kept
// in such a buffer (`sums_kept`) and nothing deferred.
inline bool casts_into_shard_grad(bool reduces_alone, const FlatParamDTypes& t, bool sums_kept, bool grad_is_zero,
                                  bool defer_all_reduce, bool offload) {
  return reduces_alone && t.reduce != t.compute && t.grad == t.reduce && !sums_kept && grad_is_zero &&
         !defer_all_reduce && !offload;
}

// What one post_backward does with a unit's gradient (chosen from its GradientSync).
enum class GradientPlan : std::uint8_t {
  keep_unsharded,  // no communication: kept for the next backward to add into
  reduce_partial,  // reduce inside the shard group only; the replicate all-reduce waits
  reduce,          // the whole reduction into the sharded gradient
};

// The plan under a unit's GradientSync: without sync, kept unsharded in that mode; the
// hybrid strategies' replica all-reduce deferred (`all_reduces_shards`: the unit's shards
// have replicas); else the whole reduction.
inline GradientPlan plan_gradient(const GradientSync& sync, bool all_reduces_shards) {
  if (!sync.requires_sync && sync.mode == GradientSyncMode::keep_unsharded) return GradientPlan::keep_unsharded;
  if (all_reduces_shards && !sync.requires_all_reduce) return GradientPlan::reduce_partial;
  return GradientPlan::reduce;
}

// Whether a reduction under `plan` makes the sharded gradient final (what an optimizer
// steps on): sync on, and nothing of it deferred.
inline bool gradient_is_final(const GradientSync& sync, GradientPlan plan) {
  return sync.requires_sync && plan == GradientPlan::reduce;
}

}  // namespace fsdp::detail
