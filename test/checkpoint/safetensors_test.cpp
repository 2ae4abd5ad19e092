// fsdp/checkpoint/safetensors*.hpp: round trips of every dtype, scalars, empty tensors and
// metadata; deterministic bytes; the writer's refusals; and the reader's validation on
// hand-made bad files, on every truncation of a good file and on every bit flip of its
// header (an error or a still-valid file, never a crash).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fsdp/checkpoint/safetensors.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_safetensors_test {

using fsdp::DType;
using fsdp::checkpoint::SafetensorsFile;
using fsdp::checkpoint::SafetensorsWriter;
using fsdp::checkpoint::Shape;
using test_support::contains;
using test_support::error_of;

namespace {

const DType all_dtypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                            DType::i8,  DType::u8,  DType::i32, DType::i64};

// Distinct bytes per tensor so a mix-up between tensors shows.
std::vector<std::byte> pattern(std::size_t bytes, int seed) {
  std::vector<std::byte> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(seed) * 17 + 5) & 0xff);
  return v;
}

std::vector<std::byte> read_all(const SafetensorsFile& f, const std::string& name) {
  std::vector<std::byte> out(f.at(name).bytes());
  f.read(name, out.data(), out.size());
  return out;
}

// A small valid file: three tensors and metadata.
SafetensorsWriter sample_writer(std::vector<std::vector<std::byte>>& keep) {
  SafetensorsWriter w;
  keep = {pattern(6 * 4, 1), pattern(3 * 2, 2), pattern(8, 3)};
  w.add("layers.0.weight", DType::f32, {2, 3}, keep[0].data());
  w.add("layers.0.bias", DType::bf16, {3}, keep[1].data());
  w.add("step", DType::i64, {}, keep[2].data());
  w.set_metadata("format", "pt");
  w.set_metadata("step", "12");
  return w;
}

std::string open_error(const std::filesystem::path& p) {
  return error_of([&] { SafetensorsFile::open(p); });
}

}  // namespace

TEST_CASE("every dtype round-trips, from host memory and from fill functions") {
  test_support::TempDir dir;
  SafetensorsWriter w;
  std::vector<std::vector<std::byte>> data;
  data.reserve(16);  // the fill functions keep references
  int seed = 0;
  for (DType t : all_dtypes) {
    const std::string name(fsdp::name_of(t));
    data.push_back(pattern(5 * 3 * fsdp::size_of(t), ++seed));
    w.add(name + ".ptr", t, {5, 3}, data.back().data());
    data.push_back(pattern(7 * fsdp::size_of(t), ++seed));
    const std::vector<std::byte>& src = data.back();
    w.add(name + ".fill", t, {7}, [&src](std::span<std::byte> out) {
      REQUIRE(out.size() == src.size());
      std::copy(src.begin(), src.end(), out.begin());
    });
  }
  const auto result = w.write(dir / "all.safetensors");
  CHECK(result.bytes == std::filesystem::file_size(dir / "all.safetensors"));
  const SafetensorsFile f = SafetensorsFile::open(dir / "all.safetensors");
  REQUIRE(f.tensors().size() == 16);
  std::size_t k = 0;
  for (DType t : all_dtypes) {
    const std::string name(fsdp::name_of(t));
    for (const char* suffix : {".ptr", ".fill"}) {
      const auto* info = f.find(name + suffix);
      REQUIRE(info != nullptr);
      CHECK(info->dtype == t);
      CHECK(info->shape == (suffix == std::string(".ptr") ? Shape{5, 3} : Shape{7}));
      CHECK(read_all(f, name + suffix) == data[k++]);
    }
  }
  CHECK(f.find("absent") == nullptr);
  const std::string err = error_of([&] { f.at("absent"); });
  CHECK(contains(err, "no tensor 'absent'"));
  CHECK(contains(err, (dir / "all.safetensors").string()));
}

