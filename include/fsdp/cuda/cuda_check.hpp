#pragma once
// What the CUDA communicators (CudaThreadComm, NcclComm) share about CUDA calls made on a
// collective's behalf: a checked call whose error names the call and the collective, and
// the pause between host polls of a CUDA event or a nonblocking communicator.
#include <cuda_runtime.h>

#include <chrono>
#include <thread>
#include <utility>

#include "fsdp/core/error.hpp"

namespace fsdp::detail {

// The fsdp::ErrorKind of a failed CUDA call: out_of_memory for an allocation the device
// refused, misuse (a bug, or a broken context) for the rest.
inline ErrorKind cuda_error_kind(cudaError_t e) {
  return e == cudaErrorMemoryAllocation ? ErrorKind::out_of_memory : ErrorKind::misuse;
}

template <class... Where>
void cuda_check(cudaError_t e, const char* call, Where&&... where) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call does not see it
  fail_as(cuda_error_kind(e), std::forward<Where>(where)..., ": ", call, " failed: ", cudaGetErrorString(e), " (",
          cudaGetErrorName(e), ")");
}

// Set on a thread while fsdp::CapturedStep frees a failed step's buffers into a capture
// that a prohibited call invalidated (fsdp/graph/captured_step.hpp): CudaDevice then takes
// cudaErrorStreamCaptureInvalidated as done, since that work joins a graph that never runs
// and cudaStreamEndCapture reports the failure. Nowhere else is that error ignored.
inline thread_local bool discarding_failed_capture = false;

// Between polls: a few yields (collectives often finish within microseconds), then short
// sleeps so many waiting ranks on few cores do not starve the one that must progress.
inline void cuda_poll_backoff(int spins) {
  if (spins < 64) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(50));
}

}  // namespace fsdp::detail
