#pragma once
// For communicators without collective tags (fsdp/core/collective_tag.hpp; tagged ones compare
// every collective's unit instead, and skip this): the check that every rank ran the same
// units in the same order in a pass, made once per pass when it ends
// (ShardedModel::finish_backward, or reshard() after a forward-only pass): the first
// iteration checks every entry as it records the order, but later ones
// would otherwise pair the collectives of two same-sized units that some rank swapped (or
// ran in another order in an evaluation pass) without a word. Each rank hashes the units
// it entered, in order; one 8-byte all-gather compares the hashes; only when they differ do
// the ranks exchange their lists, so the error names the first place they part and what
// each rank ran there. Values computed in that pass are wrong, but the error comes before
// the optimizer step could apply them.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

class PassRecord {
 public:
  // A unit entering the pass (its index in the model; backward or forward). Not recorded
  // over a communicator that checks tags: its collectives were compared as they ran.
  void enter(int unit, bool backward, const CommRef& world) {
    if (world.checks_tags()) return;
    if (!world_) world_ = world;
    ran_.push_back(unit * 2 + (backward ? 1 : 0));
  }
  void clear() { ran_.clear(); }

  // At the end of a pass: every rank must have entered the same units in the same order.
  // `name` gives a unit's name from its index.
  void check(const std::function<std::string(int)>& name) {
    if (!world_ || world_->size() == 1) return ran_.clear();  // nothing recorded (tags checked each collective), or alone
    std::uint64_t mine = 1469598103934665603ull;  // FNV-1a over the entries
    for (std::int32_t e : ran_) mine = (mine ^ static_cast<std::uint32_t>(e)) * 1099511628211ull;
    std::vector<std::uint64_t> all(static_cast<std::size_t>(world_->size()));
    world_->all_gather(&mine, all.data(), 1, DType::i64).wait();
    if (std::all_of(all.begin(), all.end(), [&](std::uint64_t h) { return h == mine; })) return ran_.clear();
    fail_with_lists(name);
  }

 private:
  [[noreturn]] void fail_with_lists(const std::function<std::string(int)>& name) {
    const auto n = static_cast<std::size_t>(world_->size());
    const std::int64_t count = static_cast<std::int64_t>(ran_.size());
    std::vector<std::int64_t> counts(n);
    world_->all_gather(&count, counts.data(), 1, DType::i64).wait();
    const auto longest = static_cast<std::size_t>(*std::max_element(counts.begin(), counts.end()));
    std::vector<std::int32_t> mine(ran_), lists(longest * n);
    mine.resize(longest, -1);
    world_->all_gather(mine.data(), lists.data(), longest, DType::i32).wait();
    ran_.clear();
    std::size_t at = 0;
    auto same_at = [&](std::size_t i) {
      for (std::size_t r = 1; r < n; ++r)
        if (lists[r * longest + i] != lists[i]) return false;
      return true;
    };
    while (at < longest && same_at(at)) ++at;
    auto entry = [&](std::int32_t e) {
      return e < 0 ? std::string("nothing (its pass had ended)")
                   : std::string(e % 2 ? "the backward of '" : "the forward of '") + name(e / 2) + "'";
    };
    std::ostringstream os;
    os << "ranks ran units in different orders in this pass (checked as it ended, before any optimizer step; "
          "its gradients and outputs are wrong): at entry #"
       << at << ",";
    for (std::size_t r = 0; r < n; ++r) os << (r ? ";" : "") << " rank " << r << " ran " << entry(lists[r * longest + at]);
    os << " (seen on rank " << world_->rank() << "); every rank must run the same units in the same order";
    throw Error(ErrorKind::mismatch, os.str());
  }

  std::vector<std::int32_t> ran_;
  std::optional<CommRef> world_;
};

}  // namespace fsdp::detail
