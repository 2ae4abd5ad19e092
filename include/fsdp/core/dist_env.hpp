#pragma once
// The launch environment, with torchrun's names and meaning: MASTER_ADDR, MASTER_PORT,
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT,
// TORCHELASTIC_RUN_ID. fsdp_run (tools/) sets them; so can a cluster script by hand.
// FSDP_STORE_TOKEN, if set, is a shared secret the store demands; FSDP_STORE_HOST (or
// FSDP_STORE_EXTERNAL) says who serves the store.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"

namespace fsdp {

// Who serves a job's rendezvous store: fsdp_run --store, the ranks' FSDP_STORE_HOST.
enum class StoreHost {
  // The launcher (fsdp_run; node 0's with several nodes), for the whole job: it outlives
  // every rank and restart, and begins each restart's generation itself.
  launcher,
  // Rank 0's process: the store ends with it (fsdp::connect_store starts it there).
  rank0,
  // A store run apart, tools/fsdp_store: it may serve one job after another.
  external,
};

// "launcher", "rank0", "external".
constexpr const char* name_of(StoreHost h) {
  switch (h) {
    case StoreHost::launcher: return "launcher";
    case StoreHost::rank0: return "rank0";
    case StoreHost::external: return "external";
  }
  return "?";
}

struct DistEnv {
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string token;  // FSDP_STORE_TOKEN; empty = none
  // TORCHELASTIC_RESTART_COUNT: how many times the launcher restarted the job before this
  // start (fsdp_run --max-restarts, torchrun); 0 for the first start or when unset. A
  // program that saves checkpoints resumes from its last one when this is > 0.
  int restart_count = 0;
  // TORCHELASTIC_RUN_ID: the job's id, the same for every start of it (empty when unset):
  // a restarted job resumes only from checkpoints that carry it, not another job's.
  std::string run_id;
  // FSDP_COMM_EPOCH: which rebuild of the job's communicator this process joins (0 when
  // unset). fsdp_run --restart-scope rank sets it on a replacement for a failed rank; the
  // survivors reach the same epoch through TcpProcessGroup::rejoin().
  int comm_epoch = 0;

  // The store's membership generation this process joins: the job's whole restarts, that
  // is restart_count less the replacements of single ranks (comm_epoch: fsdp_run
  // --restart-scope rank keeps the generation). A stale rank of an earlier start is refused.
  std::uint64_t store_generation() const { return static_cast<std::uint64_t>(std::max(0, restart_count - comm_epoch)); }
  // The same from the environment alone, where RANK and the others may be unset (a store
  // client that is not a rank).
  static std::uint64_t store_generation_from_env() {
    DistEnv e;
    e.restart_count = static_cast<int>(number("TORCHELASTIC_RESTART_COUNT", 0, 1 << 20, false).value_or(0));
    e.comm_epoch = static_cast<int>(number("FSDP_COMM_EPOCH", 0, 1 << 20, false).value_or(0));
    return e.store_generation();
  }

  // True when RANK and WORLD_SIZE are both set (the program was launched as one rank of
  // a job); a lone process then runs as world size 1.
  static bool launched() { return std::getenv("RANK") && std::getenv("WORLD_SIZE"); }

  // Reads the environment; every variable that is set must be a valid value, and a
  // required one (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) that is missing is an error.
  static DistEnv from_env() {
    DistEnv e;
    e.master_addr = text("MASTER_ADDR", true).value();
    e.master_port = static_cast<std::uint16_t>(number("MASTER_PORT", 1, 65535, true).value());
    e.world_size = static_cast<int>(number("WORLD_SIZE", 1, 1 << 20, true).value());
    e.rank = static_cast<int>(number("RANK", 0, e.world_size - 1, true).value());
    e.local_world_size = static_cast<int>(number("LOCAL_WORLD_SIZE", 1, e.world_size, false).value_or(e.world_size));
    e.local_rank = static_cast<int>(number("LOCAL_RANK", 0, e.local_world_size - 1, false).value_or(e.rank % e.local_world_size));
    e.token = text("FSDP_STORE_TOKEN", false).value_or("");
    e.restart_count = static_cast<int>(number("TORCHELASTIC_RESTART_COUNT", 0, 1 << 20, false).value_or(0));
    e.run_id = text("TORCHELASTIC_RUN_ID", false).value_or("");
    e.comm_epoch = static_cast<int>(number("FSDP_COMM_EPOCH", 0, 1 << 20, false).value_or(0));
    return e;
  }

  // Who serves the store: FSDP_STORE_HOST (launcher, rank0 or external; what fsdp_run
  // sets), else FSDP_STORE_EXTERNAL (what a user sets by hand, a boolean: true, the store
  // runs apart from the ranks, external; false, rank0), else rank0. Anything else, or the
  // two set and disagreeing (true with rank0, false with launcher or external), is an
  // error naming them.
  static StoreHost store_host() {
    const std::optional<bool> external = detail::env_bool("FSDP_STORE_EXTERNAL");
    const auto host = text("FSDP_STORE_HOST", false);
    if (!host) return external.value_or(false) ? StoreHost::external : StoreHost::rank0;
    std::optional<StoreHost> found;
    for (StoreHost h : {StoreHost::launcher, StoreHost::rank0, StoreHost::external})
      if (*host == name_of(h)) found = h;
    if (!found)
      detail::fail("environment: FSDP_STORE_HOST is '", *host, "'; write launcher, rank0 or external");
    if (external && *external != (*found != StoreHost::rank0))
      detail::fail("environment: FSDP_STORE_HOST=", *host, " and FSDP_STORE_EXTERNAL=", std::getenv("FSDP_STORE_EXTERNAL"),
                   " disagree (", *external ? "a store run apart" : "rank 0 hosting it", "); set one of them");
    return *found;
  }

  // An environment variable's value (nullopt when unset or empty; an error when required).
  static std::optional<std::string> text(const char* name, bool required) {
    const char* v = std::getenv(name);
    if (!v || !*v) {
      if (required) detail::fail("environment: ", name, " is not set (launch with fsdp_run, torchrun-style)");
      return std::nullopt;
    }
    return std::string(v);
  }
  // An integer variable in [lo, hi]: anything else set there is an error naming it.
  static std::optional<long long> number(const char* name, long long lo, long long hi, bool required) {
    auto s = text(name, required);
    if (!s) return std::nullopt;
    // Read whole (fsdp/core/parse.hpp): " 5", "+5", "5abc" and "0x10" are refused, not read as 5 or 0.
    return detail::parse_integer<long long>(*s, std::string("environment: ") + name, lo, hi);
  }
};

}  // namespace fsdp
