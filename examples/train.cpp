// The README's main example: the reference model trained sharded on N ranks (FullShard
// unless --strategy says otherwise; f32 unless --precision says otherwise; optionally with
// --offload), next to the same model trained unsharded on the same global batch with the
// same casts. Each step prints the loss of both and every rank's live / peak bytes in the
// Device's device space, as counted by its Device; the last line sums it up:
//   final: loss=<x> unsharded_loss=<y> peak_bytes_per_rank=<a> unsharded_peak_bytes=<b>
//
// --local-gradients sum: the engine's loss, and so its gradients, are sums over its local
// batch (fsdp sums them over the ranks: ShardOptions::local_gradients), and the reference's
// over the global batch; sharded and unsharded agree as under the default mean.
//
// The ranks are threads of this process (--backend thread, the default), processes talking
// TCP (--backend tcp: the program starts --nproc copies of itself through fsdp_run's
// launcher), or MPI processes (--backend mpi, under mpirun / srun).
//
// Checkpoints: --save DIR writes a sharded checkpoint of the model and the optimizer state
// (plus the step, the global batch and, under fp16, the loss scaler's state) after the last
// step, and every K steps with --save-every K. --resume DIR loads one on any number of ranks
// with any strategy and continues from its step to --steps; with the same global batch
// (ranks x --batch) the run sees the same data as one that never stopped, and on the same
// ranks and strategy it trains bit for bit the same model. --peer-checkpoint keeps a copy
// of every rank's state in host memory, and one on the next rank, after every step.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include <fsdp/asio/tcp_process_group.hpp>
#include <fsdp/comm/async_communicator.hpp>
#include <fsdp/checkpoint/checkpoint.hpp>
#include <fsdp/model/memory_plan.hpp>
#include <fsdp/mpi/mpi_comm.hpp>
#include <fsdp/core/trace_json.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "examples/train_checkpoint.hpp"
#include "examples/train_config.hpp"
#include "examples/train_report.hpp"
#include "tools/launcher/launcher.hpp"

namespace {

using namespace train_example;

// Step s's --accumulate micro-batches: samples [first, first + count) of each. Micro-batch j
// of step s is the synthetic task's batch s * accumulate + j, so --accumulate 1 trains on
// the batches of a run without it.
std::vector<engine::Batch> micro_batches(const Config& cfg, int s, std::int64_t first, std::int64_t count) {
  std::vector<engine::Batch> out;
  for (int j = 0; j < cfg.accumulate; ++j) out.push_back(engine::make_batch(cfg.model, s * cfg.accumulate + j, first, count));
  return out;
}

Reference train_unsharded(const Config& cfg, int world) {
  const fsdp::DType param_dtype = precision_dtype(cfg.precision);
  fsdp::HostDevice device;
  engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
  engine::Model model(cfg.model, alloc);
  std::optional<engine::Model> compute;
  if (param_dtype != fsdp::DType::f32) compute.emplace(cfg.model, alloc, param_dtype, param_dtype);
  engine::AdamW::Options adam;
  adam.lr = 1e-3f;
  engine::AdamW adamw(adam, alloc);
  engine::Sgd sgd(cfg.sgd_lr(world));
  engine::Muon muon(cfg.muon_options(adam), alloc);
  engine::BeforeStep clip;
  if (cfg.clip > 0) clip = [&] { engine::clip_grad_norm(model, cfg.clip); };
  auto step = [&](auto& opt, std::span<const engine::Batch> micro) {
    return compute ? engine::unsharded_mixed_step(model, *compute, opt, micro, param_dtype, clip)
                   : engine::unsharded_step(model, opt, micro, clip);
  };
  Reference ref;
  for (int s = 0; s < cfg.steps; ++s) {
    const auto micro = micro_batches(cfg, s, 0, static_cast<std::int64_t>(world) * cfg.batch_per_rank);
    ref.loss.push_back(cfg.optimizer == "sgd" ? step(sgd, micro) : cfg.optimizer == "muon" ? step(muon, micro) : step(adamw, micro));
  }
  ref.peak = device.stats().peak_bytes;
  return ref;
}

// --plan: the per-rank device peak fsdp::plan predicts for this run (AdamW's moments are
// the engine's bytes through the same Device, planned as such), the largest of any rank's,
// printed before the first step. The model reports its own policies, mesh, threshold and
// settings (ShardedModel::config()), so nothing is restated here. A collective.
template <class C>
fsdp::MemoryPlan print_plan(fsdp::ShardedModel& sharded, C& comm, const Config& cfg) {
  fsdp::PlanOptions options;
  options.asynchronous = true;  // the AsyncCommunicator: one reduction stays in flight
  options.steps = std::min(cfg.steps, 2);
  options.micro_batches = cfg.accumulate;  // each unit's accumulation mode and resharding are read from it
  const auto space = sharded.config().units.front().policies.shard_space();
  const auto k = static_cast<std::size_t>(space);
  if (cfg.optimizer == "adamw")  // two f32 moments per shard element: after the first step, or in each unit's first hook
    for (auto& u : sharded) {
      std::size_t moments = 0;
      for (const auto& v : u->shards()) moments += 2 * sizeof(float) * static_cast<std::size_t>(v.numel);
      (cfg.optimizer_in_backward ? options.engine_state_in_hook[u->fqn()][k] : options.engine_state[k]) += moments;
    }
  if (cfg.optimizer == "muon")  // one f32 momentum per element of a weight matrix this rank owns, AdamW's two for the rest
    for (const engine::Slot& s : engine::parameter_slots(sharded))
      options.engine_state[k] += (s.rows > 0 ? 1 : 2) * sizeof(float) * static_cast<std::size_t>(s.numel);
  fsdp::MemoryPlan plan = fsdp::plan(sharded, options);
  const auto mine = static_cast<std::int64_t>(plan.peak_bytes());
  std::int64_t most = 0;
  comm.all_reduce(&mine, &most, 1, fsdp::DType::i64, fsdp::ReduceOp::max).wait();
  if (comm.rank() == 0) fmt::print("plan: peak_bytes_per_rank={}\nplan: rank 0 {}\n", most, plan.describe());
  return plan;
}

// A dashed line where each step begins, labelled.
std::string step_marks(const fsdp::MemoryPlan& plan) {
  std::string marks;
  int step = 0;
  for (std::size_t i = 0; i < plan.timeline.size(); ++i)
    if (plan.timeline[i].step != step) {
      step = plan.timeline[i].step;
      marks += fmt::format("set arrow from {0}, graph 0 to {0}, graph 1 nohead dashtype 2\n"
                           "set label 'step {1}' at {0}, graph 0.95 offset 0.5, 0\n", i, step);
    }
  return marks;
}

// --plot FILE: the plan's timeline (live bytes, allocation by allocation) as a PNG drawn by
// gnuplot, with the data beside it (FILE.dat). Rank 0's plan.
void plot_plan(const fsdp::MemoryPlan& plan, const std::string& png) {
  const std::string data = png + ".dat";
  {
    std::ofstream out(data);
    plan.write_timeline(out);
    if (!out) throw std::runtime_error("--plot: cannot write '" + data + "'");
  }
  auto quoted = [](const std::string& s) {  // a gnuplot string in single quotes
    std::string q = "'";
    for (char ch : s) q += ch == '\'' ? std::string("''") : std::string(1, ch);
    return q + "'";
  };
  const std::string script =
      "set terminal pngcairo size 1200,500\nset output " + quoted(png) + "\n" +
      "set title " + quoted("fsdp::plan, rank 0: " + plan.describe()) +
      " noenhanced\nset xlabel 'allocation or free, in order (setup, then each step)'\nset ylabel 'bytes live'\n"
      "set key right bottom\nset grid\n" + step_marks(plan) +
      "plot " + quoted(data) + " using 1:3 with steps lw 2 title 'device', '' using 1:4 with steps lw 2 title 'host'\n";
  FILE* gnuplot = popen("gnuplot", "w");
  if (!gnuplot) throw std::runtime_error("--plot: cannot start gnuplot (apt install gnuplot-nox)");
  std::fputs(script.c_str(), gnuplot);
  const int status = pclose(gnuplot);
  const int code = status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code != 0 || !std::filesystem::exists(png))
    throw std::runtime_error("--plot: gnuplot did not draw '" + png + "' (exit status " + std::to_string(code) +
                             (code == 127 ? ": no gnuplot here; apt install gnuplot-nox)" : ")"));
}

