#pragma once
// Whether the CUDA tests have a GPU. Without one their GPU cases report as skipped. A
// machine that is meant to have one (a GPU CI lane) sets FSDP_REQUIRE_GPU=1; then the
// case below fails when no GPU is visible, so a lost GPU cannot pass as a clean run.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string_view>

#include "fsdp/cuda/cuda_device.hpp"

namespace test_support {

inline bool gpu_required() {
  const char* v = std::getenv("FSDP_REQUIRE_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

inline const bool no_gpu = fsdp::cuda_device_count() == 0;

}  // namespace test_support

// One per test binary that includes this header (each CUDA test is its own binary).
TEST_CASE("FSDP_REQUIRE_GPU=1: a GPU is visible" * doctest::skip(!test_support::gpu_required())) {
  CHECK(fsdp::cuda_device_count() > 0);
}
