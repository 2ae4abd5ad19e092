#pragma once
// Checksums of checkpoint files: streaming XXH64 (seed 0) and its text form in an index,
// 16 lowercase hex digits of the digest (XXH64's canonical, big-endian form, as xxhsum prints it).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace fsdp::checkpoint {

// XXH64 over bytes fed in pieces; the digest equals XXH64 of their concatenation.
class Xxh64 {
 public:
  Xxh64() { XXH64_reset(&state_, 0); }
  void update(const void* data, std::size_t n) {
    if (n != 0) XXH64_update(&state_, data, n);
  }
  std::uint64_t digest() const { return XXH64_digest(&state_); }
  // The digest of one contiguous range.
  static std::uint64_t of(const void* data, std::size_t n) {
    Xxh64 h;
    h.update(data, n);
    return h.digest();
  }

 private:
  XXH64_state_t state_;
};

// The piece size of the readers that hash what they read: each piece is hashed right
// after it is read, while it is still in the core's L2 cache (4 MiB pieces spill to L3 and
// cost the hash pass about 10% more CPU on the 2-core development VM).
inline constexpr std::uint64_t hash_piece_bytes = std::uint64_t{1} << 20;

// XXH64 of bytes [begin, end) that read(dst, n, offset) fetches, in pieces the size of
// `scratch` (not empty where the range is not).
template <class Read>
std::uint64_t xxh64_of_range(Read&& read, std::uint64_t begin, std::uint64_t end, std::vector<std::byte>& scratch) {
  Xxh64 h;
  for (std::uint64_t at = begin; at < end;) {
    const std::uint64_t n = std::min<std::uint64_t>(scratch.size(), end - at);
    read(scratch.data(), n, at);
    h.update(scratch.data(), static_cast<std::size_t>(n));
    at += n;
  }
  return h.digest();
}

inline std::string xxh64_hex(std::uint64_t h) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) s[static_cast<std::size_t>(i)] = digits[h & 0xf];
  return s;
}

// Exactly 16 hex digits (either case); anything else is nullopt.
inline std::optional<std::uint64_t> parse_xxh64_hex(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t h = 0;
  for (char c : s) {
    int v;
    if (c >= '0' && c <= '9') v = c - '0';
    else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
    else return std::nullopt;
    h = h << 4 | static_cast<std::uint64_t>(v);
  }
  return h;
}

}  // namespace fsdp::checkpoint
