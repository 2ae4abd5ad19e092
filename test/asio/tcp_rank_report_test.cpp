// fsdp/asio/tcp_rank_report.hpp and tcp_rendezvous.hpp: what a failing TcpComm rank asks
// its peers through the store, and what a joining rank looks up there, is bounded by
// detail::kStoreRequestBound per request, not by the store's own request timeout. The store sits behind a proxy that the test freezes: it still accepts
// connections but never answers, the worst a store can do short of refusing them.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/asio/tcp_comm.hpp"
#include "fsdp/asio/tcp_rank_report.hpp"
#include "fsdp/asio/tcp_store.hpp"
#include "test/asio/freezable_proxy.hpp"
#include "test/asio/tcp_world.hpp"

namespace asio_tcp_rank_report_test {

namespace {

using fsdp::DType;
using test_support::contains;
using test_support::seconds_since;
using test_support::error_of;
using test_support::FreezableProxy;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

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

TEST_CASE("TcpStore::bounded_client: one second connection, its calls bounded, not retried once gone") {
  ProxiedStore s;
  auto main = s.client();
  const auto bounded = main->bounded_client(300ms);
  REQUIRE(bounded);
  CHECK(main->bounded_client(300ms) == bounded);  // shared while it works
  bounded->set("k", "v");
  CHECK(main->get("k", 1s) == "v");  // the same store

  s.proxy.freeze();
  auto t0 = Clock::now();
  CHECK(contains(error_of([&] { bounded->try_get("k"); }), "try_get 'k' failed: no reply within the deadline"));
  CHECK(seconds_since(t0) < 1.5);
  t0 = Clock::now();  // lost: a new one connects, and the proxy leaves its handshake unanswered
  CHECK(contains(error_of([&] { main->bounded_client(300ms); }), "hello failed: no reply within the deadline"));
  CHECK(seconds_since(t0) < 1.5);

  CHECK_FALSE(fsdp::HashStore().bounded_client(300ms));  // in-process: its own calls are quick
}

TEST_CASE("TcpStore::bounded_client of a store that is gone fails at once") {
  std::shared_ptr<fsdp::TcpStore> main;
  {
    fsdp::TcpStoreServer server;
    fsdp::TcpStoreOptions o;
    o.timeout = 60s;
    main = std::make_shared<fsdp::TcpStore>("127.0.0.1", server.port(), o);
  }
  const auto t0 = Clock::now();
  CHECK(contains(error_of([&] { main->bounded_client(2s); }), "could not reach the store at 127.0.0.1:"));
  CHECK(seconds_since(t0) < 0.5);  // not retried for the bound's 2 s
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
    for (auto& c : world.comms) c.reset();  // destruction deletes the address keys: bounded as well
    const double took = seconds_since(t0);
    CAPTURE(took);
    // Frozen: each rank's report waits one bound for its first request on the bounded
    // connection, open since the join (the ranks in parallel), then the error; 4 s of room for a loaded machine. Before the bound: the
    // store's 60 s request timeout.
    CHECK(took < fsdp::detail::kStoreRequestBound.count() / 1000.0 + 4.0);
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(contains(e, "collective mismatch: rank "));
      CHECK(contains(e, "all_gather(count=4, dtype=f32)"));
      CHECK(contains(e, "all_gather(count=8, dtype=f32)"));
      if (frozen) CHECK(contains(e, "could not ask the other ranks what they called"));
      if (frozen) CHECK(contains(e, "failed: no reply within the deadline"));
      else CHECK_FALSE(contains(e, "could not ask"));
    }
    // Healthy, each destructor removed its address; frozen, the keys stay (a failed store
    // is not asked again), for the next communicator of the prefix to replace.
    fsdp::TcpStore direct("127.0.0.1", world.store.server.port());
    for (int r = 0; r < 2; ++r) CHECK(direct.try_get("fsdp/comm/addr/" + std::to_string(r)).has_value() == bool(frozen));
  }
}

TEST_CASE("a timeout with a store that stopped answering: the error comes within the report's bound") {
  ProxiedWorld world(2s);
  world.store.proxy.freeze();
  const auto t0 = Clock::now();
  const std::string error = error_of([&] {
    std::vector<float> in(8, 1.0f), out(16);
    world.comms[0]->all_gather(in.data(), out.data(), 8, DType::f32).wait();  // rank 1 never calls
  });
  const double took = seconds_since(t0);
  CAPTURE(took);
  CAPTURE(error);
  CHECK(contains(error, "rank 0: all_gather(count=8, dtype=f32) as collective #0 timed out after 2000 ms"));
  CHECK(contains(error, "could not ask the other ranks where they are"));
  CHECK(contains(error, "failed: no reply within the deadline"));
  // While stalled, the rank looked for the flag (one bounded request, from 0.5 s); the
  // timeout then reports that failure without asking again.
  CHECK(took < 2.0 + fsdp::detail::kStoreRequestBound.count() / 1000.0 + 3.0);
  const auto t1 = Clock::now();
  world.comms[0].reset();
  world.comms[1].reset();
  CHECK(seconds_since(t1) < fsdp::detail::kStoreRequestBound.count() / 1000.0 + 3.0);
}

