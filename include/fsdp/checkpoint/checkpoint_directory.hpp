#pragma once
// CheckpointDirectory: a checkpoint directory that is complete or absent, never
// half-written, even if the process is killed during the save, and never a mix of two
// saves, even when two jobs save into the same path at once.
//
// Files are written (each atomically) into a staging directory "<dir>.partial-fsdp-<hex>"
// next to `dir`, where <hex> is 16 hex digits of a hash of a token unique to the save
// (random unless the caller gives one); commit() fsyncs it and renames it to `dir`. When
// `dir` already holds an older checkpoint, commit() first renames that one aside to
// "<dir>.old-fsdp-<hex>", renames the staging directory into place, fsyncs the parent and
// only then removes the old one. A crash between those two renames leaves no `dir` but the
// old checkpoint, complete, under "<dir>.old-fsdp-<hex>"; it never leaves a half-written `dir`.
//
// Why the "fsdp-<16 hex>" form, matched exactly: recovery removes and restores siblings by
// name, and a user's own "<dir>.old-backup" or "<dir>.partial-run2" must never be taken for
// a leftover (deleted by the next save, or loaded when `dir` is absent). An old copy is
// also restored, loaded or removed only if it holds an index.json (it looks like a checkpoint).
//
// Why locks: a save cannot tell from names alone whether "<dir>.partial-fsdp-<hex>" belongs
// to a save that died (remove it) or to one still writing (leave it), nor whether an
// "<dir>.old-fsdp-<hex>" is a dead commit's (restore or remove it) or a live one's. So the
// save holds an flock on its staging directory from begin() to commit() or abort() (the
// kernel drops it when the process dies), and begin() and commit() hold an flock on the
// parent directory for their few renames. Holding the parent's lock, begin() recovers what
// interrupted saves left (recover_leftovers: dead staging directories removed, an old copy
// put back when `dir` is missing, removed when `dir` is there) and reports it; what it
// removes is only renamed to "<dir>.trash-fsdp-<hex>" under the lock and deleted after the
// lock is released (as commit() deletes the old copy), so a huge deletion never holds every
// save into that parent; two commits
// into one path run one after the other, and the last one wins. Where the file system has
// no flock, staging directories are left alone (reported, never removed) and a commit that
// loses a race fails naming the directory.
//
// Several writers (ranks) can fill one staging directory: one begin()s it with a token it
// shares, the others write into staging_path(dir, token), and the first commits when all
// are done.
//
// A set of files that must appear together (a full checkpoint's model file and its
// optimizer file: commit_files) cannot be renamed at once. Each is written under its
// temporary name (StagedFile, flock()ed while its save lives); then, holding the parent's
// lock, the commit writes the journal ".<file>.commit-fsdp" (atomically: it is the commit
// point) naming each temporary file and its target and the targets to remove, renames and
// removes, and removes the journal. A crash before the journal leaves the old files; after
// it, a load reads the journal's temporary files in place of the targets not yet renamed
// (committed_files: it writes nothing), and the next commit into that path finishes the
// journal first (roll forward), removes the temporary files of dead saves and reports both.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

// The points of a commit, for tests that stop it there (detail::commit_hook).
enum class CommitStep {
  locked,       // the parent's lock held, nothing renamed yet
  journal_renamed,  // commit_files: the journal renamed into place (the commit point), its directory not yet
                    // fsynced. An fsdp::Error thrown here is handled as that fsync's failure: a test cannot
                    // make a real directory fsync fail, and this is the one after the commit point
  journaled,    // commit_files: the journal written and fsynced (the commit point), no file renamed yet
  renamed_first,  // commit_files: the first of its changes done (a full checkpoint's optimizer file renamed
                  // or removed), not the others (the model file's rename)
  moved_aside,  // the old checkpoint renamed to "<dir>.old-fsdp-<hex>"; no `dir`
  published,    // the new checkpoint is `dir`; the old one not yet removed
  done,         // the old one removed (after the parent's lock was released); the commit returns
};

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