TEST_CASE("scalars, empty tensors, metadata and a large tensor round-trip") {
  test_support::TempDir dir;
  const double scalar = 2.5;
  const std::vector<std::byte> big = pattern(3u << 20, 9);  // past the sink's 1 MiB buffer
  SafetensorsWriter w;
  w.add("scalar", DType::f64, {}, &scalar);
  w.add("empty", DType::f32, {0}, nullptr);
  w.add("empty2d", DType::i32, {3, 0}, [](std::span<std::byte> out) { CHECK(out.empty()); });
  w.add("big", DType::u8, {3, 1 << 20}, big.data());
  w.add("big_fill", DType::f32, {1 << 18, 3}, [&](std::span<std::byte> out) {
    REQUIRE(out.size() == big.size());
    std::copy(big.begin(), big.end(), out.begin());
  });
  w.set_metadata("step", "41");
  w.set_metadata("rng", std::string("\x01\x02 \"quoted\"\n", 13));
  w.write(dir / "m.safetensors");
  const SafetensorsFile f = SafetensorsFile::open(dir / "m.safetensors");
  double back = 0;
  f.read("scalar", &back, sizeof back);
  CHECK(back == 2.5);
  CHECK(f.at("scalar").shape.empty());
  CHECK(f.at("scalar").numel() == 1);
  CHECK(f.at("empty").bytes() == 0);
  CHECK(f.at("empty").shape == Shape{0});
  CHECK(f.at("empty2d").shape == Shape{3, 0});
  f.read("empty", nullptr, 0);
  CHECK(read_all(f, "big") == big);
  CHECK(read_all(f, "big_fill") == big);
  REQUIRE(f.metadata().size() == 2);
  CHECK(f.metadata().at("step") == "41");
  CHECK(f.metadata().at("rng") == std::string("\x01\x02 \"quoted\"\n", 13));
}

TEST_CASE("small fills written in place and large ones pipelined, interleaved, keep every tensor's bytes") {
  test_support::TempDir dir;
  const auto large = static_cast<std::int64_t>(SafetensorsWriter::pipelined_fill_bytes);
  // Large, small, small, large, small: a small fill must neither overwrite a buffer a
  // pipelined write still reads nor be overwritten by the next fill before it is written.
  const std::vector<std::int64_t> sizes{large + 3, 100, 7, 2 * large, 1000};
  std::vector<std::vector<std::byte>> want;
  SafetensorsWriter w;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    want.push_back(pattern(static_cast<std::size_t>(sizes[i]), static_cast<int>(i) + 1));
    w.add("t" + std::to_string(i), DType::u8, {sizes[i]}, [&want, i](std::span<std::byte> out) {
      REQUIRE(out.size() == want[i].size());
      std::copy(want[i].begin(), want[i].end(), out.begin());
    });
  }
  w.write(dir / "m.safetensors");
  const SafetensorsFile f = SafetensorsFile::open(dir / "m.safetensors");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(i);
    CHECK(read_all(f, "t" + std::to_string(i)) == want[i]);
  }
}

TEST_CASE("the bytes are deterministic, the header is padded and the checksum is the file's") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep1, keep2;
  SafetensorsWriter a = sample_writer(keep1);
  SafetensorsWriter b;
  keep2 = keep1;
  b.set_metadata("step", "12");  // the other order: metadata is sorted
  b.set_metadata("format", "pt");
  b.add("layers.0.weight", DType::f32, {2, 3}, keep2[0].data());
  b.add("layers.0.bias", DType::bf16, {3}, [&](std::span<std::byte> out) { std::copy(keep2[1].begin(), keep2[1].end(), out.begin()); });
  b.add("step", DType::i64, {}, keep2[2].data());
  const auto ra = a.write(dir / "a.safetensors");
  const auto rb = b.write(dir / "b.safetensors");
  const std::string bytes = test_support::read_bytes(dir / "a.safetensors");
  CHECK(bytes == test_support::read_bytes(dir / "b.safetensors"));
  CHECK(ra.xxh64 == rb.xxh64);
  CHECK(ra.xxh64 == XXH64(bytes.data(), bytes.size(), 0));
  CHECK(ra.bytes == bytes.size());
  const SafetensorsFile f = SafetensorsFile::open(dir / "a.safetensors");
  CHECK(f.xxh64() == ra.xxh64);
  CHECK(f.data_offset() % 8 == 0);
  CHECK(f.header_bytes() == a.header().size());
  const std::string header = bytes.substr(8, f.header_bytes());
  CHECK(header.find_last_not_of(' ') == header.find_last_of('}'));
  CHECK(header.substr(0, 15) == "{\"__metadata__\"");
  // Tensors are laid out in the order they were added.
  CHECK(f.at("layers.0.weight").begin == 0);
  CHECK(f.at("layers.0.bias").begin == 24);
  CHECK(f.at("step").begin == 30);
}

