#pragma once
// examples/train.cpp's checkpoints: the metadata a --save checkpoint carries beside the
// model and the optimizer state, and the checks --resume makes before anything trains.
#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include <fsdp/checkpoint/checkpoint.hpp>
#include <fsdp/model/grad_scaler.hpp>

#include "examples/train_config.hpp"

namespace train_example {

// What a checkpoint of this example holds beside the model and the optimizer state (its
// metadata): what a resumed run needs to continue exactly where the saved one stopped.
struct Resume {
  int step = 0;   // completed steps
  int ranks = 0;  // that saved it
  std::int64_t global_batch = 0;
  std::string optimizer, model;
  std::optional<fsdp::GradScalerState> scaler;  // fp16 runs
  int skipped_steps = 0;                        // fp16: skipped so far
};

inline std::string model_text(const Config& cfg) {
  return fmt::format("blocks {}, dim {}, hidden {}", cfg.model.blocks, cfg.model.dim, cfg.model.hidden);
}

inline std::map<std::string, std::string> checkpoint_metadata(const Config& cfg, int world, int step,
                                                       const std::optional<fsdp::GradScalerState>& scaler, int skipped) {
  std::map<std::string, std::string> m{{"train.step", std::to_string(step)},
                                       {"train.ranks", std::to_string(world)},
                                       {"train.global_batch", std::to_string(static_cast<std::int64_t>(world) * cfg.batch_per_rank)},
                                       {"train.optimizer", cfg.optimizer},
                                       {"train.accumulate", std::to_string(cfg.accumulate)},
                                       {"train.local_gradients", std::string(fsdp::name_of(cfg.local_gradients))},
                                       {"train.model", model_text(cfg)}};
  if (!cfg.run_id.empty()) m["train.run_id"] = cfg.run_id;
  if (scaler) {
    m["train.loss_scale"] = fmt::format("{}", scaler->scale);  // shortest text that reads back exactly
    m["train.loss_scale_good_steps"] = std::to_string(scaler->good_steps);
    m["train.skipped_steps"] = std::to_string(skipped);
  }
  return m;
}

// The fp16 loss scaler's state and skipped steps in checkpoint_metadata's keys (a
// checkpoint on disk, a peer checkpoint's copy), into `r`; `where` names the source.
inline void read_scaler(const std::map<std::string, std::string>& metadata, const std::string& where, Resume& r) {
  auto number = [&](const std::string& key, auto value) {
    const auto it = metadata.find(key);
    if (it == metadata.end())
      fsdp::detail::fail(where, ": has no loss scaler state ('", key, "'; not saved with --precision fp16), which this run needs");
    const std::string& t = it->second;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
    if (ec != std::errc{} || end != t.data() + t.size()) fsdp::detail::fail(where, ": metadata '", key, "' is not a number: '", t, "'");
    return value;
  };
  r.scaler = fsdp::GradScalerState{number("train.loss_scale", 0.0), number("train.loss_scale_good_steps", 0)};
  r.skipped_steps = number("train.skipped_steps", 0);
}

// The checkpoint in cfg.resume_dir, checked against this run before anything trains: its
// index and every file's header (checksums are verified by the load), then the metadata.
// Not a collective: every rank (or the launcher) reads it.
inline Resume read_resume(const Config& cfg, int world) {
  const std::string where = "--resume '" + cfg.resume_dir + "'";
  const auto metadata = fsdp::ShardedCheckpointSource(cfg.resume_dir).metadata();
  auto text = [&](const std::string& key) {
    auto it = metadata.find(key);
    if (it == metadata.end()) fsdp::detail::fail(where, ": no metadata '", key, "' (not saved by this example's --save)");
    return it->second;
  };
  auto number = [&](const std::string& key, auto value) {
    const std::string t = text(key);
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
    if (ec != std::errc{} || end != t.data() + t.size()) fsdp::detail::fail(where, ": metadata '", key, "' is not a number: '", t, "'");
    return value;
  };
  Resume r;
  r.step = number("train.step", 0);
  r.ranks = number("train.ranks", 0);
  r.global_batch = number("train.global_batch", std::int64_t{0});
  r.optimizer = text("train.optimizer");
  r.model = text("train.model");
  const std::int64_t global_batch = static_cast<std::int64_t>(world) * cfg.batch_per_rank;
  if (r.global_batch != global_batch)
    fsdp::detail::fail(where, ": saved with a global batch of ", r.global_batch, " samples, but this run's is ", global_batch,
                       " (", world, " ranks x --batch ", cfg.batch_per_rank, "); resuming would train on other data");
  if (cfg.steps <= r.step)
    fsdp::detail::fail(where, ": saved after step ", r.step, "; --steps ", cfg.steps, " leaves nothing to train");
  // Checkpoints saved before --accumulate existed have no such key: they trained one
  // micro-batch per step.
  if (const int k = metadata.count("train.accumulate") ? number("train.accumulate", 0) : 1; k != cfg.accumulate)
    fsdp::detail::fail(where, ": saved with --accumulate ", k, ", this run uses ", cfg.accumulate,
                       "; resuming would train on other micro-batches");
  if (r.optimizer != cfg.optimizer)
    fsdp::detail::fail(where, ": saved with --optimizer ", r.optimizer, ", this run uses ", cfg.optimizer);
  // Optimizer moments and the loss scale are sized to the gradients, which sums make larger
  // by the global batch. Checkpoints saved before --local-gradients existed used means.
  const std::string saved_gradients = metadata.count("train.local_gradients") ? text("train.local_gradients") : "mean";
  if (saved_gradients != fsdp::name_of(cfg.local_gradients))
    fsdp::detail::fail(where, ": saved with --local-gradients ", saved_gradients, ", this run uses ",
                       fsdp::name_of(cfg.local_gradients), "; the optimizer's state and the loss scale are sized to those gradients");
  if (r.model != model_text(cfg))
    fsdp::detail::fail(where, ": saved for a model of ", r.model, ", this run's has ", model_text(cfg));
  if (precision_dtype(cfg.precision) == fsdp::DType::f16) read_scaler(metadata, where, r);
  return r;
}

// After a restart (TORCHELASTIC_RESTART_COUNT > 0, --max-restarts): the step of the last
// checkpoint this job committed to --save, or none (no --save, nothing committed yet, or
// only another job's checkpoint there: start from scratch, as the first start did). Not a
// collective: every rank reads the same directory, which no rank of the failed start
// writes any more (the launcher reaped them all), so they agree.
inline std::optional<int> restart_step(const Config& cfg, int world) {
  // An index.json, not just the directory: --save into an existing empty directory works,
  // and a job killed before its first save then finds it empty.
  if (cfg.save_dir.empty() ||
      !std::filesystem::exists(fsdp::checkpoint::committed_checkpoint_dir(cfg.save_dir) / "index.json"))
    return std::nullopt;
  const auto metadata = fsdp::ShardedCheckpointSource(cfg.save_dir).metadata();
  const auto id = metadata.find("train.run_id");
  if (cfg.run_id.empty() || id == metadata.end() || id->second != cfg.run_id || !metadata.count("train.step"))
    return std::nullopt;
  // The same checks as --resume (global batch, optimizer, model, ...), but for the step
  // (--steps at its largest: any saved step leaves something to train): a run id shared by
  // two jobs (one set by hand) must not resume, or end, the wrong job.
  Config probe = cfg;
  probe.resume_dir = cfg.save_dir;
  probe.steps = std::numeric_limits<int>::max();
  return read_resume(probe, world).step;
}

// The checkpoint to resume from, checked; none without --resume.
inline std::optional<Resume> resume_point(const Config& cfg, int world) {
  if (cfg.resume_dir.empty()) return std::nullopt;
  return read_resume(cfg, world);
}

}  // namespace train_example