// --kill: this process dies as the OOM killer or a lost node would end it, its output
// written first.
[[noreturn]] void kill_self() {
  std::fflush(nullptr);
  std::raise(SIGKILL);
  std::abort();  // not reached: SIGKILL cannot be caught
}

// Thrown when the peer checkpoint cannot restore the ranks: the rank exits with
// fsdp::kNoReplacementExitStatus, and fsdp_run --restart-scope rank starts the whole job
// again (from --save's last checkpoint), or stops it when no restart is left.
struct NoRecovery : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One rank's training on any communicator. Figures reach rank 0 through the communicator
// itself (the ranks may be processes on other hosts), and rank 0 prints them.
template <fsdp::SplittableCommunicator C>
Summary train_rank(C& comm, const Config& cfg, fsdp::MeshShape mesh_shape, const Reference* reference,
                   const Resume* resume, fsdp::PeerCheckpoint& peer, Recovery& recovery) {
  const int r = comm.rank();
  const int world = comm.size();
  const fsdp::DType param_dtype = precision_dtype(cfg.precision);
  // Collectives run on this rank's communication thread, overlapping compute; every
  // collective of this rank goes through it, so all ranks issue them in one order.
  fsdp::Trace trace(r);
  fsdp::Trace* tracing = cfg.trace_dir.empty() ? nullptr : &trace;
  fsdp::AsyncCommunicator stream(comm, tracing);
  // A mesh serves every strategy: the hybrid ones shard inside its shard groups, the
  // others use its whole world. Its groups count what they send (the groups split from the
  // stream record into its trace).
  fsdp::CountingCommunicator counted(stream);
  fsdp::DeviceMesh mesh(counted, mesh_shape);
  engine::Model model(cfg.model);
  fsdp::HostDevice device;
  engine::AdamW::Options adam;
  adam.lr = 1e-3f;
  Summary summary;
  std::vector<fsdp::CounterTrack> plan_tracks;  // --plan with --trace: the planned timeline
  {  // the sharded model and all that uses it end here, before the trace is written
    // Runtime flags -> compile-time policies. Only fsdp::shard takes them as types, and
    // every combination returns the same fsdp::ShardedModel, so the training
    // below is compiled once per communicator, not once per combination (5 strategies x 30
    // precisions, comm precisions and gather formats x offload: 300 fsdp::shard calls).
    std::optional<fsdp::ShardedModel> built;
    fsdp::with_strategy(cfg.strategy, [&](auto chosen) {
      with_precision_and_offload(param_dtype, cfg.comm_precision == "bf16", cfg.gather_dtype, cfg.offload, [&](auto mixed, auto comm_precision, auto off) {
        using S = decltype(chosen);
        using M = decltype(mixed);
        using P = decltype(comm_precision);
        using O = decltype(off);
        built.emplace(fsdp::shard<S, M, P, O>(model, mesh, device, engine::Wrap{},
                                              fsdp::ShardOptions{.persistence_threshold = cfg.persistence_threshold,
                                                                 .local_gradients = cfg.local_gradients,
                                                                 .shard_layout = cfg.shard_layout}));
      });
    });
    fsdp::ShardedModel& sharded = *built;
    sharded.set_trace(tracing);
    // --reshard-after-forward N: the backward all-gathers run inside groups of N consecutive
    // ranks (one host's, on a cluster), each rank keeping 1/N of the parameters after forward.
    std::optional<decltype(counted.split(0, 0))> post_forward;
    if (cfg.post_forward_ranks > 0) {
      post_forward.emplace(counted.split(r / cfg.post_forward_ranks, r));
      sharded.set_reshard_after_forward(*post_forward);
    } else if (!cfg.reshard_after_forward.empty()) {
      sharded.set_reshard_after_forward(cfg.reshard_after_forward == "true");
    }
    sharded.set_reshard_after_backward(cfg.reshard_after_backward);
    if (cfg.sync_every_microbatch) sharded.set_gradient_sync_mode(fsdp::GradientSyncMode::reduce_every_microbatch);
    // Optimizer state next to the shards it steps: host space when they are offloaded.
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device, cfg.offload ? fsdp::MemorySpace::host : fsdp::MemorySpace::device);
    engine::AdamW adamw(adam, alloc);
    engine::Sgd sgd(cfg.sgd_lr(world));
    engine::Muon muon(cfg.muon_options(adam), alloc);
    fsdp::ShardedGradScaler scaler(stream, device, cfg.scaler_options(world));  // fp16 only
    engine::AdamWState adamw_state(adamw, sharded);
    fsdp::OptimizerState* optimizer_state = cfg.optimizer == "adamw" ? &adamw_state : nullptr;  // SGD has none
    const bool scaled = param_dtype == fsdp::DType::f16;
    // Saves are written in the background while training goes on, and committed (a
    // collective) after the first step that finds every rank's files written (try_commit),
    // else before the next save, and at the end: a job restarted after a failure
    // (--max-restarts) then loses at most the steps since the last save, plus the write.
    fsdp::AsyncCheckpointer checkpointer(sharded, optimizer_state);
    int saving_step = 0;
    auto commit_save = [&](bool if_written) {
      if (!checkpointer.pending()) return;
      if (if_written) {
        if (!checkpointer.try_commit()) return;
      } else {
        checkpointer.wait();
      }
      const auto& t = checkpointer.last_timing();
      if (r == 0) {
        fmt::print("checkpoint: saved step {} to {} ({} B on rank 0, {:.0f}% of the write hidden behind training)\n",
                   saving_step, cfg.save_dir, t.bytes, 100 * t.hidden_fraction());
        std::fflush(stdout);  // before a later failure (or --kill) ends the process with the line unwritten
      }
    };
    int first_step = 0;
    if (resume) {
      fsdp::load_sharded_checkpoint(cfg.resume_dir, sharded, optimizer_state);
      if (scaled) scaler.load_state(*resume->scaler);
      summary.skipped_steps = resume->skipped_steps;
      first_step = resume->step;
      if (r == 0) fmt::print("checkpoint: resumed step {} from {} ({} ranks -> {} ranks)\n", first_step, cfg.resume_dir, resume->ranks, world);
    }
    // --kill RANK@STEP:PHASE: a lost rank, as the OOM killer or a node would lose it.
    int step_now = 0;  // 1-based, the step being trained
    auto kill_here = [&](std::string_view phase) {
      if (cfg.kills_at(r, step_now, phase)) kill_self();
    };
    if (cfg.kills_in("backward"))  // on every rank alike; it computes nothing and keeps the gradient
      sharded.set_post_accumulate_grad_hook([&](fsdp::Unit&) { kill_here("backward"); });
    engine::BeforeStep clip;  // --clip: the global 2-norm over every shard of every rank
    if (cfg.clip > 0) clip = [&] { fsdp::clip_grad_norm(sharded, mesh, device, {.max_norm = cfg.clip}); };
    if (cfg.kills_in("optimizer"))
      clip = [&, clip_norm = clip] {
        kill_here("optimizer");
        if (clip_norm) clip_norm();
      };
    // --optimizer-in-backward: one optimizer per unit steps its shards as soon as their
    // gradient is final, and the gradient is freed right after.
    std::optional<engine::OptimizerInBackward<engine::AdamW>> adamw_inside;
    std::optional<engine::OptimizerInBackward<engine::Sgd>> sgd_inside;
    if (cfg.optimizer_in_backward && cfg.optimizer == "adamw")
      adamw_inside.emplace(sharded, [&] { return std::make_unique<engine::AdamW>(adam, alloc); });
    else if (cfg.optimizer_in_backward)
      sgd_inside.emplace(sharded, [&] { return std::make_unique<engine::Sgd>(cfg.sgd_lr(world)); });
    if (cfg.plan) {
      const fsdp::MemoryPlan plan = print_plan(sharded, stream, cfg);
      if (tracing) plan_tracks = plan.counter_tracks(r);  // beside the rank's spans in its trace file
      if (!cfg.plot.empty() && r == 0) plot_plan(plan, cfg.plot);
    }
    if (cfg.show_config && r == 0) fmt::print("config: {}", fsdp::to_string(sharded.config()));
    auto step = [&](auto& opt, std::span<const engine::Batch> micro) {
      if (cfg.optimizer_in_backward) return engine::sharded_forward_backward(model, sharded, micro);
      if (!scaled) return engine::sharded_step(model, sharded, opt, micro, clip);
      const auto result = engine::sharded_scaled_step(model, sharded, opt, scaler, micro, clip);
      if (!result.stepped) ++summary.skipped_steps;
      return result.loss;
    };
    // --peer-checkpoint: a copy of every rank's state after every step, and one before the
    // first; after a failure (--restart-scope rank) every rank restores from them instead.
    // The copies carry what a checkpoint on disk carries beside the model (the fp16 loss
    // scaler's state among it), and restore() gives it back.
    auto refresh_peer = [&](int done) {
      if constexpr (fsdp::RingShiftCommunicator<decltype(stream)>)
        peer.refresh(stream, sharded, optimizer_state, done,
                     checkpoint_metadata(cfg, world, done, scaled ? std::optional(scaler.state()) : std::nullopt,
                                         summary.skipped_steps));
      else
        throw std::runtime_error("--peer-checkpoint: this backend's communicator has no ring_shift (NCCL and the CUDA "
                                 "thread ranks do not yet)");
    };
    if (cfg.peer_checkpoint && recovery.restore) {
      if constexpr (fsdp::RingShiftCommunicator<decltype(stream)>) {
        std::string why;
        if (!peer.restorable_step(stream, &why))  // the state is gone: a replacement cannot mend that
          throw NoRecovery(fmt::format("rank {}: in-memory recovery is not possible: {}. Exiting {}: fsdp_run starts every "
                                       "rank again, from the last checkpoint --save wrote (else from --resume, or from "
                                       "scratch), while restarts are left",
                                       r, why, fsdp::kNoReplacementExitStatus));
        step_now = recovery.done + 1;  // the step that failed
        kill_here("recovery");         // a second failure, before the copies move
        const fsdp::PeerRestore restored = peer.restore(stream, sharded, optimizer_state);
        first_step = static_cast<int>(restored.step);
        if (scaled) {  // the loss scaler as it was at that step, and the steps it had skipped
          Resume at;
          read_scaler(restored.metadata, fmt::format("rank {}: the peer checkpoint of step {}", r, first_step), at);
          scaler.load_state(*at.scaler);
          summary.skipped_steps = at.skipped_steps;
        }
        recovery.restore = false;
        if (!std::exchange(recovery.replacement, false)) {  // a survivor: what it trains again (the interrupted step too), and how long it took
          recovery.redone_steps += recovery.done + 1 - first_step;
          recovery.recovery_ms_max = std::max<std::int64_t>(
              recovery.recovery_ms_max,
              std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - recovery.failed_at).count());
        }
        if (r == 0) {  // each replaced rank, and where its state came from
          std::vector<std::string> from;
          for (std::size_t i = 0; i < restored.replaced.size(); ++i)
            from.push_back(restored.from_replica[i]
                               ? fmt::format("rank {} from its replica rank {}", restored.replaced[i], restored.sources[i])
                               : fmt::format("rank {} from rank {}'s copy", restored.replaced[i], restored.sources[i]));
          fmt::print("recovery: every rank restored step {} from the peer checkpoint ({})\n", first_step, fmt::join(from, "; "));
        }
        std::fflush(stdout);
      }
    } else if (cfg.peer_checkpoint) {
      refresh_peer(first_step);
    }
    for (int s = first_step; s < cfg.steps; ++s) {
      step_now = s + 1;
      kill_here("begin");
      const auto micro = micro_batches(cfg, s, static_cast<std::int64_t>(r) * cfg.batch_per_rank, cfg.batch_per_rank);
      engine::reset_counts(mesh);
      if (post_forward) post_forward->reset();
      double local = cfg.optimizer == "sgd"    ? step(sgd, micro)
                     : cfg.optimizer == "muon" ? step(muon, micro)
                                               : step(adamw, micro);
      summary.last_step = engine::total_counts(mesh);
      if (post_forward) summary.last_step_post_forward = post_forward->counts();
      if (post_forward)
        for (std::size_t k = 0; k < fsdp::collective_kinds; ++k) {
          summary.last_step.by_kind[k].calls += post_forward->counts().by_kind[k].calls;
          summary.last_step.by_kind[k].bytes += post_forward->counts().by_kind[k].bytes;
        }
      double global = 0;  // equal batches per rank: the global loss is the mean of the ranks'
      stream.all_reduce(&local, &global, 1, fsdp::DType::f64, fsdp::ReduceOp::avg).wait();
      const auto dev = device.stats(fsdp::MemorySpace::device);
      const std::array<std::int64_t, 3> mine{static_cast<std::int64_t>(dev.live_bytes), static_cast<std::int64_t>(dev.peak_bytes),
                                             static_cast<std::int64_t>(device.stats(fsdp::MemorySpace::host).peak_bytes)};
      std::vector<std::int64_t> all(3 * static_cast<std::size_t>(world));
      stream.all_gather(mine.data(), all.data(), 3, fsdp::DType::i64).wait();
      if (r == 0) {
        std::vector<std::int64_t> live, peak;
        for (int q = 0; q < world; ++q) {
          live.push_back(all[3 * q]);
          peak.push_back(all[3 * q + 1]);
          summary.peak = std::max(summary.peak, static_cast<std::size_t>(all[3 * q + 1]));
          summary.host_peak = std::max(summary.host_peak, static_cast<std::size_t>(all[3 * q + 2]));
        }
        fmt::print("step {:>3}: loss={:.6f} unsharded_loss={:.6f} live_bytes={} peak_bytes={}\n", s + 1, global,
                   reference->loss[static_cast<std::size_t>(s)], live, peak);
        std::fflush(stdout);
        summary.loss = global;
      }
      const int done = s + 1;
      recovery.done = done;
      if (cfg.peer_checkpoint) refresh_peer(done);  // the step's copies, before anything else can fail
      commit_save(true);
      if (!cfg.save_dir.empty() && (done == cfg.steps || (cfg.save_every > 0 && done % cfg.save_every == 0))) {
        commit_save(false);
        const auto scaler_state = scaled ? std::optional(scaler.state()) : std::nullopt;
        checkpointer.save_sharded(cfg.save_dir, checkpoint_metadata(cfg, world, done, scaler_state, summary.skipped_steps));
        saving_step = done;
        kill_here("save");  // while the files are written in the background
      }
    }
    commit_save(false);
    step_now = 0;
    kill_here("end");  // --kill RANK@end: a failure after training was done
    // The trained parameters, gathered (a collective), fingerprinted: two runs trained the
    // same model bit for bit exactly when their fingerprints agree.
    XXH64_state_t* h = XXH64_createState();
    XXH64_reset(h, 0);
    for (const auto& [fqn, values] : engine::gather_full_parameters(model, sharded)) {
      XXH64_update(h, fqn.data(), fqn.size());
      XXH64_update(h, values.data(), values.size() * sizeof(float));
    }
    summary.fingerprint = XXH64_digest(h);
    summary.peer_bytes = peer.host_bytes();
    summary.peer_on_replicas = peer.on_replicas();
    if (cfg.restart_scope == "rank") {  // the largest over the ranks, for rank 0's line
      const std::int64_t mine[4] = {recovery.failures, fsdp::DistEnv::launched() ? fsdp::DistEnv::from_env().restart_count : 0,
                                    recovery.redone_steps, recovery.recovery_ms_max};
      std::int64_t most[4];
      stream.all_reduce(mine, most, 4, fsdp::DType::i64, fsdp::ReduceOp::max).wait();
      summary.failures = static_cast<int>(most[0]), summary.restarts = static_cast<int>(most[1]);
      summary.redone_steps = static_cast<int>(most[2]), summary.recovery_ms_max = most[3];
    }
    XXH64_freeState(h);
  }
  if (tracing) {
    std::filesystem::create_directories(cfg.trace_dir);
    fsdp::write_chrome_json(trace, (std::filesystem::path(cfg.trace_dir) / ("rank" + std::to_string(r) + ".json")).string(),
                            plan_tracks);
  }
  return summary;
}

