// fsdp/dtype.hpp: dtype metadata and the float <-> f16 / bf16 host conversions.
//
// The conversions are checked against reference implementations written here in a
// different way: decoding via std::ldexp, encoding by looking up the two nearest
// representable values in a sorted table and comparing distances exactly in double.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string_view>
#include <vector>

#include "fsdp/dtype.hpp"

namespace {

using fsdp::DType;

constexpr DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                          DType::i8,  DType::u8,  DType::i32, DType::i64};

// ---- reference 16-bit formats -----------------------------------------------------------

struct Format {
  int exp_bits;
  int mant_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  std::uint16_t exp_mask() const { return static_cast<std::uint16_t>(((1u << exp_bits) - 1u) << mant_bits); }
  std::uint16_t mant_mask() const { return static_cast<std::uint16_t>((1u << mant_bits) - 1u); }
  std::uint16_t inf_bits() const { return exp_mask(); }
  bool is_nan(std::uint16_t h) const { return (h & exp_mask()) == exp_mask() && (h & mant_mask()) != 0; }
  bool is_inf(std::uint16_t h) const { return (h & 0x7fffu) == inf_bits(); }

  // Value of a bit pattern, by the textbook formula (not by bit shuffling into a float).
  double decode(std::uint16_t h) const {
    const bool neg = (h & 0x8000u) != 0;
    const int e = (h & exp_mask()) >> mant_bits;
    const int m = h & mant_mask();
    double v;
    if (e == (1 << exp_bits) - 1) v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
    else if (e == 0) v = std::ldexp(static_cast<double>(m), 1 - bias() - mant_bits);
    else v = std::ldexp(static_cast<double>(m + (1 << mant_bits)), e - bias() - mant_bits);
    return neg ? -v : v;
  }
};

constexpr Format kHalf{5, 10};
constexpr Format kBF16{8, 7};

// Reference encoder: the non-negative finite values of the format in increasing order,
// plus one more entry for the pattern after the largest finite value (the infinity
// pattern), valued as if the exponent range went on. Rounding past the largest finite
// value to that entry is exactly IEEE's overflow-to-infinity rule under ties-to-even.
class RefEncoder {
 public:
  explicit RefEncoder(Format f) : f_(f) {
    for (std::uint32_t h = 0; h < f.inf_bits(); ++h) values_.push_back(f.decode(static_cast<std::uint16_t>(h)));
    const double max_finite = values_.back();
    values_.push_back(max_finite + std::ldexp(1.0, std::ilogb(max_finite) - f.mant_bits));
  }

  // Returns the pattern for x rounded to nearest, ties to the even pattern; or -1 for NaN
  // (any NaN pattern is acceptable there).
  int encode(float x) const {
    if (std::isnan(x)) return -1;
    const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(static_cast<double>(x));
    if (std::isinf(a) || a >= values_.back()) return sign | f_.inf_bits();
    // values_[lo] <= a < values_[lo + 1]
    const auto it = std::upper_bound(values_.begin(), values_.end(), a);
    const auto hi = static_cast<std::uint16_t>(it - values_.begin());
    const auto lo = static_cast<std::uint16_t>(hi - 1);
    // Compare a with the midpoint without forming distances: 2a and lo+hi are exact.
    const double twice = 2 * a, sum = values_[lo] + values_[hi];
    std::uint16_t r;
    if (twice < sum) r = lo;
    else if (twice > sum) r = hi;
    else r = (lo & 1u) ? hi : lo;
    return sign | r;
  }

  const std::vector<double>& values() const { return values_; }

 private:
  Format f_;
  std::vector<double> values_;
};

const RefEncoder& ref_half() { static const RefEncoder e(kHalf); return e; }
const RefEncoder& ref_bf16() { static const RefEncoder e(kBF16); return e; }

