#pragma once
// Where the ranks of a TcpComm are when one of them fails, learned through the store, for
// the two failures a rank cannot explain alone: a timeout and a collective mismatch. The
// rank that fails publishes its call under <prefix>/last/<rank> and raises <prefix>/ask;
// ranks stalled in a collective of the same communicator see the flag (they look at most
// once a second while stalled, never while collectives progress) and publish theirs. The
// failing rank waits briefly for every report, then says:
//  - after a timeout, which ranks are behind: those in an older collective, and those that
//    did not report (not in any collective of this communicator: stalled in other code, or
//    a process that is stopped or dead);
//  - after a mismatch, every rank's call with its unit, worded as ThreadComm words it
//    (detail/collective_mismatch.hpp). The first such message in <prefix>/mismatch is the
//    one every detecting rank reports, and ABORT frames carry it to the others.
// Every store request of a report, and the destructor's removal of the address, goes
// through Store::bounded_client (kStoreRequestBound per request, one connection per process),
// not the communicator's own store client, whose request timeout may be minutes: a store
// that stopped answering costs the failing rank about one bound, and the error then says
// the ranks could not be asked and why. Used by one thread at a time: the communicator's
// I/O thread, or its constructor and destructor.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/asio/tcp_ring.hpp"
#include "fsdp/core/detail/collective_mismatch.hpp"
#include "fsdp/core/store.hpp"

namespace fsdp::detail {

class StoreRankReport final : public RingObserver {
 public:
  StoreRankReport(std::shared_ptr<Store> store, std::string prefix, int rank, int size, std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), size_(size), timeout_(timeout) {}

  std::string last_key(int r) const { return prefix_ + "/last/" + std::to_string(r); }
  std::string flag_key() const { return prefix_ + "/ask"; }
  std::string mismatch_key() const { return prefix_ + "/mismatch"; }

  // The longest wait for reports after a mismatch. Stalled ranks look at the flag every
  // ring_poll_interval (timeout/4, at most 1 s), so 2 s gives the slowest a second to
  // spare; on short timeouts, timeout/2 (two looks) ends the wait well before the ranks
  // stalled on this one time out themselves.
  std::chrono::milliseconds mismatch_wait() const {
    return std::min<std::chrono::milliseconds>(timeout_ / 2, std::chrono::seconds(2));
  }

  void stalled(const CollectiveCall& call, const std::string& state) override {
    if (published_ && *published_ == call.seq) return;
    std::string ignored;  // the store is only asked for a better message
    through_store([&](Store& s) {
      if (s.try_get(flag_key())) publish(s, call, state);
    }, ignored);
  }

  std::string timed_out(const CollectiveCall& call, const std::string& state) override {
    std::ostringstream os;
    os << "rank " << rank_ << ": " << call.describe() << " timed out after " << timeout_.count()
       << " ms without progress (" << state << ")";
    std::vector<std::optional<Report>> reports;
    std::string failure;
    if (through_store([&](Store& s) {
          ask(s, call, state);
          reports = gather(s, std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(2)));
        }, failure))
      os << "; " << where_the_ranks_are(reports);
    else
      os << "; could not ask the other ranks where they are: " << failure;
    return os.str();
  }

  std::string mismatched(const CollectiveCall& call, const CollectiveCall& left_call, int left_rank) override {
    std::string message, failure;
    const bool asked = through_store([&](Store& s) {
      ask(s, call, "its frames disagree with rank " + std::to_string(left_rank) + "'s");
      const auto reports = gather(s, mismatch_wait());
      std::vector<std::string> each_rank(size_);
      bool silent = false;
      for (int r = 0; r < size_; ++r) {
        if (reports[r]) each_rank[r] = "called " + reports[r]->call;
        else if (r == left_rank) each_rank[r] = "called " + left_call.describe();  // its frame's header says so
        else each_rank[r] = "did not report";
        silent = silent || !reports[r];
      }
      message = mismatch_message(each_rank, static_cast<std::size_t>(rank_));
      if (silent)
        message += "; a rank that did not report within " + std::to_string(mismatch_wait().count()) +
                   " ms is in no collective of communicator " + prefix_ +
                   " (stalled in other code, or its process is stopped or dead)";
      message = s.compare_set(mismatch_key(), "", message);  // the first rank's message, on every rank
    }, failure);
    if (asked) return message;
    return "collective mismatch: rank " + std::to_string(rank_) + " called " + call.describe() + " but rank " +
           std::to_string(left_rank) + " called " + left_call.describe() +
           "; could not ask the other ranks what they called: " + failure;
  }

  // Where a communicator deletes its address key as it goes: the bounded client (connected
  // now if no report did), not the store it was given, whose connection another thread's
  // long get or wait may hold and whose request timeout may be minutes: a destructor must
  // not wait that long when the store is what failed, or when a peer's failure has not
  // reached this rank yet. Null when the store's last request failed: the key is left as
  // a dead process leaves it, for the next communicator of the prefix to replace. May
  // throw (connecting).
  Store* store_for_cleanup() { return failed_at_ ? nullptr : &bounded_store(); }

  // This rank's report, and (`shared`) the keys that ask for reports: called before
  // joining, for what an earlier communicator of this prefix left (it never removes them
  // itself, since a peer may still be gathering them): a stale report, flag, or a
  // mismatch message that compare_set would return as this communicator's. Rank 0 clears
  // the shared keys, before it publishes its address: a mismatch found earlier (only
  // between ranks that joined without waiting for rank 0) at worst leaves the ranks'
  // messages different. Run by the join (RingJoiner::join), through its bounded client and
  // under its deadline; throws the store's error.
  void forget(Store& s, bool shared) const {
    s.delete_key(last_key(rank_));
    if (!shared) return;
    s.delete_key(flag_key());
    s.delete_key(mismatch_key());
  }

