// The CUDA example engine (examples/cuda_engine/): raw device buffers, cuBLAS GEMMs, its
// own NVRTC kernels, all on its own stream, trained
//   - with fsdp: shard<FullShard, BackwardPre, MixedPrecision<bf16, float>> (or full f32
//     precision), optionally OffloadParams (AdamW then steps on the host, on the pinned
//     shards), over a one-rank NcclComm, fsdp::CudaDevice on the engine's stream;
//   - or without fsdp (--no-fsdp): the same engine on plain buffers (under bf16, f32 master
//     weights cast for each step, gradients cast back: what MixedPrecision does);
//   - with fsdp and --cuda-graph: from the second step on, the forward and backward with
//     their hooks and finish_backward are one CUDA graph (fsdp::CapturedStep), captured
//     at that step and replayed at every one after, each batch copied first into the
//     buffers the graph reads; zero_grad and AdamW stay outside it.
// The same model and data run on the host reference engine (examples/engine) in this
// process; per-step losses are compared within a stated tolerance. Prints per-step loss,
// step time, device peak bytes and the library's host time per unit per step, and one
// `summary:` line for tools/gpu_proof.sh.
//
//   cuda_train [--precision bf16|f32] [--offload] [--no-fsdp] [--cuda-graph] [--bench] [--no-reference]
//              [--steps N] [--warmup N] [--batch N] [--in N] [--dim N] [--hidden N] [--out N]
//              [--blocks N] [--device N]
// Exit status: 0 trained (and matched the reference), 1 failed, 77 skipped: no GPU visible
// (FSDP_REQUIRE_GPU=1, or true/yes/on, turns that into a failure; a value that is no boolean is refused).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fsdp/core/parse.hpp>
#include <fsdp/cuda/cuda_device.hpp>
#include <fsdp/fsdp.hpp>
#include <fsdp/graph/captured_step.hpp>
#include <fsdp/nccl/nccl_comm.hpp>

#include "examples/cuda_engine/training.hpp"
#include "examples/engine/fsdp_integration.hpp"

namespace {

using namespace cuda_engine;
using Clock = std::chrono::steady_clock;
constexpr int kSkipped = 77;

struct Options {
  engine::ModelConfig model{.in = 16, .dim = 128, .hidden = 256, .out = 8, .blocks = 4};
  int batch = 64, steps = 8, warmup = 2, device = 0;
  bool bf16 = true, fsdp = true, offload = false, reference = true, graph = false;
  engine::AdamW::Options adamw{};
  int distinct_batches() const { return std::min(steps, 8); }  // step s trains on batch s % 8
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "cuda_train: %s\n(see the comment at the top of examples/cuda_train.cpp)\n", what.c_str());
  std::exit(1);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    // A value read whole, in [lo, hi] (fsdp/core/parse.hpp): " 5", "5x" and a number past
    // the range are refused naming the flag, never read as 5 or wrapped into an int.
    auto number = [&](auto& into, long long lo = 1, long long hi = 1 << 20) {
      if (i + 1 >= argc) usage_error(std::string(a) + " needs a value");
      try {
        into = static_cast<std::remove_reference_t<decltype(into)>>(fsdp::detail::parse_integer<long long>(argv[++i], a, lo, hi));
      } catch (const fsdp::Error& e) {
        usage_error(e.what());
      }
    };
    if (a == "--precision") {
      if (i + 1 >= argc) usage_error("--precision needs bf16 or f32");
      const std::string_view p = argv[++i];
      if (p != "bf16" && p != "f32") usage_error("--precision is bf16 or f32, not '" + std::string(p) + "'");
      o.bf16 = p == "bf16";
    } else if (a == "--offload") o.offload = true;
    else if (a == "--no-fsdp") o.fsdp = false;
    else if (a == "--no-reference") o.reference = false;
    else if (a == "--cuda-graph") o.graph = true;
    else if (a == "--bench") {  // big enough that GEMMs dominate; too big for the host reference
      o.model.in = 64, o.model.dim = 2048, o.model.hidden = 8192, o.model.out = 64, o.model.blocks = 8;
      o.batch = 16384, o.steps = 20, o.warmup = 5, o.reference = false;
      o.adamw.lr = 1e-4f;  // 1e-3 made a width-2048 stack jump to 1e15 and back (H200 run)
    } else if (a == "--steps") number(o.steps, 1, 1000000);
    else if (a == "--warmup") number(o.warmup, 0, 1000000);
    else if (a == "--batch") number(o.batch, 1, 1 << 24);
    else if (a == "--in") number(o.model.in);
    else if (a == "--dim") number(o.model.dim);
    else if (a == "--hidden") number(o.model.hidden);
    else if (a == "--out") number(o.model.out);
    else if (a == "--blocks") number(o.model.blocks, 1, 1000);
    else if (a == "--device") number(o.device, 0, 1023);
    else usage_error("unknown flag '" + std::string(a) + "'");
  }
  if (o.offload && !o.fsdp) usage_error("--offload is fsdp's OffloadParams; it needs fsdp (drop --no-fsdp)");
  if (o.graph && !o.fsdp) usage_error("--cuda-graph captures fsdp's step (fsdp::CapturedStep); it needs fsdp (drop --no-fsdp)");
  if (o.graph && o.offload)
    usage_error("--cuda-graph with --offload: an offloaded step waits for the GPU on the host (the CPU optimizer), "
                "which a CUDA graph cannot");
  if (o.graph && o.warmup < 2)
    usage_error("--cuda-graph needs --warmup 2 or more: the first step runs eagerly and the second is captured, and "
                "neither is a replay to time");
  if (o.warmup >= o.steps) usage_error("--warmup must be below --steps (the timed steps come after it)");
  return o;
}

