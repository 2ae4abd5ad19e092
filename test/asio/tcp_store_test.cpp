// TcpStore against a TcpStoreServer on loopback: every verb, waits that park without
// blocking other clients, timeouts with their messages, HashStore parity, and the
// environment-driven connect_store.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/asio/tcp_store.hpp>

#include "store_test_support.hpp"
#include "test/support/scoped_env.hpp"

namespace asio_tcp_store_test {

using namespace store_test;

namespace {

fsdp::TcpStoreOptions quick() {
  fsdp::TcpStoreOptions o;
  o.timeout = 2000ms;
  o.connect_timeout = 2000ms;
  return o;
}

// A scenario through the Store interface that logs every answer, so two stores can be
// compared. Timeout messages are logged from "waited" on (the prefix names the store).
std::vector<std::string> scenario(fsdp::Store& s) {
  std::vector<std::string> log;
  auto note = [&](const auto& v) {
    std::ostringstream os;
    os << v;
    log.push_back(os.str());
  };
  auto note_error = [&](auto&& fn) {
    const std::string e = error_of(fn);
    note(e.empty() ? std::string("<no error>") : e.substr(e.find("waited")));
  };
  s.set("a", "1");
  s.set("b", std::string("x\0y", 3));
  note(s.get("a", 100ms));
  note(s.get("b", 100ms));
  note(s.add("counter", 5));
  note(s.add("counter", -7));
  note(s.add("a", 41));
  note(s.compare_set("cas", "", "first"));      // absent, expected empty: set
  note(s.compare_set("cas", "nope", "x"));      // present, mismatch: unchanged
  note(s.compare_set("cas", "first", "second"));
  note(s.compare_set("absent", "want", "x"));   // absent, expected given: not set
  note(s.try_get("absent").value_or("<none>"));
  note(s.try_get("cas").value_or("<none>"));
  note(s.num_keys());
  note(s.delete_key("b"));
  note(s.delete_key("b"));
  note(s.num_keys());
  s.wait({"a", "cas", "counter"}, 100ms);
  note_error([&] { s.get("b", 30ms); });
  note(s.compare_set("", "", "empty keys are keys too"));
  note(s.get("", 10ms));
  return log;
}

// The launch environment of rank 0 of a job of `world_size` on loopback at `port`.
fsdp::DistEnv loopback_env(std::uint16_t port, int world_size) {
  fsdp::DistEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.world_size = world_size;
  return env;
}

// Unsets, for the scope of `env`, what says who hosts the store and where rank 0's listens.
void no_store_settings(test_support::ScopedEnv& env) {
  env.set("FSDP_STORE_EXTERNAL", std::nullopt).set("FSDP_STORE_HOST", std::nullopt).set("FSDP_STORE_BIND", std::nullopt);
}

}  // namespace

TEST_CASE("every verb, and the same answers as HashStore") {
  fsdp::TcpStoreServer server;
  fsdp::TcpStore store("127.0.0.1", server.port(), quick());
  fsdp::HashStore reference;
  const auto tcp = scenario(store);
  const auto hash = scenario(reference);
  CHECK(tcp == hash);
  CHECK(tcp.front() == "1");
  REQUIRE(tcp.size() == 18);
  CHECK(tcp[4] == "42");       // add to "a", which held "1"
  CHECK(tcp[8] == "want");     // compare_set on an absent key returns the expectation
  CHECK(tcp[9] == "<none>");   // ... and did not set it
  CHECK(tcp[11] == "4");       // a, b, counter, cas
  CHECK(tcp[12] == "1");       // b existed
  CHECK(tcp[13] == "0");       // ... and is gone
  CHECK(tcp[15] == "waited 30 ms for key 'b', which no rank set");
  CHECK(store.local_address() == "127.0.0.1");
  CHECK(server.stats().accepted == 1);
}

TEST_CASE("a wait parks until another client sets the keys, and other clients carry on meanwhile") {
  fsdp::TcpStoreServer server;
  fsdp::TcpStore waiter("127.0.0.1", server.port(), quick());
  fsdp::TcpStore other("127.0.0.1", server.port(), quick());
  std::atomic<bool> waited{false};
  std::string got, error;
  std::thread t([&] {  // an exception must not escape the thread (std::terminate)
    error = error_of([&] {
      waiter.wait({"late/1", "late/2"}, 10000ms);
      waited = true;
      got = waiter.get("late/2", 100ms);
    });
  });
  // While that wait is parked, the server answers everyone else at once.
  const auto t0 = Clock::now();
  for (int i = 0; i < 50; ++i) other.set("busy/" + std::to_string(i), "x");
  CHECK(other.get("busy/49", 100ms) == "x");
  CHECK(ms_since(t0) < 1000);
  other.set("late/1", "one");
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(waited.load());  // one of two keys
  other.add("late/2", 7);      // any verb that sets a key wakes waiters
  t.join();
  CHECK(error == "");
  CHECK(waited.load());
  CHECK(got == "7");
}

TEST_CASE("get and wait time out with the missing keys named, and the connection stays usable") {
  fsdp::TcpStoreServer server;
  fsdp::TcpStore store("127.0.0.1", server.port(), quick());
  const std::string prefix = "fsdp: store at 127.0.0.1:" + std::to_string(server.port()) + ": ";
  auto t0 = Clock::now();
  CHECK(error_of([&] { store.get("nobody", 150ms); }) == prefix + "waited 150 ms for key 'nobody', which no rank set");
  const auto took = ms_since(t0);
  CHECK(took >= 150);
  CHECK(took < 1000);
  store.set("k1", "v");
  CHECK(error_of([&] { store.wait({"k1", "k2", "k3"}, 100ms); }) == prefix + "waited 100 ms for 3 keys; no rank set 'k2' 'k3'");
  CHECK(store.get("k1", 100ms) == "v");
  CHECK(error_of([&] { store.get("k1", 0ms); }) == "fsdp: store: timeout must be in (0 ms, 24 h], got 0 ms");
  CHECK(contains(error_of([&] { store.wait({"k1"}, std::chrono::hours(25)); }), "timeout must be in (0 ms, 24 h]"));
}

TEST_CASE("add from many clients and many threads on one client") {
  fsdp::TcpStoreServer server;
  fsdp::TcpStore shared("127.0.0.1", server.port(), quick());
  std::vector<std::thread> threads;
  for (int c = 0; c < 4; ++c)  // clients of their own
    threads.emplace_back([&] {
      fsdp::TcpStore mine("127.0.0.1", server.port(), quick());
      for (int i = 0; i < 100; ++i) mine.add("n", 1);
    });
  for (int c = 0; c < 4; ++c)  // threads sharing one client
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) shared.add("n", 2);
    });
  for (auto& t : threads) t.join();
  CHECK(shared.add("n", 0) == 4 * 100 + 4 * 200);
}

