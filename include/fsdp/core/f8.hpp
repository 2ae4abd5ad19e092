#pragma once
// The OCP 8-bit floating point formats as bit patterns: OFP8 E4M3 (E4M3FN) and E5M2, and
// E8M0, the power-of-two scale of the OCP Microscaling (MX) formats. What DType::f8e4m3,
// f8e5m2 and e8m0 hold (fsdp/core/dtype.hpp) and what the block quantization of
// fsdp/core/quantize.hpp writes. Conversions from float and from double round once, to
// nearest with ties to even (double through float rounded to odd, which keeps that one
// rounding exact); to float they are exact.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace fsdp {

namespace detail {

// An OFP8 format: exponent bits, mantissa bits, bias, its largest finite pattern (no
// sign) and the pattern (no sign) an overflow gives when not saturating.
struct F8Format {
  int exp_bits, mant_bits, bias;
  std::uint8_t max_finite;  // e4m3: 0x7e = 448; e5m2: 0x7b = 57344
  std::uint8_t overflow;    // e4m3: 0x7f (NaN, it has no inf); e5m2: 0x7c (inf)
  std::uint8_t nan;         // e4m3: 0x7f; e5m2: 0x7e (a quiet NaN)
};
inline constexpr F8Format kE4M3{4, 3, 7, 0x7e, 0x7f, 0x7f};
inline constexpr F8Format kE5M2{5, 2, 15, 0x7b, 0x7c, 0x7e};

// float -> OFP8 pattern, rounded once to nearest, ties to even; signed zero kept.
// Saturating ("satfinite"): finite overflow and +-inf give +-max; NaN stays NaN.
inline std::uint8_t float_to_f8(float f, const F8Format& fmt, bool saturate) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint8_t>(sign | fmt.nan);
  if (abs == 0x7f800000u) return static_cast<std::uint8_t>(sign | (saturate ? fmt.max_finite : fmt.overflow));
  const int e = static_cast<int>(abs >> 23) - 127;  // unbiased (float subnormals: far below)
  // Below 2^(-bias - mant): at most half the smallest subnormal, so zero (a tie goes to
  // the even 0). Returning early also keeps the shift below under 32.
  if (e < -fmt.bias - fmt.mant_bits) return sign;
  const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  // Bits of m below the target's quantum: the mantissa width, plus the shift to subnormal.
  const int drop = 23 - fmt.mant_bits + std::max(0, 1 - fmt.bias - e);
  std::uint32_t r = m >> drop;
  const std::uint32_t rest = m & ((1u << drop) - 1u), half = 1u << (drop - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  // r holds the implicit bit for a normal result (hence the - 1 on the exponent field);
  // a round-up to the next binade carries into the exponent by itself.
  const std::uint32_t bits =
      (static_cast<std::uint32_t>(std::max(e + fmt.bias, 1) - 1) << fmt.mant_bits) + r;
  if (bits > fmt.max_finite) return static_cast<std::uint8_t>(sign | (saturate ? fmt.max_finite : fmt.overflow));
  return static_cast<std::uint8_t>(sign | bits);
}

// OFP8 pattern -> float (exact: every OFP8 value is a normal float or zero).
inline float f8_to_float(std::uint8_t b, const F8Format& fmt, bool is_special) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t e = (b & 0x7fu) >> fmt.mant_bits;
  const std::uint32_t m = b & ((1u << fmt.mant_bits) - 1u);
  if (is_special) {  // e5m2 exponent all ones: inf (m == 0) or NaN; e4m3 0x7f: NaN
    const bool inf = fmt.exp_bits == 5 && m == 0;
    return std::bit_cast<float>(sign | 0x7f800000u | (inf ? 0u : 0x400000u));
  }
  if (e == 0) {  // subnormal: m * 2^(1 - bias - mant), a product by an exact power of two
    const float quantum = std::bit_cast<float>(static_cast<std::uint32_t>(128 - fmt.bias - fmt.mant_bits) << 23);
    return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(static_cast<float>(m) * quantum));
  }
  return std::bit_cast<float>(sign | (e - fmt.bias + 127) << 23 | m << (23 - fmt.mant_bits));
}

}  // namespace detail

