#pragma once
// The CUDA engine's own element-wise kernels, compiled with NVRTC when the engine starts
// (no nvcc), for the GPU's architecture, and kept in fsdp's on-disk kernel cache (their
// own key: this source). Loaded with the runtime's library API and launched with
// cudaLaunchKernel on the engine's stream only, like fsdp::CudaDevice's kernels.
//
// Storage dtypes are f32 and bf16 (activations and parameters in the compute dtype); all
// arithmetic is in float, with the bf16 rounding of fsdp/core/dtype.hpp. Compiled without fused
// multiply-adds, so adamw computes exactly what engine::AdamW computes on the host.
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <fsdp/cuda/cuda_kernels.hpp>
#include <fsdp/cuda/kernel_cache.hpp>
#include <fsdp/core/dtype.hpp>

#include "examples/cuda_engine/cuda_calls.hpp"

namespace cuda_engine {

inline constexpr std::string_view kernels_source = R"cuda(
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
enum { F32 = 0, BF16 = 3 };  // fsdp::DType codes

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float((u32)h << 16); }
__device__ __forceinline__ u16 float_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return (u16)(u >> 16);
}
__device__ __forceinline__ float ld(const void* p, u64 i, int t) {
  return t == F32 ? ((const float*)p)[i] : bf16_to_float(((const u16*)p)[i]);
}
__device__ __forceinline__ void st(void* p, u64 i, int t, float v) {
  if (t == F32) ((float*)p)[i] = v; else ((u16*)p)[i] = float_to_bf16(v);
}

// Grid-stride: correct for any grid size (the host caps the grid).
#define FOR_EACH(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// y[r, c] += b[c], y row-major [rows, cols]
extern "C" __global__ void bias_add(void* y, int ty, const void* b, int tb, u64 rows, u64 cols) {
  FOR_EACH(i, rows * cols) st(y, i, ty, ld(y, i, ty) + ld(b, i % cols, tb));
}

// h = max(h, 0) in place (NaN -> 0, as the host engine's `h > 0 ? h : 0`)
extern "C" __global__ void relu(void* h, int t, u64 n) {
  FOR_EACH(i, n) if (!(ld(h, i, t) > 0.0f)) st(h, i, t, 0.0f);
}

// dh = 0 where the activation was cut (h is relu's output: h > 0 exactly where it passed)
extern "C" __global__ void relu_backward(void* dh, const void* h, int t, u64 n) {
  FOR_EACH(i, n) if (!(ld(h, i, t) > 0.0f)) st(dh, i, t, 0.0f);
}

// y = x * g[c] * s[c]   (gain g, fixed scale s), [rows, cols] row-major
extern "C" __global__ void gain_forward(void* y, const void* x, int ta, const void* g, int tg, const void* s, int ts,
                                        u64 rows, u64 cols) {
  FOR_EACH(i, rows * cols) {
    const u64 c = i % cols;
    st(y, i, ta, ld(x, i, ta) * ld(g, c, tg) * ld(s, c, ts));
  }
}

// dx = dy * g[c] * s[c];  p = dy * x * s[c] (the gain's gradient is p summed over rows)
extern "C" __global__ void gain_backward(void* dx, void* p, const void* dy, const void* x, int ta, const void* g, int tg,
                                         const void* s, int ts, u64 rows, u64 cols) {
  FOR_EACH(i, rows * cols) {
    const u64 c = i % cols;
    const float d = ld(dy, i, ta), sc = ld(s, c, ts);
    st(p, i, ta, d * ld(x, i, ta) * sc);
    st(dx, i, ta, d * ld(g, c, tg) * sc);
  }
}

