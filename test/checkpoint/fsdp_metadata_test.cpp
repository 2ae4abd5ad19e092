// fsdp/checkpoint/fsdp_metadata.hpp and save_id.hpp: a checkpoint file fsdp writes carries
// its format version, its save id and its header's checksum; a header changed after the save
// (two tensors' data_offsets swapped), a misspelt or missing key of the library's, another
// format version: each is refused when the file is opened, naming the file. Every single
// bit flip in such a header is refused. A file with no "fsdp." key (another tool's) opens as
// before.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fsdp/checkpoint/fsdp_metadata.hpp>
#include <fsdp/checkpoint/safetensors.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_fsdp_metadata_test {

using fsdp::DType;
using fsdp::checkpoint::SafetensorsFile;
using fsdp::checkpoint::SafetensorsWriter;
using test_support::contains;
using test_support::error_of;

namespace {

constexpr std::uint64_t save_id = 0x1234'5678'9abc'def0ull;

// Two tensors of 16 bytes each (so swapping their offsets passes every other check), a
// third of 8; data checksums as a full checkpoint file has.
SafetensorsWriter fsdp_writer(std::vector<std::vector<std::byte>>& keep) {
  keep = {std::vector<std::byte>(16, std::byte{1}), std::vector<std::byte>(16, std::byte{2}),
          std::vector<std::byte>(8, std::byte{3})};
  SafetensorsWriter w;
  w.add("a.weight", DType::f32, {4}, keep[0].data());
  w.add("b.weight", DType::f32, {2, 2}, keep[1].data());
  w.add("step", DType::i64, {}, keep[2].data());
  w.set_metadata("step", "7");
  w.checksum_data();
  w.mark_fsdp_file(save_id);
  return w;
}

std::string open_error(const std::filesystem::path& p) {
  return error_of([&] { SafetensorsFile::open(p); });
}

// `text` with its only occurrence of `from` replaced by `to` (same length: the header's
// length stays right).
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  REQUIRE(from.size() == to.size());
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);
  REQUIRE(text.find(from, at + 1) == std::string::npos);
  return text.replace(at, from.size(), to);
}

// `text` with the only occurrences of `x` and `y` (x first) exchanged.
std::string swapped(const std::string& text, const std::string& x, const std::string& y) {
  const auto at_x = text.find(x), at_y = text.find(y);
  REQUIRE((at_x != std::string::npos && at_y != std::string::npos && at_x + x.size() <= at_y));
  return text.substr(0, at_x) + y + text.substr(at_x + x.size(), at_y - at_x - x.size()) + x + text.substr(at_y + y.size());
}

}  // namespace

TEST_CASE("a marked file carries its version, save id and header checksum; users see their own metadata") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  fsdp_writer(keep).write(dir / "m.safetensors");
  const SafetensorsFile f = SafetensorsFile::open(dir / "m.safetensors");
  CHECK(f.metadata().at("fsdp.format_version") == "2");
  CHECK(f.metadata().at("fsdp.save_id") == "123456789abcdef0");
  CHECK(f.metadata().at("fsdp.header_xxh64").size() == 16);
  CHECK(fsdp::checkpoint::save_id_of(f.metadata()) == save_id);
  CHECK(fsdp::checkpoint::without_fsdp_keys(f.metadata()) == std::map<std::string, std::string>{{"step", "7"}});
  CHECK(fsdp::checkpoint::without_data_checksums(f.metadata()) == std::map<std::string, std::string>{{"step", "7"}});
  // The checksum is over the canonical header, which a reader can recompute.
  auto canonical = f.metadata();
  canonical.erase("fsdp.header_xxh64");
  CHECK(fsdp::checkpoint::xxh64_hex(fsdp::checkpoint::header_xxh64(f.tensors(), canonical)) ==
        f.metadata().at("fsdp.header_xxh64"));
}

