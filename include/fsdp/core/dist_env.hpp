#pragma once
// The launch environment, with torchrun's names and meaning: MASTER_ADDR, MASTER_PORT,
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT,
// TORCHELASTIC_RUN_ID. fsdp_run (tools/) sets them; so can a cluster script by hand.
// FSDP_STORE_TOKEN, if set, is a shared secret the store demands.
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"

namespace fsdp {

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
    return e;
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
