#pragma once
// CudaDevice: the fsdp::Device of one CUDA GPU. Every operation is queued on one "compute
// stream", so they run in the order they were issued: the engine's own (CudaDevice(index,
// stream): the library's work lands in the engine's stream order, and collectives are
// waited for there, see docs/cuda.md) or, by default, a non-blocking stream of its own.
//   - MemorySpace::device: stream-ordered cudaMallocAsync / cudaFreeAsync;
//   - MemorySpace::host: pinned memory (cudaMallocHost), freed after the stream drains,
//     since a queued copy may still read it;
//   - copy: cudaMemcpyAsync(cudaMemcpyDefault) in any direction (unified addressing);
//   - fill_zero: cudaMemsetAsync; fill_zero_batch: one kernel launch per 128 buffers;
//     cast_zeroing: one kernel, a cast and up to 128 buffers zeroed;
//   - scale / accumulate / cast / unscale / quantize / dequantize and the per-tensor
//     abs_max / max_over_rows / quantize_tensor / dequantize_tensor: kernels compiled at
//     run time with NVRTC for this GPU's
//     architecture (once per CudaDevice, on first use; kept in an on-disk cache so later
//     processes skip the compile, see fsdp/cuda/kernel_cache.hpp), loaded with the runtime's library
//     API (cudaLibraryLoadData + cudaLibraryGetKernel) and launched with cudaLaunchKernel.
//     Only the CUDA runtime (libcudart) and NVRTC (libnvrtc) are used, never the driver
//     API, so a program using this header links and starts on a machine without a GPU
//     driver; cuda_device_count() then returns 0.
// The kernels compute exactly what fsdp::HostDevice computes: f32/f64 in their own type
// without fused multiply-adds or flush-to-zero, f16/bf16 through float with the same
// bitwise round-to-nearest-even conversions as fsdp/core/dtype.hpp, rounding to the 16-bit
// type after every operation, so results are bitwise identical (NaN payloads from
// arithmetic aside, which differ between CPUs and GPUs).
// Like HostDevice, one CudaDevice is used by one thread at a time.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/detail/memory_counter.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/quantize.hpp"
#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/cuda/cuda_kernels.hpp"

namespace fsdp {

// Number of CUDA devices visible to this process; 0 (never an error) when there is no
// GPU or no driver.
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error for later calls
    return 0;
  }
  return n;
}

class CudaDevice {
 public:
  explicit CudaDevice(int device_index = 0) : index_(device_index) {
    const int count = cuda_device_count();
    if (device_index < 0 || device_index >= count)
      detail::fail("CudaDevice(cuda:", device_index, "): no such CUDA device (", count, " visible)");
    Guard g(*this);
    check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, index_),
          "cudaDeviceGetAttribute(MultiProcessorCount)");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    owns_stream_ = true;
  }

  // On the engine's compute stream, which the engine owns and keeps alive longer than this
  // device (the legacy default stream, a null handle, is refused: it would serialize with
  // every other stream, the library's communication streams included).
  CudaDevice(int device_index, cudaStream_t compute_stream) : index_(device_index), stream_(compute_stream) {
    const int count = cuda_device_count();
    if (device_index < 0 || device_index >= count)
      detail::fail("CudaDevice(cuda:", device_index, "): no such CUDA device (", count, " visible)");
    if (!compute_stream)
      detail::fail("CudaDevice(cuda:", device_index, "): the compute stream is null (the legacy default stream); ",
                   "pass a stream of the engine's (e.g. from cudaStreamCreateWithFlags(.., cudaStreamNonBlocking))");
    Guard g(*this);
    check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, index_),
          "cudaDeviceGetAttribute(MultiProcessorCount)");
#if CUDART_VERSION >= 12080  // cudaStreamGetDevice is CUDA 12.8's
    int stream_device = -1;
    check(cudaStreamGetDevice(compute_stream, &stream_device), "cudaStreamGetDevice(compute stream)");
    if (stream_device != index_)
      detail::fail("CudaDevice(cuda:", index_, "): the compute stream belongs to cuda:", stream_device);
