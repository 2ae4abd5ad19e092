// CommPrecision with a block format as Gather (fsdp/policy/policies.hpp: Int8Blocks,
// F8E4M3Blocks, MXFP8): what the engine sees (each rank's shard quantized in blocks and
// back, bit for bit as the host functions compute it), what a summon sees (the master,
// unrounded), the bytes each step moves, an inf or NaN, the loss against f32
// communication, and the per-rank peak the planner predicts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/quantize_reference.hpp"
#include "test/support/reference_training.hpp"

namespace core_quantized_gather_test {

namespace {

using fsdp::Collective;
using fsdp::QuantFormat;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

float* tensor_of(engine::Model& model, std::string_view fqn) {
  for (auto& p : engine::named_parameters(model))
    if (p.fqn == fqn) return p.param->data();
  FAIL("no parameter " << std::string(fqn));
  return nullptr;
}

// Under unit `unit`'s forward, each of this rank's parameter slices must hold its shard's
// values quantized in `format` blocks of `block` (cut from the shard's first element) and
// dequantized: the host functions' round trip of the shard, computed here from the shard
// itself. Each rank checks its own slices, so together the ranks check every element.
void check_gathered_as_round_trip(engine::Model& model, fsdp::ShardedModel& sm, const std::string& unit,
                                  QuantFormat format, std::size_t block, bool& some_value_rounded) {
  std::map<std::size_t, std::vector<float>> expected;  // by model shard index
  for (std::size_t k = 0; k < sm.shards().size(); ++k) {
    const auto& v = sm.shards()[k];
    if (v.unit != unit) continue;
    REQUIRE(v.dtype == fsdp::DType::f32);
    const auto* p = static_cast<const float*>(v.param);
    expected[k] = test_support::quantize_round_trip(format, std::vector<float>(p, p + v.padded_numel), block);
  }
  REQUIRE_FALSE(expected.empty());
  auto scope = sm.unit(unit).forward_scope();
  for (const auto& pv : sm.parameters()) {
    if (pv.unit != unit || pv.count == 0) continue;
    const float* engine_values = tensor_of(model, pv.fqn);
    const auto& want = expected.at(pv.model_shard);
    const auto* master = static_cast<const float*>(pv.param);
    for (std::int64_t j = 0; j < pv.count; ++j) {
      const float got = engine_values[pv.param_begin + j], w = want[static_cast<std::size_t>(pv.shard_offset + j)];
      if (std::memcmp(&got, &w, sizeof got) != 0)
        FAIL_CHECK(pv.fqn << "[" << pv.param_begin + j << "] = " << got << ", the round trip gives " << w);
      some_value_rounded = some_value_rounded || got != master[j];
    }
  }
}

template <class Gather>
void check_engine_sees_round_trip(QuantFormat format, std::size_t block) {
  const auto c = config();
  std::vector<int> rounded(2, 0);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    engine::Model fresh(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::CommPrecision<Gather, float>>(model, comm, device, engine::Wrap{});
    bool some = false;
    for (const char* unit : {"blocks.0", "blocks.2"}) check_gathered_as_round_trip(model, sm, unit, format, block, some);
    rounded[comm.rank()] = some;
    // A summon gathers the master dtype, unrounded.
    auto s = sm.unit("blocks.0").summon_full_params();
    const auto& w = model.blocks[0].fc1.weight;
    CHECK(std::memcmp(w.data(), fresh.blocks[0].fc1.weight.data(), 4 * static_cast<std::size_t>(w.numel())) == 0);
  });
  CHECK((rounded[0] && rounded[1]));  // else the bitwise checks prove nothing about quantizing
}

// blocks.1's fc2.weight as the engine sees it during that unit's forward (in `want`).
template <class... Ps>
std::vector<float> gathered_weight(fsdp::ThreadComm& comm, fsdp::DType want) {
  engine::Model model(config());
  fsdp::HostDevice device;
  auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
  auto s = sm.unit("blocks.1").forward_scope();
  const auto& w = model.blocks[1].fc2.weight;
  REQUIRE(w.dtype() == want);
  std::vector<float> out;
  for (std::int64_t i = 0; i < w.numel(); ++i) out.push_back(w.get(i));
  return out;
}

template <class... Ps, class WrapPolicy>
fsdp::CollectiveCounts step_counts(int world, WrapPolicy wrap) {
  return test_support::step_collectives<Ps...>(config(), world, wrap);
}

// The global loss of each of `steps` SGD steps.
template <class... Ps>
std::vector<double> losses(int world, int steps) {
  return test_support::sgd_run<Ps...>(config(), world, steps).losses;
}

// Bytes of one rank's slot: the block scales, then one code per value, padded to 8.
std::uint64_t slot_bytes(std::uint64_t shard, std::uint64_t block, std::uint64_t scale) {
  const std::uint64_t used = (shard + block - 1) / block * scale + shard;
  return (used + 7) / 8 * 8;
}

}  // namespace

