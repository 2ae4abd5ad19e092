#pragma once
// TcpStoreServer: the rendezvous store's server (the role of torchrun's TCPStore master).
// Rank 0's process hosts it (see connect_store in fsdp/asio/tcp_store.hpp), or it runs on
// its own (tools/fsdp_store). It serves on one thread of its own with its own io_context,
// so the table needs no lock; a get or wait whose keys are missing parks that connection
// (not the thread) until the keys appear or its timeout passes.
//
// Defensive by default: it listens on loopback unless told otherwise, a connection must
// open with a hello frame (and the token, if one is set) within the handshake timeout,
// and a malformed, oversized or unexpected frame closes that connection only. A client
// with a wrong token gets no reply at all.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

// Only the parts used (see fsdp/asio/deadline_socket.hpp for why not <boost/asio.hpp>).
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/asio/store_protocol.hpp"
#include "fsdp/asio/store_table.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

struct TcpStoreServerOptions {
  std::string host = "127.0.0.1";  // the address to listen on; "0.0.0.0" for every interface
  std::uint16_t port = 0;          // 0: an ephemeral port, see TcpStoreServer::port()
  std::string token;               // clients must present it; empty: none needed
  store_wire::Limits limits;       // key and value sizes
  std::size_t max_clients = 1024;  // connections past this are refused with a message
  // A connection that has not completed its hello by then is dropped.
  std::chrono::milliseconds handshake_timeout{10000};
};

class TcpStoreServer {
 public:
  // Connections the server ended and why, for tests and diagnostics.
  struct Stats {
    std::uint64_t accepted = 0;       // connections that completed the handshake
    std::uint64_t wrong_token = 0;    // closed: a hello with a wrong or missing token
    std::uint64_t malformed = 0;      // closed: a malformed, oversized or unexpected frame
    std::uint64_t idle = 0;           // closed: no hello within the handshake timeout
    std::uint64_t over_capacity = 0;  // refused: max_clients reached
    std::uint64_t parked = 0;         // gets and waits parked now
  };

  // Listens before it returns, so port() is usable at once; a bind failure throws here.
  explicit TcpStoreServer(TcpStoreServerOptions options = {}) : options_(std::move(options)) {
    options_.limits.check();
    if (options_.max_clients == 0) detail::fail("store server: max_clients must be at least 1");
    const auto t = options_.handshake_timeout;
    detail::check_timeout(t, "store server: handshake timeout");
    if (options_.token.size() > store_wire::max_token_bytes)
      detail::fail("store server: token of ", options_.token.size(), " bytes exceeds ", store_wire::max_token_bytes);
    listen();
    accept();
    thread_ = std::thread([this] { serve(); });
  }
  ~TcpStoreServer() {
    boost::asio::post(io_, [this] { stop_serving(); });
    thread_.join();
  }
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  const std::string& host() const { return options_.host; }
  std::uint16_t port() const { return port_; }
  Stats stats() const {
    return {counters_.accepted, counters_.wrong_token, counters_.malformed, counters_.idle, counters_.over_capacity,
            counters_.parked};
  }

 private:
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;
  class Session;

  struct Counters {
    std::atomic<std::uint64_t> accepted{0}, wrong_token{0}, malformed{0}, idle{0}, over_capacity{0}, parked{0};
  };

  void listen() {
    const std::string where = options_.host + ":" + std::to_string(options_.port);
    error_code ec;
    tcp::endpoint endpoint(boost::asio::ip::make_address(options_.host, ec), options_.port);
    if (ec) {  // a host name: listen on its first address
      tcp::resolver resolver(io_);
      auto found = resolver.resolve(options_.host, std::to_string(options_.port), ec);
      if (ec || found.empty())
        detail::fail_as(ErrorKind::io, "store server: cannot resolve '", options_.host, "': ", ec.message());
      endpoint = found.begin()->endpoint();
    }
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(tcp::socket::max_listen_connections, ec);
    if (ec) detail::fail_as(ErrorKind::io, "store server: could not listen on ", where, ": ", ec.message());
    port_ = acceptor_.local_endpoint().port();
  }

