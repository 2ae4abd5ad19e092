#pragma once
// ReadPlanner: which reads bring elements [begin, begin + count) of a checkpointed tensor
// into memory. A rank of any world size asks for exactly the range it owns and gets, in
// order, one step per file tensor that holds part of it; the steps cover the range
// exactly, whatever number of ranks wrote the checkpoint. Also the index checks behind
// CheckpointIndex::validate() and check_complete(), which share the planner's tables.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checkpoint_index_types.hpp"
#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

// Copy `count` elements starting at element `src_offset` of tensor `key` in `file` to
// element `dst_offset` of the requested range.
struct ReadStep {
  std::string file;
  std::string key;
  std::uint64_t src_offset = 0;
  std::uint64_t count = 0;
  std::uint64_t dst_offset = 0;
};

namespace detail {

[[noreturn]] inline void fail_gap(const std::string& source, const StateKey& id, std::uint64_t a, std::uint64_t b) {
  fail_as(ErrorKind::corrupt, "checkpoint '", source, "': elements [", a, ", ", b, ") of ", id.describe(),
          " are in no file");
}

// Entries by id and each tensor's slices with elements, sorted by begin (indexes into the
// index's vectors), built with every check of CheckpointIndex::validate().
struct SliceTable {
  std::map<StateKey, std::size_t> entry;
  std::map<StateKey, std::vector<std::size_t>> slices;

  explicit SliceTable(const CheckpointIndex& ix) {
    const std::string& src = ix.source;
    if (ix.world_size < 1)
      fail_as(ErrorKind::corrupt, "checkpoint '", src, "': world_size ", ix.world_size, " must be at least 1");
    std::set<std::string_view> files;
    for (const IndexFile& f : ix.files) {
      check_file_name(f.name, src);
      if (!files.insert(f.name).second)
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': file '", f.name, "' is listed twice");
    }
    for (std::size_t i = 0; i < ix.entries.size(); ++i) {
      const IndexEntry& e = ix.entries[i];
      const std::string what = e.id.describe();
      if (e.id.fqn.empty()) fail_as(ErrorKind::corrupt, "checkpoint '", src, "': an entry has an empty fqn");
      if ((e.id.kind == StateKind::optim) == e.id.state.empty())
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': entry ", what,
                ": a state name is required for kind \"optim\" and only for it");
      if (!checked_bytes(e.shape, e.dtype))
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': entry ", what, ": shape ", format_shape(e.shape),
                " is negative or overflows");
      if (!entry.emplace(e.id, i).second)
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': entry ", what, " is listed twice");
    }
    std::set<std::pair<std::string_view, std::string_view>> keys;
    for (std::size_t i = 0; i < ix.slices.size(); ++i) {
      const IndexSlice& s = ix.slices[i];
      const std::string where = "slice of " + s.id.describe() + " in file '" + s.file + "' (key '" + s.key + "')";
      const auto e = entry.find(s.id);
      if (e == entry.end())
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': ", where, ": no entry for that tensor");
      if (files.count(s.file) == 0)
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': ", where, ": the file is not in \"files\"");
      if (s.key.empty()) fail_as(ErrorKind::corrupt, "checkpoint '", src, "': ", where, ": the key is empty");
      const std::uint64_t numel = *checked_numel(ix.entries[e->second].shape);
      if (s.begin > numel || s.count > numel - s.begin)
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': ", where, ": elements [", s.begin, ", +", s.count,
                ") are outside the tensor's ", numel, " elements");
      if (!keys.emplace(s.file, s.key).second)
        fail_as(ErrorKind::corrupt, "checkpoint '", src, "': ", where,
                ": another slice uses the same key of the same file");
      // A count-0 slice (a saving rank that holds none of the tensor) holds no element:
      // checked like any slice, then left out of the tables that place elements.
      if (s.count > 0) slices[s.id].push_back(i);
    }
    for (auto& [id, list] : slices) {
      std::sort(list.begin(), list.end(), [&](std::size_t a, std::size_t b) { return ix.slices[a].begin < ix.slices[b].begin; });
      for (std::size_t k = 1; k < list.size(); ++k) {
        const IndexSlice& p = ix.slices[list[k - 1]];
        const IndexSlice& s = ix.slices[list[k]];
        if (s.begin < p.begin + p.count)
          fail_as(ErrorKind::corrupt, "checkpoint '", src, "': slices of ", id.describe(), " overlap: [", p.begin, ", ",
                  p.begin + p.count, ") in file '", p.file, "' and [", s.begin, ", ", s.begin + s.count, ") in file '",
                  s.file, "'");
      }
    }
  }
};

}  // namespace detail