TEST_CASE("a block format as CommPrecision's Gather: its values, its name in the configuration, what it refuses") {
  using I = fsdp::CommPrecision<fsdp::Int8Blocks<64>, float>;
  static_assert(I::quantized && I::gather_format == QuantFormat::int8_blocks && I::gather_block == 64);
  static_assert(I::gather == fsdp::DType::u8 && I::reduce == fsdp::DType::f32);
  using E = fsdp::CommPrecision<fsdp::F8E4M3Blocks<>, fsdp::bf16>;
  static_assert(E::gather_format == QuantFormat::f8e4m3_blocks && E::gather_block == 128 && E::reduce == fsdp::DType::bf16);
  using M = fsdp::CommPrecision<fsdp::MXFP8, float>;
  static_assert(M::gather_format == QuantFormat::mxfp8 && M::gather_block == 32);
  static_assert(!fsdp::CommPrecision<fsdp::bf16>::quantized);
  // MixedPrecision<bf16> with a block format: the codes are narrower than any compute dtype.
  using P = fsdp::Policies<fsdp::MixedPrecision<fsdp::bf16>, fsdp::CommPrecision<fsdp::MXFP8, fsdp::bf16>>;
  static_assert(P::comm_precision::quantized);

  CHECK(fsdp::to_string(fsdp::policy_config<fsdp::Policies<fsdp::FullShard, I>>()) ==
        "FULL_SHARD BACKWARD_PRE forward_prefetch=off offload=off FullPrecision CommPrecision<Int8Blocks<64>, f32>");
  CHECK(fsdp::to_string(fsdp::policy_config<fsdp::Policies<fsdp::FullShard, M>>()).ends_with("CommPrecision<MXFP8, f32>"));
  CHECK(fsdp::to_string(fsdp::policy_config<fsdp::Policies<fsdp::FullShard, E, fsdp::MixedPrecision<fsdp::bf16>>>())
            .ends_with("CommPrecision<F8E4M3Blocks<128>, bf16>"));
}

TEST_CASE("the engine sees each rank's shard quantized in blocks and back, bit for bit; a summon sees the master") {
  SUBCASE("int8 blocks of 16") { check_engine_sees_round_trip<fsdp::Int8Blocks<16>>(QuantFormat::int8_blocks, 16); }
  SUBCASE("E4M3 blocks of 16") { check_engine_sees_round_trip<fsdp::F8E4M3Blocks<16>>(QuantFormat::f8e4m3_blocks, 16); }
  SUBCASE("MXFP8") { check_engine_sees_round_trip<fsdp::MXFP8>(QuantFormat::mxfp8, 32); }
}

TEST_CASE("under MixedPrecision<bf16> the engine sees the dequantized values rounded to bf16; offloaded shards gather the same") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    using Q = fsdp::CommPrecision<fsdp::Int8Blocks<16>, float>;
    const auto f32_values = gathered_weight<fsdp::FullShard, Q>(comm, fsdp::DType::f32);
    const auto offloaded = gathered_weight<fsdp::FullShard, Q, fsdp::OffloadParams>(comm, fsdp::DType::f32);
    const auto bf16_values = gathered_weight<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>,
                                             fsdp::CommPrecision<fsdp::Int8Blocks<16>, fsdp::bf16>>(comm, fsdp::DType::bf16);
    REQUIRE(f32_values.size() == bf16_values.size());
    CHECK(offloaded == f32_values);
    for (std::size_t i = 0; i < f32_values.size(); ++i)
      REQUIRE(bf16_values[i] == fsdp::bf16_bits_to_float(fsdp::float_to_bf16_bits(f32_values[i])));
  });
}

TEST_CASE("an inf or NaN in a shard arrives as NaNs over its whole block, never as numbers") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    model.blocks[0].fc1.weight[5] = std::numeric_limits<float>::quiet_NaN();
    model.blocks[0].fc2.weight[3] = std::numeric_limits<float>::infinity();
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::CommPrecision<fsdp::Int8Blocks<16>, float>>(model, comm, device, engine::Wrap{});
    // Where the two values sit: fc1.weight's first 16 elements start rank 0's shard, so
    // they are its block 0; fc2.weight[3] is at some shard offset o: the block
    // [o / 16 * 16, o / 16 * 16 + 16) of its rank's shard is NaN, nothing else.
    for (const auto& pv : sm.parameters())
      if (pv.fqn == "blocks.0.fc1.weight" && pv.param_begin == 0 && pv.count > 0) REQUIRE(pv.shard_offset == 0);
    // Each rank marks the elements of its own slices whose shard block holds a bad value.
    std::vector<std::int64_t> bad_blocks;
    for (const auto& pv : sm.parameters()) {
      if (pv.unit != "blocks.0") continue;
      const auto* master = static_cast<const float*>(pv.param);
      for (std::int64_t j = 0; j < pv.count; ++j)
        if (!std::isfinite(master[j])) bad_blocks.push_back((pv.shard_offset + j) / 16);
    }
    auto s = sm.unit("blocks.0").forward_scope();
    std::int64_t nans = 0;
    for (const auto& pv : sm.parameters()) {
      if (pv.unit != "blocks.0") continue;
      const float* values = tensor_of(model, pv.fqn);
      for (std::int64_t j = 0; j < pv.count; ++j) {
        const bool bad = std::find(bad_blocks.begin(), bad_blocks.end(), (pv.shard_offset + j) / 16) != bad_blocks.end();
        const float v = values[pv.param_begin + j];
        nans += std::isnan(v);
        if (bad != std::isnan(v)) FAIL_CHECK(pv.fqn << "[" << pv.param_begin + j << "] = " << v);
      }
    }
    if (comm.rank() == 0) {
      CHECK(std::isnan(model.blocks[0].fc1.weight[0]));
      CHECK(std::isnan(model.blocks[0].fc1.weight[15]));
      CHECK_FALSE(std::isnan(model.blocks[0].fc1.weight[16]));
    }
    std::int64_t all = 0;
    comm.all_reduce(&nans, &all, 1, fsdp::DType::i64, fsdp::ReduceOp::sum).wait();
    CHECK(all == 32);  // two whole blocks of 16, one per bad value (they lie in different blocks)
  });
}

