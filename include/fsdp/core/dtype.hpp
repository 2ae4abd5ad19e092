#pragma once
// Element types the library moves and reduces, with host conversions for the 16-bit ones
// (the 8-bit floats' are fsdp/core/f8.hpp's).
//   f8e4m3, f8e5m2: OCP OFP8 (E4M3FN: max 448, no inf; E5M2: max 57344, IEEE-like)
//   e8m0: the OCP MX block scale, 2^(bits - 127), unsigned, 0xff NaN: it moves and takes
//         max / min, but has no sum (an error says so)
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "fsdp/core/error.hpp"
#include "fsdp/core/f8.hpp"

namespace fsdp {

// The codes are stable (checkpoints and wire messages carry them): new ones go last.
enum class DType : std::uint8_t { f32, f64, f16, bf16, i8, u8, i32, i64, f8e4m3, f8e5m2, e8m0 };

// Whether a byte read from a wire or a file names a DType (the last one is e8m0).
constexpr bool is_dtype_code(std::uint8_t code) { return code <= static_cast<std::uint8_t>(DType::e8m0); }

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::i8: case DType::u8: case DType::f8e4m3: case DType::f8e5m2: case DType::e8m0: return 1;
  }
  return 0;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::f8e4m3: return "f8e4m3";
    case DType::f8e5m2: return "f8e5m2";
    case DType::e8m0: return "e8m0";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16 || t == DType::f8e4m3 ||
         t == DType::f8e5m2 || t == DType::e8m0;
}

// The dtypes a parameter, its gradient and a precision policy's casts can be in. The 8-bit
// floats are floating but not among them: they hold a tensor's values only with per-block
// scales (fsdp/core/quantize.hpp), which no unit keeps yet (issue 38).
constexpr bool is_compute_dtype(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

// Tag types so policies can name dtypes at compile time: MixedPrecision<bf16, float>.
struct f16 { static constexpr DType value = DType::f16; };
struct bf16 { static constexpr DType value = DType::bf16; };
struct f8e4m3 { static constexpr DType value = DType::f8e4m3; };
struct f8e5m2 { static constexpr DType value = DType::f8e5m2; };
struct e8m0 { static constexpr DType value = DType::e8m0; };
template <class T> struct dtype_of;  // C++ type -> DType
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<f8e4m3> { static constexpr DType value = DType::f8e4m3; };
template <> struct dtype_of<f8e5m2> { static constexpr DType value = DType::f8e5m2; };
template <> struct dtype_of<e8m0> { static constexpr DType value = DType::e8m0; };
template <> struct dtype_of<std::int8_t> { static constexpr DType value = DType::i8; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <class T> inline constexpr DType dtype_v = dtype_of<T>::value;

// ---- host conversions, round-to-nearest-even, NaN stays NaN, overflow goes to inf ----
// float -> 16-bit here; double -> 16-bit (one rounding, not two through float) below.

inline std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // ties go to the even neighbour
  return static_cast<std::uint16_t>(u >> 16);
}

inline float bf16_bits_to_float(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

inline std::uint16_t float_to_f16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // rounds to 0 (ties to even 0)
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // result = mant >> (shift) in half-subnormal units
    std::uint32_t r = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

inline float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    int e = -1;  // normalise the subnormal
    do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
    return std::bit_cast<float>(sign | static_cast<std::uint32_t>(112 - e) << 23 | (mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(sign | (exp + 112u) << 23 | mant << 13);
}

namespace detail {
// double -> a 16-bit float format with `kExpBits` exponent and `kMantBits` mantissa bits,
// rounded once (never through float, which would round twice): round to nearest, ties to
// even; NaN stays NaN (quiet), overflow goes to inf, subnormals and signed zero kept.
template <int kExpBits, int kMantBits>
std::uint16_t double_to_16bit(double d) {
  constexpr int bias = (1 << (kExpBits - 1)) - 1;
  constexpr std::uint64_t inf = ((std::uint64_t{1} << kExpBits) - 1) << kMantBits;
  const std::uint64_t u = std::bit_cast<std::uint64_t>(d);
  const auto sign = static_cast<std::uint16_t>((u >> 48) & 0x8000u);
  const std::uint64_t abs = u & 0x7fffffffffffffffull;
  if (abs > 0x7ff0000000000000ull) return static_cast<std::uint16_t>(sign | inf | (1u << (kMantBits - 1)));
  const int e = static_cast<int>(abs >> 52) - 1023;  // unbiased; double subnormals are far below
  if (e < -bias - kMantBits) return sign;            // under half the smallest subnormal: zero
  const std::uint64_t m = (abs & 0xfffffffffffffull) | (std::uint64_t{1} << 52);
  // Bits of m below the target's quantum: its mantissa width, plus the shift to subnormal.
  const int drop = 52 - kMantBits + std::max(0, 1 - bias - e);
  std::uint64_t r = m >> drop;
  const std::uint64_t rest = m & ((std::uint64_t{1} << drop) - 1), half = std::uint64_t{1} << (drop - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  // r carries into the exponent on its own when rounding up to the next binade.
  const std::uint64_t bits = (static_cast<std::uint64_t>(std::max(e + bias, 1) - 1) << kMantBits) + r;
  return static_cast<std::uint16_t>(sign | std::min(bits, inf));
}
}  // namespace detail

inline std::uint16_t double_to_bf16_bits(double d) { return detail::double_to_16bit<8, 7>(d); }
inline std::uint16_t double_to_f16_bits(double d) { return detail::double_to_16bit<5, 10>(d); }

// Reads element i of a buffer of dtype t as double / writes it back (host only; used by
// host reductions and casts, never on a per-element hot path of f32 which has its own loop).
inline double load_as_double(const void* p, std::size_t i, DType t) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::f16: return f16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case DType::bf16: return bf16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case DType::i8: return static_cast<const std::int8_t*>(p)[i];
    case DType::u8: return static_cast<const std::uint8_t*>(p)[i];
    case DType::i32: return static_cast<const std::int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case DType::f8e4m3: return f8e4m3_bits_to_float(static_cast<const std::uint8_t*>(p)[i]);
    case DType::f8e5m2: return f8e5m2_bits_to_float(static_cast<const std::uint8_t*>(p)[i]);
    case DType::e8m0: return e8m0_bits_to_float(static_cast<const std::uint8_t*>(p)[i]);
  }
  return 0;
}

// Integer dtypes truncate toward zero and need v in their range (fsdp::cast checks it).
// The 8-bit floats round once to nearest even and, like the 16-bit ones, do not saturate:
// beyond their largest finite value E5M2 gives inf and E4M3 (which has none) NaN. e8m0
// takes the largest power of two <= |v|.
inline void store_from_double(void* p, std::size_t i, DType t, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(p)[i] = v; return;
    case DType::f16: static_cast<std::uint16_t*>(p)[i] = double_to_f16_bits(v); return;
    case DType::bf16: static_cast<std::uint16_t*>(p)[i] = double_to_bf16_bits(v); return;
    case DType::i8: static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(v); return;
    case DType::u8: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); return;
    case DType::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); return;
    case DType::i64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); return;
    case DType::f8e4m3: static_cast<std::uint8_t*>(p)[i] = double_to_f8e4m3_bits(v, false); return;
    case DType::f8e5m2: static_cast<std::uint8_t*>(p)[i] = double_to_f8e5m2_bits(v, false); return;
    case DType::e8m0: static_cast<std::uint8_t*>(p)[i] = double_to_e8m0_bits(v); return;
  }
}

}  // namespace fsdp
