// fsdp/checkpoint/checkpoint_index.hpp and read_planner.hpp: index.json round trips, every
// refusal of a damaged or inconsistent index (naming the index and the tensor or field),
// and read plans that bring any range of a tensor written as N slices into M ranges.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <fsdp/checkpoint/checkpoint_index.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_checkpoint_index_test {

using fsdp::DType;
using fsdp::StateKey;
using fsdp::checkpoint::CheckpointIndex;
using fsdp::checkpoint::ReadPlanner;
using fsdp::checkpoint::ReadStep;
using test_support::contains;
using test_support::error_of;

namespace {

const StateKey weight = StateKey::param("fc.weight");
const StateKey mean = StateKey::buffer("bn.mean");
const StateKey exp_avg = StateKey::optim("fc.weight", "exp_avg");
const StateKey step = StateKey::optim("fc.weight", "step");

// Two ranks: fc.weight [4, 6] split 13 + 11, bn.mean and the step count on rank 0, an
// empty parameter with no slice at all.
CheckpointIndex sample_index() {
  CheckpointIndex ix;
  ix.world_size = 2;
  ix.metadata = {{"step", "120"}, {"rng", "seed=7"}};
  ix.files = {{"rank-00000.safetensors", 4096, 0x0123456789abcdefull}, {"rank-00001.safetensors", 2048, 42}};
  ix.entries = {{weight, DType::f32, {4, 6}},
                {mean, DType::f32, {6}},
                {exp_avg, DType::f32, {4, 6}},
                {step, DType::i64, {}},
                {StateKey::param("empty"), DType::bf16, {0, 5}}};
  ix.slices = {{weight, "rank-00000.safetensors", "fc.weight", 0, 13},
               {weight, "rank-00001.safetensors", "fc.weight", 13, 11},
               {mean, "rank-00000.safetensors", "bn.mean", 0, 6},
               {exp_avg, "rank-00001.safetensors", "fc.weight.exp_avg", 13, 11},
               {exp_avg, "rank-00000.safetensors", "fc.weight.exp_avg", 0, 13},
               {step, "rank-00000.safetensors", "fc.weight.step", 0, 1}};
  return ix;
}

std::string from_json_error(const nlohmann::json& j) {
  return error_of([&] { CheckpointIndex::from_json(j, "/ckpt/index.json"); });
}

}  // namespace

TEST_CASE("an index round-trips through JSON text and through a file") {
  const CheckpointIndex ix = sample_index();
  const CheckpointIndex back = CheckpointIndex::from_json(nlohmann::json::parse(ix.dump()), "x");
  CHECK(back.to_json() == ix.to_json());
  CHECK(back.source == "x");
  CHECK(back.files[0].xxh64 == 0x0123456789abcdefull);
  CHECK(back.entries[3].shape.empty());
  CHECK(back.metadata.at("rng") == "seed=7");
  CHECK(ix.dump().find("\"xxh64\":\"0123456789abcdef\"") != std::string::npos);
  CHECK(ix.dump() == sample_index().dump());  // deterministic

  test_support::TempDir dir;
  const auto result = ix.save(dir / "index.json");
  CHECK(result.bytes == std::filesystem::file_size(dir / "index.json"));
  const CheckpointIndex loaded = CheckpointIndex::load(dir / "index.json");
  CHECK(loaded.to_json() == ix.to_json());
  CHECK(loaded.source == (dir / "index.json").string());
  CHECK(loaded.find(exp_avg) != nullptr);
  CHECK(loaded.find(StateKey::optim("fc.weight", "exp_avg_sq")) == nullptr);
  CHECK(loaded.find_file("rank-00001.safetensors")->bytes == 2048);
}

