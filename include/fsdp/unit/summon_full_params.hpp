#pragma once
// A unit's summon_full_params (fsdp/unit/sharded_unit.hpp keeps the state machine around it): which
// options it refuses, the gathers it runs for each option, and the writeback check that
// every rank made the same edits.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/unit/unit.hpp"

namespace fsdp::detail {

inline void check_summon_options(const SummonOptions& options, bool hook_frees_gradient, std::string_view unit, int rank) {
  if (options.with_grads && hook_frees_gradient)
    fail("unit '", unit, "' on rank ", rank,
         ": summon_full_params with_grads, but its post-accumulate-grad hook frees the sharded gradient "
         "(GradientAfterHook::free), so there is none to show");
  if (options.writeback && options.rank0_only)
    fail("unit '", unit, "' on rank ", rank,
         ": summon_full_params with writeback and rank0_only: ranks other than 0 hold no full "
         "parameters to write back; summon with writeback on every rank instead");
}

// Gathers the full parameters (and with_grads the gradients) in their own dtype, where the
// options want them. Returns whether this rank holds nothing (rank0_only, not rank 0): it
// took part in the gathers for rank 0's sake only. Nothing stays gathered when it fails.
template <class Group>
bool gather_for_summon(Group& group, const SummonOptions& options, int rank, const TracedWait& wait,
                       const CollectiveTag* tag) {
  const bool holds_nothing = options.rank0_only && rank != 0;
  try {  // a gather, or a module's parameters_rebound hook, that fails leaves nothing bound
    group.unshard_master(wait, tag);
    if (holds_nothing) group.release_unsharded();
    else if (options.offload_to_host) group.move_unsharded_to_host();
  } catch (...) {
    group.release_unsharded_after_error();
    throw;
  }
  if (options.with_grads) {
    try {
      group.unshard_gradients();
    } catch (...) {
      group.release_summoned_gradients();
      group.release_unsharded_after_error();
      throw;
    }
    if (holds_nothing) group.release_summoned_gradients();
  }
  return holds_nothing;
}

// Whether every rank ends the summon with the same writeback flag (else an error on every
// rank: ranks that differ would run the edit check's collective alone).
inline void check_writeback_flag_agrees(const CommRef& world, bool writeback, std::string_view unit) {
  Fingerprint f;
  f.add(writeback ? "writeback" : "no writeback");
  check_same_across_ranks(
      world, f, [&] { return "unit '" + std::string(unit) + "': the writeback flag at the end of summon_full_params"; },
      [&] { return std::string(writeback ? "writeback=true" : "writeback=false"); });
}

// Each rank writes back only its own slice of its own full copy, so edits made on some
// ranks only would be kept in some slices and lost in others. A collective hash of the
// unit's full parameters and buffers (as a summon shows them); returns the ranks whose
// hash differs from rank 0's ("1, 3"), empty when all agree, and sets `in_place` when some
// parameters are their own shard (edited in place, so each rank's edits are kept).
template <class Group>
std::string ranks_with_other_edits(const Group& group, const Unit& unit, bool& in_place) {
  const auto& world = group.groups().world;
  if (world.size() == 1) return {};  // one rank: nothing to compare, so no pass over the parameters
  Fingerprint f;
  in_place = group.hash_unsharded(f);
  // Buffers live where the device computes (GPU memory on CUDA): copied to the host to be
  // hashed, as the parameters are.
  const auto buffers = unit.buffers();
  std::vector<std::byte> host;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    host.resize(static_cast<std::size_t>(buffers[i].numel) * size_of(buffers[i].dtype));
    if (!host.empty()) fsdp::detail::internals(unit).copy_bytes(host.data(), fsdp::detail::internals(unit).buffer_data(i), host.size());
    f.add_bytes(host.data(), host.size());
  }
  std::uint64_t mine = f.value();
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world.size()));
  world.all_gather(&mine, all.data(), 1, DType::i64).wait();
  std::ostringstream differ;
  for (std::size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0]) differ << (differ.tellp() ? ", " : "") << r;
  return differ.str();
}

[[noreturn]] inline void fail_edits_differ(std::string_view unit, int rank, const std::string& differ, bool in_place) {
  fail_as(ErrorKind::mismatch, "unit '", unit, "' on rank ", rank,
          ": summon_full_params(writeback) ended with full parameters or buffers that differ across ranks "
          "(rank(s) ",
          differ,
          " differ from rank 0): each rank writes back only its own slice, so "
          "make the same edits on every rank; ",
          in_place ? "parameters replicated in place kept each rank's own edits" : "nothing was written back");
}

// The end of a summon: writeback is a decision of every rank (one all-gather of a flag;
// ranks that differ would otherwise run the edit check's collective alone), and with it
// every rank must have made the same edits. Else `discard` ends the summon without
// writing anything back and an error is thrown on every rank.
template <class Group, class Discard>
void check_summon_end(const Group& group, const Unit& unit, bool writeback, int rank, Discard discard) {
  try {
    check_writeback_flag_agrees(group.groups().world, writeback, fsdp::detail::display_name(unit.fqn()));
  } catch (...) {
    discard();
    throw;
  }
  if (!writeback) return;
  bool in_place = false;
  const std::string differ = ranks_with_other_edits(group, unit, in_place);
  if (differ.empty()) return;
  discard();
  fail_edits_differ(fsdp::detail::display_name(unit.fqn()), rank, differ, in_place);
}

}  // namespace fsdp::detail
