// Checkpoints verified end to end (fsdp_metadata.hpp, save_id.hpp, the index's checksum and
// its cross-checks in sharded_checkpoint_reader.hpp): real checkpoints, saved by training
// ranks, damaged the ways that used to load silently wrong, each refused on every rank
// naming the file, with the model and the optimizer untouched:
//  - two tensors' data_offsets swapped in a full checkpoint's header;
//  - the data checksums' key misspelt (fsdp.data_xxh64 -> fsdp.data_xxi64) plus a data bit flip;
//  - a model file next to an optimizer file of another save;
//  - two slices' keys or begins swapped in index.json, in place or with its checksum redone;
//  - a wrong world_size; a rank file of another save; another format version.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_checkpoint_integrity_test {

using fsdp::checkpoint::CheckpointIndex;
using fsdp::checkpoint::SafetensorsFile;
using test_support::contains;
using test_support::load_expecting_failure;
using test_support::train;

namespace {

// `text` with the only occurrences of `x` and `y` exchanged (x first or y first).
std::string swapped(const std::string& text, std::string x, std::string y) {
  auto at_x = text.find(x), at_y = text.find(y);
  REQUIRE((at_x != std::string::npos && at_y != std::string::npos));
  REQUIRE(text.find(x, at_x + 1) == std::string::npos);
  REQUIRE(text.find(y, at_y + 1) == std::string::npos);
  if (at_y < at_x) std::swap(x, y), std::swap(at_x, at_y);
  return text.substr(0, at_x) + y + text.substr(at_x + x.size(), at_y - at_x - x.size()) + x + text.substr(at_y + y.size());
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

// A full checkpoint (with its optimizer file) after `steps` steps on 2 ranks.
void save_full(const std::filesystem::path& file, int steps) {
  train<fsdp::FullShard>(2, 0, steps, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::save_full_checkpoint(file, sm, &st, {{"step", std::to_string(steps)}});
  });
}

void save_sharded(const std::filesystem::path& dir, int steps, int ranks = 2) {
  train<fsdp::FullShard>(ranks, 0, steps, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::save_sharded_checkpoint(dir, sm, &st, {{"step", std::to_string(steps)}});
  });
}

// Loads `path` on 2 ranks expecting every rank to fail with all of `expected` in its
// message and its model and optimizer untouched.
void check_refused(const std::filesystem::path& path, const std::vector<std::string>& expected) {
  const bool sharded = std::filesystem::is_directory(path);
  const auto failed = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    if (sharded) fsdp::load_sharded_checkpoint(path, sm, &st);
    else fsdp::load_full_checkpoint(path, sm, &st);
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(failed.errors[r]);
    CHECK(!failed.errors[r].empty());
    for (const auto& e : expected) CHECK(contains(failed.errors[r], e));
    CHECK(failed.untouched[r]);
  }
}

}  // namespace

TEST_CASE("a full checkpoint whose header had two tensors' data_offsets swapped is refused") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  save_full(file, 1);
  // Two tensors of one size: every other check of the header passes after the swap.
  const auto f = SafetensorsFile::open(file);
  const fsdp::checkpoint::TensorInfo *a = nullptr, *b = nullptr;
  for (const auto& t : f.tensors())
    for (const auto& u : f.tensors())
      if (!a && &t != &u && t.bytes() == u.bytes() && t.bytes() > 0 && t.dtype == u.dtype) a = &t, b = &u;
  REQUIRE(a != nullptr);
  auto offsets = [](const fsdp::checkpoint::TensorInfo& t) {
    return "\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]";
  };
  test_support::write_bytes(file, swapped(test_support::read_bytes(file), offsets(*a), offsets(*b)));
  check_refused(file, {"checkpoint file '" + file.string() + "'", "its header does not match its checksum"});
}

TEST_CASE("a full checkpoint whose data checksums' key is misspelt, with a data bit flipped, is refused") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  save_full(file, 1);
  const std::uint64_t data_at = SafetensorsFile::open(file).data_offset();
  std::string bytes = replaced(test_support::read_bytes(file), "\"fsdp.data_xxh64\"", "\"fsdp.data_xxi64\"");
  bytes[data_at + 5] ^= 0x20;
  test_support::write_bytes(file, bytes);
  check_refused(file, {"checkpoint file '" + file.string() + "'", "unknown metadata key 'fsdp.data_xxi64'"});
}

TEST_CASE("a full checkpoint of another format version is refused, naming the file and both versions") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  save_full(file, 1);
  test_support::write_bytes(file, replaced(test_support::read_bytes(file), "\"fsdp.format_version\":\"2\"",
                                           "\"fsdp.format_version\":\"3\""));
  check_refused(file, {"checkpoint file '" + file.string() + "': checkpoint format version 3, but this build reads version 2"});
}

TEST_CASE("a model file next to an optimizer file of another save is refused, naming both") {
  test_support::TempDir tmp;
  const auto a = tmp / "a.safetensors", b = tmp / "b.safetensors";
  save_full(a, 1);
  save_full(b, 2);
  const auto a_optim = fsdp::optimizer_file_of(a);
  CHECK(SafetensorsFile::open(a).metadata().at("fsdp.save_id") == SafetensorsFile::open(a_optim).metadata().at("fsdp.save_id"));
  std::filesystem::copy_file(fsdp::optimizer_file_of(b), a_optim, std::filesystem::copy_options::overwrite_existing);
  check_refused(a, {"checkpoint '" + a.string() + "' and its optimizer file '" + a_optim.string() + "' are from different saves"});
}

