#pragma once
// Runs a program (fsdp_run, in these tests) as a child with its stdout and stderr captured
// in files, and waits a bounded time for it: one that outlives the limit is killed and
// fails the test, so no test can hang on a launcher that does not return.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace test_tools {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A scratch directory of its own, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/fsdp_run_test.XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Splits at '\n', dropping the empty piece after a final newline.
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

struct Finished {
  int status = -1;  // exit code, or 128 + signal
  std::string out, err;
  double seconds = 0;  // from start to exit
};

class ChildProcess {
 public:
  // `env_changes`: "KEY=VALUE" sets a variable for the child; "KEY" removes it.
  ChildProcess(std::vector<std::string> argv, const std::vector<std::string>& env_changes = {})
      : out_path_(dir_.file("stdout")), err_path_(dir_.file("stderr")) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    for (const auto& change : env_changes) {
      const std::string key = change.substr(0, change.find('='));
      std::erase_if(env, [&](const std::string& e) { return e.substr(0, e.find('=')) == key; });
      if (change.find('=') != std::string::npos) env.push_back(change);
    }
    std::vector<char*> args, envp;
    for (auto& a : argv) args.push_back(a.data());
    for (auto& e : env) envp.push_back(e.data());
    args.push_back(nullptr);
    envp.push_back(nullptr);
    const int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(out >= 0);
    REQUIRE(err >= 0);
    started_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out, 1);
      ::dup2(err, 2);
      ::execve(args[0], args.data(), envp.data());
      ::_exit(126);
    }
    ::close(out);
    ::close(err);
    REQUIRE(pid_ > 0);
  }

  ~ChildProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }

  // Waits at most `limit`; a child still running then is killed and fails the test.
  Finished wait(std::chrono::milliseconds limit = 20s) {
    Finished f;
    int status = 0;
    const auto deadline = started_ + limit;
    pid_t r = 0;
    while ((r = ::waitpid(pid_, &status, WNOHANG)) == 0 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    f.seconds = std::chrono::duration<double>(Clock::now() - started_).count();
    if (r == 0) {
      FAIL_CHECK("the child did not exit within ", limit.count(), " ms; killing it");
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
    pid_ = -1;
    f.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    f.out = read_file(out_path_);
    f.err = read_file(err_path_);
    return f;
  }

 private:
  TempDir dir_;
  std::string out_path_, err_path_;
  pid_t pid_ = -1;
  Clock::time_point started_;
};

// Waits (bounded) until every path exists.
inline bool wait_for_files(const std::vector<std::string>& paths, std::chrono::milliseconds limit = 10s) {
  const auto deadline = Clock::now() + limit;
  auto all = [&] {
    for (const auto& p : paths)
      if (::access(p.c_str(), F_OK) != 0) return false;
    return true;
  };
  while (!all() && Clock::now() < deadline) std::this_thread::sleep_for(2ms);
  return all();
}

// A process that is gone or a zombie (dead, not yet reaped by its new parent), waiting up
// to `limit` for it: a SIGKILL sent to it takes effect soon after kill() returns, not in it.
inline bool process_gone(pid_t pid, std::chrono::milliseconds limit = 2s) {
  auto gone = [pid] {
    if (::kill(pid, 0) != 0) return true;
    const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
    const auto paren = stat.rfind(')');
    return paren == std::string::npos || (paren + 2 < stat.size() && stat[paren + 2] == 'Z');
  };
  const auto deadline = Clock::now() + limit;
  while (!gone() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  return gone();
}

}  // namespace test_tools
