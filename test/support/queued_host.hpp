#pragma once
// A host stand-in for the CUDA path's scheduling, for tests: QueuedHostDevice is a
// HostDevice with a queue (a QueuedDevice, fsdp/core/device.hpp), and RecordingComm wraps
// ThreadComm so that its Work is never complete inside the call and can be waited on that
// queue (Work::wait_on). The library then takes the same decisions as on CudaDevice with
// NcclComm or CudaThreadComm: it waits on the queue, keeps a reduction in flight until
// the next unit's, frees behind the waits. So a host run with these gives the device
// run's exact allocations and peaks, and values bit for bit. Both log what happened.
#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

namespace test_support {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::Work;

// One rank's log: collective waits and device frees, in the order they happened.
// Collectives on device buffers are the units' (parameters, gradients); those on other
// memory are the library's small agreements (order and pass checks), which the host needs
// the values of and so waits for on the host.
struct Event {
  enum Kind { device_wait, host_wait, dropped_after_device_wait, free } kind;
  std::string collective;  // "all_gather", "reduce_scatter", "all_reduce", ... ("" for a free)
  const void* buffer;      // what the collective wrote, or what was freed
  bool on_device = false;  // the collective writes device memory
};
struct Log {
  std::vector<Event> events;
  struct Issued {
    std::string collective;
    const void* recv;
    bool on_device;
    std::size_t at;  // events.size() when issued: later events at `recv` are this buffer's (an
                     // earlier free there was another allocation at the same address)
  };
  std::vector<Issued> issued;  // collectives, in order
  std::map<const std::byte*, std::size_t> live;  // the device's allocations
  bool fail_reductions_on_host = false;  // a reduction "fails" when the host checks it
  bool in_device_memory(const void* p) const {
    const auto* b = static_cast<const std::byte*>(p);
    auto it = live.upper_bound(b);
    if (it == live.begin()) return false;
    --it;
    return b < it->first + it->second;
  }
  std::size_t count(Event::Kind k, const std::string& c, bool on_device = true) const {
    return static_cast<std::size_t>(std::count_if(events.begin(), events.end(), [&](const Event& e) {
      return e.kind == k && e.collective == c && e.on_device == on_device;
    }));
  }
  void clear() { events.clear(), issued.clear(); }
};

// A Work the "device" can wait on. The wrapped ThreadComm Work is completed either way (the
// fake's queue is the host), so values stay right; what is recorded is which wait it was.
class RecordingPending final : public Work::Pending {
 public:
  RecordingPending(Work inner, Log& log, std::string what, const void* recv, const void* queue)
      : inner_(std::move(inner)), log_(log), what_(std::move(what)), recv_(recv), queue_(queue),
        on_device_(recv && log.in_device_memory(recv)) {}
  ~RecordingPending() override {  // (a Work dropped without any wait host-waits first)
    if (!done_) log_.events.push_back({Event::dropped_after_device_wait, what_, recv_, on_device_});
  }
  void wait() override {
    inner_.wait();
    done_ = true;
    log_.events.push_back({Event::host_wait, what_, recv_, on_device_});
    if (log_.fail_reductions_on_host && what_ != "all_gather")
      fsdp::detail::fail("recording comm: ", what_, " failed on a peer (injected)");
  }
  bool ready() override { return inner_.ready(); }
  bool enqueue_wait(const fsdp::DeviceQueue& q) override {
    if (q.handle != queue_) return false;  // not the queue of the device it was made for
    inner_.wait();
    log_.events.push_back({Event::device_wait, what_, recv_, on_device_});
    return true;
  }

 private:
  Work inner_;
  Log& log_;
  std::string what_;
  const void* recv_;
  const void* queue_;
  bool on_device_;
  bool done_ = false;
};

class RecordingComm {
 public:
  RecordingComm(fsdp::ThreadComm& inner, Log& log, const void* queue) : inner_(&inner), log_(&log), queue_(queue) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  Work all_gather(const void* s, void* r, std::size_t n, DType t) { return wrap("all_gather", r, inner_->all_gather(s, r, n, t)); }
  Work reduce_scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op) {
    return wrap("reduce_scatter", r, inner_->reduce_scatter(s, r, n, t, op));
  }
  Work all_reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op) {
    return wrap("all_reduce", r, inner_->all_reduce(s, r, n, t, op));
  }
  Work broadcast(const void* s, void* r, std::size_t n, DType t, int root) {
    return wrap("broadcast", r, inner_->broadcast(s, r, n, t, root));
  }
  Work barrier() { return wrap("barrier", nullptr, inner_->barrier()); }

 private:
  Work wrap(const char* what, const void* recv, Work inner) {
    log_->issued.push_back({what, recv, recv && log_->in_device_memory(recv), log_->events.size()});
    return Work(std::make_unique<RecordingPending>(std::move(inner), *log_, what, recv, queue_));
  }
  fsdp::ThreadComm* inner_;
  Log* log_;
  const void* queue_;
};

// HostDevice with a queue (itself) and a log of frees.
class QueuedHostDevice {
 public:
  explicit QueuedHostDevice(Log& log) : log_(&log) {}
  Log& log() { return *log_; }
  fsdp::DeviceId id() const { return host_.id(); }
  fsdp::DeviceQueue queue() { return {id(), this}; }
  void* allocate(std::size_t b, fsdp::MemorySpace s = fsdp::MemorySpace::device) {
    void* p = host_.allocate(b, s);
    if (p) log_->live[static_cast<const std::byte*>(p)] = b;
    return p;
  }
  void deallocate(void* p, std::size_t b, fsdp::MemorySpace s = fsdp::MemorySpace::device) {
    if (p) log_->events.push_back({Event::free, "", p}), log_->live.erase(static_cast<const std::byte*>(p));
    host_.deallocate(p, b, s);
  }
  void copy(void* d, const void* s, std::size_t b) { host_.copy(d, s, b); }
  void fill_zero(void* p, std::size_t b) { host_.fill_zero(p, b); }
  void scale(void* p, std::size_t n, DType t, double f) { host_.scale(p, n, t, f); }
  void accumulate(void* d, const void* s, std::size_t n, DType t) { host_.accumulate(d, s, n, t); }
  void cast(void* d, DType to, const void* s, DType from, std::size_t n) { host_.cast(d, to, s, from, n); }
  void unscale(void* p, std::size_t n, DType t, double inv) { host_.unscale(p, n, t, inv); }
  bool found_nonfinite() { return host_.found_nonfinite(); }
  void synchronize() { host_.synchronize(); }
  fsdp::MemoryStats stats(fsdp::MemorySpace s = fsdp::MemorySpace::device) const { return host_.stats(s); }
  void reset_peak(fsdp::MemorySpace s = fsdp::MemorySpace::device) { host_.reset_peak(s); }

 private:
  fsdp::HostDevice host_;
  Log* log_;
};
static_assert(fsdp::QueuedDevice<QueuedHostDevice>);
static_assert(!fsdp::QueuedDevice<fsdp::HostDevice>);

}  // namespace test_support
