#pragma once
// 8-bit wire formats for quantized collectives (issue 38), host side: bit conversions
// between float and the OCP 8-bit floating point formats (OFP8 E4M3 and E5M2, and the
// E8M0 scale of the OCP Microscaling formats), and block quantization of host spans to
// int8 or E4M3 with one scale per block (f32 scales, or e8m0 scales for MXFP8).
// The conversions round to nearest, ties to even. Nothing here is a DType yet: the
// 8-bit values travel as std::uint8_t bit patterns (int8 as std::int8_t).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include "fsdp/core/error.hpp"

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

namespace detail {

// Number of blocks of `block` elements covering n (the last one may be shorter).
inline std::size_t block_count(std::size_t n, std::size_t block) { return n / block + (n % block != 0); }

// Checks the spans of a block (de)quantization: block > 0, as many codes as values, one
// scale per block. `fn` names the call in the message, the other names the arguments.
inline void check_block_sizes(std::string_view fn, std::size_t values, std::string_view values_name,
                              std::size_t codes, std::string_view codes_name, std::size_t scales,
                              std::size_t block) {
  if (block == 0) fail_as(ErrorKind::misuse, "fsdp::", fn, ": block must be positive");
  if (codes != values)
    fail_as(ErrorKind::misuse, "fsdp::", fn, ": ", codes_name, " has ", codes, " elements, ", values_name,
            " has ", values, " (they must match)");
  const std::size_t want = block_count(values, block);
  if (scales != want)
    fail_as(ErrorKind::misuse, "fsdp::", fn, ": scales has ", scales, " elements, want ", want, " (one per block of ",
            block, " over ", values, " elements)");
}

// The largest |x| of a block; a NaN or inf is refused (a quantized all-gather must never
// turn one into a number), naming the block and the element.
inline float block_amax(std::string_view fn, std::span<const float> x, std::size_t first, std::size_t block_index) {
  float amax = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]))
      fail_as(ErrorKind::misuse, "fsdp::", fn, ": x[", first + i, "] is ", std::isnan(x[i]) ? "NaN" : "inf",
              " (block ", block_index, "); refusing to quantize a non-finite value");
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

// amax / qmax as a float scale, rounded up (computed in double): amax / scale then never
// exceeds qmax, so no code is clamped (a quotient rounded down, in the subnormal range,
// clamped the largest values by up to a third). 0 for an all-zero block (its codes are
// then 0 and decode to exact zeros); never 0 for a nonzero block.
inline float scale_for(float amax, float qmax) {
  if (amax == 0) return 0;
  const double exact = static_cast<double>(amax) / qmax;
  float scale = static_cast<float>(exact);
  if (static_cast<double>(scale) < exact) scale = std::nextafter(scale, std::numeric_limits<float>::infinity());
  return std::max(scale, std::numeric_limits<float>::denorm_min());
}

// code * scale, in double and clamped to the finite floats: a block whose amax is near
// FLT_MAX has 127 * scale just past it, which must decode to FLT_MAX, not inf.
inline float decode_scaled(float code, float scale) {
  constexpr double top = std::numeric_limits<float>::max();
  return static_cast<float>(std::clamp(static_cast<double>(code) * scale, -top, top));
}

// Round to nearest, ties to even, independent of the floating-point environment's mode.
inline float round_half_even(float v) {
  const float lo = std::floor(v);
  const float frac = v - lo;  // exact for |v| < 2^23, the only use here
  if (frac > 0.5f || (frac == 0.5f && std::fmod(lo, 2.0f) != 0)) return lo + 1;
  return lo;
}

}  // namespace detail

