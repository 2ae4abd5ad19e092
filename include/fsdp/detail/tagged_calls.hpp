#pragma once
// The all-gather and reductions of a communicator with a CollectiveTag when it takes one
// (TaggedCommunicator) and `tag` is set, else the plain call: how the library and the
// wrapping communicators (counting, asynchronous, staged) pass tags on without requiring
// them of a user's own Communicator.
#include <cstddef>

#include "fsdp/collective_tag.hpp"
#include "fsdp/communicator.hpp"

namespace fsdp::detail {

template <Communicator C>
Work all_gather(C& c, const void* s, void* r, std::size_t n, DType t, const CollectiveTag* tag) {
  if constexpr (TaggedCommunicator<C>)
    if (tag) return c.all_gather(s, r, n, t, *tag);
  return c.all_gather(s, r, n, t);
}

template <Communicator C>
Work reduce_scatter(C& c, const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) {
  if constexpr (TaggedCommunicator<C>)
    if (tag) return c.reduce_scatter(s, r, n, t, op, *tag);
  return c.reduce_scatter(s, r, n, t, op);
}

template <Communicator C>
Work all_reduce(C& c, const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) {
  if constexpr (TaggedCommunicator<C>)
    if (tag) return c.all_reduce(s, r, n, t, op, *tag);
  return c.all_reduce(s, r, n, t, op);
}

}  // namespace fsdp::detail
