// fsdp/unit/detail/zero_batch.hpp: zeroing gathered into fewer device calls. Counted on
// CountingDevice: one call for many buffers, host buffers at once, one batch per device,
// and a cast that zeroes the batch along the way only where it is a real cast on the
// batch's own device.
#include <doctest/doctest.h>

#include <stdexcept>
#include <vector>

#include <fsdp/testing/counting_device.hpp>
#include <fsdp/unit/detail/zero_batch.hpp>
#include <fsdp/host/host_device.hpp>

namespace core_zero_batch_test {

using fsdp::DeviceOp;
using fsdp::MemorySpace;
using fsdp::detail::DeviceRef;
using fsdp::detail::ZeroBatch;

namespace {
struct Buffers {  // n buffers of 8 floats, all 1
  std::vector<std::vector<float>> v;
  explicit Buffers(int n) : v(static_cast<std::size_t>(n), std::vector<float>(8, 1.0f)) {}
  bool zero(std::size_t i) const {
    for (float x : v[i]) if (x != 0.0f) return false;
    return true;
  }
};
}  // namespace

TEST_CASE("many buffers in one call (past the inline ones), host ones at once") {
  fsdp::HostDevice host;
  fsdp::CountingDevice<fsdp::HostDevice> counted(host);
  const DeviceRef dev(counted);
  Buffers b(7);
  ZeroBatch batch;
  for (std::size_t i = 0; i < 6; ++i) batch.add(dev, b.v[i].data(), 32, MemorySpace::device);
  batch.add(dev, b.v[6].data(), 32, MemorySpace::host);  // offloaded: zeroed now
  batch.add(dev, nullptr, 32, MemorySpace::device);      // nothing there: skipped
  CHECK(batch.pending() == 6);
  CHECK(b.zero(6));
  CHECK(!b.zero(0));
  batch.flush();
  CHECK(batch.pending() == 0);
  for (std::size_t i = 0; i < 6; ++i) CHECK(b.zero(i));
  CHECK(counted.counts()[DeviceOp::fill_zero_batch] == 1);
  CHECK(counted.counts()[DeviceOp::fill_zero] == 1);  // the host one

  Buffers one(1);
  batch.add(dev, one.v[0].data(), 32, MemorySpace::device);
  batch.flush();
  CHECK(one.zero(0));
  CHECK(counted.counts()[DeviceOp::fill_zero_batch] == 2);  // a lone buffer too: the device decides how
  batch.flush();                                            // empty: no call
  CHECK(counted.counts().total() == 3);
}

TEST_CASE("a buffer of another device flushes the batch first") {
  fsdp::HostDevice h1, h2;
  fsdp::CountingDevice<fsdp::HostDevice> c1(h1), c2(h2);
  Buffers b(3);
  ZeroBatch batch;
  batch.add(DeviceRef(c1), b.v[0].data(), 32, MemorySpace::device);
  batch.add(DeviceRef(c1), b.v[1].data(), 32, MemorySpace::device);
  batch.add(DeviceRef(c2), b.v[2].data(), 32, MemorySpace::device);
  CHECK(b.zero(0));
  CHECK(b.zero(1));
  CHECK(!b.zero(2));
  CHECK(c1.counts()[DeviceOp::fill_zero_batch] == 1);
  batch.flush();
  CHECK(b.zero(2));
  CHECK(c2.counts()[DeviceOp::fill_zero_batch] == 1);
}

TEST_CASE("a cast zeroes the batch on its way only when it is a cast on the batch's device") {
  fsdp::HostDevice h1, h2;
  fsdp::CountingDevice<fsdp::HostDevice> c1(h1), c2(h2);
  const DeviceRef d1(c1), d2(c2);
  std::vector<float> src{1, 2, 3, 4};
  std::vector<float> dst(4, 0), bits(2, 0);
  Buffers b(2);
  ZeroBatch batch;
  batch.add(d1, b.v[0].data(), 32, MemorySpace::device);
  batch.add(d1, b.v[1].data(), 32, MemorySpace::device);
  batch.cast(d2, bits.data(), fsdp::DType::bf16, src.data(), fsdp::DType::f32, 4);  // another device
  batch.cast(d1, dst.data(), fsdp::DType::f32, src.data(), fsdp::DType::f32, 4);    // a copy
  CHECK(batch.pending() == 2);
  CHECK(!b.zero(0));
  CHECK(dst == src);
  batch.cast(d1, bits.data(), fsdp::DType::bf16, src.data(), fsdp::DType::f32, 4);  // rides
  CHECK(batch.pending() == 0);
  CHECK(b.zero(0));
  CHECK(b.zero(1));
  CHECK(c1.counts()[DeviceOp::cast_zeroing] == 1);
  CHECK(c1.counts()[DeviceOp::copy] == 1);
  CHECK(c2.counts()[DeviceOp::cast] == 1);
  batch.flush();  // nothing left: no call
  CHECK(c1.counts().total() == 2);
}

TEST_CASE("run flushes what was added also when the filling throws") {
  fsdp::HostDevice host;
  const DeviceRef dev(host);
  Buffers b(2);
  CHECK_THROWS_AS(ZeroBatch::run([&](ZeroBatch& batch) {
                    batch.add(dev, b.v[0].data(), 32, MemorySpace::device);
                    batch.add(dev, b.v[1].data(), 32, MemorySpace::device);
                    throw std::runtime_error("unit refused");
                  }),
                  std::runtime_error);
  CHECK(b.zero(0));
  CHECK(b.zero(1));
}

}  // namespace core_zero_batch_test
