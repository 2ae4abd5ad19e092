// ShardOptions::shard_layout (fsdp/core/flat_param.hpp): block_aligned(K) starts every
// parameter on a multiple of K elements and cuts shards on multiples of K, so no K-element
// block of a parameter is split between ranks. The layout worked out by hand and checked on
// many parameter lists; training bit for bit as under element_flat; a block format's scales
// each covering one parameter; checkpoints across layouts and world sizes; the
// configuration reporting it; and what is refused.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
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

// Every promise of param_atomic(K): each parameter lies whole on one rank, starting on a
// multiple of K of that rank's shard; no two overlap; S is the largest rank's load of
// K-rounded sizes, which a greedy largest-first placement keeps within one parameter of
// the mean and at least the largest parameter and the mean.
void check_atomic_layout(const std::vector<std::int64_t>& numels, int world, std::int64_t k) {
  CAPTURE(world);
  CAPTURE(k);
  CAPTURE(numels.size());
  const FlatParamLayout L(DType::f32, make_params(numels), world, ShardLayout::param_atomic(k));
  const std::int64_t S = L.shard_numel();
  CHECK(L.padded_numel() == S * world);
  std::vector<int> owner(static_cast<std::size_t>(L.padded_numel()), -1);
  std::vector<std::int64_t> load(static_cast<std::size_t>(world), 0);
  std::int64_t total = 0, largest = 0, end = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    CAPTURE(i);
    const std::int64_t rounded = (numels[i] + k - 1) / k * k;
    total += rounded;
    largest = std::max(largest, rounded);
    int holders = 0;
    for (int r = 0; r < world; ++r) {
      const fsdp::ShardSlice s = L.slice(i, r);
      if (s.count == 0) continue;
      ++holders;
      CHECK(s.param_begin == 0);
      CHECK(s.count == numels[i]);
      CHECK(s.shard_offset % k == 0);
      CHECK(L.params()[i].offset == r * S + s.shard_offset);
      load[static_cast<std::size_t>(r)] += rounded;
    }
    CHECK(holders == (numels[i] > 0 ? 1 : 0));
    for (std::int64_t e = 0; e < numels[i]; ++e) {
      auto& o = owner.at(static_cast<std::size_t>(L.params()[i].offset + e));
      if (o != -1) {
        FAIL_CHECK("parameters " << o << " and " << i << " overlap");
        break;
      }
      o = static_cast<int>(i);
    }
    end = std::max(end, L.params()[i].offset + numels[i]);
  }
  CHECK(L.numel() == end);
  CHECK(S == *std::max_element(load.begin(), load.end()));
  CHECK(S >= largest);
  CHECK(S * world >= total);
  CHECK(S * world <= total + (world - 1) * largest + world);  // at most the mean plus the largest
  for (int r = 0; r < world; ++r) {
    std::int64_t last = -1;
    for (std::int64_t e = 0; e < S; ++e)
      if (owner[static_cast<std::size_t>(r * S + e)] >= 0) last = e;
    CHECK(L.valid_shard_numel(r) == last + 1);
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
fsdp::ShardOptions atomic(std::int64_t k = 1) { return {.shard_layout = ShardLayout::param_atomic(k)}; }

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

TEST_CASE("a parameter-atomic layout worked out by hand") {
  // 10, 3, 20 and 7 elements on 2 ranks, largest first onto the least loaded rank: 20 to
  // rank 0; 10, 7 and 3 to rank 1 (10, 17, 20). Both hold 20; rank 1 keeps its parameters
  // in their order: the first at 20, the second at 30, the fourth at 33.
  const FlatParamLayout L(DType::f32, make_params({10, 3, 20, 7}), 2, ShardLayout::param_atomic());
  CHECK(L.shard_numel() == 20);
  CHECK(L.params()[2].offset == 0);
  CHECK(L.params()[0].offset == 20);
  CHECK(L.params()[1].offset == 30);
  CHECK(L.params()[3].offset == 33);
  CHECK(L.numel() == 40);
  CHECK(L.valid_shard_numel(0) == 20);
  CHECK(L.valid_shard_numel(1) == 20);
  CHECK(L.slice(2, 1).count == 0);
  const fsdp::ShardSlice second = L.slice(1, 1);
  CHECK((second.param_begin == 0 && second.count == 3 && second.shard_offset == 10));
  // param_atomic(8): sizes rounded to 16, 8, 24 and 8: the 24 to rank 0, the 16 and the
  // first 8 to rank 1 (24 each then), the last 8 to rank 0 on the tie (32): shards of 32.
  const FlatParamLayout B(DType::f32, make_params({10, 3, 20, 7}), 2, ShardLayout::param_atomic(8));
  CHECK(B.shard_numel() == 32);
  CHECK(B.params()[2].offset == 0);
  CHECK(B.params()[0].offset == 32);
  CHECK(B.params()[1].offset == 48);
  CHECK(B.params()[3].offset == 24);
}

TEST_CASE("parameter-atomic layouts keep every promise over world sizes, blocks and parameter lists") {
  std::mt19937_64 rng(20261202);
  std::uniform_int_distribution<int> count(0, 12);
  std::uniform_int_distribution<std::int64_t> size(0, 400);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<std::int64_t> numels(static_cast<std::size_t>(count(rng)));
    for (auto& n : numels) n = size(rng);
    for (int world : {1, 2, 3, 4, 7})
      for (std::int64_t k : {1, 8, 32}) check_atomic_layout(numels, world, k);
  }
}

