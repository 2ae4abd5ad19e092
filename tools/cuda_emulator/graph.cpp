// Stream capture and CUDA graphs in the emulated runtime (capture.hpp says which rules it
// keeps). A capture records nodes in the order the host queued them, which is an order
// the graph's dependencies allow; a launch queues them again in that order, slot 0's on
// the launch stream and every other slot's on a stream the executable graph owns, with
// its own events in place of the captured ones. So every replayed copy, kernel and
// collective goes through the eager entry points and their checks (memory, stream-order
// races), and a replay orders after what was queued before it on the launch stream and
// before what is queued after it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tools/cuda_emulator/capture.hpp"
#include "tools/cuda_emulator/entry.hpp"

namespace cuda_emulator::detail {

thread_local cudaStreamCaptureMode thread_capture_mode = cudaStreamCaptureModeGlobal;

namespace {

struct GraphHandle {
  std::shared_ptr<GraphData> data;
};

struct ExecData {
  std::shared_ptr<GraphData> data;
  int device = 0;
  cudaEvent_t done = nullptr;  // the end of its last launch: the next one is ordered after it
  bool launched = false;
  std::vector<cudaStream_t> streams;  // slots 1.. (slot 0 is the launch stream)
  std::vector<cudaEvent_t> events;    // the capture's event slots
  cudaEvent_t fork = nullptr;         // the launch stream's point where a replay starts
  std::vector<cudaEvent_t> joins;     // each own stream's end of a replay
};

// Under the runtime's mutex.
std::set<GraphHandle*>& graphs() {
  static auto* s = new std::set<GraphHandle*>;
  return *s;
}
std::set<std::shared_ptr<ExecData>*>& execs() {
  static auto* s = new std::set<std::shared_ptr<ExecData>*>;
  return *s;
}

std::string describe(const Capture& c) { return c.name; }

void invalidate(Capture& c, std::string why) {
  if (c.invalidated.empty()) c.invalidated = std::move(why);
}

long at(const std::vector<long>& v, std::size_t i) { return i < v.size() ? v[i] : -1; }

void join(std::vector<long>& into, const std::vector<long>& from) {
  if (from.size() > into.size()) into.resize(from.size(), -1);
  for (std::size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

std::size_t slot_of(Capture& c, Stream& s) { return c.streams.at(&s); }

// Appends a node queued on slot `slot`; a wait is not the slot's own work (joining back
// needs the origin to have seen the slot's last record, copy, kernel...).
void add_node(Capture& c, std::size_t slot, Node n) {
  const long index = static_cast<long>(c.graph->nodes.size());
  const bool own_work = n.kind != Node::Kind::wait;
  n.stream = slot;
  c.graph->nodes.push_back(std::move(n));
  if (!own_work) return;
  c.last[slot] = index;
  if (c.seen[slot].size() <= slot) c.seen[slot].resize(slot + 1, -1);
  c.seen[slot][slot] = index;
}

cudaError_t refuse_if_invalidated(Entry& entry, Capture& c, const std::string& what) {
  if (c.invalidated.empty()) return cudaSuccess;
  return entry.fail(cudaErrorStreamCaptureInvalidated,
                    what + ": " + describe(c) + " was invalidated earlier: " + c.invalidated);
}

// The capture ends for every stream in it and lets go of its graph (returned), which
// events recorded in it must not keep alive.
std::shared_ptr<GraphData> end(Capture& c) {
  c.ended = true;
  for (auto& [s, slot] : c.streams) s->capture = nullptr;
  c.streams.clear();
  c.origin = nullptr;
  std::erase_if(rt().captures, [&](const std::shared_ptr<Capture>& x) { return x.get() == &c; });
  return std::exchange(c.graph, nullptr);
}

// Whether `p` is in device memory: eager, or of a graph (live or not).
bool known_memory(const void* p) { return rt().find(p) || find_graph_allocation(p); }

void drop_if_last(std::shared_ptr<GraphData>& data) {
  if (data && data.use_count() == 1) rt().drop_graph_memory(*data);
  data.reset();
}

void set_error(cudaError_t e, std::string text) {
  last_error = e;
  detail_code = e;
  last_detail = std::move(text);
}

}  // namespace

const GraphAllocation* find_graph_allocation(const void* p) {
  const auto* b = static_cast<const std::byte*>(p);
  auto in = [&](const GraphData& g) -> const GraphAllocation* {
    for (const GraphAllocation& a : g.allocations)
      if (a.base && b >= a.base && b < a.base + a.bytes) return &a;
    return nullptr;
  };
  for (const auto& c : rt().captures)
    if (const auto* a = in(*c->graph)) return a;
  for (const GraphHandle* h : graphs())
    if (const auto* a = in(*h->data)) return a;
  for (const auto* x : execs())
    if (const auto* a = in(*(*x)->data)) return a;
  return nullptr;
}

cudaError_t check_unsafe_call(Entry& entry, const char* call) {
  if (thread_capture_mode == cudaStreamCaptureModeRelaxed || rt().captures.empty()) return cudaSuccess;
  const auto me = std::this_thread::get_id();
  std::string by;
  for (const auto& c : rt().captures) {
    const bool own = c->thread == me && c->mode != cudaStreamCaptureModeRelaxed;
    const bool other = c->thread != me && c->mode == cudaStreamCaptureModeGlobal &&
                       thread_capture_mode == cudaStreamCaptureModeGlobal;
    if (!own && !other) continue;
    invalidate(*c, std::string(call) + " was called " +
                       (own ? "on the capturing thread" : "on another thread in the global capture mode"));
    if (by.empty()) by = describe(*c) + (own ? " on this thread" : " on another thread in the global mode");
  }
  if (by.empty()) return cudaSuccess;
  return entry.fail(cudaErrorStreamCaptureUnsupported,
                    std::string(call) + " is not permitted during " + by +
                        " (a potentially unsafe call; the capture is invalidated, as on a GPU)");
}

cudaError_t capture_prohibits(Entry& entry, Stream& s, const char* call) {
  invalidate(*s.capture, std::string(call) + " of a stream in the capture");
  return entry.fail(cudaErrorStreamCaptureUnsupported, std::string(call) + " of " + rt().describe(s) + ", which is in " +
                                                           describe(*s.capture) + " (the capture is invalidated)");
}

cudaError_t captured_event_use(Entry& entry, Event& e, const char* call) {
  if (!e.capture->ended) invalidate(*e.capture, std::string(call) + " of an event recorded in the capture");
  return entry.fail(cudaErrorCapturedEvent, std::string(call) + " of an event last recorded in " + describe(*e.capture) +
                                                ": it marks a point of a graph, not of a stream");
}

cudaError_t capture_op(Entry& entry, Stream& s, std::string what, std::function<cudaError_t(cudaStream_t)> issue) {
  Capture& c = *s.capture;
  if (cudaError_t e = refuse_if_invalidated(entry, c, what); e != cudaSuccess) return e;
  Node n;
  n.what = std::move(what);
  n.issue = std::move(issue);
  add_node(c, slot_of(c, s), std::move(n));
  return cudaSuccess;
}

cudaError_t capture_copy_check(Entry& entry, Stream& s, void* dst, const void* src, std::size_t bytes, const char* what) {
  Capture& c = *s.capture;
  if (bytes == 0 || (known_memory(dst) && known_memory(src))) return cudaSuccess;
  invalidate(c, std::string(what) + " of pageable host memory");
  return entry.fail(cudaErrorStreamCaptureUnsupported,
                    std::string(what) + " in " + describe(c) +
                        " touches pageable host memory (a copy a graph cannot replay: use pinned memory)");
}

cudaError_t capture_record(Entry& entry, Stream& s, Event& e) {
  Capture& c = *s.capture;
  if (cudaError_t r = refuse_if_invalidated(entry, c, "cudaEventRecord"); r != cudaSuccess) return r;
  if (e.capture.get() != &c) e.slot = c.graph->events++;
  const std::size_t slot = slot_of(c, s);
  Node n;
  n.kind = Node::Kind::record;
  n.event = e.slot;
  n.what = "cudaEventRecord";
  add_node(c, slot, std::move(n));
  e.capture = s.capture;
  e.seen = c.seen[slot];
  return cudaSuccess;
}

cudaError_t capture_wait(Entry& entry, Stream& s, Event& e, unsigned flags) {
  if (flags != 0) {
    if (s.capture) invalidate(*s.capture, "cudaStreamWaitEvent with flags");
    return entry.fail(cudaErrorNotSupported, "cudaStreamWaitEvent: flags (cudaEventWaitExternal) are not emulated");
  }
  if (!s.capture) {  // e was recorded in a capture
    if (e.capture->ended)
      return entry.fail(cudaErrorCapturedEvent, "cudaStreamWaitEvent on " + rt().describe(s) +
                                                    " of an event last recorded in " + describe(*e.capture) +
                                                    ", which has ended: the event marks a point of a graph");
    Capture& c = *e.capture;  // s joins the capture (a fork)
    if (cudaError_t r = refuse_if_invalidated(entry, c, "cudaStreamWaitEvent"); r != cudaSuccess) return r;
    const std::size_t slot = c.graph->streams++;
    c.streams[&s] = slot;
    c.seen.push_back(e.seen);
    c.last.push_back(-1);
    s.capture = e.capture;
    Node n;
    n.kind = Node::Kind::wait;
    n.event = e.slot;
    n.what = "cudaStreamWaitEvent";
    add_node(c, slot, std::move(n));
    return cudaSuccess;
  }
  Capture& c = *s.capture;
  if (cudaError_t r = refuse_if_invalidated(entry, c, "cudaStreamWaitEvent"); r != cudaSuccess) return r;
  if (!e.capture) {
    if (!e.recorded) return cudaSuccess;  // never recorded: nothing to wait for, as eagerly
    invalidate(c, "a wait on an event recorded outside the capture");
    return entry.fail(cudaErrorStreamCaptureIsolation,
                      "cudaStreamWaitEvent: " + rt().describe(s) + " in " + describe(c) +
                          " waits on an event recorded outside the capture (the capture is invalidated; "
                          "record the event inside it, or order the work before cudaStreamBeginCapture)");
  }
  if (e.capture.get() != &c) {
    invalidate(c, "a wait on an event of another capture");
    return entry.fail(cudaErrorStreamCaptureMerge, "cudaStreamWaitEvent: " + rt().describe(s) + " in " + describe(c) +
                                                       " waits on an event recorded in " + describe(*e.capture));
  }
  const std::size_t slot = slot_of(c, s);
  join(c.seen[slot], e.seen);
  Node n;
  n.kind = Node::Kind::wait;
  n.event = e.slot;
  n.what = "cudaStreamWaitEvent";
  add_node(c, slot, std::move(n));
  return cudaSuccess;
}

cudaError_t capture_malloc(Entry& entry, Stream& s, void** p, std::size_t bytes) {
  Capture& c = *s.capture;
  if (!p) return entry.fail(cudaErrorInvalidValue, "cudaMallocAsync with a null result pointer");
  *p = nullptr;
  if (cudaError_t r = refuse_if_invalidated(entry, c, "cudaMallocAsync"); r != cudaSuccess) return r;
  if (bytes == 0) return cudaSuccess;
  std::byte* base = rt().graph_storage(bytes);
  if (!base) return entry.fail(cudaErrorMemoryAllocation, "cudaMallocAsync(" + std::to_string(bytes) + " bytes) in a capture");
  c.graph->allocations.push_back({base, bytes, s.device, false});
  Node n;
  n.kind = Node::Kind::alloc;
  n.allocation = c.graph->allocations.size() - 1;
  n.what = "cudaMallocAsync";
  add_node(c, slot_of(c, s), std::move(n));
  *p = base;
  return cudaSuccess;
}

cudaError_t capture_free(Entry& entry, Stream& s, void* p) {
  Capture& c = *s.capture;
  if (cudaError_t r = refuse_if_invalidated(entry, c, "cudaFreeAsync"); r != cudaSuccess) return r;
  if (!p) return cudaSuccess;
  auto& all = c.graph->allocations;
  const auto it = std::ranges::find_if(all, [&](const GraphAllocation& a) { return a.base == p; });
  if (it == all.end()) {
    invalidate(c, "cudaFreeAsync of memory allocated outside the capture");
    return entry.fail(cudaErrorNotSupported, "cudaFreeAsync in " + describe(c) +
                                                 " of memory not allocated in it: not emulated (free it outside the capture)");
  }
  if (it->freed_in_capture) {
    invalidate(c, "a graph allocation freed twice");
    return entry.fail(cudaErrorInvalidValue, "cudaFreeAsync in " + describe(c) + ": this allocation was freed in it already");
  }
  it->freed_in_capture = true;
  Node n;
  n.kind = Node::Kind::free;
  n.allocation = static_cast<std::size_t>(it - all.begin());
  n.what = "cudaFreeAsync";
  add_node(c, slot_of(c, s), std::move(n));
  return cudaSuccess;
}

}  // namespace cuda_emulator::detail

using namespace cuda_emulator;          // NOLINT: the entry points below are the C API
using namespace cuda_emulator::detail;  // NOLINT

extern "C" {

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  FSDP_EMULATOR_ENTER(cudaThreadExchangeStreamCaptureMode);
  if (!mode || *mode < cudaStreamCaptureModeGlobal || *mode > cudaStreamCaptureModeRelaxed)
    return entry.fail(cudaErrorInvalidValue, "cudaThreadExchangeStreamCaptureMode: not a mode");
  std::swap(*mode, thread_capture_mode);
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  FSDP_EMULATOR_ENTER(cudaStreamBeginCapture);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (s->legacy) return entry.fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture on the legacy default stream");
  if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed)
    return entry.fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: not a capture mode");
  if (s->capture) return entry.fail(cudaErrorIllegalState, "cudaStreamBeginCapture: " + rt().describe(*s) + " is capturing already");
  auto c = std::make_shared<Capture>();
  c->id = rt().next_capture_id++;
  c->name = "the capture #" + std::to_string(c->id) + " begun on " + rt().describe(*s);
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->origin = s;
  c->graph = std::make_shared<GraphData>();
  c->graph->device = s->device;
  c->streams[s] = 0;
  c->seen.push_back({});
  c->last.push_back(-1);
  s->capture = c;
  rt().captures.push_back(std::move(c));
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  FSDP_EMULATOR_ENTER(cudaStreamEndCapture);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (!graph) return entry.fail(cudaErrorInvalidValue, "cudaStreamEndCapture with a null result pointer");
  *graph = nullptr;
  if (!s->capture) return entry.fail(cudaErrorIllegalState, "cudaStreamEndCapture: " + rt().describe(*s) + " is not capturing");
  const std::shared_ptr<Capture> c = s->capture;
  if (c->origin != s)
    return entry.fail(cudaErrorStreamCaptureUnmatched,
                      "cudaStreamEndCapture on " + rt().describe(*s) + ", which joined " + describe(*c) + " but did not begin it");
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
    return entry.fail(cudaErrorStreamCaptureWrongThread,
                      "cudaStreamEndCapture of " + describe(*c) + " on another thread than the one that began it");
  const std::vector<std::pair<std::string, std::size_t>> joined_streams = [&] {
    std::vector<std::pair<std::string, std::size_t>> v;
    for (const auto& [joined, slot] : c->streams) v.emplace_back(rt().describe(*joined), slot);
    return v;
  }();
  const std::shared_ptr<GraphData> data = end(*c);
  std::string refused;
  cudaError_t code = cudaSuccess;
  if (!c->invalidated.empty()) {
    code = cudaErrorStreamCaptureInvalidated;
    refused = describe(*c) + " was invalidated: " + c->invalidated;
  }
  for (const auto& [joined, slot] : joined_streams)
    if (code == cudaSuccess && slot != 0 && c->last[slot] > at(c->seen[0], slot)) {
      code = cudaErrorStreamCaptureUnjoined;
      refused = describe(*c) + ": the work queued on " + joined +
                " after it joined the capture is not joined back into the stream it began on (record an event "
                "there and wait on it from that stream before cudaStreamEndCapture)";
    }
  for (const GraphAllocation& a : data->allocations)
    if (code == cudaSuccess && !a.freed_in_capture) {
      code = cudaErrorNotSupported;
      refused = describe(*c) + ": " + std::to_string(a.bytes) +
                " bytes allocated in the capture and not freed in it: not emulated (free them in the capture)";
    }
  if (code != cudaSuccess) {
    rt().drop_graph_memory(*data);
    return entry.fail(code, "cudaStreamEndCapture: " + refused);
  }
  auto* h = new GraphHandle{data};
  graphs().insert(h);
  *graph = reinterpret_cast<cudaGraph_t>(h);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  FSDP_EMULATOR_ENTER(cudaStreamIsCapturing);
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return entry.unknown("stream");
  if (!status) return entry.fail(cudaErrorInvalidValue, "cudaStreamIsCapturing with a null result pointer");
  *status = !s->capture                        ? cudaStreamCaptureStatusNone
            : s->capture->invalidated.empty() ? cudaStreamCaptureStatusActive
                                              : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  const ThreadCalls before = calls_here;
  std::shared_ptr<GraphData> data;
  {
    FSDP_EMULATOR_ENTER(cudaGraphInstantiate);
    auto* h = reinterpret_cast<GraphHandle*>(graph);
    if (!exec) return entry.fail(cudaErrorInvalidValue, "cudaGraphInstantiate with a null result pointer");
    if (!graphs().count(h)) return entry.unknown("graph");
    if (flags != 0) return entry.fail(cudaErrorNotSupported, "cudaGraphInstantiate: flags are not emulated");
    data = h->data;
    if (!data->allocations.empty() && data->executables > 0)
      return entry.fail(cudaErrorNotSupported, "cudaGraphInstantiate: a graph with memory nodes (cudaMallocAsync in "
                                               "its capture) has one executable graph at a time, as in CUDA");
    ++data->executables;
  }
  // Its own streams and events, made through the entry points (the lock is not held).
  auto x = std::make_shared<ExecData>();
  x->data = data;
  x->device = data->device;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(data->device);
  for (std::size_t i = 1; i < data->streams; ++i) {
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    x->streams.push_back(s);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    x->joins.push_back(e);
  }
  for (std::size_t i = 0; i < data->events; ++i) {
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    x->events.push_back(e);
  }
  cudaEventCreateWithFlags(&x->fork, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&x->done, cudaEventDisableTiming);
  cudaSetDevice(previous);
  calls_here.calls = before.calls;  // the streams and events are the graph's, not the caller's calls
  ++calls_here.calls[static_cast<std::size_t>(Call::cudaGraphInstantiate)];
  std::lock_guard lock(rt().mutex);
  auto* handle = new std::shared_ptr<ExecData>(std::move(x));
  execs().insert(handle);
  *exec = reinterpret_cast<cudaGraphExec_t>(handle);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  const auto begin = std::chrono::steady_clock::now();
  const ThreadCalls before = calls_here;
  std::shared_ptr<ExecData> x;
  {
    FSDP_EMULATOR_ENTER(cudaGraphLaunch);
    auto* handle = reinterpret_cast<std::shared_ptr<ExecData>*>(exec);
    if (!execs().count(handle)) return entry.unknown("graph exec");
    Stream* s = rt().resolve(stream, current_device);
    if (!s) return entry.unknown("stream");
    if (s->capture) {
      invalidate(*s->capture, "a graph launched in the capture");
      return entry.fail(cudaErrorNotSupported, "cudaGraphLaunch inside a capture (a child graph): not emulated");
    }
    x = *handle;
    if (s->device != x->device)
      return entry.fail(cudaErrorInvalidValue, "cudaGraphLaunch on a stream of cuda:" + std::to_string(s->device) +
                                                   " of a graph captured on cuda:" + std::to_string(x->device));
  }
  // Queued again through the entry points, which count as the launch's own work, not as
  // the caller's calls: the counts are put back below, with the launch counted once.
  const GraphData& g = *x->data;
  auto on = [&](std::size_t slot) { return slot == 0 ? stream : x->streams[slot - 1]; };
  int previous = 0;  // the graph's kernels run on its device, whichever is current here
  cudaGetDevice(&previous);
  cudaSetDevice(x->device);
  // After its previous launch, on whatever stream that was (CUDA orders launches of one
  // executable graph), and after what was queued before it on this stream.
  if (x->launched) cudaStreamWaitEvent(stream, x->done, 0);
  cudaError_t result = cudaEventRecord(x->fork, stream);
  for (cudaStream_t s : x->streams)
    if (result == cudaSuccess) result = cudaStreamWaitEvent(s, x->fork, 0);
  std::string failed;
  for (std::size_t i = 0; i < g.nodes.size() && result == cudaSuccess; ++i) {
    const Node& n = g.nodes[i];
    switch (n.kind) {
      case Node::Kind::op: result = n.issue(on(n.stream)); break;
      case Node::Kind::record: result = cudaEventRecord(x->events[n.event], on(n.stream)); break;
      case Node::Kind::wait: result = cudaStreamWaitEvent(on(n.stream), x->events[n.event], 0); break;
      case Node::Kind::alloc:
      case Node::Kind::free: {
        std::lock_guard lock(rt().mutex);
        Stream* s = rt().resolve(on(n.stream), x->device);
        const GraphAllocation& a = g.allocations[n.allocation];
        if (n.kind == Node::Kind::alloc) {
          rt().adopt(a, *s);
        } else if (!rt().release(a.base, Space::device, "cudaFreeAsync (a graph's free node)", s)) {
          result = cudaErrorInvalidValue;
          set_error(result, "the graph's allocation is not live");
        }
        break;
      }
    }
    if (result != cudaSuccess)
      failed = "cudaGraphLaunch: node " + std::to_string(i) + " (" + n.what + ") failed: " + cudaGetErrorString(result);
  }
  for (std::size_t i = 0; i < x->streams.size(); ++i) {  // the launch stream waits for the whole replay
    cudaEventRecord(x->joins[i], x->streams[i]);
    cudaStreamWaitEvent(stream, x->joins[i], 0);
  }
  cudaEventRecord(x->done, stream);
  x->launched = true;
  cudaSetDevice(previous);
  calls_here = before;
  ++calls_here.calls[static_cast<std::size_t>(Call::cudaGraphLaunch)];
  calls_here.ns += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin).count());
  if (result != cudaSuccess) set_error(result, failed);
  return result;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::shared_ptr<ExecData> x;
  {
    FSDP_EMULATOR_ENTER(cudaGraphExecDestroy);
    auto* handle = reinterpret_cast<std::shared_ptr<ExecData>*>(exec);
    if (!execs().erase(handle)) return entry.unknown("graph exec");
    x = std::move(*handle);
    delete handle;
  }
  for (cudaStream_t s : x->streams) cudaStreamDestroy(s);
  for (cudaEvent_t e : x->joins) cudaEventDestroy(e);
  for (cudaEvent_t e : x->events) cudaEventDestroy(e);
  cudaEventDestroy(x->fork);
  cudaEventDestroy(x->done);
  std::lock_guard lock(rt().mutex);
  --x->data->executables;
  drop_if_last(x->data);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  FSDP_EMULATOR_ENTER(cudaGraphDestroy);
  auto* h = reinterpret_cast<GraphHandle*>(graph);
  if (!graphs().erase(h)) return entry.unknown("graph");
  drop_if_last(h->data);
  delete h;
  return cudaSuccess;
}

}  // extern "C"
