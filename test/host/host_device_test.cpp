// fsdp/host/host_device.hpp: byte accounting per memory space, alignment, and the
// element-wise operations (copy, fill_zero, scale, accumulate).
#include <doctest/doctest.h>

#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/host/host_device.hpp"
#include "test/support/device_accounting.hpp"

namespace host_host_device_test {

namespace {

using fsdp::DType;
using fsdp::HostDevice;
using fsdp::MemorySpace;

constexpr MemorySpace kDev = MemorySpace::device;
constexpr MemorySpace kHost = MemorySpace::host;

// Reference rounding of an exact (double) value to bfloat16 (8 significant bits), written
// independently of the library: scale the quantum of x's binade to 1 and round the
// scaled value to the nearest integer with the default ties-to-even mode.
float ref_round_bf16(double x) {
  if (x == 0 || std::isnan(x) || std::isinf(x)) return static_cast<float>(x);
  const int e = std::max(std::ilogb(x), -126);  // below 2^-126: bf16 subnormal spacing
  const double quantum = std::ldexp(1.0, e - 7);
  const double r = std::nearbyint(x / quantum) * quantum;
  return static_cast<float>(r);  // exact (or +-inf past the top)
}

std::uint16_t bf16_bits_of(float exact_bf16_value) {
  const auto u = std::bit_cast<std::uint32_t>(exact_bf16_value);
  REQUIRE((u & 0xffffu) == 0u);
  return static_cast<std::uint16_t>(u >> 16);
}

float bf16_value(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

// Random bf16 values with a spread of magnitudes and signs.
std::vector<std::uint16_t> random_bf16(std::mt19937& rng, std::size_t n) {
  std::uniform_int_distribution<int> exp(120, 134), mant(0, 127), sign(0, 1);
  std::vector<std::uint16_t> v(n);
  for (auto& h : v) h = static_cast<std::uint16_t>(sign(rng) << 15 | exp(rng) << 7 | mant(rng));
  return v;
}

// Random floats in [-8, 8) with all 24 mantissa bits in use.
std::vector<float> random_f32(std::mt19937& rng, std::size_t n) {
  std::uniform_real_distribution<float> d(-8.0f, 8.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("HostDevice models fsdp::Device and identifies as cpu:0") {
  static_assert(fsdp::Device<HostDevice>);
  HostDevice dev;
  CHECK(dev.id() == fsdp::DeviceId{fsdp::DeviceKind::cpu, 0});
  CHECK(HostDevice::alignment == 64);
  dev.synchronize();  // no-op, must be callable
}

TEST_CASE("live, peak and allocation counts per memory space") {
  HostDevice dev;
  test_support::check_memory_accounting(dev, [](void* d, void* h) { CHECK(d != h); });
}

TEST_CASE("the default memory space is device") {
  HostDevice dev;
  void* p = dev.allocate(64);
  CHECK(dev.stats().live_bytes == 64);
  CHECK(dev.stats(kDev).live_bytes == 64);
  CHECK(dev.stats(kHost).live_bytes == 0);
  dev.deallocate(p, 64);
  CHECK(dev.stats(kDev).live_bytes == 0);
}

TEST_CASE("reset_peak sets peak to live, per space") {
  HostDevice dev;
  void* a = dev.allocate(500, kDev);
  void* b = dev.allocate(700, kHost);
  dev.deallocate(a, 500, kDev);
  void* c = dev.allocate(40, kDev);
  CHECK(dev.stats(kDev).peak_bytes == 500);
  dev.reset_peak(kDev);
  CHECK(dev.stats(kDev).peak_bytes == 40);
  CHECK(dev.stats(kDev).live_bytes == 40);
  CHECK(dev.stats(kHost).peak_bytes == 700);  // untouched
  void* e = dev.allocate(10, kDev);
  CHECK(dev.stats(kDev).peak_bytes == 50);    // grows from the new baseline
  dev.deallocate(b, 700, kHost);
  dev.reset_peak(kHost);
  CHECK(dev.stats(kHost).peak_bytes == 0);
  dev.deallocate(c, 40, kDev);
  dev.deallocate(e, 10, kDev);
}

TEST_CASE("zero-byte allocations change no byte counts") {
  HostDevice dev;
  void* keep = dev.allocate(32, kDev);
  for (MemorySpace s : {kDev, kHost}) {
    void* p = dev.allocate(0, s);
    CHECK(dev.stats(kDev).live_bytes == 32);
    CHECK(dev.stats(kDev).peak_bytes == 32);
    CHECK(dev.stats(kHost).live_bytes == 0);
    CHECK(dev.stats(kHost).peak_bytes == 0);
    CHECK_NOTHROW(dev.deallocate(p, 0, s));
    CHECK(dev.stats(kDev).live_bytes == 32);
  }
  // fill_zero / copy of zero bytes are fine on whatever a zero-byte allocation returned.
  void* z = dev.allocate(0, kDev);
  CHECK_NOTHROW(dev.fill_zero(z, 0));
  CHECK_NOTHROW(dev.copy(z, z, 0));
  dev.deallocate(z, 0, kDev);
  dev.deallocate(keep, 32, kDev);
  CHECK(dev.stats(kDev).live_bytes == 0);
}

TEST_CASE("deallocating more than is live throws fsdp::Error and leaves the counts alone") {
  HostDevice dev;
  void* a = dev.allocate(128, kDev);
  CHECK_THROWS_AS(dev.deallocate(a, 129, kDev), fsdp::Error);
  CHECK(dev.stats(kDev).live_bytes == 128);
  // Device bytes cannot be freed from the host space's account.
  CHECK_THROWS_AS(dev.deallocate(a, 128, kHost), fsdp::Error);
  CHECK(dev.stats(kHost).live_bytes == 0);
  CHECK(dev.stats(kDev).live_bytes == 128);
  try {
    dev.deallocate(a, 1000, kDev);
    FAIL("expected fsdp::Error");
  } catch (const fsdp::Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("1000") != std::string::npos);  // says how much was asked
    CHECK(msg.find("128") != std::string::npos);   // and how much is live
  }
  dev.deallocate(a, 128, kDev);  // the right size still works
  CHECK(dev.stats(kDev).live_bytes == 0);
}

TEST_CASE("returned pointers are 64-byte aligned") {
  HostDevice dev;
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t bytes : {1, 2, 3, 7, 8, 63, 64, 65, 100, 127, 128, 129, 1000, 4095, 4096, 1 << 20}) {
    for (MemorySpace s : {kDev, kHost}) {
      void* p = dev.allocate(bytes, s);
      REQUIRE(p != nullptr);
      CAPTURE(bytes);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
      std::memset(p, 0xab, bytes);  // the whole block is usable
      blocks.emplace_back(p, bytes);
    }
  }
  for (std::size_t i = 0; i < blocks.size(); ++i)
    dev.deallocate(blocks[i].first, blocks[i].second, i % 2 ? kHost : kDev);
  CHECK(dev.stats(kDev).live_bytes == 0);
  CHECK(dev.stats(kHost).live_bytes == 0);
}

TEST_CASE("copy and fill_zero") {
  HostDevice dev;
  const std::size_t n = 1000;
  auto* src = static_cast<unsigned char*>(dev.allocate(n, kHost));
  auto* dst = static_cast<unsigned char*>(dev.allocate(n, kDev));
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 7 + 3);
  std::memset(dst, 0x5a, n);

  dev.copy(dst + 10, src + 20, 500);  // host -> device, offsets
  dev.synchronize();
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char want = (i >= 10 && i < 510) ? static_cast<unsigned char>((i + 10) * 7 + 3) : 0x5a;
    if (dst[i] != want) { INFO("byte " << i); CHECK(dst[i] == want); break; }
  }

