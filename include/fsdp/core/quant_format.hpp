#pragma once
// The quantized wire formats as one value, apart from the quantization itself
// (fsdp/core/quantize.hpp): what a device's quantize kernel takes, and what a policy
// (CommPrecision's quantized Gather, fsdp/policy/policies.hpp) names, without either
// including the host arithmetic. Block formats carry their scales beside the codes; the
// per-tensor formats carry codes only, their one scale per tensor agreed by the ranks
// (the largest of their gathered amaxes) before anything is quantized.
#include <cstddef>
#include <string_view>

namespace fsdp {

enum class QuantFormat : int {
  int8_blocks = 0,    // quantize_int8_blocks: int8 codes, one f32 scale per block (default 128)
  f8e4m3_blocks = 1,  // quantize_f8e4m3_blocks: E4M3 codes, one f32 scale per block (default 128)
  mxfp8 = 2,          // quantize_mxfp8: E4M3 codes, one e8m0 scale per block of 32 (fixed)
  f8e5m2_blocks = 3,  // quantize_f8e5m2_blocks: E5M2 codes, one f32 scale per block (default 128)
  f8e4m3_tensor = 4,  // quantize_f8e4m3_tensor: E4M3 codes, one f32 scale per tensor (amax / 448)
  f8e5m2_tensor = 5,  // quantize_f8e5m2_tensor: E5M2 codes, one f32 scale per tensor (amax / 57344)
};

inline constexpr std::string_view name_of(QuantFormat f) {
  switch (f) {
    case QuantFormat::int8_blocks: return "int8_blocks";
    case QuantFormat::f8e4m3_blocks: return "f8e4m3_blocks";
    case QuantFormat::mxfp8: return "mxfp8";
    case QuantFormat::f8e5m2_blocks: return "f8e5m2_blocks";
    case QuantFormat::f8e4m3_tensor: return "f8e4m3_tensor";
    case QuantFormat::f8e5m2_tensor: return "f8e5m2_tensor";
  }
  return "?";
}

// Whether f scales per tensor (one scale, agreed before quantizing, not on the wire) rather
// than per block: a device quantizes it with quantize_tensor, not quantize.
inline constexpr bool is_per_tensor(QuantFormat f) {
  return f == QuantFormat::f8e4m3_tensor || f == QuantFormat::f8e5m2_tensor;
}

// Bytes of one scale: 4 (f32) or 1 (e8m0). Codes are one byte each in every format. A
// per-tensor format's scale is an f32 amax in device memory, never in a slot.
inline constexpr std::size_t scale_bytes(QuantFormat f) { return f == QuantFormat::mxfp8 ? 1 : 4; }

// MXFP8's block: 32 elements share one e8m0 scale (OCP Microscaling).
inline constexpr std::size_t kMxBlock = 32;

namespace detail {
// Number of blocks of `block` elements covering n (the last one may be shorter).
inline constexpr std::size_t block_count(std::size_t n, std::size_t block) { return n / block + (n % block != 0); }

// One rank's slot in a quantized all-gather of n values: an 8-byte status word if
// `status` (fsdp::quantized_all_gather's; a unit's slots have none), the block scales
// (none for a per-tensor format: its scale is agreed, not sent; `block` is then unused),
// the n codes, then padding to a multiple of 8 bytes, so that in a buffer of slots every
// status and f32 scale stays aligned. Offsets in bytes from the slot's start.
struct QuantSlot {
  std::size_t scales_at = 0;
  std::size_t codes_at = 0;
  std::size_t used = 0;   // codes_at + n: the bytes written; the rest is padding
  std::size_t bytes = 0;  // the slot's size
};
inline constexpr QuantSlot quant_slot(QuantFormat f, std::size_t n, std::size_t block, bool status) {
  QuantSlot s;
  s.scales_at = status ? 8 : 0;
  s.codes_at = s.scales_at + (is_per_tensor(f) ? 0 : block_count(n, block) * scale_bytes(f));
  s.used = s.codes_at + n;
  s.bytes = (s.used + 7) / 8 * 8;
  return s;
}
}  // namespace detail

}  // namespace fsdp
