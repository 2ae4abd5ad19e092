// Sharded training on the engine's own CUDA stream over NcclComm (one rank): what runs on
// which stream (docs/cuda.md). The engine's stream is held by a host function (a gate), so
// the library's collectives, which wait for it, cannot run; the hooks must still return
// (the compute stream waits for the collectives, not the host), and once the gate opens
// the step must give the same parameters as the same step on the host (every all-gather
// and reduction of a unit tagged; one rank gathers no tags). A collective that
// cannot complete becomes an fsdp::Error at finish_backward's host check, within the
// communicator's timeout (in a child process: it aborts the communicator). Every case
// needs a GPU and reports itself skipped without one; test/streams/queued_waits_test.cpp
// checks the same dispatch on the host with fakes.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/fsdp.hpp"
#include "fsdp/nccl/nccl_comm.hpp"
#include "test/support/device_training.hpp"
#include "test/support/errors.hpp"
#include "test/support/gpu.hpp"
#include "test/tools/child_process.hpp"

namespace {

using fsdp::CudaDevice;
using fsdp::HostDevice;
using fsdp::NcclComm;
using test_support::contains;
using test_support::error_of;
using test_support::no_gpu;
using Clock = std::chrono::steady_clock;

std::string role() {
  const char* r = std::getenv("FSDP_NCCL_STREAMS_ROLE");
  return r ? r : "";
}

// A stream of the engine's own, destroyed after everything on it.
struct EngineStream {
  cudaStream_t s = nullptr;
  EngineStream() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~EngineStream() { cudaStreamSynchronize(s), cudaStreamDestroy(s); }
};

// Holds a stream until open() (or `limit`, so nothing can hang): nothing queued behind it runs.
struct Gate {
  std::atomic<bool> opened{false}, passed{false};
  Clock::time_point until;
  void hold(cudaStream_t s, std::chrono::seconds limit) {
    until = Clock::now() + limit;
    REQUIRE(cudaLaunchHostFunc(s, [](void* p) {
      auto& g = *static_cast<Gate*>(p);
      while (!g.opened && Clock::now() < g.until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      g.passed = true;
    }, this) == cudaSuccess);
  }
  void open() { opened = true; }
};

NcclComm one_rank_comm(cudaStream_t engine, std::chrono::milliseconds timeout = std::chrono::minutes(1)) {
  fsdp::NcclCommOptions o;
  o.after = engine;  // collectives wait for what the engine (and the library on its stream) queued
  o.timeout = timeout;
  o.watchdog_interval = std::chrono::milliseconds(5);
  auto comms = NcclComm::create({0}, o);
  return std::move(comms[0]);
}

const test_support::DeviceTrainingConfig kConfig{.width = 16, .layers = 3, .batch = 2, .steps = 2, .lr = 0.05f};

// One step whose "engine" only queues device work: every hook, and each parameter's
// gradient accumulated from a device buffer uploaded beforehand (Device::accumulate), so
// nothing in it waits for the stream. Gradients differ per parameter and per step.
template <fsdp::Device D>
struct QueuedStep {
  D& dev;
  std::vector<void*> grads;  // one per parameter, in visit order: gain, then w, b per layer
  std::size_t bytes;
  QueuedStep(D& d, int step) : dev(d), bytes(static_cast<std::size_t>(kConfig.width) * 4) {
    for (int k = 0; k < 1 + 2 * kConfig.layers; ++k) {
      std::vector<float> g(static_cast<std::size_t>(kConfig.width));
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>((k + 1) * (i + 1)) - 0.3f * static_cast<float>(step);
      grads.push_back(dev.allocate(bytes, fsdp::MemorySpace::device));
      dev.copy(grads.back(), g.data(), bytes);
      // Exact, and loads CudaDevice's kernels now: a module load may synchronize, so it
      // must not first happen while the stream is held.
      dev.scale(grads.back(), g.size(), fsdp::DType::f32, 1.0);
    }
    dev.synchronize();
  }
  ~QueuedStep() {
    for (void* g : grads) dev.deallocate(g, bytes, fsdp::MemorySpace::device);
  }
  void run(test_support::Net<D>& net, fsdp::ShardedModel& sm) {
    const auto n = static_cast<std::size_t>(kConfig.width);
    fsdp::Unit& root = *sm.find_unit_for(net);
    {
      auto r = root.forward_scope();
      for (auto& l : net.layers) auto s = sm.find_unit_for(l)->forward_scope();
    }
    auto r = root.backward_scope();
    for (std::size_t k = net.layers.size(); k-- > 0;) {
      auto s = sm.find_unit_for(net.layers[k])->backward_scope();
      dev.accumulate(net.layers[k].gw.data, grads[1 + 2 * k], n, fsdp::DType::f32);
      dev.accumulate(net.layers[k].gb.data, grads[2 + 2 * k], n, fsdp::DType::f32);
    }
    dev.accumulate(net.ggain.data, grads[0], n, fsdp::DType::f32);
  }
};

// Full parameters after one ordinary step (NVRTC compiles, the first pass's agreements run)
// and then kConfig.steps queued steps; `around(step, run)` wraps each queued step.
template <fsdp::Device D, fsdp::Communicator C, class Around>
test_support::Params queued_training(D& dev, C& comm, Around around) {
  test_support::Net<D> net(dev, kConfig);
  auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
  sm.zero_grad();
  test_support::forward_backward(dev, net, sm, kConfig, 0, 0, 1.0);
  sm.finish_backward();
  test_support::sgd_step(dev, sm.shards(), kConfig.lr);
  for (int step = 1; step <= kConfig.steps; ++step) {
    QueuedStep<D> queued(dev, step);
    sm.zero_grad();
    around(step, [&] { queued.run(net, sm); });
    sm.finish_backward();  // the host-side check: the optimizer needs the gradients now
    test_support::sgd_step(dev, sm.shards(), kConfig.lr);
  }
  return test_support::full_parameters(dev, net, sm);
}

test_support::Params on_host() {
  test_support::Params out;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    HostDevice host;
    out = queued_training(host, comm, [](int, auto&& run) { run(); });
  });
  return out;
}

}  // namespace

