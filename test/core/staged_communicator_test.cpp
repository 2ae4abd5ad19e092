// fsdp/comm/staged_communicator.hpp: every collective staged through host memory gives what the
// inner communicator gives, in place or not; errors of the inner communicator reach every
// rank; and sharded training over it is bitwise identical to training over ThreadComm,
// for every precision x offload x strategy combination. (The same training on CudaDevice
// is test/cuda/cuda_sharded_test.cpp.)
#include <doctest/doctest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "test/support/device_training.hpp"
#include "test/support/rank_errors.hpp"

namespace core_staged_communicator_test {

namespace {

using fsdp::DType;
using fsdp::HostDevice;
using fsdp::ReduceOp;
using fsdp::ThreadComm;
using Staged = fsdp::StagedCommunicator<ThreadComm, HostDevice>;

static_assert(fsdp::Communicator<Staged>);
static_assert(fsdp::SplittableCommunicator<Staged>);

// Rank r's value i: distinct across ranks and positions.
std::vector<float> values(int rank, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(100 * rank + static_cast<int>(i)) + 0.25f;
  return v;
}

}  // namespace

TEST_CASE("each collective staged through host gives what ThreadComm gives, in place or not") {
  constexpr int kWorld = 3;
  constexpr std::size_t kCount = 5;
  fsdp::ThreadGroup(kWorld).run([&](ThreadComm& comm) {
    HostDevice dev;
    Staged staged(comm, dev);
    CHECK(staged.rank() == comm.rank());
    CHECK(staged.size() == kWorld);
    const int r = comm.rank();
    const auto mine = values(r, kCount);

    std::vector<float> gathered(kCount * kWorld), expected(kCount * kWorld);
    staged.all_gather(mine.data(), gathered.data(), kCount, DType::f32).wait();
    comm.all_gather(mine.data(), expected.data(), kCount, DType::f32).wait();
    CHECK(gathered == expected);
    std::vector<float> in_place(kCount * kWorld, -1.0f);  // send == recv + rank * count
    std::copy(mine.begin(), mine.end(), in_place.begin() + r * kCount);
    staged.all_gather(in_place.data() + r * kCount, in_place.data(), kCount, DType::f32).wait();
    CHECK(in_place == expected);

    const auto full = values(r, kCount * kWorld);
    std::vector<float> scattered(kCount), scattered_expected(kCount);
    staged.reduce_scatter(full.data(), scattered.data(), kCount, DType::f32, ReduceOp::sum).wait();
    comm.reduce_scatter(full.data(), scattered_expected.data(), kCount, DType::f32, ReduceOp::sum).wait();
    CHECK(scattered == scattered_expected);
    auto rs_in_place = full;  // recv == send + rank * count
    staged.reduce_scatter(rs_in_place.data(), rs_in_place.data() + r * kCount, kCount, DType::f32, ReduceOp::sum).wait();
    CHECK(std::vector<float>(rs_in_place.begin() + r * kCount, rs_in_place.begin() + (r + 1) * kCount) == scattered_expected);

    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
      CAPTURE(fsdp::name_of(op));
      std::vector<float> reduced(kCount), reduced_expected(kCount);
      staged.all_reduce(mine.data(), reduced.data(), kCount, DType::f32, op).wait();
      comm.all_reduce(mine.data(), reduced_expected.data(), kCount, DType::f32, op).wait();
      CHECK(reduced == reduced_expected);
      auto ar_in_place = mine;
      staged.all_reduce(ar_in_place.data(), ar_in_place.data(), kCount, DType::f32, op).wait();
      CHECK(ar_in_place == reduced_expected);
    }

    std::vector<std::int64_t> b(4, r);
    staged.broadcast(r == 2 ? b.data() : nullptr, b.data(), 4, DType::i64, 2).wait();  // only the root's send is read
    CHECK(b == std::vector<std::int64_t>(4, 2));
    staged.barrier().wait();
  });
}

TEST_CASE("split groups stage through the same device") {
  fsdp::ThreadGroup(4).run([&](ThreadComm& comm) {
    HostDevice dev;
    Staged staged(comm, dev);
    auto half = staged.split(comm.rank() % 2, comm.rank());
    static_assert(std::is_same_v<decltype(half), Staged>);
    CHECK(half.size() == 2);
    const std::int32_t mine = comm.rank();
    std::int32_t sum = 0;
    half.all_reduce(&mine, &sum, 1, DType::i32, ReduceOp::sum).wait();
    CHECK(sum == (comm.rank() % 2 == 0 ? 0 + 2 : 1 + 3));
  });
}

TEST_CASE("the inner communicator's errors reach every rank, and null buffers are refused") {
  const auto errors = test_support::errors_per_rank(2, [](ThreadComm& comm) {
    HostDevice dev;
    Staged staged(comm, dev);
    std::vector<float> a(4), b(8);
    if (comm.rank() == 0) staged.all_gather(a.data(), b.data(), 4, DType::f32).wait();
    else staged.all_reduce(a.data(), a.data(), 4, DType::f32, ReduceOp::sum).wait();  // a different collective
  });
  for (const auto& e : errors) CHECK(test_support::contains(e, "collective mismatch"));

  const auto null_errors = test_support::errors_per_rank(1, [](ThreadComm& comm) {
    HostDevice dev;
    Staged staged(comm, dev);
    std::vector<float> a(4);
    staged.all_reduce(nullptr, a.data(), 4, DType::f32, ReduceOp::sum).wait();
  });
  CHECK(test_support::contains(null_errors[0], "StagedCommunicator (rank 0): null buffer"));
}

TEST_CASE("sharded training over StagedCommunicator is bitwise identical to ThreadComm's, for every combination") {
  const test_support::DeviceTrainingConfig config;
  std::size_t peak_without_offload = 0;
  test_support::for_each_combination([&]<class S, class P, class O>() {
    const std::string combination = test_support::combination_name<S, P, O>();
    CAPTURE(combination);
    std::vector<HostDevice> devices(4);
    std::vector<HostDevice*> ptrs;
    for (auto& d : devices) ptrs.push_back(&d);
    const auto direct = test_support::train_on_devices<S, P, O>(ptrs, config, [](ThreadComm& c, HostDevice&, auto&& body) { body(c); });
    const auto staged = test_support::train_on_devices<S, P, O>(ptrs, config, [](ThreadComm& c, HostDevice& d, auto&& body) {
      Staged s(c, d);
      body(s);
    });
    CHECK(test_support::bitwise_equal(direct.params, staged.params));
    CHECK(direct.losses == staged.losses);
    // The training is real: the loss falls and the parameters moved.
    CHECK(direct.losses.back() < direct.losses.front());
    CHECK(direct.skipped_steps == 0);
    // Staging buffers are the communicator's own: the Device's accounting is unchanged.
    CHECK(direct.device_space.peak_bytes == staged.device_space.peak_bytes);
    CHECK(direct.host_space.peak_bytes == staged.host_space.peak_bytes);
    CHECK(direct.device_space.allocations == staged.device_space.allocations);
    // Offload moves exactly the parameter and gradient shards out of device space (runs
    // come without offload first, then with). NoShard without offload keeps its
    // parameters in the shard itself, so it is not a plain move there.
    if constexpr (!O::offload) {
      peak_without_offload = direct.device_space.peak_bytes;
      CHECK(direct.host_space.peak_bytes == 0);
    } else if constexpr (S::shards_parameters) {
      CHECK(direct.host_space.peak_bytes > 0);
      CHECK(direct.device_space.peak_bytes + direct.host_space.peak_bytes == peak_without_offload);
    }
  });
}

}  // namespace core_staged_communicator_test
