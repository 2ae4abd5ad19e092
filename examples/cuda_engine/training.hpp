#pragma once
// Training the CUDA engine: the engine's GPU context (its own stream, cuBLAS handle on
// that stream, kernels, stream-ordered allocator), the device AdamW, the data, and the
// hooks that drive fsdp's units with a clock around each call (the library's host time).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <fsdp/core/detail/host_math.hpp>
#include <fsdp/model/sharded_model.hpp>

#include "examples/cuda_engine/model.hpp"
#include "examples/engine/optim.hpp"

namespace cuda_engine {

// One GPU as the engine uses it. Everything it queues goes on stream(), which it hands to
// fsdp::CudaDevice(index, stream) and to NcclCommOptions::after.
class Gpu {
 public:
  Gpu(int device, fsdp::DType compute) : device_(device) {
    check(cudaSetDevice(device), "cudaSetDevice(", device, ")");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cublasCreate(&blas_), "cublasCreate");
    check(cublasSetStream(blas_, stream_), "cublasSetStream");
    // Plain f32 products stay f32 (no TF32), so the f32 run can match the host closely.
    check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    // The stream-ordered pool keeps what is freed instead of returning it to the driver at
    // every synchronization: steady-state steps then allocate without driver calls.
    check(cudaDeviceGetDefaultMemPool(&pool_, device), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute(ReleaseThreshold)");
    kernels_.emplace(device);
    alloc_.emplace(stream_);
    context_.emplace(stream_, blas_, *kernels_, *alloc_, compute);
  }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
  ~Gpu() {  // the context's buffers are freed on the stream before it goes
    context_.reset();
    workspace_.reset();
    cudaStreamSynchronize(stream_);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
    kernels_.reset();
    (void)cudaGetLastError();
  }

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  Context& context() { return *context_; }
  StreamAllocator& alloc() { return *alloc_; }
  const Kernels& kernels() const { return *kernels_; }
  void synchronize() { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  // cuBLAS works in this buffer from now on instead of memory of its own choosing: a GEMM
  // captured into a CUDA graph must not allocate (cuda_train --cuda-graph).
  void fixed_blas_workspace(std::size_t bytes) {
    if (!workspace_) workspace_.emplace(*alloc_, bytes);
    check(cublasSetWorkspace(blas_, workspace_->get(), workspace_->bytes()), "cublasSetWorkspace");
  }

  // The pool's high-water mark of bytes in use (engine and library together), since reset.
  std::size_t pool_peak_bytes() const {
    std::uint64_t v = 0;
    check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &v), "cudaMemPoolGetAttribute(UsedMemHigh)");
    return v;
  }
  void reset_pool_peak() {
    std::uint64_t zero = 0;
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero), "cudaMemPoolSetAttribute(UsedMemHigh)");
  }
  std::size_t used_bytes() const {  // the whole GPU, every process and context included
    std::size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return total - free;
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  std::optional<Kernels> kernels_;
  std::optional<StreamAllocator> alloc_;
  std::optional<Context> context_;
  std::optional<Buffer> workspace_;  // fixed_blas_workspace's
};

// One step's input on the device: x in the compute dtype, the target in f32.
struct DeviceBatch {
  Act x;
  Buffer y;
};

// A batch's bytes into another of the same shape, on the engine's stream.
inline void copy_into(Gpu& gpu, const DeviceBatch& from, DeviceBatch& to) {
  check(cudaMemcpyAsync(to.x->data(), from.x->data(), from.x->bytes(), cudaMemcpyDeviceToDevice, gpu.stream()),
        "cudaMemcpyAsync(batch x)");
  check(cudaMemcpyAsync(to.y.get(), from.y.get(), from.y.bytes(), cudaMemcpyDeviceToDevice, gpu.stream()),
        "cudaMemcpyAsync(batch y)");
}
inline DeviceBatch copy_of(Gpu& gpu, const DeviceBatch& b) {
  Context& c = gpu.context();
  DeviceBatch d{c.make(b.x->rows, b.x->cols, b.x->dtype), Buffer(gpu.alloc(), b.y.bytes())};
  copy_into(gpu, b, d);
  return d;
}

inline DeviceBatch upload(Gpu& gpu, const engine::Batch& b) {
  Context& c = gpu.context();
  DeviceBatch d{c.make(b.x.rows, b.x.cols, c.act), Buffer(gpu.alloc(), b.y.v.size() * sizeof(float))};
  std::vector<unsigned char> x(d.x->bytes());
  fsdp::detail::host_cast(x.data(), c.act, b.x.v.data(), fsdp::DType::f32, b.x.v.size());
  check(cudaMemcpyAsync(d.x->data(), x.data(), x.size(), cudaMemcpyHostToDevice, gpu.stream()), "cudaMemcpyAsync(batch x)");
  check(cudaMemcpyAsync(d.y.get(), b.y.v.data(), d.y.bytes(), cudaMemcpyHostToDevice, gpu.stream()),
        "cudaMemcpyAsync(batch y)");
  gpu.synchronize();  // the host vectors go now
  return d;
}

