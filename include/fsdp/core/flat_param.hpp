#pragma once
// Flat parameters (one per dtype in a unit): the unit's parameters in one buffer, padded
// to a multiple of the group size N. Rank r owns elements [r*S, (r+1)*S) with S = padded / N.
// How the buffer is cut is the ShardLayout: element_flat (the default) lays the parameters
// back to back and pads only at the end; block_aligned(K) starts every parameter on a
// multiple of K elements and makes S one too, so every shard boundary falls on a multiple of
// K of every parameter (a K-element scale block of a parameter is never split between
// ranks); param_atomic(K) puts each parameter whole on one rank, the ranks balanced by
// a greedy planner (largest first, onto the least loaded rank), S the largest rank's
// load. Each way a rank's elements after its last real one are padding
// (`valid_shard_numel` counts up to it); the gaps between parameters are padding too,
// held at zero.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"

namespace fsdp {

// The part of one parameter that one rank's shard holds.
struct ShardSlice {
  std::int64_t param_begin = 0;   // first element within the parameter
  std::int64_t count = 0;         // elements (0: this rank holds none of it)
  std::int64_t shard_offset = 0;  // where they start within the rank's shard
};

// How a unit's flat parameters are cut into shards (ShardOptions::shard_layout).
struct ShardLayout {
  enum class Kind : std::uint8_t { element_flat, block_aligned, param_atomic };
  Kind kind = Kind::element_flat;
  std::int64_t block = 1;  // the K of block_aligned and param_atomic (1 under element_flat)

  static constexpr ShardLayout element_flat() { return {}; }
  static constexpr ShardLayout block_aligned(std::int64_t k) { return {Kind::block_aligned, k}; }
  // Each parameter whole on one rank, starting on a multiple of K elements there.
  static constexpr ShardLayout param_atomic(std::int64_t k = 1) { return {Kind::param_atomic, k}; }
  // The alignment in elements that the layout asks of parameters and shards.
  constexpr std::int64_t alignment() const { return block; }
  // Whether where a parameter lies depends on the other parameters' sizes one by one (not
  // only on their sum): the memory planner then needs them listed.
  constexpr bool depends_on_each_size() const { return kind == Kind::param_atomic || block > 1; }
  friend bool operator==(const ShardLayout&, const ShardLayout&) = default;

  // The largest K: padding stays below K elements per parameter, and offsets far from overflow.
  static constexpr std::int64_t max_block = std::int64_t{1} << 24;
};

// "flat", "block:K", "param" or "param:K", as --shard-layout takes it.
inline std::string name_of(const ShardLayout& l) {
  if (l.kind == ShardLayout::Kind::block_aligned) return "block:" + std::to_string(l.block);
  if (l.kind == ShardLayout::Kind::param_atomic) return l.block == 1 ? "param" : "param:" + std::to_string(l.block);
  return "flat";
}

namespace detail {
// Refuses a layout that means nothing, naming `what` (the option or flag).
inline void check_shard_layout(const ShardLayout& l, std::string_view what) {
  if (l.kind != ShardLayout::Kind::element_flat && l.kind != ShardLayout::Kind::block_aligned &&
      l.kind != ShardLayout::Kind::param_atomic)
    fail(what, " is not a layout (the value ", static_cast<int>(l.kind), "): use ShardLayout::element_flat(), ",
         "block_aligned(K) or param_atomic()");
  if (l.kind == ShardLayout::Kind::element_flat && l.block != 1)
    fail(what, ": an element-flat layout has no block (got ", l.block, "): use ShardLayout::block_aligned(", l.block, ")");
  if (l.block < 1 || l.block > ShardLayout::max_block)
    fail(what, ": the block must be in [1, ", ShardLayout::max_block, "] elements, got ", l.block);
}
}  // namespace detail

// "flat", "block:K", "param" or "param:K" (K a whole number in [1, 2^24]), strictly: what
// --shard-layout reads.
inline ShardLayout parse_shard_layout(std::string_view text, std::string_view what = "shard layout") {
  auto block = [&](std::size_t prefix) {
    return detail::parse_integer<std::int64_t>(text.substr(prefix), what, 1, ShardLayout::max_block);
  };
  if (text == "flat") return ShardLayout::element_flat();
  if (text == "param") return ShardLayout::param_atomic();
  if (text.starts_with("block:")) return ShardLayout::block_aligned(block(6));
  if (text.starts_with("param:")) return ShardLayout::param_atomic(block(6));
  detail::fail(what, ": '", text, "' is not a layout; write flat, block:K (K elements, e.g. block:128), param or param:K");
}

struct ParamInfo {
  std::string fqn;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  std::int64_t offset = 0;  // first element in the unsharded flat buffer
  std::vector<std::string> aliases;  // its other FQNs when tied (one tensor under several names)
};


class FlatParamLayout {
 public:
  FlatParamLayout(DType dtype, std::vector<ParamInfo> params, int world, ShardLayout layout = {})
      : dtype_(dtype), params_(std::move(params)), world_(world), layout_(layout) {
    if (world < 1) detail::fail("flat parameter: group size must be at least 1, got ", world);
    detail::check_shard_layout(layout, "flat parameter: shard layout");
    const std::int64_t k = layout.alignment();
    constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 4;  // room for the roundings below
    auto round_up = [k](std::int64_t n) { return (n + k - 1) / k * k; };
    std::int64_t off = 0;  // the parameters' aligned sizes, summed: what element_flat or block_aligned spans
    for (auto& p : params_) {
      if (p.numel < 0 || p.numel > limit - off - k) detail::fail("flat parameter: '", p.fqn, "' has ", p.numel, " elements, too many");
      p.offset = round_up(off);
      off = p.offset + p.numel;
      real_numel_ += p.numel;
    }
    if (layout.kind == ShardLayout::Kind::param_atomic) {
      place_whole_parameters(k);
      return;
    }
    numel_ = off;
    shard_numel_ = round_up((numel_ + world - 1) / world);
    padded_numel_ = shard_numel_ * world;
  }

