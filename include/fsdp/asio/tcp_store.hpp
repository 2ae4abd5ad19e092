#pragma once
// TcpStore: the client of a TcpStoreServer, an fsdp::Store for ranks that are processes,
// on one host or many (the role of torch.distributed's TCPStore). connect_store() below
// is the usual entry: rank 0's process hosts the server and every rank connects to it,
// configured from torchrun's variables (fsdp::DistEnv).
//
// One connection, one mutex around it: verbs from several threads take turns, and a get
// or wait holds the connection while it waits, so a thread that must set the key another
// thread waits for needs a TcpStore of its own. Every verb is bounded: a get or wait by
// its own timeout (the server answers when it passes) plus options.timeout for the round
// trip, any other verb by options.timeout. After a lost or timed-out connection the store
// is unusable and every verb says why. Connecting retries, until options.connect_timeout,
// only what may pass: the server not up yet, a DNS failure, a host name that does not
// resolve yet (a service name that appears with the master); a numeric address that is
// not one (999.1.1.1) fails at once.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fsdp/asio/deadline_socket.hpp"
#include "fsdp/asio/store_protocol.hpp"
#include "fsdp/asio/tcp_store_server.hpp"
#include "fsdp/core/dist_env.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"
#include "fsdp/core/store.hpp"

namespace fsdp {

struct TcpStoreOptions {
  std::chrono::milliseconds timeout{300000};  // a verb's round trip (on top of a wait's own timeout)
  std::string token;                          // what the server demands (FSDP_STORE_TOKEN); empty: none
  std::chrono::milliseconds connect_timeout{60000};  // connecting retries until the server is up
  // The start of the job this client belongs to, and the job (TcpStoreServer,
  // "Generations"). Unset: TORCHELASTIC_RESTART_COUNT's (0 when that is unset) and
  // TORCHELASTIC_RUN_ID's (empty when unset), as a rank of a launched job has them.
  std::optional<std::uint64_t> generation;
  std::optional<std::string> job;
};

class TcpStore final : public Store {
 public:
  // Connects, retrying with backoff until the server listens or connect_timeout passes,
  // then presents the token.
  TcpStore(std::string host, std::uint16_t port, TcpStoreOptions options = {})
      : TcpStore(std::move(host), port, std::move(options), /*retry_connect=*/true) {}

  // A client of the store at MASTER_ADDR:MASTER_PORT; the token defaults to FSDP_STORE_TOKEN.
  static std::shared_ptr<TcpStore> from_env(TcpStoreOptions options = {}) {
    const DistEnv env = DistEnv::from_env();
    if (options.token.empty()) options.token = env.token;
    return std::make_shared<TcpStore>(env.master_addr, env.master_port, std::move(options));
  }

  void set(std::string_view key, std::string_view value) override {
    call(keyed(store_wire::Verb::set, key, value));
  }
  std::string get(std::string_view key, Timeout timeout) override {
    auto r = keyed(store_wire::Verb::get, key);
    return waiting(std::move(r), timeout).value;
  }
  void wait(const std::vector<std::string>& keys, Timeout timeout) override {
    store_wire::Request r;
    r.verb = store_wire::Verb::wait;
    r.keys = keys;
    waiting(std::move(r), timeout);
  }
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    auto r = keyed(store_wire::Verb::add, key);
    r.delta = delta;
    return call(r).number;
  }
  std::string compare_set(std::string_view key, std::string_view expected, std::string_view desired) override {
    auto r = keyed(store_wire::Verb::compare_set, key, desired);
    r.expected = std::string(expected);
    return call(r).value;
  }
  bool delete_key(std::string_view key) override { return call(keyed(store_wire::Verb::delete_key, key)).flag; }
  std::int64_t num_keys() override {
    store_wire::Request r;
    r.verb = store_wire::Verb::num_keys;
    return call(r).number;
  }
  std::optional<std::string> try_get(std::string_view key) override {
    auto reply = call(keyed(store_wire::Verb::try_get, key));
    if (!reply.flag) return std::nullopt;
    return std::move(reply.value);
  }

