// ShardOptions::shard_layout (fsdp/core/flat_param.hpp): block_aligned(K) starts every
// parameter on a multiple of K elements and cuts shards on multiples of K, so no K-element
// block of a parameter is split between ranks. The layout worked out by hand and checked on
// many parameter lists; training bit for bit as under element_flat; a block format's scales
// each covering one parameter; checkpoints across layouts and world sizes; the
// configuration reporting it; and what is refused.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "test/support/quantize_reference.hpp"
#include "test/support/reference_training.hpp"

namespace core_shard_layout_test {

namespace {

using fsdp::DType;
using fsdp::FlatParamLayout;
using fsdp::ShardLayout;
using test_support::max_difference;
using test_support::Params;

std::vector<fsdp::ParamInfo> make_params(const std::vector<std::int64_t>& numels) {
  std::vector<fsdp::ParamInfo> ps;
  for (std::size_t i = 0; i < numels.size(); ++i)
    ps.push_back({.fqn = "p" + std::to_string(i), .shape = {numels[i]}, .numel = numels[i], .offset = -1, .aliases = {}});
  return ps;
}

// Every promise of block_aligned(K), element by element: parameters start on multiples of
// K, in order, with gaps below K; the shard is the smallest multiple of K that holds a
// world's share; every slice starts and ends on a multiple of K of its parameter (or at its
// end); every parameter element lies in exactly one shard, where its offset says; what
// valid_shard_numel counts reaches exactly to the rank's last real element.
void check_block_layout(const std::vector<std::int64_t>& numels, int world, std::int64_t k) {
  CAPTURE(world);
  CAPTURE(k);
  CAPTURE(numels.size());
  const FlatParamLayout L(DType::f32, make_params(numels), world, ShardLayout::block_aligned(k));
  CHECK(L.layout() == ShardLayout::block_aligned(k));
  std::int64_t end = 0, sum = 0;
  std::vector<int> owner;  // per flat element: the parameter's index, or -1 for padding
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const auto& p = L.params()[i];
    CAPTURE(i);
    CHECK(p.offset % k == 0);
    CHECK(p.offset >= end);
    CHECK(p.offset - end < k);
    owner.resize(static_cast<std::size_t>(p.offset), -1);
    owner.resize(static_cast<std::size_t>(p.offset + p.numel), static_cast<int>(i));
    end = p.offset + p.numel;
    sum += p.numel;
  }
  CHECK(L.numel() == end);
  CHECK(L.param_numel() == sum);
  const std::int64_t share = (end + world - 1) / world;
  const std::int64_t S = L.shard_numel();
  CHECK(S % k == 0);
  CHECK(S >= share);
  CHECK(S - share < k);
  CHECK(L.padded_numel() == S * world);
  owner.resize(static_cast<std::size_t>(L.padded_numel()), -1);
  for (int r = 0; r < world; ++r) {
    std::int64_t last = -1;
    for (std::int64_t e = 0; e < S; ++e)
      if (owner[static_cast<std::size_t>(r * S + e)] >= 0) last = e;
    CHECK(L.valid_shard_numel(r) == last + 1);
  }
  for (std::size_t i = 0; i < numels.size(); ++i) {
    std::int64_t covered = 0;
    for (int r = 0; r < world; ++r) {
      const fsdp::ShardSlice s = L.slice(i, r);
      if (s.count == 0) continue;
      CHECK(s.param_begin % k == 0);
      CHECK(((s.param_begin + s.count) % k == 0 || s.param_begin + s.count == numels[i]));
      CHECK(s.param_begin == covered);  // ranks hold a parameter's slices in order, without gaps
      for (std::int64_t e = 0; e < s.count; ++e)
        if (owner[static_cast<std::size_t>(r * S + s.shard_offset + e)] != static_cast<int>(i)) {
          FAIL_CHECK("element " << s.param_begin + e << " of parameter " << i << " is not where rank " << r << "'s slice says");
          break;
        }
      covered += s.count;
    }
    CHECK(covered == numels[i]);
  }
}

constexpr int kGlobalBatch = 12;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

// AdamW steps [first, last) on `world` ranks (a {1, world} mesh, or `mesh`) with `options`,
// after `before` (a load); then `after` (a save). Returns rank 0's full parameters.
using Hook = test_support::AdamwHook;
template <class... Ps>
Params train(int world, int first, int last, const fsdp::ShardOptions& options, std::uint64_t seed = 1,
             const Hook& before = {}, const Hook& after = {}, fsdp::MeshShape mesh = {}) {
  auto c = config();
  c.seed = seed;
  return test_support::adamw_run<Ps...>(c, {.world = world, .first = first, .last = last, .global_batch = kGlobalBatch,
                                            .options = options, .before = before, .after = after, .mesh = mesh});
}

fsdp::ShardOptions aligned(std::int64_t k) { return {.shard_layout = ShardLayout::block_aligned(k)}; }

}  // namespace

