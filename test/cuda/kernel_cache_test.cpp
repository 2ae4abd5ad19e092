// fsdp/cuda/kernel_cache.hpp: the on-disk cache of CudaDevice's NVRTC-compiled kernels.
// No GPU needed: the entries are real NVRTC compiles of the real kernels (for sm_90), and
// what is checked is the cache's logic: a hit returns the very bytes compiled, a
// truncated, corrupt or foreign entry is recompiled and rewritten, never loaded, writes
// leave no temporary behind, and the environment picks the directory or turns it off.
#include <doctest/doctest.h>

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/cuda/cuda_kernels.hpp"
#include "test/support/scoped_env.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp::detail::KernelCache;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "fsdp_kernel_cache_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<char> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  for (auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  return out;
}

using test_support::ScopedEnv;

}  // namespace

TEST_CASE("entries round-trip; truncated, corrupt and foreign files are misses") {
  TempDir tmp;
  const KernelCache cache(tmp.path / "a" / "b");  // created on the first store
  const std::vector<char> code = {'c', 'u', 'b', 'i', 'n', '\0', '\x7f', 'x'};
  const auto key = KernelCache::key_of({"source", "sm_90"});
  CHECK_FALSE(cache.load(key, "sm_90").has_value());
  REQUIRE(cache.store(key, "sm_90", code));
  CHECK(cache.load(key, "sm_90") == code);
  CHECK(files_in(cache.dir()).size() == 1);  // no temporary left behind
  CHECK_FALSE(cache.load(key ^ 1, "sm_90").has_value());
  CHECK_FALSE(cache.load(key, "sm_80").has_value());

  const fs::path file = cache.path_of(key, "sm_90");
  const std::vector<char> whole = read_file(file);
  SUBCASE("truncated") { write_file(file, std::vector<char>(whole.begin(), whole.end() - 1)); }
  SUBCASE("truncated into the header") { write_file(file, std::vector<char>(whole.begin(), whole.begin() + 12)); }
  SUBCASE("a byte of code flipped") {
    auto bad = whole;
    bad[bad.size() - 3] ^= 0x20;
    write_file(file, bad);
  }
  SUBCASE("longer than its header says") {
    auto bad = whole;
    bad.push_back('!');
    write_file(file, bad);
  }
  SUBCASE("another key's entry under this name") {
    const KernelCache other(tmp.path / "other");
    REQUIRE(other.store(key ^ 1, "sm_90", code));
    write_file(file, read_file(other.path_of(key ^ 1, "sm_90")));
  }
  SUBCASE("not an entry at all") { write_file(file, std::vector<char>(64, 'z')); }
  CHECK_FALSE(cache.load(key, "sm_90").has_value());
}

TEST_CASE("the key covers every part and where parts end") {
  CHECK(KernelCache::key_of({"ab", "c"}) != KernelCache::key_of({"a", "bc"}));
  CHECK(KernelCache::key_of({"src", "sm_90"}) != KernelCache::key_of({"src", "sm_80"}));
  CHECK(fsdp::detail::cuda_kernel_cache_key("sm_90") != fsdp::detail::cuda_kernel_cache_key("sm_80"));
  CHECK(fsdp::detail::cuda_kernel_cache_key("sm_90") == fsdp::detail::cuda_kernel_cache_key("sm_90"));
}

TEST_CASE("a directory that cannot be made leaves compilation as it was") {
  TempDir tmp;
  write_file(tmp.path / "file", {'x'});
  const KernelCache cache(tmp.path / "file" / "sub");  // under a regular file
  CHECK_FALSE(cache.store(1, "sm_90", {'a'}));
  fsdp::detail::CudaKernelImage image;
  REQUIRE_NOTHROW(image = fsdp::detail::load_cuda_kernels(9, 0, 0, cache));
  CHECK_FALSE(image.from_cache);
  CHECK(!image.code.empty());
}

