#pragma once
// DeviceMesh: the world's ranks arranged as replicate x shard (FSDP2's HSDP mesh shape).
// Shard group g holds the neighbouring ranks [g*shard, (g+1)*shard) — one node, typically,
// where all-gathers are cheap; replicate group j holds the ranks {j, j+shard, ...} that own
// the same shard. Built from any communicator that can split itself (MPI_Comm_split,
// ncclCommSplit; ThreadComm::split on the thread backend).
//
// A shape is two numbers a user types (--mesh 2x4), so its product is checked: a shape
// whose ranks do not fit in an int is refused, never wrapped around to a small world that
// happens to match (5002x858650 is 4294967300 ranks, not 4).
#include <array>
#include <cctype>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"

namespace fsdp {

template <class C>
concept SplittableCommunicator = Communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> Communicator;
};

struct MeshShape {
  int replicate = 1;
  int shard = 1;
  // The number of ranks, replicate x shard; an fsdp::Error when that overflows an int.
  int size() const { return detail::checked_product(replicate, shard, "mesh shape " + str() + ": its number of ranks"); }
  // The same in 64 bits, which two ints cannot overflow: for messages and comparisons.
  std::int64_t ranks() const { return std::int64_t{replicate} * shard; }
  friend bool operator==(const MeshShape&, const MeshShape&) = default;
  std::string str() const { return std::to_string(replicate) + "x" + std::to_string(shard); }
};

// "2x3" (or "2X3", "2*3") -> {replicate 2, shard 3}: two positive decimal numbers whose
// product fits in an int. `what` names the input in an error (a flag, a variable).
inline MeshShape parse_mesh_shape(std::string_view text, std::string_view what = "mesh shape") {
  const std::size_t sep = text.find_first_of("xX*");
  auto digits = [](std::string_view part) {
    bool positive = false;
    for (char c : part) {
      if (!std::isdigit(static_cast<unsigned char>(c))) return false;
      positive = positive || c != '0';
    }
    return positive;
  };
  if (sep == std::string_view::npos || !digits(text.substr(0, sep)) || !digits(text.substr(sep + 1)))
    detail::fail(what, " '", text, "' is not of the form REPLICATExSHARD with positive numbers, e.g. 2x4");
  const std::string where = std::string(what) + " '" + std::string(text) + "'";
  const int most = std::numeric_limits<int>::max();
  MeshShape m{detail::parse_integer<int>(text.substr(0, sep), where + ": REPLICATE", 1, most),
              detail::parse_integer<int>(text.substr(sep + 1), where + ": SHARD", 1, most)};
  if (m.ranks() > most)
    detail::fail(where, ": ", m.replicate, " x ", m.shard, " = ", m.ranks(), " ranks, more than an int counts (", most, ")");
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
    if (shape.replicate < 1 || shape.shard < 1 || shape.ranks() != n)  // in 64 bits: a product that overflows int is no match
      detail::fail("device mesh on rank ", rank, ": shape ", shape.str(), " (replicate x shard) needs ",
                   shape.ranks(), " ranks but the communicator has ", n);
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