float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// Random floats: a third arbitrary bit patterns (all exponents, NaN and inf included), a
// third with exponents around the 16-bit format's range, a third near the midpoints
// between two adjacent values of the format (where rounding decides).
template <class Encode>
void compare_random(const RefEncoder& ref, Format f, Encode encode, std::uint32_t seed, int n) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::uint32_t> bits;
  const int lo_exp = 127 - f.bias() - f.mant_bits - 3, hi_exp = 127 + f.bias() + 3;
  std::uniform_int_distribution<int> exp_dist(std::max(lo_exp, 0), std::min(hi_exp, 254));
  const auto& vals = ref.values();
  std::uniform_int_distribution<std::size_t> pick(0, vals.size() - 2);
  std::uniform_int_distribution<int> nudge(-2, 2);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    float x;
    switch (i % 3) {
      case 0: x = from_bits(bits(rng)); break;
      case 1: {
        const std::uint32_t e = static_cast<std::uint32_t>(exp_dist(rng));
        x = from_bits((bits(rng) & 0x807fffffu) | (e << 23));
        break;
      }
      default: {
        const std::size_t k = pick(rng);
        float m = static_cast<float>((vals[k] + vals[k + 1]) / 2);
        for (int s = nudge(rng); s != 0; s += s > 0 ? -1 : 1)
          m = std::nextafter(m, s > 0 ? INFINITY : 0.0f);
        x = (bits(rng) & 1u) ? -m : m;
        break;
      }
    }
    const int want = ref.encode(x);
    const std::uint16_t got = encode(x);
    const bool ok = want < 0 ? f.is_nan(got) : got == want;
    if (!ok && ++mismatches <= 10) {
      INFO("x bits = 0x" << std::hex << std::bit_cast<std::uint32_t>(x) << " (" << x << "): got 0x" << got
                         << ", want 0x" << want);
      CHECK(ok);
    }
  }
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("size_of, name_of and is_floating describe every dtype") {
  CHECK(fsdp::size_of(DType::f32) == sizeof(float));
  CHECK(fsdp::size_of(DType::f64) == sizeof(double));
  CHECK(fsdp::size_of(DType::f16) == sizeof(std::uint16_t));
  CHECK(fsdp::size_of(DType::bf16) == sizeof(std::uint16_t));
  CHECK(fsdp::size_of(DType::i8) == sizeof(std::int8_t));
  CHECK(fsdp::size_of(DType::u8) == sizeof(std::uint8_t));
  CHECK(fsdp::size_of(DType::i32) == sizeof(std::int32_t));
  CHECK(fsdp::size_of(DType::i64) == sizeof(std::int64_t));

  CHECK(fsdp::name_of(DType::f32) == "f32");
  CHECK(fsdp::name_of(DType::f64) == "f64");
  CHECK(fsdp::name_of(DType::f16) == "f16");
  CHECK(fsdp::name_of(DType::bf16) == "bf16");
  CHECK(fsdp::name_of(DType::i8) == "i8");
  CHECK(fsdp::name_of(DType::u8) == "u8");
  CHECK(fsdp::name_of(DType::i32) == "i32");
  CHECK(fsdp::name_of(DType::i64) == "i64");

  int floating = 0;
  for (DType t : kAll) {
    const std::string_view n = fsdp::name_of(t);
    CAPTURE(n);
    // Float dtypes are exactly those whose name starts with 'f' or "bf".
    const bool want = n.front() == 'f' || n.substr(0, 2) == "bf";
    CHECK(fsdp::is_floating(t) == want);
    floating += fsdp::is_floating(t);
    // Names are distinct.
    for (DType u : kAll) if (u != t) CHECK(fsdp::name_of(u) != n);
  }
  CHECK(floating == 4);

  // Usable at compile time.
  static_assert(fsdp::size_of(DType::bf16) == 2);
  static_assert(fsdp::name_of(DType::i64) == "i64");
  static_assert(!fsdp::is_floating(DType::i32));
}

TEST_CASE("dtype_v maps C++ types and tags to dtypes of the right size") {
  static_assert(fsdp::dtype_v<float> == DType::f32);
  static_assert(fsdp::dtype_v<double> == DType::f64);
  static_assert(fsdp::dtype_v<fsdp::f16> == DType::f16);
  static_assert(fsdp::dtype_v<fsdp::bf16> == DType::bf16);
  static_assert(fsdp::dtype_v<std::int8_t> == DType::i8);
  static_assert(fsdp::dtype_v<std::uint8_t> == DType::u8);
  static_assert(fsdp::dtype_v<std::int32_t> == DType::i32);
  static_assert(fsdp::dtype_v<std::int64_t> == DType::i64);
  CHECK(fsdp::size_of(fsdp::dtype_v<double>) == sizeof(double));
  CHECK(fsdp::size_of(fsdp::dtype_v<std::int64_t>) == sizeof(std::int64_t));
  CHECK(fsdp::size_of(fsdp::dtype_v<std::int8_t>) == 1);
}

// Every 16-bit pattern decodes to the format's exact value and sign (-0 apart from +0).
template <class Format>
void check_decodes_all_patterns(const Format& format, float (*decode)(std::uint16_t)) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const double want = format.decode(b);
    const float got = decode(b);
    if (format.is_nan(b)) {
      if (!std::isnan(got)) { INFO("h = 0x" << std::hex << h); CHECK(std::isnan(got)); }
      continue;
    }
    if (static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) {
      INFO("h = 0x" << std::hex << h << ": got " << got << ", want " << want);
      CHECK(static_cast<double>(got) == want);
      CHECK(std::signbit(got) == std::signbit(want));
    }
  }
}

