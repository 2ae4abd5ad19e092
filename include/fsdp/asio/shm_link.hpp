#pragma once
// ShmLink: one direction of a TcpComm ring link through POSIX shared memory, for ring
// neighbours on the same host. The payload of each DATA frame goes through a
// single-producer / single-consumer ring of `slots` fixed-size slots in the segment; the
// frame's header still goes over the TCP connection and is what wakes the receiver.
// So TCP keeps doing everything but moving bulk bytes: headers (collective checks),
// ABORT frames, and liveness (a peer that dies closes its socket, shared memory or not).
//
// Flow control: the producer writes a slot only while produced - consumed < slots. When
// the ring is full it raises `producer_waits` and reads `consumed` again; the consumer,
// after it frees a slot, clears the flag and, if it was raised, sends a CREDIT frame back
// on the TCP link. Both sides use sequentially consistent atomics, so one of them always
// sees the other: no lost wake-up, and no waiting outside the socket's event loop (every
// wait stays bounded by the communicator's timeout).
//
// Lifetime: the producer creates the segment (Boost.Interprocess, /dev/shm on Linux), the
// consumer opens it and unlinks it at once, and the producer unlinks it again once the
// consumer answered; after the handshake no name is left in /dev/shm, so nothing leaks
// even when a process is killed. The mapping lives as long as the ShmLink.
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

namespace fsdp::detail {

// The segment's first page: identity, then the two counters on cache lines of their own.
struct ShmRingControl {
  static constexpr std::uint64_t kMagic = 0x4b4e494c4d485346;  // "FSHMLINK"
  std::uint64_t magic;
  std::uint64_t nonce;  // the handshake's proof that both sides mapped the same segment
  std::uint64_t slots;
  std::uint64_t slot_bytes;
  alignas(64) std::atomic<std::uint64_t> produced;  // slots written, ever (producer only)
  alignas(64) std::atomic<std::uint64_t> consumed;  // slots read, ever (consumer only)
  alignas(64) std::atomic<std::uint32_t> producer_waits;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free,
              "counters shared between processes must be lock-free");

// "hostname/boot_id": ranks with different keys never try shared memory (two containers
// with the same hostname on different machines differ in boot_id). Equal keys are only a
// hint; the nonce read through the segment is the proof.
inline std::string shm_host_key() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + boot;
}

class ShmLink {
  using Segment = boost::interprocess::shared_memory_object;
  using Region = boost::interprocess::mapped_region;
  using IpcError = boost::interprocess::interprocess_exception;
  static constexpr std::size_t kDataOffset = 4096;

 public:
  // Slots for a ring of about `ring_bytes`: at least 2, at most 1024.
  static std::size_t slots_for(std::size_t ring_bytes, std::size_t slot_bytes) {
    return std::clamp<std::size_t>(ring_bytes / slot_bytes, 2, 1024);
  }
  static constexpr std::size_t kMaxSegmentBytes = std::size_t{256} << 20;

  // The producer's side: a new segment `name`, reserved in full (so a full /dev/shm is an
  // empty optional here, not a SIGBUS later). Empty, with `why`, if it cannot be made.
  static std::optional<ShmLink> create(const std::string& name, std::uint64_t nonce, std::size_t slots,
                                       std::size_t slot_bytes, std::string& why) {
    const std::size_t bytes = kDataOffset + slots * slot_bytes;
    if (bytes > kMaxSegmentBytes) {
      why = "segments of " + std::to_string(slot_bytes) + " bytes are too large for a shared-memory ring";
      return std::nullopt;
    }
    try {
      Segment shm(boost::interprocess::create_only, name.c_str(), boost::interprocess::read_write);
      try {
        shm.truncate(static_cast<boost::interprocess::offset_t>(bytes));
        if (const int e = posix_fallocate(shm.get_mapping_handle().handle, 0, static_cast<off_t>(bytes)))
          throw IpcError(("cannot reserve " + std::to_string(bytes) + " bytes: " + std::strerror(e)).c_str());
        ShmLink link(Region(shm, boost::interprocess::read_write));
        auto* c = new (link.region_.get_address()) ShmRingControl{ShmRingControl::kMagic, nonce, slots, slot_bytes, {}, {}, {}};
        link.control_ = c;
        return link;
      } catch (...) {
        Segment::remove(name.c_str());
        throw;
      }
    } catch (const std::exception& e) {
      why = "cannot create shared memory " + name + ": " + e.what();
      return std::nullopt;
    }
  }

