// bench/checkpoint: checkpoint throughput of fsdp against this machine's plain file write
// and read speed, measured in the same run. The reference engine (AdamW, so the checkpoints
// hold the parameters and both moments: 3x the parameter bytes) trains FullShard on N thread
// ranks; then, each repeated --repeat times, interleaved:
//   write: one plain file of the sharded checkpoint's byte count (16 MiB write()s, fsync),
//          N plain files by N threads at once, save_sharded_checkpoint, save_full_checkpoint;
//   read:  the same plain files back (16 MiB read()s), load_sharded_checkpoint (in place,
//          the default, and staged in host memory), load_full_checkpoint — every file
//          evicted from the page cache before its row.
// Then where one save and one load of each kind spends its time, and AsyncCheckpointer
// saving every K steps while training goes on.
//
//   checkpoint [--ranks 4] [--blocks 9] [--dim 1024] [--hidden 4096] [--repeat 3] [--batch 1]
//              [--async-every 2] [--async-saves 3] [--dir DIR] [--json PATH]
//
// Everything runs in a fresh directory (under --dir, $TMPDIR or /tmp), removed at the end.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <vector>

#include "bench/checkpoint/plain_files.hpp"
#include "bench/checkpoint/report.hpp"
#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "fsdp/checkpoint/checkpoint.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// The default load reads in place after its checks; this row shows what staging costs.
constexpr const char* kStagedLoad = "load_sharded_checkpoint, staged (stage_in_host_memory; not a goal row)";

struct Options {
  engine::ModelConfig model{.in = 16, .dim = 1024, .hidden = 4096, .out = 4, .blocks = 9, .seed = 1};
  int ranks = 4, repeat = 3, batch = 1, async_every = 2, async_saves = 3;
  std::string dir, json;
};

// Where one save or load spends its time: named phases, each timed between barriers on rank 0.
using Phases = std::vector<std::pair<std::string, double>>;

struct AsyncSave {
  int step = 0;
  double snapshot_s = 0, write_s = 0, blocked_s = 0, commit_s = 0, hidden = 0;  // means over ranks (commit: max)
  std::uint64_t bytes = 0;                                                        // all ranks
};

struct Results {
  std::uint64_t param_numel = 0, param_bytes = 0, optim_bytes = 0, sharded_bytes = 0, full_bytes = 0;
  std::map<std::string, bench::ThroughputRow> rows;
  std::vector<std::pair<std::string, Phases>> phases;  // in the order run
  std::vector<AsyncSave> saves;
  std::vector<double> steps_idle, steps_writing;  // step seconds without / with a save being written
};

