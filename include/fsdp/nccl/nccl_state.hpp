#pragma once
// The state behind an fsdp::NcclComm, shared with the Work its collectives return (so the
// communicator outlives them), and its watchdog.
//
// Every collective is enqueued on one of the communicator's two streams (nccl_streams.hpp:
// all-gathers on the all-gather stream, the others on the reduce stream, as FSDP splits
// them) and followed there by a CUDA event. Its Work either makes another stream wait for that event
// (Work::wait_on: cudaStreamWaitEvent, the engine's compute stream, no host block) or
// polls it (cudaEventQuery, Work::wait), never blocking inside CUDA or NCCL. The
// communicator is nonblocking, so no NCCL call blocks either. A thread per communicator,
// the watchdog, looks at the oldest collective in flight every watchdog_interval: when NCCL
// reports an asynchronous error, or the collective is not complete `timeout` after it was
// issued, it aborts the communicator (ncclCommAbort, on a thread of its own since it may
// wait for the device; it also ends the kernels waiting on a peer, so streams drain) and
// records why. From then on every wait() and every new call
// throws an fsdp::Error with that reason, naming the collective, its sequence number and
// the rank. Waiters check the same conditions themselves, so a wait is bounded even when
// the watchdog is late.
//
// A tagged collective (the library's all-gathers and reductions of a unit) is launched in
// one NCCL group with an 8-byte all-gather of its CollectiveTag (nccl_tag_ring.hpp). It
// counts as complete only once its event has completed and every rank's tag equals this
// rank's; otherwise the communicator is aborted with every rank's unit named, by the
// watchdog as it retires the collective (all-gathers are waited for on the GPU only) or by
// a host wait, which first retires every collective before it. Every rank gathers the same
// tags, so every rank finds the same mismatch. A communicator of one rank has nothing to
// compare and gathers no tags. A tagged call waits on the host only when the tag slot it
// needs is still used by a collective issued NcclTagRing::kSlots tagged collectives earlier.
//
// A rank that calls abort_step leaves word in the communicator's store (which rank, in
// which place among the collectives enqueued, and its note: the exception that left its
// step) before issuing the agreement. A peer whose collective in that place mismatched
// (the tags), or stays in flight (a collective of another shape, which NCCL never
// completes: the watchdog looks for word at ages 1, 2, 4 and 8 s, then every 8 s,
// outside the lock) or timed out, fails naming that rank and quoting its note, as an
// echo of it (detail::EchoedError), and leaves word that it left, which ends the aborting
// rank's agreement too. See nccl_notes.hpp.
//
// One mutex guards the ncclComm_t: the watchdog may abort (and so free) it at any time.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/collective_mismatch.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/nccl/nccl_abort.hpp"
#include "fsdp/nccl/nccl_in_flight.hpp"
#include "fsdp/nccl/nccl_notes.hpp"
#include "fsdp/nccl/nccl_streams.hpp"
#include "fsdp/nccl/nccl_tag_ring.hpp"
#include "fsdp/nccl/nccl_types.hpp"

namespace fsdp::detail {

// Tests only: communicators created while set gather tags on one rank too, so the ring of
// tag slots is exercised on a machine with one GPU.
inline std::atomic<bool> nccl_tags_on_one_rank{false};

class NcclCommState : public std::enable_shared_from_this<NcclCommState> {
 public:
  // Takes `comm` (initialized, this rank's): on failure here it is aborted.
  static std::shared_ptr<NcclCommState> make(ncclComm_t comm, int rank, int size, int device, std::string name,
                                             NcclCommOptions options, NcclNotes notes = {}) {
    std::shared_ptr<NcclCommState> s(
        new NcclCommState(comm, rank, size, device, std::move(name), std::move(options), std::move(notes)));
    try {
      s->start();
    } catch (...) {
      std::lock_guard lk(s->mu_);
      s->abort_locked("creating the communicator failed", ~std::uint64_t{0}, ErrorKind::misuse);
      throw;
    }
    return s;
  }

  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;

