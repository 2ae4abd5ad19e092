// fsdp/cuda/cuda_thread_comm.hpp: several thread ranks on one GPU, collectives as device
// copies on communication streams ordered by events. Every collective must equal
// ThreadComm's bit for bit (in place too), a mismatch must fail on every rank, and
// sharded training of every combination on four ranks sharing GPU 0, each on its own
// engine stream, must equal the same training on the host stand-in that schedules as a
// queued device does (test/support/queued_host.hpp): parameters, losses, peak and
// allocation counts. Collective tags are compared in the exchange of calls: a pair of
// same-sized units swapped on one rank fails on every rank naming both, and the pass check
// (an all-gather as each pass ends) no longer runs. Every case needs a GPU and reports
// itself skipped without one.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/comm/quantized_all_gather.hpp"
#include "fsdp/core/quantize.hpp"
#include "fsdp/cuda/cuda_thread_comm.hpp"
#include "fsdp/fsdp.hpp"
#include "fsdp/testing/counting_communicator.hpp"
#include "fsdp/testing/untagged_communicator.hpp"
#include "test/support/device_training.hpp"
#include "test/faults/unit_order_driver.hpp"
#include "test/support/errors.hpp"
#include "test/support/gpu.hpp"
#include "test/support/quantize_reference.hpp"
#include "test/support/queued_host.hpp"
#include "test/support/rank_errors.hpp"

namespace {

using fsdp::CudaDevice;
using fsdp::CudaThreadComm;
using fsdp::DType;
using fsdp::ReduceOp;
using test_support::contains;
using test_support::error_of;
using test_support::no_gpu;
using test_support::QueuedHostDevice;

// Rank r's engine stream and CudaDevice on it, all on GPU 0.
struct Ranks {
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<CudaDevice>> devices;
  std::vector<CudaDevice*> ptrs;
  explicit Ranks(int n) {
    for (int r = 0; r < n; ++r) {
      cudaStream_t s = nullptr;
      REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
      streams.push_back(s);
      devices.push_back(std::make_unique<CudaDevice>(0, s));
      ptrs.push_back(devices.back().get());
    }
  }
  ~Ranks() {
    devices.clear();
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
};

// Bytes of rank r's input: values every dtype can hold exactly, different per rank.
std::vector<unsigned char> input(int rank, std::size_t count, DType t) {
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<float>((rank + 1) * 3 + static_cast<int>(i % 11)) * 0.25f;
  std::vector<unsigned char> out(count * fsdp::size_of(t));
  fsdp::detail::host_cast(out.data(), t, v.data(), DType::f32, count);
  return out;
}

enum class Call { all_gather, all_gather_in_place, reduce_scatter, all_reduce, all_reduce_in_place, broadcast };

// Rank r's result of `call` through `comm` (buffers in `dev`'s device memory when given).
template <class Comm>
std::vector<unsigned char> run(Comm& comm, CudaDevice* dev, Call call, std::size_t count, DType t, ReduceOp op) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t es = fsdp::size_of(t), bytes = count * es;
  const bool gathers = call == Call::all_gather || call == Call::all_gather_in_place;
  const std::size_t send_bytes = call == Call::reduce_scatter ? bytes * n : bytes;
  const std::size_t recv_bytes = gathers ? bytes * n : bytes;
  std::vector<unsigned char> send = input(r, send_bytes / es, t), recv(recv_bytes, 0xab);
  if (call == Call::all_gather_in_place) std::memcpy(recv.data() + r * bytes, send.data(), bytes);
  if (call == Call::all_reduce_in_place) recv = send;
  void* s = send.data();
  void* d = recv.data();
  if (dev) {
    s = dev->allocate(send_bytes), d = dev->allocate(recv_bytes);
    dev->copy(s, send.data(), send_bytes);
    dev->copy(d, recv.data(), recv_bytes);
  }
  void* in_place_send = call == Call::all_gather_in_place ? static_cast<unsigned char*>(d) + r * bytes : d;
  fsdp::Work w;
  switch (call) {
    case Call::all_gather: w = comm.all_gather(s, d, count, t); break;
    case Call::all_gather_in_place: w = comm.all_gather(in_place_send, d, count, t); break;
    case Call::reduce_scatter: w = comm.reduce_scatter(s, d, count, t, op); break;
    case Call::all_reduce: w = comm.all_reduce(s, d, count, t, op); break;
    case Call::all_reduce_in_place: w = comm.all_reduce(d, d, count, t, op); break;
    case Call::broadcast: w = comm.broadcast(s, d, count, t, n - 1); break;
  }
  if (dev) {
    CHECK(w.wait_on(dev->queue()));  // the device stream waits; then the copy back is ordered behind it
    dev->copy(recv.data(), d, recv_bytes);
    dev->synchronize();
    w.wait();
    dev->deallocate(s, send_bytes);
    dev->deallocate(d, recv_bytes);
    dev->synchronize();
  } else {
    w.wait();
  }
  return recv;
}

}  // namespace

