#pragma once
// Element-wise loops on host memory shared by the host device and the host collectives.
// f32/f64 get plain typed loops; 16-bit types round to their dtype after every operation,
// the way a device kernel working in that dtype would.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <type_traits>
#include <utility>

#include "fsdp/core/config.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

template <class F>
void for_each_typed(DType t, F&& f) {  // f(tag) with tag a pointer-type of the dtype
  switch (t) {
    case DType::f32: f(static_cast<float*>(nullptr)); return;
    case DType::f64: f(static_cast<double*>(nullptr)); return;
    case DType::i8: f(static_cast<std::int8_t*>(nullptr)); return;
    case DType::u8: f(static_cast<std::uint8_t*>(nullptr)); return;
    case DType::i32: f(static_cast<std::int32_t*>(nullptr)); return;
    case DType::i64: f(static_cast<std::int64_t*>(nullptr)); return;
    case DType::f16: case DType::bf16: f(static_cast<std::uint16_t*>(nullptr)); return;
    case DType::f8e4m3: case DType::f8e5m2: case DType::e8m0: break;  // no C++ type: callers take them first
  }
  fail("internal: dtype ", name_of(t), " reached arithmetic on its bit patterns");
}

inline bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }
inline bool is_f8(DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; }  // OFP8: arithmetic in float

inline float f8_load(std::uint8_t v, DType t) {
  return t == DType::f8e4m3 ? f8e4m3_bits_to_float(v) : f8e5m2_bits_to_float(v);
}
inline std::uint8_t f8_store(double v, DType t) {  // rounded once, not saturating (store_from_double's rule)
  return t == DType::f8e4m3 ? double_to_f8e4m3_bits(v, false) : double_to_f8e5m2_bits(v, false);
}
// e8m0 holds scales: it moves and takes max / min; anything else is refused.
[[noreturn]] inline void no_e8m0_arithmetic(const char* what) {
  fail(what, " on e8m0 (power-of-two scales): only moves and max / min are defined for it");
}

inline float half_load(std::uint16_t v, DType t) {
  return t == DType::f16 ? f16_bits_to_float(v) : bf16_bits_to_float(v);
}
inline std::uint16_t half_store(float v, DType t) {
  return t == DType::f16 ? float_to_f16_bits(v) : float_to_bf16_bits(v);
}
inline std::uint16_t half_store(double v, DType t) {  // one rounding, not two through float
  return t == DType::f16 ? double_to_f16_bits(v) : double_to_bf16_bits(v);
}

// The 8- and 16-bit floats are bit patterns computed on in float, each result rounded once
// to the dtype, as a kernel working in that dtype would: f(tag, load, store) with tag a
// pointer-type of the patterns, load(bits) -> float and store(x) -> bits for a float or a
// double x. A float goes to half_store's float overload, which keeps a NaN's payload bits
// as the CUDA kernels do (the double one makes every NaN the same quiet NaN). host_unscale
// rounds its double product once; the CUDA kernel rounds it to float first, so at a rare
// tie the two can differ by one unit in the last place. Returns false, calling nothing, for
// the other dtypes.
template <class F>
bool with_narrow_float(DType t, F&& f) {
  if (is_f8(t)) {
    f(static_cast<std::uint8_t*>(nullptr), [t](std::uint8_t v) { return f8_load(v, t); },
      [t](auto v) { return f8_store(static_cast<double>(v), t); });
    return true;
  }
  if (is_half(t)) {
    f(static_cast<std::uint16_t*>(nullptr), [t](std::uint16_t v) { return half_load(v, t); },
      [t](auto v) { return half_store(v, t); });
    return true;
  }
  return false;
}

template <class T>
T combine(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::max: return std::max(a, b);
    case ReduceOp::min: return std::min(a, b);
    default: return static_cast<T>(a + b);
  }
}

inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void host_scale(void* p, std::size_t n, DType t, double factor);
}
#if FSDP_DEFINES_IMPLEMENTATION
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void host_scale(void* p, std::size_t n, DType t, double factor) {
  if (t == DType::e8m0) no_e8m0_arithmetic("scaling");
  const bool narrow = with_narrow_float(t, [&](auto* tag, auto load, auto store) {
    auto* q = static_cast<decltype(tag)>(p);
    for (std::size_t i = 0; i < n; ++i) q[i] = store(load(q[i]) * static_cast<float>(factor));
  });
  if (narrow) return;
  for_each_typed(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* q = static_cast<T*>(p);
    if constexpr (std::is_integral_v<T>) {  // p[i] *= factor: converting factor to T would truncate it
      for (std::size_t i = 0; i < n; ++i) q[i] = static_cast<T>(q[i] * factor);
    } else {
      const T f = static_cast<T>(factor);
      for (std::size_t i = 0; i < n; ++i) q[i] = static_cast<T>(q[i] * f);
    }
  });
}
}
#endif

// dst[i] = dst[i] (op) src[i]
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void host_combine(void* dst, const void* src, std::size_t n, DType t, ReduceOp op);
}
#if FSDP_DEFINES_IMPLEMENTATION
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void host_combine(void* dst, const void* src, std::size_t n, DType t, ReduceOp op) {
  if (t == DType::e8m0) {  // the patterns order as the values do (0xff, NaN, is largest)
    if (op != ReduceOp::max && op != ReduceOp::min) no_e8m0_arithmetic(name_of(op).data());
    auto* d = static_cast<std::uint8_t*>(dst);
    auto* s = static_cast<const std::uint8_t*>(src);
    for (std::size_t i = 0; i < n; ++i) d[i] = combine(d[i], s[i], op);
    return;
  }
  const bool narrow = with_narrow_float(t, [&](auto* tag, auto load, auto store) {
    auto* d = static_cast<decltype(tag)>(dst);
    auto* s = static_cast<const std::remove_pointer_t<decltype(tag)>*>(src);
    for (std::size_t i = 0; i < n; ++i) d[i] = store(combine(load(d[i]), load(s[i]), op));
  });
  if (narrow) return;
  for_each_typed(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* d = static_cast<T*>(dst);
    auto* s = static_cast<const T*>(src);
    for (std::size_t i = 0; i < n; ++i) d[i] = combine(d[i], s[i], op);
  });
}
}
#endif

// ---- casts ----------------------------------------------------------------------------
// Floating targets round to nearest even, once: f32 and the 16-bit types go through float
// (which holds them all exactly), everything else through double, which holds every
// value but i64's beyond 2^53; those are rounded to odd first, which keeps the one later
// rounding to <= 51 bits correct. Integer targets truncate toward zero, and a value that
// does not fit (NaN and inf included) is an fsdp::Error before anything is written.

// i64 -> double, rounded to odd: exact below 2^53; above, the dropped bits stick to the
// lowest kept bit, so no later rounding to a narrower format can see a false tie.
inline double int64_to_double_odd(std::int64_t v) {
  std::uint64_t u = v < 0 ? 0 - static_cast<std::uint64_t>(v) : static_cast<std::uint64_t>(v);
  const int width = std::bit_width(u);
  if (width > 53) {
    const int drop = width - 53;
    const std::uint64_t kept = u >> drop << drop;
    if (kept != u) u = kept | (std::uint64_t{1} << drop);
  }
  const double d = static_cast<double>(u);  // exact: at most 53 significant bits
  return v < 0 ? -d : d;
}

// [lowest, highest] of an integer dtype ({0, 0} for the floating ones).
inline std::pair<std::int64_t, std::int64_t> integer_range(DType t) {
  using L8 = std::numeric_limits<std::int8_t>;
  using L32 = std::numeric_limits<std::int32_t>;
  using L64 = std::numeric_limits<std::int64_t>;
  switch (t) {
    case DType::i8: return {L8::lowest(), L8::max()};
    case DType::u8: return {0, std::numeric_limits<std::uint8_t>::max()};
    case DType::i32: return {L32::lowest(), L32::max()};
    case DType::i64: return {L64::lowest(), L64::max()};
    default: return {0, 0};
  }
}

