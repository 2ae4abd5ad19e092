#pragma once
// TcpStoreServer: the rendezvous store's server (the role of torchrun's TCPStore master).
// fsdp_run hosts it (tools/launcher/launcher.hpp), or rank 0's process (see connect_store
// in fsdp/asio/tcp_store.hpp), or it runs on its own (tools/fsdp_store). It serves on one thread of its own with its own io_context,
// so the table needs no lock; a get or wait whose keys are missing parks that connection
// (not the thread) until the keys appear or its timeout passes.
//
// Defensive by default: it listens on loopback unless told otherwise, a connection must
// open with a hello frame (and the token, if one is set) within the handshake timeout,
// and a malformed, oversized or unexpected frame closes that connection only. A client
// with a wrong token gets no reply at all. Nobody can starve it: a frame's announced
// length is checked before anything is allocated and its buffer grows only as its bytes
// arrive (store_wire::FrameReader); a frame once begun must arrive whole within
// frame_timeout; connections that have not said hello never take one of the job's
// max_clients slots, are closed at the handshake timeout, and past max_pending of them
// the oldest is closed to make room, so a flood of silent connections cannot lock a real
// client out. Why each connection was closed goes to options.log.
//
// Generations. A store that outlives the ranks serves one start of a job after another.
// Each client says in its hello which start it belongs to (TcpStoreOptions::generation:
// TORCHELASTIC_RESTART_COUNT under a launcher) and of which job (TcpStoreOptions::job:
// TORCHELASTIC_RUN_ID). Beginning a generation drops every key and closes every client of
// another one (a rank of the failed start that still runs, or waits in a get, learns at
// once that it is out; a parked get or wait is answered with the reason). From then on a
// hello of an earlier generation is refused with a message saying so, so a stale rank can
// never read or write the new start's keys. Who begins one:
//  - host_begins_generations (a store that serves one job: fsdp_run's, which calls
//    begin_generation before it starts a restart's ranks, and rank 0's, which starts at
//    its own generation): the host alone; a hello of a later generation is refused too,
//    and the job is not looked at (one job by construction).
//  - otherwise (tools/fsdp_store, which may serve one job after another): the clients. The
//    first hello of a later generation of the job served begins it; the first hello of
//    another job begins that job at its generation (the next job; a job still running
//    there loses its keys and clients, and says so, rather than sharing them).
// The server's sockets are close-on-exec, so no process the host starts inherits them.
#include <fcntl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <list>
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

#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/asio/store_protocol.hpp"
#include "fsdp/asio/store_table.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

