#pragma once
// Helpers for the store tests: a raw connection that speaks bytes (to misbehave on
// purpose), a port nobody listens on, error capture and a stopwatch.
#include <doctest/doctest.h>

#include <chrono>
#include <string>

#include <fsdp/asio/deadline_socket.hpp>
#include <fsdp/asio/store_protocol.hpp>
#include <fsdp/core/error.hpp>

#include "test/support/errors.hpp"
#include "tools/launcher/launcher.hpp"

namespace store_test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

using test_support::contains;
using test_support::error_of;

inline long long ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// A loopback port that was free a moment ago.
inline std::uint16_t unused_port() { return static_cast<std::uint16_t>(fsdp::launch::find_free_port()); }

// A client that sends whatever bytes a test wants.
class RawClient {
 public:
  explicit RawClient(std::uint16_t port) {
    REQUIRE_FALSE(socket_.connect("127.0.0.1", port, Clock::now() + 2s));
  }
  void send(const std::string& bytes) { REQUIRE_FALSE(socket_.write(bytes, Clock::now() + 2s)); }
  // Presents `token`; the server must accept it.
  void hello(const std::string& token = "") {
    fsdp::store_wire::Request r;
    r.verb = fsdp::store_wire::Verb::hello;
    r.token = token;
    send(fsdp::store_wire::encode(r));
    unsigned char header[4];
    REQUIRE_FALSE(socket_.read(header, 4, Clock::now() + 2s));
    std::string payload(fsdp::store_wire::frame_length(header, 1 << 20), '\0');
    REQUIRE_FALSE(socket_.read(payload.data(), payload.size(), Clock::now() + 2s));
    REQUIRE(payload[0] == char(fsdp::store_wire::Status::ok));
  }
  // Everything the server sends until it closes the connection; `closed` says whether
  // it did so within `within`.
  std::string read_until_closed(std::chrono::milliseconds within, bool& closed) {
    std::string got;
    const auto deadline = Clock::now() + within;
    char c;
    for (;;) {
      const auto ec = socket_.read(&c, 1, deadline);
      if (ec) {
        closed = ec != boost::asio::error::timed_out;
        return got;
      }
      got.push_back(c);
    }
  }

 private:
  fsdp::detail::DeadlineSocket socket_;
};

}  // namespace store_test