 private:
  struct Report {
    std::uint64_t seq;
    std::string call;   // its describe(), with the reporting rank's unit names
    std::string state;  // how far it got
  };

  // Publishes this rank's call, then asks the others for theirs.
  void ask(Store& s, const CollectiveCall& call, const std::string& state) {
    publish(s, call, state);
    s.set(flag_key(), std::to_string(rank_));
  }

  // Its call's words, with abort_step's note (an engine's message, which may hold tabs:
  // they become spaces, as the report's fields are tab-separated).
  void publish(Store& s, const CollectiveCall& call, const std::string& state) {
    std::string words = call.describe(true);  // for the mismatch's list
    std::replace(words.begin(), words.end(), '\t', ' ');
    s.set(last_key(rank_), std::to_string(call.seq) + "\t" + words + "\t" + state);
    published_ = call.seq;
  }

  // Every rank's report, waiting at most `wait` (and one request) for the missing ones.
  std::vector<std::optional<Report>> gather(Store& s, std::chrono::milliseconds wait) {
    std::vector<std::optional<Report>> reports(size_);
    const auto deadline = Store::Clock::now() + wait;
    for (;;) {
      bool all = true;
      for (int r = 0; r < size_; ++r) {
        if (reports[r]) continue;
        if (auto v = s.try_get(last_key(r))) reports[r] = parse(*v);
        else all = false;
        if (Store::Clock::now() >= deadline) return reports;  // a slow store: each request counts
      }
      if (all) return reports;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  static Report parse(const std::string& v) {
    const auto tab = v.find('\t'), tab2 = tab == std::string::npos ? tab : v.find('\t', tab + 1);
    if (tab2 == std::string::npos) return {0, v, "?"};
    return {std::strtoull(v.c_str(), nullptr, 10), v.substr(tab + 1, tab2 - tab - 1), v.substr(tab2 + 1)};
  }

  std::string where_the_ranks_are(const std::vector<std::optional<Report>>& reports) const {
    std::uint64_t lowest = UINT64_MAX, highest = 0;
    std::vector<int> silent;
    for (int r = 0; r < size_; ++r) {
      if (!reports[r]) {
        silent.push_back(r);
        continue;
      }
      lowest = std::min(lowest, reports[r]->seq);
      highest = std::max(highest, reports[r]->seq);
    }
    auto in = [&](int r) { return "rank " + std::to_string(r) + " in " + reports[r]->call + ": " + reports[r]->state; };
    std::ostringstream os;
    os << "behind: ";
    const char* sep = "";
    constexpr std::size_t kMaxListed = 8;  // messages stay readable on large worlds
    for (std::size_t i = 0; i < silent.size() && i < kMaxListed; ++i, sep = ", ") os << sep << "rank " << silent[i];
    if (silent.size() > kMaxListed) os << " and " << silent.size() - kMaxListed << " more";
    if (!silent.empty())
      os << (silent.size() == 1 ? " did" : " did all") << " not report (not in a collective of communicator " << prefix_
         << ": stalled in other code, or its process is stopped or dead)";
    if (lowest < highest) {
      for (int r = 0; r < size_; ++r)
        if (reports[r] && reports[r]->seq == lowest) {
          os << sep << in(r);
          sep = ", ";
        }
      os << " (the furthest rank is in collective #" << highest << ")";
    } else if (silent.empty()) {
      os << "none; every rank is in collective #" << lowest << ", so a link or a peer's process is stuck";
    }
    os << ". Reports: ";
    std::size_t listed = 0;
    for (int r = 0; r < size_ && listed < kMaxListed; ++r)
      if (reports[r]) os << (listed++ ? "; " : "") << in(r);
    os << ".";
    return os.str();
  }

  // Runs `use(store)` on the bounded client; false, with the reason in `failure`, when the
  // store failed. After a failure the store is not asked again for kRetryAfter: a stalled
  // rank would otherwise spend every look at the flag in a bounded handshake (its I/O
  // thread, and so its collective, waits meanwhile), and the reason stands in.
  template <class Use>
  bool through_store(Use&& use, std::string& failure) {
    const auto now = Store::Clock::now();
    if (failed_at_ && now < *failed_at_ + kRetryAfter) {
      const auto ago = std::chrono::duration_cast<std::chrono::milliseconds>(now - *failed_at_);
      failure = last_failure_ + " (" + std::to_string(ago.count()) + " ms ago)";
      return false;
    }
    try {
      use(bounded_store());
      failed_at_.reset();
      return true;
    } catch (const std::exception& e) {
      bounded_.reset();  // connect afresh next time
      failed_at_ = Store::Clock::now();
      failure = last_failure_ = e.what();
      return false;
    }
  }

  // Connected at first use (a communicator that never fails or stalls may never open it,
  // though its destructor does); the store itself where it has none (in-process).
  Store& bounded_store() {
    if (!bounded_) bounded_ = store_->bounded_client(kStoreRequestBound);
    if (!bounded_) bounded_ = store_;
    return *bounded_;
  }

  static constexpr std::chrono::seconds kRetryAfter{10};

  std::shared_ptr<Store> store_;
  std::shared_ptr<Store> bounded_;
  std::optional<Store::Clock::time_point> failed_at_;  // the store's last request failed then
  std::string last_failure_;
  const std::string prefix_;
  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  std::optional<std::uint64_t> published_;
};

}  // namespace fsdp::detail