TEST_CASE("the real kernels: compiled once, then loaded; a damaged entry is recompiled and rewritten") {
  TempDir tmp;
  const KernelCache cache(tmp.path);
  const auto first = fsdp::detail::load_cuda_kernels(9, 0, 0, cache);
  CHECK_FALSE(first.from_cache);
  CHECK(first.arch == "sm_90");
  REQUIRE(!first.code.empty());
  const fs::path file = cache.path_of(fsdp::detail::cuda_kernel_cache_key("sm_90"), "sm_90");
  REQUIRE(fs::exists(file));

  const auto second = fsdp::detail::load_cuda_kernels(9, 0, 0, cache);
  CHECK(second.from_cache);
  CHECK(second.arch == "sm_90");
  CHECK(second.code == first.code);

  auto whole = read_file(file);
  SUBCASE("truncated") { whole.resize(whole.size() / 2); }
  SUBCASE("corrupt") { whole[whole.size() / 2] ^= 0x01; }
  write_file(file, whole);
  const auto third = fsdp::detail::load_cuda_kernels(9, 0, 0, cache);
  CHECK_FALSE(third.from_cache);  // recompiled, not loaded
  CHECK(third.code.size() == first.code.size());
  const auto fourth = fsdp::detail::load_cuda_kernels(9, 0, 0, cache);  // rewritten whole
  CHECK(fourth.from_cache);
  CHECK(fourth.code == third.code);
}

TEST_CASE("a PTX fallback is cached under its own architecture") {
  TempDir tmp;
  const KernelCache cache(tmp.path);
  const auto first = fsdp::detail::load_cuda_kernels(99, 9, 0, cache);
  REQUIRE(first.arch.rfind("compute_", 0) == 0);
  const auto again = fsdp::detail::load_cuda_kernels(99, 9, 0, cache);
  CHECK(again.from_cache);
  CHECK(again.arch == first.arch);
  CHECK(again.code == first.code);
  CHECK(again.code.back() == '\0');  // PTX keeps its terminating NUL through the cache
}

TEST_CASE("writers racing on one key leave one whole entry") {
  TempDir tmp;
  const KernelCache cache(tmp.path);
  std::vector<char> code(100000);
  for (std::size_t i = 0; i < code.size(); ++i) code[i] = static_cast<char>(i * 7);
  std::vector<std::thread> writers;
  for (int t = 0; t < 4; ++t)
    writers.emplace_back([&] {
      for (int i = 0; i < 20; ++i) cache.store(42, "sm_90", code);
    });
  for (int i = 0; i < 50; ++i) {
    const auto got = cache.load(42, "sm_90");
    if (got) CHECK(*got == code);  // a reader sees a whole entry or none
  }
  for (auto& w : writers) w.join();
  CHECK(cache.load(42, "sm_90") == code);
  CHECK(files_in(tmp.path).size() == 1);
}

TEST_CASE("the environment picks the directory, or turns the cache off") {
  {
    ScopedEnv c("FSDP_KERNEL_CACHE", "off");
    CHECK_FALSE(KernelCache::from_environment().enabled());
  }
  {
    ScopedEnv c("FSDP_KERNEL_CACHE", "0");
    CHECK_FALSE(KernelCache::from_environment().enabled());
  }
  for (const char* off : {"false", "NO", "Off"}) {  // every boolean spelling of off, not a directory named so
    ScopedEnv c("FSDP_KERNEL_CACHE", off);
    CHECK_FALSE(KernelCache::from_environment().enabled());
  }
  {
    ScopedEnv c("FSDP_KERNEL_CACHE", "/some/dir");
    CHECK(KernelCache::from_environment().dir() == fs::path("/some/dir"));
  }
  {  // on: the default place, not a directory named "on"
    ScopedEnv c("FSDP_KERNEL_CACHE", "on"), x("XDG_CACHE_HOME", "/xdg");
    CHECK(KernelCache::from_environment().dir() == fs::path("/xdg/fsdp/kernels"));
  }
  {
    ScopedEnv c("FSDP_KERNEL_CACHE", std::nullopt), x("XDG_CACHE_HOME", "/xdg");
    CHECK(KernelCache::from_environment().dir() == fs::path("/xdg/fsdp/kernels"));
  }
  {
    ScopedEnv c("FSDP_KERNEL_CACHE", std::nullopt), x("XDG_CACHE_HOME", std::nullopt), h("HOME", "/home/u");
    CHECK(KernelCache::from_environment().dir() == fs::path("/home/u/.cache/fsdp/kernels"));
  }
  {
    ScopedEnv c("FSDP_KERNEL_CACHE", std::nullopt), x("XDG_CACHE_HOME", std::nullopt), h("HOME", std::nullopt);
    CHECK_FALSE(KernelCache::from_environment().enabled());
  }
  ScopedEnv c("FSDP_KERNEL_CACHE", "off");
  const auto image = fsdp::detail::load_cuda_kernels(9, 0, 0, KernelCache::from_environment());
  CHECK_FALSE(image.from_cache);
}
