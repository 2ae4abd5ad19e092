// Full checkpoints carry XXH64 checksums of their data in chunks (checkpoint/data_checksums.hpp):
// written by the gathering and the shared save alike, checked by the ranks of a load in
// parallel, so a damaged byte is an error on every rank naming the file and the tensors,
// before anything is loaded; files from other tools (no checksums) still load.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_data_checksums_test {

using fsdp::checkpoint::ChunkHasher;
using fsdp::checkpoint::DataChecksums;
using fsdp::checkpoint::SafetensorsFile;
using fsdp::checkpoint::SafetensorsWriter;
using test_support::contains;
using test_support::load_expecting_failure;
using test_support::train;

namespace {

// XXH64 of each `chunk`-byte piece of `data`, straight from the library that defines it.
std::vector<std::uint64_t> reference_digests(const std::string& data, std::size_t chunk) {
  std::vector<std::uint64_t> out;
  for (std::size_t at = 0; at < data.size(); at += chunk)
    out.push_back(XXH64(data.data() + at, std::min(chunk, data.size() - at), 0));
  return out;
}

// The data section of a safetensors file's bytes.
std::string data_of(const std::filesystem::path& file) {
  const std::string bytes = test_support::read_bytes(file);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return bytes.substr(8 + n);
}

void check_digests_match_data(const std::filesystem::path& file) {
  CAPTURE(file.string());
  const auto f = SafetensorsFile::open(file);
  const std::string data = data_of(file);
  const auto it = f.metadata().find(fsdp::checkpoint::data_checksums_key);
  REQUIRE(it != f.metadata().end());
  const auto sums = DataChecksums::parse(it->second, data.size());
  REQUIRE(sums.has_value());
  CHECK(sums->chunk_bytes == fsdp::checkpoint::data_checksum_chunk_bytes);
  CHECK(sums->digests == reference_digests(data, static_cast<std::size_t>(sums->chunk_bytes)));
}

}  // namespace

TEST_CASE("DataChecksums: format and parse agree; malformed lists are refused") {
  const DataChecksums c{64, {0x0123456789abcdefull, 0, 0xffffffffffffffffull}};
  const std::string text = c.format();
  CHECK(text == "64:0123456789abcdef,0000000000000000,ffffffffffffffff");
  const auto back = DataChecksums::parse(text, 150);  // 150 bytes: 3 chunks of 64
  REQUIRE(back.has_value());
  CHECK(back->chunk_bytes == 64);
  CHECK(back->digests == c.digests);
  CHECK(DataChecksums::parse(text, 200) == std::nullopt);  // 4 chunks expected
  CHECK(DataChecksums::parse(text, 128) == std::nullopt);  // 2
  CHECK(DataChecksums::parse("0:", 0) == std::nullopt);
  CHECK(DataChecksums::parse("64", 10) == std::nullopt);
  CHECK(DataChecksums::parse("64:0123456789abcdeg", 10) == std::nullopt);
  CHECK(DataChecksums::parse("64;0123456789abcdef", 10) == std::nullopt);
  CHECK(DataChecksums::parse("64:", 0).has_value());  // no data, no chunks
  CHECK(DataChecksums::placeholder(150, 64).format().size() == text.size());
  for (std::size_t i = 0; i < c.digests.size(); ++i)  // where the shared save's ranks write their digests
    CHECK(text.substr(c.digits_at(i), 16) == fsdp::checkpoint::xxh64_hex(c.digests[i]));
}

TEST_CASE("ChunkHasher: pieces of any size give each chunk's XXH64") {
  std::string data(1000, '\0');
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + 7);
  for (const std::size_t piece : {1u, 7u, 64u, 100u, 1000u}) {
    CAPTURE(piece);
    ChunkHasher h(64);
    for (std::size_t at = 0; at < data.size(); at += piece) h.update(data.data() + at, std::min(piece, data.size() - at));
    const DataChecksums c = h.finish();
    CHECK(c.chunk_bytes == 64);
    CHECK(c.digests == reference_digests(data, 64));
  }
}

