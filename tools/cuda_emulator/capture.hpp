#pragma once
// Stream capture as the entry points see it (graph.cpp): what each does instead of running
// when its stream is capturing, and the calls a capture prohibits. The rules are CUDA's
// (cudaThreadExchangeStreamCaptureMode, the programming guide's "prohibited and unhandled
// operations"), and a prohibited call invalidates the capture as on a GPU:
//   - a synchronization or query of a capturing stream, or of an event last recorded in
//     a capture: cudaErrorStreamCaptureUnsupported / cudaErrorCapturedEvent;
//   - a "potentially unsafe" call (cudaMalloc, cudaFree, cudaMallocHost, cudaFreeHost,
//     cudaMemcpy, cudaMemset, a device, stream or event synchronization or query) from a
//     thread with a capture of its own not begun relaxed, or from any thread in the global
//     interaction mode while another thread has a global-mode capture:
//     cudaErrorStreamCaptureUnsupported;
//   - a capturing stream waiting on an event not recorded in its capture
//     (cudaErrorStreamCaptureIsolation; cudaEventWaitExternal is not emulated), or on one
//     of another capture (cudaErrorStreamCaptureMerge);
//   - ending a capture whose forked streams were not joined back into the stream it began
//     on (cudaErrorStreamCaptureUnjoined).
// Not emulated (refused with cudaErrorNotSupported, saying so): memory allocated in a
// capture and not freed in it, a free in a capture of memory allocated outside it, a graph
// launched inside a capture, cudaEventWaitExternal, instantiation flags. Not checked: the
// legacy stream's implicit synchronization with a capture of a blocking stream (CUDA's
// cudaErrorStreamCaptureImplicit); a launch whose node fails leaves the nodes before it
// queued (a partial replay).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <string>

#include "tools/cuda_emulator/entry.hpp"

namespace cuda_emulator::detail {

extern thread_local cudaStreamCaptureMode thread_capture_mode;

// cudaSuccess when the calling thread may make the potentially unsafe `call` now.
cudaError_t check_unsafe_call(Entry& entry, const char* call);
// The graph allocation (of a capture under way or of a graph) holding p, if any: memory a
// replay makes live, which CUDA already knows as device memory.
const GraphAllocation* find_graph_allocation(const void* p);
// A synchronization, query or destruction of the capturing stream s: refused.
cudaError_t capture_prohibits(Entry& entry, Stream& s, const char* call);
// A query or synchronization of an event last recorded in a capture: refused.
cudaError_t captured_event_use(Entry& entry, Event& e, const char* call);

// Work queued on the capturing stream s: recorded as a node that `issue` queues again, on
// the stream it is given, at each launch.
cudaError_t capture_op(Entry& entry, Stream& s, std::string what, std::function<cudaError_t(cudaStream_t)> issue);
// A copy queued on the capturing stream s: refused when it touches pageable host memory.
cudaError_t capture_copy_check(Entry& entry, Stream& s, void* dst, const void* src, std::size_t bytes, const char* what);
cudaError_t capture_record(Entry& entry, Stream& s, Event& e);
// cudaStreamWaitEvent where s is capturing or e was recorded in a capture.
cudaError_t capture_wait(Entry& entry, Stream& s, Event& e, unsigned flags);
cudaError_t capture_malloc(Entry& entry, Stream& s, void** p, std::size_t bytes);
cudaError_t capture_free(Entry& entry, Stream& s, void* p);

}  // namespace cuda_emulator::detail
