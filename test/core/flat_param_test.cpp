// fsdp/core/flat_param.hpp: how a unit's parameters are laid out back to back and split
// into equal per-rank shards, padded at the end only (ShardLayout::element_flat, the default;
// block_aligned: test/core/shard_layout_test.cpp).
#include <doctest/doctest.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/flat_param.hpp"

namespace core_flat_param_test {

namespace {

using fsdp::DType;
using fsdp::FlatParamLayout;
using fsdp::ParamInfo;

// Parameters with the given element counts; offsets are deliberately garbage so the
// layout has to compute them.
std::vector<ParamInfo> make_params(const std::vector<std::int64_t>& numels) {
  std::vector<ParamInfo> ps;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    ParamInfo p;
    p.fqn = "layer." + std::to_string(i) + ".weight";
    p.shape = {numels[i]};
    p.numel = numels[i];
    p.offset = -12345;
    ps.push_back(std::move(p));
  }
  return ps;
}

// Checks every documented property of the layout of `numels` over `world` ranks.
void check_layout(const std::vector<std::int64_t>& numels, int world, DType dtype = DType::f32) {
  CAPTURE(world);
  CAPTURE(numels.size());
  const FlatParamLayout L(dtype, make_params(numels), world);

  // Metadata passes through.
  CHECK(L.dtype() == dtype);
  CHECK(L.world() == world);
  REQUIRE(L.params().size() == numels.size());

  // Offsets are back to back, in order.
  std::int64_t total = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    CAPTURE(i);
    CHECK(L.params()[i].offset == total);
    CHECK(L.params()[i].numel == numels[i]);
    CHECK(L.params()[i].fqn == "layer." + std::to_string(i) + ".weight");
    total += numels[i];
  }
  CHECK(L.numel() == total);

  // padded_numel: the smallest multiple of world that is >= numel.
  std::int64_t smallest = 0;
  while (smallest < total) smallest += world;
  CHECK(L.padded_numel() == smallest);
  CHECK(L.shard_numel() * world == L.padded_numel());
  CHECK(L.shard_bytes() == static_cast<std::size_t>(L.shard_numel()) * fsdp::size_of(dtype));
  CHECK(L.padded_bytes() == static_cast<std::size_t>(L.padded_numel()) * fsdp::size_of(dtype));

  const std::int64_t S = L.shard_numel();

  // valid_shard_numel: how many of rank r's elements [r*S, (r+1)*S) are real, counted one
  // by one; they must be a prefix of the shard.
  std::int64_t valid_sum = 0;
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    std::int64_t real = 0, first_pad = -1;
    for (std::int64_t k = 0; k < S; ++k) {
      if (r * S + k < total) {
        ++real;
        CHECK(first_pad == -1);  // no real element after padding
      } else if (first_pad == -1) {
        first_pad = k;
      }
    }
    CHECK(L.valid_shard_numel(r) == real);
    valid_sum += L.valid_shard_numel(r);
  }
  CHECK(valid_sum == total);

  // slice(i, r) over all (param, rank) pairs covers every element of every parameter
  // exactly once, at the place in rank r's shard where the flat layout puts it.
  std::vector<int> flat_cover(static_cast<std::size_t>(L.padded_numel()), 0);
  for (std::size_t i = 0; i < numels.size(); ++i) {
    CAPTURE(i);
    std::vector<int> param_cover(static_cast<std::size_t>(numels[i]), 0);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const fsdp::ShardSlice s = L.slice(i, r);
      CHECK(s.count >= 0);
      if (numels[i] == 0) CHECK(s.count == 0);
      if (s.count == 0) continue;
      CHECK(s.param_begin >= 0);
      CHECK(s.param_begin + s.count <= numels[i]);
      CHECK(s.shard_offset >= 0);
      CHECK(s.shard_offset + s.count <= L.valid_shard_numel(r));  // never into padding
      // Same element seen from the parameter and from the shard.
      CHECK(L.params()[i].offset + s.param_begin == r * S + s.shard_offset);
      const bool in_bounds = s.param_begin >= 0 && s.param_begin + s.count <= numels[i] &&
                             s.shard_offset >= 0 && s.shard_offset + s.count <= S;
      if (!in_bounds) continue;  // already reported; don't index out of range
      for (std::int64_t k = 0; k < s.count; ++k) {
        ++param_cover[static_cast<std::size_t>(s.param_begin + k)];
        ++flat_cover[static_cast<std::size_t>(r * S + s.shard_offset + k)];
      }
    }
    for (std::size_t e = 0; e < param_cover.size(); ++e)
      if (param_cover[e] != 1) { INFO("param element " << e); CHECK(param_cover[e] == 1); break; }
  }
  for (std::size_t g = 0; g < flat_cover.size(); ++g) {
    const int want = static_cast<std::int64_t>(g) < total ? 1 : 0;  // padding belongs to nobody
    if (flat_cover[g] != want) { INFO("flat element " << g); CHECK(flat_cover[g] == want); break; }
  }
}

}  // namespace

