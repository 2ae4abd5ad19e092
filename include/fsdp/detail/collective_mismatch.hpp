#pragma once
// What a backend says when the ranks' calls at one collective differ: every rank's call,
// with the unit of its tag, in one message that every rank throws alike (ThreadComm,
// CudaThreadComm and MpiComm compare whole calls; NcclComm gathers only the tags beside
// each tagged collective, see nccl/nccl_tag_ring.hpp).
//
//   collective mismatch: rank 0 called all_gather(count=101, dtype=f32) of unit 'blocks.0'
//   (forward, pass 1) as collective #20, rank 1 called ... of unit 'blocks.1' ... (seen on rank 1)
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/detail/collective_call.hpp"

namespace fsdp::detail {

// "" when every rank's call has calls[self]'s shape and tag (CollectiveCall::same_shape),
// else the message above. Ranks are named world_ranks[r] where given (a split group's
// members), else r.
inline std::string collective_mismatch(std::span<const CollectiveCall> calls, std::size_t self,
                                       std::span<const int> world_ranks = {}) {
  bool differ = false;
  for (const auto& c : calls) differ = differ || !c.same_shape(calls[self]);
  if (!differ) return {};
  auto name = [&](std::size_t r) { return world_ranks.empty() ? static_cast<int>(r) : world_ranks[r]; };
  std::ostringstream os;
  os << "collective mismatch:";
  for (std::size_t r = 0; r < calls.size(); ++r) os << (r ? "," : "") << " rank " << name(r) << " called " << calls[r].describe();
  os << " (seen on rank " << name(self) << ")";
  return os.str();
}

// The same for a backend that gathers only the ranks' tags (tags[r]: rank r's packed
// CollectiveTag, 0 untagged): each rank is shown with `mine`'s shape, its own tag, and
// `mine`'s unit names (every rank's model names its units alike).
inline std::string tag_mismatch(const CollectiveCall& mine, std::span<const std::uint64_t> tags, std::size_t self) {
  if (std::all_of(tags.begin(), tags.end(), [&](std::uint64_t t) { return t == mine.tag; })) return {};  // every collective
  std::vector<CollectiveCall> calls(tags.size(), mine);
  for (std::size_t r = 0; r < tags.size(); ++r) calls[r].tag = tags[r];
  return collective_mismatch(calls, self);
}

}  // namespace fsdp::detail
