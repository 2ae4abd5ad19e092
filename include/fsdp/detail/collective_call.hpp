#pragma once
// A collective call as every backend describes it: which collective, its shape, and its
// per-rank sequence number, so that messages read "all_gather(count=4, dtype=f32) as
// collective #7" on every backend. Also the one definition of what avg means.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include "fsdp/communicator.hpp"
#include "fsdp/detail/host_math.hpp"

namespace fsdp::detail {

enum class CollectiveKind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier };

inline std::string_view name_of(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::barrier: return "barrier";
  }
  return "?";
}

struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  std::uint64_t seq = 0;  // per-rank call number, for messages

  bool same_shape(const CollectiveCall& o) const {
    return kind == o.kind && count == o.count && dtype == o.dtype && op == o.op && root == o.root;
  }
  std::string describe() const {
    std::ostringstream os;
    os << name_of(kind);
    if (kind != CollectiveKind::barrier) os << "(count=" << count << ", dtype=" << fsdp::name_of(dtype);
    if (kind == CollectiveKind::reduce_scatter || kind == CollectiveKind::all_reduce) os << ", op=" << fsdp::name_of(op);
    if (kind == CollectiveKind::broadcast) os << ", root=" << root;
    if (kind != CollectiveKind::barrier) os << ")";
    os << " as collective #" << seq;
    return os.str();
  }
};

// The last step of ReduceOp::avg on the sum of `ranks` contributions: floats are
// multiplied by 1/ranks (rounded in the dtype, as a kernel would); integers are divided by
// ranks, truncating, as NCCL's ncclAvg does (a factor 1/ranks would truncate to 0).
inline void finish_avg(void* sum, std::size_t n, DType t, int ranks) {
  if (is_floating(t)) {
    host_scale(sum, n, t, 1.0 / ranks);
    return;
  }
  for_each_typed(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* a = static_cast<T*>(sum);
    for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<T>(a[i] / ranks);
  });
}

}  // namespace fsdp::detail
