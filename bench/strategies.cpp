// bench/strategies: every ShardingStrategy on the same model and 4 thread ranks, one row
// each: median step time, bytes communicated per step per rank (by collective), and
// per-rank peak bytes counted by the Device. The baseline, measured in the same run, is
// the same model trained unsharded on one thread with the whole global batch.
//
//   strategies [--ranks 4] [--steps 20] [--blocks 8] [--dim 64] [--hidden 256] [--json PATH]
//
// Step times come from threads sharing this machine's cores: read them as relative, and
// the bytes as exact.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "examples/engine/fsdp_integration.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;

struct Row {
  std::string name, mesh;
  double step_ms = 0;
  std::uint64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;  // bytes per step, rank 0
  std::size_t peak = 0;                                              // max over ranks
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class S>
Row run(const engine::ModelConfig& c, int ranks, int steps, int batch) {
  Row row{S::name, "1x" + std::to_string(ranks)};
  fsdp::MeshShape shape{1, ranks};
  if (S::hybrid && ranks % 2 == 0 && ranks >= 4) shape = {2, ranks / 2};
  row.mesh = shape.str();
  std::vector<std::size_t> peaks(ranks);
  std::vector<double> times;
  fsdp::ThreadGroup(ranks).run([&](fsdp::ThreadComm& comm) {
    Counting counted(comm);
    fsdp::DeviceMesh<Counting> mesh(counted, shape);
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<S>(model, mesh, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({.lr = 1e-3f}, alloc);
    for (int s = 0; s < steps; ++s) {
      auto b = engine::make_batch(c, s, comm.rank() * batch, batch);
      counted.reset();
      mesh.shard_group().reset();
      mesh.replicate_group().reset();
      comm.barrier().wait();
      const auto t0 = Clock::now();
      engine::sharded_step(model, sm, opt, b);
      comm.barrier().wait();  // the step ends when the slowest rank is done
      if (comm.rank() == 0) times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    peaks[comm.rank()] = device.stats().peak_bytes;
    if (comm.rank() == 0) {
      using fsdp::Collective;
      for (const auto* k : {&counted.counts(), &mesh.shard_group().counts(), &mesh.replicate_group().counts()}) {
        row.all_gather += (*k)[Collective::all_gather].bytes;
        row.reduce_scatter += (*k)[Collective::reduce_scatter].bytes;
        row.all_reduce += (*k)[Collective::all_reduce].bytes;
      }
    }
  });
  row.step_ms = median(times);
  row.peak = *std::max_element(peaks.begin(), peaks.end());
  return row;
}

Row unsharded(const engine::ModelConfig& c, int ranks, int steps, int batch) {
  fsdp::HostDevice device;
  engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
  engine::Model model(c, alloc);
  engine::AdamW opt({.lr = 1e-3f}, alloc);
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    auto b = engine::make_batch(c, s, 0, static_cast<std::int64_t>(ranks) * batch);
    const auto t0 = Clock::now();
    engine::unsharded_step(model, opt, b);
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return {"unsharded (1 thread)", "-", median(times), 0, 0, 0, device.stats().peak_bytes};
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, steps = 20, batch = 8;
  std::string json_path;
  engine::ModelConfig c{.in = 16, .dim = 64, .hidden = 256, .out = 4, .blocks = 8, .seed = 1};
  CLI::App app{"Step time, communication and per-rank peak memory of every sharding strategy"};
  app.add_option("--ranks", ranks, "thread ranks")->check(CLI::Range(1, 64));
  app.add_option("--steps", steps, "timed steps per strategy")->check(CLI::Range(1, 100000));
  app.add_option("--batch", batch, "samples per rank per step")->check(CLI::Range(1, 1 << 16));
  app.add_option("--blocks", c.blocks, "residual blocks")->check(CLI::Range(0, 1000));
  app.add_option("--dim", c.dim, "model width")->check(CLI::Range(1, 1 << 14));
  app.add_option("--hidden", c.hidden, "block hidden width")->check(CLI::Range(1, 1 << 14));
  app.add_option("--json", json_path, "also write the rows as JSON");
  CLI11_PARSE(app, argc, argv);

  const Row base = unsharded(c, ranks, steps, batch);
  std::vector<Row> rows{run<fsdp::FullShard>(c, ranks, steps, batch), run<fsdp::ShardGradOp>(c, ranks, steps, batch),
                        run<fsdp::NoShard>(c, ranks, steps, batch), run<fsdp::HybridShard>(c, ranks, steps, batch),
                        run<fsdp::HybridShardZero2>(c, ranks, steps, batch)};

  fmt::print("model: {} blocks, dim {}, hidden {} ({} ranks x {} samples, AdamW; default BackwardPre prefetch; "
             "synchronous ThreadComm); bytes are per rank per step\n\n",
             c.blocks, c.dim, c.hidden, ranks, batch);
  fmt::print("| strategy | mesh | step ms | all-gather B | reduce-scatter B | all-reduce B | total comm B | peak B/rank | peak vs unsharded |\n");
  fmt::print("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  nlohmann::json out = nlohmann::json::array();
  for (const Row& r : rows) {
    const auto total = r.all_gather + r.reduce_scatter + r.all_reduce;
    fmt::print("| {} | {} | {:.2f} | {} | {} | {} | {} | {} | {:.1f}% |\n", r.name, r.mesh, r.step_ms, r.all_gather,
               r.reduce_scatter, r.all_reduce, total, r.peak, 100.0 * double(r.peak) / double(base.peak));
    out.push_back({{"strategy", r.name}, {"mesh", r.mesh}, {"step_ms", r.step_ms}, {"all_gather_bytes", r.all_gather},
                   {"reduce_scatter_bytes", r.reduce_scatter}, {"all_reduce_bytes", r.all_reduce},
                   {"peak_bytes_per_rank", r.peak}});
  }
  fmt::print("| {} | {} | {:.2f} | 0 | 0 | 0 | 0 | {} | 100.0% |\n", base.name, base.mesh, base.step_ms, base.peak);
  out.push_back({{"strategy", "unsharded"}, {"step_ms", base.step_ms}, {"peak_bytes_per_rank", base.peak}});
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
