// fsdp/checkpoint/checkpoint_directory.hpp: a checkpoint directory is complete or absent
// (or the previous one), whatever happens during the save: an exception, an abort, or the
// process killed at any point, including between commit's renames.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/checkpoint/checkpoint_directory.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/child_process.hpp"
#include "test/checkpoint/sharded_fixture.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_checkpoint_directory_test {

using fsdp::checkpoint::checkpoint_leftovers;
using fsdp::checkpoint::CheckpointDirectory;
using fsdp::checkpoint::FileSink;
using fsdp::checkpoint::restore_interrupted_checkpoint;
using test_support::check_fixture;
using test_support::contains;
using test_support::error_of;
using test_support::names_in;
using test_support::save_fixture;
using test_support::write_fixture;

TEST_CASE("commit publishes a complete directory and leaves nothing else") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  CheckpointDirectory d = CheckpointDirectory::begin(dir, "tok");
  CHECK(d.staging() == tmp / fsdp::checkpoint::detail::sibling_name(dir, "partial", "tok"));
  CHECK(d.staging().filename().string().size() == std::string("ckpt.partial-fsdp-").size() + 16);
  CHECK(d.target() == dir);
  CHECK(d.pending());
  write_fixture(d, 3, 1);
  CHECK(!std::filesystem::exists(dir));  // nothing visible before commit
  d.commit();
  CHECK(!d.pending());
  CHECK(check_fixture(dir, 2) == 1);
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  CHECK(names_in(dir) == std::vector<std::string>{"index.json", "rank-00000.safetensors", "rank-00001.safetensors",
                                                  "rank-00002.safetensors"});
  // Replacing it: the new one in place, the old one gone.
  save_fixture(dir, 2, 2);
  CHECK(check_fixture(dir, 3) == 2);
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  CHECK(checkpoint_leftovers(dir).empty());
  // A trailing slash names the same directory.
  save_fixture(tmp.path() / "ckpt/", 2, 3);
  CHECK(check_fixture(dir, 1) == 3);
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
}

TEST_CASE("an abandoned save removes its staging directory and leaves the old checkpoint") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_fixture(dir, 2, 1);
  {
    CheckpointDirectory d = CheckpointDirectory::begin(dir);
    write_fixture(d, 2, 2);
  }  // destroyed without commit
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  CHECK(check_fixture(dir, 2) == 1);
  const std::string err = error_of([&] {
    CheckpointDirectory d = CheckpointDirectory::begin(dir);
    write_fixture(d, 2, 2, [n = 0]() mutable {
      if (++n == 4) throw std::runtime_error("rank 1 failed during the save");
    });
    d.commit();
  });
  CHECK(contains(err, "rank 1 failed during the save"));
  CHECK(contains(err, "rank-00000.safetensors"));  // the file being written when it failed
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  CHECK(check_fixture(dir, 1) == 1);
  CheckpointDirectory d = CheckpointDirectory::begin(dir);
  d.abort();
  CHECK(!d.pending());
  CHECK(!std::filesystem::exists(d.staging()));
  CHECK(contains(error_of([&] { d.commit(); }), "already committed or aborted"));
}

TEST_CASE("misuse is refused with the checkpoint path") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  CHECK(contains(error_of([&] { CheckpointDirectory::begin(tmp / "missing" / "ckpt"); }),
                 "its parent directory '" + (tmp / "missing").string() + "' does not exist"));
  CHECK(contains(error_of([&] { CheckpointDirectory::begin(dir, "a/b"); }), "staging token 'a/b' must be"));
  CHECK(contains(error_of([&] { CheckpointDirectory::begin(dir, ""); }), "staging token ''"));
  CHECK(contains(error_of([&] { CheckpointDirectory::begin("."); }), "must name a directory"));
  CHECK(contains(error_of([&] { CheckpointDirectory::begin(".."); }), "must name a directory"));
  CHECK(contains(error_of([&] { CheckpointDirectory::begin("/"); }), "must name a directory"));
  CheckpointDirectory d = CheckpointDirectory::begin(dir, "same");
  CHECK(contains(error_of([&] { CheckpointDirectory::begin(dir, "same"); }), "File exists"));
  CHECK(contains(error_of([&] { d.file("../escape"); }), "file name '../escape' must be one plain path component"));
  CHECK(contains(error_of([&] { d.file(".."); }), "must be one plain path component"));
  CHECK(contains(error_of([&] { d.file(""); }), "must be one plain path component"));
  d.write_file("a.bin", [](FileSink& s) { s.write("a"); });
  d.commit();
  CHECK(contains(error_of([&] { d.commit(); }), "checkpoint '" + dir.string() + "': cannot commit it: it was already committed"));
  CHECK(contains(error_of([&] { d.write_file("b.bin", [](FileSink&) {}); }), "cannot write a file into it"));
  // A regular file where the directory should go is not replaced.
  test_support::write_bytes(tmp / "file", "precious");
  CheckpointDirectory f = CheckpointDirectory::begin(tmp / "file");
  CHECK(contains(error_of([&] { f.commit(); }), "it exists and is not a directory"));
  CHECK(test_support::read_bytes(tmp / "file") == "precious");
}