TEST_CASE("verbs that cannot be done say why, and the connection stays usable") {
  fsdp::TcpStoreServerOptions opts;
  opts.limits = {16, 64};
  fsdp::TcpStoreServer server(opts);
  fsdp::TcpStore store("127.0.0.1", server.port(), quick());
  const std::string prefix = "fsdp: store at 127.0.0.1:" + std::to_string(server.port()) + ": ";
  store.set("text", "hello");
  CHECK(error_of([&] { store.add("text", 1); }) == prefix + "add 'text': add to key 'text': its value 'hello' is not a 64-bit integer");
  store.set("big", std::to_string(INT64_MAX));
  CHECK(contains(error_of([&] { store.add("big", 1); }), "overflows a 64-bit integer"));
  fsdp::HashStore local;  // the in-process store refuses the same adds
  local.set("text", "12abc");
  CHECK(error_of([&] { local.add("text", 1); }) == "fsdp: store: add to key 'text': its value '12abc' is not a 64-bit integer");
  local.set("big", std::to_string(INT64_MAX));
  CHECK(contains(error_of([&] { local.add("big", 1); }), "overflows a 64-bit integer"));
  CHECK(error_of([&] { store.set("k", std::string(65, 'v')); }) ==
        prefix + "set 'k': value of 65 bytes exceeds the store's limit of 64 bytes");
  CHECK(error_of([&] { store.get(std::string(17, 'k'), 100ms); }) ==
        prefix + "get '" + std::string(17, 'k') + "': key of 17 bytes exceeds the store's limit of 16 bytes");
  // Every key within the limit, but together past the frame limit: refused before sending.
  const std::vector<std::string> many(10, std::string(16, 'k'));
  CHECK(error_of([&] { store.wait(many, 100ms); }) ==
        prefix + "wait for 10 keys: the request of 209 bytes exceeds the store's frame limit of 157 bytes");
  CHECK(store.get("text", 100ms) == "hello");
  CHECK(server.stats().malformed == 0);  // refused by the client, before sending
}

