// A full checkpoint (model file + optimizer file) is one unit: a save stopped at any step
// of its commit, by an exception or by the death of its process, leaves the previous pair
// or the new one, never old parameters next to new optimizer state; a load reads an
// unfinished commit's files without writing; the next save finishes or removes what was
// left and says so, and the saves after it leave nothing behind.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/child_process.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_full_commit_test {

using fsdp::checkpoint::CommitStep;
using test_support::Params;
using test_support::train;

namespace {

const std::vector<std::string> kPair{"model.optimizer.safetensors", "model.safetensors"};

// A full save on 2 ranks of a model of `seed` trained `steps` steps (its optimizer's step
// is `steps`), with metadata seed=<seed>; shared: every rank writes (else rank 0 gathers).
// Rank 0's report.
fsdp::SaveReport save(const std::filesystem::path& file, std::uint64_t seed, int steps, bool shared = true,
                      bool optimizer = true) {
  fsdp::SaveReport report;
  train<fsdp::FullShard>(2, 0, steps, seed, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int rank) {
    const std::map<std::string, std::string> metadata{{"seed", std::to_string(seed)}};
    fsdp::OptimizerState* optim = optimizer ? &st : nullptr;
    fsdp::SaveReport r;
    if (shared) {
      r = fsdp::save_full_checkpoint(file, sm, optim, metadata);
    } else {
      fsdp::detail::FullSave s(file, sm, optim, metadata, /*snapshot=*/false);
      s.commit(sm, fsdp::detail::captured([&] { s.write_streaming(); }));
      r.recovered = s.recovered();
    }
    if (rank == 0) report = r;
  });
  return report;
}

// One more step after loading `file` on 2 ranks: it depends on the parameters and on the
// optimizer's state, so it tells a whole pair from a mix.
Params resumed(const std::filesystem::path& file) {
  return train<fsdp::FullShard>(2, 5, 6, 99, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_full_checkpoint(file, sm, &st);
  }, nullptr);
}

// Which save (its seed) `file` loads as, checking that both files agree: the model's
// metadata and the optimizer's step (seed s was saved after s steps).
std::string loaded_seed(const std::filesystem::path& file) {
  const fsdp::FullCheckpointSource source(file);
  const std::string seed = source.metadata().at("seed");
  const auto scalars = source.optim_scalars();
  if (!scalars.empty()) CHECK(scalars.at("step") == seed);
  return seed;
}

using HookFor = test_support::CommitHookFor;
using test_support::mentions;

const std::vector<CommitStep> kSteps{CommitStep::locked, CommitStep::journaled, CommitStep::renamed_first,
                                     CommitStep::published, CommitStep::done};
bool after_commit_point(CommitStep s) { return s != CommitStep::locked; }
bool journal_left(CommitStep s) {
  return s == CommitStep::journaled || s == CommitStep::renamed_first || s == CommitStep::published;
}

// The next two saves into `file` succeed, the first reporting a finished journal when one
// was left, and each leaves exactly the pair; the last one loads whole.
void next_two_saves_clean_up(const test_support::TempDir& tmp, const std::filesystem::path& file, bool journal,
                             const Params& expected_last) {
  const auto first = save(file, 1, 1);
  CHECK(mentions(first.recovered, "finished the commit of save") == journal);
  CHECK(test_support::names_in(tmp.path()) == kPair);
  CHECK(loaded_seed(file) == "1");
  const auto second = save(file, 2, 2);
  CHECK(second.recovered.empty());
  CHECK(test_support::names_in(tmp.path()) == kPair);
  CHECK(loaded_seed(file) == "2");
  CHECK(resumed(file) == expected_last);
}

}  // namespace

