#pragma once
// Checksums of a full checkpoint file's data, kept in the file itself so that the file stays
// one plain safetensors file that other tools read: "__metadata__" holds
//   "fsdp.data_xxh64": "<chunk bytes>:<h0>,<h1>,..."
// the XXH64 of each consecutive chunk of the data section (the last one shorter), 16 hex
// digits each. Chunks, not one digest for the whole file, so that N ranks loading it
// verify N parts in parallel, and a writer whose ranks write their own slices (the shared
// save) hashes in parallel too. The number of chunks follows from the data size, so the
// header is written first with zero digits of the same width, and they are filled in once
// the data is out (checkpoint::FileSink::overwrite).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/json_checks.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

inline constexpr std::string_view data_checksums_key = "fsdp.data_xxh64";
inline constexpr std::uint64_t data_checksum_chunk_bytes = std::uint64_t{64} << 20;

struct DataChecksums {
  std::uint64_t chunk_bytes = data_checksum_chunk_bytes;
  std::vector<std::uint64_t> digests;

  static std::size_t chunks_for(std::uint64_t data_bytes, std::uint64_t chunk) {
    return static_cast<std::size_t>((data_bytes + chunk - 1) / chunk);
  }
  // Bytes [begin, end) of the data section that chunk i covers.
  std::uint64_t begin(std::size_t i) const { return i * chunk_bytes; }
  std::uint64_t end(std::size_t i, std::uint64_t data_bytes) const { return std::min(data_bytes, (i + 1) * chunk_bytes); }

  // The rank of `ranks` that hashes chunk i: each rank a contiguous run of chunks, so
  // that the disk sees `ranks` sequential streams.
  int owner(std::size_t i, int ranks) const {
    return static_cast<int>(i * static_cast<std::size_t>(ranks) / digests.size());
  }

  // Where chunk i's 16 digits start in format()'s value.
  std::size_t digits_at(std::size_t i) const { return std::to_string(chunk_bytes).size() + 1 + 17 * i; }

  // The metadata value (same width whatever the digests, so zeros make the placeholder).
  std::string format() const {
    std::string s = std::to_string(chunk_bytes) + ":";
    for (std::size_t i = 0; i < digests.size(); ++i) s += (i ? "," : "") + xxh64_hex(digests[i]);
    return s;
  }
  static DataChecksums placeholder(std::uint64_t data_bytes, std::uint64_t chunk = data_checksum_chunk_bytes) {
    DataChecksums c;
    c.chunk_bytes = chunk;
    c.digests.assign(chunks_for(data_bytes, chunk), 0);
    return c;
  }
  // nullopt if `value` is not a well-formed list for `data_bytes` of data.
  static std::optional<DataChecksums> parse(std::string_view value, std::uint64_t data_bytes) {
    const auto colon = value.find(':');
    if (colon == std::string_view::npos || colon == 0 || colon > 19) return std::nullopt;
    DataChecksums c;
    c.chunk_bytes = 0;
    for (char ch : value.substr(0, colon)) {
      if (ch < '0' || ch > '9') return std::nullopt;
      c.chunk_bytes = c.chunk_bytes * 10 + static_cast<std::uint64_t>(ch - '0');
    }
    if (c.chunk_bytes == 0) return std::nullopt;
    std::string_view rest = value.substr(colon + 1);
    const std::size_t n = chunks_for(data_bytes, c.chunk_bytes);
    if (rest.size() != (n == 0 ? 0 : 17 * n - 1)) return std::nullopt;
    for (std::size_t i = 0; i < n; ++i) {
      if (i && rest[17 * i - 1] != ',') return std::nullopt;
      const auto h = parse_xxh64_hex(rest.substr(17 * i, 16));
      if (!h) return std::nullopt;
      c.digests.push_back(*h);
    }
    return c;
  }
};

// A file's "__metadata__" as its writer's user gave it: without the data checksums, nor any
// other of the library's own "fsdp." keys (fsdp_metadata.hpp).
template <class Map>
std::map<std::string, std::string> without_data_checksums(const Map& metadata) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : metadata)
    if (std::string_view(k).substr(0, 5) != "fsdp.") out.emplace(k, v);
  return out;
}

