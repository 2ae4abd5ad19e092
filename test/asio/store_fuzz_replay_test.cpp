// Replays the checked-in fuzz corpus (test/asio/store_fuzz_corpus/: seeds for every
// verb and reply, plus what libFuzzer found that adds coverage) through the fuzz
// target's checks, built with g++, so every test run exercises the parser on them.
// tools/fuzz_store.sh runs libFuzzer itself.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "store_fuzz_check.hpp"

namespace asio_store_fuzz_replay_test {

namespace {

// The test runs from the workspace root, under Bazel and by hand alike.
const std::filesystem::path corpus = "test/asio/store_fuzz_corpus";

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("every corpus input keeps the frame invariants") {
  REQUIRE(std::filesystem::is_directory(corpus));
  std::vector<std::filesystem::path> inputs;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) inputs.push_back(entry.path());
  CHECK(inputs.size() >= 100);
  for (const auto& p : inputs) {
    CAPTURE(p.string());
    const std::string bytes = read_file(p);
    CHECK_NOTHROW(store_fuzz::check_frames(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
  }
  for (const char* seed : {"request_hello", "request_compare_set", "reply_timeout_wait", "garbage_http"})
    CHECK(std::filesystem::exists(corpus / seed));
}

}  // namespace asio_store_fuzz_replay_test
