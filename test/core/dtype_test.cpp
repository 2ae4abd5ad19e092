// fsdp/core/dtype.hpp: dtype metadata and the float / double <-> f16 / bf16 host conversions,
// and the 8-bit floats (f8e4m3, f8e5m2, e8m0) as dtypes;
// fsdp/core/cast.hpp: bulk conversion between any two dtypes.
//
// The conversions are checked against reference implementations written here in a
// different way: decoding via std::ldexp, encoding by looking up the two nearest
// representable values in a sorted table and comparing distances exactly in double.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/cast.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "test/support/errors.hpp"
#include "test/support/sanitized.hpp"

namespace core_dtype_test {

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
  int encode(double x) const {
    if (std::isnan(x)) return -1;
    const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(x);
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
// from the two neighbours, as values of type Real (float or double). A midpoint goes to
// the neighbour with the even (0 low bit) pattern; one ulp of Real either side goes to
// the nearer neighbour. The pair after the largest finite value is the overflow
// threshold: its midpoint and above go to inf. Returns how many midpoints were checked.
template <class Real, class Encode>
int check_ties(Format f, Encode encode) {
  int checked = 0, bad = 0;
  for (std::uint32_t h = 0; h < f.inf_bits(); ++h) {
    const auto lo = static_cast<std::uint16_t>(h), hi = static_cast<std::uint16_t>(h + 1);
    const double vlo = f.decode(lo);
    // The pattern after the largest finite one is infinity; value it as the next step.
    const double vhi = hi == f.inf_bits() ? vlo + (vlo - f.decode(static_cast<std::uint16_t>(lo - 1)))
                                          : f.decode(hi);
    const double mid = (vlo + vhi) / 2;
    const Real rm = static_cast<Real>(mid);
    if (static_cast<double>(rm) != mid) continue;  // not representable: nothing to check
    ++checked;
    const std::uint16_t even = (lo & 1u) ? hi : lo;
    const Real below = std::nextafter(rm, Real(0)), above = std::nextafter(rm, std::numeric_limits<Real>::infinity());
    for (int neg = 0; neg < 2; ++neg) {
      const std::uint16_t s = neg ? 0x8000u : 0u;
      const Real sg = neg ? -1 : 1;
      const std::uint16_t got_mid = encode(sg * rm), got_below = encode(sg * below), got_above = encode(sg * above);
      const bool ok = got_mid == (s | even) && got_below == (s | lo) && got_above == (s | hi);
      if (!ok && ++bad <= 10) {
        INFO("between 0x" << std::hex << (s | lo) << " and 0x" << (s | hi) << ": mid -> 0x" << got_mid
                          << ", below -> 0x" << got_below << ", above -> 0x" << got_above);
        CHECK(ok);
      }
    }
  }
  CHECK(bad == 0);
  return checked;
}

TEST_CASE("f16: ties go to the even neighbour") {
  // Every midpoint of a 16-bit format is a float.
  CHECK(check_ties<float>(kHalf, [](float x) { return fsdp::float_to_f16_bits(x); }) == kHalf.inf_bits());
}

TEST_CASE("bf16: ties go to the even neighbour") {
  CHECK(check_ties<float>(kBF16, [](float x) { return fsdp::float_to_bf16_bits(x); }) == kBF16.inf_bits());
}

TEST_CASE("from double: ties go to the even neighbour, one double ulp either side to the nearer one") {
  CHECK(check_ties<double>(kHalf, [](double x) { return fsdp::double_to_f16_bits(x); }) == kHalf.inf_bits());
  CHECK(check_ties<double>(kBF16, [](double x) { return fsdp::double_to_bf16_bits(x); }) == kBF16.inf_bits());
  // store_from_double, which the host casts and reductions use, is the same conversion.
  for (const DType t : {DType::f16, DType::bf16}) {
    auto stored = [t](double x) {
      std::uint16_t h = 0;
      fsdp::store_from_double(&h, 0, t, x);
      return h;
    };
    const Format& f = t == DType::f16 ? kHalf : kBF16;
    CHECK(check_ties<double>(f, stored) == f.inf_bits());
  }
}

TEST_CASE("from double: one rounding, where going through float would round twice") {
  // The example: just above the midpoint between 1 and 1 + 2^-7; float rounds it
  // onto the midpoint, and the second rounding goes to the even 1.0.
  const double x = 1.0039062509313226;
  CHECK(fsdp::double_to_bf16_bits(x) == 0x3f81);  // 1.0078125
  CHECK(fsdp::float_to_bf16_bits(static_cast<float>(x)) == 0x3f80);
  std::uint16_t h = 0;
  fsdp::store_from_double(&h, 0, DType::bf16, x);
  CHECK(h == 0x3f81);
  // One double ulp beside every midpoint: through float, each of these lands on the
  // midpoint and goes to the even neighbour, half of them wrongly; directly, none does.
  for (const Format* f : {&kHalf, &kBF16}) {
    int via_float_wrong = 0, direct_wrong = 0;
    for (std::uint32_t b = 1; b + 1 < f->inf_bits(); ++b) {
      const double mid = (f->decode(static_cast<std::uint16_t>(b)) + f->decode(static_cast<std::uint16_t>(b + 1))) / 2;
      for (const double x2 : {std::nextafter(mid, 0.0), std::nextafter(mid, INFINITY)}) {
        const int want = (f == &kHalf ? ref_half() : ref_bf16()).encode(x2);
        const std::uint16_t direct = f == &kHalf ? fsdp::double_to_f16_bits(x2) : fsdp::double_to_bf16_bits(x2);
        const float xf = static_cast<float>(x2);
        const std::uint16_t via = f == &kHalf ? fsdp::float_to_f16_bits(xf) : fsdp::float_to_bf16_bits(xf);
        direct_wrong += direct != want;
        via_float_wrong += via != want;
      }
    }
    CHECK(direct_wrong == 0);
    CHECK(via_float_wrong > 1000);  // the old path really was wrong on these inputs
  }
}

TEST_CASE("from double: overflow, NaN, infinity, signed zero, subnormals") {
  using Lim = std::numeric_limits<double>;
  for (const bool bf : {false, true}) {
    CAPTURE(bf);
    const Format& f = bf ? kBF16 : kHalf;
    auto enc = [bf](double x) { return bf ? fsdp::double_to_bf16_bits(x) : fsdp::double_to_f16_bits(x); };
    const std::uint16_t inf = f.inf_bits(), max_finite = static_cast<std::uint16_t>(inf - 1);
    const double max_v = f.decode(max_finite);
    const double threshold = max_v + std::ldexp(1.0, std::ilogb(max_v) - f.mant_bits - 1);  // midpoint to 2^(emax+1)
    CHECK(enc(max_v) == max_finite);
    CHECK(enc(std::nextafter(threshold, 0.0)) == max_finite);
    CHECK(enc(threshold) == inf);
    CHECK(enc(-threshold) == (0x8000 | inf));
    CHECK(enc(Lim::max()) == inf);
    CHECK(enc(-Lim::max()) == (0x8000 | inf));
    CHECK(enc(Lim::infinity()) == inf);
    CHECK(enc(-Lim::infinity()) == (0x8000 | inf));
    // NaN stays NaN and is quiet (top mantissa bit set), whatever its payload and sign.
    for (const std::uint64_t nan : {0x7ff8000000000000ull, 0x7ff0000000000001ull, 0xfff0000000000001ull,
                                    0x7fffffffffffffffull, 0xfff8000000000000ull}) {
      CAPTURE(nan);
      const std::uint16_t got = enc(std::bit_cast<double>(nan));
      CHECK(f.is_nan(got));
      CHECK((got & (1u << (f.mant_bits - 1))) != 0);
      CHECK(((got & 0x8000u) != 0) == ((nan >> 63) != 0));
    }
    // Signed zero, and what underflows keeps its sign.
    CHECK(enc(0.0) == 0x0000);
    CHECK(enc(-0.0) == 0x8000);
    CHECK(enc(Lim::denorm_min()) == 0x0000);
    CHECK(enc(-Lim::denorm_min()) == 0x8000);
    CHECK(enc(Lim::min()) == 0x0000);
    CHECK(enc(-1e-300) == 0x8000);
    // Subnormals of the 16-bit format: the smallest, half of it (tie with 0: even is 0),
    // just above that, and every subnormal exactly.
    const double tiny = f.decode(0x0001);
    CHECK(enc(tiny) == 0x0001);
    CHECK(enc(-tiny) == 0x8001);
    CHECK(enc(tiny / 2) == 0x0000);
    CHECK(enc(-tiny / 2) == 0x8000);
    CHECK(enc(std::nextafter(tiny / 2, 1.0)) == 0x0001);
    CHECK(enc(std::nextafter(tiny / 2, 0.0)) == 0x0000);
    CHECK(enc(1.5 * tiny) == 0x0002);
    for (std::uint16_t m = 1; m <= f.mant_mask(); ++m) {
      if (enc(m * tiny) != m) {
        CAPTURE(m);
        CHECK(enc(m * tiny) == m);
      }
    }
    CHECK(enc((f.mant_mask() + 0.5) * tiny) == f.mant_mask() + 1);  // tie with the smallest normal: even
  }
}

template <class Encode>
void compare_random_doubles(const RefEncoder& ref, Format f, Encode encode, std::uint64_t seed, int n) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint64_t> bits;
  const auto& vals = ref.values();
  std::uniform_int_distribution<std::size_t> pick(0, vals.size() - 2);
  std::uniform_int_distribution<int> exp_dist(1023 - f.bias() - f.mant_bits - 3, 1023 + f.bias() + 3);
  std::uniform_int_distribution<int> nudge(-3, 3);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    double x;
    switch (i % 3) {
      case 0: x = std::bit_cast<double>(bits(rng)); break;
      case 1: x = std::bit_cast<double>((bits(rng) & 0x800fffffffffffffull) | std::uint64_t(exp_dist(rng)) << 52); break;
      default: {  // a few double ulps from a midpoint: where rounding twice goes wrong
        const std::size_t k = pick(rng);
        double m = (vals[k] + vals[k + 1]) / 2;
        for (int s = nudge(rng); s != 0; s += s > 0 ? -1 : 1) m = std::nextafter(m, s > 0 ? INFINITY : 0.0);
        x = (bits(rng) & 1u) ? -m : m;
      }
    }
    const int want = ref.encode(x);
    const std::uint16_t got = encode(x);
    const bool ok = want < 0 ? f.is_nan(got) : got == want;
    if (!ok && ++mismatches <= 10) {
      INFO("x = " << std::hexfloat << x << ": got 0x" << std::hex << got << ", want 0x" << want);
      CHECK(ok);
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("from double: random doubles round like the reference encoder") {
  compare_random_doubles(ref_half(), kHalf, [](double x) { return fsdp::double_to_f16_bits(x); }, 11u, test_support::sweep_count(1'500'000));
  compare_random_doubles(ref_bf16(), kBF16, [](double x) { return fsdp::double_to_bf16_bits(x); }, 12u, test_support::sweep_count(1'500'000));
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
  compare_random(ref_half(), kHalf, [](float x) { return fsdp::float_to_f16_bits(x); }, 12345u, test_support::sweep_count(3'000'000));
}

TEST_CASE("bf16: random floats round like the reference encoder") {
  compare_random(ref_bf16(), kBF16, [](float x) { return fsdp::float_to_bf16_bits(x); }, 67890u, test_support::sweep_count(3'000'000));
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

// ---- fsdp::cast (fsdp/core/cast.hpp): bulk conversion between any two dtypes ------------------

namespace {

bool holds(DType t, double v) {  // whether dtype t represents v exactly
  if (fsdp::is_floating(t)) return true;  // the values used here are small integers
  if (t == DType::u8) return v >= 0 && v <= 255;
  if (t == DType::i8) return v >= -128 && v <= 127;
  return true;
}

// u rounded to p significant bits, ties to even, by integer arithmetic (u < 2^63).
std::uint64_t ref_round_int(std::uint64_t u, int p) {
  const int width = std::bit_width(u);
  if (width <= p) return u;
  const std::uint64_t q = std::uint64_t{1} << (width - p), r = u / q, rest = u % q;
  const bool up = rest > q / 2 || (rest == q / 2 && (r & 1u));
  return (r + up) * q;
}

// The f32, bf16 and f16 patterns an integer rounds to, worked out with ref_round_int.
std::uint32_t ref_int_to_f32_bits(std::int64_t v) {
  const std::uint64_t u = v < 0 ? 0 - static_cast<std::uint64_t>(v) : static_cast<std::uint64_t>(v);
  const float f = static_cast<float>(static_cast<double>(ref_round_int(u, 24)));  // exact: 24 bits
  return std::bit_cast<std::uint32_t>(v < 0 ? -f : f);
}
std::uint16_t ref_int_to_16_bits(std::int64_t v, bool bf) {
  const std::uint64_t u = v < 0 ? 0 - static_cast<std::uint64_t>(v) : static_cast<std::uint64_t>(v);
  const std::uint64_t r = ref_round_int(u, bf ? 8 : 11);
  const std::uint16_t sign = v < 0 ? 0x8000 : 0;
  if (!bf && r >= 65536) return sign | 0x7c00;  // beyond f16's range: inf
  const float f = static_cast<float>(static_cast<double>(r));  // exact: 8 or 11 bits
  return sign | (bf ? fsdp::float_to_bf16_bits(f) : fsdp::float_to_f16_bits(f));
}

using test_support::contains;

std::string cast_error(void* dst, DType to, const void* src, DType from, std::size_t n) {
  return test_support::error_of([&] { fsdp::cast(dst, to, src, from, n); });
}

}  // namespace

TEST_CASE("fsdp::cast: every pair of dtypes converts the values both hold exactly") {
  const double values[] = {0, 1, 2, 3, 7, 100, 127, -1, -7, -100, -128, 200, 255};
  for (DType from : kAll) {
    for (DType to : kAll) {
      CAPTURE(fsdp::name_of(from));
      CAPTURE(fsdp::name_of(to));
      std::vector<double> vs;
      for (double v : values) if (holds(from, v) && holds(to, v)) vs.push_back(v);
      alignas(8) unsigned char src[16 * 8] = {}, dst[17 * 8];
      std::memset(dst, 0x5a, sizeof dst);
      for (std::size_t i = 0; i < vs.size(); ++i) fsdp::store_from_double(src, i, from, vs[i]);
      fsdp::cast(dst, to, src, from, vs.size());
      for (std::size_t i = 0; i < vs.size(); ++i) CHECK(fsdp::load_as_double(dst, i, to) == vs[i]);
      const std::size_t end = vs.size() * fsdp::size_of(to);
      CHECK(std::all_of(dst + end, dst + sizeof dst, [](unsigned char b) { return b == 0x5a; }));  // no overrun
    }
  }
}

TEST_CASE("fsdp::cast: f64 -> bf16 / f16 rounds once") {
  std::vector<double> xs;
  for (std::uint32_t b = 0; b + 1 < kBF16.inf_bits(); b += 7) {
    const double mid = (kBF16.decode(static_cast<std::uint16_t>(b)) + kBF16.decode(static_cast<std::uint16_t>(b + 1))) / 2;
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0), std::nextafter(mid, INFINITY), -std::nextafter(mid, INFINITY)});
  }
  xs.push_back(1.0039062509313226);
  std::vector<std::uint16_t> bf(xs.size()), hf(xs.size());
  fsdp::cast(bf.data(), DType::bf16, xs.data(), DType::f64, xs.size());
  fsdp::cast(hf.data(), DType::f16, xs.data(), DType::f64, xs.size());
  int bad = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    bad += bf[i] != ref_bf16().encode(xs[i]);
    const int want_h = ref_half().encode(xs[i]);
    bad += hf[i] != want_h;
  }
  CHECK(bad == 0);
  CHECK(bf.back() == 0x3f81);
}

