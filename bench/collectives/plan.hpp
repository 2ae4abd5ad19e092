#pragma once
// What one run measures: sizes, iteration counts, and which sizes fit in memory.
#include <algorithm>
#include <cstddef>
#include <fstream>
#include <string>
#include <vector>

namespace bench {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

inline std::string format_bytes(std::size_t b) {
  if (b >= GiB && b % GiB == 0) return std::to_string(b / GiB) + " GiB";
  if (b >= MiB && b % MiB == 0) return std::to_string(b / MiB) + " MiB";
  if (b >= KiB && b % KiB == 0) return std::to_string(b / KiB) + " KiB";
  return std::to_string(b) + " B";
}

// min, 4*min, 16*min, ... up to max, and max itself if the powers of 4 miss it.
inline std::vector<std::size_t> sizes_between(std::size_t min_bytes, std::size_t max_bytes) {
  std::vector<std::size_t> sizes;
  for (std::size_t b = min_bytes; b <= max_bytes; b *= 4) sizes.push_back(b);
  if (sizes.empty() || sizes.back() != max_bytes) sizes.push_back(max_bytes);
  return sizes;
}

// Timed iterations at most: `max_iters` while a call moves up to 1 MiB in all, then fewer
// so that a row moves about 64 MiB, but at least 3 (a median of 3 drops one outlier).
// measure() runs fewer still when one call takes long (kRowBudgetSeconds).
inline int iters_for(std::size_t bytes_per_rank, int world, int max_iters) {
  const std::size_t moved = bytes_per_rank * static_cast<std::size_t>(world);
  const std::size_t scaled = std::max<std::size_t>(1, 64 * MiB / std::max<std::size_t>(moved, 1));
  return static_cast<int>(std::clamp<std::size_t>(scaled, std::min(3, max_iters), static_cast<std::size_t>(max_iters)));
}
inline int warmup_for(int iters) { return iters >= 10 ? 2 : 1; }

// Bytes a row may need across all ranks of the host: each rank holds send + recv
// ((world + 1) * size) and a backend may stage as much again (Gloo's reduce-scatter does).
inline std::size_t row_footprint(std::size_t bytes_per_rank, int world) {
  return 2 * static_cast<std::size_t>(world) * static_cast<std::size_t>(world + 1) * bytes_per_rank;
}

// MemAvailable from /proc/meminfo; 0 if unknown.
inline std::size_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  std::size_t kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * KiB;
  return 0;
}

// The 1-minute load average ("?" if unknown): other processes on the cores make the
// figures noisy, so the output says how busy the machine was.
inline std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  return in >> one ? one : "?";
}

}  // namespace bench