TEST_CASE("a server going away ends a parked wait at once, and later verbs say so") {
  auto server = std::make_unique<fsdp::TcpStoreServer>();
  fsdp::TcpStore store("127.0.0.1", server->port(), quick());
  std::string error;
  const auto t0 = Clock::now();
  std::thread t([&] { error = error_of([&] { store.wait({"never"}, 5000ms); }); });
  // Only once the wait is parked: a wait sent after the server closed could read a reset.
  for (auto until = Clock::now() + 2000ms; server->stats().parked == 0 && Clock::now() < until;)
    std::this_thread::sleep_for(5ms);
  CHECK(server->stats().parked == 1);
  server.reset();  // must not hang on the parked connection
  t.join();
  CHECK(ms_since(t0) < 2000);
  CHECK(contains(error, "wait for 1 keys failed: the store closed the connection"));
  CHECK(contains(error_of([&] { store.set("k", "v"); }), "set 'k' on a connection lost earlier: wait for 1 keys failed"));
}

TEST_CASE("generations, led by clients (fsdp_store): a later hello drops every key and closes earlier clients; earlier ones are refused") {
  test_support::ScopedEnv env_vars("TORCHELASTIC_RESTART_COUNT", std::nullopt);  // the clients' defaults: 0 and ""
  env_vars.set("TORCHELASTIC_RUN_ID", std::nullopt);
  fsdp::TcpStoreServer server;
  auto generation = [](std::uint64_t g) {
    fsdp::TcpStoreOptions o = quick();
    o.generation = g;
    return o;
  };
  fsdp::TcpStore idle("127.0.0.1", server.port(), quick());  // generation 0, as every client by default
  fsdp::TcpStore parked("127.0.0.1", server.port(), quick());
  idle.set("from/0", "stale");
  std::string parked_error;
  std::thread t([&] { parked_error = error_of([&] { parked.get("never", 5000ms); }); });
  for (auto until = Clock::now() + 2000ms; server.stats().parked == 0 && Clock::now() < until;)
    std::this_thread::sleep_for(5ms);
  REQUIRE(server.stats().parked == 1);

  const auto t0 = Clock::now();
  fsdp::TcpStore next("127.0.0.1", server.port(), generation(1));  // a restarted rank
  t.join();
  CHECK(ms_since(t0) < 2000);  // the parked get ended at once, not at its timeout
  CHECK(contains(parked_error, "get 'never': generation 1 began (a client of it (127.0.0.1:"));
  CHECK(contains(parked_error, "said hello), which ends generation 0 and its clients"));
  CHECK_FALSE(next.try_get("from/0"));  // the failed start's keys are gone
  CHECK(next.num_keys() == 0);
  CHECK(contains(error_of([&] { idle.set("from/0", "again"); }), "set 'from/0' failed"));
  CHECK_FALSE(next.try_get("from/0"));  // and its clients cannot write any more
  CHECK(error_of([&] { fsdp::TcpStore late("127.0.0.1", server.port(), quick()); }) ==
        "fsdp: the store at 127.0.0.1:" + std::to_string(server.port()) +
            " refused this client: this client belongs to generation 0 of the job, and the store at 127.0.0.1:" +
            std::to_string(server.port()) +
            " serves generation 1: it is left from an earlier start of the job, which was restarted since "
            "(TORCHELASTIC_RESTART_COUNT counts the starts)");
  auto stats = server.stats();
  CHECK(stats.generation == 1);
  CHECK(stats.superseded == 2);
  CHECK(stats.stale == 1);
  CHECK(stats.clients == 1);

  // Its host begins one too (fsdp_run, before a restart's ranks start); generations only grow.
  next.set("from/1", "x");
  server.begin_generation(1);  // the one served: nothing happens
  CHECK(next.get("from/1", 100ms) == "x");
  server.begin_generation(3);
  CHECK(contains(error_of([&] { next.get("from/1", 100ms); }), "get 'from/1' failed"));
  CHECK(error_of([&] { server.begin_generation(2); }) ==
        "fsdp: store server: cannot begin generation 2: it serves generation 3 already (generations only grow)");
  fsdp::TcpStore current("127.0.0.1", server.port(), generation(3));
  CHECK(current.num_keys() == 0);
  current.set("from/3", "x");
  stats = server.stats();
  CHECK(stats.generation == 3);
  CHECK(stats.superseded == 3);
  CHECK(contains(error_of([&] { fsdp::TcpStore late("127.0.0.1", server.port(), generation(2)); }),
                 "belongs to generation 2 of the job"));

  // Another job (its TORCHELASTIC_RUN_ID) begins there at its own generation: the next job
  // on a store that outlived one that restarted.
  fsdp::TcpStoreOptions next_job_options = generation(0);
  next_job_options.job = "next-job";
  fsdp::TcpStore next_job("127.0.0.1", server.port(), next_job_options);
  CHECK(server.stats().generation == 0);
  CHECK_FALSE(next_job.try_get("from/3"));
  CHECK(contains(error_of([&] { current.get("from/3", 100ms); }), "get 'from/3' failed"));
  CHECK(server.stats().clients == 1);
}

