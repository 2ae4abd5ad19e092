#pragma once
// StagedCommunicator: runs a host communicator's collectives on buffers of any memory a
// Device can copy, by staging them through host memory. It is what lets thread ranks
// (ThreadComm), or any CPU transport, drive sharded training whose buffers live on a
// GPU: several ranks on one GPU in one process, for tests and for machines without NCCL.
//
// Each collective: copy the send buffer to host behind the device's queued work (which
// may still be writing it) and wait, run the host collective, copy the result back and
// wait again (the caller may read the result on the host, as the library does with its
// own small collectives). So collectives complete inside the call and
// overlap nothing; NCCL is the fast path on a GPU. Pointers may be device memory, pinned
// or plain host memory: the Device's copy handles every direction.
//
// The staging buffers are the communicator's own, like NCCL's internal buffers, and are
// not counted in the Device's memory statistics. They grow to the largest collective
// seen and are kept for reuse. One StagedCommunicator per rank, used by one thread.
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/tagged_calls.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

// The all-gathers and reductions, plain and tagged (tags pass through to a communicator
// that takes them, fsdp/core/collective_tag.hpp), come from detail::WrappedCollectives.
template <Communicator C, Device D>
class StagedCommunicator : public detail::WrappedCollectives<StagedCommunicator<C, D>, C> {
 public:
  StagedCommunicator(C& comm, D& device) : comm_(&comm), device_(&device) {}

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }

  Work broadcast(const void* send, void* recv, std::size_t count, DType t, int root) {
    const std::size_t bytes = count * size_of(t);
    // Only the root's send buffer is read (others may pass null, as with NCCL).
    const bool root_here = rank() == root;
    return stage(root_here ? send : nullptr, root_here ? bytes : 0, recv, bytes,
                 [&](const void* s, void* r) { return comm_->broadcast(s, r, count, t, root); });
  }
  Work barrier() {
    device_->synchronize();  // a barrier also orders this rank's queued device work before it
    return comm_->barrier();
  }

  // Sub-groups (for DeviceMesh) stage through the same device.
  auto split(int color, int key)
    requires requires(C& c) { c.split(color, key); }
  {
    using Group = decltype(std::declval<C&>().split(color, key));
    auto owned = std::make_shared<Group>(comm_->split(color, key));
    return StagedCommunicator<Group, D>(std::move(owned), *device_);
  }

 private:
  template <Communicator, Device> friend class StagedCommunicator;
  friend class detail::WrappedCollectives<StagedCommunicator, C>;
  StagedCommunicator(std::shared_ptr<C> owned, D& device) : comm_(owned.get()), device_(&device), owned_(std::move(owned)) {}

  Work gather(const void* send, void* recv, std::size_t count, DType t, const CollectiveTag* tag) {
    const std::size_t chunk = count * size_of(t);
    return stage(send, chunk, recv, chunk * static_cast<std::size_t>(size()),
                 [&](const void* s, void* r) { return detail::all_gather(*comm_, s, r, count, t, tag); });
  }
  Work scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, const CollectiveTag* tag) {
    const std::size_t chunk = count * size_of(t);
    return stage(send, chunk * static_cast<std::size_t>(size()), recv, chunk,
                 [&](const void* s, void* r) { return detail::reduce_scatter(*comm_, s, r, count, t, op, tag); });
  }
  Work reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, const CollectiveTag* tag) {
    const std::size_t bytes = count * size_of(t);
    return stage(send, bytes, recv, bytes,
                 [&](const void* s, void* r) { return detail::all_reduce(*comm_, s, r, count, t, op, tag); });
  }

  template <class Run>
  Work stage(const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes, Run&& run) {
    if ((send_bytes && !send) || (recv_bytes && !recv))
      detail::fail("StagedCommunicator (rank ", rank(), "): null buffer for a collective of ", recv_bytes, " bytes");
    if (send_in_.size() < send_bytes) send_in_.resize(send_bytes);
    if (recv_out_.size() < recv_bytes) recv_out_.resize(recv_bytes);
    // The copy is queued behind whatever is still writing the send buffer on the device.
    if (send_bytes) device_->copy(send_in_.data(), send, send_bytes);
    device_->synchronize();
    run(send_in_.data(), recv_out_.data()).wait();
    if (recv_bytes) device_->copy(recv, recv_out_.data(), recv_bytes);
    device_->synchronize();
    return Work{};
  }

  C* comm_;
  D* device_;
  std::shared_ptr<C> owned_;  // set for groups made by split()
  std::vector<std::byte> send_in_, recv_out_;
};

}  // namespace fsdp
