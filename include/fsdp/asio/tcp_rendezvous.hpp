#pragma once
// Joining TcpComm's ring through a Store. Each rank listens on an ephemeral port of its
// address, publishes "addr:port" under <prefix>/addr/<rank>, connects to its right
// neighbour (rank + 1) and accepts its left one (rank - 1). The connecting side opens
// with a Hello (its rank, the communicator's prefix, world size, segment size); the
// accepting side checks it and answers, so a peer of another communicator, another size
// or another segment size is refused with a message on both ends instead of exchanging
// misframed data later. Stray connections (not an fsdp handshake) are dropped and the
// rank keeps listening. An address that answers as something else (a rank of another
// communicator, or not fsdp at all) is taken as stale, left by an earlier communicator of
// the prefix, and read again until its rank publishes its own. Everything ends by one
// deadline; the store's requests too, so that a store which stopped answering cannot hold
// a joining rank for its own request timeout (minutes): see ask_store.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "fsdp/asio/endpoint.hpp"
#include "fsdp/asio/tcp_frame.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/store.hpp"

namespace fsdp::detail {

// Who this rank is in which ring, and the settings its neighbours must share.
struct RingIdentity {
  std::string prefix;
  int rank = 0;
  int size = 1;
  std::string address;  // numeric IP to bind and advertise
  std::size_t segment_bytes = 0;
  int socket_buffer_bytes = 0;  // SO_SNDBUF / SO_RCVBUF; 0 keeps the kernel's autotuning
  bool sender_thread = false;   // the sending half on a thread of its own (tcp_ring_sender.hpp)
  bool shared_memory = false;   // offer / accept shared-memory links (shm_handshake.hpp)
  std::size_t shared_memory_bytes = 0;  // size of the shared ring this rank offers
  std::chrono::milliseconds timeout{0};
  // Asked every 100 ms while joining: a reason ends the join (TcpCommOptions::abandon_join).
  std::function<std::optional<std::string>(Store&)> abandon;

  int left() const { return (rank + size - 1) % size; }
  int right() const { return (rank + 1) % size; }
  std::string address_key(int r) const { return prefix + "/addr/" + std::to_string(r); }
  std::string where() const { return "rank " + std::to_string(rank) + ": "; }
};

struct RingSockets {
  boost::asio::ip::tcp::socket left, right;  // receive from rank-1 / send to rank+1 (ABORTs go both ways)
};

class RingJoiner {
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;
  using Clock = std::chrono::steady_clock;

 public:
  RingJoiner(boost::asio::io_context& io, Store& store, const RingIdentity& id) : io_(io), store_(store), id_(id) {}

  // Runs `io` (nobody else may run it meanwhile) until both links are up; throws
  // fsdp::Error naming the neighbour and the communicator otherwise. `clear` first removes
  // what an earlier communicator of the prefix left in the store (under the same deadline).
  RingSockets join(const std::function<void(Store&)>& clear = {}) {
    deadline_ = Clock::now() + id_.timeout;
    listen();
    if (clear) until_answered(clear, "could not clear what an earlier communicator " + id_.prefix + " left in the store");
    until_answered([&](Store& s) { s.set(id_.address_key(id_.rank), advertised_); },
                   "could not publish its address for communicator " + id_.prefix);
    start_accept();
    look_up_right();
    watch();
    while (!(left_ && right_done_) && !failure_ && io_.run_one_until(deadline_)) {
    }
    // A refusal still being written to the left neighbour goes out before the sockets close
    // (within a second, and the deadline): when both ranks refuse each other, the one that
    // finds out first would otherwise close the connection its refusal is on, and its
    // neighbour would read "it closed the connection" instead of why.
    const auto grace = std::min(deadline_, Clock::now() + std::chrono::seconds(1));
    while (failure_ && answers_in_flight_ > 0 && io_.run_one_until(grace)) {
    }
    const bool ok = left_ && right_done_ && !failure_;
    error_code ignored;
    acceptor_.close(ignored);
    timer_.cancel();
    watch_timer_.cancel();
    for (auto& in : incoming_) in->socket.close(ignored);
    if (!ok) right_.close(ignored);
    io_.restart();
    while (io_.poll()) {  // the cancelled handlers finish here: none outlives this call
    }
    if (failure_) fail_as(failure_kind_, *failure_);
    if (!ok) fail_as(ErrorKind::timeout, timeout_message());
    return {std::move(*left_), std::move(right_)};
  }