TEST_CASE("generations, led by the host (fsdp_run's and rank 0's stores): clients of any other are refused") {
  fsdp::TcpStoreServerOptions at5;
  at5.generation = 5;
  at5.host_begins_generations = true;
  fsdp::TcpStoreServer server(at5);
  const std::string here = "the store at 127.0.0.1:" + std::to_string(server.port());
  auto generation = [](std::uint64_t g) {
    fsdp::TcpStoreOptions o = quick();
    o.generation = g;
    return o;
  };
  // Refused even with no client connected, and a later one too: only the host moves on.
  CHECK(contains(error_of([&] { fsdp::TcpStore s("127.0.0.1", server.port(), generation(4)); }),
                 "belongs to generation 4 of the job, and " + here + " serves generation 5: it is left from an earlier start"));
  CHECK(contains(error_of([&] { fsdp::TcpStore s("127.0.0.1", server.port(), generation(6)); }),
                 "belongs to generation 6 of the job, and " + here +
                     " serves generation 5, which only its host (fsdp_run, or rank 0) moves on"));
  fsdp::TcpStore fifth("127.0.0.1", server.port(), generation(5));
  fifth.set("k", "v");
  server.begin_generation(6);
  fsdp::TcpStore sixth("127.0.0.1", server.port(), generation(6));
  CHECK_FALSE(sixth.try_get("k"));
  CHECK(contains(error_of([&] { fifth.get("k", 100ms); }), "get 'k' failed"));
  const auto stats = server.stats();
  CHECK(stats.stale == 2);
  CHECK(stats.superseded == 1);
  CHECK(stats.generation == 6);
}

TEST_CASE("connect_store: a client's generation is TORCHELASTIC_RESTART_COUNT's, and a restarted rank 0 hosts that one") {
  const std::uint16_t port = unused_port();
  test_support::ScopedEnv env_vars;
  no_store_settings(env_vars);
  fsdp::DistEnv env = loopback_env(port, 2);
  env.restart_count = 2;
  auto rank0 = fsdp::connect_store(env, quick());
  REQUIRE(rank0.server);
  CHECK(rank0.server->stats().generation == 2);
  env.rank = 1;
  env.restart_count = 1;  // a rank of the start before
  CHECK(contains(error_of([&] { fsdp::connect_store(env, quick()); }), "belongs to generation 1 of the job"));
  env_vars.set("MASTER_ADDR", "127.0.0.1").set("MASTER_PORT", std::to_string(port));
  env_vars.set("RANK", "1").set("WORLD_SIZE", "2").set("TORCHELASTIC_RESTART_COUNT", "2");
  auto store = fsdp::TcpStore::from_env(quick());
  CHECK(store->get("fsdp/job/world_size", 100ms) == "2");  // rank 0's claim, of this generation
  fsdp::TcpStoreOptions given = quick();
  given.generation = 0;  // given, not read from TORCHELASTIC_RESTART_COUNT
  CHECK(contains(error_of([&] { fsdp::TcpStore::from_env(given); }), "belongs to generation 0 of the job"));
}