TEST_CASE("--shard-layout's spelling: flat or block:K, strictly; a layout that means nothing is refused") {
  CHECK(fsdp::parse_shard_layout("flat") == ShardLayout::element_flat());
  CHECK(fsdp::parse_shard_layout("block:128") == ShardLayout::block_aligned(128));
  CHECK(fsdp::parse_shard_layout("param") == ShardLayout::param_atomic());
  CHECK(fsdp::parse_shard_layout("param:32") == ShardLayout::param_atomic(32));
  CHECK(fsdp::name_of(ShardLayout::param_atomic()) == "param");
  CHECK(fsdp::name_of(ShardLayout::param_atomic(32)) == "param:32");
  CHECK(fsdp::name_of(fsdp::parse_shard_layout("block:32")) == "block:32");
  CHECK(fsdp::name_of(ShardLayout::element_flat()) == "flat");
  for (const char* bad : {"", "Flat", "block", "block:", "block:0", "block:-8", "block:2abc", "block: 8", "block:16777217", "param:", "param:0",
                          "params", "param:8x"})
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
  // Each parameter whole on one rank: the same sums, so the same parameters too.
  CHECK(train<fsdp::FullShard>(4, 0, 4, atomic()) == flat);
  CHECK(train<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>(3, 0, 4, atomic(16)) ==
        train<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>(3, 0, 4, {}));
  CHECK(train<fsdp::ShardGradOp, fsdp::OffloadParams>(2, 0, 4, atomic()) == train<fsdp::ShardGradOp, fsdp::OffloadParams>(2, 0, 4, {}));
  CHECK(train<fsdp::FullShard, M>(4, 0, 4, atomic()) == train<fsdp::FullShard, M>(4, 0, 4, {}));
  CHECK(train<fsdp::HybridShard>(4, 0, 4, atomic(), 1, {}, {}, {2, 2}) == train<fsdp::HybridShard>(4, 0, 4, {}, 1, {}, {}, {2, 2}));
}

TEST_CASE("a block format's all-gather under block_aligned(K) or param_atomic(K): every scale block covers one parameter") {
  // The engine sees each parameter quantized on its own, in blocks of 16 from its first
  // element, and back: what an engine holding codes and scales per parameter would compute.
  // Element-flat, blocks are cut from each shard's first element, and some straddle two
  // parameters or start inside one.
  const auto c = config();
  const std::vector<fsdp::ShardOptions> layouts{aligned(16), atomic(16), {}};
  std::vector<int> per_parameter(layouts.size(), -1);  // rank 0's count of parameters seen as quantized alone
  using Int8 = fsdp::CommPrecision<fsdp::Int8Blocks<16>, float>;
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    for (std::size_t l = 0; l < layouts.size(); ++l) {
      engine::Model model(c);
      const engine::Model fresh(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, Int8>(model, comm, device, engine::Wrap{}, layouts[l]);
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
      if (comm.rank() == 0) per_parameter[l] = equal;
    }
  });
  CHECK(per_parameter[0] == 4);
  CHECK(per_parameter[1] == 4);
  CHECK(per_parameter[2] < 4);  // else this test proves nothing about the layouts
}

