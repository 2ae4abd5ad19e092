// fsdp/comm/quantized_all_gather.hpp, and the QuantizingDevice HostDevice is: every rank
// gets every rank's shard as the host functions of fsdp/core/quantize.hpp quantize and
// dequantize it, in one all-gather of about a quarter of the f32 bytes; an inf or NaN in
// any rank's shard is the same error on every rank, and nothing is dequantized.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>
#include <fsdp/comm/quantized_all_gather.hpp>
#include <fsdp/core/quantize.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#include "test/support/errors.hpp"
#include "test/support/quantize_reference.hpp"
#include "test/support/rank_errors.hpp"

namespace core_quantized_all_gather_test {

namespace {

using fsdp::HostDevice;
using fsdp::QuantFormat;
using test_support::contains;

static_assert(fsdp::QuantizingDevice<HostDevice>);

// Rank r's shard: magnitudes that differ between ranks and blocks, never a whole block of
// zeros but some zeros.
std::vector<float> shard_of(int rank, std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i)
    x[i] = (i % 11 == 0) ? 0.0f : std::ldexp(static_cast<float>((i * 7919 + 13 * rank) % 201) - 100.0f, rank - 3);
  return x;
}

// The expected result, from the host functions alone: each rank's shard quantized and
// dequantized on its own.
std::vector<float> expected_full(QuantFormat f, std::size_t block, int world, std::size_t n) {
  std::vector<float> full;
  for (int r = 0; r < world; ++r) {
    const std::vector<float> y = test_support::quantize_round_trip(f, shard_of(r, n), block);
    full.insert(full.end(), y.begin(), y.end());
  }
  return full;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Case {
  QuantFormat f;
  std::size_t block;
};
constexpr Case kCases[] = {{QuantFormat::int8_blocks, 128},
                           {QuantFormat::f8e4m3_blocks, 50},
                           {QuantFormat::f8e5m2_blocks, 96},
                           {QuantFormat::mxfp8, 32}};

// Each rank's quantized_all_gather of shard_of(rank, n) on `world` thread ranks, counted.
struct GatherRun {
  std::vector<std::string> errors;
  std::vector<std::vector<float>> got;
  std::vector<fsdp::CollectiveCounts> counts;
  std::vector<std::size_t> live_after;
};
GatherRun run_gather(int world, QuantFormat f, std::size_t block, std::size_t n) {
  GatherRun out;
  out.got.resize(world);
  out.counts.resize(world);
  out.live_after.assign(world, 1);
  out.errors = test_support::errors_per_rank(world, [&](fsdp::ThreadComm& comm) {
    fsdp::CountingCommunicator<fsdp::ThreadComm> counted(comm);
    HostDevice device;
    const std::vector<float> shard = shard_of(comm.rank(), n);
    std::vector<float> full(n * world, -1.0f);
    fsdp::quantized_all_gather(counted, device, f, block, shard.data(), n, full.data());
    const auto i = static_cast<std::size_t>(comm.rank());
    out.got[i] = full;
    out.counts[i] = counted.counts();
    out.live_after[i] = device.stats(fsdp::MemorySpace::device).live_bytes;
  });
  return out;
}

}  // namespace

TEST_CASE("quantized_all_gather: every rank gets every shard as the host functions round-trip it, in one gather of "
          "codes and scales") {
  constexpr int world = 3;
  constexpr std::size_t n = 1000;  // no format's block divides it: every shard ends in a short block
  for (const Case c : kCases) {
    CAPTURE(fsdp::name_of(c.f));
    const std::vector<float> want = expected_full(c.f, c.block, world, n);
    const auto [errors, got, counts, live_after] = run_gather(world, c.f, c.block, n);
    // A slot per rank: an 8-byte status, the scales, the codes, rounded up to 8 bytes.
    const std::size_t blocks = (n + c.block - 1) / c.block;
    const std::size_t slot = (8 + blocks * (c.f == QuantFormat::mxfp8 ? 1 : 4) + n + 7) / 8 * 8;
    CHECK(fsdp::quantized_slot_bytes(c.f, n, c.block) == slot);
    for (int r = 0; r < world; ++r) {
      const auto i = static_cast<std::size_t>(r);
      CAPTURE(r);
      CHECK(errors[i].empty());
      CHECK(same_bits(got[i], want));
      CHECK(counts[i][fsdp::Collective::all_gather].calls == 1);  // one collective, nothing else
      CHECK(counts[i][fsdp::Collective::all_gather].bytes == slot * world);
      CHECK(counts[i][fsdp::Collective::all_reduce].calls == 0);
      CHECK(live_after[i] == 0);  // the scratch is freed
    }
    // Against an f32 all-gather of the same shards (4n bytes per rank).
    const double ratio = static_cast<double>(slot) / static_cast<double>(4 * n);
    CHECK(ratio < (c.f == QuantFormat::f8e4m3_blocks ? 0.28 : 0.27));
  }
}

TEST_CASE("quantized_all_gather: an inf or NaN in any rank's shard is the same error on every rank, and nothing is "
          "dequantized") {
  constexpr int world = 3;
  constexpr std::size_t n = 300;
  for (const Case c : kCases) {
    CAPTURE(fsdp::name_of(c.f));
    std::vector<char> untouched(world, 0);
    std::vector<std::size_t> live_after(world, 1);
    const auto errors = test_support::errors_per_rank(world, [&](fsdp::ThreadComm& comm) {
      HostDevice device;
      std::vector<float> shard = shard_of(comm.rank(), n);
      if (comm.rank() == 1) shard[217] = std::numeric_limits<float>::quiet_NaN(), shard[250] = -INFINITY;
      if (comm.rank() == 2) shard[5] = INFINITY;  // a higher rank: rank 1 is named
      std::vector<float> full(n * world, -1.0f);
      try {
        fsdp::quantized_all_gather(comm, device, c.f, c.block, shard.data(), n, full.data());
      } catch (...) {  // as the error leaves the rank: nothing written, the scratch freed
        const auto i = static_cast<std::size_t>(comm.rank());
        untouched[i] = std::all_of(full.begin(), full.end(), [](float v) { return v == -1.0f; });
        live_after[i] = device.stats(fsdp::MemorySpace::device).live_bytes;
        throw;
      }
    });
    for (int r = 0; r < world; ++r) {
      const auto i = static_cast<std::size_t>(r);
      CAPTURE(errors[i]);
      CHECK(contains(errors[i], "quantized_all_gather (" + std::string(fsdp::name_of(c.f)) + ", 300 values per rank) on rank " +
                                    std::to_string(r) + ": rank 1's shard holds an inf or NaN at element 217"));
      CHECK(untouched[i]);
      CHECK(live_after[i] == 0);
    }
  }
}

TEST_CASE("quantized_all_gather per tensor: one agreed scale, the whole gathered tensor quantized per tensor, bit for "
          "bit; an inf or NaN is the same error on every rank") {
  constexpr int world = 3;
  constexpr std::size_t n = 301;  // slots padded to 8
  for (const QuantFormat f : {QuantFormat::f8e4m3_tensor, QuantFormat::f8e5m2_tensor}) {
    CAPTURE(fsdp::name_of(f));
    // Every shard back to back, quantized as one tensor by the public functions and back.
    std::vector<float> all;
    for (int r = 0; r < world; ++r) {
      const auto x = shard_of(r, n);
      all.insert(all.end(), x.begin(), x.end());
    }
    std::vector<std::uint8_t> q(all.size());
    std::vector<float> want(all.size());
    float scale = 0;
    if (f == QuantFormat::f8e4m3_tensor) {
      fsdp::quantize_f8e4m3_tensor(all, q, scale);
      fsdp::dequantize_f8e4m3_tensor(q, scale, want);
    } else {
      fsdp::quantize_f8e5m2_tensor(all, q, scale);
      fsdp::dequantize_f8e5m2_tensor(q, scale, want);
    }
    const auto [errors, got, counts, live_after] = run_gather(world, f, 0, n);
    const std::size_t slot = (8 + n + 7) / 8 * 8;  // the status, the codes: no scales
    CHECK(fsdp::quantized_slot_bytes(f, n, 0) == slot);
    for (std::size_t i = 0; i < world; ++i) {
      CAPTURE(i);
      CHECK(errors[i].empty());
      CHECK(same_bits(got[i], want));
      CHECK(got[i] != all);  // it did round
      CHECK(counts[i][fsdp::Collective::all_reduce].calls == 0);
      CHECK(counts[i][fsdp::Collective::all_gather].calls == 2);  // the amaxes, 4 bytes a rank, then the slots
      CHECK(counts[i][fsdp::Collective::all_gather].bytes == 4 * world + slot * world);
      CHECK(live_after[i] == 0);
    }
    // An inf or NaN: the lowest rank's first such element is named on every rank.
    std::vector<char> untouched(world, 0);
    const auto bad = test_support::errors_per_rank(world, [&](fsdp::ThreadComm& comm) {
      HostDevice device;
      std::vector<float> shard = shard_of(comm.rank(), n);
      if (comm.rank() == 1) shard[217] = std::numeric_limits<float>::quiet_NaN(), shard[250] = -INFINITY;
      if (comm.rank() == 2) shard[5] = INFINITY;
      std::vector<float> full(n * world, -1.0f);
      try {
        fsdp::quantized_all_gather(comm, device, f, 0, shard.data(), n, full.data());
      } catch (...) {
        untouched[static_cast<std::size_t>(comm.rank())] =
            std::all_of(full.begin(), full.end(), [](float v) { return v == -1.0f; }) &&
            device.stats(fsdp::MemorySpace::device).live_bytes == 0;
        throw;
      }
    });
    for (std::size_t i = 0; i < world; ++i) {
      CAPTURE(bad[i]);
      CHECK(contains(bad[i], "quantized_all_gather (" + std::string(fsdp::name_of(f)) + ", 301 values per rank) on rank " +
                                 std::to_string(i) + ": rank 1's shard holds an inf or NaN at element 217"));
      CHECK(untouched[i]);
    }
  }
}

TEST_CASE("quantized_all_gather: one rank, a block longer than the shard, and an empty shard") {
  const auto errors = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
    HostDevice device;
    const std::vector<float> shard = shard_of(0, 5);
    std::vector<float> full(5, -1.0f);
    fsdp::quantized_all_gather(comm, device, QuantFormat::int8_blocks, 128, shard.data(), 5, full.data());
    CHECK(same_bits(full, test_support::quantize_round_trip(QuantFormat::int8_blocks, shard, 128)));
    fsdp::quantized_all_gather(comm, device, QuantFormat::mxfp8, 32, shard.data(), 0, full.data());  // nothing to move
    CHECK(same_bits(full, test_support::quantize_round_trip(QuantFormat::int8_blocks, shard, 128)));
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
  });
  CHECK(errors[0].empty());
}