TEST_CASE("a damaged or inconsistent index is refused with the index path and the field or tensor") {
  struct Case {
    std::string what;
    std::function<void(nlohmann::json&)> damage;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"not an object", [](auto& j) { j = nlohmann::json::array(); }, "top level: expected an object"},
      {"foreign format", [](auto& j) { j["format"] = "torch-dcp"; }, "format \"torch-dcp\" is not \"fsdp-sharded-checkpoint\""},
      {"newer version", [](auto& j) { j["version"] = 3; }, "checkpoint format version 3, but this build reads version 2 (a newer fsdp wrote it)"},
      {"older version", [](auto& j) { j = {{"format", "fsdp-sharded-checkpoint"}, {"version", 1}}; },
       "checkpoint format version 1, but this build reads version 2 (an older fsdp wrote it"},
      {"version as text", [](auto& j) { j["version"] = "1"; }, "'version' must be an integer >= 0, got \"1\""},
      {"missing files", [](auto& j) { j.erase("files"); }, "top level: the field 'files' is missing"},
      {"unknown field", [](auto& j) { j["extra"] = 1; }, "top level: unknown field 'extra'"},
      {"world size 0", [](auto& j) { j["world_size"] = 0; }, "world_size 0 is not in [1, 2^30]"},
      {"metadata not a string", [](auto& j) { j["metadata"]["step"] = 120; }, "metadata 'step': the value must be a string, got 120"},
      {"slices not an array", [](auto& j) { j["slices"] = 3; }, "'slices' must be an array, got 3"},
      {"file without checksum", [](auto& j) { j["files"][1].erase("xxh64"); }, "files[1]: the field 'xxh64' is missing"},
      {"bad checksum text", [](auto& j) { j["files"][0]["xxh64"] = "xyz"; },
       "files[0] ('rank-00000.safetensors'): xxh64 \"xyz\" is not 16 hex digits"},
      {"file name with a path", [](auto& j) { j["files"][0]["name"] = "../evil"; }, "file name '../evil' must be one plain path component"},
      {"file listed twice", [](auto& j) { j["files"][1]["name"] = "rank-00000.safetensors"; },
       "file 'rank-00000.safetensors' is listed twice"},
      {"negative file size", [](auto& j) { j["files"][0]["bytes"] = -1; }, "files[0]: 'bytes' must be an integer >= 0, got -1"},
      {"unknown kind", [](auto& j) { j["entries"][0]["kind"] = "weights"; }, "entries[0] ('fc.weight'): kind \"weights\""},
      {"unknown dtype", [](auto& j) { j["entries"][0]["dtype"] = "Q8"; }, "entries[0] ('fc.weight'): dtype \"Q8\" is not supported"},
      {"negative dimension", [](auto& j) { j["entries"][1]["shape"] = {-6}; }, "entries[1] (buffer 'bn.mean'): shape [-6]"},
      {"optimizer state without a name", [](auto& j) { j["entries"][2].erase("state"); }, "a state name is required for kind \"optim\""},
      {"state on a parameter", [](auto& j) { j["entries"][0]["state"] = "exp_avg"; }, "a state name is required for kind \"optim\" and only for it"},
      {"entry listed twice", [](auto& j) { j["entries"][4] = j["entries"][0]; }, "entry 'fc.weight' is listed twice"},
      {"slice in an unknown file", [](auto& j) { j["slices"][1]["file"] = "rank-00009.safetensors"; },
       "slice of 'fc.weight' in file 'rank-00009.safetensors' (key 'fc.weight'): the file is not in \"files\""},
      {"slice of an unknown tensor", [](auto& j) { j["slices"][2]["fqn"] = "bn.var"; },
       "slice of buffer 'bn.var' in file 'rank-00000.safetensors' (key 'bn.mean'): no entry for that tensor"},
      {"slice outside the tensor", [](auto& j) { j["slices"][1]["count"] = 12; },
       "slice of 'fc.weight' in file 'rank-00001.safetensors' (key 'fc.weight'): elements [13, +12) are outside the tensor's 24 elements"},
      {"empty slice outside the tensor", [](auto& j) { j["slices"][5]["begin"] = 2; j["slices"][5]["count"] = 0; },
       "optimizer state 'step' of 'fc.weight' in file 'rank-00000.safetensors' (key 'fc.weight.step'): elements [2, +0) are outside the tensor's 1 elements"},
      {"only an empty slice of a tensor", [](auto& j) { j["slices"][5]["count"] = 0; },
       "elements [0, 1) of optimizer state 'step' of 'fc.weight' are in no file"},
      {"negative begin", [](auto& j) { j["slices"][0]["begin"] = -1; }, "slices[0] ('fc.weight'): 'begin' must be an integer >= 0, got -1"},
      {"key used twice", [](auto& j) { j["slices"][2]["key"] = "fc.weight"; }, "another slice uses the same key of the same file"},
      {"overlapping slices", [](auto& j) { j["slices"][1]["begin"] = 12; j["slices"][1]["count"] = 12; },
       "slices of 'fc.weight' overlap: [0, 13) in file 'rank-00000.safetensors' and [12, 24) in file 'rank-00001.safetensors'"},
      {"gap between slices", [](auto& j) { j["slices"][1]["begin"] = 14; j["slices"][1]["count"] = 10; },
       "elements [13, 14) of 'fc.weight' are in no file"},
      {"tail missing", [](auto& j) { j["slices"][4]["count"] = 10; }, "elements [10, 13) of optimizer state 'exp_avg' of 'fc.weight' are in no file"},
      {"tensor in no file", [](auto& j) { j["slices"].erase(2); }, "elements [0, 6) of buffer 'bn.mean' are in no file"},
  };
  const nlohmann::json good = nlohmann::json::parse(sample_index().dump());
  CHECK(from_json_error(good).empty());
  for (const Case& c : cases) {
    CAPTURE(c.what);
    nlohmann::json j = good;
    c.damage(j);
    const std::string err = from_json_error(j);
    CHECK_MESSAGE(contains(err, "'/ckpt/index.json'"), err);
    CHECK_MESSAGE(contains(err, c.expected), err);
  }
}

