// fsdp/cuda/cuda_device.hpp: CudaDevice against fsdp::HostDevice. Every case that needs a
// GPU is skipped (reported as skipped by doctest, never as passed) when
// fsdp::cuda_device_count() is 0, e.g. on a build machine with the toolkit but no driver.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <span>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/quantize.hpp"
#include "fsdp/host/host_device.hpp"
#include "test/support/device_accounting.hpp"
#include "test/support/errors.hpp"
#include "test/support/gpu.hpp"

namespace {

using fsdp::CudaDevice;
using fsdp::DType;
using fsdp::HostDevice;
using fsdp::MemorySpace;

constexpr MemorySpace kDev = MemorySpace::device;
constexpr MemorySpace kHost = MemorySpace::host;

using test_support::no_gpu;

constexpr DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                          DType::i8,  DType::u8,  DType::i32, DType::i64};
constexpr DType kFloats[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

using Bytes = std::vector<unsigned char>;

// Host bytes -> fresh device buffer (owned by `dev`'s accounting) and back.
struct DeviceBuffer {
  CudaDevice& dev;
  std::size_t bytes;
  void* p;
  DeviceBuffer(CudaDevice& d, std::size_t n) : dev(d), bytes(n), p(d.allocate(n, kDev)) {}
  DeviceBuffer(CudaDevice& d, const Bytes& host) : DeviceBuffer(d, host.size()) { dev.copy(p, host.data(), bytes); }
  ~DeviceBuffer() { dev.deallocate(p, bytes, kDev); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  Bytes read() const {
    Bytes out(bytes);
    dev.copy(out.data(), p, bytes);
    dev.synchronize();
    return out;
  }
};

bool is_nan(const unsigned char* p, DType t) {
  switch (t) {
    case DType::f32: { float v; std::memcpy(&v, p, 4); return std::isnan(v); }
    case DType::f64: { double v; std::memcpy(&v, p, 8); return std::isnan(v); }
    case DType::f16: { std::uint16_t h; std::memcpy(&h, p, 2); return (h & 0x7fffu) > 0x7c00u; }
    case DType::bf16: { std::uint16_t h; std::memcpy(&h, p, 2); return (h & 0x7fffu) > 0x7f80u; }
    default: return false;
  }
}

// Bitwise equality, element by element. Where HostDevice produced a NaN by arithmetic,
// only NaN-ness is compared: CPUs and GPUs make different NaN bit patterns (x86 keeps the
// operand's sign and payload or gives 0xffc00000; NVIDIA gives 0x7fffffff).
void check_same(const Bytes& expected, const Bytes& actual, DType t, const std::string& what) {
  REQUIRE(expected.size() == actual.size());
  const std::size_t es = fsdp::size_of(t);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < expected.size() / es; ++i) {
    const unsigned char* e = expected.data() + i * es;
    const unsigned char* a = actual.data() + i * es;
    if (std::memcmp(e, a, es) == 0) continue;
    if (is_nan(e, t) && is_nan(a, t)) continue;
    if (mismatches++ < 5) {
      std::uint64_t eb = 0, ab = 0;
      std::memcpy(&eb, e, es);
      std::memcpy(&ab, a, es);
      MESSAGE(what, ": element ", i, " expected bits 0x", std::hex, eb, " got 0x", ab);
    }
  }
  CHECK_MESSAGE(mismatches == 0, what, ": ", mismatches, " mismatching elements");
}

// Values of dtype t from doubles (through HostDevice's own f64 -> t conversion).
Bytes from_doubles(const std::vector<double>& v, DType t) {
  Bytes out(v.size() * fsdp::size_of(t));
  HostDevice{}.cast(out.data(), t, v.data(), DType::f64, v.size());
  return out;
}

// Inputs for arithmetic on dtype t: every 16-bit pattern for f16/bf16 (normals,
// subnormals, zeros of both signs, infinities, NaNs), random bits plus edge values for f32/f64,
// small values for the integers (so that results stay in range: overflow is UB on the host).
Bytes arithmetic_inputs(DType t, std::mt19937_64& rng) {
  if (t == DType::f16 || t == DType::bf16) {
    std::vector<std::uint16_t> h;
    for (std::uint32_t b = 0; b < 65536; ++b) h.push_back(static_cast<std::uint16_t>(b));
    Bytes out(h.size() * 2);
    std::memcpy(out.data(), h.data(), out.size());
    return out;
  }
  if (t == DType::f32) {
    std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 1e-45f, -1e-45f, 1.17549435e-38f, 5.9e-39f,
                            3.4e38f, -3.4e38f, std::numeric_limits<float>::infinity(), 0.1f, 1.5f};
    for (int i = 0; i < 20000; ++i) {
      const float f = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
      v.push_back(std::isnan(f) ? 2.0f : f);
    }
    Bytes out(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  if (t == DType::f64) {
    std::vector<double> v = {0.0, -0.0, 1.0, 4.9e-324, -4.9e-324, 2.2250738585072014e-308, 1.7e308, 0.1};
    for (int i = 0; i < 20000; ++i) {
      const double d = std::bit_cast<double>(rng());
      v.push_back(std::isnan(d) ? 3.0 : d);
    }
    Bytes out(v.size() * 8);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  std::vector<double> v;
  const double lo = t == DType::u8 ? 0 : t == DType::i8 ? -40 : -1e6;
  const double hi = t == DType::u8 ? 80 : t == DType::i8 ? 40 : 1e6;
  std::uniform_int_distribution<std::int64_t> d(static_cast<std::int64_t>(lo), static_cast<std::int64_t>(hi));
  for (int i = 0; i < 5000; ++i) v.push_back(static_cast<double>(d(rng)));
  return from_doubles(v, t);
}

// A second operand of the same length (a shuffled copy: same value range).
Bytes shuffled(const Bytes& in, DType t, std::mt19937_64& rng) {
  const std::size_t es = fsdp::size_of(t), n = in.size() / es;
  std::vector<std::size_t> idx(n);
  for (std::size_t i = 0; i < n; ++i) idx[i] = i;
  std::shuffle(idx.begin(), idx.end(), rng);
  Bytes out(in.size());
  for (std::size_t i = 0; i < n; ++i) std::memcpy(out.data() + i * es, in.data() + idx[i] * es, es);
  return out;
}

// Cast sources of dtype `from` suitable for casting to `to`: every 16-bit pattern (NaNs
// included) for f16/bf16; for f32 and f64 random bits plus values exactly halfway between
// neighbouring f16 and bf16 values (ties), and values around the subnormal ranges; when
// either side is an integer, values inside both ranges (out-of-range is UB on the host).
Bytes cast_inputs(DType from, DType to, std::mt19937_64& rng) {
  const bool integral = !fsdp::is_floating(from) || !fsdp::is_floating(to);
  if (integral) {
    // Values both dtypes hold (a cast out of range is an error): the intersection.
    double lo = -1e6, hi = 1e6;
    for (DType t : {from, to}) {
      if (t == DType::u8) lo = std::max(lo, 0.0), hi = std::min(hi, 255.0);
      if (t == DType::i8) lo = std::max(lo, -128.0), hi = std::min(hi, 127.0);
      if (t == DType::f16) lo = std::max(lo, -60000.0), hi = std::min(hi, 60000.0);  // f16 tops out at 65504
    }
    std::uniform_real_distribution<double> d(lo, hi);
    std::vector<double> v = {0.0, lo, hi, 0.5, -0.5, 1.5, 2.5};
    for (int i = 0; i < 5000; ++i) v.push_back(fsdp::is_floating(from) ? d(rng) : std::trunc(d(rng)));
    for (double& x : v) x = std::clamp(x, lo, hi);
    return from_doubles(v, from);
  }
  if (from == DType::f16 || from == DType::bf16) return arithmetic_inputs(from, rng);  // all 65536 patterns
  std::vector<double> v;
  // Ties and near-ties of every f16 / bf16 binade, normal and subnormal.
  for (int e = -26; e <= 16; ++e) {
    for (int m : {0, 1, 2, 3, 511, 1023}) {
      const double f16_ulp = std::ldexp(1.0, std::max(e, -14) - 10);
      const double base = std::ldexp(1.0, e) + m * f16_ulp;
      for (double frac : {0.5, 0.25, 0.75, 0.5 + 1e-7, 0.5 - 1e-7}) {
        v.push_back(base + frac * f16_ulp);
        v.push_back(-(base + frac * f16_ulp));
      }
    }
  }
  for (int e = -134; e <= 127; e += 3) {
    const double bf16_ulp = std::ldexp(1.0, std::max(e, -126) - 7);
    for (int m : {0, 1, 2, 127}) {
      const double base = std::ldexp(1.0, e) + m * bf16_ulp;
      v.push_back(base + 0.5 * bf16_ulp);
      v.push_back(-(base + 0.5 * bf16_ulp));
    }
  }
  v.push_back(0.0);
  v.push_back(-0.0);
  v.push_back(65504.0);
  v.push_back(65520.0);  // the f16 overflow tie
  v.push_back(3.5e38);
  v.push_back(std::numeric_limits<double>::infinity());
  v.push_back(std::numeric_limits<double>::quiet_NaN());
  if (from == DType::f64) {
    v.push_back(1e300);
    v.push_back(1e-300);
    for (int i = 0; i < 20000; ++i) {
      std::uniform_real_distribution<double> d(-70000.0, 70000.0);
      v.push_back(d(rng));
    }
    for (int i = 0; i < 5000; ++i) {
      const double d = std::bit_cast<double>(rng());
      v.push_back(std::isnan(d) ? 1.0 : d);
    }
    return from_doubles(v, DType::f64);
  }
  std::vector<float> f;
  for (double d : v) f.push_back(static_cast<float>(d));
  for (int i = 0; i < 20000; ++i) f.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  Bytes out(f.size() * 4);
  std::memcpy(out.data(), f.data(), out.size());
  return out;
}

std::string label(const char* op, DType a, DType b = DType::f32, bool two = false) {
  std::string s = std::string(op) + " " + std::string(fsdp::name_of(a));
  if (two) s += " <- " + std::string(fsdp::name_of(b));
  return s;
}

}  // namespace

// ---- without a GPU -------------------------------------------------------------------

TEST_CASE("cuda_device_count does not throw and is never negative (0 without a driver)") {
  int n = -1;
  CHECK_NOTHROW(n = fsdp::cuda_device_count());
  CHECK(n >= 0);
  CHECK(fsdp::cuda_device_count() == n);  // asking again gives the same answer
}

// ---- on a GPU ------------------------------------------------------------------------

TEST_CASE("CudaDevice models fsdp::Device and identifies as cuda:N" * doctest::skip(no_gpu)) {
  static_assert(fsdp::Device<CudaDevice>);
  CudaDevice dev;
  CHECK(dev.id() == fsdp::DeviceId{fsdp::DeviceKind::cuda, 0});
  CHECK(dev.stream() != nullptr);
  dev.synchronize();
  CudaDevice last(fsdp::cuda_device_count() - 1);
  CHECK(last.id() == fsdp::DeviceId{fsdp::DeviceKind::cuda, fsdp::cuda_device_count() - 1});
  CHECK(last.stream() != dev.stream());
}

TEST_CASE("live, peak and allocation counts per memory space" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  test_support::check_memory_accounting(dev, [&](void* d, void* h) {
    cudaPointerAttributes attr{};
    REQUIRE(cudaPointerGetAttributes(&attr, h) == cudaSuccess);
    CHECK(attr.type == cudaMemoryTypeHost);  // pinned
    dev.synchronize();                       // stream-ordered allocation is complete
    REQUIRE(cudaPointerGetAttributes(&attr, d) == cudaSuccess);
    CHECK(attr.type == cudaMemoryTypeDevice);
    CHECK(attr.device == 0);
  });
  void* z = dev.allocate(0, kDev);  // zero-byte operations are no-ops, not CUDA errors
  CHECK_NOTHROW(dev.fill_zero(z, 0));
  CHECK_NOTHROW(dev.copy(z, z, 0));
  dev.deallocate(z, 0, kDev);
  dev.synchronize();
}

TEST_CASE("copies round-trip host <-> device and fill_zero zeroes both spaces" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  constexpr std::size_t n = (1 << 20) + 13;
  Bytes src(n);
  std::mt19937 rng(7);
  for (auto& b : src) b = static_cast<unsigned char>(rng());

  auto* pinned = static_cast<unsigned char*>(dev.allocate(n, kHost));
  void* d1 = dev.allocate(n, kDev);
  void* d2 = dev.allocate(n, kDev);
  auto* back = static_cast<unsigned char*>(dev.allocate(n, kHost));
  std::memcpy(pinned, src.data(), n);
  dev.copy(d1, pinned, n);          // host -> device
  dev.copy(d2, d1, n);              // device -> device
  dev.copy(back, d2, n);            // device -> host
  dev.synchronize();
  CHECK(std::memcmp(back, src.data(), n) == 0);

  Bytes pageable(n, 0);             // ordinary host memory works too
  dev.copy(pageable.data(), d2, n);
  dev.synchronize();
  CHECK(pageable == src);

  dev.fill_zero(static_cast<unsigned char*>(d1) + 5, n - 10);
  dev.copy(back, d1, n);
  dev.synchronize();
  CHECK(std::memcmp(back, src.data(), 5) == 0);
  CHECK(std::memcmp(back + n - 5, src.data() + n - 5, 5) == 0);
  CHECK(std::all_of(back + 5, back + n - 5, [](unsigned char c) { return c == 0; }));

  dev.fill_zero(pinned, n);         // the host (pinned) space too
  dev.synchronize();
  CHECK(std::all_of(pinned, pinned + n, [](unsigned char c) { return c == 0; }));

  dev.deallocate(pinned, n, kHost);
  dev.deallocate(back, n, kHost);
  dev.deallocate(d1, n, kDev);
  dev.deallocate(d2, n, kDev);
}

// fill_zero_batch's kernel: 300 buffers (three launches of up to 128) of awkward sizes at
// odd offsets, one of several blocks; every byte inside zeroed, every byte between kept.
TEST_CASE("fill_zero_batch zeroes each buffer exactly, over several launches" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  std::mt19937 rng(5);
  std::vector<std::size_t> sizes{1, 15, 16, 17, 32 * 1024 - 1, 32 * 1024 + 1, 5 * 32 * 1024 + 3};
  while (sizes.size() < 300) sizes.push_back(1 + rng() % 5000);
  std::size_t total = 64;
  for (auto n : sizes) total += n + 40;
  auto* d = static_cast<unsigned char*>(dev.allocate(total, kDev));
  Bytes want(total, 0xAB);
  std::vector<fsdp::ZeroSpan> spans;
  std::size_t at = 3;
  for (auto n : sizes) {
    at += rng() % 23;
    spans.push_back({d + at, n});
    std::fill(want.begin() + static_cast<std::ptrdiff_t>(at), want.begin() + static_cast<std::ptrdiff_t>(at + n), 0);
    at += n + 1 + rng() % 9;
  }
  REQUIRE(at <= total);
  spans.push_back({d + at, 0});  // empty: skipped
  Bytes pattern(total, 0xAB);
  dev.copy(d, pattern.data(), total);
  dev.fill_zero_batch(spans);
  Bytes got(total, 0);
  dev.copy(got.data(), d, total);
  dev.synchronize();
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < total; ++k) wrong += got[k] != want[k];
  CHECK(wrong == 0);
  dev.copy(d, pattern.data(), total);
  dev.fill_zero_batch(std::span<const fsdp::ZeroSpan>(spans).first(1));  // one: a memset
  dev.fill_zero_batch({});
  dev.copy(got.data(), d, total);
  dev.synchronize();
  CHECK(std::count(got.begin(), got.end(), 0) == static_cast<std::ptrdiff_t>(sizes[0]));
  dev.deallocate(d, total, kDev);
}

// cast_zeroing's fused kernel: the cast equals HostDevice's bit for bit while the same
// launch zeroes other buffers (past 128 buffers, the rest in launches of their own); a
// copy (equal dtypes) takes the two-call path, with the same result.
TEST_CASE("cast_zeroing casts like cast and zeroes like fill_zero_batch, in one launch" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  HostDevice host;
  constexpr std::size_t n = 100003;
  std::vector<float> src(n);
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (auto& x : src) x = dist(rng);
  std::vector<std::uint16_t> want(n);
  host.cast(want.data(), DType::bf16, src.data(), DType::f32, n);

  for (const std::size_t buffers : {std::size_t{3}, std::size_t{200}}) {
    CAPTURE(buffers);
    constexpr std::size_t each = 4099;
    const std::size_t total = buffers * (each + 5);
    auto* z = static_cast<unsigned char*>(dev.allocate(total, kDev));
    Bytes pattern(total, 0xCD), expect(total, 0xCD);
    std::vector<fsdp::ZeroSpan> spans;
    for (std::size_t i = 0; i < buffers; ++i) {
      spans.push_back({z + i * (each + 5) + 1, each});
      std::fill_n(expect.begin() + static_cast<std::ptrdiff_t>(i * (each + 5) + 1), each, 0);
    }
    dev.copy(z, pattern.data(), total);
    void* d_src = dev.allocate(n * 4, kDev);
    void* d_dst = dev.allocate(n * 2, kDev);
    dev.copy(d_src, src.data(), n * 4);
    dev.cast_zeroing(d_dst, DType::bf16, d_src, DType::f32, n, spans);
    std::vector<std::uint16_t> got(n);
    Bytes zeroed(total);
    dev.copy(got.data(), d_dst, n * 2);
    dev.copy(zeroed.data(), z, total);
    dev.synchronize();
    CHECK(got == want);
    CHECK(zeroed == expect);

    dev.copy(z, pattern.data(), total);  // equal dtypes: a copy and the zeroing
    void* d_copy = dev.allocate(n * 4, kDev);
    dev.cast_zeroing(d_copy, DType::f32, d_src, DType::f32, n, spans);
    std::vector<float> copied(n);
    dev.copy(copied.data(), d_copy, n * 4);
    dev.copy(zeroed.data(), z, total);
    dev.synchronize();
    CHECK(copied == src);
    CHECK(zeroed == expect);
    dev.deallocate(d_copy, n * 4, kDev);
    dev.deallocate(d_src, n * 4, kDev);
    dev.deallocate(d_dst, n * 2, kDev);
    dev.deallocate(z, total, kDev);
  }
}

// Past the grid cap (32 blocks per SM) the kernels loop over their blocks: a buffer of 2.5
// caps of 32 KiB blocks zeroed alone and beside a cast of 8 caps of elements (256 threads a
// block). On an H200 (132 SMs: a cap of 4,224 blocks) that is 330 MiB and 8.7M elements;
// the emulated test shows 4 SMs (FSDP_CUDA_EMULATOR_SMS, test/BUILD.bazel): 10 MiB and 262K,
// the same loops at a 33rd of an H200's bytes (54 s of 62 under ASan at 320 MiB).
TEST_CASE("fill_zero_batch and cast_zeroing loop past the grid cap" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  int sms = 0;
  REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.index()) == cudaSuccess);
  REQUIRE(sms > 0);
  const std::size_t cap = static_cast<std::size_t>(sms) * 32;
  const std::size_t big = (cap * 5 / 2 + 3) * (std::size_t{32} << 10), small = 4096, n = cap * 256 * 8 + 5;
  auto* z = static_cast<unsigned char*>(dev.allocate(big + small, kDev));
  Bytes pattern(big + small, 0x5A), back(big + small);
  auto count_zero = [&] {
    dev.copy(back.data(), z, big + small);
    dev.synchronize();
    return static_cast<std::size_t>(std::count(back.begin(), back.end(), 0));
  };
  const fsdp::ZeroSpan spans[] = {{z, big}, {z + big, small}};
  dev.copy(z, pattern.data(), big + small);
  dev.fill_zero_batch(spans);
  CHECK(count_zero() == big + small);

  std::vector<float> src(n);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<float>(i % 1000) * 0.25f;
  std::vector<std::uint16_t> want(n), got(n);
  HostDevice().cast(want.data(), DType::bf16, src.data(), DType::f32, n);
  void* d_src = dev.allocate(n * 4, kDev);
  void* d_dst = dev.allocate(n * 2, kDev);
  dev.copy(d_src, src.data(), n * 4);
  dev.copy(z, pattern.data(), big + small);
  dev.cast_zeroing(d_dst, DType::bf16, d_src, DType::f32, n, spans);
  dev.copy(got.data(), d_dst, n * 2);
  CHECK(count_zero() == big + small);
  CHECK(got == want);
  dev.deallocate(d_src, n * 4, kDev);
  dev.deallocate(d_dst, n * 2, kDev);
  dev.deallocate(z, big + small, kDev);
}

