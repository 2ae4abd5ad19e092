// Clients that misbehave: garbage, oversized frames, frames announced and never sent,
// wrong or missing tokens, silence, floods of connections that never say hello, too many
// clients, or a store that is not there. Each ends in a clear error (or a closed
// connection) within its timeout, and the server keeps serving the well-behaved clients.
#include <doctest/doctest.h>

#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include <fsdp/asio/tcp_store.hpp>

#include "store_test_support.hpp"

namespace asio_tcp_store_abuse_test {

using namespace store_test;

namespace {

fsdp::TcpStoreOptions with_token(std::string token) {
  fsdp::TcpStoreOptions o;
  o.timeout = 2000ms;
  o.connect_timeout = 1000ms;
  o.token = std::move(token);
  return o;
}

std::string header(std::uint32_t n) {
  return {char(n & 0xff), char((n >> 8) & 0xff), char((n >> 16) & 0xff), char(n >> 24)};
}

// The server must close `raw` promptly and send it nothing.
void check_closed_silently(RawClient& raw) {
  bool closed = false;
  CHECK(raw.read_until_closed(2000ms, closed).empty());
  CHECK(closed);
}

// A server that demands a token, and a client that has it.
struct GuardedStore {
  static fsdp::TcpStoreServerOptions options() {
    fsdp::TcpStoreServerOptions o;
    o.token = "s3cret";
    return o;
  }
  fsdp::TcpStoreServer server{options()};
  fsdp::TcpStore good{"127.0.0.1", server.port(), with_token("s3cret")};
};

// What a server's options.log was told, safe to read from the test's thread.
struct Log {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard lk(mu);
      lines.push_back(line);
    };
  }
  std::size_t count(const std::string& part) {
    std::lock_guard lk(mu);
    std::size_t n = 0;
    for (const auto& l : lines) n += contains(l, part);
    return n;
  }
};

template <class Pred>
bool becomes(Pred pred, std::chrono::milliseconds within = 2000ms) {
  const auto deadline = Clock::now() + within;
  while (!pred() && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
  return pred();
}

}  // namespace

TEST_CASE("garbage and oversized frames close that connection only") {
  GuardedStore guarded;
  auto& server = guarded.server;
  auto& good = guarded.good;
  good.set("k", "v");

  SUBCASE("an HTTP request before the handshake: its first bytes read as a huge length") {
    RawClient raw(server.port());
    raw.send("GET / HTTP/1.1\r\nHost: store\r\n\r\n");
    check_closed_silently(raw);
  }
  SUBCASE("a frame of a plausible length with an unknown verb") {
    RawClient raw(server.port());
    raw.send(header(3) + std::string("\x63\x00\x01", 3));
    check_closed_silently(raw);
  }
  SUBCASE("a frame past the handshake limit before the handshake") {
    RawClient raw(server.port());
    raw.send(header(static_cast<std::uint32_t>(fsdp::store_wire::Limits::max_hello_bytes() + 1)));
    check_closed_silently(raw);
  }
  SUBCASE("an authenticated client announcing a 4 GiB frame") {
    RawClient raw(server.port());
    raw.hello("s3cret");
    raw.send(header(0xfffffff0u));
    check_closed_silently(raw);
  }
  SUBCASE("an authenticated client sending a second hello") {
    RawClient raw(server.port());
    raw.hello("s3cret");
    fsdp::store_wire::Request hello;
    hello.verb = fsdp::store_wire::Verb::hello;
    raw.send(fsdp::store_wire::encode(hello));
    check_closed_silently(raw);
  }
  CHECK(server.stats().malformed == 1);
  // The well-behaved client, connected all along, and a new one are both served.
  CHECK(good.get("k", 500ms) == "v");
  fsdp::TcpStore later("127.0.0.1", server.port(), with_token("s3cret"));
  CHECK(later.get("k", 500ms) == "v");
}

