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

template <class... Where>
void cuda_check(cudaError_t e, const char* call, Where&&... where) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call does not see it
  fail(std::forward<Where>(where)..., ": ", call, " failed: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
}

// Between polls: a few yields (collectives often finish within microseconds), then short
// sleeps so many waiting ranks on few cores do not starve the one that must progress.
inline void cuda_poll_backoff(int spins) {
  if (spins < 64) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(50));
}

}  // namespace fsdp::detail
