// fsdp/checkpoint/atomic_file.hpp: a written file is complete; a failed or killed write
// leaves the old file (or none) and, when the process survives, no temporary file.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <cstddef>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fsdp/checkpoint/atomic_file.hpp>
#include <fsdp/checkpoint/safetensors.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/checkpoint/child_process.hpp"
#include "test/support/errors.hpp"

namespace checkpoint_atomic_file_test {

using fsdp::checkpoint::FileSink;
using fsdp::checkpoint::write_file_atomically;
using test_support::contains;
using test_support::error_of;
using test_support::names_in;

TEST_CASE("a write publishes the whole content with its size and XXH64, and leaves nothing else") {
  test_support::TempDir dir;
  const auto path = dir / "out.bin";
  std::string expected;
  const std::string big((3u << 20) + 7, 'b');  // larger than the sink's buffer
  const auto result = write_file_atomically(path, [&](FileSink& sink) {
    for (int i = 0; i < 1000; ++i) sink.write(std::to_string(i));  // small writes, buffered
    sink.write(big);
    sink.write("tail", 4);
    CHECK(sink.path() == path);
  });
  for (int i = 0; i < 1000; ++i) expected += std::to_string(i);
  expected += big + "tail";
  CHECK(test_support::read_bytes(path) == expected);
  CHECK(result.bytes == expected.size());
  CHECK(result.xxh64 == XXH64(expected.data(), expected.size(), 0));
  CHECK(result.xxh64 == fsdp::checkpoint::detail::file_xxh64(path));
  CHECK(names_in(dir.path()) == std::vector<std::string>{"out.bin"});
  // Over an existing file, and an empty file.
  write_file_atomically(path, [](FileSink& sink) { sink.write("new"); });
  CHECK(test_support::read_bytes(path) == "new");
  CHECK(write_file_atomically(dir / "empty", [](FileSink&) {}).bytes == 0);
  CHECK(std::filesystem::file_size(dir / "empty") == 0);
}

TEST_CASE("a function that throws half-way leaves the old file untouched and no temporary file") {
  test_support::TempDir dir;
  const auto path = dir / "ckpt.bin";
  test_support::write_bytes(path, "old");
  const std::string half(5u << 20, 'x');
  const std::string err = error_of([&] {
    write_file_atomically(path, [&](FileSink& sink) {
      sink.write(half);
      throw std::runtime_error("optimizer state missing");
    });
  });
  CHECK(contains(err, "cannot write '" + path.string() + "': optimizer state missing"));
  CHECK(test_support::read_bytes(path) == "old");
  CHECK(names_in(dir.path()) == std::vector<std::string>{"ckpt.bin"});
  // Without an old file: none afterwards.
  CHECK_THROWS_AS(write_file_atomically(dir / "fresh", [](FileSink& s) { s.write("x"); throw fsdp::Error("boom"); }),
                  fsdp::Error);
  CHECK(!std::filesystem::exists(dir / "fresh"));
  // Exceptions that are not std::exception pass through unchanged, and still clean up.
  CHECK_THROWS_AS(write_file_atomically(dir / "fresh", [](FileSink& s) { s.write("x"); throw 42; }), int);
  CHECK(names_in(dir.path()) == std::vector<std::string>{"ckpt.bin"});
}

TEST_CASE("a missing directory or a path without a file name is an error naming the path and the reason") {
  test_support::TempDir dir;
  const std::string err = error_of([&] { write_file_atomically(dir / "no" / "f", [](FileSink&) {}); });
  CHECK(contains(err, "cannot write '" + (dir / "no" / "f").string() + "'"));
  CHECK(contains(err, "No such file or directory"));
  CHECK(contains(error_of([&] { write_file_atomically(dir.path() / "", [](FileSink&) {}); }), "names no file"));
  // A directory in the way of the rename.
  std::filesystem::create_directory(dir / "taken");
  std::filesystem::create_directory(dir / "taken" / "sub");
  CHECK(contains(error_of([&] { write_file_atomically(dir / "taken", [](FileSink& s) { s.write("x"); }); }),
                 "renaming"));
  CHECK(names_in(dir.path()) == std::vector<std::string>{"taken"});
}

TEST_CASE("a write the file system refuses (file size limit) fails with the reason and removes the temporary") {
  test_support::TempDir dir;
  const auto path = dir / "big.bin";
  test_support::write_bytes(path, "old");
  // RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk fails it with ENOSPC; it is
  // set in a child so the test process keeps its limits.
  test_support::ChildProcess child([&](const test_support::Parent& parent) {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{1u << 20, 1u << 20};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    const std::string chunk(256u << 10, 'z');
    parent.report(error_of([&] {
      write_file_atomically(path, [&](FileSink& sink) {
        for (int i = 0; i < 16; ++i) sink.write(chunk);
      });
    }));
  });
  const std::string err = child.rest();
  CHECK(WIFEXITED(child.wait()));
  CHECK(contains(err, "cannot write '" + path.string() + "'"));
  CHECK(contains(err, "File too large"));
  CHECK(test_support::read_bytes(path) == "old");
  CHECK(names_in(dir.path()) == std::vector<std::string>{"big.bin"});
}

TEST_CASE("a process killed at any point of a write leaves the old file or the new one, complete") {
  using fsdp::DType;
  test_support::TempDir dir;
  const auto path = dir / "model.safetensors";
  constexpr int tensors = 8;
  constexpr std::int64_t elements = 64 << 10;  // 256 KiB each
  auto save = [&](const char* version, const test_support::Parent* parent) {
    fsdp::checkpoint::SafetensorsWriter w;
    w.set_metadata("version", version);
    for (int t = 0; t < tensors; ++t) {
      w.add("t" + std::to_string(t), DType::f32, {elements}, [=](std::span<std::byte> out) {
        if (parent != nullptr) {  // stop mid-file until the parent says go on (or kills us)
          parent->report('f');
          parent->wait_for_go();
        }
        std::vector<float> v(elements, static_cast<float>(t) + (version[0] == 'n' ? 0.5f : 0.0f));
        std::memcpy(out.data(), v.data(), out.size());
      });
    }
    w.write(path);
  };
  auto version_of = [&] {
    const auto f = fsdp::checkpoint::SafetensorsFile::open(path);  // validates the header
    REQUIRE(f.tensors().size() == tensors);
    const std::string version = f.metadata().at("version");
    std::vector<float> v(elements);
    for (int t = 0; t < tensors; ++t) {
      f.read("t" + std::to_string(t), v.data(), v.size() * sizeof(float));
      CHECK(v.front() == static_cast<float>(t) + (version == "new" ? 0.5f : 0.0f));
      CHECK(v.back() == v.front());
    }
    return version;
  };
  save("old", nullptr);
  // Kill while blocked in fill k (k = 1..tensors: the temporary file is partly written),
  // and after write() returned (k = tensors + 1).
  for (int kill_at : {1, 2, tensors / 2, tensors, tensors + 1}) {
    CAPTURE(kill_at);
    test_support::ChildProcess child([&](const test_support::Parent& parent) {
      save("new", &parent);
      parent.report('d');
      parent.wait_for_go();
    });
    for (int step = 1; step <= kill_at; ++step) {
      REQUIRE(child.next() == (step <= tensors ? 'f' : 'd'));
      if (step < kill_at) child.go();
    }
    child.kill();
    const int status = child.wait();
    REQUIRE(WIFSIGNALED(status));
    CHECK(version_of() == (kill_at <= tensors ? "old" : "new"));
    if (kill_at <= tensors) {  // the killed process leaves its hidden temporary file, nothing else
      const auto names = names_in(dir.path());
      CHECK(names.size() == 2);
      CHECK(names.front().rfind(".model.safetensors.tmp-", 0) == 0);
    }
    for (const auto& name : names_in(dir.path()))
      if (name != "model.safetensors") std::filesystem::remove(dir / name);
    save("old", nullptr);
  }
  // And at whatever point a timer hits, a few times.
  for (int round = 0; round < 6; ++round) {
    test_support::ChildProcess child([&](const test_support::Parent&) {
      for (;;) {
        save("new", nullptr);
        save("old", nullptr);
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(3 + 7 * round));
    child.kill();
    REQUIRE(WIFSIGNALED(child.wait()));
    version_of();  // whichever version is there opens and has every tensor right
  }
}

}  // namespace checkpoint_atomic_file_test
