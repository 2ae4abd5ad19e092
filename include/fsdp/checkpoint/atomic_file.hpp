#pragma once
// write_file_atomically: a file is either its old content (or absent) or complete, even if
// the process dies mid-write. The caller's function writes into a temporary file next to
// the target (".<name>.tmp-<pid>-<random>", so it is on the same file system and hidden
// from globs); then the file is fsynced, renamed over the target and the directory is
// fsynced so that the rename itself survives a crash. On any failure the temporary file
// is removed and the target is untouched.
//
// write_file_staged stops before the rename: a commit that publishes several files together
// (a full checkpoint's model and optimizer files, checkpoint_directory.hpp) renames them.
// Every temporary file is flock()ed by its writer while it lives, so that a later save can
// tell a dead save's temporary file (remove it) from a live one's (leave it).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

// What a completed write produced: the file's size and the XXH64 of all its bytes (0 when
// written with Hashing::none).
struct WriteResult {
  std::uint64_t bytes = 0;
  std::uint64_t xxh64 = 0;
};

// Whether the sink hashes the whole file as it goes. A writer that overwrites bytes it
// already wrote (FileSink::overwrite) asks for none: the streamed hash would not be the
// file's.
enum class Hashing { whole_file, none };

// Where write_file_atomically's function writes: buffered, counts the bytes and hashes
// them as they go, so the checksum costs no second pass over the file.
class FileSink {
 public:
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  void write(const void* data, std::size_t n) {
    if (n == 0) return;
    if (hashing_ == Hashing::whole_file) hash_.update(data, n);
    if (n >= buffer_.capacity()) {  // large writes skip the copy
      flush();
      write_out(data, n);
      return;
    }
    if (buffer_.size() + n > buffer_.capacity()) flush();
    const auto* p = static_cast<const std::byte*>(data);
    buffer_.insert(buffer_.end(), p, p + n);
  }
  void write(std::span<const std::byte> bytes) { write(bytes.data(), bytes.size()); }
  void write(std::string_view text) { write(text.data(), text.size()); }

  // Replaces bytes [offset, offset + n) already written (a placeholder filled in at the end).
  void overwrite(std::uint64_t offset, const void* data, std::size_t n) {
    if (hashing_ != Hashing::none)
      fsdp::detail::fail("cannot write '", target_.string(), "': overwrite() needs a sink without hashing");
    if (offset > bytes_written() || n > bytes_written() - offset)
      fsdp::detail::fail("cannot write '", target_.string(), "': overwrite of bytes [", offset, ", +", n,
                         ") past the ", bytes_written(), " written");
    flush();
    detail::pwrite_all(fd_, data, n, offset, temp_);
  }

  std::uint64_t bytes_written() const { return written_ + buffer_.size(); }
  std::uint64_t xxh64() const { return hashing_ == Hashing::whole_file ? hash_.digest() : 0; }
  // The file being written (the target, not the temporary name), for messages.
  const std::filesystem::path& path() const { return target_; }

 private:
  friend class StagedFile;
  FileSink(int fd, std::filesystem::path temp, std::filesystem::path target, Hashing hashing)
      : fd_(fd), temp_(std::move(temp)), target_(std::move(target)), hashing_(hashing) {
    buffer_.reserve(std::size_t{1} << 20);
  }
  void flush() {
    if (buffer_.empty()) return;
    write_out(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  // Every 32 MiB written, the kernel is asked to start writing those pages to disk (not
  // waited for), so the disk works while the caller produces the next bytes and the final
  // fsync has little left to do.
  void write_out(const void* data, std::size_t n) {
    detail::write_all(fd_, data, n, temp_);
    written_ += n;
#ifdef SYNC_FILE_RANGE_WRITE
    constexpr std::uint64_t step = std::uint64_t{32} << 20;
    if (written_ - started_ >= step) {
      ::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(written_ - started_), SYNC_FILE_RANGE_WRITE);
      started_ = written_;
    }
#endif
  }

  int fd_;
  std::filesystem::path temp_;
  std::filesystem::path target_;
  std::vector<std::byte> buffer_;
  std::uint64_t written_ = 0, started_ = 0;  // bytes in the file; of those, whose writeback was started
  Hashing hashing_;
  Xxh64 hash_;
};

namespace detail {
using fsdp::detail::message_of;  // an exception's message without "fsdp: " (core/detail/root_cause.hpp)

// An exclusive flock on the open file `fd` (one just created), held by the returned
// descriptor (a dup: the lock lives while either is open). Empty where the file system has
// no flock: the file is then never taken for a dead save's.
inline UniqueFd hold_file_lock(int fd) {
  int rc;
  do rc = ::flock(fd, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) return UniqueFd();
  return UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
}

// Why: a temporary file is created (O_EXCL) and only then flock()ed; in between, another
// save's recovery sees it unlocked, takes it for a dead save's and unlinks it. Checked once
// the lock is held: a file with no name left fails now, naming it, not at the commit.
inline void check_still_linked(int fd, const std::filesystem::path& temp) {
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    fsdp::detail::fail_as(ErrorKind::io, "cannot stat the temporary file '", temp.string(), "': ", errno_text(errno));
  if (st.st_nlink == 0)
    fsdp::detail::fail_as(ErrorKind::io, "the temporary file '", temp.string(),
                          "' was removed (by another save's recovery?) before this save locked it; save again");
}
}  // namespace detail

// A file written under its temporary name and not yet renamed to its target: removed on
// destruction or discard() unless release()d (a commit renamed it, or a commit journal
// names it). Its flock is held until then.
class StagedFile {
 public:
  StagedFile() = default;
  StagedFile(std::filesystem::path temp, std::filesystem::path target, detail::UniqueFd lock, WriteResult result = {})
      : temp_(std::move(temp)), target_(std::move(target)), lock_(std::move(lock)), result_(result) {}
  StagedFile(StagedFile&& o) noexcept
      : temp_(std::exchange(o.temp_, {})), target_(std::move(o.target_)), lock_(std::move(o.lock_)), result_(o.result_) {}
  StagedFile& operator=(StagedFile&& o) noexcept {
    if (this != &o) {
      discard();
      temp_ = std::exchange(o.temp_, {});
      target_ = std::move(o.target_);
      lock_ = std::move(o.lock_);
      result_ = o.result_;
    }
    return *this;
  }
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  ~StagedFile() { discard(); }