// ---- int8 with one f32 scale per block -------------------------------------------------
// Block b is x[b*block, min((b+1)*block, n)); scales[b] = amax_b / 127 (0 for an all-zero
// block), q = round-half-even(x / scale) clamped to [-127, 127] (never -128, so the code
// is symmetric). Needs q.size() == x.size(), scales.size() == ceil(n / block); NaN or inf
// in x is an fsdp::Error naming the block (q and scales may then be partly written).
inline void quantize_int8_blocks(std::span<const float> x, std::span<std::int8_t> q, std::span<float> scales,
                                 std::size_t block = 128) {
  detail::check_block_sizes("quantize_int8_blocks", x.size(), "x", q.size(), "q", scales.size(), block);
  for (std::size_t b = 0, first = 0; first < x.size(); ++b, first += block) {
    const auto xs = x.subspan(first, std::min(block, x.size() - first));
    const float scale = detail::scale_for(detail::block_amax("quantize_int8_blocks", xs, first, b), 127.0f);
    scales[b] = scale;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const float v = scale == 0 ? 0.0f : detail::round_half_even(xs[i] / scale);
      q[first + i] = static_cast<std::int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

// x = q * scale of its block (an all-zero block, scale 0, gives exact zeros).
inline void dequantize_int8_blocks(std::span<const std::int8_t> q, std::span<const float> scales, std::span<float> x,
                                   std::size_t block = 128) {
  detail::check_block_sizes("dequantize_int8_blocks", q.size(), "q", x.size(), "x", scales.size(), block);
  for (std::size_t i = 0; i < q.size(); ++i) x[i] = detail::decode_scaled(static_cast<float>(q[i]), scales[i / block]);
}

// ---- E4M3 with one f32 scale per block, or per tensor ----------------------------------
// scales[b] = amax_b / 448 (0 for an all-zero block); q = e4m3(x / scale), saturating (a
// quotient a rounding above 448 still gives 448). Sizes and non-finite values as int8.
inline void quantize_f8e4m3_blocks(std::span<const float> x, std::span<std::uint8_t> q, std::span<float> scales,
                                   std::size_t block = 128) {
  detail::check_block_sizes("quantize_f8e4m3_blocks", x.size(), "x", q.size(), "q", scales.size(), block);
  for (std::size_t b = 0, first = 0; first < x.size(); ++b, first += block) {
    const auto xs = x.subspan(first, std::min(block, x.size() - first));
    const float scale = detail::scale_for(detail::block_amax("quantize_f8e4m3_blocks", xs, first, b), 448.0f);
    scales[b] = scale;
    for (std::size_t i = 0; i < xs.size(); ++i)
      q[first + i] = scale == 0 ? std::uint8_t{0} : float_to_f8e4m3_bits(xs[i] / scale, true);
  }
}

inline void dequantize_f8e4m3_blocks(std::span<const std::uint8_t> q, std::span<const float> scales,
                                     std::span<float> x, std::size_t block = 128) {
  detail::check_block_sizes("dequantize_f8e4m3_blocks", q.size(), "q", x.size(), "x", scales.size(), block);
  for (std::size_t i = 0; i < q.size(); ++i) x[i] = detail::decode_scaled(f8e4m3_bits_to_float(q[i]), scales[i / block]);
}

// Per tensor: one block spanning all of x, its scale in `scale`.
inline void quantize_f8e4m3_tensor(std::span<const float> x, std::span<std::uint8_t> q, float& scale) {
  if (x.empty() && q.empty()) { scale = 0; return; }
  quantize_f8e4m3_blocks(x, q, std::span<float>(&scale, 1), std::max<std::size_t>(x.size(), 1));
}
inline void dequantize_f8e4m3_tensor(std::span<const std::uint8_t> q, float scale, std::span<float> x) {
  if (q.empty() && x.empty()) return;
  dequantize_f8e4m3_blocks(q, std::span<const float>(&scale, 1), x, std::max<std::size_t>(q.size(), 1));
}

// ---- MXFP8 (OCP Microscaling, E4M3 elements): blocks of 32, one e8m0 scale each --------
inline constexpr std::size_t kMxBlock = 32;

// scales[b] = 2^(floor(log2 amax_b) - 8) as e8m0 (8 = the exponent of E4M3's largest
// power of two, 256), as the MX spec chooses it; q = e4m3(x / scale), saturating. So
// amax / scale lies in [256, 512): a block whose amax has a mantissa above 1.75 (amax /
// scale above 448) has its largest elements clamped to 448, by the spec's rule. An
// all-zero block gets 0x00 (2^-127) and zero codes. The last block may be shorter than
// 32; scales.size() == ceil(n / 32). NaN or inf in x is an fsdp::Error naming the block.
inline void quantize_mxfp8(std::span<const float> x, std::span<std::uint8_t> q, std::span<std::uint8_t> scales) {
  detail::check_block_sizes("quantize_mxfp8", x.size(), "x", q.size(), "q", scales.size(), kMxBlock);
  for (std::size_t b = 0, first = 0; first < x.size(); ++b, first += kMxBlock) {
    const auto xs = x.subspan(first, std::min(kMxBlock, x.size() - first));
    const float amax = detail::block_amax("quantize_mxfp8", xs, first, b);
    // floor(log2 amax) of a float (std::ilogb handles subnormals), shifted down by 8 and
    // clamped to e8m0's range; amax < 2^128, so only the lower end can clamp.
    const int shared = amax == 0 ? -127 : std::max(std::ilogb(amax) - 8, -127);
    scales[b] = static_cast<std::uint8_t>(shared + 127);
    for (std::size_t i = 0; i < xs.size(); ++i)  // x / 2^shared: exact, far above e4m3's range
      q[first + i] = float_to_f8e4m3_bits(std::ldexp(xs[i], -shared), true);
  }
}

// x = e4m3(q) * 2^(scale - 127); a NaN scale (0xff) gives NaN for its block, as the spec says.
inline void dequantize_mxfp8(std::span<const std::uint8_t> q, std::span<const std::uint8_t> scales,
                             std::span<float> x) {
  detail::check_block_sizes("dequantize_mxfp8", q.size(), "q", x.size(), "x", scales.size(), kMxBlock);
  for (std::size_t i = 0; i < q.size(); ++i) {
    const std::uint8_t s = scales[i / kMxBlock];
    x[i] = s == 0xff ? std::numeric_limits<float>::quiet_NaN()
                     : std::ldexp(f8e4m3_bits_to_float(q[i]), static_cast<int>(s) - 127);
  }
}

}  // namespace fsdp