TEST_CASE("f16: decoding every pattern matches the IEEE binary16 formula") {
  check_decodes_all_patterns(kHalf, fsdp::f16_bits_to_float);
}

TEST_CASE("f16: half -> float -> half is the identity on all non-NaN patterns; NaN stays NaN") {
  int non_nan = 0, bad = 0;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const std::uint16_t back = fsdp::float_to_f16_bits(fsdp::f16_bits_to_float(b));
    const bool ok = kHalf.is_nan(b) ? kHalf.is_nan(back) : back == b;
    non_nan += !kHalf.is_nan(b);
    if (!ok && ++bad <= 10) { INFO("h = 0x" << std::hex << h << " -> 0x" << back); CHECK(ok); }
  }
  CHECK(bad == 0);
  CHECK(non_nan == 65536 - 2 * 1023);  // sanity: 2 signs x 1023 NaN mantissas excluded
}

TEST_CASE("bf16: decoding every pattern matches the bfloat16 formula") {
  check_decodes_all_patterns(kBF16, fsdp::bf16_bits_to_float);
}

TEST_CASE("bf16: bf16 -> float -> bf16 is the identity on all non-NaN patterns; NaN stays NaN") {
  int bad = 0;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const std::uint16_t back = fsdp::float_to_bf16_bits(fsdp::bf16_bits_to_float(b));
    const bool ok = kBF16.is_nan(b) ? kBF16.is_nan(back) : back == b;
    if (!ok && ++bad <= 10) { INFO("h = 0x" << std::hex << h << " -> 0x" << back); CHECK(ok); }
  }
  CHECK(bad == 0);
  // A signalling-looking NaN (only the lowest float mantissa bit set, which truncation
  // would lose) must not turn into infinity.
  const std::uint16_t n = fsdp::float_to_bf16_bits(from_bits(0x7f800001u));
  CHECK(kBF16.is_nan(n));
  CHECK(kBF16.is_nan(fsdp::float_to_bf16_bits(from_bits(0xff800001u))));
  CHECK(kHalf.is_nan(fsdp::float_to_f16_bits(from_bits(0x7f800001u))));
  CHECK(kHalf.is_nan(fsdp::float_to_f16_bits(std::numeric_limits<float>::quiet_NaN())));
}

// Midpoints between every pair of adjacent values (both signs), computed exactly in double
// from the two neighbours; they are all exactly representable as floats. A midpoint goes
// to the neighbour with the even (0 low bit) pattern; one float ulp either side goes to
// the nearer neighbour.
template <class Encode>
void check_ties(Format f, Encode encode) {
  int checked = 0, bad = 0;
  for (std::uint32_t h = 0; h < f.inf_bits(); ++h) {
    const auto lo = static_cast<std::uint16_t>(h), hi = static_cast<std::uint16_t>(h + 1);
    const double vlo = f.decode(lo);
    // The pattern after the largest finite one is infinity; value it as the next step.
    const double vhi = hi == f.inf_bits() ? vlo + (vlo - f.decode(static_cast<std::uint16_t>(lo - 1)))
                                          : f.decode(hi);
    const double mid = (vlo + vhi) / 2;
    const float fm = static_cast<float>(mid);
    if (static_cast<double>(fm) != mid) continue;  // not representable: nothing to check
    ++checked;
    const std::uint16_t even = (lo & 1u) ? hi : lo;
    const float below = std::nextafter(fm, 0.0f), above = std::nextafter(fm, INFINITY);
    for (int neg = 0; neg < 2; ++neg) {
      const std::uint16_t s = neg ? 0x8000u : 0u;
      const float sg = neg ? -1.0f : 1.0f;
      const std::uint16_t got_mid = encode(sg * fm), got_below = encode(sg * below), got_above = encode(sg * above);
      const bool ok = got_mid == (s | even) && got_below == (s | lo) && got_above == (s | hi);
      if (!ok && ++bad <= 10) {
        INFO("between 0x" << std::hex << (s | lo) << " and 0x" << (s | hi) << ": mid -> 0x" << got_mid
                          << ", below -> 0x" << got_below << ", above -> 0x" << got_above);
        CHECK(ok);
      }
    }
  }
  CHECK(bad == 0);
  CHECK(checked == f.inf_bits());  // every midpoint of a 16-bit format is a float
}