// Wall time of f on every rank, from a barrier before to a barrier after it: the slowest rank's.
template <class F>
double timed(fsdp::ThreadComm& comm, F&& f) {
  comm.barrier().wait();
  const auto t0 = Clock::now();
  f();
  comm.barrier().wait();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

class Bench {
 public:
  Bench(const Options& o, fs::path work) : o_(o), work_(std::move(work)), chunk_(bench::kPlainChunkBytes) {
    bench::fill_incompressible(chunk_);
    timings_.resize(static_cast<std::size_t>(o_.ranks));
  }

  Results run() {
    fsdp::ThreadGroup(o_.ranks).run([&](fsdp::ThreadComm& comm) { rank_main(comm); });
    return std::move(r_);
  }

 private:
  bool root(const fsdp::ThreadComm& comm) const { return comm.rank() == 0; }
  fs::path plain(int i) const { return work_ / fmt::format("plain-{}-of-{}.bin", i, o_.ranks); }
  fs::path sharded() const { return work_ / "sharded"; }
  fs::path full() const { return work_ / "full.safetensors"; }

  // Rank 0 removes what a row is about to write, outside the timed part, and syncs, so
  // that no row's fsync pays for another's deletions (this file system may discard blocks).
  void clear(fsdp::ThreadComm& comm, const std::vector<fs::path>& paths) {
    if (root(comm)) {
      for (const auto& p : paths) fs::remove_all(p);
      ::sync();
    }
    comm.barrier().wait();
  }
  void evict(fsdp::ThreadComm& comm, const std::vector<fs::path>& paths) {
    if (root(comm))
      for (const auto& p : paths) bench::evict_from_page_cache(p);
    comm.barrier().wait();
  }
  void record(fsdp::ThreadComm& comm, const std::string& name, const char* direction, bool baseline, int files,
              std::uint64_t bytes, double seconds) {
    if (!root(comm)) return;
    auto& row = r_.rows[name];
    row.name = name, row.direction = direction, row.baseline = baseline, row.files = files, row.bytes = bytes;
    row.has_goal = name != kStagedLoad;
    row.seconds.push_back(seconds);
  }
  std::uint64_t share(int rank) const {  // rank's part of the N-files baseline
    const std::uint64_t n = static_cast<std::uint64_t>(o_.ranks);
    return r_.sharded_bytes / n + (rank == 0 ? r_.sharded_bytes % n : 0);
  }
  std::vector<fs::path> plain_files() const {
    std::vector<fs::path> out;
    for (int i = 0; i < o_.ranks; ++i) out.push_back(plain(i));
    return out;
  }

  void step(engine::Model& model, fsdp::ShardedModel& sm, engine::AdamW& opt, fsdp::ThreadComm& comm, int s) {
    const std::int64_t b = o_.batch;
    engine::sharded_step(model, sm, opt, engine::make_batch(o_.model, s, comm.rank() * b, b));
  }

  void rank_main(fsdp::ThreadComm& comm) {
    engine::Model model(o_.model);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({.lr = 1e-4f}, alloc);
    engine::AdamWState state(opt, sm);
    step(model, sm, opt, comm, 0);  // the moments hold trained values, not zeros

    // Sizes, from a first (untimed) save of each kind.
    fsdp::save_sharded_checkpoint(sharded(), sm, &state);
    fsdp::save_full_checkpoint(full(), sm, &state);
    if (root(comm)) {
      r_.sharded_bytes = bench::bytes_on_disk(sharded());
      r_.full_bytes = bench::bytes_on_disk(full()) + bench::bytes_on_disk(fsdp::optimizer_file_of(full()));
      for (const auto& p : sm.parameters()) {
        r_.param_numel += static_cast<std::uint64_t>(p.numel);
        r_.param_bytes += static_cast<std::uint64_t>(p.numel) * fsdp::size_of(p.dtype);
        for (const auto& name : state.state_names())
          r_.optim_bytes += static_cast<std::uint64_t>(p.numel) * fsdp::size_of(state.state_dtype(name));
      }
    }
    comm.barrier().wait();
    throughput_rows(comm, sm, state);
    phase_rows(comm, sm, state);
    async_rows(comm, model, sm, opt, state);
  }

  void throughput_rows(fsdp::ThreadComm& comm, fsdp::ShardedModel& sm, engine::AdamWState& state) {
    const int n = o_.ranks;
    const std::string one = "baseline: 1 file, 1 thread", many = fmt::format("baseline: {} files, {} threads", n, n);
    const std::uint64_t sb = r_.sharded_bytes, fb = r_.full_bytes;
    for (int rep = 0; rep < o_.repeat; ++rep) {
      clear(comm, {plain(0)});
      record(comm, one + " write", "write", true, 1, sb, timed(comm, [&] {
               if (root(comm)) bench::write_plain_file(plain(0), sb, chunk_);
             }));
      clear(comm, plain_files());
      record(comm, many + " write", "write", true, n, sb, timed(comm, [&] {
               bench::write_plain_file(plain(comm.rank()), share(comm.rank()), chunk_);
             }));
      clear(comm, {sharded()});
      record(comm, "save_sharded_checkpoint", "write", false, n, sb,
             timed(comm, [&] { fsdp::save_sharded_checkpoint(sharded(), sm, &state); }));
      clear(comm, {full(), fsdp::optimizer_file_of(full())});
      record(comm, "save_full_checkpoint", "write", false, 2, fb,
             timed(comm, [&] { fsdp::save_full_checkpoint(full(), sm, &state); }));

      // The N-files baseline left plain(0) at its share; the 1-file read needs the whole.
      clear(comm, {plain(0)});
      if (root(comm)) bench::write_plain_file(plain(0), sb, chunk_);
      evict(comm, {plain(0)});
      std::vector<std::byte> buffer(bench::kPlainChunkBytes);
      std::uint64_t sum = 0;
      record(comm, one + " read", "read", true, 1, sb, timed(comm, [&] {
               if (root(comm) && bench::read_plain_file(plain(0), buffer, sum) != sb) fsdp::detail::fail("short read");
             }));
      if (root(comm)) bench::write_plain_file(plain(0), share(0), chunk_);  // back to the N-files layout
      evict(comm, plain_files());
      record(comm, many + " read", "read", true, n, sb, timed(comm, [&] {
               if (bench::read_plain_file(plain(comm.rank()), buffer, sum) != share(comm.rank())) fsdp::detail::fail("short read");
             }));
      evict(comm, {sharded()});
      record(comm, "load_sharded_checkpoint", "read", false, n, sb,
             timed(comm, [&] { fsdp::load_sharded_checkpoint(sharded(), sm, &state); }));
      evict(comm, {sharded()});
      record(comm, kStagedLoad, "read", false, n, sb, timed(comm, [&] {
               fsdp::LoadOptions staged;
               staged.stage_in_host_memory = true;
               fsdp::load_sharded_checkpoint(sharded(), sm, &state, staged);
             }));
      evict(comm, {full(), fsdp::optimizer_file_of(full())});
      record(comm, "load_full_checkpoint", "read", false, 2, fb,
             timed(comm, [&] { fsdp::load_full_checkpoint(full(), sm, &state); }));
    }
    clear(comm, plain_files());
  }

  // One save and one load of each kind, through the library's own steps (the public
  // functions are exactly these), with a barrier after each step.
  void phase_rows(fsdp::ThreadComm& comm, fsdp::ShardedModel& sm, engine::AdamWState& state) {
    auto phase = [&](Phases& into, const std::string& name, auto&& f) {
      const double s = timed(comm, f);
      if (root(comm)) into.emplace_back(name, s);
    };
    Phases ss, fsv, sl, fl;
    clear(comm, {sharded()});
    {
      std::optional<fsdp::detail::ShardedSave> save;
      std::exception_ptr failed;
      phase(ss, "snapshot into host memory (agree, copy; AsyncCheckpointer's path: the synchronous save writes from the shards)", [&] { save.emplace(sharded(), sm, &state, std::map<std::string, std::string>{}); });
      phase(ss, "write + fsync own rank file (all ranks at once)", [&] { failed = fsdp::detail::captured([&] { save->write(); }); });
      phase(ss, "commit (agree; rank 0 reads the ranks' size and XXH64 notes and the headers, writes index.json, renames)",
            [&] { save->commit(sm, failed); });
    }
    clear(comm, {full(), fsdp::optimizer_file_of(full())});
    {
      std::optional<fsdp::detail::FullSave> save;
      std::exception_ptr failed;
      phase(fsv, "gather every tensor into rank 0's host memory (AsyncCheckpointer's snapshot; the synchronous save streams one flat parameter at a time)", [&] { save.emplace(full(), sm, &state, std::map<std::string, std::string>{}); });
      phase(fsv, "rank 0 writes + fsyncs both files (one thread)", [&] { failed = fsdp::detail::captured([&] { save->write(); }); });
      phase(fsv, "commit (agree)", [&] { save->commit(sm, failed); });
    }
    evict(comm, {sharded()});
    {
      std::optional<fsdp::ShardedCheckpointSource> src;
      phase(sl, "open: index and headers (each file's XXH64 is checked by one rank, in load_state)", [&] { src.emplace(sharded()); });
      phase(sl, "hash own files (1 MiB preads, each piece hashed from L2; what load_state's verify step does first)",
            [&] { src->verify(comm.rank(), o_.ranks); });
      phase(sl, "load_state: check, agree, read own slices into the shards from the page cache (files already hashed)",
            [&] { fsdp::load_state(sm, *src, &state); });
    }
    evict(comm, {full(), fsdp::optimizer_file_of(full())});
    {
      std::optional<fsdp::FullCheckpointSource> src;
      phase(fl, "open: headers", [&] { src.emplace(full()); });
      phase(fl, "load_state: check, agree, read own slices into the shards (each rank first reads and hashes its run of both files' chunks, an equal share of the bytes, warming the page cache)", [&] { fsdp::load_state(sm, *src, &state); });
    }
    if (root(comm)) {
      r_.phases = {{"save_sharded_checkpoint", ss}, {"save_full_checkpoint", fsv},
                   {"load_sharded_checkpoint", sl}, {"load_full_checkpoint", fl}};
    }
  }

  // AsyncCheckpointer: a sharded save every async_every steps while training goes on; wait()
  // just before the next save (as save_sharded would) and at the end.
  void async_rows(fsdp::ThreadComm& comm, engine::Model& model, fsdp::ShardedModel& sm, engine::AdamW& opt,
                  engine::AdamWState& state) {
    const std::size_t rank = static_cast<std::size_t>(comm.rank());
    std::vector<fsdp::AsyncSaveTiming>& mine = timings_[rank];
    std::vector<int> steps_of_saves;
    clear(comm, {work_ / "async"});
    fsdp::AsyncCheckpointer ckpt(sm, &state);
    const int last = o_.async_every * (o_.async_saves + 1);
    for (int s = 1; s <= last; ++s) {
      bool writing = ckpt.writing();
      const double t = timed(comm, [&] { step(model, sm, opt, comm, s); });
      if (root(comm)) (writing ? r_.steps_writing : r_.steps_idle).push_back(t);
      if (s % o_.async_every != 0 || static_cast<int>(steps_of_saves.size()) == o_.async_saves) continue;
      if (ckpt.pending()) {
        ckpt.wait();
        mine.push_back(ckpt.last_timing());
      }
      ckpt.save_sharded(work_ / "async", {{"step", std::to_string(s)}});
      steps_of_saves.push_back(s);
    }
    ckpt.wait();
    mine.push_back(ckpt.last_timing());
    comm.barrier().wait();
    if (!root(comm)) return;
    for (std::size_t k = 0; k < mine.size(); ++k) {
      AsyncSave a{steps_of_saves[k]};
      for (const auto& per_rank : timings_) {
        const auto& t = per_rank[k];
        a.snapshot_s += t.snapshot_s / o_.ranks, a.write_s += t.write_s / o_.ranks, a.blocked_s += t.blocked_s / o_.ranks;
        a.hidden += t.hidden_fraction() / o_.ranks, a.commit_s = std::max(a.commit_s, t.commit_s);
        a.bytes += t.bytes;
      }
      r_.saves.push_back(a);
    }
  }

  const Options& o_;
  fs::path work_;
  std::vector<std::byte> chunk_;
  Results r_;
  std::vector<std::vector<fsdp::AsyncSaveTiming>> timings_;  // per rank, per save
};

}  // namespace

