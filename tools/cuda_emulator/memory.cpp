// The emulated runtime's memory, copies, kernel launches and kernel libraries.
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tools/cuda_emulator/capture.hpp"
#include "tools/cuda_emulator/entry.hpp"
#include "tools/cuda_emulator/kernels.hpp"

namespace cuda_emulator::detail {

// Images made by the emulated NVRTC start with this line (nvrtc.cpp); no other image loads.
extern const char kImageMagic[];

namespace {

// The memory a copy touches (pageable host memory allowed where the kind permits it).
cudaError_t copy_on(Entry& entry, Stream& s, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                    const char* what) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return entry.fail(cudaErrorInvalidMemcpyDirection);
  // Pageable host memory is staged when the call is made, as a GPU's driver does: a copy
  // from it takes its bytes now (and may be deferred), a copy into it waits for what it is
  // ordered after. Copies between device and pinned memory may be deferred.
  const bool from_pageable = bytes && !rt().find(src), into_pageable = bytes && !rt().find(dst);
  bool hung = false;
  const std::uint64_t t = into_pageable ? rt().begin_op(s, &hung) : rt().queue_op(s);
  if (hung) return entry.fail(cudaErrorLaunchTimeout, std::string(what) + ": a hang (see the violations)");
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  std::string error;
  if (!rt().check_access(s, t, src, bytes, false, src_device, what, error) ||
      !rt().check_access(s, t, dst, bytes, true, dst_device, what, error))
    return entry.fail(cudaErrorInvalidValue, error);
  if (!bytes) return cudaSuccess;
  if (from_pageable && !into_pageable && rt().incomplete(s.clock)) {
    auto staged = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(src),
                                                           static_cast<const std::byte*>(src) + bytes);
    rt().run_in_order(s, t, what, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return cudaSuccess;
  }
  rt().run_in_order(s, t, what, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}

cudaError_t memset_on(Entry& entry, Stream& s, void* p, int value, std::size_t bytes, const char* what) {
  if (cudaError_t e = entry.require_current(s, what); e != cudaSuccess) return e;
  const std::uint64_t t = rt().queue_op(s);
  std::string error;
  if (!rt().check_access(s, t, p, bytes, true, true, what, error)) return entry.fail(cudaErrorInvalidValue, error);
  if (bytes) rt().run_in_order(s, t, what, [p, value, bytes] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

cudaError_t allocate(Entry& entry, void** p, std::size_t bytes, Space space, const char* how, Stream* on) {
  if (!p) return entry.fail(cudaErrorInvalidValue, std::string(how) + " with a null result pointer");
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (bytes > kMemoryBytes - rt().live_bytes(space))
    return entry.fail(cudaErrorMemoryAllocation, std::string(how) + "(" + std::to_string(bytes) + " bytes): past the emulated GPU's " +
                                                     std::to_string(kMemoryBytes >> 30) + " GiB");
  *p = rt().allocate(bytes, space, on ? on->device : current_device, how, on);
  return *p ? cudaSuccess : entry.fail(cudaErrorMemoryAllocation, std::string(how) + "(" + std::to_string(bytes) + " bytes)");
}

struct Library {
  std::string image;
};

}  // namespace

}  // namespace cuda_emulator::detail

using namespace cuda_emulator;          // NOLINT: the entry points below are the C API
using namespace cuda_emulator::detail;  // NOLINT

extern "C" {

// ---- memory ----
cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  FSDP_EMULATOR_ENTER(cudaMalloc);
  if (cudaError_t e = check_unsafe_call(entry, "cudaMalloc"); e != cudaSuccess) return e;
  return allocate(entry, p, bytes, Space::device, "cudaMalloc", nullptr);
}
cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaMallocAsync);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->capture) return capture_malloc(entry, *s, p, bytes);
  return allocate(entry, p, bytes, Space::device, "cudaMallocAsync", s);
}
cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  FSDP_EMULATOR_ENTER(cudaMallocHost);
  if (cudaError_t e = check_unsafe_call(entry, "cudaMallocHost"); e != cudaSuccess) return e;
  return allocate(entry, p, bytes, Space::pinned, "cudaMallocHost", nullptr);
}
cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned int flags) {
  FSDP_EMULATOR_ENTER(cudaHostAlloc);
  if (cudaError_t e = check_unsafe_call(entry, "cudaHostAlloc"); e != cudaSuccess) return e;
  (void)flags;  // portable / mapped / write-combined: all the same host memory here
  return allocate(entry, p, bytes, Space::pinned, "cudaHostAlloc", nullptr);
}
cudaError_t cudaFree(void* p) {
  FSDP_EMULATOR_ENTER(cudaFree);
  if (cudaError_t e = check_unsafe_call(entry, "cudaFree"); e != cudaSuccess) return e;
  if (p && !rt().release(p, Space::device, "cudaFree", nullptr))
    return entry.fail(cudaErrorInvalidValue, "cudaFree of a pointer that is not a live device allocation");
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaFreeAsync);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->capture) return capture_free(entry, *s, p);
  if (p && !rt().release(p, Space::device, "cudaFreeAsync", s)) {
    const Freed* f = rt().find_freed(p);
    return entry.fail(cudaErrorInvalidValue, std::string("cudaFreeAsync of a pointer that is not a live device allocation") +
                                                 (f ? " (" + f->how + " freed it)" : ""));
  }
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  FSDP_EMULATOR_ENTER(cudaFreeHost);
  if (cudaError_t e = check_unsafe_call(entry, "cudaFreeHost"); e != cudaSuccess) return e;
  if (p && !rt().release(p, Space::pinned, "cudaFreeHost", nullptr))
    return entry.fail(cudaErrorInvalidValue, "cudaFreeHost of a pointer that is not a live pinned allocation");
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned int flags) {
  FSDP_EMULATOR_ENTER(cudaHostGetDevicePointer);
  const Allocation* a = rt().find(host_ptr);
  if (!a || a->space != Space::pinned || flags != 0)
    return entry.fail(cudaErrorInvalidValue, "cudaHostGetDevicePointer of memory that is not pinned");
  *device_ptr = host_ptr;  // unified addressing: the same address
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  FSDP_EMULATOR_ENTER(cudaPointerGetAttributes);
  *attributes = cudaPointerAttributes{};
  attributes->device = -1;
  const Allocation* a = rt().find(ptr);
  if (!a) {
    if (const GraphAllocation* g = find_graph_allocation(ptr)) {  // a graph's, live or not
      attributes->type = cudaMemoryTypeDevice;
      attributes->device = g->device;
      attributes->devicePointer = const_cast<void*>(ptr);
      return cudaSuccess;
    }
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->hostPointer = const_cast<void*>(ptr);
    return cudaSuccess;
  }
  attributes->device = a->device;
  attributes->devicePointer = const_cast<void*>(ptr);
  if (a->space == Space::pinned) {
    attributes->type = cudaMemoryTypeHost;
    attributes->hostPointer = const_cast<void*>(ptr);
  } else {
    attributes->type = cudaMemoryTypeDevice;
  }
  return cudaSuccess;
}