// The names fsdp gives a save's siblings: "<dir>.<tag>-fsdp-<16 hex digits>", the digits the
// XXH64 of the save's token. Only names of exactly that form are taken for fsdp's own
// leftovers: a user's "<dir>.old-backup" or "<dir>.partial-run2" is never removed, restored
// or loaded.
inline constexpr std::string_view sibling_infix = "-fsdp-";
inline std::string sibling_name(const std::filesystem::path& dir, std::string_view tag, std::string_view token) {
  Xxh64 h;
  h.update(token.data(), token.size());
  return dir.filename().string() + "." + std::string(tag) + std::string(sibling_infix) + xxh64_hex(h.digest());
}
inline bool is_sibling_name(std::string_view name, std::string_view prefix) {
  if (name.size() != prefix.size() + 16 || name.substr(0, prefix.size()) != prefix) return false;
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// Called at each CommitStep of every commit in this process when set (tests only: it may
// throw, or end the process to stand for a kill at that point). Null by default.
inline std::function<void(CommitStep, const std::filesystem::path& target)>& commit_hook() {
  static std::function<void(CommitStep, const std::filesystem::path&)> hook;
  return hook;
}
inline void at_commit_step(CommitStep step, const std::filesystem::path& target) {
  if (const auto& hook = commit_hook()) hook(step, target);
}

// An exclusive flock on a directory, released on destruction (or when the process dies).
// Not held where the file system has no flock for directories (held() false).
class DirLock {
 public:
  enum class Try { held, busy, unsupported, gone };

  DirLock() = default;
  // Tries once, without waiting. `directory` false: a file (a save's temporary file).
  static std::pair<DirLock, Try> try_lock(const std::filesystem::path& dir, bool directory = true) {
    int fd;
    do fd = ::open(dir.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : O_NOFOLLOW));
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return {DirLock(), errno == ENOENT || errno == ENOTDIR ? Try::gone : Try::unsupported};
    UniqueFd owned(fd);
    int rc;
    do rc = ::flock(fd, LOCK_EX | LOCK_NB);
    while (rc != 0 && errno == EINTR);
    if (rc == 0) return {DirLock(std::move(owned)), Try::held};
    return {DirLock(), errno == EWOULDBLOCK ? Try::busy : Try::unsupported};
  }
  // Waits for the lock, at most `timeout`; then fails naming `dir` and what it was for.
  static DirLock wait(const std::filesystem::path& dir, const std::filesystem::path& target,
                      std::chrono::milliseconds timeout = std::chrono::minutes(2)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(50))) {
      auto [lock, result] = try_lock(dir);
      if (result == Try::held || result == Try::unsupported) return std::move(lock);
      if (result == Try::gone)
        fail_as(ErrorKind::io, "cannot save checkpoint '", target.string(), "': its parent directory '", dir.string(),
                "' does not exist");
      if (std::chrono::steady_clock::now() >= deadline)
        fail_as(ErrorKind::io, "cannot save checkpoint '", target.string(), "': another save has held the lock on '",
                dir.string(), "' for ", std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
                " s (a process stopped in the middle of a commit?)");
      std::this_thread::sleep_for(pause);
    }
  }
  bool held() const { return static_cast<bool>(fd_); }
  void release() { fd_.reset(); }

 private:
  explicit DirLock(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

// Sorted "<dir>.<tag>-fsdp-<16 hex>" siblings of `target` (sibling_name's form, exactly).
inline std::vector<std::filesystem::path> siblings_tagged(const std::filesystem::path& target, std::string_view tag) {
  const std::string prefix = target.filename().string() + "." + std::string(tag) + std::string(sibling_infix);
  std::vector<std::filesystem::path> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(parent_or_dot(target), ec))
    if (is_sibling_name(e.path().filename().string(), prefix)) found.push_back(e.path());
  std::sort(found.begin(), found.end());
  return found;
}

// The "<dir>.old-fsdp-<hex>" siblings that hold a checkpoint (an index.json, not a symlink):
// the only ones restored, loaded or removed. One without is left alone, whatever made it.
inline std::vector<std::filesystem::path> old_copies(const std::filesystem::path& target) {
  std::vector<std::filesystem::path> found;
  for (auto& p : siblings_tagged(target, "old")) {
    std::error_code ec;
    if (std::filesystem::is_directory(std::filesystem::symlink_status(p, ec)) &&
        std::filesystem::is_regular_file(std::filesystem::symlink_status(p / "index.json", ec)))
      found.push_back(std::move(p));
  }
  return found;
}