 private:
  // How a listener refuses a rank of another communicator (its prefix follows): the
  // address the joining rank read is stale.
  static constexpr std::string_view kAnotherCommunicator = "this port belongs to communicator ";

  struct Incoming {
    explicit Incoming(boost::asio::io_context& io) : socket(io) {}
    tcp::socket socket;
    std::array<std::byte, Hello::kFixedSize> hello{};
    std::string prefix, answer;
  };

  std::string waited() const { return std::to_string(id_.timeout.count()) + " ms"; }
  std::string waited_so_far() const {
    const auto start = deadline_ - id_.timeout;
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()) + " ms";
  }

  void listen() {
    error_code ec;
    const auto addr = boost::asio::ip::make_address(id_.address, ec);
    if (ec || addr.is_unspecified())
      fail(id_.where(), "TcpComm address '", id_.address,
           "' is not an IP address the other ranks can reach (use e.g. 127.0.0.1 or this host's address)");
    const tcp::endpoint local(addr, 0);
    acceptor_.open(local.protocol(), ec);
    if (!ec) acceptor_.bind(local, ec);
    if (!ec) acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec);
    if (ec)
      fail_as(ErrorKind::io, id_.where(), "cannot listen on ", id_.address, " for communicator ", id_.prefix, ": ",
              ec.message());
    advertised_ = format_endpoint(addr, acceptor_.local_endpoint().port());
  }

  // ---- the store: every request bounded ----
  // Through Store::bounded_client (kStoreRequestBound per request), not the caller's
  // client, whose requests may wait minutes. A request that ran out its bound may have met
  // a store that is only slow: false, and the caller asks again (on a fresh connection)
  // until the deadline. One that failed sooner is tried once more on a fresh connection
  // (the bounded client is shared: another thread's request may have lost it meanwhile);
  // failing fast again, the store is gone, and its fsdp::Error propagates.
  template <class Request>
  bool ask_store(Request&& request) {
    for (int attempt = 1;; ++attempt) {
      const auto start = Clock::now();
      try {
        if (!bounded_) bounded_ = store_.bounded_client(kStoreRequestBound);
        request(bounded_ ? *bounded_ : store_);  // none: an in-process store, whose requests are quick
        silent_ = false;
        return true;
      } catch (const Error& e) {
        bounded_.reset();
        if (Clock::now() - start < kStoreRequestBound) {
          if (attempt == 1) continue;
          throw;
        }
        ++unanswered_;
        silent_ = true;
        last_unanswered_ = e.what();
        return false;
      }
    }
  }
  std::string silence() const {
    return "the store stopped answering (" + std::to_string(unanswered_) + " request" + (unanswered_ == 1 ? "" : "s") +
           " without a reply within " + std::to_string(kStoreRequestBound.count()) + " ms each; the last: " +
           last_unanswered_ + ")";
  }

  // `request` until the store answers it; else an error saying `what` could not be done.
  template <class Request>
  void until_answered(Request&& request, const std::string& what) {
    for (;;) {
      try {
        if (ask_store(request)) return;
      } catch (const Error& e) {
        fail_as(e.kind(), id_.where(), what, ": ", e.what());
      }
      if (Clock::now() >= deadline_)
        fail_as(ErrorKind::timeout, id_.where(), what, " before the join's timeout (", waited(), "): ", silence());
    }
  }

  // ---- the link to the right: find its address, connect, send Hello, read the answer ----
  // Polls the store (backing off to 50 ms) so that this rank keeps answering its left
  // neighbour meanwhile: a refused handshake then fails both ranks at once.
  void look_up_right(std::chrono::milliseconds backoff = std::chrono::milliseconds(1)) {
    std::optional<std::string> text;
    try {
      ask_store([&](Store& s) { text = s.try_get(id_.address_key(id_.right())); });  // no answer: look again
    } catch (const Error& e) {
      // The store went away (its host, rank 0 under a launcher, gave up or died) while this
      // rank waited for its right neighbour: name the neighbour, not just the store. Whether
      // the neighbour would have joined later, nobody can tell any more.
      std::string why = id_.where() + "rank " + std::to_string(id_.right()) + " had not joined communicator " + id_.prefix +
                        " when the store failed, after " + waited_so_far() + " of waiting for its address";
      if (!target_text_.empty()) why += " (the one it had published, " + target_text_ + ", was stale: " + last_connect_error_ + ")";
      return record_failure(why + ": " + e.what(), e.kind());
    }
    if (text) {
      target_text_ = *text;
      return connect();
    }
    timer_.expires_after(backoff);
    timer_.async_wait([this, backoff](error_code ec) {
      if (!ec) look_up_right(std::min(backoff * 2, std::chrono::milliseconds(50)));
    });
  }

  // RingIdentity::abandon, every 100 ms until the join ends, through the bounded client
  // (ask_store). A call that throws or goes unanswered gives no reason: a store that failed
  // is the join's own paths' to report, and the watch asks again.
  void watch() {
    if (!id_.abandon) return;
    watch_timer_.expires_after(std::chrono::milliseconds(100));
    watch_timer_.async_wait([this](error_code ec) {
      if (ec || failure_) return;
      std::optional<std::string> why;
      try {
        ask_store([&](Store& s) { why = id_.abandon(s); });
      } catch (...) {
        why.reset();
      }
      if (why) return record_failure(id_.where() + "left communicator " + id_.prefix + " before it formed: " + *why, ErrorKind::peer_lost);
      watch();
    });
  }

  void connect() {
    const auto target = parse_endpoint(target_text_);
    if (!target) {
      return record_failure(id_.where() + "rank " + std::to_string(id_.right()) + " published an unusable address '" +
                                target_text_ + "' for communicator " + id_.prefix,
                            ErrorKind::corrupt);
    }
    right_ = tcp::socket(io_);
    right_.async_connect(*target, [this](error_code ec) {
      if (ec) return connect_failed(ec);
      tune_socket(right_, id_.socket_buffer_bytes);
      hello_ = Hello{id_.rank, id_.right(), id_.size, id_.segment_bytes, id_.prefix}.encode();
      boost::asio::async_write(right_, boost::asio::buffer(hello_), [this](error_code ec, std::size_t) {
        if (ec) return connect_failed(ec);
        boost::asio::async_read(right_, boost::asio::buffer(reply_), [this](error_code ec, std::size_t) {
          if (ec) return connect_failed(ec);
          const auto n = HelloReply::decode_fixed(reply_.data());
          if (!n) return stale_address("it answered with something that is not an fsdp TcpComm handshake");
          if (*n == 0) {
            right_done_ = true;
            return;
          }
          refusal_.resize(*n);
          boost::asio::async_read(right_, boost::asio::buffer(refusal_), [this](error_code ec, std::size_t) {
            if (!ec && refusal_.rfind(kAnotherCommunicator, 0) == 0) return stale_address(refusal_);
            refused(ec ? "it closed the connection" : refusal_, ec ? ErrorKind::peer_lost : ErrorKind::mismatch);
          });
        });
      });
    });
  }
  // `kind`: mismatch for a refusal (the ranks' sizes or settings differ), peer_lost for a close.
  void refused(const std::string& why, ErrorKind kind) {
    record_failure(id_.where() + "rank " + std::to_string(id_.right()) + " at " + target_text_ + " refused to join communicator " +
                       id_.prefix + ": " + why,
                   kind);
  }
  // The first failure is the one reported, with one exception: a neighbour that closed
  // the connection (peer_lost) is usually the consequence of a refusal this rank is
  // writing or has just written (the neighbour read it and gave up), so a refusal found
  // later replaces it. Handlers still queued when join() stops (its final poll) land here
  // too and must not overwrite the cause.
  void record_failure(std::string why, ErrorKind kind) {
    if (failure_ && !(failure_kind_ == ErrorKind::peer_lost && kind == ErrorKind::mismatch)) return;
    failure_ = std::move(why);
    failure_kind_ = kind;
  }
  // The address may be stale (an earlier communicator of this prefix): read it again.
  void connect_failed(error_code ec) {
    if (ec == boost::asio::error::operation_aborted) return;
    stale_address(ec.message());
  }
  // What answered at the address is not this communicator's rank: the address is what an
  // earlier communicator of this prefix left (a process that died, or a destructor that
  // could not reach the store), and its port now belongs to something else. The rank it
  // names publishes its own address when it joins: read the key again until then.
  void stale_address(const std::string& why) {
    last_connect_error_ = why;
    error_code ignored;
    right_.close(ignored);
    timer_.expires_after(std::chrono::milliseconds(20));
    timer_.async_wait([this](error_code ec) {
      if (!ec) look_up_right();
    });
  }

  // ---- the link from the left: accept, check the Hello, answer ----
  // Keeps accepting while a connection shakes hands, so a stray client that connects and
  // says nothing cannot keep the real neighbour waiting.
  void start_accept() {
    auto in = std::make_shared<Incoming>(io_);
    incoming_.push_back(in);
    acceptor_.async_accept(in->socket, [this, in](error_code ec) {
      if (ec == boost::asio::error::operation_aborted) return;
      start_accept();
      if (ec) return;
      tune_socket(in->socket, id_.socket_buffer_bytes);
      boost::asio::async_read(in->socket, boost::asio::buffer(in->hello), [this, in](error_code ec, std::size_t) {
        if (ec) return drop(*in, "it closed before its handshake");
        std::size_t prefix_bytes = 0;
        const auto hello = Hello::decode_fixed(in->hello.data(), prefix_bytes);
        if (!hello) return drop(*in, "not an fsdp TcpComm handshake");
        in->prefix.resize(prefix_bytes);
        auto on_prefix = [this, in, h = *hello](error_code ec, std::size_t) {
          if (ec) return drop(*in, "it closed during its handshake");
          if (in->prefix != id_.prefix)
            return answer(in, std::string(kAnotherCommunicator) + id_.prefix + ", not " + in->prefix,
                          [this, in] { drop(*in, "it asked for communicator " + in->prefix); });
          std::string problem = check_hello(h);
          if (problem.empty() && left_) problem = id_.where() + "a second rank " + std::to_string(h.from_rank) + " connected";
          answer(in, problem, [this, in, problem] {
            if (!problem.empty()) {
              record_failure(problem, ErrorKind::mismatch);
            } else {
              left_ = std::move(in->socket);
            }
          });
        };
        boost::asio::async_read(in->socket, boost::asio::buffer(in->prefix), on_prefix);
      });
    });
  }
  std::string check_hello(const Hello& h) const {
    const std::string who = id_.where() + "rank " + std::to_string(h.from_rank) + " ";
    const std::string me = ", but rank " + std::to_string(id_.rank) + " ";
    if (h.size != id_.size)
      return who + "joined communicator " + id_.prefix + " with size " + std::to_string(h.size) + me + "has size " +
             std::to_string(id_.size);
    if (h.from_rank != id_.left() || h.to_rank != id_.rank)
      return who + "connected as the left neighbour of rank " + std::to_string(h.to_rank) + " in communicator " + id_.prefix +
             me + "expects rank " + std::to_string(id_.left()) + " (two processes with the same rank?)";
    if (h.segment_bytes != id_.segment_bytes)
      return who + "uses segment_bytes=" + std::to_string(h.segment_bytes) + me + "uses " +
             std::to_string(id_.segment_bytes) + " in communicator " + id_.prefix;
    return {};
  }
  template <class Then>
  void answer(const std::shared_ptr<Incoming>& in, const std::string& refusal, Then then) {
    in->answer = HelloReply::encode(refusal);
    ++answers_in_flight_;
    boost::asio::async_write(in->socket, boost::asio::buffer(in->answer), [this, in, then](error_code ec, std::size_t) {
      --answers_in_flight_;
      if (ec != boost::asio::error::operation_aborted) then();
    });
  }
  void drop(Incoming& in, const std::string& why) {
    error_code ignored;
    rejected_ = "dropped a connection from " + in.socket.remote_endpoint(ignored).address().to_string() + " (" + why + ")";
    in.socket.close(ignored);
  }

  std::string timeout_message() {
    auto never_joined = [&](int r) {
      return id_.where() + "rank " + std::to_string(r) + " never joined communicator " + id_.prefix + " (waited " + waited() +
             " for its address)";
    };
    std::string msg;
    if (target_text_.empty() && silent_) {
      msg = id_.where() + "waited " + waited() + " for rank " + std::to_string(id_.right()) + " to join communicator " +
            id_.prefix + ", but " + silence();
    } else if (target_text_.empty()) {
      msg = never_joined(id_.right());
    } else if (!right_done_) {
      msg = id_.where() + "could not connect to rank " + std::to_string(id_.right()) + " at " + target_text_ + " within " +
            waited() + " (communicator " + id_.prefix + ")";
      if (!last_connect_error_.empty()) msg += ": " + last_connect_error_;
    } else {
      std::string store_error;
      const std::optional<bool> published = left_published(store_error);
      if (!published)
        msg = id_.where() + "rank " + std::to_string(id_.left()) + " did not connect to " + advertised_ + " within " +
              waited() + " (communicator " + id_.prefix + "), and the store could not say whether it joined: " + store_error;
      else if (!*published)
        msg = never_joined(id_.left());
      else
        msg = id_.where() + "rank " + std::to_string(id_.left()) + " published its address but did not connect to " +
              advertised_ + " within " + waited() + " (communicator " + id_.prefix + ")";
    }
    if (!left_ && !rejected_.empty()) msg += "; meanwhile " + rejected_;
    return msg;
  }

  // Whether the left neighbour published its address; nullopt (and the store's error) when
  // the store cannot say. One request: the deadline has passed.
  std::optional<bool> left_published(std::string& store_error) {
    std::optional<std::string> text;
    try {
      if (ask_store([&](Store& s) { text = s.try_get(id_.address_key(id_.left())); })) return text.has_value();
      store_error = silence();
    } catch (const Error& e) {
      store_error = e.what();
    }
    return std::nullopt;
  }

  boost::asio::io_context& io_;
  Store& store_;
  std::shared_ptr<Store> bounded_;  // store_.bounded_client's, while it works
  int unanswered_ = 0;              // store requests that got no reply within their bound
  bool silent_ = false;             // the last one among them
  std::string last_unanswered_;
  const RingIdentity& id_;
  Clock::time_point deadline_;
  tcp::acceptor acceptor_{io_};
  tcp::socket right_{io_};
  boost::asio::steady_timer timer_{io_};
  boost::asio::steady_timer watch_timer_{io_};  // watch(): RingIdentity::abandon
  std::vector<std::shared_ptr<Incoming>> incoming_;
  std::optional<tcp::socket> left_;
  bool right_done_ = false;
  std::optional<std::string> failure_;
  int answers_in_flight_ = 0;  // handshake answers written but not yet sent
  ErrorKind failure_kind_ = ErrorKind::misuse;  // of failure_
  std::string advertised_, target_text_, hello_, refusal_, rejected_, last_connect_error_;
  std::array<std::byte, HelloReply::kFixedSize> reply_{};
};

}  // namespace fsdp::detail
