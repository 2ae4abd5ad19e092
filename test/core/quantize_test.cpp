// fsdp/core/quantize.hpp: the 8-bit wire formats of quantized collectives (issue 38).
// Specifies the bit conversions of OCP OFP8 E4M3 / E5M2 and of the MX scale E8M0, and
// block quantization to int8, E4M3 and E5M2 with f32 scales and to MXFP8 with e8m0 scales.
//
// The conversions are checked against references written here in another way: decoding
// from the sign / exponent / mantissa fields with std::ldexp, encoding by a search for the
// nearest of the 256 values (ties to the even pattern). Block quantization is checked by
// its error bounds, its scale rules and its refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/quantize.hpp"
#include "test/support/errors.hpp"
#include "test/support/sanitized.hpp"

namespace core_quantize_test {

namespace {

using test_support::contains;
using test_support::error_of;

// The smallest float >= v: a block's scale, amax / qmax rounded up, so that no code is
// clamped.
float float_at_least(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

// ---- reference OFP8 formats -------------------------------------------------------------

struct Ref8 {
  int exp_bits, mant_bits, bias;
  bool has_inf;  // e5m2: IEEE specials; e4m3 (FN): only S.1111.111 is special (NaN)
  std::uint8_t (*encode)(float, bool);
  float (*decode)(std::uint8_t);

  int exp_field(std::uint8_t b) const { return (b & 0x7f) >> mant_bits; }
  int mant_field(std::uint8_t b) const { return b & ((1 << mant_bits) - 1); }
  bool is_nan(std::uint8_t b) const {
    const bool top = exp_field(b) == (1 << exp_bits) - 1;
    if (has_inf) return top && mant_field(b) != 0;
    return top && mant_field(b) == (1 << mant_bits) - 1;
  }
  bool is_inf(std::uint8_t b) const { return has_inf && exp_field(b) == (1 << exp_bits) - 1 && mant_field(b) == 0; }

  // The value of a pattern by the textbook formula.
  double value(std::uint8_t b) const {
    if (is_nan(b)) return std::numeric_limits<double>::quiet_NaN();
    const double mag = is_inf(b) ? INFINITY
                       : exp_field(b) == 0
                           ? std::ldexp(mant_field(b), 1 - bias - mant_bits)
                           : std::ldexp(mant_field(b) + (1 << mant_bits), exp_field(b) - bias - mant_bits);
    return (b & 0x80) ? -mag : mag;
  }

  // The non-negative finite values in increasing order (pattern k has value table[k]),
  // plus the value the next pattern would have if the exponent range went on.
  std::vector<double> table() const {
    std::vector<double> t;
    for (int b = 0; b < 0x80 && !is_nan(static_cast<std::uint8_t>(b)) && !is_inf(static_cast<std::uint8_t>(b)); ++b)
      t.push_back(value(static_cast<std::uint8_t>(b)));
    t.push_back(t.back() + std::ldexp(1.0, std::ilogb(t.back()) - mant_bits));
    return t;
  }
  std::uint8_t max_pattern() const { return static_cast<std::uint8_t>(table().size() - 2); }

  // Reference encoder: nearest value, ties to the even pattern; reaching the pattern past
  // the largest finite is overflow: the largest finite when saturating, else inf (e5m2) or
  // NaN (e4m3). Returns -1 for "any NaN pattern".
  int reference_encode(const std::vector<double>& t, double x, bool saturate) const {
    if (std::isnan(x)) return -1;
    const int sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs(x);
    const int top = static_cast<int>(t.size()) - 1;  // the pattern past the largest finite
    int r;
    if (a >= t[top]) {
      r = top;
    } else {
      const int hi = static_cast<int>(std::upper_bound(t.begin(), t.end(), a) - t.begin()), lo = hi - 1;
      const double twice = 2 * a, sum = t[lo] + t[hi];
      r = twice < sum ? lo : twice > sum ? hi : (lo % 2 == 0 ? lo : hi);
    }
    if (r == top) {
      if (saturate) return sign | (top - 1);
      return has_inf ? sign | top : -1;
    }
    return sign | r;
  }

  // Checks one encoding against the reference, reporting the first mismatches.
  bool agrees(const std::vector<double>& t, float x, bool saturate) const {
    const int want = reference_encode(t, x, saturate);
    const std::uint8_t got = encode(x, saturate);
    return want < 0 ? is_nan(got) : got == want;
  }
};

const Ref8 kE4M3{4, 3, 7, false, fsdp::float_to_f8e4m3_bits, fsdp::f8e4m3_bits_to_float};
const Ref8 kE5M2{5, 2, 15, true, fsdp::float_to_f8e5m2_bits, fsdp::f8e5m2_bits_to_float};

// ---- block helpers -----------------------------------------------------------------------

double amax_of(std::span<const float> x) {
  double m = 0;
  for (float v : x) m = std::max(m, std::fabs(static_cast<double>(v)));
  return m;
}

// n values whose magnitudes differ by block (block b scaled by 2^(b % 9 - 4)), with signs,
// a few exact zeros, and values from 2^lowest (2^-12 unless given) to 1 of the block's
// magnitude.
std::vector<float> sample(std::size_t n, std::size_t block, std::uint32_t seed, double lowest = -12) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> exponent(lowest, 0);
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int b = static_cast<int>(i / block);
    const double mag = std::exp2(exponent(rng)) * std::ldexp(1.0, b % 9 - 4);
    x[i] = i % 17 == 3 ? 0.0f : static_cast<float>(rng() & 1 ? mag : -mag);
  }
  return x;
}

}  // namespace

// ---- decoding: all 256 patterns ------------------------------------------------------------

