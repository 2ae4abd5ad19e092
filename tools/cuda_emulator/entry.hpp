#pragma once
// What every entry point of the emulated runtime shares: the calling thread's state and
// the Entry that counts, times and serializes a call and applies an injected failure.
#include <cuda_runtime_api.h>

#include <chrono>
#include <mutex>
#include <string>

#include "tools/cuda_emulator/emulator.hpp"
#include "tools/cuda_emulator/state.hpp"

namespace cuda_emulator::detail {

extern thread_local ThreadCalls calls_here;
extern thread_local int current_device;
extern thread_local cudaError_t last_error;
extern thread_local std::string last_detail;  // what the emulator adds to the text of
extern thread_local cudaError_t detail_code;   // the last error it returned

// One entry point's bookkeeping: counted, timed, serialized, and the injected failure.
class Entry {
 public:
  explicit Entry(Call c) : call_(c), begin_(std::chrono::steady_clock::now()), lock_(Runtime::get().mutex) {
    ++calls_here.calls[static_cast<std::size_t>(c)];
    Runtime::Injected& i = Runtime::get().injection;
    if (i.error != cudaSuccess && i.call == name_of(c) && i.skip-- == 0) {
      injected_ = i.error;
      i.error = cudaSuccess;
    }
  }
  ~Entry() {
    calls_here.ns += static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin_).count());
  }
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;

  cudaError_t injected() const { return injected_; }
  cudaError_t fail(cudaError_t e, std::string detail = {}) {
    last_error = e;
    detail_code = e;
    last_detail = std::move(detail);
    return e;
  }
  // A handle the runtime does not know ("stream", "event", "pointer"...).
  cudaError_t unknown(const char* what) {
    return fail(cudaErrorInvalidResourceHandle, std::string(name_of(call_)) + ": unknown " + what);
  }
  // Kernels (on a GPU) and memsets (as CudaDevice assumes) go on a stream of the current device.
  cudaError_t require_current(const Stream& s, const std::string& what) {
    if (s.device == current_device) return cudaSuccess;
    return fail(cudaErrorInvalidResourceHandle, what + " on a stream of cuda:" + std::to_string(s.device) + " while cuda:" +
                                                    std::to_string(current_device) + " is current");
  }

 private:
  Call call_;
  std::chrono::steady_clock::time_point begin_;
  std::unique_lock<std::mutex> lock_;
  cudaError_t injected_ = cudaSuccess;
};

#define FSDP_EMULATOR_ENTER(name)                                                      \
  Entry entry(Call::name);                                                             \
  if (entry.injected() != cudaSuccess) return entry.fail(entry.injected(), "injected by cuda_emulator::fail_next")

inline Runtime& rt() { return Runtime::get(); }
inline bool valid_device(int d) { return d >= 0 && d < rt().device_count; }

}  // namespace cuda_emulator::detail
