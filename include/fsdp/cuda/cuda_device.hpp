#pragma once
// CudaDevice: the fsdp::Device of one CUDA GPU. Every operation is queued on the device's
// own non-blocking "compute stream", so they run in the order they were issued:
//   - MemorySpace::device: stream-ordered cudaMallocAsync / cudaFreeAsync;
//   - MemorySpace::host: pinned memory (cudaMallocHost), freed after the stream drains,
//     since a queued copy may still read it;
//   - copy: cudaMemcpyAsync(cudaMemcpyDefault) in any direction (unified addressing);
//   - fill_zero: cudaMemsetAsync;
//   - scale / accumulate / cast / unscale: kernels compiled at run time with NVRTC for this GPU's
//     architecture (once per CudaDevice, on first use), loaded with the runtime's library
//     API (cudaLibraryLoadData + cudaLibraryGetKernel) and launched with cudaLaunchKernel.
//     Only the CUDA runtime (libcudart) and NVRTC (libnvrtc) are used, never the driver
//     API, so a program using this header links and starts on a machine without a GPU
//     driver; cuda_device_count() then returns 0.
// The kernels compute exactly what fsdp::HostDevice computes: f32/f64 in their own type
// without fused multiply-adds or flush-to-zero, f16/bf16 through float with the same
// bitwise round-to-nearest-even conversions as fsdp/dtype.hpp, rounding to the 16-bit
// type after every operation, so results are bitwise identical (NaN payloads from
// arithmetic aside, which differ between CPUs and GPUs).
// Like HostDevice, one CudaDevice is used by one thread at a time.
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/detail/memory_counter.hpp"
#include "fsdp/device.hpp"
#include "fsdp/dtype.hpp"
#include "fsdp/error.hpp"

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

namespace detail {

// The kernels' dtype codes are fsdp::DType's values.
static_assert(static_cast<int>(DType::f32) == 0 && static_cast<int>(DType::f64) == 1 &&
              static_cast<int>(DType::f16) == 2 && static_cast<int>(DType::bf16) == 3 &&
              static_cast<int>(DType::i8) == 4 && static_cast<int>(DType::u8) == 5 &&
              static_cast<int>(DType::i32) == 6 && static_cast<int>(DType::i64) == 7);

// NVRTC source of the element-wise kernels. Self-contained: no #include, so it compiles
// the same wherever NVRTC is installed. The 16-bit conversions are fsdp/dtype.hpp's,
// line for line.
inline constexpr std::string_view cuda_kernels_source = R"cuda(
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I8 = 4, U8 = 5, I32 = 6, I64 = 7 };

__device__ __forceinline__ u16 float_to_bf16_bits(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // ties go to the even neighbour
  return (u16)(u >> 16);
}

