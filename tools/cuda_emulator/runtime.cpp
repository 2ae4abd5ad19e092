// The emulated CUDA runtime's entry points (see emulator.hpp): the libcudart functions the
// library, its tests and benches call, with C linkage, so a program linked with this
// library instead of libcudart runs them here.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <string>
#include <string_view>

#include "tools/cuda_emulator/capture.hpp"
#include "tools/cuda_emulator/entry.hpp"

namespace cuda_emulator {

thread_local ThreadCalls detail::calls_here;
thread_local int detail::current_device = 0;
thread_local cudaError_t detail::last_error = cudaSuccess;
thread_local std::string detail::last_detail;
thread_local cudaError_t detail::detail_code = cudaSuccess;

using namespace detail;  // NOLINT

const char* name_of(Call c) {
  static constexpr const char* names[] = {
#define FSDP_CUDA_EMULATOR_NAME(name) #name,
      FSDP_CUDA_EMULATOR_CALLS(FSDP_CUDA_EMULATOR_NAME)
#undef FSDP_CUDA_EMULATOR_NAME
  };
  return names[static_cast<std::size_t>(c)];
}

std::uint64_t ThreadCalls::total() const {
  std::uint64_t n = 0;
  for (auto c : calls) n += c;
  return n;
}

std::string ThreadCalls::summary() const {
  std::string out;
  for (std::size_t i = 0; i < calls.size(); ++i)
    if (calls[i]) out += (out.empty() ? "" : " ") + std::string(name_of(static_cast<Call>(i))) + "=" + std::to_string(calls[i]);
  return out;
}

const ThreadCalls& this_thread_calls() { return calls_here; }
void reset_this_thread_calls() { calls_here = {}; }

std::vector<std::string> take_violations() {
  std::lock_guard lock(rt().mutex);
  return rt().take_violations();
}

void set_device_count(int n) {
  std::lock_guard lock(rt().mutex);
  rt().device_count = n;
}

void fail_next(std::string_view call, cudaError_t error, int skip) {
  std::lock_guard lock(rt().mutex);
  rt().injection = {std::string(call), error, skip};
}

std::size_t live_device_bytes() {
  std::lock_guard lock(rt().mutex);
  return rt().live_bytes(Space::device);
}

}  // namespace cuda_emulator

using namespace cuda_emulator;          // NOLINT: the entry points below are the C API
using namespace cuda_emulator::detail;  // NOLINT

extern "C" {

// ---- errors ----
cudaError_t cudaGetLastError() {
  Entry entry(Call::cudaGetLastError);
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  Entry entry(Call::cudaPeekAtLastError);
  return last_error;
}
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorSymbolNotFound: return "cudaErrorSymbolNotFound";
    case cudaErrorInvalidKernelImage: return "cudaErrorInvalidKernelImage";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    default: return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  thread_local std::string text;
  text = std::string(cudaGetErrorName(e)) + " (CUDA runtime emulator)";
  if (e == detail_code && !last_detail.empty()) text += ": " + last_detail;
  return text.c_str();
}

// ---- devices ----
cudaError_t cudaGetDeviceCount(int* count) {
  FSDP_EMULATOR_ENTER(cudaGetDeviceCount);
  *count = rt().device_count;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  FSDP_EMULATOR_ENTER(cudaGetDevice);
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  FSDP_EMULATOR_ENTER(cudaSetDevice);
  if (!valid_device(device)) return entry.fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  FSDP_EMULATOR_ENTER(cudaDeviceGetAttribute);
  if (!valid_device(device)) return entry.fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = sm_count(); break;
    case cudaDevAttrComputeCapabilityMajor: *value = kComputeMajor; break;
    case cudaDevAttrComputeCapabilityMinor: *value = kComputeMinor; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    default: return entry.fail(cudaErrorInvalidValue, "attribute not emulated");
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  FSDP_EMULATOR_ENTER(cudaGetDeviceProperties);
  if (!valid_device(device)) return entry.fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, kDeviceName, sizeof prop->name - 1);
  prop->major = kComputeMajor;
  prop->minor = kComputeMinor;
  prop->multiProcessorCount = sm_count();
  prop->totalGlobalMem = kMemoryBytes;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  FSDP_EMULATOR_ENTER(cudaDeviceSynchronize);
  if (cudaError_t e = check_unsafe_call(entry, "cudaDeviceSynchronize"); e != cudaSuccess) return e;
  const Clock work = rt().device_work(current_device);  // a copy: the wait releases the lock
  if (!rt().wait_for(work, "cudaDeviceSynchronize")) return entry.fail(cudaErrorLaunchTimeout, "a hang (see the violations)");
  rt().host.join(work);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  FSDP_EMULATOR_ENTER(cudaMemGetInfo);
  *total = kMemoryBytes;
  *free = kMemoryBytes - rt().live_bytes(Space::device);
  return cudaSuccess;
}