  ~NcclCommState() {  // errors cannot be reported from here
    {
      std::lock_guard lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    bool drained = aborter_.finish(options.setup_timeout);  // bounded: never hangs on a device that does not drain
    int prev = -1;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    cudaSetDevice(device);
    if (!aborted_) {  // a clean end flushes what was issued; bounded, then aborted (bounded too)
      ncclResult_t r = ncclCommFinalize(comm_);
      if (r == ncclSuccess || r == ncclInProgress) r = nccl_settle(comm_, NcclClock::now() + options.setup_timeout);
      if (r == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        aborter_.start(comm_, device);
        drained = aborter_.finish(options.setup_timeout);
      }
    }
    in_flight_.clear();
    tags_.release(drained);  // after the finalize or abort: no kernel writes the slots any more
    streams_.release(drained);
    if (have_prev && prev != device) cudaSetDevice(prev);
    (void)cudaGetLastError();
  }

  const int rank;
  const int size;
  const int device;
  const std::string name;
  const NcclCommOptions options;
  const NcclNotes notes;  // where abort_step's notes travel (nccl_notes.hpp)

  // Given NcclCommOptions::stream, both are that stream.
  cudaStream_t all_gather_stream() const { return streams_.gather(); }
  cudaStream_t reduce_stream() const { return streams_.reduce(); }
  void* scratch() const { return streams_.scratch(); }  // 16 zeroed device bytes, for barrier()
  std::uint64_t next_split() { return splits_++; }

  // "NcclComm 'world' rank 1 of 4 (cuda:1)".
  const std::string& where() const { return where_; }

  std::string broken_by() const {
    std::lock_guard lk(mu_);
    return broken_;
  }

  // Throws what a collective issued now would: the failure that broke the communicator,
  // with its kind (an echo where it echoes a peer's abort_step), after `at`; nothing while
  // healthy.
  void fail_if_broken(const std::string& at) const {
    std::lock_guard lk(mu_);
    if (!broken_.empty()) fail_echo_if(broken_echo_of_, broken_kind_, at, ": the communicator broke earlier: ", broken_);
  }

  // The next collective's number (taken before checking its arguments, so that messages
  // about a refused call name it too).
  std::uint64_t next_seq() {
    std::lock_guard lk(mu_);
    return seq_++;
  }

  // Runs `enqueue(comm, stream)` (one NCCL call, returning its result) for `call` (numbered
  // by next_seq), and follows it with an event (or leaves that to the enclosing nccl_group).
  template <class Enqueue>
  std::shared_ptr<NcclInFlight> issue(CollectiveCall call, const char* nccl_function, Enqueue&& enqueue) {
    std::lock_guard lk(mu_);
    if (!broken_.empty())
      fail_echo_if(broken_echo_of_, broken_kind_, where(), ": ", call.describe(),
                   " not started: the communicator broke earlier: ", broken_);
    const CallAt at{where_, call};  // streamed into a message only on failure
    CurrentDevice current(device, at);
    auto f = std::make_shared<NcclInFlight>();
    f->call = call;
    f->stream = streams_.for_kind(call.kind);
    f->event = streams_.take_event(at);
    streams_.order_after_engine(f->stream, at);  // what the engine queued before is ready first
    if (nccl_active_group) {  // before enqueuing: a failure below must not abort inside the open group
      nccl_active_group->issued.push_back({shared_from_this(), f});
      ++grouped_;
    }
    std::uint64_t* captured_tag = nullptr;  // its tag's slot in the capture under way
    if (capture_) {
      f->captured = true;
      f->captured_by = capture_;
      ++capture_->collectives;
      if (call.tag && gathers_tags_) captured_tag = claim_capture_slot_locked(call, at);
    } else if (call.tag && gathers_tags_) {
      claim_tag_slot_locked(f, at);
    }
    f->issued = NcclClock::now();
    ncclResult_t r = captured_tag ? NcclTagRing::enqueue_with_gathered_tag(captured_tag, static_cast<std::size_t>(rank),
                                                                           enqueue, comm_, f->stream)
                     : f->tag_slot >= 0 ? tags_.enqueue_with_tag(static_cast<std::size_t>(f->tag_slot), enqueue, comm_, f->stream)
                                        : enqueue(comm_, f->stream);
    if (r == ncclInProgress) r = nccl_settle(comm_, f->issued + options.timeout);
    if (r == ncclInProgress)
      fail_locked(at.text() + " was not enqueued within " + std::to_string(options.timeout.count()) + " ms by " +
                      nccl_function + " (NcclCommOptions::timeout)",
                  call.seq, ErrorKind::timeout);
    if (r != ncclSuccess)
      fail_locked(at.text() + " failed in " + nccl_function + ": " + nccl_error_text(r, comm_), call.seq,
                  nccl_error_kind(r));
    f->launch = launched_++;
    if (!f->captured) in_flight_.push_back(f);  // a captured one: its replays are tracked instead
    if (!nccl_active_group) record_locked(*f);
    return f;
  }

  // abort_step's agreement `call`, about to be issued (before its host buffer is staged):
  // its word goes to the store first (not under the lock: a store request), in the place
  // it will take, so that a peer that finds the mismatch, or waits in that place, finds it
  // there. Returns that place, or none (no word: not an agreement, no store, or broken).
  std::optional<std::uint64_t> post_word(const CollectiveCall& call) {
    if (!gathers_tags_ || !notes || !aborts(call)) return std::nullopt;
    std::uint64_t place = 0;
    {
      std::lock_guard lk(mu_);
      if (!broken_.empty()) return std::nullopt;
      place = launched_;
    }
    notes.post(place, rank, call.note);
    return place;
  }
  // The agreement whose word is in `place` failed before NCCL took it: the word goes.
  void take_back_word(std::uint64_t place) {
    {
      std::lock_guard lk(mu_);
      if (launched_ > place) return;  // enqueued: the word stands
    }
    notes.take_back(place);
  }

  // CUDA graph capture (fsdp/graph/captured_step.hpp). Between begin_capture and
  // end_capture the collectives issued are recorded into the graph being captured on
  // `stream` (the communicator's streams join the capture through NcclCommOptions::after,
  // which must be that stream), and none is tracked here: the watchdog would query events
  // that mark points of a graph. A tagged one gathers its tag into a slot of the capture's
  // own, `capacity` of them, allocated here, before the stream captures (allocating pinned
  // memory during a capture is prohibited). Each replay is then tracked as one collective
  // (track_replay): the watchdog bounds it by NcclCommOptions::timeout, and once it has
  // completed every captured tag is compared, as the collectives' own would have been.
  void begin_capture(cudaStream_t stream, std::size_t capacity) {
    std::lock_guard lk(mu_);
    if (!broken_.empty())
      fail_echo_if(broken_echo_of_, broken_kind_, where(),
                   ": a capture cannot begin: the communicator broke earlier: ", broken_);
    if (capture_) fail(where(), ": a capture is under way on it already (one at a time)");
    if (!streams_.ordered_after(stream))
      fail(where(), ": its collectives would not join a capture of stream ", static_cast<const void*>(stream),
           ": set NcclCommOptions::after (or ::stream) to the stream the step is captured on");
    auto c = std::make_shared<NcclCapture>();
    c->ranks = static_cast<std::size_t>(size);
    c->rank = static_cast<std::size_t>(rank);
    c->capacity = gathers_tags_ ? capacity : 0;
    c->first_seq = seq_;
    if (c->capacity) {
      CurrentDevice current(device, where_);
      const std::size_t bytes = c->capacity * c->ranks * sizeof(std::uint64_t);
      void* host = nullptr;
      cuda_check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                 "cudaHostAlloc(captured tag slots)", where_);
      c->host = static_cast<std::uint64_t*>(host);
      std::memset(c->host, 0, bytes);
      void* dev = nullptr;
      cuda_check(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer(captured tag slots)", where_);
      c->device = static_cast<std::uint64_t*>(dev);
    }
    capture_ = std::move(c);
  }
  // The capture under way failed: the collectives it recorded will never run, and waits
  // for them return at once (so a failed step's cleanup, inside the capture, can free).
  void abandon_capture() {
    std::lock_guard lk(mu_);
    if (capture_) capture_->abandoned = true;
  }
  std::shared_ptr<const NcclCapture> end_capture() {
    std::lock_guard lk(mu_);
    if (capture_) capture_->last_seq = seq_;
    return std::exchange(capture_, nullptr);
  }
  // The `replay`th launch of `c`'s graph, just queued on `stream`: tracked as one
  // collective, whose event follows the graph there.
  std::shared_ptr<NcclInFlight> track_replay(cudaStream_t stream, std::shared_ptr<const NcclCapture> c, std::uint64_t replay) {
    std::lock_guard lk(mu_);
    auto f = std::make_shared<NcclInFlight>();
    f->call.seq = seq_++;
    const std::string first = "#" + std::to_string(c->first_seq), last = "#" + std::to_string(c->last_seq - 1);
    f->label = "replay " + std::to_string(replay) + " of a captured step (" +
               (c->collectives == 0   ? std::string("no collective")
                : c->collectives == 1 ? "1 collective, " + first + " when captured"
                                      : std::to_string(c->collectives) + " collectives, " + first + " to " + last +
                                            " when captured") +
               ") as collective #" + std::to_string(f->call.seq);
    if (!broken_.empty())
      fail_echo_if(broken_echo_of_, broken_kind_, where(), ": ", f->describe(),
                   " not tracked: the communicator broke earlier: ", broken_);
    CurrentDevice current(device, where_);
    f->stream = stream;
    f->event = streams_.take_event(where_);
    f->replay_of = std::move(c);
    f->issued = NcclClock::now();
    cuda_check(cudaEventRecord(f->event, stream), "cudaEventRecord(after a replay)", where_);
    f->recorded = true;
    in_flight_.push_back(f);
    return f;
  }

  // True once `f` has completed; throws when it failed, timed out, or the communicator broke.
  bool poll(NcclInFlight& f) {
    std::vector<std::shared_ptr<const NcclCapture>> release;  // destroyed after the lock is released
    std::lock_guard lk(mu_);
    ReleaseOutside outside{release, released_};
    if (f.captured) {
      if (f.captured_by->abandoned) return true;  // never runs: nothing to wait for
      fail(where(), ": wait() on ", f.describe(), ", which was captured into a CUDA graph: it runs at each replay of ",
           "the graph, and what is waited for is the replay (fsdp::CapturedStep::wait)");
    }
    // Retired: it and every collective before it were compared. Complete but not retired
    // (a tag slot's reuse found it so) and broken since: no NCCL call on an aborted comm.
    if (f.retired || (f.complete && !broken_.empty())) return true;
    if (!f.complete) {
      check_waitable_locked(f, "wait() on ");
      const std::string reason = inspect_locked(f);
      if (!reason.empty()) fail_locked(reason, f.call.seq, reason_kind_, reason_echo_of_);
      if (!f.complete) return false;
    }
    // A host wait is also the check of collectives waited for on the GPU before it.
    const ncclResult_t state = nccl_async_state(comm_);
    if (state != ncclSuccess && state != ncclInProgress)
      fail_locked(where() + ": " + f.describe() +
                      " completed, but NCCL reported an asynchronous error: " + nccl_error_text(state, comm_),
                  f.call.seq, nccl_error_kind(state));
    // Those before it have completed too (in order): their tags are compared now, not at
    // the watchdog's next look, so no host wait passes a mismatch. Up to `f` only: a later
    // collective's state is not this wait's.
    std::uint64_t seq = 0;
    const std::string earlier = retire_locked(seq, &f);
    if (!earlier.empty()) fail_locked(earlier, seq, reason_kind_, reason_echo_of_);
    return true;
  }

  // True while `f` waits for its nccl_group to end (and the communicator is healthy).
  bool unlaunched(const NcclInFlight& f) const {
    std::lock_guard lk(mu_);
    return broken_.empty() && !f.recorded && grouped_ > 0;
  }

  // Makes `stream` wait (on the GPU) for `f`, unless it has completed; throws like poll()
  // when the communicator broke or `f` is inside an nccl_group that has not ended. The
  // wait takes the event's record of this moment: reusing the event later cannot move it.
  void enqueue_wait(NcclInFlight& f, cudaStream_t stream) {
    std::lock_guard lk(mu_);
    if (f.complete || (f.captured && f.captured_by->abandoned)) return;
    check_waitable_locked(f, "a stream was made to wait for ");
    cuda_check(cudaStreamWaitEvent(stream, f.event, 0), "cudaStreamWaitEvent", CallAt{where_, f.call});
  }

  // For nccl_group: the lock, and what the group's end does under it.
  std::unique_lock<std::mutex> lock() { return std::unique_lock(mu_); }
  const std::string& broken_locked() const { return broken_; }
  ErrorKind broken_kind_locked() const { return broken_kind_; }
  int broken_echo_of_locked() const { return broken_echo_of_; }
  ncclComm_t comm_locked() const { return comm_; }
  void record_locked(NcclInFlight& f) {
    const CallAt at{where_, f.call};
    CurrentDevice current(device, at);
    cuda_check(cudaEventRecord(f.event, f.stream), "cudaEventRecord", at);
    f.recorded = true;
  }
  // Records why the communicator broke (the first reason wins) and aborts it, unless an
  // nccl_group that issued on it is still open: NCCL has not launched that group yet, so its
  // end aborts instead (group_ended_locked).
  // `kind`: what every error quoting `reason` throws; `echo_of`: the rank whose abort_step
  // it follows (those errors are echoes of it), or -1.
  void abort_locked(const std::string& reason, std::uint64_t seq, ErrorKind kind, int echo_of = -1) {
    if (broken_.empty()) {
      broken_ = reason + "; the communicator is aborted (ncclCommAbort)";
      broken_seq_ = seq;
      broken_kind_ = kind;
      broken_echo_of_ = echo_of;
    }
    if (aborted_ || grouped_ > 0) return;
    aborter_.start(comm_, device);  // returns at once: the abort may wait for the device (nccl_abort.hpp)
    aborted_ = true;
  }
  // The group that issued `n` collectives here has ended (ncclGroupEnd returned).
  void group_ended_locked(std::size_t n) {
    grouped_ -= n;
    if (grouped_ == 0 && !broken_.empty() && !aborted_)
      abort_locked(broken_, broken_seq_, broken_kind_, broken_echo_of_);
  }

  [[noreturn]] void fail_locked(const std::string& reason, std::uint64_t seq, ErrorKind kind, int echo_of = -1) {
    abort_locked(reason, seq, kind, echo_of);
    fail_echo_if(broken_echo_of_, broken_kind_, broken_);
  }

 private:
  NcclCommState(ncclComm_t comm, int rank, int size, int device, std::string name, NcclCommOptions options,
                NcclNotes notes)
      : rank(rank),
        size(size),
        device(device),
        name(std::move(name)),
        options(std::move(options)),
        notes(std::move(notes)),
        where_(nccl_where(this->name, rank, size) + " (cuda:" + std::to_string(device) + ")"),
        comm_(comm) {}

  // Throws when `f`, not complete, can never be waited for: the communicator broke, or its
  // nccl_group has not ended (`what`: "wait() on ", ...).
  void check_waitable_locked(const NcclInFlight& f, const char* what) const {
    if (!broken_.empty()) {
      if (broken_seq_ == f.call.seq) fail_echo_if(broken_echo_of_, broken_kind_, broken_);
      fail_echo_if(broken_echo_of_, broken_kind_, where(), ": ", f.describe(), " did not complete: ", broken_);
    }
    if (!f.recorded)
      fail(where(), ": ", what, f.describe(),
           " inside an nccl_group: NCCL launches the group's collectives when it ends; wait after it");
  }

  void start() {
    const std::string at = where();
    CurrentDevice current(device, at);
    int nccl_rank = -1, nccl_size = -1;
    nccl_check(ncclCommUserRank(comm_, &nccl_rank), comm_, "ncclCommUserRank", at);
    nccl_check(ncclCommCount(comm_, &nccl_size), comm_, "ncclCommCount", at);
    if (nccl_rank != rank || nccl_size != size)
      fail(at, ": NCCL made rank ", nccl_rank, " of ", nccl_size, " instead");
    streams_.create(options, at);  // on a failure, the destructor frees what was made
    if (gathers_tags_) tags_.allocate(rank, size, at);
    watchdog_ = std::thread([this] { watch(); });
  }

  // Why the communicator must be aborted while `f` is in flight, or "" (f.complete says
  // whether it has finished), with its kind in reason_kind_ and, where it follows a peer's
  // abort_step, that rank in reason_echo_of_. A tagged collective whose ranks' tags differ
  // never completes.
  std::string inspect_locked(NcclInFlight& f) {
    reason_echo_of_ = -1;
    const cudaError_t q = cudaEventQuery(f.event);
    if (q == cudaSuccess) {
      std::string mismatch = tag_mismatch_locked(f);
      f.complete = mismatch.empty();
      reason_kind_ = ErrorKind::mismatch;
      return mismatch;
    }
    if (q == cudaErrorCapturedEvent) {  // issued while its stream was captured, by an engine that did not say so
      (void)cudaGetLastError();
      reason_kind_ = ErrorKind::misuse;
      return where() + ": " + f.describe() + " was issued while the stream it follows (NcclCommOptions::after) was " +
             "being captured into a CUDA graph, but this communicator was not told (pass it to fsdp::CapturedStep): " +
             "its event marks a point of the graph, which cannot be waited for here";
    }
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      reason_kind_ = cuda_error_kind(q);
      return where() + ": " + f.describe() + " failed: cudaEventQuery: " + cudaGetErrorString(q) + " (" +
             cudaGetErrorName(q) + ")";
    }
    const ncclResult_t state = nccl_async_state(comm_);
    if (state != ncclSuccess && state != ncclInProgress) {
      reason_kind_ = nccl_error_kind(state);
      return where() + ": " + f.describe() + " failed: NCCL reported an asynchronous error: " +
             nccl_error_text(state, comm_);
    }
    const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(NcclClock::now() - f.issued);
    if (age > options.timeout && broken_.empty() && !f.replay_of)  // a peer's word says why, if it left any
      if (std::string why = aborted_by_word_locked(f, notes.fetch(f.launch, false)); !why.empty()) {
        notes.leave(f.launch, rank, f.describe(), false);  // the aborting rank's agreement ends too
        return why;
      }
    reason_kind_ = ErrorKind::timeout;
    if (age > options.timeout)
      return where() + ": " + f.describe() + " did not complete within " +
             std::to_string(options.timeout.count()) + " ms of being issued (NcclCommOptions::timeout): a peer is " +
             "dead, stalled, or issued a different collective; NCCL async state: " + nccl_error_text(state, comm_);
    return {};
  }

