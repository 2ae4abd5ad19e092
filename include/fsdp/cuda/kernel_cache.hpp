#pragma once
// The on-disk cache of CudaDevice's compiled kernels, so that only a machine's first
// process pays NVRTC's compile (docs/cuda.md has the figures). One file per key: a hash of
// everything the compiled code depends on (kernel source, architecture, NVRTC options and
// version), named by that hash. An entry is written to a temporary file and renamed into
// place, so readers see a whole entry or none; it carries its key, its size and a hash of
// its code, so a truncated, corrupt or foreign file is never loaded: it counts as a miss,
// is recompiled and overwritten. The cache is an optimization: a directory that cannot be
// created or written leaves compilation as it was, never an error.
//
// Where (first that applies):  FSDP_KERNEL_CACHE=off (or 0, false, no): no cache;
//   FSDP_KERNEL_CACHE=<dir>;  $XDG_CACHE_HOME/fsdp/kernels;  $HOME/.cache/fsdp/kernels.
// FSDP_KERNEL_CACHE=on (or 1, true, yes) asks for the default place, not a directory "on".
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/core/parse.hpp"

namespace fsdp::detail {

class KernelCache {
 public:
  KernelCache() = default;  // disabled
  explicit KernelCache(std::filesystem::path dir) : dir_(std::move(dir)) {}

  // The cache the environment asks for (see above); disabled when none applies.
  static KernelCache from_environment() {
    const char* env = std::getenv("FSDP_KERNEL_CACHE");
    if (env && *env) {
      const auto b = as_bool(env);
      if (b && !*b) return {};
      if (!b) return KernelCache(env);  // a directory; a true boolean falls through to the default
    }
    if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
      return KernelCache(std::filesystem::path(xdg) / "fsdp" / "kernels");
    if (const char* home = std::getenv("HOME"); home && *home)
      return KernelCache(std::filesystem::path(home) / ".cache" / "fsdp" / "kernels");
    return {};
  }

  bool enabled() const { return !dir_.empty(); }
  const std::filesystem::path& dir() const { return dir_; }

  // The key of the parts the code depends on, each length-prefixed (so no two lists of
  // parts hash alike by moving a boundary).
  static std::uint64_t key_of(std::initializer_list<std::string_view> parts) {
    Fingerprint f;
    for (auto p : parts) f.add(p);
    return f.value();
  }

  std::filesystem::path path_of(std::uint64_t key, std::string_view arch) const {
    return dir_ / ("fsdp_kernels-" + std::string(arch) + "-" + hex(key) + ".bin");
  }

  // The code stored under `key` for `arch`, or nullopt: missing, unreadable, or not a
  // whole entry of that key (truncated, corrupt, another file).
  std::optional<std::vector<char>> load(std::uint64_t key, std::string_view arch) const {
    if (!enabled()) return std::nullopt;
    std::ifstream in(path_of(key, arch), std::ios::binary);
    if (!in) return std::nullopt;
    const std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (file.size() < header_bytes) return std::nullopt;
    Header h;
    std::memcpy(&h, file.data(), header_bytes);
    if (std::memcmp(h.magic, magic, sizeof h.magic) != 0 || h.key != key || h.size != file.size() - header_bytes)
      return std::nullopt;
    std::vector<char> code(file.begin() + header_bytes, file.end());
    if (hash_of(code) != h.code_hash) return std::nullopt;
    return code;
  }

  // Stores `code` under `key`; false (and nothing half-written left) when it cannot.
  bool store(std::uint64_t key, std::string_view arch, const std::vector<char>& code) const noexcept {
    if (!enabled()) return false;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return false;
    const std::filesystem::path target = path_of(key, arch);
    static std::atomic<unsigned> counter{0};  // distinct temporaries for threads of one process
    std::filesystem::path tmp = target;
    tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    Header h;
    std::memcpy(h.magic, magic, sizeof h.magic);
    h.key = key;
    h.size = code.size();
    h.code_hash = hash_of(code);
    bool written = false;
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (out) {
        out.write(reinterpret_cast<const char*>(&h), header_bytes);
        out.write(code.data(), static_cast<std::streamsize>(code.size()));
        out.flush();
        written = static_cast<bool>(out);
      }
    }
    if (written) std::filesystem::rename(tmp, target, ec);  // atomic within one filesystem
    if (!written || ec) {
      std::filesystem::remove(tmp, ec);
      return false;
    }
    return true;
  }

 private:
  static constexpr char magic[8] = {'F', 'S', 'D', 'P', 'K', 'R', 'N', '1'};
  struct Header {
    char magic[8];
    std::uint64_t key;
    std::uint64_t size;       // bytes of code after the header
    std::uint64_t code_hash;  // Fingerprint of the code
  };
  static constexpr std::size_t header_bytes = sizeof(Header);

  static std::uint64_t hash_of(const std::vector<char>& code) {
    Fingerprint f;
    f.add_bytes(code.data(), code.size());
    return f.value();
  }
  static std::string hex(std::uint64_t v) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = digits[v & 15];
    return s;
  }

  std::filesystem::path dir_;
};

}  // namespace fsdp::detail
