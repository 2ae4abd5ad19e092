#pragma once
// A loopback TCP proxy in front of a server that a test can freeze: from then on it still
// accepts connections, but drops every byte in both directions, so to its clients the
// server looks alive (connections succeed) and never answers. There is no thaw: the
// dropped bytes would leave every open connection out of frame. It can also stall for a
// while (a server that is only slow): bytes are held, then passed on in order. Its own
// I/O thread; the destructor stops it, and the connections close with its io_context.
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

namespace test_support {

class FreezableProxy {
 public:
  using tcp = boost::asio::ip::tcp;

  explicit FreezableProxy(std::uint16_t server_port)
      : server_(boost::asio::ip::make_address("127.0.0.1"), server_port),
        acceptor_(io_, tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0)),
        port_(acceptor_.local_endpoint().port()) {
    accept();
    thread_ = std::thread([this] { io_.run(); });
  }
  FreezableProxy(const FreezableProxy&) = delete;
  FreezableProxy& operator=(const FreezableProxy&) = delete;
  ~FreezableProxy() {
    io_.stop();
    thread_.join();
  }

  std::uint16_t port() const { return port_; }
  void freeze() { frozen_ = true; }
  void stall_for(std::chrono::milliseconds d) { stalled_until_ = (std::chrono::steady_clock::now() + d).time_since_epoch().count(); }
  // Bytes read from the clients (counted before they are passed on, so a request the
  // server has seen is counted): a test waits for a client's next request, which it sends
  // only after the reply to its last one arrived.
  std::uint64_t bytes_from_clients() const { return bytes_from_clients_; }

 private:
  struct Pipe {
    tcp::socket client, server;
    explicit Pipe(boost::asio::io_context& io) : client(io), server(io) {}
  };

  void accept() {
    auto pipe = std::make_shared<Pipe>(io_);
    acceptor_.async_accept(pipe->client, [this, pipe](boost::system::error_code ec) {
      if (ec) return;  // stopped (or out of descriptors: the test then fails on its own)
      boost::system::error_code connect_ec;
      pipe->server.connect(server_, connect_ec);  // loopback: immediate
      if (!connect_ec) {
        pump(pipe, pipe->client, pipe->server);
        pump(pipe, pipe->server, pipe->client);
      }
      accept();
    });
  }

  // Moves bytes from `from` to `to` until either side closes; frozen, reads and drops them.
  void pump(std::shared_ptr<Pipe> pipe, tcp::socket& from, tcp::socket& to) {
    auto buffer = std::make_shared<std::array<char, 4096>>();
    from.async_read_some(boost::asio::buffer(*buffer), [this, pipe, &from, &to, buffer](boost::system::error_code ec,
                                                                                         std::size_t n) {
      if (ec) return close(*pipe);
      if (frozen_) return pump(pipe, from, to);
      if (&from == &pipe->client) bytes_from_clients_ += n;
      const std::chrono::steady_clock::time_point until{std::chrono::steady_clock::duration(stalled_until_.load())};
      if (std::chrono::steady_clock::now() < until) {  // held, then passed on: this pipe reads nothing meanwhile
        auto timer = std::make_shared<boost::asio::steady_timer>(io_, until);
        return timer->async_wait([this, pipe, &from, &to, buffer, n, timer](boost::system::error_code) {
          forward(pipe, from, to, buffer, n);
        });
      }
      forward(pipe, from, to, buffer, n);
    });
  }
  void forward(std::shared_ptr<Pipe> pipe, tcp::socket& from, tcp::socket& to, std::shared_ptr<std::array<char, 4096>> buffer,
               std::size_t n) {
    boost::asio::async_write(to, boost::asio::buffer(buffer->data(), n),
                             [this, pipe, &from, &to, buffer](boost::system::error_code wec, std::size_t) {
                               if (wec) return close(*pipe);
                               pump(pipe, from, to);
                             });
  }

  static void close(Pipe& pipe) {
    boost::system::error_code ignored;
    pipe.client.close(ignored);
    pipe.server.close(ignored);
  }

  boost::asio::io_context io_;
  const tcp::endpoint server_;
  tcp::acceptor acceptor_;
  const std::uint16_t port_;
  std::atomic<bool> frozen_{false};
  std::atomic<std::uint64_t> bytes_from_clients_{0};
  std::atomic<std::chrono::steady_clock::rep> stalled_until_{0};
  std::thread thread_;
};

}  // namespace test_support
