#pragma once
// Gradient accumulation over micro-batches: whether a unit's backward completes the
// gradient reduction (FSDP2's set_requires_gradient_sync, FSDP1's no_sync), whether a
// hybrid strategy's all-reduce across replicas runs (FSDP2's set_requires_all_reduce), and
// which of the two ways to accumulate a unit uses while sync is off.
//
// After k backwards (since zero_grad) the sharded gradient is the gradient of the *sum* of
// the k micro-batch losses, each reduced over the ranks as ShardOptions::local_gradients
// says (averaged, or summed): what an unsharded engine gets by calling backward k times
// without zeroing. Whatever the mode, the reduction's division applies to each gradient
// exactly once; nothing divides by k (an engine that wants the mean over micro-batches
// scales its loss by 1/k). docs/training_loop.md#what-the-engines-gradients-mean.
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp {

// What a unit does at post_backward while its gradient sync is off.
enum class GradientSyncMode : std::uint8_t {
  // FSDP1's no_sync (the default): no communication. The unit keeps its unsharded gradient,
  // in MixedPrecision's reduce dtype (never CommPrecision's narrower one), in device memory; later backwards add into it, and the next
  // synchronized backward reduces the sum once. Communicates 1/k of the gradient bytes, at
  // the cost of one unsharded gradient per unit alive between micro-batches.
  keep_unsharded,
  // Reduce every micro-batch, as a synchronized backward does, and add the result into the
  // sharded gradient: no memory beyond a normal backward, k times the communication.
  reduce_every_microbatch,
};

constexpr std::string_view name_of(GradientSyncMode m) {
  return m == GradientSyncMode::keep_unsharded ? "keep_unsharded" : "reduce_every_microbatch";
}

// A unit's settings, read at each post_backward.
struct GradientSync {
  bool requires_sync = true;
  // Hybrid strategies only (elsewhere there is no all-reduce of gradient shards to skip).
  // Off: the reduce-scatter inside the shard group still runs, its result waits in a
  // shard-sized device buffer (MixedPrecision's reduce dtype, counted by the Device), and the sharded
  // gradient is left as it was; the next backward with it on adds the waiting sum and
  // all-reduces once across replicas. So between micro-batches the sharded gradient holds
  // only what earlier complete reductions put there.
  bool requires_all_reduce = true;
  GradientSyncMode mode = GradientSyncMode::keep_unsharded;

  friend bool operator==(const GradientSync&, const GradientSync&) = default;

  std::int32_t code() const {
    return (requires_sync ? 1 : 0) | (requires_all_reduce ? 2 : 0) | (static_cast<std::int32_t>(mode) << 2);
  }
  static std::string describe(std::int32_t code) {
    std::ostringstream os;
    os << "sync " << (code & 1 ? "on" : "off") << ", all-reduce " << (code & 2 ? "on" : "off") << ", "
       << name_of(static_cast<GradientSyncMode>(code >> 2));
    return os.str();
  }
};

}  // namespace fsdp