  // "" when every rank gathered `f`'s tag (or it is untagged), else the mismatch; where a
  // peer called abort_step, with its note (from the store: one bounded request, on this
  // failure path only) and that rank in reason_echo_of_.
  std::string tag_mismatch_locked(const NcclInFlight& f) {
    if (f.replay_of) {  // every captured collective's tag, as gathered by this replay
      const NcclCapture& c = *f.replay_of;
      for (std::size_t i = 0; i < c.tagged.size(); ++i) {
        std::string m = quoted_mismatch(c.tagged[i], {c.host + i * c.ranks, c.ranks});
        if (!m.empty()) return where() + ": in " + f.describe() + ": " + m;
      }
      return {};
    }
    if (f.tag_slot < 0) return {};
    std::string m = quoted_mismatch(f.call, tags_.gathered(static_cast<std::size_t>(f.tag_slot)), f.launch);
    return m.empty() ? m : where() + ": " + m;
  }
  // `place`: the collective's place on every rank (none for a replay's captured ones). The
  // word was left before the agreement was issued, so it is there if the store took it;
  // one bounded store request under the lock, once per communicator (a failure path: it
  // is aborted next).
  std::string quoted_mismatch(const CollectiveCall& mine, std::span<const std::uint64_t> tags,
                              std::optional<std::uint64_t> place = std::nullopt) {
    const auto self = static_cast<std::size_t>(rank);
    std::string m = tag_mismatch(mine, tags, self);
    if (m.empty()) return m;
    const int root = abort_root(tags, self);
    if (root < 0) return m;
    reason_echo_of_ = root;
    if (!place || !broken_.empty()) return m;
    auto word = notes.fetch(*place, false);
    return word && word->rank == root && word->text ? tag_mismatch(mine, tags, self, root, std::move(word->text)) : m;
  }