TEST_CASE("fill functions run once each, in order, with their tensor's exact size") {
  test_support::TempDir dir;
  std::vector<std::pair<std::string, std::size_t>> calls;
  SafetensorsWriter w;
  const float x[2] = {1, 2};
  w.add("c", DType::f16, {4}, [&](std::span<std::byte> out) { calls.emplace_back("c", out.size()); });
  w.add("a", DType::f32, {2}, x);
  w.add("b", DType::i64, {3}, [&](std::span<std::byte> out) { calls.emplace_back("b", out.size()); });
  w.add("e", DType::bf16, {0}, [&](std::span<std::byte> out) { calls.emplace_back("e", out.size()); });
  w.write(dir / "f.safetensors");
  CHECK(calls == std::vector<std::pair<std::string, std::size_t>>{{"c", 8}, {"b", 24}, {"e", 0}});
}

TEST_CASE("a fill function that throws leaves no file and names the file and the tensor") {
  test_support::TempDir dir;
  const auto path = dir / "ckpt.safetensors";
  test_support::write_bytes(path, "old content");
  const std::vector<std::byte> big = pattern(8u << 20, 1);
  // The first tensor from host memory, or from a fill whose bytes are still being written
  // on the writer's second thread when the next fill throws.
  for (const bool first_filled : {false, true}) {
    CAPTURE(first_filled);
    SafetensorsWriter w;
    const std::int64_t n = static_cast<std::int64_t>(big.size());
    if (first_filled)
      w.add("first", DType::u8, {n}, [&](std::span<std::byte> out) { std::memcpy(out.data(), big.data(), out.size()); });
    else
      w.add("first", DType::u8, {n}, big.data());
    w.add("second", DType::f32, {4}, [](std::span<std::byte>) { throw std::runtime_error("gather failed on rank 3"); });
    const std::string err = error_of([&] { w.write(path); });
    CHECK(contains(err, "cannot write '" + path.string() + "'"));
    CHECK(contains(err, "tensor 'second'"));
    CHECK(contains(err, "gather failed on rank 3"));
    CHECK(test_support::read_bytes(path) == "old content");
    CHECK(test_support::names_in(dir.path()) == std::vector<std::string>{"ckpt.safetensors"});
  }
}

TEST_CASE("the writer refuses bad names, shapes and data, naming the tensor") {
  SafetensorsWriter w;
  const float x = 1;
  w.add("w", DType::f32, {}, &x);
  auto err = [&](auto&& fn) { return error_of(fn); };
  CHECK(contains(err([&] { w.add("w", DType::f32, {}, &x); }), "tensor 'w': added twice"));
  CHECK(contains(err([&] { w.add("__metadata__", DType::f32, {}, &x); }), "reserved"));
  CHECK(contains(err([&] { w.add("__x", DType::f32, {}, &x); }), "tensor '__x'"));
  CHECK(contains(err([&] { w.add("", DType::f32, {}, &x); }), "the name is empty"));
  CHECK(contains(err([&] { w.add("neg", DType::f32, {2, -1}, &x); }), "tensor 'neg': shape [2, -1] has a negative"));
  CHECK(contains(err([&] { w.add("huge", DType::f32, {1LL << 32, 1LL << 32}, &x); }), "tensor 'huge': shape"));
  CHECK(contains(err([&] { w.add("huge", DType::f64, {1LL << 61}, &x); }), "overflows"));
  CHECK(contains(err([&] { w.add("null", DType::f32, {2}, static_cast<const void*>(nullptr)); }), "tensor 'null': host data is null"));
  CHECK(contains(err([&] { w.add("nofill", DType::f32, {2}, SafetensorsWriter::Fill{}); }), "tensor 'nofill'"));
  CHECK(contains(err([&] { w.add(std::string("bad\xff", 4), DType::f32, {}, &x); }), "not valid UTF-8"));
  CHECK(contains(err([&] { w.set_metadata("k", "\xc3"); }), "metadata 'k' is not valid UTF-8"));
  // Offsets of all tensors together overflow too.
  SafetensorsWriter v;
  v.add("a", DType::u8, {INT64_MAX}, [](std::span<std::byte>) {});
  v.add("b", DType::u8, {INT64_MAX}, [](std::span<std::byte>) {});
  CHECK(contains(err([&] { v.add("c", DType::u8, {4}, &x); }), "tensor 'c'"));
  CHECK(w.size() == 1);  // refused adds leave nothing behind
}