TEST_CASE("scale matches HostDevice bitwise for every dtype" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  HostDevice host;
  std::mt19937_64 rng(1);
  for (DType t : kAll) {
    const Bytes in = arithmetic_inputs(t, rng);
    const std::size_t n = in.size() / fsdp::size_of(t);
    for (double factor : {0.5, 1.0 / 3.0, 3.0, -2.5, 1e-3, 0.125, 1.0 / 7.0, 0.0}) {
      if (t == DType::u8 && factor < 0) continue;  // negative -> unsigned is UB on the host
      Bytes expected = in;
      host.scale(expected.data(), n, t, factor);
      DeviceBuffer buf(dev, in);
      dev.scale(buf.p, n, t, factor);
      check_same(expected, buf.read(), t, label("scale", t) + " by " + std::to_string(factor));
    }
  }
  CHECK(!dev.kernel_arch().empty());
  MESSAGE("kernels loaded from ", dev.kernel_arch());
}

TEST_CASE("accumulate matches HostDevice bitwise for every dtype" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  HostDevice host;
  std::mt19937_64 rng(2);
  for (DType t : kAll) {
    const Bytes a = arithmetic_inputs(t, rng);
    const std::size_t n = a.size() / fsdp::size_of(t);
    for (int round = 0; round < 3; ++round) {
      const Bytes b = round == 0 ? a : shuffled(a, t, rng);  // a + a, then random pairs
      Bytes expected = a;
      host.accumulate(expected.data(), b.data(), n, t);
      DeviceBuffer dst(dev, a), src(dev, b);
      dev.accumulate(dst.p, src.p, n, t);
      check_same(expected, dst.read(), t, label("accumulate", t));
    }
  }
}

