#pragma once
// fsdp::cast: converts host memory between any two dtypes, for engines that keep their
// own dtypes and convert at the edges (loading a checkpoint, feeding an optimizer).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/tensor.hpp"

namespace fsdp {

// dst[i] = src[i] converted from `from` to `to`, for i in [0, n), on host memory.
//  - To a floating dtype: rounded to nearest, ties to even, in one step (f64 -> bf16 or
//    f16 never rounds twice through f32; i64 above 2^53 neither); NaN stays NaN,
//    overflow gives inf, signed zero is kept.
//  - To an integer dtype: floats truncate toward zero (as C++ and torch's .to() do). A
//    value that does not fit the target (NaN, inf, or out of range, also from a wider
//    integer) is an fsdp::Error naming the element; dst is then left untouched.
//  - n == 0 does nothing (null pointers are fine then). Otherwise dst and src must not
//    overlap, except dst == src when both dtypes have the same size (in place).
inline void cast(void* dst, DType to, const void* src, DType from, std::size_t n) {
  if (n == 0) return;
  const std::size_t in_bytes = detail::checked_bytes(n, from, "fsdp::cast source");
  const std::size_t out_bytes = detail::checked_bytes(n, to, "fsdp::cast destination");
  auto describe = [&] {
    return "fsdp::cast(" + std::to_string(n) + " elements, " + std::string(name_of(from)) + " -> " +
           std::string(name_of(to)) + ")";
  };
  if (!dst || !src) detail::fail(describe(), ": ", !dst ? "dst" : "src", " is null");
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  const bool overlap = d < s + in_bytes && s < d + out_bytes;
  if (overlap && !(d == s && in_bytes == out_bytes))
    detail::fail(describe(), ": dst and src overlap; only dst == src with dtypes of the same size converts in place");
  detail::host_cast(dst, to, src, from, n);
}

}  // namespace fsdp
