// A checkpoint is one save's files or none: two jobs saving into one directory at once
// never publish a mix (each save stages under its own token, commits take turns), and a
// sharded commit stopped at any of its steps leaves the old or the new checkpoint
// loadable, whose leftovers the next save recovers or removes and reports. A load that
// meets a commit mid-open retries and loads the new save; a damaged one fails after its
// retries.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_checkpoint_commit_test {

using fsdp::checkpoint::CommitStep;
using test_support::Params;
using test_support::train;

namespace {

// The parameters of an untrained model of `seed` (what a job of that seed saves).
Params params_of(std::uint64_t seed) { return train<fsdp::FullShard>(2, 0, 0, seed, nullptr, nullptr); }

// `saves` sharded saves of an untrained model of `seed` on 2 ranks into `dir`; rank 0's reports.
std::vector<fsdp::SaveReport> save_seed(std::uint64_t seed, const std::filesystem::path& dir, int saves = 1) {
  std::vector<fsdp::SaveReport> reports;
  train<fsdp::FullShard>(2, 0, 0, seed, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int rank) {
    for (int i = 0; i < saves; ++i) {
      auto report = fsdp::save_sharded_checkpoint(dir, sm, &st, {{"seed", std::to_string(seed)}});
      if (rank == 0) reports.push_back(std::move(report));
    }
  });
  return reports;
}

// The parameters a 2-rank load of `dir` gives.
Params load(const std::filesystem::path& dir) {
  return train<fsdp::FullShard>(2, 0, 0, 99, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_sharded_checkpoint(dir, sm, &st);
  }, nullptr);
}

using HookFor = test_support::CommitHookFor;
using test_support::mentions;

// Sets the hook before each open of a ShardedCheckpointSource for its lifetime.
struct OpenHookFor {
  explicit OpenHookFor(std::function<void(const std::filesystem::path&, int)> hook) {
    fsdp::detail::sharded_open_hook() = std::move(hook);
  }
  ~OpenHookFor() { fsdp::detail::sharded_open_hook() = nullptr; }
  OpenHookFor(const OpenHookFor&) = delete;
  OpenHookFor& operator=(const OpenHookFor&) = delete;
};

// Copies `names` from directory `from` over those in `to`.
void copy_over(const std::filesystem::path& from, const std::filesystem::path& to, const std::vector<std::string>& names) {
  for (const auto& n : names)
    std::filesystem::copy_file(from / n, to / n, std::filesystem::copy_options::overwrite_existing);
}

const std::vector<std::string> kRankFiles{"rank-00000.safetensors", "rank-00001.safetensors"};

}  // namespace

TEST_CASE("two jobs saving sharded checkpoints into one directory at once never publish a mix") {
  const Params a = params_of(1), b = params_of(2);
  REQUIRE(a != b);
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    test_support::TempDir tmp;
    const auto dir = tmp / "ckpt";
    std::string error_a, error_b;
    std::thread job_a([&] { error_a = test_support::error_of([&] { save_seed(1, dir, 4); }); });
    std::thread job_b([&] { error_b = test_support::error_of([&] { save_seed(2, dir, 4); }); });
    job_a.join();
    job_b.join();
    CHECK(error_a == "");  // commits take turns: both jobs' saves succeed, the last one wins
    CHECK(error_b == "");
    REQUIRE(std::filesystem::exists(dir / "index.json"));
    const Params loaded = load(dir);
    CHECK((loaded == a || loaded == b));
    const std::string seed = fsdp::read_checkpoint_metadata(dir).at("seed");
    CHECK(loaded == (seed == "1" ? a : b));  // the index and the rank files are one save's
    CHECK(fsdp::checkpoint::checkpoint_leftovers(dir).empty());
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  }
}

TEST_CASE("a sharded commit stopped at each step leaves a loadable checkpoint, and the next saves clean up") {
  const Params old_params = params_of(1), new_params = params_of(2);
  for (const CommitStep step : {CommitStep::locked, CommitStep::moved_aside, CommitStep::published, CommitStep::done}) {
    CAPTURE(static_cast<int>(step));
    test_support::TempDir tmp;
    const auto dir = tmp / "ckpt";
    save_seed(1, dir);
    {
      HookFor hook([&](CommitStep at, const std::filesystem::path&) {
        if (at == step) throw std::runtime_error("stopped at this step of the commit");
      });
      const std::string err = test_support::error_of([&] { save_seed(2, dir); });
      CHECK(test_support::contains(err, "stopped at this step of the commit"));
    }
    // (a) A load gives the old checkpoint or the new one, whole.
    const bool published = step == CommitStep::published || step == CommitStep::done;
    CHECK(load(dir) == (published ? new_params : old_params));
    // (b) The next two saves succeed and leave nothing else; the first says what it found.
    const auto first = save_seed(3, dir);
    REQUIRE(first.size() == 1);
    if (step == CommitStep::moved_aside) CHECK(mentions(first[0].recovered, "restored '" + dir.string() + "'"));
    if (step == CommitStep::published) CHECK(mentions(first[0].recovered, "ckpt.old-"));
    if (step == CommitStep::locked || step == CommitStep::done) CHECK(first[0].recovered.empty());
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
    const auto second = save_seed(2, dir);
    REQUIRE(second.size() == 1);
    CHECK(second[0].recovered.empty());
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
    CHECK(load(dir) == new_params);
  }
}