TEST_CASE("fsdp::cast: integers to floats round once, also i64 beyond 2^53") {
  // Hand-worked: 2^60 + 2^36 + 1 is just above the midpoint between two floats (their
  // step there is 2^37). Through double the +1 is lost, leaving an exact tie that goes
  // to the even 2^60; rounded once it goes up.
  const std::int64_t a = (std::int64_t{1} << 60) + (std::int64_t{1} << 36) + 1;
  float f = 0;
  fsdp::cast(&f, DType::f32, &a, DType::i64, 1);
  CHECK(f == std::ldexp(1.0f, 60) + std::ldexp(1.0f, 37));
  CHECK(static_cast<float>(static_cast<double>(a)) == std::ldexp(1.0f, 60));  // the double rounding avoided
  const std::int64_t b = -((std::int64_t{1} << 60) + (std::int64_t{1} << 52) + 1);  // bf16's step at 2^60: 2^53
  std::uint16_t h = 0;
  fsdp::cast(&h, DType::bf16, &b, DType::i64, 1);
  CHECK(fsdp::bf16_bits_to_float(h) == -(std::ldexp(1.0f, 60) + std::ldexp(1.0f, 53)));
  // i32 -> bf16 / f16 used to round through float too: 2^24 + 2^16 + 1 is just above a
  // bf16 midpoint (step 2^17), and float drops the +1.
  const std::int32_t c = (1 << 24) + (1 << 16) + 1;
  fsdp::cast(&h, DType::bf16, &c, DType::i32, 1);
  CHECK(fsdp::bf16_bits_to_float(h) == std::ldexp(1.0f, 24) + std::ldexp(1.0f, 17));

  // Random integers of every width against exact integer rounding.
  std::mt19937_64 rng(99);
  std::uniform_int_distribution<int> width(1, 63);
  std::vector<std::int64_t> i64(20000);
  for (auto& v : i64) {
    const int w = width(rng);
    v = static_cast<std::int64_t>(rng() >> (64 - w)) * ((rng() & 1) ? -1 : 1);
  }
  i64.push_back(std::numeric_limits<std::int64_t>::min());
  i64.push_back(std::numeric_limits<std::int64_t>::max());
  std::vector<std::int32_t> i32(i64.size());
  for (std::size_t i = 0; i < i64.size(); ++i) i32[i] = static_cast<std::int32_t>(i64[i] >> 32 ^ i64[i]);
  int bad = 0;
  // Casts `ints` (of dtype `from`) to f32, bf16 and f16 and counts results off the reference.
  auto check_all = [&](const auto& ints, DType from) {
    const std::size_t n = ints.size();
    std::vector<float> f32(n);
    std::vector<std::uint16_t> bf(n), hf(n);
    fsdp::cast(f32.data(), DType::f32, ints.data(), from, n);
    fsdp::cast(bf.data(), DType::bf16, ints.data(), from, n);
    fsdp::cast(hf.data(), DType::f16, ints.data(), from, n);
    for (std::size_t i = 0; i < n; ++i) {
      bad += std::bit_cast<std::uint32_t>(f32[i]) != ref_int_to_f32_bits(ints[i]);
      bad += bf[i] != ref_int_to_16_bits(ints[i], true);
      bad += hf[i] != ref_int_to_16_bits(ints[i], false);
    }
  };
  check_all(i64, DType::i64);
  check_all(i32, DType::i32);
  CHECK(bad == 0);
  // i64 -> f64 is plain round to nearest (53 bits), not to odd.
  const std::int64_t d = (std::int64_t{1} << 60) + 1;
  double g = 0;
  fsdp::cast(&g, DType::f64, &d, DType::i64, 1);
  CHECK(g == std::ldexp(1.0, 60));
}

