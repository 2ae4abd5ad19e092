// The README's main example: the reference model trained sharded on N in-process ranks
// (FullShard unless --strategy says otherwise; f32 unless --precision says otherwise;
// optionally with --offload), next to the same model trained unsharded on the same global
// batch with the same casts. Each step prints the loss of both and every rank's live /
// peak bytes in the Device's device space, as counted by its Device; the last line sums
// it up:
//   final: loss=<x> unsharded_loss=<y> peak_bytes_per_rank=<a> unsharded_peak_bytes=<b>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <optional>

#include <fsdp/async_communicator.hpp>
#include <fsdp/trace_json.hpp>

#include "examples/engine/fsdp_integration.hpp"

namespace {

// --precision names: the dtype computation sees.
fsdp::DType precision_dtype(const std::string& name) {
  return name == "bf16" ? fsdp::DType::bf16 : name == "fp16" ? fsdp::DType::f16 : fsdp::DType::f32;
}

// Runtime --precision and --offload -> the compile-time policies: f(Precision{}, Offload{}).
template <class F>
void with_precision_and_offload(fsdp::DType param, bool offload, F&& f) {
  auto with_offload = [&](auto precision) {
    if (offload) f(precision, fsdp::OffloadParams{});
    else f(precision, fsdp::NoOffload{});
  };
  if (param == fsdp::DType::bf16) with_offload(fsdp::MixedPrecision<fsdp::bf16>{});
  else if (param == fsdp::DType::f16) with_offload(fsdp::MixedPrecision<fsdp::f16>{});
  else with_offload(fsdp::FullPrecision{});
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, steps = 20, batch_per_rank = 8;
  std::string optimizer = "adamw", strategy = "FULL_SHARD", precision = "fp32", mesh_text, trace_dir;
  bool offload = false;
  engine::ModelConfig model_config{.in = 16, .dim = 64, .hidden = 256, .out = 4, .blocks = 8, .seed = 1};
  CLI::App app{"Train the reference model sharded with fsdp on in-process ranks"};
  app.add_option("--ranks", ranks, "number of ranks (threads)")->check(CLI::Range(1, 256));
  app.add_option("--steps", steps, "training steps")->check(CLI::Range(1, 1000000));
  app.add_option("--batch", batch_per_rank, "samples per rank per step")->check(CLI::Range(1, 1 << 20));
  app.add_option("--optimizer", optimizer, "sgd or adamw")->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--blocks", model_config.blocks, "residual blocks")->check(CLI::Range(0, 1000));
  app.add_option("--dim", model_config.dim, "model width")->check(CLI::Range(1, 1 << 16));
  app.add_option("--hidden", model_config.hidden, "block hidden width")->check(CLI::Range(1, 1 << 16));
  app.add_option("--strategy", strategy, "sharding strategy: " + fsdp::strategy_names() + " (any case)");
  app.add_option("--mesh", mesh_text,
                 "REPLICATExSHARD ranks for the hybrid strategies (default: 2 x ranks/2 when ranks is even and "
                 "at least 4, else 1 x ranks)");
  app.add_option("--precision", precision,
                 "fp32, bf16 (MixedPrecision<bf16>) or fp16 (MixedPrecision<f16> with a ShardedGradScaler)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_flag("--offload", offload, "OffloadParams: sharded parameters, gradients and optimizer state in host space");
  app.add_option("--trace", trace_dir, "write a Chrome / Perfetto trace per rank into this directory (rankN.json)");
  CLI11_PARSE(app, argc, argv);
  fsdp::MeshShape mesh_shape{1, ranks};
  try {
    fsdp::with_strategy(strategy, [](auto) {});  // an unknown name fails here, listing the valid ones
    if (!mesh_text.empty()) mesh_shape = fsdp::parse_mesh_shape(mesh_text);
    else if (ranks >= 4 && ranks % 2 == 0) fsdp::with_strategy(strategy, [&](auto s) {
      if (decltype(s)::hybrid) mesh_shape = {2, ranks / 2};
    });
    if (mesh_shape.size() != ranks)
      throw fsdp::Error("--mesh " + mesh_shape.str() + " needs " + std::to_string(mesh_shape.size()) + " ranks, not " +
                        std::to_string(ranks));
  } catch (const fsdp::Error& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 2;
  }

  const auto make_sgd = [] { return engine::Sgd(0.05f); };
  engine::AdamW::Options adam;
  adam.lr = 1e-3f;

  // Unsharded reference: one model, the whole global batch, every byte through a counting
  // Device. Under --precision bf16 / fp16 it computes with a 16-bit copy of the model, as
  // MixedPrecision does (without loss scaling, so fp16 agrees only roughly).
  const fsdp::DType param_dtype = precision_dtype(precision);
  fsdp::HostDevice reference_device;
  engine::DeviceAllocator<fsdp::HostDevice> reference_alloc(reference_device);
  engine::Model reference(model_config, reference_alloc);
  std::optional<engine::Model> reference_compute;
  if (param_dtype != fsdp::DType::f32) reference_compute.emplace(model_config, reference_alloc, param_dtype, param_dtype);
  engine::AdamW reference_adam(adam, reference_alloc);
  engine::Sgd reference_sgd = make_sgd();
  std::vector<double> reference_loss;
  auto reference_step = [&](auto& opt, const engine::Batch& batch) {
    return reference_compute ? engine::unsharded_mixed_step(reference, *reference_compute, opt, batch, param_dtype)
                             : engine::unsharded_step(reference, opt, batch);
  };
  for (int s = 0; s < steps; ++s) {
    auto batch = engine::make_batch(model_config, s, 0, static_cast<std::int64_t>(ranks) * batch_per_rank);
    reference_loss.push_back(optimizer == "sgd" ? reference_step(reference_sgd, batch) : reference_step(reference_adam, batch));
  }

  // Sharded: every rank builds the model, shards it, and trains on its slice of the batch.
  std::vector<fsdp::MemoryStats> stats(static_cast<std::size_t>(ranks)), host_stats(stats.size());
  int skipped_steps = 0;  // fp16: steps the loss scaler skipped (the same on every rank)
  std::vector<double> loss(static_cast<std::size_t>(steps));
  std::mutex print;
  fsdp::ThreadGroup(ranks).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    // Collectives run on this rank's communication thread, overlapping compute; every
    // collective of this rank goes through it, so all ranks issue them in one order.
    fsdp::Trace trace(r);
    fsdp::Trace* tracing = trace_dir.empty() ? nullptr : &trace;
    fsdp::AsyncCommunicator stream(comm, tracing);
    // A mesh serves every strategy: the hybrid ones shard inside its shard groups, the
    // others use its whole world.
    fsdp::DeviceMesh mesh(stream, mesh_shape);
    mesh.shard_group().set_trace(tracing);
    mesh.replicate_group().set_trace(tracing);
    engine::Model model(model_config);
    fsdp::HostDevice device;
    // Runtime flags -> compile-time policies: one instantiation per combination.
    auto train = [&](auto chosen, auto mixed, auto off) {
      auto sharded = fsdp::shard<decltype(chosen), decltype(mixed), decltype(off)>(model, mesh, device, engine::Wrap{});
      sharded.set_trace(tracing);
      // Optimizer state next to the shards it steps: host space when they are offloaded.
      engine::DeviceAllocator<fsdp::HostDevice> alloc(device, decltype(off)::offload ? fsdp::MemorySpace::host : fsdp::MemorySpace::device);
      engine::AdamW adamw(adam, alloc);
      engine::Sgd sgd = make_sgd();
      fsdp::ShardedGradScaler scaler(stream, device);  // fp16 only
      auto step = [&](auto& opt, const engine::Batch& batch) {
        if (param_dtype != fsdp::DType::f16) return engine::sharded_step(model, sharded, opt, batch);
        const auto result = engine::sharded_scaled_step(model, sharded, opt, scaler, batch);
        if (!result.stepped && r == 0) ++skipped_steps;
        return result.loss;
      };
      for (int s = 0; s < steps; ++s) {
        auto batch = engine::make_batch(model_config, s, static_cast<std::int64_t>(r) * batch_per_rank, batch_per_rank);
        double local = optimizer == "sgd" ? step(sgd, batch) : step(adamw, batch);
        double global = 0;  // equal batches per rank: the global loss is the mean of the ranks'
        stream.all_reduce(&local, &global, 1, fsdp::DType::f64, fsdp::ReduceOp::avg).wait();
        stats[static_cast<std::size_t>(r)] = device.stats(fsdp::MemorySpace::device);
        host_stats[static_cast<std::size_t>(r)] = device.stats(fsdp::MemorySpace::host);
        stream.barrier().wait();  // every rank's stats for this step are in
        if (r == 0) {
          std::vector<std::size_t> live, peak;
          for (auto& st : stats) { live.push_back(st.live_bytes); peak.push_back(st.peak_bytes); }
          std::lock_guard lk(print);
          fmt::print("step {:>3}: loss={:.6f} unsharded_loss={:.6f} live_bytes={} peak_bytes={}\n", s + 1, global,
                     reference_loss[static_cast<std::size_t>(s)], live, peak);
          loss[static_cast<std::size_t>(s)] = global;
        }
        stream.barrier().wait();  // rank 0 has read the stats before anyone overwrites them
      }
    };
    fsdp::with_strategy(strategy, [&](auto chosen) {
      with_precision_and_offload(param_dtype, offload, [&](auto mixed, auto off) { train(chosen, mixed, off); });
    });
    if (tracing) {
      std::filesystem::create_directories(trace_dir);
      fsdp::write_chrome_json(trace, (std::filesystem::path(trace_dir) / ("rank" + std::to_string(r) + ".json")).string());
    }
  });