// Puts the one "<dir>.old-fsdp-*" back as `dir` when `dir` is absent; true if it did.
// Several are ambiguous (an error naming them).
inline bool restore_old_copy(const std::filesystem::path& target, std::vector<std::string>* report) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(target, ec))) return false;
  const auto olds = old_copies(target);
  if (olds.empty()) return false;
  if (olds.size() > 1) {
    std::string names;
    for (const auto& p : olds) names += " '" + p.string() + "'";
    fail_as(ErrorKind::io, "checkpoint '", target.string(), "' is absent and several old copies exist:", names,
            "; restore one by hand");
  }
  if (::rename(olds[0].c_str(), target.c_str()) != 0)
    fail_as(ErrorKind::io, "cannot restore checkpoint '", target.string(), "' from '", olds[0].string(),
            "': ", errno_text(errno));
  fsync_directory(parent_or_dot(target));
  if (report)
    report->push_back("restored '" + target.string() + "' from '" + olds[0].string() +
                      "', the last complete checkpoint, which a commit interrupted between its renames had left");
  return true;
}

// Why trash: under the parent's lock a recovery only renames what it removes (a dead
// staging directory, an old copy) to "<dir>.trash-fsdp-<hex>"; the deletion itself, which
// for a large checkpoint takes minutes, runs after the lock is released (empty_trash), so
// it does not hold up every save into that parent. A trash directory is never anyone's live
// data: the next save removes one that a killed process left.
inline std::filesystem::path move_to_trash(const std::filesystem::path& target, const std::filesystem::path& p) {
  const std::filesystem::path trash = parent_or_dot(target) / sibling_name(target, "trash", random_token());
  if (::rename(p.c_str(), trash.c_str()) != 0)
    fail_as(ErrorKind::io, "cannot save checkpoint '", target.string(), "': renaming '", p.string(), "' to '",
            trash.string(), "' to remove it failed: ", errno_text(errno));
  return trash;
}

// Removes `trash` (the parent's lock not held). Another save may be removing the same
// directory: what it removed first (ENOENT) is not an error. Anything else left is reported
// (the next save tries again), not thrown: the save itself is fine.
inline void empty_trash(const std::vector<std::filesystem::path>& trash, std::vector<std::string>* report) {
  for (const auto& p : trash)
    for (int attempt = 0;; ++attempt) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
      if (!ec || ec == std::errc::no_such_file_or_directory) {
        if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec))) break;
      }
      if (attempt == 2) {
        if (report)
          report->push_back("could not remove '" + p.string() + "' (" + (ec ? ec.message() : std::string("still there")) +
                            "); the next save tries again");
        break;
      }
    }
}

// What interrupted saves left next to `target`, dealt with (see the top of this file); the
// caller holds the parent's lock where there is one. One line per thing found. What it
// removes is renamed into `trash`, for empty_trash once the lock is released.
inline std::vector<std::string> recover_leftovers_locked(const std::filesystem::path& target,
                                                         std::vector<std::filesystem::path>& trash) {
  std::vector<std::string> report;
  for (const auto& p : siblings_tagged(target, "trash")) {  // a removal that was killed, or is running now
    trash.push_back(p);
    report.push_back("removed '" + p.string() + "', what an interrupted removal of a leftover left");
  }
  for (const auto& p : siblings_tagged(target, "partial")) {
    auto [lock, result] = DirLock::try_lock(p);
    if (result == DirLock::Try::held) {
      trash.push_back(move_to_trash(target, p));
      report.push_back("removed '" + p.string() + "', the staging directory of a save that did not finish");
    } else if (result == DirLock::Try::busy) {
      report.push_back("left '" + p.string() + "': a save in progress is writing into it");
    } else if (result == DirLock::Try::unsupported) {
      report.push_back("left '" + p.string() + "': the file system cannot tell whether a save still writes into it "
                       "(no flock); remove it by hand if none does");
    }
  }
  if (restore_old_copy(target, &report)) return report;
  std::error_code ec;
  if (!std::filesystem::is_directory(std::filesystem::symlink_status(target, ec))) return report;
  for (const auto& p : old_copies(target)) {  // `dir` is complete: these are older
    trash.push_back(move_to_trash(target, p));
    report.push_back("removed '" + p.string() + "', an older checkpoint that an interrupted commit left beside '" +
                     target.string() + "'");
  }
  return report;
}
}  // namespace detail