TEST_CASE("every collective equals ThreadComm's bit for bit, in place too" * doctest::skip(no_gpu)) {
  for (int n : {1, 3, 4}) {
    Ranks ranks(n);
    for (Call call : {Call::all_gather, Call::all_gather_in_place, Call::reduce_scatter, Call::all_reduce,
                      Call::all_reduce_in_place, Call::broadcast})
      for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32})
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
          if (op == ReduceOp::avg && (!fsdp::is_floating(t) || call == Call::all_gather || call == Call::broadcast))
            continue;
          CAPTURE(n);
          CAPTURE(static_cast<int>(call));
          CAPTURE(fsdp::name_of(t));
          CAPTURE(fsdp::name_of(op));
          std::vector<std::vector<unsigned char>> expected(n), got(n);
          fsdp::ThreadGroup(n).run([&](fsdp::ThreadComm& tc) {
            expected[tc.rank()] = run(tc, nullptr, call, 1000, t, op);
            CudaThreadComm comm(tc, *ranks.ptrs[tc.rank()]);
            got[tc.rank()] = run(comm, ranks.ptrs[tc.rank()], call, 1000, t, op);
          });
          for (int r = 0; r < n; ++r) CHECK(got[r] == expected[r]);
        }
  }
}

TEST_CASE("different collectives on different ranks fail on every rank; max is refused" * doctest::skip(no_gpu)) {
  Ranks ranks(2);
  std::vector<std::string> errors(2), refused(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& tc) {
    CudaDevice& dev = *ranks.ptrs[tc.rank()];
    CudaThreadComm comm(tc, dev);
    void* buf = dev.allocate(64);
    errors[tc.rank()] = error_of([&] { comm.all_reduce(buf, buf, tc.rank() == 0 ? 4 : 8, DType::f32, ReduceOp::sum).wait(); });
    refused[tc.rank()] = error_of([&] { comm.all_reduce(buf, buf, 4, DType::f32, ReduceOp::max).wait(); });
    dev.deallocate(buf, 64);
    dev.synchronize();
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "collective mismatch: rank 0 called all_reduce(count=4, dtype=f32, op=sum) as collective #0, "
                              "rank 1 called all_reduce(count=8, dtype=f32, op=sum) as collective #0"));
    CHECK(contains(refused[r], "only sum, and avg of floating dtypes"));
  }
}

namespace {

struct Names final : fsdp::UnitNames {
  std::string unit_name(int index) const override { return "block" + std::to_string(index); }
};

}  // namespace