TEST_CASE("unscale matches HostDevice bitwise and flags the same inf/NaN" * doctest::skip(no_gpu)) {
  static_assert(fsdp::UnscalingDevice<CudaDevice>);
  CudaDevice dev;
  HostDevice host;
  CHECK_FALSE(dev.found_nonfinite());  // no unscale yet
  std::mt19937_64 rng(5);
  for (DType t : kFloats) {
    const Bytes in = arithmetic_inputs(t, rng);  // holds inf and NaN among ordinary values
    const std::size_t n = in.size() / fsdp::size_of(t);
    // 1/65536 is exact; 1/3 rounds in double; 1e30 overflows every dtype but f64.
    for (double inv : {1.0 / 65536, 1.0 / 3.0, 1e30}) {
      Bytes expected = in;
      host.unscale(expected.data(), n, t, inv);
      DeviceBuffer buf(dev, in);
      dev.unscale(buf.p, n, t, inv);
      CHECK(dev.found_nonfinite() == host.found_nonfinite());
      check_same(expected, buf.read(), t, label("unscale", t) + " by " + std::to_string(inv));
    }
    // Several finite unscales queued, then one wait: no flag; the flag was cleared above.
    const Bytes threes = from_doubles(std::vector<double>(1000, 3.0), t);
    DeviceBuffer a(dev, threes), b(dev, threes);
    dev.unscale(a.p, 1000, t, 0.5);
    dev.unscale(b.p, 1000, t, 0.5);
    dev.unscale(b.p, 0, t, 1e300);  // nothing to look at
    CHECK_FALSE(dev.found_nonfinite());
    Bytes halves = threes;
    host.unscale(halves.data(), 1000, t, 0.5);
    check_same(halves, a.read(), t, label("unscale finite", t));
  }
  CHECK_THROWS_AS(dev.unscale(nullptr, 1, DType::i32, 0.5), fsdp::Error);
}

