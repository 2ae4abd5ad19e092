#pragma once
// 8-bit wire formats for quantized collectives (issue 38), host side: block quantization
// of host spans to int8, E4M3 or E5M2 with one scale per block (f32 scales, or e8m0 scales
// for MXFP8), and E4M3 or E5M2 with one scale per tensor (with the helpers a device's
// per-tensor kernels share: abs_max, the ranks' largest, quantize and dequantize with an
// agreed amax). The bit conversions of the 8-bit floats are fsdp/core/f8.hpp's (the dtypes
// DType::f8e4m3, f8e5m2 and e8m0); here the values travel as spans of std::uint8_t bit
// patterns (int8 as std::int8_t).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string_view>

#include "fsdp/core/error.hpp"
#include "fsdp/core/f8.hpp"
#include "fsdp/core/quant_format.hpp"

namespace fsdp {

namespace detail {

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

// The f32-scaled block quantizations (int8, E4M3, E5M2), `fn` naming the call in messages: per
// block, its amax (a non-finite value refused), its scale amax / qmax rounded up
// (scale_for), then each code encode(x / scale), or the zero code for an all-zero block.
template <class Code, class Encode>
void quantize_blocks(std::string_view fn, std::span<const float> x, std::span<Code> q, std::span<float> scales,
                     std::size_t block, float qmax, Encode encode) {
  check_block_sizes(fn, x.size(), "x", q.size(), "q", scales.size(), block);
  for (std::size_t b = 0, first = 0; first < x.size(); ++b, first += block) {
    const auto xs = x.subspan(first, std::min(block, x.size() - first));
    const float scale = scale_for(block_amax(fn, xs, first, b), qmax);
    scales[b] = scale;
    for (std::size_t i = 0; i < xs.size(); ++i) q[first + i] = scale == 0 ? Code{0} : encode(xs[i] / scale);
  }
}

// Their inverse: x = decode(q) * the scale of its block (decode_scaled).
template <class Code, class Decode>
void dequantize_blocks(std::string_view fn, std::span<const Code> q, std::span<const float> scales, std::span<float> x,
                       std::size_t block, Decode decode) {
  check_block_sizes(fn, q.size(), "q", x.size(), "x", scales.size(), block);
  for (std::size_t i = 0; i < q.size(); ++i) x[i] = decode_scaled(decode(q[i]), scales[i / block]);
}

}  // namespace detail

// ---- int8 with one f32 scale per block -------------------------------------------------
// Block b is x[b*block, min((b+1)*block, n)); scales[b] = amax_b / 127 (0 for an all-zero
// block), q = round-half-even(x / scale) clamped to [-127, 127] (never -128, so the code
// is symmetric). Needs q.size() == x.size(), scales.size() == ceil(n / block); NaN or inf
// in x is an fsdp::Error naming the block (q and scales may then be partly written).
inline void quantize_int8_blocks(std::span<const float> x, std::span<std::int8_t> q, std::span<float> scales,
                                 std::size_t block = 128) {
  detail::quantize_blocks("quantize_int8_blocks", x, q, scales, block, 127.0f, [](float v) {
    return static_cast<std::int8_t>(std::clamp(detail::round_half_even(v), -127.0f, 127.0f));
  });
}

// x = q * scale of its block (an all-zero block, scale 0, gives exact zeros).
inline void dequantize_int8_blocks(std::span<const std::int8_t> q, std::span<const float> scales, std::span<float> x,
                                   std::size_t block = 128) {
  detail::dequantize_blocks("dequantize_int8_blocks", q, scales, x, block,
                            [](std::int8_t c) { return static_cast<float>(c); });
}

// ---- E4M3 with one f32 scale per block, or per tensor ----------------------------------
// scales[b] = amax_b / 448 (0 for an all-zero block); q = e4m3(x / scale), saturating (a
// quotient a rounding above 448 still gives 448). Sizes and non-finite values as int8.
inline void quantize_f8e4m3_blocks(std::span<const float> x, std::span<std::uint8_t> q, std::span<float> scales,
                                   std::size_t block = 128) {
  detail::quantize_blocks("quantize_f8e4m3_blocks", x, q, scales, block, 448.0f,
                          [](float v) { return float_to_f8e4m3_bits(v, true); });
}

inline void dequantize_f8e4m3_blocks(std::span<const std::uint8_t> q, std::span<const float> scales,
                                     std::span<float> x, std::size_t block = 128) {
  detail::dequantize_blocks("dequantize_f8e4m3_blocks", q, scales, x, block,
                            [](std::uint8_t c) { return f8e4m3_bits_to_float(c); });
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

// ---- E5M2 with one f32 scale per block, or per tensor ----------------------------------
// As E4M3 blocks, with E5M2's largest value: scales[b] = amax_b / 57344, q = e5m2(x / scale),
// saturating. Two mantissa bits to E4M3's three, so a rounding error of up to 2^-3 of a
// value, not 2^-4; but five exponent bits, so that bound holds down to 2^-29 of the
// block's amax, where E4M3's holds to 2^-14 (below, subnormal codes keep less). Worth
// it for blocks whose values span many binades (an outlier beside small values);
// otherwise E4M3, or int8, keeps more of each value.
inline void quantize_f8e5m2_blocks(std::span<const float> x, std::span<std::uint8_t> q, std::span<float> scales,
                                   std::size_t block = 128) {
  detail::quantize_blocks("quantize_f8e5m2_blocks", x, q, scales, block, 57344.0f,
                          [](float v) { return float_to_f8e5m2_bits(v, true); });
}
inline void dequantize_f8e5m2_blocks(std::span<const std::uint8_t> q, std::span<const float> scales,
                                     std::span<float> x, std::size_t block = 128) {
  detail::dequantize_blocks("dequantize_f8e5m2_blocks", q, scales, x, block,
                            [](std::uint8_t c) { return f8e5m2_bits_to_float(c); });
}

// Per tensor: one block spanning all of x, its scale in `scale` (amax / 57344).
inline void quantize_f8e5m2_tensor(std::span<const float> x, std::span<std::uint8_t> q, float& scale) {
  if (x.empty() && q.empty()) { scale = 0; return; }
  quantize_f8e5m2_blocks(x, q, std::span<float>(&scale, 1), std::max<std::size_t>(x.size(), 1));
}
inline void dequantize_f8e5m2_tensor(std::span<const std::uint8_t> q, float scale, std::span<float> x) {
  if (q.empty() && x.empty()) return;
  dequantize_f8e5m2_blocks(q, std::span<const float>(&scale, 1), x, std::max<std::size_t>(q.size(), 1));
}

// ---- MXFP8 (OCP Microscaling, E4M3 elements): blocks of 32, one e8m0 scale each --------

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

// Checks a format's block size (MXFP8's is 32, the others' any positive number); `who`
// names the caller in the message. A per-tensor format has no blocks: refused here, so a
// block quantize never receives one (its scale is agreed first: quantize_tensor).
inline void check_quant_block(QuantFormat f, std::size_t block, std::string_view who) {
  if (is_per_tensor(f))
    detail::fail_as(ErrorKind::misuse, who, ": ", name_of(f),
                    " scales per tensor, not per block: quantize it with the device's quantize_tensor and "
                    "dequantize_tensor (fsdp::TensorScalingDevice) after the ranks agree on each tensor's amax");
  if (f == QuantFormat::mxfp8 ? block != kMxBlock : block == 0)
    detail::fail_as(ErrorKind::misuse, who, ": ", name_of(f), " needs ",
            f == QuantFormat::mxfp8 ? "block = 32 (the MX block)" : "a positive block", ", got block = ", block);
}

namespace detail {

// What a device's quantize does (HostDevice's, and the emulated GPU kernel's): n values
// of x into q (n codes) and scales (one per block, scale_bytes(f) each), block by block;
// a block holding an inf or NaN does not throw but is written as a NaN block (zero codes,
// scale NaN, or 0xff in e8m0), which every format's dequantization turns into NaNs, so
// no inf or NaN ever comes back a number. Returns the lowest such element's index, if
// any. A per-tensor format, or a block its format does not take, is refused
// (check_quant_block).
inline std::optional<std::size_t> quantize_poisoning_nonfinite(QuantFormat f, const float* x, std::size_t n, void* q,
                                                               void* scales, std::size_t block) {
  check_quant_block(f, block, "quantize");
  std::optional<std::size_t> bad;
  auto* codes = static_cast<std::uint8_t*>(q);
  auto* s8 = static_cast<std::uint8_t*>(scales);
  auto* s32 = static_cast<float*>(scales);
  for (std::size_t first = 0, b = 0; first < n; first += block, ++b) {
    const std::span<const float> xs(x + first, std::min(block, n - first));
    const auto it = std::find_if(xs.begin(), xs.end(), [](float v) { return !std::isfinite(v); });
    if (it != xs.end()) {
      if (!bad) bad = first + static_cast<std::size_t>(it - xs.begin());
      std::fill_n(codes + first, xs.size(), std::uint8_t{0});
      if (f == QuantFormat::mxfp8) s8[b] = 0xff;
      else s32[b] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const std::span<std::uint8_t> cs(codes + first, xs.size());
    switch (f) {
      case QuantFormat::int8_blocks:
        quantize_int8_blocks(xs, {reinterpret_cast<std::int8_t*>(cs.data()), cs.size()}, {s32 + b, 1}, xs.size());
        break;
      case QuantFormat::f8e4m3_blocks: quantize_f8e4m3_blocks(xs, cs, {s32 + b, 1}, xs.size()); break;
      case QuantFormat::f8e5m2_blocks: quantize_f8e5m2_blocks(xs, cs, {s32 + b, 1}, xs.size()); break;
      case QuantFormat::mxfp8: quantize_mxfp8(xs, cs, {s8 + b, 1}); break;
      case QuantFormat::f8e4m3_tensor:
      case QuantFormat::f8e5m2_tensor: break;  // refused above
    }
  }
  return bad;
}

// Its inverse for n codes (dequantize_int8_blocks, dequantize_f8e4m3_blocks,
// dequantize_f8e5m2_blocks, dequantize_mxfp8).
inline void dequantize_any(QuantFormat f, const void* q, const void* scales, std::size_t n, float* x, std::size_t block) {
  check_quant_block(f, block, "dequantize");
  const auto* codes = static_cast<const std::uint8_t*>(q);
  const std::size_t blocks = block_count(n, block);
  switch (f) {
    case QuantFormat::int8_blocks:
      dequantize_int8_blocks({reinterpret_cast<const std::int8_t*>(codes), n}, {static_cast<const float*>(scales), blocks},
                             {x, n}, block);
      break;
    case QuantFormat::f8e4m3_blocks:
      dequantize_f8e4m3_blocks({codes, n}, {static_cast<const float*>(scales), blocks}, {x, n}, block);
      break;
    case QuantFormat::f8e5m2_blocks:
      dequantize_f8e5m2_blocks({codes, n}, {static_cast<const float*>(scales), blocks}, {x, n}, block);
      break;
    case QuantFormat::mxfp8: dequantize_mxfp8({codes, n}, {static_cast<const std::uint8_t*>(scales), blocks}, {x, n}); break;
    case QuantFormat::f8e4m3_tensor:
    case QuantFormat::f8e5m2_tensor: break;  // refused above
  }
}

// ---- per-tensor scaling with an agreed amax (a unit's F8E4M3Tensor / F8E5M2Tensor gather) --
// What a device's abs_max, max_over_rows, quantize_tensor and dequantize_tensor do
// (HostDevice's, and the emulated GPU kernels'), so every device computes the same bits.
// The ranks holding slices of one tensor each take their slice's abs_max, agree on the
// largest (an all-gather of them, then max_over_rows: scale_for is monotone, so the
// largest local amax is the tensor's), then quantize their slice with it: the codes are
// those quantize_f8e4m3_tensor / quantize_f8e5m2_tensor give for the whole tensor.

// The largest code of a per-tensor format (E4M3's 448, E5M2's 57344).
inline float tensor_qmax(QuantFormat f, std::string_view who = "quantize_tensor") {
  if (!is_per_tensor(f))
    fail_as(ErrorKind::misuse, "fsdp::", who, ": ", name_of(f), " is a block format, not a per-tensor one "
            "(f8e4m3_tensor, f8e5m2_tensor)");
  return f == QuantFormat::f8e4m3_tensor ? 448.0f : 57344.0f;
}

// max |x[i]| over n values (0 for n = 0); +inf when any is inf or NaN, never NaN, so that
// a tensor holding one on any rank agrees on a non-finite amax (max_over_rows keeps it).
inline float abs_max_or_inf(const float* x, std::size_t n) {
  float amax = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return std::numeric_limits<float>::infinity();
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

// out[i] = the largest of in[r * n + i] over `rows` rows (0 for no rows): the ranks'
// amaxes of n tensors, gathered rank by rank, into the agreed ones. An amax is never NaN
// (abs_max_or_inf); a NaN would still be read as +inf, since agreement must never drop a
// poisoned tensor.
inline void max_over_rows(const float* in, std::size_t rows, std::size_t n, float* out) {
  for (std::size_t i = 0; i < n; ++i) {
    float m = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      const float v = in[r * n + i];
      m = std::isnan(v) ? std::numeric_limits<float>::infinity() : std::max(m, v);
    }
    out[i] = m;
  }
}

// n values of x into n codes with the tensor's agreed `amax`: scale = scale_for(amax,
// qmax), code = encode(x / scale) saturating, zero codes for scale 0, as the block
// formats encode. A non-finite amax writes zero codes (dequantize_tensor_with_amax turns
// them into NaNs, never numbers).
inline void quantize_tensor_with_amax(QuantFormat f, const float* x, std::size_t n, std::uint8_t* q, float amax) {
  const float qmax = tensor_qmax(f);
  if (!std::isfinite(amax)) {
    std::fill_n(q, n, std::uint8_t{0});
    return;
  }
  const float scale = scale_for(amax, qmax);
  const bool e4m3 = f == QuantFormat::f8e4m3_tensor;
  for (std::size_t i = 0; i < n; ++i)
    q[i] = scale == 0 ? std::uint8_t{0}
                      : e4m3 ? float_to_f8e4m3_bits(x[i] / scale, true) : float_to_f8e5m2_bits(x[i] / scale, true);
}

// Its inverse: y = decode(q) * scale_for(amax, qmax) (decode_scaled); every element NaN
// when amax is not finite (the tensor held an inf or NaN on some rank).
inline void dequantize_tensor_with_amax(QuantFormat f, const std::uint8_t* q, std::size_t n, float amax, float* y) {
  const float qmax = tensor_qmax(f, "dequantize_tensor");
  if (!std::isfinite(amax)) {
    std::fill_n(y, n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const float scale = scale_for(amax, qmax);
  const bool e4m3 = f == QuantFormat::f8e4m3_tensor;
  for (std::size_t i = 0; i < n; ++i)
    y[i] = decode_scaled(e4m3 ? f8e4m3_bits_to_float(q[i]) : f8e5m2_bits_to_float(q[i]), scale);
}

}  // namespace detail

}  // namespace fsdp
