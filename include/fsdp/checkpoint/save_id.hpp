#pragma once
// The save id: a random number drawn once per save and written into every file of that
// save (a full checkpoint's model and optimizer files, a sharded checkpoint's rank files and
// its index), in each file's own metadata ("fsdp.save_id" in a safetensors "__metadata__",
// "save_id" in index.json). A load compares the ids of the files it opens and refuses files
// from two saves, naming them: a model file next to an optimizer file of another save (a
// save killed between its renames, a file copied from elsewhere) is an error, not a
// training run resumed from a mix. Each file's checksum covers its id, so the id cannot
// change without its file failing its checksum.
//
// 63 bits, never 0: ranks agree on rank 0's id by a maximum over signed 64-bit integers
// (the collectives the saves already use), and 0 means "no id".
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include "fsdp/checkpoint/checksum.hpp"

namespace fsdp::checkpoint {

inline constexpr std::string_view save_id_key = "fsdp.save_id";

// A fresh id: the system's random source, mixed with the clock and the process id in case
// that source is deterministic (some sandboxes: two jobs started together would draw the
// same), in [1, 2^63). Also the tokens that name a save's staging directory and shared
// temporary files.
inline std::uint64_t new_save_id() {
  std::random_device rd;
  const auto now = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
                   static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) << 1;
  const auto pid = static_cast<std::uint64_t>(::getpid());
  std::uint64_t id = 0;
  while (id == 0) {
    const std::uint64_t drawn = std::uint64_t{rd()} << 32 ^ rd();
    Xxh64 h;  // mixes every bit of each into all of the id's
    h.update(&drawn, sizeof drawn);
    h.update(&now, sizeof now);
    h.update(&pid, sizeof pid);
    id = h.digest() & 0x7fff'ffff'ffff'ffffull;
  }
  return id;
}

// The id of the save whose ranks agreed on `token` (any text, the same on every rank: a
// sharded save's staging token), so that the saves need no collective more for it.
inline std::uint64_t save_id_of_token(std::string_view token) {
  Xxh64 h;
  h.update(token.data(), token.size());
  const std::uint64_t id = h.digest() & 0x7fff'ffff'ffff'ffffull;
  return id == 0 ? 1 : id;
}

// 16 lowercase hex digits, as checksums are written.
inline std::string format_save_id(std::uint64_t id) { return xxh64_hex(id); }
// nullopt unless exactly 16 hex digits.
inline std::optional<std::uint64_t> parse_save_id(std::string_view text) { return parse_xxh64_hex(text); }

}  // namespace fsdp::checkpoint