// Two ranks that open different saves (a commit landing between rank 0's open and rank 1's,
// stood for here by giving the ranks two paths, each a whole checkpoint) must not load: every
// rank fails naming both save ids, and nothing is written. Fails without the agreement on the
// opened save id in open_and_load (each rank then loads its own save).
TEST_CASE("a load whose ranks opened different saves fails on every rank, naming both save ids") {
  test_support::TempDir tmp;
  const auto a = tmp / "a", b = tmp / "b";
  save_seed(1, a);
  save_seed(2, b);
  const auto id_of = [](const std::filesystem::path& dir) {
    return fsdp::checkpoint::format_save_id(fsdp::ShardedCheckpointSource(dir).save_id());
  };
  const auto failed = test_support::load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int rank) {
    fsdp::load_sharded_checkpoint(rank == 0 ? a : b, sm, &st);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(test_support::contains(failed.errors[r], "the ranks opened different saves"));
    CHECK(test_support::contains(failed.errors[r], id_of(a)));
    CHECK(test_support::contains(failed.errors[r], id_of(b)));
    CHECK(failed.untouched[r]);
  }
  // The same for full checkpoints (model file + optimizer file).
  const auto fa = tmp / "a.safetensors", fb = tmp / "b.safetensors";
  for (const auto& [path, seed] : {std::pair{fa, 1}, std::pair{fb, 2}}) {
    const std::filesystem::path& file = path;  // a lambda may not capture a structured binding (clang 14)
    train<fsdp::FullShard>(2, 0, 1, static_cast<std::uint64_t>(seed), nullptr,
                           [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) { fsdp::save_full_checkpoint(file, sm, &st); });
  }
  const auto full_failed = test_support::load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int rank) {
    fsdp::load_full_checkpoint(rank == 0 ? fa : fb, sm, &st);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(test_support::contains(full_failed.errors[r], "the ranks opened different saves"));
    CHECK(test_support::contains(full_failed.errors[r], fsdp::checkpoint::format_save_id(fsdp::FullCheckpointSource(fa).save_id())));
    CHECK(test_support::contains(full_failed.errors[r], fsdp::checkpoint::format_save_id(fsdp::FullCheckpointSource(fb).save_id())));
    CHECK(full_failed.untouched[r]);
  }
}

// A commit that lands inside a load's open (after it read index.json, before it opened the
// rank files) shows the open one save's index with another save's rank files. That moment
// cannot be timed from outside, so the open hook sets it up: at the first attempt `dir` holds
// save 1's index with save 2's rank files (the commit of save 2 landed mid-open), from the
// second on save 2 whole (the commit is done). The open is retried and loads save 2, whole.
// Fails without open_reader's retry (the mix is reported as a rank file of another save).
TEST_CASE("a sharded load that meets a commit mid-open is retried and loads the new save whole") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt", next = tmp / "next";
  save_seed(1, dir);
  save_seed(2, next);
  const Params two = params_of(2);
  REQUIRE(params_of(1) != two);
  const std::uint64_t next_id = fsdp::ShardedCheckpointSource(next).save_id();
  std::vector<int> attempts;
  Params loaded;
  {
    OpenHookFor hook([&](const std::filesystem::path& at, int attempt) {
      if (at != dir) return;
      attempts.push_back(attempt);
      if (attempt == 1) copy_over(next, dir, kRankFiles);  // save 1's index, save 2's rank files
      if (attempt == 2) copy_over(next, dir, {"index.json"});  // save 2 whole
    });
    // One rank: the hook runs on one thread, once per attempt.
    loaded = train<fsdp::FullShard>(1, 0, 0, 99, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::load_sharded_checkpoint(dir, sm, &st);
    }, nullptr);
  }
  CHECK(attempts == std::vector<int>{1, 2});
  CHECK(loaded == two);
  const fsdp::ShardedCheckpointSource source(dir);
  CHECK(source.save_id() == next_id);
  CHECK(source.metadata().at("seed") == "2");
}

// A checkpoint that stays damaged (here a rank file of another save, a mix no commit ever
// finishes) fails the same way at every attempt: the open gives up after its 3 attempts
// (pauses of 20 and 40 ms), with an error naming the checkpoint, the file and why, and a load
// on every rank fails saying so and writes nothing. Fails if the open does not retry (1
// attempt) or never stops retrying (the hook stops it at the 10th with another error).
TEST_CASE("a sharded checkpoint that stays damaged fails after the retries, naming the file, in bounded time") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt", other = tmp / "other";
  save_seed(1, dir);
  save_seed(2, other);
  copy_over(other, dir, {"rank-00001.safetensors"});
  int attempts = 0;
  test_support::Thrown thrown;
  const auto start = std::chrono::steady_clock::now();
  {
    OpenHookFor hook([&](const std::filesystem::path&, int) {
      if (++attempts == 10) throw std::runtime_error("the open is still retrying after 10 attempts");
    });
    thrown = test_support::thrown_by([&] { fsdp::ShardedCheckpointSource source(dir); });
  }
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(attempts == 3);
  CHECK(took < std::chrono::seconds(5));
  CHECK(thrown.kind == fsdp::ErrorKind::corrupt);
  CHECK(test_support::contains(thrown.message, "checkpoint '" + dir.string() + "': file 'rank-00001.safetensors'"));
  CHECK(test_support::contains(thrown.message, "it is from another save than the index"));
  const auto failed = test_support::load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_sharded_checkpoint(dir, sm, &st);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(test_support::contains(failed.errors[r], "file 'rank-00001.safetensors'"));
    CHECK(test_support::contains(failed.errors[r], "from another save than the index"));
    CHECK(failed.untouched[r]);
  }
}

}  // namespace checkpoint_checkpoint_commit_test
