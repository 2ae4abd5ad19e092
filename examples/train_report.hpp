#pragma once
// examples/train.cpp's reporting: what rank 0 knows at the end of training, and the lines
// it prints (the README's `final:` line among them); and the mesh the flags choose.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "examples/train_config.hpp"

namespace train_example {

// What rank 0 knows at the end of training.
struct Summary {
  double loss = 0;
  std::uint64_t fingerprint = 0;  // xxh64 of every trained parameter's bits, in FQN order
  std::size_t peak = 0, host_peak = 0;
  int skipped_steps = 0;  // fp16: steps the loss scaler skipped (the same on every rank)
  std::size_t peer_bytes = 0;  // --peer-checkpoint: host memory of rank 0's copies
  bool peer_on_replicas = false;  // and whether its replicas hold them (none sent to rank + 1)
  // --restart-scope rank, the largest over the ranks: recoveries a survivor went through,
  // the launcher's restarts, the steps trained again (the interrupted one included), and
  // from a failure being caught to the model restored.
  int failures = 0, restarts = 0, redone_steps = 0;
  std::int64_t recovery_ms_max = 0;
  fsdp::CollectiveCounts last_step;  // rank 0's collectives in the last step, every group together
  fsdp::CollectiveCounts last_step_post_forward;  // those of them inside --reshard-after-forward N's group
};

// One rank's in-memory recoveries (--restart-scope rank), across its trainings.
struct Recovery {
  bool restore = false;  // the next training restores from the peer checkpoint
  bool replacement = false;  // started for a failed rank: it redoes nothing, it has not trained
  int failures = 0;      // failures this rank survived
  int done = 0;          // steps done when the last failure was caught
  int redone_steps = 0;
  std::int64_t recovery_ms_max = 0;
  std::chrono::steady_clock::time_point failed_at{};  // when the failure recovered from was caught (the first of several)
};

// Unsharded reference: one model, the whole global batch, every byte through a counting
// Device. Under --precision bf16 / fp16 it computes with a 16-bit copy of the model, as
// MixedPrecision does (without loss scaling, so fp16 agrees only roughly).
struct Reference {
  std::vector<double> loss;
  std::size_t peak = 0;
};

// The mesh for `world` ranks: --mesh if given; 2 x world/2 for a hybrid strategy on an even
// world of at least 4; else 1 x world.
inline fsdp::MeshShape choose_mesh(const std::string& strategy, const std::string& mesh_text, int world) {
  fsdp::MeshShape mesh{1, world};
  fsdp::with_strategy(strategy, [](auto) {});  // an unknown name fails here, listing the valid ones
  if (!mesh_text.empty()) mesh = fsdp::parse_mesh_shape(mesh_text, "--mesh");  // whole, its product checked
  else if (world >= 4 && world % 2 == 0) fsdp::with_strategy(strategy, [&](auto s) {
    if (decltype(s)::hybrid) mesh = {2, world / 2};
  });
  if (mesh.ranks() != world)
    fsdp::detail::fail("--mesh ", mesh.str(), " needs ", mesh.ranks(), " ranks, not ", world);
  return mesh;
}

inline void print_summary(const Config& cfg, int world, fsdp::MeshShape mesh_shape, const std::string& backend,
                   const Summary& s, const Reference& ref) {
  fmt::print("model: {} blocks, dim {}, hidden {}; {} ranks x {} samples; optimizer {}; strategy {} on a {} mesh; "
             "precision {}{}{}{}\n",
             cfg.model.blocks, cfg.model.dim, cfg.model.hidden, world, cfg.batch_per_rank, cfg.optimizer, cfg.strategy,
             mesh_shape.str(), cfg.precision, cfg.offload ? ", offload" : "",
             fmt::format("{}{}", cfg.accumulate > 1 ? fmt::format("; {} micro-batches per step{}", cfg.accumulate,
                                                                  cfg.sync_every_microbatch ? ", each reduced" : "")
                                                    : "",
                         cfg.clip > 0 ? fmt::format("; gradients clipped to norm {}", cfg.clip) : "") +
                 (cfg.comm_precision != "fp32" ? fmt::format("; collectives in {}", cfg.comm_precision) : "") +
                 (cfg.gather_dtype.empty() ? "" : fmt::format("; all-gathers in {}", cfg.gather_dtype)) +
                 (cfg.persistence_threshold > 0
                      ? fmt::format("; units under {} elements unsharded", cfg.persistence_threshold)
                      : "") +
                 (cfg.shard_layout == fsdp::ShardLayout::element_flat() ? "" : "; shard layout " + fsdp::name_of(cfg.shard_layout)) +
                 (cfg.optimizer_in_backward ? "; optimizer steps in backward" : "") +
                 (cfg.reshard_after_forward.empty() ? "" : "; reshard after forward " + cfg.reshard_after_forward) +
                 (cfg.reshard_after_backward ? "" : "; parameters kept between micro-batches") +
                 (cfg.local_gradients == fsdp::LocalGradients::sum ? "; gradients summed over each rank's batch" : ""),
             backend == "thread" ? "" : "; backend " + backend);
  fmt::print("per-rank peak is {:.1f}% of unsharded\n", 100.0 * static_cast<double>(s.peak) / static_cast<double>(ref.peak));
  if (cfg.offload) fmt::print("host space: peak {} B per rank (the offloaded shards and the optimizer state)\n", s.host_peak);
  if (cfg.restart_scope == "rank")
    fmt::print("recovered: failures={} restarts={} redone_steps={} recovery_ms_max={}\n", s.failures, s.restarts, s.redone_steps,
               s.recovery_ms_max);
  if (cfg.peer_checkpoint && s.peer_on_replicas)
    fmt::print("peer checkpoint: {} B of host memory on rank 0 (a copy of its state, which its replicas also hold, refreshed "
               "every step, and the buffer of the previous one, reused)\n",
               s.peer_bytes);
  else if (cfg.peer_checkpoint)
    fmt::print("peer checkpoint: {} B of host memory on rank 0 (a copy of its state and one of rank {}'s, refreshed every step, "
               "and the buffers of the previous ones, reused)\n",
               s.peer_bytes, world - 1);
  if (precision_dtype(cfg.precision) == fsdp::DType::f16)
    fmt::print("fp16: the loss scaler skipped {} of {} steps\n", s.skipped_steps, cfg.steps);
  if (!cfg.trace_dir.empty())
    fmt::print("traces: {}/rank0.json .. rank{}.json (open in ui.perfetto.dev or chrome://tracing)\n", cfg.trace_dir, world - 1);
  if (cfg.report_comm) {
    using fsdp::Collective;
    const auto& c = s.last_step;
    std::uint64_t calls = 0, bytes = 0;
    for (const auto& e : c.by_kind) { calls += e.calls; bytes += e.bytes; }
    fmt::print("comm: last step on rank 0: {} collectives, {} B (all_gather {} x, {} B; reduce_scatter {} x, {} B; "
               "all_reduce {} x, {} B)\n",
               calls, bytes, c[Collective::all_gather].calls, c[Collective::all_gather].bytes,
               c[Collective::reduce_scatter].calls, c[Collective::reduce_scatter].bytes, c[Collective::all_reduce].calls,
               c[Collective::all_reduce].bytes);
    if (cfg.post_forward_ranks > 0)
      fmt::print("comm: of which inside groups of {} ranks (the backward all-gathers of the partial reshard): all_gather {} x, {} B\n",
                 cfg.post_forward_ranks, s.last_step_post_forward[Collective::all_gather].calls,
                 s.last_step_post_forward[Collective::all_gather].bytes);
  }
  fmt::print("parameters: xxh64={:016x}\n", s.fingerprint);
  fmt::print("final: loss={:.6f} unsharded_loss={:.6f} peak_bytes_per_rank={} unsharded_peak_bytes={}\n", s.loss,
             ref.loss.back(), s.peak, ref.peak);
}

}  // namespace train_example
