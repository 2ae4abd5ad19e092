#pragma once
// A forked child that the test drives through two pipes: the child reports progress
// (one byte per step) and can block until the parent lets it go on, so the parent can
// SIGKILL it at an exact point of a save. Every wait is bounded.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

namespace test_support {

// The child's end.
class Parent {
 public:
  Parent(int to_parent, int from_parent) : out_(to_parent), in_(from_parent) {}
  void report(char c) const {
    if (::write(out_, &c, 1) != 1) std::_Exit(90);
  }
  void report(const std::string& s) const {
    if (!s.empty() && ::write(out_, s.data(), s.size()) != static_cast<ssize_t>(s.size())) std::_Exit(90);
  }
  // Blocks until the parent says go on (or 20 s pass: then the child gives up).
  void wait_for_go() const {
    pollfd p{in_, POLLIN, 0};
    char c;
    if (::poll(&p, 1, 20'000) != 1 || ::read(in_, &c, 1) != 1) std::_Exit(91);
  }

 private:
  int out_, in_;
};

class ChildProcess {
 public:
  // Runs body(parent) in a forked child, which exits 0 when it returns, 1 if it throws.
  explicit ChildProcess(const std::function<void(const Parent&)>& body) {
    int up[2], down[2];
    if (::pipe(up) != 0 || ::pipe(down) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::close(up[0]);
      ::close(down[1]);
      try {
        body(Parent(up[1], down[0]));
      } catch (const std::exception& e) {
        Parent(up[1], down[0]).report(std::string("child failed: ") + e.what());
        std::_Exit(1);
      }
      std::_Exit(0);
    }
    ::close(up[1]);
    ::close(down[0]);
    from_child_ = up[0];
    to_child_ = down[1];
  }
  ~ChildProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    ::close(from_child_);
    ::close(to_child_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The next progress byte, or '\0' if none comes within the timeout or the child is gone.
  char next(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    pollfd p{from_child_, POLLIN, 0};
    char c;
    if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1 || ::read(from_child_, &c, 1) != 1) return '\0';
    return c;
  }
  void go() {
    const char c = 'g';
    if (::write(to_child_, &c, 1) != 1) throw std::runtime_error("cannot reach the child");
  }
  void kill() { ::kill(pid_, SIGKILL); }

  // Waits (at most 20 s) for the child to end; its wait status, or -1 if it did not.
  int wait() {
    if (pid_ <= 0) return status_;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        status_ = status;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return -1;
  }
  // Everything the child reported until it closed its end (bounded by the timeout).
  std::string rest(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    std::string s;
    for (char c; (c = next(timeout)) != '\0';) s += c;
    return s;
  }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  int from_child_ = -1, to_child_ = -1;
};

}  // namespace test_support
