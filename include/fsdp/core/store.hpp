#pragma once
// fsdp::Store: the key-value rendezvous that multi-process backends bootstrap from (the
// role of torch.distributed's Store). Values are byte strings. TcpStore (fsdp/asio/) is the
// multi-process one; HashStore below serves ranks that are threads of one process.
//
// Every blocking verb takes a timeout and throws fsdp::Error naming the keys it waited for.
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

class Store {
 public:
  using Clock = std::chrono::steady_clock;
  using Timeout = std::chrono::milliseconds;
  virtual ~Store() = default;

  virtual void set(std::string_view key, std::string_view value) = 0;
  // Waits until `key` exists, then returns its value.
  virtual std::string get(std::string_view key, Timeout timeout) = 0;
  // Waits until every key exists.
  virtual void wait(const std::vector<std::string>& keys, Timeout timeout) = 0;
  // Adds `delta` to the integer stored at `key` (absent = 0) and returns the new value.
  virtual std::int64_t add(std::string_view key, std::int64_t delta) = 0;
  // Sets `key` to `desired` if its value is `expected` (or it is absent and `expected` is
  // empty); returns the value now stored.
  virtual std::string compare_set(std::string_view key, std::string_view expected, std::string_view desired) = 0;
  // Removes `key`; true if it existed.
  virtual bool delete_key(std::string_view key) = 0;
  virtual std::int64_t num_keys() = 0;
  // The value if present, without waiting.
  virtual std::optional<std::string> try_get(std::string_view key) = 0;

  // Another client of the same store whose calls (and connecting, and its handshake)
  // each give up after `timeout`: what a joining rank looks for its neighbours through,
  // and a failing rank asks its peers through for a better message, so that a store which
  // accepts connections but never answers cannot hold either for the store's own, long,
  // request timeout. Null where this store's calls other than get and wait cannot block
  // (an in-process store): use this one.
  virtual std::shared_ptr<Store> bounded_client(Timeout /*timeout*/) { return nullptr; }
};

namespace detail {
// The longest one request through Store::bounded_client may take where a rank must not
// wait on a store that stopped answering: a TcpComm's join and its failure reports.
// Loopback round trips take microseconds; 2 s leaves room for a loaded machine.
inline constexpr std::chrono::milliseconds kStoreRequestBound{2000};
}  // namespace detail

// In-process store for ranks that are threads (tests, benchmarks of the TCP communicator
// inside one process).
class HashStore final : public Store {
 public:
  void set(std::string_view key, std::string_view value) override {
    { std::lock_guard lk(mu_); map_[std::string(key)] = std::string(value); }
    cv_.notify_all();
  }
  std::string get(std::string_view key, Timeout timeout) override {
    const std::vector<std::string> keys{std::string(key)};
    std::unique_lock lk(mu_);
    wait_locked(lk, keys, timeout);
    return map_.find(keys.front())->second;  // under the same lock: a delete_key cannot come between
  }
  void wait(const std::vector<std::string>& keys, Timeout timeout) override {
    std::unique_lock lk(mu_);
    wait_locked(lk, keys, timeout);
  }
  // As TcpStore's server: the stored value must be exactly a 64-bit integer, and an
  // overflowing sum is refused.
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    std::int64_t v = 0;
    {
      std::lock_guard lk(mu_);
      auto& s = map_[std::string(key)];
      if (!s.empty()) {
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || p != s.data() + s.size())
          detail::fail("store: add to key '", key, "': its value '", s.substr(0, 64), "' is not a 64-bit integer");
      }
      if (__builtin_add_overflow(v, delta, &v))
        detail::fail("store: add of ", delta, " to key '", key, "' (", s, ") overflows a 64-bit integer");
      s = std::to_string(v);
    }
    cv_.notify_all();
    return v;
  }
  std::string compare_set(std::string_view key, std::string_view expected, std::string_view desired) override {
    std::string now;
    {
      std::lock_guard lk(mu_);
      auto it = map_.find(std::string(key));
      if (it == map_.end()) {
        if (!expected.empty()) return std::string(expected);
        now = map_[std::string(key)] = std::string(desired);
      } else {
        if (it->second == expected) it->second = std::string(desired);
        now = it->second;
      }
    }
    cv_.notify_all();
    return now;
  }
  bool delete_key(std::string_view key) override {
    std::lock_guard lk(mu_);
    return map_.erase(std::string(key)) > 0;
  }
  std::int64_t num_keys() override {
    std::lock_guard lk(mu_);
    return static_cast<std::int64_t>(map_.size());
  }
  std::optional<std::string> try_get(std::string_view key) override {
    std::lock_guard lk(mu_);
    auto it = map_.find(std::string(key));
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }

  // Timeouts are positive and at most a day: a zero, negative or absurd value is a bug in
  // the caller's units, not a wish to wait forever.
  static void check_timeout(Timeout t) {
    detail::check_timeout(t, "store: timeout");
  }

 private:
  void wait_locked(std::unique_lock<std::mutex>& lk, const std::vector<std::string>& keys, Timeout timeout) {
    check_timeout(timeout);
    const auto deadline = Clock::now() + timeout;
    for (const auto& k : keys) {
      while (!map_.count(k)) {
        if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && !map_.count(k))
          detail::fail_as(ErrorKind::timeout, "store: waited ", timeout.count(), " ms for key '", k,
                          "', which no rank set");
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string, std::less<>> map_;
};

}  // namespace fsdp