TEST_CASE("fsdp::cast: floats to integers truncate toward zero; what does not fit is an error, dst untouched") {
  SUBCASE("values that fit") {
    const double in[] = {2.9, -2.9, -0.5, 0.99, 2147483647.9, -2147483648.9};
    std::int32_t out[6] = {};
    fsdp::cast(out, DType::i32, in, DType::f64, 6);
    CHECK(std::vector<std::int32_t>(out, out + 6) ==
          std::vector<std::int32_t>{2, -2, 0, 0, 2147483647, std::numeric_limits<std::int32_t>::min()});
    const float small[] = {127.99f, -128.99f, -0.99f};
    std::int8_t i8[3] = {};
    fsdp::cast(i8, DType::i8, small, DType::f32, 3);
    CHECK(std::vector<int>(i8, i8 + 3) == std::vector<int>{127, -128, 0});
    const float unsigned_in[] = {-0.99f, 255.5f};
    std::uint8_t u8[2] = {9, 9};
    fsdp::cast(u8, DType::u8, unsigned_in, DType::f32, 2);
    CHECK(std::vector<int>(u8, u8 + 2) == std::vector<int>{0, 255});
    const double big[] = {-std::ldexp(1.0, 63), std::nextafter(std::ldexp(1.0, 63), 0.0)};
    std::int64_t i64[2] = {};
    fsdp::cast(i64, DType::i64, big, DType::f64, 2);
    CHECK(i64[0] == std::numeric_limits<std::int64_t>::min());
    CHECK(i64[1] == std::numeric_limits<std::int64_t>::max() - 1023);
  }
  SUBCASE("values that do not fit") {
    struct Case {
      DType from, to;
      double bad;
      const char* range;
    };
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = INFINITY;
    const Case cases[] = {
        {DType::f64, DType::i8, 128.0, "[-128, 127]"},
        {DType::f64, DType::i8, -129.0, "[-128, 127]"},
        {DType::f32, DType::u8, 256.0, "[0, 255]"},
        {DType::f32, DType::u8, -1.0, "[0, 255]"},
        {DType::f64, DType::i32, 2147483648.0, "[-2147483648, 2147483647]"},
        {DType::f64, DType::i64, std::ldexp(1.0, 63), "[-9223372036854775808, 9223372036854775807]"},
        {DType::f64, DType::i64, nan, "[-9223372036854775808"},
        {DType::f32, DType::i32, inf, "[-2147483648"},
        {DType::f16, DType::i8, -inf, "[-128, 127]"},
        {DType::bf16, DType::i64, nan, "[-9223372036854775808"},
    };
    for (const Case& k : cases) {
      CAPTURE(fsdp::name_of(k.from));
      CAPTURE(fsdp::name_of(k.to));
      CAPTURE(k.bad);
      alignas(8) unsigned char src[3 * 8], dst[3 * 8];
      fsdp::store_from_double(src, 0, k.from, 1.0);
      fsdp::store_from_double(src, 1, k.from, 2.0);
      fsdp::store_from_double(src, 2, k.from, k.bad);
      std::memset(dst, 0x5a, sizeof dst);
      const std::string msg = cast_error(dst, k.to, src, k.from, 3);
      CAPTURE(msg);
      CHECK(contains(msg, std::string("cast ") + std::string(fsdp::name_of(k.from)) + " -> " + std::string(fsdp::name_of(k.to))));
      CHECK(contains(msg, "element 2 ("));
      CHECK(contains(msg, "outside the range of " + std::string(fsdp::name_of(k.to)) + " " + k.range));
      CHECK(std::all_of(dst, dst + sizeof dst, [](unsigned char b) { return b == 0x5a; }));  // nothing written
    }
  }
}