TEST_CASE("count-0 slices (ranks that saved none of a tensor) are accepted and hold nothing") {
  CheckpointIndex ix = sample_index();
  const StateKey empty = StateKey::param("empty");
  // One at the start of fc.weight, where a full slice starts too, one at its end, and two
  // of the zero-element tensor, which is complete with or without them.
  ix.slices.push_back({weight, "rank-00001.safetensors", "fc.weight.none", 0, 0});
  ix.slices.push_back({weight, "rank-00000.safetensors", "fc.weight.end", 24, 0});
  ix.slices.push_back({empty, "rank-00000.safetensors", "empty", 0, 0});
  ix.slices.push_back({empty, "rank-00001.safetensors", "empty", 0, 0});
  const CheckpointIndex back = CheckpointIndex::from_json(nlohmann::json::parse(ix.dump()), "x");  // check_complete()s
  CHECK(back.slices.size() == 10);
  const ReadPlanner planner(back);
  const auto steps = planner.plan(weight, 0, 24);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].key == "fc.weight");
  CHECK(steps[0].count == 13);
  CHECK(steps[1].key == "fc.weight");
  CHECK(steps[1].count == 11);
  CHECK(planner.plan(empty, 0, 0).empty());
  // Still refused: an empty slice in a file the index does not list.
  ix.slices.push_back({empty, "rank-00002.safetensors", "empty", 0, 0});
  CHECK(contains(error_of([&] { ix.validate(); }), "the file is not in \"files\""));
}

