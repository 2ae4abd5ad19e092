// Sharded training on CUDA memory: four thread ranks, each with its own CudaDevice (all on
// GPU 0 when there is one GPU), communicating through StagedCommunicator<ThreadComm>.
// For every precision x offload x strategy combination the parameters, losses, skipped
// fp16 steps and per-space byte counts must equal those of the same training on HostDevice
// bit for bit, and offloaded shards must be pinned host memory while everything the engine
// computes with is device memory. Every case needs a GPU and reports itself skipped
// without one; test/core/staged_communicator_test.cpp runs the same training on the host.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/fsdp.hpp"
#include "test/support/device_training.hpp"
#include "test/support/gpu.hpp"

namespace {

using fsdp::CudaDevice;
using fsdp::HostDevice;
using fsdp::ThreadComm;

using test_support::no_gpu;
constexpr int kWorld = 4;

// Rank r on GPU r % (visible GPUs): with one GPU, every rank shares it (own streams).
struct CudaRanks {
  std::vector<std::unique_ptr<CudaDevice>> owned;
  std::vector<CudaDevice*> ptrs;
  CudaRanks() {
    for (int r = 0; r < kWorld; ++r) {
      owned.push_back(std::make_unique<CudaDevice>(r % fsdp::cuda_device_count()));
      ptrs.push_back(owned.back().get());
    }
  }
};

auto staged_on_cuda = [](ThreadComm& c, CudaDevice& d, auto&& body) {
  fsdp::StagedCommunicator<ThreadComm, CudaDevice> s(c, d);
  body(s);
};

cudaMemoryType memory_type(const void* p) {
  cudaPointerAttributes a{};
  REQUIRE(cudaPointerGetAttributes(&a, p) == cudaSuccess);
  return a.type;
}

}  // namespace

TEST_CASE("training on CudaDevice equals training on HostDevice bit for bit, for every combination" *
          doctest::skip(no_gpu)) {
  const test_support::DeviceTrainingConfig config;
  CudaRanks cuda;
  test_support::for_each_combination([&]<class S, class P, class O>() {
    const std::string combination = test_support::combination_name<S, P, O>();
    CAPTURE(combination);
    std::vector<HostDevice> hosts(kWorld);
    std::vector<HostDevice*> host_ptrs;
    for (auto& h : hosts) host_ptrs.push_back(&h);
    for (auto* d : cuda.ptrs) d->reset_peak(fsdp::MemorySpace::device), d->reset_peak(fsdp::MemorySpace::host);
    const auto on_host = test_support::train_on_devices<S, P, O>(host_ptrs, config,
                                                                 [](ThreadComm& c, HostDevice&, auto&& body) { body(c); });
    const auto on_gpu = test_support::train_on_devices<S, P, O>(cuda.ptrs, config, staged_on_cuda);
    CHECK(test_support::bitwise_equal(on_host.params, on_gpu.params));
    CHECK(on_host.losses == on_gpu.losses);
    CHECK(on_host.skipped_steps == on_gpu.skipped_steps);
    CHECK(on_host.losses.back() < on_host.losses.front());
    // The same allocations, in the same spaces, at the same points.
    CHECK(on_gpu.device_space.peak_bytes == on_host.device_space.peak_bytes);
    CHECK(on_gpu.host_space.peak_bytes == on_host.host_space.peak_bytes);
    CHECK(on_gpu.device_space.allocations == on_host.device_space.allocations);
  });
  for (auto* d : cuda.ptrs) {
    CHECK(d->stats(fsdp::MemorySpace::device).live_bytes == 0);  // every run gave back all it took
    CHECK(d->stats(fsdp::MemorySpace::host).live_bytes == 0);
  }
}