// Where the digits of the placeholder for `data_bytes` of data start in `header` (a file
// offset: the header follows its 8-byte length), for overwriting them with the digests.
inline std::uint64_t data_checksums_offset(const std::string& header, std::uint64_t data_bytes, std::string_view file,
                                           std::uint64_t chunk = data_checksum_chunk_bytes) {
  const std::string value = DataChecksums::placeholder(data_bytes, chunk).format();
  const std::string entry = detail::json_string(std::string(data_checksums_key)) + ":" + detail::json_string(value);
  const auto pos = header.find(entry);
  if (pos == std::string::npos) fsdp::detail::fail("'", file, "': the header has no place for the data checksums");
  return 8 + pos + entry.size() - 1 - value.size();
}

// Hashes the chunks c of `layout` for which mine(c) is true, in order, the data section
// read through read(dst, n, offset) in pieces of hash_piece_bytes; calls found(chunk,
// digest) for each.
template <class Mine, class Read, class Found>
void hash_chunks(const DataChecksums& layout, std::uint64_t data_bytes, Mine&& mine, Read&& read, Found&& found) {
  std::vector<std::byte> scratch(static_cast<std::size_t>(hash_piece_bytes));
  for (std::size_t c = 0; c < layout.digests.size(); ++c)
    if (mine(c)) found(c, xxh64_of_range(read, layout.begin(c), layout.end(c, data_bytes), scratch));
}

// Hashes the chunks of `layout` that `rank` of `ranks` owns (DataChecksums::owner), the
// data section read through read(dst, n, offset); calls found(chunk, digest) for each.
template <class Read, class Found>
void hash_owned_chunks(const DataChecksums& layout, std::uint64_t data_bytes, int rank, int ranks, Read&& read,
                       Found&& found) {
  hash_chunks(layout, data_bytes, [&](std::size_t c) { return layout.owner(c, ranks) == rank; }, read, found);
}

// A load's split of the checking among `ranks` ranks when the chunks of several files are
// taken as one sequence of `total` bytes (file 0's data, then file 1's, ...): the rank of a
// chunk at bytes [begin, end) of that sequence, the one whose share (consecutive runs of
// ceil(total / ranks) bytes) holds the chunk's middle byte. Each chunk has exactly one
// rank, each rank one contiguous run, and no rank more than a share and half a chunk.
// DataChecksums::owner, file by file, split bench/checkpoint's 302 MB + 604 MB pair (15
// chunks of 64 MiB) among 4 ranks as 336, 201, 268 and 101 MB; this as 201, 235, 268 and
// 202 MB, so the last rank to finish reading and hashing finishes sooner.
inline int share_owner(std::uint64_t begin, std::uint64_t end, std::uint64_t total, int ranks) {
  if (ranks <= 1 || total == 0) return 0;
  const std::uint64_t n = static_cast<std::uint64_t>(ranks), share = total / n + (total % n != 0);
  const std::uint64_t middle = begin + (end - begin) / 2;
  return static_cast<int>(std::min(n - 1, middle / share));
}

// Hashes a data section fed in order, in pieces of any size, chunk by chunk.
class ChunkHasher {
 public:
  explicit ChunkHasher(std::uint64_t chunk_bytes = data_checksum_chunk_bytes) : chunk_(chunk_bytes) {}
  void update(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    while (n > 0) {
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, chunk_ - in_chunk_));
      hash_.update(p, take);
      p += take, n -= take, in_chunk_ += take;
      if (in_chunk_ == chunk_) close_chunk();
    }
  }
  DataChecksums finish() {
    if (in_chunk_ > 0) close_chunk();
    return {chunk_, std::move(digests_)};
  }

 private:
  void close_chunk() {
    digests_.push_back(hash_.digest());
    hash_ = Xxh64();
    in_chunk_ = 0;
  }
  std::uint64_t chunk_;
  std::uint64_t in_chunk_ = 0;
  Xxh64 hash_;
  std::vector<std::uint64_t> digests_;
};

}  // namespace fsdp::checkpoint