TEST_CASE("loading an index that is missing or not JSON names the file") {
  test_support::TempDir dir;
  CHECK(contains(error_of([&] { CheckpointIndex::load(dir / "index.json"); }), "No such file or directory"));
  test_support::write_bytes(dir / "index.json", "{\"format\": ");
  const std::string err = error_of([&] { CheckpointIndex::load(dir / "index.json"); });
  CHECK(contains(err, "checkpoint index '" + (dir / "index.json").string() + "' is not valid JSON"));
  // nlohmann would keep the second "version" silently.
  test_support::write_bytes(dir / "index.json", "{\"version\": 1, \"version\": 2}");
  CHECK(contains(error_of([&] { CheckpointIndex::load(dir / "index.json"); }), "has the key 'version' twice in one object"));
  test_support::write_bytes(dir / "index.json", std::string(100000, '[') + std::string(100000, ']'));
  CHECK(contains(error_of([&] { CheckpointIndex::load(dir / "index.json"); }), "nests deeper than 16 levels"));
}

TEST_CASE("save refuses an incomplete index and writes nothing") {
  test_support::TempDir dir;
  CheckpointIndex ix = sample_index();
  ix.slices.erase(ix.slices.begin() + 1);
  CHECK(contains(error_of([&] { ix.save(dir / "index.json"); }), "elements [13, 24) of 'fc.weight' are in no file"));
  CHECK(!std::filesystem::exists(dir / "index.json"));
}

TEST_CASE("plans name the file tensor, its offset and the destination offset of every piece") {
  const ReadPlanner planner(sample_index());
  auto steps = planner.plan(weight, 10, 8);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].file == "rank-00000.safetensors");
  CHECK(steps[0].key == "fc.weight");
  CHECK(steps[0].src_offset == 10);
  CHECK(steps[0].count == 3);
  CHECK(steps[0].dst_offset == 0);
  CHECK(steps[1].file == "rank-00001.safetensors");
  CHECK(steps[1].src_offset == 0);
  CHECK(steps[1].count == 5);
  CHECK(steps[1].dst_offset == 3);
  CHECK(planner.plan(weight, 24, 0).empty());
  CHECK(planner.plan(StateKey::param("empty"), 0, 0).empty());
  steps = planner.plan(step, 0, 1);
  REQUIRE(steps.size() == 1);
  CHECK(steps[0].key == "fc.weight.step");
  CHECK(planner.entry(exp_avg).dtype == DType::f32);
  CHECK(contains(error_of([&] { planner.plan(weight, 20, 5); }),
                 "checkpoint '<in-memory index>': elements [20, +5) of 'fc.weight' are outside its 24 elements (shape [4, 6])"));
  CHECK(contains(error_of([&] { planner.plan(weight, UINT64_MAX, 2); }), "are outside its 24 elements"));
  CHECK(contains(error_of([&] { planner.plan(StateKey::optim("fc.weight", "exp_avg_sq"), 0, 1); }),
                 "no entry for optimizer state 'exp_avg_sq' of 'fc.weight'"));
}

TEST_CASE("a range that reaches elements no slice holds is an error naming them") {
  CheckpointIndex ix = sample_index();
  ix.slices.erase(ix.slices.begin() + 1);  // fc.weight [13, 24) is in no file
  ix.validate();                           // consistent, just incomplete
  CHECK(contains(error_of([&] { ix.check_complete(); }), "elements [13, 24) of 'fc.weight' are in no file"));
  const ReadPlanner planner(ix);
  CHECK(planner.plan(weight, 0, 13).size() == 1);
  CHECK(error_of([&] { planner.plan(weight, 10, 6); }) ==
        "fsdp: checkpoint '<in-memory index>': elements [13, 16) of 'fc.weight' are in no file");
  CHECK(contains(error_of([&] { planner.plan(weight, 14, 10); }), "elements [14, 24) of 'fc.weight' are in no file"));
  ix.slices = {{weight, "rank-00001.safetensors", "w", 5, 3}};  // a hole before and after
  ix.entries.resize(1);
  const ReadPlanner holes(ix);
  CHECK(contains(error_of([&] { holes.plan(weight, 0, 24); }), "elements [0, 5) of 'fc.weight'"));
  CHECK(contains(error_of([&] { holes.plan(weight, 6, 10); }), "elements [8, 16) of 'fc.weight'"));
  CHECK(holes.plan(weight, 6, 2).size() == 1);
}

