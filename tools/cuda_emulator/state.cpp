// The emulated runtime's model: clocks, streams, events, allocations and their checks.
#include "tools/cuda_emulator/state.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <new>
#include <string>
#include <thread>
#include <utility>

namespace cuda_emulator::detail {

namespace {

constexpr std::size_t kAlignment = 256;                  // what cudaMalloc guarantees
constexpr std::size_t kQuarantineBytes = 256ull << 20;   // freed memory kept unreleased
constexpr std::size_t kQuarantineBlocks = 4096;
constexpr std::size_t kAccessesKept = 256;               // per allocation (oldest dropped)
constexpr std::size_t kViolationsKept = 64;

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

const char* space_name(Space s) { return s == Space::device ? "device" : "pinned host"; }

// The value of environment variable `name`, a whole number in [lo, hi]; `fallback` where it is
// unset or empty. Anything else stops the program, saying what the variable must be (`what`).
long env_number(const char* name, long fallback, long lo, long hi, const char* what) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < lo || n > hi) {
    std::fprintf(stderr, "cuda_emulator: %s='%s' is not %s\n", name, v, what);
    std::abort();
  }
  return n;
}

// FSDP_CUDA_EMULATOR_DEVICES: how many GPUs the runtime shows at start (1 unset), so that
// each process of a multi-process test can take its rank's.
int devices_at_start() {
  return static_cast<int>(env_number("FSDP_CUDA_EMULATOR_DEVICES", 1, 0, 64, "a count of GPUs in [0, 64]"));
}

}  // namespace

std::chrono::seconds hang_bound() {
  static const std::chrono::seconds bound(env_number("FSDP_CUDA_EMULATOR_HANG_S", 60, 1, std::numeric_limits<long>::max(),
                                                     "a positive number of seconds"));
  return bound;
}

int sm_count() {
  static const int count =
      static_cast<int>(env_number("FSDP_CUDA_EMULATOR_SMS", kSmCount, 1, 1024, "a count of SMs in [1, 1024]"));
  return count;
}

Runtime& Runtime::get() {
  static Runtime* runtime = [] {  // never destroyed: CUDA objects may outlive statics
    auto* r = new Runtime;
    r->device_count = devices_at_start();
    return r;
  }();
  return *runtime;
}

Stream* Runtime::make_stream(int device, bool blocking) {
  auto s = std::make_unique<Stream>();
  s->device = device;
  s->blocking = blocking;
  s->id = next_stream_id_++;
  Stream* raw = s.get();
  streams_.emplace(raw, std::move(s));
  return raw;
}

bool Runtime::destroy_stream(Stream* s) {
  auto it = streams_.find(s);
  if (it == streams_.end() || s->legacy) return false;
  retired_[s->device].join(s->clock);  // its queued work still finishes: a device sync waits for it
  streams_.erase(it);  // the host has not seen that work: no join into `host`
  return true;
}

Stream* Runtime::resolve(cudaStream_t handle, int current_device) {
  const auto raw = reinterpret_cast<std::uintptr_t>(handle);
  if (raw == 0 || handle == cudaStreamLegacy) {
    Stream*& legacy = legacy_[current_device];
    if (!legacy) {
      legacy = make_stream(current_device, false);
      legacy->legacy = true;
    }
    return legacy;
  }
  auto it = streams_.find(reinterpret_cast<Stream*>(handle));
  return it == streams_.end() ? nullptr : it->first;
}

Clock Runtime::device_work(int device) const {
  Clock out;
  for (const auto& [raw, owned] : streams_)
    if (raw->device == device) out.join(raw->clock);
  if (auto it = retired_.find(device); it != retired_.end()) out.join(it->second);
  return out;
}

Event* Runtime::make_event(int device) {
  auto e = std::make_unique<Event>();
  e->device = device;
  Event* raw = e.get();
  events_.emplace(raw, std::move(e));
  return raw;
}

bool Runtime::destroy_event(Event* e) { return events_.erase(e) != 0; }

