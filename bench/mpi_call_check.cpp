// What MpiComm's call comparison (MpiCommOptions::check_calls, fsdp/mpi/mpi_call_check.hpp)
// costs: small and large f32 all_reduce and all_gather on a communicator that compares the
// ranks' calls against one that does not, on 2 and 4 ranks of this host.
//
//   bazel run -c opt //bench:mpi_call_check [-- --worlds 2,4 --reps 15]
//
// Run without mpirun, it starts itself under `mpirun -np W` per world size. Each rep times
// a batch of calls (issue, then wait) on each communicator in turn; a rep's time is the
// slowest rank's, a row's the median over reps, and the ratio is checked / unchecked.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fsdp/mpi/mpi_comm.hpp"

namespace {

struct Flags {
  std::vector<int> worlds{2, 4};
  int reps = 15;
  bool worker = false;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--worker") {
      f.worker = true;
    } else if (a == "--reps" && i + 1 < argc) {
      f.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--worlds" && i + 1 < argc) {
      f.worlds.clear();
      for (const char* p = argv[++i]; *p;) {
        f.worlds.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p) ++p;
      }
    } else {
      fsdp::detail::fail("mpi_call_check: unknown argument '", a, "' (--worlds 2,4, --reps N)");
    }
  }
  return f;
}

// Microseconds per call of `batch` calls, the slowest rank's.
template <class Call>
double time_batch(fsdp::MpiComm& comm, fsdp::MpiComm& timing, int batch, Call&& call) {
  timing.barrier().wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < batch; ++i) call(comm).wait();
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / batch;
  timing.all_reduce(&us, &us, 1, fsdp::DType::f64, fsdp::ReduceOp::max).wait();
  return us;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int worker(int argc, char** argv, const Flags& flags) {
  fsdp::MpiSession session(argc, argv);
  auto checked = fsdp::MpiComm::world(session, {std::chrono::minutes(1), true});
  auto unchecked = fsdp::MpiComm::world(session, {std::chrono::minutes(1), false});
  const int n = checked.size();
  if (checked.rank() == 0)
    std::printf("\n| world | op | bytes per rank | unchecked µs | checked µs | checked / unchecked |\n|---:|---|---:|---:|---:|---:|\n");
  for (const char* op : {"all_reduce", "all_gather"}) {
    for (std::size_t bytes : {std::size_t(64), std::size_t(4) << 20}) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<float> send(count, 1.0f), recv(count * static_cast<std::size_t>(n));
      auto call = [&](fsdp::MpiComm& c) {
        return std::string(op) == "all_reduce"
                   ? c.all_reduce(send.data(), recv.data(), count, fsdp::DType::f32, fsdp::ReduceOp::sum)
                   : c.all_gather(send.data(), recv.data(), count, fsdp::DType::f32);
      };
      const int batch = bytes < 4096 ? 200 : 4;
      time_batch(checked, unchecked, batch, call);  // warm-up
      time_batch(unchecked, unchecked, batch, call);
      std::vector<double> on, off;
      for (int r = 0; r < flags.reps; ++r) {  // interleaved: drift hits both alike
        off.push_back(time_batch(unchecked, unchecked, batch, call));
        on.push_back(time_batch(checked, unchecked, batch, call));
      }
      if (checked.rank() == 0)
        std::printf("| %d | %s | %zu | %.2f | %.2f | %.2f× |\n", n, op, bytes, median(off), median(on),
                    median(on) / median(off));
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Flags flags = parse(argc, argv);
    if (flags.worker || std::getenv("OMPI_COMM_WORLD_SIZE")) return worker(argc, argv, flags);
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    int failures = 0;
    for (int w : flags.worlds) {
      const std::string cmd = "timeout -k 5 600 mpirun -np " + std::to_string(w) + " --oversubscribe '" + argv[0] +
                              "' --worker --reps " + std::to_string(flags.reps);
      if (std::system(cmd.c_str()) != 0) {
        std::fprintf(stderr, "mpi_call_check: world %d failed: %s\n", w, cmd.c_str());
        ++failures;
      }
    }
    return failures ? 1 : 0;
  } catch (const fsdp::Error& e) {
    std::fprintf(stderr, "mpi_call_check: %s\n", e.what());
    return 1;
  }
}