TEST_CASE("two tensors' data_offsets swapped in a marked header: refused, naming the file") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  const auto path = dir / "m.safetensors";
  fsdp_writer(keep).write(path);
  // The two values change places; the header keeps its length.
  const std::string bytes = swapped(test_support::read_bytes(path), "\"data_offsets\":[0,16]", "\"data_offsets\":[16,32]");
  test_support::write_bytes(path, bytes);
  const std::string err = open_error(path);
  CHECK_MESSAGE(contains(err, "checkpoint file '" + path.string() + "'"), err);
  CHECK_MESSAGE(contains(err, "its header does not match its checksum (fsdp.header_xxh64 "), err);
  CHECK_MESSAGE(contains(err, "data_offsets"), err);
}

TEST_CASE("a misspelt, missing or unknown key of the library's is an error, not an unchecked file") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  const auto good_path = dir / "good.safetensors";
  fsdp_writer(keep).write(good_path);
  const std::string good = test_support::read_bytes(good_path);
  const auto path = dir / "bad.safetensors";
  struct Case {
    std::string from, to, expected;
  };
  const std::vector<Case> cases = {
      // One bit: 'h' (0x68) -> 'i' (0x69). A data bit flip added to it would go unnoticed if
      // the file then loaded as another tool's.
      {"\"fsdp.data_xxh64\"", "\"fsdp.data_xxi64\"", "unknown metadata key 'fsdp.data_xxi64'"},
      {"\"fsdp.header_xxh64\"", "\"fsdp.header_xxi64\"", "unknown metadata key 'fsdp.header_xxi64'"},
      {"\"fsdp.format_version\"", "\"fsdp.format_versioo\"", "but no 'fsdp.format_version'"},
      {"\"fsdp.format_version\"", "\"fsdq.format_version\"", "but no 'fsdp.format_version'"},
      {"\"fsdp.save_id\"", "\"fsdp.save_ie\"", "unknown metadata key 'fsdp.save_ie'"},
      {"\"fsdp.format_version\":\"2\"", "\"fsdp.format_version\":\"x\"", "'fsdp.format_version' is \"x\", not a version number"},
      {"\"fsdp.save_id\":\"123456789abcdef0\"", "\"fsdp.save_id\":\"123456789abcdef1\"", "its header does not match its checksum"},
      {"\"step\":\"7\"", "\"step\":\"8\"", "its header does not match its checksum"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.to);
    test_support::write_bytes(path, replaced(good, c.from, c.to));
    const test_support::Thrown t = test_support::thrown_by([&] { SafetensorsFile::open(path); });
    CHECK_MESSAGE(contains(t.message, "checkpoint file '" + path.string() + "'"), t.message);
    CHECK_MESSAGE(contains(t.message, c.expected), t.message);
    CHECK(t.kind == fsdp::ErrorKind::corrupt);
  }
  // The data checksums' digits are outside the header checksum (filled in after the data):
  // the data check catches them (data_checksums_test), the header check does not need to.
  const auto digits = good.find("\"fsdp.data_xxh64\":\"67108864:") + 29;
  std::string digit_flipped = good;
  digit_flipped[digits] = digit_flipped[digits] == '0' ? '1' : '0';
  test_support::write_bytes(path, digit_flipped);
  CHECK(open_error(path).empty());
}

TEST_CASE("another format version is refused, naming the file and both versions") {
  test_support::TempDir dir;
  const auto path = dir / "v3.safetensors";
  for (const char* version : {"3", "1"}) {
    CAPTURE(version);
    std::map<std::string, std::string, std::less<>> metadata = {
        {"fsdp.format_version", version}, {"fsdp.save_id", "0000000000000001"}, {"fsdp.data_xxh64", "64:"}};
    // A consistent header of that version: only the version is wrong.
    metadata["fsdp.header_xxh64"] = fsdp::checkpoint::xxh64_hex(fsdp::checkpoint::header_xxh64({}, metadata));
    test_support::write_bytes(path, test_support::safetensors_bytes(fsdp::checkpoint::format_safetensors_header({}, metadata)));
    const std::string err = open_error(path);
    CHECK_MESSAGE(contains(err, "checkpoint file '" + path.string() + "': checkpoint format version " + version +
                                    ", but this build reads version 2"), err);
  }
}