namespace {
struct BadFile {
  const char* what;
  std::string bytes;
  std::vector<std::string> expected;
};

std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return "{\"dtype\":" + dtype + ",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}
std::string one(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return "{\"a\":" + entry(dtype, shape, offsets) + "}";
}
const std::string ok_a = entry("\"F32\"", "[2]", "[0,8]");
}  // namespace

TEST_CASE("the reader refuses every malformed header, naming the file, the key and the value") {
  using test_support::safetensors_bytes;
  const std::string d8(8, 'x');
  std::string huge(8, '\0');
  const std::uint64_t over = 100'000'001;
  std::memcpy(huge.data(), &over, 8);
  std::string past(8, '\0');
  const std::uint64_t hundred = 100;
  std::memcpy(past.data(), &hundred, 8);
  const std::vector<BadFile> cases = {
      {"empty file", "", {"too short"}},
      {"7 bytes", "1234567", {"7 bytes is too short"}},
      {"header length 0", safetensors_bytes(""), {"header length is 0"}},
      {"header length over 100 MB", huge + "{}", {"header length 100000001 is over the limit"}},
      {"header past the end", past + "{}      ", {"header length 100 runs past the end of the file (16 bytes"}},
      {"invalid JSON", safetensors_bytes("{\"a\":"), {"not valid JSON", "parse error"}},
      {"invalid UTF-8", safetensors_bytes("{\"\xff\":1}"), {"not valid JSON"}},
      {"not an object", safetensors_bytes("[1,2]"), {"not a JSON object but [1,2]"}},
      {"deeply nested", safetensors_bytes(std::string(1 << 20, '[') + std::string(1 << 20, ']')), {"nests deeper than 16 levels"}},
      {"long value quoted short", safetensors_bytes("[" + std::string(1000, '7') + "]"), {"number overflow parsing '777", "77..."}},
      {"long array quoted short", safetensors_bytes([] {
         std::string many = "[1";
         for (int i = 0; i < 500; ++i) many += ",1";
         return many + "]";
       }()),
       {"not a JSON object but [1,1,1,", "1,..."}},
      {"entry not an object", safetensors_bytes("{\"a\":5}"), {"tensor 'a'", "not an object but 5"}},
      {"unknown dtype", safetensors_bytes(one("\"U16\"", "[2]", "[0,4]"), "1234"), {"tensor 'a'", "dtype \"U16\" is not supported"}},
      {"dtype not a string", safetensors_bytes(one("7", "[2]", "[0,8]"), d8), {"tensor 'a'", "dtype 7"}},
      {"negative dim", safetensors_bytes(one("\"F32\"", "[-2]", "[0,8]"), d8), {"tensor 'a'", "shape [-2]", "[0, 2^63)"}},
      {"fractional dim", safetensors_bytes(one("\"F32\"", "[2.5]", "[0,8]"), d8), {"tensor 'a'", "shape [2.5]"}},
      {"shape not an array", safetensors_bytes(one("\"F32\"", "2", "[0,8]"), d8), {"tensor 'a'", "shape 2 is not an array"}},
      {"dim product overflows", safetensors_bytes(one("\"F32\"", "[4294967296,4294967296]", "[0,8]"), d8),
       {"tensor 'a'", "shape [4294967296, 4294967296] of F32 overflows"}},
      {"byte count overflows", safetensors_bytes(one("\"F64\"", "[2305843009213693952]", "[0,8]"), d8), {"tensor 'a'", "overflows"}},
      {"dim past int64", safetensors_bytes(one("\"U8\"", "[9223372036854775808]", "[0,8]"), d8), {"tensor 'a'", "[0, 2^63)"}},
      {"offsets reversed", safetensors_bytes(one("\"F32\"", "[2]", "[8,0]"), d8), {"tensor 'a'", "data_offsets [8,0] is not [begin, end]"}},
      {"one offset", safetensors_bytes(one("\"F32\"", "[2]", "[8]"), d8), {"tensor 'a'", "data_offsets [8]"}},
      {"three offsets", safetensors_bytes(one("\"F32\"", "[2]", "[0,8,8]"), d8), {"tensor 'a'", "data_offsets [0,8,8]"}},
      {"negative offset", safetensors_bytes(one("\"F32\"", "[2]", "[-8,0]"), d8), {"tensor 'a'", "data_offsets [-8,0]"}},
      {"offsets not an array", safetensors_bytes(one("\"F32\"", "[2]", "\"0-8\""), d8), {"tensor 'a'", "data_offsets \"0-8\""}},
      {"size mismatch", safetensors_bytes(one("\"F32\"", "[3]", "[0,8]"), d8),
       {"tensor 'a'", "span 8 bytes but shape [3] of F32 needs 12"}},
      {"overlap", safetensors_bytes("{\"a\":" + ok_a + ",\"b\":" + entry("\"F32\"", "[2]", "[4,12]") + "}", d8 + "1234"),
       {"tensor 'b'", "data_offsets [4, 12] overlap tensor 'a' [0, 8]"}},
      {"empty tensor inside another", safetensors_bytes("{\"a\":" + ok_a + ",\"e\":" + entry("\"F32\"", "[0]", "[4,4]") + "}", d8),
       {"tensor 'e'", "overlap tensor 'a'"}},
      {"hole", safetensors_bytes("{\"a\":" + ok_a + ",\"b\":" + entry("\"F32\"", "[2]", "[12,20]") + "}", d8 + d8 + "1234"),
       {"tensor 'b'", "leave bytes [8, 12) of the data buffer unused"}},
      {"hole at the start", safetensors_bytes(one("\"F32\"", "[2]", "[4,12]"), d8 + "1234"), {"tensor 'a'", "leave bytes [0, 4)"}},
      {"extra bytes", safetensors_bytes(one("\"F32\"", "[2]", "[0,8]"), d8 + "1234"), {"4 bytes after the last tensor's end"}},
      {"data but no tensors", safetensors_bytes("{}", d8), {"8 bytes after the last tensor's end"}},
      {"truncated data", safetensors_bytes(one("\"F32\"", "[2]", "[0,8]"), "1234"),
       {"tensor 'a'", "end past the data buffer, which has 4 bytes (the file is truncated)"}},
      {"metadata not an object", safetensors_bytes("{\"__metadata__\":[1]}"), {"__metadata__ is not an object but [1]"}},
      {"metadata value not a string", safetensors_bytes("{\"__metadata__\":{\"step\":12}}"), {"__metadata__ value of 'step' is not a string but 12"}},
      {"duplicate tensor", safetensors_bytes("{\"a\":" + ok_a + ",\"a\":" + entry("\"F32\"", "[2]", "[8,16]") + "}", d8 + d8),
       {"the key 'a' twice"}},
      {"duplicate field", safetensors_bytes("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,8]}}", d8),
       {"the key 'dtype' twice"}},
      {"missing field", safetensors_bytes("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", d8), {"tensor 'a'", "the field 'shape' is missing"}},
      {"unknown field", safetensors_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", d8),
       {"tensor 'a'", "unknown field 'x'"}},
  };
  test_support::TempDir dir;
  for (const BadFile& c : cases) {
    const std::string what = c.what;
    CAPTURE(what);
    const auto path = dir / "bad.safetensors";
    test_support::write_bytes(path, c.bytes);
    const std::string err = open_error(path);
    CHECK(contains(err, "safetensors file '" + path.string() + "'"));
    for (const std::string& part : c.expected) CHECK_MESSAGE(contains(err, part), err);
    CHECK(err.size() < path.string().size() + 300);  // corrupt values are quoted, not copied whole
  }
}