TEST_CASE("a block-aligned layout worked out by hand") {
  // Parameters of 10, 3 and 20 elements, blocks of 8, 2 ranks: they start at 0, 16 and 24
  // and end at 44; a rank's share is 22, rounded up to 24; 48 elements in all.
  const FlatParamLayout L(DType::f32, make_params({10, 3, 20}), 2, ShardLayout::block_aligned(8));
  CHECK(L.params()[0].offset == 0);
  CHECK(L.params()[1].offset == 16);
  CHECK(L.params()[2].offset == 24);
  CHECK(L.numel() == 44);
  CHECK(L.param_numel() == 33);
  CHECK(L.shard_numel() == 24);
  CHECK(L.padded_numel() == 48);
  CHECK(L.valid_shard_numel(0) == 19);  // up to the second parameter's end; the rest of rank 0 is padding
  CHECK(L.valid_shard_numel(1) == 20);
  const fsdp::ShardSlice p2 = L.slice(2, 1);  // the third parameter lies whole on rank 1, at its start
  CHECK((p2.param_begin == 0 && p2.count == 20 && p2.shard_offset == 0));
  CHECK(L.slice(2, 0).count == 0);
  // The same list element-flat: back to back, 33 elements, shards of 17.
  const FlatParamLayout F(DType::f32, make_params({10, 3, 20}), 2);
  CHECK(F.params()[2].offset == 13);
  CHECK(F.shard_numel() == 17);
  CHECK(F.slice(2, 0).count == 4);  // the third parameter is cut at its 4th element
}

TEST_CASE("block-aligned layouts keep every promise over world sizes, blocks and parameter lists") {
  std::mt19937_64 rng(20261201);
  std::uniform_int_distribution<int> count(0, 7);
  std::uniform_int_distribution<std::int64_t> size(0, 300);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<std::int64_t> numels(static_cast<std::size_t>(count(rng)));
    for (auto& n : numels) n = size(rng);
    for (int world : {1, 2, 3, 4, 7})
      for (std::int64_t k : {1, 2, 8, 32, 128}) check_block_layout(numels, world, k);
  }
  // block_aligned(1) is element_flat's layout exactly.
  const FlatParamLayout one(DType::f32, make_params({5, 7, 9}), 4, ShardLayout::block_aligned(1));
  const FlatParamLayout flat(DType::f32, make_params({5, 7, 9}), 4);
  CHECK(one.padded_numel() == flat.padded_numel());
  for (std::size_t i = 0; i < 3; ++i) CHECK(one.params()[i].offset == flat.params()[i].offset);
}