// HostDevice whose synchronize() throws at its `fail_at`-th call: each wait of the gather
// in turn, the cleanup's included.
struct FailingWait : HostDevice {
  int fail_at = -1, waits = 0;
  void synchronize() {
    if (waits++ == fail_at) throw fsdp::Error("injected wait failure");
    HostDevice::synchronize();
  }
};
static_assert(fsdp::QuantizingDevice<FailingWait>);

TEST_CASE("quantized_all_gather: a device that fails at any of its waits: the error leaves, the scratch is freed") {
  int waits = 0;
  {  // how many waits a gather makes
    const auto errors = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
      FailingWait device;
      const std::vector<float> shard = shard_of(0, 100);
      std::vector<float> full(100);
      fsdp::quantized_all_gather(comm, device, QuantFormat::int8_blocks, 32, shard.data(), 100, full.data());
      waits = device.waits;
    });
    REQUIRE(errors[0].empty());
  }
  REQUIRE(waits >= 3);
  for (int at = 0; at < waits; ++at) {
    CAPTURE(at);
    std::size_t live = 1;
    const auto errors = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
      FailingWait device;
      device.fail_at = at;
      const std::vector<float> shard = shard_of(0, 100);
      std::vector<float> full(100);
      try {
        fsdp::quantized_all_gather(comm, device, QuantFormat::int8_blocks, 32, shard.data(), 100, full.data());
      } catch (...) {
        live = device.stats(fsdp::MemorySpace::device).live_bytes;
        throw;
      }
    });
    CHECK(contains(errors[0], "injected wait failure"));
    CHECK(live == 0);
  }
}