struct RunResult {
  std::vector<double> losses, step_ms;
  LibraryClock clock;
  std::size_t units = 0;
  fsdp::MemoryStats library_device, library_host;  // fsdp::CudaDevice's own allocations
  std::size_t pool_peak = 0, gpu_used = 0;
  std::size_t graph_peak = 0;  // --cuda-graph: CUDA's graph memory pool, apart from the stream-ordered one
};

// One step's bookkeeping around `body` (zeroing the loss sum, reading it back, the clock).
template <class Body>
void timed_step(Gpu& gpu, const Options& o, Buffer& sum, RunResult& r, Body&& body) {
  const auto begin = Clock::now();
  check(cudaMemsetAsync(sum.get(), 0, sizeof(double), gpu.stream()), "cudaMemsetAsync(loss)");
  body();
  double total = 0;
  check(cudaMemcpyAsync(&total, sum.get(), sizeof total, cudaMemcpyDeviceToHost, gpu.stream()), "cudaMemcpyAsync(loss)");
  gpu.synchronize();  // the step is done on the GPU when its loss is on the host
  r.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - begin).count());
  r.losses.push_back(total / static_cast<double>(o.batch * o.model.out));
}

template <class... Policies>
RunResult run_sharded(Gpu& gpu, engine::Model& reference, const std::vector<DeviceBatch>& data, const Options& o) {
  RunResult r;
  fsdp::CudaDevice device(gpu.device(), gpu.stream());  // the library queues its work on the engine's stream
  fsdp::NcclCommOptions nccl;
  nccl.after = gpu.stream();  // collectives wait for what the engine queued
  nccl.name = "cuda_train";
  std::vector<fsdp::NcclComm> comms = fsdp::NcclComm::create({gpu.device()}, nccl);
  Model model(reference, fsdp::DType::f32, fsdp::DType::f32, gpu.device(), gpu.alloc(), /*grads_with_storage=*/false);
  fsdp::ShardedModel sharded = fsdp::shard<Policies...>(model, comms[0], device, fsdp::wrap_types<Block, Gain>{});
  r.units = sharded.size();
  DeviceAdamW on_device(o.adamw);
  engine::AdamW on_host(o.adamw);  // OffloadParams: the shards are pinned host memory
  Buffer sum(gpu.alloc(), sizeof(double));
  // --cuda-graph: the batch the graph reads, refilled before each replay, and cuBLAS's
  // workspace fixed before the capture.
  std::optional<DeviceBatch> staged;
  std::optional<fsdp::CapturedStep> graph;
  if (o.graph) {
    staged.emplace(copy_of(gpu, data[0]));
    gpu.fixed_blas_workspace(std::size_t{32} << 20);
  }
  gpu.synchronize();
  gpu.reset_pool_peak();
  device.reset_peak(fsdp::MemorySpace::device), device.reset_peak(fsdp::MemorySpace::host);
  for (int step = 0; step < o.steps; ++step) {
    r.clock.on = step >= o.warmup;
    const DeviceBatch& batch = data[static_cast<std::size_t>(step % o.distinct_batches())];
    timed_step(gpu, o, sum, r, [&] {
      r.clock.time(r.clock.zero_grad, [&] { sharded.zero_grad(); });
      if (o.graph && step > 0) {  // the first step is eager: it records the units' order
        copy_into(gpu, batch, *staged);
        if (!graph)
          graph.emplace(sharded, gpu.stream(), std::vector<fsdp::NcclComm*>{&comms[0]}, [&] {
            forward_backward(gpu, model, *staged, static_cast<double*>(sum.get()), TimedUnitHooks{sharded, r.clock});
            sharded.finish_backward();
          });
        r.clock.time(r.clock.hooks, [&] { graph->replay(); });  // the library's host time: the launch
        r.clock.time(r.clock.finish_backward, [&] { graph->wait(); });
      } else {
        forward_backward(gpu, model, batch, static_cast<double*>(sum.get()), TimedUnitHooks{sharded, r.clock});
        r.clock.time(r.clock.finish_backward, [&] { sharded.finish_backward(); });
      }
      const auto slots = engine::slots(sharded);  // f32 master shards and gradients
      if (o.offload) {
        device.synchronize();  // the host optimizer reads what the device wrote
        on_host.step(slots);
      } else {
        on_device.step(gpu, slots);
      }
    });
  }
  r.pool_peak = gpu.pool_peak_bytes();
  if (o.graph) {  // the captured step's buffers live in the graph memory pool
    unsigned long long high = 0;
    check(cudaDeviceGetGraphMemAttribute(gpu.device(), cudaGraphMemAttrUsedMemHigh, &high),
          "cudaDeviceGetGraphMemAttribute(UsedMemHigh)");
    r.graph_peak = static_cast<std::size_t>(high);
  }
  r.library_device = device.stats(fsdp::MemorySpace::device);
  r.library_host = device.stats(fsdp::MemorySpace::host);
  r.gpu_used = gpu.used_bytes();
  return r;
}