TEST_CASE("--shard-layout's spelling: flat or block:K, strictly; a layout that means nothing is refused") {
  CHECK(fsdp::parse_shard_layout("flat") == ShardLayout::element_flat());
  CHECK(fsdp::parse_shard_layout("block:128") == ShardLayout::block_aligned(128));
  CHECK(fsdp::name_of(fsdp::parse_shard_layout("block:32")) == "block:32");
  CHECK(fsdp::name_of(ShardLayout::element_flat()) == "flat");
  for (const char* bad : {"", "Flat", "block", "block:", "block:0", "block:-8", "block:2abc", "block: 8", "block:16777217"})
    CHECK_THROWS_WITH_AS(fsdp::parse_shard_layout(bad, "--shard-layout"), doctest::Contains("--shard-layout"), fsdp::Error);
  CHECK(fsdp::parse_shard_layout("block:16777216").block == ShardLayout::max_block);
  CHECK_THROWS_WITH_AS(FlatParamLayout(DType::f32, make_params({4}), 2, ShardLayout{ShardLayout::Kind::block_aligned, 0}),
                       doctest::Contains("the block must be in [1, 16777216]"), fsdp::Error);
  CHECK_THROWS_WITH_AS(FlatParamLayout(DType::f32, make_params({4}), 2, ShardLayout{ShardLayout::Kind::element_flat, 8}),
                       doctest::Contains("block_aligned(8)"), fsdp::Error);
  // From ShardOptions: named with the unit and the rank, before anything is allocated.
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    CHECK_THROWS_WITH_AS(fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, aligned(-4)),
                         doctest::Contains("on rank 0: ShardOptions::shard_layout: the block must be in"), fsdp::Error);
    CHECK(device.stats().live_bytes == 0);
  });
}

TEST_CASE("ranks that choose different layouts are refused on every rank, naming the option") {
  std::vector<std::string> errors(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    try {
      fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, comm.rank() == 1 ? aligned(8) : fsdp::ShardOptions{});
    } catch (const fsdp::Error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("shard_layout") != std::string::npos);
  }
}

TEST_CASE("the shards a block-aligned model holds, and the configuration reporting the layout") {
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, aligned(8));
    // A block: fc1.weight 91, fc1.bias 7, fc2.weight 91, fc2.bias 13 start at 0, 96, 104 and
    // 200 and end at 213; a share of 71 rounds up to 72. Element-flat it would be 202 and 68.
    const auto& block = sm.unit("blocks.0").shards()[0];
    CHECK(block.padded_numel == 72);
    CHECK(block.numel == (comm.rank() < 2 ? 72 : 213 - 144));
    // The gain unit's 13 elements: shards of 8 on 3 ranks, the last rank holds none.
    CHECK(sm.unit("gain").shards()[0].padded_numel == 8);
    for (const auto& u : sm.config().units) {
      CHECK(u.shard_layout == ShardLayout::block_aligned(8));
      CHECK(fsdp::to_string(u).find(" shard_layout=block:8 ") != std::string::npos);
    }
    // Every parameter's slice on this rank starts on a multiple of 8 of the parameter.
    for (const auto& p : sm.parameters())
      if (p.count > 0) CHECK(p.param_begin % 8 == 0);
    engine::Model flat_model(config());
    auto flat = fsdp::shard<fsdp::FullShard>(flat_model, comm, device, engine::Wrap{});
    CHECK(flat.unit("blocks.0").shards()[0].padded_numel == 68);
    CHECK(fsdp::to_string(flat.config()).find("shard_layout") == std::string::npos);  // the default is not printed
  });
}

TEST_CASE("training is bit for bit the same as element-flat, whatever the strategy, prefetch, precision or offload") {
  const Params reference = test_support::reference_params(config(), 4, kGlobalBatch);
  const Params flat = train<fsdp::FullShard>(4, 0, 4, {});
  CHECK(max_difference(flat, reference) < 2e-5);
  CHECK(train<fsdp::FullShard>(4, 0, 4, aligned(8)) == flat);
  CHECK(train<fsdp::FullShard>(4, 0, 4, aligned(128)) == flat);  // most parameters whole on one rank
  CHECK(train<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>(3, 0, 4, aligned(16)) ==
        train<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>(3, 0, 4, {}));
  CHECK(train<fsdp::ShardGradOp, fsdp::OffloadParams>(2, 0, 4, aligned(32)) == train<fsdp::ShardGradOp, fsdp::OffloadParams>(2, 0, 4, {}));
  using M = fsdp::MixedPrecision<fsdp::bf16>;
  CHECK(train<fsdp::FullShard, M>(4, 0, 4, aligned(8)) == train<fsdp::FullShard, M>(4, 0, 4, {}));
  CHECK(train<fsdp::HybridShard>(4, 0, 4, aligned(8), 1, {}, {}, {2, 2}) == train<fsdp::HybridShard>(4, 0, 4, {}, 1, {}, {}, {2, 2}));
}

