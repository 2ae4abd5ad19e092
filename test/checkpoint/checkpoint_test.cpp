// Checkpoints on disk: sharded (a directory of rank files plus index.json) and full (one
// plain safetensors file), saved on N ranks after a few AdamW steps and resumed on M ranks
// with another strategy: training continues as if it had never stopped. A damaged or
// missing checkpoint is an error on every rank that names it, and loads nothing.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_checkpoint_test {

using test_support::Params;
using test_support::load_expecting_failure;
using test_support::resume;
using test_support::train;

namespace {

// `steps` steps of training on `world` ranks, then a sharded checkpoint of them in `dir`.
void save_sharded_after(int steps, int world, const std::filesystem::path& dir,
                        const std::map<std::string, std::string>& metadata = {}) {
  train<fsdp::FullShard>(world, 0, steps, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::save_sharded_checkpoint(dir, sm, &st, metadata);
  });
}

}  // namespace

TEST_CASE("a sharded checkpoint saved on N ranks resumes on M ranks and another strategy") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  for (const auto& ranks : {std::pair{2, 3}, {4, 1}, {1, 2}}) {
    const int n = ranks.first, m = ranks.second;  // not bound: CAPTURE captures them
    CAPTURE(n);
    CAPTURE(m);
    test_support::TempDir tmp;
    const auto dir = tmp / "ckpt";
    save_sharded_after(3, n, dir, {{"step", "3"}, {"loader", "epoch 0 batch 3"}});
    auto names = test_support::names_in(dir);
    CHECK(names.size() == static_cast<std::size_t>(n) + 1);  // rank files and index.json
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});  // no staging left
    const auto metadata = fsdp::read_checkpoint_metadata(dir);
    CHECK(metadata == std::map<std::string, std::string>{{"step", "3"}, {"loader", "epoch 0 batch 3"}});
    const Params resumed = resume(m, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::load_sharded_checkpoint(dir, sm, &st);
      CHECK(fsdp::ShardedCheckpointSource(dir).optim_scalars().at("step") == "3");
    });
    CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
  }
}

TEST_CASE("a zero-element parameter goes through a sharded checkpoint: a count-0 slice from every saving rank") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_sharded_after(1, 3, dir);
  const auto index = fsdp::checkpoint::CheckpointIndex::load(dir / "index.json");
  for (const auto& id : {fsdp::StateKey::param("blocks.0.adapter"), fsdp::StateKey::optim("blocks.0.adapter", "exp_avg")}) {
    CAPTURE(id.describe());
    const auto* entry = index.find(id);
    REQUIRE(entry != nullptr);
    CHECK(entry->shape == fsdp::checkpoint::Shape{0, 13});
    std::vector<std::string> files;
    for (const auto& s : index.slices)
      if (s.id == id) {
        CHECK(s.count == 0);
        files.push_back(s.file);
      }
    CHECK(files == std::vector<std::string>{fsdp::checkpoint::rank_file_name(0), fsdp::checkpoint::rank_file_name(1),
                                            fsdp::checkpoint::rank_file_name(2)});
  }
  // A strict load on another number of ranks needs it: it would be "missing" otherwise.
  train<fsdp::FullShard>(2, 0, 0, 7, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    const fsdp::ShardedCheckpointSource source(dir);
    const auto meta = source.find(fsdp::StateKey::param("blocks.0.adapter"));
    REQUIRE(meta.has_value());
    CHECK(meta->shape == std::vector<std::int64_t>{0, 13});
    fsdp::load_state(sm, source, &st);
  }, nullptr);
}

TEST_CASE("saving over an older sharded checkpoint replaces it") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  for (const char* step : {"1", "2"})
    save_sharded_after(1, 2, dir, {{"step", step}});
  CHECK(fsdp::read_checkpoint_metadata(dir).at("step") == "2");
  CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"ckpt"});
}

