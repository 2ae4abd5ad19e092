#pragma once
// DeadlineSocket: a blocking TCP client connection whose every operation ends by a
// deadline. Each call starts the asynchronous Asio operation on a private io_context and
// runs that context until the operation completes or the deadline passes; a missed
// deadline closes the socket (the connection is then unusable) and reports timed_out.
// Not thread-safe: callers serialize (TcpStore holds a mutex around it).
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

// Only the parts used: <boost/asio.hpp> (Boost 1.74) also pulls in awaitable.hpp, which
// misses an #include <utility> under g++ 12 in C++20 mode.
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

namespace fsdp::detail {

class DeadlineSocket {
 public:
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;
  using Deadline = std::chrono::steady_clock::time_point;

  // Resolves `host` (an address or a name) and connects to its first reachable address.
  error_code connect(const std::string& host, std::uint16_t port, Deadline deadline) {
    close();
    error_code ec;
    const auto address = boost::asio::ip::make_address(host, ec);
    if (!ec) {
      const tcp::endpoint target(address, port);
      return run([&](auto done) { socket_.async_connect(target, done); }, deadline);
    }
    tcp::resolver resolver(io_);
    tcp::resolver::results_type found;
    ec = run(
        [&](auto done) {
          resolver.async_resolve(host, std::to_string(port), [&found, done](error_code e, tcp::resolver::results_type r) {
            found = std::move(r);
            done(e);
          });
        },
        deadline, [&] { resolver.cancel(); });
    if (ec) return ec;
    return run([&](auto done) { boost::asio::async_connect(socket_, found, [done](error_code e, const tcp::endpoint&) { done(e); }); },
               deadline);
  }

  error_code write(std::string_view bytes, Deadline deadline) {
    return run([&](auto done) { boost::asio::async_write(socket_, boost::asio::buffer(bytes.data(), bytes.size()), done); },
               deadline);
  }

  // Reads exactly `n` bytes.
  error_code read(void* data, std::size_t n, Deadline deadline) {
    return run([&](auto done) { boost::asio::async_read(socket_, boost::asio::buffer(data, n), done); }, deadline);
  }

  void close() {
    error_code ignored;
    socket_.close(ignored);
  }

  bool is_open() const { return socket_.is_open(); }
  tcp::socket& socket() { return socket_; }

 private:
  // Runs the operation `start(done)` begins until `done` is called or `deadline`; then
  // `abandon` (by default: closing the socket) cancels it and the context is drained, so
  // no handler outlives this call.
  template <class Start, class Abandon>
  error_code run(Start&& start, Deadline deadline, Abandon&& abandon) {
    std::optional<error_code> result;
    start([&result](error_code ec, auto&&...) { result = ec; });
    io_.restart();
    while (!result && io_.run_one_until(deadline)) {
    }
    if (result) return *result;
    abandon();
    io_.restart();
    io_.run();
    return boost::asio::error::timed_out;
  }
  template <class Start>
  error_code run(Start&& start, Deadline deadline) {
    return run(std::forward<Start>(start), deadline, [this] { close(); });
  }

  boost::asio::io_context io_;
  tcp::socket socket_{io_};
};

}  // namespace fsdp::detail
