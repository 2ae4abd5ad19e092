#pragma once
// CountingCommunicator<C>: wraps a communicator and counts each collective's calls and
// bytes, so tests and benchmarks can check what a strategy promises to send per step.
// Bytes are those of the full-size side of the call: the gathered output of an all_gather,
// the input of a reduce_scatter, the buffer of an all_reduce or broadcast.
#include <array>
#include <memory>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/tagged_calls.hpp"

namespace fsdp {

enum class Collective : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier };
inline constexpr std::size_t collective_kinds = 5;

struct CollectiveCounts {
  struct Entry {
    std::uint64_t calls = 0;
    std::uint64_t bytes = 0;
    friend bool operator==(const Entry&, const Entry&) = default;
  };
  std::array<Entry, collective_kinds> by_kind{};
  Entry& operator[](Collective c) { return by_kind[static_cast<std::size_t>(c)]; }
  const Entry& operator[](Collective c) const { return by_kind[static_cast<std::size_t>(c)]; }
  friend bool operator==(const CollectiveCounts&, const CollectiveCounts&) = default;
};

// The all-gathers and reductions, plain and tagged (tags pass through to a communicator
// that takes them, fsdp/core/collective_tag.hpp), come from detail::WrappedCollectives.
template <Communicator C>
class CountingCommunicator : public detail::WrappedCollectives<CountingCommunicator<C>, C> {
 public:
  explicit CountingCommunicator(C& inner) : inner_(&inner), counts_(std::make_shared<CollectiveCounts>()) {}

  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }

  Work broadcast(const void* s, void* r, std::size_t n, DType t, int root) {
    note(Collective::broadcast, n, t);
    return inner_->broadcast(s, r, n, t, root);
  }
  Work barrier() {
    note(Collective::barrier, 0, DType::u8);
    return inner_->barrier();
  }

  // Sub-communicators count into their own tallies (a mesh's shard and replicate groups
  // are told apart), and own the communicator they wrap.
  auto split(int color, int key)
    requires requires(C& c) { c.split(color, key); }
  {
    using Sub = decltype(inner_->split(color, key));
    return CountingCommunicator<Sub>(std::make_shared<Sub>(inner_->split(color, key)));
  }

  const CollectiveCounts& counts() const { return *counts_; }
  void reset() { *counts_ = {}; }

 private:
  template <Communicator>
  friend class CountingCommunicator;
  friend class detail::WrappedCollectives<CountingCommunicator, C>;
  explicit CountingCommunicator(std::shared_ptr<C> owned)
      : owned_(std::move(owned)), inner_(owned_.get()), counts_(std::make_shared<CollectiveCounts>()) {}

  Work gather(const void* s, void* r, std::size_t n, DType t, const CollectiveTag* tag) {
    note(Collective::all_gather, n * static_cast<std::size_t>(size()), t);
    return detail::all_gather(*inner_, s, r, n, t, tag);
  }
  Work scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) {
    note(Collective::reduce_scatter, n * static_cast<std::size_t>(size()), t);
    return detail::reduce_scatter(*inner_, s, r, n, t, op, tag);
  }
  Work reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) {
    note(Collective::all_reduce, n, t);
    return detail::all_reduce(*inner_, s, r, n, t, op, tag);
  }

  void note(Collective c, std::size_t elements, DType t) {
    auto& e = (*counts_)[c];
    ++e.calls;
    e.bytes += elements * size_of(t);
  }

  std::shared_ptr<C> owned_;
  C* inner_;
  std::shared_ptr<CollectiveCounts> counts_;
};

}  // namespace fsdp