__device__ __forceinline__ float bf16_bits_to_float(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ u16 float_to_f16_bits(float f) {
  const u32 u = __float_as_uint(f);
  const u32 sign = (u >> 16) & 0x8000u;
  const u32 abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return (u16)(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return (u16)sign;  // rounds to 0 (ties to even 0)
    const u32 exp = abs >> 23;
    const u32 mant = (abs & 0x7fffffu) | 0x800000u;
    const u32 shift = 126u - exp;
    u32 r = mant >> shift;
    const u32 rem = mant & ((1u << shift) - 1u);
    const u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (u16)(sign | r);
  }
  u32 r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return (u16)(sign | (r >> 13));
}

__device__ __forceinline__ float f16_bits_to_float(u16 h) {
  const u32 sign = (u32)(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1fu;
  u32 mant = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return __uint_as_float(sign);
    int e = -1;  // normalise the subnormal
    do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
    return __uint_as_float(sign | (u32)(112 - e) << 23 | (mant & 0x3ffu) << 13);
  }
  return __uint_as_float(sign | (exp + 112u) << 23 | mant << 13);
}

__device__ __forceinline__ bool is_half(int t) { return t == F16 || t == BF16; }
__device__ __forceinline__ float half_load(u16 v, int t) {
  return t == F16 ? f16_bits_to_float(v) : bf16_bits_to_float(v);
}
__device__ __forceinline__ u16 half_store(float v, int t) {
  return t == F16 ? float_to_f16_bits(v) : float_to_bf16_bits(v);
}

__device__ double load_as_double(const void* p, u64 i, int t) {
  switch (t) {
    case F32: return ((const float*)p)[i];
    case F64: return ((const double*)p)[i];
    case F16: return f16_bits_to_float(((const u16*)p)[i]);
    case BF16: return bf16_bits_to_float(((const u16*)p)[i]);
    case I8: return ((const signed char*)p)[i];
    case U8: return ((const unsigned char*)p)[i];
    case I32: return ((const int*)p)[i];
    case I64: return (double)((const i64*)p)[i];
  }
  return 0;
}

// double -> 16-bit in one rounding step (through float would round twice).
__device__ u16 double_to_16bit(double d, int exp_bits, int mant_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const u64 inf = ((1ull << exp_bits) - 1) << mant_bits;
  const u64 u = (u64)__double_as_longlong(d);
  const u16 sign = (u16)((u >> 48) & 0x8000u);
  const u64 abs = u & 0x7fffffffffffffffull;
  if (abs > 0x7ff0000000000000ull) return (u16)(sign | inf | (1ull << (mant_bits - 1)));
  const int e = (int)(abs >> 52) - 1023;
  if (e < -bias - mant_bits) return sign;
  const u64 m = (abs & 0xfffffffffffffull) | (1ull << 52);
  const int sub = 1 - bias - e;
  const int drop = 52 - mant_bits + (sub > 0 ? sub : 0);
  u64 r = m >> drop;
  const u64 rest = m & ((1ull << drop) - 1), half = 1ull << (drop - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  const int biased = e + bias > 1 ? e + bias : 1;
  const u64 bits = ((u64)(biased - 1) << mant_bits) + r;
  return (u16)(sign | (bits < inf ? bits : inf));
}

__device__ void store_from_double(void* p, u64 i, int t, double v) {
  switch (t) {
    case F32: ((float*)p)[i] = (float)v; return;
    case F64: ((double*)p)[i] = v; return;
    case F16: ((u16*)p)[i] = double_to_16bit(v, 5, 10); return;
    case BF16: ((u16*)p)[i] = double_to_16bit(v, 8, 7); return;
    case I8: ((signed char*)p)[i] = (signed char)v; return;
    case U8: ((unsigned char*)p)[i] = (unsigned char)v; return;
    case I32: ((int*)p)[i] = (int)v; return;
    case I64: ((i64*)p)[i] = (i64)v; return;
  }
}

#define FSDP_FOR_EACH(i, n) \
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

template <class T> __device__ void scale_float(T* q, u64 n, double factor) {
  const T f = (T)factor;
  FSDP_FOR_EACH(i, n) q[i] = (T)(q[i] * f);
}
template <class T> __device__ void scale_int(T* q, u64 n, double factor) {  // not truncating factor
  FSDP_FOR_EACH(i, n) q[i] = (T)(q[i] * factor);
}
template <class T> __device__ void add(T* d, const T* s, u64 n) {
  FSDP_FOR_EACH(i, n) d[i] = (T)(d[i] + s[i]);
}

extern "C" __global__ void fsdp_scale(void* p, u64 n, int t, double factor) {
  switch (t) {
    case F32: scale_float((float*)p, n, factor); return;
    case F64: scale_float((double*)p, n, factor); return;
    case F16: case BF16: {
      u16* q = (u16*)p;
      const float f = (float)factor;
      FSDP_FOR_EACH(i, n) q[i] = half_store(half_load(q[i], t) * f, t);
      return;
    }
    case I8: scale_int((signed char*)p, n, factor); return;
    case U8: scale_int((unsigned char*)p, n, factor); return;
    case I32: scale_int((int*)p, n, factor); return;
    case I64: scale_int((i64*)p, n, factor); return;
  }
}

extern "C" __global__ void fsdp_accumulate(void* dst, const void* src, u64 n, int t) {
  switch (t) {
    case F32: add((float*)dst, (const float*)src, n); return;
    case F64: add((double*)dst, (const double*)src, n); return;
    case F16: case BF16: {
      u16* d = (u16*)dst;
      const u16* s = (const u16*)src;
      FSDP_FOR_EACH(i, n) d[i] = half_store(half_load(d[i], t) + half_load(s[i], t), t);
      return;
    }
    case I8: add((signed char*)dst, (const signed char*)src, n); return;
    case U8: add((unsigned char*)dst, (const unsigned char*)src, n); return;
    case I32: add((int*)dst, (const int*)src, n); return;
    case I64: add((i64*)dst, (const i64*)src, n); return;
  }
}

__device__ __forceinline__ bool finite_f32(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool finite_f64(double v) {
  return ((u64)__double_as_longlong(v) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// ShardedGradScaler's unscale, as fsdp::detail::host_unscale: the product in double,
// rounded once; *nonfinite = 1 if any result is inf/NaN (every writer stores the same 1;
// the flag is cleared only by CudaDevice::found_nonfinite).
extern "C" __global__ void fsdp_unscale(void* p, u64 n, int t, double inv, u32* nonfinite) {
  bool bad = false;
  switch (t) {
    case F32: {
      float* q = (float*)p;
      FSDP_FOR_EACH(i, n) { const float v = (float)((double)q[i] * inv); bad |= !finite_f32(v); q[i] = v; }
      break;
    }
    case F64: {
      double* q = (double*)p;
      FSDP_FOR_EACH(i, n) { const double v = q[i] * inv; bad |= !finite_f64(v); q[i] = v; }
      break;
    }
    case F16: case BF16: {
      u16* q = (u16*)p;
      FSDP_FOR_EACH(i, n) {
        const u16 b = half_store((float)((double)half_load(q[i], t) * inv), t);
        bad |= !finite_f32(half_load(b, t));
        q[i] = b;
      }
      break;
    }
  }
  if (bad) *nonfinite = 1u;
}

// to != from (equal dtypes are a copy). Same steps as fsdp::detail::host_cast.
extern "C" __global__ void fsdp_cast(void* dst, int to, const void* src, int from, u64 n) {
  if (from == F32 && is_half(to)) {  // the mixed-precision hot paths
    const float* s = (const float*)src;
    u16* d = (u16*)dst;
    FSDP_FOR_EACH(i, n) d[i] = half_store(s[i], to);
    return;
  }
  if (is_half(from) && to == F32) {
    const u16* s = (const u16*)src;
    float* d = (float*)dst;
    FSDP_FOR_EACH(i, n) d[i] = half_load(s[i], from);
    return;
  }
  if (to == F64 || from == F64) {
    FSDP_FOR_EACH(i, n) store_from_double(dst, i, to, load_as_double(src, i, from));
    return;
  }
  FSDP_FOR_EACH(i, n) {
    const float v = is_half(from) ? half_load(((const u16*)src)[i], from) : (float)load_as_double(src, i, from);
    if (is_half(to)) ((u16*)dst)[i] = half_store(v, to);
    else store_from_double(dst, i, to, (double)v);
  }
}
)cuda";

// Compiles cuda_kernels_source for compute capability major.minor: a CUBIN for sm_XY when
// this NVRTC knows that architecture, else PTX for the newest compute_XY it supports that
// is not newer than the device (the driver finishes it). Needs no GPU. Throws fsdp::Error
// with NVRTC's log on failure.
struct CudaKernelImage {
  std::vector<char> code;  // CUBIN, or PTX with its terminating NUL
  std::string arch;        // "sm_90" or "compute_90"
};

inline void nvrtc_check(nvrtcResult r, const char* call, int device_index) {
  if (r != NVRTC_SUCCESS)
    fail("CudaDevice(cuda:", device_index, "): ", call, " failed: ", nvrtcGetErrorString(r));
}

inline CudaKernelImage compile_cuda_kernels(int major, int minor, int device_index = 0) {
  const int want = major * 10 + minor;
  int num_archs = 0;
  nvrtc_check(nvrtcGetNumSupportedArchs(&num_archs), "nvrtcGetNumSupportedArchs", device_index);
  std::vector<int> archs(static_cast<std::size_t>(num_archs));
  if (num_archs > 0) nvrtc_check(nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs", device_index);
  const bool exact = std::find(archs.begin(), archs.end(), want) != archs.end();
  int use = want;
  if (!exact) {
    use = 0;
    for (int a : archs)
      if (a <= want) use = std::max(use, a);
    if (use == 0)
      fail("CudaDevice(cuda:", device_index, "): NVRTC supports no architecture up to compute capability ",
           major, ".", minor);
  }
  CudaKernelImage image;
  image.arch = (exact ? "sm_" : "compute_") + std::to_string(use);
  const std::string arch_opt = "--gpu-architecture=" + image.arch;
  const char* opts[] = {arch_opt.c_str(), "--std=c++17", "--fmad=false", "--ftz=false",
                        "--prec-div=true", "--prec-sqrt=true"};

  nvrtcProgram prog = nullptr;
  const std::string src(cuda_kernels_source);
  nvrtc_check(nvrtcCreateProgram(&prog, src.c_str(), "fsdp_cuda_kernels.cu", 0, nullptr, nullptr),
              "nvrtcCreateProgram", device_index);
  struct Destroy {
    nvrtcProgram* p;
    ~Destroy() { nvrtcDestroyProgram(p); }
  } destroy{&prog};

  const nvrtcResult compiled = nvrtcCompileProgram(prog, static_cast<int>(std::size(opts)), opts);
  if (compiled != NVRTC_SUCCESS) {
    std::size_t log_size = 0;
    std::string log;
    if (nvrtcGetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
      log.resize(log_size);
      if (nvrtcGetProgramLog(prog, log.data()) != NVRTC_SUCCESS) log.clear();
      while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
    }
    fail("CudaDevice(cuda:", device_index, "): nvrtcCompileProgram(", arch_opt, ") failed: ",
         nvrtcGetErrorString(compiled), "\n", log);
  }
  std::size_t size = 0;
  if (exact) {
    nvrtc_check(nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize", device_index);
    image.code.resize(size);
    nvrtc_check(nvrtcGetCUBIN(prog, image.code.data()), "nvrtcGetCUBIN", device_index);
  } else {
    nvrtc_check(nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize", device_index);  // includes the NUL
    image.code.resize(size);
    nvrtc_check(nvrtcGetPTX(prog, image.code.data()), "nvrtcGetPTX", device_index);
  }
  return image;
}

}  // namespace detail

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
  }

  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  ~CudaDevice() {  // errors cannot be reported from here; release what we can
    int prev = -1;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    cudaSetDevice(index_);
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (flag_) cudaFree(flag_);
    if (library_) cudaLibraryUnload(library_);
    if (have_prev && prev != index_) cudaSetDevice(prev);
    (void)cudaGetLastError();
  }

  DeviceId id() const { return {DeviceKind::cuda, index_}; }
  int index() const { return index_; }
  cudaStream_t stream() const { return stream_; }  // the compute stream all work is queued on

  void* allocate(std::size_t bytes, MemorySpace space = MemorySpace::device) {
    if (bytes == 0) return nullptr;
    Guard g(*this);
    void* p = nullptr;
    if (space == MemorySpace::device)
      check(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync(", bytes, " bytes)");
    else
      check(cudaMallocHost(&p, bytes), "cudaMallocHost(", bytes, " bytes)");
    counter_.allocated(bytes, space);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, MemorySpace space = MemorySpace::device) {
    if (!p) return;
    counter_.check_free(bytes, space, "CudaDevice(cuda:" + std::to_string(index_) + ")");
    Guard g(*this);
    if (space == MemorySpace::device) {
      check(cudaFreeAsync(p, stream_), "cudaFreeAsync");
    } else {
      check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (before cudaFreeHost)");
      check(cudaFreeHost(p), "cudaFreeHost");
    }
    counter_.freed(bytes, space);
  }

  void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    Guard g(*this);
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync(", bytes, " bytes)");
  }

  void fill_zero(void* p, std::size_t bytes) {
    if (bytes == 0) return;
    Guard g(*this);
    check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync(", bytes, " bytes)");
  }

  void scale(void* p, std::size_t n, DType t, double factor) {
    if (n == 0) return;
    Guard g(*this);
    unsigned long long count = n;
    int dtype = static_cast<int>(t);
    void* args[] = {&p, &count, &dtype, &factor};
    launch(kernels().scale, "fsdp_scale", n, args);
  }

  void accumulate(void* dst, const void* src, std::size_t n, DType t) {
    if (n == 0) return;
    Guard g(*this);
    unsigned long long count = n;
    int dtype = static_cast<int>(t);
    void* args[] = {&dst, const_cast<void**>(&src), &count, &dtype};
    launch(kernels().accumulate, "fsdp_accumulate", n, args);
  }

  void cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
    if (n == 0) return;
    if (to == from) {
      if (dst != src) copy(dst, src, n * size_of(to));
      return;
    }
    Guard g(*this);
    unsigned long long count = n;
    int to_i = static_cast<int>(to), from_i = static_cast<int>(from);
    void* args[] = {&dst, &to_i, const_cast<void**>(&src), &from_i, &count};
    launch(kernels().cast, "fsdp_cast", n, args);
  }

  // ShardedGradScaler's unscale (see UnscalingDevice): one kernel per call, each setting a
  // device flag on inf/NaN; found_nonfinite() reads and clears the flag with one wait.
  void unscale(void* p, std::size_t n, DType t, double inv_scale) {
    if (!is_floating(t)) detail::fail("CudaDevice(cuda:", index_, "): unscale needs a floating dtype, got ", name_of(t));
    if (n == 0) return;
    Guard g(*this);
    if (!flag_) {
      check(cudaMalloc(reinterpret_cast<void**>(&flag_), sizeof(unsigned)), "cudaMalloc(unscale flag)");
      check(cudaMemsetAsync(flag_, 0, sizeof(unsigned), stream_), "cudaMemsetAsync(unscale flag)");
    }
    unsigned long long count = n;
    int dtype = static_cast<int>(t);
    void* args[] = {&p, &count, &dtype, &inv_scale, &flag_};
    launch(kernels().unscale, "fsdp_unscale", n, args);
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

  void synchronize() {
    Guard g(*this);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  MemoryStats stats(MemorySpace space = MemorySpace::device) const { return counter_.stats(space); }
  void reset_peak(MemorySpace space = MemorySpace::device) { counter_.reset_peak(space); }

  // Which code the kernels were loaded from ("sm_90" CUBIN or "compute_XY" PTX); empty
  // before the first scale/accumulate/cast.
  const std::string& kernel_arch() const { return arch_; }

 private:
  struct Kernels {
    cudaKernel_t scale = nullptr, accumulate = nullptr, cast = nullptr, unscale = nullptr;
  };

  // Makes this device current for the calling thread, restoring the previous one after.
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
    detail::fail("CudaDevice(cuda:", index_, "): ", call, std::forward<Parts>(parts)..., " failed: ",
                 cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
  }

  const Kernels& kernels() {  // compiles and loads on first use (the caller holds a Guard)
    std::call_once(loaded_, [this] {
      int major = 0, minor = 0;
      check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index_),
            "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
      check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index_),
            "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
      const detail::CudaKernelImage image = detail::compile_cuda_kernels(major, minor, index_);
      cudaLibrary_t lib = nullptr;
      check(cudaLibraryLoadData(&lib, image.code.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
            "cudaLibraryLoadData(", image.arch, ")");
      Kernels k;
      const std::pair<cudaKernel_t*, const char*> names[] = {
          {&k.scale, "fsdp_scale"}, {&k.accumulate, "fsdp_accumulate"}, {&k.cast, "fsdp_cast"},
          {&k.unscale, "fsdp_unscale"}};
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
    });
    return kernels_;
  }

  void launch(cudaKernel_t kernel, const char* name, std::size_t n, void** args) {
    constexpr unsigned threads = 256;
    const std::size_t wanted = (n + threads - 1) / threads;
    const std::size_t cap = static_cast<std::size_t>(std::max(sm_count_, 1)) * 32;  // grid-stride beyond
    const dim3 grid(static_cast<unsigned>(std::min(wanted, cap)));
    // cudaKernel_t is launched through the runtime's const void* entry point (CUDA 12+).
    check(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, dim3(threads), args, 0, stream_),
          "cudaLaunchKernel(", name, ", ", n, " elements)");
  }

  int index_;
  int sm_count_ = 0;
  cudaStream_t stream_ = nullptr;
  unsigned* flag_ = nullptr;  // unscale's inf/NaN flag: 4 device bytes of its own, not counted
  detail::MemoryCounter counter_;
  std::once_flag loaded_;
  cudaLibrary_t library_ = nullptr;
  Kernels kernels_;
  std::string arch_;
};

static_assert(UnscalingDevice<CudaDevice>);

}  // namespace fsdp
