#pragma once
// The CUDA resources of one NcclComm (nccl_state.hpp): the stream each collective runs on
// (all-gathers on their own, the others on the reduce stream, as FSDP splits them; or the
// one stream the caller gives), the event that orders them after the engine's stream
// (NcclCommOptions::after), 16 zeroed device bytes for barrier(), and the events of
// completed collectives, reused so that the steady state creates none. Not thread-safe:
// the communicator's mutex guards it.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/nccl/nccl_types.hpp"

namespace fsdp::detail {

class NcclStreams {
 public:
  NcclStreams() = default;
  NcclStreams(const NcclStreams&) = delete;
  NcclStreams& operator=(const NcclStreams&) = delete;

  // On the current device; what was made before a failure is freed by release().
  void create(const NcclCommOptions& o, const std::string& at) {
    after_ = o.after;
    if (o.stream) {
      reduce_ = gather_ = o.stream;
    } else {
      cuda_check(cudaStreamCreateWithFlags(&reduce_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", at);
      owns_streams_ = true;
      cuda_check(cudaStreamCreateWithFlags(&gather_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", at);
    }
    if (after_) cuda_check(cudaEventCreateWithFlags(&after_event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", at);
    cuda_check(cudaMalloc(&scratch_, 16), "cudaMalloc(16 bytes for barrier)", at);
    cuda_check(cudaMemset(scratch_, 0, 16), "cudaMemset(barrier bytes)", at);
  }

  // On the current device, once the communicator is finalized or aborted. `drained`: its
  // kernels have ended; if not, the barrier bytes stay (cudaFree would wait for the device).
  void release(bool drained) {
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    spare_events_.clear();
    if (after_event_) cudaEventDestroy(after_event_);
    if (scratch_ && drained) cudaFree(scratch_);
    if (owns_streams_ && reduce_) cudaStreamDestroy(reduce_);
    if (owns_streams_ && gather_) cudaStreamDestroy(gather_);
    after_event_ = nullptr, scratch_ = nullptr, reduce_ = gather_ = nullptr;
  }

  cudaStream_t gather() const { return gather_; }
  cudaStream_t reduce() const { return reduce_; }
  cudaStream_t for_kind(CollectiveKind k) const { return k == CollectiveKind::all_gather ? gather_ : reduce_; }
  void* scratch() const { return scratch_; }

  // Makes `stream` wait for what was queued on the `after` stream up to now (inputs
  // written, buffers allocated stream-ordered); nothing without one. The event is recorded
  // again per call: a wait takes the record of the moment.
  template <class At>
  void order_after_engine(cudaStream_t stream, const At& at) {
    if (!after_) return;
    cuda_check(cudaEventRecord(after_event_, after_), "cudaEventRecord(after stream)", at);
    cuda_check(cudaStreamWaitEvent(stream, after_event_, 0), "cudaStreamWaitEvent(after stream)", at);
  }

  // Whether collectives issued now are ordered after `stream`'s work (and so join a
  // capture of it): it is the `after` stream, or the one stream they run on.
  bool ordered_after(cudaStream_t stream) const { return stream && (after_ == stream || (!owns_streams_ && gather_ == stream)); }

  // An event for the next collective: a completed one's, else a new one.
  template <class At>
  cudaEvent_t take_event(const At& at) {
    if (spare_events_.empty()) {
      cudaEvent_t e = nullptr;
      cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags", at);
      return e;
    }
    cudaEvent_t e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  void give_back(cudaEvent_t e) { spare_events_.push_back(e); }

 private:
  cudaStream_t reduce_ = nullptr;  // every collective but all_gather
  cudaStream_t gather_ = nullptr;  // all_gather
  bool owns_streams_ = false;
  cudaStream_t after_ = nullptr;
  cudaEvent_t after_event_ = nullptr;
  void* scratch_ = nullptr;
  std::vector<cudaEvent_t> spare_events_;
};

}  // namespace fsdp::detail