// AdamW over f32 device slots (engine::Slot: parameter, gradient, count), with
// engine::AdamW's arithmetic: the same kernel math and the same host-side bias
// corrections. Decay everywhere (a slot's decay mask is not used), as engine::slots gives.
class DeviceAdamW {
 public:
  explicit DeviceAdamW(engine::AdamW::Options o) : o_(o) {}
  void step(Gpu& gpu, std::span<const engine::Slot> slots) {
    if (state_.empty())
      for (const auto& s : slots) {
        const std::size_t bytes = static_cast<std::size_t>(s.numel) * sizeof(float);
        Buffer m(gpu.alloc(), bytes), v(gpu.alloc(), bytes);
        if (bytes) {
          check(cudaMemsetAsync(m.get(), 0, bytes, gpu.stream()), "cudaMemsetAsync(AdamW state)");
          check(cudaMemsetAsync(v.get(), 0, bytes, gpu.stream()), "cudaMemsetAsync(AdamW state)");
        }
        state_.push_back({std::move(m), std::move(v)});
      }
    if (state_.size() != slots.size())
      fsdp::detail::fail("DeviceAdamW: stepped on ", slots.size(), " slots, but its state is for ", state_.size());
    ++t_;
    const float c1 = 1.0f - std::pow(o_.beta1, static_cast<float>(t_));
    const float c2 = 1.0f - std::pow(o_.beta2, static_cast<float>(t_));
    for (std::size_t k = 0; k < slots.size(); ++k)
      gpu.kernels().adamw_step(gpu.stream(), slots[k].param, slots[k].grad, static_cast<float*>(state_[k].m.get()),
                               static_cast<float*>(state_[k].v.get()), static_cast<unsigned long long>(slots[k].numel),
                               o_.lr, o_.beta1, o_.beta2, o_.eps, o_.weight_decay, c1, c2);
  }

 private:
  struct Moments {
    Buffer m, v;
  };
  engine::AdamW::Options o_;
  std::vector<Moments> state_;
  long t_ = 0;
};

// The library's host time: a steady clock around every call into fsdp (hooks,
// finish_backward, zero_grad), counted only while `on` (after the warm-up steps).
struct LibraryClock {
  std::chrono::nanoseconds hooks{0}, finish_backward{0}, zero_grad{0};
  long hook_calls = 0;
  bool on = false;
  template <class F>
  void time(std::chrono::nanoseconds& into, F&& f) {
    // Under tools/gpu_proof/api_timer.so (LD_PRELOAD), the CUDA and NCCL calls made in the
    // host time reported (hooks, zero_grad) are counted apart; without it, region is null.
    static const auto region = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "fsdp_api_timer_region"));
    struct Region {  // left on every way out, a throwing call too
      void (*mark)(int);
      ~Region() {
        if (mark) mark(0);
      }
    } marked{on && region && &into != &finish_backward ? region : nullptr};
    if (marked.mark) marked.mark(1);
    const auto begin = std::chrono::steady_clock::now();
    f();
    if (on) into += std::chrono::steady_clock::now() - begin;
  }
};

// The engine's hook points -> the units' lifecycle calls, each timed.
struct TimedUnitHooks {
  fsdp::ShardedModel& model;
  LibraryClock& clock;
  template <class M, class Call>
  void at(const M* m, Call call) {
    clock.time(clock.hooks, [&] {
      if (auto* u = model.find_unit_for(*m)) call(*u);
    });
    if (clock.on) ++clock.hook_calls;
  }
  template <class M> void before_forward(const M* m) { at(m, [](fsdp::Unit& u) { u.pre_forward(); }); }
  template <class M> void after_forward(const M* m) { at(m, [](fsdp::Unit& u) { u.post_forward(); }); }
  template <class M> void before_backward(const M* m) { at(m, [](fsdp::Unit& u) { u.pre_backward(); }); }
  template <class M> void after_backward(const M* m) { at(m, [](fsdp::Unit& u) { u.post_backward(); }); }
};

// Forward, loss and backward of one batch; the loss's sum of squares lands in *sum.
template <class Hooks = NoHooks>
void forward_backward(Gpu& gpu, Model& model, const DeviceBatch& b, double* sum, Hooks&& hooks = {}) {
  Context& c = gpu.context();
  Act y = model.forward(c, b.x, hooks);
  Act dout = mse(c, *y, b.y.get(), sum);
  y.reset();
  model.backward(c, dout, hooks);
}

}  // namespace cuda_engine
