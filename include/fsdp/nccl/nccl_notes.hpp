#pragma once
// Where an NcclComm's abort_step agreement leaves word for the peers: which rank aborted,
// at which collective, and its note (CollectiveTag::note: the exception that left its
// step). NCCL gathers only each rank's 8-byte tag, and only once a collective completes
// (nccl_tag_ring.hpp): a peer still inside the step learns from the tags that rank R
// called abort_step where the calls had the same shape, and learns nothing where they did
// not (a unit's all_gather meets the agreement's all_reduce: NCCL never completes them and
// the peer would time out). So the aborting rank leaves word in a store before it issues
// the agreement (before staging its host buffer too), under the agreement's place among
// the collectives enqueued on the communicator (NcclInFlight::launch: NCCL pairs calls by
// it), and a rank whose collective in that place mismatched, stays in flight or timed out
// reads it there: its error names the aborting rank, quotes its note, and is an echo of it
// (detail::EchoedError). It also leaves word that it left that collective, which the
// aborting rank's watchdog looks for, so that rank's agreement fails too, on its own
// account, instead of waiting out the timeout. An agreement that was never enqueued takes
// its word back.
//
// Costs: nothing while collectives complete within a second. A collective still in flight
// after 1 s (a slow or straggling peer, or a host far ahead of its GPU) costs a store
// request from the watchdog at ages 1, 2, 4 and 8 s, then every 8 s, outside the
// communicator's lock. The failure paths make a few more.
//
// The store: a bounded client (Store::bounded_client: every request bounded by
// kStoreRequestBound, on a connection of its own, shared by the communicators of a
// process) of from_store()'s store, made at setup where the world has more than one rank.
// Where a request fails, the watchdog's and the post's are tried once more on a new client
// (a client that timed out once refuses every later request); those made under the
// communicator's lock are not. create()'s communicators, ranks of one process, share an
// in-process HashStore. A store with no bounded client (an in-process store, which the
// communicator could outlive) carries no word: the errors then say what the tags say, or
// time out, as before. Word is best effort: a store that fails leaves the word out, never
// the agreement or the error.
//
// Not covered: a collective of a split communicator (HybridShard's shard and replica
// groups) whose peer aborted on the parent (the agreement runs on the world): different
// keys; and the collectives of a captured step's replay.
//
// Keys: `prefix/L` and `prefix/L/left` for place L, where the prefix is unique to the
// communicator (from_store: its store key and a hash of its unique id; a split adds the
// child's name), so no word of another communicator is read. The first rank to abort at L
// sets it (compare_set); values are "<rank>\n<text>".
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "fsdp/core/store.hpp"

namespace fsdp::detail {

class NcclNotes {
 public:
  struct Word {
    int rank = -1;                             // the rank that left it
    std::shared_ptr<const std::string> text;  // its note (or what it left); null: none
  };

  NcclNotes() = default;  // no word travels
  // Through a bounded client of `store` (from_store's), made now; none where it has none
  // or cannot make one (no word then: not worth failing the communicator's setup for).
  static NcclNotes bounded(Store& store, std::string prefix) {
    std::shared_ptr<Store> client;
    try {
      client = store.bounded_client(kStoreRequestBound);
    } catch (...) {
    }
    return NcclNotes(std::move(client), std::move(prefix));
  }
  // Through a store of this process's own, for ranks that all live in it (create()).
  static NcclNotes in_process() { return NcclNotes(std::make_shared<HashStore>(), "abort_notes"); }

  explicit operator bool() const { return channel_ != nullptr; }

  // The word of a communicator split from this one (`suffix`: the same on its ranks).
  NcclNotes child(const std::string& suffix) const {
    if (!channel_) return {};
    std::lock_guard lk(channel_->mu);
    return NcclNotes(channel_->store, channel_->prefix + suffix);
  }

  // Rank `rank` is about to issue abort_step's agreement in place `launch`.
  void post(std::uint64_t launch, int rank, const std::shared_ptr<const std::string>& note) const noexcept {
    set(launch, "", rank, note ? *note : std::string(), true);
  }
  // Its agreement was never enqueued: the place will hold another collective.
  void take_back(std::uint64_t launch) const noexcept {
    if (!channel_) return;
    try {
      channel_->request([&](Store& s) { (void)s.delete_key(key(launch)); }, true);
    } catch (...) {
    }
  }
  // Rank `rank` left its collective in place `launch` (`what`: that collective) because of
  // the word there.
  void leave(std::uint64_t launch, int rank, const std::string& what, bool renew) const noexcept {
    set(launch, "/left", rank, what, renew);
  }

  // The word left in place `launch` (`renew`: may make a new client when a request fails;
  // not under the communicator's lock).
  std::optional<Word> fetch(std::uint64_t launch, bool renew) const noexcept { return get(launch, "", renew); }
  // Who left their collective in place `launch`, if anyone.
  std::optional<Word> left(std::uint64_t launch, bool renew) const noexcept {
    return get(launch, "/left", renew);
  }

 private:
  struct Channel {
    std::mutex mu;  // the client may be replaced (request)
    std::shared_ptr<Store> store;
    std::string prefix;
    // `fn(store)`; when it throws and `renew`, once more on a new bounded client of the
    // same server (a client that timed out once refuses every later request).
    template <class Fn>
    void request(Fn&& fn, bool renew) {
      std::shared_ptr<Store> s;
      {
        std::lock_guard lk(mu);
        s = store;
      }
      std::exception_ptr failed;
      try {
        fn(*s);
        return;
      } catch (...) {
        failed = std::current_exception();
      }
      std::shared_ptr<Store> fresh = renew ? s->bounded_client(kStoreRequestBound) : nullptr;
      if (!fresh) std::rethrow_exception(failed);  // in-process, or not now: nothing to renew
      {
        std::lock_guard lk(mu);
        store = fresh;
      }
      fn(*fresh);
    }
  };

  NcclNotes(std::shared_ptr<Store> store, std::string prefix) {
    if (!store) return;
    channel_ = std::make_shared<Channel>();
    channel_->store = std::move(store);
    channel_->prefix = std::move(prefix);
  }

  std::string key(std::uint64_t launch) const { return channel_->prefix + "/" + std::to_string(launch); }

  // The keys below are built only where there is a channel.
  void set(std::uint64_t launch, const char* suffix, int rank, const std::string& text, bool renew) const noexcept {
    if (!channel_) return;
    try {
      const std::string k = key(launch) + suffix;
      const std::string value = std::to_string(rank) + "\n" + text;
      channel_->request([&](Store& s) { (void)s.compare_set(k, "", value); }, renew);
    } catch (...) {  // best effort: the caller goes on without it
    }
  }
  std::optional<Word> get(std::uint64_t launch, const char* suffix, bool renew) const noexcept {
    if (!channel_) return std::nullopt;
    try {
      const std::string k = key(launch) + suffix;
      std::optional<std::string> value;
      channel_->request([&](Store& s) { value = s.try_get(k); }, renew);
      if (!value) return std::nullopt;
      const auto cut = value->find('\n');
      if (cut == std::string::npos || cut == 0 || cut > 9) return std::nullopt;
      Word w;
      w.rank = std::stoi(value->substr(0, cut));
      if (value->size() > cut + 1) w.text = std::make_shared<const std::string>(value->substr(cut + 1));
      return w;
    } catch (...) {  // a store that fails: the caller goes on without the word
      return std::nullopt;
    }
  }

  std::shared_ptr<Channel> channel_;  // null: no word travels
};

}  // namespace fsdp::detail
