#pragma once
// fsdp::CudaThreadComm: thread ranks sharing one GPU, with NcclComm's stream behaviour, so
// the multi-rank stream logic (and the multi-rank parity and memory tests) run on a
// machine with one GPU, which NCCL refuses (one rank per device). Each rank wraps its
// ThreadComm and its CudaDevice (its own compute stream, e.g. the engine's). Collectives on
// GPU-addressable memory are device-to-device copies and CudaDevice's accumulate kernel,
// queued on the rank's all-gather or reduce stream and ordered by events:
//
//   1. the communication stream waits for the rank's compute stream (inputs written,
//      buffers allocated), then records this rank's "ready" event;
//   2. the ranks exchange buffers, ready events and calls (a ThreadComm all_gather of
//      handles); every rank checks that all issued the same collective, with the same
//      CollectiveTag (the unit it belongs to), and fails alike naming every rank's call;
//   3. each rank's stream waits for every peer's ready event and pulls what it needs from
//      the peers' send buffers: all_gather and broadcast straight into recv; reductions
//      into a scratch buffer, summed in rank order 0..N-1 as ThreadComm does, so results
//      are bitwise ThreadComm's; then it records its "done" event;
//   4. the ranks exchange done events; each stream waits for every peer's (nobody reads
//      this rank's send buffer any more), copies a reduction's scratch into recv (so an
//      in-place all_reduce is safe) and records the collective's own event: the Work.
//      A last host barrier keeps every rank's events alive until its peers have enqueued
//      their waits on them (a communicator may be destroyed right after its call returns).
// The Work is waited for like NcclComm's: Work::wait_on(CudaDevice::queue()) makes a
// stream wait (no host block), Work::wait() polls from the host, bounded by the timeout.
// A rank's ready and done events are reused from one collective to the next: a rank
// re-records them only after the next exchange, which every peer reaches after enqueuing
// its waits on them. The exchanges are host rendezvous, so a call returns once every rank
// has issued it (thread ranks issue in step); the GPU work is not waited for.
//
// Calls whose buffers are all ordinary host memory (the library's small agreements) run
// on the ThreadComm itself (tags passed on). On device memory: sum, and avg of floating dtypes (the sum
// times 1/N, as ThreadComm finishes it); max and min are refused. Scratch buffers are
// stream-ordered allocations of the communicator, not counted by the CudaDevice.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/collective_mismatch.hpp"
#include "fsdp/core/detail/tagged_calls.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

struct CudaThreadCommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // a host wait for one collective
};

namespace detail {

// A rank's streams and events, shared by the moves of its communicator and its Work.
struct CudaThreadCommState {
  CudaThreadCommState(int device_index, std::string where_text) : device(device_index), where(std::move(where_text)) {}
  ~CudaThreadCommState() {  // errors cannot be reported from here
    cudaSetDevice(device);
    for (cudaStream_t s : {gather, reduce})
      if (s) cudaStreamSynchronize(s), cudaStreamDestroy(s);
    for (cudaEvent_t e : {after, ready, done})
      if (e) cudaEventDestroy(e);
    (void)cudaGetLastError();
  }
  int device;
  std::string where;  // "CudaThreadComm rank 1 of 4 (cuda:0)"
  cudaStream_t gather = nullptr, reduce = nullptr;
  cudaEvent_t after = nullptr, ready = nullptr, done = nullptr;
};

// One collective's completion on this rank, as a Work. Its messages are formatted only
// when one is written.
class CudaEventPending final : public Work::Pending {
 public:
  CudaEventPending(cudaEvent_t event, std::shared_ptr<const CudaThreadCommState> state, const CollectiveCall& call,
                   std::chrono::milliseconds timeout)
      : event_(event), state_(std::move(state)), call_(call), timeout_(timeout) {}
  ~CudaEventPending() override { cudaEventDestroy(event_); }  // released once complete
  void wait() override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (int spins = 0; !ready(); ++spins) {
      if (std::chrono::steady_clock::now() > deadline)
        fail_as(ErrorKind::timeout, at(), " did not complete within ", timeout_.count(),
                " ms (CudaThreadCommOptions::timeout)");
      cuda_poll_backoff(spins);
    }
  }
  bool ready() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return (void)cudaGetLastError(), false;
    cuda_check(e, "cudaEventQuery", at());
    return true;
  }
  bool enqueue_wait(const DeviceQueue& q) override {
    if (q.device.kind != DeviceKind::cuda) return false;
    cuda_check(cudaStreamWaitEvent(static_cast<cudaStream_t>(q.handle), event_, 0), "cudaStreamWaitEvent", at());
    return true;
  }

 private:
  CallAt at() const { return {state_->where, call_}; }
  cudaEvent_t event_;
  std::shared_ptr<const CudaThreadCommState> state_;
  CollectiveCall call_;
  std::chrono::milliseconds timeout_;
};

}  // namespace detail