  void accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
      if (stopping_) return;
      if (!ec) return admit(std::move(socket)), accept();
      // Out of descriptors, say: try again shortly rather than spin.
      retry_timer_.expires_after(std::chrono::milliseconds(50));
      retry_timer_.async_wait([this](error_code e) { if (!e && !stopping_) accept(); });
    });
  }

  void admit(tcp::socket socket);
  void serve() {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception&) {
        // A handler failed (out of memory, say); its connection is lost, the rest go on.
      }
    }
  }
  void stop_serving();
  void wake_waiters();
  bool token_matches(const std::string& presented) const {
    const std::string& want = options_.token;
    unsigned diff = presented.size() != want.size();
    for (std::size_t i = 0; i < presented.size() && i < want.size(); ++i) diff |= unsigned(presented[i] ^ want[i]);
    return diff == 0;
  }

  TcpStoreServerOptions options_;
  boost::asio::io_context io_;  // first: destroyed last, after everything bound to it
  tcp::acceptor acceptor_{io_};
  boost::asio::steady_timer retry_timer_{io_};
  std::uint16_t port_ = 0;
  bool stopping_ = false;
  store_wire::StoreTable table_;
  std::set<std::shared_ptr<Session>> sessions_;
  std::set<std::shared_ptr<Session>> waiting_;  // sessions parked in a get or wait
  Counters counters_;
  std::thread thread_;
};