TEST_CASE("a wrong or missing token is refused and gets nothing") {
  GuardedStore guarded;
  auto& server = guarded.server;
  auto& good = guarded.good;
  good.set("secret/key", "the value");
  const std::string refused =
      "fsdp: the store at 127.0.0.1:" + std::to_string(server.port()) + " refused this client: wrong or missing FSDP_STORE_TOKEN "
      "(or the server is full, or is not an fsdp store of this protocol version)";

  const auto t0 = Clock::now();
  CHECK(error_of([&] { fsdp::TcpStore("127.0.0.1", server.port(), with_token("wrong")); }) == refused);
  CHECK(error_of([&] { fsdp::TcpStore("127.0.0.1", server.port(), with_token("")); }) == refused);
  CHECK(ms_since(t0) < 1000);

  // A raw client with a wrong token that sends a get right behind its hello: the server
  // answers neither.
  RawClient raw(server.port());
  fsdp::store_wire::Request hello, get;
  hello.verb = fsdp::store_wire::Verb::hello;
  hello.token = "s3creT";
  get.verb = fsdp::store_wire::Verb::get;
  get.keys = {"secret/key"};
  get.timeout_ms = 100;
  raw.send(fsdp::store_wire::encode(hello) + fsdp::store_wire::encode(get));
  bool closed = false;
  const std::string leaked = raw.read_until_closed(2000ms, closed);
  CHECK(closed);
  CHECK(leaked.empty());
  CHECK_FALSE(contains(leaked, "the value"));

  CHECK(server.stats().wrong_token == 3);
  CHECK(server.stats().accepted == 1);
  CHECK(good.get("secret/key", 500ms) == "the value");
}

TEST_CASE("a client that connects and says nothing is dropped after the handshake timeout") {
  Log log;
  fsdp::TcpStoreServerOptions opts;
  opts.handshake_timeout = 200ms;
  opts.log = log.sink();
  fsdp::TcpStoreServer server(opts);
  RawClient silent(server.port());
  const auto t0 = Clock::now();
  bool closed = false;
  CHECK(silent.read_until_closed(2000ms, closed).empty());
  CHECK(closed);
  CHECK(ms_since(t0) >= 150);
  CHECK(server.stats().idle == 1);
  CHECK(becomes([&] { return log.count("no hello within the handshake timeout of 200 ms") == 1; }));
  // An authenticated client may stay quiet for longer than that.
  fsdp::TcpStore quiet("127.0.0.1", server.port(), with_token(""));
  std::this_thread::sleep_for(300ms);
  CHECK(quiet.num_keys() == 0);
}

TEST_CASE("clients past max_clients are refused with the reason") {
  fsdp::TcpStoreServerOptions opts;
  opts.max_clients = 2;
  fsdp::TcpStoreServer server(opts);
  fsdp::TcpStore one("127.0.0.1", server.port(), with_token(""));
  fsdp::TcpStore two("127.0.0.1", server.port(), with_token(""));
  CHECK(error_of([&] { fsdp::TcpStore("127.0.0.1", server.port(), with_token("")); }) ==
        "fsdp: the store at 127.0.0.1:" + std::to_string(server.port()) +
            " refused this client: the store at 127.0.0.1:" + std::to_string(server.port()) + " serves at most 2 clients");
  CHECK(server.stats().over_capacity == 1);
  one.set("still", "served");
  CHECK(two.get("still", 500ms) == "served");
}

TEST_CASE("past max_clients, a client without the token still gets nothing, not even the refusal") {
  fsdp::TcpStoreServerOptions opts;
  opts.max_clients = 1;
  opts.token = "s3cret";
  fsdp::TcpStoreServer server(opts);
  fsdp::TcpStore one("127.0.0.1", server.port(), with_token("s3cret"));
  RawClient stray(server.port());
  fsdp::store_wire::Request hello;
  hello.verb = fsdp::store_wire::Verb::hello;
  hello.token = "guess";
  stray.send(fsdp::store_wire::encode(hello));
  check_closed_silently(stray);
  CHECK(server.stats().over_capacity == 0);  // it never got as far as asking for a slot
  CHECK(server.stats().wrong_token == 1);
  CHECK(one.num_keys() == 0);
}

TEST_CASE("a store nobody runs: an error within the connect timeout") {
  const std::uint16_t port = unused_port();
  auto options = with_token("");
  options.connect_timeout = 300ms;
  const auto t0 = Clock::now();
  const std::string e = error_of([&] { fsdp::TcpStore("127.0.0.1", port, options); });
  const auto took = ms_since(t0);
  CHECK(contains(e, "fsdp: could not reach the store at 127.0.0.1:" + std::to_string(port) + " within 300 ms ("));
  CHECK(contains(e, "last error: Connection refused)"));
  CHECK(took < 300 + 200);
}

