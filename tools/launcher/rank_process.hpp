#pragma once
// RankProcess: one rank of the job as a child process. It starts in a process group of its
// own, so signalling the group reaches whatever the rank started too (a shell's children,
// a data loader); stdin is /dev/null (several ranks cannot share a terminal's input, and a
// background group reading it would stop); stdout and stderr go into pipes the launcher
// reads and prefixes, or straight to the launcher's own when not prefixing.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/core/error.hpp"
#include "tools/launcher/line_prefixer.hpp"
#include "tools/launcher/options.hpp"
#include "tools/launcher/signals.hpp"

extern char** environ;

namespace fsdp::launch::detail {

// What every rank of this node shares, and what it needs to be started.
struct LaunchSpec {
  std::string program;  // a path, or (search_path) a name looked up in PATH
  bool search_path = true;
  std::vector<std::string> argv;
  int port = 0;
  std::string token;  // FSDP_STORE_TOKEN to add; empty when the environment has one (or --store external)
  StoreHost store = StoreHost::launcher;  // FSDP_STORE_HOST
  bool reset_sigpipe = true;
  // How many times the job was restarted before this start (--max-restarts); for a
  // replacement (RestartScope::rank), the replacements so far, this one included.
  int restart = 0;
  std::string run_id;  // the job's id, the same for every start
  // FSDP_COMM_EPOCH: set on a replacement for a failed rank only (RestartScope::rank).
  std::optional<long long> comm_epoch;
};

// Where the store must listen for the job's ranks to reach it, when that is not its
// default, loopback: with several nodes, or a master address that is not loopback,
// --master-addr.
inline std::optional<std::string> store_bind_address(const Options& o) {
  const bool loopback = o.master_addr == "localhost" || o.master_addr == "::1" || o.master_addr.rfind("127.", 0) == 0;
  if (o.nnodes > 1 || !loopback) return o.master_addr;
  return std::nullopt;
}

// This process's environment with the job's variables for local rank `local_rank` on top.
inline std::vector<std::string> rank_environment(const Options& o, const LaunchSpec& spec, int local_rank) {
  std::map<std::string, std::string> set(o.env.begin(), o.env.end());
  set["MASTER_ADDR"] = o.master_addr;
  set["MASTER_PORT"] = std::to_string(spec.port);
  set["RANK"] = std::to_string(o.node_rank * o.nproc + local_rank);
  set["WORLD_SIZE"] = std::to_string(o.nnodes * o.nproc);
  set["LOCAL_RANK"] = std::to_string(local_rank);
  set[kRestartCountVariable] = std::to_string(spec.restart);
  set[kMaxRestartsVariable] = std::to_string(o.max_restarts);
  if (!spec.run_id.empty()) set[kRunIdVariable] = spec.run_id;
  set["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc);
  set[kStoreHostVariable] = name_of(spec.store);
  // Where rank 0's store must listen, when rank 0 hosts it and that is not its default.
  if (spec.store == StoreHost::rank0 && !std::getenv(kBindVariable) && !set.count(kBindVariable))
    if (auto bind = store_bind_address(o)) set[kBindVariable] = *bind;
  if (!spec.token.empty()) set[kTokenVariable] = spec.token;
  if (spec.comm_epoch) set[kCommEpochVariable] = std::to_string(*spec.comm_epoch);
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry(*e), key = entry.substr(0, entry.find('='));
    // --store says who hosts the store; only a replacement gets an epoch, fsdp_run's own.
    if (!set.count(key) && key != kExternalStoreVariable && key != kCommEpochVariable) env.push_back(entry);
  }
  for (const auto& [key, value] : set) env.push_back(key + "=" + value);
  return env;
}

// The nul-terminated char* array that exec wants, pointing into `strings`.
inline std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

class RankProcess {
 public:
  struct Stream {
    int fd = -1;  // our read end; -1 once closed
    std::optional<LinePrefixer> prefixer;
  };

  RankProcess(int rank, int local_rank) : rank_(rank), local_rank_(local_rank) {}
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;