  // A second connection to the same server, its handshake and every verb bounded by
  // `timeout`; shared by every caller while it works, so a process holds at most two
  // connections to the store however many communicators report through it. It connects
  // to the address this one reached (no name lookup, which cannot be bounded) and does not
  // retry: the server was up, so a refusal means it is gone.
  std::shared_ptr<Store> bounded_client(Timeout timeout) override {
    std::lock_guard lk(bounded_mu_);  // not mu_: a long get or wait may hold that one
    if (bounded_ && bounded_->options_.timeout == timeout && !bounded_->lost_) return bounded_;
    TcpStoreOptions o = options_;
    o.timeout = timeout;
    o.connect_timeout = timeout;
    bounded_.reset(new TcpStore(peer_address_, port_, std::move(o), /*retry_connect=*/false));
    return bounded_;
  }

  // The local IP of this connection: the interface through which this host reaches the
  // store, which is the one to advertise to peers.
  std::string local_address() {
    std::lock_guard lk(mu_);
    boost::system::error_code ec;
    const auto endpoint = socket_.socket().local_endpoint(ec);
    if (ec)
      detail::fail_as(broken_.empty() ? ErrorKind::io : broken_kind_, where(),
                      ": no local address: ", broken_.empty() ? ec.message() : broken_);
    return endpoint.address().to_string();
  }
  const std::string& host() const { return host_; }
  std::uint16_t port() const { return port_; }

 private:
  using Clock = std::chrono::steady_clock;

  TcpStore(std::string host, std::uint16_t port, TcpStoreOptions options, bool retry_connect)
      : host_(std::move(host)), port_(port), options_(with_launch_defaults(std::move(options))), retry_connect_(retry_connect) {
    HashStore::check_timeout(options_.timeout);
    HashStore::check_timeout(options_.connect_timeout);
    connect();
    handshake();
  }

  std::string where() const { return "store at " + host_ + ":" + std::to_string(port_); }

  static TcpStoreOptions with_launch_defaults(TcpStoreOptions o) {
    if (!o.generation) o.generation = DistEnv::store_generation_from_env();
    if (!o.job) o.job = DistEnv::text("TORCHELASTIC_RUN_ID", false).value_or("");
    if (o.job->size() > store_wire::max_job_bytes)
      detail::fail("store client: job id (TORCHELASTIC_RUN_ID) of ", o.job->size(), " bytes exceeds ",
                   store_wire::max_job_bytes);
    return o;
  }

  // Digits, dots and colons only (or any colon: no host name has one): meant as a numeric
  // address, so a failure to resolve it is final.
  static bool looks_numeric(std::string_view host) {
    if (host.find(':') != std::string_view::npos) return true;
    return std::all_of(host.begin(), host.end(), [](char ch) { return (ch >= '0' && ch <= '9') || ch == '.'; });
  }

  static store_wire::Request keyed(store_wire::Verb verb, std::string_view key, std::string_view value = {}) {
    store_wire::Request r;
    r.verb = verb;
    r.keys.emplace_back(key);
    r.value = std::string(value);
    return r;
  }

