// fsdp/cuda/cuda_thread_comm.hpp: several thread ranks on one GPU, collectives as device
// copies on communication streams ordered by events. Every collective must equal
// ThreadComm's bit for bit (in place too), a mismatch must fail on every rank, and
// sharded training of every combination on four ranks sharing GPU 0, each on its own
// engine stream, must equal the same training on the host stand-in that schedules as a
// queued device does (test/support/queued_host.hpp): parameters, losses, peak and
// allocation counts. Every case needs a GPU and reports itself skipped without one.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/cuda/cuda_thread_comm.hpp"
#include "fsdp/fsdp.hpp"
#include "test/support/device_training.hpp"
#include "test/support/errors.hpp"
#include "test/support/gpu.hpp"
#include "test/support/queued_host.hpp"

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
    CHECK(contains(errors[r], "rank 1 issued a different collective than rank 0"));
    CHECK(contains(refused[r], "only sum, and avg of floating dtypes"));
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