struct TcpStoreServerOptions {
  std::string host = "127.0.0.1";  // the address to listen on; "0.0.0.0" for every interface
  std::uint16_t port = 0;          // 0: an ephemeral port, see TcpStoreServer::port()
  std::string token;               // clients must present it; empty: none needed (loopback only, see below)
  // Listening beyond loopback without a token is refused unless this says it is meant.
  bool allow_without_token = false;
  store_wire::Limits limits;       // key and value sizes
  std::size_t max_clients = 1024;  // clients (past their hello) served at once; more are refused with a message
  // Connections that have not said hello yet: past this many, the oldest is closed.
  std::size_t max_pending = 256;
  // A connection that has not completed its hello by then is dropped.
  std::chrono::milliseconds handshake_timeout{10000};
  // A frame whose first byte arrived must be complete by then, or its connection is dropped.
  std::chrono::milliseconds frame_timeout{30000};
  // The generation served at first, and who begins later ones (see "Generations" above).
  std::uint64_t generation = 0;
  bool host_begins_generations = false;
  // Told why each connection the server closed was closed (on the server's thread); none: silent.
  std::function<void(const std::string&)> log;
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
    std::uint64_t slow = 0;           // closed: a frame not complete within frame_timeout
    std::uint64_t evicted = 0;        // closed: without hello, the oldest past max_pending
    std::uint64_t stale = 0;          // refused: a hello of a generation the server does not serve
    std::uint64_t superseded = 0;     // closed: clients of a generation (or job) that another one ended
    std::uint64_t generation = 0;     // the generation served now
    std::uint64_t clients = 0;        // connections past their hello now (counted against max_clients)
    std::uint64_t pending = 0;        // connections that have not said hello yet, now
    std::uint64_t buffered_bytes = 0;       // held now for frames still arriving
    std::uint64_t peak_buffered_bytes = 0;  // the most ever held at once for them
  };

  // Listens before it returns, so port() is usable at once; a bind failure throws here.
  explicit TcpStoreServer(TcpStoreServerOptions options = {}) : options_(std::move(options)) {
    options_.limits.check();
    if (options_.max_clients == 0) detail::fail("store server: max_clients must be at least 1");
    if (options_.max_pending == 0) detail::fail("store server: max_pending must be at least 1");
    detail::check_timeout(options_.handshake_timeout, "store server: handshake timeout");
    detail::check_timeout(options_.frame_timeout, "store server: frame timeout");
    if (options_.token.size() > store_wire::max_token_bytes)
      detail::fail("store server: token of ", options_.token.size(), " bytes exceeds ", store_wire::max_token_bytes);
    generation_ = counters_.generation = options_.generation;
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
            counters_.parked, counters_.slow, counters_.evicted, counters_.stale, counters_.superseded,
            counters_.generation, counters_.clients, counters_.pending, counters_.buffered, counters_.peak_buffered};
  }

  // Begins generation `g` (see "Generations" above) and returns once it has: every key is
  // dropped and every client of an earlier generation closed. `g` equal to the generation
  // served does nothing; an earlier one is refused (fsdp::Error), as the host's generations
  // only grow. Not from the server's own thread (options.log's): that is refused too.
  void begin_generation(std::uint64_t g) {
    if (std::this_thread::get_id() == thread_.get_id())
      detail::fail("store server: begin_generation called from the server's own thread (its log), which would wait "
                   "for itself");
    auto done = std::make_shared<std::promise<detail::OwnFailure>>();
    auto finished = done->get_future();
    boost::asio::post(io_, [this, g, done] {
      try {
        if (g < generation_)
          detail::fail("store server: cannot begin generation ", g, ": it serves generation ", generation_,
                       " already (generations only grow)");
        if (g > generation_) begin(job_, g, "its host began it");
        done->set_value({});
      } catch (...) {
        done->set_value(detail::own_failure(std::current_exception()));
      }
    });
    // The server's thread answers at once unless it has stopped, which it does only when
    // the server is destroyed or its io_context ran out of work.
    if (finished.wait_for(std::chrono::seconds(10)) != std::future_status::ready)
      detail::fail_as(ErrorKind::timeout, "store server at ", options_.host, ":", port_,
                      ": begin_generation(", g, ") got no answer from the server's thread within 10 s (it has stopped)");
    rethrow(finished.get());
  }

  // Does `request`, a verb that never waits (set, try_get, add, compare_set, delete_key,
  // num_keys), on the keys served, as a client's request would be done, and returns the
  // reply (Status::error for an add to a value that is not an integer); a get or wait
  // parked on a key it sets is answered. For the host itself: fsdp_run announces a
  // replacement rank this way. A get, wait or hello is refused (fsdp::Error), and so is a
  // call from the server's own thread, as for begin_generation.
  store_wire::Reply apply(store_wire::Request request) {
    if (request.verb == store_wire::Verb::hello || store_wire::detail::waits(request.verb))
      detail::fail("store server: apply(", store_wire::name_of(request.verb), "): only a verb that never waits");
    if (std::this_thread::get_id() == thread_.get_id())
      detail::fail("store server: apply called from the server's own thread (its log), which would wait for itself");
    const store_wire::Verb verb = request.verb;
    auto done = std::make_shared<std::promise<std::pair<store_wire::Reply, detail::OwnFailure>>>();
    auto answered = done->get_future();
    boost::asio::post(io_, [this, request = std::move(request), done] {
      try {
        store_wire::Reply reply = table_.apply(request);
        if (store_wire::StoreTable::may_set_keys(request.verb)) wake_waiters();
        done->set_value({std::move(reply), {}});
      } catch (...) {
        done->set_value({store_wire::Reply{}, detail::own_failure(std::current_exception())});
      }
    });
    if (answered.wait_for(std::chrono::seconds(10)) != std::future_status::ready)
      detail::fail_as(ErrorKind::timeout, "store server at ", options_.host, ":", port_, ": apply(",
                      store_wire::name_of(verb), ") got no answer from the server's thread within 10 s (it has stopped)");
    auto [reply, failure] = answered.get();
    rethrow(failure);
    return reply;
  }

 private:
  // A failure on the server's thread reaches the caller's as text (detail::own_failure,
  // taken there): the caller throws an fsdp::Error of its own, so no exception object is
  // shared by the two threads (their reference counts live in a libstdc++ that
  // ThreadSanitizer does not see).
  static void rethrow(const detail::OwnFailure& failure) {
    if (failure.kind) throw Error(*failure.kind, failure.message);
  }

  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;
  class Session;

  struct Counters {
    std::atomic<std::uint64_t> accepted{0}, wrong_token{0}, malformed{0}, idle{0}, over_capacity{0}, parked{0};
    std::atomic<std::uint64_t> slow{0}, evicted{0}, stale{0}, superseded{0}, generation{0};
    std::atomic<std::uint64_t> clients{0}, pending{0}, buffered{0}, peak_buffered{0};
  };

  // Bytes held for frames in progress, and their peak (only the server's thread writes).
  void buffered_changed(std::size_t before, std::size_t after) {
    const auto now = counters_.buffered.load() + after - before;
    counters_.buffered = now;
    if (now > counters_.peak_buffered) counters_.peak_buffered = now;
  }

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
    // Beyond loopback, anyone who can reach the port could read and write the job's keys.
    if (!endpoint.address().is_loopback() && options_.token.empty() && !options_.allow_without_token)
      detail::fail("store server: listening on ", where, " reaches beyond loopback, so it needs a token: set "
                   "FSDP_STORE_TOKEN (the same on every host), or bind to 127.0.0.1");
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) close_on_exec(acceptor_.native_handle());
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(tcp::socket::max_listen_connections, ec);
    if (ec == boost::asio::error::address_in_use)
      detail::fail_as(ErrorKind::io, "store server: could not listen on ", where, ": ", ec.message(),
                      " (another job's store, or another program, holds port ", options_.port,
                      ": give this job another MASTER_PORT)");
    if (ec) detail::fail_as(ErrorKind::io, "store server: could not listen on ", where, ": ", ec.message());
    port_ = acceptor_.local_endpoint().port();
  }

  // Asio opens sockets without SOCK_CLOEXEC: set it, so that processes the host starts
  // (fsdp_run's ranks) do not hold the port or its connections.
  static void close_on_exec(int fd) {
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }

  void accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
      if (stopping_) return;
      if (!ec) {
        try {
          admit(std::move(socket));
        } catch (const std::exception&) {
          // No memory for the session, say: that connection is lost, the next is accepted.
        }
        return accept();
      }
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
  void begin(const std::string& job, std::uint64_t g, const std::string& why);
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
  std::uint64_t generation_ = 0;  // the generation served (the server's thread only; counters_ shows it)
  std::string job_;               // and its job's id (looked at unless host_begins_generations)
  store_wire::StoreTable table_;
  std::set<std::shared_ptr<Session>> sessions_;
  std::set<std::shared_ptr<Session>> waiting_;  // sessions parked in a get or wait
  std::list<std::shared_ptr<Session>> pending_;  // sessions before their hello, oldest first
  Counters counters_;
  std::thread thread_;
};