  void connect() {
    const auto deadline = Clock::now() + options_.connect_timeout;
    auto backoff = std::chrono::milliseconds(10);
    for (int attempts = 1;; ++attempts) {
      const auto ec = socket_.connect(host_, port_, deadline);
      if (!ec) break;
      // Resolution failures. A numeric form that is not an address (999.1.1.1) or an
      // invalid one will never resolve: it fails at once. A host name that does not
      // resolve yet is retried like a refused connection: a Kubernetes-style service
      // name (MASTER_ADDR) resolves only once the master's pod is up.
      const bool resolving = ec.category() == boost::asio::error::get_netdb_category() ||
                             ec.category() == boost::asio::error::get_addrinfo_category();
      const bool not_yet = ec == boost::asio::error::host_not_found_try_again ||
                           ((ec == boost::asio::error::host_not_found || ec == boost::asio::error::no_data) &&
                            !looks_numeric(host_));
      if (resolving && !not_yet)
        detail::fail("the store's address '", host_, "' (port ", port_, ") cannot be resolved: ", ec.message(),
                     " (check MASTER_ADDR)");
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left <= backoff && retry_connect_ && resolving)
        detail::fail_as(ErrorKind::timeout, "the store's address '", host_, "' (port ", port_,
                        ") did not resolve within ", options_.connect_timeout.count(), " ms (", attempts,
                        " attempts; last error: ", ec.message(), "; check MASTER_ADDR)");
      if (left <= backoff || !retry_connect_)  // a store that refuses a connection it once took is gone
        detail::fail_as(
            retry_connect_ || ec == boost::asio::error::timed_out ? ErrorKind::timeout : ErrorKind::peer_lost,
            "could not reach the store at ", host_, ":", port_, " within ", options_.connect_timeout.count(), " ms (",
            attempts, " attempts; last error: ", ec.message(), ")");
      std::this_thread::sleep_for(backoff);
      backoff = std::min(2 * backoff, std::chrono::milliseconds(1000));
    }
    boost::system::error_code ignored;
    socket_.socket().set_option(boost::asio::ip::tcp::no_delay(true), ignored);
    const auto peer = socket_.socket().remote_endpoint(ignored);
    peer_address_ = ignored ? host_ : peer.address().to_string();
  }

  // The server closes on a wrong token without a word, so a closed connection here means
  // refused.
  void handshake() {
    if (options_.token.size() > store_wire::max_token_bytes)
      detail::fail(where(), ": token of ", options_.token.size(), " bytes exceeds ", store_wire::max_token_bytes);
    store_wire::Request hello;
    hello.verb = store_wire::Verb::hello;
    hello.token = options_.token;
    hello.generation = *options_.generation;
    hello.job = *options_.job;
    store_wire::Reply reply;
    try {
      reply = exchange(hello, Clock::now() + options_.timeout);
    } catch (const Error&) {
      if (broken_code_ == boost::asio::error::eof || broken_code_ == boost::asio::error::connection_reset)
        detail::fail("the store at ", host_, ":", port_, " refused this client: wrong or missing FSDP_STORE_TOKEN "
                     "(or the server is full, or is not an fsdp store of this protocol version)");
      throw;
    }
    if (reply.status != store_wire::Status::ok)
      detail::fail("the store at ", host_, ":", port_, " refused this client: ", reply.value);
    limits_ = reply.limits;
  }

  // A get or wait: the server answers by `timeout` with the value or the keys missing.
  store_wire::Reply waiting(store_wire::Request r, Timeout timeout) {
    HashStore::check_timeout(timeout);
    r.timeout_ms = static_cast<std::uint32_t>(timeout.count());
    auto reply = call(r, timeout);
    if (reply.status == store_wire::Status::timeout) {
      std::ostringstream os;
      if (r.keys.size() == 1) {
        os << "waited " << timeout.count() << " ms for key '" << r.keys.front() << "', which no rank set";
      } else {
        os << "waited " << timeout.count() << " ms for " << r.keys.size() << " keys; no rank set";
        for (std::size_t i = 0; i < reply.keys.size() && i < 8; ++i) os << " '" << reply.keys[i] << "'";
        if (reply.keys.size() > 8) os << " and " << reply.keys.size() - 8 << " more";
      }
      detail::fail_as(ErrorKind::timeout, where(), ": ", os.str());
    }
    return reply;
  }

  // One round trip. Status::error (the verb cannot be done) throws with the server's reason;
  // the connection stays usable.
  store_wire::Reply call(const store_wire::Request& r, Timeout waited = Timeout(0)) {
    std::lock_guard lk(mu_);
    if (!broken_.empty())
      detail::fail_as(broken_kind_, where(), ": ", what(r), " on a connection lost earlier: ", broken_);
    for (const auto& k : r.keys)
      if (k.size() > limits_.max_key_bytes)
        detail::fail(where(), ": ", what(r), ": key of ", k.size(), " bytes exceeds the store's limit of ",
                     limits_.max_key_bytes, " bytes");
    for (const auto* v : {&r.value, &r.expected})
      if (v->size() > limits_.max_value_bytes)
        detail::fail(where(), ": ", what(r), ": value of ", v->size(), " bytes exceeds the store's limit of ",
                     limits_.max_value_bytes, " bytes");
    auto reply = exchange(r, Clock::now() + waited + options_.timeout);
    if (reply.status == store_wire::Status::error) detail::fail(where(), ": ", what(r), ": ", reply.value);
    return reply;
  }

  // Writes the request and reads its reply; any failure closes the connection for good.
  store_wire::Reply exchange(const store_wire::Request& r, Clock::time_point deadline) {
    const std::string frame = store_wire::encode(r);
    if (frame.size() - 4 > limits_.max_frame_bytes())  // nothing sent: the connection stays usable
      detail::fail(where(), ": ", what(r), ": the request of ", frame.size() - 4, " bytes exceeds the store's frame limit of ",
                   limits_.max_frame_bytes(), " bytes");
    if (auto ec = socket_.write(frame, deadline)) lose(r, ec, "");
    unsigned char header[4];
    if (auto ec = socket_.read(header, 4, deadline)) lose(r, ec, "");
    try {
      std::string payload(store_wire::frame_length(header, limits_.max_frame_bytes()), '\0');
      if (auto ec = socket_.read(payload.data(), payload.size(), deadline)) lose(r, ec, "");
      return store_wire::decode_reply(r.verb, payload, limits_);
    } catch (const Error& e) {
      if (!broken_.empty()) throw;
      lose(r, {}, std::string("it sent a malformed reply: ") + e.what());
    }
  }

  // The kind: timeout past the deadline, peer_lost for a store that closed or reset the
  // connection, corrupt for a malformed reply (no `ec`), io for another socket error.
  [[noreturn]] void lose(const store_wire::Request& r, boost::system::error_code ec, std::string reason) {
    if (ec == boost::asio::error::timed_out) reason = "no reply within the deadline";
    else if (ec == boost::asio::error::eof) reason = "the store closed the connection";
    else if (ec) reason = ec.message();
    if (!ec) broken_kind_ = ErrorKind::corrupt;
    else if (ec == boost::asio::error::timed_out) broken_kind_ = ErrorKind::timeout;
    else if (ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset ||
             ec == boost::asio::error::broken_pipe)
      broken_kind_ = ErrorKind::peer_lost;
    else broken_kind_ = ErrorKind::io;
    socket_.close();
    lost_ = true;
    broken_code_ = ec;
    broken_ = what(r) + " failed: " + reason;
    detail::fail_as(broken_kind_, where(), ": ", broken_);
  }

  static std::string what(const store_wire::Request& r) {
    std::string s = store_wire::name_of(r.verb);
    if (r.verb == store_wire::Verb::wait) return s + " for " + std::to_string(r.keys.size()) + " keys";
    if (!r.keys.empty()) s += " '" + r.keys.front() + "'";
    return s;
  }

  const std::string host_;
  const std::uint16_t port_;
  const TcpStoreOptions options_;
  const bool retry_connect_;
  std::string peer_address_;  // host_ as connected to: an IP address
  std::mutex mu_;
  detail::DeadlineSocket socket_;
  store_wire::Limits limits_;  // the server's, from the handshake
  std::string broken_;         // why the connection was lost; empty while it is up
  boost::system::error_code broken_code_;
  ErrorKind broken_kind_ = ErrorKind::io;  // its kind (see lose)
  std::atomic<bool> lost_{false};  // broken_ is set: read without mu_

  std::mutex bounded_mu_;
  std::shared_ptr<TcpStore> bounded_;  // bounded_client's
};