  static bool aborts(const CollectiveCall& call) {
    return call.tag && CollectiveTag::unpack(call.tag).phase == TagPhase::abort_step;
  }
  // Why `f` cannot complete, where a peer left word that it issued abort_step's agreement
  // as `f`'s collective (sets reason_kind_ and reason_echo_of_); "" where that is not so.
  std::string aborted_by_word_locked(const NcclInFlight& f, const std::optional<NcclNotes::Word>& word) {
    if (!word || word->rank == rank || word->rank < 0 || word->rank >= size || aborts(f.call)) return {};
    reason_kind_ = ErrorKind::mismatch;
    reason_echo_of_ = word->rank;
    return where() + ": " + f.describe() + " cannot complete: rank " + std::to_string(word->rank) +
           " issued abort_step's agreement as this collective instead (the step was left by an exception" +
           (word->text ? ": \"" + *word->text + "\"" : std::string()) +
           "), and NCCL does not complete collectives that differ";
  }

  // A slot of the ring for `f`'s tag, written with it: the next one, once the collective
  // that used it last has completed (polled here, bounded by the timeout, if it has not).
  // The next slot of the capture under way for `call`'s tag, written with it.
  std::uint64_t* claim_capture_slot_locked(const CollectiveCall& call, const CallAt& at) {
    NcclCapture& c = *capture_;
    if (c.tagged.size() == c.capacity)
      fail(at.text(), ": more than ", c.capacity, " tagged collectives in one captured step ",
           "(CaptureOptions::max_tagged_collectives)");
    std::uint64_t* slot = c.host + c.tagged.size() * c.ranks;
    slot[c.rank] = call.tag;
    c.tagged.push_back(call);
    return c.device + (c.tagged.size() - 1) * c.ranks;
  }

