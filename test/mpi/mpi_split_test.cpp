// MpiComm::split (MPI_Comm_split) and a DeviceMesh built over MpiComm: group sizes, rank
// order by (key, rank), collectives that stay inside each group, and a negative color that
// fails on every rank alike instead of leaving the others waiting.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "test/mpi/mpi_test_support.hpp"

namespace {

using fsdp::DType;
using fsdp::ReduceOp;

// Sum of the world ranks of a group's members, over the group.
std::int64_t sum_of_world_ranks(fsdp::MpiComm& group) {
  std::int64_t v = test_mpi::session().world_rank();
  group.all_reduce(&v, &v, 1, DType::i64, ReduceOp::sum).wait();
  return v;
}

TEST_CASE("split: color picks the group, key orders it, collectives stay inside it") {
  auto world = test_mpi::world();
  const int n = world.size(), me = world.rank();
  // Even and odd ranks, each group in descending world rank (key = -rank).
  auto parity = world.split(me % 2, -me);
  int size = 0, rank = 0;
  std::int64_t sum = 0;
  for (int r = 0; r < n; ++r) {
    if (r % 2 != me % 2) continue;
    ++size;
    sum += r;
    if (r > me) ++rank;
  }
  CHECK(parity.size() == size);
  CHECK(parity.rank() == rank);
  CHECK(sum_of_world_ranks(parity) == sum);
  CHECK(parity.name() == "world/split#0(color " + std::to_string(me % 2) + ")");

  // Same color everywhere, equal keys: the parent's order. A split of a split works too.
  auto copy = world.split(7, 0);
  CHECK(copy.size() == n);
  CHECK(copy.rank() == me);
  CHECK(copy.name() == "world/split#1(color 7)");
  auto alone = copy.split(me, 0);
  CHECK(alone.size() == 1);
  CHECK(sum_of_world_ranks(alone) == me);
}

TEST_CASE("split: a negative color on one rank fails on every rank, naming that rank") {
  auto world = test_mpi::world();
  const int last = world.size() - 1;
  const std::string error = test_mpi::error_of([&] { world.split(world.rank() == last ? -1 : 0, 0); });
  CHECK(test_mpi::contains(error, "rank " + std::to_string(world.rank()) + " of MPI communicator 'world'"));
  CHECK(test_mpi::contains(error, "MpiComm::split color must be >= 0, but rank " + std::to_string(last)));
  CHECK(test_mpi::contains(error, "passed color -1"));
  // Refused before MPI_Comm_split: the communicator is intact and still in step.
  CHECK_FALSE(world.broken());
  auto again = world.split(0, 0);
  CHECK(again.size() == world.size());
  CHECK_FALSE(test_mpi::session().failed());
}

TEST_CASE("DeviceMesh over MpiComm: every replicate x shard shape of the world") {
  auto world = test_mpi::world();
  const int n = world.size(), me = world.rank();
  for (int shard = 1; shard <= n; ++shard) {
    if (n % shard) continue;
    const int replicate = n / shard;
    fsdp::DeviceMesh<fsdp::MpiComm> mesh(world, {replicate, shard});
    CAPTURE(replicate);
    CAPTURE(shard);
    // Shard group g: ranks [g*shard, (g+1)*shard); replicate group j: ranks j, j+shard, ...
    CHECK(mesh.shard_group().size() == shard);
    CHECK(mesh.shard_group().rank() == me % shard);
    CHECK(mesh.replicate_group().size() == replicate);
    CHECK(mesh.replicate_group().rank() == me / shard);
    const int g = me / shard, j = me % shard;
    std::int64_t shard_sum = 0, replicate_sum = 0;
    for (int i = 0; i < shard; ++i) shard_sum += g * shard + i;
    for (int i = 0; i < replicate; ++i) replicate_sum += j + i * shard;
    CHECK(sum_of_world_ranks(mesh.shard_group()) == shard_sum);
    CHECK(sum_of_world_ranks(mesh.replicate_group()) == replicate_sum);
  }
  // Ranks that disagree on the shape are told so (by DeviceMesh, over MpiComm's all_gather).
  if (n >= 2) {
    const fsdp::MeshShape shape = world.rank() == 0 ? fsdp::MeshShape{1, n} : fsdp::MeshShape{n, 1};
    const std::string error = test_mpi::error_of([&] { fsdp::DeviceMesh<fsdp::MpiComm> mesh(world, shape); });
    CHECK(test_mpi::contains(error, "ranks disagree on the shape"));
  }
}

}  // namespace