TEST_CASE("a full save stopped at each step of its commit loads as the old pair or the new one, whole") {
  test_support::TempDir refs;
  save(refs / "one.safetensors", 1, 1);
  save(refs / "two.safetensors", 2, 2);
  const Params one = resumed(refs / "one.safetensors"), two = resumed(refs / "two.safetensors");
  REQUIRE(one != two);
  for (const bool shared : {true, false}) {
    for (const CommitStep step : kSteps) {
      CAPTURE(shared);
      CAPTURE(static_cast<int>(step));
      test_support::TempDir tmp;
      const auto file = tmp / "model.safetensors";
      save(file, 1, 1);
      {
        HookFor hook([&](CommitStep at, const std::filesystem::path& target) {
          if (at == step && target == file) throw std::runtime_error("stopped at this step of the commit");
        });
        const std::string err = test_support::error_of([&] { save(file, 2, 2, shared); });
        CHECK(test_support::contains(err, "stopped at this step of the commit"));
      }
      // A load reads one save's pair (parameters and optimizer state), and writes nothing.
      const auto before = test_support::names_in(tmp.path());
      CHECK(loaded_seed(file) == (after_commit_point(step) ? "2" : "1"));
      CHECK(resumed(file) == (after_commit_point(step) ? two : one));
      CHECK(test_support::names_in(tmp.path()) == before);
      CHECK(mentions(before, ".model.safetensors.commit-fsdp") == journal_left(step));
      next_two_saves_clean_up(tmp, file, journal_left(step), two);
    }
  }
}

TEST_CASE("a full save without an optimizer stopped midway never leaves a stale optimizer file with the new model") {
  for (const CommitStep step : kSteps) {
    CAPTURE(static_cast<int>(step));
    test_support::TempDir tmp;
    const auto file = tmp / "model.safetensors";
    save(file, 1, 1);
    {
      HookFor hook([&](CommitStep at, const std::filesystem::path&) {
        if (at == step) throw std::runtime_error("stopped at this step of the commit");
      });
      CHECK(test_support::contains(test_support::error_of([&] { save(file, 2, 2, true, /*optimizer=*/false); }),
                                   "stopped at this step"));
    }
    const fsdp::FullCheckpointSource source(file);
    if (after_commit_point(step)) {
      CHECK(source.metadata().at("seed") == "2");
      CHECK(source.optim_scalars().empty());  // the old optimizer file is not read with the new model
    } else {
      CHECK(loaded_seed(file) == "1");
      CHECK(!source.optim_scalars().empty());
    }
    const auto next = save(file, 3, 3, true, /*optimizer=*/false);
    CHECK(mentions(next.recovered, "finished the commit of save") == journal_left(step));
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"model.safetensors"});
    CHECK(fsdp::FullCheckpointSource(file).metadata().at("seed") == "3");
  }
}

TEST_CASE("a process killed at each step of a full commit leaves a whole pair; the next save finishes or removes its leftovers") {
  for (const CommitStep step : kSteps) {
    CAPTURE(static_cast<int>(step));
    test_support::TempDir tmp;
    const auto file = tmp / "model.safetensors";
    save(file, 1, 1);
    test_support::ChildProcess child([&](const test_support::Parent&) {
      fsdp::checkpoint::detail::commit_hook() = [&](CommitStep at, const std::filesystem::path&) {
        if (at == step) std::_Exit(3);  // as a kill: no destructor runs, the flocks die with the process
      };
      save(file, 2, 2);
    });
    const int status = child.wait();
    REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 3));
    CHECK(loaded_seed(file) == (after_commit_point(step) ? "2" : "1"));
    const auto first = save(file, 3, 3);
    CHECK(mentions(first.recovered, "finished the commit of save") == journal_left(step));
    // Killed before its commit point, the save's temporary files are a dead save's.
    CHECK(mentions(first.recovered, "a temporary file of a save that did not finish") == (step == CommitStep::locked));
    CHECK(test_support::names_in(tmp.path()) == kPair);
    CHECK(loaded_seed(file) == "3");
    CHECK(save(file, 2, 2).recovered.empty());
    CHECK(test_support::names_in(tmp.path()) == kPair);
    CHECK(loaded_seed(file) == "2");
  }
}