// ---- copies and fills ----
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaMemcpyAsync);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->capture) {
    if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return entry.fail(cudaErrorInvalidMemcpyDirection);
    if (cudaError_t e = capture_copy_check(entry, *s, dst, src, bytes, "cudaMemcpyAsync"); e != cudaSuccess) return e;
    return capture_op(entry, *s, "cudaMemcpyAsync",
                      [=](cudaStream_t on) { return cudaMemcpyAsync(dst, src, bytes, kind, on); });
  }
  return copy_on(entry, *s, dst, src, bytes, kind, "cudaMemcpyAsync");
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  FSDP_EMULATOR_ENTER(cudaMemcpy);
  if (cudaError_t e = check_unsafe_call(entry, "cudaMemcpy"); e != cudaSuccess) return e;
  Stream& s = *rt().resolve(nullptr, current_device);
  const cudaError_t e = copy_on(entry, s, dst, src, bytes, kind, "cudaMemcpy");
  if (!rt().wait_for(Clock(s.clock), "cudaMemcpy"))  // synchronous
    return entry.fail(cudaErrorLaunchTimeout, "cudaMemcpy: a hang (see the violations)");
  rt().host.join(s.clock);
  return e;
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaMemsetAsync);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->capture) {
    if (cudaError_t e = entry.require_current(*s, "cudaMemsetAsync"); e != cudaSuccess) return e;
    return capture_op(entry, *s, "cudaMemsetAsync", [=](cudaStream_t on) { return cudaMemsetAsync(p, value, bytes, on); });
  }
  return memset_on(entry, *s, p, value, bytes, "cudaMemsetAsync");
}
cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  FSDP_EMULATOR_ENTER(cudaMemset);
  if (cudaError_t e = check_unsafe_call(entry, "cudaMemset"); e != cudaSuccess) return e;
  Stream& s = *rt().resolve(nullptr, current_device);
  const cudaError_t e = memset_on(entry, s, p, value, bytes, "cudaMemset");
  if (!rt().wait_for(Clock(s.clock), "cudaMemset"))
    return entry.fail(cudaErrorLaunchTimeout, "cudaMemset: a hang (see the violations)");
  rt().host.join(s.clock);
  return e;
}

