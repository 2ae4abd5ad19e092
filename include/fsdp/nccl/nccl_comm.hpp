#pragma once
// fsdp::NcclComm: an fsdp::Communicator over NCCL (2.18+; written against 2.28), for
// buffers in GPU memory:
//
//   all_gather -> ncclAllGather       reduce_scatter -> ncclReduceScatter
//   all_reduce -> ncclAllReduce       broadcast -> ncclBroadcast
//   barrier -> a one-element ncclAllReduce      split -> ncclCommSplit (for DeviceMesh)
//
// NCCL's in-place forms are the concept's own. avg is ncclAvg (see detail::nccl_op). A
// broadcast reads only the root's `send` (it may equal `recv`, or be null elsewhere).
// All-gathers run on the communicator's all-gather stream, the other collectives on its
// reduce stream (both its own, or both NcclCommOptions::stream), after the work already
// queued on NcclCommOptions::after (the engine's compute stream), and return a Work backed
// by a CUDA event: Work::wait_on(CudaDevice::queue()) makes the compute stream wait for it
// without blocking the host, Work::wait() polls it from the host. Several issued inside
// fsdp::nccl_group are launched together. See docs/cuda.md for what runs where. A call
// with a CollectiveTag (TaggedCommunicator) adds an 8-byte all-gather of the tag in the
// same launch; a rank whose unit differs aborts the communicator on every rank.
//
// Made by from_store() (one process per GPU: rank 0 puts the unique id in the rendezvous
// store) or create() (one process driving several GPUs, one rank each). Communicators are
// nonblocking; a watchdog aborts one whose collective is not complete within
// NcclCommOptions::timeout, or that NCCL reports an error on (see nccl_state.hpp), so a
// dead or stalled peer becomes an fsdp::Error on every survivor, never a hang. A rank's
// abort_step note reaches its peers' errors through the store (nccl_notes.hpp).
//
// As with any communicator, every rank issues the same collectives in the same order, from
// one thread at a time; buffers stay untouched until the Work completes.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/nccl/nccl_group.hpp"
#include "fsdp/nccl/nccl_in_flight.hpp"
#include "fsdp/nccl/nccl_pending.hpp"
#include "fsdp/nccl/nccl_state.hpp"
#include "fsdp/nccl/nccl_types.hpp"
#include "fsdp/core/store.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

// The five collectives come from detail::CollectiveCalls, through issue() below.
class NcclComm : public detail::CollectiveCalls<NcclComm> {
 public:
  using Options = NcclCommOptions;
  // Tagged calls gather the ranks' tags beside the collective and compare them once it
  // completes (nccl_state.hpp, nccl_tag_ring.hpp).
  static constexpr bool checks_tags = true;

  // Rank `rank` of `world` processes, on GPU `device`. Rank 0 makes the unique id and sets
  // it in `store` under options.store_key; the others wait for it (options.setup_timeout).
  static NcclComm from_store(Store& store, int rank, int world, int device, Options options = {}) {
    const std::string at = detail::nccl_where(options.name, rank, world);
    if (world < 1) detail::fail(at, ": the world size must be at least 1");
    if (rank < 0 || rank >= world) detail::fail(at, ": rank is outside [0, ", world, ")");
    detail::check_nccl_options(options, at);
    check_device(device, at);
    ncclUniqueId id;
    if (rank == 0) {
      detail::nccl_check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId", at);
      store.set(options.store_key, detail::nccl_unique_id_to_hex(id));
    } else {
      id = detail::nccl_unique_id_from_hex(store.get(options.store_key, options.setup_timeout), options.store_key);
    }
    // Word of abort_step goes through a bounded client of the same store, under keys of this
    // communicator's own (nccl_notes.hpp); made before NCCL's, so nothing here can leak it.
    detail::Fingerprint id_fingerprint;  // the same 64 bits on every rank
    id_fingerprint.add_bytes(&id, sizeof id);
    char id_hash[17];
    std::snprintf(id_hash, sizeof id_hash, "%016llx", static_cast<unsigned long long>(id_fingerprint.value()));
    detail::NcclNotes notes =
        world > 1 ? detail::NcclNotes::bounded(store, options.store_key + "/abort_notes/" + id_hash) : detail::NcclNotes{};
    ncclComm_t comm = init(id, rank, world, device, options, at + " (cuda:" + std::to_string(device) + ")");
    return NcclComm(detail::NcclCommState::make(comm, rank, world, device, options.name, options, std::move(notes)));
  }