class CheckpointDirectory {
 public:
  // Recovers what interrupted saves left at `dir` (recovered() says what it found), then
  // creates the staging directory. Refuses a token that is not 1..64 characters of
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
    detail::DirLock parent_lock = detail::DirLock::wait(parent, target);
    std::vector<std::filesystem::path> trash;
    std::vector<std::string> recovered = detail::recover_leftovers_locked(target, trash);
    if (::mkdir(staging.c_str(), 0777) != 0) {
      const int err = errno;
      parent_lock.release();
      detail::empty_trash(trash, nullptr);
      fsdp::detail::fail_as(ErrorKind::io, "cannot save checkpoint '", target.string(),
                            "': creating the staging directory '", staging.string(),
                            "' failed: ", detail::errno_text(err));
    }
    detail::DirLock staging_lock = detail::DirLock::try_lock(staging).first;  // before the parent's is released
    parent_lock.release();
    detail::empty_trash(trash, &recovered);  // the lock released: other saves go on meanwhile
    return CheckpointDirectory(std::move(target), std::move(staging), std::move(token), std::move(staging_lock),
                               std::move(recovered));
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
        lock_(std::move(o.lock_)), recovered_(std::move(o.recovered_)), open_(std::exchange(o.open_, false)) {}
  CheckpointDirectory& operator=(CheckpointDirectory&&) = delete;
  CheckpointDirectory(const CheckpointDirectory&) = delete;
  ~CheckpointDirectory() { abort(); }

  const std::filesystem::path& target() const { return target_; }
  const std::filesystem::path& staging() const { return staging_; }
  const std::string& token() const { return token_; }
  // What begin() found of interrupted saves and did with it, one line each; empty when
  // there was nothing.
  const std::vector<std::string>& recovered() const { return recovered_; }

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
    detail::DirLock parent_lock = detail::DirLock::wait(parent, target_);
    detail::at_commit_step(CommitStep::locked, target_);
    struct stat st {};
    if (::lstat(target_.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", target_.string(),
                              "': it exists and is not a directory; refusing to replace it");
      const std::filesystem::path old = parent / detail::sibling_name(target_, "old", token_);
      rename_or_fail(target_, old);
      detail::at_commit_step(CommitStep::moved_aside, target_);
      if (::rename(staging_.c_str(), target_.c_str()) != 0) {
        const int err = errno;
        const bool put_back = ::rename(old.c_str(), target_.c_str()) == 0;
        fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", target_.string(), "': renaming '",
                              staging_.string(), "' to it failed: ", detail::errno_text(err),
                              put_back ? "; the old checkpoint is back in place"
                                       : (" (another save published it meanwhile?); the old checkpoint is '" +
                                          old.string() + "'"));
      }
      open_ = false;
      detail::fsync_directory(parent);
      detail::at_commit_step(CommitStep::published, target_);
      parent_lock.release();  // only renames under it: the old copy is removed without it
      detail::empty_trash({old}, nullptr);  // committed: a copy left is removed by the next save
    } else {
      if (::rename(staging_.c_str(), target_.c_str()) != 0) {
        const int err = errno;
        fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", target_.string(), "': renaming '",
                              staging_.string(), "' to it failed: ", detail::errno_text(err),
                              err == ENOTEMPTY || err == EEXIST ? " (another save published it meanwhile?)" : "");
      }
      open_ = false;
      detail::fsync_directory(parent);
      detail::at_commit_step(CommitStep::published, target_);
    }
    lock_.release();
    detail::at_commit_step(CommitStep::done, target_);
  }

  // Removes the staging directory and everything in it; a no-op after commit().
  void abort() noexcept {
    if (!std::exchange(open_, false)) return;
    std::error_code ignored;
    std::filesystem::remove_all(staging_, ignored);
    lock_.release();
  }

  // True until commit() or abort().
  bool pending() const { return open_; }

 private:
  CheckpointDirectory(std::filesystem::path target, std::filesystem::path staging, std::string token,
                      detail::DirLock lock, std::vector<std::string> recovered)
      : target_(std::move(target)), staging_(std::move(staging)), token_(std::move(token)), lock_(std::move(lock)),
        recovered_(std::move(recovered)) {}

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
  detail::DirLock lock_;  // on staging_, while this save may still write into it
  std::vector<std::string> recovered_;
  bool open_ = true;
};

