// DeviceMesh: shape parsing, the groups it builds, and every way to get it wrong.
#include <doctest/doctest.h>

#include <fsdp/fsdp.hpp>

#include <set>

namespace core_device_mesh_test {

TEST_CASE("mesh shapes parse as REPLICATExSHARD") {
  CHECK(fsdp::parse_mesh_shape("2x3") == fsdp::MeshShape{2, 3});
  CHECK(fsdp::parse_mesh_shape("1X8") == fsdp::MeshShape{1, 8});
  CHECK(fsdp::parse_mesh_shape("4*2") == fsdp::MeshShape{4, 2});
  for (const char* bad : {"", "2", "x3", "2x", "0x4", "2x3x1", "-1x2", "2 x 3", "axb"})
    CHECK_THROWS_WITH_AS(fsdp::parse_mesh_shape(bad), doctest::Contains("is not of the form REPLICATExSHARD"), fsdp::Error);
}

TEST_CASE("shard groups are neighbouring ranks, replicate groups hold the same shard index") {
  for (fsdp::MeshShape shape : {fsdp::MeshShape{2, 2}, fsdp::MeshShape{3, 2}, fsdp::MeshShape{2, 3}, fsdp::MeshShape{1, 4},
                                fsdp::MeshShape{4, 1}}) {
    CAPTURE(shape.str());
    const int n = shape.size();
    std::vector<std::vector<int>> shard_members(n), replicate_members(n);
    fsdp::ThreadGroup(n).run([&](fsdp::ThreadComm& comm) {
      fsdp::DeviceMesh mesh(comm, shape);
      auto gather_world_ranks = [&](fsdp::ThreadComm& g) {
        std::vector<int> out(static_cast<std::size_t>(g.size()));
        int me = comm.rank();
        g.all_gather(&me, out.data(), 1, fsdp::DType::i32).wait();
        return out;
      };
      CHECK(mesh.shard_group().size() == shape.shard);
      CHECK(mesh.replicate_group().size() == shape.replicate);
      shard_members[comm.rank()] = gather_world_ranks(mesh.shard_group());
      replicate_members[comm.rank()] = gather_world_ranks(mesh.replicate_group());
    });
    for (int r = 0; r < n; ++r) {
      std::vector<int> want_shard, want_replicate;
      for (int k = 0; k < shape.shard; ++k) want_shard.push_back(r / shape.shard * shape.shard + k);
      for (int k = 0; k < shape.replicate; ++k) want_replicate.push_back(r % shape.shard + k * shape.shard);
      CHECK(shard_members[r] == want_shard);
      CHECK(replicate_members[r] == want_replicate);
    }
  }
}

TEST_CASE("ranks that ask for different shapes all fail, naming both shapes") {
  std::vector<std::string> msgs(4);
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    try {
      fsdp::DeviceMesh mesh(comm, comm.rank() == 3 ? fsdp::MeshShape{1, 4} : fsdp::MeshShape{2, 2});
    } catch (const fsdp::Error& e) {
      msgs[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) CHECK(msgs[r].find("rank 3 asked for 1x4, rank " + std::to_string(r) + " for 2x2") != std::string::npos);
  CHECK(msgs[3].find("rank 0 asked for 2x2, rank 3 for 1x4") != std::string::npos);
}

TEST_CASE("a failure inside a split group reaches the ranks waiting in another group") {
  // Rank 0 throws; rank 1 shares its shard group, ranks 2 and 3 wait in their own shard
  // group's collective for rank 2's partner... every rank must return, with rank 0's error.
  std::vector<std::string> msgs(4);
  fsdp::ThreadGroup group(4, fsdp::ThreadGroupOptions{std::chrono::milliseconds(5000)});
  CHECK_THROWS_WITH_AS(group.run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{2, 2});
    if (comm.rank() == 0) throw std::runtime_error("boom on rank 0");
    try {
      int x = 1, y = 0;
      mesh.replicate_group().all_reduce(&x, &y, 1, fsdp::DType::i32, fsdp::ReduceOp::sum).wait();  // waits for rank 0 (or 1)
      mesh.shard_group().all_reduce(&x, &y, 1, fsdp::DType::i32, fsdp::ReduceOp::sum).wait();
    } catch (const fsdp::Error& e) {
      msgs[comm.rank()] = e.what();
    }
  }), "boom on rank 0", std::runtime_error);
  CHECK(msgs[2].find("rank 0 failed: boom on rank 0") != std::string::npos);  // its replica partner was rank 0
}

}  // namespace core_device_mesh_test
