#pragma once
// The library's own entries in a checkpoint file's safetensors "__metadata__" (the keys
// starting with "fsdp."), and the rules that make a damaged one an error. They exist so that
// every byte of a header that decides what is loaded where is covered by a checksum, and a
// file written by fsdp can never pass as a file that merely lacks checksums:
//
//   fsdp.format_version  the checkpoint format ("2"); another version is refused, naming both
//   fsdp.save_id         the save the file belongs to (save_id.hpp), the same in every file
//   fsdp.header_xxh64    XXH64 of the header's canonical form (below), 16 hex digits
//   fsdp.data_xxh64      full checkpoint files: their data's chunk checksums (data_checksums.hpp)
//   fsdp.slices          sharded checkpoints' rank files: which tensor each slice is of, and
//                        where (their data is covered by index.json's checksum of the file)
//
// The canonical form of a header is its JSON object without the entries fsdp.header_xxh64
// and fsdp.data_xxh64 of "__metadata__", written compactly (no spaces) with every object's
// keys sorted, as Python's json.dumps(h, sort_keys=True, separators=(",", ":"),
// ensure_ascii=False) writes it: every tensor's name, dtype, shape and data_offsets and every
// other metadata entry. fsdp.data_xxh64 is left out because its digits are filled in after
// the data is written (by every rank of a shared save); each digit is checked against the
// data anyway.
//
// A file with any "fsdp." key is fsdp's, and must have the version, the save id, the header
// checksum, exactly one of fsdp.data_xxh64 and fsdp.slices, and no other "fsdp." key: a
// misspelt or damaged key is an error, never a reason to load unchecked. Only a file with
// no "fsdp." key at all (written by another tool) loads without these checks.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/data_checksums.hpp"
#include "fsdp/checkpoint/save_id.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

// The format of every checkpoint file and index this build writes and the only one it
// reads. 1 was the format before headers, indexes and saves were identified and
// checksummed (files without fsdp.format_version, indexes with "version": 1).
inline constexpr std::uint64_t checkpoint_format_version = 2;

inline constexpr std::string_view fsdp_key_prefix = "fsdp.";
inline constexpr std::string_view format_version_key = "fsdp.format_version";
inline constexpr std::string_view header_checksum_key = "fsdp.header_xxh64";
inline constexpr std::string_view slices_key = "fsdp.slices";

inline bool is_fsdp_key(std::string_view key) { return key.substr(0, fsdp_key_prefix.size()) == fsdp_key_prefix; }

// Whether metadata holds any "fsdp." key: the file claims to be fsdp's.
template <class Map>
bool is_fsdp_file(const Map& metadata) {
  for (const auto& entry : metadata)
    if (is_fsdp_key(entry.first)) return true;
  return false;
}

// What a writer's user gave: the metadata without the library's own keys.
template <class Map>
std::map<std::string, std::string> without_fsdp_keys(const Map& metadata) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : metadata)
    if (!is_fsdp_key(k)) out.emplace(k, v);
  return out;
}

// XXH64 of the canonical form of the header `root` (a JSON object, keys sorted as
// nlohmann::json keeps them). Removes the two excluded entries from root's "__metadata__".
inline std::uint64_t canonical_header_xxh64(nlohmann::json& root) {
  if (auto m = root.find("__metadata__"); m != root.end() && m->is_object()) {
    m->erase(std::string(header_checksum_key));
    m->erase(std::string(data_checksums_key));
  }
  const std::string text = root.dump();
  Xxh64 h;
  h.update(text.data(), text.size());
  return h.digest();
}