// ---- kernels ----
cudaError_t cudaLibraryLoadData(cudaLibrary_t* library, const void* code, cudaJitOption*, void**, unsigned int,
                                cudaLibraryOption*, void**, unsigned int) {
  FSDP_EMULATOR_ENTER(cudaLibraryLoadData);
  const char* text = static_cast<const char*>(code);
  if (!code || std::strncmp(text, kImageMagic, std::strlen(kImageMagic)) != 0)
    return entry.fail(cudaErrorInvalidKernelImage, "not an image of the emulated NVRTC");
  *library = reinterpret_cast<cudaLibrary_t>(new Library{text});
  return cudaSuccess;
}
cudaError_t cudaLibraryGetKernel(cudaKernel_t* kernel, cudaLibrary_t library, const char* name) {
  FSDP_EMULATOR_ENTER(cudaLibraryGetKernel);
  const auto* lib = reinterpret_cast<const Library*>(library);
  const Kernel* k = kernel_named(name);
  // The image must define it (the program NVRTC was given), and the emulator must know it.
  if (!lib || !k || lib->image.find(std::string("__global__ void ") + name + "(") == std::string::npos)
    return entry.fail(cudaErrorSymbolNotFound, std::string("no kernel ") + name);
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<Kernel*>(k));
  return cudaSuccess;
}
cudaError_t cudaLibraryUnload(cudaLibrary_t library) {
  FSDP_EMULATOR_ENTER(cudaLibraryUnload);
  delete reinterpret_cast<Library*>(library);
  return cudaSuccess;
}
cudaError_t cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, std::size_t shared_mem,
                             cudaStream_t stream) {
  FSDP_EMULATOR_ENTER(cudaLaunchKernel);
  const Kernel* k = kernel_of(func);
  if (!k) return entry.unknown("function");
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (cudaError_t e = entry.require_current(*s, k->name); e != cudaSuccess) return e;
  if (grid.x == 0 || grid.y != 1 || grid.z != 1 || block.x == 0 || block.x > 1024 || block.y != 1 || block.z != 1 ||
      shared_mem != 0)
    return entry.fail(cudaErrorInvalidConfiguration, std::string(k->name) + ": launch configuration");
  const KernelArgs a{args, grid.x, block.x};
  if (s->capture) {  // the arguments are the caller's only during the call: a copy of each is kept
    auto saved = std::make_shared<std::vector<std::vector<std::byte>>>();
    for (std::size_t i = 0; i < k->arg_bytes.size(); ++i) {
      const auto* v = static_cast<const std::byte*>(args[i]);
      saved->emplace_back(v, v + k->arg_bytes[i]);
    }
    return capture_op(entry, *s, k->name, [func, grid, block, saved](cudaStream_t on) {
      std::vector<void*> ptrs;
      for (auto& v : *saved) ptrs.push_back(v.data());
      return cudaLaunchKernel(func, grid, block, ptrs.data(), 0, on);
    });
  }
  std::vector<Range> ranges;
  k->ranges(a, ranges);
  const std::uint64_t t = rt().queue_op(*s);
  std::string error;
  for (const Range& r : ranges)
    if (!rt().check_access(*s, t, r.p, r.bytes, r.write, true, k->name, error))
      return entry.fail(cudaErrorIllegalAddress, error);
  if (!rt().incomplete(s->clock)) {
    k->run(a);
    return cudaSuccess;
  }
  // Deferred: the arguments are the caller's only during the call, so a copy of each is kept.
  auto saved = std::make_shared<std::vector<std::vector<std::byte>>>();
  for (std::size_t i = 0; i < k->arg_bytes.size(); ++i) {
    const auto* p = static_cast<const std::byte*>(args[i]);
    saved->emplace_back(p, p + k->arg_bytes[i]);
  }
  rt().run_in_order(*s, t, k->name, [k, saved, grid = a.grid, block = a.block] {
    std::vector<void*> ptrs;
    for (auto& v : *saved) ptrs.push_back(v.data());
    k->run(KernelArgs{ptrs.data(), grid, block});
  });
  return cudaSuccess;
}

}  // extern "C"