TEST_CASE("every single bit flip in a marked file's length or header is refused, naming the file") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  const auto path = dir / "flip.safetensors";
  // A rank file's kind of marked file (slices, no data checksums: their digits are outside
  // the header checksum by design, see above).
  SafetensorsWriter w;
  keep = {std::vector<std::byte>(16, std::byte{1}), std::vector<std::byte>(16, std::byte{2})};
  w.add("a", DType::f32, {4}, keep[0].data());
  w.add("b", DType::f32, {4}, keep[1].data());
  w.set_metadata("fsdp.slices", "{}");
  w.set_metadata("user", "value");
  w.mark_fsdp_file(save_id);
  w.write(path);
  const std::string good = test_support::read_bytes(path);
  const std::size_t header_end = 8 + SafetensorsFile::open(path).header_bytes();
  std::FILE* file = std::fopen(path.c_str(), "r+b");
  REQUIRE(file != nullptr);
  auto put = [&](std::size_t at, char c) {
    REQUIRE(std::fseek(file, static_cast<long>(at), SEEK_SET) == 0);
    REQUIRE(std::fputc(c, file) != EOF);
    REQUIRE(std::fflush(file) == 0);
  };
  int refused = 0;
  std::set<std::size_t> valid_at;
  for (std::size_t byte = 0; byte < header_end; ++byte)
    for (int bit = 0; bit < 8; ++bit) {
      put(byte, static_cast<char>(good[byte] ^ (1 << bit)));
      const std::string err = open_error(path);
      if (err.empty()) valid_at.insert(byte);
      else if (contains(err, path.string())) ++refused;
      put(byte, good[byte]);
    }
  std::fclose(file);
  CHECK(refused == static_cast<int>(header_end) * 8);
  for (std::size_t b : valid_at) MESSAGE("still valid after a flip at byte ", b, " of ", header_end, ": ", good.substr(b > 20 ? b - 20 : 0, 40));
  CHECK(valid_at.empty());
}

TEST_CASE("files with no fsdp key open unchecked; a marked writer refuses the library's keys as user metadata") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep{std::vector<std::byte>(4)};
  SafetensorsWriter plain;
  plain.add("x", DType::f32, {1}, keep[0].data());
  plain.set_metadata("format", "pt");
  plain.write(dir / "plain.safetensors");
  CHECK(open_error(dir / "plain.safetensors").empty());

  SafetensorsWriter marked;
  marked.add("x", DType::f32, {1}, keep[0].data());
  marked.set_metadata("fsdp.data_xxi64", "1");
  marked.checksum_data();
  marked.mark_fsdp_file(save_id);
  CHECK(contains(error_of([&] { marked.write(dir / "m.safetensors"); }), "metadata key 'fsdp.data_xxi64' is reserved"));
  CHECK(!std::filesystem::exists(dir / "m.safetensors"));
  CHECK(contains(error_of([&] { SafetensorsWriter().mark_fsdp_file(0); }), "save id 0"));
}

TEST_CASE("save ids are random, never 0, below 2^63, and print as 16 hex digits") {
  std::set<std::uint64_t> ids;
  for (int i = 0; i < 64; ++i) {
    const std::uint64_t id = fsdp::checkpoint::new_save_id();
    CHECK(id != 0);
    CHECK(id < (std::uint64_t{1} << 63));
    ids.insert(id);
  }
  CHECK(ids.size() == 64);
  CHECK(fsdp::checkpoint::format_save_id(0xabc) == "0000000000000abc");
  CHECK(fsdp::checkpoint::parse_save_id("0000000000000abc") == 0xabc);
  CHECK(!fsdp::checkpoint::parse_save_id("abc"));
  CHECK(fsdp::checkpoint::save_id_of_token("a1b2") == fsdp::checkpoint::save_id_of_token("a1b2"));
  CHECK(fsdp::checkpoint::save_id_of_token("a1b2") != fsdp::checkpoint::save_id_of_token("a1b3"));
}

}  // namespace checkpoint_fsdp_metadata_test