TEST_CASE("f16: ties go to the even neighbour") {
  check_ties(kHalf, [](float x) { return fsdp::float_to_f16_bits(x); });
}

TEST_CASE("bf16: ties go to the even neighbour") {
  check_ties(kBF16, [](float x) { return fsdp::float_to_bf16_bits(x); });
}

TEST_CASE("f16: overflow to infinity") {
  const std::uint16_t inf = 0x7c00, max_finite = 0x7bff;
  REQUIRE(kHalf.decode(max_finite) == 65504.0);
  CHECK(fsdp::float_to_f16_bits(65504.0f) == max_finite);
  CHECK(fsdp::float_to_f16_bits(65519.99f) == max_finite);
  CHECK(fsdp::float_to_f16_bits(std::nextafter(65520.0f, 0.0f)) == max_finite);
  CHECK(fsdp::float_to_f16_bits(65520.0f) == inf);  // midpoint to 2^16: ties to even = inf
  CHECK(fsdp::float_to_f16_bits(-65520.0f) == (0x8000 | inf));
  CHECK(fsdp::float_to_f16_bits(-65519.99f) == (0x8000 | max_finite));
  CHECK(fsdp::float_to_f16_bits(65536.0f) == inf);
  CHECK(fsdp::float_to_f16_bits(1e10f) == inf);
  CHECK(fsdp::float_to_f16_bits(std::numeric_limits<float>::max()) == inf);
  CHECK(fsdp::float_to_f16_bits(INFINITY) == inf);
  CHECK(fsdp::float_to_f16_bits(-INFINITY) == (0x8000 | inf));
  CHECK(std::isinf(fsdp::f16_bits_to_float(inf)));
}

TEST_CASE("bf16: overflow to infinity") {
  const std::uint16_t inf = 0x7f80, max_finite = 0x7f7f;
  const float max_bf16 = static_cast<float>(kBF16.decode(max_finite));
  CHECK(fsdp::float_to_bf16_bits(max_bf16) == max_finite);
  // Half a bf16 step above the largest value is the tie with 2^128: rounds to inf.
  const float mid = static_cast<float>(kBF16.decode(max_finite) + std::ldexp(1.0, 127 - 8));
  CHECK(fsdp::float_to_bf16_bits(std::nextafter(mid, 0.0f)) == max_finite);
  CHECK(fsdp::float_to_bf16_bits(mid) == inf);
  CHECK(fsdp::float_to_bf16_bits(std::numeric_limits<float>::max()) == inf);
  CHECK(fsdp::float_to_bf16_bits(-std::numeric_limits<float>::max()) == (0x8000 | inf));
  CHECK(fsdp::float_to_bf16_bits(INFINITY) == inf);
  CHECK(fsdp::float_to_bf16_bits(-INFINITY) == (0x8000 | inf));
}

