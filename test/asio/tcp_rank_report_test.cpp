// fsdp/asio/tcp_rank_report.hpp: what a failing TcpComm rank asks its peers through the
// store is bounded by StoreRankReport::kRequestBound, not by the store's own request
// timeout. The store sits behind a proxy that the test freezes: it still accepts
// connections but never answers, the worst a store can do short of refusing them.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/asio/tcp_comm.hpp"
#include "fsdp/asio/tcp_rank_report.hpp"
#include "fsdp/asio/tcp_store.hpp"
#include "test/asio/freezable_proxy.hpp"
#include "test/asio/tcp_world.hpp"

namespace {

using fsdp::DType;
using test_support::contains;
using test_support::error_of;
using test_support::FreezableProxy;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A store server, and clients that reach it through a proxy, whose own requests may wait
// a minute: longer than any of these tests may take.
struct ProxiedStore {
  fsdp::TcpStoreServer server;
  FreezableProxy proxy{server.port()};

  std::shared_ptr<fsdp::TcpStore> client() {
    fsdp::TcpStoreOptions o;
    o.timeout = 60s;
    o.connect_timeout = 10s;
    return std::make_shared<fsdp::TcpStore>("127.0.0.1", proxy.port(), o);
  }
};

// Two ranks as threads, each with its own store client through the proxy.
struct ProxiedWorld {
  ProxiedStore store;
  std::vector<std::unique_ptr<fsdp::TcpComm>> comms{2};

  explicit ProxiedWorld(std::chrono::milliseconds timeout) {
    auto o = test_support::ok_options();
    o.timeout = timeout;
    const auto errors = test_support::on_threads(
        2, [&](int r) { comms[r] = std::make_unique<fsdp::TcpComm>(store.client(), r, 2, o); });
    for (const auto& e : errors) REQUIRE(e.empty());
  }
};

}  // namespace

TEST_CASE("TcpStore::bounded_client: a second connection whose calls give up after its bound") {
  ProxiedStore s;
  auto main = s.client();
  const auto bounded = main->bounded_client(300ms);
  REQUIRE(bounded);
  bounded->set("k", "v");
  CHECK(main->get("k", 1s) == "v");  // the same store

  s.proxy.freeze();
  auto t0 = Clock::now();
  CHECK(contains(error_of([&] { bounded->try_get("k"); }), "try_get 'k' failed: no reply within the deadline"));
  CHECK(seconds_since(t0) < 1.5);
  t0 = Clock::now();  // connecting: the proxy accepts, the handshake goes unanswered
  CHECK(contains(error_of([&] { main->bounded_client(300ms); }), "hello failed: no reply within the deadline"));
  CHECK(seconds_since(t0) < 1.5);

  CHECK_FALSE(fsdp::HashStore().bounded_client(300ms));  // in-process: its own calls are quick
}

TEST_CASE("a mismatch with a store that stopped answering: every rank fails within the report's bound") {
  for (int frozen : {0, 1}) {
    CAPTURE(frozen);
    ProxiedWorld world(60s);
    if (frozen) world.store.proxy.freeze();
    const auto t0 = Clock::now();
    const auto errors = test_support::on_threads(2, [&](int r) {
      std::vector<float> in(8, 1.0f), out(16);
      world.comms[r]->all_gather(in.data(), out.data(), r == 0 ? 4 : 8, DType::f32).wait();
    });
    for (auto& c : world.comms) c.reset();  // destruction deletes keys: bounded as well
    const double took = seconds_since(t0);
    CAPTURE(took);
    // Frozen: one kRequestBound per rank for the handshake of its bounded client; before
    // the bound, the store's 60 s request timeout.
    CHECK(took < 2 * fsdp::detail::StoreRankReport::kRequestBound.count() / 1000.0 + 4.0);
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(contains(e, "collective mismatch: rank "));
      CHECK(contains(e, "all_gather(count=4, dtype=f32)"));
      CHECK(contains(e, "all_gather(count=8, dtype=f32)"));
      if (frozen) CHECK(contains(e, "could not ask the other ranks what they called"));
      if (frozen) CHECK(contains(e, "hello failed: no reply within the deadline"));
      else CHECK_FALSE(contains(e, "could not ask"));
    }
  }
}

TEST_CASE("a timeout with a store that stopped answering: the error comes within the report's bound") {
  ProxiedWorld world(500ms);
  world.store.proxy.freeze();
  std::string error;
  const auto t0 = Clock::now();
  error = error_of([&] {
    std::vector<float> in(8, 1.0f), out(16);
    world.comms[0]->all_gather(in.data(), out.data(), 8, DType::f32).wait();  // rank 1 never calls
  });
  const double took = seconds_since(t0);
  CAPTURE(took);
  CAPTURE(error);
  CHECK(contains(error, "rank 0: all_gather(count=8, dtype=f32) as collective #0 timed out after 500 ms"));
  CHECK(contains(error, "could not ask the other ranks where they are"));
  // While stalled, the rank looks for the flag (one bounded handshake), then asks (another).
  CHECK(took < 0.5 + 3 * fsdp::detail::StoreRankReport::kRequestBound.count() / 1000.0 + 2.0);
  world.comms[0].reset();
  world.comms[1].reset();
}