TEST_CASE("other writers find the staging directory by its token") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  CheckpointDirectory d = CheckpointDirectory::begin(dir, "step-40_r0");
  const auto staging = CheckpointDirectory::staging_path(dir, "step-40_r0");
  CHECK(staging == d.staging());
  fsdp::checkpoint::write_file_atomically(staging / "from-rank-1", [](FileSink& s) { s.write("1"); });
  d.commit();
  CHECK(test_support::read_bytes(dir / "from-rank-1") == "1");
}

TEST_CASE("a crash between commit's renames leaves the old checkpoint, which restore puts back") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  CHECK(!restore_interrupted_checkpoint(dir));  // nothing at all
  save_fixture(dir, 2, 1);
  CHECK(!restore_interrupted_checkpoint(dir));  // nothing to restore
  using fsdp::checkpoint::detail::sibling_name;
  std::filesystem::rename(dir, tmp / sibling_name(dir, "old", "abc"));  // what the first rename did
  std::filesystem::create_directory(tmp / sibling_name(dir, "partial", "abc"));
  CHECK(checkpoint_leftovers(dir) ==
        std::vector<std::filesystem::path>{tmp / sibling_name(dir, "old", "abc"), tmp / sibling_name(dir, "partial", "abc")});
  CHECK(restore_interrupted_checkpoint(dir));
  CHECK(check_fixture(dir, 2) == 1);
  std::filesystem::rename(dir, tmp / sibling_name(dir, "old", "1"));
  std::filesystem::copy(tmp / sibling_name(dir, "old", "1"), tmp / sibling_name(dir, "old", "2"),
                        std::filesystem::copy_options::recursive);
  const std::string err = error_of([&] { restore_interrupted_checkpoint(dir); });
  CHECK(contains(err, "several old copies exist"));
  CHECK(contains(err, sibling_name(dir, "old", "1")));
  CHECK(contains(err, sibling_name(dir, "old", "2")));
}

TEST_CASE("a user's own ckpt.old-* and ckpt.partial-* siblings are never removed, restored or loaded") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_fixture(dir, 2, 1);
  // Copies a user made by hand, each a complete checkpoint, and an fsdp-looking name without its hex.
  const std::vector<std::string> mine = {"ckpt.old-backup", "ckpt.partial-run2", "ckpt.old-fsdp", "ckpt.old-fsdp-xyz",
                                         "ckpt.partial-fsdp-0123456789abcdef0"};
  for (const auto& name : mine) std::filesystem::copy(dir, tmp / name, std::filesystem::copy_options::recursive);
  // An fsdp-named old copy without an index.json: not a checkpoint, left alone too.
  std::filesystem::create_directory(tmp / fsdp::checkpoint::detail::sibling_name(dir, "old", "empty"));
  CHECK(checkpoint_leftovers(dir).size() == 1);
  CHECK(fsdp::checkpoint::recover_leftovers(dir).empty());
  save_fixture(dir, 2, 2);
  for (const auto& name : mine) CHECK(check_fixture(tmp / name, 2) == 1);
  CHECK(std::filesystem::exists(tmp / fsdp::checkpoint::detail::sibling_name(dir, "old", "empty")));
  // With `dir` absent, a load does not read a user's copy, and nothing restores one.
  std::filesystem::remove_all(dir);
  CHECK(fsdp::checkpoint::committed_checkpoint_dir(dir) == dir);
  CHECK(!restore_interrupted_checkpoint(dir));
  CHECK(!std::filesystem::exists(dir));
  save_fixture(dir, 2, 3);
  for (const auto& name : mine) CHECK(check_fixture(tmp / name, 2) == 1);
}