TEST_CASE("edge cases that are valid: no tensors, empty tensors sharing an offset, a header with trailing spaces") {
  using test_support::safetensors_bytes;
  test_support::TempDir dir;
  const auto path = dir / "ok.safetensors";
  test_support::write_bytes(path, safetensors_bytes("{}"));
  CHECK(SafetensorsFile::open(path).tensors().empty());
  test_support::write_bytes(path, safetensors_bytes("{\"z\":" + entry("\"F32\"", "[0]", "[8,8]") + ",\"a\":" + ok_a +
                                                    ",\"e\":" + entry("\"I64\"", "[0,3]", "[8,8]") + "}   ",
                                                    std::string(8, 'x')));
  const SafetensorsFile f = SafetensorsFile::open(path);
  REQUIRE(f.tensors().size() == 3);
  CHECK(f.tensors()[0].name == "a");  // data order, then name
  CHECK(f.tensors()[1].name == "e");
  CHECK(f.tensors()[2].name == "z");
  CHECK(f.at("e").shape == Shape{0, 3});
}

TEST_CASE("every truncation of a valid file is refused, and so are bytes appended to it") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  sample_writer(keep).write(dir / "good.safetensors");
  const std::string good = test_support::read_bytes(dir / "good.safetensors");
  const auto path = dir / "cut.safetensors";
  test_support::write_bytes(path, good);
  for (std::size_t n = good.size(); n-- > 0;) {
    CAPTURE(n);
    std::filesystem::resize_file(path, n);
    const std::string err = open_error(path);
    CHECK(contains(err, path.string()));
  }
  test_support::write_bytes(path, good + "x");
  CHECK(contains(open_error(path), "1 bytes after the last tensor's end"));
}