// A claim about the GPU's rounding: on the emulated runtime the kernel is HostDevice's own
// arithmetic, so the comparison could not fail there, and the case skips.
TEST_CASE("16-bit accumulate rounds ties to even and keeps subnormals" *
          doctest::skip(no_gpu || test_support::emulated_runtime)) {
  CudaDevice dev;
  HostDevice host;
  // bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (-> 1, even); 1 + 3*2^-8 -> 1 + 2^-6;
  // f16: 2^-24 + 2^-24 = 2^-23 (subnormals add exactly); 2048 + 1 is a tie (-> 2048).
  const std::vector<std::pair<DType, std::vector<double>>> cases = {
      {DType::bf16, {1.0, 1.0 + 1.0 / 128, 1e-40, 3.0}},
      {DType::f16, {std::ldexp(1.0, -24), 2048.0, 2050.0, 65504.0}},
  };
  const std::vector<std::vector<double>> addends = {
      {1.0 / 256, 1.0 / 256, 1e-40, 1.0 / 64},
      {std::ldexp(1.0, -24), 1.0, 1.0, 16.0},
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const DType t = cases[c].first;
    const Bytes a = from_doubles(cases[c].second, t), b = from_doubles(addends[c], t);
    Bytes expected = a;
    host.accumulate(expected.data(), b.data(), 4, t);
    DeviceBuffer dst(dev, a), src(dev, b);
    dev.accumulate(dst.p, src.p, 4, t);
    check_same(expected, dst.read(), t, label("tie accumulate", t));
  }
}