// One client connection: reads a frame, answers it, reads the next. A get or wait whose
// keys are missing parks here until wake() finds them set or the timer fires.
class TcpStoreServer::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(TcpStoreServer& server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), frames_(store_wire::Limits::max_hello_bytes()) {
    error_code ec;
    const auto peer = socket_.remote_endpoint(ec);
    peer_ = ec ? std::string("an unknown peer") : peer.address().to_string() + ":" + std::to_string(peer.port());
  }

  // `pending`: this session's place in the server's list of sessions before their hello.
  void start(std::list<std::shared_ptr<Session>>::iterator pending) {
    pending_ = pending;
    in_pending_ = true;
    ++server_.counters_.pending;
    timer_.expires_after(server_.options_.handshake_timeout);
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec && !self->authenticated_)
        self->drop(self->server_.counters_.idle,
                   "no hello within the handshake timeout of " + std::to_string(self->server_.options_.handshake_timeout.count()) + " ms");
    });
    read_frame();
  }

  // Answers the parked get or wait if its keys are all set now.
  void wake() {
    if (parked_ && server_.table_.missing(parked_->keys).empty()) answer_parked();
  }

  // Whether this client said hello for another job or generation than `job`'s `g`.
  bool of_another(const std::string& job, std::uint64_t g) const {
    return authenticated_ && !closed_ && (generation_ != g || job_ != job);
  }

  // Closes a client whose generation ended, counted as superseded. One parked in a get or
  // wait is answered first with `why` as an error, which its caller sees; any other learns
  // it from the closed connection at its next request.
  void supersede(const std::string& why) {
    authenticated_ = false;  // no longer a client (of_another skips it): its slot is free now, not once it closes
    --server_.counters_.clients;
    if (!parked_) return drop(server_.counters_.superseded, why);
    ++server_.counters_.superseded;
    if (server_.options_.log)
      server_.options_.log("store at " + server_.options_.host + ":" + std::to_string(server_.port_) +
                           ": answered and closed the connection from " + peer_ + ": " + why);
    const store_wire::Verb verb = parked_->verb;
    unpark();
    store_wire::Reply reply;
    reply.status = store_wire::Status::error;
    reply.value = why;
    send(verb, reply, /*then_close=*/true);
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    error_code ignored;
    unpark();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    timer_.cancel();
    frame_timer_.cancel();
    server_.buffered_changed(frames_.held(), 0);
    frames_.next();
    leave_pending();
    if (authenticated_) --server_.counters_.clients;
    server_.sessions_.erase(shared_from_this());
  }

  // Closes this session, counted under `reason`, and tells the log why.
  void drop(std::atomic<std::uint64_t>& reason, const std::string& why) {
    if (closed_) return;
    ++reason;
    if (server_.options_.log)
      server_.options_.log("store at " + server_.options_.host + ":" + std::to_string(server_.port_) +
                           ": closed the connection from " + peer_ + ": " + why);
    close();
  }

 private:
  void leave_pending() {
    if (!in_pending_) return;
    in_pending_ = false;
    --server_.counters_.pending;
    server_.pending_.erase(pending_);
  }

  // Reads the next frame piece by piece (FrameReader); the frame timer starts with its
  // first byte.
  void read_frame() {
    const std::size_t before = frames_.held();
    char* into = frames_.buffer();
    server_.buffered_changed(before, frames_.held());
    socket_.async_read_some(boost::asio::buffer(into, frames_.room()), [self = shared_from_this()](error_code ec, std::size_t n) {
      if (ec) return self->close();
      self->received(n);
    });
  }

  void received(std::size_t n) {
    const bool first = !frames_.started();
    bool complete = false;
    try {
      complete = frames_.received(n);
    } catch (const Error& e) {
      return drop(server_.counters_.malformed, e.what());
    }
    if (complete) {
      frame_timer_.cancel();
      ++frame_id_;
      return handle();
    }
    if (first && authenticated_) {  // before the hello, the handshake timeout bounds it
      const std::uint64_t id = ++frame_id_;
      frame_timer_.expires_after(server_.options_.frame_timeout);
      frame_timer_.async_wait([self = shared_from_this(), id](error_code ec) {
        if (ec || self->frame_id_ != id) return;
        self->drop(self->server_.counters_.slow,
                   "a frame of " + std::to_string(self->frames_.announced()) + " bytes not complete within the frame timeout of " +
                       std::to_string(self->server_.options_.frame_timeout.count()) + " ms");
      });
    }
    read_frame();
  }

  void handle() {
    store_wire::Request request;
    try {
      request = store_wire::decode_request(frames_.payload(), server_.options_.limits);
    } catch (const Error& e) {
      return drop(server_.counters_.malformed, e.what());
    }
    server_.buffered_changed(frames_.held(), 0);
    frames_.next();
    if (!authenticated_) return handshake(request);
    if (request.verb == store_wire::Verb::hello) return drop(server_.counters_.malformed, "a second hello");
    if (store_wire::detail::waits(request.verb) && !server_.table_.missing(request.keys).empty())
      return park(std::move(request));
    send(request.verb, server_.table_.apply(request));
    if (store_wire::StoreTable::may_set_keys(request.verb)) server_.wake_waiters();
  }

  void handshake(const store_wire::Request& hello) {
    if (hello.verb != store_wire::Verb::hello)
      return drop(server_.counters_.malformed, std::string("a ") + store_wire::name_of(hello.verb) + " before its hello");
    // The token first: only a client that has it may learn even that the store is full.
    if (!server_.token_matches(hello.token)) return drop(server_.counters_.wrong_token, "wrong or missing token");
    leave_pending();
    timer_.cancel();
    const std::uint64_t served = server_.generation_;
    const bool host_begins = server_.options_.host_begins_generations;
    const bool new_job = !host_begins && hello.job != server_.job_;
    const std::string here = "the store at " + server_.options_.host + ":" + std::to_string(server_.port_);
    const std::string theirs = "this client belongs to generation " + std::to_string(hello.generation) + " of the job, and " +
                               here + " serves generation " + std::to_string(served);
    if (!new_job && hello.generation < served)
      return refuse(server_.counters_.stale, theirs + ": it is left from an earlier start of the job, which was "
                                                      "restarted since (TORCHELASTIC_RESTART_COUNT counts the starts)");
    if (hello.generation > served && host_begins)
      return refuse(server_.counters_.stale, theirs + ", which only its host (fsdp_run, or rank 0) moves on: is "
                                                      "TORCHELASTIC_RESTART_COUNT this job's?");
    if (server_.counters_.clients >= server_.options_.max_clients)
      return refuse(server_.counters_.over_capacity,
                    here + " serves at most " + std::to_string(server_.options_.max_clients) + " clients");
    if (new_job)
      server_.begin(hello.job, hello.generation, "a client of job '" + hello.job + "' (" + peer_ + ") said hello");
    else if (hello.generation > served)
      server_.begin(server_.job_, hello.generation, "a client of it (" + peer_ + ") said hello");
    authenticated_ = true;
    generation_ = hello.generation;
    job_ = hello.job;
    ++server_.counters_.clients;
    ++server_.counters_.accepted;
    frames_.set_limit(server_.options_.limits.max_frame_bytes());
    store_wire::Reply reply;
    reply.limits = server_.options_.limits;
    send(store_wire::Verb::hello, reply);
  }

  // Answers the hello with `why` as an error, counted under `reason`, and closes.
  void refuse(std::atomic<std::uint64_t>& reason, const std::string& why) {
    ++reason;
    store_wire::Reply reply;
    reply.status = store_wire::Status::error;
    reply.value = why;
    if (server_.options_.log) server_.options_.log(why + ": refused " + peer_);
    send(store_wire::Verb::hello, reply, /*then_close=*/true);
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
      self->drop(self->server_.counters_.malformed, "a request while its get or wait was parked");
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
      self->read_frame();
    });
  }

  TcpStoreServer& server_;
  tcp::socket socket_;
  boost::asio::steady_timer timer_{socket_.get_executor()};        // handshake, then parked waits
  boost::asio::steady_timer frame_timer_{socket_.get_executor()};  // the frame in progress
  store_wire::FrameReader frames_;
  std::string peer_;
  char probe_[1] = {};
  std::string out_;
  bool authenticated_ = false, closed_ = false, in_pending_ = false;
  std::list<std::shared_ptr<Session>>::iterator pending_;
  std::optional<store_wire::Request> parked_;
  std::uint64_t parks_ = 0, frame_id_ = 0;
  std::uint64_t generation_ = 0;  // the hello's
  std::string job_;               // the hello's
};

