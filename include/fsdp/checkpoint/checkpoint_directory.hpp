#pragma once
// CheckpointDirectory: a checkpoint directory that is complete or absent, never
// half-written, even if the process is killed during the save.
//
// Files are written (each atomically) into a staging directory "<dir>.partial-<token>"
// next to `dir`; commit() fsyncs it and renames it to `dir`. When `dir` already holds an
// older checkpoint, commit() first renames that one aside to "<dir>.old-<token>", renames
// the staging directory into place, fsyncs the parent and only then removes the old one.
// A crash between those two renames leaves no `dir` but the old checkpoint, complete,
// under "<dir>.old-<token>" (restore_interrupted_checkpoint() puts it back); it never
// leaves a half-written `dir`. A save that is abandoned (abort(), the destructor without
// commit(), an exception) removes its staging directory; one killed outright leaves it as
// "<dir>.partial-<token>", which checkpoint_leftovers() lists.
//
// Several writers (ranks) can fill one staging directory: one begin()s it with a token it
// shares, the others write into staging_path(dir, token), and the first commits when all
// are done.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

namespace detail {
// "ckpt/" and "ckpt" name the same directory; ".", ".." and "/" name none we can replace.
inline std::filesystem::path checkpoint_dir_path(const std::filesystem::path& dir) {
  std::filesystem::path p = dir.lexically_normal();
  if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
  const std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..")
    fail("checkpoint directory '", dir.string(), "' must name a directory (not '.', '..' or '/')");
  return p;
}

inline std::string sibling_name(const std::filesystem::path& dir, std::string_view tag, std::string_view token) {
  return dir.filename().string() + "." + std::string(tag) + "-" + std::string(token);
}
}  // namespace detail

class CheckpointDirectory {
 public:
  // Creates the staging directory. Refuses a token that is not 1..64 characters of
  // [A-Za-z0-9_-], a parent directory that does not exist, and a staging directory that
  // already exists (a token used twice).
  static CheckpointDirectory begin(const std::filesystem::path& dir, std::string token = detail::random_token()) {
    std::filesystem::path target = detail::checkpoint_dir_path(dir);
    std::filesystem::path staging = staging_path(target, token);
    const std::filesystem::path parent = detail::parent_or_dot(target);
    std::error_code ec;
    if (!std::filesystem::is_directory(parent, ec))
      fsdp::detail::fail_as(ErrorKind::io, "cannot save checkpoint '", target.string(), "': its parent directory '",
                            parent.string(), "' does not exist");
    if (::mkdir(staging.c_str(), 0777) != 0)
      fsdp::detail::fail_as(ErrorKind::io, "cannot save checkpoint '", target.string(),
                            "': creating the staging directory '", staging.string(),
                            "' failed: ", detail::errno_text(errno));
    return CheckpointDirectory(std::move(target), std::move(staging), std::move(token));
  }

