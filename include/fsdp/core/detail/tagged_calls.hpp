#pragma once
// The all-gather and reductions of a communicator with a CollectiveTag when it takes one
// (TaggedCommunicator) and `tag` is set, else the plain call: how the library and the
// wrapping communicators (counting, asynchronous, staged) pass tags on without requiring
// them of a user's own Communicator. WrappedCollectives gives those wrappers their public
// calls, plain and tagged, over one private function per collective.
#include <cstddef>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"

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

// The all-gather and reductions of a communicator wrapping a C, plain and (where C takes
// them) tagged, each forwarded to the wrapper's gather / scatter / reduce(..., tag), `tag`
// null when untagged. The wrapper derives from it and befriends it.
template <class Wrapper, class C>
class WrappedCollectives {
 public:
  Work all_gather(const void* s, void* r, std::size_t n, DType t) { return self().gather(s, r, n, t, nullptr); }
  Work reduce_scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op) {
    return self().scatter(s, r, n, t, op, nullptr);
  }
  Work all_reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op) {
    return self().reduce(s, r, n, t, op, nullptr);
  }
  Work all_gather(const void* s, void* r, std::size_t n, DType t, const CollectiveTag& tag)
    requires TaggedCommunicator<C>
  {
    return self().gather(s, r, n, t, &tag);
  }
  Work reduce_scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag& tag)
    requires TaggedCommunicator<C>
  {
    return self().scatter(s, r, n, t, op, &tag);
  }
  Work all_reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag& tag)
    requires TaggedCommunicator<C>
  {
    return self().reduce(s, r, n, t, op, &tag);
  }

 private:
  Wrapper& self() { return static_cast<Wrapper&>(*this); }
};

}  // namespace fsdp::detail