TEST_CASE("a process killed at each step of a commit leaves a loadable checkpoint; the next saves recover and clean up") {
  using fsdp::checkpoint::CommitStep;
  for (const CommitStep step : {CommitStep::locked, CommitStep::moved_aside, CommitStep::published, CommitStep::done}) {
    CAPTURE(static_cast<int>(step));
    test_support::TempDir tmp;
    const auto dir = tmp / "ckpt";
    save_fixture(dir, 2, 1);
    test_support::ChildProcess child([&](const test_support::Parent&) {
      fsdp::checkpoint::detail::commit_hook() = [&](CommitStep at, const std::filesystem::path&) {
        if (at == step) std::_Exit(3);  // as a kill: no destructor runs, no lock is released by hand
      };
      save_fixture(dir, 2, 2);
    });
    const int status = child.wait();
    REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 3));
    // (a) A load finds the old checkpoint or the new one, whole (between the renames: the old copy).
    const bool published = step == CommitStep::published || step == CommitStep::done;
    CHECK(check_fixture(fsdp::checkpoint::committed_checkpoint_dir(dir), 3) == (published ? 2 : 1));
    const std::size_t left = checkpoint_leftovers(dir).size();
    CHECK(left == (step == CommitStep::moved_aside ? 2u : step == CommitStep::done ? 0u : 1u));
    // (b) The next save recovers or removes every leftover and says so; it and one more succeed.
    CheckpointDirectory d = CheckpointDirectory::begin(dir);
    CHECK(d.recovered().size() == left);
    if (step == CommitStep::moved_aside)
      CHECK((!d.recovered().empty() && contains(d.recovered().back(), "restored '" + dir.string() + "'")));
    write_fixture(d, 2, 3);
    d.commit();
    CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
    CHECK(check_fixture(dir, 1) == 3);
    save_fixture(dir, 3, 4);
    CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
    CHECK(check_fixture(dir, 2) == 4);
  }
}

TEST_CASE("the next save leaves a staging directory alone while its save is alive, and removes it once it died") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  CheckpointDirectory live = CheckpointDirectory::begin(dir, "live");
  write_fixture(live, 2, 1);
  const auto dead = tmp / fsdp::checkpoint::detail::sibling_name(dir, "partial", "dead");
  std::filesystem::create_directory(dead);  // a save killed before it locked
  const auto found = fsdp::checkpoint::recover_leftovers(dir);
  REQUIRE(found.size() == 2);
  const bool dead_first = dead < live.staging();
  CHECK(contains(found[dead_first ? 0 : 1], "removed '" + dead.string() + "'"));
  CHECK(contains(found[dead_first ? 1 : 0], "left '" + live.staging().string() + "': a save in progress"));
  CHECK(std::filesystem::exists(live.staging() / "index.json"));
  live.commit();
  CHECK(check_fixture(dir, 2) == 1);
  CHECK(fsdp::checkpoint::recover_leftovers(dir).empty());
}

namespace {
// Leftovers of a killed save: gone before the next round.
void clean_leftovers(const std::filesystem::path& dir) {
  for (const auto& p : checkpoint_leftovers(dir)) std::filesystem::remove_all(p);
}
}  // namespace

TEST_CASE("a process killed at chosen points of a save leaves the old checkpoint or the new one") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_fixture(dir, 2, 1);
  // Stops: while producing each of the first 3 tensors (files partly written), after all
  // files and the index but before commit, and after commit.
  for (int kill_at : {1, 2, 3, 4, 5}) {
    CAPTURE(kill_at);
    test_support::ChildProcess child([&](const test_support::Parent& parent) {
      CheckpointDirectory d = CheckpointDirectory::begin(dir);
      int tensors = 0;
      write_fixture(d, 2, 2, [&] {
        if (++tensors <= 3) {
          parent.report('t');
          parent.wait_for_go();
        }
      });
      parent.report('c');
      parent.wait_for_go();
      d.commit();
      parent.report('d');
      parent.wait_for_go();
    });
    for (int stop = 1; stop <= kill_at; ++stop) {
      REQUIRE(child.next() == (stop <= 3 ? 't' : stop == 4 ? 'c' : 'd'));
      if (stop < kill_at) child.go();
    }
    child.kill();
    REQUIRE(WIFSIGNALED(child.wait()));
    CHECK(!restore_interrupted_checkpoint(dir));
    CHECK(check_fixture(dir, 3) == (kill_at <= 4 ? 1 : 2));
    CHECK(checkpoint_leftovers(dir).size() == (kill_at <= 4 ? 1u : 0u));  // the killed save's staging
    clean_leftovers(dir);
    if (kill_at == 5) save_fixture(dir, 2, 1);
  }
}

