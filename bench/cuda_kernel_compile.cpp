// The first-use cost of CudaDevice's kernels: NVRTC compiling them for one architecture,
// against loading them from the on-disk cache (fsdp/cuda/kernel_cache.hpp). Needs NVRTC,
// no GPU (with one, also a fresh CudaDevice's first kernel, cache off and warm). Prints one line per measurement, in milliseconds (the first run, the median and
// the minimum).
//
//   bench/cuda_kernel_compile [--cc 9.0] [--runs 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/cuda/cuda_kernels.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// Milliseconds of each run, in order (the first includes loading NVRTC's own state).
template <class F>
std::vector<double> time_runs(int runs, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    const auto begin = Clock::now();
    f(i);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - begin).count());
  }
  return ms;
}

void report(const char* what, std::vector<double> ms) {
  const double first = ms.front();
  std::sort(ms.begin(), ms.end());
  std::printf("%-44s first %9.3f ms   median %9.3f ms   min %9.3f ms   (%zu runs)\n", what, first, ms[ms.size() / 2],
              ms.front(), ms.size());
}

}  // namespace

int main(int argc, char** argv) {
  int major = 9, minor = 0, runs = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--cc") std::sscanf(argv[i + 1], "%d.%d", &major, &minor);
    else if (flag == "--runs") runs = std::max(1, std::atoi(argv[i + 1]));
    else return std::fprintf(stderr, "usage: %s [--cc 9.0] [--runs 5]\n", argv[0]), 2;
  }
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fsdp_kernel_cache_bench_" + std::to_string(::getpid()));
  const fsdp::detail::KernelCache cache(dir);
  std::size_t bytes = 0;
  std::string arch;
  const auto compile = time_runs(runs, [&](int) {
    const auto image = fsdp::detail::compile_cuda_kernels(major, minor);
    bytes = image.code.size(), arch = image.arch;
  });
  std::printf("CudaDevice kernels for compute capability %d.%d: %s, %zu bytes, %s\n", major, minor, arch.c_str(), bytes,
              fsdp::detail::nvrtc_version_text().c_str());
  report("NVRTC compile (no cache)", compile);
  report("first load, cache empty (compile + store)", time_runs(1, [&](int) {
           if (fsdp::detail::load_cuda_kernels(major, minor, 0, cache).from_cache) std::abort();
         }));
  report("load from the on-disk cache", time_runs(runs, [&](int) {
           if (!fsdp::detail::load_cuda_kernels(major, minor, 0, cache).from_cache) std::abort();
         }));
  // With a GPU: a fresh CudaDevice's first kernel (compile or cache load, then
  // cudaLibraryLoadData and the launch), with the cache off and then warm.
  if (fsdp::cuda_device_count() > 0) {
    auto first_use = [&](const char* cache_setting) {
      ::setenv("FSDP_KERNEL_CACHE", cache_setting, 1);
      return time_runs(runs, [&](int) {
        fsdp::CudaDevice dev(0);
        void* p = dev.allocate(256);
        dev.scale(p, 64, fsdp::DType::f32, 0.5);
        dev.synchronize();
        dev.deallocate(p, 256);
      });
    };
    report("CudaDevice first kernel, cache off", first_use("off"));
    report("CudaDevice first kernel, cache warm", first_use(dir.c_str()));
  } else {
    std::printf("no GPU visible: CudaDevice's first-use times (module load included) not measured\n");
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}