  dev.copy(src, dst, n);  // device -> host
  CHECK(std::memcmp(src, dst, n) == 0);

  dev.fill_zero(dst + 100, 250);
  for (std::size_t i = 0; i < n; ++i) {
    const bool zeroed = i >= 100 && i < 350;
    if (zeroed ? dst[i] != 0 : dst[i] != src[i]) { INFO("byte " << i); CHECK(false); break; }
  }
  dev.deallocate(src, n, kHost);
  dev.deallocate(dst, n, kDev);
}

TEST_CASE("scale on f32") {
  HostDevice dev;
  std::mt19937 rng(1);
  const auto orig = random_f32(rng, 4096);
  // Factors that are floats: the exact product rounded once to float is the answer
  // (computed in double, which is exact for a float times a float, then rounded).
  for (double factor : {0.5, -0.25, 3.0, 1.0 / 1024, 0.1f + 0.0, -7.5}) {
    CAPTURE(factor);
    auto v = orig;
    dev.scale(v.data(), v.size(), DType::f32, factor);
    int bad = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const float want = static_cast<float>(static_cast<double>(orig[i]) * factor);
      if (v[i] != want && ++bad <= 3) { INFO("i=" << i); CHECK(v[i] == want); }
    }
    CHECK(bad == 0);
  }
  // A factor that is not a float (the 1/N of a gradient average): within float rounding.
  auto v = orig;
  dev.scale(v.data(), v.size(), DType::f32, 1.0 / 3);
  for (std::size_t i = 0; i < v.size(); ++i)
    CHECK(v[i] == doctest::Approx(orig[i] / 3.0).epsilon(3e-7));
  // count limits the range.
  v = orig;
  dev.scale(v.data(), 10, DType::f32, 2.0);
  CHECK(v[9] == orig[9] * 2);
  CHECK(v[10] == orig[10]);
}

