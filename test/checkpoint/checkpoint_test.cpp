// Checkpoints on disk: sharded (a directory of rank files plus index.json) and full (one
// plain safetensors file), saved on N ranks after a few AdamW steps and resumed on M ranks
// with another strategy: training continues as if it had never stopped. A damaged or
// missing checkpoint is an error on every rank that names it, and loads nothing.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/support/errors.hpp"
#include "test/support/reference_training.hpp"

namespace {

using Params = test_support::Params;
using Hook = std::function<void(fsdp::ShardedModel&, engine::AdamWState&, int)>;

engine::ModelConfig config(std::uint64_t seed = 1) {
  engine::ModelConfig c;
  c.blocks = 3;
  c.seed = seed;
  return c;
}

constexpr int kGlobalBatch = 12;  // divisible by 1, 2, 3, 4

// Steps [first, last) of AdamW training on `world` ranks after `before` on each rank, then
// `after`. Returns rank 0's full parameters.
template <class Strategy>
Params train(int world, int first, int last, std::uint64_t seed, const Hook& before, const Hook& after) {
  auto c = config(seed);
  std::vector<Params> out(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    engine::AdamWState state(opt, sm);
    if (before) before(sm, state, comm.rank());
    const int local = kGlobalBatch / world;
    for (int s = first; s < last; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
    if (after) after(sm, state, comm.rank());
    out[static_cast<std::size_t>(comm.rank())] = engine::gather_full_parameters(model, sm);
  });
  return out[0];
}

Params resume(int m, const Hook& load) {
  // seed 7: the fresh model starts elsewhere, so only the load can bring it back.
  return m % 2 ? train<fsdp::ShardGradOp>(m, 3, 6, 7, load, nullptr) : train<fsdp::FullShard>(m, 3, 6, 7, load, nullptr);
}

// Every rank's error and whether its parameters stayed as they were, for a load on 2 ranks.
struct FailedLoad {
  std::vector<std::string> errors = std::vector<std::string>(2);
  std::vector<bool> untouched = std::vector<bool>(2);
};
FailedLoad load_expecting_failure(const std::function<void(fsdp::ShardedModel&, engine::AdamWState&)>& load) {
  FailedLoad out;
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    engine::Model model(config(7));
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::AdamW opt({});
    engine::AdamWState st(opt, sm);
    const Params before = engine::gather_full_parameters(model, sm);
    out.errors[r] = test_support::error_of([&] { load(sm, st); });
    out.untouched[r] = engine::gather_full_parameters(model, sm) == before && opt.step_count() == 0;
  });
  return out;
}

}  // namespace

TEST_CASE("a sharded checkpoint saved on N ranks resumes on M ranks and another strategy") {
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  for (auto [n, m] : {std::pair{2, 3}, {4, 1}, {1, 2}}) {
    CAPTURE(n);
    CAPTURE(m);
    test_support::TempDir tmp;
    const auto dir = tmp / "ckpt";
    train<fsdp::FullShard>(n, 0, 3, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::save_sharded_checkpoint(dir, sm, &st, {{"step", "3"}, {"loader", "epoch 0 batch 3"}});
    });
    auto names = test_support::names_in(dir);
    CHECK(names.size() == static_cast<std::size_t>(n) + 1);  // rank files and index.json
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});  // no staging left
    const auto metadata = fsdp::read_checkpoint_metadata(dir);
    CHECK(metadata == std::map<std::string, std::string>{{"step", "3"}, {"loader", "epoch 0 batch 3"}});
    const Params resumed = resume(m, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      auto report = fsdp::load_sharded_checkpoint(dir, sm, &st);
      CHECK(report.missing.empty());
      CHECK(report.unexpected.empty());
      CHECK(fsdp::ShardedCheckpointSource(dir).optim_scalars().at("step") == "3");
    });
    CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
  }
}

TEST_CASE("saving over an older sharded checkpoint replaces it") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  for (const char* step : {"1", "2"})
    train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::save_sharded_checkpoint(dir, sm, &st, {{"step", step}});
    });
  CHECK(fsdp::read_checkpoint_metadata(dir).at("step") == "2");
  CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
}

