#pragma once
// StateSource: where a load reads from — a full state dict in memory, the sharded state
// dicts of N ranks, or checkpoint files — as element ranges of flattened tensors, so a
// model on any number of ranks reads exactly the slices it owns, whatever wrote them.
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/state_dict.hpp"
#include "fsdp/checkpoint/state_key.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

struct TensorMeta {
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
};

// One range a load stages: elements [begin, begin + count) of `key` into host memory `dst`.
struct ReadRequest {
  StateKey key;
  std::int64_t begin = 0, count = 0;
  void* dst = nullptr;
};

class StateSource {
 public:
  virtual ~StateSource() = default;
  virtual std::string name() const = 0;  // for messages: "checkpoint /path" or "full state dict"
  virtual std::optional<TensorMeta> find(const StateKey& key) const = 0;
  // Elements [begin, begin + count) of the flattened tensor into host memory `dst`.
  virtual void read(const StateKey& key, std::int64_t begin, std::int64_t count, void* dst) const = 0;
  virtual std::vector<StateKey> keys() const = 0;
  virtual std::map<std::string, std::string> optim_scalars() const = 0;

  // A load's reads on `rank` of `ranks` loading together (load_state calls it once on
  // every rank): every request read. A source with checksums may split verifying them
  // among the ranks; agree_damage() then tells every rank what any rank found.
  virtual void read_all(std::span<const ReadRequest> requests, int /*rank*/, int /*ranks*/) const {
    for (const ReadRequest& r : requests)
      if (r.count) read(r.key, r.begin, r.count, r.dst);
  }
  // Whether, once find() has checked every key and verify() and agree_damage() found no
  // damage, a read can fail only through an I/O error. load_state then reads straight into
  // the model (no host staging) unless LoadOptions::stage_in_host_memory.
  virtual bool reads_in_place() const { return false; }
  // Before such a load's agreement: this rank's share of the checksum work (the same split
  // as read_all's), so that damage is found before anything is written; a source without
  // checksums may read ahead here instead (an I/O error then also comes before the agreement).
  virtual void verify(int /*rank*/, int /*ranks*/) const {}
  // A collective after read_all on every rank (also where it threw): "" when no rank found a
  // damaged file, else the same message naming one on every rank. `agree` is
  // Unit::all_ranks_agree.
  virtual std::string agree_damage(const std::function<bool(bool)>& /*agree*/) const { return ""; }

 protected:
  // The checks of a read of a file source: the key is there (`found`), the range not negative.
  void check_read(bool found, const StateKey& key, std::int64_t begin, std::int64_t count) const {
    if (!found) detail::fail(name(), ": no ", key.describe());
    if (begin < 0 || count < 0) detail::fail(name(), ": ", key.describe(), ": negative range [", begin, ", +", count, ")");
  }
};

// A full state dict held in memory.
class FullStateDictSource final : public StateSource {
 public:
  explicit FullStateDictSource(const FullStateDict& sd) : sd_(sd) {}
  std::string name() const override { return "full state dict"; }
  std::optional<TensorMeta> find(const StateKey& key) const override {
    const StateTensor* t = lookup(key);
    if (!t) return std::nullopt;
    return TensorMeta{t->dtype, t->shape};
  }
  void read(const StateKey& key, std::int64_t begin, std::int64_t count, void* dst) const override {
    const StateTensor* t = lookup(key);
    if (!t) detail::fail(name(), ": no ", key.describe());
    const auto esize = size_of(t->dtype);
    if (begin < 0 || count < 0 || begin + count > t->numel() ||
        t->data.size() != static_cast<std::size_t>(t->numel()) * esize)
      detail::fail(name(), ": ", key.describe(), " holds ", t->data.size(), " bytes; elements [", begin, ", ",
                   begin + count, ") of a ", t->numel(), "-element ", name_of(t->dtype), " tensor were asked for");
    if (count) std::memcpy(dst, t->data.data() + begin * esize, static_cast<std::size_t>(count) * esize);
  }
  std::vector<StateKey> keys() const override {
    std::vector<StateKey> out;
    for (auto& [fqn, t] : sd_.tensors) out.push_back(StateKey::param(fqn));  // param or buffer: see lookup
    for (auto& [state, m] : sd_.optim)
      for (auto& [fqn, t] : m) out.push_back(StateKey::optim(fqn, state));
    return out;
  }
  std::map<std::string, std::string> optim_scalars() const override { return sd_.optim_scalars; }

 private:
  // Parameters and buffers share one FQN namespace in a full state dict.
  const StateTensor* lookup(const StateKey& key) const {
    if (key.kind == StateKind::optim) {
      auto s = sd_.optim.find(key.state);
      if (s == sd_.optim.end()) return nullptr;
      auto it = s->second.find(key.fqn);
      return it == s->second.end() ? nullptr : &it->second;
    }
    auto it = sd_.tensors.find(key.fqn);
    return it == sd_.tensors.end() ? nullptr : &it->second;
  }
  const FullStateDict& sd_;
};

// The sharded state dicts of every rank that saved (any number): a read of a range takes
// each part from the slice that holds it; a part no slice holds is an error.
class ShardedStateDictsSource final : public StateSource {
 public:
  explicit ShardedStateDictsSource(const std::vector<ShardedStateDict>& dicts) {
    for (auto& d : dicts) {
      for (auto& s : d.slices) {
        auto& e = entries_[s.id];
        if (!e.slices.empty() && (e.meta.dtype != s.dtype || e.meta.shape != s.shape))
          detail::fail_as(ErrorKind::mismatch, "sharded state dicts disagree on the dtype or shape of ",
                          s.id.describe());
        e.meta = {s.dtype, s.shape};
        e.slices.push_back(&s);
      }
      if (scalars_.empty()) scalars_ = d.optim_scalars;
    }
  }
  std::string name() const override { return "sharded state dicts"; }
  std::optional<TensorMeta> find(const StateKey& key) const override {
    auto it = entries_.find(key);
    if (it == entries_.end()) return std::nullopt;
    return it->second.meta;
  }
  void read(const StateKey& key, std::int64_t begin, std::int64_t count, void* dst) const override {
    auto it = entries_.find(key);
    if (it == entries_.end()) detail::fail(name(), ": no ", key.describe());
    const auto esize = size_of(it->second.meta.dtype);
    std::int64_t covered = 0;
    for (const StateSlice* s : it->second.slices) {
      const std::int64_t lo = std::max(begin, s->begin), hi = std::min(begin + count, s->begin + s->count);
      if (hi <= lo) continue;
      std::memcpy(static_cast<std::byte*>(dst) + (lo - begin) * esize, s->data.data() + (lo - s->begin) * esize,
                  static_cast<std::size_t>(hi - lo) * esize);
      covered += hi - lo;
    }
    if (covered != count)  // slices of one tensor never overlap, so a shortfall is a gap
      detail::fail(name(), ": elements [", begin, ", ", begin + count, ") of ", key.describe(),
                   " are not all in any slice (", covered, " of ", count, " found)");
  }
  std::vector<StateKey> keys() const override {
    std::vector<StateKey> out;
    for (auto& [k, e] : entries_) out.push_back(k);
    return out;
  }
  std::map<std::string, std::string> optim_scalars() const override { return scalars_; }

 private:
  struct Entry {
    TensorMeta meta;
    std::vector<const StateSlice*> slices;
  };
  std::map<StateKey, Entry> entries_;
  std::map<std::string, std::string> scalars_;
};

}  // namespace fsdp