namespace {

double mb(std::uint64_t bytes) { return double(bytes) / 1e6; }

void report(const Options& o, const fs::path& work, const Results& r, bench::JsonRows& json, const std::string& load_before) {
  const int n = o.ranks;
  fmt::print("model: reference engine, {} blocks, dim {}, hidden {}: {} parameters = {:.1f} MB; AdamW moments {:.1f} MB\n",
             o.model.blocks, o.model.dim, o.model.hidden, r.param_numel, mb(r.param_bytes), mb(r.optim_bytes));
  fmt::print("checkpoints (parameters + moments): sharded {:.1f} MB ({} rank files + index.json), full {:.1f} MB "
             "(model file + optimizer file)\n",
             mb(r.sharded_bytes), n, mb(r.full_bytes));
  fmt::print("setup: {} thread ranks, FullShard, HostDevice; files in {}; load average before {} / after {}\n", n,
             work.string(), load_before, bench::load_average());
  fmt::print("times: wall, barrier to barrier (the slowest rank), best and median of {} repeats, rows interleaved; "
             "GB/s = bytes / time, 1 GB = 1e9 B\n",
             o.repeat);
  fmt::print("page cache: before every read row, baseline and checkpoint alike, every file it reads is fsynced and "
             "evicted (posix_fadvise POSIX_FADV_DONTNEED); every write row ends with its files fsynced\n\n");

  const auto& rows = r.rows;
  const std::string one = "baseline: 1 file, 1 thread", many = fmt::format("baseline: {} files, {} threads", n, n);
  bench::print_table_header();
  std::vector<std::string> verdicts;
  for (const char* dir : {"write", "read"}) {
    const bench::Comparison cmp{&rows.at(one + " " + dir), &rows.at(many + " " + dir)};
    for (const auto* name : {"1", "n"}) {
      const auto& row = rows.at((std::string(name) == "1" ? one : many) + " " + dir);
      bench::print_row(row);
      json.add(bench::row_json(row));
    }
    const bool write = std::string(dir) == "write";
    for (const char* name : {write ? "save_sharded_checkpoint" : "load_sharded_checkpoint",
                             write ? "save_full_checkpoint" : "load_full_checkpoint"}) {
      const auto& row = rows.at(name);
      const bench::Comparison c{cmp.one_file, row.files == n ? cmp.n_files : nullptr};
      bench::print_row(row, c);
      json.add(bench::row_json(row, c));
      const double x = bench::ratio(row, c.one_file);
      if (!write && std::string(name) == "load_sharded_checkpoint") {  // the option's row, after the default's
        const auto& staged = rows.at(kStagedLoad);
        bench::print_row(staged, c);
        json.add(bench::row_json(staged, c));
      }
      verdicts.push_back(fmt::format("{}: {:.2f}x the 1-file {} baseline (median) -> goal {}", name, x, dir,
                                     x >= bench::kGoalRatio ? "met" : "NOT met"));
    }
  }
  fmt::print("\ngoal: every checkpoint row at >= {:.1f}x the plain sequential 1-file baseline of its direction\n",
             bench::kGoalRatio);
  for (const auto& v : verdicts) fmt::print("  {}\n", v);

  fmt::print("\nwhere the time goes (one more save / load of each kind, a barrier after each step, rank 0's clock):\n");
  for (const auto& [name, phases] : r.phases) {
    double total = 0;
    for (const auto& [what, s] : phases)
      if (what.rfind("  ", 0) != 0) total += s;
    fmt::print("  {} ({:.3f} s):\n", name, total);
    nlohmann::json j{{"row", name + " phases"}, {"kind", "phases"}, {"total_s", total}};
    for (const auto& [what, s] : phases) {
      fmt::print("    {:>7.3f} s  {:>5.1f}%  {}\n", s, total > 0 ? 100 * s / total : 0, what);
      j["phases"].push_back({{"phase", what}, {"seconds", s}});
    }
    json.add(j);
  }

  fmt::print("\nAsyncCheckpointer: save_sharded every {} steps ({} samples per rank per step), wait() before the next "
             "save and at the end; figures are means over ranks (commit: the slowest rank)\n",
             o.async_every, o.batch);
  fmt::print("| save | after step | bytes | snapshot s | write s | blocked s | commit s | write hidden |\n");
  fmt::print("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  double hidden = 0;
  for (std::size_t k = 0; k < r.saves.size(); ++k) {
    const auto& a = r.saves[k];
    fmt::print("| {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.1f}% |\n", k + 1, a.step, a.bytes, a.snapshot_s,
               a.write_s, a.blocked_s, a.commit_s, 100 * a.hidden);
    json.add({{"row", "async save_sharded"}, {"kind", "async"}, {"save", k + 1}, {"after_step", a.step},
              {"bytes", a.bytes}, {"snapshot_s", a.snapshot_s}, {"write_s", a.write_s}, {"blocked_s", a.blocked_s},
              {"commit_s", a.commit_s}, {"hidden_fraction", a.hidden}});
    hidden += a.hidden / double(r.saves.size());
  }
  const double idle = bench::median_of(r.steps_idle), busy = bench::median_of(r.steps_writing);
  fmt::print("write hidden behind training (1 - blocked/write, mean over saves): {:.1f}%\n", 100 * hidden);
  fmt::print("training step, median: {:.3f} s with no save being written ({} steps), {:.3f} s while one is ({} steps): "
             "{:+.1f}%\n",
             idle, r.steps_idle.size(), busy, r.steps_writing.size(), idle > 0 ? 100 * (busy / idle - 1) : 0);
  json.add({{"row", "async summary"}, {"kind", "async"}, {"saves", r.saves.size()}, {"hidden_fraction_mean", hidden},
            {"step_s_idle", idle}, {"step_s_writing", busy}, {"steps_idle", r.steps_idle.size()},
            {"steps_writing", r.steps_writing.size()}});
  fmt::print("\nnote: one machine, shared with whatever else runs: figures are noisy (see the load average above).\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Checkpoint save / load throughput against plain sequential file writes and reads, in the same run"};
  app.add_option("--ranks", o.ranks, "thread ranks")->check(CLI::Range(1, 64));
  app.add_option("--blocks", o.model.blocks, "residual blocks")->check(CLI::Range(0, 1000));
  app.add_option("--dim", o.model.dim, "model width")->check(CLI::Range(1, 1 << 16));
  app.add_option("--hidden", o.model.hidden, "block hidden width")->check(CLI::Range(1, 1 << 16));
  app.add_option("--repeat", o.repeat, "runs of each throughput row")->check(CLI::Range(1, 1000));
  app.add_option("--batch", o.batch, "samples per rank per training step")->check(CLI::Range(1, 1 << 16));
  app.add_option("--async-every", o.async_every, "training steps between asynchronous saves")->check(CLI::Range(1, 1000));
  app.add_option("--async-saves", o.async_saves, "asynchronous saves")->check(CLI::Range(1, 1000));
  app.add_option("--dir", o.dir, "where to make the (removed afterwards) work directory; default $TMPDIR or /tmp");
  app.add_option("--json", o.json, "also write one JSON object per row to this file (JSON Lines)");
  CLI11_PARSE(app, argc, argv);

  try {
    const char* tmp = std::getenv("TMPDIR");
    const fs::path base = !o.dir.empty() ? fs::path(o.dir) : fs::path(tmp && *tmp ? tmp : "/tmp");
    bench::JsonRows json(o.json);
    if (!json.good()) fsdp::detail::fail("cannot write '", o.json, "'");
    const std::string load_before = bench::load_average();
    bench::WorkDir work(base);
    const Results r = Bench(o, work.path()).run();
    report(o, work.path(), r, json, load_before);
    if (!json.good()) fsdp::detail::fail("writing '", o.json, "' failed");
  } catch (const std::exception& e) {
    fmt::print(stderr, "checkpoint: {}\n", e.what());
    return 1;
  }
  return 0;
}