TEST_CASE("fsdp::cast: integers to narrower integers must fit") {
  const std::int32_t i32[] = {5, 300};
  std::uint8_t u8[2] = {7, 7};
  CHECK(contains(cast_error(u8, DType::u8, i32, DType::i32, 2), "element 1 (300) is outside the range of u8 [0, 255]"));
  CHECK(u8[0] == 7);
  const std::int64_t i64[] = {-5, std::int64_t{1} << 40};
  std::int32_t o32[2] = {};
  CHECK(contains(cast_error(o32, DType::i32, i64, DType::i64, 2), "element 1 (1099511627776)"));
  std::int8_t o8[1] = {};
  fsdp::cast(o8, DType::i8, i64, DType::i64, 1);
  CHECK(o8[0] == -5);
  const std::uint8_t u[] = {200};
  CHECK(contains(cast_error(o8, DType::i8, u, DType::u8, 1), "element 0 (200) is outside the range of i8"));
  const std::int8_t neg[] = {3, -1};
  CHECK(contains(cast_error(u8, DType::u8, neg, DType::i8, 2), "element 1 (-1) is outside the range of u8"));
  const std::uint8_t top[] = {255};
  std::int32_t wide = 0;
  fsdp::cast(&wide, DType::i32, top, DType::u8, 1);  // widening never fails
  CHECK(wide == 255);
}

