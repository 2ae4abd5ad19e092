#pragma once
// fsdp::nccl_group(f): the NcclComm collectives that f issues (on this thread) are launched
// together when it returns (ncclGroupStart / ncclGroupEnd), as NCCL requires when one
// thread drives several ranks (NcclComm::create) and as it fuses several collectives of
// one rank. Their Work may be waited on only after the group: each one's CUDA event is
// recorded once NCCL has launched it, so a wait inside the group is an fsdp::Error.
//
//   fsdp::nccl_group([&] { for (auto& c : comms) works.push_back(c.all_reduce(...)); });
//   for (auto& w : works) w.wait();
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/nccl/nccl_in_flight.hpp"
#include "fsdp/nccl/nccl_state.hpp"
#include "fsdp/nccl/nccl_types.hpp"

namespace fsdp {

class NcclGroup {
 public:
  NcclGroup() {
    if (detail::nccl_active_group)
      detail::fail("nccl_group: this thread is already inside one (groups here do not nest)");
    const ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) detail::fail("nccl_group: ncclGroupStart failed: ", detail::nccl_error_text(r));
    detail::nccl_active_group = &frame_;
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() {  // left by an exception: the group must still end, its communicators are aborted
    if (!open_) return;
    try {
      end();
    } catch (...) {
    }
  }

  // ncclGroupEnd, then waits (bounded by each communicator's timeout) until NCCL has
  // launched every collective of the group, and records their events.
  void end() {
    if (!open_) return;
    open_ = false;
    detail::nccl_active_group = nullptr;
    std::map<detail::NcclCommState*, std::size_t> issued;  // ordered: locks taken in one order
    for (auto& [state, f] : frame_.issued) ++issued[state.get()];
    std::vector<std::unique_lock<std::mutex>> locks;  // a watchdog must not abort during the launch
    for (auto& [state, n] : issued) locks.push_back(state->lock());
    const ncclResult_t r = ncclGroupEnd();
    std::string error;
    ErrorKind kind = detail::nccl_error_kind(r);
    if (r != ncclSuccess && r != ncclInProgress) error = "ncclGroupEnd failed: " + detail::nccl_error_text(r);
    for (auto& [state, n] : issued) {
      if (!error.empty() || !state->broken_locked().empty()) continue;
      const ncclResult_t s =
          detail::nccl_settle(state->comm_locked(), detail::NcclClock::now() + state->options.timeout);
      if (s == ncclInProgress) {
        error = state->where() + ": the collectives of an nccl_group were not launched within " +
                std::to_string(state->options.timeout.count()) + " ms after ncclGroupEnd (NcclCommOptions::timeout)";
        kind = ErrorKind::timeout;
      } else if (s != ncclSuccess) {
        error = state->where() + ": ncclGroupEnd failed: " + detail::nccl_error_text(s, state->comm_locked());
        kind = detail::nccl_error_kind(s);
      }
    }
    if (error.empty())
      for (auto& [state, f] : frame_.issued)
        if (state->broken_locked().empty()) state->record_locked(*f);
    for (auto& [state, n] : issued) {  // a communicator that broke meanwhile reports through its Work
      if (!error.empty()) state->abort_locked(error, ~std::uint64_t{0}, kind);
      state->group_ended_locked(n);
    }
    if (!error.empty()) detail::fail_as(kind, error);
  }

 private:
  detail::NcclGroupFrame frame_;
  bool open_ = true;
};

template <class F>
void nccl_group(F&& f) {
  NcclGroup group;
  std::forward<F>(f)();
  group.end();
}

}  // namespace fsdp