TEST_CASE("a listener that never answers the handshake: an error within the timeout") {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor mute(io, {boost::asio::ip::make_address("127.0.0.1"), 0});  // listens, never accepts
  auto options = with_token("");
  options.timeout = 200ms;
  const auto t0 = Clock::now();
  const std::string e = error_of([&] { fsdp::TcpStore("127.0.0.1", mute.local_endpoint().port(), options); });
  CHECK(contains(e, "hello failed: no reply within the deadline"));
  CHECK(ms_since(t0) < 1000);
}

TEST_CASE("a parked client that hangs up is let go at once; one that talks out of turn is dropped") {
  fsdp::TcpStoreServer server;
  auto parked_count_becomes = [&](std::uint64_t n) {
    const auto deadline = Clock::now() + 2000ms;
    while (server.stats().parked != n && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
    return server.stats().parked == n;
  };
  fsdp::store_wire::Request get;
  get.verb = fsdp::store_wire::Verb::get;
  get.keys = {"never"};
  get.timeout_ms = 60000;

  auto leaving = std::make_unique<RawClient>(server.port());
  leaving->hello();
  leaving->send(fsdp::store_wire::encode(get));
  REQUIRE(parked_count_becomes(1));
  const auto t0 = Clock::now();
  leaving.reset();  // hangs up, 60 s before its get would time out
  CHECK(parked_count_becomes(0));
  CHECK(ms_since(t0) < 1000);
  CHECK(server.stats().malformed == 0);

  RawClient chatty(server.port());
  chatty.hello();
  chatty.send(fsdp::store_wire::encode(get));
  REQUIRE(parked_count_becomes(1));
  chatty.send(fsdp::store_wire::encode(get));  // a second request before the first's reply
  check_closed_silently(chatty);
  CHECK(parked_count_becomes(0));
  CHECK(server.stats().malformed == 1);
}

TEST_CASE("a frame announced but never sent: nothing allocated for it, closed at the frame timeout") {
  Log log;
  fsdp::TcpStoreServerOptions opts;
  opts.limits.max_value_bytes = std::size_t{16} << 20;
  opts.frame_timeout = 300ms;
  opts.log = log.sink();
  fsdp::TcpStoreServer server(opts);
  fsdp::TcpStore good("127.0.0.1", server.port(), with_token(""));
  const auto announced = static_cast<std::uint32_t>(opts.limits.max_frame_bytes());  // the most a frame may be

  std::vector<std::unique_ptr<RawClient>> starving;
  for (int i = 0; i < 8; ++i) {
    starving.push_back(std::make_unique<RawClient>(server.port()));
    starving.back()->hello();
    starving.back()->send(header(announced) + std::string(100, 's'));  // a header and a trickle
  }
  const auto t0 = Clock::now();
  // Served meanwhile; eight frames of 32 MiB announced cost a few KiB each.
  good.set("k", "v");
  CHECK(good.get("k", 500ms) == "v");
  CHECK(server.stats().buffered_bytes > 0);
  CHECK(server.stats().peak_buffered_bytes <= 9 * (std::size_t{64} << 10));  // eight first chunks and good's frame
  for (auto& raw : starving) check_closed_silently(*raw);
  CHECK(ms_since(t0) >= 250);
  CHECK(becomes([&] { return server.stats().slow == 8 && server.stats().buffered_bytes == 0; }));
  CHECK(log.count("not complete within the frame timeout of 300 ms") == 8);
  CHECK(log.count("store at 127.0.0.1:" + std::to_string(server.port()) + ": closed the connection from 127.0.0.1:") == 8);

  // One past the limit is refused by its header alone, with the reason logged.
  RawClient over(server.port());
  over.hello();
  over.send(header(announced + 1));
  check_closed_silently(over);
  CHECK(server.stats().malformed == 1);
  CHECK(log.count("exceeds the limit of " + std::to_string(announced) + " bytes") == 1);
  CHECK(server.stats().peak_buffered_bytes <= 9 * (std::size_t{64} << 10));
  CHECK(good.get("k", 500ms) == "v");
}

TEST_CASE("a large frame sent in slow pieces within the frame timeout is served") {
  fsdp::TcpStoreServerOptions opts;
  opts.frame_timeout = 2000ms;
  fsdp::TcpStoreServer server(opts);
  fsdp::TcpStore good("127.0.0.1", server.port(), with_token(""));
  RawClient raw(server.port());
  raw.hello();
  fsdp::store_wire::Request set;
  set.verb = fsdp::store_wire::Verb::set;
  set.keys = {"big"};
  set.value = std::string(std::size_t{3} << 20, 'x');
  const std::string frame = fsdp::store_wire::encode(set);
  for (std::size_t at = 0; at < frame.size(); at += frame.size() / 3 + 1) {
    raw.send(frame.substr(at, frame.size() / 3 + 1));
    std::this_thread::sleep_for(50ms);
  }
  CHECK(becomes([&] { return good.try_get("big").has_value(); }));
  CHECK(good.get("big", 500ms) == set.value);
  CHECK(server.stats().slow == 0);
  CHECK(server.stats().peak_buffered_bytes >= set.value.size());
}

TEST_CASE("connections that never say hello take no slot: a real client gets in past them") {
  Log log;
  fsdp::TcpStoreServerOptions opts;
  opts.max_clients = 8;
  // Long: the silent connections below must still be pending when counted, however loaded
  // the machine (the deadline has its own test above); they are closed by the test.
  opts.handshake_timeout = 30000ms;
  opts.token = "s3cret";
  opts.log = log.sink();
  fsdp::TcpStoreServer server(opts);

  SUBCASE("more silent connections than slots") {
    std::vector<std::unique_ptr<RawClient>> silent;
    for (int i = 0; i < 20; ++i) silent.push_back(std::make_unique<RawClient>(server.port()));
    REQUIRE(becomes([&] { return server.stats().pending == 20; }));
    fsdp::TcpStore real("127.0.0.1", server.port(), with_token("s3cret"));
    real.set("k", "v");
    CHECK(real.get("k", 500ms) == "v");
    CHECK(server.stats().clients == 1);
    CHECK(server.stats().pending == 20);  // still there, and no slot taken
    silent.clear();                       // their closing frees them
    CHECK(becomes([&] { return server.stats().pending == 0; }));
    CHECK(server.stats().idle == 0);
    CHECK(real.num_keys() == 1);
  }
  SUBCASE("more silent connections than max_pending: the oldest make room") {
    opts.max_pending = 4;
    fsdp::TcpStoreServer small(opts);
    std::vector<std::unique_ptr<RawClient>> silent;
    for (int i = 0; i < 10; ++i) silent.push_back(std::make_unique<RawClient>(small.port()));
    REQUIRE(becomes([&] { return small.stats().evicted == 6 && small.stats().pending == 4; }));
    for (int i = 0; i < 6; ++i) check_closed_silently(*silent[static_cast<std::size_t>(i)]);
    fsdp::TcpStore real("127.0.0.1", small.port(), with_token("s3cret"));
    CHECK(real.num_keys() == 0);
    CHECK(small.stats().evicted == 7);  // the real client's arrival pushed out one more
    CHECK(log.count("connections without one are the most kept") == 7);
    silent.clear();
    CHECK(becomes([&] { return small.stats().pending == 0; }));
  }
  // The slots themselves still hold: eight clients in, the ninth refused with the reason.
  std::vector<std::unique_ptr<fsdp::TcpStore>> clients;
  for (int i = 0; i < 8; ++i) clients.push_back(std::make_unique<fsdp::TcpStore>("127.0.0.1", server.port(), with_token("s3cret")));
  CHECK(contains(error_of([&] { fsdp::TcpStore("127.0.0.1", server.port(), with_token("s3cret")); }), "serves at most 8 clients"));
  clients.pop_back();
  CHECK(becomes([&] { return server.stats().clients <= 7; }));
  fsdp::TcpStore ninth("127.0.0.1", server.port(), with_token("s3cret"));
  CHECK(ninth.num_keys() >= 0);
}

}  // namespace asio_tcp_store_abuse_test