// The "<dir>.partial-fsdp-<hex>", "<dir>.old-fsdp-<hex>" and "<dir>.trash-fsdp-<hex>"
// siblings that interrupted saves left, sorted (only names of exactly that form: see
// sibling_name).
// (The next save into `dir` deals with them: see recover_leftovers.)
inline std::vector<std::filesystem::path> checkpoint_leftovers(const std::filesystem::path& dir) {
  const std::filesystem::path target = detail::checkpoint_dir_path(dir);
  auto found = detail::siblings_tagged(target, "partial");
  for (auto& p : detail::siblings_tagged(target, "old")) found.push_back(std::move(p));
  for (auto& p : detail::siblings_tagged(target, "trash")) found.push_back(std::move(p));
  std::sort(found.begin(), found.end());
  return found;
}

// What begin() does before a save, for a caller that wants it without saving: removes the
// staging directories of saves that died, puts the old copy back when a commit interrupted
// between its renames left no `dir`, removes old copies beside a complete `dir`. Returns
// one line per thing found (empty: nothing).
inline std::vector<std::string> recover_leftovers(const std::filesystem::path& dir) {
  const std::filesystem::path target = detail::checkpoint_dir_path(dir);
  detail::DirLock lock = detail::DirLock::wait(detail::parent_or_dot(target), target);
  std::vector<std::filesystem::path> trash;
  std::vector<std::string> report = detail::recover_leftovers_locked(target, trash);
  lock.release();
  detail::empty_trash(trash, &report);
  return report;
}

// Where a load finds the checkpoint `dir` names: `dir` itself, or, when it is absent and a
// commit interrupted between its two renames left exactly one "<dir>.old-fsdp-<hex>" holding
// an index.json, that old
// copy (the last complete checkpoint; the next save puts it back). Reads only.
inline std::filesystem::path committed_checkpoint_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(dir, ec))) return dir;
  const std::filesystem::path target = detail::checkpoint_dir_path(dir);
  const auto olds = detail::old_copies(target);
  return olds.size() == 1 ? olds[0] : dir;
}

// After a crash between commit()'s two renames: if `dir` is absent and exactly one
// "<dir>.old-fsdp-<hex>" holding an index.json exists, renames it back to `dir` and returns true. Several are ambiguous
// (an error naming them); none, or `dir` present, returns false.
inline bool restore_interrupted_checkpoint(const std::filesystem::path& dir) {
  const std::filesystem::path target = detail::checkpoint_dir_path(dir);
  const detail::DirLock lock = detail::DirLock::wait(detail::parent_or_dot(target), target);
  return detail::restore_old_copy(target, nullptr);
}

// Files committed together (commit_files; see the top of this file).
namespace detail {

// ".<file>.commit-fsdp" next to `file` (the set's first target: a full checkpoint's model file).
inline std::filesystem::path commit_journal_path(const std::filesystem::path& file) {
  return parent_or_dot(file) / ("." + file.filename().string() + ".commit-fsdp");
}

// What a journal says: each temporary file's name and its target's (siblings of the
// journal, in rename order) and the targets to remove, of the save `save`.
struct CommitJournal {
  std::string save;
  std::vector<std::pair<std::string, std::string>> renames;  // (temporary name, target name)
  std::vector<std::string> removes;

