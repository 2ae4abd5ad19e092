// fsdp/checkpoint/sharded_checkpoint_reader.hpp: a sharded checkpoint written by N ranks
// read back by M ranks for every N, M in 1..5 (ranks that own nothing included), and every
// mismatch between the index and the files refused before anything is read.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fsdp/checkpoint/sharded_checkpoint_reader.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/sharded_fixture.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_sharded_checkpoint_reader_test {

using fsdp::DType;
using fsdp::StateKey;
using fsdp::checkpoint::Checksums;
using fsdp::checkpoint::CheckpointDirectory;
using fsdp::checkpoint::CheckpointIndex;
using fsdp::checkpoint::ShardedCheckpointReader;
using test_support::contains;
using test_support::error_of;

namespace {
std::filesystem::path saved(const test_support::TempDir& tmp, int n, int g = 1) {
  const auto dir = tmp / ("ckpt-" + std::to_string(n));
  test_support::save_fixture(dir, n, g);
  return dir;
}

// Rewrites index.json after `edit` (non-atomically: it is a test of the reader).
template <class Edit>
void edit_index(const std::filesystem::path& dir, Edit edit) {
  CheckpointIndex ix = CheckpointIndex::load(dir / "index.json");
  edit(ix);
  test_support::write_bytes(dir / "index.json", ix.dump());
}
}  // namespace

TEST_CASE("a checkpoint written by N ranks loads into M ranks, for N and M in 1..5") {
  test_support::TempDir tmp;
  for (int n = 1; n <= 5; ++n) {
    const auto dir = saved(tmp, n, n);
    for (int m = 1; m <= 5; ++m) {
      CAPTURE(n);
      CAPTURE(m);
      CHECK(test_support::check_fixture(dir, m) == n);
    }
  }
  // 5 ranks over the 1 element of the step count: ranks 1..4 own nothing and wrote a
  // count-0 slice of it, which the reads above went past.
  const CheckpointIndex ix = CheckpointIndex::load(tmp / "ckpt-5" / "index.json");
  std::vector<std::uint64_t> step_counts;
  for (const auto& s : ix.slices)
    if (s.id == StateKey::optim("fc.weight", "step")) step_counts.push_back(s.count);
  CHECK(step_counts == std::vector<std::uint64_t>{1, 0, 0, 0, 0});
}

TEST_CASE("reads check the destination size and the requested range") {
  test_support::TempDir tmp;
  const ShardedCheckpointReader reader(saved(tmp, 2));
  std::vector<float> out(10);
  CHECK(contains(error_of([&] { reader.read(StateKey::param("fc.weight"), 0, 10, out.data(), 39); }),
                 "reading 10 elements of 'fc.weight' needs 10 * 4 bytes but the destination has 39"));
  CHECK(contains(error_of([&] { reader.read(StateKey::param("fc.weight"), 30, 10, out.data(), 40); }),
                 "elements [30, +10) of 'fc.weight' are outside its 37 elements"));
  CHECK(contains(error_of([&] { reader.read(StateKey::param("fc.bias"), 0, 1, out.data(), 4); }), "no entry for 'fc.bias'"));
  reader.read(StateKey::param("fc.weight"), 15, 10, out.data(), 40);  // across both files
  for (int i = 0; i < 10; ++i) CHECK(out[i] == static_cast<float>(test_support::fixture_value(1, 0, 15 + i)));
}

TEST_CASE("a damaged file is found by its checksum when read, or skipped knowingly") {
  test_support::TempDir tmp;
  const auto dir = saved(tmp, 2);
  const auto file = dir / "rank-00001.safetensors";
  const auto f = fsdp::checkpoint::SafetensorsFile::open(file);
  const auto& t = f.at("fc.weight");
  std::string bytes = test_support::read_bytes(file);
  bytes[f.data_offset() + t.begin + 1] ^= 0x04;  // one bit of element 0 of this file's slice
  test_support::write_bytes(file, bytes);
  const ShardedCheckpointReader reader(dir);  // headers still fine: opens
  float x = 0;
  reader.read(StateKey::param("fc.weight"), 0, 1, &x, 4);  // rank 0's file: not damaged
  const test_support::Thrown damaged = test_support::thrown_by([&] { reader.read(StateKey::param("fc.weight"), 30, 1, &x, 4); });
  const std::string& err = damaged.message;
  CHECK(contains(err, "checkpoint '" + dir.string() + "': file 'rank-00001.safetensors': its XXH64 is "));
  CHECK(contains(err, "but the index says"));
  CHECK(damaged.kind == fsdp::ErrorKind::corrupt);
  CHECK(contains(error_of([&] { ShardedCheckpointReader(dir).verify_checksums(); }), "rank-00001.safetensors"));
  const ShardedCheckpointReader unchecked(dir, Checksums::skip);
  std::vector<float> v(37);
  unchecked.read(StateKey::param("fc.weight"), 0, 37, v.data(), v.size() * 4);
  CHECK(v[19] != static_cast<float>(test_support::fixture_value(1, 0, 19)));  // first element of rank 1
}

