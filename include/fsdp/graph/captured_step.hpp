#pragma once
// fsdp::CapturedStep: a training step captured once into a CUDA graph and replayed, so the
// host issues one cudaGraphLaunch per step where the hooks issue a dozen CUDA and NCCL
// calls per unit (docs/cuda.md, "Capturing a step in a CUDA graph").
//
//   // after one step run eagerly (the first iteration records the units' order and agrees
//   // on it across ranks, on the host):
//   fsdp::CapturedStep step(model, stream, {&comm}, [&] {
//     forward and backward with their hooks, the engine's kernels on `stream`;
//     model.finish_backward();
//   });
//   for (...) {
//     write the batch into the buffers the capture read (a graph keeps its addresses);
//     step.replay();   // returns at once
//     step.wait();     // the host check: an fsdp::Error if a collective failed, stalled or mismatched
//     the optimizer, on model.shards();
//   }
//
// The capture runs the body once with the model in capture mode: the hooks queue their
// work as usual, CUDA records it instead of running it, and finish_backward checks nothing
// on the host (it would wait inside the capture). Memory the hooks allocate and free in the
// step (unsharded parameters and gradients) becomes the graph's own, at the same address
// in every replay. Each NcclComm given records its collectives without tracking them
// (NcclCommState::begin_capture); each replay is then tracked as one collective per
// communicator, bounded by its timeout, with every captured collective tag compared once
// it has completed, so a rank that replays another graph is found as an eager step's
// mismatch would be. Every replay does exactly what the capture recorded: call around
// each replay what was called around the capture (zero_grad before it, say), in the same
// run-time settings. The model's gradient state on the host follows the graph: the capture
// leaves it as it was (nothing ran), each replay as the captured step left it. A replay
// that does not find it as the capture did (zero_grad skipped, say), or that comes after a
// run-time setting changed, is refused. What cannot be captured is refused when the
// capture begins, or fails it with CUDA's error: a step that waits on the host
// (OffloadParams, a ShardedGradScaler's unscale check, a host-side wait() in the body),
// gradients kept by no_sync, a communicator whose collectives do not follow the captured
// stream (NcclCommOptions::after), a model in the middle of a step or before its first one.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/work.hpp"
#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/nccl/nccl_comm.hpp"