// Without fsdp: the engine's own buffers. Under bf16, f32 master weights are cast to the
// bf16 compute model each step and its gradients cast back before AdamW.
RunResult run_plain(Gpu& gpu, engine::Model& reference, const std::vector<DeviceBatch>& data, const Options& o) {
  RunResult r;
  const fsdp::DType act = gpu.context().act;
  Model compute(reference, act, act, gpu.device(), gpu.alloc(), /*grads_with_storage=*/true);
  std::optional<Model> master;
  if (act != fsdp::DType::f32) master.emplace(reference, fsdp::DType::f32, fsdp::DType::f32, gpu.device(), gpu.alloc(), true);
  const auto cp = compute.parameters();
  const auto mp = master ? master->parameters() : cp;
  std::vector<engine::Slot> slots;
  for (const auto& p : mp)
    slots.push_back({static_cast<float*>(p.param->data()), static_cast<const float*>(p.grad->data()), p.param->numel()});
  DeviceAdamW opt(o.adamw);
  Buffer sum(gpu.alloc(), sizeof(double));
  const auto& k = gpu.kernels();
  gpu.synchronize();
  gpu.reset_pool_peak();
  for (int step = 0; step < o.steps; ++step) {
    timed_step(gpu, o, sum, r, [&] {
      for (std::size_t i = 0; i < cp.size(); ++i) {
        const auto n = static_cast<unsigned long long>(cp[i].param->numel());
        if (master) k.convert(gpu.stream(), cp[i].param->data(), act, mp[i].param->data(), fsdp::DType::f32, n);
        check(cudaMemsetAsync(cp[i].grad->data(), 0, cp[i].grad->bytes(), gpu.stream()), "cudaMemsetAsync(gradient)");
      }
      forward_backward(gpu, compute, data[static_cast<std::size_t>(step % o.distinct_batches())],
                       static_cast<double*>(sum.get()));
      if (master)
        for (std::size_t i = 0; i < cp.size(); ++i)
          k.convert(gpu.stream(), mp[i].grad->data(), fsdp::DType::f32, cp[i].grad->data(), act,
                    static_cast<unsigned long long>(cp[i].param->numel()));
      opt.step(gpu, slots);
    });
  }
  r.pool_peak = gpu.pool_peak_bytes();
  r.gpu_used = gpu.used_bytes();
  return r;
}

