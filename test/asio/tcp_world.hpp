#pragma once
// Ranks as threads of this process, each with its own fsdp::TcpComm over real loopback
// sockets, sharing one fsdp::HashStore. Rank bodies never use doctest assertions: they
// return what they saw, and the test checks it after every thread has joined.
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/asio/tcp_comm.hpp"
#include "fsdp/core/store.hpp"
#include "test/support/errors.hpp"

namespace test_support {

using namespace std::chrono_literals;

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Options for tests that must succeed (a hang fails after 10 s instead of never).
inline fsdp::TcpCommOptions ok_options(std::size_t segment_bytes = 1 << 20, int io_threads = 1) {
  fsdp::TcpCommOptions o;
  o.timeout = 10s;
  o.segment_bytes = segment_bytes;
  o.io_threads = io_threads;
  return o;
}

// Both ways of running a communicator: sending on the I/O thread, or on its own.
constexpr int kIoThreads[] = {1, 2};

// Runs fn(rank) on `n` threads and joins them; returns each rank's fsdp::Error message
// ("" if none). Any other exception is rethrown after the join.
inline std::vector<std::string> on_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(n);
  std::vector<std::exception_ptr> other(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const fsdp::Error& e) {
        errors[r] = e.what();
      } catch (...) {
        other[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : other)
    if (e) std::rethrow_exception(e);
  return errors;
}

class TcpWorld {
 public:
  explicit TcpWorld(int n, fsdp::TcpCommOptions o = ok_options()) : TcpWorld(n, [o](int) { return o; }) {}
  // Rank r with options_for(r).
  TcpWorld(int n, const std::function<fsdp::TcpCommOptions(int)>& options_for)
      : store_(std::make_shared<fsdp::HashStore>()), comms_(n) {
    const auto errors = on_threads(n, [&](int r) { comms_[r].emplace(store_, r, n, options_for(r)); });
    for (const auto& e : errors)
      if (!e.empty()) throw fsdp::Error("test world construction: " + e);
  }
  int size() const { return static_cast<int>(comms_.size()); }
  fsdp::TcpComm& comm(int r) { return *comms_[r]; }
  const std::shared_ptr<fsdp::HashStore>& store() const { return store_; }
  void destroy(int r) { comms_[r].reset(); }

  // fn(comm, rank) on every rank at once; each rank's fsdp::Error message.
  std::vector<std::string> each(const std::function<void(fsdp::TcpComm&, int)>& fn) {
    return on_threads(size(), [&](int r) { fn(*comms_[r], r); });
  }

 private:
  std::shared_ptr<fsdp::HashStore> store_;
  std::vector<std::optional<fsdp::TcpComm>> comms_;
};

}  // namespace test_support