// Mean squared error: dout = (y - target) * scale (scale = 2 / n), and the sum of squares
// added into *sum (one atomic per block). Needs blockDim.x == 256.
extern "C" __global__ void __launch_bounds__(256) mse(const float* y, const float* target, void* dout, int td, u64 n,
                                                      float scale, double* sum) {
  __shared__ double part[256];
  double acc = 0;
  FOR_EACH(i, n) {
    const float d = y[i] - target[i];
    acc += (double)d * d;
    st(dout, i, td, d * scale);
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (unsigned w = 128; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(sum, part[0]);
}

// AdamW on f32 parameters, step for step engine::AdamW (c1, c2: the bias corrections).
extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, u64 n, float lr, float beta1, float beta2,
                                 float eps, float weight_decay, float c1, float c2) {
  FOR_EACH(i, n) {
    const float gi = g[i];
    float pi = p[i];
    pi -= lr * weight_decay * pi;
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    pi -= lr * (mi / c1) / (sqrtf(vi / c2) + eps);
    p[i] = pi;
  }
}

// dst = src converted (f32 <-> bf16); p[i] = v
extern "C" __global__ void cast(void* dst, int td, const void* src, int ts, u64 n) {
  FOR_EACH(i, n) st(dst, i, td, ld(src, i, ts));
}
extern "C" __global__ void fill(void* p, int t, u64 n, float v) {
  FOR_EACH(i, n) st(p, i, t, v);
}
)cuda";

inline constexpr const char* kernel_options[] = {"--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true",
                                                 "--prec-sqrt=true"};