// Every connection is served; only those before their hello are bounded here, by closing
// the oldest of them. The slots of max_clients are checked at the hello (see handshake).
inline void TcpStoreServer::admit(tcp::socket socket) {
  error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  if (pending_.size() >= options_.max_pending) {
    const auto oldest = pending_.front();  // leaves pending_ as it closes
    oldest->drop(counters_.evicted, "no hello yet, and " + std::to_string(options_.max_pending) +
                                        " connections without one are the most kept (the oldest goes)");
  }
  close_on_exec(socket.native_handle());
  auto session = std::make_shared<Session>(*this, std::move(socket));
  sessions_.insert(session);
  session->start(pending_.insert(pending_.end(), session));
}

inline void TcpStoreServer::wake_waiters() {
  const std::vector<std::shared_ptr<Session>> parked(waiting_.begin(), waiting_.end());
  for (const auto& s : parked) s->wake();
}

// Drops every key and closes the clients of other generations (their parked gets and
// waits with them); connections that have not said hello are left to their handshake.
inline void TcpStoreServer::begin(const std::string& job, std::uint64_t g, const std::string& why) {
  const std::string ended = job == job_ ? "generation " + std::to_string(generation_)
                                        : "job '" + job_ + "' (generation " + std::to_string(generation_) + ")";
  const std::string began = job == job_ ? "generation " + std::to_string(g) : "job '" + job + "' (generation " + std::to_string(g) + ")";
  job_ = job;
  generation_ = counters_.generation = g;
  table_.clear();
  const std::vector<std::shared_ptr<Session>> all(sessions_.begin(), sessions_.end());
  for (const auto& s : all)
    if (s->of_another(job, g)) s->supersede(began + " began (" + why + "), which ends " + ended + " and its clients");
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