// The host reference engine, unsharded: f32, or fsdp's mixed precision as the engine
// defines it (engine::unsharded_mixed_step: bf16 compute model, f32 reduce and master).
std::vector<double> host_reference(const Options& o, const std::vector<engine::Batch>& batches) {
  engine::Model master(o.model);
  engine::AdamW opt(o.adamw);
  std::optional<engine::Model> compute;
  if (o.bf16) compute.emplace(o.model, engine::heap(), fsdp::DType::bf16, fsdp::DType::bf16);
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    const auto& b = batches[static_cast<std::size_t>(step % o.distinct_batches())];
    losses.push_back(o.bf16 ? engine::unsharded_mixed_step(master, *compute, opt, b, fsdp::DType::f32)
                            : engine::unsharded_step(master, opt, b));
  }
  return losses;
}

double mean_after(const std::vector<double>& v, int skip) {
  double s = 0;
  for (std::size_t i = static_cast<std::size_t>(skip); i < v.size(); ++i) s += v[i];
  return s / static_cast<double>(v.size() - static_cast<std::size_t>(skip));
}

int run(const Options& o) {
  const double tolerance = o.bf16 ? 5e-2 : 1e-3;  // relative, per step (see docs/cuda.md)
  const std::string mode = o.fsdp ? (o.offload ? "fsdp+offload" : o.graph ? "fsdp+cuda-graph" : "fsdp") : "no-fsdp";
  const fsdp::DType act = o.bf16 ? fsdp::DType::bf16 : fsdp::DType::f32;
  Gpu gpu(o.device, act);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties");
  std::printf("cuda_train: %s on cuda:%d (%s), precision %s, model in %lld dim %lld hidden %lld out %lld blocks %d, batch %d, "
              "%d steps (%d warm-up); kernels %s%s\n",
              mode.c_str(), o.device, prop.name, o.bf16 ? "bf16 (MixedPrecision<bf16, float>)" : "f32",
              static_cast<long long>(o.model.in), static_cast<long long>(o.model.dim),
              static_cast<long long>(o.model.hidden), static_cast<long long>(o.model.out), o.model.blocks, o.batch, o.steps,
              o.warmup, gpu.kernels().arch().c_str(), gpu.kernels().from_cache() ? " (from the cache)" : " (compiled)");

  std::vector<engine::Batch> batches;
  std::vector<DeviceBatch> data;
  for (int s = 0; s < o.distinct_batches(); ++s) {
    batches.push_back(engine::make_batch(o.model, s, 0, o.batch));
    data.push_back(upload(gpu, batches.back()));
  }
  engine::Model initial(o.model);  // the initial values, as the host reference builds them
  RunResult r;
  if (!o.fsdp) r = run_plain(gpu, initial, data, o);
  else if (o.bf16 && o.offload)
    r = run_sharded<fsdp::FullShard, fsdp::BackwardPre, fsdp::MixedPrecision<fsdp::bf16, float>, fsdp::OffloadParams>(gpu, initial, data, o);
  else if (o.bf16) r = run_sharded<fsdp::FullShard, fsdp::BackwardPre, fsdp::MixedPrecision<fsdp::bf16, float>>(gpu, initial, data, o);
  else if (o.offload) r = run_sharded<fsdp::FullShard, fsdp::BackwardPre, fsdp::OffloadParams>(gpu, initial, data, o);
  else r = run_sharded<fsdp::FullShard, fsdp::BackwardPre>(gpu, initial, data, o);

  std::vector<double> ref;
  if (o.reference) ref = host_reference(o, batches);
  double worst = 0;
  bool parity = true, finite = true;
  for (int s = 0; s < o.steps; ++s) {
    const auto i = static_cast<std::size_t>(s);
    std::printf("step %2d: loss %.6f", s, r.losses[i]);
    finite = finite && std::isfinite(r.losses[i]);
    if (!ref.empty()) {
      const double rel = std::abs(r.losses[i] - ref[i]) / std::max(std::abs(ref[i]), 1e-12);
      parity = parity && rel <= tolerance;  // a NaN fails too
      worst = std::isnan(rel) ? rel : std::max(worst, rel);
      std::printf("  host reference %.6f  (relative difference %.2e)", ref[i], rel);
    }
    std::printf("  %.3f ms\n", r.step_ms[i]);
  }
  if (!finite) std::printf("loss: FAILED: a step's loss is not finite\n");
  if (!ref.empty())
    std::printf("parity: %s: largest relative loss difference %.2e, tolerance %.0e (%s host reference)\n",
                parity ? "ok" : "FAILED", worst, tolerance, o.bf16 ? "bf16 mixed-precision" : "f32");
  const double step_ms = mean_after(r.step_ms, o.warmup);
  const int timed = o.steps - o.warmup;
  std::printf("step time: %.3f ms (mean of %d steps after %d warm-up)\n", step_ms, timed, o.warmup);
  double host_us = 0;
  if (o.fsdp) {
    const double per = static_cast<double>(r.units) * timed;
    host_us = static_cast<double>((r.clock.hooks + r.clock.zero_grad).count()) / 1e3 / per;
    std::printf("library host time: %.2f us per unit per step (%zu units, %ld hook calls timed; hooks %.1f us + zero_grad "
                "%.1f us per step); finish_backward %.1f us per step (waits for the GPU's reductions%s)\n",
                host_us, r.units, r.clock.hook_calls, r.clock.hooks.count() / 1e3 / timed,
                r.clock.zero_grad.count() / 1e3 / timed, r.clock.finish_backward.count() / 1e3 / timed,
                o.offload ? " and the stream" : "");
    std::printf("device peak: %zu bytes in the stream-ordered pool (engine + library); fsdp::CudaDevice peak %zu bytes "
                "device, %zu bytes pinned host; GPU in use now %zu bytes (cudaMemGetInfo)\n",
                r.pool_peak, r.library_device.peak_bytes, r.library_host.peak_bytes, r.gpu_used);
    if (o.graph)
      std::printf("graph memory peak: %zu bytes (cudaGraphMemAttrUsedMemHigh: the captured step's buffers, engine and "
                  "library, apart from the stream-ordered pool above)\n", r.graph_peak);
  } else {
    std::printf("device peak: %zu bytes in the stream-ordered pool; GPU in use now %zu bytes (cudaMemGetInfo)\n", r.pool_peak,
                r.gpu_used);
  }
  std::printf("summary: mode=%s precision=%s step_ms=%.4f host_us_per_unit_step=%.3f parity=%s max_rel_diff=%.3e "
              "tolerance=%.0e final_loss=%.6f pool_peak_bytes=%zu\n",
              mode.c_str(), o.bf16 ? "bf16" : "f32", step_ms, host_us, ref.empty() ? "not-run" : (parity ? "ok" : "FAILED"),
              worst, tolerance, r.losses.back(), r.pool_peak);
  return parity && finite ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const int gpus = fsdp::cuda_device_count();
  if (gpus == 0) {
    std::optional<bool> require;
    try {
      require = fsdp::detail::env_bool("FSDP_REQUIRE_GPU");  // 1/true/yes/on; a value that is no boolean is refused
    } catch (const fsdp::Error& e) {
      usage_error(e.what());
    }
    if (require.value_or(false)) {
      std::printf("cuda_train: FAILED: FSDP_REQUIRE_GPU=1 but no CUDA GPU is visible\n");
      return 1;
    }
    std::printf("cuda_train: skipped: no CUDA GPU visible (nothing was trained; exit status %d)\n", kSkipped);
    return kSkipped;
  }
  if (o.device >= gpus) usage_error("--device " + std::to_string(o.device) + ": only " + std::to_string(gpus) + " GPUs visible");
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "cuda_train: error: %s\n", e.what());
    return 1;
  }
}