  std::string format() const {
    nlohmann::json j;
    j["fsdp_commit_journal"] = 1;
    j["save_id"] = save;
    j["renames"] = nlohmann::json::array();
    for (const auto& [from, to] : renames) j["renames"].push_back({{"from", from}, {"to", to}});
    j["removes"] = removes;
    return j.dump(1) + "\n";
  }
  // The journal of `file` (whose targets are `targets`), nullopt when there is none. One
  // that cannot be read, or that names other files than `targets` and their temporary
  // files, is an error naming it (the journal is written atomically: it is whole or absent).
  static std::optional<CommitJournal> read(const std::filesystem::path& file, const std::vector<std::filesystem::path>& targets) {
    const std::filesystem::path path = commit_journal_path(file);
    int fd;
    do fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      fail_as(ErrorKind::io, "checkpoint '", file.string(), "': cannot open its commit journal '", path.string(),
              "': ", errno_text(errno));
    }
    UniqueFd owned(fd);
    std::string text(file_size_of(fd, path), '\0');
    if (pread_up_to(fd, text.data(), text.size(), 0, path) != text.size())
      fail_as(ErrorKind::io, "checkpoint '", file.string(), "': its commit journal '", path.string(), "' shrank while read");
    std::set<std::string> names;
    for (const auto& t : targets) names.insert(t.filename().string());
    auto bad = [&](const std::string& why) {
      fail_as(ErrorKind::corrupt, "checkpoint '", file.string(), "': its commit journal '", path.string(), "' is damaged (",
              why, "); remove it by hand only if you know which files are whole");
    };
    CommitJournal out;
    try {
      const nlohmann::json j = nlohmann::json::parse(text);
      if (j.at("fsdp_commit_journal").get<int>() != 1) bad("an unknown version");
      out.save = j.at("save_id").get<std::string>();
      for (const auto& r : j.at("renames")) {
        auto from = r.at("from").get<std::string>(), to = r.at("to").get<std::string>();
        if (!names.count(to) || from.rfind("." + to + ".tmp-", 0) != 0 || from.find('/') != std::string::npos)
          bad("it renames '" + from + "' to '" + to + "'");
        out.renames.emplace_back(std::move(from), std::move(to));
      }
      for (const auto& r : j.at("removes")) {
        auto name = r.get<std::string>();
        if (!names.count(name)) bad("it removes '" + name + "'");
        out.removes.push_back(std::move(name));
      }
    } catch (const nlohmann::json::exception& e) {
      bad(e.what());
    }
    return out;
  }
};

// The "<prefix>*" names in `dir`, sorted.
inline std::vector<std::filesystem::path> names_starting(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::filesystem::path> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > prefix.size() && name.rfind(prefix, 0) == 0) found.push_back(e.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

// Finishes a journal left by a commit that did not finish (the caller holds the parent's
// lock): renames what is still under its temporary name, removes what it removes, then the
// journal. One line for the report.
inline std::string finish_journal_locked(const std::filesystem::path& file, const CommitJournal& j) {
  const std::filesystem::path parent = parent_or_dot(file), journal = commit_journal_path(file);
  std::string done;
  for (const auto& name : j.removes)
    if (::unlink((parent / name).c_str()) == 0) done += ", removed '" + name + "'";
    else if (errno != ENOENT)
      fail_as(ErrorKind::io, "cannot save checkpoint '", file.string(), "': finishing the commit journal '",
              journal.string(), "': removing '", (parent / name).string(), "' failed: ", errno_text(errno));
  for (const auto& [from, to] : j.renames) {
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::symlink_status(parent / from, ec))) continue;  // renamed already
    if (::rename((parent / from).c_str(), (parent / to).c_str()) != 0)
      fail_as(ErrorKind::io, "cannot save checkpoint '", file.string(), "': finishing the commit journal '",
              journal.string(), "': renaming '", (parent / from).string(), "' to '", (parent / to).string(),
              "' failed: ", errno_text(errno));
    done += ", renamed '" + from + "' to '" + to + "'";
  }
  fsync_directory(parent);
  if (::unlink(journal.c_str()) != 0 && errno != ENOENT)
    fail_as(ErrorKind::io, "cannot save checkpoint '", file.string(), "': removing the commit journal '",
            journal.string(), "' failed: ", errno_text(errno));
  fsync_directory(parent);
  return "finished the commit of save " + j.save + " into '" + file.string() + "' that an interrupted save left (" +
         (done.empty() ? std::string("nothing was left to rename") : done.substr(2)) + ")";
}

