#pragma once
// An emulated CUDA runtime, NVRTC and NCCL for running the library's CUDA and NCCL host
// code on a machine without a GPU: link a program against //tools/cuda_emulator instead of
// libcudart, libnvrtc and libnccl, and CudaDevice, CudaThreadComm and NcclComm run
// unchanged, NcclComm over several ranks (processes, or communicators of one process).
//
// What it is for: the host side of the CUDA path, which otherwise runs only where a GPU is
// lent, and NcclComm's multi-rank code, which needs more GPUs than have been lent. It is
// not a GPU and proves nothing about one (tools/gpu_proof.sh does that).
//   - A call runs eagerly, in the calling thread, in issue order: device memory is host
//     memory, a copy is a memcpy, and the library's kernels run as fsdp::HostDevice's
//     operations and the zero-spans block code (the same bytes a GPU computes, so results
//     compare bitwise with HostDevice). Except behind a held stream (state.hpp, Pending):
//     a host function holds its stream until it returns, an NCCL collective until every
//     rank has queued its part (nccl.cpp); work ordered after either is deferred until
//     then, queries report cudaErrorNotReady, synchronizations wait (a wait past
//     FSDP_CUDA_EMULATOR_HANG_S, default 60 s, is reported as a hang).
//   - Each emulated GPU shows an H200's 132 SMs, or FSDP_CUDA_EMULATOR_SMS of them (1 to
//     1024): CudaDevice caps its grids at 32 blocks per SM, and with few SMs a test passes
//     that cap with small buffers.
//   - It counts every call per thread, and the time spent inside them, so a test can pin a
//     step's CUDA calls and a bench can time the library's own code around them.
//   - It checks what a GPU would not report: a kernel or copy on memory that is not live
//     device memory (freed, out of bounds, pageable host memory in a kernel), and stream
//     order. Each stream, event and the host carry a vector clock; every access to an
//     allocation is checked against earlier conflicting ones (a write against any, a read
//     against writes), and against the allocation's cudaMallocAsync and cudaFreeAsync:
//     when neither is ordered before the other by the stream itself, an event wait or a
//     host synchronization, that is a race on a GPU even though the eager run computed
//     the right bytes. Such findings are collected as violations for the test to check.
// Limits: the engine's own direct host reads of device pointers are not seen; timing,
// overlap and concurrency on the GPU are not modelled; host synchronization is taken in
// real-time order across threads (sound for what it orders, blind to luck on a real GPU);
// NCCL's transports are not modelled, and calls that differ between ranks hang.
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cuda_emulator {

#define FSDP_CUDA_EMULATOR_CALLS(X)                                                                         \
  X(cudaGetDeviceCount) X(cudaGetDevice) X(cudaSetDevice) X(cudaDeviceGetAttribute) X(cudaGetDeviceProperties) \
  X(cudaDeviceSynchronize) X(cudaMemGetInfo) X(cudaStreamCreate) X(cudaStreamCreateWithFlags)                 \
  X(cudaStreamDestroy) X(cudaStreamSynchronize) X(cudaStreamQuery) X(cudaStreamWaitEvent) X(cudaStreamGetDevice) \
  X(cudaEventCreate) X(cudaEventCreateWithFlags) X(cudaEventDestroy) X(cudaEventRecord) X(cudaEventQuery)     \
  X(cudaEventSynchronize) X(cudaMalloc) X(cudaFree) X(cudaMallocAsync) X(cudaFreeAsync) X(cudaMallocHost)     \
  X(cudaHostAlloc) X(cudaFreeHost) X(cudaHostGetDevicePointer) X(cudaPointerGetAttributes) X(cudaMemcpy)      \
  X(cudaMemcpyAsync) X(cudaMemset) X(cudaMemsetAsync) X(cudaLaunchKernel) X(cudaLibraryLoadData)              \
  X(cudaLibraryGetKernel) X(cudaLibraryUnload) X(cudaGetLastError) X(cudaPeekAtLastError) X(cudaLaunchHostFunc) \
  X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommSplit) X(ncclCommFinalize) X(ncclCommDestroy)       \
  X(ncclCommAbort) X(ncclCommGetAsyncError) X(ncclCommCount) X(ncclCommUserRank) X(ncclCommCuDevice)        \
  X(ncclGroupStart) X(ncclGroupEnd) X(ncclAllGather) X(ncclReduceScatter) X(ncclAllReduce) X(ncclBroadcast)        \
  X(cudaStreamBeginCapture) X(cudaStreamEndCapture) X(cudaStreamIsCapturing) X(cudaThreadExchangeStreamCaptureMode)  \
  X(cudaGraphInstantiate) X(cudaGraphLaunch) X(cudaGraphExecDestroy) X(cudaGraphDestroy)

enum class Call : int {
#define FSDP_CUDA_EMULATOR_ENUM(name) name,
  FSDP_CUDA_EMULATOR_CALLS(FSDP_CUDA_EMULATOR_ENUM)
#undef FSDP_CUDA_EMULATOR_ENUM
      count
};

const char* name_of(Call c);

// The calls this thread made since its last reset, and the time spent inside them.
struct ThreadCalls {
  std::array<std::uint64_t, static_cast<std::size_t>(Call::count)> calls{};
  std::uint64_t ns = 0;
  std::uint64_t of(Call c) const { return calls[static_cast<std::size_t>(c)]; }
  std::uint64_t total() const;
  std::string summary() const;  // "cudaLaunchKernel=3 cudaMemsetAsync=1 ..." (non-zero ones)
};
const ThreadCalls& this_thread_calls();
void reset_this_thread_calls();

// Stream-order races and invalid memory uses found since the last call (and cleared).
std::vector<std::string> take_violations();

// How many GPUs the emulated runtime shows (1 at start, or FSDP_CUDA_EMULATOR_DEVICES).
void set_device_count(int n);

// The next call named `call` (any thread), after `skip` more of them, returns `error`
// without doing anything, as a failing runtime would. An NCCL call returns ncclSystemError
// instead, with "<call>: injected by cuda_emulator::fail_next" from ncclGetLastError.
void fail_next(std::string_view call, cudaError_t error, int skip = 0);

// Every NCCL communicator of this process reports `result` (an ncclResult_t, e.g.
// ncclRemoteError) with `text` from ncclCommGetAsyncError from now on, as NCCL does when a
// peer's connection fails.
void nccl_fail_async(int result, std::string_view text);

// Device bytes live now (cudaMalloc and cudaMallocAsync), for leak checks.
std::size_t live_device_bytes();

}  // namespace cuda_emulator