TEST_CASE("fsdp::cast: n == 0, null pointers, overlap and in-place conversion") {
  CHECK_NOTHROW(fsdp::cast(nullptr, DType::f16, nullptr, DType::f64, 0));
  float x = 1.5f;
  CHECK(contains(cast_error(nullptr, DType::f16, &x, DType::f32, 1), "dst is null"));
  CHECK(contains(cast_error(&x, DType::f16, nullptr, DType::f32, 1), "src is null"));
  // In place between dtypes of one size.
  float buf[4] = {1.5f, -2.5f, 3.0f, 100.75f};
  fsdp::cast(buf, DType::i32, buf, DType::f32, 4);
  std::int32_t as_int[4];
  std::memcpy(as_int, buf, sizeof buf);
  CHECK(std::vector<std::int32_t>(as_int, as_int + 4) == std::vector<std::int32_t>{1, -2, 3, 100});
  std::uint16_t halves[2] = {fsdp::float_to_f16_bits(1.5f), fsdp::float_to_f16_bits(-3.0f)};
  fsdp::cast(halves, DType::bf16, halves, DType::f16, 2);
  CHECK(fsdp::bf16_bits_to_float(halves[0]) == 1.5f);
  CHECK(fsdp::bf16_bits_to_float(halves[1]) == -3.0f);
  fsdp::cast(buf, DType::f32, buf, DType::f32, 4);  // same dtype, same place: nothing to do
  // Any other overlap is refused before anything is written.
  double wide[4] = {1, 2, 3, 4};
  CHECK(contains(cast_error(wide, DType::f32, wide, DType::f64, 4), "fsdp::cast(4 elements, f64 -> f32): dst and src overlap"));
  CHECK(wide[0] == 1);
  CHECK(contains(cast_error(wide + 1, DType::f64, wide, DType::f64, 2), "overlap"));
  CHECK(contains(cast_error(reinterpret_cast<float*>(wide) + 1, DType::f32, wide, DType::f64, 1), "overlap"));
  float out[2];
  CHECK_NOTHROW(fsdp::cast(out, DType::f32, wide + 2, DType::f64, 2));  // adjacent is fine
  CHECK(out[1] == 4.0f);
  // A count whose byte size overflows is refused before any memory is touched.
  CHECK(contains(cast_error(out, DType::f32, wide, DType::f64, std::numeric_limits<std::size_t>::max() / 4),
                 "are more bytes than size_t holds"));
}

}  // namespace core_dtype_test