  void claim_tag_slot_locked(const std::shared_ptr<NcclInFlight>& f, const CallAt& at) {
    const std::size_t slot = tags_.next();
    std::shared_ptr<NcclInFlight>& last = tags_.last_user(slot);
    if (last && !last->complete && !last->recorded)  // waiting here would never end
      fail_locked(at.text() + ": its tag slot is still used by " + last->call.describe() +
                      ", inside an nccl_group that has not ended (at most " + std::to_string(NcclTagRing::kSlots) +
                      " tagged collectives may be in flight)",
                  f->call.seq, ErrorKind::misuse);
    for (int spins = 0; last && !last->complete; ++spins) {
      const std::string reason = inspect_locked(*last);
      if (!reason.empty()) fail_locked(reason, last->call.seq, reason_kind_, reason_echo_of_);
      if (!last->complete) cuda_poll_backoff(spins);
    }
    tags_.set_mine(slot, f->call.tag);
    f->tag_slot = static_cast<int>(slot);
    last = f;
  }

  // Retires the completed collectives at the front of in_flight_. NCCL runs one
  // communicator's kernels in the order they were issued, whatever their streams, so they
  // finish in order; a later one is looked at once those before it are done. Returns why
  // the communicator must be aborted, or "" (`seq`: the collective concerned). Stops once
  // `upto` (when given) is retired.
  std::string retire_locked(std::uint64_t& seq, const NcclInFlight* upto = nullptr) {
    while (!in_flight_.empty() && in_flight_.front()->recorded) {
      NcclInFlight& f = *in_flight_.front();
      std::string reason = f.complete ? std::string() : inspect_locked(f);
      if (!reason.empty()) {
        seq = f.call.seq;
        return reason;
      }
      if (!f.complete) break;
      streams_.give_back(std::exchange(f.event, nullptr));  // poll() and enqueue_wait() read `complete` only now
      if (f.replay_of) released_.push_back(std::move(f.replay_of));  // freed outside the lock (release_outside)
      f.retired = true;
      const bool reached = &f == upto;
      in_flight_.pop_front();  // may free `f`
      if (reached) break;
    }
    return {};
  }