// The source compiled for `arch` ("sm_90", or "compute_XY" PTX the driver finishes).
inline std::vector<char> compile_kernels(const std::string& arch) {
  nvrtcProgram prog = nullptr;
  const std::string source(kernels_source);  // NUL-terminated, alive until the program is compiled
  check(nvrtcCreateProgram(&prog, source.c_str(), "cuda_engine_kernels.cu", 0, nullptr, nullptr), "nvrtcCreateProgram");
  struct Destroy {
    nvrtcProgram* p;
    ~Destroy() { nvrtcDestroyProgram(p); }
  } destroy{&prog};
  const std::string arch_option = "--gpu-architecture=" + arch;
  std::vector<const char*> options{arch_option.c_str()};
  options.insert(options.end(), std::begin(kernel_options), std::end(kernel_options));
  if (nvrtcResult r = nvrtcCompileProgram(prog, static_cast<int>(options.size()), options.data()); r != NVRTC_SUCCESS) {
    std::size_t size = 0;
    std::string log;
    if (nvrtcGetProgramLogSize(prog, &size) == NVRTC_SUCCESS && size > 1) {
      log.resize(size);
      if (nvrtcGetProgramLog(prog, log.data()) != NVRTC_SUCCESS) log.clear();
    }
    check(r, "nvrtcCompileProgram(", arch_option, ")\n", log);
  }
  const bool cubin = arch.rfind("sm_", 0) == 0;
  std::size_t size = 0;
  std::vector<char> code;
  if (cubin) {
    check(nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize");
    code.resize(size);
    check(nvrtcGetCUBIN(prog, code.data()), "nvrtcGetCUBIN");
  } else {
    check(nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize");  // with its NUL
    code.resize(size);
    check(nvrtcGetPTX(prog, code.data()), "nvrtcGetPTX");
  }
  return code;
}

class Kernels {
 public:
  cudaKernel_t bias_add = nullptr, relu = nullptr, relu_backward = nullptr, gain_forward = nullptr,
               gain_backward = nullptr, mse = nullptr, adamw = nullptr, cast = nullptr, fill = nullptr;

  // Compiles (or loads from the cache) and loads the kernels for `device`.
  explicit Kernels(int device) {
    int major = 0, minor = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute(major)");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute(minor)");
    check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device),
          "cudaDeviceGetAttribute(MultiProcessorCount)");
    arch_ = fsdp::detail::cuda_kernel_arch(major, minor, device);
    std::string options;
    for (const char* o : kernel_options) options.append(o).push_back(' ');
    const auto cache = fsdp::detail::KernelCache::from_environment();
    const auto key = fsdp::detail::KernelCache::key_of({kernels_source, arch_, options, fsdp::detail::nvrtc_version_text()});
    std::vector<char> code;
    if (auto cached = cache.load(key, arch_)) {
      code = std::move(*cached), from_cache_ = true;
    } else {
      code = compile_kernels(arch_);
      cache.store(key, arch_, code);
    }
    check(cudaLibraryLoadData(&library_, code.data(), nullptr, nullptr, 0, nullptr, nullptr, 0), "cudaLibraryLoadData(",
          arch_, ")");
    const std::pair<cudaKernel_t*, const char*> names[] = {
        {&bias_add, "bias_add"}, {&relu, "relu"},   {&relu_backward, "relu_backward"}, {&gain_forward, "gain_forward"},
        {&gain_backward, "gain_backward"}, {&mse, "mse"}, {&adamw, "adamw"}, {&cast, "cast"}, {&fill, "fill"}};
    for (auto [slot, name] : names) check(cudaLibraryGetKernel(slot, library_, name), "cudaLibraryGetKernel(", name, ")");
  }
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;
  ~Kernels() {
    if (library_) cudaLibraryUnload(library_);
  }

  const std::string& arch() const { return arch_; }
  bool from_cache() const { return from_cache_; }

  // Typed launches: each passes exactly the kernel's parameter types (u64 counts, int
  // dtype codes, float scalars), since cudaLaunchKernel copies arguments by their size.
  using u64 = unsigned long long;
  static int code(fsdp::DType t) { return static_cast<int>(t); }
  void add_bias(cudaStream_t s, void* y, fsdp::DType ty, const void* b, fsdp::DType tb, u64 rows, u64 cols) const {
    launch(bias_add, "bias_add", rows * cols, s, y, code(ty), b, code(tb), rows, cols);
  }
  void relu_inplace(cudaStream_t s, void* h, fsdp::DType t, u64 n) const { launch(relu, "relu", n, s, h, code(t), n); }
  void relu_grad(cudaStream_t s, void* dh, const void* h, fsdp::DType t, u64 n) const {
    launch(relu_backward, "relu_backward", n, s, dh, h, code(t), n);
  }
  void gain(cudaStream_t s, void* y, const void* x, fsdp::DType ta, const void* g, fsdp::DType tg, const void* sc,
            fsdp::DType ts, u64 rows, u64 cols) const {
    launch(gain_forward, "gain_forward", rows * cols, s, y, x, code(ta), g, code(tg), sc, code(ts), rows, cols);
  }
  void gain_grad(cudaStream_t s, void* dx, void* p, const void* dy, const void* x, fsdp::DType ta, const void* g,
                 fsdp::DType tg, const void* sc, fsdp::DType ts, u64 rows, u64 cols) const {
    launch(gain_backward, "gain_backward", rows * cols, s, dx, p, dy, x, code(ta), g, code(tg), sc, code(ts), rows, cols);
  }
  void mse_loss(cudaStream_t s, const float* y, const float* target, void* dout, fsdp::DType td, u64 n, float scale,
                double* sum) const {
    launch(mse, "mse", n, s, y, target, dout, code(td), n, scale, sum);
  }
  void adamw_step(cudaStream_t s, float* p, const float* g, float* m, float* v, u64 n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, float c1, float c2) const {
    launch(adamw, "adamw", n, s, p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, c1, c2);
  }
  void convert(cudaStream_t s, void* dst, fsdp::DType td, const void* src, fsdp::DType ts, u64 n) const {
    launch(cast, "cast", n, s, dst, code(td), src, code(ts), n);
  }
  void fill_value(cudaStream_t s, void* p, fsdp::DType t, u64 n, float v) const {
    launch(fill, "fill", n, s, p, code(t), n, v);
  }

  // Launches `k` over n elements on `stream`: 256 threads a block (mse's reduction needs
  // exactly that), at most 32 blocks per SM; the kernels' grid-stride loops cover the rest.
  template <class... Args>
  void launch(cudaKernel_t k, const char* name, std::size_t n, cudaStream_t stream, Args... args) const {
    if (n == 0) return;
    constexpr unsigned threads = 256;
    const std::size_t cap = static_cast<std::size_t>(std::max(sm_count_, 1)) * 32;
    const dim3 grid(static_cast<unsigned>(std::min((n + threads - 1) / threads, cap)));
    void* argv[] = {static_cast<void*>(&args)...};
    check(cudaLaunchKernel(reinterpret_cast<const void*>(k), grid, dim3(threads), argv, 0, stream), "cudaLaunchKernel(",
          name, ", ", n, " elements)");
  }

 private:
  cudaLibrary_t library_ = nullptr;
  std::string arch_;
  bool from_cache_ = false;
  int sm_count_ = 0;
};

}  // namespace cuda_engine
