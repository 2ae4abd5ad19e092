// examples/cuda_engine: its NVRTC kernels compile for the GPUs the proof runs on (no GPU
// needed), its cuBLAS plumbing refuses what it cannot compute, and (with a GPU) one f32
// forward and backward of the whole model equals the host reference engine's: the loss
// and every gradient, within f32 rounding of a different summation order. That pins each
// GEMM's row/column-major convention and every kernel on its own, before any training.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "examples/cuda_engine/training.hpp"
#include "test/support/errors.hpp"
#include "test/support/gpu.hpp"

using test_support::contains;
using test_support::error_of;

TEST_CASE("NVRTC compiles the engine's kernels, with no GPU needed") {
  for (const auto& version : {std::pair{8, 0}, std::pair{9, 0}}) {
    const int major = version.first, minor = version.second;  // not bound: CAPTURE captures them
    CAPTURE(major);
    const std::string arch = fsdp::detail::cuda_kernel_arch(major, minor);
    CHECK(arch == "sm_" + std::to_string(major * 10 + minor));
    std::vector<char> code;
    REQUIRE_NOTHROW(code = cuda_engine::compile_kernels(arch));
    CHECK(code.size() > 0);
  }
  const std::vector<char> ptx = cuda_engine::compile_kernels("compute_80");
  REQUIRE(!ptx.empty());
  const std::string text(ptx.data());
  for (const char* k : {"bias_add", "relu", "relu_backward", "gain_forward", "gain_backward", "mse", "adamw", "cast", "fill"})
    CHECK(text.find(std::string(".entry ") + k) != std::string::npos);
}

TEST_CASE("the cuBLAS plumbing refuses dtypes and sizes it cannot pass") {
  CHECK(cuda_engine::cuda_type(fsdp::DType::bf16) == CUDA_R_16BF);
  CHECK(cuda_engine::cuda_type(fsdp::DType::f32) == CUDA_R_32F);
  CHECK(contains(error_of([] { cuda_engine::cuda_type(fsdp::DType::f16); }), "f32 or bf16, not f16"));
  CHECK(cuda_engine::blas_dim(7, "m") == 7);
  CHECK(contains(error_of([] { cuda_engine::blas_dim(std::int64_t{1} << 31, "k"); }), "k dimension 2147483648 exceeds int"));
}

TEST_CASE("one f32 forward and backward equals the host reference engine's" * doctest::skip(test_support::no_gpu)) {
  const engine::ModelConfig config{.in = 5, .dim = 13, .hidden = 7, .out = 3, .blocks = 2};  // odd sizes on purpose
  const std::int64_t rows = 6;
  engine::Model host(config);
  const engine::Batch batch = engine::make_batch(config, 0, 0, rows);
  engine::Mat dout;
  const double host_loss = engine::mse(host.forward(batch.x), batch.y, dout);
  host.backward(dout);

  cuda_engine::Gpu gpu(0, fsdp::DType::f32);
  cuda_engine::Model model(host, fsdp::DType::f32, fsdp::DType::f32, 0, gpu.alloc(), /*grads_with_storage=*/true);
  const cuda_engine::DeviceBatch data = cuda_engine::upload(gpu, batch);
  cuda_engine::Buffer sum(gpu.alloc(), sizeof(double));
  REQUIRE(cudaMemsetAsync(sum.get(), 0, sizeof(double), gpu.stream()) == cudaSuccess);
  cuda_engine::forward_backward(gpu, model, data, static_cast<double*>(sum.get()));
  double total = 0;
  REQUIRE(cudaMemcpyAsync(&total, sum.get(), sizeof total, cudaMemcpyDeviceToHost, gpu.stream()) == cudaSuccess);
  gpu.synchronize();
  CHECK(total / static_cast<double>(rows * config.out) == doctest::Approx(host_loss).epsilon(1e-5));

  std::map<std::string, const engine::Tensor*> host_grads;
  for (auto& p : engine::named_parameters(host)) host_grads[p.fqn] = p.grad;
  int compared = 0;
  for (const auto& p : model.parameters()) {
    CAPTURE(p.fqn);
    REQUIRE(host_grads.count(p.fqn) == 1);
    std::vector<float> got(static_cast<std::size_t>(p.grad->numel()));
    REQUIRE(cudaMemcpy(got.data(), p.grad->data(), p.grad->bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
    const engine::Tensor& want = *host_grads[p.fqn];
    REQUIRE(want.numel() == p.grad->numel());
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      CAPTURE(i);
      CHECK(std::abs(got[static_cast<std::size_t>(i)] - want[i]) <= 1e-5f + 1e-4f * std::abs(want[i]));
    }
    ++compared;
  }
  CHECK(compared == 4 + 4 * config.blocks + 1);  // embed, head: weight and bias; 2 Linears a block; the gain
}