// One client connection: reads a frame, answers it, reads the next. A get or wait whose
// keys are missing parks here until wake() finds them set or the timer fires.
class TcpStoreServer::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer& server, tcp::socket socket) : server_(server), socket_(std::move(socket)) {}

  // `refusal`: the reason to answer this client's hello with instead of serving it.
  void start(std::string refusal = {}) {
    refusal_ = std::move(refusal);
    timer_.expires_after(server_.options_.handshake_timeout);
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec && !self->authenticated_) self->drop(self->server_.counters_.idle);
    });
    read_header();
  }

  // Answers the parked get or wait if its keys are all set now.
  void wake() {
    if (parked_ && server_.table_.missing(parked_->keys).empty()) answer_parked();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    error_code ignored;
    unpark();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    timer_.cancel();
    server_.sessions_.erase(shared_from_this());
  }

 private:
  void drop(std::atomic<std::uint64_t>& reason) {
    ++reason;
    close();
  }

  void read_header() {
    boost::asio::async_read(socket_, boost::asio::buffer(header_), [self = shared_from_this()](error_code ec, std::size_t) {
      if (ec) return self->close();
      self->read_payload();
    });
  }

  void read_payload() {
    const auto& limits = server_.options_.limits;
    std::size_t n = 0;
    try {
      n = store_wire::frame_length(header_, authenticated_ ? limits.max_frame_bytes() : limits.max_hello_bytes());
    } catch (const Error&) {
      return drop(server_.counters_.malformed);
    }
    if (payload_.capacity() > (std::size_t{1} << 20)) payload_ = std::string();  // do not hold on to a big value
    payload_.resize(n);
    boost::asio::async_read(socket_, boost::asio::buffer(payload_), [self = shared_from_this()](error_code ec, std::size_t) {
      if (ec) return self->close();
      self->handle();
    });
  }

  void handle() {
    store_wire::Request request;
    try {
      request = store_wire::decode_request(payload_, server_.options_.limits);
    } catch (const Error&) {
      return drop(server_.counters_.malformed);
    }
    if (!authenticated_) return handshake(request);
    if (request.verb == store_wire::Verb::hello) return drop(server_.counters_.malformed);
    if (store_wire::detail::waits(request.verb) && !server_.table_.missing(request.keys).empty())
      return park(std::move(request));
    send(request.verb, server_.table_.apply(request));
    if (store_wire::StoreTable::may_set_keys(request.verb)) server_.wake_waiters();
  }

  void handshake(const store_wire::Request& hello) {
    if (hello.verb != store_wire::Verb::hello) return drop(server_.counters_.malformed);
    // The token first: only a client that has it may learn even that the store is full.
    if (!server_.token_matches(hello.token)) return drop(server_.counters_.wrong_token);
    store_wire::Reply reply;
    if (!refusal_.empty()) {
      reply.status = store_wire::Status::error;
      reply.value = refusal_;
      return send(store_wire::Verb::hello, reply, /*then_close=*/true);
    }
    authenticated_ = true;
    ++server_.counters_.accepted;
    timer_.cancel();
    reply.limits = server_.options_.limits;
    send(store_wire::Verb::hello, reply);
  }

  void park(store_wire::Request request) {
    parked_ = std::move(request);
    server_.waiting_.insert(shared_from_this());
    ++server_.counters_.parked;
    const std::uint64_t id = ++parks_;  // a timer that fired for an earlier park is stale
    timer_.expires_after(std::chrono::milliseconds(parked_->timeout_ms));
    timer_.async_wait([self = shared_from_this(), id](error_code ec) {
      if (ec || !self->parked_ || self->parks_ != id) return;
      self->answer_parked();
    });
    // A client that hangs up while parked is let go at once, not at its timeout. A client
    // waits for the reply before it sends again, so a byte arriving now breaks the protocol.
    socket_.async_read_some(boost::asio::buffer(probe_), [self = shared_from_this(), id](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted || !self->parked_ || self->parks_ != id) return;
      if (ec) return self->close();
      self->drop(self->server_.counters_.malformed);
    });
  }

  void unpark() {
    if (!parked_) return;
    parked_.reset();
    --server_.counters_.parked;
    timer_.cancel();
    error_code ignored;
    socket_.cancel(ignored);  // the probe read
    server_.waiting_.erase(shared_from_this());
  }

  // The parked request's answer: its value, or the keys still missing at its timeout.
  void answer_parked() {
    store_wire::Request request = std::move(*parked_);
    unpark();
    store_wire::Reply reply;
    reply.keys = server_.table_.missing(request.keys);
    if (reply.keys.empty()) reply = server_.table_.apply(request);
    else reply.status = store_wire::Status::timeout;
    send(request.verb, reply);
  }

  void send(store_wire::Verb to, const store_wire::Reply& reply, bool then_close = false) {
    out_ = store_wire::encode(to, reply);
    boost::asio::async_write(socket_, boost::asio::buffer(out_), [self = shared_from_this(), then_close](error_code ec, std::size_t) {
      if (ec || then_close) return self->close();
      self->read_header();
    });
  }

  TcpStoreServer& server_;
  tcp::socket socket_;
  boost::asio::steady_timer timer_{socket_.get_executor()};  // handshake, then parked waits
  unsigned char header_[4] = {};
  char probe_[1] = {};
  std::string payload_, out_, refusal_;
  bool authenticated_ = false, closed_ = false;
  std::optional<store_wire::Request> parked_;
  std::uint64_t parks_ = 0;
};

inline void TcpStoreServer::admit(tcp::socket socket) {
  error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  // Refusing takes a session of its own (to read the hello and answer it), but not
  // without bound.
  if (sessions_.size() >= 2 * options_.max_clients) return void(++counters_.over_capacity);
  auto session = std::make_shared<Session>(*this, std::move(socket));
  sessions_.insert(session);
  std::string refusal;
  if (sessions_.size() > options_.max_clients) {
    ++counters_.over_capacity;
    refusal = "the store at " + options_.host + ":" + std::to_string(port_) + " serves at most " +
              std::to_string(options_.max_clients) + " clients";
  }
  session->start(std::move(refusal));
}

inline void TcpStoreServer::wake_waiters() {
  const std::vector<std::shared_ptr<Session>> parked(waiting_.begin(), waiting_.end());
  for (const auto& s : parked) s->wake();
}

inline void TcpStoreServer::stop_serving() {
  stopping_ = true;
  error_code ignored;
  acceptor_.close(ignored);
  retry_timer_.cancel();
  const auto all = std::move(sessions_);
  sessions_.clear();
  for (const auto& s : all) s->close();
  io_.stop();
}

}  // namespace fsdp