TEST_CASE("a sharded checkpoint whose index had two slices' keys swapped is refused") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_sharded(dir, 1);
  const auto index = dir / "index.json";
  const CheckpointIndex ix = CheckpointIndex::load(index);
  // A parameter's slice and its exp_avg's in the same file: same dtype, same count.
  const fsdp::checkpoint::IndexSlice *p = nullptr, *m = nullptr;
  for (const auto& s : ix.slices)
    for (const auto& t : ix.slices)
      if (!p && s.id.kind == fsdp::StateKind::param && t.id == fsdp::StateKey::optim(s.id.fqn, "exp_avg") &&
          s.file == t.file && s.count > 0)
        p = &s, m = &t;
  REQUIRE(p != nullptr);
  auto key_text = [](const fsdp::checkpoint::IndexSlice& s) {
    return "\"file\":\"" + s.file + "\",\"key\":\"" + s.key + "\"";
  };
  const std::string good = test_support::read_bytes(index);
  SUBCASE("in place: the index's checksum") {
    test_support::write_bytes(index, swapped(good, key_text(*p), key_text(*m)));
    check_refused(dir, {"checkpoint index '" + index.string() + "'", "its content does not match its checksum"});
  }
  SUBCASE("with the index's checksum redone: each rank file's own slices") {
    CheckpointIndex edited = ix;
    for (auto& s : edited.slices)
      if (s.file == p->file && (s.key == p->key || s.key == m->key)) s.key = s.key == p->key ? m->key : p->key;
    test_support::write_bytes(index, edited.dump());
    check_refused(dir, {"checkpoint '" + dir.string() + "': file '" + p->file + "': the index says tensor '"});
  }
}

TEST_CASE("a sharded checkpoint whose index had two slices' begins swapped is refused") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt";
  save_sharded(dir, 1, 4);  // 4 ranks: a tensor over three shards or more has slices of one size
  const auto index = dir / "index.json";
  const CheckpointIndex ix = CheckpointIndex::load(index);
  // Rank 0's and rank 1's slices of one tensor, of one size: their begins exchanged, every
  // element is still in exactly one slice, so only the checksum sees it.
  const fsdp::checkpoint::IndexSlice *x = nullptr, *y = nullptr;
  for (const auto& s : ix.slices)
    for (const auto& t : ix.slices)
      if (!x && s.id == t.id && s.file < t.file && s.count > 0 && t.count == s.count) x = &s, y = &t;
  REQUIRE(x != nullptr);
  auto begin_text = [](const fsdp::checkpoint::IndexSlice& s) {
    return "\"key\":\"" + s.key + "\",\"begin\":" + std::to_string(s.begin) + ",";
  };
  auto with_begin = [](const fsdp::checkpoint::IndexSlice& s, std::uint64_t begin) {
    return "\"key\":\"" + s.key + "\",\"begin\":" + std::to_string(begin) + ",";
  };
  std::string text = test_support::read_bytes(index);
  const std::string file_x = "\"file\":\"" + x->file + "\",", file_y = "\"file\":\"" + y->file + "\",";
  text = replaced(text, file_x + begin_text(*x), file_x + with_begin(*x, y->begin));
  text = replaced(text, file_y + begin_text(*y), file_y + with_begin(*y, x->begin));
  test_support::write_bytes(index, text);
  check_refused(dir, {"checkpoint index '" + index.string() + "'", "its content does not match its checksum"});
}

TEST_CASE("a sharded checkpoint with a wrong world_size, another format version or a rank file of another save is refused") {
  test_support::TempDir tmp;
  const auto dir = tmp / "ckpt", other = tmp / "other";
  save_sharded(dir, 1);
  save_sharded(other, 2);
  const auto index = dir / "index.json";
  const std::string good = test_support::read_bytes(index);
  SUBCASE("world_size, in place") {
    test_support::write_bytes(index, replaced(good, "\"world_size\": 2", "\"world_size\": 3"));
    check_refused(dir, {"checkpoint index '" + index.string() + "'", "its content does not match its checksum"});
  }
  SUBCASE("world_size, checksum redone") {
    CheckpointIndex ix = CheckpointIndex::load(index);
    ix.world_size = 1;
    test_support::write_bytes(index, ix.dump());
    check_refused(dir, {"checkpoint '" + dir.string() + "': index 'index.json': world_size is 1 but it lists 2 files"});
  }
  SUBCASE("another format version") {
    test_support::write_bytes(index, replaced(good, "\"version\": 2", "\"version\": 3"));
    check_refused(dir, {"checkpoint index '" + index.string() + "'", "checkpoint format version 3, but this build reads version 2"});
  }
  SUBCASE("a rank file of another save") {
    std::filesystem::copy_file(other / "rank-00001.safetensors", dir / "rank-00001.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    check_refused(dir, {"checkpoint '" + dir.string() + "': file 'rank-00001.safetensors': it is from another save than the index"});
  }
  SUBCASE("every file of one save carries the index's save id") {
    const CheckpointIndex ix = CheckpointIndex::load(index);
    CHECK(ix.save_id != 0);
    CHECK(ix.save_id != CheckpointIndex::load(other / "index.json").save_id);
    for (const auto& f : ix.files)
      CHECK(fsdp::checkpoint::save_id_of(SafetensorsFile::open(dir / f.name).metadata()) == ix.save_id);
    CHECK(contains(good, "\"save_id\": \"" + fsdp::checkpoint::format_save_id(ix.save_id) + "\""));
  }
}

}  // namespace checkpoint_checkpoint_integrity_test
