// Asynchronous saves: the checkpoint holds the state at the save call although training
// goes on while it is written, it appears only at wait() (the commit), the next save waits
// for the previous one, try_commit() commits once every rank's files are written, a failed
// background write fails every rank at wait(), and a save never waited for leaves nothing
// behind and the older checkpoint intact.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/checkpoint/async_checkpoint.hpp>
#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_async_checkpoint_test {

using test_support::Params;
using test_support::resume;

namespace {

// Calls `at(step, checkpointer, rank)` before each of `steps` AdamW steps of training on
// `world` ranks (FullShard), and `at(steps, ...)` after the last.
using AtStep = std::function<void(int step, fsdp::AsyncCheckpointer&, fsdp::ShardedModel&, int rank)>;

void train_with_checkpointer(int world, int steps, const AtStep& at) {
  const auto c = test_support::resume_config(1);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    engine::AdamWState state(opt, sm);
    fsdp::AsyncCheckpointer ckpt(sm, &state);
    const int local = test_support::kGlobalBatch / world;
    for (int s = 0; s <= steps; ++s) {
      at(s, ckpt, sm, comm.rank());
      if (s < steps) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
    }
  });
}

}  // namespace

TEST_CASE("an asynchronous sharded save holds the state of its call, while training goes on, and resumes on other ranks") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  std::vector<int> absent_before_wait(2, 0), pending(2, 0);  // not vector<bool>: ranks write apart
  std::vector<fsdp::AsyncSaveTiming> timing(2);
  train_with_checkpointer(2, 5, [&](int s, fsdp::AsyncCheckpointer& ckpt, fsdp::ShardedModel&, int r) {
    const auto i = static_cast<std::size_t>(r);
    if (s == 3) {
      ckpt.save_sharded(dir, {{"step", "3"}});
      pending[i] = ckpt.pending();
      absent_before_wait[i] = !std::filesystem::exists(dir);  // committed only at wait()
    }
    if (s == 5) {  // two more steps changed the model meanwhile
      ckpt.wait();
      CHECK_FALSE(ckpt.pending());
      timing[i] = ckpt.last_timing();
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(pending[r]);
    CHECK(absent_before_wait[r]);
    CHECK(timing[r].bytes > 0);
    CHECK(timing[r].write_s > 0);
    CHECK(timing[r].hidden_fraction() >= 0.0);
    CHECK(timing[r].hidden_fraction() <= 1.0);
  }
  CHECK(fsdp::read_checkpoint_metadata(dir) == std::map<std::string, std::string>{{"step", "3"}});
  CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
  const Params resumed = resume(3, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_sharded_checkpoint(dir, sm, &st);
  });
  CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
}

TEST_CASE("an asynchronous full save is one plain file of the state at its call") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  train_with_checkpointer(2, 4, [&](int s, fsdp::AsyncCheckpointer& ckpt, fsdp::ShardedModel&, int) {
    if (s == 3) ckpt.save_full(file, {{"step", "3"}});
    if (s == 4) ckpt.wait();
  });
  CHECK(fsdp::read_checkpoint_metadata(file) == std::map<std::string, std::string>{{"step", "3"}});
  const Params resumed = resume(1, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_full_checkpoint(file, sm, &st);
  });
  CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
}

TEST_CASE("the next save waits for the one in flight: both are committed, each with its own step") {
  test_support::TempDir tmp;
  train_with_checkpointer(2, 3, [&](int s, fsdp::AsyncCheckpointer& ckpt, fsdp::ShardedModel&, int) {
    if (s == 1) ckpt.save_sharded(tmp / "a", {{"step", "1"}});
    if (s == 2) {
      ckpt.save_sharded(tmp / "b", {{"step", "2"}});
      CHECK(std::filesystem::exists(tmp / "a"));  // committed by the second save's call
    }
    if (s == 3) ckpt.wait();
  });
  CHECK(fsdp::read_checkpoint_metadata(tmp / "a").at("step") == "1");
  CHECK(fsdp::read_checkpoint_metadata(tmp / "b").at("step") == "2");
  const fsdp::ShardedCheckpointSource a(tmp / "a"), b(tmp / "b");
  CHECK(a.optim_scalars().at("step") == "1");
  CHECK(b.optim_scalars().at("step") == "2");
}

TEST_CASE("try_commit commits once every rank's files are written, the same call on every rank, and never waits") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  std::vector<std::vector<int>> answers(2);  // each rank's try_commit results, call by call
  std::vector<int> absent_while_false(2, 1), present_after(2, 0), no_save_answer(2, 1), pending_after(2, 1);
  train_with_checkpointer(2, 3, [&](int s, fsdp::AsyncCheckpointer& ckpt, fsdp::ShardedModel&, int r) {
    const auto i = static_cast<std::size_t>(r);
    if (s == 0 && r == 0) no_save_answer[i] = ckpt.try_commit();  // nothing pending: no collective (rank 1 does not call)
    if (s != 1) return;
    ckpt.save_sharded(dir, {{"step", "1"}});
    // Bounded: a small model's files are written in milliseconds; the ranks leave together,
    // as every call returns the same on every rank.
    for (int call = 0; call < 5000; ++call) {
      const bool committed = ckpt.try_commit();
      answers[i].push_back(committed);
      if (committed) break;
      if (std::filesystem::exists(dir)) absent_while_false[i] = 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    present_after[i] = std::filesystem::exists(dir);
    pending_after[i] = ckpt.pending();
  });
  CHECK(no_save_answer[0] == 0);
  CHECK(answers[0] == answers[1]);  // the ranks agreed at every call
  REQUIRE_FALSE(answers[0].empty());
  CHECK(answers[0].back() == 1);
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(absent_while_false[r]);
    CHECK(present_after[r]);
    CHECK_FALSE(pending_after[r]);
  }
  CHECK(fsdp::read_checkpoint_metadata(dir) == std::map<std::string, std::string>{{"step", "1"}});
  CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
}

TEST_CASE("a save never waited for is discarded: no staging left, the older checkpoint intact") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  train_with_checkpointer(2, 2, [&](int s, fsdp::AsyncCheckpointer& ckpt, fsdp::ShardedModel& sm, int) {
    if (s == 0) fsdp::save_sharded_checkpoint(dir, sm, nullptr, {{"step", "0"}});
    if (s == 1) ckpt.save_sharded(dir, {{"step", "1"}});
    // never waited: the checkpointer is destroyed at the end of training
  });
  CHECK(fsdp::read_checkpoint_metadata(dir).at("step") == "0");
  CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
}

TEST_CASE("a background write that fails on one rank fails wait() on every rank and commits nothing") {
  test_support::TempDir tmp;
  const auto file = tmp / "missing" / "model.safetensors";  // rank 0 writes; the directory is not there
  std::vector<std::string> errors(2);
  train_with_checkpointer(2, 1, [&](int s, fsdp::AsyncCheckpointer& ckpt, fsdp::ShardedModel&, int r) {
    if (s != 0) return;
    ckpt.save_full(file);
    errors[static_cast<std::size_t>(r)] = test_support::error_of([&] { ckpt.wait(); });
    CHECK_FALSE(ckpt.pending());
  });
  CHECK(test_support::contains(errors[0], "model.safetensors"));
  CHECK(test_support::contains(errors[1], "another rank failed"));
  CHECK(test_support::names_in(tmp.path()).empty());
}

}  // namespace checkpoint_async_checkpoint_test
