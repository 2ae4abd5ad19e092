#pragma once
// The kernels the emulated runtime can launch: CudaDevice's (fsdp/cuda/cuda_kernels.hpp),
// by name, each with the memory it touches (checked before it runs) and what it computes
// on the CPU for a given grid.
#include <cstddef>
#include <cstring>
#include <string_view>
#include <vector>

namespace cuda_emulator::detail {

struct KernelArgs {
  void* const* args;  // as cudaLaunchKernel gets them: a pointer to each argument
  unsigned grid;      // blocks (x; y and z must be 1)
  unsigned block;     // threads per block
  template <class T>
  T get(int i) const {
    T v;
    std::memcpy(&v, args[i], sizeof v);
    return v;
  }
};

struct Range {
  const void* p;
  std::size_t bytes;
  bool write;
};

struct Kernel {
  const char* name;
  void (*ranges)(const KernelArgs&, std::vector<Range>&);
  void (*run)(const KernelArgs&);
  std::vector<std::size_t> arg_bytes;  // each argument's size, to keep a copy of a deferred launch's
};

const Kernel* kernel_named(std::string_view name);
const Kernel* kernel_of(const void* handle);  // a handle cudaLibraryGetKernel gave out, else null

}  // namespace cuda_emulator::detail