TEST_CASE("full state dicts, the optimizer's state included, are the same under every layout") {
  // A state dict gathers each flat parameter and reads its parameters back to back: under
  // a layout with gaps, or with parameters moved to other ranks, the gather picks them out.
  using Dict = fsdp::FullStateDict;
  auto dict_after_two_steps = [](const fsdp::ShardOptions& options) {
    Dict out;
    train<fsdp::FullShard>(3, 0, 2, options, 1, {}, [&](fsdp::ShardedModel& sm, engine::AdamWState& st) {
      auto d = fsdp::full_state_dict(sm, &st);
      if (fsdp::detail::internals(sm[0]).rank() == 0) out = std::move(d);
    });
    return out;
  };
  auto same = [](const std::map<std::string, fsdp::StateTensor>& a, const std::map<std::string, fsdp::StateTensor>& b) {
    if (a.size() != b.size()) return false;
    for (const auto& entry : a) {
      const std::string& name = entry.first;
      const fsdp::StateTensor& t = entry.second;
      const auto it = b.find(name);
      if (it == b.end() || it->second.dtype != t.dtype || it->second.shape != t.shape || it->second.data != t.data) {
        INFO("tensor " << name);
        return false;
      }
    }
    return true;
  };
  const Dict flat = dict_after_two_steps({});
  REQUIRE(flat.tensors.size() > 10);
  REQUIRE_FALSE(flat.optim.empty());
  for (const auto& options : {aligned(8), aligned(128), atomic(), atomic(16)}) {
    CAPTURE(fsdp::name_of(options.shard_layout));
    const Dict d = dict_after_two_steps(options);
    CHECK(same(d.tensors, flat.tensors));
    REQUIRE(d.optim.size() == flat.optim.size());
    for (const auto& [state, tensors] : flat.optim) CHECK(same(d.optim.at(state), tensors));
  }
}

TEST_CASE("a full checkpoint written while training goes on (AsyncCheckpointer: it gathers) loads across layouts") {
  const auto tmp = std::filesystem::temp_directory_path() / ("fsdp-shard-layout-async-" + std::to_string(::getpid()));
  std::filesystem::remove_all(tmp);
  std::filesystem::create_directories(tmp);
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  auto save_async = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) {
    fsdp::AsyncCheckpointer saver(sm, &st);
    saver.save_full(tmp / "full.safetensors");
    saver.wait();
  };
  auto load_full = [&](fsdp::ShardedModel& sm, engine::AdamWState& st) { fsdp::load_full_checkpoint(tmp / "full.safetensors", sm, &st); };
  for (const auto& saved : {aligned(8), atomic()}) {
    CAPTURE(fsdp::name_of(saved.shard_layout));
    train<fsdp::FullShard>(3, 0, 3, saved, 1, {}, save_async);
    CHECK(max_difference(train<fsdp::FullShard>(2, 3, 6, {}, 7, load_full), uninterrupted) < 2e-5);
    CHECK(max_difference(train<fsdp::FullShard>(4, 3, 6, atomic(8), 7, load_full), uninterrupted) < 2e-5);
  }
  std::filesystem::remove_all(tmp);
}

TEST_CASE("replicated units are not cut: NoShard, and units the persistence threshold keeps whole") {
  fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
    fsdp::HostDevice device;
    for (const auto& layout : {ShardLayout::block_aligned(8), ShardLayout::param_atomic()}) {
      engine::Model model(config());
      auto replicated = fsdp::shard<fsdp::NoShard>(model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.shard_layout = layout});
      CHECK(replicated.unit("blocks.0").shards()[0].padded_numel == 202);  // the block whole, no gaps
      engine::Model other(config());
      auto kept = fsdp::shard<fsdp::FullShard>(other, comm, device, engine::Wrap{},
                                               fsdp::ShardOptions{.persistence_threshold = 14, .shard_layout = layout});
      CHECK(kept.unit("gain").shards()[0].padded_numel == 13);
      CHECK(kept.unit("gain").config().kept_unsharded);
    }
  });
}