std::uint64_t Runtime::begin_op(Stream& s, bool* hung) {
  // Ordered and checked under the lock it then ticks under: a pending operation queued by
  // another thread while this one waited is waited for too.
  for (;;) {
    order(s);
    if (!incomplete(s.clock)) break;
    if (!wait_for(Clock(s.clock), "an operation on " + describe(s))) {
      if (hung) *hung = true;
      break;
    }
  }
  return s.clock.tick(s.id);
}

void Runtime::order(Stream& s) {
  s.clock.join(host);
  if (s.blocking) {
    if (auto it = legacy_.find(s.device); it != legacy_.end()) s.clock.join(it->second->clock);
  } else if (s.legacy) {
    for (auto& [raw, owned] : streams_)
      if (raw->device == s.device && raw->blocking) s.clock.join(raw->clock);
  }
}

std::uint64_t Runtime::queue_op(Stream& s) {
  order(s);
  return s.clock.tick(s.id);
}

std::byte* Runtime::allocate(std::size_t bytes, Space space, int device, const char* how, Stream* on) {
  auto* p = static_cast<std::byte*>(::operator new(bytes, std::align_val_t{kAlignment}, std::nothrow));
  if (!p) return nullptr;
  Allocation a;
  a.base = p;
  a.bytes = bytes;
  a.space = space;
  a.device = device;
  a.how = how;
  if (on) {
    a.made_on = on->id;
    a.made_at = queue_op(*on);  // touches no bytes: nothing to wait for
  }
  live_.emplace(reinterpret_cast<std::uintptr_t>(p), std::move(a));
  live_bytes_[static_cast<int>(space)] += bytes;
  return p;
}

std::byte* Runtime::graph_storage(std::size_t bytes) {
  return static_cast<std::byte*>(::operator new(bytes, std::align_val_t{kAlignment}, std::nothrow));
}

void Runtime::adopt(const GraphAllocation& g, Stream& on) {
  Allocation a;
  a.base = g.base;
  a.bytes = g.bytes;
  a.space = Space::device;
  a.device = g.device;
  a.how = "cudaMallocAsync (a graph's allocation node)";
  a.graph_owned = true;
  a.made_on = on.id;
  a.made_at = queue_op(on);
  // A replay whose free has not been queued yet (a graph launched again meanwhile) keeps
  // the one live entry: the address is the graph's.
  if (live_.emplace(reinterpret_cast<std::uintptr_t>(g.base), std::move(a)).second) live_bytes_[0] += g.bytes;
}

// The storage of a graph no handle refers to any more: a live entry (a replay whose free
// never ran) is dropped, and the bytes join the quarantine as the runtime's own, so a late
// use is still reported and nothing pending can lose them.
void Runtime::drop_graph_memory(GraphData& g) {
  for (GraphAllocation& a : g.allocations) {
    if (!a.base) continue;
    if (auto it = live_.find(reinterpret_cast<std::uintptr_t>(a.base)); it != live_.end()) {
      live_bytes_[0] -= it->second.bytes;
      live_.erase(it);
    }
    for (Freed& f : freed_)
      if (f.base == a.base) f.owned = false;  // an older entry of a replay's free: not deleted twice
    freed_.push_back({a.base, a.bytes, "cudaGraphDestroy", true});
    freed_bytes_ += a.bytes;
    a.base = nullptr;
  }
}

std::shared_ptr<Pending> Runtime::add_pending(Stream& s, std::uint64_t time, std::string what,
                                              std::function<void(Pending&)> step) {
  auto p = std::make_shared<Pending>();
  p->what = std::move(what);
  p->step = std::move(step);
  p->time = time;
  p->stream = s.id;
  p->after = s.clock;
  p->after.t[s.id] = p->time - 1;  // before itself
  pending_.push_back(p);
  start_progress_thread();
  progress();
  return p;
}

