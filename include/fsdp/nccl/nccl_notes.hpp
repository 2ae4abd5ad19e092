#pragma once
// Where an NcclComm's abort_step agreement leaves word for the peers: which rank aborted
// at which collective, and its note (CollectiveTag::note: the exception that left its
// step). NCCL gathers only each rank's 8-byte tag, and only once a collective completes
// (nccl_tag_ring.hpp): a peer still inside the step learns from the tags that rank R
// called abort_step where the calls had the same shape, and learns nothing where they did
// not (a unit's all_gather meets the agreement's all_reduce: NCCL never completes them and
// the peer times out). So the aborting rank also leaves word in a store before it issues
// the agreement, under the agreement's collective number, and a rank whose collective of
// that number mismatched or timed out reads it there: its error names the aborting rank,
// quotes its note, and is an echo of it (detail::EchoedError). Failure paths only: a step
// that succeeds never touches the store.
//
// The store: a bounded client (Store::bounded_client: every request bounded by
// kStoreRequestBound, on a connection of its own, one per process however many
// communicators use it) of from_store()'s store, made at setup where the world has more
// than one rank, and made again once when a request fails; create()'s
// communicators, ranks of one process, share an in-process HashStore. A store with no
// bounded client (an in-process store, which the communicator could outlive) carries no
// word: the errors then say what the tags say, or time out, as before. Word is best
// effort: a store that fails leaves the quote out, never the agreement or the error.
//
// Keys: `prefix/N` for collective number N, where the prefix is unique to the
// communicator (from_store: its store key and a hash of its unique id; a split adds the
// child's name), so no word of another communicator or another agreement is read. The
// first rank to abort at N sets it (compare_set); its value is "<rank>\n<note>".
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
    int rank = -1;                             // the rank that aborted
    std::shared_ptr<const std::string> note;  // its note; null: it had none
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
    NcclNotes n;
    if (!channel_) return n;
    n.channel_ = std::make_shared<Channel>();
    n.channel_->store = channel_->store;
    n.channel_->prefix = channel_->prefix + suffix;
    return n;
  }

  // Rank `rank` is about to issue abort_step's agreement as collective `seq`.
  void post(std::uint64_t seq, int rank, const std::shared_ptr<const std::string>& note) const noexcept {
    if (!channel_) return;
    try {
      const std::string value = std::to_string(rank) + "\n" + (note ? *note : std::string());
      channel_->request([&](Store& s) { (void)s.compare_set(key(seq), "", value); });
    } catch (...) {  // best effort: the agreement goes on without it
    }
  }

  // The word left at collective `seq`, if any.
  std::optional<Word> fetch(std::uint64_t seq) const noexcept {
    if (!channel_) return std::nullopt;
    try {
      std::optional<std::string> value;
      channel_->request([&](Store& s) { value = s.try_get(key(seq)); });
      if (!value) return std::nullopt;
      const auto cut = value->find('\n');
      if (cut == std::string::npos || cut == 0 || cut > 9) return std::nullopt;
      Word w;
      w.rank = std::stoi(value->substr(0, cut));
      if (value->size() > cut + 1) w.note = std::make_shared<const std::string>(value->substr(cut + 1));
      return w;
    } catch (...) {  // a store that fails: the error goes on without the word
      return std::nullopt;
    }
  }

  // FNV-1a: the same 64 bits on every rank for the same bytes (a unique id's).
  static std::uint64_t hash(const void* data, std::size_t n) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(data)[i]) * 0x100000001b3ull;
    return h;
  }

 private:
  struct Channel {
    std::mutex mu;  // the client may be replaced (request)
    std::shared_ptr<Store> store;
    std::string prefix;
    // `fn(store)`; when it throws, once more on a new bounded client of the same server
    // (a client that timed out once refuses every later request).
    template <class Fn>
    void request(Fn&& fn) {
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
      std::shared_ptr<Store> fresh = s->bounded_client(kStoreRequestBound);
      if (!fresh) std::rethrow_exception(failed);  // in-process: nothing to renew
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

  std::string key(std::uint64_t seq) const { return channel_->prefix + "/" + std::to_string(seq); }

  std::shared_ptr<Channel> channel_;  // null: no word travels
};

}  // namespace fsdp::detail
