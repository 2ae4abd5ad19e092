#pragma once
// What the memory planner's replay (fsdp/detail/memory_simulation.hpp) is given: each
// unit as the planner sees it, how a step accumulates gradients, and where a peak was
// reached.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "fsdp/dtype.hpp"
#include "fsdp/flat_param.hpp"
#include "fsdp/gradient_sync.hpp"
#include "fsdp/post_accumulate_grad_hook.hpp"

namespace fsdp::detail {

struct SimFlat {
  DType master = DType::f32;
  std::int64_t numel = 0;
};
struct SimBuffer {
  DType dtype = DType::f32;
  std::int64_t numel = 0;
};
struct SimUnit {
  std::vector<SimFlat> flat;
  std::vector<SimBuffer> buffers;
  bool kept_unsharded = false;  // under the persistence threshold
  bool reshard_after_forward = true;  // the unit's ReshardSettings (its strategy's by default)
  int post_forward_ranks = 0;         // a partial reshard's group size (sharded units only); 0: none
  bool reshard_after_backward = true;  // off: kept between micro-batches while the gradient is not final
  GradientSyncMode accumulation = GradientSyncMode::keep_unsharded;  // what a backward with sync off does
  // A post-accumulate-grad hook (optimizer in backward), if any: what it does with the
  // sharded gradient, and what the engine allocates in its first run and keeps, per space.
  std::optional<GradientAfterHook> hook;
  std::array<std::size_t, 2> hook_engine_state{};
  std::vector<int> forward_prefetch, backward_prefetch;  // explicit lists (unit indices); empty: the order's next
  std::vector<int> children;    // units nested in it, in forward order
};

// A flat parameter of `numel` elements split over n ranks, sized as the unit sizes it.
inline FlatParamLayout sim_layout(DType dtype, std::int64_t numel, int n) {
  return FlatParamLayout(dtype, {ParamInfo{.numel = numel}}, n);
}

// Where a space's peak was reached.
struct SimPeak {
  std::size_t bytes = 0;
  int unit = -1;  // -1: the engine's state
  const char* phase = "";
  int step = 0;  // 1-based; 0: setup
};

// Passes per step: all but the last with gradient sync off (ShardedModel::no_sync), or
// (defer_all_reduce) with the replicate all-reduce deferred instead, over `replicate`
// replicas.
struct Accumulation {
  int micro_batches = 1;
  bool defer_all_reduce = false;
  int replicate = 1;
};

}  // namespace fsdp::detail
