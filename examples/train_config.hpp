#pragma once
// examples/train.cpp's configuration: its flags, and how the runtime --precision,
// --comm-precision and --offload become compile-time policies.
#include <algorithm>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "examples/engine/model.hpp"
#include "examples/engine/optim.hpp"

namespace train_example {

// --precision names: the dtype computation sees.
inline fsdp::DType precision_dtype(const std::string& name) {
  return name == "bf16" ? fsdp::DType::bf16 : name == "fp16" ? fsdp::DType::f16 : fsdp::DType::f32;
}

// --gather-dtype names a block format or a per-tensor one (fp8tensor, fp8e5m2tensor): its
// CommPrecision Gather, with Reduce (the gradient reduction's dtype) as given;
// f(CommPrecision{}). `name` is checked by the flag.
template <class Reduce, class F>
void with_block_gather(const std::string& name, F&& f) {
  if (name == "int8") f(fsdp::CommPrecision<fsdp::Int8Blocks<>, Reduce>{});
  else if (name == "fp8") f(fsdp::CommPrecision<fsdp::F8E4M3Blocks<>, Reduce>{});
  else if (name == "fp8e5m2") f(fsdp::CommPrecision<fsdp::F8E5M2Blocks<>, Reduce>{});
  else if (name == "fp8tensor") f(fsdp::CommPrecision<fsdp::F8E4M3Tensor, Reduce>{});
  else if (name == "fp8e5m2tensor") f(fsdp::CommPrecision<fsdp::F8E5M2Tensor, Reduce>{});
  else f(fsdp::CommPrecision<fsdp::MXFP8, Reduce>{});
}
inline bool is_block_gather(const std::string& name) {
  return name == "int8" || name == "fp8" || name == "fp8e5m2" || name == "mxfp8" || name == "fp8tensor" ||
         name == "fp8e5m2tensor";
}

// Runtime --precision, --comm-precision, --gather-dtype and --offload -> the compile-time
// policies: f(Precision{}, CommPrecision{}, Offload{}). `comm_bf16`: --comm-precision bf16
// (both collectives in bf16, under f32 computation only; main() refuses it otherwise);
// `gather`: --gather-dtype (f32, bf16, fp8, fp8e5m2, mxfp8, int8, fp8tensor or fp8e5m2tensor;
// "" for --comm-precision's). Under bf16 or fp16 computation, gathers move that dtype unless
// --gather-dtype names a block or per-tensor format (main() refuses f32 and the other
// 16-bit dtype there).
template <class F>
void with_precision_and_offload(fsdp::DType param, bool comm_bf16, const std::string& gather, bool offload, F&& f) {
  auto with_offload = [&](auto precision, auto comm) {
    if (offload) f(precision, comm, fsdp::OffloadParams{});
    else f(precision, comm, fsdp::NoOffload{});
  };
  auto mixed = [&]<class T>(fsdp::MixedPrecision<T> precision) {
    if (is_block_gather(gather)) with_block_gather<T>(gather, [&](auto comm) { with_offload(precision, comm); });
    else with_offload(precision, fsdp::FullCommPrecision{});
  };
  if (param == fsdp::DType::bf16) return mixed(fsdp::MixedPrecision<fsdp::bf16>{});
  if (param == fsdp::DType::f16) return mixed(fsdp::MixedPrecision<fsdp::f16>{});
  const std::string g = gather.empty() ? (comm_bf16 ? "bf16" : "f32") : gather;
  auto with_reduce = [&]<class Reduce>(Reduce*) {
    if (is_block_gather(g)) with_block_gather<Reduce>(g, [&](auto comm) { with_offload(fsdp::FullPrecision{}, comm); });
    else if (g == "bf16") with_offload(fsdp::FullPrecision{}, fsdp::CommPrecision<fsdp::bf16, Reduce>{});
    else if constexpr (std::is_same_v<Reduce, float>) with_offload(fsdp::FullPrecision{}, fsdp::FullCommPrecision{});
    else with_offload(fsdp::FullPrecision{}, fsdp::CommPrecision<float, Reduce>{});
  };
  if (comm_bf16) with_reduce(static_cast<fsdp::bf16*>(nullptr));
  else with_reduce(static_cast<float*>(nullptr));
}

struct Config {
  int steps = 20, batch_per_rank = 8;
  std::string optimizer = "adamw", strategy = "FULL_SHARD", precision = "fp32", trace_dir;
  bool offload = false;
  std::string comm_precision = "fp32";  // --comm-precision: what collectives move under fp32 computation
  std::string gather_dtype;  // --gather-dtype: what all-gathers move ("": --comm-precision's or the compute dtype)
  std::int64_t persistence_threshold = 0;  // --persistence-threshold: units below it stay unsharded
  fsdp::ShardLayout shard_layout = {};     // --shard-layout: flat or block:K
  bool report_comm = false;  // either flag given: print the collectives of a step
  double clip = 0;  // --clip: the max gradient 2-norm; 0: no clipping
  int accumulate = 1;                  // --accumulate: micro-batches per step
  int scaler_growth_interval = 2000;   // --scaler-growth-interval: fp16's good steps before the loss scale grows
  bool sync_every_microbatch = false;  // GradientSyncMode::reduce_every_microbatch
  bool plan = false;  // --plan: print fsdp::plan's per-rank peak before the first step
  std::string plot;   // --plot FILE: with --plan, rank 0's planned timeline as a PNG (gnuplot)
  bool show_config = false;  // --show-config: print the sharded model's configuration (rank 0)
  bool optimizer_in_backward = false;  // --optimizer-in-backward: each unit steps in its post-accumulate-grad hook
  // --reshard-after-forward: "" (the strategy's), "true", "false", or N: a partial reshard
  // over groups of N consecutive ranks (N parsed into post_forward_ranks).
  std::string reshard_after_forward;
  int post_forward_ranks = 0;
  bool reshard_after_backward = true;  // --reshard-after-backward false: keep parameters between micro-batches
  std::string save_dir, resume_dir;
  int save_every = 0;  // 0: save after the last step only
  // --peer-checkpoint: after every step, a copy of this rank's state in host memory and one
  // on rank + 1 (fsdp::PeerCheckpoint::refresh), what in-memory recovery keeps up to date.
  bool peer_checkpoint = false;
  // --restart-scope rank (with --max-restarts and --peer-checkpoint): the launcher replaces
  // a failed rank only; the others rejoin it (TcpProcessGroup::rejoin), rebuild their model
  // and every rank restores from the peer checkpoint. "job": every rank restarts.
  std::string restart_scope = "job";
  // --kill RANK@STEP[:PHASE], once or more: that rank kills itself (SIGKILL) in step STEP
  // (1-based; 0, RANK@end: after the last step and its checkpoint), on the job's first
  // start only (a restarted or replacement process injects nothing). Fault injection for
  // --max-restarts and --restart-scope rank.
  struct Kill {
    int rank = -1, step = 0;
    // Where in the step: "begin" (before its forward), "backward" (once the first unit's
    // gradient is final: some reductions done, others not), "optimizer" (after the
    // gradients are final, before the optimizer), "save" (the step's checkpoint being
    // written in the background), "end" (step 0: after training). In the in-memory
    // recovery from another rank's failure in that step, on a survivor: "recovery" (after
    // every rank agreed what to restore, before the copies move), "rejoin" (before it
    // rejoins, once fsdp_run announced the first replacement).
    std::string phase = "begin";
    bool in_recovery() const { return phase == "recovery" || phase == "rejoin"; }
  };
  std::vector<Kill> kills;
  bool kills_in(std::string_view phase) const {
    return std::any_of(kills.begin(), kills.end(), [&](const Kill& k) { return k.phase == phase; });
  }
  // Whether rank `rank` dies at `step` in `phase`.
  bool kills_at(int rank, int step, std::string_view phase) const {
    return std::any_of(kills.begin(), kills.end(), [&](const Kill& k) { return k.rank == rank && k.step == step && k.phase == phase; });
  }
  // The job's id (TORCHELASTIC_RUN_ID, under a launcher), saved with every checkpoint: a
  // restarted job resumes only from its own checkpoints, not from another job's left in
  // the same --save directory. Empty: not saved.
  std::string run_id;
  // --local-gradients: what the engine's gradients are over its local batch (its loss a mean
  // or a sum over its samples, model.loss), passed to fsdp as ShardOptions::local_gradients.
  fsdp::LocalGradients local_gradients = fsdp::LocalGradients::mean;
  engine::ModelConfig model{.in = 16, .dim = 64, .hidden = 256, .out = 4, .blocks = 8, .seed = 1};

