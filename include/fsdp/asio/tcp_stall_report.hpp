#pragma once
// What a TcpComm timeout says. A rank that gives up publishes where it is under
// <prefix>/last/<rank> and raises <prefix>/timeout; ranks stalled in a collective of the
// same communicator see the flag (they look at most once a second while stalled) and
// publish theirs. The rank that timed out waits briefly for every report, then names the
// ranks that are behind: those in an older collective, and those that did not report
// (not in any collective of this communicator: stalled in other code, or a process that
// is stopped or dead).
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
#include "fsdp/store.hpp"

namespace fsdp::detail {

class StoreStallReport final : public StallObserver {
 public:
  StoreStallReport(std::shared_ptr<Store> store, std::string prefix, int rank, int size, std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), size_(size), timeout_(timeout) {}

  std::string last_key(int r) const { return prefix_ + "/last/" + std::to_string(r); }
  std::string flag_key() const { return prefix_ + "/timeout"; }

  void stalled(const CollectiveCall& call, const std::string& state) override {
    if (published_ && *published_ == call.seq) return;
    try {
      if (store_->try_get(flag_key())) publish(call, state);
    } catch (const std::exception&) {  // the store is only asked for a better message
    }
  }

  std::string timed_out(const CollectiveCall& call, const std::string& state) override {
    std::ostringstream os;
    os << "rank " << rank_ << ": " << call.describe() << " timed out after " << timeout_.count()
       << " ms without progress (" << state << ")";
    try {
      publish(call, state);
      store_->set(flag_key(), std::to_string(rank_));
      os << "; " << where_the_ranks_are(gather());
    } catch (const std::exception& e) {
      os << "; could not ask the other ranks where they are: " << e.what();
    }
    return os.str();
  }

 private:
  struct Report {
    std::uint64_t seq;
    std::string text;
  };

  void publish(const CollectiveCall& call, const std::string& state) {
    store_->set(last_key(rank_), std::to_string(call.seq) + "\t" + call.describe() + ": " + state);
    published_ = call.seq;
  }

  // Every rank's report, waiting at most min(timeout, 2 s) for the missing ones.
  std::vector<std::optional<Report>> gather() {
    std::vector<std::optional<Report>> reports(size_);
    const auto deadline = Store::Clock::now() + std::min<Store::Clock::duration>(timeout_, std::chrono::seconds(2));
    for (;;) {
      bool all = true;
      for (int r = 0; r < size_; ++r) {
        if (reports[r]) continue;
        if (auto v = store_->try_get(last_key(r))) {
          const auto tab = v->find('\t');
          reports[r] = Report{std::strtoull(v->c_str(), nullptr, 10), tab == std::string::npos ? *v : v->substr(tab + 1)};
        } else {
          all = false;
        }
      }
      if (all || Store::Clock::now() >= deadline) return reports;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
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
          os << sep << "rank " << r << " in " << reports[r]->text;
          sep = ", ";
        }
      os << " (the furthest rank is in collective #" << highest << ")";
    } else if (silent.empty()) {
      os << "none; every rank is in collective #" << lowest << ", so a link or a peer's process is stuck";
    }
    os << ". Reports: ";
    std::size_t listed = 0;
    for (int r = 0; r < size_ && listed < kMaxListed; ++r)
      if (reports[r]) os << (listed++ ? "; " : "") << "rank " << r << " in " << reports[r]->text;
    os << ".";
    return os.str();
  }

  std::shared_ptr<Store> store_;
  const std::string prefix_;
  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  std::optional<std::uint64_t> published_;
};

}  // namespace fsdp::detail
