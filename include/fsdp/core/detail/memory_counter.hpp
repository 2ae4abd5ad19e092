#pragma once
// Live and peak bytes per memory space: the accounting every Device does the same way.
#include <algorithm>
#include <array>
#include <cstddef>
#include <string_view>

#include "fsdp/core/device.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

class MemoryCounter {
 public:
  void allocated(std::size_t bytes, MemorySpace space) {
    auto& s = at(space);
    s.live_bytes += bytes;
    s.peak_bytes = std::max(s.peak_bytes, s.live_bytes);
    ++s.allocations;
  }
  // Throws before anything is freed when more would be freed than is live.
  void check_free(std::size_t bytes, MemorySpace space, std::string_view device) const {
    const auto& s = stats_[static_cast<std::size_t>(space)];
    if (bytes > s.live_bytes)
      fail(device, ": freeing ", bytes, " bytes in ", name_of(space), " space but only ", s.live_bytes,
           " are live (double free or wrong size)");
  }
  void freed(std::size_t bytes, MemorySpace space) { at(space).live_bytes -= bytes; }
  MemoryStats stats(MemorySpace space) const { return stats_[static_cast<std::size_t>(space)]; }
  void reset_peak(MemorySpace space) { at(space).peak_bytes = at(space).live_bytes; }

 private:
  MemoryStats& at(MemorySpace space) { return stats_[static_cast<std::size_t>(space)]; }
  std::array<MemoryStats, 2> stats_{};
};

}  // namespace fsdp::detail
