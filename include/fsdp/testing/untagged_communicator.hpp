#pragma once
// UntaggedCommunicator<C>: the communicator C without its tagged calls, so the library
// checks unit order once per pass (one 8-byte all-gather as each pass ends) instead of at
// every all-gather and reduction (fsdp/core/collective_tag.hpp). How the per-collective check
// is turned off, and what bench/overhead compares it with; rarely needed, as it costs
// next to nothing (docs/reliability.md).
#include <cstddef>
#include <memory>
#include <utility>

#include "fsdp/core/communicator.hpp"

namespace fsdp {

template <Communicator C>
class UntaggedCommunicator {
 public:
  explicit UntaggedCommunicator(C& inner) : inner_(&inner) {}

  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  Work all_gather(const void* s, void* r, std::size_t n, DType t) { return inner_->all_gather(s, r, n, t); }
  Work reduce_scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op) {
    return inner_->reduce_scatter(s, r, n, t, op);
  }
  Work all_reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op) {
    return inner_->all_reduce(s, r, n, t, op);
  }
  Work broadcast(const void* s, void* r, std::size_t n, DType t, int root) { return inner_->broadcast(s, r, n, t, root); }
  Work barrier() { return inner_->barrier(); }

  // Sub-groups (for DeviceMesh) are untagged too, and own the communicator they wrap.
  auto split(int color, int key)
    requires requires(C& c) { c.split(color, key); }
  {
    using Sub = decltype(inner_->split(color, key));
    return UntaggedCommunicator<Sub>(std::make_shared<Sub>(inner_->split(color, key)));
  }

 private:
  template <Communicator>
  friend class UntaggedCommunicator;
  explicit UntaggedCommunicator(std::shared_ptr<C> owned) : owned_(std::move(owned)), inner_(owned_.get()) {}

  std::shared_ptr<C> owned_;
  C* inner_;
};

}  // namespace fsdp