TEST_CASE("a process killed at random points of repeated saves always leaves a complete checkpoint") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_fixture(dir, 2, 1);
  int restored = 0, generation_seen = 0;
  for (int round = 0; round < 12; ++round) {
    test_support::ChildProcess child([&](const test_support::Parent&) {
      for (int g = 2;; ++g) save_fixture(dir, 2, g);
    });
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + 8000 * round));
    child.kill();
    REQUIRE(WIFSIGNALED(child.wait()));
    restored += restore_interrupted_checkpoint(dir) ? 1 : 0;
    // Throws unless the checkpoint there is complete, with every element of one generation.
    generation_seen = std::max(generation_seen, check_fixture(dir, 1 + round % 5));
    clean_leftovers(dir);
  }
  MESSAGE("latest generation seen ", generation_seen, "; restored after a kill between renames ", restored, " times");
}

}  // namespace checkpoint_checkpoint_directory_test

namespace checkpoint_checkpoint_directory_test {

// A staged file that another save's recovery removed (between its creation and its flock),
// or that was replaced by another file of its name, fails the commit before its journal:
// the previous files stay, no journal is left. Fails without commit_files' check_in_place
// (the journal was written, then the commit failed midway renaming the missing file).
TEST_CASE("commit_files refuses, before its commit point, a staged file that is gone or replaced") {
  using fsdp::checkpoint::StagedFile;
  test_support::TempDir tmp;
  const auto model = tmp / "m.safetensors", optim = tmp / "m.optimizer.safetensors";
  const std::vector<std::filesystem::path> targets{model, optim};
  auto stage = [&](const std::string& text) {
    std::vector<StagedFile> files;
    files.push_back(StagedFile::write(optim, [&](FileSink& s) { s.write("optim " + text); }));
    files.push_back(StagedFile::write(model, [&](FileSink& s) { s.write("model " + text); }));
    return files;
  };
  {
    auto files = stage("old");
    fsdp::checkpoint::commit_files(files, {}, targets, "0000000000000001");
  }
  for (const bool replaced : {false, true}) {
    CAPTURE(replaced);
    auto files = stage("new");
    const auto temp = files[1].temp();
    std::filesystem::remove(temp);  // what a recovery that found it unlocked did
    if (replaced) test_support::write_bytes(temp, "someone else's");
    const std::string err = error_of([&] { fsdp::checkpoint::commit_files(files, {}, targets, "0000000000000002"); });
    CHECK(contains(err, temp.string()));
    CHECK(contains(err, replaced ? "is no longer the file this save wrote" : "is gone"));
    CHECK(contains(err, "nothing was committed"));
    CHECK(!std::filesystem::exists(fsdp::checkpoint::detail::commit_journal_path(model)));
    CHECK(test_support::read_bytes(model) == "model old");
    CHECK(test_support::read_bytes(optim) == "optim old");
    std::filesystem::remove(temp);
  }
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"m.optimizer.safetensors", "m.safetensors"});
}

// Under the parent's lock a commit and a recovery only rename; the old copy and dead staging
// directories are deleted after the lock is released (a huge deletion must not hold every
// save into that parent). The `done` hook runs after the old copy's removal: the parent's
// lock must be free by then (busy without the fix). A trash directory a killed removal left
// is removed by the next save and reported.
TEST_CASE("old copies and dead staging directories are deleted after the parent's lock is released") {
  using fsdp::checkpoint::CommitStep;
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_fixture(dir, 2, 1);
  bool checked = false;
  fsdp::checkpoint::detail::commit_hook() = [&](CommitStep at, const std::filesystem::path&) {
    if (at != CommitStep::done) return;
    auto [lock, result] = fsdp::checkpoint::detail::DirLock::try_lock(tmp.path());
    CHECK(result == fsdp::checkpoint::detail::DirLock::Try::held);
    CHECK(checkpoint_leftovers(dir).empty());
    checked = true;
  };
  save_fixture(dir, 2, 2);
  fsdp::checkpoint::detail::commit_hook() = nullptr;
  CHECK(checked);
  const auto trash = tmp / fsdp::checkpoint::detail::sibling_name(dir, "trash", "killed");
  std::filesystem::copy(dir, trash, std::filesystem::copy_options::recursive);
  CHECK(checkpoint_leftovers(dir) == std::vector<std::filesystem::path>{trash});
  CheckpointDirectory d = CheckpointDirectory::begin(dir);
  REQUIRE(d.recovered().size() == 1);
  CHECK(contains(d.recovered()[0], "removed '" + trash.string() + "'"));
  CHECK(!std::filesystem::exists(trash));
  write_fixture(d, 2, 3);
  d.commit();
  CHECK(names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  CHECK(check_fixture(dir, 2) == 3);
}

}  // namespace checkpoint_checkpoint_directory_test