// Casts every pair of `types` on the GPU from a source in `space` and compares bitwise
// with HostDevice.
void check_casts(std::span<const DType> types, MemorySpace space, std::uint64_t seed) {
  CudaDevice dev;
  HostDevice host;
  std::mt19937_64 rng(seed);
  for (DType from : types) {
    for (DType to : types) {
      const Bytes in = cast_inputs(from, to, rng);
      const std::size_t n = in.size() / fsdp::size_of(from);
      Bytes expected(n * fsdp::size_of(to));
      host.cast(expected.data(), to, in.data(), from, n);
      auto* src = static_cast<unsigned char*>(dev.allocate(in.size(), space));
      dev.copy(src, in.data(), in.size());
      DeviceBuffer dst(dev, expected.size());
      dev.cast(dst.p, to, src, from, n);
      check_same(expected, dst.read(), to, label(space == kHost ? "cast from pinned" : "cast", to, from, true));
      dev.deallocate(src, in.size(), space);
    }
  }
}

TEST_CASE("cast matches HostDevice bitwise between every pair of dtypes" * doctest::skip(no_gpu)) {
  check_casts(kAll, kDev, 3);
}

TEST_CASE("cast reads a pinned host-space source, as offloaded shards do" * doctest::skip(no_gpu)) {
  check_casts(kFloats, kHost, 4);
}

TEST_CASE("errors are fsdp::Error naming the device and leave the counts alone" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  void* a = dev.allocate(128, kDev);
  CHECK_THROWS_AS(dev.deallocate(a, 129, kDev), fsdp::Error);
  CHECK(dev.stats(kDev).live_bytes == 128);
  CHECK_THROWS_AS(dev.deallocate(a, 128, kHost), fsdp::Error);  // wrong space's account
  CHECK(dev.stats(kHost).live_bytes == 0);
  try {
    dev.deallocate(a, 1000, kDev);
    FAIL("expected fsdp::Error");
  } catch (const fsdp::Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("1000") != std::string::npos);
    CHECK(msg.find("128") != std::string::npos);
    CHECK(msg.find("cuda:0") != std::string::npos);
  }
  dev.deallocate(a, 128, kDev);
  CHECK(dev.stats(kDev).live_bytes == 0);

  // A failing CUDA call: the message names the call, CUDA's error and the device.
  try {
    dev.allocate(std::size_t{1} << 60, kDev);
    FAIL("expected fsdp::Error");
  } catch (const fsdp::Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("cudaMallocAsync") != std::string::npos);
    CHECK(msg.find("cuda:0") != std::string::npos);
    CHECK(msg.find("cudaErrorMemoryAllocation") != std::string::npos);
    CHECK(e.kind() == fsdp::ErrorKind::out_of_memory);  // a device refusal, not a bug
  }
  CHECK(dev.stats(kDev).live_bytes == 0);
  CHECK(dev.stats(kDev).allocations == 1);
  void* b = dev.allocate(64, kDev);  // the device still works afterwards
  dev.fill_zero(b, 64);
  dev.synchronize();
  dev.deallocate(b, 64, kDev);

  // No such device. Braces: in parentheses, clang reads the macro's statement as a declaration.
  CHECK_THROWS_AS(CudaDevice{fsdp::cuda_device_count()}, fsdp::Error);
  CHECK_THROWS_AS(CudaDevice(-1), fsdp::Error);
}

