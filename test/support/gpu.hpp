#pragma once
// Whether the CUDA tests have a GPU. Without one their GPU cases report as skipped. A
// machine that is meant to have one (a GPU CI lane) sets FSDP_REQUIRE_GPU=1; then the
// case below fails when no GPU is visible, so a lost GPU cannot pass as a clean run.
// Linked with the emulated runtime (tools/cuda_emulator, the *_emulated_test targets) the
// GPU cases run on the emulator and test the host code; that check is skipped there, since
// the emulator's device stands for no GPU.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string_view>

#include "fsdp/cuda/cuda_device.hpp"

namespace test_support {

inline bool gpu_required() {
  const char* v = std::getenv("FSDP_REQUIRE_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

inline const bool no_gpu = fsdp::cuda_device_count() == 0;

// The emulated runtime names its device so (tools/cuda_emulator/state.hpp, kDeviceName).
inline const bool emulated_runtime = [] {
  cudaDeviceProp p{};
  return !no_gpu && cudaGetDeviceProperties(&p, 0) == cudaSuccess &&
         std::string_view(p.name).starts_with("fsdp CUDA runtime emulator");
}();

}  // namespace test_support

// One per test binary that includes this header (each CUDA test is its own binary).
TEST_CASE("FSDP_REQUIRE_GPU=1: a GPU is visible" *
          doctest::skip(!test_support::gpu_required() || test_support::emulated_runtime)) {
  CHECK(fsdp::cuda_device_count() > 0);
}