TEST_CASE("a full checkpoint is a plain safetensors file of every FQN and resumes on other ranks") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  for (const auto& ranks : {std::pair{3, 2}, {1, 3}}) {
    const int n = ranks.first, m = ranks.second;
    CAPTURE(n);
    CAPTURE(m);
    test_support::TempDir tmp;
    const auto file = tmp / "model.safetensors";
    train<fsdp::FullShard>(n, 0, 3, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::save_full_checkpoint(file, sm, &st, {{"step", "3"}});
    });
    CHECK(test_support::names_in(tmp.path()) == std::vector<std::string>{"model.optimizer.safetensors", "model.safetensors"});
    const auto opened = fsdp::checkpoint::SafetensorsFile::open(file);
    engine::Model probe(test_support::resume_config());
    for (auto& p : engine::named_parameters(probe)) {
      CAPTURE(p.fqn);
      const auto* t = opened.find(p.fqn);
      REQUIRE(t != nullptr);
      CHECK(t->numel() == static_cast<std::uint64_t>(p.param->numel()));
      CHECK(t->dtype == fsdp::DType::f32);
    }
    for (auto& b : engine::named_buffers(probe)) CHECK(opened.find(b.fqn) != nullptr);
    CHECK(fsdp::read_checkpoint_metadata(file) == std::map<std::string, std::string>{{"step", "3"}});
    fsdp::LoadOptions options;
    options.stage_in_host_memory = m == 3;  // both ways of reading
    const Params resumed = resume(m, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::load_full_checkpoint(file, sm, &st, options);
    });
    CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
  }
}

TEST_CASE("a full save by every rank into one shared file writes the gathering save's bytes") {
  test_support::TempDir tmp;
  for (const int world : {3, 4}) {  // uneven and even shards; 4 ranks leave some padding
    CAPTURE(world);
    const auto shared = tmp / ("shared-" + std::to_string(world) + ".safetensors");
    const auto gathered = tmp / ("gathered-" + std::to_string(world) + ".safetensors");
    std::vector<char> wrote_shared(static_cast<std::size_t>(world));
    train<fsdp::FullShard>(world, 0, 2, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
      fsdp::detail::FullSave a(shared, sm, &st, {{"step", "2"}}, /*snapshot=*/false);
      wrote_shared[static_cast<std::size_t>(r)] = fsdp::detail::save_full_shared(a, sm, &st);
      fsdp::detail::FullSave b(gathered, sm, &st, {{"step", "2"}}, /*snapshot=*/false);
      b.commit(sm, fsdp::detail::captured([&] { b.write_streaming(); }));
    });
    for (const char w : wrote_shared) CHECK(w);
    CHECK(test_support::bytes_without_save_id(shared) == test_support::bytes_without_save_id(gathered));
    CHECK(test_support::bytes_without_save_id(fsdp::optimizer_file_of(shared)) == test_support::bytes_without_save_id(fsdp::optimizer_file_of(gathered)));
    CHECK(test_support::read_bytes(shared).size() > 1000);
  }
  CHECK(test_support::names_in(tmp.path()).size() == 8);  // no temporary file left
}

TEST_CASE("ranks that do not share rank 0's file system make the full save gather instead, leaving nothing") {
  test_support::TempDir tmp;
  std::vector<char> wrote_shared(2, 1);
  train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    // Each rank's own directory stands for its own host's disk: same name, other files.
    const auto own = tmp / ("host" + std::to_string(r));
    std::filesystem::create_directories(own);
    fsdp::detail::FullSave save(own / "model.safetensors", sm, &st, {}, /*snapshot=*/false);
    wrote_shared[static_cast<std::size_t>(r)] = fsdp::detail::save_full_shared(save, sm, &st);
  });
  CHECK_FALSE(wrote_shared[0]);
  CHECK_FALSE(wrote_shared[1]);
  CHECK(test_support::names_in(tmp / "host0").empty());
  CHECK(test_support::names_in(tmp / "host1").empty());
}

TEST_CASE("a full save that fails, shared or gathering, fails on every rank and leaves no temporary file") {
  // Where it fails: creating the files (no such directory), or publishing them (the
  // optimizer file's name is taken by a directory), after every byte was written.
  for (const bool shared : {true, false}) {
    for (const bool at_publish : {false, true}) {
      CAPTURE(shared);
      CAPTURE(at_publish);
      test_support::TempDir tmp;
      const auto file = at_publish ? tmp / "model.safetensors" : tmp / "missing" / "model.safetensors";
      if (at_publish) std::filesystem::create_directories(fsdp::optimizer_file_of(file) / "kept");
      std::vector<std::string> errors(2);
      train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
        errors[static_cast<std::size_t>(r)] = test_support::error_of([&] {
          if (shared) return (void)fsdp::save_full_checkpoint(file, sm, &st);
          fsdp::detail::FullSave save(file, sm, &st, {}, /*snapshot=*/false);  // the fallback's way
          save.commit(sm, fsdp::detail::captured([&] { save.write_streaming(); }));
        });
      });
      for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(test_support::contains(e, "save_full_checkpoint '" + file.string() + "'"));
      }
      const auto left = at_publish ? std::vector<std::string>{"model.optimizer.safetensors"} : std::vector<std::string>{};
      CHECK(test_support::names_in(tmp.path()) == left);
      if (at_publish) CHECK(test_support::names_in(fsdp::optimizer_file_of(file)) == std::vector<std::string>{"kept"});
    }
  }
}

