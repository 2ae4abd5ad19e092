#pragma once
// Whether the CUDA tests have a GPU. Without one their GPU cases report as skipped. A
// machine that is meant to have one (a GPU CI lane) sets FSDP_REQUIRE_GPU=1; then the
// case below fails when no GPU is visible, so a lost GPU cannot pass as a clean run.
// Linked with the emulated runtime (tools/cuda_emulator, the *_emulated_test targets) the
// GPU cases run on the emulator and test the host code; that check is skipped there, since
// the emulator's device stands for no GPU.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/cuda/cuda_device.hpp"

namespace test_support {

inline bool gpu_required() {
  const char* v = std::getenv("FSDP_REQUIRE_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

inline const bool no_gpu = fsdp::cuda_device_count() == 0;

// Built with ThreadSanitizer (slow enough that some multi-process cases run smaller).
#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_tsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif
#else
inline constexpr bool under_tsan = false;
#endif

// The emulated runtime names its device so (tools/cuda_emulator/state.hpp, kDeviceName).
inline const bool emulated_runtime = [] {
  cudaDeviceProp p{};
  return !no_gpu && cudaGetDeviceProperties(&p, 0) == cudaSuccess &&
         std::string_view(p.name).starts_with("fsdp CUDA runtime emulator");
}();

// The world sizes a multi-process GPU case runs: FSDP_NCCL_TEST_WORLDS ("2,4"; the
// emulated targets set it), else 2. Under TSan only those up to 2: four emulated ranks on
// CI's two cores take minutes there (the plain build and tools/nccl_emulated.sh run four).
inline std::vector<int> test_worlds() {
  const char* w = std::getenv("FSDP_NCCL_TEST_WORLDS");
  std::vector<int> out;
  for (std::string rest = w ? w : "2"; !rest.empty();) {
    const auto comma = rest.find(',');
    const int world = std::atoi(rest.substr(0, comma).c_str());
    if (!under_tsan || world <= 2) out.push_back(world);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
  }
  return out;
}

// Whether fewer GPUs are visible than the largest of test_worlds() needs.
// None left (FSDP_NCCL_TEST_WORLDS=4 under TSan): skipped, as with too few GPUs.
inline bool too_few_gpus_for_test_worlds() {
  const std::vector<int> worlds = test_worlds();
  return worlds.empty() || fsdp::cuda_device_count() < *std::max_element(worlds.begin(), worlds.end());
}

}  // namespace test_support

// One per test binary that includes this header (each CUDA test is its own binary).
TEST_CASE("FSDP_REQUIRE_GPU=1: a GPU is visible" *
          doctest::skip(!test_support::gpu_required() || test_support::emulated_runtime)) {
  CHECK(fsdp::cuda_device_count() > 0);
}