TEST_CASE("connect_store: FSDP_STORE_HOST says who serves; a launcher's store is claimed, one run apart is not") {
  fsdp::TcpStoreServer launcher;  // as fsdp_run hosts it
  test_support::ScopedEnv env_vars("FSDP_STORE_EXTERNAL", std::nullopt);
  env_vars.set("FSDP_STORE_HOST", "launcher");
  fsdp::DistEnv env = loopback_env(launcher.port(), 2);
  auto rank0 = fsdp::connect_store(env, quick());
  CHECK_FALSE(rank0.server);
  CHECK(rank0.store->get("fsdp/job/world_size", 100ms) == "2");
  CHECK(contains(error_of([&] { fsdp::connect_store(env, quick()); }),
                 "already has a rank 0: another job is using port " + std::to_string(launcher.port())));
  env_vars.set("FSDP_STORE_HOST", "external");  // fsdp_store: not claimed
  CHECK_FALSE(fsdp::connect_store(env, quick()).claimed);
  CHECK(rank0.store->add("fsdp/job/rank/0", 0) == 2);  // the claim above and the refused one, not a third
  rank0.release_place(0);  // as a TcpProcessGroup's teardown does: the rank may connect again
  env_vars.set("FSDP_STORE_HOST", "launcher");
  CHECK(fsdp::connect_store(env, quick()).claimed);
  env_vars.set("FSDP_STORE_HOST", "rank1");
  CHECK(error_of([&] { fsdp::connect_store(env, quick()); }) ==
        "fsdp: environment: FSDP_STORE_HOST is 'rank1'; write launcher, rank0 or external");
  env_vars.set("FSDP_STORE_HOST", "rank0").set("FSDP_STORE_EXTERNAL", "1");
  CHECK(error_of([&] { fsdp::connect_store(env, quick()); }) ==
        "fsdp: environment: FSDP_STORE_HOST=rank0 and FSDP_STORE_EXTERNAL=1 disagree (a store run apart); set one of "
        "them");
}

TEST_CASE("the client retries until the server listens") {
  const std::uint16_t port = unused_port();
  std::unique_ptr<fsdp::TcpStoreServer> server;
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    fsdp::TcpStoreServerOptions opts;
    opts.port = port;
    server = std::make_unique<fsdp::TcpStoreServer>(opts);
  });
  const auto t0 = Clock::now();
  fsdp::TcpStore store("localhost", port, quick());  // by name: resolved on each attempt
  late.join();
  CHECK(ms_since(t0) >= 150);
  store.set("up", "yes");
  CHECK(store.get("up", 100ms) == "yes");
}

