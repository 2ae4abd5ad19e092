#pragma once
// FaultyComm<Inner>: any communicator, except that its collective number `at` (from 1) on
// this rank throws, or sleeps for `stall` before it is issued (past the peers' timeout);
// at < 1: never. Tags pass through to an Inner that takes them. Groups split from it (a
// device mesh's) count with it: `at` numbers this rank's collectives on all of them.
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <fsdp/fsdp.hpp>

#include "fsdp/core/detail/tagged_calls.hpp"

namespace test_support {

enum class FaultMode { fail, stall };

struct Fault {
  long at = 0;
  FaultMode mode = FaultMode::fail;
  std::chrono::milliseconds stall{0};
};

template <fsdp::Communicator Inner>
class FaultyComm : public fsdp::detail::WrappedCollectives<FaultyComm<Inner>, Inner> {
 public:
  FaultyComm(Inner& inner, Fault fault) : inner_(&inner), state_(std::make_shared<State>(State{fault})) {}

  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  // Collectives this rank issued (or tried to) on this communicator and its groups.
  long issued() const { return state_->count; }

  fsdp::Work broadcast(const void* s, void* r, std::size_t n, fsdp::DType t, int root) {
    return next(), inner_->broadcast(s, r, n, t, root);
  }
  fsdp::Work barrier() { return next(), inner_->barrier(); }

  auto split(int color, int key)
    requires requires(Inner& c) { c.split(color, key); }
  {
    using Sub = decltype(inner_->split(color, key));
    return FaultyComm<Sub>(std::make_shared<Sub>(inner_->split(color, key)), state_);
  }

 private:
  struct State {
    Fault fault;
    long count = 0;
  };
  template <fsdp::Communicator>
  friend class FaultyComm;
  friend class fsdp::detail::WrappedCollectives<FaultyComm, Inner>;

  FaultyComm(std::shared_ptr<Inner> owned, std::shared_ptr<State> state)
      : owned_(std::move(owned)), inner_(owned_.get()), state_(std::move(state)) {}

  fsdp::Work gather(const void* s, void* r, std::size_t n, fsdp::DType t, const fsdp::CollectiveTag* tag) {
    return next(), fsdp::detail::all_gather(*inner_, s, r, n, t, tag);
  }
  fsdp::Work scatter(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op,
                     const fsdp::CollectiveTag* tag) {
    return next(), fsdp::detail::reduce_scatter(*inner_, s, r, n, t, op, tag);
  }
  fsdp::Work reduce(const void* s, void* r, std::size_t n, fsdp::DType t, fsdp::ReduceOp op,
                    const fsdp::CollectiveTag* tag) {
    return next(), fsdp::detail::all_reduce(*inner_, s, r, n, t, op, tag);
  }

  void next() {
    const Fault& f = state_->fault;
    if (++state_->count != f.at) return;
    if (f.mode == FaultMode::fail)
      fsdp::detail::fail("injected failure of collective #", f.at);
    std::this_thread::sleep_for(f.stall);
  }

  std::shared_ptr<Inner> owned_;  // a split group's
  Inner* inner_;
  std::shared_ptr<State> state_;
};

}  // namespace test_support