#endif
  }

  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  ~CudaDevice() {  // errors cannot be reported from here; release what we can
    int prev = -1;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    cudaSetDevice(index_);
    if (stream_) {
      cudaStreamSynchronize(stream_);  // queued frees and kernels of this device are done
      if (owns_stream_) cudaStreamDestroy(stream_);
    }
    if (flag_) cudaFree(flag_);
    if (first_bad_) cudaFree(first_bad_);
    if (library_) cudaLibraryUnload(library_);
    if (have_prev && prev != index_) cudaSetDevice(prev);
    (void)cudaGetLastError();
  }

  DeviceId id() const { return {DeviceKind::cuda, index_}; }
  int index() const { return index_; }
  cudaStream_t stream() const { return stream_; }  // the compute stream all work is queued on
  // The compute stream as a QueuedDevice's queue: collectives' Work wait on it there.
  DeviceQueue queue() const { return {id(), stream_}; }

  void* allocate(std::size_t bytes, MemorySpace space = MemorySpace::device) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (space == MemorySpace::device) {  // from the stream's device's pool: no Guard needed
      check(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync(", bytes, " bytes)");
      if (!p) detail::fail("CudaDevice(cuda:", index_, "): cudaMallocAsync(", bytes, " bytes) gave no memory");
    } else {
      Guard g(*this);
      check(cudaMallocHost(&p, bytes), "cudaMallocHost(", bytes, " bytes)");
    }
    counter_.allocated(bytes, space);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, MemorySpace space = MemorySpace::device) {
    if (!p) return;
    counter_.check_free(bytes, space, "CudaDevice(cuda:" + std::to_string(index_) + ")");
    if (space == MemorySpace::device) {
      check(cudaFreeAsync(p, stream_), "cudaFreeAsync");  // ordered on the stream: no Guard needed
    } else {
      Guard g(*this);
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (before cudaFreeHost)");
      check(cudaFreeHost(p), "cudaFreeHost");
    }
    counter_.freed(bytes, space);
  }

  void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;  // a copy may be queued on a stream of another device: no Guard
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync(", bytes, " bytes)");
  }

  void fill_zero(void* p, std::size_t bytes) {
    if (bytes == 0) return;
    Guard g(*this);
    memset_zero(p, bytes);
  }

  // Many device-space buffers, one launch per 128 of them (BatchZeroingDevice); a lone
  // buffer is a cudaMemsetAsync.
  void fill_zero_batch(std::span<const ZeroSpan> spans) {
    if (spans.empty()) return;  // nothing to make current for (cast_zeroing's rest, usually)
    Guard g(*this);
    detail::ZeroSpans table;
    void* args[] = {&table};
    while (!spans.empty()) {
      spans = spans.subspan(detail::fill_zero_spans_table(spans, table));
      if (table.count == 1) memset_zero(table.data[0], table.bytes[0]);
      if (table.count <= 1) continue;
      launch(kernels().zero_spans, grid_for(table), args, stream_, "fsdp_zero_spans, ", table.count, " buffers");
    }
  }

  void scale(void* p, std::size_t n, DType t, double factor) { scale_on(stream_, p, n, t, factor); }
  void accumulate(void* dst, const void* src, std::size_t n, DType t) { accumulate_on(stream_, dst, src, n, t); }

  // scale and accumulate queued on another stream of this GPU (CudaThreadComm reduces on
  // its communication streams with them).
  void scale_on(cudaStream_t stream, void* p, std::size_t n, DType t, double factor) {
    if (n == 0) return;
    kernel_dtype("scale", t);
    Guard g(*this);
    unsigned long long count = n;
    int dtype = static_cast<int>(t);
    void* args[] = {&p, &count, &dtype, &factor};
    launch(kernels().scale, grid_for(n), args, stream, "fsdp_scale, ", n, " elements");
  }
  void accumulate_on(cudaStream_t stream, void* dst, const void* src, std::size_t n, DType t) {
    if (n == 0) return;
    kernel_dtype("accumulate", t);
    Guard g(*this);
    unsigned long long count = n;
    int dtype = static_cast<int>(t);
    void* args[] = {&dst, const_cast<void**>(&src), &count, &dtype};
    launch(kernels().accumulate, grid_for(n), args, stream, "fsdp_accumulate, ", n, " elements");
  }

  void cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
    if (n == 0) return;
    if (to == from) {
      if (dst != src) copy(dst, src, n * size_of(to));
      return;
    }
    kernel_dtype("cast", to), kernel_dtype("cast", from);
    Guard g(*this);
    unsigned long long count = n;
    int to_i = static_cast<int>(to), from_i = static_cast<int>(from);
    void* args[] = {&dst, &to_i, const_cast<void**>(&src), &from_i, &count};
    launch(kernels().cast, grid_for(n), args, stream_, "fsdp_cast, ", n, " elements");
  }

  // The cast and the zeroing in one launch (CastZeroingDevice): the cast gets the grid it
  // would get alone, the zeroing as many blocks more as fill_zero_batch would give it. A
  // copy (to == from) goes as the two calls; buffers past the first 128 as fill_zero_batch's.
  void cast_zeroing(void* dst, DType to, const void* src, DType from, std::size_t n, std::span<const ZeroSpan> spans) {
    if (to == from || n == 0) {
      fill_zero_batch(spans);
      return cast(dst, to, src, from, n);
    }
    detail::ZeroSpans table;
    const std::size_t taken = detail::fill_zero_spans_table(spans, table);
    if (table.count == 0) return cast(dst, to, src, from, n);  // only empty spans
    kernel_dtype("cast", to), kernel_dtype("cast", from);
    Guard g(*this);
    unsigned long long count = n;
    int to_i = static_cast<int>(to), from_i = static_cast<int>(from);
    unsigned cast_grid = grid_for(n);
    void* args[] = {&dst, &to_i, const_cast<void**>(&src), &from_i, &count, &cast_grid, &table};
    launch(kernels().cast_zero, cast_grid + grid_for(table), args, stream_, "fsdp_cast_zero, ", n, " elements, ",
           table.count, " buffers");
    fill_zero_batch(spans.subspan(taken));
  }

  // ShardedGradScaler's unscale (see UnscalingDevice): one kernel per call, each setting a
  // device flag on inf/NaN; found_nonfinite() reads and clears the flag with one wait.
  void unscale(void* p, std::size_t n, DType t, double inv_scale) {
    if (!is_floating(t)) detail::fail("CudaDevice(cuda:", index_, "): unscale needs a floating dtype, got ", name_of(t));
    if (n == 0) return;
    kernel_dtype("unscale", t);
    Guard g(*this);
    if (!flag_) {
      check(cudaMalloc(reinterpret_cast<void**>(&flag_), sizeof(unsigned)), "cudaMalloc(unscale flag)");
      check(cudaMemsetAsync(flag_, 0, sizeof(unsigned), stream_), "cudaMemsetAsync(unscale flag)");
    }
    unsigned long long count = n;
    int dtype = static_cast<int>(t);
    void* args[] = {&p, &count, &dtype, &inv_scale, &flag_};
    launch(kernels().unscale, grid_for(n), args, stream_, "fsdp_unscale, ", n, " elements");
  }

  bool found_nonfinite() {
    if (!flag_) return false;  // no unscale yet
    Guard g(*this);
    unsigned found = 0;
    check(cudaMemcpyAsync(&found, flag_, sizeof found, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync(unscale flag)");
    check(cudaMemsetAsync(flag_, 0, sizeof(unsigned), stream_), "cudaMemsetAsync(unscale flag)");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return found != 0;
  }

  // Block quantization of n f32 values on the device, bit for bit what fsdp/core/quantize.hpp
  // computes on the host (QuantFormat names the host function): q gets n one-byte codes,
  // scales one scale per block (f32, or e8m0 for MXFP8, whose block is 32). A block
  // holding an inf or NaN is written as a NaN block (zero codes, a NaN scale, 0xff in
  // e8m0: it dequantizes to NaNs); quantize_nonfinite() says which element. Sizes
  // are the caller's: n codes, ceil(n / block) scales. One launch, no wait; one warp per
  // block, so a block of a whole large tensor is slow.
  void quantize(QuantFormat format, const float* x, std::size_t n, void* q, void* scales, std::size_t block) {
    check_quant_block(format, block, "CudaDevice(cuda:" + std::to_string(index_) + ")::quantize");
    if (n == 0) return;
    Guard g(*this);
    if (!first_bad_) {
      check(cudaMalloc(reinterpret_cast<void**>(&first_bad_), sizeof(unsigned long long)), "cudaMalloc(quantize flag)");
      check(cudaMemsetAsync(first_bad_, 0xff, sizeof(unsigned long long), stream_), "cudaMemsetAsync(quantize flag)");
    }
    unsigned long long count = n, blk = block;
    int f = static_cast<int>(format);
    void* args[] = {&q, &scales, const_cast<float**>(&x), &count, &f, &blk, &first_bad_};
    launch(kernels().quantize, grid_for(detail::block_count(n, block) * 32), args, stream_, "fsdp_quantize ",
           name_of(format), ", ", n, " elements");  // a warp per block
  }

  // Its inverse, as the host's dequantize functions: x[i] = code i times its block's scale.
  void dequantize(QuantFormat format, const void* q, const void* scales, std::size_t n, float* x, std::size_t block) {
    check_quant_block(format, block, "CudaDevice(cuda:" + std::to_string(index_) + ")::dequantize");
    if (n == 0) return;
    Guard g(*this);
    unsigned long long count = n, blk = block;
    int f = static_cast<int>(format);
    void* args[] = {&x, const_cast<void**>(&q), const_cast<void**>(&scales), &count, &f, &blk};
    launch(kernels().dequantize, grid_for(n), args, stream_, "fsdp_dequantize ", name_of(format), ", ", n, " elements");
  }

  // Per-tensor scaling (TensorScalingDevice), bit for bit fsdp/core/quantize.hpp's
  // detail::abs_max_or_inf, max_over_rows, quantize_tensor_with_amax and
  // dequantize_tensor_with_amax; the amaxes stay in device memory (no host wait). abs_max zeroes *out, then each block of
  // the launch folds its largest |x| into it (atomicMax): a parameter's slice is one
  // launch over as many blocks as its elements need, so a large slice is not left to one SM.
  void abs_max(const float* x, std::size_t n, float* out) {
    Guard g(*this);
    check(cudaMemsetAsync(out, 0, sizeof(float), stream_), "cudaMemsetAsync(abs_max)");
    if (n == 0) return;
    unsigned long long count = n;
    void* args[] = {const_cast<float**>(&x), &count, &out};
    launch(kernels().abs_max, grid_for(n), args, stream_, "fsdp_abs_max, ", n, " elements");
  }
  void max_over_rows(const float* in, std::size_t rows, std::size_t n, float* out) {
    if (n == 0) return;
    Guard g(*this);
    unsigned long long r = rows, count = n;
    void* args[] = {&out, const_cast<float**>(&in), &r, &count};
    launch(kernels().max_over_rows, grid_for(n), args, stream_, "fsdp_max_over_rows, ", rows, " rows of ", n);
  }
  void quantize_tensor(QuantFormat format, const float* x, std::size_t n, void* q, const float* amax) {
    launch_per_tensor(&Kernels::quantize_tensor, "quantize_tensor", format, q, x, n, amax);
  }
  void dequantize_tensor(QuantFormat format, const void* q, std::size_t n, const float* amax, float* y) {
    launch_per_tensor(&Kernels::dequantize_tensor, "dequantize_tensor", format, y, q, n, amax);
  }

  // The lowest index, within its call's x, of an inf or NaN that a quantize since the last
  // call met (its block was written as a NaN block), or nullopt; clears it. Waits
  // for the stream, as found_nonfinite does. Over several quantizes it is the lowest of
  // their indices: check after each one whose failure must be told apart.
  std::optional<std::size_t> quantize_nonfinite() {
    if (!first_bad_) return std::nullopt;  // no quantize yet
    Guard g(*this);
    unsigned long long found = 0;
    check(cudaMemcpyAsync(&found, first_bad_, sizeof found, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync(quantize flag)");
    check(cudaMemsetAsync(first_bad_, 0xff, sizeof found, stream_), "cudaMemsetAsync(quantize flag)");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (found == ~0ull) return std::nullopt;
    return static_cast<std::size_t>(found);
  }

  void synchronize() {
    Guard g(*this);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  MemoryStats stats(MemorySpace space = MemorySpace::device) const { return counter_.stats(space); }
  void reset_peak(MemorySpace space = MemorySpace::device) { counter_.reset_peak(space); }

  // Which code the kernels were loaded from ("sm_90" CUBIN or "compute_XY" PTX); empty
  // before the first scale/accumulate/cast.
  const std::string& kernel_arch() const { return arch_; }
  bool kernels_from_cache() const { return from_cache_; }  // loaded from the on-disk cache, not compiled

 private:
  struct Kernels {
    cudaKernel_t scale = nullptr, accumulate = nullptr, cast = nullptr, unscale = nullptr, zero_spans = nullptr,
                 cast_zero = nullptr, quantize = nullptr, dequantize = nullptr, abs_max = nullptr, max_over_rows = nullptr,
                 quantize_tensor = nullptr, dequantize_tensor = nullptr;
  };

  // Makes this device current for the calling thread, restoring the previous one after:
  // around kernel launches (they fail on a stream of a device that is not current), memsets
  // and the calls that are not stream-ordered. Stream-ordered allocation, free and copy take
  // their device from the stream, so they go without one (a cudaGetDevice saved per call,
  // several per unit and step).
  struct Guard {
    explicit Guard(const CudaDevice& d) : index(d.index_) {
      d.check(cudaGetDevice(&prev), "cudaGetDevice");
      if (prev != index) d.check(cudaSetDevice(index), "cudaSetDevice");
    }
    ~Guard() {
      if (prev != index) cudaSetDevice(prev);
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    int index;
    int prev = -1;
  };

  template <class... Parts>
  void check(cudaError_t e, const char* call, Parts&&... parts) const {
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();  // clear it unless sticky, so the next call does not see it
    // fsdp::CapturedStep freeing a failed step's buffers into the capture that failed.
    if (e == cudaErrorStreamCaptureInvalidated && detail::discarding_failed_capture) return;
    detail::fail_as(detail::cuda_error_kind(e), "CudaDevice(cuda:", index_, "): ", call, std::forward<Parts>(parts)...,
                    " failed: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
  }

  const Kernels& kernels() {  // compiles and loads on first use (the caller holds a Guard)
    std::call_once(loaded_, [this] {
      int major = 0, minor = 0;
      check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index_),
            "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
      check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index_),
            "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
      const detail::CudaKernelImage image =
          detail::load_cuda_kernels(major, minor, index_, detail::KernelCache::from_environment());
      cudaLibrary_t lib = nullptr;
      check(cudaLibraryLoadData(&lib, image.code.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
            "cudaLibraryLoadData(", image.arch, ")");
      Kernels k;
      const std::pair<cudaKernel_t*, const char*> names[] = {
          {&k.scale, "fsdp_scale"}, {&k.accumulate, "fsdp_accumulate"}, {&k.cast, "fsdp_cast"},
          {&k.unscale, "fsdp_unscale"}, {&k.zero_spans, "fsdp_zero_spans"},
          {&k.cast_zero, "fsdp_cast_zero"}, {&k.quantize, "fsdp_quantize"}, {&k.dequantize, "fsdp_dequantize"},
          {&k.abs_max, "fsdp_abs_max"}, {&k.max_over_rows, "fsdp_max_over_rows"},
          {&k.quantize_tensor, "fsdp_quantize_tensor"},
          {&k.dequantize_tensor, "fsdp_dequantize_tensor"}};
      for (auto [slot, name] : names) {
        const cudaError_t e = cudaLibraryGetKernel(slot, lib, name);
        if (e != cudaSuccess) {
          cudaLibraryUnload(lib);
          check(e, "cudaLibraryGetKernel(", name, ")");
        }
      }
      library_ = lib;
      kernels_ = k;
      arch_ = image.arch;
      from_cache_ = image.from_cache;
    });
    return kernels_;
  }

  void memset_zero(void* p, std::size_t bytes) {  // the caller holds a Guard
    check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync(", bytes, " bytes)");
  }

  static constexpr unsigned threads_per_block = 256;

  // At most 32 blocks per SM; the kernels' grid-stride loops cover the rest.
  unsigned capped(std::size_t blocks) const {
    return static_cast<unsigned>(std::min(blocks, static_cast<std::size_t>(std::max(sm_count_, 1)) * 32));
  }
  unsigned grid_for(std::size_t n) const { return capped((n + threads_per_block - 1) / threads_per_block); }  // n elements
  unsigned grid_for(const detail::ZeroSpans& t) const { return capped(t.first_block[t.count]); }  // a zero table

  // quantize_tensor and dequantize_tensor: one launch of `kernel` (out, in, n, format,
  // amax). A block format is refused, as a per-tensor one given to quantize is
  // (check_quant_block).
  void launch_per_tensor(cudaKernel_t Kernels::*kernel, const char* op, QuantFormat format, void* out, const void* in,
                         std::size_t n, const float* amax) {
    if (!is_per_tensor(format))
      detail::fail_as(ErrorKind::misuse, "CudaDevice(cuda:", index_, ")::", op, ": ", name_of(format),
                      " is a block format; ", op, " takes f8e4m3_tensor or f8e5m2_tensor");
    if (n == 0) return;
    Guard g(*this);
    unsigned long long count = n;
    int f = static_cast<int>(format);
    void* args[] = {&out, const_cast<void**>(&in), &count, &f, const_cast<float**>(&amax)};
    launch(kernels().*kernel, grid_for(n), args, stream_, "fsdp_", op, " ", name_of(format), ", ", n, " elements");
  }

  // A dtype the kernels do not compute in (detail::has_kernels) is refused here rather than
  // left undone on the GPU.
  void kernel_dtype(const char* op, DType t) const {
    if (!detail::has_kernels(t))
      detail::fail("CudaDevice(cuda:", index_, "): ", op, " of ", name_of(t),
                   ": the CUDA kernels have no 8-bit float arithmetic yet (copies and collectives move it)");
  }

  // cudaKernel_t is launched through the runtime's const void* entry point (CUDA 12+).
  template <class... What>
  void launch(cudaKernel_t kernel, unsigned grid, void** args, cudaStream_t stream, const What&... what) {
    check(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(threads_per_block), args, 0, stream),
          "cudaLaunchKernel(", what..., ")");
  }

  int index_;
  int sm_count_ = 0;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  unsigned* flag_ = nullptr;  // unscale's inf/NaN flag: 4 device bytes of its own, not counted
  unsigned long long* first_bad_ = nullptr;  // quantize's first inf/NaN (all ones: none); 8 bytes, not counted
  detail::MemoryCounter counter_;
  std::once_flag loaded_;
  cudaLibrary_t library_ = nullptr;
  Kernels kernels_;
  std::string arch_;
  bool from_cache_ = false;
};

static_assert(UnscalingDevice<CudaDevice>);
static_assert(BatchZeroingDevice<CudaDevice>);
static_assert(CastZeroingDevice<CudaDevice>);
static_assert(QueuedDevice<CudaDevice>);
static_assert(QuantizingDevice<CudaDevice>);
static_assert(TensorScalingDevice<CudaDevice>);

}  // namespace fsdp
