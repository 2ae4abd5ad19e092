#pragma once
// What a backend says when the ranks' calls at one collective differ: every rank's call,
// with the unit of its tag, in one message that every rank throws alike (ThreadComm,
// CudaThreadComm and MpiComm compare whole calls; NcclComm gathers only the tags beside
// each tagged collective, see nccl/nccl_tag_ring.hpp; TcpComm asks the ranks through its
// store, see asio/tcp_rank_report.hpp).
//
//   collective mismatch: rank 0 called all_gather(count=101, dtype=f32) of unit 'blocks.0'
//   (forward, pass 1) as collective #20, rank 1 called ... of unit 'blocks.1' ... (seen on rank 1)
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/detail/collective_call.hpp"

namespace fsdp::detail {

// The message above from what each rank did (each_rank[r]: "called <call>", or a
// backend's own words such as "did not report"), seen on rank `self` (an index too).
// Ranks are named world_ranks[r] where given (a split group's members), else r. Past
// kListAll ranks only those that differ from the most common entry are listed (at most
// kListAll), so that the message stays readable and fits an ABORT frame on large worlds.
inline std::string mismatch_message(std::span<const std::string> each_rank, std::size_t self,
                                    std::span<const int> world_ranks = {}) {
  constexpr std::size_t kListAll = 64;
  auto name = [&](std::size_t r) { return world_ranks.empty() ? static_cast<int>(r) : world_ranks[r]; };
  std::string common;  // the entry of most ranks, when not every rank is listed
  if (each_rank.size() > kListAll) {
    std::map<std::string_view, std::size_t> counts;
    std::size_t most = 0;
    for (const auto& e : each_rank) {
      const std::size_t n = ++counts[e];
      if (n > most) {
        most = n;
        common = e;
      }
    }
  }
  std::ostringstream os;
  os << "collective mismatch:";
  std::size_t listed = 0, unlisted = 0, as_common = 0;
  for (std::size_t r = 0; r < each_rank.size(); ++r) {
    if (!common.empty() && each_rank[r] == common) ++as_common;
    else if (listed == kListAll) ++unlisted;
    else os << (listed++ ? "," : "") << " rank " << name(r) << " " << each_rank[r];
  }
  if (unlisted) os << ", " << unlisted << " more ranks that differ";
  if (as_common) os << (listed ? "," : "") << " and the other " << as_common << " ranks " << common;
  os << " (seen on rank " << name(self) << ")";
  return os.str();
}

// "" when every rank's call has calls[self]'s shape and tag (CollectiveCall::same_shape),
// else the message above.
inline std::string collective_mismatch(std::span<const CollectiveCall> calls, std::size_t self,
                                       std::span<const int> world_ranks = {}) {
  bool differ = false;
  for (const auto& c : calls) differ = differ || !c.same_shape(calls[self]);
  if (!differ) return {};
  std::vector<std::string> each_rank;
  for (const auto& c : calls) each_rank.push_back("called " + c.describe(true));  // with an abort's note
  return mismatch_message(each_rank, self, world_ranks);
}

// The same for a backend that gathers only the ranks' tags (tags[r]: rank r's packed
// CollectiveTag, 0 untagged) beside a collective that completed: a peer whose tag is an
// agreement's (is_agreement_tag) is shown with the agreement's shape, which that tag
// implies; any other with `mine`'s (NCCL completed the calls together, so their bytes
// matched), its own tag, and `mine`'s unit names (every rank's model names its units
// alike). A peer's note is not gathered: `note_rank`'s is `note` where the backend brought
// it by other means.
inline std::string tag_mismatch(const CollectiveCall& mine, std::span<const std::uint64_t> tags, std::size_t self,
                                int note_rank = -1, std::shared_ptr<const std::string> note = nullptr) {
  if (std::all_of(tags.begin(), tags.end(), [&](std::uint64_t t) { return t == mine.tag; })) return {};  // every collective
  std::vector<CollectiveCall> calls(tags.size(), mine);
  for (std::size_t r = 0; r < tags.size(); ++r) {
    if (r == self) continue;
    calls[r].tag = tags[r];
    calls[r].note = static_cast<int>(r) == note_rank ? note : nullptr;
    if (is_agreement_tag(tags[r])) calls[r] = as_agreement(calls[r]);
  }
  return collective_mismatch(calls, self);
}

// The rank whose failure the others' errors echo after the mismatch in `tags` (packed
// CollectiveTags, as tag_mismatch takes them): the lowest rank whose call is abort_step's
// agreement, unless `self`'s is one too (its error is then its own); -1 where none is.
inline int abort_root(std::span<const std::uint64_t> tags, std::size_t self) {
  auto aborts = [](std::uint64_t t) { return t && CollectiveTag::unpack(t).phase == TagPhase::abort_step; };
  if (self < tags.size() && aborts(tags[self])) return -1;
  for (std::size_t r = 0; r < tags.size(); ++r)
    if (aborts(tags[r])) return static_cast<int>(r);
  return -1;
}

}  // namespace fsdp::detail