// ---- the 8-bit floats: DType::f8e4m3, f8e5m2, e8m0 (fsdp/core/f8.hpp) ----------------------
// The reference here enumerates the format's 256 patterns, decodes each with std::ldexp from
// its fields, and encodes a double by taking the nearest finite value (ties to the even
// mantissa), with no shortcut through float.

namespace core_dtype_test {

namespace {

struct F8Ref {
  int exp_bits, mant_bits, bias;
  bool ieee;  // E5M2: exponent all ones is inf / NaN; E4M3: only S.1111.111 is NaN
  bool is_nan(unsigned b) const {
    const unsigned e = (b & 0x7fu) >> mant_bits, m = b & ((1u << mant_bits) - 1u);
    return ieee ? (e == (1u << exp_bits) - 1u && m != 0) : (b & 0x7fu) == 0x7fu;
  }
  bool is_inf(unsigned b) const { return ieee && (b & 0x7fu) == ((1u << exp_bits) - 1u) << mant_bits; }
  double decode(unsigned b) const {
    const unsigned e = (b & 0x7fu) >> mant_bits, m = b & ((1u << mant_bits) - 1u);
    const double mag = e == 0 ? std::ldexp(m, 1 - bias - mant_bits) : std::ldexp((1u << mant_bits) | m, static_cast<int>(e) - bias - mant_bits);
    return (b & 0x80u) ? -mag : mag;
  }
  // The nearest finite value to v >= 0 (ties: even pattern), or -1 when v rounds past the
  // largest finite value (IEEE's rule: at or beyond max + half an ulp of max).
  int encode_magnitude(double v) const {
    int best = -1;
    double best_d = 0;
    double max = 0;
    int max_b = 0;
    for (unsigned b = 0; b < 0x80u; ++b) {
      if (is_nan(b) || is_inf(b)) continue;
      const double x = decode(b), d = std::fabs(x - v);
      if (x > max) max = x, max_b = static_cast<int>(b);
      if (best < 0 || d < best_d || (d == best_d && (b & 1u) == 0)) best = static_cast<int>(b), best_d = d;
    }
    const double ulp_at_max = max - decode(static_cast<unsigned>(max_b - 1));
    if (v >= max + ulp_at_max / 2 && !(v == max + ulp_at_max / 2 && (max_b & 1) == 0)) return -1;
    return best;
  }
};

const F8Ref kE4M3Ref{4, 3, 7, false}, kE5M2Ref{5, 2, 15, true};

}  // namespace

TEST_CASE("16-bit scale and combine round from float: a quiet NaN keeps its payload bits") {
  // bf16 0x7fd7 is a quiet NaN with payload; float arithmetic on x86 passes it through, and
  // float -> bf16 keeps the top bits (double -> bf16 would give the one NaN 0x7fc0).
  std::uint16_t p[2] = {0x7fd7, 0x3f80};  // NaN, 1.0
  fsdp::detail::host_scale(p, 2, DType::bf16, 2.0);
  CHECK(p[0] == 0x7fd7);
  CHECK(p[1] == 0x4000);  // 2.0
  const std::uint16_t one[2] = {0x3f80, 0x3f80};
  fsdp::detail::host_combine(p, one, 2, DType::bf16, fsdp::ReduceOp::sum);
  CHECK(p[0] == 0x7fd7);
  CHECK(p[1] == 0x4040);  // 3.0
}

TEST_CASE("8-bit floats: sizes, names, floating, tags; codes after the older dtypes'") {
  for (DType t : {DType::f8e4m3, DType::f8e5m2, DType::e8m0}) {
    CHECK(fsdp::size_of(t) == 1);
    CHECK(fsdp::is_floating(t));
  }
  CHECK(fsdp::name_of(DType::f8e4m3) == "f8e4m3");
  CHECK(fsdp::name_of(DType::f8e5m2) == "f8e5m2");
  CHECK(fsdp::name_of(DType::e8m0) == "e8m0");
  static_assert(fsdp::dtype_v<fsdp::f8e4m3> == DType::f8e4m3);
  static_assert(fsdp::dtype_v<fsdp::f8e5m2> == DType::f8e5m2);
  static_assert(fsdp::dtype_v<fsdp::e8m0> == DType::e8m0);
  static_assert(static_cast<int>(DType::i64) == 7 && static_cast<int>(DType::f8e4m3) == 8 &&
                static_cast<int>(DType::f8e5m2) == 9 && static_cast<int>(DType::e8m0) == 10);
}

TEST_CASE("8-bit floats: every pattern loads as its value and stores back to itself") {
  alignas(8) unsigned char buf[1];
  for (const auto& [t_, ref] : {std::pair{DType::f8e4m3, kE4M3Ref}, std::pair{DType::f8e5m2, kE5M2Ref}}) {
    const DType t = t_;  // clang 14 cannot capture a binding (CAPTURE's lambda)
    CAPTURE(fsdp::name_of(t));
    for (unsigned b = 0; b < 256; ++b) {
      buf[0] = static_cast<unsigned char>(b);
      const double v = fsdp::load_as_double(buf, 0, t);
      if (ref.is_nan(b)) {
        CHECK(std::isnan(v));
        continue;
      }
      if (ref.is_inf(b)) {
        CHECK(v == ((b & 0x80u) ? -HUGE_VAL : HUGE_VAL));
      } else if (v != ref.decode(b) || std::signbit(v) != ((b & 0x80u) != 0)) {
        INFO("b = 0x" << std::hex << b);
        CHECK(v == ref.decode(b));
      }
      fsdp::store_from_double(buf, 0, t, v);
      if (buf[0] != b) {
        INFO("b = 0x" << std::hex << b);
        CHECK(static_cast<unsigned>(buf[0]) == b);
      }
    }
  }
  for (unsigned b = 0; b < 255; ++b) {  // e8m0: 2^(b - 127); 0xff is NaN
    buf[0] = static_cast<unsigned char>(b);
    CHECK(fsdp::load_as_double(buf, 0, DType::e8m0) == std::ldexp(1.0, static_cast<int>(b) - 127));
    fsdp::store_from_double(buf, 0, DType::e8m0, std::ldexp(1.0, static_cast<int>(b) - 127));
    CHECK(static_cast<unsigned>(buf[0]) == b);
  }
  buf[0] = 0xff;
  CHECK(std::isnan(fsdp::load_as_double(buf, 0, DType::e8m0)));
}

TEST_CASE("8-bit floats from double: one rounding to nearest even, at every midpoint and one ulp either side") {
  alignas(8) unsigned char buf[1];
  for (const auto& [t_, ref] : {std::pair{DType::f8e4m3, kE4M3Ref}, std::pair{DType::f8e5m2, kE5M2Ref}}) {
    const DType t = t_;  // clang 14 cannot capture a binding (CAPTURE's lambda)
    CAPTURE(fsdp::name_of(t));
    std::vector<double> values;  // the finite positive values, ascending
    for (unsigned b = 0; b < 0x80u; ++b)
      if (!ref.is_nan(b) && !ref.is_inf(b)) values.push_back(ref.decode(b));
    std::mt19937_64 rng(38);
    int checked = 0;
    for (std::size_t i = 0; i + 1 < values.size(); ++i) {
      const double mid = (values[i] + values[i + 1]) / 2;  // exact in double
      // The midpoint, one double ulp either side, and a nudge below float's precision: going
      // through float rounded to nearest would land on the midpoint and round twice.
      const double tiny = std::ldexp(mid, -40);
      for (double v : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e300), mid + tiny, mid - tiny,
                       values[i] + (values[i + 1] - values[i]) * std::uniform_real_distribution<double>(0, 1)(rng)}) {
        for (double s : {1.0, -1.0}) {
          const int want = ref.encode_magnitude(v);
          fsdp::store_from_double(buf, 0, t, s * v);
          const unsigned want_bits = (s < 0 ? 0x80u : 0u) | static_cast<unsigned>(want);
          if (buf[0] != want_bits) {
            INFO("v = " << s * v);
            CHECK(static_cast<unsigned>(buf[0]) == want_bits);
          }
          ++checked;
        }
      }
    }
    CHECK(checked > 1000);
  }
}

