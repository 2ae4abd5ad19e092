// tools/fsdp_store as a process: it prints its port, serves TcpStore clients (including
// connect_store with FSDP_STORE_EXTERNAL=1), demands the token from the environment and
// stops cleanly on SIGTERM.
#include <doctest/doctest.h>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <fsdp/asio/tcp_store.hpp>

#include "store_test_support.hpp"
#include "test/support/scoped_env.hpp"

extern char** environ;

namespace asio_store_tool_test {

using namespace store_test;

namespace {

// Under Bazel the binary is a runfile (this test runs from the workspace root);
// FSDP_STORE_BIN points elsewhere for a hand-built one.
std::string tool_path() {
  const char* p = std::getenv("FSDP_STORE_BIN");
  return p ? p : "tools/fsdp_store";
}

// fsdp_store with `args`, its stdout and stderr on a pipe; killed when this goes away.
class StoreProcess {
 public:
  explicit StoreProcess(std::vector<std::string> args) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    args.insert(args.begin(), tool_path());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    out_ = fds[0];
    REQUIRE_MESSAGE(rc == 0, "cannot start ", tool_path());
  }
  ~StoreProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
  }

  // Output up to the end of the first line (or whatever came within `within`).
  std::string first_line(std::chrono::milliseconds within = 5000ms) { return read_until("\n", within); }

  // Sends `sig` and returns the exit status, waiting at most `within` (-1: still running).
  int stop(int sig, std::chrono::milliseconds within = 3000ms) {
    ::kill(pid_, sig);
    const auto deadline = Clock::now() + within;
    for (;;) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (Clock::now() > deadline) return -1;
      std::this_thread::sleep_for(10ms);
    }
  }
  // Waits for the process to exit by itself.
  int exit_code(std::chrono::milliseconds within = 3000ms) { return stop(0, within); }
  std::string rest(std::chrono::milliseconds within = 2000ms) { return read_until("", within); }

 private:
  // Reads until `stop` appears (or end of file, when `stop` is empty) or the time is up.
  std::string read_until(const std::string& stop, std::chrono::milliseconds within) {
    std::string got;
    const auto deadline = Clock::now() + within;
    while (stop.empty() || got.find(stop) == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd p{out_, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
      char buf[256];
      const ssize_t n = ::read(out_, buf, sizeof buf);
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
    }
    return got;
  }

  pid_t pid_ = -1;
  int out_ = -1;
};

std::uint16_t port_from(const std::string& line) {
  const auto colon = line.rfind(':');
  REQUIRE(colon != std::string::npos);
  return static_cast<std::uint16_t>(std::stoi(line.substr(colon + 1)));
}

}  // namespace

TEST_CASE("fsdp_store serves clients, demands its token and stops on SIGTERM") {
  test_support::ScopedEnv env_vars("TOOL_TEST_TOKEN", "tool-secret");
  StoreProcess store({"--port", "0", "--token-env", "TOOL_TEST_TOKEN"});
  const std::string line = store.first_line();
  REQUIRE(contains(line, "fsdp_store: listening on 127.0.0.1:"));
  CHECK(contains(line, "(token required)"));
  const std::uint16_t port = port_from(line);

  fsdp::TcpStoreOptions options;
  options.timeout = options.connect_timeout = 2000ms;
  options.token = "tool-secret";
  fsdp::TcpStore client("127.0.0.1", port, options);
  client.set("k", "v");

  // Rank 0 of a job whose store runs outside it: connect_store only connects.
  fsdp::DistEnv env;
  env.master_port = port;
  env.world_size = 2;
  env.token = "tool-secret";
  env_vars.set("FSDP_STORE_EXTERNAL", "1");
  auto rank0 = fsdp::connect_store(env, options);
  env_vars.set("FSDP_STORE_EXTERNAL", std::nullopt);
  CHECK_FALSE(rank0.server);
  CHECK(rank0.store->get("k", 500ms) == "v");

  options.token = "guess";
  CHECK(contains(error_of([&] { fsdp::TcpStore("127.0.0.1", port, options); }), "refused this client: wrong or missing FSDP_STORE_TOKEN"));

  CHECK(store.stop(SIGTERM) == 0);
  CHECK(contains(store.rest(), "fsdp_store: stopping on signal 15"));
}

TEST_CASE("fsdp_store refuses a missing token variable, a bad flag and a taken port") {
  test_support::ScopedEnv env_vars("TOOL_TEST_UNSET", std::nullopt);
  StoreProcess no_token({"--token-env", "TOOL_TEST_UNSET"});
  CHECK(no_token.exit_code() == 2);
  CHECK(contains(no_token.rest(), "--token-env TOOL_TEST_UNSET: that variable is not set"));
  env_vars.set("TOOL_TEST_EMPTY", "");
  StoreProcess empty_token({"--token-env", "TOOL_TEST_EMPTY"});
  CHECK(empty_token.exit_code() == 2);
  CHECK(contains(empty_token.rest(), "--token-env TOOL_TEST_EMPTY: that variable is not set or is empty"));

  StoreProcess bad_port({"--port", "70000"});
  CHECK(bad_port.exit_code() != 0);
  CHECK(contains(bad_port.rest(), "--port: Value 70000 not in range 0 to 65535"));

  fsdp::TcpStoreServer taken;
  StoreProcess second({"--port", std::to_string(taken.port())});
  CHECK(second.exit_code() == 1);
  CHECK(contains(second.rest(), "could not listen on 127.0.0.1:" + std::to_string(taken.port()) + ": Address already in use"));

  StoreProcess open({"--host", "0.0.0.0", "--port", "0"});
  CHECK(open.exit_code() == 1);
  CHECK(contains(open.rest(), "reaches beyond loopback, so it needs a token: set FSDP_STORE_TOKEN"));
}

}  // namespace asio_store_tool_test
