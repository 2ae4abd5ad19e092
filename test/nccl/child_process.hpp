#pragma once
// Runs this test binary again as a child process, limited to one test case, with extra
// environment variables, and waits for it within a deadline (killing it past that). CUDA
// cannot be used in a child forked after the parent initialized it, so the child is a
// fresh exec (posix_spawn); its stdout and stderr go to a file the parent reads back.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/error.hpp"

extern char** environ;

namespace test_support {

struct Child {
  pid_t pid = -1;
  std::string output_path;
};

inline Child spawn_self(const std::string& test_case, const std::vector<std::string>& extra_env,
                        const std::string& output_path) {
  std::vector<std::string> args{"/proc/self/exe", "--test-case=" + test_case, "--no-version"};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  Child child{-1, output_path};
  const int rc = posix_spawn(&child.pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) fsdp::detail::fail("posix_spawn(", argv[0], ") failed with error ", rc);
  return child;
}

struct ChildResult {
  int exit_code = -1;  // 128 + signal when killed by one
  bool timed_out = false;
  std::string output;
};

inline ChildResult wait_child(const Child& child, std::chrono::steady_clock::time_point deadline) {
  ChildResult result;
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(child.pid, &status, WNOHANG);
    if (r == child.pid) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      result.timed_out = true;
      kill(child.pid, SIGKILL);
      waitpid(child.pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(child.output_path);
  std::stringstream ss;
  ss << in.rdbuf();
  result.output = ss.str();
  return result;
}

}  // namespace test_support
