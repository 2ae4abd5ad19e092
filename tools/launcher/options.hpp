#pragma once
// fsdp::launch::Options: how many ranks fsdp_run starts on this node, where they meet, and
// how it supervises them; validate() refuses a bad value before any process starts.
#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp::launch {

struct Options {
  int nproc = 1;      // ranks on this node (torchrun's --nproc-per-node)
  int nnodes = 1;     // nodes in the job, each running fsdp_run with the same nproc
  int node_rank = 0;  // this node's index: its ranks are node_rank * nproc + 0 .. nproc - 1
  std::string master_addr = "127.0.0.1";  // where rank 0's store listens
  int master_port = 0;  // 0: a free loopback port, picked at launch (single node only)
  // "[rank R] " before every line a rank writes; false: the ranks write straight to
  // fsdp_run's stdout and stderr (which keeps a terminal a terminal).
  bool prefix_output = true;
  // After the first failure, the other ranks get SIGTERM, then SIGKILL this much later.
  std::chrono::milliseconds grace{3000};
  // 0: none; else the whole job is stopped (as for a failure) and run() throws after it.
  std::chrono::milliseconds timeout{0};
  // Extra variables for every rank (KEY, VALUE); they may not name a per-rank variable.
  std::vector<std::pair<std::string, std::string>> env;
};

// The variables every rank gets, with torchrun's names and meaning (see fsdp/core/dist_env.hpp).
inline constexpr std::string_view kRankVariables[] = {"MASTER_ADDR", "MASTER_PORT", "RANK",
                                                      "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
// The store's shared secret, and (several nodes) the address rank 0's store binds to.
inline constexpr const char* kTokenVariable = "FSDP_STORE_TOKEN";
inline constexpr const char* kBindVariable = "FSDP_STORE_BIND";

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
  detail::check_ms("--grace-ms", o.grace, false);
  detail::check_ms("--timeout-ms", o.timeout, true);
  for (const auto& [key, value] : o.env) {
    if (key.empty() || key.find('=') != std::string::npos || key.find('\0') != std::string::npos)
      fail("launch: --env '", key, "=", value, "': the name must be non-empty and contain no '='");
    for (auto reserved : kRankVariables)
      if (key == reserved) fail("launch: --env ", key, ": fsdp_run sets ", key, " itself, for each rank");
  }
}

}  // namespace fsdp::launch
