// GPU figures for tools/gpu_proof.sh: CudaDevice copy, cast and block-quantization
// throughput, and NcclComm all_gather / reduce_scatter bandwidth over sizes, on every
// visible GPU (one rank each, in one process, issued in an nccl_group). Prints one line
// per measurement:
//   bench cuda copy bytes=... GB/s=...
//   bench cuda quantize FORMAT block=... elements=... GB/s=... dequantize_GB/s=...
//   bench nccl all_gather ranks=N bytes=... us=... algbw_GB/s=... busbw_GB/s=...
// busbw = algbw * (N-1)/N, NCCL's bus bandwidth; with one rank NCCL only copies locally.
// Exits 2 when no GPU is visible.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/nccl/nccl_comm.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void bench_device(fsdp::CudaDevice& dev) {
  for (std::size_t mib : {16, 256, 1024}) {
    const std::size_t bytes = mib << 20;
    const std::size_t n = bytes / 4;
    void* a = dev.allocate(bytes);
    void* b = dev.allocate(bytes);
    dev.fill_zero(a, bytes);
    dev.cast(b, fsdp::DType::bf16, a, fsdp::DType::f32, n);  // compiles the kernels before timing
    dev.synchronize();
    constexpr int iters = 10;
    auto t = Clock::now();
    for (int i = 0; i < iters; ++i) dev.copy(b, a, bytes);
    dev.synchronize();
    const double copy = 2.0 * bytes * iters / seconds_since(t) / 1e9;  // read + write
    t = Clock::now();
    for (int i = 0; i < iters; ++i) dev.cast(b, fsdp::DType::bf16, a, fsdp::DType::f32, n);
    dev.synchronize();
    const double cast = 6.0 * n * iters / seconds_since(t) / 1e9;  // 4 bytes read + 2 written
    std::printf("bench cuda copy bytes=%zu GB/s=%.1f\n", bytes, copy);
    std::printf("bench cuda cast_f32_bf16 elements=%zu GB/s=%.1f\n", n, cast);
    dev.deallocate(a, bytes);
    dev.deallocate(b, bytes);
  }
  dev.synchronize();
}

void bench_nccl(int gpus) {
  std::vector<int> devices;
  for (int d = 0; d < gpus; ++d) devices.push_back(d);
  auto comms = fsdp::NcclComm::create(devices);
  const int n = gpus;
  for (std::size_t chunk_bytes : {std::size_t{1} << 16, std::size_t{1} << 20, std::size_t{1} << 24, std::size_t{1} << 27}) {
    const std::size_t count = chunk_bytes / 2;  // bf16 elements per rank
    std::vector<void*> big(n), small(n);
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(r);
      cudaMalloc(&big[r], chunk_bytes * n);
      cudaMalloc(&small[r], chunk_bytes);
      cudaMemset(big[r], 0, chunk_bytes * n);
      cudaMemset(small[r], 0, chunk_bytes);
    }
    for (const char* which : {"all_gather", "reduce_scatter"}) {
      const bool gather = which[0] == 'a';
      auto round = [&] {
        std::vector<fsdp::Work> works;
        fsdp::nccl_group([&] {
          for (int r = 0; r < n; ++r)
            works.push_back(gather ? comms[r].all_gather(small[r], big[r], count, fsdp::DType::bf16)
                                   : comms[r].reduce_scatter(big[r], small[r], count, fsdp::DType::bf16,
                                                             fsdp::ReduceOp::sum));
        });
        for (auto& w : works) w.wait();
      };
      round();  // warm-up
      const int iters = chunk_bytes >= (std::size_t{1} << 24) ? 10 : 50;
      const auto t = Clock::now();
      for (int i = 0; i < iters; ++i) round();
      const double s = seconds_since(t) / iters;
      const double algbw = static_cast<double>(chunk_bytes) * n / s / 1e9;
      std::printf("bench nccl %s ranks=%d bytes=%zu us=%.1f algbw_GB/s=%.2f busbw_GB/s=%.2f\n", which, n,
                  chunk_bytes * n, s * 1e6, algbw, algbw * (n - 1) / n);
    }
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(r);
      cudaFree(big[r]);
      cudaFree(small[r]);
    }
  }
}

}  // namespace

// Block quantization (CudaDevice::quantize / dequantize) of 64 Mi f32 values in each format:
// bytes read and written per second (4 + 1 per element, plus the scales).
void bench_quantize(fsdp::CudaDevice& dev) {
  constexpr std::size_t n = std::size_t{64} << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>((i * 2654435761u) % 20011) * 1e-3f - 10.0f;
  float* x = static_cast<float*>(dev.allocate(n * 4));
  float* back = static_cast<float*>(dev.allocate(n * 4));
  void* q = dev.allocate(n);
  void* scales = dev.allocate(n / 32 * 4);
  dev.copy(x, host.data(), n * 4);
  for (const fsdp::QuantFormat f : {fsdp::QuantFormat::int8_blocks, fsdp::QuantFormat::f8e4m3_blocks,
                                    fsdp::QuantFormat::f8e5m2_blocks, fsdp::QuantFormat::mxfp8}) {
    const std::size_t block = f == fsdp::QuantFormat::mxfp8 ? 32 : 128;
    const double scale_bytes = static_cast<double>(n / block * fsdp::scale_bytes(f));
    dev.quantize(f, x, n, q, scales, block);  // warm-up
    dev.synchronize();
    constexpr int iters = 10;
    auto t = Clock::now();
    for (int i = 0; i < iters; ++i) dev.quantize(f, x, n, q, scales, block);
    dev.synchronize();
    const double quantize = (5.0 * n + scale_bytes) * iters / seconds_since(t) / 1e9;
    t = Clock::now();
    for (int i = 0; i < iters; ++i) dev.dequantize(f, q, scales, n, back, block);
    dev.synchronize();
    const double dequantize = (5.0 * n + scale_bytes) * iters / seconds_since(t) / 1e9;
    if (dev.quantize_nonfinite()) throw fsdp::Error("bench: quantize met a non-finite value");
    std::printf("bench cuda quantize %s block=%zu elements=%zu GB/s=%.1f dequantize_GB/s=%.1f\n",
                std::string(fsdp::name_of(f)).c_str(), block, n, quantize, dequantize);
  }
  dev.deallocate(x, n * 4);
  dev.deallocate(back, n * 4);
  dev.deallocate(q, n);
  dev.deallocate(scales, n / 32 * 4);
  dev.synchronize();
}

int main() {
  const int gpus = fsdp::cuda_device_count();
  if (gpus == 0) {
    std::printf("bench: no GPU visible\n");
    return 2;
  }
  try {
    fsdp::CudaDevice dev(0);
    std::printf("bench: %d GPU(s) visible\n", gpus);
    bench_device(dev);
    bench_quantize(dev);
    std::printf("bench: CudaDevice kernels loaded as %s\n", dev.kernel_arch().c_str());
    bench_nccl(gpus < 8 ? gpus : 8);
  } catch (const std::exception& e) {
    std::printf("bench failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
