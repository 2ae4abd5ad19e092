#pragma once
// The expected result of a quantized round trip, from fsdp/core/quantize.hpp's host
// functions alone: x quantized in `format` with `block`, then dequantized. What the
// quantized all-gather tests compare each rank's gathered shard with.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fsdp/core/quantize.hpp"

namespace test_support {

inline std::vector<float> quantize_round_trip(fsdp::QuantFormat format, const std::vector<float>& x, std::size_t block) {
  const std::size_t n = x.size(), blocks = (n + block - 1) / block;
  std::vector<std::uint8_t> q(n), s8(blocks);
  std::vector<std::int8_t> i8(n);
  std::vector<float> s32(blocks), y(n);
  switch (format) {
    case fsdp::QuantFormat::int8_blocks:
      fsdp::quantize_int8_blocks(x, i8, s32, block);
      fsdp::dequantize_int8_blocks(i8, s32, y, block);
      break;
    case fsdp::QuantFormat::f8e4m3_blocks:
      fsdp::quantize_f8e4m3_blocks(x, q, s32, block);
      fsdp::dequantize_f8e4m3_blocks(q, s32, y, block);
      break;
    case fsdp::QuantFormat::mxfp8:
      fsdp::quantize_mxfp8(x, q, s8);
      fsdp::dequantize_mxfp8(q, s8, y);
      break;
  }
  return y;
}

}  // namespace test_support
