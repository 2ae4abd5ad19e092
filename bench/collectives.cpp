// bench/collectives: all_gather and reduce_scatter (f32 sum), 1 KiB to 256 MiB per rank,
// on 2 and 4 ranks, for every backend in the same run:
//   thread  fsdp::ThreadComm, ranks as threads of this process (no wire: shared memory)
//   tcp     fsdp::TcpComm, one process per rank, started with the launcher (torchrun's env);
//           same-host ring links move payloads through shared memory (its default)
//   tcp-socket  the same with shared memory off (every byte through loopback TCP); not
//           run unless named in --backends
//   gloo    Gloo over TCP (PyTorch's CPU backend), the baseline, also through the launcher
//   mpi     fsdp::MpiComm over OpenMPI (shared memory between same-host ranks), via mpirun
// Multi-process backends re-run this binary as workers (--worker); rank 0 of each writes
// its rows to a file that this process reads back. Each row is checked element by element
// before it is timed; bench/collectives/measure.hpp says what is measured. Prints a table
// per (op, world) with the TCP/Gloo and TCP/MPI ratios and the goals, or with
// --json one object per row (bench/plot_collectives.sh draws those). Sizes whose buffers
// would not fit in memory are skipped with a note; more ranks than cores are flagged.
//
//   collectives [--backends thread,tcp,gloo,mpi] [--worlds 2,4] [--min-bytes 1024]
//               [--max-bytes 268435456] [--iters 50] [--json] [--json-file PATH] [--quick]
//               [--timeout-s 600]
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fsdp/host/thread_group.hpp>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "bench/collectives/child_process.hpp"
#include "bench/collectives/fsdp_runner.hpp"
#include "bench/collectives/options.hpp"
#include "bench/collectives/plan.hpp"
#include "bench/collectives/report.hpp"
#include "bench/collectives/worker.hpp"
#include "tools/launcher/launcher.hpp"

namespace {

namespace fs = std::filesystem;
using namespace bench;

// A fresh directory for one launch, removed afterwards.
struct RunDir {
  fs::path path;
  RunDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    if (!base) base = std::getenv("TMPDIR");
    std::string templ = (fs::path(base ? base : "/tmp") / "fsdp_collectives.XXXXXX").string();
    if (!mkdtemp(templ.data())) fsdp::detail::fail("collectives: mkdtemp('", templ, "') failed: ", std::strerror(errno));
    path = templ;
    fs::create_directory(path / "gloo_store");
  }
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
  ~RunDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<Row> read_rows(const fs::path& file) {
  std::ifstream in(file);
  if (!in) fsdp::detail::fail("every worker exited 0 but rank 0 wrote no rows (", file.string(), ")");
  std::vector<Row> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(row_from_json(nlohmann::json::parse(line)));
  return rows;
}

std::vector<Row> run_backend(const Options& o, const std::string& backend, int world) {
  if (backend == "thread") {
    std::vector<Row> rows;
    fsdp::ThreadGroup(world, {o.collective_timeout()}).run([&](fsdp::ThreadComm& comm) {
      FsdpRunner runner(comm);
      auto mine = measure_all(runner, "thread", o);
      if (comm.rank() == 0) rows = std::move(mine);
    });
    return rows;
  }
  RunDir dir;
  const auto argv = o.worker_args(fs::read_symlink("/proc/self/exe").string(), backend, dir.path.string());
  const std::chrono::milliseconds timeout = std::chrono::seconds(o.timeout_s);
  int code = 0;
  if (backend == "tcp" || backend == "tcp-socket" || backend == "gloo") {
    fsdp::launch::Options launch;
    launch.nproc = world;
    launch.timeout = timeout;
    code = fsdp::launch::run(launch, argv);
  } else if (backend == "mpi") {
    std::vector<std::string> cmd{"mpirun", "-np", std::to_string(world), "--oversubscribe"};
    cmd.insert(cmd.end(), argv.begin(), argv.end());
    code = run_child(cmd, {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}}, timeout);
  } else {
    fsdp::detail::fail("unknown backend '", backend, "' (thread, tcp, tcp-socket, gloo, mpi)");
  }
  if (code != 0) fsdp::detail::fail("a worker exited with status ", code, " (its message is above)");
  return read_rows(dir.path / "rows.jsonl");
}

