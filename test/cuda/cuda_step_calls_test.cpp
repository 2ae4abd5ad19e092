// The CUDA runtime calls CudaDevice makes in a training step, per unit, counted by the
// emulated runtime (tools/cuda_emulator). On a GPU most of the host time the library adds
// per unit and step is these calls, a few microseconds each (docs/cuda.md), so the budget
// is pinned here, derived from the design, for the configuration tools/gpu_proof.sh times
// (one rank, FullShard + BackwardPre, bf16 parameters with f32 reduction) and in full
// precision. test/core/counting_device_test.cpp pins the same step in Device operations.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/fsdp.hpp"
#include "test/support/device_training.hpp"
#include "tools/cuda_emulator/emulator.hpp"

namespace {

using cuda_emulator::Call;
using test_support::Layer;
using test_support::Net;

struct StepCalls {
  std::uint64_t units = 0;
  cuda_emulator::ThreadCalls calls;
};

// Three steps of the hooks alone (test_support::hooks_only_step: every CUDA call is the
// library's); the last is counted (steady state: the root kept from forward to backward).
template <class Precision>
StepCalls count_step(int layers) {
  test_support::DeviceTrainingConfig c;
  c.layers = layers;
  StepCalls out;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    fsdp::CudaDevice dev(0);
    Net<fsdp::CudaDevice> net(dev, c);
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre, Precision>(net, comm, dev, fsdp::wrap_types<Layer>{});
    for (int step = 0; step < 3; ++step) {
      cuda_emulator::reset_this_thread_calls();
      test_support::hooks_only_step(net, sm);
      out.calls = cuda_emulator::this_thread_calls();
    }
    out.units = sm.size();
  });
  return out;
}

}  // namespace

// Per step, U units, 2U - 1 gathers (the root is kept from forward to backward). Each
// gather casts the f32 shard into the bf16 parameter (one launch); each backward but the
// last unit's gathers the next unit ahead, and that launch also zeroes the unit's fresh
// bf16 gradient (fsdp_cast_zero); the last one is zeroed by a memset. Each backward casts
// the bf16 gradient straight into the f32 sharded gradient (one launch: one rank, nothing
// to exchange). zero_grad zeroes every sharded gradient with one launch. Each gathered
// parameter and unsharded gradient is a stream-ordered allocation and free. Only launches
// and memsets make the device current (a cudaGetDevice each, nothing to set: it is). No
// event, no host synchronization, no collective.
TEST_CASE("a step's CUDA calls per unit, one rank, bf16 parameters with f32 reduction") {
  for (int layers : {3, 5}) {
    const auto got = count_step<fsdp::MixedPrecision<fsdp::bf16, float>>(layers);
    const std::uint64_t U = got.units, gathers = 2 * U - 1;
    CAPTURE(U);
    CAPTURE(got.calls.summary());
    CHECK(U == static_cast<std::uint64_t>(layers) + 1);
    CHECK(got.calls.of(Call::cudaLaunchKernel) == gathers + U + 1);
    CHECK(got.calls.of(Call::cudaMemsetAsync) == 1);
    CHECK(got.calls.of(Call::cudaMallocAsync) == gathers + U);
    CHECK(got.calls.of(Call::cudaFreeAsync) == gathers + U);
    CHECK(got.calls.of(Call::cudaGetDevice) == gathers + U + 1 + 1);
    CHECK(got.calls.total() == 12 * U);  // nothing else: 12 calls per unit
    CHECK(got.calls.of(Call::cudaSetDevice) == 0);
    CHECK(got.calls.of(Call::cudaStreamSynchronize) == 0);
    CHECK(got.calls.of(Call::cudaEventRecord) == 0);
  }
}

// Full precision: each gather copies the shard into the parameter; the engine adds its
// gradients into the sharded ones themselves (one rank: the shard is the whole padded
// parameter), which zero_grad zeroes with one launch. No unsharded gradient: nothing to
// allocate, zero, copy or free per backward.
TEST_CASE("a step's CUDA calls per unit, one rank, full precision") {
  const auto got = count_step<fsdp::FullPrecision>(5);
  const std::uint64_t U = got.units, gathers = 2 * U - 1;
  CAPTURE(got.calls.summary());
  CHECK(got.calls.of(Call::cudaMemcpyAsync) == gathers);
  CHECK(got.calls.of(Call::cudaMemsetAsync) == 0);
  CHECK(got.calls.of(Call::cudaLaunchKernel) == 1);
  CHECK(got.calls.of(Call::cudaMallocAsync) == gathers);
  CHECK(got.calls.of(Call::cudaFreeAsync) == gathers);
  CHECK(got.calls.of(Call::cudaGetDevice) == 1);
  CHECK(got.calls.total() == 3 * gathers + 2);  // nothing else
}

// With two GPUs, a CudaDevice of the second one launches its kernels and memsets with that
// GPU current (a kernel on a stream of another device fails, in the emulator as on a GPU)
// and leaves the caller's device current; its allocations, frees and copies need no
// switch. One real GPU cannot test this.
TEST_CASE("a CudaDevice of another GPU makes it current only around launches and memsets") {
  struct TwoGpus {  // back to one however the case ends
    TwoGpus() { cuda_emulator::set_device_count(2); }
    ~TwoGpus() { cuda_emulator::set_device_count(1); }
  } two_gpus;
  {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    fsdp::CudaDevice d(1);
    cuda_emulator::reset_this_thread_calls();
    void* f32 = d.allocate(64 * sizeof(float));
    void* b16 = d.allocate(64 * 2);
    void* other = d.allocate(100);
    d.fill_zero(f32, 64 * sizeof(float));
    d.scale(f32, 64, fsdp::DType::f32, 0.5);
    const fsdp::ZeroSpan spans[] = {{other, 100}, {b16, 128}};
    d.fill_zero_batch(spans);
    d.cast_zeroing(b16, fsdp::DType::bf16, f32, fsdp::DType::f32, 64, std::span(spans, 1));
    d.copy(other, f32, 64);
    d.deallocate(other, 100);
    d.deallocate(b16, 64 * 2);
    d.deallocate(f32, 64 * sizeof(float));
    d.synchronize();
    const auto& calls = cuda_emulator::this_thread_calls();
    CAPTURE(calls.summary());
    // fill_zero, scale, fill_zero_batch, cast_zeroing, synchronize: set and restored each time
    CHECK(calls.of(Call::cudaSetDevice) == 2 * 5);
    CHECK(calls.of(Call::cudaGetDevice) == 5);
    int current = -1;
    CHECK(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == 0);
  }
}