TEST_CASE("bit for bit as element-flat, with accumulation, low-precision gradients and (on one rank) clipping") {
  // One rank: the gradient accumulates in the shard (no reduction buffer). Accumulation
  // under no_sync keeps unsharded gradients, gaps included; clipping reads every gradient;
  // KeepLowPrecisionGrads keeps the sharded gradient in bf16.
  auto run = [](int world, const fsdp::ShardOptions& options, bool keep_low) {
    std::vector<Params> out(static_cast<std::size_t>(world));
    const auto c = config();
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = keep_low ? fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, fsdp::bf16, fsdp::bf16, true>>(
                               model, comm, device, engine::Wrap{}, options)
                         : fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, options);
      engine::Sgd sgd(0.05f);
      for (int s = 0; s < 3; ++s) {
        std::vector<engine::Batch> micro{engine::make_batch(c, 2 * s, comm.rank(), 1), engine::make_batch(c, 2 * s + 1, comm.rank(), 1)};
        sm.zero_grad();
        for (std::size_t m = 0; m < micro.size(); ++m) {
          sm.set_requires_gradient_sync(m + 1 == micro.size());
          engine::sharded_micro_batch(model, sm, micro[m]);
        }
        if (keep_low) continue;  // the sharded gradient is bf16: the engine's f32 optimizers refuse it
        // Clipping on one rank only: on several, each rank's partial norm sums other elements
        // under another layout, so the clip coefficient may differ in its last bit.
        if (world == 1) fsdp::clip_grad_norm(sm, comm, device, {.max_norm = 0.05});
        sgd.step(engine::slots(sm));
      }
      if (keep_low) {  // the bf16 gradients themselves, gathered
        auto summoned = sm.summon_full_params({.with_grads = true});
        Params grads;
        for (auto& p : engine::named_parameters(model))
          grads.emplace_back(p.fqn, std::vector<float>(p.grad->numel()));
        out[static_cast<std::size_t>(comm.rank())] = grads;
        std::size_t i = 0;
        for (auto& p : engine::named_parameters(model)) {
          for (std::int64_t e = 0; e < p.grad->numel(); ++e) out[static_cast<std::size_t>(comm.rank())][i].second[static_cast<std::size_t>(e)] = p.grad->get(e);
          ++i;
        }
        return;
      }
      out[static_cast<std::size_t>(comm.rank())] = engine::gather_full_parameters(model, sm);
    });
    return out[0];
  };
  for (int world : {1, 3}) {
    CAPTURE(world);
    CHECK(run(world, aligned(8), false) == run(world, {}, false));
    CHECK(run(world, atomic(), false) == run(world, {}, false));
    CHECK(run(world, aligned(8), true) == run(world, {}, true));
    CHECK(run(world, atomic(), true) == run(world, {}, true));
  }
}

TEST_CASE("Muon's orthogonalization on a matrix whose singular vectors are known") {
  // M has one non-zero per row and column, so its singular values are those entries'
  // magnitudes and its singular vectors unit vectors: the map acts on each entry alone, as
  // the scalar quintic p(s) = a s + b s^3 + c s^5 iterated five times on s / ||M||_F.
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  auto p5 = [&](double s) {
    for (int i = 0; i < 5; ++i) s = a * s + b * s * s * s + c * s * s * s * s * s;
    return s;
  };
  const double norm = std::sqrt(9.0 + 1.0 + 0.25);
  for (bool tall : {false, true}) {
    CAPTURE(tall);
    const std::int64_t rows = tall ? 5 : 3, cols = tall ? 3 : 5;
    std::vector<float> m(15, 0.0f);
    auto at = [&](std::int64_t r, std::int64_t col) -> float& { return tall ? m[static_cast<std::size_t>(col * cols + r)] : m[static_cast<std::size_t>(r * cols + col)]; };
    at(0, 2) = 3.0f, at(1, 0) = -1.0f, at(2, 4) = 0.5f;  // (row, column) of the wide form; the tall one is its transpose
    engine::Muon::orthogonalize(m.data(), rows, cols, 5);
    const double want0 = p5(3.0 / norm), want1 = -p5(1.0 / norm), want2 = p5(0.5 / norm);
    for (double w : {want0, -want1, want2}) CHECK((w > 0.6 && w < 1.3));  // pushed towards 1, from 0.94, 0.31 and 0.16
    CHECK(at(0, 2) == doctest::Approx(want0).epsilon(1e-5));
    CHECK(at(1, 0) == doctest::Approx(want1).epsilon(1e-5));
    CHECK(at(2, 4) == doctest::Approx(want2).epsilon(1e-5));
    int zeros = 0;
    for (float v : m) zeros += v == 0.0f;
    CHECK(zeros == 12);
  }
}