// Every flag's value is read whole by fsdp's strict parsers (fsdp/core/parse.hpp), never
// by CLI11's own conversions, which read "010" as 8, " 5" as 5, "nan" as a number (so
// --clip nan turned clipping off) and "5" or "-3" as a boolean. A refusal names the flag and
// ends the program with CLI11's usage message and status.
template <class Parse>
auto strictly(Parse&& parse) {
  try {
    return parse();
  } catch (const fsdp::Error& e) {
    throw CLI::ValidationError(e.what());
  }
}

template <std::integral T>
CLI::Option* integer_flag(CLI::App& app, const std::string& flag, T& out, std::type_identity_t<T> lo, std::type_identity_t<T> hi,
                          const std::string& help) {
  return app
      .add_option_function<std::string>(
          flag, [&out, flag, lo, hi](const std::string& text) {
            out = strictly([&] { return fsdp::detail::parse_integer<T>(text, flag, lo, hi); });
          },
          help + fmt::format(" (an integer in [{}, {}])", lo, hi))
      ->type_name("INT");
}

CLI::Option* bool_flag(CLI::App& app, const std::string& flag, bool& out, const std::string& help) {
  return app
      .add_option_function<std::string>(
          flag, [&out, flag](const std::string& text) { out = strictly([&] { return fsdp::detail::parse_bool(text, flag); }); },
          help + " (true/false, 1/0, yes/no or on/off)")
      ->type_name("BOOL");
}