// All-gathers in a block format (CommPrecision<Int8Blocks<32>, ...>, MXFP8) or per tensor
// (F8E4M3Tensor, F8E5M2Tensor: the amaxes agreed on the device, no host wait): the CUDA
// kernels quantize and dequantize as the host functions do, so CUDA training still equals
// host training bit for bit, with the same allocations (the slots, the f32 buffer under
// bf16, the staged offloaded shard).
TEST_CASE("all-gathers in a block format: training on CudaDevice equals HostDevice bit for bit" * doctest::skip(no_gpu)) {
  const test_support::DeviceTrainingConfig config;
  CudaRanks cuda;
  auto check = [&]<class P, class O, class Q>(const char* name) {
    CAPTURE(name);
    std::vector<HostDevice> hosts(kWorld);
    std::vector<HostDevice*> host_ptrs;
    for (auto& h : hosts) host_ptrs.push_back(&h);
    const auto on_host = test_support::train_on_devices<fsdp::FullShard, P, O, Q>(
        host_ptrs, config, [](ThreadComm& c, HostDevice&, auto&& body) { body(c); });
    const auto on_gpu = test_support::train_on_devices<fsdp::FullShard, P, O, Q>(cuda.ptrs, config, staged_on_cuda);
    const auto plain = test_support::train_on_devices<fsdp::FullShard, P, O>(
        host_ptrs, config, [](ThreadComm& c, HostDevice&, auto&& body) { body(c); });
    CHECK(test_support::bitwise_equal(on_host.params, on_gpu.params));
    CHECK(on_host.losses == on_gpu.losses);
    CHECK(on_host.losses != plain.losses);  // the gathers did quantize
    CHECK(on_gpu.device_space.peak_bytes == on_host.device_space.peak_bytes);
    CHECK(on_gpu.host_space.peak_bytes == on_host.host_space.peak_bytes);
    CHECK(on_gpu.device_space.allocations == on_host.device_space.allocations);
  };
  check.template operator()<fsdp::FullPrecision, fsdp::NoOffload, fsdp::CommPrecision<fsdp::Int8Blocks<32>, float>>("int8");
  check.template operator()<fsdp::FullPrecision, fsdp::OffloadParams, fsdp::CommPrecision<fsdp::F8E4M3Blocks<32>, float>>(
      "e4m3, offload");
  check.template operator()<fsdp::MixedPrecision<fsdp::bf16>, fsdp::NoOffload, fsdp::CommPrecision<fsdp::MXFP8, fsdp::bf16>>(
      "mxfp8, bf16");
  check.template operator()<fsdp::FullPrecision, fsdp::NoOffload, fsdp::CommPrecision<fsdp::F8E5M2Blocks<32>, float>>("e5m2");
  check.template operator()<fsdp::FullPrecision, fsdp::NoOffload, fsdp::CommPrecision<fsdp::F8E4M3Tensor, float>>(
      "e4m3 per tensor");
  check.template operator()<fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams,
                            fsdp::CommPrecision<fsdp::F8E5M2Tensor, fsdp::bf16>>("e5m2 per tensor, bf16, offload");
  for (auto* d : cuda.ptrs) CHECK(d->stats(fsdp::MemorySpace::device).live_bytes == 0);
}

TEST_CASE("offloaded shards are pinned host memory; parameters the engine sees are device memory" *
          doctest::skip(no_gpu)) {
  const test_support::DeviceTrainingConfig config;
  CudaRanks cuda;
  auto check_placement = [&]<class O>() {
    const cudaMemoryType shard_type = O::offload ? cudaMemoryTypeHost : cudaMemoryTypeDevice;
    fsdp::ThreadGroup(kWorld).run([&](ThreadComm& tc) {
      CudaDevice& dev = *cuda.ptrs[static_cast<std::size_t>(tc.rank())];
      fsdp::StagedCommunicator<ThreadComm, CudaDevice> comm(tc, dev);
      test_support::Net<CudaDevice> net(dev, config);
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, O>(net, comm, dev,
                                                                                 fsdp::wrap_types<test_support::Layer>{});
      for (const auto& v : sm.shards()) {
        CHECK(memory_type(v.param) == shard_type);
        CHECK(memory_type(v.grad) == shard_type);
      }
      CHECK(net.layers[0].w.data == nullptr);  // resharded between steps
      fsdp::Unit& root = *sm.find_unit_for(net);
      {
        auto fwd = root.forward_scope();
        CHECK(memory_type(net.gain.data) == cudaMemoryTypeDevice);  // gathered, in bf16
        CHECK(net.gain.dtype == fsdp::DType::bf16);
        CHECK(memory_type(net.scale.data) == cudaMemoryTypeDevice);  // the buffer's cast copy
        CHECK(net.scale.dtype == fsdp::DType::bf16);
      }
      root.reshard();
    });
  };
  check_placement.template operator()<fsdp::OffloadParams>();
  check_placement.template operator()<fsdp::NoOffload>();
}
