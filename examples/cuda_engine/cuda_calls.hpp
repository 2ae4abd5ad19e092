#pragma once
// The CUDA engine's checked calls and its memory. Every CUDA runtime, cuBLAS and NVRTC
// call goes through check(): a failure is an fsdp::Error that names the call. Memory is
// stream-ordered on the engine's one stream (cudaMallocAsync / cudaFreeAsync), the same
// pool fsdp::CudaDevice allocates from when it is handed that stream, so the library's
// buffers and the engine's activations reuse each other's memory in stream order.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <cstddef>
#include <utility>

#include <fsdp/core/error.hpp>

namespace cuda_engine {

template <class... Parts>
void check(cudaError_t e, const char* call, Parts&&... parts) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call does not see it
  fsdp::detail::fail("cuda_engine: ", call, std::forward<Parts>(parts)..., " failed: ", cudaGetErrorString(e), " (",
                     cudaGetErrorName(e), ")");
}

template <class... Parts>
void check(cublasStatus_t s, const char* call, Parts&&... parts) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  fsdp::detail::fail("cuda_engine: ", call, std::forward<Parts>(parts)..., " failed: ", cublasGetStatusName(s), " (",
                     cublasGetStatusString(s), ")");
}

template <class... Parts>
void check(nvrtcResult r, const char* call, Parts&&... parts) {
  if (r == NVRTC_SUCCESS) return;
  fsdp::detail::fail("cuda_engine: ", call, std::forward<Parts>(parts)..., " failed: ", nvrtcGetErrorString(r));
}

// The engine's allocator: stream-ordered device memory on its compute stream. A free is
// queued behind every kernel already queued there, so no use can outlive its buffer.
class StreamAllocator {
 public:
  explicit StreamAllocator(cudaStream_t stream) : stream_(stream) {}
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    check(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync(", bytes, " bytes)");
    return p;
  }
  // From destructors too, so it cannot throw; a failure here is sticky and surfaces at the
  // next checked call on the stream.
  void deallocate(void* p) noexcept {
    if (p) (void)cudaFreeAsync(p, stream_);
  }
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
};

// An owned device buffer (activations, optimizer state, data).
class Buffer {
 public:
  Buffer() = default;
  Buffer(StreamAllocator& a, std::size_t bytes) : alloc_(&a), p_(a.allocate(bytes)), bytes_(bytes) {}
  Buffer(Buffer&& o) noexcept
      : alloc_(std::exchange(o.alloc_, nullptr)), p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      alloc_ = std::exchange(o.alloc_, nullptr), p_ = std::exchange(o.p_, nullptr), bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void* get() const { return p_; }
  std::size_t bytes() const { return bytes_; }
  void reset() noexcept {
    if (alloc_) alloc_->deallocate(p_);
    alloc_ = nullptr, p_ = nullptr, bytes_ = 0;
  }

 private:
  StreamAllocator* alloc_ = nullptr;
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace cuda_engine