TEST_CASE("a small layout worked out by hand") {
  // Two parameters of 3 and 5 elements over 3 ranks: 8 elements, padded to 9, shards of 3.
  //   rank 0: a[0..3)        rank 1: b[0..3)        rank 2: b[3..5) + 1 padding
  const FlatParamLayout L(DType::bf16, make_params({3, 5}), 3);
  CHECK(L.numel() == 8);
  CHECK(L.padded_numel() == 9);
  CHECK(L.shard_numel() == 3);
  CHECK(L.shard_bytes() == 6);
  CHECK(L.padded_bytes() == 18);
  CHECK(L.params()[1].offset == 3);
  CHECK(L.valid_shard_numel(0) == 3);
  CHECK(L.valid_shard_numel(1) == 3);
  CHECK(L.valid_shard_numel(2) == 2);

  auto s = L.slice(0, 0);
  CHECK((s.param_begin == 0 && s.count == 3 && s.shard_offset == 0));
  CHECK(L.slice(0, 1).count == 0);
  CHECK(L.slice(0, 2).count == 0);
  CHECK(L.slice(1, 0).count == 0);
  s = L.slice(1, 1);
  CHECK((s.param_begin == 0 && s.count == 3 && s.shard_offset == 0));
  s = L.slice(1, 2);
  CHECK((s.param_begin == 3 && s.count == 2 && s.shard_offset == 0));
}

TEST_CASE("a parameter straddling several shards") {
  // 2 + 10 + 1 = 13 elements over 4 ranks: S = 4, padded 16.
  const FlatParamLayout L(DType::f32, make_params({2, 10, 1}), 4);
  CHECK(L.shard_numel() == 4);
  const auto s0 = L.slice(1, 0), s1 = L.slice(1, 1), s2 = L.slice(1, 2), s3 = L.slice(1, 3);
  CHECK((s0.param_begin == 0 && s0.count == 2 && s0.shard_offset == 2));
  CHECK((s1.param_begin == 2 && s1.count == 4 && s1.shard_offset == 0));
  CHECK((s2.param_begin == 6 && s2.count == 4 && s2.shard_offset == 0));
  CHECK(s3.count == 0);
  const auto last = L.slice(2, 3);
  CHECK((last.param_begin == 0 && last.count == 1 && last.shard_offset == 0));
  CHECK(L.valid_shard_numel(3) == 1);
}

TEST_CASE("layout invariants over world sizes 1..9 and many parameter lists") {
  const std::vector<std::vector<std::int64_t>> lists = {
      {},                       // no parameters at all
      {0},                      // only an empty parameter
      {0, 0, 0},
      {1},
      {5},
      {7},                      // world > numel for most worlds
      {1, 1, 1},
      {3, 0, 4},                // zero-size parameter in the middle
      {0, 6},
      {6, 0},
      {9, 9},
      {7, 1, 0, 12, 3},
      {100},
      {17, 33, 2, 0, 64, 5},
      {2520},                   // divisible by every world size 1..9
      {1000, 1, 1, 1},
  };
  for (const auto& numels : lists)
    for (int world = 1; world <= 9; ++world) check_layout(numels, world);
}

TEST_CASE("layout invariants on random parameter lists") {
  std::mt19937 rng(2024);
  std::uniform_int_distribution<int> count(0, 12), world_dist(1, 9), kind(0, 3);
  std::uniform_int_distribution<std::int64_t> small(1, 5), big(6, 300);
  for (int iter = 0; iter < 200; ++iter) {
    std::vector<std::int64_t> numels(static_cast<std::size_t>(count(rng)));
    for (auto& n : numels) {
      const int k = kind(rng);
      n = k == 0 ? 0 : k == 1 ? small(rng) : big(rng);
    }
    check_layout(numels, world_dist(rng), iter % 2 ? DType::bf16 : DType::f64);
  }
}

TEST_CASE("zero elements in total") {
  for (int world = 1; world <= 9; ++world) {
    const FlatParamLayout L(DType::f32, make_params({0, 0}), world);
    CHECK(L.numel() == 0);
    CHECK(L.padded_numel() == 0);
    CHECK(L.shard_numel() == 0);
    CHECK(L.shard_bytes() == 0);
    for (int r = 0; r < world; ++r) {
      CHECK(L.valid_shard_numel(r) == 0);
      CHECK(L.slice(0, r).count == 0);
      CHECK(L.slice(1, r).count == 0);
    }
  }
}

TEST_CASE("counts beyond 32 bits") {
  const std::int64_t big = std::int64_t{3} << 32;  // 12 Gi elements
  const int world = 7;
  const FlatParamLayout L(DType::bf16, make_params({big, 5, big}), world);
  const std::int64_t total = 2 * big + 5;
  CHECK(L.numel() == total);
  CHECK(L.padded_numel() % world == 0);
  CHECK(L.padded_numel() >= total);
  CHECK(L.padded_numel() - world < total);
  CHECK(L.params()[2].offset == big + 5);
  CHECK(L.shard_bytes() == static_cast<std::size_t>(L.shard_numel()) * 2);
  std::int64_t valid = 0, covered0 = 0, covered2 = 0;
  for (int r = 0; r < world; ++r) {
    valid += L.valid_shard_numel(r);
    covered0 += L.slice(0, r).count;
    covered2 += L.slice(2, r).count;
  }
  CHECK(valid == total);
  CHECK(covered0 == big);
  CHECK(covered2 == big);
}

TEST_CASE("invalid arguments") {
  CHECK_THROWS_AS(FlatParamLayout(DType::f32, make_params({4}), 0), fsdp::Error);
  CHECK_THROWS_AS(FlatParamLayout(DType::f32, make_params({4}), -3), fsdp::Error);
  const FlatParamLayout L(DType::f32, make_params({4}), 2);
  CHECK_THROWS(L.slice(1, 0));  // no parameter 1
}

}  // namespace core_flat_param_test