  // One communicator per entry of `devices` (distinct GPUs), rank i on devices[i], all in
  // this process. Drive them from one thread per rank, or issue theirs in an nccl_group.
  static std::vector<NcclComm> create(const std::vector<int>& devices, Options options = {}) {
    const std::string at = "NcclComm::create('" + options.name + "', " + std::to_string(devices.size()) + " GPUs)";
    if (devices.empty()) detail::fail(at, ": no devices given");
    detail::check_nccl_options(options, at);
    for (std::size_t i = 0; i < devices.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (devices[j] == devices[i])
          detail::fail(at, ": ranks ", j, " and ", i, " are both on cuda:", devices[i],
                       "; NCCL needs one GPU per rank of a communicator");
    for (int d : devices) check_device(d, at);
    const int n = static_cast<int>(devices.size());
    const detail::NcclNotes notes = n > 1 ? detail::NcclNotes::in_process() : detail::NcclNotes{};  // word of abort_step
    ncclUniqueId id;
    detail::nccl_check(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId", at);
    std::vector<ncclComm_t> comms(devices.size(), nullptr);
    std::vector<ncclResult_t> started(devices.size(), ncclSuccess);
    std::vector<ncclConfig_t> configs(devices.size(), detail::nccl_nonblocking_config(options.name.c_str()));
    std::string error;
    ErrorKind kind = ErrorKind::misuse;
    detail::CurrentDevice restore(devices[0], at);  // the loop below moves between devices
    ncclGroupStart();
    for (int i = 0; i < n; ++i) {
      if (cudaSetDevice(devices[i]) != cudaSuccess) {
        (void)cudaGetLastError();
        if (error.empty()) error = "cudaSetDevice(" + std::to_string(devices[i]) + ") failed";
        continue;
      }
      started[i] = ncclCommInitRankConfig(&comms[i], n, id, i, &configs[i]);
    }
    const ncclResult_t ended = ncclGroupEnd();
    cudaSetDevice(devices[0]);  // back where `restore` left it, so that it restores the caller's
    if (ended != ncclSuccess && ended != ncclInProgress && error.empty()) {
      error = "ncclGroupEnd failed: " + detail::nccl_error_text(ended);
      kind = detail::nccl_error_kind(ended);
    }
    const auto deadline = detail::NcclClock::now() + options.setup_timeout;
    for (int i = 0; i < n && error.empty(); ++i)
      error = settled(started[i], comms[i], deadline, options, "ncclCommInitRankConfig(rank " + std::to_string(i) + ")",
                      kind);
    if (!error.empty()) {
      for (ncclComm_t c : comms)
        if (c) ncclCommAbort(c);
      detail::fail_as(kind, at, ": ", error);
    }
    std::vector<NcclComm> out;
    for (int i = 0; i < n; ++i) {
      try {
        out.push_back(NcclComm(detail::NcclCommState::make(comms[i], i, n, devices[i], options.name, options, notes)));
      } catch (...) {
        for (int j = i + 1; j < n; ++j) ncclCommAbort(comms[j]);
        throw;
      }
    }
    return out;
  }

  NcclComm(NcclComm&&) noexcept = default;
  NcclComm& operator=(NcclComm&&) noexcept = default;

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  int device() const { return state_->device; }
  cudaStream_t all_gather_stream() const { return state_->all_gather_stream(); }
  cudaStream_t reduce_stream() const { return state_->reduce_stream(); }  // every collective but all_gather
  const std::string& name() const { return state_->name; }
  // Why a collective failed and the communicator was aborted; empty while healthy.
  std::string broken_by() const { return state_->broken_by(); }
  bool broken() const { return !broken_by().empty(); }
  // Throws that failure, as the communicator's next collective would (its kind, an echo of
  // the peer whose abort_step broke it), after `at`; nothing while healthy.
  void fail_if_broken(const std::string& at) const { state_->fail_if_broken(at); }

  // CUDA graph capture of a training step: fsdp::CapturedStep (fsdp/graph/captured_step.hpp)
  // calls these; an engine need not. Between begin_capture and end_capture the collectives
  // issued are recorded into the graph captured on `stream` (which NcclCommOptions::after,
  // or ::stream, must be), with their tags in up to `max_tagged` slots of the capture's own;
  // each replay, once queued on `stream`, is tracked as one collective (track_replay):
  // bounded by the timeout, its tags compared once it has completed. abandon_capture: the
  // capture failed, and waits for what it recorded return at once.
  void begin_capture(cudaStream_t stream, std::size_t max_tagged) { state_->begin_capture(stream, max_tagged); }
  void abandon_capture() { state_->abandon_capture(); }
  std::shared_ptr<const detail::NcclCapture> end_capture() { return state_->end_capture(); }
  Work track_replay(cudaStream_t stream, std::shared_ptr<const detail::NcclCapture> capture, std::uint64_t replay) {
    return Work(std::make_unique<detail::NcclPending>(state_, state_->track_replay(stream, std::move(capture), replay)));
  }

  // ncclCommSplit: collective over this communicator; ranks passing the same color (>= 0)
  // form a new one on the same GPU, ordered by (key, rank). Every rank first learns every
  // rank's color (an all_gather), so a bad color fails on all ranks alike.
  NcclComm split(int color, int key) {
    const std::string at = state_->where() + ": split(color " + std::to_string(color) + ", key " +
                           std::to_string(key) + ")";
    const std::vector<std::int32_t> all = gather_color_keys(color, key, at);
    for (int r = 0; r < size(); ++r)
      if (all[2 * static_cast<std::size_t>(r)] < 0)
        detail::fail(at, ": colors must be >= 0, but rank ", r, r == rank() ? " (this rank)" : "", " passed color ",
                     all[2 * static_cast<std::size_t>(r)]);
    const std::vector<int> members = detail::split_members(all, color);
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    Options child = state_->options;
    child.name = state_->name + "/split#" + std::to_string(state_->next_split()) + "(color " + std::to_string(color) + ")";
    ncclConfig_t config = detail::nccl_nonblocking_config(child.name.c_str());
    detail::NcclNotes notes =  // before NCCL's: nothing to leak
        members.size() > 1 ? state_->notes.child("/" + child.name) : detail::NcclNotes{};
    ncclComm_t comm = nullptr;
    {
      auto lk = state_->lock();
      if (!state_->broken_locked().empty())
        detail::fail_echo_if(state_->broken_echo_of_locked(), state_->broken_kind_locked(), at,
                        ": the communicator broke earlier: ", state_->broken_locked());
      detail::CurrentDevice current(device(), at);
      // A nonblocking split is a job of the parent's: NCCL writes the new communicator from
      // a thread of its own once the split is complete (null until then, even when one rank
      // splits alone), and the parent's ncclCommGetAsyncError says when. So the parent
      // settles first, and the new communicator is read after. Its slot is on the heap: when
      // the parent does not settle (a timeout, or an error while the job may still run), the
      // slot is left to NCCL, whose thread may still write it; a communicator already there
      // is aborted (one written later is not: the parent's abort ends the job).
      auto slot = std::make_unique<ncclComm_t>(nullptr);
      const ncclResult_t r = ncclCommSplit(state_->comm_locked(), color, key, slot.get(), &config);
      const auto deadline = detail::NcclClock::now() + child.setup_timeout;
      ErrorKind kind = ErrorKind::misuse;
      std::string error = settled(r, state_->comm_locked(), deadline, child, "ncclCommSplit", kind);
      comm = __atomic_load_n(slot.get(), __ATOMIC_ACQUIRE);  // NCCL's thread stores it
      if (!error.empty() && (r == ncclSuccess || r == ncclInProgress))
        (void)slot.release();  // one pointer, leaked: a late write from NCCL's job lands there
      if (error.empty() && !comm) error = "ncclCommSplit completed without a communicator";
      if (error.empty()) error = settled(ncclSuccess, comm, deadline, child, "ncclCommSplit (new communicator)", kind);
      if (!error.empty()) {
        if (comm) ncclCommAbort(comm);
        state_->fail_locked(at + ": " + error, ~std::uint64_t{0}, kind);  // the ranks are out of step now
      }
    }
    return NcclComm(detail::NcclCommState::make(comm, new_rank, static_cast<int>(members.size()), device(),
                                                child.name, child, std::move(notes)));
  }

 private:
  explicit NcclComm(std::shared_ptr<detail::NcclCommState> state) : state_(std::move(state)) {}

  static void check_device(int device, const std::string& at) {
    const int count = cuda_device_count();
    if (count == 0)
      detail::fail(at, ": cuda:", device, " requested, but no CUDA device is visible (no GPU or no driver); ",
                   "NcclComm needs one GPU per rank");
    if (device < 0 || device >= count)
      detail::fail(at, ": no such CUDA device cuda:", device, " (", count, " visible)");
  }

  // "" once `call`, which returned `r` for `comm`, has left ncclInProgress successfully
  // (by `deadline`), else what went wrong (and `kind` is set to its kind).
  static std::string settled(ncclResult_t r, ncclComm_t comm, detail::NcclClock::time_point deadline, const Options& o,
                             const std::string& call, ErrorKind& kind) {
    kind = ErrorKind::misuse;
    if (r != ncclSuccess && r != ncclInProgress) {
      kind = detail::nccl_error_kind(r);
      return call + " failed: " + detail::nccl_error_text(r);
    }
    if (!comm) return call + " returned no communicator";
    const ncclResult_t s = detail::nccl_settle(comm, deadline);
    if (s == ncclSuccess) return {};
    if (s == ncclInProgress) {
      kind = ErrorKind::timeout;
      return call + " did not complete within " + std::to_string(o.setup_timeout.count()) +
             " ms (NcclCommOptions::setup_timeout): not every rank joined";
    }
    kind = detail::nccl_error_kind(s);
    return call + " failed: " + detail::nccl_error_text(s, comm);
  }

  static ncclComm_t init(const ncclUniqueId& id, int rank, int world, int device, const Options& o,
                         const std::string& at) {
    detail::CurrentDevice current(device, at);
    ncclConfig_t config = detail::nccl_nonblocking_config(o.name.c_str());
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
    ErrorKind kind = ErrorKind::misuse;
    const std::string error =
        settled(r, comm, detail::NcclClock::now() + o.setup_timeout, o, "ncclCommInitRankConfig", kind);
    if (!error.empty()) {
      if (comm) ncclCommAbort(comm);
      detail::fail_as(kind, at, ": ", error, " (unique id from store key '", o.store_key, "')");
    }
    return comm;
  }

  friend class detail::CollectiveCalls<NcclComm>;

  // abort_step's agreement first leaves word of itself in the store (nccl_notes.hpp), before
  // its host buffer is staged (a CUDA error that failed the step may fail the staging),
  // and takes it back if NCCL never took the agreement.
  Work issue(detail::CollectiveCall call) {
    const std::optional<std::uint64_t> word = state_->post_word(call);
    if (!word) return issue_call(std::move(call));
    try {
      return issue_call(std::move(call));
    } catch (...) {
      state_->take_back_word(*word);
      throw;
    }
  }

  // One NCCL call per collective, after its buffers are checked (`count` is per rank).
  Work issue_call(detail::CollectiveCall call) {
    const std::size_t bytes = call.count * size_of(call.dtype);
    const std::size_t all = bytes * static_cast<std::size_t>(size());
    using Kind = detail::CollectiveKind;
    const std::size_t send_bytes = call.kind == Kind::reduce_scatter ? all : bytes;
    const std::size_t recv_bytes = call.kind == Kind::all_gather ? all : bytes;
    // Each buffer's memory is asked once (a barrier has none; a broadcast's non-roots may
    // pass a null send).
    const bool reads_send = call.kind != Kind::barrier && (call.kind != Kind::broadcast || rank() == call.root);
    const Memory send_memory = reads_send && send_bytes ? memory_of(call.send) : Memory::gpu;
    const Memory recv_memory = call.kind != Kind::barrier && recv_bytes ? memory_of(call.recv) : Memory::gpu;
    if (send_memory == Memory::plain_host && recv_memory == Memory::plain_host)
      return staged_on_gpu(call, send_bytes, recv_bytes);  // issues the call on GPU buffers
    call.seq = state_->next_seq();
    check_buffer(call, call.send, send_memory, "send");
    check_buffer(call, call.recv, recv_memory, "receive");
    const void* send = call.send;
    void* recv = call.recv;
    const std::size_t count = call.count;
    const ncclDataType_t type = detail::nccl_dtype(call.dtype);
    const ncclRedOp_t op = detail::nccl_op(call.op);
    switch (call.kind) {
      case Kind::all_gather:
        return start(call, "ncclAllGather",
                     [&](ncclComm_t c, cudaStream_t s) { return ncclAllGather(send, recv, count, type, c, s); });
      case Kind::reduce_scatter:
        return start(call, "ncclReduceScatter", [&](ncclComm_t c, cudaStream_t s) {
          return ncclReduceScatter(send, recv, count, type, op, c, s);
        });
      case Kind::all_reduce:
        return start(call, "ncclAllReduce",
                     [&](ncclComm_t c, cudaStream_t s) { return ncclAllReduce(send, recv, count, type, op, c, s); });
      case Kind::broadcast:
        return start(call, "ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) {
          return ncclBroadcast(send, recv, count, type, call.root, c, s);
        });
      case Kind::barrier: {
        void* scratch = state_->scratch();  // a one-element all_reduce
        return start(call, "ncclAllReduce(barrier)", [&](ncclComm_t c, cudaStream_t s) {
          return ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, c, s);
        });
      }
      case Kind::ring_shift: break;  // not declared (shifts_ring): never issued
    }
    detail::fail(state_->where(), ": collective kind ", static_cast<int>(call.kind), " is not one NCCL runs");
  }