// Throws unless every element of src (dtype `from`) truncates to a value of the integer
// dtype `to`.
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void check_fits_integer(const void* src, DType from, std::size_t n, DType to);
}
#if FSDP_DEFINES_IMPLEMENTATION
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void check_fits_integer(const void* src, DType from, std::size_t n, DType to) {
  const auto range = integer_range(to);  // not bound: clang 14 cannot capture a binding
  const std::int64_t lo = range.first, hi = range.second;
  auto refuse = [&](std::size_t i, const auto& value) {
    std::ostringstream os;
    os.precision(17);
    os << value;
    fail("cast ", name_of(from), " -> ", name_of(to), ": element ", i, " (", os.str(), ") is outside the range of ",
         name_of(to), " [", lo, ", ", hi, "]");
  };
  if (is_floating(from)) {
    // Compare in double: lo and hi + 1 are 0 or powers of two, so both are exact.
    const double lo_d = static_cast<double>(lo), above_hi = 2 * static_cast<double>(hi / 2 + 1);
    for (std::size_t i = 0; i < n; ++i) {
      const double v = load_as_double(src, i, from), t = std::trunc(v);
      if (!(t >= lo_d && t < above_hi)) refuse(i, v);  // NaN fails both
    }
    return;
  }
  const auto [from_lo, from_hi] = integer_range(from);
  if (lo <= from_lo && from_hi <= hi) return;  // every value fits
  for_each_typed(from, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_integral_v<T>) {
      const T* p = static_cast<const T*>(src);
      for (std::size_t i = 0; i < n; ++i)
        if (static_cast<std::int64_t>(p[i]) < lo || static_cast<std::int64_t>(p[i]) > hi) refuse(i, +p[i]);
    }
  });
}
}
#endif

// dst[i] = src[i] converted from `from` to `to` (see above). dst == src is fine when the
// two dtypes have the same size; other overlaps are the caller's to avoid.
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void host_cast(void* dst, DType to, const void* src, DType from, std::size_t n);
}
#if FSDP_DEFINES_IMPLEMENTATION
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void host_cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
  if (to == from) {
    if (n && dst != src) std::memmove(dst, src, n * size_of(to));
    return;
  }
  if (!is_floating(to)) check_fits_integer(src, from, n, to);
  const bool float_exact = from == DType::f32 || is_half(from);
  if (float_exact && (to == DType::f32 || is_half(to))) {
    for (std::size_t i = 0; i < n; ++i) {
      const float v = is_half(from) ? half_load(static_cast<const std::uint16_t*>(src)[i], from)
                                    : static_cast<const float*>(src)[i];
      if (is_half(to)) static_cast<std::uint16_t*>(dst)[i] = half_store(v, to);
      else static_cast<float*>(dst)[i] = v;
    }
    return;
  }
  if (from == DType::i64 && is_floating(to) && to != DType::f64) {
    const auto* p = static_cast<const std::int64_t*>(src);
    for (std::size_t i = 0; i < n; ++i) store_from_double(dst, i, to, int64_to_double_odd(p[i]));
    return;
  }
  // i64 -> i64 is a copy and i64 -> a narrower integer was checked to fit in 32 bits, so
  // double is exact for every pair left.
  for (std::size_t i = 0; i < n; ++i) store_from_double(dst, i, to, load_as_double(src, i, from));
}
}
#endif

// ShardedGradScaler's unscale: p[i] *= inv_scale for a floating dtype `t`, the product
// taken in double and rounded once to the dtype; returns whether any result is inf or NaN
// (checked after rounding: a finite product can round to a 16-bit type's inf).
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL bool host_unscale(void* p, std::size_t n, DType t, double inv_scale);
}
#if FSDP_DEFINES_IMPLEMENTATION
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL bool host_unscale(void* p, std::size_t n, DType t, double inv_scale) {
  bool bad = false;
  if (t == DType::e8m0) no_e8m0_arithmetic("unscaling");
  const bool narrow = with_narrow_float(t, [&](auto* tag, auto load, auto store) {
    auto* q = static_cast<decltype(tag)>(p);
    for (std::size_t i = 0; i < n; ++i) {
      const auto bits = store(static_cast<double>(load(q[i])) * inv_scale);
      bad |= !std::isfinite(load(bits));
      q[i] = bits;
    }
  });
  if (narrow) return bad;
  auto typed = [&](auto* q) {
    using T = std::remove_pointer_t<decltype(q)>;
    for (std::size_t i = 0; i < n; ++i) {
      const T v = static_cast<T>(static_cast<double>(q[i]) * inv_scale);
      bad |= !std::isfinite(v);
      q[i] = v;
    }
  };
  if (t == DType::f64) typed(static_cast<double*>(p));
  else typed(static_cast<float*>(p));
  return bad;
}
}
#endif

}  // namespace fsdp::detail