namespace {
// Contiguous ranges of `n` elements over `parts` ranks, FSDP style: ceil(n / parts) each,
// so the last ranks may own nothing; or, when `skewed`, rank r gets a share growing with r.
std::vector<std::pair<std::uint64_t, std::uint64_t>> partition(std::uint64_t n, int parts, bool skewed) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  std::uint64_t at = 0;
  const std::uint64_t shard = (n + parts - 1) / parts;
  const std::uint64_t weights = static_cast<std::uint64_t>(parts) * (parts + 1) / 2;
  for (int r = 0; r < parts; ++r) {
    std::uint64_t count = skewed ? n * (r + 1) / weights : shard;
    if (r == parts - 1 && skewed) count = n - at;
    count = std::min(count, n - at);
    out.emplace_back(at, count);
    at += count;
  }
  return out;
}
}  // namespace

TEST_CASE("N writers to M readers: every reader gets exactly its range, for N, M in 1..5") {
  for (const std::uint64_t numel : {1u, 7u, 24u, 101u}) {
    for (int n = 1; n <= 5; ++n) {
      for (bool skewed_writers : {false, true}) {
        // Writer w owns a range of the tensor and stores it as its own file's tensor "w".
        CheckpointIndex ix;
        ix.world_size = n;
        ix.entries = {{weight, DType::f32, {static_cast<std::int64_t>(numel)}}};
        std::map<std::string, std::vector<float>> files;  // file name -> its tensor's values
        for (int w = 0; w < n; ++w) {
          const auto [begin, count] = partition(numel, n, skewed_writers)[w];
          const std::string file = "rank-" + std::to_string(w);
          ix.files.push_back({file, 0, 0});
          if (count == 0) continue;  // this writer owns nothing
          ix.slices.push_back({weight, file, "fc.weight", begin, count});
          for (std::uint64_t i = 0; i < count; ++i) files[file].push_back(static_cast<float>(begin + i) * 0.5f);
        }
        ix.check_complete();
        const ReadPlanner planner(ix);
        for (int m = 1; m <= 5; ++m) {
          for (bool skewed_readers : {false, true}) {
            CAPTURE(numel);
            CAPTURE(n);
            CAPTURE(m);
            std::uint64_t covered = 0;
            for (const auto& [begin, count] : partition(numel, m, skewed_readers)) {
              std::vector<float> out(count, -1.0f);
              std::uint64_t expected_dst = 0;
              for (const ReadStep& s : planner.plan(weight, begin, count)) {
                CHECK(s.dst_offset == expected_dst);  // in order, no gap, no overlap
                CHECK(s.count > 0);
                const auto& src = files.at(s.file);
                REQUIRE(s.src_offset + s.count <= src.size());
                std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(s.src_offset), s.count,
                            out.begin() + static_cast<std::ptrdiff_t>(s.dst_offset));
                expected_dst += s.count;
              }
              CHECK(expected_dst == count);
              for (std::uint64_t i = 0; i < count; ++i) CHECK(out[i] == static_cast<float>(begin + i) * 0.5f);
              covered += count;
            }
            CHECK(covered == numel);
          }
        }
      }
    }
  }
}

TEST_CASE("checksums print as 16 hex digits and parse back") {
  using fsdp::checkpoint::parse_xxh64_hex;
  using fsdp::checkpoint::xxh64_hex;
  CHECK(xxh64_hex(0) == "0000000000000000");
  CHECK(xxh64_hex(0xfedcba9876543210ull) == "fedcba9876543210");
  CHECK(parse_xxh64_hex("FEDCBA9876543210") == 0xfedcba9876543210ull);
  CHECK(parse_xxh64_hex(xxh64_hex(12345)) == 12345u);
  CHECK(!parse_xxh64_hex("fedcba987654321"));
  CHECK(!parse_xxh64_hex("fedcba987654321g"));
  CHECK(!parse_xxh64_hex(""));
}

}  // namespace checkpoint_checkpoint_index_test
