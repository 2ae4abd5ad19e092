#pragma once
// write_file_atomically: a file is either its old content (or absent) or complete, even if
// the process dies mid-write. The caller's function writes into a temporary file next to
// the target (".<name>.tmp-<pid>-<random>", so it is on the same file system and hidden
// from globs); then the file is fsynced, renamed over the target and the directory is
// fsynced so that the rename itself survives a crash. On any failure the temporary file
// is removed and the target is untouched.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/file_io.hpp"
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
  friend WriteResult write_file_atomically(const std::filesystem::path&, const std::function<void(FileSink&)>&, Hashing);
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
// An exception's message without fsdp::Error's "fsdp: " prefix, for wrapping it.
inline std::string_view message_of(const std::exception& e) {
  std::string_view m = e.what();
  if (m.substr(0, 6) == "fsdp: ") m.remove_prefix(6);
  return m;
}
}  // namespace detail

// Runs `write(sink)` into a temporary file and publishes it as `path` (see the top of this
// file). Failures, including an exception from `write`, throw fsdp::Error "cannot write
// '<path>': <reason>"; exceptions that are not std::exception are rethrown as they are.
inline WriteResult write_file_atomically(const std::filesystem::path& path, const std::function<void(FileSink&)>& write,
                                         Hashing hashing = Hashing::whole_file) {
  if (!path.has_filename()) fsdp::detail::fail("cannot write '", path.string(), "': the path names no file");
  const std::filesystem::path temp = detail::temp_path_for(path, std::to_string(::getpid()) + "-" + detail::random_token());
  bool renamed = false;
  auto remove_temp = [&] {
    if (!renamed) ::unlink(temp.c_str());
  };
  try {
    detail::UniqueFd fd = detail::open_fd(temp, O_WRONLY | O_CREAT | O_EXCL, "to write a temporary file");
    FileSink sink(fd.get(), temp, path, hashing);
    write(sink);
    sink.flush();
    detail::fsync_fd(fd.get(), temp);
    fd.close_checked(temp);
    if (::rename(temp.c_str(), path.c_str()) != 0)
      fsdp::detail::fail_as(ErrorKind::io, "renaming '", temp.string(), "' to it failed: ", detail::errno_text(errno));
    renamed = true;
    detail::fsync_directory(detail::parent_or_dot(path));
    return {sink.bytes_written(), sink.xxh64()};
  } catch (const std::exception& e) {
    remove_temp();
    // Keeps the kind of what failed (a write's io, a writer's misuse); io for a foreign exception.
    fsdp::detail::fail_as(kind_of(e, ErrorKind::io), "cannot write '", path.string(), "': ", detail::message_of(e));
  } catch (...) {
    remove_temp();
    throw;
  }
}

}  // namespace fsdp::checkpoint
