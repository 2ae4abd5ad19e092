// bench/precision_offload: every MixedPrecision x OffloadParams combination of
// docs/precision_and_offload.md on the same model and 4 thread ranks under FullShard, one
// row each: bytes communicated per step per rank (by collective), and per-rank peak bytes
// in the Device's device space and host space. The baseline, measured in the same run, is
// the same model trained unsharded on one thread with the whole global batch.
//
//   precision_offload [--ranks 4] [--steps 3] [--json PATH]
//
// Everything printed is an exact byte count, so the run also checks the invariants the
// doc states (16-bit all-gathers are half of fp32's; offload changes no collective byte and
// moves exactly the shards to the host) and exits 1 if one does not hold. The last holds
// on 2 or more ranks only, so it is skipped on 1 (see the check).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

#include "examples/engine/fsdp_integration.hpp"

namespace {

using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;

// The doc's reference model and setup; its figures depend on them, so they are not options.
const engine::ModelConfig kConfig{.in = 16, .dim = 64, .hidden = 256, .out = 4, .blocks = 8, .seed = 1};
constexpr int kBatch = 8;  // samples per rank per step
constexpr float kLr = 0.05f;

struct Row {
  std::string name;
  std::uint64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;  // bytes of the last step, rank 0
  std::size_t device_peak = 0, host_peak = 0;                         // max over ranks, over all steps
  int skipped = -1;                                                   // steps the fp16 scaler skipped; -1: no scaler
};

template <class Precision, class Offload, bool Fp16Scaler>
Row run(std::string name, int ranks, int steps) {
  Row row{std::move(name)};
  std::vector<std::size_t> device_peaks(ranks), host_peaks(ranks);
  fsdp::ThreadGroup(ranks).run([&](fsdp::ThreadComm& comm) {
    Counting counted(comm);
    engine::Model model(kConfig);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, Precision, Offload>(model, counted, device, engine::Wrap{});
    fsdp::ShardedGradScaler scaler(counted, fsdp::GradScalerOptions{.init_scale = 1024});  // fp16 rows only
    engine::Sgd sgd(kLr);
    int skipped = 0;
    for (int s = 0; s < steps; ++s) {
      // Count the last step only: the first one also records the execution order.
      if (s == steps - 1) counted.reset();
      const auto batch = engine::make_batch(kConfig, s, comm.rank() * kBatch, kBatch);
      if constexpr (Fp16Scaler) {  // the scaler loop of the doc's fp16 section
        if (!engine::sharded_scaled_step(model, sm, sgd, scaler, batch).stepped) ++skipped;
      } else {
        engine::sharded_step(model, sm, sgd, batch);
      }
    }
    device_peaks[comm.rank()] = device.stats(fsdp::MemorySpace::device).peak_bytes;
    host_peaks[comm.rank()] = device.stats(fsdp::MemorySpace::host).peak_bytes;
    if (comm.rank() == 0) {
      using fsdp::Collective;
      const auto& k = counted.counts();
      row.all_gather = k[Collective::all_gather].bytes;
      row.reduce_scatter = k[Collective::reduce_scatter].bytes;
      row.all_reduce = k[Collective::all_reduce].bytes;
      if (Fp16Scaler) row.skipped = skipped;  // step() answers the same on every rank
    }
  });
  row.device_peak = *std::max_element(device_peaks.begin(), device_peaks.end());
  row.host_peak = *std::max_element(host_peaks.begin(), host_peaks.end());
  return row;
}

Row unsharded(int ranks, int steps) {
  fsdp::HostDevice device;
  engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
  engine::Model model(kConfig, alloc);
  engine::Sgd sgd(kLr);
  for (int s = 0; s < steps; ++s)
    engine::unsharded_step(model, sgd, engine::make_batch(kConfig, s, 0, static_cast<std::int64_t>(ranks) * kBatch));
  return {"unsharded (1 thread)", 0, 0, 0, device.stats().peak_bytes, 0};
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, steps = 3;
  std::string json_path;
  CLI::App app{"Communication and per-rank device / host peak memory of each precision and offload combination"};
  app.add_option("--ranks", ranks, "thread ranks")->check(CLI::Range(1, 64));
  app.add_option("--steps", steps, "training steps; bytes are those of the last")->check(CLI::Range(1, 100000));
  app.add_option("--json", json_path, "also write the rows as JSON");
  CLI11_PARSE(app, argc, argv);

  using fsdp::bf16, fsdp::f16, fsdp::FullPrecision, fsdp::MixedPrecision, fsdp::NoOffload, fsdp::OffloadParams;
  const Row base = unsharded(ranks, steps);
  // In pairs, offload off then on, so each check below compares a row with its neighbour.
  const std::vector<Row> rows{
      run<FullPrecision, NoOffload, false>("fp32", ranks, steps),
      run<FullPrecision, OffloadParams, false>("fp32 offload", ranks, steps),
      run<MixedPrecision<bf16>, NoOffload, false>("bf16", ranks, steps),
      run<MixedPrecision<bf16>, OffloadParams, false>("bf16 offload", ranks, steps),
      run<MixedPrecision<bf16, float>, NoOffload, false>("bf16/f32", ranks, steps),
      run<MixedPrecision<bf16, float>, OffloadParams, false>("bf16/f32 offload", ranks, steps),
      run<MixedPrecision<f16>, NoOffload, true>("fp16+scaler", ranks, steps),
      run<MixedPrecision<f16>, OffloadParams, true>("fp16+scaler offload", ranks, steps),
  };

  fmt::print("model: {} blocks, dim {}, hidden {} ({} ranks x {} samples, SGD {}; FullShard, default BackwardPre "
             "prefetch; synchronous ThreadComm, HostDevice); bytes are per rank, of step {} of {}; peaks over all "
             "steps\n\n",
             kConfig.blocks, kConfig.dim, kConfig.hidden, ranks, kBatch, kLr, steps, steps);
  fmt::print("| configuration | all-gather B/step | reduce-scatter B/step | all-reduce B/step | device peak B/rank "
             "| host peak B/rank | all-gather vs fp32 | device peak vs unsharded | skipped steps |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  nlohmann::json out = nlohmann::json::array();
  for (const Row& r : rows) {
    fmt::print("| {} | {} | {} | {} | {} | {} | {:.2f}x | {:.1f}% | {} |\n", r.name, r.all_gather, r.reduce_scatter,
               r.all_reduce, r.device_peak, r.host_peak, double(r.all_gather) / double(rows[0].all_gather),
               100.0 * double(r.device_peak) / double(base.device_peak),
               r.skipped < 0 ? std::string("-") : std::to_string(r.skipped));
    out.push_back({{"configuration", r.name}, {"all_gather_bytes", r.all_gather},
                   {"reduce_scatter_bytes", r.reduce_scatter}, {"all_reduce_bytes", r.all_reduce},
                   {"device_peak_bytes_per_rank", r.device_peak}, {"host_peak_bytes_per_rank", r.host_peak}});
    if (r.skipped >= 0) out.back()["skipped_steps"] = r.skipped;
  }
  fmt::print("| {} | 0 | 0 | 0 | {} | 0 | - | 100.0% | - |\n", base.name, base.device_peak);
  out.push_back({{"configuration", "unsharded"}, {"device_peak_bytes_per_rank", base.device_peak}});
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";

  // The doc's invariants. Every figure is an exact count, so equality is the right test.
  std::vector<std::string> failed;
  auto check = [&](bool ok, const Row& r, const std::string& what) {
    if (!ok) failed.push_back(fmt::format("{}: {}", r.name, what));
  };
  const std::size_t shards = rows[1].host_peak;  // fp32 offload: the f32 parameter and gradient shards
  for (std::size_t i = 0; i < rows.size(); i += 2) {
    const Row &off = rows[i], &on = rows[i + 1];
    if (i > 0) {  // every row but fp32 gathers in a 16-bit Param dtype
      check(2 * off.all_gather == rows[0].all_gather, off, "all-gather bytes are not half of fp32's");
      check(2 * on.all_gather == rows[0].all_gather, on, "all-gather bytes are not half of fp32's");
    }
    check(on.all_gather == off.all_gather && on.reduce_scatter == off.reduce_scatter &&
              on.all_reduce == off.all_reduce,
          on, "offload changed collective bytes");
    check(off.host_peak == 0, off, "host space used without offload");
    // Under offload the reduction's output is a device temporary, since it cannot land in
    // the host shard. On one rank it is a whole unit's gradient and can raise the peak.
    if (ranks > 1)
      check(on.device_peak + on.host_peak == off.device_peak, on, "device peak + host peak != device peak without offload");
    check(on.host_peak == shards, on, fmt::format("host peak != the shards ({} B)", shards));
  }
  if (!failed.empty()) {
    for (const auto& f : failed) fmt::print(stderr, "precision_offload: check failed: {}\n", f);
    return 1;
  }
  fmt::print("\nchecks passed: 16-bit all-gathers are half of fp32's; offload changes no collective byte, and moves "
             "exactly the shards ({} B) {}to the host\n",
             shards, ranks > 1 ? "from the device peak " : "");
  return 0;
}
