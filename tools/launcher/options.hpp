#pragma once
// fsdp::launch::Options: how many ranks fsdp_run starts on this node, where they meet, and
// how it supervises them; validate() refuses a bad value before any process starts.
#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/dist_env.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/exit_status.hpp"

namespace fsdp::launch {

// Who serves the job's rendezvous store (fsdp_run --store; fsdp/core/dist_env.hpp):
//  launcher (the default): fsdp_run (node 0's, with several nodes) hosts it for the whole
//    job. It outlives every rank and restart, keeps one port (no port is picked and then
//    freed for a rank to take), and begins a new generation before each restart
//    (TcpStoreServer), so a process left from an earlier start is refused.
//  rank0: rank 0's process hosts it; it ends with rank 0, and each restart gets a fresh
//    port (unless master_port is given) and token.
//  external: a store runs elsewhere (tools/fsdp_store at master_addr:master_port, which
//    must be given); fsdp_run hosts none and draws no token (FSDP_STORE_TOKEN of its
//    environment, if any, is passed on).
// The ranks get FSDP_STORE_HOST with its name (an FSDP_STORE_EXTERNAL in fsdp_run's
// environment is not passed on).
using fsdp::StoreHost;

// What fsdp_run starts again when a rank fails and --max-restarts allows (fsdp_run
// --restart-scope):
//  job (the default): every rank is stopped and the whole job started again, as the
//    store's next generation.
//  rank: only the failed rank is started again, as a replacement with the same RANK; the
//    others go on, with what they hold in memory, and rebuild their communicator with it
//    (fsdp::TcpProcessGroup::rejoin). Before it starts the replacement, fsdp_run gives the
//    failed rank's claim back in its store (fsdp::claim_key) and adds 1 to the store's
//    fsdp/job/epoch, the count the survivors wait on; the replacement gets that count in
//    FSDP_COMM_EPOCH. One node, fsdp_run's own store (--store launcher) only.
enum class RestartScope { job, rank };

// "job", "rank".
constexpr const char* name_of(RestartScope s) { return s == RestartScope::rank ? "rank" : "job"; }

struct Options {
  int nproc = 1;      // ranks on this node (torchrun's --nproc-per-node)
  int nnodes = 1;     // nodes in the job, each running fsdp_run with the same nproc
  int node_rank = 0;  // this node's index: its ranks are node_rank * nproc + 0 .. nproc - 1
  std::string master_addr = "127.0.0.1";  // where the job's store listens (see StoreHost)
  int master_port = 0;  // 0: a free loopback port, picked at launch (single node only)
  StoreHost store = StoreHost::launcher;  // who serves the store (see StoreHost)
  // "[rank R] " before every line a rank writes; false: the ranks write straight to
  // fsdp_run's stdout and stderr (which keeps a terminal a terminal).
  bool prefix_output = true;
  // After the first failure, the other ranks get SIGTERM, then SIGKILL this much later.
  std::chrono::milliseconds grace{3000};
  // A rank that exits with fsdp::kEchoExitStatus failed only because another rank did
  // (fsdp/core/exit_status.hpp): the job is stopped once a rank fails on its own account,
  // reported first, or this much after the first echo, whichever comes first. 0: at once.
  std::chrono::milliseconds echo_wait{2000};
  // When a rank fails, every rank is stopped and the whole job started again, up to this
  // many times (torchrun's --max-restarts): each start gets the restart count in
  // TORCHELASTIC_RESTART_COUNT, so a program can resume from its last checkpoint, and is
  // the store's next generation (see StoreHost for the store's port and token). With
  // restart_scope rank, this many replacements of failed ranks in all instead.
  int max_restarts = 0;
  RestartScope restart_scope = RestartScope::job;  // see RestartScope
  // 0: none; else the whole job is stopped (as for a failure) and run() throws after it,
  // without a restart. With max_restarts (scope job) it bounds each start, not all of
  // them; in scope rank, the whole job, replacements included.
  std::chrono::milliseconds timeout{0};
  // Extra variables for every rank (KEY, VALUE); they may not name a per-rank variable.
  std::vector<std::pair<std::string, std::string>> env;
};

// The variables every rank gets, with torchrun's names and meaning (see fsdp/core/dist_env.hpp).
inline constexpr std::string_view kRankVariables[] = {"MASTER_ADDR", "MASTER_PORT", "RANK",
                                                      "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
// The store's shared secret, the address it binds to where that is not loopback, who hosts
// it (fsdp_run sets it from --store), and the by-hand spelling of the last, which
// fsdp_run does not pass on.
inline constexpr const char* kTokenVariable = "FSDP_STORE_TOKEN";
inline constexpr const char* kBindVariable = "FSDP_STORE_BIND";
inline constexpr const char* kStoreHostVariable = "FSDP_STORE_HOST";
inline constexpr const char* kExternalStoreVariable = "FSDP_STORE_EXTERNAL";
// torchrun's names: how many times the job was restarted before this start, the limit, and
// the job's id (the same for every start: what a program uses to tell its own checkpoints
// from another job's; fsdp_run's own TORCHELASTIC_RUN_ID if set, else a random one).
inline constexpr const char* kRestartCountVariable = "TORCHELASTIC_RESTART_COUNT";
inline constexpr const char* kMaxRestartsVariable = "TORCHELASTIC_MAX_RESTARTS";
inline constexpr const char* kRunIdVariable = "TORCHELASTIC_RUN_ID";
// Which rebuild of the communicator a replacement rank joins (RestartScope::rank): set on
// replacements only; fsdp_run does not pass on one of its own environment.
inline constexpr const char* kCommEpochVariable = "FSDP_COMM_EPOCH";
inline constexpr int kMaxRestarts = 1000;

// DistEnv reads WORLD_SIZE up to 2^20; past a few thousand processes per node the machine
// runs out of processes or descriptors long before, so a bigger --nproc is a typo.
inline constexpr long long kMaxWorldSize = 1 << 20;
inline constexpr int kMaxProcsPerNode = 4096;

namespace detail {
// A duration flag in ms: positive and at most a day (0 is allowed where it means "none").
inline void check_ms(const char* flag, std::chrono::milliseconds ms, bool zero_means_none) {
  if (zero_means_none && ms.count() == 0) return;
  if (ms.count() <= 0 || ms > std::chrono::hours(24))
    fsdp::detail::fail("launch: ", flag, " must be in (0 ms, 24 h]", zero_means_none ? " or 0 (none)" : "", ", got ",
                       ms.count(), " ms");
}
}  // namespace detail

inline void validate(const Options& o) {
  using fsdp::detail::fail;
  if (o.nproc < 1 || o.nproc > kMaxProcsPerNode)
    fail("launch: --nproc must be in [1, ", kMaxProcsPerNode, "], got ", o.nproc);
  if (o.nnodes < 1 || static_cast<long long>(o.nnodes) * o.nproc > kMaxWorldSize)
    fail("launch: --nnodes must be at least 1 with nnodes * nproc at most ", kMaxWorldSize, ", got nnodes ", o.nnodes,
         " with nproc ", o.nproc);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    fail("launch: --node-rank ", o.node_rank, " is out of range [0, ", o.nnodes - 1, "] for --nnodes ", o.nnodes);
  if (o.master_addr.empty()) fail("launch: --master-addr is empty");
  if (o.master_port < 0 || o.master_port > 65535)
    fail("launch: --master-port must be in [1, 65535] (or 0: pick a free one), got ", o.master_port);
  if (o.master_port == 0 && o.nnodes > 1)
    fail("launch: --master-port is required with --nnodes ", o.nnodes,
         " (every node must name the same port; 0 picks a free one on a single node only)");
  if (o.master_port == 0 && o.store == StoreHost::external)
    fail("launch: --store external needs --master-port: the port the store (tools/fsdp_store) listens on");
  // fsdp_store tells jobs apart by their id; each node would draw its own.
  if (o.store == StoreHost::external && o.nnodes > 1 && !std::getenv(kRunIdVariable))
    fail("launch: --store external with --nnodes ", o.nnodes, " needs ", kRunIdVariable,
         " set to the same id on every node (the store tells jobs apart by it; one drawn per node would differ)");
  if (o.max_restarts < 0 || o.max_restarts > kMaxRestarts)
    fail("launch: --max-restarts must be in [0, ", kMaxRestarts, "], got ", o.max_restarts);
  if (o.restart_scope == RestartScope::rank) {
    if (o.max_restarts < 1)
      fail("launch: --restart-scope rank needs --max-restarts 1 or more (how many failed ranks to replace in all)");
    if (o.nnodes > 1)
      fail("launch: --restart-scope rank with --nnodes ", o.nnodes,
           ": a replacement is started on this node only, announced in fsdp_run's own store (one node only)");
    if (o.store != StoreHost::launcher)
      fail("launch: --restart-scope rank with --store ", name_of(o.store),
           ": it needs the store fsdp_run hosts (--store launcher, the default), which outlives every rank and "
           "which fsdp_run edits to announce each replacement");
  }
  if (o.max_restarts > 0 && o.nnodes > 1)
    fail("launch: --max-restarts ", o.max_restarts, " with --nnodes ", o.nnodes,
         ": a restart starts this node's ranks only, and the other nodes' would not follow (restarts are for one node)");
  detail::check_ms("--grace-ms", o.grace, false);
  detail::check_ms("--timeout-ms", o.timeout, true);
  detail::check_ms("--echo-wait-ms", o.echo_wait, true);
  for (const auto& [key, value] : o.env) {
    if (key.empty() || key.find('=') != std::string::npos || key.find('\0') != std::string::npos)
      fail("launch: --env '", key, "=", value, "': the name must be non-empty and contain no '='");
    for (auto reserved : kRankVariables)
      if (key == reserved) fail("launch: --env ", key, ": fsdp_run sets ", key, " itself, for each rank");
    if (key == kStoreHostVariable || key == kExternalStoreVariable)
      fail("launch: --env ", key, ": fsdp_run says who hosts the store itself (FSDP_STORE_HOST), from --store "
           "(launcher, rank0 or external)");
    if (key == kRestartCountVariable || key == kMaxRestartsVariable || key == kRunIdVariable)
      fail("launch: --env ", key, ": fsdp_run sets ", key, " itself (see --max-restarts; a ", kRunIdVariable,
           " in fsdp_run's own environment is passed on)");
    if (key == kCommEpochVariable)
      fail("launch: --env ", key, ": fsdp_run sets ", key, " itself, on a replacement rank (--restart-scope rank)");
  }
}

}  // namespace fsdp::launch