  // The consumer's side: opens `name`, unlinks it, and checks that it is the producer's
  // segment (nonce and geometry). Empty, with `why`, otherwise (another host or another
  // /dev/shm: the link stays on TCP).
  static std::optional<ShmLink> open(const std::string& name, std::uint64_t nonce, std::size_t slots,
                                     std::size_t slot_bytes, std::string& why) {
    try {
      Segment shm(boost::interprocess::open_only, name.c_str(), boost::interprocess::read_write);
      Segment::remove(name.c_str());
      boost::interprocess::offset_t size = 0;
      if (slots < 1 || slot_bytes < 1 || slots > kMaxSegmentBytes / slot_bytes || !shm.get_size(size) ||
          static_cast<std::size_t>(size) != kDataOffset + slots * slot_bytes) {
        why = "shared memory " + name + " has an unexpected size";
        return std::nullopt;
      }
      ShmLink link(Region(shm, boost::interprocess::read_write));
      link.control_ = static_cast<ShmRingControl*>(link.region_.get_address());
      const ShmRingControl& c = *link.control_;
      if (c.magic != ShmRingControl::kMagic || c.nonce != nonce || c.slots != slots || c.slot_bytes != slot_bytes) {
        why = "shared memory " + name + " is not the one the neighbour made";
        return std::nullopt;
      }
      return link;
    } catch (const std::exception& e) {
      why = "cannot open shared memory " + name + ": " + e.what();
      return std::nullopt;
    }
  }

  // Idempotent; the producer calls it once the consumer answered (or gave up).
  static void unlink(const std::string& name) { Segment::remove(name.c_str()); }

  ShmLink(ShmLink&&) noexcept = default;
  ShmLink& operator=(ShmLink&&) noexcept = default;

  // ---- producer ----
  // True if a slot is free; else raises producer_waits (a CREDIT frame will come).
  bool has_room_or_ask() {
    if (room()) return true;
    control_->producer_waits.store(1);
    if (!room()) return false;
    control_->producer_waits.store(0);
    return true;
  }
  // Copies one frame's payload (at most slot_bytes) into the next slot; has_room_or_ask
  // said yes before.
  void produce(const void* data, std::size_t bytes) {
    const std::uint64_t p = control_->produced.load(std::memory_order_relaxed);
    std::memcpy(slot(p), data, bytes);
    control_->produced.store(p + 1);
  }

  // ---- consumer ----
  // Copies the next slot's payload to `dest`. False if the producer has not written it
  // (out of step: a header came without its payload). `credit` says the producer waits.
  bool consume(void* dest, std::size_t bytes, bool& credit) {
    const std::uint64_t c = control_->consumed.load(std::memory_order_relaxed);
    if (control_->produced.load() <= c || bytes > control_->slot_bytes) return false;
    std::memcpy(dest, slot(c), bytes);
    control_->consumed.store(c + 1);
    credit = control_->producer_waits.exchange(0) != 0;
    return true;
  }

 private:
  explicit ShmLink(Region region) : region_(std::move(region)) {}

  bool room() const { return control_->produced.load() - control_->consumed.load() < control_->slots; }
  std::byte* slot(std::uint64_t i) const {
    return static_cast<std::byte*>(region_.get_address()) + kDataOffset + (i % control_->slots) * control_->slot_bytes;
  }

  Region region_;
  ShmRingControl* control_ = nullptr;
};

}  // namespace fsdp::detail