TEST_CASE("mismatches between the index and the files are refused when the checkpoint is opened") {
  test_support::TempDir tmp;
  struct Case {
    std::string what;
    std::function<void(const std::filesystem::path&)> damage;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"index missing", [](const auto& dir) { std::filesystem::remove(dir / "index.json"); }, "index.json' to read a checkpoint index: No such file"},
      {"file missing", [](const auto& dir) { std::filesystem::remove(dir / "rank-00001.safetensors"); },
       "rank-00001.safetensors' to read a safetensors file: No such file or directory"},
      {"file truncated", [](const auto& dir) { std::filesystem::resize_file(dir / "rank-00000.safetensors", 100); },
       "rank-00000.safetensors"},
      {"size differs", [](const auto& dir) { edit_index(dir, [](CheckpointIndex& ix) { ix.files[0].bytes += 8; }); },
       "file 'rank-00000.safetensors': it has "},
      {"dtype differs", [](const auto& dir) { edit_index(dir, [](CheckpointIndex& ix) { ix.entries[0].dtype = DType::i32; }); },
       "file 'rank-00000.safetensors': tensor 'fc.weight' is F32 with 19 elements but the index says 'fc.weight' is I32"},
      {"key missing", [](const auto& dir) { edit_index(dir, [](CheckpointIndex& ix) { ix.slices[1].key = "bn.var"; }); },
       "file 'rank-00000.safetensors': no tensor 'bn.var' (it holds buffer 'bn.mean')"},
      {"extra tensor in a file",
       [](const auto& dir) {
         edit_index(dir, [](CheckpointIndex& ix) {
           const StateKey mean = StateKey::buffer("bn.mean");  // its entry and slices go, its tensors stay
           std::erase_if(ix.entries, [&](const auto& e) { return e.id == mean; });
           std::erase_if(ix.slices, [&](const auto& s) { return s.id == mean; });
         });
       },
       "file 'rank-00000.safetensors': tensor 'bn.mean' is in no slice of the index"},
      // The index rewritten whole (its checksum recomputed): each rank file's own slice
      // metadata still disagrees. Both slices have 19 F32 elements, so only that sees it.
      {"keys of two slices swapped",
       [](const auto& dir) {
         edit_index(dir, [](CheckpointIndex& ix) {
           auto& a = ix.slices[0];  // rank 0's fc.weight [0, 19)
           auto& b = ix.slices[2];  // rank 0's exp_avg [0, 19)
           REQUIRE((a.key == "fc.weight" && b.key == "fc.weight.exp_avg" && a.count == b.count));
           std::swap(a.key, b.key);
         });
       },
       "file 'rank-00000.safetensors': the index says tensor 'fc.weight.exp_avg' is elements [0, +19) of 'fc.weight'"},
      {"world_size wrong", [](const auto& dir) { edit_index(dir, [](CheckpointIndex& ix) { ix.world_size = 3; }); },
       "index 'index.json': world_size is 3 but it lists 2 files"},
      {"a rank file the index does not list",
       [](const auto& dir) { std::filesystem::copy_file(dir / "rank-00001.safetensors", dir / "rank-00002.safetensors"); },
       "the directory holds 'rank-00002.safetensors', which the index (world_size 2) does not list"},
      {"files of another save", [](const auto& dir) { edit_index(dir, [](CheckpointIndex& ix) { ix.save_id ^= 1; }); },
       "file 'rank-00000.safetensors': it is from another save than the index (save id "},
      // index.json edited in place (a hand edit, a bit flip): its own checksum fails.
      {"keys swapped in the index's text",
       [](const auto& dir) {
         std::string text = test_support::read_bytes(dir / "index.json");
         const std::string a = "\"key\":\"fc.weight\",\"begin\":0,", b = "\"key\":\"fc.weight.exp_avg\",\"begin\":0,";
         const auto at_a = text.find(a), at_b = text.find(b);
         REQUIRE((at_a != std::string::npos && at_b != std::string::npos && at_a < at_b));
         text = text.substr(0, at_a) + b + text.substr(at_a + a.size(), at_b - at_a - a.size()) + a + text.substr(at_b + b.size());
         test_support::write_bytes(dir / "index.json", text);
       },
       "index.json': top level: its content does not match its checksum"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const auto dir = tmp / "ckpt";
    {
      CheckpointDirectory d = CheckpointDirectory::begin(dir);
      test_support::write_fixture(d, 2, 1);
      d.commit();
    }
    c.damage(dir);
    const test_support::Thrown t = test_support::thrown_by([&] { ShardedCheckpointReader reader(dir); });
    const std::string& err = t.message;
    CHECK_MESSAGE(contains(err, dir.string()), err);
    CHECK_MESSAGE(contains(err, c.expected), err);
    // A file that is not there cannot be opened (io); one that disagrees with the index is corrupt.
    const bool missing = c.what == "index missing" || c.what == "file missing";
    CHECK(t.kind == (missing ? fsdp::ErrorKind::io : fsdp::ErrorKind::corrupt));
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("rank files are named with five digits") {
  CHECK(fsdp::checkpoint::rank_file_name(0) == "rank-00000.safetensors");
  CHECK(fsdp::checkpoint::rank_file_name(12345) == "rank-12345.safetensors");
  CHECK(fsdp::checkpoint::rank_file_name(123456) == "rank-123456.safetensors");
}

}  // namespace checkpoint_sharded_checkpoint_reader_test