TEST_CASE("a full checkpoint is a plain safetensors file of every FQN and resumes on other ranks") {
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  for (auto [n, m] : {std::pair{3, 2}, {1, 3}}) {
    CAPTURE(n);
    CAPTURE(m);
    test_support::TempDir tmp;
    const auto file = tmp / "model.safetensors";
    train<fsdp::FullShard>(n, 0, 3, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::save_full_checkpoint(file, sm, &st, {{"step", "3"}});
    });
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"model.optimizer.safetensors", "model.safetensors"});
    const auto opened = fsdp::checkpoint::SafetensorsFile::open(file);
    engine::Model probe(config());
    for (auto& p : engine::named_parameters(probe)) {
      CAPTURE(p.fqn);
      const auto* t = opened.find(p.fqn);
      REQUIRE(t != nullptr);
      CHECK(t->numel() == static_cast<std::uint64_t>(p.param->numel()));
      CHECK(t->dtype == fsdp::DType::f32);
    }
    for (auto& b : engine::named_buffers(probe)) CHECK(opened.find(b.fqn) != nullptr);
    CHECK(fsdp::read_checkpoint_metadata(file) == std::map<std::string, std::string>{{"step", "3"}});
    const Params resumed = resume(m, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      auto report = fsdp::load_full_checkpoint(file, sm, &st);
      CHECK(report.missing.empty());
      CHECK(report.unexpected.empty());
    });
    CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
  }
}

TEST_CASE("a corrupted rank file fails the load on every rank, naming the file, and loads nothing") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  train<fsdp::FullShard>(2, 0, 2, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::save_sharded_checkpoint(dir, sm, &st);
  });
  const auto victim = dir / fsdp::checkpoint::rank_file_name(1);
  std::string bytes = test_support::read_bytes(victim);
  REQUIRE(bytes.size() > 16);
  bytes[bytes.size() - 5] ^= 0x40;  // in the data, not the header
  test_support::write_bytes(victim, bytes);
  const auto failed = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st) {
    fsdp::load_sharded_checkpoint(dir, sm, &st);
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(failed.errors[r]);
    CHECK(test_support::contains(failed.errors[r], fsdp::checkpoint::rank_file_name(1)));
    CHECK(test_support::contains(failed.errors[r], "XXH64"));
    CHECK(failed.untouched[r]);
  }
}

TEST_CASE("a checkpoint that does not exist is an error naming it on every rank") {
  test_support::TempDir tmp;
  const auto dir = tmp / "no-such-checkpoint";
  const auto sharded = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st) {
    fsdp::load_sharded_checkpoint(dir, sm, &st);
  });
  const auto full = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st) {
    fsdp::load_full_checkpoint(dir / "model.safetensors", sm, &st);
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(sharded.errors[r]);
    CAPTURE(full.errors[r]);
    CHECK(test_support::contains(sharded.errors[r], dir.string()));
    CHECK(test_support::contains(full.errors[r], "model.safetensors"));
    CHECK(sharded.untouched[r]);
    CHECK(full.untouched[r]);
  }
}

TEST_CASE("a save that fails on one rank fails on every rank and leaves no checkpoint") {
  test_support::TempDir tmp;
  const auto dir = tmp / "missing-parent" / "ckpt";  // rank 0 cannot create the staging directory
  std::vector<std::string> errors(2);
  train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    errors[static_cast<std::size_t>(r)] = test_support::error_of([&] { fsdp::save_sharded_checkpoint(dir, sm, &st); });
  });
  CHECK(test_support::contains(errors[0], "missing-parent"));
  CHECK(test_support::contains(errors[1], "another rank failed"));
  CHECK(test_support::names_in(tmp.path()).empty());
  // Reserved metadata keys are refused on every rank before anything is written.
  const auto ok_dir = tmp / "ckpt";
  train<fsdp::FullShard>(2, 0, 0, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    CHECK(test_support::contains(test_support::error_of([&] { fsdp::save_sharded_checkpoint(ok_dir, sm, &st, {{"optim.step", "1"}}); }),
                                 "reserved"));
  });
  CHECK(test_support::names_in(tmp.path()).empty());
}