TEST_CASE("Muon's orthogonalization of a dense matrix keeps its singular vectors and pushes its singular values towards 1") {
  // With M = U S V^T, the map gives X = U f(S) V^T: X M^T = U f(S) S U^T and M^T X are then
  // symmetric, and the eigenvalues of X X^T, f(s)^2, lie in the quintic's band around 1.
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal;
  for (bool tall : {false, true}) {
    CAPTURE(tall);
    const int rows = tall ? 7 : 4, cols = tall ? 4 : 7;
    std::vector<float> m(static_cast<std::size_t>(rows * cols));
    for (auto& v : m) v = static_cast<float>(normal(rng));
    std::vector<float> x = m;
    engine::Muon::orthogonalize(x.data(), rows, cols, 5);
    auto mat = [&](const std::vector<float>& a, int r, int c) { return double(a[static_cast<std::size_t>(r * cols + c)]); };
    // P = X M^T (rows x rows) and Q = M^T X (cols x cols): symmetric.
    double asym = 0, scale = 0;
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < rows; ++j) {
        double pij = 0, pji = 0;
        for (int k = 0; k < cols; ++k) pij += mat(x, i, k) * mat(m, j, k), pji += mat(x, j, k) * mat(m, i, k);
        asym = std::max(asym, std::fabs(pij - pji)), scale = std::max(scale, std::fabs(pij));
      }
    for (int i = 0; i < cols; ++i)
      for (int j = 0; j < cols; ++j) {
        double qij = 0, qji = 0;
        for (int k = 0; k < rows; ++k) qij += mat(m, k, i) * mat(x, k, j), qji += mat(m, k, j) * mat(x, k, i);
        asym = std::max(asym, std::fabs(qij - qji));
      }
    CHECK(asym < 1e-5 * scale);
    // G = X X^T over the smaller side: its largest and smallest eigenvalues by power iteration.
    const int s = std::min(rows, cols);
    std::vector<double> G(static_cast<std::size_t>(s * s));
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < s; ++j) {
        double g = 0;
        for (int k = 0; k < std::max(rows, cols); ++k)
          g += tall ? mat(x, k, i) * mat(x, k, j) : mat(x, i, k) * mat(x, j, k);
        G[static_cast<std::size_t>(i * s + j)] = g;
      }
    auto largest = [&](double shift) {  // of shift * I - G when shift > 0, else of G
      std::vector<double> v(static_cast<std::size_t>(s), 1.0), w(v.size());
      double lambda = 0;
      for (int it = 0; it < 500; ++it) {
        double n = 0;
        for (int i = 0; i < s; ++i) {
          double sum = shift * v[static_cast<std::size_t>(i)];
          for (int j = 0; j < s; ++j) sum += (shift > 0 ? -1 : 1) * G[static_cast<std::size_t>(i * s + j)] * v[static_cast<std::size_t>(j)];
          w[static_cast<std::size_t>(i)] = sum;
          n += sum * sum;
        }
        lambda = std::sqrt(n);
        for (int i = 0; i < s; ++i) v[static_cast<std::size_t>(i)] = w[static_cast<std::size_t>(i)] / lambda;
      }
      return lambda;
    };
    const double most = largest(0), least = most - largest(most);
    CAPTURE(most);
    CAPTURE(least);
    CHECK((least > 0.3 && most < 1.6));  // singular values in about [0.55, 1.26]
  }
}