TEST_CASE("a block format's all-gather under block_aligned(K): every scale block covers one parameter") {
  // The engine sees each parameter quantized on its own, in blocks of 16 from its first
  // element, and back: what an engine holding codes and scales per parameter would compute.
  // Element-flat, blocks are cut from each shard's first element, and some straddle two
  // parameters or start inside one.
  const auto c = config();
  std::vector<int> per_parameter(2, -1), flat_per_parameter(2, -1);
  using Int8 = fsdp::CommPrecision<fsdp::Int8Blocks<16>, float>;
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    for (bool block_aligned : {true, false}) {
      engine::Model model(c);
      const engine::Model fresh(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, Int8>(model, comm, device, engine::Wrap{}, block_aligned ? aligned(16) : fsdp::ShardOptions{});
      auto scope = sm.unit("blocks.1").forward_scope();
      int equal = 0;
      const auto& mine = model.blocks[1];
      const auto& was = fresh.blocks[1];
      using Pair = std::pair<const engine::Tensor*, const engine::Tensor*>;
      for (auto [seen, master] : std::vector<Pair>{{&mine.fc1.weight, &was.fc1.weight}, {&mine.fc1.bias, &was.fc1.bias},
                                                   {&mine.fc2.weight, &was.fc2.weight}, {&mine.fc2.bias, &was.fc2.bias}}) {
        const std::vector<float> x(master->data(), master->data() + master->numel());
        const auto want = test_support::quantize_round_trip(fsdp::QuantFormat::int8_blocks, x, 16);
        equal += std::memcmp(seen->data(), want.data(), want.size() * sizeof(float)) == 0;
      }
      if (comm.rank() < 2) (block_aligned ? per_parameter : flat_per_parameter)[static_cast<std::size_t>(comm.rank())] = equal;
    }
  });
  CHECK(per_parameter == std::vector<int>{4, 4});
  CHECK(flat_per_parameter[0] < 4);  // else this test proves nothing about the layout
}

TEST_CASE("checkpoints load across layouts and world sizes, sharded and full") {
  const auto tmp = std::filesystem::temp_directory_path() / ("fsdp-shard-layout-" + std::to_string(::getpid()));
  std::filesystem::remove_all(tmp);
  std::filesystem::create_directories(tmp);
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  auto save_sharded = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::save_sharded_checkpoint(tmp / "sharded", sm, &st); };
  auto save_full = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::save_full_checkpoint(tmp / "full.safetensors", sm, &st); };
  auto load_sharded = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::load_sharded_checkpoint(tmp / "sharded", sm, &st); };
  auto load_full = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::load_full_checkpoint(tmp / "full.safetensors", sm, &st); };
  // Seed 7: the fresh model starts elsewhere, so only the load brings it back.
  train<fsdp::FullShard>(4, 0, 3, {}, 1, {}, save_sharded);
  CHECK(max_difference(train<fsdp::FullShard>(3, 3, 6, aligned(8), 7, load_sharded), uninterrupted) < 2e-5);
  train<fsdp::FullShard>(3, 0, 3, aligned(32), 1, {}, save_sharded);
  CHECK(max_difference(train<fsdp::FullShard>(2, 3, 6, {}, 7, load_sharded), uninterrupted) < 2e-5);
  CHECK(max_difference(train<fsdp::FullShard>(4, 3, 6, aligned(8), 7, load_sharded), uninterrupted) < 2e-5);
  train<fsdp::FullShard>(2, 0, 3, aligned(16), 1, {}, save_full);
  CHECK(max_difference(train<fsdp::FullShard>(4, 3, 6, {}, 7, load_full), uninterrupted) < 2e-5);
  CHECK(max_difference(train<fsdp::FullShard>(3, 3, 6, aligned(128), 7, load_full), uninterrupted) < 2e-5);
  std::filesystem::remove_all(tmp);
}

}  // namespace core_shard_layout_test