TEST_CASE("on the engine's stream, every combination trains like the host, bit for bit" * doctest::skip(no_gpu)) {
  EngineStream engine;
  CudaDevice dev(0, engine.s);
  CHECK(dev.stream() == engine.s);
  CHECK(dev.queue().handle == engine.s);
  NcclComm comm = one_rank_comm(engine.s);
  CHECK(comm.all_gather_stream() != comm.reduce_stream());  // FSDP's two streams
  CHECK(fsdp::detail::CommRef(comm).checks_tags());  // the units' collectives run tagged
  test_support::for_each_combination([&]<class S, class P, class O>() {
    const std::string combination = test_support::combination_name<S, P, O>();
    CAPTURE(combination);
    HostDevice host;
    const auto expected = test_support::train_on_devices<S, P, O>(std::vector<HostDevice*>{&host}, kConfig,
                                                                  [](fsdp::ThreadComm& c, HostDevice&, auto&& body) { body(c); });
    const auto got = test_support::train_on_devices<S, P, O>(std::vector<CudaDevice*>{&dev}, kConfig,
                                                             [&](fsdp::ThreadComm&, CudaDevice&, auto&& body) { body(comm); });
    CHECK(test_support::bitwise_equal(expected.params, got.params));
    CHECK(expected.losses == got.losses);
  });
  CHECK(!comm.broken());
  dev.synchronize();
  CHECK(dev.stats(fsdp::MemorySpace::device).live_bytes == 0);
}

TEST_CASE("hooks return while the engine's stream is held; the step completes once it runs" * doctest::skip(no_gpu)) {
  EngineStream engine;
  CudaDevice dev(0, engine.s);
  NcclComm comm = one_rank_comm(engine.s);
  int held_steps = 0;
  const auto got = queued_training(dev, comm, [&](int step, auto&& run) {
    CAPTURE(step);
    Gate gate;
    gate.hold(engine.s, std::chrono::seconds(20));
    const auto begin = Clock::now();
    run();  // forward and backward hooks: all-gathers and reduce-scatters wait for the gate
    const auto took = Clock::now() - begin;
    CHECK_FALSE(gate.passed);  // the hooks returned before the stream moved at all
    CHECK(took < std::chrono::seconds(5));
    gate.open();  // finish_backward's host check (after this) waits for the stream
    ++held_steps;
  });
  CHECK(held_steps == kConfig.steps);
  CHECK(test_support::bitwise_equal(got, on_host()));
  CHECK(!comm.broken());
}

TEST_CASE("a collective that cannot complete is an fsdp::Error at finish_backward, within the timeout" *
          doctest::skip(no_gpu)) {
  test_tools::ChildProcess child({"/proc/self/exe", "--test-case=nccl streams child", "--no-version"},
                                 {"FSDP_NCCL_STREAMS_ROLE=stall"});
  const auto r = child.wait(std::chrono::seconds(60));
  INFO("child stdout:\n", r.out, "\nstderr:\n", r.err);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "HOOKS-RETURNED"));
  CHECK(contains(r.out, "STALL_ERROR: fsdp: "));
  CHECK(contains(r.out, "did not complete within 2000 ms"));
  CHECK(contains(r.out, "ncclCommAbort"));
  CHECK(contains(r.out, "STALL-DONE"));
}

// The child: the engine's stream is held for longer than the communicator's timeout; the
// hooks return, finish_backward throws once the watchdog aborts the communicator. Exits
// with _Exit so that nothing waits on an aborted communicator's work.
TEST_CASE("nccl streams child" * doctest::skip(role().empty())) {
  EngineStream engine;
  CudaDevice dev(0, engine.s);
  NcclComm comm = one_rank_comm(engine.s, std::chrono::milliseconds(2000));
  test_support::Net<CudaDevice> net(dev, kConfig);
  auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
  sm.zero_grad();
  test_support::forward_backward(dev, net, sm, kConfig, 0, 0, 1.0);
  sm.finish_backward();
  QueuedStep<CudaDevice> queued(dev, 1);
  sm.zero_grad();
  static Gate gate;  // outlives the process's last use of the stream
  gate.hold(engine.s, std::chrono::seconds(20));
  const std::string hooks = error_of([&] { queued.run(net, sm); });
  std::printf("HOOKS-%s%s\n", hooks.empty() ? "RETURNED" : "THREW: ", hooks.c_str());
  const auto begin = Clock::now();
  const std::string e = error_of([&] { sm.finish_backward(); });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - begin).count();
  std::printf("STALL_ERROR: %s\nSTALL_MS: %lld\n", e.c_str(), static_cast<long long>(ms));
  std::printf("STALL-%s\n", ms < 10000 ? "DONE" : "TOO-SLOW");
  std::fflush(stdout);
  gate.open();
  std::_Exit(0);
}
