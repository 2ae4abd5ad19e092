// fsdp/cuda/cuda_kernels.hpp: the kernel source compiles with NVRTC for several
// architectures, with no GPU needed (so it is checked on every build machine).
#include <doctest/doctest.h>

#include <string>
#include <utility>

#include "fsdp/cuda/cuda_kernels.hpp"

TEST_CASE("NVRTC compiles the kernel source, with no GPU needed") {
  for (const auto& arch : {std::pair{7, 5}, std::pair{8, 0}, std::pair{9, 0}}) {
    const int major = arch.first, minor = arch.second;  // not bound: CAPTURE captures them
    CAPTURE(major);
    CAPTURE(minor);
    fsdp::detail::CudaKernelImage image;
    REQUIRE_NOTHROW(image = fsdp::detail::compile_cuda_kernels(major, minor));
    CHECK(image.arch == "sm_" + std::to_string(major * 10 + minor));
    CHECK(image.code.size() > 0);
  }
  // A device newer than this NVRTC gets PTX for the newest architecture it knows.
  const auto ptx = fsdp::detail::compile_cuda_kernels(99, 9);
  CHECK(ptx.arch.rfind("compute_", 0) == 0);
  REQUIRE(!ptx.code.empty());
  CHECK(ptx.code.back() == '\0');
  const std::string text(ptx.code.data());
  for (const char* k : {"fsdp_scale", "fsdp_accumulate", "fsdp_cast", "fsdp_unscale", "fsdp_zero_spans", "fsdp_cast_zero",
                        "fsdp_quantize", "fsdp_dequantize", "fsdp_abs_max", "fsdp_max_over_rows", "fsdp_quantize_tensor",
                        "fsdp_dequantize_tensor"}) {
    CAPTURE(k);
    CHECK(text.find(std::string(".entry ") + k + "(") != std::string::npos);  // the entry itself, not a prefix
  }
}