TEST_CASE("a writer with data checksums: digests of the bytes written, the file still plain safetensors") {
  test_support::TempDir tmp;
  std::vector<float> a(100), b(37);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
  SafetensorsWriter w;
  w.add("a", fsdp::DType::f32, {10, 10}, a.data());
  w.add("b", fsdp::DType::f32, {37}, [&](std::span<std::byte> out) { std::memcpy(out.data(), b.data(), out.size()); });
  w.set_metadata("step", "5");
  w.checksum_data(96);  // 548 bytes of data: 6 chunks
  w.mark_fsdp_file(1);   // data checksums make an fsdp file (fsdp_metadata.hpp)
  const auto result = w.write(tmp / "m.safetensors");
  CHECK(result.xxh64 == 0);  // not hashed whole: the header changed after the data
  const auto f = SafetensorsFile::open(tmp / "m.safetensors");
  CHECK(f.metadata().at("step") == "5");
  const auto sums = DataChecksums::parse(f.metadata().at(std::string(fsdp::checkpoint::data_checksums_key)), 548);
  REQUIRE(sums.has_value());
  CHECK(sums->digests == reference_digests(data_of(tmp / "m.safetensors"), 96));
  std::vector<float> back(37);
  f.read_elements("b", 0, 37, back.data());
  CHECK(back == b);
}

TEST_CASE("full checkpoints, gathered or shared, carry the checksums of their data") {
  test_support::TempDir tmp;
  const auto shared = tmp / "shared.safetensors", gathered = tmp / "gathered.safetensors";
  train<fsdp::FullShard>(3, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::detail::FullSave a(shared, sm, &st, {{"step", "1"}}, /*snapshot=*/false);
    CHECK(fsdp::detail::save_full_shared(a, sm, &st));
    fsdp::detail::FullSave b(gathered, sm, &st, {{"step", "1"}}, /*snapshot=*/false);
    b.commit(sm, fsdp::detail::captured([&] { b.write_streaming(); }));
  });
  for (const auto& f : {shared, gathered, fsdp::optimizer_file_of(shared), fsdp::optimizer_file_of(gathered)})
    check_digests_match_data(f);
  CHECK(test_support::bytes_without_save_id(shared) == test_support::bytes_without_save_id(gathered));
  CHECK(fsdp::read_checkpoint_metadata(shared) == std::map<std::string, std::string>{{"step", "1"}});
}

TEST_CASE("the library's metadata key is refused as user metadata") {
  test_support::TempDir tmp;
  std::vector<std::string> errors(2);
  train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    errors[static_cast<std::size_t>(r)] = test_support::error_of(
        [&] { fsdp::save_full_checkpoint(tmp / "m.safetensors", sm, &st, {{"fsdp.data_xxh64", "mine"}}); });
  });
  for (const auto& e : errors) CHECK(contains(e, "metadata key 'fsdp.data_xxh64' starts with 'fsdp.', which is reserved"));
  CHECK(test_support::names_in(tmp.path()).empty());
}

TEST_CASE("a damaged byte in a full checkpoint fails the load on every rank, naming the file and tensor") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  train<fsdp::FullShard>(2, 0, 2, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::save_full_checkpoint(file, sm, &st);
  });
  const auto victim = SafetensorsFile::open(file).tensors().front();
  std::string bytes = test_support::read_bytes(file);
  const std::size_t at = static_cast<std::size_t>(SafetensorsFile::open(file).data_offset() + victim.begin);
  bytes[at] ^= 0x10;
  test_support::write_bytes(file, bytes);
  for (const bool staged : {false, true}) {
    CAPTURE(staged);
    fsdp::LoadOptions options;
    options.stage_in_host_memory = staged;
    const auto failed = load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::load_full_checkpoint(file, sm, &st, options);
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(failed.errors[r]);
      CHECK(contains(failed.errors[r], "checkpoint '" + file.string() + "' is damaged: bytes [0, "));
      CHECK(contains(failed.errors[r], "(tensors " + victim.name));
      CHECK(contains(failed.errors[r], "do not match the XXH64 its save wrote"));
      CHECK(failed.untouched[r]);
    }
  }
}

TEST_CASE("each rank checks its own run of chunks, and only the owner of a damaged chunk finds it") {
  test_support::TempDir tmp;
  std::vector<float> a(64, 1.0f), b(64, 2.0f), c(64, 3.0f);  // 768 bytes: 6 chunks of 128
  SafetensorsWriter w;
  w.add("a", fsdp::DType::f32, {64}, a.data());
  w.add("b", fsdp::DType::f32, {64}, b.data());
  w.add("c", fsdp::DType::f32, {64}, c.data());
  w.checksum_data(128);
  w.mark_fsdp_file(1);
  const auto file = tmp / "model.safetensors";
  w.write(file);
  std::string bytes = test_support::read_bytes(file);
  const std::uint64_t data_at = SafetensorsFile::open(file).data_offset();
  bytes[data_at + 5 * 128 + 3] ^= 1;  // chunk 5: the last 128 bytes, tensor c
  test_support::write_bytes(file, bytes);
  // 3 ranks: chunks 0-1, 2-3, 4-5. One process stands for all: each rank agrees with itself.
  const auto alone = [](bool ok) { return ok; };
  for (int rank = 0; rank < 3; ++rank) {
    CAPTURE(rank);
    const fsdp::FullCheckpointSource source(file);
    source.verify(rank, 3);
    const std::string damage = source.agree_damage(alone);
    if (rank < 2) CHECK(damage.empty());
    else CHECK(contains(damage, "is damaged: bytes [640, 768) of its data (tensors c) do not match"));
  }
}

