// CountingCommunicator counts what passes through it and changes nothing.
#include <doctest/doctest.h>

#include <fsdp/fsdp.hpp>
#include <fsdp/testing/counting_communicator.hpp>

namespace core_counting_communicator_test {

TEST_CASE("calls and bytes per collective, results unchanged, split groups counted apart") {
  fsdp::ThreadGroup(4).run([](fsdp::ThreadComm& comm) {
    fsdp::CountingCommunicator counted(comm);
    std::vector<float> shard(3, float(comm.rank())), full(12);
    counted.all_gather(shard.data(), full.data(), 3, fsdp::DType::f32).wait();
    for (int i = 0; i < 12; ++i) CHECK(full[i] == float(i / 3));
    counted.reduce_scatter(full.data(), shard.data(), 3, fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
    CHECK(shard[0] == 4.0f * float(comm.rank()));
    double x = 1, y = 0;
    counted.all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
    CHECK(y == 4.0);
    counted.broadcast(&x, &y, 1, fsdp::DType::f64, 0).wait();
    counted.barrier().wait();
    using fsdp::Collective;
    const auto& c = counted.counts();
    CHECK(c[Collective::all_gather].calls == 1);
    CHECK(c[Collective::all_gather].bytes == 12 * 4);  // the gathered (full) side
    CHECK(c[Collective::reduce_scatter].bytes == 12 * 4);
    CHECK(c[Collective::all_reduce].bytes == 8);
    CHECK(c[Collective::broadcast].calls == 1);
    CHECK(c[Collective::barrier].calls == 1);

    auto half = counted.split(comm.rank() / 2, comm.rank());
    CHECK(half.size() == 2);
    half.all_reduce(&x, &y, 1, fsdp::DType::f64, fsdp::ReduceOp::sum).wait();
    CHECK(y == 2.0);
    CHECK(half.counts()[Collective::all_reduce].calls == 1);
    // The group's traffic is the group's alone; split's own color exchange runs inside the
    // wrapped communicator (setup, not training traffic) and is not counted either.
    CHECK(counted.counts()[Collective::all_reduce].calls == 1);
    CHECK(counted.counts()[Collective::all_gather].calls == 1);
    counted.reset();
    CHECK(counted.counts() == fsdp::CollectiveCounts{});
  });
}

}  // namespace core_counting_communicator_test