  DType dtype() const { return dtype_; }
  int world() const { return world_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const ShardLayout& layout() const { return layout_; }
  // Elements from the buffer's start to the end of the parameter that ends last: the
  // parameters', and the gaps between them (none under element_flat).
  std::int64_t numel() const { return numel_; }
  // Whether the parameters lie back to back in their order from the buffer's start (no
  // gaps, none moved): always under element_flat.
  bool back_to_back() const {
    std::int64_t at = 0;
    for (const auto& p : params_) {
      if (p.offset != at) return false;
      at += p.numel;
    }
    return true;
  }
  // The parameters' own elements (numel() without the gaps).
  std::int64_t param_numel() const { return real_numel_; }
  std::int64_t padded_numel() const { return padded_numel_; }
  std::int64_t shard_numel() const { return shard_numel_; }
  std::size_t shard_bytes() const { return static_cast<std::size_t>(shard_numel_) * size_of(dtype_); }
  std::size_t padded_bytes() const { return static_cast<std::size_t>(padded_numel_) * size_of(dtype_); }

  // Rank r's elements up to its last real (non-padding) one; after them its shard holds
  // only padding.
  std::int64_t valid_shard_numel(int rank) const {
    if (layout_.kind == ShardLayout::Kind::element_flat) return std::clamp<std::int64_t>(numel_ - rank * shard_numel_, 0, shard_numel_);
    std::int64_t end = 0;  // a shard may end inside a gap between parameters
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (const ShardSlice s = slice(i, rank); s.count > 0) end = std::max(end, s.shard_offset + s.count);
    return end;
  }

  // The elements of rank r's shard that belong to parameters; the rest of its
  // shard_numel() is padding (or gaps between parameters).
  std::int64_t param_numel_on(int rank) const {
    std::int64_t held = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) held += slice(i, rank).count;
    return held;
  }

  ShardSlice slice(std::size_t param, int rank) const {
    const auto& p = params_.at(param);
    const std::int64_t lo = std::max(p.offset, rank * shard_numel_);
    const std::int64_t hi = std::min(p.offset + p.numel, (rank + 1) * shard_numel_);
    if (hi <= lo) return {};
    return {lo - p.offset, hi - lo, lo - rank * shard_numel_};
  }

 private:
  // param_atomic: the largest parameter first, each onto the rank with the least elements
  // so far (the lowest rank on a tie), sizes rounded up to k; S is the largest rank's load.
  // Within its rank's range the parameters keep their order. Every rank computes the same.
  void place_whole_parameters(std::int64_t k) {
    auto aligned = [k](const ParamInfo& p) { return (p.numel + k - 1) / k * k; };
    std::vector<std::size_t> order(params_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return aligned(params_[a]) > aligned(params_[b]); });
    std::vector<std::int64_t> load(static_cast<std::size_t>(world_), 0);
    std::vector<int> owner(params_.size(), 0);
    for (std::size_t i : order) {
      const auto least = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owner[i] = static_cast<int>(least);
      load[least] += aligned(params_[i]);
    }
    shard_numel_ = *std::max_element(load.begin(), load.end());
    padded_numel_ = detail::checked_product<std::int64_t>(shard_numel_, world_, "flat parameter: the padded elements");
    std::vector<std::int64_t> next(static_cast<std::size_t>(world_));
    for (int r = 0; r < world_; ++r) next[static_cast<std::size_t>(r)] = r * shard_numel_;
    numel_ = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& at = next[static_cast<std::size_t>(owner[i])];
      params_[i].offset = at;
      at += aligned(params_[i]);
      numel_ = std::max(numel_, params_[i].offset + params_[i].numel);
    }
  }

  DType dtype_;
  std::vector<ParamInfo> params_;
  int world_;
  ShardLayout layout_;
  std::int64_t numel_ = 0, padded_numel_ = 0, shard_numel_ = 0, real_numel_ = 0;
};

}  // namespace fsdp
