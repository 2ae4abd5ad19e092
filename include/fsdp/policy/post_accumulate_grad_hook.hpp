#pragma once
// Post-accumulate-grad hooks: engine code run once a unit's sharded gradient is final, the
// role of PyTorch's register_post_accumulate_grad_hook (FSDP2 runs them by hand after the
// reduce-scatter). "Final" means: the unit's reduction into its sharded gradient has
// completed (reduce-scatter, and the all-reduce across replicas of the hybrid strategies),
// in a backward with gradient sync on. So a hook
//  - runs once per synchronized backward of the unit, in backward order, with the unit in
//    BACKWARD_POST; on asynchronous backends where the reduction is left in flight, when it
//    is completed (at the next unit's post_backward, or at finish_backward);
//  - does not run for micro-batches under no_sync / set_requires_gradient_sync(false)
//    (whatever the GradientSyncMode) nor for a HybridShard backward whose replica
//    all-reduce is deferred (set_requires_all_reduce(false)): the gradient is not final.
//
// The hook gets the unit: its shards() and parameters() show the parameters and the final
// gradient, which is what an optimizer needs to step there and then (optimizer in
// backward). With GradientAfterHook::free the unit then frees the sharded gradient: between
// hooks a unit holds no sharded gradient at all (views show grad == nullptr), so at most
// one unit's sharded gradient is alive beyond the one being reduced. That is the memory
// saving of stepping in backward; what it rules out is anything that needs every gradient
// after backward (clip_grad_norm, ShardedGradScaler, summon with_grads), which then fails
// naming the unit.
#include <cstdint>
#include <functional>
#include <string_view>

namespace fsdp {

class Unit;
struct ParamView;

// What a unit does with its sharded gradient once its hook has returned.
enum class GradientAfterHook : std::uint8_t {
  keep,  // it stays, as without a hook (zero_grad zeroes it)
  free,  // freed now; allocated again by the next backward, counting as zero (the
         // reduction writes all of it; where the engine adds into it, it is zeroed first)
};

constexpr std::string_view name_of(GradientAfterHook a) { return a == GradientAfterHook::keep ? "keep" : "free"; }

// Per unit: called with the unit whose gradient is final.
using PostAccumulateGradHook = std::function<void(Unit&)>;
// Per parameter: called for each parameter of that unit in turn (parameters() order,
// including those with no element on this rank: count == 0, grad == nullptr).
using PostAccumulateParamHook = std::function<void(Unit&, const ParamView&)>;

}  // namespace fsdp