TEST_CASE("a corrupted rank file fails the load on every rank, naming the file, and loads nothing") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_sharded_after(2, 2, dir);
  const auto victim = dir / fsdp::checkpoint::rank_file_name(1);
  std::string bytes = test_support::read_bytes(victim);
  REQUIRE(bytes.size() > 16);
  bytes[bytes.size() - 5] ^= 0x40;  // in the data, not the header
  test_support::write_bytes(victim, bytes);
  for (const bool staged : {false, true}) {  // checked then read in place, or read into host memory first
    CAPTURE(staged);
    fsdp::LoadOptions options;
    options.stage_in_host_memory = staged;
    const auto failed = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::load_sharded_checkpoint(dir, sm, &st, options);
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(r);
      CAPTURE(failed.errors[r]);
      CHECK(test_support::contains(failed.errors[r], fsdp::checkpoint::rank_file_name(1)));
      CHECK(test_support::contains(failed.errors[r], "XXH64"));
      // The checkpoint is named once, not by the load and again by the check that failed.
      const std::string& e = failed.errors[r];
      const auto first = e.find(dir.string());
      CHECK(first != std::string::npos);
      CHECK(e.find(dir.string(), first + 1) == std::string::npos);
      CHECK(failed.untouched[r]);
    }
  }
}

namespace {

// A checkpoint whose reads fail on rank 1 from the `fail_from`-th read_all call on (an I/O
// error): every check passes, so only where the failing read happens differs.
class FailingReads final : public fsdp::StateSource {
 public:
  FailingReads(const std::filesystem::path& dir, int rank, int fail_from) : inner_(dir), rank_(rank), fail_from_(fail_from) {}
  std::string name() const override { return inner_.name(); }
  std::optional<fsdp::TensorMeta> find(const fsdp::StateKey& k) const override { return inner_.find(k); }
  void read(const fsdp::StateKey& k, std::int64_t b, std::int64_t c, void* d) const override { inner_.read(k, b, c, d); }
  std::vector<fsdp::StateKey> keys() const override { return inner_.keys(); }
  std::map<std::string, std::string> optim_scalars() const override { return inner_.optim_scalars(); }
  bool reads_in_place() const override { return inner_.reads_in_place(); }
  void verify(int rank, int ranks) const override { inner_.verify(rank, ranks); }
  std::string agree_damage(const std::function<bool(bool)>& agree) const override { return inner_.agree_damage(agree); }
  void read_all(std::span<const fsdp::ReadRequest> requests, int rank, int ranks) const override {
    if (rank_ == 1 && ++calls_ >= fail_from_) fsdp::detail::fail("simulated EIO reading ", name());
    inner_.read_all(requests, rank, ranks);
  }

 private:
  fsdp::ShardedCheckpointSource inner_;
  int rank_, fail_from_;
  mutable int calls_ = 0;
};

}  // namespace

TEST_CASE("an I/O error after the checks: staged, nothing is loaded; in place, every rank says the load is partial") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_sharded_after(2, 2, dir);
  fsdp::LoadOptions staged;
  staged.stage_in_host_memory = true;
  // Staged: the one read_all (everything into host memory) fails on rank 1.
  const auto before = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int rank) {
    fsdp::load_state(sm, FailingReads(dir, rank, 1), &st, staged);
  });
  // In place: the first read_all (the buffers) passes; the second (into the model) fails.
  const auto after = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int rank) {
    fsdp::load_state(sm, FailingReads(dir, rank, 2), &st);
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(before.errors[r]);
    CAPTURE(after.errors[r]);
    CHECK(test_support::contains(before.errors[r], "nothing was loaded"));
    CHECK(before.untouched[r]);
    CHECK(test_support::contains(after.errors[r], "partially loaded"));
    CHECK(test_support::contains(after.errors[r], dir.string()));
  }
  CHECK(test_support::contains(before.errors[1], "simulated EIO"));
  CHECK(test_support::contains(after.errors[1], "simulated EIO"));
  CHECK_FALSE(after.untouched[0]);  // rank 0's reads landed: the load really was in place
}

TEST_CASE("a checkpoint that does not exist is an error naming it on every rank") {
  test_support::TempDir tmp;
  const auto dir = tmp / "no-such-checkpoint";
  const auto sharded = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_sharded_checkpoint(dir, sm, &st);
  });
  const auto full = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
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

}  // namespace checkpoint_checkpoint_test
