// Sharded training on the engine's own CUDA stream over NcclComm: what runs on which
// stream (docs/cuda.md). On one rank, every combination trains as on the host, bit for bit,
// and the hooks return while a host function (a gate) holds the engine's stream: nothing
// in them waits on the host, and once the gate opens the step gives the host's parameters.
// On two ranks (two GPUs, or the emulated runtime), a peer whose stream is held keeps
// every collective of the step from completing, and finish_backward's host check turns
// that into an fsdp::Error within the communicator's timeout (child processes: it aborts
// the communicator). One rank cannot show that: it issues no collective in a step (its
// shard is the whole parameter). Cases report skipped without the GPUs they need;
// test/streams/queued_waits_test.cpp checks the same dispatch on the host with fakes.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

// The two-process case needs Boost.Asio (the TcpStore); tools/gpu_proof.sh builds this
// file with g++ where Boost may be missing, and then compiles that case out.
#if __has_include(<boost/asio.hpp>)
#define FSDP_NCCL_STREAMS_TCP 1
#include "fsdp/asio/tcp_store.hpp"
#endif
#include "fsdp/fsdp.hpp"
#include "fsdp/graph/captured_step.hpp"
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

const bool fewer_than_two_gpus = fsdp::cuda_device_count() < 2;

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
    for (int k = 0; k < 1 + 2 * kConfig.layers; ++k) grads.push_back(dev.allocate(bytes, fsdp::MemorySpace::device));
    fill(step);
  }
  // Step `step`'s gradients, into the same buffers (a captured step reads them there).
  void fill(int step) {
    for (std::size_t k = 0; k < grads.size(); ++k) {
      std::vector<float> g(static_cast<std::size_t>(kConfig.width));
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>((k + 1) * (i + 1)) - 0.3f * static_cast<float>(step);
      dev.copy(grads[k], g.data(), bytes);
      // Exact, and loads CudaDevice's kernels now: a module load may synchronize, so it
      // must not first happen while the stream is held (or captured).
      dev.scale(grads[k], g.size(), fsdp::DType::f32, 1.0);
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

// queued_training's steps captured into one CUDA graph at the first queued step and
// replayed at every one (fsdp::CapturedStep), zero_grad and the optimizer around each.
// First a capture that fails halfway (a host wait in the body, after the step's first
// all-gathers were captured): it must leave the model between steps, its buffers gone
// with the capture, and change nothing.
test_support::Params captured_training(CudaDevice& dev, NcclComm& comm, cudaStream_t stream, std::uint64_t* replays,
                                       std::string* failed_capture) {
  test_support::Net<CudaDevice> net(dev, kConfig);
  auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
  sm.zero_grad();
  test_support::forward_backward(dev, net, sm, kConfig, 0, 0, 1.0);
  sm.finish_backward();
  test_support::sgd_step(dev, sm.shards(), kConfig.lr);
  QueuedStep<CudaDevice> queued(dev, 1);
  std::optional<fsdp::CapturedStep> step;
  for (int s = 1; s <= kConfig.steps; ++s) {
    queued.fill(s);
    sm.zero_grad();
    if (!step)
      *failed_capture = error_of([&] {
        fsdp::CapturedStep failing(sm, stream, std::vector<NcclComm*>{&comm}, [&] {
          fsdp::Unit& root = *sm.find_unit_for(net);
          auto r = root.forward_scope();
          auto first = sm.find_unit_for(net.layers[0])->forward_scope();
          dev.synchronize();
        });
      });
    if (!step) step.emplace(sm, stream, std::vector<NcclComm*>{&comm}, [&] {
      queued.run(net, sm);
      sm.finish_backward();
    });
    step->replay();
    step->wait();
    test_support::sgd_step(dev, sm.shards(), kConfig.lr);
  }
  *replays = step->replays();
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
    // The host function reads the gate until it sees it open: the gate must outlive that.
    while (!gate.passed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ++held_steps;
  });
  CHECK(held_steps == kConfig.steps);
  CHECK(test_support::bitwise_equal(got, on_host()));
  CHECK(!comm.broken());
}

TEST_CASE("a step captured into a CUDA graph and replayed trains like the host, bit for bit" * doctest::skip(no_gpu)) {
  EngineStream engine;
  CudaDevice dev(0, engine.s);
  NcclComm comm = one_rank_comm(engine.s);
  std::uint64_t replays = 0;
  std::string failed;
  const auto got = captured_training(dev, comm, engine.s, &replays, &failed);
  CHECK(contains(failed, "cudaStreamSynchronize failed: cudaErrorStreamCaptureUnsupported"));
  CHECK(replays == static_cast<std::uint64_t>(kConfig.steps));
  CHECK(test_support::bitwise_equal(got, on_host()));
  CHECK(!comm.broken());
  dev.synchronize();
  CHECK(dev.stats(fsdp::MemorySpace::device).live_bytes == 0);
}

TEST_CASE("a step that cannot be captured is refused, naming why" * doctest::skip(no_gpu)) {
  EngineStream engine;
  CudaDevice dev(0, engine.s);
  NcclComm comm = one_rank_comm(engine.s);
  test_support::Net<CudaDevice> net(dev, kConfig);
  auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
  QueuedStep<CudaDevice> queued(dev, 1);
  auto capture = [&](cudaStream_t stream, std::vector<NcclComm*> comms, auto&& body) {
    return error_of([&] { fsdp::CapturedStep step(sm, stream, std::move(comms), body); });
  };
  auto whole_step = [&] {
    queued.run(net, sm);
    sm.finish_backward();
  };
  CHECK(contains(capture(engine.s, {&comm}, whole_step), "no step has ended yet: run one eagerly first"));
  sm.zero_grad();
  test_support::forward_backward(dev, net, sm, kConfig, 0, 0, 1.0);
  sm.finish_backward();
  CHECK(contains(capture(nullptr, {&comm}, whole_step), "not the legacy default stream"));
  CHECK(contains(capture(engine.s, {}, whole_step), "no communicator given"));
  EngineStream other;
  CHECK(contains(capture(other.s, {&comm}, whole_step), "set NcclCommOptions::after (or ::stream) to the stream"));
  // A host wait inside the body: CUDA refuses it and invalidates the capture.
  const std::string waited = capture(engine.s, {&comm}, [&] {
    queued.run(net, sm);
    dev.synchronize();
  });
  CHECK(contains(waited, "cudaStreamSynchronize"));
  CHECK(contains(waited, "cudaErrorStreamCaptureUnsupported"));
  CHECK(!comm.broken());
  // The model goes on eagerly after a refused capture, and captures once it can.
  dev.synchronize();
  sm.zero_grad();
  test_support::forward_backward(dev, net, sm, kConfig, 0, 0, 1.0);
  sm.finish_backward();
  sm.zero_grad();
  fsdp::CapturedStep step(sm, engine.s, {&comm}, whole_step);
  sm.zero_grad();
  step.replay();
  CHECK(contains(error_of([&] { step.replay(); }), "replay() before wait() of replay 1 returned"));
  step.wait();
  CHECK(step.replays() == 1);
  // What a replay cannot see is checked before it launches: the gradients it reduces into
  // (zeroed before the capture, so before every replay), and the run-time settings.
  CHECK(contains(error_of([&] { step.replay(); }),
                 "replay 2 refused: unit '<root>' has gradients 'reduced -s' where the capture began with 'zero -s'"));
  sm.zero_grad();
  sm.set_reshard_after_forward(false);
  CHECK(contains(error_of([&] { step.replay(); }),
                 "replay 2 refused: unit '<root>': its run-time settings changed since the last step, and the ranks "
                 "agree on them in the next backward, on the host, which a replay does not run: set them back as "
                 "captured, or run a step eagerly and capture again"));
  sm.set_reshard_after_forward(true);
  step.replay();
  step.wait();
  CHECK(step.replays() == 2);
  // A communicator the step uses but the capture was not told of: its watchdog cannot wait
  // for a collective recorded into a graph, and says why.
  fsdp::NcclComm untold_comm = one_rank_comm(engine.s);
  fsdp::CudaDevice scratch_dev(0, engine.s);
  void* scratch = scratch_dev.allocate(64);
  sm.zero_grad();
  (void)error_of([&] {
    fsdp::CapturedStep untold(sm, engine.s, {&comm}, [&] {
      whole_step();
      untold_comm.all_reduce(scratch, scratch, 16, fsdp::DType::f32, fsdp::ReduceOp::sum);
    });
  });
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (!untold_comm.broken() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(contains(untold_comm.broken_by(), "was not told (pass it to fsdp::CapturedStep)"));
  dev.synchronize();
  scratch_dev.deallocate(scratch, 64);
  // A communicator of the step that broke since (here a collective that timed out behind
  // a held stream): the replay is refused with the communicator's own failure and kind, as
  // its next eager collective would be (an echo's stays an echo), not as a misuse.
  EngineStream held;
  fsdp::CudaDevice held_dev(0, held.s);
  NcclComm timing_out = one_rank_comm(held.s, std::chrono::milliseconds(300));
  test_support::Net<CudaDevice> held_net(held_dev, kConfig);
  auto held_sm = fsdp::shard<fsdp::FullShard>(held_net, timing_out, held_dev, fsdp::wrap_types<test_support::Layer>{});
  QueuedStep<CudaDevice> held_queued(held_dev, 1);
  held_sm.zero_grad();
  test_support::forward_backward(held_dev, held_net, held_sm, kConfig, 0, 0, 1.0);
  held_sm.finish_backward();
  held_sm.zero_grad();
  fsdp::CapturedStep held_step(held_sm, held.s, {&timing_out}, [&] {
    held_queued.run(held_net, held_sm);
    held_sm.finish_backward();
  });
  static Gate gate;  // outlives the process's last use of the stream
  gate.hold(held.s, std::chrono::seconds(20));
  void* x = held_dev.allocate(64);
  timing_out.all_reduce(x, x, 16, fsdp::DType::f32, fsdp::ReduceOp::sum);  // behind the gate: times out
  const auto broke_by = Clock::now() + std::chrono::seconds(10);
  while (!timing_out.broken() && Clock::now() < broke_by) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  gate.open();
  held_sm.zero_grad();
  const auto refused = test_support::thrown_by([&] { held_step.replay(); });
  CHECK(contains(refused.message, "CapturedStep: replay 1 refused: NcclComm '"));
  CHECK(contains(refused.message, "the communicator broke earlier: "));
  CHECK(contains(refused.message, "did not complete within 300 ms"));
  CHECK(refused.kind == fsdp::ErrorKind::timeout);
  CHECK(refused.echo_of == -1);
  CHECK(held_step.replays() == 0);
  // x stays allocated: the aborted all_reduce is never known to be done with it.
}

#ifdef FSDP_NCCL_STREAMS_TCP
// Starts `world` children of this binary as the ranks of one job in `role` ("stall" or
// "train"; "nccl streams child" below), meeting through `server`'s store.
std::vector<std::unique_ptr<test_tools::ChildProcess>> spawn_ranks(const std::string& role, int world,
                                                                   const fsdp::TcpStoreServer& server) {
  std::vector<std::unique_ptr<test_tools::ChildProcess>> children;
  for (int r = 0; r < world; ++r)
    children.push_back(std::make_unique<test_tools::ChildProcess>(
        std::vector<std::string>{"/proc/self/exe", "--test-case=nccl streams child", "--no-version"},
        std::vector<std::string>{"FSDP_NCCL_STREAMS_ROLE=" + role, "FSDP_NCCL_STREAMS_RANK=" + std::to_string(r),
                                 "FSDP_NCCL_TEST_WORLD=" + std::to_string(world),
                                 "FSDP_NCCL_STREAMS_PORT=" + std::to_string(server.port())}));
  return children;
}

// Two ranks, since one issues no collective in a step (its shard is the whole parameter:
// nothing to gather or reduce), so only a peer can hold one.
TEST_CASE("a collective that cannot complete is an fsdp::Error at finish_backward, within the timeout" *
          doctest::skip(fewer_than_two_gpus)) {
  fsdp::TcpStoreServer server;
  const auto children = spawn_ranks("stall", 2, server);
  for (int r = 0; r < 2; ++r) {
    const auto result = children[static_cast<std::size_t>(r)]->wait(std::chrono::seconds(60));
    INFO("rank ", r, " stdout:\n", result.out, "\nstderr:\n", result.err);
    CHECK(result.status == 0);
    CHECK(contains(result.out, "HOOKS-RETURNED"));
    // The watchdog thread or finish_backward's wait may see the timeout first; the error
    // names the communicator and rank either way ("watchdog: " says which saw it).
    const std::string stalled = "NcclComm 'world' rank " + std::to_string(r) + " of 2 (cuda:" + std::to_string(r) + "): ";
    CHECK((contains(result.out, "STALL_ERROR: fsdp: " + stalled) ||
           contains(result.out, "STALL_ERROR: fsdp: watchdog: " + stalled)));
    CHECK(contains(result.out, "did not complete within 2000 ms"));
    CHECK(contains(result.out, "ncclCommAbort"));
    CHECK(contains(result.out, "STALL-DONE"));
  }
}

// The multi-process training case's world sizes: test_support::test_worlds(); a child
// learns its own from FSDP_NCCL_TEST_WORLD.
int train_world() { return std::atoi(std::getenv("FSDP_NCCL_TEST_WORLD")); }

const bool too_few_gpus_to_train = test_support::too_few_gpus_for_test_worlds();

// Runs `role` as the ranks of each of test_support::test_worlds(), children of this binary
// meeting through a store, and checks each rank's exit status and `check(rank, stdout)`.
template <class Check>
void on_each_rank(const std::string& role, std::chrono::seconds limit, Check&& check) {
  for (const int world : test_support::test_worlds()) {
    CAPTURE(world);
    fsdp::TcpStoreServer server;
    const auto children = spawn_ranks(role, world, server);
    for (int r = 0; r < world; ++r) {
      const auto result = children[static_cast<std::size_t>(r)]->wait(limit);
      INFO("rank ", r, " of ", world, " stdout:\n", result.out, "\nstderr:\n", result.err);
      CHECK(result.status == 0);
      check(r, result.out);
    }
  }
}

TEST_CASE("processes: every combination trains like the host on as many ranks, bit for bit" *
          doctest::skip(too_few_gpus_to_train)) {
  on_each_rank("train", std::chrono::seconds(240),
               [](int, const std::string& out) { CHECK(contains(out, "COMBINATIONS: 18 trained, 0 differ")); });
}

TEST_CASE("processes: a step captured into a CUDA graph trains like the host on as many ranks, bit for bit" *
          doctest::skip(too_few_gpus_to_train)) {
  on_each_rank("capture", std::chrono::seconds(120), [](int r, const std::string& out) {
    CHECK(contains(out, "CAPTURED: equal 1, replays " + std::to_string(kConfig.steps) + ", broken 0"));
    CHECK(contains(out, "FAILED-CAPTURE: fsdp: CudaDevice(cuda:" + std::to_string(r) +
                            "): cudaStreamSynchronize failed: cudaErrorStreamCaptureUnsupported"));
  });
}

// A capturing child: rank FSDP_NCCL_STREAMS_RANK of train_world() trains as
// captured_training does over NcclComm, and compares with queued_training on the host
// reference engine over as many thread ranks.
void capture_child(int rank, fsdp::Store& store) {
  const int world = train_world();
  REQUIRE(cudaSetDevice(rank) == cudaSuccess);
  test_support::Params expected;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& c) {
    HostDevice host;
    auto p = queued_training(host, c, [](int, auto&& run) { run(); });
    if (c.rank() == 0) expected = std::move(p);
  });
  EngineStream engine;
  CudaDevice dev(rank, engine.s);
  fsdp::NcclCommOptions o;
  o.after = engine.s;
  o.timeout = std::chrono::seconds(60);
  NcclComm comm = NcclComm::from_store(store, rank, world, rank, o);
  std::uint64_t replays = 0;
  std::string failed;
  const std::string error = error_of([&] {
    const auto got = captured_training(dev, comm, engine.s, &replays, &failed);
    std::printf("CAPTURED: equal %d, replays %llu, broken %d\nFAILED-CAPTURE: %s\n",
                test_support::bitwise_equal(expected, got) ? 1 : 0, static_cast<unsigned long long>(replays),
                comm.broken() ? 1 : 0, failed.c_str());
  });
  if (!error.empty()) std::printf("CAPTURE-ERROR: %s\n", error.c_str());
  std::fflush(stdout);
  std::_Exit(0);
}