// A GPU moves on by itself: a thread steps the pending operations every millisecond, so a
// collective whose turn comes while its process is busy elsewhere (a store barrier, a
// socket) still posts its part for the other ranks.
void Runtime::start_progress_thread() {
  if (progress_thread_started_) return;
  progress_thread_started_ = true;
  std::thread([this] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::lock_guard lock(mutex);
      if (!pending_.empty()) progress();
    }
  }).detach();  // the runtime is never destroyed
}

void Runtime::run_in_order(Stream& s, std::uint64_t time, std::string what, std::function<void()> body) {
  if (!incomplete(s.clock)) return body();  // nothing pending is ordered before it
  add_pending(s, time, std::move(what), [body = std::move(body)](Pending& p) {
    body();
    p.done = true;
  });
}

void Runtime::progress() {
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      const std::shared_ptr<Pending> p = pending_[i];  // a step may queue more
      if (p->done || incomplete(p->after)) continue;
      p->step(*p);
      if (p->done) moved = true;
    }
    std::erase_if(pending_, [](const std::shared_ptr<Pending>& p) { return p->done; });
  }
}

const Pending* Runtime::incomplete(const Clock& c) const {
  for (const auto& p : pending_)
    if (!p->done && c.at(p->stream) >= p->time) return p.get();
  return nullptr;
}

bool Runtime::wait_for(const Clock& c, const std::string& waiter) {
  const std::chrono::seconds bound = hang_bound();
  const auto deadline = std::chrono::steady_clock::now() + bound;
  for (int spins = 0;; ++spins) {
    progress();
    const Pending* p = incomplete(c);
    if (!p) return true;
    if (std::chrono::steady_clock::now() > deadline) {
      violation("hang: " + waiter + " waited " + std::to_string(bound.count()) + " s (FSDP_CUDA_EMULATOR_HANG_S) for " +
                p->what + " on stream #" + std::to_string(p->stream) + ", which has not completed: on a GPU it would wait forever");
      return false;
    }
    mutex.unlock();  // the caller's Entry keeps its lock object; it is ours again on return
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 20 : 500));
    mutex.lock();
  }
}

bool Runtime::release(void* p, Space space, const char* how, Stream* on) {
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == live_.end() || it->second.space != space) return false;
  Allocation& a = it->second;
  // Every access must be ordered before the free: on its stream (stream-ordered free) or,
  // for a synchronous free, seen complete by the host.
  const Clock* at = &host;
  if (on) {  // its bytes are released late (below): nothing to wait for
    queue_op(*on);
    at = &on->clock;
  }
  const std::string freer = on ? std::string(how) + " on " + describe(*on) : std::string(how) + " (from the host)";
  for (const Access& x : a.accesses)
    if (at->at(x.stream) < x.time)
      violation("stream-order race: " + freer + " frees the " + std::to_string(a.bytes) + "-byte " + space_name(a.space) +
                " allocation at " + hex(a.base) + " (" + a.how + ") while " + x.what + " on stream #" +
                std::to_string(x.stream) + " may still " + (x.write ? "write" : "read") + " it (nothing orders it before the free)");
  if (on && a.made_on != Allocation::kNoStream && at->at(a.made_on) < a.made_at)
    violation("stream-order race: " + freer + " frees the allocation at " + hex(a.base) + " before its " + a.how +
              " on stream #" + std::to_string(a.made_on) + " is ordered before the free");
  freed_.push_back({a.base, a.bytes, how, !a.graph_owned});
  freed_bytes_ += a.bytes;
  live_bytes_[static_cast<int>(space)] -= a.bytes;
  live_.erase(it);
  // Kept while an operation is pending: a deferred one queued before the free may still use it.
  while (pending_.empty() && !freed_.empty() && (freed_bytes_ > kQuarantineBytes || freed_.size() > kQuarantineBlocks)) {
    freed_bytes_ -= freed_.front().bytes;
    if (freed_.front().owned) ::operator delete(freed_.front().base, std::align_val_t{kAlignment});
    freed_.pop_front();
  }
  return true;
}