TEST_CASE("a store rank 0 hosts keeps 2 connections per rank that have not said hello yet") {
  // A job of 200 ranks connecting at once: 300 connections before their hellos (more than
  // the server's default max_pending of 256) must all be kept, none evicted.
  const std::uint16_t port = unused_port();
  test_support::ScopedEnv env_vars;
  no_store_settings(env_vars);
  fsdp::DistEnv env = loopback_env(port, 200);
  auto rank0 = fsdp::connect_store(env, quick());
  REQUIRE(rank0.server);
  std::vector<std::unique_ptr<RawClient>> early;
  for (int i = 0; i < 300; ++i) early.push_back(std::make_unique<RawClient>(port));
  const auto deadline = Clock::now() + 5000ms;
  while (rank0.server->stats().pending + rank0.server->stats().evicted < 300 && Clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  CHECK(rank0.server->stats().pending == 300);
  CHECK(rank0.server->stats().evicted == 0);
  early.clear();
}

TEST_CASE("connect_store: rank 0 hosts the server from the environment, or uses an external one") {
  const std::uint16_t port = unused_port();
  fsdp::DistEnv env = loopback_env(port, 2);
  env.token = "t0ken";
  test_support::ScopedEnv env_vars;
  no_store_settings(env_vars);
  {
    auto rank0 = fsdp::connect_store(env, quick());
    REQUIRE(rank0.server);
    CHECK(rank0.server->host() == "127.0.0.1");
    env.rank = 1;
    auto rank1 = fsdp::connect_store(env, quick());
    CHECK_FALSE(rank1.server);
    rank1.store->set("from/1", "hi");
    CHECK(rank0.store->get("from/1", 500ms) == "hi");

    // A standalone server already runs: rank 0 only connects.
    env_vars.set("FSDP_STORE_EXTERNAL", "1");
    env.rank = 0;
    auto external = fsdp::connect_store(env, quick());
    CHECK_FALSE(external.server);
    CHECK(external.store->get("from/1", 500ms) == "hi");
    env_vars.set("FSDP_STORE_EXTERNAL", "yes");  // a boolean like every other
    CHECK_FALSE(fsdp::connect_store(env, quick()).server);
    env_vars.set("FSDP_STORE_EXTERNAL", "maybe");
    CHECK(error_of([&] { fsdp::connect_store(env, quick()); }) ==
          "fsdp: environment variable FSDP_STORE_EXTERNAL: 'maybe' is not a boolean; write 1/0, true/false, yes/no or on/off");
    env_vars.set("FSDP_STORE_EXTERNAL", std::nullopt);
  }
  env_vars.set("MASTER_ADDR", "127.0.0.1").set("MASTER_PORT", std::to_string(port)).set("RANK", "0");
  env_vars.set("WORLD_SIZE", "1").set("FSDP_STORE_TOKEN", "from-env");
  {
    fsdp::TcpStoreServerOptions opts;
    opts.port = port;
    opts.token = "from-env";
    fsdp::TcpStoreServer server(opts);
    auto store = fsdp::TcpStore::from_env(quick());  // the token comes from FSDP_STORE_TOKEN
    CHECK(store->num_keys() == 0);
    CHECK(server.stats().accepted == 1);
  }
}

TEST_CASE("bad options are refused with the value named") {
  fsdp::TcpStoreServer server;
  auto options = quick();
  options.timeout = 0ms;
  CHECK(error_of([&] { fsdp::TcpStore("127.0.0.1", server.port(), options); }) ==
        "fsdp: store: timeout must be in (0 ms, 24 h], got 0 ms");
  fsdp::TcpStoreServerOptions taken;
  taken.port = server.port();
  CHECK(error_of([&] { fsdp::TcpStoreServer second(taken); }) ==
        "fsdp: store server: could not listen on 127.0.0.1:" + std::to_string(server.port()) +
            ": Address already in use (another job's store, or another program, holds port " +
            std::to_string(server.port()) + ": give this job another MASTER_PORT)");
  fsdp::TcpStoreServerOptions slow;
  slow.frame_timeout = 0ms;
  CHECK(contains(error_of([&] { fsdp::TcpStoreServer s(slow); }), "frame timeout must be in (0 ms, 24 h], got 0 ms"));
  fsdp::TcpStoreServerOptions no_pending;
  no_pending.max_pending = 0;
  CHECK(error_of([&] { fsdp::TcpStoreServer s(no_pending); }) == "fsdp: store server: max_pending must be at least 1");
  fsdp::TcpStoreServerOptions idle;
  idle.handshake_timeout = 0ms;
  CHECK(contains(error_of([&] { fsdp::TcpStoreServer s(idle); }), "handshake timeout must be in (0 ms, 24 h], got 0 ms"));
  fsdp::TcpStoreServerOptions limits;
  limits.limits.max_value_bytes = 0;
  CHECK(contains(error_of([&] { fsdp::TcpStoreServer s(limits); }), "max value size must be in [1, 1 GiB], got 0 bytes"));
}

TEST_CASE("HashStore: a get racing a delete_key returns the value, never another exception") {
  fsdp::HashStore store;
  std::atomic<bool> done{false};
  std::thread churn([&] {
    for (int i = 0; i < 20000 && !done; ++i) {
      store.set("k", "v");
      store.delete_key("k");
    }
    store.set("k", "v");  // the getter's last get finds it
  });
  std::string unexpected;
  int got = 0;
  for (int i = 0; i < 5000 && unexpected.empty(); ++i) {
    try {
      got += store.get("k", 2000ms) == "v";
    } catch (const std::exception& e) {
      unexpected = e.what();
    }
  }
  done = true;
  churn.join();
  CHECK(unexpected == "");
  CHECK(got > 0);
}

TEST_CASE("a numeric address that is not one fails at once; a host name that does not resolve is retried") {
  const std::uint16_t port = unused_port();
  {
    auto options = quick();
    options.connect_timeout = 20000ms;  // not waited for
    const auto t0 = Clock::now();
    const std::string e = error_of([&] { fsdp::TcpStore("999.1.1.1", port, options); });
    CHECK(contains(e, "fsdp: the store's address '999.1.1.1' (port " + std::to_string(port) + ") cannot be resolved: "));
    CHECK(contains(e, "check MASTER_ADDR"));
    CHECK(ms_since(t0) < 2000);
  }
  {  // it may be a service name that resolves once the master is up: retried until connect_timeout
    auto options = quick();
    options.connect_timeout = 600ms;
    const auto t0 = Clock::now();
    const std::string e = error_of([&] { fsdp::TcpStore("no.such.host.invalid", port, options); });
    CHECK(contains(e, "fsdp: the store's address 'no.such.host.invalid' (port " + std::to_string(port) +
                          ") did not resolve within 600 ms ("));
    CHECK(contains(e, "check MASTER_ADDR"));
    CHECK(ms_since(t0) >= 200);  // not at once (the backoff gives up ~300 ms before the deadline)
    CHECK(ms_since(t0) < 10000);
  }
}

TEST_CASE("a second job on a busy port fails at once on every rank, naming the port") {
  const std::uint16_t port = unused_port();
  test_support::ScopedEnv env_vars;
  no_store_settings(env_vars);
  fsdp::DistEnv first;
  first.master_addr = "127.0.0.1";
  first.master_port = port;
  first.world_size = 2;
  auto first0 = fsdp::connect_store(first, quick());
  first.rank = 1;
  auto first1 = fsdp::connect_store(first, quick());

  fsdp::DistEnv second = first;
  const auto t0 = Clock::now();
  second.rank = 0;
  const std::string busy = error_of([&] { fsdp::connect_store(second, quick()); });
  CHECK(contains(busy, "could not listen on 127.0.0.1:" + std::to_string(port)));
  CHECK(contains(busy, "holds port " + std::to_string(port) + ": give this job another MASTER_PORT"));
  second.rank = 1;  // the same size: its rank is taken
  CHECK(error_of([&] { fsdp::connect_store(second, quick()); }) ==
        "fsdp: rank 1: the store at 127.0.0.1:" + std::to_string(port) + " already has a rank 1: another job is using port " +
            std::to_string(port) + " (give each job its own MASTER_PORT), or two processes were started with RANK=1");
  second.world_size = 4;  // another size
  second.rank = 3;
  CHECK(error_of([&] { fsdp::connect_store(second, quick()); }) ==
        "fsdp: rank 3: the store at 127.0.0.1:" + std::to_string(port) +
            " serves a job of world size 2, not 4: another job is using port " + std::to_string(port) +
            " (give each job its own MASTER_PORT)");
  CHECK(ms_since(t0) < 1000);
  // The first job is untouched.
  first1.store->set("still", "mine");
  CHECK(first0.store->get("still", 500ms) == "mine");
}

TEST_CASE("a store that listens beyond loopback demands a token unless told not to") {
  fsdp::TcpStoreServerOptions open;
  open.host = "0.0.0.0";
  CHECK(error_of([&] { fsdp::TcpStoreServer s(open); }) ==
        "fsdp: store server: listening on 0.0.0.0:0 reaches beyond loopback, so it needs a token: set FSDP_STORE_TOKEN "
        "(the same on every host), or bind to 127.0.0.1");
  open.token = "s3cret";
  {
    fsdp::TcpStoreServer guarded(open);
    auto options = quick();
    options.token = "s3cret";
    fsdp::TcpStore client("127.0.0.1", guarded.port(), options);
    CHECK(client.num_keys() == 0);
  }
  open.token.clear();
  open.allow_without_token = true;
  fsdp::TcpStoreServer knowingly(open);
  CHECK(fsdp::TcpStore("127.0.0.1", knowingly.port(), quick()).num_keys() == 0);
  // Through connect_store: FSDP_STORE_BIND beyond loopback and no token.
  test_support::ScopedEnv env_vars("FSDP_STORE_EXTERNAL", std::nullopt);
  env_vars.set("FSDP_STORE_HOST", std::nullopt);
  env_vars.set("FSDP_STORE_BIND", "0.0.0.0");
  fsdp::DistEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = unused_port();
  env.world_size = 1;
  CHECK(contains(error_of([&] { fsdp::connect_store(env, quick()); }), "reaches beyond loopback, so it needs a token: set FSDP_STORE_TOKEN"));
}

}  // namespace asio_tcp_store_test