  // Where begin(dir, token) stages, for writers that did not call begin() themselves.
  static std::filesystem::path staging_path(const std::filesystem::path& dir, std::string_view token) {
    const std::filesystem::path target = detail::checkpoint_dir_path(dir);
    const bool ok = !token.empty() && token.size() <= 64 && std::all_of(token.begin(), token.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    });
    if (!ok)
      fsdp::detail::fail("checkpoint '", target.string(), "': staging token '", token,
                         "' must be 1 to 64 characters of A-Z a-z 0-9 _ -");
    return detail::parent_or_dot(target) / detail::sibling_name(target, "partial", token);
  }

  CheckpointDirectory(CheckpointDirectory&& o) noexcept
      : target_(std::move(o.target_)), staging_(std::move(o.staging_)), token_(std::move(o.token_)),
        open_(std::exchange(o.open_, false)) {}
  CheckpointDirectory& operator=(CheckpointDirectory&&) = delete;
  CheckpointDirectory(const CheckpointDirectory&) = delete;
  ~CheckpointDirectory() { abort(); }

  const std::filesystem::path& target() const { return target_; }
  const std::filesystem::path& staging() const { return staging_; }
  const std::string& token() const { return token_; }

  // The staging path of file `name` (one plain path component).
  std::filesystem::path file(std::string_view name) const {
    detail::check_file_name(name, target_.string());
    return staging_ / std::string(name);
  }
  WriteResult write_file(std::string_view name, const std::function<void(FileSink&)>& write) const {
    check_open("write a file into");
    return write_file_atomically(file(name), write);
  }

  // Publishes the staging directory as target() (see the top of this file).
  void commit() {
    check_open("commit");
    const std::filesystem::path parent = detail::parent_or_dot(target_);
    detail::fsync_directory(staging_);
    struct stat st {};
    if (::lstat(target_.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", target_.string(),
                              "': it exists and is not a directory; refusing to replace it");
      const std::filesystem::path old = parent / detail::sibling_name(target_, "old", token_);
      rename_or_fail(target_, old);
      if (::rename(staging_.c_str(), target_.c_str()) != 0) {
        const int err = errno;
        ::rename(old.c_str(), target_.c_str());  // put the old checkpoint back
        fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", target_.string(), "': renaming '",
                              staging_.string(), "' to it failed: ", detail::errno_text(err));
      }
      open_ = false;
      detail::fsync_directory(parent);
      std::error_code ignored;  // committed: a leftover old copy is listed by checkpoint_leftovers()
      std::filesystem::remove_all(old, ignored);
    } else {
      rename_or_fail(staging_, target_);
      open_ = false;
      detail::fsync_directory(parent);
    }
  }

  // Removes the staging directory and everything in it; a no-op after commit().
  void abort() noexcept {
    if (!std::exchange(open_, false)) return;
    std::error_code ignored;
    std::filesystem::remove_all(staging_, ignored);
  }

  // True until commit() or abort().
  bool pending() const { return open_; }

 private:
  CheckpointDirectory(std::filesystem::path target, std::filesystem::path staging, std::string token)
      : target_(std::move(target)), staging_(std::move(staging)), token_(std::move(token)) {}

  void check_open(const char* what) const {
    if (!open_)
      fsdp::detail::fail("checkpoint '", target_.string(), "': cannot ", what,
                         " it: it was already committed or aborted");
  }
  void rename_or_fail(const std::filesystem::path& from, const std::filesystem::path& to) const {
    if (::rename(from.c_str(), to.c_str()) != 0)
      fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", target_.string(), "': renaming '",
                            from.string(), "' to '", to.string(), "' failed: ", detail::errno_text(errno));
  }

  std::filesystem::path target_;
  std::filesystem::path staging_;
  std::string token_;
  bool open_ = true;
};

// The "<dir>.partial-*" and "<dir>.old-*" siblings that interrupted saves left, sorted.
inline std::vector<std::filesystem::path> checkpoint_leftovers(const std::filesystem::path& dir) {
  const std::filesystem::path target = detail::checkpoint_dir_path(dir);
  const std::string partial = target.filename().string() + ".partial-";
  const std::string old = target.filename().string() + ".old-";
  std::vector<std::filesystem::path> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(detail::parent_or_dot(target), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(partial, 0) == 0 || name.rfind(old, 0) == 0) found.push_back(e.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

// After a crash between commit()'s two renames: if `dir` is absent and exactly one
// "<dir>.old-*" exists, renames it back to `dir` and returns true. Several are ambiguous
// (an error naming them); none, or `dir` present, returns false.
inline bool restore_interrupted_checkpoint(const std::filesystem::path& dir) {
  const std::filesystem::path target = detail::checkpoint_dir_path(dir);
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(target, ec))) return false;
  const std::string old = target.filename().string() + ".old-";
  std::vector<std::filesystem::path> olds;
  for (const auto& p : checkpoint_leftovers(target))
    if (p.filename().string().rfind(old, 0) == 0) olds.push_back(p);
  if (olds.empty()) return false;
  if (olds.size() > 1) {
    std::string names;
    for (const auto& p : olds) names += " '" + p.string() + "'";
    fsdp::detail::fail_as(ErrorKind::io, "checkpoint '", target.string(),
                          "' is absent and several old copies exist:", names, "; restore one by hand");
  }
  if (::rename(olds[0].c_str(), target.c_str()) != 0)
    fsdp::detail::fail_as(ErrorKind::io, "cannot restore checkpoint '", target.string(), "' from '", olds[0].string(),
                          "': ", detail::errno_text(errno));
  detail::fsync_directory(detail::parent_or_dot(target));
  return true;
}

}  // namespace fsdp::checkpoint
