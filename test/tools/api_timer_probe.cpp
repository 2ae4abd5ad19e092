// For api_timer_test.sh: calls the CUDA runtime a known number of times, 3 of them inside
// the region tools/gpu_proof/api_timer.so attributes (marked as examples/cuda_train marks
// its calls into fsdp). Needs no GPU: a call that fails is timed all the same.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>

int main() {
  using Mark = void (*)(int);
  const auto mark = reinterpret_cast<Mark>(dlsym(RTLD_DEFAULT, "fsdp_api_timer_region"));
  if (!mark) {
    std::puts("api_timer_probe: fsdp_api_timer_region not found: api_timer.so is not preloaded");
    return 2;
  }
  int device = -1;
  for (int i = 0; i < 2; ++i) (void)cudaGetDevice(&device);
  mark(1);
  for (int i = 0; i < 3; ++i) (void)cudaGetDevice(&device);
  mark(0);
  std::puts("api_timer_probe: done");
  return 0;
}
