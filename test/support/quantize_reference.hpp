#pragma once
// The expected result of a quantized round trip, from fsdp/core/quantize.hpp's host
// functions alone: x quantized in `format` with `block`, then dequantized.
// What the quantized all-gather tests compare each rank's gathered shard with.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/quantize.hpp"

namespace test_support {

// `allow_nonfinite`: an inf or NaN makes its block NaNs, as a device's quantize writes it
// (otherwise it is an error of the test's).
inline std::vector<float> quantize_round_trip(fsdp::QuantFormat format, const std::vector<float>& x, std::size_t block,
                                              bool allow_nonfinite = false) {
  const std::size_t n = x.size();
  std::vector<std::uint8_t> q(n), scales(fsdp::detail::block_count(n, block) * fsdp::scale_bytes(format));
  if (fsdp::detail::quantize_poisoning_nonfinite(format, x.data(), n, q.data(), scales.data(), block) &&
      !allow_nonfinite)
    fsdp::detail::fail("quantize_round_trip: the test's input holds an inf or NaN");
  std::vector<float> y(n);
  fsdp::detail::dequantize_any(format, q.data(), scales.data(), n, y.data(), block);
  return y;
}

}  // namespace test_support