// A store that rank 0 or fsdp_run hosts belongs to one job. A second job given the same
// port (and no token, or the same one) would otherwise have its store fail to listen while
// its ranks on other hosts joined the first job's store and failed much later, for reasons
// far from the cause. So every rank records the job's world size (the first to come sets
// it) and claims its rank, each in one round trip: a rank that finds another world size,
// or its rank taken, is in another job's store and fails at once, naming the port. Each
// generation (restart) of the store starts without keys, so its ranks claim afresh. (A
// store run apart, tools/fsdp_store, may serve one job after another, so it is not
// claimed.)
inline std::string claim_key(int rank) { return "fsdp/job/rank/" + std::to_string(rank); }
// The count of single-rank replacements, the communicator's epoch: fsdp_run
// --restart-scope rank adds to it as it starts them, TcpProcessGroup::rejoin() waits for
// it to grow. An integer, as Store::add keeps it, absent (0) until the first replacement.
inline constexpr const char* kEpochKey = "fsdp/job/epoch";
inline void claim_place(TcpStore& store, const DistEnv& env) {
  const std::string where = "the store at " + store.host() + ":" + std::to_string(store.port());
  const std::string size = std::to_string(env.world_size);
  const std::string found = store.compare_set("fsdp/job/world_size", "", size);
  if (found != size)
    detail::fail_as(ErrorKind::mismatch, "rank ", env.rank, ": ", where, " serves a job of world size ", found, ", not ",
                    size, ": another job is using port ", store.port(), " (give each job its own MASTER_PORT)");
  if (store.add(claim_key(env.rank), 1) != 1)
    detail::fail_as(ErrorKind::mismatch, "rank ", env.rank, ": ", where, " already has a rank ", env.rank,
                    ": another job is using port ", store.port(),
                    " (give each job its own MASTER_PORT), or two processes were started with RANK=", env.rank);
}

