#pragma once
// Where abort_step's note (CollectiveTag::note: the exception that left a rank's step)
// travels between an NcclComm's ranks. NCCL gathers only each rank's 8-byte tag beside a
// collective (nccl_tag_ring.hpp), so a peer still inside the step learns from the tags that
// rank R called abort_step, but not why. The aborting rank therefore also sets its note in
// a store before it issues the agreement, and a rank that finds the mismatch reads it from
// there, so its error quotes that exception as it does on the other backends. Failure paths
// only: a step that succeeds never touches the store.
//
// The store is from_store()'s, through Store::bounded_client (every request bounded by
// kStoreRequestBound, on a connection of its own); create()'s communicators, ranks of one
// process, share an in-process HashStore. A store with no bounded client (an in-process
// store, which the communicator could outlive) carries none: the message then names the
// rank and its abort_step without the quote. Notes are best effort: a store that fails
// leaves the quote out, never the agreement or the error.
//
// Keys: `prefix/rank`, one per rank, overwritten by each abort_step; the value begins with
// the agreement's packed tag, which the reader compares with the tag NCCL gathered, so a
// note of another agreement is never quoted.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "fsdp/core/store.hpp"

namespace fsdp::detail {

struct NcclNotes {
  std::shared_ptr<Store> store;  // null: no note travels
  std::string prefix;            // this communicator's keys

  // The notes of a communicator split from this one (`suffix`: the same on its ranks).
  NcclNotes child(const std::string& suffix) const { return {store, prefix + suffix}; }

  // Rank `rank` is about to issue the agreement tagged `tag`, carrying `note`.
  void post(int rank, std::uint64_t tag, const std::string& note) const noexcept {
    if (!store) return;
    try {
      store->set(key(rank), hex(tag) + note);
    } catch (...) {  // best effort: the agreement goes on without it
    }
  }

  // The note rank `rank` posted with `tag`, or null (none, another agreement's, no store).
  std::shared_ptr<const std::string> fetch(int rank, std::uint64_t tag) const noexcept {
    if (!store) return nullptr;
    try {
      const auto value = store->try_get(key(rank));
      const std::string expected = hex(tag);
      if (!value || value->compare(0, expected.size(), expected) != 0) return nullptr;
      return std::make_shared<const std::string>(value->substr(expected.size()));
    } catch (...) {  // a store that fails: the error goes on without the quote
      return nullptr;
    }
  }

 private:
  std::string key(int rank) const { return prefix + "/" + std::to_string(rank); }
  static std::string hex(std::uint64_t tag) {
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(tag));
    return out;
  }
};

}  // namespace fsdp::detail
