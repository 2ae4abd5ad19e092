#pragma once
// POSIX file plumbing for checkpoints: an owned descriptor, writes and positioned reads
// that finish or fail (never loop without progress), fsync of files and directories, and
// the whole-file XXH64. Every failure names the path and the system's reason.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/save_id.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint::detail {

using fsdp::detail::fail;
using fsdp::detail::fail_as;

inline std::string errno_text(int err) { return std::generic_category().message(err); }

// Closes on destruction; close_checked() reports a failed close (NFS reports write errors there).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }
  // Closes; a failed close is an error naming `path`.
  void close_checked(const std::filesystem::path& path) {
    if (fd_ < 0) return;
    if (::close(std::exchange(fd_, -1)) != 0)
      fail_as(ErrorKind::io, "closing '", path.string(), "' failed: ", errno_text(errno));
  }

 private:
  int fd_ = -1;
};

// `flags` without O_CLOEXEC (added here); mode is used with O_CREAT.
inline UniqueFd open_fd(const std::filesystem::path& path, int flags, const char* why, mode_t mode = 0666) {
  int fd;
  do fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_as(ErrorKind::io, "cannot open '", path.string(), "' ", why, ": ", errno_text(errno));
  return UniqueFd(fd);
}

inline std::uint64_t file_size_of(int fd, const std::filesystem::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_as(ErrorKind::io, "cannot stat '", path.string(), "': ", errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail_as(ErrorKind::io, "'", path.string(), "' is not a regular file");
  return static_cast<std::uint64_t>(st.st_size);
}

// Writes all n bytes; a write that makes no progress is an error, not a retry loop.
inline void write_all(int fd, const void* data, std::size_t n, const std::filesystem::path& path) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail_as(ErrorKind::io, "cannot write '", path.string(), "': ", errno_text(errno));
    if (w == 0) fail_as(ErrorKind::io, "cannot write '", path.string(), "': the write made no progress (disk full?)");
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Writes all n bytes at `offset` (the file position is not used).
inline void pwrite_all(int fd, const void* data, std::size_t n, std::uint64_t offset, const std::filesystem::path& path) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail_as(ErrorKind::io, "cannot write '", path.string(), "' at byte ", offset, ": ", errno_text(errno));
    if (w == 0)
      fail_as(ErrorKind::io, "cannot write '", path.string(), "' at byte ", offset,
              ": the write made no progress (disk full?)");
    p += w, offset += static_cast<std::uint64_t>(w);
    n -= static_cast<std::size_t>(w);
  }
}

// Reads up to n bytes at `offset`; returns fewer only at end of file.
inline std::uint64_t pread_up_to(int fd, void* dst, std::uint64_t n, std::uint64_t offset,
                                 const std::filesystem::path& path) {
  auto* p = static_cast<char*>(dst);
  std::uint64_t done = 0;
  while (done < n) {
    const std::uint64_t chunk = std::min<std::uint64_t>(n - done, std::uint64_t{1} << 30);
    const ssize_t r = ::pread(fd, p + done, chunk, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      fail_as(ErrorKind::io, "cannot read '", path.string(), "' at byte ", offset + done, ": ", errno_text(errno));
    if (r == 0) break;
    done += static_cast<std::uint64_t>(r);
  }
  return done;
}

inline void fsync_fd(int fd, const std::filesystem::path& path) {
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) fail_as(ErrorKind::io, "cannot fsync '", path.string(), "': ", errno_text(errno));
}

// Makes renames and creations inside `dir` durable.
inline void fsync_directory(const std::filesystem::path& dir) {
  UniqueFd fd = open_fd(dir, O_RDONLY | O_DIRECTORY, "to fsync the directory");
  fsync_fd(fd.get(), dir);
}

// XXH64 of the first `size` bytes, read and hashed piece by piece (the kernel's readahead
// keeps the disk reading while a piece is hashed); a file shorter than that is an error.
inline std::uint64_t xxh64_of_fd(int fd, std::uint64_t size, const std::filesystem::path& path) {
  std::vector<std::byte> scratch(std::min<std::uint64_t>(size, checkpoint::hash_piece_bytes));
  const auto read = [&](std::byte* dst, std::uint64_t n, std::uint64_t at) {
    if (pread_up_to(fd, dst, n, at, path) != n)
      fail_as(ErrorKind::io, "'", path.string(), "' ended before byte ", size,
              " while computing its checksum (it shrank)");
  };
  return xxh64_of_range(read, 0, size, scratch);
}

inline std::uint64_t file_xxh64(const std::filesystem::path& path) {
  UniqueFd fd = open_fd(path, O_RDONLY, "to compute its checksum");
  return xxh64_of_fd(fd.get(), file_size_of(fd.get(), path), path);
}

// 16 hex digits that make temporary names unique among processes and threads: a fresh save
// id (new_save_id: the random source mixed with the clock and the process id), so that the
// library draws its names and its ids from one source.
inline std::string random_token() { return format_save_id(new_save_id()); }

// A path's parent for creating siblings: "." when it has none.
inline std::filesystem::path parent_or_dot(const std::filesystem::path& p) {
  return p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
}

// Where `target` is written before it is renamed into place: ".<name>.tmp-<tag>" next to it
// (the same file system, hidden from globs).
inline std::filesystem::path temp_path_for(const std::filesystem::path& target, const std::string& tag) {
  return parent_or_dot(target) / ("." + target.filename().string() + ".tmp-" + tag);
}

// One plain path component: no separators, not empty, '.' or '..'.
inline void check_file_name(std::string_view name, std::string_view where) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos)
    fail("checkpoint '", where, "': file name '", name, "' must be one plain path component");
}

}  // namespace fsdp::checkpoint::detail