// What connect_store returns: the client, and on the hosting rank the server. The server
// is declared first so that it outlives this process's own client.
struct StoreConnection {
  std::unique_ptr<TcpStoreServer> server;
  std::shared_ptr<TcpStore> store;
  bool claimed = false;  // claim_place ran: release_place gives the rank back at the end

  // Gives this rank's claim back (a store that outlives the connection, fsdp_run's, may
  // see this rank connect again in the same start: a second TcpProcessGroup, say).
  void release_place(int rank) {
    if (claimed && store) store->delete_key(claim_key(rank));
    claimed = false;
  }
};

// Every rank connects to MASTER_ADDR:MASTER_PORT. Who serves there is
// DistEnv::store_host() (FSDP_STORE_HOST, or FSDP_STORE_EXTERNAL): rank0 (the default)
// makes rank 0 first start the server there, listening on $FSDP_STORE_BIND (default
// 127.0.0.1; anything else needs a token); launcher (fsdp_run) and external
// (tools/fsdp_store) say one already runs. The token defaults to env.token, the generation
// to env.store_generation() (the job's whole restarts), the job to env.run_id. Each rank then claims its place
// (claim_place above), except in a store run apart.
inline StoreConnection connect_store(const DistEnv& env, TcpStoreOptions options = {}) {
  if (options.token.empty()) options.token = env.token;
  if (!options.generation) options.generation = env.store_generation();
  if (!options.job) options.job = env.run_id;
  const StoreHost host = DistEnv::store_host();
  StoreConnection c;
  if (env.rank == 0 && host == StoreHost::rank0) {
    TcpStoreServerOptions server;
    const char* bind = std::getenv("FSDP_STORE_BIND");
    if (bind && *bind) server.host = bind;
    server.port = env.master_port;
    server.token = options.token;
    // One start's store: its generation is this start's, and no client moves it on.
    server.generation = *options.generation;
    server.host_begins_generations = true;
    // Room for every rank's connections (2 each: its client, and the bounded one a
    // TcpComm's join and failure reports use), and as many that have not said hello yet: a large job's ranks all connect at once, and
    // none of them may be evicted as a silent connection before its hello arrives.
    const std::size_t per_job = 2 * static_cast<std::size_t>(env.world_size);
    server.max_clients = std::max(server.max_clients, per_job);
    server.max_pending = std::max(server.max_pending, per_job);
    // Why a connection was closed (a stranger's oversized frame, a slow or silent client).
    server.log = [](const std::string& line) { std::fprintf(stderr, "fsdp: %s\n", line.c_str()); };
    c.server = std::make_unique<TcpStoreServer>(std::move(server));
  }
  c.store = std::make_shared<TcpStore>(env.master_addr, env.master_port, std::move(options));
  if (host != StoreHost::external) {
    claim_place(*c.store, env);
    c.claimed = true;
  }
  return c;
}

}  // namespace fsdp
