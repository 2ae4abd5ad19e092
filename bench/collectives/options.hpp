#pragma once
// The benchmark's flags, shared by the driver and the worker processes it starts.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "plan.hpp"

namespace bench {

struct Options {
  std::vector<std::string> backends{"thread", "tcp", "gloo", "mpi"};
  std::vector<int> worlds{2, 4};
  std::size_t min_bytes = KiB, max_bytes = 256 * MiB;
  int iters = 50;
  bool json = false, quick = false;
  std::string json_file;  // also write the --json lines here
  int timeout_s = 600;  // one backend at one world size, all its rows
  // Worker mode (set by the driver on the command lines it starts):
  std::string worker;   // the backend this process is one rank of
  std::string run_dir;  // where rank 0 writes rows.jsonl (and Gloo's file store lives)

  // The longest one collective may wait for a peer: well inside the launch's timeout, so
  // a stuck rank is reported by its communicator (naming the peer) before it is killed.
  std::chrono::milliseconds collective_timeout() const {
    return std::chrono::milliseconds(std::clamp(timeout_s * 1000 / 3, 1, 300000));
  }

  // The command line of one worker: this program with the flags that shape the rows.
  std::vector<std::string> worker_args(const std::string& self, const std::string& backend, const std::string& dir) const {
    return {self, "--worker", backend, "--run-dir", dir,
            "--min-bytes", std::to_string(min_bytes), "--max-bytes", std::to_string(max_bytes),
            "--iters", std::to_string(iters), "--timeout-s", std::to_string(timeout_s)};
  }
};

}  // namespace bench