// What interrupted commits and dead saves left next to `file` (the caller holds the parent's
// lock): a journal finished; dead saves' temporary files of the targets and journal
// temporary files removed; a live save's temporary files (flock held) left, except `own`
// (this save's), which are not mentioned. One line per thing found.
inline std::vector<std::string> recover_files_locked(const std::filesystem::path& file,
                                                     const std::vector<std::filesystem::path>& targets,
                                                     const std::set<std::filesystem::path>& own) {
  std::vector<std::string> report;
  if (const auto journal = CommitJournal::read(file, targets)) report.push_back(finish_journal_locked(file, *journal));
  const std::filesystem::path parent = parent_or_dot(file);
  auto remove = [&](const std::filesystem::path& p, const std::string& what) {
    if (::unlink(p.c_str()) != 0 && errno != ENOENT)
      fail_as(ErrorKind::io, "cannot save checkpoint '", file.string(), "': removing '", p.string(), "', ", what,
              ", failed: ", errno_text(errno));
    report.push_back("removed '" + p.string() + "', " + what);
  };
  // Journals are written holding the parent's lock: a temporary one now is a dead commit's.
  for (const auto& p : names_starting(parent, "." + commit_journal_path(file).filename().string() + ".tmp-"))
    remove(p, "the unfinished commit journal of a save that died before its commit point");
  for (const auto& target : targets)
    for (const auto& p : names_starting(parent, "." + target.filename().string() + ".tmp-")) {
      if (own.count(p)) continue;
      auto [lock, result] = DirLock::try_lock(p, /*directory=*/false);
      if (result == DirLock::Try::held) remove(p, "a temporary file of a save that did not finish");
      else if (result == DirLock::Try::busy) report.push_back("left '" + p.string() + "': a save in progress is writing it");
      else if (result == DirLock::Try::unsupported)
        report.push_back("left '" + p.string() + "': the file system cannot tell whether a save still writes it "
                         "(no flock); remove it by hand if none does");
    }
  return report;
}

}  // namespace detail