TEST_CASE("bit flips in the length and header give an error or a valid file, never a crash") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  sample_writer(keep).write(dir / "good.safetensors");
  const std::string good = test_support::read_bytes(dir / "good.safetensors");
  const std::size_t header_end = 8 + SafetensorsFile::open(dir / "good.safetensors").header_bytes();
  const auto path = dir / "flip.safetensors";
  test_support::write_bytes(path, good);
  std::FILE* file = std::fopen(path.c_str(), "r+b");
  REQUIRE(file != nullptr);
  auto put = [&](std::size_t at, char c) {  // in place: rewriting the file each time is slow
    REQUIRE(std::fseek(file, static_cast<long>(at), SEEK_SET) == 0);
    REQUIRE(std::fputc(c, file) != EOF);
    REQUIRE(std::fflush(file) == 0);
  };
  int refused = 0, still_valid = 0;
  for (std::size_t byte = 0; byte < header_end; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      put(byte, static_cast<char>(good[byte] ^ (1 << bit)));
      try {
        const SafetensorsFile f = SafetensorsFile::open(path);
        // Still valid: the tensors cover the data buffer exactly and read back.
        std::uint64_t total = 0;
        for (const auto& t : f.tensors()) {
          total += t.bytes();
          std::vector<std::byte> out(t.bytes());
          f.read(t.name, out.data(), out.size());
        }
        CHECK(total == f.file_bytes() - f.data_offset());
        ++still_valid;
      } catch (const fsdp::Error& e) {
        CHECK(contains(e.what(), path.string()));
        ++refused;
      }
      put(byte, good[byte]);
    }
  }
  std::fclose(file);
  MESSAGE(refused, " flips refused, ", still_valid, " still valid");
  CHECK(refused > 0);
  CHECK(still_valid > 0);  // e.g. flips inside metadata values or spaces of the padding
  // A flip in the data buffer is invisible to the header but not to the checksum.
  std::string bytes = good;
  bytes[header_end + 3] ^= 0x10;
  test_support::write_bytes(path, bytes);
  CHECK(SafetensorsFile::open(path).xxh64() != XXH64(good.data(), good.size(), 0));
}