Allocation* Runtime::find(const void* p) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  auto it = live_.upper_bound(addr);
  if (it == live_.begin()) return nullptr;
  --it;
  Allocation& a = it->second;
  return addr < it->first + std::max<std::size_t>(a.bytes, 1) ? &a : nullptr;
}

const Freed* Runtime::find_freed(const void* p) const {
  const auto* b = static_cast<const std::byte*>(p);
  for (auto it = freed_.rbegin(); it != freed_.rend(); ++it)
    if (b >= it->base && b < it->base + std::max<std::size_t>(it->bytes, 1)) return &*it;
  return nullptr;
}

bool Runtime::check_access(Stream& s, std::uint64_t time, const void* p, std::size_t bytes, bool write,
                           bool device_only, const std::string& what, std::string& error) {
  if (bytes == 0) return true;
  Allocation* a = find(p);
  if (!a) {
    if (const Freed* f = find_freed(p)) {
      error = what + " " + (write ? "writes " : "reads ") + hex(p) + ", inside the " + std::to_string(f->bytes) +
              "-byte allocation at " + hex(f->base) + " that " + f->how + " already freed";
    } else if (device_only) {
      error = what + " " + (write ? "writes " : "reads ") + hex(p) +
              ", which is not device memory (pageable host memory, or never allocated)";
    } else {
      return true;  // pageable host memory, which a copy may use
    }
    violation(error);
    return false;
  }
  const auto begin = static_cast<std::size_t>(static_cast<const std::byte*>(p) - a->base);
  if (bytes > a->bytes - begin) {
    error = what + " " + (write ? "writes " : "reads ") + std::to_string(bytes) + " bytes at offset " +
            std::to_string(begin) + " of the " + std::to_string(a->bytes) + "-byte allocation at " + hex(a->base) +
            " (" + a->how + "): past its end";
    violation(error);
    return false;
  }
  const std::size_t end = begin + bytes;
  if (a->made_on != Allocation::kNoStream && s.clock.at(a->made_on) < a->made_at)
    violation("stream-order race: " + what + " on " + describe(s) + " uses the allocation at " + hex(a->base) +
              " before its " + a->how + " on stream #" + std::to_string(a->made_on) + " is ordered before it");
  for (const Access& x : a->accesses)
    if (x.begin < end && begin < x.end && (x.write || write) && s.clock.at(x.stream) < x.time)
      violation("stream-order race: " + what + " on " + describe(s) + " " + (write ? "writes" : "reads") + " bytes [" +
                std::to_string(begin) + ", " + std::to_string(end) + ") of the " + std::to_string(a->bytes) + "-byte " +
                space_name(a->space) + " allocation at " + hex(a->base) + " (" + a->how + "), which " + x.what +
                " on stream #" + std::to_string(x.stream) + " " + (x.write ? "wrote" : "read") +
                " with nothing ordering the two (no event wait or host synchronization between them)");
  record_access(*a, s, {s.id, time, begin, end, write, what});
  return true;
}

// Keeps the history short without losing a race: an earlier access ordered before this
// one and inside its range is dropped when this one is a write or both are reads (any later
// access that conflicts with the dropped one and is not ordered after this one conflicts
// with this one too, and is reported against it).
void Runtime::record_access(Allocation& a, const Stream& s, Access x) {
  std::erase_if(a.accesses, [&](const Access& y) {
    return s.clock.at(y.stream) >= y.time && x.begin <= y.begin && y.end <= x.end && (x.write || !y.write);
  });
  if (a.accesses.size() >= kAccessesKept) a.accesses.erase(a.accesses.begin());
  a.accesses.push_back(std::move(x));
}

void Runtime::violation(std::string text) {
  if (violations_.size() < kViolationsKept) violations_.push_back(std::move(text));
}

std::vector<std::string> Runtime::take_violations() { return std::exchange(violations_, {}); }

std::string Runtime::describe(const Stream& s) const {
  return "stream #" + std::to_string(s.id) + " (cuda:" + std::to_string(s.device) + (s.legacy ? ", legacy default" : "") + ")";
}

}  // namespace cuda_emulator::detail