// `o` with max_bytes lowered (by 4x steps) until a row's buffers fit in 60% of the free
// memory: all ranks share this host, and swapping or the OOM killer would be the result.
Options fit_in_memory(const Options& o, int world) {
  Options w = o;
  const std::size_t avail = available_memory();
  while (avail && w.max_bytes > w.min_bytes && row_footprint(w.max_bytes, world) > avail / 10 * 6) w.max_bytes /= 4;
  if (w.max_bytes != o.max_bytes)
    fmt::print(stderr, "note: {} ranks: sizes above {} skipped, they need about {} of the {} available\n", world,
               format_bytes(w.max_bytes), format_bytes(row_footprint(o.max_bytes, world)), format_bytes(avail));
  return w;
}

int driver_main(const Options& o) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::vector<Row> rows;
  std::vector<std::string> failures;
  const std::string load = load_average();
  for (int world : o.worlds) {
    const Options w = fit_in_memory(o, world);
    if (world > static_cast<int>(cores))
      fmt::print(stderr, "note: {} ranks on {} cores oversubscribe the CPU: ranks take turns, read those rows as a "
                 "lower bound\n", world, cores);
    for (const auto& b : o.backends) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        auto got = run_backend(w, b, world);
        rows.insert(rows.end(), got.begin(), got.end());
        fmt::print(stderr, "{} on {} ranks: {} rows in {:.2f} s\n", b, world, got.size(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      } catch (const std::exception& e) {
        failures.push_back(fmt::format("{} on {} ranks: {}", b, world, e.what()));
        fmt::print(stderr, "FAILED: {}\n", failures.back());
      }
    }
  }
  if (!o.json_file.empty()) {
    // `bazel run` starts us in the runfiles: a relative path means the caller's directory.
    const char* caller_dir = std::getenv("BUILD_WORKING_DIRECTORY");
    const fs::path file = caller_dir ? fs::path(caller_dir) / o.json_file : fs::path(o.json_file);
    std::ofstream out(file);
    out << json_lines(rows, cores);
    if (!out) failures.push_back("could not write --json-file '" + file.string() + "'");
  }
  if (o.json) {
    fmt::print("{}", json_lines(rows, cores));
  } else {
    fmt::print("collectives: f32 sum, {} cores (load average {} before the run); busbw = algbw * (n-1)/n as "
               "NCCL-tests; time = slowest rank, median of the iterations; every row verified\n", cores, load);
    for (int world : o.worlds)
      if (world > static_cast<int>(cores))
        fmt::print("note: {} ranks on {} cores oversubscribe the CPU (ranks take turns)\n", world, cores);
    print_tables(rows, o.backends, o.worlds);
    print_goals(rows);
  }
  if (!failures.empty()) fmt::print(stderr, "\n{} failure(s):\n", failures.size());
  for (const auto& f : failures) fmt::print(stderr, "  {}\n", f);
  return failures.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"all_gather / reduce_scatter bandwidth of the thread, TCP, Gloo and MPI backends"};
  app.add_option("--backends", o.backends, "backends to run, in order")
      ->delimiter(',')->check(CLI::IsMember({"thread", "tcp", "tcp-socket", "gloo", "mpi"}));
  app.add_option("--worlds", o.worlds, "rank counts")->delimiter(',')->check(CLI::Range(1, 64));
  app.add_option("--min-bytes", o.min_bytes, "smallest size per rank (a multiple of 4)")->check(CLI::Range(4ul, 4 * GiB));
  app.add_option("--max-bytes", o.max_bytes, "largest size per rank; sizes go up by 4x")->check(CLI::Range(4ul, 4 * GiB));
  app.add_option("--iters", o.iters,
                 "timed iterations of small sizes; big ones run fewer (about 64 MiB moved or 1.5 s per row, at least 1)")
      ->check(CLI::Range(1, 100000));
  app.add_flag("--json", o.json, "one JSON object per row on stdout instead of tables");
  app.add_option("--json-file", o.json_file, "also write the JSON rows to this file (tables and plot from one run)");
  app.add_flag("--quick", o.quick, "smoke run: 1 KiB to 16 KiB, 5 iterations (explicit flags win)");
  app.add_option("--timeout-s", o.timeout_s, "longest a backend may take on one world size")->check(CLI::Range(1, 86400));
  app.add_option("--worker", o.worker)->group("");
  app.add_option("--run-dir", o.run_dir)->group("");
  CLI11_PARSE(app, argc, argv);
  if (o.quick) {
    if (!app.count("--max-bytes")) o.max_bytes = 16 * KiB;
    if (!app.count("--iters")) o.iters = 5;
  }
  if (o.min_bytes % 4 || o.max_bytes % 4 || o.min_bytes > o.max_bytes) {
    fmt::print(stderr, "collectives: --min-bytes and --max-bytes must be multiples of 4 with min <= max\n");
    return 2;
  }
  return o.worker.empty() ? driver_main(o) : worker_main(o, argc, argv);
}
