#pragma once
// The benchmark's inputs and the results expected from them. Element i of rank r's input
// is (7r + i) mod 251: small integers, so sums over up to 64 ranks are exact in f32, and a
// misplaced chunk, a missed peer or a shifted element shows up (251 is prime, so no
// power-of-two chunk lines up with the period). Everything has period 251, so buffers of
// a GiB are filled and checked a period at a time with memcpy / memcmp.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <optional>

namespace bench {

constexpr std::size_t kPeriod = 251;
using Period = std::array<float, kPeriod>;

inline float pattern(int rank, std::size_t i) {
  return static_cast<float>((static_cast<std::size_t>(rank) * 7 + i) % kPeriod);
}

// One period of rank r's input.
inline Period input_period(int rank) {
  Period p;
  for (std::size_t k = 0; k < kPeriod; ++k) p[k] = pattern(rank, k);
  return p;
}

// One period of the sum of every rank's input.
inline Period sum_period(int world) {
  Period p{};
  for (int q = 0; q < world; ++q)
    for (std::size_t k = 0; k < kPeriod; ++k) p[k] += pattern(q, k);
  return p;
}

// out[i] = period[(start + i) % kPeriod] for i in [0, n).
inline void fill_periodic(float* out, std::size_t n, const Period& period, std::size_t start = 0) {
  std::array<float, 2 * kPeriod> twice;  // any window of kPeriod elements is contiguous here
  std::copy(period.begin(), period.end(), twice.begin());
  std::copy(period.begin(), period.end(), twice.begin() + kPeriod);
  const float* window = twice.data() + start % kPeriod;
  for (std::size_t i = 0; i < n; i += kPeriod) std::memcpy(out + i, window, std::min(kPeriod, n - i) * sizeof(float));
}

// The first i in [0, n) with got[i] != period[(start + i) % kPeriod], if any.
inline std::optional<std::size_t> first_mismatch(const float* got, std::size_t n, const Period& period,
                                                 std::size_t start = 0) {
  Period window;
  fill_periodic(window.data(), kPeriod, period, start);
  for (std::size_t i = 0; i < n; i += kPeriod) {
    const std::size_t len = std::min(kPeriod, n - i);
    if (std::memcmp(got + i, window.data(), len * sizeof(float)) == 0) continue;
    for (std::size_t k = 0; k < len; ++k)  // bitwise: -1, NaN and -0 all count as wrong
      if (std::memcmp(got + i + k, &window[k], sizeof(float)) != 0) return i + k;
  }
  return std::nullopt;
}

}  // namespace bench