  // The place of the oldest collective in flight when it is time to look for word about it
  // (nccl_notes.hpp): at ages 1, 2, 4 and 8 s, then every 8 s, so a collective that
  // completes within a second costs nothing and a stuck one is found within seconds.
  std::optional<std::uint64_t> word_due_locked() {
    if (!notes || !broken_.empty() || in_flight_.empty()) return std::nullopt;
    const NcclInFlight& f = *in_flight_.front();
    if (!f.recorded || f.complete || f.replay_of) return std::nullopt;
    const auto age = NcclClock::now() - f.issued;
    if (f.launch != word_place_) {
      word_place_ = f.launch;
      word_next_ = std::chrono::seconds(1);
    }
    if (age < word_next_) return std::nullopt;
    word_next_ = age < std::chrono::seconds(8) ? word_next_ * 2 : age + std::chrono::seconds(8);
    return f.launch;
  }

  // The watchdog's look at `place`, the oldest collective in flight (word_due_locked), with
  // `lk` released for the store requests: a peer's word that it aborted there fails this
  // rank's collective as an echo (and says this rank left it); for this rank's own
  // agreement, word that a peer left ends it at once, on this rank's own account.
  void look_for_word(std::unique_lock<std::mutex>& lk, std::uint64_t place) {
    const bool own_agreement = aborts(in_flight_.front()->call);
    const std::string what = in_flight_.front()->describe();
    lk.unlock();
    std::optional<NcclNotes::Word> word = own_agreement ? notes.left(place, true) : notes.fetch(place, true);
    const bool blames = word && !own_agreement && word->rank != rank && word->rank >= 0 && word->rank < size;
    if (blames) notes.leave(place, rank, what, true);  // before the lock: the aborting rank stops waiting
    lk.lock();
    if (!word || !broken_.empty() || in_flight_.empty() || in_flight_.front()->launch != place ||
        in_flight_.front()->complete)
      return;
    const NcclInFlight& f = *in_flight_.front();
    if (own_agreement) {
      if (word->rank == rank || word->rank < 0 || word->rank >= size) return;
      const std::string left = word->text ? *word->text : std::string("its collective");
      abort_locked("watchdog: " + where() + ": " + f.describe() + " cannot complete: rank " +
                       std::to_string(word->rank) + " left " + left +
                       " in its place, which NCCL does not complete against this one",
                   f.call.seq, ErrorKind::mismatch);
      return;
    }
    if (std::string why = aborted_by_word_locked(f, word); !why.empty())
      abort_locked("watchdog: " + why, f.call.seq, reason_kind_, reason_echo_of_);
  }

