#pragma once
// DeviceMesh: the world's ranks arranged as replicate x shard (FSDP2's HSDP mesh shape).
// Shard group g holds the neighbouring ranks [g*shard, (g+1)*shard) — one node, typically,
// where all-gathers are cheap; replicate group j holds the ranks {j, j+shard, ...} that own
// the same shard. Built from any communicator that can split itself (MPI_Comm_split,
// ncclCommSplit; ThreadComm::split on the thread backend).
#include <array>
#include <cctype>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

template <class C>
concept SplittableCommunicator = Communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> Communicator;
};

struct MeshShape {
  int replicate = 1;
  int shard = 1;
  int size() const { return replicate * shard; }
  friend bool operator==(const MeshShape&, const MeshShape&) = default;
  std::string str() const { return std::to_string(replicate) + "x" + std::to_string(shard); }
};

// "2x3" (or "2X3", "2*3") -> {replicate 2, shard 3}.
inline MeshShape parse_mesh_shape(std::string_view text) {
  MeshShape m{0, 0};
  std::size_t i = 0;
  auto number = [&](int& out) {
    std::size_t start = i;
    long v = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) && v < 1000000) v = v * 10 + (text[i++] - '0');
    out = static_cast<int>(v);
    return i > start && v > 0;
  };
  const bool ok = number(m.replicate) && i < text.size() && (text[i] == 'x' || text[i] == 'X' || text[i] == '*') &&
                  (++i, number(m.shard)) && i == text.size();
  if (!ok)
    detail::fail("mesh shape '", text, "' is not of the form REPLICATExSHARD with positive numbers, e.g. 2x4");
  return m;
}

template <SplittableCommunicator C>
class DeviceMesh {
 public:
  using group_type = decltype(std::declval<C&>().split(0, 0));

  // Collective over `world`: every rank must pass the same shape.
  DeviceMesh(C& world, MeshShape shape) : world_(&world), shape_(shape) {
    const int rank = world.rank();
    const int n = world.size();
    std::array<std::int32_t, 2> mine{shape.replicate, shape.shard};
    std::vector<std::int32_t> all(2 * static_cast<std::size_t>(n));
    world.all_gather(mine.data(), all.data(), 2, DType::i32).wait();
    for (int r = 0; r < n; ++r)
      if (all[2 * r] != mine[0] || all[2 * r + 1] != mine[1])
        detail::fail_as(ErrorKind::mismatch, "device mesh on rank ", rank, ": ranks disagree on the shape: rank ", r,
                        " asked for ", all[2 * r], "x", all[2 * r + 1], ", rank ", rank, " for ", shape.str());
    if (shape.replicate < 1 || shape.shard < 1 || shape.size() != n)
      detail::fail("device mesh on rank ", rank, ": shape ", shape.str(), " (replicate x shard) needs ",
                   shape.size(), " ranks but the communicator has ", n);
    shard_ = std::make_unique<group_type>(world.split(rank / shape.shard, rank));
    replicate_ = std::make_unique<group_type>(world.split(rank % shape.shard, rank));
  }

  C& world() { return *world_; }
  group_type& shard_group() { return *shard_; }
  group_type& replicate_group() { return *replicate_; }
  MeshShape shape() const { return shape_; }

 private:
  C* world_;
  MeshShape shape_;
  std::unique_ptr<group_type> shard_, replicate_;
};

}  // namespace fsdp
