#pragma once
// Runs one child process (mpirun) with extra environment variables and a deadline: past
// it the child's process group is terminated, so a stuck run fails instead of hanging.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"

namespace bench {

using EnvVars = std::vector<std::pair<std::string, std::string>>;

inline std::string join(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

// Returns the child's exit status (128 + signal if a signal ended it).
inline int run_child(const std::vector<std::string>& argv, const EnvVars& env, std::chrono::milliseconds timeout) {
  if (argv.empty()) fsdp::detail::fail("run_child: empty command line");
  if (timeout.count() <= 0 || timeout > std::chrono::hours(24))
    fsdp::detail::fail("run_child: timeout must be in (0 ms, 24 h], got ", timeout.count(), " ms");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  const pid_t pid = fork();
  if (pid < 0) fsdp::detail::fail("run_child: fork for '", join(argv), "' failed: ", std::strerror(errno));
  if (pid == 0) {  // the child: its own process group, so the whole tree can be stopped
    setpgid(0, 0);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    execvp(args[0], args.data());
    _exit(127);
  }
  setpgid(pid, pid);  // also here: no race with the child's own call

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) fsdp::detail::fail("run_child: waitpid for '", join(argv), "': ", std::strerror(errno));
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGTERM);
      std::this_thread::sleep_for(std::chrono::seconds(2));
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      fsdp::detail::fail("'", join(argv), "' did not finish within ", timeout.count(), " ms; stopped it");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) {
    if (WEXITSTATUS(status) == 127) fsdp::detail::fail("could not run '", join(argv), "' (not found or exec failed)");
    return WEXITSTATUS(status);
  }
  return 128 + WTERMSIG(status);
}

}  // namespace bench
