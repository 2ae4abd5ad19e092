#pragma once
// One memory-accounting scenario for any fsdp::Device: live, peak and allocation counts
// per memory space, through allocations, frees and reset_peak. Every device counts with
// the same rules, so every device's test runs this same scenario.
#include <doctest/doctest.h>

#include <fsdp/core/device.hpp>

namespace test_support {

// `inspect(device_ptr, host_ptr)` lets a device's test check the memory itself (pinned,
// on the right GPU...) while both are live.
template <fsdp::Device D, class Inspect>
void check_memory_accounting(D& dev, Inspect&& inspect) {
  using fsdp::MemorySpace;
  constexpr MemorySpace kDev = MemorySpace::device, kHost = MemorySpace::host;
  for (MemorySpace s : {kDev, kHost}) {
    CHECK(dev.stats(s).live_bytes == 0);
    CHECK(dev.stats(s).peak_bytes == 0);
    CHECK(dev.stats(s).allocations == 0);
  }
  void* a = dev.allocate(100, kDev);
  void* b = dev.allocate(300, kDev);
  void* h = dev.allocate(1000, kHost);
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(h);
  CHECK(dev.stats(kDev).live_bytes == 400);
  CHECK(dev.stats(kDev).peak_bytes == 400);
  CHECK(dev.stats(kDev).allocations == 2);
  CHECK(dev.stats(kHost).live_bytes == 1000);  // host bytes are not device bytes
  CHECK(dev.stats(kHost).peak_bytes == 1000);
  CHECK(dev.stats(kHost).allocations == 1);
  inspect(a, h);

  dev.deallocate(b, 300, kDev);
  CHECK(dev.stats(kDev).live_bytes == 100);
  CHECK(dev.stats(kDev).peak_bytes == 400);  // peak remembers
  CHECK(dev.stats(kDev).allocations == 2);   // counts allocate() calls, not live blocks
  void* c = dev.allocate(200, kDev);         // 300 live < old peak 400
  CHECK(dev.stats(kDev).peak_bytes == 400);
  void* d = dev.allocate(250, kDev);         // 550 live: new peak
  CHECK(dev.stats(kDev).peak_bytes == 550);
  CHECK(dev.stats(kDev).allocations == 4);
  dev.reset_peak(kDev);
  CHECK(dev.stats(kDev).peak_bytes == 550);  // live is the peak right now
  dev.deallocate(c, 200, kDev);
  dev.deallocate(d, 250, kDev);
  dev.reset_peak(kDev);
  CHECK(dev.stats(kDev).peak_bytes == 100);  // reset to live
  CHECK(dev.stats(kHost).peak_bytes == 1000);  // per space: untouched
  dev.deallocate(a, 100, kDev);
  dev.deallocate(h, 1000, kHost);
  for (MemorySpace s : {kDev, kHost}) CHECK(dev.stats(s).live_bytes == 0);
  void* z = dev.allocate(0, kDev);  // zero bytes: nothing counted
  CHECK(dev.stats(kDev).allocations == 4);
  dev.deallocate(z, 0, kDev);
}

}  // namespace test_support
