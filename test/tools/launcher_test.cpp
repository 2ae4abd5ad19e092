// fsdp::launch as a library: fsdp_run's command-line parsing, find_free_port, run() in
// this process (status, restored signal handling), relaunch_self, and the store it hosts
// (outliving rank 0, one port and a new generation per restart, and what it is told in
// --restart-scope rank).
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fsdp/asio/tcp_store.hpp>

#include "test/support/scoped_env.hpp"
#include "tools/launcher/cli.hpp"
#include "tools/launcher/launcher.hpp"

namespace {

namespace launch = fsdp::launch;

launch::Command parse(std::vector<std::string> args) {
  args.insert(args.begin(), "fsdp_run");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return launch::parse(static_cast<int>(argv.size()), argv.data());
}

std::string parse_error(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

using Strings = std::vector<std::string>;

}  // namespace

TEST_CASE("parse: options first, then the program with arguments that stay the program's") {
  const auto c = parse({"--nproc", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                        "--master-port", "29500", "--grace-ms", "500", "--timeout-ms", "9000", "--no-prefix",
                        "--env", "A=1", "--env", "B=x=y", "./train", "--nproc", "3", "--", "z"});
  const launch::Options& o = c.options;
  CHECK(o.nproc == 4);
  CHECK(o.nnodes == 2);
  CHECK(o.node_rank == 1);
  CHECK(o.master_addr == "10.0.0.1");
  CHECK(o.master_port == 29500);
  CHECK(o.grace.count() == 500);
  CHECK(o.timeout.count() == 9000);
  CHECK(o.echo_wait.count() == 2000);
  CHECK(parse({"--echo-wait-ms", "0", "p"}).options.echo_wait.count() == 0);
  CHECK_FALSE(o.prefix_output);
  CHECK(o.env == std::vector<std::pair<std::string, std::string>>{{"A", "1"}, {"B", "x=y"}});
  CHECK(c.argv == Strings{"./train", "--nproc", "3", "--", "z"});
  CHECK(c.help.empty());

  const auto defaults = parse({"prog"});
  CHECK(defaults.options.nproc == 1);
  CHECK(defaults.options.master_port == 0);
  CHECK(defaults.options.prefix_output);
  CHECK(defaults.options.grace.count() == 3000);
  CHECK(defaults.options.timeout.count() == 0);
  CHECK(parse({"--nproc-per-node", "2", "--", "-odd-name", "a"}).argv == Strings{"-odd-name", "a"});
  CHECK(parse({"--nproc_per_node=2", "prog"}).options.nproc == 2);
  CHECK(parse({"--help"}).help.find("--nproc") != std::string::npos);
}

TEST_CASE("parse and validate refuse bad values, naming flag and value") {
  CHECK(parse_error({"--nproc", "0", "p"}) == "fsdp: launch: --nproc must be in [1, 4096], got 0");
  CHECK(parse_error({"--nproc", "5000", "p"}) == "fsdp: launch: --nproc must be in [1, 4096], got 5000");
  CHECK(parse_error({"--nnodes", "2", "--node-rank", "2", "--master-port", "1", "p"}) ==
        "fsdp: launch: --node-rank 2 is out of range [0, 1] for --nnodes 2");
  CHECK(parse_error({"--master-port", "-1", "p"}) ==
        "fsdp: launch: --master-port must be in [1, 65535] (or 0: pick a free one), got -1");
  CHECK(parse_error({"--master-addr", "", "p"}) == "fsdp: launch: --master-addr is empty");
  CHECK(parse_error({"--grace-ms", "90000000", "p"}) == "fsdp: launch: --grace-ms must be in (0 ms, 24 h], got 90000000 ms");
  CHECK(parse({"--max-restarts", "3", "p"}).options.max_restarts == 3);
  CHECK(parse_error({"--max-restarts", "-1", "p"}) == "fsdp: launch: --max-restarts must be in [0, 1000], got -1");
  CHECK(parse_error({"--max-restarts", "1", "--nnodes", "2", "--master-port", "9", "p"}) ==
        "fsdp: launch: --max-restarts 1 with --nnodes 2: a restart starts this node's ranks only, and the other "
        "nodes' would not follow (restarts are for one node)");
  CHECK(parse({"p"}).options.restart_scope == launch::RestartScope::job);
  CHECK(parse({"--restart-scope", "job", "p"}).options.restart_scope == launch::RestartScope::job);
  CHECK(parse({"--restart-scope", "rank", "--max-restarts", "2", "p"}).options.restart_scope ==
        launch::RestartScope::rank);
  CHECK(parse_error({"--restart-scope", "ranks", "--max-restarts", "2", "p"}) ==
        "fsdp: launch: --restart-scope: ranks not in {job,rank}");
  CHECK(parse_error({"--restart-scope", "rank", "p"}) ==
        "fsdp: launch: --restart-scope rank needs --max-restarts 1 or more (how many failed ranks to replace in all)");
  CHECK(parse_error({"--restart-scope", "rank", "--max-restarts", "1", "--nnodes", "2", "--master-port", "9", "p"}) ==
        "fsdp: launch: --restart-scope rank with --nnodes 2: a replacement is started on this node only, announced "
        "in fsdp_run's own store (one node only)");
  for (const char* store : {"rank0", "external"})
    CHECK(parse_error({"--restart-scope", "rank", "--max-restarts", "1", "--store", store, "--master-port", "9", "p"}) ==
          "fsdp: launch: --restart-scope rank with --store " + std::string(store) +
              ": it needs the store fsdp_run hosts (--store launcher, the default), which outlives every rank and "
              "which fsdp_run edits to announce each replacement");
  CHECK(parse_error({"--env", "FSDP_COMM_EPOCH=1", "p"}) ==
        "fsdp: launch: --env FSDP_COMM_EPOCH: fsdp_run sets FSDP_COMM_EPOCH itself, on a replacement rank "
        "(--restart-scope rank)");
  CHECK(parse_error({"--env", "TORCHELASTIC_RESTART_COUNT=2", "p"}) ==
        "fsdp: launch: --env TORCHELASTIC_RESTART_COUNT: fsdp_run sets TORCHELASTIC_RESTART_COUNT itself (see "
        "--max-restarts; a TORCHELASTIC_RUN_ID in fsdp_run's own environment is passed on)");
  CHECK(parse_error({"--echo-wait-ms", "-1", "p"}) ==
        "fsdp: launch: --echo-wait-ms must be in (0 ms, 24 h] or 0 (none), got -1 ms");
  CHECK(parse_error({"--env", "=v", "p"}) == "fsdp: launch: --env '=v' is not KEY=VALUE");
  CHECK(parse_error({"--env", "WORLD_SIZE=9", "p"}) ==
        "fsdp: launch: --env WORLD_SIZE: fsdp_run sets WORLD_SIZE itself, for each rank");
  CHECK(parse_error({"--nproc", "2"}) ==
        "fsdp: launch: missing the program to run (usage: fsdp_run [options] PROGRAM [ARGS...])");
  CHECK(parse_error({"--"}) == "fsdp: launch: missing the program to run (usage: fsdp_run [options] PROGRAM [ARGS...])");
  CHECK(parse_error({"-x", "p"}).find("unknown option '-x'") != std::string::npos);
  CHECK(parse_error({"--nnodes", "x", "p"}).find("--nnodes") != std::string::npos);

  launch::Options o;
  o.nnodes = 3;
  o.master_port = 0;
  CHECK_THROWS_WITH_AS(launch::validate(o),
                       "fsdp: launch: --master-port is required with --nnodes 3 (every node must name the same port; 0 "
                       "picks a free one on a single node only)",
                       fsdp::Error);
}

TEST_CASE("find_free_port gives a loopback port that can be bound") {
  const int port = launch::find_free_port();
  REQUIRE(port > 0);
  REQUIRE(port < 65536);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  ::close(fd);
}

TEST_CASE("run() in this process: the failing rank's status, and signal handling restored after") {
  struct sigaction before_int {}, before_pipe {}, before_chld {}, after {};
  ::sigaction(SIGINT, nullptr, &before_int);
  ::sigaction(SIGPIPE, nullptr, &before_pipe);
  ::sigaction(SIGCHLD, nullptr, &before_chld);

  launch::Options o;
  o.nproc = 3;
  o.prefix_output = false;
  CHECK(launch::run(o, {"sh", "-c", "[ $RANK = 2 ] && exit 5; exit 0"}) == 5);
  CHECK(launch::run(o, {"sh", "-c", "exit 0"}) == 0);
  {  // the launcher's own failures carry their fsdp::ErrorKind: a job past its timeout, a program it cannot start
    launch::Options timed = o;
    timed.timeout = std::chrono::milliseconds(200);
    try {
      launch::run(timed, {"sh", "-c", "exec sleep 30"});
      FAIL("expected fsdp::Error");
    } catch (const fsdp::Error& e) {
      CHECK(std::string(e.what()).find("were still running after the 200 ms timeout") != std::string::npos);
      CHECK(e.kind() == fsdp::ErrorKind::timeout);
    }
    try {
      launch::run(o, {"no-such-program-fsdp"});
      FAIL("expected fsdp::Error");
    } catch (const fsdp::Error& e) {
      CHECK(std::string(e.what()).find("cannot start 'no-such-program-fsdp'") != std::string::npos);
      CHECK(e.kind() == fsdp::ErrorKind::io);
    }
  }
  CHECK_THROWS_WITH_AS(launch::run(o, {}), "fsdp: launch: missing the program to run", fsdp::Error);
  o.nproc = 0;
  CHECK_THROWS_AS(launch::run(o, {"true"}), fsdp::Error);

  ::sigaction(SIGINT, nullptr, &after);
  CHECK((after.sa_handler == before_int.sa_handler));
  ::sigaction(SIGPIPE, nullptr, &after);
  CHECK((after.sa_handler == before_pipe.sa_handler));
  ::sigaction(SIGCHLD, nullptr, &after);
  CHECK((after.sa_handler == before_chld.sa_handler));
}

// The child side of the next case: when relaunched, this binary is a rank and exits before
// doctest runs. Rank 0 exits 40 + WORLD_SIZE if its arguments arrived unchanged (3 if not),
// the others 0, so the status the parent sees covers arguments and environment.
const bool relaunched_rank_exits = [] {
  if (!std::getenv("FSDP_LAUNCHER_TEST_CHILD") || !fsdp::DistEnv::launched()) return false;
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const auto env = fsdp::DistEnv::from_env();
  if (env.rank != 0) std::_Exit(0);
  std::_Exit(cmdline == std::string("launcher_test\0child\0two words\0", 30) ? 40 + env.world_size : 3);
}();

TEST_CASE("relaunch_self runs this program as the ranks, and refuses inside a launched process") {
  launch::Options o;
  o.nproc = 2;
  o.prefix_output = false;
  o.env = {{"FSDP_LAUNCHER_TEST_CHILD", "1"}};
  const char* argv[] = {"launcher_test", "child", "two words"};
  CHECK(launch::relaunch_self(o, 3, argv) == 42);

  test_support::ScopedEnv launched("RANK", "1");
  launched.set("WORLD_SIZE", "2");
  CHECK_THROWS_WITH_AS(launch::relaunch_self(o, 3, argv),
                       "fsdp: launch: relaunch_self: this process already is rank 1 of a launched job (RANK and "
                       "WORLD_SIZE are set); run as that rank instead",
                       fsdp::Error);
}

// The children of the store cases below: ranks that talk to the job's store, each exiting
// with a status that says what it found (0: as the case expects).
//  outlive: rank 0 holds a lock on $DIR/rank0 (flock) and exits once rank 1 has seen it
//    held; rank 1 waits until it can take the lock (rank 0's process has exited: its files
//    and sockets are closed), then uses the store. 7: the store went with rank 0; 8: rank 0
//    never let go (within 10 s).
//  restart: start 0: rank 0 writes its MASTER_PORT to $DIR/port0, sets a key and exits 0;
//    rank 1 waits for the key and exits 9, a failure that restarts the job. Start 1: rank 0
//    finds no key of start 0 (5 if it does) and writes $DIR/port1; rank 1 tries clients of
//    generations 0 and 2, which must be refused naming the generations (6 if not): only
//    fsdp_run begins one, before the ranks of a start (a client of generation 1 could
//    not have begun it).
const bool store_rank_exits = [] {
  const char* mode = std::getenv("FSDP_LAUNCHER_TEST_STORE");
  if (!mode || !fsdp::DistEnv::launched()) return false;
  using namespace std::chrono_literals;
  const auto env = fsdp::DistEnv::from_env();
  const std::string dir = std::getenv("FSDP_LAUNCHER_TEST_DIR");
  fsdp::TcpStoreOptions quick;
  quick.timeout = 10000ms;
  quick.connect_timeout = 10000ms;
  try {
    auto c = fsdp::connect_store(env, quick);
    auto& store = *c.store;
    if (std::string(mode) == "outlive") {
      const int lock = ::open((dir + "/rank0").c_str(), O_RDWR | O_CREAT, 0600);
      if (lock < 0) std::_Exit(3);
      if (env.rank == 0) {
        if (::flock(lock, LOCK_EX) != 0) std::_Exit(3);
        store.set("rank0/locked", "1");
        store.wait({"rank1/saw_lock"}, 10000ms);
        std::_Exit(0);
      }
      store.get("rank0/locked", 10000ms);
      if (::flock(lock, LOCK_EX | LOCK_NB) == 0) std::_Exit(3);  // rank 0 holds it
      store.set("rank1/saw_lock", "1");
      bool gone = false;
      for (int i = 0; i < 1000 && !gone; ++i) {
        gone = ::flock(lock, LOCK_EX | LOCK_NB) == 0;
        if (!gone) std::this_thread::sleep_for(10ms);
      }
      if (!gone) std::_Exit(8);
      try {
        store.set("after", "rank 0 exited");
        std::_Exit(store.get("after", 1000ms) == "rank 0 exited" ? 0 : 7);
      } catch (const fsdp::Error&) {
        std::_Exit(7);
      }
    }
    if (env.restart_count == 0) {
      if (env.rank == 0) {
        std::ofstream(dir + "/port0") << env.master_port;  // first: rank 1 fails, and this rank is stopped, once the key is set
        store.set("start0", "x");
        std::_Exit(0);
      }
      store.get("start0", 10000ms);
      std::_Exit(9);
    }
    if (env.rank == 0) {
      std::ofstream(dir + "/port1") << env.master_port;
      std::_Exit(store.try_get("start0") ? 5 : 0);
    }
    auto refused = [&](std::uint64_t generation, const std::string& why) {
      fsdp::TcpStoreOptions other = quick;
      other.token = env.token;
      other.generation = generation;
      try {
        fsdp::TcpStore client(env.master_addr, env.master_port, other);
      } catch (const fsdp::Error& e) {
        return std::string(e.what()).find(why) != std::string::npos;
      }
      return false;
    };
    std::_Exit(refused(0, "belongs to generation 0 of the job, and the store at 127.0.0.1:" +
                              std::to_string(env.master_port) + " serves generation 1: it is left from an earlier start") &&
                       refused(2, "serves generation 1, which only its host (fsdp_run, or rank 0) moves on")
                   ? 0
                   : 6);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store child, rank %d: %s\n", env.rank, e.what());
    std::_Exit(3);
  }
}();

// The children of the rank-scope case below (FSDP_LAUNCHER_TEST_REPLACE names a directory):
// three ranks of one store generation, each start appending "RANK COUNT" to $DIR/starts.
// Rank 1 claims its place and exits 1 on its first start. Its replacement, before it claims
// the place again, must find the claim gone and the store's fsdp/job/epoch at 1, as its
// FSDP_COMM_EPOCH says; it then claims the place and sets "replaced". Ranks 0 and 2 wait
// for that key and read the epoch. Exit status: 0 as expected; 3 an exception; 10 the
// failed rank's claim was still there; 11 the epoch key was not 1; 12 the replacement's
// FSDP_COMM_EPOCH or TORCHELASTIC_RESTART_COUNT was not 1; 13 a survivor saw another epoch.
const bool replace_rank_exits = [] {
  const char* dir = std::getenv("FSDP_LAUNCHER_TEST_REPLACE");
  if (!dir || !fsdp::DistEnv::launched()) return false;
  using namespace std::chrono_literals;
  const auto env = fsdp::DistEnv::from_env();
  std::ofstream(std::string(dir) + "/starts", std::ios::app) << env.rank << " " << env.restart_count << "\n";
  fsdp::TcpStoreOptions quick;
  quick.timeout = 10000ms;
  quick.connect_timeout = 10000ms;
  // The store keeps one generation for the whole job in rank scope, while a replacement's
  // TORCHELASTIC_RESTART_COUNT counts the replacements: its client must say generation 0.
  quick.generation = 0;
  try {
    if (env.restart_count > 0) {
      const char* epoch = std::getenv("FSDP_COMM_EPOCH");
      if (env.rank != 1 || env.restart_count != 1 || !epoch || std::string(epoch) != "1") std::_Exit(12);
      fsdp::TcpStoreOptions plain = quick;
      plain.token = env.token;
      fsdp::TcpStore probe(env.master_addr, env.master_port, plain);
      if (probe.try_get(fsdp::claim_key(1))) std::_Exit(10);
      if (probe.try_get(fsdp::kEpochKey) != std::optional<std::string>("1")) std::_Exit(11);
    }
    auto c = fsdp::connect_store(env, quick);
    if (env.rank == 1 && env.restart_count == 0) std::_Exit(1);
    if (env.rank == 1) {
      c.store->set("replaced", "1");
      std::_Exit(0);
    }
    c.store->get("replaced", 10000ms);
    std::_Exit(c.store->add(fsdp::kEpochKey, 0) == 1 ? 0 : 13);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replace child, rank %d: %s\n", env.rank, e.what());
    std::_Exit(3);
  }
}();

namespace {
// A directory of its own for one case's children, removed with what they wrote.
struct ChildDir {
  ChildDir() {
    char name[] = "/tmp/launcher_test.XXXXXX";
    REQUIRE(::mkdtemp(name));
    path = name;
  }
  ~ChildDir() {
    for (const char* f : {"rank0", "port0", "port1", "starts"}) ::unlink((path + "/" + f).c_str());
    ::rmdir(path.c_str());
  }
  std::vector<std::string> lines(const std::string& name) const {
    std::ifstream in(path + "/" + name);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }
  std::string read(const std::string& name) const {
    std::ifstream in(path + "/" + name);
    std::string text;
    std::getline(in, text);
    return text;
  }
  std::string path;
};

// A job of two relaunched store children (store_rank_exits above) in `mode`, writing to `dir`.
launch::Options store_children(const ChildDir& dir, const char* mode) {
  launch::Options o;
  o.nproc = 2;
  o.prefix_output = false;
  o.grace = std::chrono::milliseconds(200);
  o.env = {{"FSDP_LAUNCHER_TEST_STORE", mode}, {"FSDP_LAUNCHER_TEST_DIR", dir.path}};
  return o;
}
}  // namespace

TEST_CASE("the store fsdp_run hosts outlives rank 0; the one rank 0 hosts goes with it") {
  const ChildDir dir;
  launch::Options o = store_children(dir, "outlive");
  const char* argv[] = {"launcher_test"};
  CHECK(o.store == launch::StoreHost::launcher);  // the default
  CHECK(launch::relaunch_self(o, 1, argv) == 0);
  o.store = launch::StoreHost::rank0;
  CHECK(launch::relaunch_self(o, 1, argv) == 7);
}

TEST_CASE("a restart under fsdp_run's store: the same port, a new generation without the failed start's keys") {
  const ChildDir dir;
  launch::Options o = store_children(dir, "restart");
  o.max_restarts = 1;
  const char* argv[] = {"launcher_test"};
  CHECK(launch::relaunch_self(o, 1, argv) == 0);
  CHECK_FALSE(dir.read("port0").empty());
  CHECK(dir.read("port0") == dir.read("port1"));
}

TEST_CASE("--restart-scope rank: the store gives the failed rank's claim back and counts the epoch before its "
          "replacement starts") {
  const ChildDir dir;
  launch::Options o;
  o.nproc = 3;
  o.prefix_output = false;
  o.grace = std::chrono::milliseconds(200);
  o.max_restarts = 1;
  o.restart_scope = launch::RestartScope::rank;
  o.env = {{"FSDP_LAUNCHER_TEST_REPLACE", dir.path}};
  const char* argv[] = {"launcher_test"};
  CHECK(launch::relaunch_self(o, 1, argv) == 0);
  std::vector<std::string> starts = dir.lines("starts");
  std::sort(starts.begin(), starts.end());
  CHECK(starts == Strings{"0 0", "1 0", "1 1", "2 0"});  // ranks 0 and 2 started once
}