  std::size_t peak = 0, host_peak = 0;
  for (auto& st : stats) peak = std::max(peak, st.peak_bytes);
  for (auto& st : host_stats) host_peak = std::max(host_peak, st.peak_bytes);
  const std::size_t unsharded_peak = reference_device.stats().peak_bytes;
  fmt::print("model: {} blocks, dim {}, hidden {}; {} ranks x {} samples; optimizer {}; strategy {} on a {} mesh; "
             "precision {}{}\n",
             model_config.blocks, model_config.dim, model_config.hidden, ranks, batch_per_rank, optimizer, strategy,
             mesh_shape.str(), precision, offload ? ", offload" : "");
  fmt::print("per-rank peak is {:.1f}% of unsharded\n", 100.0 * static_cast<double>(peak) / static_cast<double>(unsharded_peak));
  if (offload) fmt::print("host space: peak {} B per rank (the offloaded shards and the optimizer state)\n", host_peak);
  if (param_dtype == fsdp::DType::f16) fmt::print("fp16: the loss scaler skipped {} of {} steps\n", skipped_steps, steps);
  if (!trace_dir.empty()) fmt::print("traces: {}/rank0.json .. rank{}.json (open in ui.perfetto.dev or chrome://tracing)\n", trace_dir, ranks - 1);
  fmt::print("final: loss={:.6f} unsharded_loss={:.6f} peak_bytes_per_rank={} unsharded_peak_bytes={}\n", loss.back(),
             reference_loss.back(), peak, unsharded_peak);
  return 0;
}