TEST_CASE("8-bit floats from double: no saturation (E4M3 overflows to NaN, E5M2 to inf), signed zero, NaN") {
  alignas(8) unsigned char buf[1];
  auto store = [&](DType t, double v) {
    fsdp::store_from_double(buf, 0, t, v);
    return static_cast<unsigned>(buf[0]);
  };
  CHECK(store(DType::f8e4m3, 448) == 0x7eu);
  CHECK(store(DType::f8e4m3, 463.99) == 0x7eu);  // below the midpoint to the missing 480
  CHECK(store(DType::f8e4m3, 464) == 0x7eu);     // the midpoint: 448's pattern is even
  CHECK(store(DType::f8e4m3, 464.01) == 0x7fu);  // NaN: E4M3 has no inf
  CHECK(store(DType::f8e4m3, -1e30) == 0xffu);
  CHECK(store(DType::f8e4m3, HUGE_VAL) == 0x7fu);
  CHECK(store(DType::f8e5m2, 57344) == 0x7bu);
  CHECK(store(DType::f8e5m2, 61440) == 0x7cu);  // the midpoint to 65536: 57344's pattern is odd, so inf
  CHECK(store(DType::f8e5m2, -HUGE_VAL) == 0xfcu);
  CHECK(store(DType::f8e5m2, -0.0) == 0x80u);
  CHECK(store(DType::f8e4m3, -0.0) == 0x80u);
  CHECK(store(DType::f8e5m2, std::nan("")) == 0x7eu);
  CHECK(store(DType::e8m0, 3.0) == 128u);                             // 2^1 <= 3 < 2^2
  CHECK(store(DType::e8m0, -3.0) == 128u);                            // the sign is dropped
  CHECK(store(DType::e8m0, 4.0 * (1 - std::ldexp(1.0, -40))) == 128u);  // just below 4: still 2^1
  CHECK(store(DType::e8m0, 0.0) == 0u);
  CHECK(store(DType::e8m0, std::nan("")) == 0xffu);
}

