#pragma once
// What a unit does with its unsharded parameters between passes, and how it averages its
// gradient: FSDP2's reshard_after_forward (a bool, or an int for partial resharding),
// set_reshard_after_backward and set_gradient_divide_factor, settable per unit at run
// time. With the gradient sync settings (fsdp/policy/gradient_sync.hpp) they are a unit's run-time
// settings, which every rank must make alike: a unit checks that they did at its first
// backward after a change (agree_unit_settings below).
//
// What the divide factor is by default follows what the engine's gradients are over its
// local batch, LocalGradients below (ShardOptions::local_gradients, chosen when the unit is
// built): docs/training_loop.md#what-the-engines-gradients-mean has the one table.
#include <bit>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/policy/gradient_sync.hpp"

namespace fsdp {

// What the engine's gradients are over its local batch (this rank's samples), and so what a
// synchronized reduction makes of them across the data-parallel ranks (ShardOptions::
// local_gradients; a unit's config() reports it).
enum class LocalGradients : std::uint8_t {
  // Means over the local batch (the loss is a mean): the reduction averages, dividing the
  // sum over ranks by the world size (every rank holding a shard or a replica), so with
  // equal local batches the optimizer sees the gradient of the global batch's mean.
  mean,
  // Sums over the local batch (the loss is a sum): the reduction sums over ranks (divides
  // by 1), so the optimizer sees the gradient of the global batch's sum, what the engine
  // computes unsharded on the whole global batch.
  sum,
};

constexpr std::string_view name_of(LocalGradients g) { return g == LocalGradients::sum ? "sum" : "mean"; }

struct ReshardSettings {
  // Between a unit's forward and its backward: false keeps the unsharded parameters whole
  // (ShardGradOp's default); true frees them (FullShard's default), or, with
  // post_forward_ranks = k, keeps this rank's 1/k of them, in the gathered dtype, so the
  // backward all-gather runs inside the group of k ranks passed to
  // set_reshard_after_forward (FSDP2's integer reshard_after_forward, ZeRO++ hpZ).
  bool after_forward = true;
  int post_forward_ranks = 0;  // 0: the shard group (a full reshard)
  // Off: after a backward whose gradient is not final (gradient sync off, or the replicate
  // all-reduce skipped), the unsharded parameters stay for the next forward, which then
  // needs no all-gather (FSDP2's set_reshard_after_backward(false) for gradient
  // accumulation). After a final gradient the unit reshards anyway: the optimizer step
  // that follows would make a kept copy stale (FSDP2 leaves that to the user).
  bool after_backward = true;
  // What a synchronized reduction divides the summed gradient by (set_gradient_divide_factor);
  // 0: none set, the unit's LocalGradients decides (divide_factor below).
  double gradient_divide_factor = 0;

  friend bool operator==(const ReshardSettings&, const ReshardSettings&) = default;
};

// What a synchronized reduction divides the gradient summed over ranks by: the factor set
// (set_gradient_divide_factor), which overrides the rest; else 1 where the engine's
// gradients are sums (LocalGradients::sum); else 0, which stands for the world size
// (LocalGradients::mean).
constexpr double divide_factor(const ReshardSettings& r, LocalGradients local) {
  return r.gradient_divide_factor > 0 ? r.gradient_divide_factor : local == LocalGradients::sum ? 1.0 : 0.0;
}

namespace detail {

// The run-time settings as 5 integers (an all-gather's payload) and back in words.
inline std::vector<std::int64_t> settings_code(const GradientSync& sync, const ReshardSettings& r) {
  return {sync.code(), r.after_forward ? 1 : 0, r.post_forward_ranks, r.after_backward ? 1 : 0,
          std::bit_cast<std::int64_t>(r.gradient_divide_factor)};
}
// `local`: the unit's LocalGradients (agreed when it was built), which says what no factor set means.
inline std::string describe_settings(const std::int64_t* code, LocalGradients local) {
  std::ostringstream os;
  os << GradientSync::describe(static_cast<std::int32_t>(code[0])) << ", reshard after forward ";
  if (!code[1]) os << "off";
  else if (code[2]) os << "to groups of " << code[2] << " ranks";
  else os << "on";
  os << ", reshard after backward " << (code[3] ? "on" : "off") << ", gradient divide factor ";
  const double f = std::bit_cast<double>(code[4]);
  if (f == 0 && local == LocalGradients::sum) os << "1 (local_gradients=sum)";
  else if (f == 0) os << "the world size";
  else os << f;
  return os.str();
}

// Every rank must pair the same collectives for a unit, so its run-time settings must
// agree. A unit checks at its first pre_forward or pre_backward after they change (never
// in plain training): ranks whose settings first differ at some hook differ in whether they
// changed there, so one side runs this all-gather while the other runs the unit's own
// collective; either the values differ (named below) or the collectives do (the backend's
// error, named below too).
inline void agree_unit_settings(const CommRef& world, const GradientSync& sync, const ReshardSettings& reshard,
                                LocalGradients local, std::string_view unit, int rank) {
  if (world.size() == 1) return;
  const std::vector<std::int64_t> mine = settings_code(sync, reshard);
  const std::size_t n = mine.size();
  std::vector<std::int64_t> all(n * static_cast<std::size_t>(world.size()));
  try {
    world.all_gather(mine.data(), all.data(), n, DType::i64).wait();
  } catch (const EchoedError&) {
    throw;  // a peer failed (lost, or failed first): its error, not a settings mismatch, is the cause
  } catch (const Error& e) {
    // The other side ran another collective: a mismatch, unless the backend lost a peer or timed out.
    fail_as(e.kind() == ErrorKind::misuse ? ErrorKind::mismatch : e.kind(), "unit '", unit, "' on rank ", rank,
            ": its run-time settings changed at this backward (now ", describe_settings(mine.data(), local),
            ") but another rank ran a different collective here: the ranks' "
            "set_requires_gradient_sync / set_requires_all_reduce / no_sync / set_reshard_after_forward / "
            "set_reshard_after_backward / set_gradient_divide_factor calls differ (",
            e.what(), ")");
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(world.size()); ++r) {
    if (std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r * n))) continue;
    std::ostringstream os;
    os << "unit '" << unit << "': run-time settings differ across ranks (seen on rank " << rank << "):";
    for (std::size_t q = 0; q < static_cast<std::size_t>(world.size()); ++q)
      os << (q ? ";" : "") << " rank " << q << " " << describe_settings(all.data() + q * n, local);
    throw Error(ErrorKind::mismatch, os.str());
  }
}

// A divide factor must be a positive finite number.
inline void check_divide_factor(double f, std::string_view unit, int rank) {
  if (!(f > 0) || !std::isfinite(f))
    fail("unit '", unit, "' on rank ", rank, ": set_gradient_divide_factor(", f,
         "): the factor must be a positive finite number (by default the world size, or 1 under "
         "ShardOptions::local_gradients = sum)");
}

}  // namespace detail
}  // namespace fsdp
