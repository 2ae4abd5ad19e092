#pragma once
// Signals while the launcher supervises its ranks. SIGCHLD (a rank exited) and SIGINT,
// SIGTERM, SIGHUP (to forward to the ranks) wake its poll loop through a self-pipe: the
// handler only writes the signal's number, which is async-signal-safe. SIGPIPE is ignored,
// so a closed stdout loses output instead of killing the launcher and orphaning the ranks.
// The previous dispositions come back when the guard goes away.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp::launch {

// "SIGKILL" for 9; "signal 42" for one without a well-known name.
inline std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return "signal " + std::to_string(sig);
  }
}

namespace detail {

inline volatile std::sig_atomic_t wake_fd = -1;

inline void on_signal(int sig) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(sig);
  if (wake_fd >= 0) {
    const ssize_t written = ::write(wake_fd, &byte, 1);  // a full pipe wakes the loop anyway
    (void)written;
  }
  errno = saved;
}

// At most one launch supervises ranks per process: signal dispositions are process-wide.
inline std::atomic<bool>& launch_active() {
  static std::atomic<bool> active{false};
  return active;
}

class SignalGuard {
 public:
  static constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};

  SignalGuard() {
    if (launch_active().exchange(true))
      fsdp::detail::fail("launch: another launch is already supervising ranks in this process (signal handling "
                         "is process-wide); run one at a time");
    if (::pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
      const int err = errno;
      launch_active() = false;
      fsdp::detail::fail_as(fsdp::ErrorKind::io, "launch: cannot create the signal pipe: ", std::strerror(err));
    }
    wake_fd = pipe_[1];
    struct sigaction wake {};
    wake.sa_handler = on_signal;
    sigemptyset(&wake.sa_mask);
    wake.sa_flags = SA_RESTART;
    for (int sig : kForwarded) install(sig, wake);
    wake.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    install(SIGCHLD, wake);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    install(SIGPIPE, ignore);
    sigpipe_was_ignored_ = saved_.back().second.sa_handler == SIG_IGN;
  }

  ~SignalGuard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) ::sigaction(it->first, &it->second, nullptr);
    wake_fd = -1;
    ::close(pipe_[0]);
    ::close(pipe_[1]);
    launch_active() = false;
  }

  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

  // Readable when a signal arrived.
  int fd() const { return pipe_[0]; }

  // The signals received since the last call, in order of arrival (SIGCHLD included).
  std::vector<int> take() {
    std::vector<int> signals;
    unsigned char buf[64];
    for (ssize_t n; (n = ::read(pipe_[0], buf, sizeof buf)) > 0;) signals.insert(signals.end(), buf, buf + n);
    return signals;
  }

  // The ranks get SIGPIPE's default back unless whoever started the launcher ignored it.
  bool sigpipe_was_ignored() const { return sigpipe_was_ignored_; }

 private:
  void install(int sig, const struct sigaction& action) {
    struct sigaction old {};
    ::sigaction(sig, &action, &old);
    saved_.emplace_back(sig, old);
  }

  int pipe_[2] = {-1, -1};
  std::vector<std::pair<int, struct sigaction>> saved_;
  bool sigpipe_was_ignored_ = false;
};

}  // namespace detail
}  // namespace fsdp::launch