namespace fsdp {

struct CaptureOptions {
  // CUDA's capture mode. Global (CUDA's default): a potentially unsafe CUDA call made by
  // any thread in the global mode while the step is captured (a synchronization, cudaMalloc)
  // fails and invalidates the capture; the library's own threads are relaxed.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  // Per communicator: how many tagged collectives one step may capture (each takes a
  // slot of ranks x 8 bytes of pinned memory, made before the capture).
  std::size_t max_tagged_collectives = 4096;
};

class CapturedStep {
 public:
  // Captures `body()` on `stream` (the engine's compute stream, which every communicator in
  // `comms` has as NcclCommOptions::after) and instantiates the graph. `comms`: every
  // NcclComm the model's units use; they must outlive this object. Throws fsdp::Error when
  // the step cannot be captured; when the body threw, the model is left between steps
  // (abort_step ran, its frees into the discarded capture).
  template <class Body>
  CapturedStep(ShardedModel& model, cudaStream_t stream, std::vector<NcclComm*> comms, Body&& body,
               CaptureOptions options = {})
      : model_(&model), stream_(stream), comms_(std::move(comms)) {
    const std::string why = detail::CaptureAccess::not_capturable(model);
    if (!why.empty()) detail::fail("CapturedStep: the step cannot be captured now: ", why);
    if (!stream) detail::fail("CapturedStep: capture on the engine's own stream, not the legacy default stream");
    if (comms_.empty()) detail::fail("CapturedStep: no communicator given (pass every NcclComm the model's units use)");
    for (std::size_t i = 0; i < comms_.size(); ++i)
      if (!comms_[i]) detail::fail("CapturedStep: communicator ", i, " is null");
    // What every replay must find as the capture did: each unit's gradients (zeroed, or
    // reduced into since) and the run-time settings.
    states_ = detail::CaptureAccess::step_states(model);
    config_ = model.config();
    for (std::size_t i = 0; i < states_.size(); ++i)
      if (states_[i].find('k') != std::string::npos)
        detail::fail("CapturedStep: unit '", detail::CaptureAccess::unit_name(model, i),
                     "' keeps gradients accumulated without synchronization (no_sync): a captured step would free "
                     "memory allocated before it at every replay; capture a step that begins after zero_grad or "
                     "after a synchronized step");
    for (std::size_t i = 0; i < comms_.size(); ++i) {
      try {
        comms_[i]->begin_capture(stream, options.max_tagged_collectives);
      } catch (...) {
        for (std::size_t j = 0; j < i; ++j) comms_[j]->end_capture();
        throw;
      }
    }
    cudaError_t began = cudaStreamBeginCapture(stream, options.mode);
    if (began != cudaSuccess) {
      for (NcclComm* c : comms_) c->end_capture();
      detail::cuda_check(began, "cudaStreamBeginCapture", "CapturedStep");
    }
    detail::CaptureAccess::set_capturing(model, true);
    std::exception_ptr failed;
    try {
      body();
      // A step that keeps gradients across steps (no_sync, a deferred all-reduce) would
      // leave the host holding memory of the graph's; refused, inside the capture, so the
      // cleanup below frees it there.
      states_after_ = detail::CaptureAccess::step_states(model);
      for (std::size_t i = 0; i < states_.size() && i < states_after_.size(); ++i) {
        const auto grads = [](const std::string& s) { return s.substr(s.find(' ') + 1); };
        if (grads(states_after_[i]) != grads(states_[i]))
          detail::fail("CapturedStep: unit '", detail::CaptureAccess::unit_name(model, i), "' ends the captured step ",
                       "with gradients '", grads(states_after_[i]), "' where it began with '", grads(states_[i]),
                       "' (k: a sum kept across steps, n: no sharded gradient): a step that keeps gradients for the "
                       "next one (no_sync, a deferred all-reduce) cannot be replayed");
      }
    } catch (...) {
      failed = std::current_exception();
      // The step's buffers were allocated in the capture: freed in it (or dropped with a
      // capture already invalidated), they go with it, and what it recorded is never
      // waited for. abort_step's agreement across ranks waits on the host: below.
      for (NcclComm* c : comms_) c->abandon_capture();
      detail::discarding_failed_capture = true;
      try {
        detail::CaptureAccess::abandon_step(model);
      } catch (...) {  // abort_step below tries again, and says so
      }
      detail::discarding_failed_capture = false;
    }
    detail::CaptureAccess::set_capturing(model, false);
    // Nothing ran: the gradients are as before the body; a replay leaves them as after it.
    if (!failed) detail::CaptureAccess::set_step_states(model, states_);
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph_);
    for (NcclComm* c : comms_) captures_.push_back(c->end_capture());
    if (failed) {
      release();
      (void)cudaGetLastError();
      std::string cleanup;
      try {
        model.abort_step();
      } catch (const std::exception& e) {
        cleanup = e.what();
      }
      if (cleanup.empty()) std::rethrow_exception(failed);
      try {
        std::rethrow_exception(failed);
      } catch (const std::exception& e) {
        detail::fail(e.what(), "; then abort_step failed too: ", cleanup, " (call abort_step() again before anything else)");
      }
    }
    try {
      detail::cuda_check(ended, "cudaStreamEndCapture (a call in the step that a capture prohibits?)", "CapturedStep");
      std::size_t captured = 0;
      bool alone = true;
      for (std::size_t i = 0; i < comms_.size(); ++i) {
        captured += captures_[i]->collectives;
        alone = alone && comms_[i]->size() == 1;
      }
      if (captured == 0 && !alone)
        detail::fail("CapturedStep: no collective was captured on the communicators given, although they have "
                     "peers: the model's units use another communicator (pass every NcclComm they use)");
      detail::cuda_check(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate", "CapturedStep");
    } catch (...) {
      release();
      throw;
    }
  }

  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;
  CapturedStep(CapturedStep&& o) noexcept
      : model_(o.model_),
        stream_(o.stream_),
        comms_(std::move(o.comms_)),
        captures_(std::move(o.captures_)),
        states_(std::move(o.states_)),
        states_after_(std::move(o.states_after_)),
        config_(std::move(o.config_)),
        graph_(std::exchange(o.graph_, nullptr)),
        exec_(std::exchange(o.exec_, nullptr)),
        pending_(std::move(o.pending_)),
        replays_(o.replays_) {}
  CapturedStep& operator=(CapturedStep&&) = delete;