TEST_CASE("bytes moved per step: each all-gather moves every rank's scales and codes, the reductions are unchanged") {
  const int world = 4;
  // One unit (no wrap policy): every all-gather moves the same shard, so the bytes are exact.
  const auto f32 = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch>(world, fsdp::wrap_types<>{});
  const auto int8 = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::CommPrecision<fsdp::Int8Blocks<128>, float>>(
      world, fsdp::wrap_types<>{});
  const auto mx = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::CommPrecision<fsdp::MXFP8, float>>(
      world, fsdp::wrap_types<>{});
  REQUIRE(f32[Collective::all_gather].calls > 0);
  const auto c = config();
  std::uint64_t numel = 0;
  for (auto n : test_support::unit_numels(c)) numel += static_cast<std::uint64_t>(n);
  const std::uint64_t shard = (numel + world - 1) / world;  // one flat parameter, padded to a multiple of 4
  const auto calls = f32[Collective::all_gather].calls;
  CHECK(f32[Collective::all_gather].bytes == calls * world * shard * 4);
  CHECK(int8[Collective::all_gather].calls == calls);
  CHECK(int8[Collective::all_gather].bytes == calls * world * slot_bytes(shard, 128, 4));
  CHECK(mx[Collective::all_gather].bytes == calls * world * slot_bytes(shard, 32, 1));
  CHECK(int8[Collective::reduce_scatter] == f32[Collective::reduce_scatter]);
  // 185 values per rank: 200 bytes (8 of scales, 7 of padding) against 740, 0.270x; a
  // shard of 1M values would move 0.258x (bench/ measures a larger model).

  // NoShard gathers nothing: the block format changes nothing there.
  const auto ddp = step_counts<fsdp::NoShard>(world, engine::Wrap{});
  const auto ddp_q = step_counts<fsdp::NoShard, fsdp::CommPrecision<fsdp::Int8Blocks<>, float>>(world, engine::Wrap{});
  CHECK(ddp_q[Collective::all_gather].calls == 0);
  CHECK(ddp_q[Collective::all_reduce] == ddp[Collective::all_reduce]);
}

TEST_CASE("loss against f32 communication over 20 steps: int8 and E4M3 blocks and MXFP8 stay close") {
  const int world = 4, steps = 20;
  const auto f32 = losses<fsdp::FullShard>(world, steps);
  const auto int8 = losses<fsdp::FullShard, fsdp::CommPrecision<fsdp::Int8Blocks<>, float>>(world, steps);
  const auto e4m3 = losses<fsdp::FullShard, fsdp::CommPrecision<fsdp::F8E4M3Blocks<>, float>>(world, steps);
  const auto mx = losses<fsdp::FullShard, fsdp::CommPrecision<fsdp::MXFP8, float>>(world, steps);
  auto worst_relative = [&](const std::vector<double>& q) {
    double worst = 0;
    for (std::size_t s = 0; s < f32.size(); ++s) worst = std::max(worst, std::fabs(q[s] - f32[s]) / f32[s]);
    return worst;
  };
  // int8 rounds each value by at most half a step of amax/127 (0.4% of its block's
  // largest); E4M3 keeps 3 mantissa bits, so up to 2^-4 (6%) of each value, and MXFP8's
  // power-of-two scale leaves the block's largest values fewer of E4M3's exponents to
  // spare. Measured here (November 2026): int8 0.5%, E4M3 3.9%, MXFP8 6.5% at worst
  // over the 20 steps; the bounds leave half again as much.
  MESSAGE("relative loss deviation: int8 ", worst_relative(int8), ", e4m3 ", worst_relative(e4m3), ", mxfp8 ",
          worst_relative(mx));
  CHECK(worst_relative(int8) < 0.01);
  CHECK(worst_relative(e4m3) < 0.06);
  CHECK(worst_relative(mx) < 0.1);
  CHECK(worst_relative(int8) > 0);  // the gathers did round
}

}  // namespace core_quantized_gather_test