  // Runs `write(sink)` into a new temporary file next to `path`, fsyncs and closes it.
  // Failures, including an exception from `write`, throw fsdp::Error "cannot write
  // '<path>': <reason>" and leave nothing behind; exceptions that are not std::exception
  // are rethrown as they are.
  static StagedFile write(const std::filesystem::path& path, const std::function<void(FileSink&)>& write,
                          Hashing hashing = Hashing::whole_file) {
    if (!path.has_filename()) fsdp::detail::fail("cannot write '", path.string(), "': the path names no file");
    const std::filesystem::path temp = detail::temp_path_for(path, std::to_string(::getpid()) + "-" + detail::random_token());
    StagedFile staged;
    try {
      detail::UniqueFd fd = detail::open_fd(temp, O_WRONLY | O_CREAT | O_EXCL, "to write a temporary file");
      staged = StagedFile(temp, path, detail::hold_file_lock(fd.get()));  // from here on, a failure removes it
      detail::check_still_linked(fd.get(), temp);
      FileSink sink(fd.get(), temp, path, hashing);
      write(sink);
      sink.flush();
      detail::fsync_fd(fd.get(), temp);
      fd.close_checked(temp);
      staged.result_ = {sink.bytes_written(), sink.xxh64()};
      return staged;
    } catch (const std::exception& e) {
      staged.discard();
      // Keeps the kind of what failed (a write's io, a writer's misuse); io for a foreign exception.
      fsdp::detail::fail_as(kind_of(e, ErrorKind::io), "cannot write '", path.string(), "': ", detail::message_of(e));
    }
  }

  const std::filesystem::path& temp() const { return temp_; }
  const std::filesystem::path& target() const { return target_; }
  const WriteResult& result() const { return result_; }
  bool pending() const { return !temp_.empty(); }

  // Throws (io, naming the file) unless temp() still names the file this save wrote and
  // locked: not removed by another save's recovery, nor replaced by another file of that
  // name. commit_files checks every file so before its journal (the commit point): a
  // journal naming a file that is gone would fail in the middle of the renames.
  void check_in_place(const std::filesystem::path& checkpoint) const {
    struct stat at {};
    if (::lstat(temp_.c_str(), &at) != 0)
      fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", checkpoint.string(), "': its temporary file '",
                            temp_.string(), "' is gone (", detail::errno_text(errno),
                            "; removed by another save's recovery?); nothing was committed");
    struct stat held {};
    if (lock_ && ::fstat(lock_.get(), &held) == 0 &&
        (held.st_nlink == 0 || held.st_dev != at.st_dev || held.st_ino != at.st_ino))
      fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", checkpoint.string(), "': its temporary file '",
                            temp_.string(), "' is no longer the file this save wrote (removed, and another made "
                            "under its name?); nothing was committed");
  }

  void discard() noexcept {
    if (!temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
    lock_.reset();
  }
  void release() noexcept {
    temp_.clear();
    lock_.reset();
  }

 private:
  std::filesystem::path temp_, target_;
  detail::UniqueFd lock_;
  WriteResult result_;
};

// Runs `write(sink)` into a temporary file and publishes it as `path` (see the top of this
// file). Failures, including an exception from `write`, throw fsdp::Error "cannot write
// '<path>': <reason>"; exceptions that are not std::exception are rethrown as they are.
inline WriteResult write_file_atomically(const std::filesystem::path& path, const std::function<void(FileSink&)>& write,
                                         Hashing hashing = Hashing::whole_file) {
  StagedFile staged = StagedFile::write(path, write, hashing);
  if (::rename(staged.temp().c_str(), path.c_str()) != 0)
    fsdp::detail::fail_as(ErrorKind::io, "cannot write '", path.string(), "': renaming '", staged.temp().string(),
                          "' to it failed: ", detail::errno_text(errno));
  staged.release();
  detail::fsync_directory(detail::parent_or_dot(path));
  return staged.result();
}

}  // namespace fsdp::checkpoint