TEST_CASE("scale on f64") {
  HostDevice dev;
  std::vector<double> v(1000), orig(1000);
  for (std::size_t i = 0; i < v.size(); ++i) orig[i] = static_cast<double>(static_cast<int>(i) - 500);
  // Integers times powers of two are exact: compare against division.
  v = orig;
  dev.scale(v.data(), v.size(), DType::f64, 0.125);
  for (std::size_t i = 0; i < v.size(); ++i) CHECK(v[i] == orig[i] / 8);
  v = orig;
  dev.scale(v.data(), v.size(), DType::f64, -3.0);
  for (std::size_t i = 0; i < v.size(); ++i) CHECK(v[i] == -(orig[i] + orig[i] + orig[i]));
  // Not truncated to float precision.
  double x = 1.0 + std::ldexp(1.0, -40);
  dev.scale(&x, 1, DType::f64, 1.0 + std::ldexp(1.0, -40));
  CHECK(x == 1.0 + std::ldexp(1.0, -39) + std::ldexp(1.0, -80));
}

TEST_CASE("scale on integers multiplies by the factor, not by the factor truncated") {
  HostDevice dev;
  std::vector<std::int32_t> v(201), orig(201);
  for (std::size_t i = 0; i < v.size(); ++i) orig[i] = static_cast<std::int32_t>(i) - 100;
  for (double factor : {0.5, 2.5, -1.25, 3.0}) {
    CAPTURE(factor);
    v = orig;
    dev.scale(v.data(), v.size(), DType::i32, factor);
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::int32_t want = orig[i];
      want *= factor;  // the documented p[i] *= factor, as C++ evaluates it
      CHECK(v[i] == want);
    }
  }
  std::int64_t big = std::int64_t{1} << 40;
  dev.scale(&big, 1, DType::i64, 0.25);
  CHECK(big == std::int64_t{1} << 38);
}

TEST_CASE("scale on bf16 rounds the product to bf16, ties to even") {
  HostDevice dev;
  std::mt19937 rng(2);
  const auto orig = random_bf16(rng, 4096);
  for (double factor : {0.5, 3.0, -1.5, 0.1f + 0.0, 1.0 / 7}) {
    CAPTURE(factor);
    const double f = static_cast<float>(factor);  // the factor as the kernel sees it, a float
    auto v = orig;
    dev.scale(v.data(), v.size(), DType::bf16, factor);
    int bad = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::uint16_t want = bf16_bits_of(ref_round_bf16(static_cast<double>(bf16_value(orig[i])) * f));
      if (v[i] != want && ++bad <= 3) { INFO("i=" << i << " x=" << bf16_value(orig[i])); CHECK(v[i] == want); }
    }
    CHECK(bad == 0);
  }
  // A product exactly halfway between two bf16 values: 1.0078125 (1 + 2^-7, odd
  // mantissa) times 1.5 = 1.51171875, halfway between 1.5078125 and 1.515625 (even).
  std::uint16_t h = bf16_bits_of(1.0f + 1.0f / 128);
  dev.scale(&h, 1, DType::bf16, 1.5);
  CHECK(bf16_value(h) == 1.515625f);
}

