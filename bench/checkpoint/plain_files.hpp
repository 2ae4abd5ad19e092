#pragma once
// bench/checkpoint's baseline: what this machine's file system gives a plain program that
// writes one file with large write() calls and fsyncs it, or reads it back with large
// read() calls. Also the page-cache eviction every read row (baseline and checkpoint
// alike) runs first, so that no side reads from memory while the other reads the disk;
// and the bench's self-removing work directory.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <span>
#include <system_error>

#include <fsdp/core/error.hpp>

namespace bench {

// The size of every write() and read() of the baseline: large enough that the system call
// count does not matter, small enough to stay in the caches.
inline constexpr std::size_t kPlainChunkBytes = std::size_t{16} << 20;

namespace detail {

inline std::string errno_text() { return std::generic_category().message(errno); }

class Fd {
 public:
  Fd(const std::filesystem::path& path, int flags, const char* why) : path_(path) {
    do fd_ = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) fsdp::detail::fail("cannot open '", path.string(), "' ", why, ": ", errno_text());
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { ::close(fd_); }
  int get() const { return fd_; }
  void fsync() const {
    if (::fsync(fd_) != 0) fsdp::detail::fail("cannot fsync '", path_.string(), "': ", errno_text());
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace detail

// Bytes that no file system or device could compress away (the checkpoints hold trained
// floats, not zeros).
inline void fill_incompressible(std::span<std::byte> out) {
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (std::size_t i = 0; i < out.size(); i += sizeof x) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    std::memcpy(out.data() + i, &x, std::min(sizeof x, out.size() - i));
  }
}

// Writes `bytes` bytes to a new file at `path`, `chunk` (repeated) per write(), then fsyncs it.
inline void write_plain_file(const std::filesystem::path& path, std::uint64_t bytes, std::span<const std::byte> chunk) {
  detail::Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC, "to write the baseline file");
  for (std::uint64_t done = 0; done < bytes;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), bytes - done));
    const ssize_t w = ::write(fd.get(), chunk.data(), n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fsdp::detail::fail("cannot write '", path.string(), "': ", w < 0 ? detail::errno_text() : "no progress");
    done += static_cast<std::uint64_t>(w);
  }
  fd.fsync();
}

// Reads the whole file into `chunk`, one read() of chunk.size() bytes at a time; returns
// the bytes read and folds them into `checksum` so the reads cannot be optimized away.
inline std::uint64_t read_plain_file(const std::filesystem::path& path, std::span<std::byte> chunk, std::uint64_t& checksum) {
  detail::Fd fd(path, O_RDONLY, "to read the baseline file");
  std::uint64_t done = 0;
  for (;;) {
    const ssize_t r = ::read(fd.get(), chunk.data(), chunk.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fsdp::detail::fail("cannot read '", path.string(), "': ", detail::errno_text());
    if (r == 0) return done;
    checksum += static_cast<std::uint64_t>(chunk[static_cast<std::size_t>(r) - 1]);
    done += static_cast<std::uint64_t>(r);
  }
}

// Drops the file (or every file under the directory) from the page cache: fsync first, as
// only clean pages can be dropped, then POSIX_FADV_DONTNEED on the whole file.
inline void evict_from_page_cache(const std::filesystem::path& path) {
  auto evict_file = [](const std::filesystem::path& file) {
    detail::Fd fd(file, O_RDONLY, "to evict it from the page cache");
    fd.fsync();
    if (const int err = ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED))
      fsdp::detail::fail("posix_fadvise(DONTNEED) on '", file.string(), "' failed: ", std::generic_category().message(err));
  };
  if (!std::filesystem::is_directory(path)) return evict_file(path);
  for (const auto& e : std::filesystem::recursive_directory_iterator(path))
    if (e.is_regular_file()) evict_file(e.path());
}

// The bytes of a file, or of every file under a directory.
inline std::uint64_t bytes_on_disk(const std::filesystem::path& path) {
  if (!std::filesystem::is_directory(path)) return std::filesystem::file_size(path);
  std::uint64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

// A fresh directory under `base`, removed (with everything in it) when this goes.
class WorkDir {
 public:
  explicit WorkDir(const std::filesystem::path& base) {
    std::string templ = (base / "fsdp-checkpoint-bench.XXXXXX").string();
    if (!::mkdtemp(templ.data())) fsdp::detail::fail("cannot create a directory under '", base.string(), "': ", detail::errno_text());
    path_ = templ;
  }
  WorkDir(const WorkDir&) = delete;
  WorkDir& operator=(const WorkDir&) = delete;
  ~WorkDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline std::string load_average() {  // for the output: how busy the machine was
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return in ? a + " " + b + " " + c : "unknown";
}

}  // namespace bench