  // A replay not waited for is waited for here, its errors dropped (bounded by each
  // communicator's timeout); then the graph goes.
  ~CapturedStep() {
    pending_.clear();
    release();
  }

  // Launches the graph on the stream it was captured on; returns at once. Refused, before
  // anything is launched, unless the model is between steps with the gradient state and
  // run-time settings it had when captured (what a replay cannot see), every communicator
  // is healthy, and the previous replay was waited for.
  void replay() {
    if (!exec_) detail::fail("CapturedStep: replay() of a moved-from step");
    if (!pending_.empty())
      detail::fail("CapturedStep: replay() before wait() of replay ", replays_,
                   " returned: each replay's collectives are checked before the next one reuses their tag slots");
    const std::uint64_t next = replays_ + 1;
    // Offloading and hooks were refused at the capture, and are in the configuration that
    // is compared below: they are not looked for again.
    const std::string why = detail::CaptureAccess::not_replayable(*model_);
    if (!why.empty()) detail::fail("CapturedStep: replay ", next, " refused: ", why);
    const std::vector<std::string> states = detail::CaptureAccess::step_states(*model_);
    for (std::size_t i = 0; i < states.size() && i < states_.size(); ++i)
      if (states[i] != states_[i])
        detail::fail("CapturedStep: replay ", next, " refused: unit '", detail::CaptureAccess::unit_name(*model_, i),
                     "' has gradients '", states[i], "' where the capture began with '", states_[i],
                     "' (a replay reduces into them as the capture did): call around each replay what was called "
                     "around the capture, zero_grad say");
    if (model_->config() != config_)
      detail::fail("CapturedStep: replay ", next, " refused: the model's run-time settings changed since the capture ",
                   "(a replay does what was captured): capture the step again");
    // A broken communicator refuses the replay with its own failure (its kind; an echo of
    // the peer whose abort_step broke it), as its next eager collective would.
    for (NcclComm* c : comms_)
      if (c->broken())  // the message built only then: a healthy replay allocates nothing here
        c->fail_if_broken("CapturedStep: replay " + std::to_string(next) + " refused: NcclComm '" + c->name() + "'");
    detail::cuda_check(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch", "CapturedStep");
    detail::CaptureAccess::set_step_states(*model_, states_after_);  // as the captured step left them
    replays_ = next;
    for (std::size_t i = 0; i < comms_.size(); ++i) pending_.push_back(comms_[i]->track_replay(stream_, captures_[i], replays_));
  }

  // The host check of the last replay: waits (bounded by each communicator's timeout) until
  // it has completed, and throws fsdp::Error when a collective in it failed, stalled or
  // gathered another unit's tag on some rank. The gradients are then ready for the optimizer.
  void wait() {
    while (!pending_.empty()) {
      pending_.front().wait();  // a throw leaves it and the rest: the next replay stays refused
      pending_.erase(pending_.begin());
    }
  }

  std::uint64_t replays() const { return replays_; }
  // The collectives captured, over every communicator.
  std::size_t collectives() const {
    std::size_t n = 0;
    for (const auto& c : captures_) n += c->collectives;
    return n;
  }

 private:
  void release() noexcept {
    if (exec_) cudaGraphExecDestroy(std::exchange(exec_, nullptr));
    if (graph_) cudaGraphDestroy(std::exchange(graph_, nullptr));
  }

  ShardedModel* model_;
  cudaStream_t stream_;
  std::vector<NcclComm*> comms_;
  std::vector<std::shared_ptr<const detail::NcclCapture>> captures_;
  std::vector<std::string> states_;        // each unit's step_state when the capture began
  std::vector<std::string> states_after_;  // and when its body ended
  ModelConfig config_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<Work> pending_;  // the last replay's, one per communicator
  std::uint64_t replays_ = 0;
};

}  // namespace fsdp