  void watch() {
    cudaSetDevice(device);
    // Its event queries are of collectives issued eagerly, never of a graph's: legal while
    // the engine's thread captures a step, which in CUDA's default (global) mode would
    // prohibit them from any thread not relaxed (and invalidate the capture).
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&relaxed);
    std::unique_lock lk(mu_);
    while (!stopping_) {
      cv_.wait_for(lk, options.watchdog_interval);
      if (aborted_) cv_.wait(lk, [this] { return stopping_; });  // nothing left to watch
      if (stopping_) break;
      std::uint64_t seq = 0;
      const std::string reason = retire_locked(seq);
      if (!reason.empty()) abort_locked("watchdog: " + reason, seq, reason_kind_, reason_echo_of_);
      if (const auto due = word_due_locked()) look_for_word(lk, *due);  // a collective long in flight
      if (!released_.empty()) {  // a captured step's tag memory: cudaFreeHost may wait for the device
        auto release = std::exchange(released_, {});
        lk.unlock();
        release.clear();
        lk.lock();
      }
      if (in_flight_.empty() && !aborted_) {  // a peer may fail between collectives
        const ncclResult_t state = nccl_async_state(comm_);
        if (state != ncclSuccess && state != ncclInProgress)
          abort_locked("watchdog: " + where() + ": NCCL reported an asynchronous error between collectives: " +
                           nccl_error_text(state, comm_),
                       ~std::uint64_t{0}, nccl_error_kind(state));
      }
    }
  }