TEST_CASE("accumulate on f32, f64 and bf16") {
  HostDevice dev;
  std::mt19937 rng(3);
  SUBCASE("f32") {
    auto a = random_f32(rng, 4096), b = random_f32(rng, 4096);
    for (std::size_t i = 0; i < b.size(); i += 7) b[i] *= 1e-6f;  // unequal exponents: rounding
    const auto a0 = a, b0 = b;
    dev.accumulate(a.data(), b.data(), a.size(), DType::f32);
    int bad = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      // float + float in double is exact; one rounding to float is the IEEE float sum.
      const float want = static_cast<float>(static_cast<double>(a0[i]) + static_cast<double>(b[i]));
      if (a[i] != want && ++bad <= 3) { INFO("i=" << i); CHECK(a[i] == want); }
    }
    CHECK(bad == 0);
    CHECK(b == b0);  // the source is only read
  }
  SUBCASE("f64") {
    std::vector<double> a(1000), b(1000);
    for (std::size_t i = 0; i < a.size(); ++i) { a[i] = static_cast<double>(i) * 0.5; b[i] = 1000.0 - static_cast<double>(i); }
    dev.accumulate(a.data(), b.data(), a.size(), DType::f64);
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == 1000.0 - static_cast<double>(i) * 0.5);
    // Precision beyond float.
    double x = 1.0, y = std::ldexp(1.0, -40);
    dev.accumulate(&x, &y, 1, DType::f64);
    CHECK(x == 1.0 + std::ldexp(1.0, -40));
  }
  SUBCASE("bf16") {
    auto a = random_bf16(rng, 4096);
    const auto b = random_bf16(rng, 4096);
    const auto a0 = a;
    dev.accumulate(a.data(), b.data(), a.size(), DType::bf16);
    int bad = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double exact = static_cast<double>(bf16_value(a0[i])) + static_cast<double>(bf16_value(b[i]));
      const std::uint16_t want = bf16_bits_of(ref_round_bf16(exact));
      if (a[i] != want && ++bad <= 3) { INFO("i=" << i); CHECK(a[i] == want); }
    }
    CHECK(bad == 0);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even gives 1; 1 + 3*2^-8 is
    // halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
    std::uint16_t one = bf16_bits_of(1.0f), tiny = bf16_bits_of(1.0f / 256);
    dev.accumulate(&one, &tiny, 1, DType::bf16);
    CHECK(bf16_value(one) == 1.0f);
    std::uint16_t x = bf16_bits_of(1.0f + 1.0f / 128);
    dev.accumulate(&x, &tiny, 1, DType::bf16);
    CHECK(bf16_value(x) == 1.0f + 1.0f / 64);
  }
}

TEST_CASE("HostDevice::cast converts between every floating dtype, rounding to nearest even") {
  fsdp::HostDevice dev;
  const std::vector<float> src{1.0f, -2.5f, 3.14159265f, 65519.99f, 1e-8f, -0.0f, 70000.0f};
  std::vector<std::uint16_t> bf(src.size()), hf(src.size());
  dev.cast(bf.data(), fsdp::DType::bf16, src.data(), fsdp::DType::f32, src.size());
  dev.cast(hf.data(), fsdp::DType::f16, src.data(), fsdp::DType::f32, src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    CHECK(bf[i] == fsdp::float_to_bf16_bits(src[i]));
    CHECK(hf[i] == fsdp::float_to_f16_bits(src[i]));
  }
  std::vector<double> wide(src.size());
  dev.cast(wide.data(), fsdp::DType::f64, hf.data(), fsdp::DType::f16, src.size());  // 16-bit -> f64: exact
  for (std::size_t i = 0; i < src.size(); ++i) CHECK(wide[i] == static_cast<double>(fsdp::f16_bits_to_float(hf[i])));
  std::vector<std::uint16_t> back(src.size());
  dev.cast(back.data(), fsdp::DType::bf16, hf.data(), fsdp::DType::f16, src.size());  // 16 -> 16 through float
  for (std::size_t i = 0; i < src.size(); ++i) CHECK(back[i] == fsdp::float_to_bf16_bits(fsdp::f16_bits_to_float(hf[i])));
  std::vector<float> same(src.size());
  dev.cast(same.data(), fsdp::DType::f32, src.data(), fsdp::DType::f32, src.size());  // same dtype: a copy
  CHECK(std::memcmp(same.data(), src.data(), 4 * src.size()) == 0);
  CHECK(dev.stats().allocations == 0);  // casting allocates nothing
}