  // Reaps the rank. One still running (the launcher failed: an exception) is killed with
  // its group first, waiting a bounded time for it to go.
  ~RankProcess() {
    if (pid_ > 0) {
      if (!exited()) signal(SIGKILL);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (!reap() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    close_stream(out_);
    close_stream(err_);
  }

  void start(const Options& o, LaunchSpec spec) {
    int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
    if (o.prefix_output && !(make_pipe(out_pipe) && make_pipe(err_pipe))) {
      const int err = errno;
      for (int fd : out_pipe)
        if (fd >= 0) ::close(fd);
      fsdp::detail::fail_as(fsdp::ErrorKind::io, "launch: cannot create the output pipes of rank ", rank_, ": ",
                            std::strerror(err), " (each rank takes 4 descriptors; see ulimit -n)");
    }
    std::vector<std::string> env = rank_environment(o, spec, local_rank_);
    std::vector<char*> argv = c_strings(spec.argv), envp = c_strings(env);

    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
    if (o.prefix_output) {
      posix_spawn_file_actions_adddup2(&files, out_pipe[1], 1);
      posix_spawn_file_actions_adddup2(&files, err_pipe[1], 2);
    }
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    short flags = POSIX_SPAWN_SETPGROUP;
    posix_spawnattr_setpgroup(&attr, 0);  // a group of its own, named by its pid
    sigset_t defaults;
    sigemptyset(&defaults);
    // The ranks start with no signal blocked, whatever the calling thread blocks, so the
    // SIGTERM that stops a job reaches them.
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attr, &none);
    flags |= POSIX_SPAWN_SETSIGMASK;
    if (spec.reset_sigpipe) {
      sigaddset(&defaults, SIGPIPE);
      posix_spawnattr_setsigdefault(&attr, &defaults);
      flags |= POSIX_SPAWN_SETSIGDEF;
    }
    posix_spawnattr_setflags(&attr, flags);
    const int rc = spec.search_path ? ::posix_spawnp(&pid_, spec.program.c_str(), &files, &attr, argv.data(), envp.data())
                                    : ::posix_spawn(&pid_, spec.program.c_str(), &files, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&files);
    posix_spawnattr_destroy(&attr);
    if (o.prefix_output) {
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      out_ = {out_pipe[0], LinePrefixer(prefix(), 1)};
      err_ = {err_pipe[0], LinePrefixer(prefix(), 2)};
    }
    if (rc != 0) {
      pid_ = -1;
      const bool not_in_path = rc == ENOENT && spec.search_path && spec.program.find('/') == std::string::npos;
      fsdp::detail::fail_as(fsdp::ErrorKind::io, "launch: cannot start '", spec.program, "' for rank ", rank_, ": ",
                            std::strerror(rc), not_in_path ? " (looked in PATH)" : "");
    }
  }

  int rank() const { return rank_; }
  int local_rank() const { return local_rank_; }
  bool exited() const { return status_.has_value(); }
  // The exit status (exit code, or 128 + signal); valid once exited().
  int status() const { return status_.value_or(-1); }
  bool killed_by_signal() const { return signaled_; }
  Stream& out() { return out_; }
  Stream& err() { return err_; }

  // Sends `sig` to the rank's process group: the rank and what it started, which may
  // outlive it. Safe until the rank is reaped: its zombie keeps the pid, and so the group
  // id, from being reused.
  void signal(int sig) {
    if (pid_ <= 0 || reaped_) return;
    if (::kill(-pid_, sig) != 0 && !exited()) ::kill(pid_, sig);
  }

  // True once the rank has exited. The zombie stays (until reap()) so that signal() can
  // still reach processes the rank left behind in its group.
  bool try_reap() {
    if (status_ || pid_ <= 0) return exited();
    siginfo_t info{};
    const int rc = ::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT);
    if (rc == 0 && info.si_pid == pid_) {
      signaled_ = info.si_code == CLD_KILLED || info.si_code == CLD_DUMPED;
      status_ = signaled_ ? 128 + info.si_status : info.si_status;
    } else if (rc != 0 && errno == ECHILD) {  // reaped behind our back: the status is lost
      status_ = 128;
      reaped_ = true;
    }
    return exited();
  }

  // True once the exited rank's zombie is gone.
  bool reap() {
    if (!reaped_ && try_reap()) {
      const pid_t rc = ::waitpid(pid_, nullptr, WNOHANG);
      reaped_ = rc == pid_ || (rc < 0 && errno == ECHILD);
    }
    return reaped_;
  }

  static void close_stream(Stream& s) {
    if (s.fd >= 0) ::close(s.fd);
    s.fd = -1;
  }

 private:
  std::string prefix() const { return "[rank " + std::to_string(rank_) + "] "; }

  // Only our read end is non-blocking; the rank's write end stays as programs expect.
  static bool make_pipe(int (&fds)[2]) {
    if (::pipe2(fds, O_CLOEXEC) != 0) return false;
    ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    return true;
  }

  int rank_, local_rank_;
  pid_t pid_ = -1;
  std::optional<int> status_;
  bool signaled_ = false, reaped_ = false;
  Stream out_, err_;
};

}  // namespace fsdp::launch::detail
