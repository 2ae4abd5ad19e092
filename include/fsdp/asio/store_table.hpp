#pragma once
// StoreTable: the key-value semantics of the store's verbs, the same as fsdp::HashStore's,
// without sockets or threads. TcpStoreServer owns one and calls it from its I/O thread.
#include <charconv>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fsdp/asio/store_protocol.hpp"

namespace fsdp::store_wire {

class StoreTable {
 public:
  // The keys of `keys` that are not set, in order.
  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys)
      if (!map_.count(k)) out.push_back(k);
    return out;
  }

  // Answers a request whose keys, for get and wait, are all present. A verb that cannot
  // be done (add to a value that is not an integer) answers Status::error.
  Reply apply(const Request& r) {
    Reply out;
    const std::string& key = r.keys.empty() ? empty_ : r.keys.front();
    switch (r.verb) {
      case Verb::set: map_[key] = r.value; break;
      case Verb::get: out.value = map_.at(key); break;
      case Verb::try_get:
        if (auto it = map_.find(key); it != map_.end()) {
          out.flag = true;
          out.value = it->second;
        }
        break;
      case Verb::add: return add(key, r.delta);
      case Verb::compare_set: out.value = compare_set(key, r.expected, r.value); break;
      case Verb::delete_key: out.flag = map_.erase(key) > 0; break;
      case Verb::num_keys: out.number = static_cast<std::int64_t>(map_.size()); break;
      case Verb::hello:
      case Verb::wait: break;
    }
    return out;
  }

  // Drops every key (a new generation begins: TcpStoreServer).
  void clear() { map_.clear(); }

  // True when the verb may have set a key that someone waits for.
  static bool may_set_keys(Verb v) { return v == Verb::set || v == Verb::add || v == Verb::compare_set; }

 private:
  Reply add(const std::string& key, std::int64_t delta) {
    Reply out;
    auto& stored = map_[key];
    std::int64_t now = 0;
    if (!stored.empty()) {
      const char* end = stored.data() + stored.size();
      auto [p, ec] = std::from_chars(stored.data(), end, now);
      if (ec != std::errc() || p != end) return error("add to key '" + key + "': its value '" + clipped(stored) + "' is not a 64-bit integer");
    }
    if (__builtin_add_overflow(now, delta, &now))
      return error("add of " + std::to_string(delta) + " to key '" + key + "' (" + stored + ") overflows a 64-bit integer");
    stored = std::to_string(now);
    out.number = now;
    return out;
  }

  // An absent key counts as holding "" only when `expected` is empty: then it is set.
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
    auto it = map_.find(key);
    if (it == map_.end()) return expected.empty() ? (map_[key] = desired) : expected;
    if (it->second == expected) it->second = desired;
    return it->second;
  }

  // Values may be megabytes; a message shows their start.
  static std::string clipped(const std::string& s) { return s.size() <= 64 ? s : s.substr(0, 64) + "..."; }

  static Reply error(std::string message) {
    Reply out;
    out.status = Status::error;
    out.value = std::move(message);
    return out;
  }

  std::map<std::string, std::string, std::less<>> map_;
  const std::string empty_;
};

}  // namespace fsdp::store_wire
