#pragma once
// Where NcclComm gathers collective tags (fsdp/core/collective_tag.hpp): NCCL has no call
// descriptor to carry them, so each tagged collective is launched in one NCCL group with
// an 8-byte ncclAllGather of its packed tag, and the ranks' tags are compared once the
// collective is known complete (nccl_state.hpp: a host wait, or the watchdog retiring it).
// The tags live in a ring of slots in pinned host memory that the GPU addresses directly
// (mapped), so writing a tag is a host store and reading the gathered ones a host load:
// no copy, no extra CUDA call, no host synchronization. Each slot holds every rank's tag,
// this rank's written at its own place before the call: the all-gather runs in place, so
// NCCL makes no local copy (a one-rank all-gather out of place is a cudaMemcpyAsync, which
// between host buffers waited for the stream on an H200). A slot is written again only once the collective that
// used it last has completed; with kSlots slots that collective was issued kSlots tagged
// collectives earlier, so it almost always has.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/nccl/nccl_in_flight.hpp"
#include "fsdp/nccl/nccl_types.hpp"

namespace fsdp::detail {

class NcclTagRing {
 public:
  static constexpr std::size_t kSlots = 256;

  NcclTagRing() = default;
  NcclTagRing(const NcclTagRing&) = delete;
  NcclTagRing& operator=(const NcclTagRing&) = delete;
  ~NcclTagRing() { release(true); }

  // The slots of rank `rank` of a communicator of `ranks` ranks, on the current device.
  void allocate(int rank, int ranks, const std::string& at) {
    rank_ = static_cast<std::size_t>(rank);
    ranks_ = static_cast<std::size_t>(ranks);
    const std::size_t bytes = kSlots * stride() * sizeof(std::uint64_t);
    void* host = nullptr;
    cuda_check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc(tag slots)", at);
    host_ = static_cast<std::uint64_t*>(host);
    std::memset(host_, 0, bytes);
    void* device = nullptr;
    cuda_check(cudaHostGetDevicePointer(&device, host, 0), "cudaHostGetDevicePointer(tag slots)", at);
    device_ = static_cast<std::uint64_t*>(device);
    users_.assign(kSlots, nullptr);
  }

  // Frees the slots, after the communicator is finalized or aborted. `drained`: its
  // kernels have ended; if not (an abort still waiting for the device), the memory is
  // left allocated: a kernel may still write into it, and freeing would wait for it.
  void release(bool drained) {
    users_.clear();
    if (host_ && drained) cudaFreeHost(host_);
    host_ = device_ = nullptr;
  }

  // The slot of the next tagged collective, and the collective that used it last (null,
  // or one that must have completed before the slot is written).
  std::size_t next() { return next_++ % kSlots; }
  std::shared_ptr<NcclInFlight>& last_user(std::size_t slot) { return users_[slot]; }

  // This rank's tag for `slot`: read by the GPU when the tag's all-gather runs.
  void set_mine(std::size_t slot, std::uint64_t tag) { host_[slot * stride() + rank_] = tag; }
  const std::uint64_t* device_mine(std::size_t slot) const { return device_gathered(slot) + rank_; }
  std::uint64_t* device_gathered(std::size_t slot) const { return device_ + slot * stride(); }
  // `enqueue(comm, stream)`'s collective and the 8-byte all-gather of `slot`'s tag,
  // launched together (inside an nccl_group: with it). Returns the first failure, else
  // ncclGroupEnd's result (ncclInProgress on a nonblocking communicator: to be settled).
  template <class Enqueue>
  ncclResult_t enqueue_with_tag(std::size_t slot, Enqueue& enqueue, ncclComm_t comm, cudaStream_t stream) const {
    return enqueue_with_gathered_tag(device_gathered(slot), rank_, enqueue, comm, stream);
  }
  // The same for any slot of every rank's tag (`gathered`, this rank's at [rank]).
  template <class Enqueue>
  static ncclResult_t enqueue_with_gathered_tag(std::uint64_t* gathered, std::size_t rank, Enqueue& enqueue,
                                                ncclComm_t comm, cudaStream_t stream) {
    const ncclResult_t started = ncclGroupStart();
    if (started != ncclSuccess) return started;
    auto ok = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
    const ncclResult_t payload = enqueue(comm, stream);
    const ncclResult_t tag = ok(payload) ? ncclAllGather(gathered + rank, gathered, 1, ncclUint64, comm, stream) : ncclSuccess;
    const ncclResult_t ended = ncclGroupEnd();  // always: the group must close
    return !ok(payload) ? payload : !ok(tag) ? tag : ended;
  }

  // Every rank's tag, in rank order: valid once the slot's collective has completed.
  std::span<const std::uint64_t> gathered(std::size_t slot) const { return {host_ + slot * stride(), ranks_}; }

 private:
  std::size_t stride() const { return ranks_; }

  std::size_t rank_ = 0;
  std::size_t ranks_ = 0;
  std::uint64_t* host_ = nullptr;
  std::uint64_t* device_ = nullptr;  // the same memory as the GPU addresses it
  std::size_t next_ = 0;
  std::vector<std::shared_ptr<NcclInFlight>> users_;
};

}  // namespace fsdp::detail
