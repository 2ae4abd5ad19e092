#pragma once
// Partial resharding (FSDP2's integer reshard_after_forward, ZeRO++ hpZ): after forward a
// unit keeps this rank's 1/k of each unsharded flat parameter, and its backward all-gather
// runs inside a group of k ranks from those chunks instead of across the shard group. The
// chunk is in the dtype the all-gather moved (the compute dtype, or CommPrecision's
// narrower one, which the widened values came from), so it holds them exactly.
#include <cstddef>
#include <optional>
#include <string_view>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

class PostForwardGroup {
 public:
  // k ranks whose group rank is their shard rank modulo k, so that k consecutive chunks of
  // the unsharded buffer, one per member, rebuild it (split by shard rank / k, keyed by
  // rank: the ranks of one host, typically). nullopt: none. That every rank asked for the
  // same k is checked with the unit's other run-time settings. It must outlive the setting.
  void set(std::optional<CommRef> group, const UnitGroups& groups, std::string_view unit) {
    if (group) check(*group, groups, unit);
    group_ = group;
  }
  // Whether `group` can be this unit's (the checks above), on this rank; changes nothing.
  static void check(const CommRef& group, const UnitGroups& groups, std::string_view unit) {
    const int k = group.size(), S = groups.shard_size;
    if (k <= 1 || k >= S || S % k != 0)
      fail("unit '", unit, "' on rank ", groups.world.rank(), ": set_reshard_after_forward(group of ", k,
           " ranks): a partial reshard needs a group whose size divides the shard group's ", S,
           " ranks and lies strictly between 1 and ", S, " (use true or false for the others)");
    if (group.rank() != groups.shard_rank % k)
      fail("unit '", unit, "' on rank ", groups.world.rank(), ": set_reshard_after_forward(group): this rank is ",
           "rank ", group.rank(), " of the group but rank ", groups.shard_rank, " of its shard group of ", S,
           "; the group's ranks must be shard ranks modulo ", k, " (split by shard rank / ", k,
           ", keyed by shard rank, e.g. the ranks of one host)");
  }
  bool active() const { return group_.has_value(); }
  int size() const { return group_ ? group_->size() : 0; }

  // Copies this rank's chunk of the gathered buffer (fp.full, bound) into fp.post_forward.
  void keep_chunk(FlatParam& fp, int shard_rank, const DeviceRef& device) const {
    const int k = group_->size();
    fp.post_forward_numel = fp.layout.padded_numel() / k;
    fp.post_forward = device.allocate(fp.post_forward_bytes(), MemorySpace::device);
    const auto* chunk = static_cast<const std::byte*>(fp.full) + FlatParam::bytes((shard_rank % k) * fp.post_forward_numel, fp.full_dtype);
    device.cast(fp.post_forward, fp.gather, chunk, fp.full_dtype, static_cast<std::size_t>(fp.post_forward_numel));
  }

  // The backward all-gather from the chunks, into a fresh `as` buffer, or into a narrower
  // wire buffer that FlatParamGroup::finish_gather widens; it frees the chunk once shown.
  void start_gather(FlatParam& fp, DType as, const DeviceRef& device, const CollectiveTag* tag) const {
    const auto n = static_cast<std::size_t>(fp.post_forward_numel);
    if (fp.gather != as) {
      fp.wire = device.allocate(fp.wire_bytes(), MemorySpace::device);
      fp.gather_work = group_->all_gather(fp.post_forward, fp.wire, n, fp.gather, tag);
      return;
    }
    fp.full = device.allocate(FlatParam::bytes(fp.layout.padded_numel(), as), MemorySpace::device);
    fp.gather_work = group_->all_gather(fp.post_forward, fp.full, n, as, tag);
  }

 private:
  std::optional<CommRef> group_;
};

}  // namespace fsdp::detail