namespace detail {

template <class Map>
const std::string* find_entry(const Map& metadata, std::string_view key) {
  const auto it = metadata.find(std::string(key));
  return it == metadata.end() ? nullptr : &it->second;
}

// The format version as written ("2"); nullopt unless 1 to 9 decimal digits.
inline std::optional<std::uint64_t> parse_format_version(std::string_view text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

}  // namespace detail

// The checks above for the file named `file`, whose header has `metadata`; header_xxh64()
// computes its canonical checksum (called only for an fsdp file). Errors are `corrupt` and
// name the file and the key.
template <class Map, class HeaderDigest>
void check_fsdp_metadata(const std::string& file, const Map& metadata, HeaderDigest&& header_xxh64) {
  if (!is_fsdp_file(metadata)) return;
  using fsdp::detail::fail_as;
  const std::string at = "checkpoint file '" + file + "': ";
  const std::string* version = detail::find_entry(metadata, format_version_key);
  if (!version) {
    std::string keys;
    for (const auto& entry : metadata)
      if (is_fsdp_key(entry.first)) keys += (keys.empty() ? "'" : ", '") + entry.first + "'";
    fail_as(ErrorKind::corrupt, at, "its metadata has fsdp's keys (", keys, ") but no '", format_version_key,
            "': the key is damaged, or an fsdp older than checkpoint format ", checkpoint_format_version,
            " wrote the file (this build reads format ", checkpoint_format_version, " only)");
  }
  const auto v = detail::parse_format_version(*version);
  if (!v)
    fail_as(ErrorKind::corrupt, at, "'", format_version_key, "' is \"", *version, "\", not a version number");
  if (*v != checkpoint_format_version)
    fail_as(ErrorKind::corrupt, at, "checkpoint format version ", *v, ", but this build reads version ",
            checkpoint_format_version, *v > checkpoint_format_version ? " (a newer fsdp wrote it)" : " (an older fsdp wrote it)");
  for (const auto& entry : metadata) {
    const std::string& key = entry.first;
    if (is_fsdp_key(key) && key != format_version_key && key != save_id_key && key != header_checksum_key &&
        key != data_checksums_key && key != slices_key)
      fail_as(ErrorKind::corrupt, at, "unknown metadata key '", key, "' (fsdp's keys are '", format_version_key, "', '",
              save_id_key, "', '", header_checksum_key, "', '", data_checksums_key, "' and '", slices_key,
              "'): a damaged or misspelt key");
  }
  const std::string* sum = detail::find_entry(metadata, header_checksum_key);
  if (!sum) fail_as(ErrorKind::corrupt, at, "the header checksum '", header_checksum_key, "' is missing");
  if (!parse_xxh64_hex(*sum))
    fail_as(ErrorKind::corrupt, at, "the header checksum '", header_checksum_key, "' is \"", *sum,
            "\", not 16 hex digits");
  // As written, lowercase: then no flipped bit anywhere in the header goes unnoticed.
  if (const std::string computed = xxh64_hex(header_xxh64()); computed != *sum)
    fail_as(ErrorKind::corrupt, at, "its header does not match its checksum (", header_checksum_key, " ", *sum,
            ", computed ", computed,
            "): a tensor's name, dtype, shape or data_offsets, or a metadata entry, changed after the save");
  const std::string* id = detail::find_entry(metadata, save_id_key);
  if (!id) fail_as(ErrorKind::corrupt, at, "the save id '", save_id_key, "' is missing");
  if (!parse_save_id(*id))
    fail_as(ErrorKind::corrupt, at, "the save id '", save_id_key, "' is \"", *id, "\", not 16 hex digits");
  const bool data = detail::find_entry(metadata, data_checksums_key) != nullptr;
  const bool slices = detail::find_entry(metadata, slices_key) != nullptr;
  if (data == slices)
    fail_as(ErrorKind::corrupt, at, "it has ", data ? "both" : "neither", " of '", data_checksums_key,
            "' (a full checkpoint's data checksums) and '", slices_key, "' (a sharded checkpoint's slices)");
}

// The save id of an fsdp file (0 for another tool's), after check_fsdp_metadata.
template <class Map>
std::uint64_t save_id_of(const Map& metadata) {
  const std::string* id = detail::find_entry(metadata, save_id_key);
  return id ? parse_save_id(*id).value_or(0) : 0;
}

}  // namespace fsdp::checkpoint
