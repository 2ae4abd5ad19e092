#pragma once
// One rank of a multi-process backend: joins its group, measures every row, and (rank 0)
// writes them to <run dir>/rows.jsonl for the driver.
//   tcp   fsdp::TcpComm over the job's TcpStore (torchrun's env from the launcher, which hosts the store)
//   tcp-socket  the same with shared_memory = false
//   gloo  Gloo's TCP transport, rendezvous in <run dir>/gloo_store (rank from the same env)
//   mpi   fsdp::MpiComm over MPI_COMM_WORLD (started by mpirun)
#include <fmt/format.h>

#include <fsdp/asio/tcp_comm.hpp>
#include <fsdp/asio/tcp_store.hpp>
#include <fsdp/core/dist_env.hpp>
#include <fsdp/mpi/mpi_comm.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fsdp_runner.hpp"
#include "gloo_runner.hpp"
#include "measure.hpp"
#include "options.hpp"
#include "report.hpp"

namespace bench {

// Every op and size of one backend on one group of ranks.
template <class Runner>
std::vector<Row> measure_all(Runner& r, const std::string& backend, const Options& o) {
  std::vector<Row> rows;
  for (Op op : {Op::all_gather, Op::reduce_scatter}) {
    for (std::size_t bytes : sizes_between(o.min_bytes, o.max_bytes)) {
      const int iters = iters_for(bytes, r.size(), o.iters);
      rows.push_back(measure(r, backend, op, bytes, iters, warmup_for(iters)));
    }
  }
  return rows;
}

inline void write_rows(const std::vector<Row>& rows, const std::string& run_dir) {
  namespace fs = std::filesystem;
  const fs::path tmp = fs::path(run_dir) / "rows.jsonl.tmp";
  {
    std::ofstream out(tmp);
    for (const auto& r : rows) out << to_json(r).dump() << "\n";
    if (!out) fsdp::detail::fail("collectives worker: could not write ", tmp.string());
  }
  fs::rename(tmp, fs::path(run_dir) / "rows.jsonl");  // the driver never reads a half-written file
}

inline int worker_main(const Options& o, int argc, char** argv) {
  try {
    std::vector<Row> rows;
    int rank = 0;
    if (o.worker == "tcp" || o.worker == "tcp-socket") {
      const auto env = fsdp::DistEnv::from_env();
      fsdp::TcpStoreOptions store_options;
      store_options.timeout = o.collective_timeout();
      auto store = fsdp::connect_store(env, store_options);
      fsdp::TcpCommOptions comm_options;
      comm_options.timeout = o.collective_timeout();
      comm_options.shared_memory = o.worker == "tcp";
      fsdp::TcpComm comm(store.store, env.rank, env.world_size, comm_options);
      FsdpRunner runner(comm);
      rank = env.rank;
      rows = measure_all(runner, o.worker, o);
    } else if (o.worker == "gloo") {
      const auto env = fsdp::DistEnv::from_env();
      GlooRunner runner((std::filesystem::path(o.run_dir) / "gloo_store").string(), env.rank, env.world_size,
                        o.collective_timeout());
      rank = env.rank;
      rows = measure_all(runner, "gloo", o);
    } else if (o.worker == "mpi") {
      fsdp::MpiSession session(argc, argv);
      auto comm = fsdp::MpiComm::world(session, {o.collective_timeout()});
      FsdpRunner runner(comm);
      rank = comm.rank();
      rows = measure_all(runner, "mpi", o);
    } else {
      fsdp::detail::fail("collectives: unknown worker backend '", o.worker, "' (tcp, tcp-socket, gloo, mpi)");
    }
    if (rank == 0) write_rows(rows, o.run_dir);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "collectives worker ({}): {}\n", o.worker, e.what());
    return 1;
  }
}

}  // namespace bench