// A training child: rank FSDP_NCCL_STREAMS_RANK of train_world() on its GPU trains every
// combination over one NcclComm, and compares with the host reference engine's run of the
// same world in threads (every rank ends with the same parameters; rank 0's losses too).
void train_child(int rank, fsdp::Store& store) {
  const int world = train_world();
  REQUIRE(cudaSetDevice(rank) == cudaSuccess);
  EngineStream engine;
  CudaDevice dev(rank, engine.s);
  fsdp::NcclCommOptions o;
  o.after = engine.s;
  o.timeout = std::chrono::seconds(60);
  NcclComm comm = NcclComm::from_store(store, rank, world, rank, o);
  int trained = 0, differ = 0;
  test_support::for_each_combination([&]<class S, class P, class O>() {
    const std::string combination = test_support::combination_name<S, P, O>();
    std::vector<HostDevice> hosts(static_cast<std::size_t>(world));
    std::vector<HostDevice*> host_ptrs;
    for (auto& h : hosts) host_ptrs.push_back(&h);
    const auto expected = test_support::train_on_devices<S, P, O>(
        host_ptrs, kConfig, [](fsdp::ThreadComm& c, HostDevice&, auto&& body) { body(c); });
    const auto got = test_support::train_on_devices<S, P, O>(
        std::vector<CudaDevice*>{&dev}, kConfig, [&](fsdp::ThreadComm&, CudaDevice&, auto&& body) { body(comm); });
    ++trained;
    if (!test_support::bitwise_equal(expected.params, got.params) || (rank == 0 && expected.losses != got.losses)) {
      ++differ;
      std::printf("DIFFERS: %s\n", combination.c_str());
    }
  });
  std::printf("COMBINATIONS: %d trained, %d differ\nBROKEN: %d\n", trained, differ, comm.broken() ? 1 : 0);
  std::fflush(stdout);
  std::_Exit(0);
}