// ---- streams ----
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  FSDP_EMULATOR_ENTER(cudaStreamCreateWithFlags);
  if (flags & ~cudaStreamNonBlocking) return entry.fail(cudaErrorInvalidValue, "unknown stream flags");
  *stream = reinterpret_cast<cudaStream_t>(rt().make_stream(current_device, !(flags & cudaStreamNonBlocking)));
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  FSDP_EMULATOR_ENTER(cudaStreamCreate);
  *stream = reinterpret_cast<cudaStream_t>(rt().make_stream(current_device, true));
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaStreamDestroy);
  if (Stream* s = stream ? rt().resolve(stream, current_device) : nullptr; s && s->capture)
    return capture_prohibits(entry, *s, "cudaStreamDestroy");
  if (!stream || !rt().destroy_stream(reinterpret_cast<Stream*>(stream))) return entry.unknown("stream");
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaStreamSynchronize);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->capture) return capture_prohibits(entry, *s, "cudaStreamSynchronize");
  if (cudaError_t e = check_unsafe_call(entry, "cudaStreamSynchronize"); e != cudaSuccess) return e;
  rt().order(*s);
  const Clock c = s->clock;  // a copy: the wait releases the lock, and s may go meanwhile
  if (!rt().wait_for(c, "cudaStreamSynchronize on " + rt().describe(*s)))
    return entry.fail(cudaErrorLaunchTimeout, "a hang (see the violations)");
  rt().host.join(c);
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaStreamQuery);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->capture) return capture_prohibits(entry, *s, "cudaStreamQuery");
  if (cudaError_t e = check_unsafe_call(entry, "cudaStreamQuery"); e != cudaSuccess) return e;
  rt().progress();
  rt().order(*s);  // a blocking stream waits for the legacy one, and the other way round
  if (rt().incomplete(s->clock)) return cudaErrorNotReady;  // not an error: not recorded as the last one
  rt().host.join(s->clock);  // eager: complete unless a pending operation holds it
  return cudaSuccess;
}
cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
  FSDP_EMULATOR_ENTER(cudaStreamGetDevice);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  *device = s->device;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  FSDP_EMULATOR_ENTER(cudaStreamWaitEvent);
  Stream* s = rt().resolve(stream, current_device);
  auto* e = reinterpret_cast<Event*>(event);
  if (!s || !rt().known(e)) return entry.unknown(s ? "event" : "stream");
  if (s->capture || e->capture) return capture_wait(entry, *s, *e, flags);
  if (flags != 0) return entry.fail(cudaErrorInvalidValue, "cudaStreamWaitEvent: flags not emulated");
  if (e->recorded) s->clock.join(e->clock);  // waiting on a never-recorded event is a no-op
  return cudaSuccess;
}

// ---- events ----
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  FSDP_EMULATOR_ENTER(cudaEventCreateWithFlags);
  (void)flags;
  *event = reinterpret_cast<cudaEvent_t>(rt().make_event(current_device));
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  FSDP_EMULATOR_ENTER(cudaEventCreate);
  *event = reinterpret_cast<cudaEvent_t>(rt().make_event(current_device));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  FSDP_EMULATOR_ENTER(cudaEventDestroy);
  if (!rt().destroy_event(reinterpret_cast<Event*>(event))) return entry.unknown("event");
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaEventRecord);
  Stream* s = rt().resolve(stream, current_device);
  auto* e = reinterpret_cast<Event*>(event);
  if (!s || !rt().known(e)) return entry.unknown(s ? "event" : "stream");
  if (s->device != e->device)
    return entry.fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: the event and the stream are on different devices");
  if (s->capture) return capture_record(entry, *s, *e);
  e->capture = nullptr;  // a point of a stream again
  e->seen.clear();
  rt().order(*s);
  e->clock = s->clock;
  e->recorded = true;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  FSDP_EMULATOR_ENTER(cudaEventQuery);
  auto* e = reinterpret_cast<Event*>(event);
  if (!rt().known(e)) return entry.unknown("event");
  if (e->capture) return captured_event_use(entry, *e, "cudaEventQuery");
  if (cudaError_t r = check_unsafe_call(entry, "cudaEventQuery"); r != cudaSuccess) return r;
  rt().progress();
  if (rt().incomplete(e->clock)) return cudaErrorNotReady;
  rt().host.join(e->clock);  // eager: the recorded work is done unless a pending operation holds it
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  FSDP_EMULATOR_ENTER(cudaEventSynchronize);
  auto* e = reinterpret_cast<Event*>(event);
  if (!rt().known(e)) return entry.unknown("event");
  if (e->capture) return captured_event_use(entry, *e, "cudaEventSynchronize");
  if (cudaError_t r = check_unsafe_call(entry, "cudaEventSynchronize"); r != cudaSuccess) return r;
  const Clock c = e->clock;  // a copy: the wait releases the lock
  if (!rt().wait_for(c, "cudaEventSynchronize")) return entry.fail(cudaErrorLaunchTimeout, "a hang (see the violations)");
  rt().host.join(c);
  return cudaSuccess;
}

// ---- host functions ----
// Runs `fn` on a thread of its own once everything before it on the stream has completed;
// the stream is held until it returns (work queued after it waits for it, and a query
// reports cudaErrorNotReady meanwhile).
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  FSDP_EMULATOR_ENTER(cudaLaunchHostFunc);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (!fn) return entry.fail(cudaErrorInvalidValue, "cudaLaunchHostFunc with a null function");
  if (s->capture)
    return capture_op(entry, *s, "cudaLaunchHostFunc", [fn, user_data](cudaStream_t on) { return cudaLaunchHostFunc(on, fn, user_data); });
  auto returned = std::make_shared<std::atomic<bool>>(false);
  rt().add_pending(*s, rt().queue_op(*s), "a host function (cudaLaunchHostFunc)", [fn, user_data, returned, started = false](Pending& p) mutable {
    if (!started) {
      started = true;
      std::thread([fn, user_data, returned] {
        fn(user_data);
        returned->store(true);
      }).detach();
    }
    p.done = returned->load();
  });
  return cudaSuccess;
}

}  // extern "C"
