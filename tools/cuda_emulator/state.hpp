#pragma once
// The emulated runtime's model (see emulator.hpp): streams, events and the host with
// vector clocks, live allocations with their access history, and the checks on them.
// One mutex guards it all; every entry point of runtime.cpp holds it.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cuda_emulator::detail {

// The GPU the emulator shows: an H200's figures (NVRTC compiles for its architecture).
inline constexpr char kDeviceName[] = "fsdp CUDA runtime emulator";  // test/support/gpu.hpp tells it by this
inline constexpr int kSmCount = 132;  // FSDP_CUDA_EMULATOR_SMS shows another count (sm_count())
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

struct Capture;

struct Stream {
  int device = 0;
  bool blocking = false;  // synchronizes with the device's legacy default stream
  bool legacy = false;
  std::size_t id = 0;
  Clock clock;
  std::shared_ptr<Capture> capture;  // set while the stream is capturing (graph.cpp)
};

struct Event {
  int device = 0;
  bool recorded = false;
  Clock clock;  // the recording stream's, at the record
  // Set when its last record was captured (into that capture's event `slot`, knowing what
  // `seen` says of the capture's streams); cleared by an eager record.
  std::shared_ptr<Capture> capture;
  std::size_t slot = 0;
  std::vector<long> seen;
};

// Stream capture (graph.cpp). A capture records what is queued on its streams as nodes,
// in the order the host queued them, instead of running it; a launch of the instantiated
// graph queues them again, on the launch stream and on streams of the executable graph's
// own, through the same entry points, so a replay is checked like eager calls.
struct GraphAllocation {  // cudaMallocAsync in a capture: one address for every replay
  std::byte* base = nullptr;
  std::size_t bytes = 0;
  int device = 0;
  bool freed_in_capture = false;
};

struct Node {
  enum class Kind { op, record, wait, alloc, free } kind = Kind::op;
  std::size_t stream = 0;      // the capture's stream slot (0: the one it began on)
  std::size_t event = 0;       // record, wait: the capture's event slot
  std::size_t allocation = 0;  // alloc, free: in GraphData::allocations
  std::string what;
  std::function<cudaError_t(cudaStream_t)> issue;  // op: queues the call again on a stream
};

struct GraphData {
  int device = 0;
  std::vector<Node> nodes;
  std::size_t streams = 1, events = 0;
  std::vector<GraphAllocation> allocations;  // storage owned here (Runtime::drop_graph_memory)
  int executables = 0;  // instantiated and not destroyed (one at a time when it has memory nodes)
};

struct Capture {
  unsigned long long id = 0;
  std::string name;  // "the capture #N begun on stream #S (cuda:D)", for messages after its stream is gone
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  Stream* origin = nullptr;
  std::shared_ptr<GraphData> graph;  // until it ends (events recorded in it keep the Capture, not its graph)
  std::map<Stream*, std::size_t> streams;  // every stream in the capture, by slot
  // Per slot: the last node each slot has that is ordered before this slot's next node
  // (-1: none), and this slot's own last node that is not a wait. Joined back = the
  // origin has seen every other slot's last node.
  std::vector<std::vector<long>> seen;
  std::vector<long> last;
  std::string invalidated;  // why, once a prohibited call invalidated it
  bool ended = false;
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
  bool graph_owned = false;               // a graph's memory, live during a replay
  static constexpr std::size_t kNoStream = static_cast<std::size_t>(-1);
};

// A freed allocation kept unreleased for a while, so that a late use is reported as such.
struct Freed {
  std::byte* base;
  std::size_t bytes;
  std::string how;  // "cudaFreeAsync", "cudaFree", "cudaFreeHost"
  bool owned = true;  // false: a graph's memory (its storage stays with the graph)
};