TEST_CASE("tagged calls: equal tags give the untagged values, different tags fail on every rank naming each unit" *
          doctest::skip(no_gpu)) {
  static_assert(fsdp::TaggedCommunicator<CudaThreadComm>);
  const Names names;
  Ranks ranks(3);
  constexpr std::size_t n = 1000;
  std::vector<std::vector<unsigned char>> plain(3), tagged(3);
  std::vector<std::string> on_device(3), on_host(3);
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& tc) {
    const int r = tc.rank();
    CudaDevice& dev = *ranks.ptrs[r];
    CudaThreadComm comm(tc, dev);
    CHECK(fsdp::detail::CommRef(comm).checks_tags());
    const auto mine = input(r, n, DType::f32);
    void* send = dev.allocate(mine.size());
    void* recv = dev.allocate(3 * mine.size());
    dev.copy(send, mine.data(), mine.size());
    auto gathered = [&](const fsdp::CollectiveTag* tag) {
      fsdp::Work w = tag ? comm.all_gather(send, recv, n, DType::f32, *tag) : comm.all_gather(send, recv, n, DType::f32);
      CHECK(w.wait_on(dev.queue()));
      std::vector<unsigned char> out(3 * mine.size());
      dev.copy(out.data(), recv, out.size());
      dev.synchronize();
      return out;
    };
    const fsdp::CollectiveTag same{4, fsdp::TagPhase::forward, 2, &names};
    plain[r] = gathered(nullptr);
    tagged[r] = gathered(&same);
    const fsdp::CollectiveTag own{r == 2 ? 5u : 4u, fsdp::TagPhase::backward, 2, &names};
    on_device[r] = error_of([&] { comm.reduce_scatter(recv, send, n, DType::f32, ReduceOp::sum, own).wait(); });
    dev.deallocate(send, mine.size());
    dev.deallocate(recv, 3 * mine.size());
    dev.synchronize();
    float x = 1, y = 0;  // ordinary host memory: the ThreadComm's call, tag passed on
    on_host[r] = error_of([&] { comm.all_reduce(&x, &y, 1, DType::f32, ReduceOp::sum, own).wait(); });
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(tagged[r] == plain[r]);
    CHECK(plain[r] == plain[0]);
    for (const std::string& e : {on_device[r], on_host[r]}) {
      CAPTURE(e);
      CHECK(contains(e, "collective mismatch:"));
      CHECK(contains(e, "rank 0 called "));
      CHECK(contains(e, "of unit 'block4' (backward, pass 2)"));
      CHECK(contains(e, "rank 2 called "));
      CHECK(contains(e, "of unit 'block5' (backward, pass 2)"));
    }
    CHECK(contains(on_device[r], "rank 1 called reduce_scatter(count=1000, dtype=f32, op=sum) of unit 'block4' (backward, pass 2)"));
  }
  std::vector<unsigned char> expected;  // every rank's input, in rank order
  for (int r = 0; r < 3; ++r) {
    const auto in = input(r, n, DType::f32);
    expected.insert(expected.end(), in.begin(), in.end());
  }
  CHECK(plain[0] == expected);
}

TEST_CASE("a pair of same-sized units swapped on one rank fails on every rank, naming both, before they are shown" *
          doctest::skip(no_gpu)) {
  const std::vector<std::string> usual{"layers.0", "layers.1", "layers.2"};
  const std::vector<std::string> swapped{"layers.1", "layers.0", "layers.2"};
  const test_support::DeviceTrainingConfig config;
  Ranks ranks(2);
  std::vector<std::vector<std::string>> logs(2);
  const auto errors = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& tc) {
    CudaDevice& dev = *ranks.ptrs[tc.rank()];
    CudaThreadComm comm(tc, dev);
    test_support::Net<CudaDevice> net(dev, config);
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
    test_support::iteration(sm, usual);
    test_support::iteration(sm, tc.rank() == 1 ? swapped : usual, logs[tc.rank()]);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "collective mismatch"));
    CHECK(test_support::in_order(errors[r], {"rank 0 called all_gather(", "of unit 'layers.0' (forward", "rank 1 called all_gather(",
                                             "of unit 'layers.1' (forward"}));
    for (const char* shown : {"pre_forward layers.0", "pre_forward layers.1", "finish_backward"})
      CHECK(std::find(logs[r].begin(), logs[r].end(), shown) == logs[r].end());
  }
  for (auto* d : ranks.ptrs) d->synchronize();
}