TEST_CASE("reads check their sizes and ranges; partial reads return the requested bytes") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  sample_writer(keep).write(dir / "s.safetensors");
  const SafetensorsFile f = SafetensorsFile::open(dir / "s.safetensors");
  std::vector<std::byte> out(64);
  CHECK(contains(error_of([&] { f.read("layers.0.weight", out.data(), 20); }),
                 "tensor 'layers.0.weight' has 24 bytes but the destination has 20"));
  CHECK(contains(error_of([&] { f.read_bytes("layers.0.weight", 20, 8, out.data()); }), "bytes [20, +8) are outside its 24 bytes"));
  CHECK(contains(error_of([&] { f.read_bytes("layers.0.weight", UINT64_MAX, 2, out.data()); }), "outside"));
  CHECK(contains(error_of([&] { f.read_elements("layers.0.weight", 5, 2, out.data()); }), "elements [5, +2) are outside its 6"));
  CHECK(contains(error_of([&] { f.read("nope", out.data(), 4); }), "no tensor 'nope'"));
  f.read_bytes("layers.0.weight", 5, 10, out.data());
  CHECK(std::equal(out.begin(), out.begin() + 10, keep[0].begin() + 5));
  f.read_elements("layers.0.weight", 2, 3, out.data());
  CHECK(std::equal(out.begin(), out.begin() + 12, keep[0].begin() + 8));
}

TEST_CASE("a file that shrinks after open fails its reads instead of returning garbage") {
  test_support::TempDir dir;
  std::vector<std::vector<std::byte>> keep;
  const auto path = dir / "s.safetensors";
  sample_writer(keep).write(path);
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::filesystem::resize_file(path, f.data_offset() + 10);
  std::vector<std::byte> out(24);
  const std::string err = error_of([&] { f.read("layers.0.weight", out.data(), out.size()); });
  CHECK(contains(err, path.string()));
  CHECK(contains(err, "reading tensor 'layers.0.weight' hit the end of the file"));
  CHECK(contains(error_of([&] { f.xxh64(); }), "shrank"));
}

TEST_CASE("files that cannot be opened are errors naming the path and the reason") {
  test_support::TempDir dir;
  CHECK(contains(open_error(dir / "missing.safetensors"), "No such file or directory"));
  CHECK(contains(open_error(dir / "missing.safetensors"), "missing.safetensors"));
  CHECK(contains(open_error(dir.path()), "is not a regular file"));
}

TEST_CASE("safetensors dtype names map both ways") {
  for (DType t : all_dtypes) CHECK(fsdp::checkpoint::dtype_from_safetensors(fsdp::checkpoint::safetensors_dtype_name(t)) == t);
  CHECK(fsdp::checkpoint::safetensors_dtype_name(DType::bf16) == "BF16");
  // The 8-bit floats under safetensors' names, and back.
  CHECK(fsdp::checkpoint::safetensors_dtype_name(DType::f8e4m3) == "F8_E4M3");
  CHECK(fsdp::checkpoint::safetensors_dtype_name(DType::f8e5m2) == "F8_E5M2");
  CHECK(fsdp::checkpoint::safetensors_dtype_name(DType::e8m0) == "F8_E8M0");
  for (DType t : {DType::f8e4m3, DType::f8e5m2, DType::e8m0})
    CHECK(fsdp::checkpoint::dtype_from_safetensors(fsdp::checkpoint::safetensors_dtype_name(t)) == t);
  CHECK(!fsdp::checkpoint::dtype_from_safetensors("f32"));
  CHECK(!fsdp::checkpoint::dtype_from_safetensors("BOOL"));
}

}  // namespace checkpoint_safetensors_test