TEST_CASE("a load's ranks split the model and optimizer files' chunks as one run each: every chunk read and hashed once") {
  // A model file of 5 chunks of 128 bytes and its optimizer file of 10, every chunk damaged
  // (the last byte of the last one too), one save id.
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  std::vector<float> w(160, 1.0f), m(160, 2.0f), v(160, 3.0f);
  const auto write = [](const std::filesystem::path& path, const std::vector<std::pair<std::string, const float*>>& tensors) {
    SafetensorsWriter out;
    for (const auto& [key, data] : tensors) out.add(key, fsdp::DType::f32, {160}, data);
    out.checksum_data(128);
    out.mark_fsdp_file(7);
    out.write(path);
  };
  write(file, {{"w", w.data()}});
  write(fsdp::optimizer_file_of(file), {{"exp_avg/w", m.data()}, {"exp_avg_sq/w", v.data()}});
  for (const auto& [path, chunks] : {std::pair{file, 5}, std::pair{fsdp::optimizer_file_of(file), 10}}) {
    std::string bytes = test_support::read_bytes(path);
    const std::uint64_t data_at = SafetensorsFile::open(path).data_offset();
    for (int c = 0; c < chunks; ++c) bytes[data_at + 128 * static_cast<std::uint64_t>(c) + 127] ^= 0x40;
    test_support::write_bytes(path, bytes);
  }
  // 4 ranks, one process standing for all: the chunks each rank found damaged (agree_damage
  // asks about each chunk in turn, model file first, while the others answer "fine").
  constexpr int ranks = 4;
  std::vector<std::vector<int>> found(ranks);  // chunk numbers over both files, 0-14
  for (int rank = 0; rank < ranks; ++rank) {
    const fsdp::FullCheckpointSource source(file);
    source.verify(rank, ranks);
    int asked = -1;
    source.agree_damage([&](bool ok) {
      if (asked >= 0 && !ok) found[static_cast<std::size_t>(rank)].push_back(asked);
      ++asked;
      return asked > 0;  // the first question (any damage here?): no, so every chunk is asked
    });
  }
  std::vector<int> all;
  for (int rank = 0; rank < ranks; ++rank) {
    const auto& mine = found[static_cast<std::size_t>(rank)];
    CAPTURE(rank);
    REQUIRE_FALSE(mine.empty());
    CHECK(mine.back() - mine.front() + 1 == static_cast<int>(mine.size()));  // one contiguous run
    CHECK(mine.size() <= 4);  // 15 chunks over 4 ranks: per file (5 = 2+1+1+1, 10 = 3+2+3+2), rank 0 had 5
    all.insert(all.end(), mine.begin(), mine.end());
  }
  std::sort(all.begin(), all.end());
  std::vector<int> each(15);
  for (int c = 0; c < 15; ++c) each[static_cast<std::size_t>(c)] = c;
  CHECK(all == each);  // every chunk, the optimizer file's last one included, by exactly one rank
  CHECK(fsdp::checkpoint::share_owner(0, 10, 100, 1) == 0);
  CHECK(fsdp::checkpoint::share_owner(90, 100, 100, 4) == 3);
  CHECK(fsdp::checkpoint::share_owner(0, 100, 100, 4) == 2);  // one chunk: the share of its middle byte
}

TEST_CASE("a full checkpoint without checksums (another tool's file) still loads") {
  test_support::TempDir tmp;
  const auto file = tmp / "model.safetensors";
  train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int) {
    fsdp::save_full_checkpoint(file, sm);  // no optimizer
  });
  // Rewrite it without the checksums, as another writer would.
  const auto f = SafetensorsFile::open(file);
  std::vector<std::vector<std::byte>> data;
  SafetensorsWriter w;
  for (const auto& t : f.tensors()) {
    data.emplace_back(t.bytes());
    f.read_bytes(t.name, 0, t.bytes(), data.back().data());
    w.add(t.name, t.dtype, t.shape, data.back().data());
  }
  const auto plain = tmp / "plain.safetensors";
  w.write(plain);
  CHECK(SafetensorsFile::open(plain).metadata().empty());
  test_support::resume(2, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int) { fsdp::load_full_checkpoint(plain, sm); });
}

}  // namespace checkpoint_data_checksums_test