TEST_CASE("8-bit floats: casts round once; reductions in float; e8m0 has max and min only") {
  const float xs[] = {1.0f, 0.3f, -2.5f, 300.0f, 1e-3f};
  unsigned char q[5];
  float back[5];
  fsdp::cast(q, DType::f8e4m3, xs, DType::f32, 5);
  fsdp::cast(back, DType::f32, q, DType::f8e4m3, 5);
  const float want[] = {1.0f, 0.3125f, -2.5f, 288.0f, 0.001953125f};  // nearest E4M3 values (the last: 2^-9, the smallest)
  for (int i = 0; i < 5; ++i) CHECK(back[i] == want[i]);
  unsigned char a[2], b[2];
  fsdp::cast(a, DType::f8e5m2, std::array<float, 2>{1.5f, 3.0f}.data(), DType::f32, 2);
  fsdp::cast(b, DType::f8e5m2, std::array<float, 2>{0.5f, 3.0f}.data(), DType::f32, 2);
  fsdp::detail::host_combine(a, b, 2, DType::f8e5m2, fsdp::ReduceOp::sum);
  CHECK(fsdp::load_as_double(a, 0, DType::f8e5m2) == 2.0);
  CHECK(fsdp::load_as_double(a, 1, DType::f8e5m2) == 6.0);
  unsigned char s[2] = {126, 130}, t2[2] = {129, 127};
  fsdp::detail::host_combine(s, t2, 2, DType::e8m0, fsdp::ReduceOp::max);
  CHECK((s[0] == 129 && s[1] == 130));
  CHECK(test_support::contains(test_support::error_of([&] { fsdp::detail::host_combine(s, t2, 2, DType::e8m0, fsdp::ReduceOp::sum); }),
                               "sum on e8m0 (power-of-two scales): only moves and max / min are defined for it"));
}

}  // namespace core_dtype_test