TEST_CASE("the 8-bit floats: copies move them; kernel arithmetic on them is refused, naming the op" *
          doctest::skip(no_gpu)) {
  CudaDevice dev;
  void* a = dev.allocate(16, kDev);
  void* b = dev.allocate(16, kDev);
  const std::uint8_t bits[4] = {0x38, 0x40, 0x44, 0xc0};
  std::uint8_t back[4] = {};
  dev.copy(a, bits, 4);
  dev.copy(b, a, 4);
  dev.copy(back, b, 4);
  dev.synchronize();
  CHECK(std::memcmp(back, bits, 4) == 0);
  for (const DType t : {DType::f8e4m3, DType::f8e5m2, DType::e8m0}) {
    CAPTURE(fsdp::name_of(t));
    const std::string name(fsdp::name_of(t));
    auto refused = [&](const char* op, auto&& call) {
      CHECK(test_support::contains(test_support::error_of(call),
                                   std::string("CudaDevice(cuda:0): ") + op + " of " + name + ": the CUDA kernels have no"));
    };
    refused("scale", [&] { dev.scale(a, 4, t, 0.5); });
    refused("accumulate", [&] { dev.accumulate(a, b, 4, t); });
    refused("cast", [&] { dev.cast(a, DType::f32, b, t, 4); });
    refused("cast", [&] { dev.cast(a, t, b, DType::f32, 4); });
    refused("unscale", [&] { dev.unscale(a, 4, t, 0.5); });
  }
  dev.synchronize();
  dev.deallocate(a, 16, kDev);
  dev.deallocate(b, 16, kDev);
}

namespace {

using fsdp::QuantFormat;

// What HostDevice computes (fsdp/core/quantize.hpp's functions, a block holding an inf or
// NaN written as a NaN block), into byte vectors: the expected codes and scales, and the first
// non-finite element's index.
std::optional<std::size_t> host_quantize(QuantFormat f, const std::vector<float>& x, Bytes& q, Bytes& scales,
                                         std::size_t block) {
  return fsdp::detail::quantize_poisoning_nonfinite(f, x.data(), x.size(), q.data(), scales.data(), block);
}

std::vector<float> host_dequantize(QuantFormat f, const Bytes& q, const Bytes& scales, std::size_t block) {
  std::vector<float> x(q.size());
  fsdp::detail::dequantize_any(f, q.data(), scales.data(), q.size(), x.data(), block);
  return x;
}

Bytes bytes_of_floats(const std::vector<float>& v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Values that reach every branch of the encoders: per block of 32 a magnitude from float's
// subnormals to near its largest, zeros and an all-zero block, and blocks whose amax makes
// the scale exactly 1 for int8 (127), E4M3 (448) and E5M2 (57344), holding halfway cases
// (2.5, -3.5; E4M3's 1.0625 lies between 1 and 1.125; E5M2's 1.125 between 1 and 1.25,
// -1.375 between 1.25 and 1.5, 1.5 * 2^-16 between its first two subnormals) that must
// round to even.
std::vector<float> quantize_inputs(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-140, 120);
  std::vector<float> x(n);
  for (std::size_t first = 0; first < n; first += 32) {
    const std::size_t kind = (first / 32) % 9;
    const float mag = std::ldexp(1.0f, exponent(rng));
    for (std::size_t i = first; i < std::min(n, first + 32); ++i) {
      if (kind == 0) x[i] = 0.0f;
      else if (kind == 1) x[i] = (i == first) ? 127.0f : (i % 2 ? 2.5f : -3.5f) + static_cast<float>(i % 5);
      else if (kind == 2) x[i] = (i == first) ? 448.0f : (i % 2 ? 1.0625f : -1.1875f);
      else if (kind == 3) x[i] = unit(rng) * 3.0e38f;  // near FLT_MAX
      else if (kind == 4)
        x[i] = (i == first) ? 57344.0f : i % 3 == 0 ? std::ldexp(1.5f, -16) : (i % 2 ? 1.125f : -1.375f);
      else x[i] = normal(rng) * mag;
    }
  }
  return x;
}

}  // namespace

