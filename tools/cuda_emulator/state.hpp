#pragma once
// The emulated runtime's model (see emulator.hpp): streams, events and the host with
// vector clocks, live allocations with their access history, and the checks on them.
// One mutex guards it all; every entry point of runtime.cpp holds it.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cuda_emulator::detail {

// The GPU the emulator shows: an H200's figures (NVRTC compiles for its architecture).
inline constexpr char kDeviceName[] = "fsdp CUDA runtime emulator";  // test/support/gpu.hpp tells it by this
inline constexpr int kSmCount = 132;
inline constexpr int kComputeMajor = 9, kComputeMinor = 0;
inline constexpr std::size_t kMemoryBytes = std::size_t{141} << 30;  // per space

// What has happened on each stream (indexed by stream id) that is ordered before a point.
struct Clock {
  std::vector<std::uint64_t> t;
  std::uint64_t at(std::size_t i) const { return i < t.size() ? t[i] : 0; }
  void join(const Clock& o) {
    if (o.t.size() > t.size()) t.resize(o.t.size(), 0);
    for (std::size_t i = 0; i < o.t.size(); ++i)
      if (o.t[i] > t[i]) t[i] = o.t[i];
  }
  std::uint64_t tick(std::size_t i) {
    if (i >= t.size()) t.resize(i + 1, 0);
    return ++t[i];
  }
};

struct Stream {
  int device = 0;
  bool blocking = false;  // synchronizes with the device's legacy default stream
  bool legacy = false;
  std::size_t id = 0;
  Clock clock;
};

struct Event {
  int device = 0;
  bool recorded = false;
  Clock clock;  // the recording stream's, at the record
};

// One access to an allocation: bytes [begin, end) from its base, by an operation at
// `time` on stream `stream`.
struct Access {
  std::size_t stream;
  std::uint64_t time;
  std::size_t begin, end;
  bool write;
  std::string what;  // "cudaMemcpyAsync" or the kernel's name
};

enum class Space { device, pinned };

struct Allocation {
  std::byte* base = nullptr;
  std::size_t bytes = 0;
  Space space = Space::device;
  int device = 0;
  const char* how = "";                   // the call that allocated it
  std::size_t made_on = kNoStream;        // cudaMallocAsync's stream, else none
  std::uint64_t made_at = 0;
  std::vector<Access> accesses;           // pruned (see Runtime::record_access)
  static constexpr std::size_t kNoStream = static_cast<std::size_t>(-1);
};

// A freed allocation kept unreleased for a while, so that a late use is reported as such.
struct Freed {
  std::byte* base;
  std::size_t bytes;
  std::string how;  // "cudaFreeAsync", "cudaFree", "cudaFreeHost"
};

class Runtime {
 public:
  static Runtime& get();

  std::mutex mutex;
  int device_count = 1;
  struct Injected {  // cuda_emulator::fail_next's
    std::string call;
    cudaError_t error = cudaSuccess;
    int skip = 0;
  } injection;
  Clock host;  // what every host thread has seen complete (real-time order, see emulator.hpp)

  // Streams: created ones and each device's legacy default stream (made on first use).
  Stream* make_stream(int device, bool blocking);
  bool destroy_stream(Stream* s);
  Stream* resolve(cudaStream_t s, int current_device);  // null for an unknown handle
  // What a cudaDeviceSynchronize on `device` waits for: its streams' work, destroyed
  // streams' included (their queued work still finishes).
  Clock device_work(int device) const;

  Event* make_event(int device);
  bool destroy_event(Event* e);
  bool known(Event* e) const { return events_.count(e) != 0; }

  // An operation starts on s: it is ordered after what the host has seen and, for a
  // blocking stream, after the legacy stream's work; returns its time on s.
  std::uint64_t begin_op(Stream& s);

  // Memory.
  std::byte* allocate(std::size_t bytes, Space space, int device, const char* how, Stream* on);
  // Frees `p` (its base): `on` is the freeing stream (null: the host, for synchronous
  // frees). Returns false for a pointer that is not a live allocation's base in `space`.
  bool release(void* p, Space space, const char* how, Stream* on);
  Allocation* find(const void* p);            // the live allocation holding p, if any
  const Freed* find_freed(const void* p) const;
  std::size_t live_bytes(Space space) const { return live_bytes_[static_cast<int>(space)]; }

  // Checks one access of `bytes` at p by `what` at time `time` on s; appends a message to
  // `error` and returns false when p is not usable (not live, out of bounds, or pageable
  // host memory where device memory is needed). Races are recorded as violations.
  bool check_access(Stream& s, std::uint64_t time, const void* p, std::size_t bytes, bool write, bool device_only,
                    const std::string& what, std::string& error);

  void violation(std::string text);
  std::vector<std::string> take_violations();

  std::string describe(const Stream& s) const;

 private:
  Runtime() = default;
  void record_access(Allocation& a, const Stream& s, Access access);

  std::size_t next_stream_id_ = 0;
  std::map<Stream*, std::unique_ptr<Stream>> streams_;
  std::map<int, Stream*> legacy_;
  std::map<int, Clock> retired_;  // per device: the clocks of its destroyed streams, joined
  std::map<Event*, std::unique_ptr<Event>> events_;
  std::map<std::uintptr_t, Allocation> live_;  // by base address
  std::size_t live_bytes_[2] = {0, 0};          // per Space
  std::deque<Freed> freed_;
  std::size_t freed_bytes_ = 0;
  std::vector<std::string> violations_;
};

}  // namespace cuda_emulator::detail