TEST_CASE("Muon's step by hand: Nesterov momentum and the scale of a tall matrix") {
  // A 2 x 1 matrix has one singular value: its orthogonalized update is the unit vector
  // u / |u| times p5(|u| / (|u| + 1e-7)), and the step is scaled by sqrt(max(1, 2 / 1)).
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  auto p5 = [&](double s) {
    for (int i = 0; i < 5; ++i) s = a * s + b * s * s * s + c * s * s * s * s * s;
    return s;
  };
  engine::Muon opt({.lr = 0.1f, .momentum = 0.9f});
  float param[2] = {1.0f, 2.0f};
  double want[2] = {1.0, 2.0}, buf[2] = {0, 0};
  for (const auto& g : {std::array<float, 2>{3.0f, 4.0f}, std::array<float, 2>{-1.0f, 0.5f}}) {
    const engine::Slot slot{param, g.data(), 2, nullptr, 2, 1};
    opt.step(std::span<const engine::Slot>(&slot, 1));
    double u[2], norm = 0;
    for (int i = 0; i < 2; ++i) {
      buf[i] = 0.9 * buf[i] + g[static_cast<std::size_t>(i)];  // momentum, then Nesterov's look ahead
      u[i] = g[static_cast<std::size_t>(i)] + 0.9 * buf[i];
      norm += u[i] * u[i];
    }
    norm = std::sqrt(norm);
    const double sigma = p5(norm / (norm + 1e-7));
    for (int i = 0; i < 2; ++i) want[i] -= 0.1 * std::sqrt(2.0) * sigma * u[i] / norm;
    CHECK(param[0] == doctest::Approx(want[0]).epsilon(1e-5));
    CHECK(param[1] == doctest::Approx(want[1]).epsilon(1e-5));
  }
  // The same slots every step: another shape in a matrix slot is refused.
  const float g[2] = {1.0f, 1.0f};
  const engine::Slot wide{param, g, 2, nullptr, 1, 2};
  CHECK_THROWS_WITH_AS(opt.step(std::span<const engine::Slot>(&wide, 1)), doctest::Contains("its state is for 2 x 1"), fsdp::Error);
}

TEST_CASE("Muon on parameter-atomic shards: each weight matrix stepped whole where it lies, as unsharded Muon") {
  const auto c = config();
  engine::Model reference(c);
  engine::Muon ref_opt({});
  for (int s = 0; s < 4; ++s) engine::unsharded_step(reference, ref_opt, engine::make_batch(c, s, 0, kGlobalBatch));
  Params want;
  for (auto& np : engine::named_parameters(reference))
    want.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  CHECK(ref_opt.matrices() == 2 + 2 * 3);  // embed and head, two per block
  for (int world : {1, 3, 4}) {
    CAPTURE(world);
    std::vector<Params> got(static_cast<std::size_t>(world));
    std::vector<std::size_t> matrices(static_cast<std::size_t>(world));
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, atomic());
      engine::Muon opt({});
      const int local = kGlobalBatch / world;
      for (int s = 0; s < 4; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
      matrices[static_cast<std::size_t>(comm.rank())] = opt.matrices();
      got[static_cast<std::size_t>(comm.rank())] = engine::gather_full_parameters(model, sm);
    });
    std::size_t all = 0;
    for (auto n : matrices) all += n;
    CHECK(all == ref_opt.matrices());  // each matrix stepped by exactly one rank
    CHECK(max_difference(got[0], want) < 2e-5);
  }
  // Element-flat shards cut matrices: an optimizer that steps whole parameters refuses them.
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    CHECK_THROWS_WITH_AS(engine::parameter_slots(sm), doctest::Contains("param_atomic"), fsdp::Error);
  });
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
  CHECK(max_difference(train<fsdp::FullShard>(4, 3, 6, atomic(), 7, load_full), uninterrupted) < 2e-5);
  train<fsdp::FullShard>(4, 0, 3, atomic(), 1, {}, save_sharded);
  CHECK(max_difference(train<fsdp::FullShard>(3, 3, 6, {}, 7, load_sharded), uninterrupted) < 2e-5);
  CHECK(max_difference(train<fsdp::FullShard>(2, 3, 6, atomic(8), 7, load_sharded), uninterrupted) < 2e-5);
  std::filesystem::remove_all(tmp);
}

}  // namespace core_shard_layout_test
