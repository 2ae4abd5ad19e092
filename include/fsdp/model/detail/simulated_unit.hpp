#pragma once
// The memory planner's replay data (fsdp/model/detail/memory_simulation.hpp): what it is given
// (each unit as the planner sees it, how a step accumulates gradients), what it tracks of
// each flat parameter, and the ledger of live and peak bytes it counts them in.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/policy/gradient_sync.hpp"
#include "fsdp/policy/post_accumulate_grad_hook.hpp"

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
  ParamInfo p;  // not ParamInfo{.numel = numel}: g++ 12's -Wextra warns of the members left out
  p.numel = numel;
  return FlatParamLayout(dtype, {p}, n);
}

// Where a space's peak was reached.
struct SimPeak {
  std::size_t bytes = 0;
  int unit = -1;  // -1: the engine's state
  const char* phase = "";
  int step = 0;  // 1-based; 0: setup
};

// Live and peak bytes per memory space, as a Device counts them, and where each peak was
// reached (unit, phase, step).
class SimLedger {
 public:
  void add(std::size_t bytes, MemorySpace space, int unit, const char* phase) {
    auto& live = live_[static_cast<std::size_t>(space)];
    live += bytes;
    auto& pk = peak_[static_cast<std::size_t>(space)];
    if (live > pk.bytes) pk = {live, unit, phase, step_};
  }
  void sub(std::size_t bytes, MemorySpace space) { live_[static_cast<std::size_t>(space)] -= bytes; }
  // n elements of dtype t.
  void add(std::int64_t n, DType t, MemorySpace space, int unit, const char* phase) { add(bytes(n, t), space, unit, phase); }
  void sub(std::int64_t n, DType t, MemorySpace space) { sub(bytes(n, t), space); }

  void next_step() { ++step_; }
  const SimPeak& peak(MemorySpace s) const { return peak_[static_cast<std::size_t>(s)]; }
  std::size_t live(MemorySpace s) const { return live_[static_cast<std::size_t>(s)]; }

 private:
  static std::size_t bytes(std::int64_t n, DType t) { return static_cast<std::size_t>(n) * size_of(t); }

  std::array<std::size_t, 2> live_{};
  std::array<SimPeak, 2> peak_{};
  int step_ = 0;
};

// One flat parameter during the replay: its sizes and dtypes (FlatParam's), and which of
// the buffers a unit holds for it are alive.
struct SimFlatState {
  std::int64_t shard = 0, padded = 0, full = 0;  // elements: shard, padded flat, what a gather holds
  DType master{}, compute{}, gather{}, accumulate{}, reduce{}, grad{};
  bool shards = true, direct = false, grad_in_shard = false;
  std::int64_t post = 0;  // elements a partial reshard keeps (0: none)
  bool full_alive = false, wire_alive = false, unbound = false, post_alive = false;
  bool full_grad_alive = false, full_grad_alias = false;
  bool reduce_in_alive = false, reduce_out_alive = false, reducing = false;
  bool partial_alive = false, deferred = false;  // a shard-group sum waiting for its all-reduce
  bool shard_grad_alive = true;

  FlatParamDTypes dtypes() const { return {compute, gather, accumulate, reduce, grad}; }
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