TEST_CASE("tags replace the pass check: untagged, each pass ends with one more all-gather" * doctest::skip(no_gpu)) {
  const std::vector<std::string> order{"layers.0", "layers.1", "layers.2"};
  const test_support::DeviceTrainingConfig config;
  Ranks ranks(2);
  std::vector<fsdp::CollectiveCounts> tagged(2), untagged(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& tc) {
    CudaDevice& dev = *ranks.ptrs[tc.rank()];
    CudaThreadComm comm(tc, dev);
    auto second_pass = [&](auto& counting) {
      test_support::Net<CudaDevice> net(dev, config);
      auto sm = fsdp::shard<fsdp::FullShard>(net, counting, dev, fsdp::wrap_types<test_support::Layer>{});
      test_support::iteration(sm, order);  // the first pass records the order and agrees on it
      counting.reset();
      test_support::iteration(sm, order);
      dev.synchronize();
      return counting.counts();
    };
    fsdp::CountingCommunicator<CudaThreadComm> counting(comm);
    tagged[tc.rank()] = second_pass(counting);
    fsdp::UntaggedCommunicator<CudaThreadComm> plain(comm);
    fsdp::CountingCommunicator<fsdp::UntaggedCommunicator<CudaThreadComm>> counting_plain(plain);
    untagged[tc.rank()] = second_pass(counting_plain);
  });
  using fsdp::Collective;
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(tagged[r][Collective::all_gather].calls > 0);
    CHECK(untagged[r][Collective::all_gather].calls == tagged[r][Collective::all_gather].calls + 1);
    CHECK(untagged[r][Collective::all_gather].bytes == tagged[r][Collective::all_gather].bytes + 2 * 8);  // 8 bytes per rank
    CHECK(untagged[r][Collective::reduce_scatter] == tagged[r][Collective::reduce_scatter]);
  }
}

TEST_CASE("four ranks on one GPU train every combination like the host, bit for bit" * doctest::skip(no_gpu)) {
  constexpr int kWorld = 4;
  const test_support::DeviceTrainingConfig config;
  Ranks ranks(kWorld);
  test_support::for_each_combination([&]<class S, class P, class O>() {
    const std::string combination = test_support::combination_name<S, P, O>();
    CAPTURE(combination);
    // The host run schedules as the GPU does (queued waits, a reduction in flight until the
    // next unit's), so peaks and allocations must match exactly, not only values.
    std::vector<test_support::Log> logs(kWorld);
    std::vector<std::unique_ptr<QueuedHostDevice>> hosts;
    std::vector<QueuedHostDevice*> host_ptrs;
    for (auto& log : logs) host_ptrs.push_back(hosts.emplace_back(std::make_unique<QueuedHostDevice>(log)).get());
    const auto on_host = test_support::train_on_devices<S, P, O>(
        host_ptrs, config, [](fsdp::ThreadComm& c, QueuedHostDevice& d, auto&& body) {
          test_support::RecordingComm comm(c, d.log(), d.queue().handle);
          body(comm);
        });
    const auto on_gpu = test_support::train_on_devices<S, P, O>(
        ranks.ptrs, config, [](fsdp::ThreadComm& c, CudaDevice& d, auto&& body) {
          CudaThreadComm comm(c, d);
          body(comm);
        });
    CHECK(test_support::bitwise_equal(on_host.params, on_gpu.params));
    CHECK(on_host.losses == on_gpu.losses);
    CHECK(on_host.skipped_steps == on_gpu.skipped_steps);
    CHECK(on_gpu.device_space.peak_bytes == on_host.device_space.peak_bytes);
    CHECK(on_gpu.device_space.allocations == on_host.device_space.allocations);
  });
  for (auto* d : ranks.ptrs) CHECK(d->stats(fsdp::MemorySpace::device).live_bytes == 0);
}