// A flag without a value (--offload): "--offload=0" or "--offload=5" is refused, not read as a boolean.
CLI::Option* switch_flag(CLI::App& app, const std::string& flag, bool& out, const std::string& help) {
  return app.add_flag(flag, out, help)->disable_flag_override();
}

// A path: an empty one (--save "") would silently mean none, so it is refused.
const CLI::Validator kNonEmptyPath([](std::string& text) { return text.empty() ? std::string("an empty path") : std::string(); },
                                   "PATH");

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  int ranks = 4, nproc = 4;
  std::string backend = "thread", mesh_text;
  CLI::App app{"Train the reference model sharded with fsdp on in-process ranks, TCP processes or MPI"};
  app.add_option("--backend", backend, "thread (ranks are threads), tcp (processes; starts --nproc copies of itself) or mpi (under mpirun)")
      ->check(CLI::IsMember({"thread", "tcp", "mpi"}));
  integer_flag(app, "--ranks", ranks, 1, 256, "number of ranks (threads) for --backend thread");
  integer_flag(app, "--nproc", nproc, 1, 256, "number of processes for --backend tcp");
  integer_flag(app, "--steps", cfg.steps, 1, 1000000, "training steps");
  integer_flag(app, "--batch", cfg.batch_per_rank, 1, 1 << 20, "samples per rank per step");
  app.add_option("--optimizer", cfg.optimizer,
                 "sgd, adamw or muon (Muon for every weight matrix, each orthogonalized whole on the rank that holds it, "
                 "AdamW for the rest; shards with --shard-layout param unless given)")
      ->check(CLI::IsMember({"sgd", "adamw", "muon"}));
  integer_flag(app, "--blocks", cfg.model.blocks, 0, 1000, "residual blocks");
  integer_flag(app, "--dim", cfg.model.dim, 1, 1 << 16, "model width");
  integer_flag(app, "--hidden", cfg.model.hidden, 1, 1 << 16, "block hidden width");
  app.add_option("--strategy", cfg.strategy, "sharding strategy: " + fsdp::strategy_names() + " (any case)");
  app.add_option("--mesh", mesh_text,
                 "REPLICATExSHARD ranks for the hybrid strategies (default: 2 x ranks/2 when ranks is even and "
                 "at least 4, else 1 x ranks)");
  app.add_option("--precision", cfg.precision,
                 "fp32, bf16 (MixedPrecision<bf16>) or fp16 (MixedPrecision<f16> with a ShardedGradScaler)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  switch_flag(app, "--offload", cfg.offload, "OffloadParams: sharded parameters, gradients and optimizer state in host space");
  auto* comm_precision = app.add_option("--comm-precision", cfg.comm_precision,
                                        "fp32 or bf16 (CommPrecision<bf16>): all-gathers and gradient reductions in bf16 while "
                                        "the model computes in f32 (with --precision fp32 only); prints a step's collectives")
                             ->check(CLI::IsMember({"fp32", "bf16"}));
  auto* gather_dtype = app.add_option("--gather-dtype", cfg.gather_dtype,
                                      "what all-gathers move: f32, bf16, or a block format (CommPrecision's Gather): fp8 "
                                      "(E4M3 blocks of 128), fp8e5m2 (E5M2 blocks of 128: a wider range, one mantissa "
                                      "bit less), mxfp8 (MXFP8, blocks of 32) or int8 (int8 blocks of 128), or per "
                                      "tensor: fp8tensor (E4M3, one scale per parameter, agreed through an all-gather "
                                      "of the amaxes before each gather; codes only on the wire) or fp8e5m2tensor (E5M2), "
                                      "dequantized into the compute dtype; default: --comm-precision's, or --precision's; "
                                      "prints a step's collectives")
                           ->check(CLI::IsMember(
                               {"f32", "bf16", "fp8", "fp8e5m2", "mxfp8", "int8", "fp8tensor", "fp8e5m2tensor"}));
  app.add_option_function<std::string>(
         "--local-gradients",
         [&cfg](const std::string& text) {
           cfg.local_gradients = text == "sum" ? fsdp::LocalGradients::sum : fsdp::LocalGradients::mean;
         },
         "what the engine's gradients are over its local batch: mean (its loss is the mean over its samples; fsdp "
         "averages over the ranks) or sum (the sum over its samples; fsdp sums over the ranks: ShardOptions::"
         "local_gradients). Either way the optimizer sees what the unsharded run on the global batch computes; "
         "under sum SGD's learning rate and fp16's initial loss scale are divided by the global batch")
      ->check(CLI::IsMember({"mean", "sum"}))
      ->type_name("mean|sum");
  auto* persistence = integer_flag(app, "--persistence-threshold", cfg.persistence_threshold, std::int64_t{0},
                                   std::int64_t{1} << 40,
                                   "units with fewer parameter elements stay unsharded: never all-gathered, gradients "
                                   "all-reduced (0: none); prints a step's collectives");
  auto* layout = app.add_option_function<std::string>(
                        "--shard-layout",
                        [&cfg](const std::string& text) {
                          cfg.shard_layout = strictly([&] { return fsdp::parse_shard_layout(text, "--shard-layout"); });
                        },
                        "how shards are cut (ShardOptions::shard_layout): flat (parameters back to back) or block:K "
                        "(every parameter starts on a multiple of K elements and every shard holds a multiple of K, "
                        "so no K-element block is split between ranks: with --gather-dtype int8, fp8 or fp8e5m2, block:128, with "
                        "mxfp8 block:32, puts every scale block inside one parameter); prints a step's collectives")
                    ->type_name("flat|block:K");
  integer_flag(app, "--accumulate", cfg.accumulate, 1, 1 << 16,
               "micro-batches per optimizer step (gradient accumulation); all but the last run under no_sync, "
               "keeping unsharded gradients instead of reducing them");
  integer_flag(app, "--scaler-growth-interval", cfg.scaler_growth_interval, 1, 1 << 30,
               "with --precision fp16: good steps before the loss scale doubles (default 2000); 1 doubles it every "
               "step until a step overflows and is skipped (the unsharded reference has no loss scaler: once a step is "
               "skipped, its loss differs)");
  switch_flag(app, "--sync-every-microbatch", cfg.sync_every_microbatch,
              "with --accumulate: reduce-scatter every micro-batch and accumulate sharded (less memory, more communication)");
  auto* clip = app.add_option_function<std::string>(
                      "--clip",
                      [&cfg](const std::string& text) {
                        cfg.clip = strictly([&] {
                          const double norm = fsdp::detail::parse_real(text, "--clip");
                          if (norm <= 0)
                            fsdp::detail::fail("--clip: ", text, " is not > 0; the max norm must be positive (leave --clip out "
                                               "for no clipping)");
                          return norm;
                        });
                      },
                      "clip gradients to this global 2-norm before each optimizer step (fsdp::clip_grad_norm); a finite "
                      "number > 0")
                   ->type_name("MAX_NORM");
  switch_flag(app, "--optimizer-in-backward", cfg.optimizer_in_backward,
               "step each unit's shards in its post-accumulate-grad hook and free its gradient "
               "there (not with --clip, fp16, --save or --resume: they need every gradient, or the "
               "one optimizer's state, after backward)")
      ->excludes(clip);
  auto* reshard = app.add_option_function<std::string>(
                         "--reshard-after-forward",
                         [&cfg](const std::string& text) {
                           strictly([&] {
                             const bool number = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
                             if (number) {
                               cfg.post_forward_ranks = fsdp::detail::parse_integer<int>(text, "--reshard-after-forward (a group size)", 2, 1 << 20);
                               cfg.reshard_after_forward = std::to_string(cfg.post_forward_ranks);
                             } else if (const auto b = fsdp::detail::as_bool(text)) {
                               cfg.reshard_after_forward = *b ? "true" : "false";
                             } else {
                               fsdp::detail::fail("--reshard-after-forward: '", text, "' is not true, false or a group size N >= 2");
                             }
                             return 0;
                           });
                         },
                         "true, false, or N: keep the parameters sharded over groups of N consecutive ranks "
                         "between forward and backward (partial resharding, ZeRO++ hpZ)")
                     ->type_name("true|false|N");
  auto* keep = bool_flag(app, "--reshard-after-backward", cfg.reshard_after_backward,
                         "false: between micro-batches of --accumulate, keep the parameters for the next forward");
  switch_flag(app, "--plan", cfg.plan,
               "print the per-rank device peak fsdp::plan predicts (plan: peak_bytes_per_rank=N) before the first step, "
               "and where rank 0's is reached (plan: rank 0 ...)");
  switch_flag(app, "--show-config", cfg.show_config,
               "print what the sharded model reports of itself (fsdp::ShardedModel::config()): each unit's policies and "
               "settings, after the settings the other flags make");
  app.add_option("--plot", cfg.plot,
                 "with --plan: draw rank 0's planned timeline (live bytes per allocation) into this PNG file (gnuplot; "
                 "the data beside it in FILE.dat)")
      ->check(kNonEmptyPath);
  app.add_option("--trace", cfg.trace_dir,
                 "write a Chrome / Perfetto trace per rank into this directory (rankN.json); with --plan, the planned "
                 "live bytes as a counter track too")
      ->check(kNonEmptyPath);
  auto* save = app.add_option("--save", cfg.save_dir,
                              "save a sharded checkpoint (model, optimizer state, step) into this directory after the last step")
                   ->check(kNonEmptyPath);
  integer_flag(app, "--save-every", cfg.save_every, 1, 1000000, "also save every K steps (needs --save)")->needs(save);
  switch_flag(app, "--peer-checkpoint", cfg.peer_checkpoint,
              "after every step, keep a copy of each rank's state in host memory and one on the next rank "
              "(fsdp::PeerCheckpoint: what in-memory recovery needs; costs two copies of a rank's state)");
  app.add_option("--resume", cfg.resume_dir,
                 "load a checkpoint saved with --save (on any number of ranks, any strategy) and continue from its "
                 "step to --steps")
      ->check(kNonEmptyPath);
  int max_restarts = 0;
  auto* restarts = integer_flag(app, "--max-restarts", max_restarts, 0, fsdp::launch::kMaxRestarts,
                                "with --backend tcp: when a rank fails, restart every rank, up to this many times "
                                "(fsdp_run --max-restarts); with --save, a restarted job resumes from the last "
                                "checkpoint saved there");
  auto* scope = app.add_option("--restart-scope", cfg.restart_scope,
                                "with --max-restarts: job (every rank restarts, resuming from --save), or rank (only the "
                                "failed rank is restarted; the others keep their state, rejoin it, and every rank restores "
                                "from --peer-checkpoint's copies, redoing the interrupted step)")
                    ->check(CLI::IsMember({"job", "rank"}))
                    ->needs(restarts);
  auto* kill = app.add_option_function<std::vector<std::string>>(
                      "--kill",
                      [&cfg](const std::vector<std::string>& texts) {
                        for (const auto& text : texts)
                          strictly([&] {
                            Config::Kill k;
                            const auto at = text.find('@');
                            if (at == std::string::npos) fsdp::detail::fail("--kill: '", text, "' is not RANK@STEP");
                            k.rank = fsdp::detail::parse_integer<int>(text.substr(0, at), "--kill (the rank)", 0, 255);
                            std::string when = text.substr(at + 1);
                            if (const auto colon = when.find(':'); colon != std::string::npos) {
                              k.phase = when.substr(colon + 1);
                              when.resize(colon);
                              if (k.phase != "begin" && k.phase != "backward" && k.phase != "optimizer" && k.phase != "save" &&
                                  k.phase != "recovery" && k.phase != "rejoin")
                                fsdp::detail::fail("--kill: phase '", k.phase,
                                                   "' is not begin, backward, optimizer, save, recovery or rejoin");
                            }
                            if (when == "end" && text.find(':') != std::string::npos)
                              fsdp::detail::fail("--kill: RANK@end takes no phase");
                            if (when == "end") k.phase = "end";
                            k.step = when == "end" ? 0 : fsdp::detail::parse_integer<int>(when, "--kill (the step)", 1, 1000000);
                            cfg.kills.push_back(k);
                            return 0;
                          });
                      },
                      "with --backend tcp: fault injection; rank RANK kills itself (SIGKILL) in step STEP: as it "
                      "begins (PHASE begin, the default), once a unit's gradient is final (backward), before the "
                      "optimizer (optimizer; not on a step the fp16 loss scaler skips), while its checkpoint is "
                      "written (save), or, under --restart-scope rank, while the survivors recover from another "
                      "rank's failure in that step (recovery: once they agreed what to restore; rejoin: before "
                      "rejoining, while the others' new ring forms); RANK@end: after the last step and its checkpoint. "
                      "Repeat it to kill several ranks. On the job's first start only (see --max-restarts)")
                   ->type_name("RANK@STEP[:PHASE]")
                   ->expected(1)
                   ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI11_PARSE(app, argc, argv);
  if (scope->count() > 0 && cfg.restart_scope == "rank") {
    const char* why = !cfg.peer_checkpoint                  ? "needs --peer-checkpoint (the copies every rank restores from)"
                      : nproc < 2                           ? "needs --nproc 2 or more (a rank's copy is on another rank)"
                      : cfg.optimizer == "muon"             ? "cannot be combined with --optimizer muon (its state is not in the copies)"
                      : cfg.optimizer_in_backward           ? "cannot be combined with --optimizer-in-backward (its optimizers' state is not in the copies)"
                                                            : nullptr;
    if (why) {
      fmt::print(stderr, "--restart-scope rank {}\n", why);
      return 2;
    }
  }
  if ((restarts->count() > 0 || kill->count() > 0) && backend != "tcp") {
    fmt::print(stderr, "{} needs --backend tcp (processes the launcher can restart)\n",
               restarts->count() > 0 ? "--max-restarts" : "--kill");
    return 2;
  }
  // Under a launcher, --max-restarts is the launcher's: train's own (relaunch_self below)
  // passes it on, so its ranks see the same limit; another launcher's limit differs.
  const char* launcher_limit = std::getenv("TORCHELASTIC_MAX_RESTARTS");
  if (restarts->count() > 0 && fsdp::DistEnv::launched() &&
      (!launcher_limit || std::string(launcher_limit) != std::to_string(max_restarts))) {
    fmt::print(stderr, "--max-restarts: this process is already one rank of a launched job (RANK and WORLD_SIZE are "
                       "set); give --max-restarts to its launcher (fsdp_run --max-restarts) instead\n");
    return 2;
  }
  for (const auto& k : cfg.kills) {
    const std::string label = k.phase == "end" ? fmt::format("--kill {}@end", k.rank) : fmt::format("--kill {}@{}:{}", k.rank, k.step, k.phase);
    const bool no_such_rank = !fsdp::DistEnv::launched() && k.rank >= nproc;  // launched: checked against WORLD_SIZE below
    const bool saves_then = !cfg.save_dir.empty() && (k.step == cfg.steps || (cfg.save_every > 0 && k.step % cfg.save_every == 0));
    const bool failure_first = std::any_of(cfg.kills.begin(), cfg.kills.end(), [&](const Config::Kill& o) {
      // save: that rank dies after the step's refresh, so the others fail in the next step
      return o.rank != k.rank && o.step == k.step && !o.in_recovery() && o.phase != "end" && o.phase != "save";
    });
    const auto twice = std::count_if(cfg.kills.begin(), cfg.kills.end(), [&](const Config::Kill& o) { return o.rank == k.rank; });
    std::string why;
    if (twice > 1)
      why = fmt::format("rank {} is killed more than once; a rank dies once (its replacement is not killed)", k.rank);
    else if (no_such_rank)
      why = fmt::format("there is no rank {} among --nproc {}", k.rank, nproc);
    else if (k.step > cfg.steps)
      why = fmt::format("there is no step {} in --steps {}", k.step, cfg.steps);
    else if (k.phase == "save" && !saves_then)
      why = fmt::format("step {} saves no checkpoint (--save and --save-every decide which do)", k.step);
    else if ((k.phase == "backward" || k.phase == "optimizer") && cfg.optimizer_in_backward)
      why = k.phase == "backward" ? "cannot be combined with --optimizer-in-backward: it uses the post-accumulate-grad hook "
                                    "that --optimizer-in-backward needs"
                                  : "cannot be combined with --optimizer-in-backward: there is no optimizer step after "
                                    "backward to kill before";
    else if (k.in_recovery() && cfg.restart_scope != "rank")
      why = "needs --restart-scope rank (only there do survivors recover)";
    else if (k.in_recovery() && !failure_first)
      why = fmt::format("needs another rank killed in step {} (begin, backward or optimizer): the failure recovered from",
                        k.step);
    if (!why.empty()) {
      fmt::print(stderr, "{}: {}\n", label, why);
      return 2;
    }
  }
  cfg.model.loss = cfg.local_gradients == fsdp::LocalGradients::sum ? engine::LossReduction::sum : engine::LossReduction::mean;
  cfg.report_comm = comm_precision->count() > 0 || gather_dtype->count() > 0 || persistence->count() > 0 || layout->count() > 0 ||
                    reshard->count() > 0 || keep->count() > 0;
  if (cfg.precision != "fp32" && !cfg.gather_dtype.empty() && !train_example::is_block_gather(cfg.gather_dtype) &&
      cfg.gather_dtype != cfg.precision) {
    fmt::print(stderr, "--gather-dtype {} with --precision {}: all-gathers move the compute dtype ({}) or a block format "
               "(fp8, fp8e5m2, mxfp8, int8) or a per-tensor one (fp8tensor, fp8e5m2tensor)\n", cfg.gather_dtype,
               cfg.precision, cfg.precision);
    return 2;
  }
  if (cfg.comm_precision != "fp32" && cfg.precision != "fp32") {
    fmt::print(stderr, "--comm-precision {} needs --precision fp32: under --precision {} collectives already move {}\n",
               cfg.comm_precision, cfg.precision, cfg.precision);
    return 2;
  }
  if (cfg.optimizer_in_backward && (cfg.precision == "fp16" || !cfg.save_dir.empty() || !cfg.resume_dir.empty())) {
    fmt::print(stderr, "--optimizer-in-backward cannot be combined with {}: {}\n",
               cfg.precision == "fp16" ? "--precision fp16" : !cfg.save_dir.empty() ? "--save" : "--resume",
               cfg.precision == "fp16" ? "the loss scaler checks every gradient for inf/NaN before any step"
                                       : "checkpoints hold the one optimizer's state that stepping after backward keeps");
    return 2;
  }
  if (cfg.optimizer == "muon") {
    if (layout->count() == 0) cfg.shard_layout = fsdp::ShardLayout::param_atomic();
    const char* with = cfg.shard_layout.kind != fsdp::ShardLayout::Kind::param_atomic ? "--shard-layout other than param"
                       : cfg.optimizer_in_backward                                    ? "--optimizer-in-backward"
                       : cfg.precision == "fp16"                                      ? "--precision fp16"
                       : !cfg.save_dir.empty()                                        ? "--save"
                       : !cfg.resume_dir.empty()                                      ? "--resume"
                                                                                      : nullptr;
    if (with) {
      fmt::print(stderr, "--optimizer muon cannot be combined with {}: {}\n", with,
                 cfg.shard_layout.kind != fsdp::ShardLayout::Kind::param_atomic
                     ? "it orthogonalizes each weight matrix whole, so each must lie on one rank (param or param:K)"
                     : "the example steps Muon after backward, on f32 or bf16 gradients, and checkpoints AdamW's state only");
      return 2;
    }
  }
  if (!cfg.plot.empty() && !cfg.plan) {
    fmt::print(stderr, "--plot draws the plan: give --plan too\n");
    return 2;
  }
  if (cfg.plan && (cfg.precision == "fp16" || !cfg.save_dir.empty() || !cfg.resume_dir.empty())) {
    fmt::print(stderr, "--plan does not model {}\n",
               cfg.precision == "fp16" ? "--precision fp16 (the loss scaler)" : "checkpoints (--save, --resume)");
    return 2;
  }

  try {
    if (backend == "thread") {
      const auto mesh = choose_mesh(cfg.strategy, mesh_text, ranks);
      const auto resume = resume_point(cfg, ranks);
      const Reference ref = train_unsharded(cfg, ranks);
      Summary summary;
      fsdp::ThreadGroup(ranks).run([&](fsdp::ThreadComm& comm) {
        fsdp::PeerCheckpoint peer;
        Recovery recovery;
        Summary s = train_rank(comm, cfg, mesh, &ref, resume ? &*resume : nullptr, peer, recovery);
        if (comm.rank() == 0) summary = s;
      });
      print_summary(cfg, ranks, mesh, backend, summary, ref);
      return 0;
    }
    if (backend == "tcp" && !fsdp::DistEnv::launched()) {
      choose_mesh(cfg.strategy, mesh_text, nproc);  // refuse bad flags and checkpoints before starting anything
      resume_point(cfg, nproc);
      fsdp::launch::Options launch;
      launch.nproc = nproc;
      launch.max_restarts = max_restarts;
      launch.restart_scope = cfg.restart_scope == "rank" ? fsdp::launch::RestartScope::rank : fsdp::launch::RestartScope::job;
      return fsdp::launch::relaunch_self(launch, argc, argv);  // each copy runs the branch below
    }
    // A restarted job (--max-restarts) resumes from the last checkpoint it committed to
    // --save, if any; a job killed before its first save starts again from scratch, the
    // same way; one whose last checkpoint is its final one had finished training. Under
    // --restart-scope rank a replacement (FSDP_COMM_EPOCH set) restores from its peers
    // instead; the whole job starts again only when they could not (exit 87).
    if (backend == "tcp") {
      const fsdp::DistEnv env = fsdp::DistEnv::from_env();
      cfg.run_id = env.run_id;
      for (const auto& k : cfg.kills)
        if (k.rank >= env.world_size) {
          fmt::print(stderr, "--kill {}@{}: there is no rank {} among {} ranks\n", k.rank,
                     k.phase == "end" ? std::string("end") : std::to_string(k.step), k.rank, env.world_size);
          return 2;
        }
      if (env.comm_epoch > 0) {
        cfg.kills.clear();  // a replacement: it restores from its peers' copies, not from --save
      } else if (env.restart_count > 0) {
        cfg.kills.clear();  // the fault is injected into the first start only
        if (const auto step = restart_step(cfg, env.world_size); step && *step >= cfg.steps) {
          if (env.rank == 0)
            fmt::print("restart {}: the last checkpoint in {} is after step {}, the last: the job had finished "
                       "training before it failed\n",
                       env.restart_count, cfg.save_dir, *step);
          return 0;
        } else if (step) {
          cfg.resume_dir = cfg.save_dir;
          if (env.rank == 0)
            fmt::print("restart {}: resuming from the last checkpoint in {}\n", env.restart_count, cfg.save_dir);
        } else if (env.rank == 0) {
          fmt::print("restart {}: no checkpoint of this job in {}; {}\n", env.restart_count,
                     cfg.save_dir.empty() ? std::string("(no --save)") : cfg.save_dir,
                     cfg.resume_dir.empty() ? "starting from scratch" : "resuming from --resume " + cfg.resume_dir);
        }
      }
    }
    // One rank of a multi-process job.
    fsdp::PeerCheckpoint peer;  // --peer-checkpoint: kept across a recovery (--restart-scope rank)
    Recovery recovery;
    std::optional<Reference> ref;
    auto run_rank = [&](auto& comm) {
      const auto mesh = choose_mesh(cfg.strategy, mesh_text, comm.size());
      const auto resume = resume_point(cfg, comm.size());
      if (comm.rank() == 0 && !ref) ref = train_unsharded(cfg, comm.size());
      const Summary s = train_rank(comm, cfg, mesh, ref ? &*ref : nullptr, resume ? &*resume : nullptr, peer, recovery);
      if (comm.rank() == 0) print_summary(cfg, comm.size(), mesh, backend, s, *ref);
    };
    if (backend == "tcp") {
      auto group = fsdp::TcpProcessGroup::from_env();
      recovery.restore = recovery.replacement = group.epoch() > 0;  // a replacement for a failed rank: it restores with the others
      // --restart-scope rank: a lost peer is replaced by the launcher; this rank keeps its
      // peer checkpoint, rejoins the replacement and the other survivors, and trains on from
      // the step they restore. Bounded: each rejoin waits for a replacement the launcher
      // starts (at most --max-restarts of them), at most the communicator's timeout.
      for (;;) {
        try {
          run_rank(group.comm());
          break;
        } catch (const fsdp::Error& e) {
          if (cfg.restart_scope != "rank" || e.kind() != fsdp::ErrorKind::peer_lost) throw;
          const bool recovering = recovery.restore;  // a failure during a recovery: timed from the first
          if (!recovering) recovery.failed_at = std::chrono::steady_clock::now();
          ++recovery.failures;
          recovery.restore = true;
          fmt::print(stderr, "{}\nrank {}: lost a peer {}; rejoining its replacement (in-memory recovery)\n", e.what(),
                     group.env().rank,
                     recovering ? std::string("while recovering") : fmt::format("at step {}", recovery.done + 1));
          // --kill R@S:rejoin: once fsdp_run announced the first replacement (its batch of
          // failures is closed: this one is a failure of its own), and the others had 300 ms
          // to start joining that epoch's ring.
          if (!recovering && cfg.kills_at(group.env().rank, recovery.done + 1, "rejoin")) {
            for (int i = 0; i < 3000 && !group.store().try_get(fsdp::kEpochKey); ++i)  // bounded: 30 s
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            kill_self();
          }
          recovery.failures += group.rejoin();  // and any failure while its ring formed
        }
      }
    } else {
      fsdp::MpiSession session(argc, argv);
      auto comm = fsdp::MpiComm::world(session);
      run_rank(comm);
    }
    return 0;
  } catch (const NoRecovery& e) {
    fmt::print(stderr, "{}\n", e.what());
    return fsdp::kNoReplacementExitStatus;
  } catch (const fsdp::Error& e) {
    fmt::print(stderr, "{}\n", e.what());
    return fsdp::exit_status(e, 2);  // an echo of another rank's failure: fsdp_run reports that rank first
  } catch (const std::exception& e) {
    fmt::print(stderr, "train: {}\n", e.what());
    return 1;
  }
}
