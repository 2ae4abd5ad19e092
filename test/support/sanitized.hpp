#pragma once
// Whether this test program runs under a sanitizer (tools/sanitize.sh: clang at -O0 with
// ASan + UBSan, or TSan), and how much of a long sweep of pure arithmetic to run under one.
// Such a sweep (every float of a stride, millions of random values, a matrix of policy
// combinations each trained alike) checks values, and the plain build runs it whole; under a
// sanitizer the same code is 5 to 10 times slower, and a sample of it reaches the same
// instructions, which is what a sanitizer checks. So sanitized runs take every 16th (or 13th).
// The TCP backend's long sweeps of its collectives take a sample too (test/asio: every 13th
// case of the ring simulation, fewer world sizes, smaller inputs): there a sanitizer checks
// the threads and buffers that a sample reaches as well.
#include <cstdint>

namespace test_support {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool sanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif
#else
inline constexpr bool sanitized = false;
#endif

// A sweep's stride: `step`, or 16 times it under a sanitizer.
inline constexpr std::uint64_t sweep_stride(std::uint64_t step) { return sanitized ? 16 * step : step; }
// A sweep's count: `n`, or a 16th of it (at least 1) under a sanitizer.
inline constexpr int sweep_count(int n) { return sanitized ? (n / 16 > 0 ? n / 16 : 1) : n; }
// Whether case `i` of a nested sweep (numbered across all its loops) runs: every case, or every
// 13th under a sanitizer. 13 is prime, so no loop of fewer than 13 values is stuck on one of
// them: over a long enough sweep every value of every loop still comes up (in ring_test's 576
// cases, every pair of a world size and a segment size too).
inline constexpr bool sweep_takes(std::uint64_t i) { return !sanitized || i % 13 == 0; }

}  // namespace test_support