// A child, rank FSDP_NCCL_STREAMS_RANK of two on its GPU: after an ordinary step, rank 1
// holds its engine's stream for longer than the communicator's timeout, so its part of
// every collective of the next step waits, and rank 0's cannot complete either. On both,
// the hooks return and finish_backward throws once the watchdog aborts the communicator.
// Exits with _Exit so that nothing waits on an aborted communicator's work.
TEST_CASE("nccl streams child" * doctest::skip(role().empty())) {
  const int rank = std::atoi(std::getenv("FSDP_NCCL_STREAMS_RANK"));
  const auto port = static_cast<std::uint16_t>(std::atoi(std::getenv("FSDP_NCCL_STREAMS_PORT")));
  fsdp::TcpStore store("127.0.0.1", port);
  if (role() == "train") train_child(rank, store);
  if (role() == "capture") capture_child(rank, store);
  REQUIRE(cudaSetDevice(rank) == cudaSuccess);
  EngineStream engine;
  CudaDevice dev(rank, engine.s);
  fsdp::NcclCommOptions o;
  o.after = engine.s;
  o.timeout = std::chrono::milliseconds(2000);
  o.watchdog_interval = std::chrono::milliseconds(5);
  NcclComm comm = NcclComm::from_store(store, rank, 2, rank, o);
  test_support::Net<CudaDevice> net(dev, kConfig);
  auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
  sm.zero_grad();
  test_support::forward_backward(dev, net, sm, kConfig, 0, 0, 1.0);
  sm.finish_backward();
  QueuedStep<CudaDevice> queued(dev, 1);
  sm.zero_grad();
  static Gate gate;  // outlives the process's last use of the stream
  if (rank == 1) gate.hold(engine.s, std::chrono::seconds(20));
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
#endif