  const std::string where_;
  mutable std::mutex mu_;
  ncclComm_t comm_;
  bool aborted_ = false;
  std::string broken_;              // why it was aborted; empty while healthy
  std::uint64_t broken_seq_ = ~std::uint64_t{0};  // the collective that broke it
  ErrorKind broken_kind_ = ErrorKind::misuse;     // what the errors quoting broken_ throw
  int broken_echo_of_ = -1;                       // the rank they echo (abort_locked), or -1
  ErrorKind reason_kind_ = ErrorKind::misuse;     // the kind of inspect_locked's last reason
  int reason_echo_of_ = -1;                       // and the rank it echoes, or -1
  std::uint64_t launched_ = 0;                     // collectives enqueued so far (NcclInFlight::launch)
  std::uint64_t word_place_ = ~std::uint64_t{0};  // word_due_locked: the collective it looks at
  NcclClock::duration word_next_{};               // and its age at the next look
  std::uint64_t seq_ = 0;
  std::uint64_t splits_ = 0;
  std::size_t grouped_ = 0;  // issued inside an nccl_group that has not ended
  std::deque<std::shared_ptr<NcclInFlight>> in_flight_;  // oldest first
  NcclStreams streams_;
  const bool gathers_tags_ = size > 1 || nccl_tags_on_one_rank;
  NcclTagRing tags_;  // allocated where gathers_tags_
  std::shared_ptr<NcclCapture> capture_;  // between begin_capture and end_capture
  // The last references to captured steps' tag memory, taken by retire_locked: released by
  // the watchdog and poll() once they no longer hold mu_ (cudaFreeHost may wait for the
  // device, which must never happen under the lock the watchdog needs).
  std::vector<std::shared_ptr<const NcclCapture>> released_;
  struct ReleaseOutside {  // moves released_ into `into` as the caller's lock goes
    std::vector<std::shared_ptr<const NcclCapture>>& into;
    std::vector<std::shared_ptr<const NcclCapture>>& from;
    ~ReleaseOutside() { into = std::exchange(from, {}); }
  };
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread watchdog_;
  NcclBackgroundAbort aborter_;
};

}  // namespace fsdp::detail
