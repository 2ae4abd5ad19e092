#pragma once
// LinePrefixer: turns one rank's stdout (or stderr) byte stream into whole lines, each
// written as "[rank R] line\n" to the launcher's own stream. The launcher is the only
// writer and writes every line completely before the next, so lines of different ranks
// never mix inside a line. Bytes are copied as they are (NULs, invalid UTF-8 and all).
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>
#include <string_view>

namespace fsdp::launch::detail {

// Writes all of `bytes` to `fd`. Returns false once the reader is gone (EPIPE), so a
// closed stdout costs the job its output, not its ranks.
inline bool write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n > 0) {
      bytes.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EAGAIN) {  // a non-blocking stdout: wait until it drains
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else if (!(n < 0 && errno == EINTR)) {
      return false;
    }
  }
  return true;
}

class LinePrefixer {
 public:
  // A line longer than this is written in pieces of this size (each ending in a newline),
  // so a rank writing binary data without newlines cannot grow the launcher without bound.
  static constexpr std::size_t kMaxLine = std::size_t{1} << 20;

  LinePrefixer(std::string prefix, int fd) : prefix_(std::move(prefix)), fd_(fd) {}

  // Writes every line that `bytes` completes, all of them in one write_all.
  void feed(std::string_view bytes) {
    std::string out;
    for (std::size_t newline; (newline = bytes.find('\n')) != std::string_view::npos;) {
      out += prefix_;
      out += pending_;
      out.append(bytes.substr(0, newline + 1));
      pending_.clear();
      bytes.remove_prefix(newline + 1);
    }
    pending_.append(bytes);
    while (pending_.size() >= kMaxLine) {
      out += prefix_;
      out.append(pending_, 0, kMaxLine);
      out += '\n';
      pending_.erase(0, kMaxLine);
    }
    emit(out);
  }

  // The stream ended: a last line without its newline is written with one, so the next
  // line (of any rank) starts on a line of its own.
  void finish() {
    if (pending_.empty()) return;
    emit(prefix_ + pending_ + '\n');
    pending_.clear();
  }

 private:
  void emit(std::string_view out) {
    if (!out.empty() && !reader_gone_) reader_gone_ = !write_all(fd_, out);
  }

  std::string prefix_;
  int fd_;
  std::string pending_;  // the current line's bytes so far
  bool reader_gone_ = false;
};

}  // namespace fsdp::launch::detail