// An operation that does not complete when it is queued: an NCCL collective (until every
// rank has queued its part, nccl.cpp), a host function (until it returns), and a kernel,
// copy or fill queued behind one of those (until it has run). The clocks say what is
// ordered after an incomplete one: such a kernel, copy or fill is deferred (its arguments
// kept) and runs once its predecessors have completed; a query of a stream or event
// ordered after one reports cudaErrorNotReady; a synchronization waits. What cannot be
// deferred waits on the host instead: a copy into pageable host memory, which a GPU also
// makes synchronously (a copy from pageable memory takes its bytes at the call, as a GPU's
// driver stages them, and may be deferred). Stream-ordered allocations and frees
// touch no bytes and are not held (freed memory is kept while anything is pending).
struct Pending {
  std::size_t stream = 0;
  std::uint64_t time = 0;  // its point on its stream
  Clock after;             // what is ordered before it: its stream's clock when it was queued
  bool done = false;
  std::string what;
  // Moves it on once everything before it has completed; called under the runtime's mutex,
  // repeatedly, until it sets `done`. May start work elsewhere (a thread, a peer).
  std::function<void(Pending&)> step;
};

// How long a host wait on a pending operation may last before the emulator calls it a hang
// (FSDP_CUDA_EMULATOR_HANG_S, default 60 s).
std::chrono::seconds hang_bound();
// The SM count the runtime shows: kSmCount, or FSDP_CUDA_EMULATOR_SMS (1 to 1024), so that a
// test of the kernels' loops past their grid cap (32 blocks per SM) needs buffers a few
// times that cap, not an H200's (cuda_device_emulated_test sets 4).
int sm_count();

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
  // blocking stream, after the legacy stream's work; returns its time on s. An eager
  // operation (begin_op) first waits on the host for the pending operations it is ordered
  // after; a pending one (queue_op) does not.
  std::uint64_t begin_op(Stream& s, bool* hung = nullptr);  // *hung: the wait reached the hang bound
  std::uint64_t queue_op(Stream& s);
  void order(Stream& s);  // the ordering part of both, without starting an operation

  // Pending operations. `add_pending` makes the operation queued on s at `time` (queue_op's)
  // pending (its step runs at once if it can).
  // `progress` steps every one whose predecessors have completed, until none moves.
  // `incomplete` is the first pending operation that `c` is ordered after and that has not
  // completed, or null. `wait_for` waits (the runtime's mutex released meanwhile, the
  // caller's lock kept) until none is; past the hang bound (FSDP_CUDA_EMULATOR_HANG_S,
  // default 60 s: a GPU would wait forever) it records a violation and returns false.
  std::shared_ptr<Pending> add_pending(Stream& s, std::uint64_t time, std::string what, std::function<void(Pending&)> step);
  void progress();
  // Runs `body` (an eager operation queued on s at `time`) now or, when s is held behind a
  // pending operation, once that has completed (then as a pending operation itself).
  void run_in_order(Stream& s, std::uint64_t time, std::string what, std::function<void()> body);
  const Pending* incomplete(const Clock& c) const;
  bool wait_for(const Clock& c, const std::string& waiter);

  // Memory.
  std::byte* allocate(std::size_t bytes, Space space, int device, const char* how, Stream* on);
  // Frees `p` (its base): `on` is the freeing stream (null: the host, for synchronous
  // frees). Returns false for a pointer that is not a live allocation's base in `space`.
  bool release(void* p, Space space, const char* how, Stream* on);
  Allocation* find(const void* p);            // the live allocation holding p, if any
  const Freed* find_freed(const void* p) const;
  std::size_t live_bytes(Space space) const { return live_bytes_[static_cast<int>(space)]; }
  // A graph's memory (graph.cpp): storage made at capture, live only from its allocation
  // node to its free node in each replay (adopt, then release), deleted with the graph.
  std::byte* graph_storage(std::size_t bytes);
  void adopt(const GraphAllocation& g, Stream& on);
  void drop_graph_memory(GraphData& g);

  // Captures under way (graph.cpp), and this thread's capture interaction mode.
  std::vector<std::shared_ptr<Capture>> captures;
  unsigned long long next_capture_id = 1;

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
  void start_progress_thread();
  std::vector<std::shared_ptr<Pending>> pending_;  // not yet done, in the order queued
  bool progress_thread_started_ = false;
  std::deque<Freed> freed_;
  std::size_t freed_bytes_ = 0;
  std::vector<std::string> violations_;
};

}  // namespace cuda_emulator::detail