TEST_CASE("a quantized all-gather between ranks sharing a GPU: every rank gets what the host functions give" *
          doctest::skip(no_gpu)) {
  constexpr int world = 2;
  constexpr std::size_t n = 1000;
  auto shard_of = [](int rank) {
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = std::ldexp(static_cast<float>((i * 7919 + 31 * rank) % 301) - 150.0f, -rank);
    return x;
  };
  for (const fsdp::QuantFormat f : {fsdp::QuantFormat::int8_blocks, fsdp::QuantFormat::mxfp8}) {
    CAPTURE(fsdp::name_of(f));
    const std::size_t block = f == fsdp::QuantFormat::mxfp8 ? 32 : 128;
    std::vector<float> want;
    for (int r = 0; r < world; ++r) {  // the host functions, shard by shard
      const std::vector<float> y = test_support::quantize_round_trip(f, shard_of(r), block);
      want.insert(want.end(), y.begin(), y.end());
    }
    Ranks ranks(world);
    std::vector<std::vector<float>> got(world, std::vector<float>(n * world));
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& tc) {
      CudaDevice& dev = *ranks.ptrs[tc.rank()];
      CudaThreadComm comm(tc, dev);
      const std::vector<float> x = shard_of(tc.rank());
      auto* shard = static_cast<float*>(dev.allocate(n * 4));
      auto* full = static_cast<float*>(dev.allocate(n * world * 4));
      dev.copy(shard, x.data(), n * 4);
      fsdp::quantized_all_gather(comm, dev, f, block, shard, n, full);
      dev.copy(got[static_cast<std::size_t>(tc.rank())].data(), full, n * world * 4);
      dev.synchronize();
      dev.deallocate(shard, n * 4);
      dev.deallocate(full, n * world * 4);
      dev.synchronize();
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(std::memcmp(got[static_cast<std::size_t>(r)].data(), want.data(), want.size() * 4) == 0);
    }
    for (auto* d : ranks.ptrs) CHECK(d->stats(fsdp::MemorySpace::device).live_bytes == 0);
    // A NaN in rank 1's shard: the status word travels through device memory both ways, and
    // every rank's error names rank 1 and the element; nothing is dequantized.
    std::vector<std::string> errors(world);
    std::vector<char> untouched(world, 0);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& tc) {
      CudaDevice& dev = *ranks.ptrs[tc.rank()];
      CudaThreadComm comm(tc, dev);
      std::vector<float> x = shard_of(tc.rank());
      if (tc.rank() == 1) x[417] = std::numeric_limits<float>::quiet_NaN();
      auto* shard = static_cast<float*>(dev.allocate(n * 4));
      auto* full = static_cast<float*>(dev.allocate(n * world * 4));
      dev.copy(shard, x.data(), n * 4);
      dev.fill_zero(full, n * world * 4);
      errors[static_cast<std::size_t>(tc.rank())] = error_of([&] { fsdp::quantized_all_gather(comm, dev, f, block, shard, n, full); });
      std::vector<float> back(n * world, 1.0f);
      dev.copy(back.data(), full, n * world * 4);
      dev.synchronize();
      untouched[static_cast<std::size_t>(tc.rank())] = std::all_of(back.begin(), back.end(), [](float v) { return v == 0.0f; });
      dev.deallocate(shard, n * 4);
      dev.deallocate(full, n * world * 4);
      dev.synchronize();
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(errors[static_cast<std::size_t>(r)]);
      CHECK(contains(errors[static_cast<std::size_t>(r)], "rank 1's shard holds an inf or NaN at element 417"));
      CHECK(untouched[static_cast<std::size_t>(r)]);
    }
    for (auto* d : ranks.ptrs) CHECK(d->stats(fsdp::MemorySpace::device).live_bytes == 0);
  }
}