class CudaThreadComm : public detail::CollectiveCalls<CudaThreadComm> {
 public:
  static constexpr bool checks_tags = true;  // compared in the exchange of calls (step 2)

  // Rank inner.rank() on `device`; both outlive this communicator.
  CudaThreadComm(ThreadComm& inner, CudaDevice& device, CudaThreadCommOptions options = {})
      : CudaThreadComm(std::shared_ptr<ThreadComm>(std::shared_ptr<ThreadComm>(), &inner), device, options) {}

  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  cudaStream_t all_gather_stream() const { return state_->gather; }
  cudaStream_t reduce_stream() const { return state_->reduce; }  // every collective but all_gather

  // ThreadComm::split, on the same device (for DeviceMesh).
  CudaThreadComm split(int color, int key) {
    return CudaThreadComm(std::make_shared<ThreadComm>(inner_->split(color, key)), *device_, options_);
  }

 private:
  friend class detail::CollectiveCalls<CudaThreadComm>;

  CudaThreadComm(std::shared_ptr<ThreadComm> inner, CudaDevice& device, CudaThreadCommOptions options)
      : inner_(std::move(inner)), device_(&device), options_(options),
        state_(std::make_shared<detail::CudaThreadCommState>(
            device.index(), "CudaThreadComm rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                                " (cuda:" + std::to_string(device.index()) + ")")) {
    const std::string at = where();
    auto& s = *state_;
    detail::cuda_check(cudaSetDevice(s.device), "cudaSetDevice", at);
    for (cudaStream_t* p : {&s.gather, &s.reduce})
      detail::cuda_check(cudaStreamCreateWithFlags(p, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", at);
    for (cudaEvent_t* e : {&s.after, &s.ready, &s.done})
      detail::cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreateWithFlags", at);
  }

  const std::string& where() const { return state_->where; }

  static bool plain_host(const void* p) {
    if (!p) return false;
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return (void)cudaGetLastError(), false;
    return a.type == cudaMemoryTypeUnregistered;
  }

  Work on_host(const detail::CollectiveCall& c) {
    using K = detail::CollectiveKind;
    const CollectiveTag tag = CollectiveTag::unpack(c.tag, c.names, c.note);
    const CollectiveTag* tagged = c.tag ? &tag : nullptr;
    switch (c.kind) {
      case K::all_gather: return detail::all_gather(*inner_, c.send, c.recv, c.count, c.dtype, tagged);
      case K::reduce_scatter: return detail::reduce_scatter(*inner_, c.send, c.recv, c.count, c.dtype, c.op, tagged);
      case K::all_reduce: return detail::all_reduce(*inner_, c.send, c.recv, c.count, c.dtype, c.op, tagged);
      case K::broadcast: return inner_->broadcast(c.send, c.recv, c.count, c.dtype, c.root);
      case K::barrier: return inner_->barrier();
      case K::ring_shift: break;  // not declared (shifts_ring): never issued
    }
    detail::fail(where(), ": collective kind ", static_cast<int>(c.kind), " unknown");
  }

  Work issue(detail::CollectiveCall call) {
    using K = detail::CollectiveKind;
    const bool reads_send = call.kind != K::barrier && (call.kind != K::broadcast || rank() == call.root);
    if (call.kind != K::barrier && plain_host(call.recv) && (!reads_send || plain_host(call.send))) return on_host(call);
    call.seq = seq_++;
    const detail::CallAt at{where(), call};  // formatted only into a message
    const bool reduces = call.kind == K::reduce_scatter || call.kind == K::all_reduce;
    if (reduces && (call.op == ReduceOp::max || call.op == ReduceOp::min || (call.op == ReduceOp::avg && !is_floating(call.dtype))))
      detail::fail(at, ": on device memory only sum, and avg of floating dtypes, are supported");
    auto& st = *state_;
    detail::cuda_check(cudaSetDevice(st.device), "cudaSetDevice", at);
    cudaStream_t s = call.kind == K::all_gather ? st.gather : st.reduce;
    auto check = [&](cudaError_t e, const char* what) { detail::cuda_check(e, what, at); };
    // 1. After the compute stream's work so far; ready.
    check(cudaEventRecord(st.after, device_->stream()), "cudaEventRecord(compute stream)");
    check(cudaStreamWaitEvent(s, st.after, 0), "cudaStreamWaitEvent(compute stream)");
    check(cudaEventRecord(st.ready, s), "cudaEventRecord(ready)");
    // 2. Every rank's buffers, ready event and call.
    const int n = size();
    std::vector<std::int64_t> posts(kFields * static_cast<std::size_t>(n));
    const auto mine = post_of(call);
    inner_->all_gather(mine.data(), posts.data(), kFields, DType::i64).wait();
    auto field = [&](int r, std::size_t f) { return posts[kFields * static_cast<std::size_t>(r) + f]; };
    check_same_calls(call, posts);
    // 3. This rank's reads, once every peer's inputs are ready.
    for (int r = 0; r < n; ++r)
      if (r != rank()) check(cudaStreamWaitEvent(s, reinterpret_cast<cudaEvent_t>(field(r, 2)), 0), "cudaStreamWaitEvent(peer ready)");
    const std::size_t esize = size_of(call.dtype), bytes = call.count * esize;
    auto send_of = [&](int r, std::size_t offset_bytes) { return reinterpret_cast<const std::byte*>(field(r, 0)) + offset_bytes; };
    auto* recv = static_cast<std::byte*>(call.recv);
    auto copy = [&](void* to, const void* from, std::size_t len) {
      if (to != from && len) check(cudaMemcpyAsync(to, from, len, cudaMemcpyDefault, s), "cudaMemcpyAsync");
    };
    void* scratch = nullptr;
    if (call.kind == K::all_gather) {
      for (int r = 0; r < n; ++r) copy(recv + static_cast<std::size_t>(r) * bytes, send_of(r, 0), bytes);
    } else if (call.kind == K::broadcast) {
      copy(recv, send_of(call.root, 0), bytes);
    } else if (reduces && bytes) {
      const std::size_t offset = call.kind == K::reduce_scatter ? static_cast<std::size_t>(rank()) * bytes : 0;
      check(cudaMallocAsync(&scratch, bytes, s), "cudaMallocAsync(scratch)");
      copy(scratch, send_of(0, offset), bytes);
      for (int r = 1; r < n; ++r) device_->accumulate_on(s, scratch, send_of(r, offset), call.count, call.dtype);
      if (call.op == ReduceOp::avg) device_->scale_on(s, scratch, call.count, call.dtype, 1.0 / n);
    }
    check(cudaEventRecord(st.done, s), "cudaEventRecord(done)");
    // 4. Once no peer reads this rank's buffers any more: the result, and the Work's event.
    const std::int64_t done = handle(st.done);
    std::vector<std::int64_t> dones(static_cast<std::size_t>(n));
    inner_->all_gather(&done, dones.data(), 1, DType::i64).wait();
    for (int r = 0; r < n; ++r)
      if (r != rank()) check(cudaStreamWaitEvent(s, reinterpret_cast<cudaEvent_t>(dones[static_cast<std::size_t>(r)]), 0), "cudaStreamWaitEvent(peer done)");
    // No rank's events may go (its communicator destroyed) before every peer has enqueued
    // its waits on them: the last use of a peer's handle, so one more rendezvous.
    inner_->barrier().wait();
    if (scratch) {
      copy(recv, scratch, bytes);
      check(cudaFreeAsync(scratch, s), "cudaFreeAsync(scratch)");
    }
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t recorded = cudaEventRecord(event, s);
    if (recorded != cudaSuccess) cudaEventDestroy(event);
    check(recorded, "cudaEventRecord");
    return Work(std::make_unique<detail::CudaEventPending>(event, state_, call, options_.timeout));
  }

  // Step 2's fields per rank: send, recv, ready event, then the call (kind, count, dtype,
  // op, root, packed tag, sequence number).
  static constexpr std::size_t kFields = 10;
  std::array<std::int64_t, kFields> post_of(const detail::CollectiveCall& c) const {
    return {handle(c.send), handle(c.recv), handle(state_->ready), static_cast<std::int64_t>(c.kind),
            static_cast<std::int64_t>(c.count), static_cast<std::int64_t>(c.dtype), static_cast<std::int64_t>(c.op),
            c.root, static_cast<std::int64_t>(c.tag), static_cast<std::int64_t>(c.seq)};
  }

  // Every rank's call as it posted it (units named by this rank's names: every rank's
  // model names them alike); on any difference every rank throws the same list.
  void check_same_calls(const detail::CollectiveCall& mine, const std::vector<std::int64_t>& posts) const {
    const std::int64_t* own = posts.data() + kFields * static_cast<std::size_t>(rank());
    bool same = true;  // the usual case, without building the calls: kind, count, dtype, op, root, tag
    for (std::size_t r = 0; same && r < static_cast<std::size_t>(size()); ++r)
      same = std::equal(own + 3, own + 9, posts.data() + kFields * r + 3);
    if (same) return;
    std::vector<detail::CollectiveCall> calls(static_cast<std::size_t>(size()), mine);
    for (std::size_t r = 0; r < calls.size(); ++r) {
      const std::int64_t* p = posts.data() + kFields * r;
      calls[r].kind = static_cast<detail::CollectiveKind>(p[3]);
      calls[r].count = static_cast<std::size_t>(p[4]);
      calls[r].dtype = static_cast<DType>(p[5]);
      calls[r].op = static_cast<ReduceOp>(p[6]);
      calls[r].root = static_cast<int>(p[7]);
      calls[r].tag = static_cast<std::uint64_t>(p[8]);
      calls[r].seq = static_cast<std::uint64_t>(p[9]);
      if (r != static_cast<std::size_t>(rank())) calls[r].note = nullptr;  // a peer's note is its own
    }
    const std::string mismatch = detail::collective_mismatch(calls, static_cast<std::size_t>(rank()));
    if (!mismatch.empty()) detail::fail_as(ErrorKind::mismatch, where(), ": ", mismatch);
  }

  template <class P>
  static std::int64_t handle(P p) {
    return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(p));
  }

  std::shared_ptr<ThreadComm> inner_;
  CudaDevice* device_;
  CudaThreadCommOptions options_;
  std::shared_ptr<detail::CudaThreadCommState> state_;
  std::uint64_t seq_ = 0;
};

static_assert(Communicator<CudaThreadComm>);
static_assert(SplittableCommunicator<CudaThreadComm>);

}  // namespace fsdp