// fsdp/asio/tcp_rendezvous.hpp: the join's store requests are bounded as the reports' are.
// Before, each went through the caller's client and could wait its 60 s.
TEST_CASE("a join with a store that stopped answering ends within its timeout and two bounds") {
  constexpr double kBound = fsdp::detail::kStoreRequestBound.count() / 1000.0;
  auto joining = [](ProxiedStore& s, std::chrono::milliseconds timeout) {
    auto o = test_support::ok_options();
    o.timeout = timeout;
    auto client = s.client();
    return [client, o] { fsdp::TcpComm(client, 0, 2, o); };  // rank 1 never comes
  };

  SUBCASE("frozen before the rank publishes its address") {
    ProxiedStore s;
    auto join = joining(s, 1500ms);
    s.proxy.freeze();
    const auto t0 = Clock::now();
    const std::string error = error_of(join);
    const double took = seconds_since(t0);
    CAPTURE(took);
    CAPTURE(error);
    // One bound for the join's first request (clearing an earlier communicator's reports),
    // which the deadline then ends, one for the failed join's clean-up.
    CHECK(took < 1.5 + 2 * kBound + 3.0);
    CHECK(contains(error, "rank 0: could not clear what an earlier communicator fsdp/comm left in the store before the "
                          "join's timeout (1500 ms): the store stopped answering (1 request without a reply within 2000 ms "
                          "each; the last: fsdp: store at 127.0.0.1:"));
    CHECK(contains(error, "hello failed: no reply within the deadline)"));
  }

  SUBCASE("frozen while the rank waits for its neighbour's address") {
    ProxiedStore s;
    auto join = joining(s, 3000ms);
    std::string error;
    std::thread rank0([&] { error = error_of(join); });
    const auto t0 = Clock::now();
    fsdp::TcpStore direct("127.0.0.1", s.server.port());  // past the proxy
    direct.wait({"fsdp/comm/addr/0"}, 10s);
    // The publish's reply arrived once the rank sends its first look-up.
    const std::uint64_t published = s.proxy.bytes_from_clients();
    for (int i = 0; i < 1000 && s.proxy.bytes_from_clients() == published; ++i) std::this_thread::sleep_for(10ms);
    CHECK(s.proxy.bytes_from_clients() > published);  // not REQUIRE: rank0 must be joined
    s.proxy.freeze();
    rank0.join();
    const double took = seconds_since(t0);
    CAPTURE(took);
    CAPTURE(error);
    // The look-up under way when the deadline passes runs out its bound.
    CHECK(took < 3.0 + kBound + 3.0);
    CHECK(contains(error, "rank 0: waited 3000 ms for rank 1 to join communicator fsdp/comm, but the store stopped "
                          "answering ("));
    CHECK(contains(error, "no reply within the deadline)"));
    CHECK_FALSE(contains(error, "never joined"));  // the store could not say
  }
}

// The bounded client is shared by the ranks of a process: a request that runs out its
// bound loses the connection, and another rank's request waiting for it then fails at
// once. That is not a store that is gone: the join tries again on a fresh connection.
TEST_CASE("a store that is slow once does not fail the joins of ranks that share its client") {
  ProxiedStore s;
  auto shared = s.client();  // ranks 0 and 2, through the proxy
  auto o = test_support::ok_options();
  o.timeout = 20s;
  std::vector<std::string> errors(4);
  std::vector<float> sums(4);
  auto rank = [&](int r, std::shared_ptr<fsdp::Store> store) {
    errors[r] = error_of([&] {
      fsdp::TcpComm comm(store, r, 4, o);
      std::vector<float> x(4, 1.0f), y(4);
      comm.all_reduce(x.data(), y.data(), 4, DType::f32, fsdp::ReduceOp::sum).wait();
      sums[r] = y[0];
    });
  };
  std::vector<std::thread> ranks;
  ranks.emplace_back(rank, 0, shared);
  std::this_thread::sleep_for(25ms);  // their look-ups interleave on the one connection
  ranks.emplace_back(rank, 2, shared);
  std::this_thread::sleep_for(1s);  // both wait for their right neighbours
  s.proxy.stall_for(3000ms);        // longer than a request's bound, then everything is answered
  std::this_thread::sleep_for(4500ms);
  for (int r : {1, 3}) ranks.emplace_back(rank, r, std::make_shared<fsdp::TcpStore>("127.0.0.1", s.server.port()));
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(errors[r] == "");
    CHECK(sums[r] == 4.0f);
  }
}

}  // namespace asio_tcp_rank_report_test
