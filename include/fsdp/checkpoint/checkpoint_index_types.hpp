#pragma once
// The types of CheckpointIndex (fsdp/checkpoint/checkpoint_index.hpp includes them with their
// member definitions, which live beside what they do: JSON in checkpoint_index_json.hpp, the
// checks in read_planner.hpp). CheckpointIndex: the index.json of a sharded checkpoint directory. It says which files
// the checkpoint has (with size and XXH64), which tensors it holds (entries: FQN, kind,
// dtype, global shape) and where each element of each tensor is (slices: a 1-D range
// [begin, begin + count) of the flattened global tensor, held by one tensor of one file).
// Slices of one tensor never overlap and, in an index loaded from disk, cover it exactly,
// so any reader can find each element in exactly one file: that is what lets a checkpoint
// written by N ranks load into M (see read_planner.hpp). A slice may have count 0 (a rank
// that saved none of the tensor); a tensor with no elements is complete with no element.
// Plus user metadata (step, data-loader position, RNG state) as strings, the save's id
// (save_id.hpp, also in every rank file) and the XXH64 of the index's own content ("xxh64",
// last), checked on load, so that no field of the index can change unnoticed.
//
//   {"format": "fsdp-sharded-checkpoint", "version": 2, "world_size": 2,
//    "save_id": "1f3a...", "metadata": {"step": "100"},
//    "files": [{"name": "rank-00000.safetensors", "bytes": 4160, "xxh64": "9f0c..."}, ...],
//    "entries": [{"fqn": "fc.weight", "kind": "param", "dtype": "F32", "shape": [16, 32]},
//                {"fqn": "fc.weight", "kind": "optim", "state": "exp_avg", "dtype": "F32", ...}],
//    "slices": [{"fqn": "fc.weight", "kind": "param", "file": "rank-00000.safetensors",
//                "key": "fc.weight", "begin": 0, "count": 256}, ...],
//    "xxh64": "77c0..."}
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/checkpoint/fsdp_metadata.hpp"
#include "fsdp/checkpoint/safetensors_header.hpp"
#include "fsdp/checkpoint/state_key.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

struct IndexFile {
  std::string name;  // relative to the checkpoint directory, one path component
  std::uint64_t bytes = 0;
  std::uint64_t xxh64 = 0;
};

struct IndexEntry {
  StateKey id;
  DType dtype = DType::f32;
  Shape shape;  // global shape; [] is a scalar
};

// Elements [begin, begin + count) of the flattened tensor `id` are tensor `key` of `file`.
struct IndexSlice {
  StateKey id;
  std::string file;
  std::string key;
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
};

struct CheckpointIndex {
  static constexpr std::string_view format_name = "fsdp-sharded-checkpoint";
  static constexpr std::uint64_t format_version = checkpoint_format_version;

  std::string source = "<in-memory index>";  // where it came from, for messages
  int world_size = 1;                        // ranks that wrote the checkpoint
  std::uint64_t save_id = 0;                 // the save's (every rank file has the same)
  std::vector<IndexFile> files;
  std::vector<IndexEntry> entries;
  std::vector<IndexSlice> slices;
  std::map<std::string, std::string, std::less<>> metadata;

  // Linear searches; ReadPlanner has the indexed lookup.
  const IndexEntry* find(const StateKey& id) const {
    for (const IndexEntry& e : entries)
      if (e.id == id) return &e;
    return nullptr;
  }
  const IndexFile* find_file(std::string_view name) const {
    for (const IndexFile& f : files)
      if (f.name == name) return &f;
    return nullptr;
  }

  // Everything but completeness: world size, unique and plain file names, unique entries
  // with valid shapes, slices that name a known file and entry and stay inside the tensor,
  // a (file, key) used once, no two slices of a tensor overlapping.
  void validate() const;
  // validate(), and every element of every entry is in some slice.
  void check_complete() const;

  // The JSON, with "xxh64" (content_xxh64()) last.
  nlohmann::ordered_json to_json() const;
  // XXH64 of the index's content: its JSON without "xxh64", written compactly in the order
  // to_json() writes (Python: json.dumps(j, separators=(",", ":"), ensure_ascii=False) of
  // the file's object, read in order, without "xxh64").
  std::uint64_t content_xxh64() const;
  // to_json() as text: one line per file, entry and slice.
  std::string dump() const;
  // Parses, check_complete()s and checks "xxh64"; `source` (the index path) names it in errors.
  static CheckpointIndex from_json(const nlohmann::json& j, std::string source);
  static CheckpointIndex load(const std::filesystem::path& path);
  // check_complete()s, then writes the JSON atomically.
  WriteResult save(const std::filesystem::path& path) const;
};

}  // namespace fsdp::checkpoint