  // Where a buffer lives, as NCCL cares: memory the GPU can address (device, managed or
  // pinned host memory), ordinary host memory, or neither (null, or CUDA does not know it).
  enum class Memory : std::uint8_t { gpu, plain_host, unusable };
  static Memory memory_of(const void* p) {
    if (!p) return Memory::unusable;
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) return (void)cudaGetLastError(), Memory::unusable;
    return a.type == cudaMemoryTypeUnregistered ? Memory::plain_host : Memory::gpu;
  }

  // NCCL reads and writes through GPU pointers: ordinary host memory would fault the
  // kernel and poison the whole CUDA context, so it is refused here (unless both buffers
  // are ordinary host memory: staged_on_gpu).
  void check_buffer(const detail::CollectiveCall& call, const void* p, Memory m, const char* which) const {
    if (m == Memory::gpu) return;
    if (!p) detail::fail(state_->where(), ": ", call.describe(), ": the ", which, " buffer is null");
    detail::fail(state_->where(), ": ", call.describe(), ": the ", which, " buffer ", p,
                 " is not GPU or pinned host memory (NCCL needs memory the GPU can address)");
  }

  // The library's own agreements (setup hashes, the order checks, run-time settings) pass a
  // few bytes of ordinary host memory, which NCCL cannot address. When both buffers are
  // ordinary host memory the call is staged through a GPU buffer and completed before it
  // returns: a host wait, off the hot path. Large or overlapping host buffers, and a mix of
  // host and GPU buffers, are refused (fsdp::StagedCommunicator stages those).
  static constexpr std::size_t host_staging_limit = std::size_t{1} << 20;
  Work staged_on_gpu(detail::CollectiveCall call, std::size_t send_bytes, std::size_t recv_bytes) {
    const std::string at = state_->where();
    const auto* send = static_cast<const std::byte*>(call.send);
    auto* recv = static_cast<std::byte*>(call.recv);
    if (send_bytes + recv_bytes > host_staging_limit)
      detail::fail(at, ": ", call.describe(), ": ", send_bytes + recv_bytes, " B of ordinary host memory; NCCL needs "
                   "memory the GPU can address (small host buffers are staged; stage large ones with fsdp::StagedCommunicator)");
    // In place (one buffer inside the other, as NCCL allows) stages the outer one only.
    const bool send_in_recv = send >= recv && send + send_bytes <= recv + recv_bytes;
    const bool recv_in_send = recv >= send && recv + recv_bytes <= send + send_bytes;
    if (!send_in_recv && !recv_in_send && send < recv + recv_bytes && recv < send + send_bytes)
      detail::fail(at, ": ", call.describe(), ": partly overlapping buffers in ordinary host memory are not staged");
    const bool one_buffer = send_in_recv || recv_in_send;
    detail::CurrentDevice current(device(), at);
    void* buffer = nullptr;
    detail::cuda_check(cudaMalloc(&buffer, one_buffer ? std::max(send_bytes, recv_bytes) : send_bytes + recv_bytes),
                       "cudaMalloc(host staging)", at);
    struct Free {
      void* p;
      ~Free() { cudaFree(p); }
    } free_buffer{buffer};
    auto* gpu = static_cast<std::byte*>(buffer);
    auto to_gpu = [&](const void* host, std::size_t n) {
      detail::cuda_check(cudaMemcpy(gpu, host, n, cudaMemcpyHostToDevice), "cudaMemcpy(host staging)", at);
    };
    std::byte* gpu_recv = nullptr;
    if (send_in_recv) to_gpu(recv, recv_bytes), gpu_recv = gpu, call.send = gpu + (send - recv);
    else if (recv_in_send) to_gpu(send, send_bytes), call.send = gpu, gpu_recv = gpu + (recv - send);
    else to_gpu(send, send_bytes), call.send = gpu, gpu_recv = gpu + send_bytes;
    call.recv = gpu_recv;
    issue_call(call).wait();
    detail::cuda_check(cudaMemcpy(recv, gpu_recv, recv_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy(host staging)", at);
    return Work{};
  }

  template <class Enqueue>
  Work start(const detail::CollectiveCall& call, const char* nccl_function, Enqueue&& enqueue) {
    auto f = state_->issue(call, nccl_function, std::forward<Enqueue>(enqueue));
    return Work(std::make_unique<detail::NcclPending>(state_, std::move(f)));
  }

  // Every rank's (color, key), in rank order, through an all_gather on the GPU.
  std::vector<std::int32_t> gather_color_keys(int color, int key, const std::string& at) {
    const std::size_t n = 2 * static_cast<std::size_t>(size());
    detail::CurrentDevice current(device(), at);
    void* buffer = nullptr;
    detail::cuda_check(cudaMalloc(&buffer, n * sizeof(std::int32_t)), "cudaMalloc(split colors)", at);
    struct Free {
      void* p;
      ~Free() { cudaFree(p); }
    } free_buffer{buffer};
    const std::array<std::int32_t, 2> mine{color, key};
    auto* mine_on_gpu = static_cast<std::int32_t*>(buffer) + 2 * static_cast<std::size_t>(rank());
    detail::cuda_check(cudaMemcpy(mine_on_gpu, mine.data(), sizeof mine, cudaMemcpyHostToDevice), "cudaMemcpy", at);
    all_gather(mine_on_gpu, buffer, 2, DType::i32).wait();
    std::vector<std::int32_t> all(n);
    detail::cuda_check(cudaMemcpy(all.data(), buffer, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost), "cudaMemcpy",
                       at);
    return all;
  }

  std::shared_ptr<detail::NcclCommState> state_;
};

static_assert(Communicator<NcclComm>);
static_assert(SplittableCommunicator<NcclComm>);

}  // namespace fsdp