TEST_CASE("quantize and dequantize match fsdp/core/quantize.hpp bit for bit in every format" * doctest::skip(no_gpu)) {
  CudaDevice dev;
  std::mt19937_64 rng(38);
  const std::size_t n = 10000 + 37;  // no format's block divides it
  std::vector<float> x = quantize_inputs(n, rng);
  std::fill(x.begin(), x.begin() + 256, 0.0f);  // an all-zero block in every format
  const DeviceBuffer dx(dev, bytes_of_floats(x));
  struct Case {
    QuantFormat f;
    std::size_t block;
  };
  for (const Case c : {Case{QuantFormat::int8_blocks, 128}, Case{QuantFormat::int8_blocks, 50},
                       Case{QuantFormat::f8e4m3_blocks, 128}, Case{QuantFormat::f8e4m3_blocks, 7},
                       Case{QuantFormat::f8e5m2_blocks, 128}, Case{QuantFormat::f8e5m2_blocks, 7},
                       Case{QuantFormat::mxfp8, 32}}) {
    const std::string what = std::string(fsdp::name_of(c.f)) + ", block " + std::to_string(c.block);
    CAPTURE(what);
    const std::size_t blocks = (n + c.block - 1) / c.block;
    Bytes q(n), scales(blocks * fsdp::scale_bytes(c.f));
    REQUIRE_FALSE(host_quantize(c.f, x, q, scales, c.block).has_value());
    DeviceBuffer dq(dev, n), ds(dev, scales.size());
    dev.quantize(c.f, static_cast<const float*>(dx.p), n, dq.p, ds.p, c.block);
    CHECK_FALSE(dev.quantize_nonfinite().has_value());
    check_same(q, dq.read(), DType::u8, what + ": codes");
    check_same(scales, ds.read(), c.f == QuantFormat::mxfp8 ? DType::u8 : DType::f32, what + ": scales");
    // Dequantize the host's codes and scales on the device.
    const DeviceBuffer hq(dev, q), hs(dev, scales);
    DeviceBuffer out(dev, n * 4);
    dev.dequantize(c.f, hq.p, hs.p, n, static_cast<float*>(out.p), c.block);
    check_same(bytes_of_floats(host_dequantize(c.f, q, scales, c.block)), out.read(), DType::f32, what + ": dequantized");
  }
  // Every code, under scales that reach the clamp to the finite floats, zero, subnormal,
  // infinite and NaN scales: each scale a block of 256 codes. (NaN results are compared
  // as NaN only: check_same.)
  Bytes codes(256 * 8);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<unsigned char>(i % 256);
  const std::vector<float> f32_scales{1.0f, 0.0f, 3.0e38f, 1e-45f, 0.1f, 7.5e35f,
                                      std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  const Bytes e8m0_scales{127, 0, 254, 0xff, 1, 200, 128, 126};
  const DeviceBuffer dcodes(dev, codes);
  for (QuantFormat f :
       {QuantFormat::int8_blocks, QuantFormat::f8e4m3_blocks, QuantFormat::f8e5m2_blocks, QuantFormat::mxfp8}) {
    const bool mx = f == QuantFormat::mxfp8;
    const std::size_t block = mx ? 32 : 256;
    Bytes scales;
    if (mx)  // 8 blocks of 32 per group of 256 codes, all with the group's scale
      for (unsigned char s : e8m0_scales) scales.insert(scales.end(), 8, s);
    else
      scales = bytes_of_floats(f32_scales);
    const DeviceBuffer ds(dev, scales);
    DeviceBuffer out(dev, codes.size() * 4);
    dev.dequantize(f, dcodes.p, ds.p, codes.size(), static_cast<float*>(out.p), block);
    check_same(bytes_of_floats(host_dequantize(f, codes, scales, block)), out.read(), DType::f32,
               std::string(fsdp::name_of(f)) + ": every code");
  }
}

TEST_CASE("quantize writes a block holding an inf or NaN as a NaN block and names its first such element" *
          doctest::skip(no_gpu)) {
  CudaDevice dev;
  CHECK_FALSE(dev.quantize_nonfinite().has_value());  // no quantize yet
  std::mt19937_64 rng(7);
  std::vector<float> x = quantize_inputs(1000, rng);
  x[700] = std::numeric_limits<float>::infinity();
  x[300] = std::numeric_limits<float>::quiet_NaN();
  x[301] = -std::numeric_limits<float>::infinity();
  const DeviceBuffer dx(dev, bytes_of_floats(x));
  for (QuantFormat f :
       {QuantFormat::int8_blocks, QuantFormat::f8e4m3_blocks, QuantFormat::f8e5m2_blocks, QuantFormat::mxfp8}) {
    CAPTURE(fsdp::name_of(f));
    const std::size_t block = f == QuantFormat::mxfp8 ? 32 : 128;
    const std::size_t blocks = (x.size() + block - 1) / block;
    Bytes q(x.size(), 0xaa), scales(blocks * fsdp::scale_bytes(f), 0xaa);  // 0xaa: overwritten everywhere
    CHECK(host_quantize(f, x, q, scales, block) == std::optional<std::size_t>(300));
    const DeviceBuffer dq(dev, Bytes(x.size(), 0xaa)), ds(dev, Bytes(scales.size(), 0xaa));
    dev.quantize(f, static_cast<const float*>(dx.p), x.size(), dq.p, ds.p, block);
    CHECK(dev.quantize_nonfinite() == std::optional<std::size_t>(300));
    CHECK_FALSE(dev.quantize_nonfinite().has_value());  // read and cleared
    check_same(q, dq.read(), DType::u8, "codes");  // the bad blocks' zero codes too
    check_same(scales, ds.read(), DType::u8, "scales");  // and their NaN scales (0x7fc00000, 0xff)
    const DeviceBuffer dy(dev, Bytes(x.size() * sizeof(float), 0));
    dev.dequantize(f, dq.p, ds.p, x.size(), static_cast<float*>(dy.p), block);
    const Bytes y = dy.read();
    for (std::size_t i = 0; i < x.size(); ++i) {
      float v;
      std::memcpy(&v, y.data() + i * sizeof v, sizeof v);
      const bool bad_block = i / block == 300 / block || i / block == 700 / block;
      if (bad_block != std::isnan(v)) FAIL_CHECK("element " << i << " dequantizes to " << v);
    }
  }
  CHECK(test_support::contains(test_support::error_of([&] { dev.quantize(QuantFormat::mxfp8, nullptr, 1, nullptr, nullptr, 128); }),
                               "CudaDevice(cuda:0)::quantize: mxfp8 needs block = 32 (the MX block), got block = 128"));
  CHECK(test_support::contains(test_support::error_of([&] { dev.dequantize(QuantFormat::int8_blocks, nullptr, nullptr, 1, nullptr, 0); }),
                               "CudaDevice(cuda:0)::dequantize: int8_blocks needs a positive block, got block = 0"));
}

// Per-tensor scaling (TensorScalingDevice): abs_max, quantize_tensor and dequantize_tensor
// against fsdp/core/quantize.hpp's detail helpers, on values from float's subnormals to
// near its largest, with the amax read from device memory: the slice's own, a larger
// (agreed) one, zero, a subnormal one, and +inf (zero codes, NaNs back).
TEST_CASE("per-tensor abs_max, quantize_tensor and dequantize_tensor match the host helpers bit for bit" *
          doctest::skip(no_gpu)) {
  CudaDevice dev;
  std::mt19937_64 rng(5);
  const std::size_t n = 10000 + 37;
  const std::vector<float> x = quantize_inputs(n, rng);
  const DeviceBuffer dx(dev, bytes_of_floats(x));
  auto read_float = [](const DeviceBuffer& b) {
    float v;
    const Bytes bytes = b.read();
    std::memcpy(&v, bytes.data(), sizeof v);
    return v;
  };
  // abs_max over the whole input, a slice, no values, and values holding an inf or a NaN.
  DeviceBuffer damax(dev, Bytes(4, 0xaa));
  struct Slice {
    std::size_t first, count;
  };
  for (const Slice sl : {Slice{0, n}, Slice{123, 4567}, Slice{5, 0}, Slice{96, 32}}) {
    CAPTURE(sl.first);
    CAPTURE(sl.count);
    dev.abs_max(static_cast<const float*>(dx.p) + sl.first, sl.count, static_cast<float*>(damax.p));
    const float want = fsdp::detail::abs_max_or_inf(x.data() + sl.first, sl.count);
    const float got = read_float(damax);
    CHECK(std::memcmp(&got, &want, sizeof got) == 0);
  }
  for (const float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> y(x.begin(), x.begin() + 1000);
    y[777] = bad;
    const DeviceBuffer dy(dev, bytes_of_floats(y));
    dev.abs_max(static_cast<const float*>(dy.p), y.size(), static_cast<float*>(damax.p));
    const float got = read_float(damax);
    CHECK(got == std::numeric_limits<float>::infinity());  // +inf, never NaN
  }
  // max_over_rows over 3 rows (ranks) of 1000 amaxes, one of them inf.
  {
    std::vector<float> rows(3000);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = std::fabs(x[i]);
    rows[1500] = std::numeric_limits<float>::infinity();
    std::vector<float> want(1000);
    fsdp::detail::max_over_rows(rows.data(), 3, 1000, want.data());
    const DeviceBuffer drows(dev, bytes_of_floats(rows));
    DeviceBuffer dout(dev, Bytes(1000 * 4, 0xaa));
    dev.max_over_rows(static_cast<const float*>(drows.p), 3, 1000, static_cast<float*>(dout.p));
    check_same(bytes_of_floats(want), dout.read(), DType::f32, "max_over_rows");
  }
  const float local = fsdp::detail::abs_max_or_inf(x.data(), n);
  for (const QuantFormat f : {QuantFormat::f8e4m3_tensor, QuantFormat::f8e5m2_tensor}) {
    // The input's own amax (near FLT_MAX: most codes round to zero), amaxes that saturate
    // its large values and encode its small ones normally or as subnormals, 0 and inf.
    for (const float amax : {local, 1000.0f, 1.0f, 3.0e38f, 0.0f, 1e-40f, std::numeric_limits<float>::infinity()}) {
      const std::string what = std::string(fsdp::name_of(f)) + ", amax " + std::to_string(amax);
      CAPTURE(what);
      Bytes q(n);
      fsdp::detail::quantize_tensor_with_amax(f, x.data(), n, q.data(), amax);
      const DeviceBuffer da(dev, bytes_of_floats({amax}));
      DeviceBuffer dq(dev, Bytes(n, 0xaa));
      dev.quantize_tensor(f, static_cast<const float*>(dx.p), n, dq.p, static_cast<const float*>(da.p));
      check_same(q, dq.read(), DType::u8, what + ": codes");
      std::vector<float> back(n);
      fsdp::detail::dequantize_tensor_with_amax(f, q.data(), n, amax, back.data());
      DeviceBuffer dy(dev, Bytes(n * 4, 0xaa));
      dev.dequantize_tensor(f, dq.p, n, static_cast<const float*>(da.p), static_cast<float*>(dy.p));
      check_same(bytes_of_floats(back), dy.read(), DType::f32, what + ": dequantized");
    }
    // Every code, with the amaxes of a scale of 1, of a subnormal scale and near FLT_MAX.
    Bytes codes(256);
    for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<unsigned char>(i);
    const DeviceBuffer dcodes(dev, codes);
    const float qmax = fsdp::detail::tensor_qmax(f);
    for (const float amax : {qmax, 1e-42f, 3.4e38f}) {
      std::vector<float> back(256);
      fsdp::detail::dequantize_tensor_with_amax(f, codes.data(), 256, amax, back.data());
      const DeviceBuffer da(dev, bytes_of_floats({amax}));
      DeviceBuffer dy(dev, Bytes(256 * 4, 0));
      dev.dequantize_tensor(f, dcodes.p, 256, static_cast<const float*>(da.p), static_cast<float*>(dy.p));
      check_same(bytes_of_floats(back), dy.read(), DType::f32, std::string(fsdp::name_of(f)) + ": every code");
    }
  }
  CHECK(test_support::contains(
      test_support::error_of([&] { dev.quantize_tensor(QuantFormat::f8e4m3_blocks, nullptr, 1, nullptr, nullptr); }),
      "CudaDevice(cuda:0)::quantize_tensor: f8e4m3_blocks is a block format"));
  CHECK(test_support::contains(
      test_support::error_of([&] { dev.quantize(QuantFormat::f8e5m2_tensor, nullptr, 1, nullptr, nullptr, 0); }),
      "CudaDevice(cuda:0)::quantize: f8e5m2_tensor scales per tensor, not per block"));
}