TEST_CASE("quantized_all_gather: a block size the format does not take is refused on every rank before any collective") {
  const auto errors = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    fsdp::CountingCommunicator<fsdp::ThreadComm> counted(comm);
    HostDevice device;
    std::vector<float> shard(64, 1.0f), full(128);
    try {
      fsdp::quantized_all_gather(counted, device, QuantFormat::mxfp8, 128, shard.data(), 64, full.data());
    } catch (...) {
      CHECK(counted.counts()[fsdp::Collective::all_gather].calls == 0);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
      throw;
    }
  });
  for (const std::string& e : errors) CHECK(contains(e, "quantized_all_gather: mxfp8 needs block = 32 (the MX block), got block = 128"));
}

TEST_CASE("HostDevice quantizes as the host functions do, writing a block with an inf or NaN as NaNs and naming it") {
  HostDevice device;
  CHECK_FALSE(device.quantize_nonfinite().has_value());
  std::vector<float> x = shard_of(0, 200);
  x[130] = std::numeric_limits<float>::quiet_NaN();
  x[190] = INFINITY;
  std::vector<std::int8_t> q(200, 0x55), want(200, 0x55);
  std::vector<float> scales(2, -1.0f), want_scales(2, -1.0f);
  fsdp::quantize_int8_blocks(std::span<const float>(x).first(128), std::span<std::int8_t>(want).first(128),
                             std::span<float>(want_scales).first(1), 128);
  device.quantize(QuantFormat::int8_blocks, x.data(), 200, q.data(), scales.data(), 128);
  std::vector<std::int8_t> q2(50, 0x55);
  float scale2 = -1.0f;
  device.quantize(QuantFormat::int8_blocks, x.data() + 150, 50, q2.data(), &scale2, 128);  // element 40 is inf
  CHECK(device.quantize_nonfinite() == std::optional<std::size_t>(40));  // the lowest since the last check
  CHECK_FALSE(device.quantize_nonfinite().has_value());                   // forgotten
  // Block 0 as the host function writes it; block 1 (and the second call's only block) a
  // NaN block: zero codes and a NaN scale.
  CHECK(std::equal(q.begin(), q.begin() + 128, want.begin()));
  CHECK(std::all_of(q.begin() + 128, q.end(), [](std::int8_t c) { return c == 0; }));
  CHECK(std::all_of(q2.begin(), q2.end(), [](std::int8_t c) { return c == 0; }));
  CHECK(scales[0] == want_scales[0]);
  CHECK(std::isnan(scales[1]));
  CHECK(std::isnan(scale2));
  std::vector<float> back(200);
  device.dequantize(QuantFormat::int8_blocks, q.data(), scales.data(), 200, back.data(), 128);
  std::vector<float> host_back(128);
  fsdp::dequantize_int8_blocks(std::span<const std::int8_t>(want).first(128), std::span<const float>(want_scales).first(1),
                               host_back, 128);
  CHECK(same_bits(std::vector<float>(back.begin(), back.begin() + 128), host_back));
  CHECK(std::all_of(back.begin() + 128, back.end(), [](float v) { return std::isnan(v); }));  // never a number
  for (QuantFormat f : {QuantFormat::f8e4m3_blocks, QuantFormat::f8e5m2_blocks, QuantFormat::mxfp8}) {  // the other formats' NaN blocks
    CAPTURE(fsdp::name_of(f));
    std::vector<std::uint8_t> codes(200, 0x55), sc(7 * 4, 0x55);
    device.quantize(f, x.data(), 200, codes.data(), sc.data(), 32);
    CHECK(device.quantize_nonfinite() == std::optional<std::size_t>(130));
    std::vector<float> y(200);
    device.dequantize(f, codes.data(), sc.data(), 200, y.data(), 32);
    for (std::size_t i = 0; i < 200; ++i) {
      const bool bad_block = i / 32 == 130 / 32 || i / 32 == 190 / 32;
      if (bad_block != std::isnan(y[i])) FAIL_CHECK("element " << i << " is " << y[i]);
    }
  }
  CHECK(contains(test_support::error_of([&] { device.quantize(QuantFormat::int8_blocks, x.data(), 1, q.data(), scales.data(), 0); }),
                 "HostDevice::quantize: int8_blocks needs a positive block, got block = 0"));
}

}  // namespace core_quantized_all_gather_test