// ---- OFP8 E4M3 (E4M3FN): bias 7, no infinities, NaN = S.1111.111, max 448 ----------------
// saturate = true is OCP's satfinite mode (torch's float8 casts): beyond +-448 gives +-448,
// +-inf too. saturate = false: anything rounding beyond 448 gives NaN.
inline std::uint8_t float_to_f8e4m3_bits(float f, bool saturate = true) {
  return detail::float_to_f8(f, detail::kE4M3, saturate);
}
inline float f8e4m3_bits_to_float(std::uint8_t b) {
  return detail::f8_to_float(b, detail::kE4M3, (b & 0x7fu) == 0x7fu);
}

// ---- OFP8 E5M2: bias 15, IEEE-like (inf = S.11111.00, NaN = S.11111.xx), max 57344 ------
// saturate = true: beyond +-57344 and +-inf give +-57344; saturate = false: overflow gives
// +-inf (IEEE's rule: from the midpoint 61440 up, since 57344 has an odd mantissa).
inline std::uint8_t float_to_f8e5m2_bits(float f, bool saturate = true) {
  return detail::float_to_f8(f, detail::kE5M2, saturate);
}
inline float f8e5m2_bits_to_float(std::uint8_t b) {
  return detail::f8_to_float(b, detail::kE5M2, (b & 0x7cu) == 0x7cu);
}

// ---- E8M0 (the MX block scale): unsigned, value 2^(bits - 127), 0xff = NaN, no zero ------
// float -> e8m0: the largest power of two <= |x| (floor of log2 |x|: the sign is ignored),
// clamped to [2^-127, 2^127]. NaN and +-inf give 0xff (NaN); zero (and any |x| below
// 2^-126, all float subnormals) gives 0x00 = 2^-127. For a normal float the pattern is
// just its biased exponent field.
inline std::uint8_t float_to_e8m0_bits(float f) {
  const std::uint32_t biased = (std::bit_cast<std::uint32_t>(f) >> 23) & 0xffu;
  return static_cast<std::uint8_t>(biased);  // 0xff for inf/NaN, 0 for zero and subnormals
}
inline float e8m0_bits_to_float(std::uint8_t b) {
  if (b == 0xff) return std::numeric_limits<float>::quiet_NaN();
  if (b == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127: a float subnormal, exact
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 23);
}

// ---- from double: one rounding -----------------------------------------------------------
namespace detail {
// double -> float rounded to odd (toward zero, the last bit set when inexact): the float
// keeps 21 more mantissa bits than an 8-bit format, so rounding it to one again is the same
// as rounding the double once. Beyond float's range: FLT_MAX with the sticky bit (already
// set), which every 8-bit format overflows.
inline float double_to_float_odd(double d) {
  if (std::isnan(d)) return static_cast<float>(d);
  float f = static_cast<float>(d);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // rounded away: back
  if (static_cast<double>(f) != d) f = std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
  return f;
}
}  // namespace detail

inline std::uint8_t double_to_f8e4m3_bits(double d, bool saturate = true) {
  return float_to_f8e4m3_bits(detail::double_to_float_odd(d), saturate);
}
inline std::uint8_t double_to_f8e5m2_bits(double d, bool saturate = true) {
  return float_to_f8e5m2_bits(detail::double_to_float_odd(d), saturate);
}
// The largest power of two <= |d| (clamped as float_to_e8m0_bits): the float rounded
// toward zero never crosses a power of two upward.
inline std::uint8_t double_to_e8m0_bits(double d) {
  if (std::isnan(d)) return 0xff;
  float f = static_cast<float>(std::fabs(d));
  if (static_cast<double>(f) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return float_to_e8m0_bits(f);
}

}  // namespace fsdp
