#pragma once
// An NcclComm collective in flight as the Work it returns: waited for on a CUDA stream
// (Work::wait_on, no host block) or polled from the host, both through the communicator's
// state (nccl_state.hpp), which it keeps alive.
#include <memory>

#include "fsdp/nccl/nccl_in_flight.hpp"
#include "fsdp/nccl/nccl_state.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp::detail {

// An issued collective as the Work it returns.
class NcclPending final : public Work::Pending {
 public:
  NcclPending(std::shared_ptr<NcclCommState> state, std::shared_ptr<NcclInFlight> f)
      : state_(std::move(state)), f_(std::move(f)) {}
  void wait() override {
    for (int spins = 0; !state_->poll(*f_); ++spins) cuda_poll_backoff(spins);  // poll throws past the timeout
  }
  bool ready() override { return state_->poll(*f_); }
  // A wait inside the nccl_group that issued it is refused; after the group it can wait.
  bool still_waitable() override { return state_->unlaunched(*f_); }
  // Any CUDA stream (of any device) can wait for the event; other queues cannot.
  bool enqueue_wait(const DeviceQueue& q) override {
    if (q.device.kind != DeviceKind::cuda) return false;
    state_->enqueue_wait(*f_, static_cast<cudaStream_t>(q.handle));
    return true;
  }

 private:
  std::shared_ptr<NcclCommState> state_;
  std::shared_ptr<NcclInFlight> f_;
};

}  // namespace fsdp::detail