// Publishes `files` (written with StagedFile::write, or staged by hand) under their targets
// and removes `removes`, all or nothing for a reader (see the top of this file): the
// targets are siblings, `files` are renamed in their order, the first target of `files`
// (or of `removes`) names the journal. `targets` lists every name the set may have (a
// full checkpoint's model and optimizer files), whose leftovers it recovers first; `save`
// goes into the journal. Returns what it found of interrupted saves (one line each).
// Failures throw fsdp::Error naming the file: before the commit point the old files stay
// and the staged ones are removed (by their owners); after it, the journal stays, loads
// read the new files and the next commit finishes it.
inline std::vector<std::string> commit_files(std::vector<StagedFile>& files, const std::vector<std::filesystem::path>& removes,
                                             const std::vector<std::filesystem::path>& targets, const std::string& save) {
  if (targets.empty()) fsdp::detail::fail("commit_files: no targets");
  const std::filesystem::path& file = targets.front();
  const std::filesystem::path parent = detail::parent_or_dot(file);
  const std::filesystem::path journal_path = detail::commit_journal_path(file);
  std::set<std::filesystem::path> own;
  detail::CommitJournal journal{save, {}, {}};
  for (const StagedFile& f : files) {
    if (!f.pending()) fsdp::detail::fail("cannot commit checkpoint '", file.string(), "': '", f.target().string(), "' is not staged");
    own.insert(f.temp());
    journal.renames.emplace_back(f.temp().filename().string(), f.target().filename().string());
  }
  for (const auto& r : removes) journal.removes.push_back(r.filename().string());

  std::error_code ec;
  if (!std::filesystem::is_directory(parent, ec))
    fsdp::detail::fail_as(ErrorKind::io, "cannot save checkpoint '", file.string(), "': its parent directory '",
                          parent.string(), "' does not exist");
  const detail::DirLock lock = detail::DirLock::wait(parent, file);
  detail::at_commit_step(CommitStep::locked, file);
  std::vector<std::string> report = detail::recover_files_locked(file, targets, own);
  for (const auto& [from, to] : journal.renames) {  // refused before the commit point, not in the middle
    struct stat st {};
    if (::lstat((parent / to).c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", file.string(), "': '", (parent / to).string(),
                            "' exists and is a directory; refusing to replace it");
  }
  // Every staged file still where the journal will say (not removed by another save's
  // recovery between its creation and its flock): checked under the parent's lock, before
  // the commit point, so that a missing one fails here with the old files in place.
  for (const StagedFile& f : files) f.check_in_place(file);
  // The journal is written under its temporary name, then renamed: that rename is the
  // commit point and the last step that can fail before it. Everything after it, the
  // directory's fsync included, is after the commit point: the staged files are released
  // first (the visible journal names them: removing them would lose the previous files at
  // the next save's roll-forward) and failures say the journal stays.
  StagedFile staged_journal = StagedFile::write(journal_path, [&](FileSink& sink) { sink.write(journal.format()); });
  if (::rename(staged_journal.temp().c_str(), journal_path.c_str()) != 0)
    fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", file.string(), "': renaming '",
                          staged_journal.temp().string(), "' to its commit journal '", journal_path.string(),
                          "' failed: ", detail::errno_text(errno), "; nothing was committed");
  staged_journal.release();
  for (StagedFile& f : files) f.release();  // the journal names them now: never removed
  auto after_commit_point_because = [&](const std::string& what, const std::string& why) {
    fsdp::detail::fail_as(ErrorKind::io, "cannot commit checkpoint '", file.string(), "': ", what, " failed: ", why,
                          "; its commit journal '", journal_path.string(),
                          "' stays: loads read this save's files, the next save finishes the commit");
  };
  auto after_commit_point = [&](const std::string& what, int err) { after_commit_point_because(what, detail::errno_text(err)); };
  try {
    detail::at_commit_step(CommitStep::journal_renamed, file);
    detail::fsync_directory(parent);  // the journal's rename made durable
  } catch (const Error& e) {
    after_commit_point_because("syncing the directory '" + parent.string() + "' after writing the journal",
                               std::string(detail::message_of(e)));
  }
  detail::at_commit_step(CommitStep::journaled, file);
  const std::size_t changes = journal.removes.size() + journal.renames.size();
  std::size_t changed = 0;
  auto one_done = [&] {
    if (++changed == 1 && changes > 1) detail::at_commit_step(CommitStep::renamed_first, file);
  };
  for (const auto& name : journal.removes) {
    if (::unlink((parent / name).c_str()) != 0 && errno != ENOENT)
      after_commit_point("removing '" + (parent / name).string() + "'", errno);
    one_done();
  }
  for (const auto& [from, to] : journal.renames) {
    if (::rename((parent / from).c_str(), (parent / to).c_str()) != 0)
      after_commit_point("renaming '" + (parent / from).string() + "' to '" + (parent / to).string() + "'", errno);
    one_done();
  }
  detail::fsync_directory(parent);
  detail::at_commit_step(CommitStep::published, file);
  if (::unlink(journal_path.c_str()) != 0) after_commit_point("removing '" + journal_path.string() + "'", errno);
  detail::fsync_directory(parent);
  detail::at_commit_step(CommitStep::done, file);
  return report;
}

// Where a load reads each of `targets` (as for commit_files): the target itself, or the
// temporary file a commit journal names for it while that commit is unfinished; nullopt
// for a target that is absent, or that the journal removes. Reads only.
inline std::vector<std::optional<std::filesystem::path>> committed_files(const std::vector<std::filesystem::path>& targets) {
  std::vector<std::optional<std::filesystem::path>> out;
  if (targets.empty()) return out;
  const auto journal = detail::CommitJournal::read(targets.front(), targets);
  const std::filesystem::path parent = detail::parent_or_dot(targets.front());
  std::error_code ec;
  for (const auto& t : targets) {
    std::optional<std::filesystem::path> at;
    if (std::filesystem::exists(t, ec)) at = t;
    if (journal) {
      const std::string name = t.filename().string();
      for (const auto& r : journal->removes)
        if (r == name) at.reset();
      for (const auto& [from, to] : journal->renames)
        if (to == name && std::filesystem::exists(parent / from, ec)) at = parent / from;
    }
    out.push_back(std::move(at));
  }
  return out;
}

// What commit_files does first, for a caller that wants it without saving: finishes an
// interrupted commit's journal and removes dead saves' temporary files of `targets`.
inline std::vector<std::string> recover_file_leftovers(const std::vector<std::filesystem::path>& targets) {
  if (targets.empty()) return {};
  const detail::DirLock lock = detail::DirLock::wait(detail::parent_or_dot(targets.front()), targets.front());
  return detail::recover_files_locked(targets.front(), targets, {});
}

}  // namespace fsdp::checkpoint