TEST_CASE("f16: subnormals") {
  const float tiny = std::ldexp(1.0f, -24);  // smallest half subnormal
  CHECK(fsdp::float_to_f16_bits(tiny) == 0x0001);
  CHECK(fsdp::float_to_f16_bits(-tiny) == 0x8001);
  CHECK(fsdp::float_to_f16_bits(tiny / 2) == 0x0000);                       // tie with 0: even is 0
  CHECK(fsdp::float_to_f16_bits(-tiny / 2) == 0x8000);
  CHECK(fsdp::float_to_f16_bits(std::nextafter(tiny / 2, 1.0f)) == 0x0001);  // just above the tie
  CHECK(fsdp::float_to_f16_bits(std::nextafter(tiny / 2, 0.0f)) == 0x0000);
  CHECK(fsdp::float_to_f16_bits(1.5f * tiny) == 0x0002);                    // tie between 1 and 2: even is 2
  CHECK(fsdp::float_to_f16_bits(2.5f * tiny) == 0x0002);                    // tie between 2 and 3
  CHECK(fsdp::float_to_f16_bits(1023 * tiny) == 0x03ff);                    // largest subnormal
  CHECK(fsdp::float_to_f16_bits(1023.5f * tiny) == 0x0400);                 // tie: even is the smallest normal
  CHECK(fsdp::float_to_f16_bits(std::ldexp(1.0f, -14)) == 0x0400);          // smallest normal
  CHECK(fsdp::float_to_f16_bits(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(fsdp::float_to_f16_bits(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(fsdp::float_to_f16_bits(std::numeric_limits<float>::min()) == 0x0000);
  for (int m = 1; m < 1024; ++m) {
    CAPTURE(m);
    CHECK(fsdp::f16_bits_to_float(static_cast<std::uint16_t>(m)) == static_cast<float>(m) * tiny);
  }
}

TEST_CASE("bf16: subnormals") {
  const float tiny = std::ldexp(1.0f, -133);  // smallest bf16 subnormal
  CHECK(fsdp::float_to_bf16_bits(tiny) == 0x0001);
  CHECK(fsdp::float_to_bf16_bits(-tiny) == 0x8001);
  CHECK(fsdp::float_to_bf16_bits(tiny / 2) == 0x0000);
  CHECK(fsdp::float_to_bf16_bits(std::nextafter(tiny / 2, 1.0f)) == 0x0001);
  CHECK(fsdp::float_to_bf16_bits(1.5f * tiny) == 0x0002);
  CHECK(fsdp::float_to_bf16_bits(127 * tiny) == 0x007f);
  CHECK(fsdp::float_to_bf16_bits(std::numeric_limits<float>::min()) == 0x0080);
  CHECK(fsdp::bf16_bits_to_float(0x0001) == tiny);
  CHECK(fsdp::bf16_bits_to_float(0x0080) == std::numeric_limits<float>::min());
}

TEST_CASE("signed zeros survive both conversions") {
  CHECK(fsdp::float_to_f16_bits(0.0f) == 0x0000);
  CHECK(fsdp::float_to_f16_bits(-0.0f) == 0x8000);
  CHECK(fsdp::float_to_bf16_bits(0.0f) == 0x0000);
  CHECK(fsdp::float_to_bf16_bits(-0.0f) == 0x8000);
  const float pz = fsdp::f16_bits_to_float(0x0000), nz = fsdp::f16_bits_to_float(0x8000);
  CHECK(pz == 0.0f);
  CHECK(nz == 0.0f);
  CHECK_FALSE(std::signbit(pz));
  CHECK(std::signbit(nz));
  CHECK_FALSE(std::signbit(fsdp::bf16_bits_to_float(0x0000)));
  CHECK(std::signbit(fsdp::bf16_bits_to_float(0x8000)));
  // A negative value that underflows keeps its sign.
  CHECK(fsdp::float_to_f16_bits(-1e-30f) == 0x8000);
}

TEST_CASE("a few well-known values") {
  CHECK(fsdp::float_to_f16_bits(1.0f) == 0x3c00);
  CHECK(fsdp::float_to_f16_bits(-2.0f) == 0xc000);
  CHECK(fsdp::float_to_f16_bits(0.5f) == 0x3800);
  CHECK(fsdp::float_to_bf16_bits(1.0f) == 0x3f80);
  CHECK(fsdp::float_to_bf16_bits(-2.0f) == 0xc000);
  CHECK(fsdp::f16_bits_to_float(0x3555) == doctest::Approx(1.0 / 3).epsilon(1e-3));
  CHECK(fsdp::bf16_bits_to_float(0x3eab) == doctest::Approx(1.0 / 3).epsilon(1e-2));
}

TEST_CASE("f16: random floats round like the reference encoder") {
  compare_random(ref_half(), kHalf, [](float x) { return fsdp::float_to_f16_bits(x); }, 12345u, 3'000'000);
}

TEST_CASE("bf16: random floats round like the reference encoder") {
  compare_random(ref_bf16(), kBF16, [](float x) { return fsdp::float_to_bf16_bits(x); }, 67890u, 3'000'000);
}

TEST_CASE("load_as_double / store_from_double round-trip each dtype") {
  alignas(8) unsigned char buf[64] = {};
  const double ints[] = {0, 1, -7, 100};
  for (DType t : kAll) {
    CAPTURE(fsdp::name_of(t));
    for (std::size_t i = 0; i < 4; ++i) {
      const double v = (t == DType::u8) ? std::fabs(ints[i]) : ints[i];
      fsdp::store_from_double(buf, i, t, v);
    }
    for (std::size_t i = 0; i < 4; ++i) {
      const double v = (t == DType::u8) ? std::fabs(ints[i]) : ints[i];
      CHECK(fsdp::load_as_double(buf, i, t) == v);
    }
  }
  // Stores round to the dtype: 1 + 2^-9 is below bf16's precision, not f16's.
  fsdp::store_from_double(buf, 0, DType::bf16, 1.0 + std::ldexp(1.0, -9));
  CHECK(fsdp::load_as_double(buf, 0, DType::bf16) == 1.0);
  fsdp::store_from_double(buf, 0, DType::f16, 1.0 + std::ldexp(1.0, -9));
  CHECK(fsdp::load_as_double(buf, 0, DType::f16) == 1.0 + std::ldexp(1.0, -9));
}
