#pragma once
// Element-wise loops on host memory shared by the host device and the host collectives.
// f32/f64 get plain typed loops; 16-bit types round to their dtype after every operation,
// the way a device kernel working in that dtype would.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fsdp/communicator.hpp"
#include "fsdp/dtype.hpp"

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
  }
}

inline bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }

inline float half_load(std::uint16_t v, DType t) {
  return t == DType::f16 ? f16_bits_to_float(v) : bf16_bits_to_float(v);
}
inline std::uint16_t half_store(float v, DType t) {
  return t == DType::f16 ? float_to_f16_bits(v) : float_to_bf16_bits(v);
}

template <class T>
T combine(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::max: return std::max(a, b);
    case ReduceOp::min: return std::min(a, b);
    default: return static_cast<T>(a + b);
  }
}

inline void host_scale(void* p, std::size_t n, DType t, double factor) {
  if (is_half(t)) {
    auto* q = static_cast<std::uint16_t*>(p);
    for (std::size_t i = 0; i < n; ++i) q[i] = half_store(half_load(q[i], t) * static_cast<float>(factor), t);
    return;
  }
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

// dst[i] = dst[i] (op) src[i]
inline void host_combine(void* dst, const void* src, std::size_t n, DType t, ReduceOp op) {
  if (is_half(t)) {
    auto* d = static_cast<std::uint16_t*>(dst);
    auto* s = static_cast<const std::uint16_t*>(src);
    for (std::size_t i = 0; i < n; ++i)
      d[i] = half_store(combine(half_load(d[i], t), half_load(s[i], t), op), t);
    return;
  }
  for_each_typed(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* d = static_cast<T*>(dst);
    auto* s = static_cast<const T*>(src);
    for (std::size_t i = 0; i < n; ++i) d[i] = combine(d[i], s[i], op);
  });
}

// dst[i] = src[i] converted from `from` to `to`, rounding to nearest even. The 16-bit
// types go through float, which holds every f16 and bf16 value exactly.
inline void host_cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
  if (to == from) {
    if (n && dst != src) std::memmove(dst, src, n * size_of(to));
    return;
  }
  if (to == DType::f64 || from == DType::f64) {
    for (std::size_t i = 0; i < n; ++i) store_from_double(dst, i, to, load_as_double(src, i, from));
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const float v = is_half(from) ? half_load(static_cast<const std::uint16_t*>(src)[i], from)
                                  : static_cast<float>(load_as_double(src, i, from));
    if (is_half(to)) static_cast<std::uint16_t*>(dst)[i] = half_store(v, to);
    else store_from_double(dst, i, to, v);
  }
}

// ShardedGradScaler's unscale: p[i] *= inv_scale for a floating dtype `t`, the product
// taken in double and rounded once to the dtype; returns whether any result is inf or NaN
// (checked after rounding: a finite product can round to a 16-bit type's inf).
inline bool host_unscale(void* p, std::size_t n, DType t, double inv_scale) {
  bool bad = false;
  if (is_half(t)) {
    auto* q = static_cast<std::uint16_t*>(p);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t bits = half_store(static_cast<float>(static_cast<double>(half_load(q[i], t)) * inv_scale), t);
      bad |= !std::isfinite(half_load(bits, t));
      q[i] = bits;
    }
    return bad;
  }
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

}  // namespace fsdp::detail