TEST_CASE("HostDevice::cast from f64 and i64 rounds once, not twice through float") {
  fsdp::HostDevice dev;
  // Just above the bf16 midpoint between 1 and 1 + 2^-7: float would round it onto the
  // midpoint, and then to the even 1.0.
  const double x = 1.0039062509313226;
  std::uint16_t h = 0;
  dev.cast(&h, fsdp::DType::bf16, &x, fsdp::DType::f64, 1);
  CHECK(h == 0x3f81);
  const double y = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);  // likewise for f16
  dev.cast(&h, fsdp::DType::f16, &y, fsdp::DType::f64, 1);
  CHECK(fsdp::f16_bits_to_float(h) == 1.0f + std::ldexp(1.0f, -10));
  const std::int64_t big = (std::int64_t{1} << 60) + (std::int64_t{1} << 36) + 1;  // above a float midpoint
  float f = 0;
  dev.cast(&f, fsdp::DType::f32, &big, fsdp::DType::i64, 1);
  CHECK(f == std::ldexp(1.0f, 60) + std::ldexp(1.0f, 37));
  const double nan = std::numeric_limits<double>::quiet_NaN();  // no integer holds NaN
  std::int32_t i = 7;
  CHECK_THROWS_AS(dev.cast(&i, fsdp::DType::i32, &nan, fsdp::DType::f64, 1), fsdp::Error);
  CHECK(i == 7);
}

TEST_CASE("unscale multiplies in double, rounds once, and reports inf/NaN after rounding, once") {
  static_assert(fsdp::UnscalingDevice<HostDevice>);
  HostDevice dev;
  CHECK_FALSE(dev.found_nonfinite());  // nothing unscaled yet
  std::vector<float> f = {3.0f, -6.0f, 1.0f};
  dev.unscale(f.data(), f.size(), DType::f32, 1.0 / 3.0);
  CHECK(f == std::vector<float>{1.0f, -2.0f, static_cast<float>(1.0 / 3.0)});
  CHECK_FALSE(dev.found_nonfinite());
  f = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  dev.unscale(f.data(), f.size(), DType::f32, 0.5);
  CHECK(f[0] == 0.5f);  // the rest is still unscaled
  CHECK(f[2] == 1.0f);
  std::vector<float> fine = {4.0f};
  dev.unscale(fine.data(), 1, DType::f32, 0.5);  // a later finite shard does not clear it
  CHECK(dev.found_nonfinite());
  CHECK_FALSE(dev.found_nonfinite());  // reading it clears it
  f = {3e38f};
  dev.unscale(f.data(), 1, DType::f32, 4.0);  // a finite value can overflow
  CHECK(dev.found_nonfinite());
  // f16: 120000 is a finite float but beyond f16's largest value, 65504.
  std::uint16_t h = fsdp::float_to_f16_bits(60000.0f);
  dev.unscale(&h, 1, DType::f16, 2.0);
  CHECK(std::isinf(fsdp::f16_bits_to_float(h)));
  CHECK(dev.found_nonfinite());
  h = fsdp::float_to_f16_bits(60000.0f);
  dev.unscale(&h, 1, DType::f16, 0.5);
  CHECK(fsdp::f16_bits_to_float(h) == 30000.0f);
  CHECK_FALSE(dev.found_nonfinite());
  // One rounding: 1 * (1 + 2^-11 + 2^-40) is just above the f16 midpoint 1 + 2^-11; a
  // product rounded to float first would land on it and go to the even 1.0.
  h = fsdp::float_to_f16_bits(1.0f);
  dev.unscale(&h, 1, DType::f16, 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40));
  CHECK(fsdp::f16_bits_to_float(h) == 1.0f + std::ldexp(1.0f, -10));
  std::int32_t i = 4;
  CHECK_THROWS_WITH_AS(dev.unscale(&i, 1, DType::i32, 0.5), "fsdp: HostDevice: unscale needs a floating dtype, got i32",
                       fsdp::Error);
  CHECK(i == 4);
}

}  // namespace host_host_device_test