  // SGD's learning rate. A micro-batch's gradient summed over the global batch is larger
  // by its size (ranks x --batch) than the mean's, so under --local-gradients sum the rate is
  // divided by that size: the same SGD steps as the mean's, to rounding (with --accumulate
  // too: under mean the micro-batches' gradients add up as well), though not with --clip,
  // whose threshold the larger norm crosses sooner. AdamW's steps do not depend on the
  // gradients' scale, so its rate stays.
  float sgd_lr(int world) const {
    const float lr = 0.05f;
    if (local_gradients == fsdp::LocalGradients::mean) return lr;
    return lr / static_cast<float>(static_cast<std::int64_t>(world) * batch_per_rank);
  }
  // --optimizer muon: Muon's defaults, AdamW's options (the example's) for what is no matrix.
  engine::Muon::Options muon_options(const engine::AdamW::Options& adamw) const {
    engine::Muon::Options o;
    o.adamw = adamw;
    return o;
  }
  // fp16's loss scaler starts at 2^16 (PyTorch's default), sized for mean gradients; sums are
  // larger by the global batch, so under --local-gradients sum it starts that much lower
  // (to a power of two), or its first steps overflow and are skipped.
  fsdp::GradScalerOptions scaler_options(int world) const {
    fsdp::GradScalerOptions o;
    o.growth_interval = scaler_growth_interval;
    if (local_gradients == fsdp::LocalGradients::sum)
      for (std::int64_t n = static_cast<std::int64_t>(world) * batch_per_rank; n > 1 && o.init_scale > 1; n = (n + 1) / 2)
        o.init_scale /= 2;
    return o;
  }
};

}  // namespace train_example
