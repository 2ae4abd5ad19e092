#pragma once
// Flat parameters (one per dtype in a unit): the unit's parameters back to back in one
// buffer, padded to a multiple of the group size N. Rank r owns elements [r*S, (r+1)*S)
// with S = padded / N. Padding sits only at the end, so the elements a rank owns that are
// real parameters form a prefix of its shard (`valid_shard_numel`).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

struct ParamInfo {
  std::string fqn;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  std::int64_t offset = 0;  // first element in the unsharded flat buffer
  std::vector<std::string> aliases;  // its other FQNs when tied (one tensor under several names)
};

// The part of one parameter that one rank's shard holds.
struct ShardSlice {
  std::int64_t param_begin = 0;   // first element within the parameter
  std::int64_t count = 0;         // elements (0: this rank holds none of it)
  std::int64_t shard_offset = 0;  // where they start within the rank's shard
};

class FlatParamLayout {
 public:
  FlatParamLayout(DType dtype, std::vector<ParamInfo> params, int world) : dtype_(dtype), params_(std::move(params)), world_(world) {
    if (world < 1) detail::fail("flat parameter: group size must be at least 1, got ", world);
    std::int64_t off = 0;
    for (auto& p : params_) { p.offset = off; off += p.numel; }
    numel_ = off;
    shard_numel_ = (numel_ + world - 1) / world;
    padded_numel_ = shard_numel_ * world;
  }

  DType dtype() const { return dtype_; }
  int world() const { return world_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  std::int64_t numel() const { return numel_; }
  std::int64_t padded_numel() const { return padded_numel_; }
  std::int64_t shard_numel() const { return shard_numel_; }
  std::size_t shard_bytes() const { return static_cast<std::size_t>(shard_numel_) * size_of(dtype_); }
  std::size_t padded_bytes() const { return static_cast<std::size_t>(padded_numel_) * size_of(dtype_); }

  // Real (non-padding) elements of rank r's shard; they are its first ones.
  std::int64_t valid_shard_numel(int rank) const {
    return std::clamp<std::int64_t>(numel_ - rank * shard_numel_, 0, shard_numel_);
  }

  ShardSlice slice(std::size_t param, int rank) const {
    const auto& p = params_.at(param);
    const std::int64_t lo = std::max(p.offset, rank * shard_numel_);
    const std::int64_t hi = std::min(p.offset + p.numel, (rank + 1) * shard_numel_);
    if (hi <= lo) return {};
    return {lo - p.offset, hi - lo, lo - rank * shard_numel_};
  }

 private:
  DType dtype_;
  std::vector<ParamInfo> params_;
  int world_;
  std::int64_t numel_ = 0, padded_numel_ = 0, shard_numel_ = 0;
};

}  // namespace fsdp