// The directory fsync right after the journal's rename comes after the commit point: it
// cannot undo the commit, so its failure fails the save with an fsdp::Error (io) naming the
// checkpoint, the directory and the journal, which stays with the new files it names (not
// removed as a failed save's); a load reads the new pair, writing nothing, and the next save
// rolls the journal forward and says so. CommitStep::journal_renamed's hook throws what a
// failed fsync_directory throws. Fails without commit_files' handling of that fsync (the
// error names no checkpoint or journal), or with the staged files released after the fsync
// instead of before (their owner removes them: the load and the roll-forward find save 1).
TEST_CASE("a directory fsync failing right after the journal's rename fails the save naming it; the journal rolls forward") {
  test_support::TempDir refs;
  save(refs / "two.safetensors", 2, 2);
  const Params two = resumed(refs / "two.safetensors");
  for (const bool shared : {true, false}) {
    CAPTURE(shared);
    test_support::TempDir tmp;
    const auto file = tmp / "model.safetensors";
    const auto journal = fsdp::checkpoint::detail::commit_journal_path(file);
    save(file, 1, 1);
    int fsyncs_failed = 0;
    test_support::Thrown thrown;
    {
      HookFor hook([&](CommitStep at, const std::filesystem::path& target) {
        if (at != CommitStep::journal_renamed || target != file) return;
        ++fsyncs_failed;
        fsdp::detail::fail_as(fsdp::ErrorKind::io, "cannot fsync '", tmp.path().string(), "': Input/output error");
      });
      thrown = test_support::thrown_by([&] { save(file, 2, 2, shared); });
    }
    REQUIRE(fsyncs_failed == 1);
    CHECK(thrown.kind == fsdp::ErrorKind::io);
    CHECK(test_support::contains(thrown.message, "cannot commit checkpoint '" + file.string() + "'"));
    CHECK(test_support::contains(thrown.message, "syncing the directory '" + tmp.path().string() +
                                                     "' after writing the journal failed: cannot fsync"));
    CHECK(test_support::contains(thrown.message, "Input/output error"));
    CHECK(test_support::contains(thrown.message, "its commit journal '" + journal.string() + "' stays"));
    // Past the commit point: the journal and the new pair under its temporary names stay.
    const auto before = test_support::names_in(tmp.path());
    CHECK(before.size() == 5);  // the old pair, the new pair's temporary files, the journal
    CHECK(mentions(before, journal.filename().string()));
    CHECK(loaded_seed(file) == "2");
    CHECK(resumed(file) == two);
    CHECK(test_support::names_in(tmp.path()) == before);
    next_two_saves_clean_up(tmp, file, /*journal=*/true, two);
  }
}

TEST_CASE("a live save's temporary file is left alone and reported; a dead save's is removed") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  save(file, 1, 1);
  {
    auto live = fsdp::checkpoint::StagedFile::write(file, [](fsdp::checkpoint::FileSink& s) { s.write("in progress"); });
    const auto report = save(file, 2, 2);
    CHECK(mentions(report.recovered, "left '" + live.temp().string() + "': a save in progress is writing it"));
    CHECK(std::filesystem::exists(live.temp()));
    CHECK(loaded_seed(file) == "2");
  }  // discarded
  CHECK(test_support::names_in(tmp.path()) == kPair);
  // A temporary file nobody holds (its writer died) and a journal's temporary file.
  test_support::write_bytes(tmp / ".model.optimizer.safetensors.tmp-1-dead", "partial");
  test_support::write_bytes(tmp / "..model.safetensors.commit-fsdp.tmp-1-dead", "{");
  const auto report = save(file, 1, 1);
  CHECK(report.recovered.size() == 2);
  CHECK(mentions(report.recovered, "a temporary file of a save that did not finish"));
  CHECK(mentions(report.recovered, "commit journal of a save that died before its commit point"));
  CHECK(test_support::names_in(tmp.path()) == kPair);
  CHECK(fsdp::checkpoint::recover_file_leftovers(fsdp::detail::full_checkpoint_targets(file)).empty());
}

TEST_CASE("a damaged commit journal is refused by the load and the save, naming it") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  save(file, 1, 1);
  const auto journal = tmp / ".model.safetensors.commit-fsdp";
  for (const std::string& text : {std::string("{\"fsdp_commit_journal\":1,"),
                                 std::string("{\"fsdp_commit_journal\":1,\"save_id\":\"0\",\"renames\":[{\"from\":\"../x\","
                                             "\"to\":\"model.safetensors\"}],\"removes\":[]}")}) {
    test_support::write_bytes(journal, text);
    const std::string load_error = test_support::error_of([&] { fsdp::FullCheckpointSource source(file); });
    CHECK(test_support::contains(load_error, "commit journal '" + journal.string() + "' is damaged"));
    const std::string save_error = test_support::error_of([&] { save(file, 2, 2); });
    CHECK(test_support::contains(save_error, "commit journal '" + journal.string() + "' is damaged"));
    std::filesystem::remove(journal);
    CHECK(test_support::names_in(tmp.path()) == kPair);  // the failed save left nothing
    CHECK(loaded_seed(file) == "1");
  }
}

}  // namespace checkpoint_full_commit_test