TEST_CASE("e4m3 and e5m2: each of the 256 patterns decodes to the value of its fields") {
  for (const Ref8* f : {&kE4M3, &kE5M2}) {
    int nans = 0, infs = 0;
    for (int i = 0; i < 256; ++i) {
      const auto b = static_cast<std::uint8_t>(i);
      const double want = f->value(b);
      const float got = f->decode(b);
      CAPTURE(f->exp_bits);
      CAPTURE(i);
      if (std::isnan(want)) {
        ++nans;
        CHECK(std::isnan(got));
      } else {
        infs += std::isinf(want);
        CHECK(static_cast<double>(got) == want);
        CHECK(std::signbit(got) == ((b & 0x80) != 0));  // -0 is -0
      }
    }
    // E4M3FN: one NaN per sign, no inf; E5M2: three NaNs and one inf per sign.
    CHECK(nans == (f->has_inf ? 6 : 2));
    CHECK(infs == (f->has_inf ? 2 : 0));
  }
  // Landmarks of the OFP8 spec.
  CHECK(fsdp::f8e4m3_bits_to_float(0x7e) == 448.0f);
  CHECK(fsdp::f8e4m3_bits_to_float(0x08) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(fsdp::f8e4m3_bits_to_float(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(fsdp::f8e5m2_bits_to_float(0x7b) == 57344.0f);
  CHECK(fsdp::f8e5m2_bits_to_float(0x04) == std::ldexp(1.0f, -14));
  CHECK(fsdp::f8e5m2_bits_to_float(0x01) == std::ldexp(1.0f, -16));
  CHECK(std::isinf(fsdp::f8e5m2_bits_to_float(0xfc)));
  CHECK(fsdp::f8e5m2_bits_to_float(0xfc) < 0);
}

TEST_CASE("e8m0: each of the 256 patterns decodes to 2^(bits - 127), 0xff to NaN") {
  for (int b = 0; b < 255; ++b) {
    CAPTURE(b);
    CHECK(static_cast<double>(fsdp::e8m0_bits_to_float(static_cast<std::uint8_t>(b))) == std::ldexp(1.0, b - 127));
  }
  CHECK(std::isnan(fsdp::e8m0_bits_to_float(0xff)));
  CHECK(fsdp::e8m0_bits_to_float(0) > 0);  // 2^-127: a float subnormal, not flushed to 0
}

// ---- encoding ----------------------------------------------------------------------------

TEST_CASE("e4m3 and e5m2: every value encodes to itself, every midpoint to its even neighbour") {
  for (const Ref8* f : {&kE4M3, &kE5M2}) {
    CAPTURE(f->exp_bits);
    const std::vector<double> t = f->table();
    const int top = static_cast<int>(t.size()) - 1;
    for (int k = 0; k < top; ++k) {
      CAPTURE(k);
      for (bool sat : {true, false}) {
        const int sign_bits[] = {0, 0x80};
        for (int s : sign_bits) {
          const float sign = s ? -1.0f : 1.0f;
          const auto v = static_cast<float>(t[k]);
          CHECK(f->encode(sign * v, sat) == (s | k));
          // The midpoint (exact in float: five significant bits) goes to the even pattern;
          // a float either side of it goes to the nearer neighbour.
          const auto mid = static_cast<float>((t[k] + t[k + 1]) / 2);
          REQUIRE(static_cast<double>(mid) == (t[k] + t[k + 1]) / 2);
          const int even = k % 2 == 0 ? k : k + 1;
          const float below = std::nextafter(mid, 0.0f), above = std::nextafter(mid, INFINITY);
          // Pattern `top` is past the largest finite: overflow, checked by its own case.
          if (even < top) CHECK(f->encode(sign * mid, sat) == (s | even));
          CHECK(f->encode(sign * below, sat) == (s | k));
          if (k + 1 < top) CHECK(f->encode(sign * above, sat) == (s | (k + 1)));
        }
      }
    }
  }
}

TEST_CASE("e4m3 and e5m2: saturation, overflow and NaN follow the OFP8 rules") {
  const float inf = INFINITY, nan = std::numeric_limits<float>::quiet_NaN();
  // E4M3: 448 is the largest; 480 would be next (an odd pattern), so 464 is a tie that goes
  // down to 448 and anything above it overflows: to 448 saturating, else to NaN (no inf).
  CHECK(fsdp::float_to_f8e4m3_bits(464.0f, false) == 0x7e);
  CHECK(fsdp::float_to_f8e4m3_bits(std::nextafter(464.0f, inf), false) == 0x7f);
  CHECK(fsdp::float_to_f8e4m3_bits(std::nextafter(464.0f, inf), true) == 0x7e);
  CHECK(fsdp::float_to_f8e4m3_bits(-1e30f, true) == 0xfe);
  CHECK(fsdp::float_to_f8e4m3_bits(-1e30f, false) == 0xff);
  CHECK(fsdp::float_to_f8e4m3_bits(inf) == 0x7e);  // satfinite is the default
  CHECK(fsdp::float_to_f8e4m3_bits(-inf, true) == 0xfe);
  CHECK(fsdp::float_to_f8e4m3_bits(inf, false) == 0x7f);
  CHECK((fsdp::float_to_f8e4m3_bits(nan, true) & 0x7f) == 0x7f);
  CHECK((fsdp::float_to_f8e4m3_bits(-nan, false) & 0x7f) == 0x7f);
  // E5M2: 57344 (pattern 0x7b, odd mantissa) is the largest; the tie 61440 goes up to inf.
  CHECK(fsdp::float_to_f8e5m2_bits(std::nextafter(61440.0f, 0.0f), false) == 0x7b);
  CHECK(fsdp::float_to_f8e5m2_bits(61440.0f, false) == 0x7c);
  CHECK(fsdp::float_to_f8e5m2_bits(61440.0f, true) == 0x7b);
  CHECK(fsdp::float_to_f8e5m2_bits(-1e30f, false) == 0xfc);
  CHECK(fsdp::float_to_f8e5m2_bits(-1e30f) == 0xfb);
  CHECK(fsdp::float_to_f8e5m2_bits(inf, true) == 0x7b);
  CHECK(fsdp::float_to_f8e5m2_bits(-inf, false) == 0xfc);
  CHECK(kE5M2.is_nan(fsdp::float_to_f8e5m2_bits(nan, true)));
  CHECK(kE5M2.is_nan(fsdp::float_to_f8e5m2_bits(-nan, false)));
  // Underflow: half the smallest subnormal is a tie that goes to (signed) zero.
  CHECK(fsdp::float_to_f8e4m3_bits(std::ldexp(1.0f, -10)) == 0x00);
  CHECK(fsdp::float_to_f8e4m3_bits(-std::ldexp(1.0f, -10)) == 0x80);
  CHECK(fsdp::float_to_f8e4m3_bits(std::nextafter(std::ldexp(1.0f, -10), 1.0f)) == 0x01);
  CHECK(fsdp::float_to_f8e5m2_bits(std::numeric_limits<float>::denorm_min()) == 0x00);
}

TEST_CASE("e4m3 and e5m2: a sweep of 10M floats agrees with a nearest-value search") {
  // Every float whose bit pattern is a multiple of 4099 (all exponents, NaN and inf
  // included), and every 61st float with magnitude in [2^-18, 2^17) (where the formats
  // live, both signs), in both modes; under a sanitizer every 16th of those.
  std::vector<std::uint32_t> xs;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += test_support::sweep_stride(4099)) xs.push_back(static_cast<std::uint32_t>(u));
  for (std::uint32_t u = 0x36800000u; u < 0x48000000u; u += test_support::sweep_stride(61)) {
    xs.push_back(u);
    xs.push_back(u | 0x80000000u);
  }
  for (const Ref8* f : {&kE4M3, &kE5M2}) {
    CAPTURE(f->exp_bits);
    const std::vector<double> t = f->table();
    int mismatches = 0;
    for (std::uint32_t u : xs) {
      const float x = std::bit_cast<float>(u);
      for (bool sat : {true, false}) {
        if (f->agrees(t, x, sat) || ++mismatches > 10) continue;
        INFO("x = " << x << " (bits 0x" << std::hex << u << "), saturate " << sat << ": got 0x"
                    << int{f->encode(x, sat)} << ", want 0x" << f->reference_encode(t, x, sat));
        CHECK(false);
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("e8m0: encodes the largest power of two <= |x|, clamped to [2^-127, 2^127]") {
  for (int e = -149; e <= 127; ++e) {
    CAPTURE(e);
    const auto want = static_cast<std::uint8_t>(std::max(e, -127) + 127);
    const float p = std::ldexp(1.0f, e);
    CHECK(fsdp::float_to_e8m0_bits(p) == want);
    CHECK(fsdp::float_to_e8m0_bits(-p) == want);  // the sign is ignored
    CHECK(fsdp::float_to_e8m0_bits(std::nextafter(p, INFINITY)) == want);
    if (e < 127) CHECK(fsdp::float_to_e8m0_bits(std::nextafter(std::ldexp(1.0f, e + 1), 0.0f)) == want);
  }
  CHECK(fsdp::float_to_e8m0_bits(std::numeric_limits<float>::max()) == 254);
  CHECK(fsdp::float_to_e8m0_bits(0.0f) == 0x00);
  CHECK(fsdp::float_to_e8m0_bits(-0.0f) == 0x00);
  CHECK(fsdp::float_to_e8m0_bits(INFINITY) == 0xff);
  CHECK(fsdp::float_to_e8m0_bits(-INFINITY) == 0xff);
  CHECK(fsdp::float_to_e8m0_bits(std::numeric_limits<float>::quiet_NaN()) == 0xff);
  for (int b = 0; b < 255; ++b)  // round trip of every finite scale
    CHECK(fsdp::float_to_e8m0_bits(fsdp::e8m0_bits_to_float(static_cast<std::uint8_t>(b))) == b);
}

// ---- int8 blocks -------------------------------------------------------------------------

TEST_CASE("int8 blocks: scale amax/127, each value back within half its block's scale") {
  const std::size_t block = 128, n = 1000;  // 8 blocks, the last one of 104
  const std::vector<float> x = sample(n, block, 7);
  std::vector<std::int8_t> q(n);
  std::vector<float> scales(8), back(n);
  fsdp::quantize_int8_blocks(x, q, scales);
  fsdp::dequantize_int8_blocks(q, scales, back);
  for (std::size_t b = 0; b < 8; ++b) {
    CAPTURE(b);
    const auto xs = std::span<const float>(x).subspan(b * block, std::min(block, n - b * block));
    const double amax = amax_of(xs);
    CHECK(scales[b] == float_at_least(amax / 127.0));
    for (std::size_t i = b * block; i < b * block + xs.size(); ++i) {
      CAPTURE(i);
      const double err = std::fabs(static_cast<double>(x[i]) - back[i]);
      CHECK(err <= scales[b] * (0.5 + std::ldexp(1.0, -16)));  // float quotient and product: tiny slack
      if (std::fabs(x[i]) == amax) CHECK(std::abs(int{q[i]}) == 127);
      if (x[i] == 0) CHECK(back[i] == 0.0f);
    }
  }
}

TEST_CASE("int8 blocks: ties go to even, the short last block has its own scale, zeros are exact") {
  // Blocks of 6. Block 0: amax 127, scale 1, so x / scale is x: the halves go to the even
  // integer. Block 1: amax 254, scale 2. Block 2 (short, one element): all zero, scale 0.
  const std::vector<float> x = {127, 0.5f, 1.5f, 2.5f, -2.5f, -3.5f, 254, -127, 3, 0, 5, 1, 0};
  std::vector<std::int8_t> q(x.size(), 99);  // not the expected codes or scales beforehand
  std::vector<float> scales(3, -1.0f), back(x.size());
  fsdp::quantize_int8_blocks(x, q, scales, 6);
  CHECK(scales == std::vector<float>{1, 2, 0});
  CHECK(std::vector<int>(q.begin(), q.end()) == std::vector<int>{127, 0, 2, 2, -2, -4, 127, -64, 2, 0, 2, 0, 0});
  fsdp::dequantize_int8_blocks(q, scales, back, 6);
  CHECK(back[7] == -128.0f);  // -127 / 2 = -63.5, a tie: to the even -64
  CHECK(back[9] == 0.0f);
  CHECK(back[12] == 0.0f);
  CHECK_FALSE(std::signbit(back[12]));
}

TEST_CASE("int8 and e4m3 blocks at the ends of the float range: FLT_MAX decodes finite, a subnormal amax is not clamped") {
  constexpr float top = std::numeric_limits<float>::max(), tiny = std::numeric_limits<float>::denorm_min();
  // amax FLT_MAX: 127 * scale (the scale rounded up) is past FLT_MAX; it decodes to FLT_MAX.
  const std::vector<float> big = {top, -top};
  std::vector<std::int8_t> q8(2);
  std::vector<std::uint8_t> qf(2);
  std::vector<float> scale(1), back(2);
  fsdp::quantize_int8_blocks(big, q8, scale, 2);
  fsdp::dequantize_int8_blocks(q8, scale, back, 2);
  CHECK(back == big);
  fsdp::quantize_f8e4m3_blocks(big, qf, scale, 2);
  fsdp::dequantize_f8e4m3_blocks(qf, scale, back, 2);
  CHECK(back == big);
  // amax 190 subnormal steps: its quotient by 127 is not a float; rounded down it clamped
  // the amax to 127 steps (a third off), rounded up it decodes within one scale.
  const std::vector<float> small = {190 * tiny, -95 * tiny};
  fsdp::quantize_int8_blocks(small, q8, scale, 2);
  CHECK(int{q8[0]} <= 127);
  fsdp::dequantize_int8_blocks(q8, scale, back, 2);
  for (std::size_t i = 0; i < 2; ++i) CHECK(std::fabs(static_cast<double>(back[i]) - small[i]) <= scale[0]);
  const std::vector<float> small8 = {1000 * tiny, 3 * tiny};
  fsdp::quantize_f8e4m3_blocks(small8, qf, scale, 2);
  fsdp::dequantize_f8e4m3_blocks(qf, scale, back, 2);
  CHECK(std::fabs(static_cast<double>(back[0]) - small8[0]) <= 0.0625 * small8[0] + scale[0]);
}

TEST_CASE("int8 blocks: wrong sizes, a zero block size and non-finite values are refused") {
  std::vector<float> x(300, 1.0f), back(300);
  std::vector<std::int8_t> q(300), short_q(299);
  std::vector<float> scales(3), few(2);
  std::string e = error_of([&] { fsdp::quantize_int8_blocks(x, short_q, scales); });
  CHECK(contains(e, "quantize_int8_blocks"));
  CHECK(contains(e, "q has 299"));
  e = error_of([&] { fsdp::quantize_int8_blocks(x, q, few); });
  CHECK(contains(e, "scales has 2 elements, want 3"));
  CHECK(contains(error_of([&] { fsdp::quantize_int8_blocks(x, q, scales, 0); }), "block must be positive"));
  CHECK(contains(error_of([&] { fsdp::dequantize_int8_blocks(short_q, scales, back); }), "x has 300"));
  CHECK(contains(error_of([&] { fsdp::dequantize_int8_blocks(q, few, back); }), "scales has 2"));

  x[130] = std::numeric_limits<float>::quiet_NaN();
  e = error_of([&] { fsdp::quantize_int8_blocks(x, q, scales); });
  CHECK(contains(e, "x[130] is NaN"));
  CHECK(contains(e, "(block 1)"));
  x[130] = 1;
  x[299] = -INFINITY;
  e = error_of([&] { fsdp::quantize_int8_blocks(x, q, scales); });
  CHECK(contains(e, "x[299] is inf"));
  CHECK(contains(e, "(block 2)"));
}

// ---- e4m3 and e5m2 blocks, e4m3 tensor ---------------------------------------------------

// An OFP8 format with one f32 scale per block (quantize_f8e4m3_blocks, quantize_f8e5m2_blocks).
struct F8Blocks {
  const char* name;
  double qmax;             // the largest finite value: the amax's quotient by the scale
  std::uint8_t max_code;   // its pattern
  int mant_bits;           // 3, 2
  int min_normal_exp;      // the smallest normal value is 2^min_normal_exp: 2^-6, 2^-14
  double sample_lowest;    // the round-trip test's smallest values, relative to a block's
  void (*quantize)(std::span<const float>, std::span<std::uint8_t>, std::span<float>, std::size_t);
  void (*dequantize)(std::span<const std::uint8_t>, std::span<const float>, std::span<float>, std::size_t);
};
// E5M2's values go down to 2^-34 of a block's: below its smallest subnormal (2^-16 / 57344,
// about 2^-31.8 of the amax), so the test meets its normal, subnormal and zero codes.
const F8Blocks kE4M3Blocks{"e4m3", 448, 0x7e, 3, -6, -12, fsdp::quantize_f8e4m3_blocks, fsdp::dequantize_f8e4m3_blocks};
const F8Blocks kE5M2Blocks{"e5m2", 57344, 0x7b, 2, -14, -34, fsdp::quantize_f8e5m2_blocks,
                           fsdp::dequantize_f8e5m2_blocks};

// Checks a dequantization. Where x / scale is normal in the format (>= 2^min_normal_exp),
// rounding to nearest moves it by at most half its binade's step, 2^(e - mant_bits - 1)
// for a quotient in [2^e, 2^(e+1)), so by at most 2^-(mant_bits + 1) of itself: 2^-4 for
// E4M3, 2^-3 for E5M2; the scale (a product, exact but for one float rounding) carries
// that to x. Below, the step is the smallest subnormal's, 2^(min_normal_exp - mant_bits),
// so the error is at most half of it times the scale: 2^-10 * scale (E4M3), 2^-17 * scale
// (E5M2). The slack covers the float quotient x / scale and the float product.
void check_f8_error(const F8Blocks& f, const std::vector<float>& x, const std::vector<float>& back, double scale,
                    std::size_t first, std::size_t count) {
  const double slack = 1 + std::ldexp(1.0, -16);
  for (std::size_t i = first; i < first + count; ++i) {
    CAPTURE(i);
    const double err = std::fabs(static_cast<double>(x[i]) - back[i]);
    if (std::fabs(x[i]) >= std::ldexp(scale, f.min_normal_exp))
      CHECK(err <= std::ldexp(std::fabs(x[i]), -(f.mant_bits + 1)) * slack);
    else
      CHECK(err <= std::ldexp(scale, f.min_normal_exp - f.mant_bits - 1) * slack);
    if (x[i] == 0) CHECK(back[i] == 0.0f);
  }
}
void check_e4m3_error(const std::vector<float>& x, const std::vector<float>& back, double scale, std::size_t first,
                      std::size_t count) {
  check_f8_error(kE4M3Blocks, x, back, scale, first, count);
}

TEST_CASE("e4m3 and e5m2 blocks: scale amax/448 or amax/57344, relative error within 2^-4 or 2^-3, the amax exact") {
  for (const F8Blocks* f : {&kE4M3Blocks, &kE5M2Blocks}) {
    CAPTURE(f->name);
    const std::size_t block = 128, n = 1000;
    const std::vector<float> x = sample(n, block, 11, f->sample_lowest);
    std::vector<std::uint8_t> q(n);
    std::vector<float> scales(8), back(n);
    f->quantize(x, q, scales, block);
    f->dequantize(q, scales, back, block);
    int subnormal_or_zero = 0;
    for (std::size_t b = 0; b < 8; ++b) {
      CAPTURE(b);
      const std::size_t first = b * block, count = std::min(block, n - first);
      const double amax = amax_of(std::span<const float>(x).subspan(first, count));
      CHECK(scales[b] == float_at_least(amax / f->qmax));
      check_f8_error(*f, x, back, scales[b], first, count);
      for (std::size_t i = first; i < first + count; ++i) {
        if (std::fabs(x[i]) == amax) CHECK((q[i] & 0x7f) == f->max_code);  // 448, 57344
        subnormal_or_zero += x[i] != 0 && (q[i] & 0x7f) >> f->mant_bits == 0;
      }
    }
    if (f == &kE5M2Blocks) CHECK(subnormal_or_zero > 0);  // the sample reaches below E5M2's normals
    // An all-zero block: scale 0, codes 0, exact zeros; sizes and NaN as for int8.
    std::vector<float> z = {0, 0, 0, 5}, zs(2), zb(4);
    std::vector<std::uint8_t> zq(4, 0xaa);
    f->quantize(z, zq, zs, 3);
    CHECK(zs[0] == 0.0f);
    CHECK((zq[0] == 0 && zq[1] == 0 && zq[2] == 0));
    f->dequantize(zq, zs, zb, 3);
    CHECK(zb == z);
    CHECK_FALSE(std::signbit(zb[0]));
    CHECK(error_of([&] { f->quantize(z, zq, zs, 2); }).empty());  // 2 blocks of 2: fine
    CHECK(contains(error_of([&] { f->quantize(z, zq, zs, 1); }), "quantize_f8" + std::string(f->name) + "_blocks"));
    CHECK(contains(error_of([&] { f->quantize(z, zq, zs, 1); }), "scales has 2 elements, want 4"));
    CHECK(contains(error_of([&] { f->quantize(z, std::span(zq).first(3), zs, 3); }), "q has 3"));
    CHECK(contains(error_of([&] { f->dequantize(zq, std::span(zs).first(1), zb, 3); }), "scales has 1"));
    z[3] = std::numeric_limits<float>::quiet_NaN();
    CHECK(contains(error_of([&] { f->quantize(z, zq, zs, 3); }), "(block 1)"));
  }
}

TEST_CASE("e5m2 blocks: a block worked out by hand") {
  // Blocks of 9. Block 0: amax 56, so the scale is 56 / 57344 = 2^-10 (exact) and each
  // code is E5M2 (bias 15, 2 mantissa bits) of x * 2^10:
  //   56      -> 57344 = 1.75 * 2^15: exponent 30 = 11110, mantissa 11     -> 0x7b (the largest)
  //   -1      -> -1024 = -1.0 * 2^10: exponent 25 = 11001, mantissa 00     -> 0xe4
  //   0.3f    -> 307.2: between 256 and 320 (steps of 64 in 2^8..2^9), above
  //              their midpoint 288 -> 320 = 1.25 * 2^8: 10111, 01         -> 0x5d (back: 0.3125)
  //   3.5     -> 3584 = 1.75 * 2^11: 11010, 11                             -> 0x6b
  //   -20     -> -20480 = -1.25 * 2^14: 11101, 01                          -> 0xf5
  //   0.5625  -> 576 = 1.125 * 2^9: a tie between 1.0 and 1.25, to the even
  //              mantissa 00 -> 512: 11000, 00                             -> 0x60 (back: 0.5)
  //   -1.375  -> -1408 = -1.375 * 2^10: a tie between 1.25 and 1.5, to the
  //              even mantissa 10 -> -1536: 11001, 10                      -> 0xe6 (back: -1.5)
  //   0       -> 0                                                        -> 0x00
  //   3*2^-27 -> 3 * 2^-17 = 1.5 subnormal steps of 2^-16: a tie between
  //              1 and 2 steps, to the even 2: 00000, 10                   -> 0x02 (back: 2^-25)
  // Block 1 (short): all zero, scale 0, codes 0.
  const float tiny = std::ldexp(3.0f, -27);
  const std::vector<float> x = {56, -1, 0.3f, 3.5f, -20, 0.5625f, -1.375f, 0, tiny, 0, 0};
  std::vector<std::uint8_t> q(x.size(), 0xaa);
  std::vector<float> scales(2, -1.0f), back(x.size());
  fsdp::quantize_f8e5m2_blocks(x, q, scales, 9);
  CHECK(scales == std::vector<float>{std::ldexp(1.0f, -10), 0.0f});
  CHECK(std::vector<int>(q.begin(), q.end()) ==
        std::vector<int>{0x7b, 0xe4, 0x5d, 0x6b, 0xf5, 0x60, 0xe6, 0x00, 0x02, 0x00, 0x00});
  fsdp::dequantize_f8e5m2_blocks(q, scales, back, 9);
  CHECK(back == std::vector<float>{56, -1, 0.3125f, 3.5f, -20, 0.5f, -1.5f, 0, std::ldexp(1.0f, -25), 0, 0});
  // The same block in E4M3 (scale 56 / 448 = 1/8): 3 * 2^-27 / scale = 3 * 2^-24 is below
  // half E4M3's smallest subnormal (2^-10), so it becomes 0; E5M2 kept it within 2^-3.
  std::vector<std::uint8_t> q4(x.size());
  fsdp::quantize_f8e4m3_blocks(x, q4, scales, 9);
  CHECK(scales[0] == 0.125f);
  CHECK(q4[8] == 0x00);
}

TEST_CASE("e5m2 blocks saturate at 57344: each block's amax gets the largest code, from 2^-110 to FLT_MAX") {
  // Blocks of 5, each with its own amax 2^e * (1 + u), u in [0, 1), e from -110 (the scale
  // amax / 57344 then still a normal float) to 127, one element -amax, the others smaller.
  // The scale is amax / 57344 rounded up, so amax / scale rounds to 57344 (0x7b), never
  // beyond: the saturating encoding keeps any quotient a rounding above it at 0x7b too.
  std::mt19937 rng(57344);
  std::uniform_real_distribution<double> mant(1.0, 2.0), frac(-1.0, 1.0);
  std::vector<float> x;
  for (int e = -110; e <= 127; ++e) {
    const auto amax = static_cast<float>(std::min(std::ldexp(mant(rng), e), double{std::numeric_limits<float>::max()}));
    for (int i = 0; i < 5; ++i) x.push_back(i == (e + 110) % 5 ? -amax : static_cast<float>(frac(rng)) * amax);
  }
  const std::size_t blocks = x.size() / 5;
  std::vector<std::uint8_t> q(x.size());
  std::vector<float> scales(blocks), back(x.size());
  fsdp::quantize_f8e5m2_blocks(x, q, scales, 5);
  fsdp::dequantize_f8e5m2_blocks(q, scales, back, 5);
  for (std::size_t b = 0; b < blocks; ++b) {
    CAPTURE(b);
    const auto xs = std::span<const float>(x).subspan(b * 5, 5);
    const double amax = amax_of(xs);
    CHECK(scales[b] == float_at_least(amax / 57344.0));
    for (std::size_t i = b * 5; i < b * 5 + 5; ++i) {
      CAPTURE(i);
      if (std::fabs(x[i]) == amax) {
        CHECK(q[i] == 0xfb);  // -57344
        // Back: 57344 * scale, rounded once to a float and clamped to FLT_MAX; never below
        // the amax, since the scale was rounded up.
        CHECK(back[i] == -static_cast<float>(std::min(57344.0 * scales[b], double{std::numeric_limits<float>::max()})));
        CHECK(-static_cast<double>(back[i]) >= amax);
      }
      CHECK((q[i] & 0x7f) <= 0x7b);  // never inf or NaN
    }
  }
}

TEST_CASE("e5m2 blocks through the device path: a block with an inf or NaN becomes a NaN block, the others as the host functions") {
  // Blocks of 4: block 0 finite, block 1 holds +inf, block 2 finite, block 3 NaN and -inf,
  // block 4 (short) finite.
  const float inf = INFINITY, nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {1, -2, 3, 0.25f, 5, inf, 7, 8, -100, 0.5f, 0, 6, 1, nan, -inf, 2, 9, -3};
  std::vector<std::uint8_t> q(x.size(), 0xaa);
  std::vector<float> scales(5, -1.0f);
  const auto bad = fsdp::detail::quantize_poisoning_nonfinite(fsdp::QuantFormat::f8e5m2_blocks, x.data(), x.size(),
                                                              q.data(), scales.data(), 4);
  CHECK(bad == std::optional<std::size_t>(5));  // the lowest non-finite element
  CHECK(std::isnan(scales[1]));
  CHECK(std::isnan(scales[3]));
  for (std::size_t i = 4; i < 8; ++i) CHECK(q[i] == 0);
  for (std::size_t i = 12; i < 16; ++i) CHECK(q[i] == 0);
  // The finite blocks: what quantize_f8e5m2_blocks writes for each alone.
  for (std::size_t b : {0, 2, 4}) {
    CAPTURE(b);
    const std::size_t count = std::min<std::size_t>(4, x.size() - 4 * b);
    std::vector<std::uint8_t> want(count);
    float want_scale = -1;
    fsdp::quantize_f8e5m2_blocks(std::span<const float>(x).subspan(4 * b, count), want, std::span(&want_scale, 1), 4);
    CHECK(scales[b] == want_scale);
    CHECK(std::equal(want.begin(), want.end(), q.begin() + static_cast<std::ptrdiff_t>(4 * b)));
  }
  CHECK(scales[2] == float_at_least(100.0 / 57344));
  // Back: NaN for every element of a NaN block, never a number; the others as
  // dequantize_f8e5m2_blocks gives them.
  std::vector<float> back(x.size()), want(x.size());
  fsdp::detail::dequantize_any(fsdp::QuantFormat::f8e5m2_blocks, q.data(), scales.data(), x.size(), back.data(), 4);
  fsdp::dequantize_f8e5m2_blocks(q, scales, want, 4);
  for (std::size_t i = 0; i < x.size(); ++i) {
    CAPTURE(i);
    const bool nan_block = i / 4 == 1 || i / 4 == 3;
    CHECK(std::isnan(back[i]) == nan_block);
    if (!nan_block) {
      CHECK(back[i] == want[i]);
      CHECK(std::fabs(static_cast<double>(back[i]) - x[i]) <= std::ldexp(std::fabs(x[i]), -3) * (1 + std::ldexp(1.0, -16)));
    }
  }
  CHECK(fsdp::name_of(fsdp::QuantFormat::f8e5m2_blocks) == "f8e5m2_blocks");
  CHECK(fsdp::scale_bytes(fsdp::QuantFormat::f8e5m2_blocks) == 4);
  CHECK(contains(error_of([&] { fsdp::check_quant_block(fsdp::QuantFormat::f8e5m2_blocks, 0, "here"); }),
                 "here: f8e5m2_blocks needs a positive block, got block = 0"));
  CHECK(error_of([&] { fsdp::check_quant_block(fsdp::QuantFormat::f8e5m2_blocks, 7, "here"); }).empty());
}

TEST_CASE("e4m3 tensor: one scale amax/448 over all the elements") {
  const std::vector<float> x = sample(777, 100, 5);  // magnitudes spread over 2^-16..2^4
  std::vector<std::uint8_t> q(x.size());
  std::vector<float> back(x.size());
  float scale = -1;
  fsdp::quantize_f8e4m3_tensor(x, q, scale);
  CHECK(scale == float_at_least(amax_of(x) / 448.0));
  fsdp::dequantize_f8e4m3_tensor(q, scale, back);
  check_e4m3_error(x, back, scale, 0, x.size());
  CHECK(contains(error_of([&] { fsdp::quantize_f8e4m3_tensor(x, std::span(q).first(5), scale); }), "q has 5"));
}

// ---- e5m2 tensor, and the per-tensor helpers a device's kernels share ---------------------

TEST_CASE("e5m2 tensor: one scale amax/57344 over all the elements, the codes of one block of the whole tensor") {
  const std::vector<float> x = sample(777, 100, 6, -34);
  std::vector<std::uint8_t> q(x.size()), q_block(x.size());
  std::vector<float> back(x.size());
  float scale = -1, block_scale = -1;
  fsdp::quantize_f8e5m2_tensor(x, q, scale);
  CHECK(scale == float_at_least(amax_of(x) / 57344.0));
  fsdp::quantize_f8e5m2_blocks(x, q_block, std::span<float>(&block_scale, 1), x.size());
  CHECK(q == q_block);
  CHECK(scale == block_scale);
  fsdp::dequantize_f8e5m2_tensor(q, scale, back);
  check_f8_error(kE5M2Blocks, x, back, scale, 0, x.size());
  CHECK(contains(error_of([&] { fsdp::quantize_f8e5m2_tensor(x, std::span(q).first(5), scale); }), "q has 5"));
  std::vector<float> bad = x;
  bad[500] = INFINITY;
  CHECK(contains(error_of([&] { fsdp::quantize_f8e5m2_tensor(bad, q, scale); }), "x[500] is inf"));
  // Empty: scale 0, nothing to dequantize; all zeros: scale 0, zero codes, exact zeros.
  fsdp::quantize_f8e5m2_tensor({}, {}, scale);
  CHECK(scale == 0.0f);
  fsdp::dequantize_f8e5m2_tensor({}, 1.0f, {});
  std::vector<float> zeros(9, 0.0f), zeros_back(9, -1.0f);
  std::vector<std::uint8_t> zq(9, 0xaa);
  fsdp::quantize_f8e5m2_tensor(zeros, zq, scale);
  CHECK(scale == 0.0f);
  CHECK(zq == std::vector<std::uint8_t>(9, 0));
  fsdp::dequantize_f8e5m2_tensor(zq, scale, zeros_back);
  CHECK(zeros_back == zeros);
}

TEST_CASE("per-tensor helpers: abs_max with the inf rule, quantize and dequantize with an agreed amax") {
  using fsdp::QuantFormat;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = sample(1000, 128, 7, -30);
  // abs_max: the largest |x|; 0 over no values or zeros; +inf (never NaN) for an inf or NaN.
  CHECK(fsdp::detail::abs_max_or_inf(x.data(), x.size()) == static_cast<float>(amax_of(x)));
  CHECK(fsdp::detail::abs_max_or_inf(x.data(), 0) == 0.0f);
  const std::vector<float> zeros(5, 0.0f), negzero{-0.0f};
  CHECK(fsdp::detail::abs_max_or_inf(zeros.data(), zeros.size()) == 0.0f);
  CHECK_FALSE(std::signbit(fsdp::detail::abs_max_or_inf(negzero.data(), 1)));
  for (const float bad : {inf, -inf, nan, -nan}) {
    std::vector<float> y = x;
    y[321] = bad;
    const float a = fsdp::detail::abs_max_or_inf(y.data(), y.size());
    CHECK(a == inf);
    CHECK_FALSE(std::signbit(a));
  }
  // max_over_rows: the ranks' rows of amaxes (rank-major, as gathered) into the agreed ones.
  const std::vector<float> rows{1, 5, 0, 2,  //
                                3, 2, 0, inf,  //
                                0, 7, 0, 1};
  std::vector<float> agreed(4, -1.0f);
  fsdp::detail::max_over_rows(rows.data(), 3, 4, agreed.data());
  CHECK(agreed == std::vector<float>{3, 7, 0, inf});
  fsdp::detail::max_over_rows(rows.data(), 1, 4, agreed.data());  // one rank: its own row
  CHECK(agreed == std::vector<float>{1, 5, 0, 2});
  const std::vector<float> with_nan{1, nan, 4, 2};  // never an amax: still read as poisoned
  fsdp::detail::max_over_rows(with_nan.data(), 2, 2, agreed.data());
  CHECK(agreed[0] == 4.0f);
  CHECK(agreed[1] == inf);
  struct Tensor {
    QuantFormat f;
    float qmax;
    void (*quantize)(std::span<const float>, std::span<std::uint8_t>, float&);
    void (*dequantize)(std::span<const std::uint8_t>, float, std::span<float>);
  };
  for (const Tensor t : {Tensor{QuantFormat::f8e4m3_tensor, 448.0f, fsdp::quantize_f8e4m3_tensor, fsdp::dequantize_f8e4m3_tensor},
                         Tensor{QuantFormat::f8e5m2_tensor, 57344.0f, fsdp::quantize_f8e5m2_tensor,
                                fsdp::dequantize_f8e5m2_tensor}}) {
    CAPTURE(fsdp::name_of(t.f));
    CHECK(fsdp::detail::tensor_qmax(t.f) == t.qmax);
    std::vector<std::uint8_t> want_q(x.size());
    std::vector<float> want(x.size());
    float scale = 0;
    t.quantize(x, want_q, scale);
    t.dequantize(want_q, scale, want);
    // Cut into three slices with their own amaxes, quantized with the whole tensor's
    // (the ranks' agreed max): the codes and values of the whole tensor, bit for bit.
    std::vector<std::uint8_t> q(x.size(), 0xaa);
    std::vector<float> back(x.size());
    float agreed = 0;
    const std::size_t cuts[] = {0, 300, 301, x.size()};
    for (std::size_t k = 0; k + 1 < std::size(cuts); ++k)
      agreed = std::max(agreed, fsdp::detail::abs_max_or_inf(x.data() + cuts[k], cuts[k + 1] - cuts[k]));
    for (std::size_t k = 0; k + 1 < std::size(cuts); ++k) {
      fsdp::detail::quantize_tensor_with_amax(t.f, x.data() + cuts[k], cuts[k + 1] - cuts[k], q.data() + cuts[k], agreed);
      fsdp::detail::dequantize_tensor_with_amax(t.f, q.data() + cuts[k], cuts[k + 1] - cuts[k], agreed, back.data() + cuts[k]);
    }
    CHECK(q == want_q);
    CHECK(std::memcmp(back.data(), want.data(), back.size() * sizeof(float)) == 0);
    CHECK(back != x);  // the round trip did round
    // A slice quantized with its own, smaller amax gets other codes: the agreement matters.
    std::vector<std::uint8_t> own(300);
    fsdp::detail::quantize_tensor_with_amax(t.f, x.data(), 300, own.data(), fsdp::detail::abs_max_or_inf(x.data(), 300));
    CHECK(own != std::vector<std::uint8_t>(want_q.begin(), want_q.begin() + 300));
    // Zero amax: zero codes, exact zeros; no values: nothing written.
    std::vector<std::uint8_t> zq(5, 0xaa);
    std::vector<float> zback(5, -1.0f);
    fsdp::detail::quantize_tensor_with_amax(t.f, zeros.data(), 5, zq.data(), 0.0f);
    fsdp::detail::dequantize_tensor_with_amax(t.f, zq.data(), 5, 0.0f, zback.data());
    CHECK(zq == std::vector<std::uint8_t>(5, 0));
    CHECK(zback == zeros);
    fsdp::detail::quantize_tensor_with_amax(t.f, x.data(), 0, nullptr, 1.0f);
    fsdp::detail::dequantize_tensor_with_amax(t.f, nullptr, 0, 1.0f, nullptr);
    // A non-finite agreed amax: zero codes, and NaN in every element back, never a number.
    fsdp::detail::quantize_tensor_with_amax(t.f, x.data(), x.size(), q.data(), inf);
    CHECK(q == std::vector<std::uint8_t>(x.size(), 0));
    fsdp::detail::dequantize_tensor_with_amax(t.f, want_q.data(), x.size(), inf, back.data());
    CHECK(std::all_of(back.begin(), back.end(), [](float v) { return std::isnan(v); }));
    // A slot of n codes, no scales.
    constexpr auto slot = fsdp::detail::quant_slot(QuantFormat::f8e4m3_tensor, 13, 0, false);
    static_assert(slot.scales_at == 0 && slot.codes_at == 0 && slot.used == 13 && slot.bytes == 16);
    static_assert(fsdp::detail::quant_slot(QuantFormat::f8e5m2_tensor, 16, 0, true).bytes == 24);
    static_assert(fsdp::is_per_tensor(QuantFormat::f8e5m2_tensor) && !fsdp::is_per_tensor(QuantFormat::mxfp8));
  }
  CHECK(fsdp::name_of(QuantFormat::f8e4m3_tensor) == "f8e4m3_tensor");
  CHECK(fsdp::name_of(QuantFormat::f8e5m2_tensor) == "f8e5m2_tensor");
  CHECK(contains(error_of([] { (void)fsdp::detail::tensor_qmax(QuantFormat::f8e4m3_blocks); }),
                 "f8e4m3_blocks is a block format"));
  CHECK(contains(error_of([] { fsdp::check_quant_block(QuantFormat::f8e4m3_tensor, 0, "here"); }),
                 "here: f8e4m3_tensor scales per tensor, not per block"));
}

// ---- MXFP8 -------------------------------------------------------------------------------

TEST_CASE("MXFP8: for amax = 448 * 2^k the e8m0 scale is exactly 2^k") {
  std::vector<float> x(32), back(32);
  std::vector<std::uint8_t> q(32), s(1);
  for (int k = -127; k <= 119; ++k) {
    CAPTURE(k);
    const float amax = std::ldexp(448.0f, k);
    for (std::size_t i = 0; i < 32; ++i)  // e4m3 values (patterns 0, 0x84, 0x08, ...) times 2^k
      x[i] = static_cast<float>(std::ldexp(kE4M3.value(static_cast<std::uint8_t>(i * 4 | (i % 2) << 7)), k));
    x[5] = -amax;
    fsdp::quantize_mxfp8(x, q, s);
    CHECK(int{s[0]} == k + 127);
    CHECK(fsdp::e8m0_bits_to_float(s[0]) == std::ldexp(1.0f, k));
    CHECK(q[5] == 0xfe);  // -448
    fsdp::dequantize_mxfp8(q, s, back);
    CHECK(back == x);  // every element here is an e4m3 value times 2^k
  }
}

TEST_CASE("MXFP8: no element saturates when amax / 2^floor(log2 amax) <= 1.75; above, the spec clamps") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> mant(1.0, 1.75), frac(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-100, 100);
  const std::size_t n = 32 * 200 + 7;  // the last block has 7 elements
  std::vector<float> x(n), back(n);
  for (std::size_t b = 0; b * 32 < n; ++b) {
    const std::size_t first = b * 32, count = std::min<std::size_t>(32, n - first);
    const int e = expo(rng);
    const float amax = static_cast<float>(std::ldexp(mant(rng), e));
    for (std::size_t i = first; i < first + count; ++i) x[i] = static_cast<float>(frac(rng)) * amax;
    x[first + b % count] = b % 2 ? -amax : amax;
  }
  std::vector<std::uint8_t> q(n), s(201);
  fsdp::quantize_mxfp8(x, q, s);
  fsdp::dequantize_mxfp8(q, s, back);
  for (std::size_t b = 0; b < s.size(); ++b) {
    CAPTURE(b);
    const std::size_t first = b * 32, count = std::min<std::size_t>(32, n - first);
    const double amax = amax_of(std::span<const float>(x).subspan(first, count));
    const int floor_log2 = static_cast<int>(std::floor(std::log2(amax)));
    CHECK(int{s[b]} == floor_log2 - 8 + 127);
    const double scale = std::ldexp(1.0, floor_log2 - 8);
    for (std::size_t i = first; i < first + count; ++i) {
      CAPTURE(i);
      // Not saturated: the code is the plain (non-saturating) rounding of x / scale.
      CHECK(q[i] == fsdp::float_to_f8e4m3_bits(static_cast<float>(x[i] / scale), false));
    }
    check_e4m3_error(x, back, scale * 448, first, count);
  }
  // amax = 1.9 * 2^k: scale 2^(k-8), amax / scale = 486.4 > 448, clamped to 448.
  std::vector<float> y(32, 0.0f), yb(32);
  y[0] = std::ldexp(1.9f, 3);
  std::vector<std::uint8_t> yq(32), ys(1);
  fsdp::quantize_mxfp8(y, yq, ys);
  CHECK(int{ys[0]} == 3 - 8 + 127);
  CHECK(yq[0] == 0x7e);
  fsdp::dequantize_mxfp8(yq, ys, yb);
  CHECK(yb[0] == 14.0f);  // 448 * 2^-5
  CHECK(yb[1] == 0.0f);
}

TEST_CASE("MXFP8: zero blocks, sizes and non-finite values") {
  std::vector<float> x(40, 0.0f), back(40, 1.0f);
  std::vector<std::uint8_t> q(40, 0xaa), s(2);
  fsdp::quantize_mxfp8(x, q, s);
  CHECK(s == std::vector<std::uint8_t>{0, 0});  // all zero: 2^-127, codes 0
  CHECK(std::all_of(q.begin(), q.end(), [](std::uint8_t c) { return c == 0; }));
  fsdp::dequantize_mxfp8(q, s, back);
  CHECK(std::all_of(back.begin(), back.end(), [](float v) { return v == 0.0f && !std::signbit(v); }));
  std::vector<std::uint8_t> one(1);
  CHECK(contains(error_of([&] { fsdp::quantize_mxfp8(x, q, one); }), "scales has 1 elements, want 2"));
  CHECK(contains(error_of([&] { fsdp::dequantize_mxfp8(std::span(q).first(39), s, back); }), "x has 40"));
  x[33] = INFINITY;
  const std::string e = error_of([&] { fsdp::quantize_mxfp8(x, q, s); });
  CHECK(contains(e, "x[33] is inf"));
  CHECK(contains(e, "(block 1)"));
  // A NaN scale decodes its block to NaN.
  s[1] = 0xff;
  fsdp::dequantize_mxfp8(q, s, back);
  CHECK(std::isnan(back[32]));
  CHECK(back[31] == 0.0f);
}

}  // namespace core_quantize_test