inline void CheckpointIndex::validate() const { detail::SliceTable{*this}; }

inline void CheckpointIndex::check_complete() const {
  const detail::SliceTable table(*this);
  for (const auto& [id, e] : table.entry) {
    const std::uint64_t numel = *detail::checked_numel(entries[e].shape);
    std::uint64_t at = 0;
    if (auto it = table.slices.find(id); it != table.slices.end()) {
      for (std::size_t i : it->second) {
        if (slices[i].begin > at) detail::fail_gap(source, id, at, slices[i].begin);
        at = slices[i].begin + slices[i].count;
      }
    }
    if (at < numel) detail::fail_gap(source, id, at, numel);
  }
}

class ReadPlanner {
 public:
  // Validates the index (see CheckpointIndex::validate; completeness is checked per plan).
  explicit ReadPlanner(CheckpointIndex index) : index_(std::move(index)), table_(index_) {}

  const CheckpointIndex& index() const { return index_; }

  // The entry for `id`; an error naming the index and the tensor if there is none.
  const IndexEntry& entry(const StateKey& id) const {
    const auto it = table_.entry.find(id);
    if (it == table_.entry.end()) detail::fail("checkpoint '", index_.source, "': no entry for ", id.describe());
    return index_.entries[it->second];
  }

  // The reads that bring elements [begin, begin + count) of `id`, in order; none for
  // count 0. A range outside the tensor or an element no slice holds is an error.
  std::vector<ReadStep> plan(const StateKey& id, std::uint64_t begin, std::uint64_t count) const {
    const IndexEntry& e = entry(id);
    const std::uint64_t numel = *detail::checked_numel(e.shape);
    if (begin > numel || count > numel - begin)
      detail::fail("checkpoint '", index_.source, "': elements [", begin, ", +", count, ") of ", id.describe(),
                   " are outside its ", numel, " elements (shape ", detail::format_shape(e.shape), ")");
    std::vector<ReadStep> steps;
    if (count == 0) return steps;
    static const std::vector<std::size_t> none;
    const auto found = table_.slices.find(id);
    const std::vector<std::size_t>& list = found == table_.slices.end() ? none : found->second;
    auto slice = [&](std::size_t k) -> const IndexSlice& { return index_.slices[list[k]]; };
    const std::uint64_t end = begin + count;
    std::uint64_t at = begin;
    // The first slice that starts after `at`, or the one before it if that covers `at`.
    std::size_t k = static_cast<std::size_t>(
        std::upper_bound(list.begin(), list.end(), at, [&](std::uint64_t v, std::size_t i) { return v < index_.slices[i].begin; }) -
        list.begin());
    if (k > 0 && slice(k - 1).begin + slice(k - 1).count > at) --k;
    while (at < end) {
      if (k == list.size() || slice(k).begin > at)
        detail::fail_gap(index_.source, id, at, k == list.size() ? end : std::min(end, slice(k).begin));
      const IndexSlice& s = slice(k);
      const std::uint64_t n = std::min(end, s.begin + s.count) - at;
      steps.push_back({s.file, s.key, at - s.begin, n, at - begin});
      at += n;
      ++k;
    }
    return steps;
  }

 private:
  CheckpointIndex index_;
  detail::SliceTable table_;
};

}  // namespace fsdp::checkpoint
