#pragma once
// ShardedCheckpointReader: a sharded checkpoint directory (index.json plus the files it
// lists) opened for reading ranges of its tensors, on any number of ranks. Opening checks
// everything but the checksums before the caller reads a byte: the index, every file's
// header and size, and that each slice's tensor is in its file with the entry's dtype and
// the slice's element count, and that no file holds a tensor the index does not list.
// Checksums are verified per file the first time read() uses it (so a rank hashes only the
// files it reads), or all at once with verify_checksums().
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checkpoint_index.hpp"
#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/error.hpp"

namespace fsdp::checkpoint {

// The names inside a sharded checkpoint directory.
inline constexpr std::string_view index_file_name = "index.json";
inline std::string rank_file_name(int rank) {
  std::string digits = std::to_string(rank);
  return "rank-" + std::string(digits.size() < 5 ? 5 - digits.size() : 0, '0') + digits + ".safetensors";
}

enum class Checksums { verify, skip };

class ShardedCheckpointReader {
 public:
  explicit ShardedCheckpointReader(const std::filesystem::path& dir, Checksums checksums = Checksums::verify)
      : dir_(dir), checksums_(checksums), planner_(CheckpointIndex::load(dir / index_file_name)) {
    const CheckpointIndex& ix = planner_.index();
    std::map<std::string_view, std::vector<const IndexSlice*>> by_file;
    for (const IndexSlice& s : ix.slices) by_file[s.file].push_back(&s);
    for (const IndexFile& f : ix.files) {
      Opened o{SafetensorsFile::open(dir_ / f.name), &f, false};
      if (o.file.file_bytes() != f.bytes)
        fail_file(f.name, "it has ", o.file.file_bytes(), " bytes but the index says ", f.bytes);
      for (const IndexSlice* s : by_file[f.name]) {
        const TensorInfo* t = o.file.find(s->key);
        const IndexEntry& e = planner_.entry(s->id);
        if (t == nullptr) fail_file(f.name, "no tensor '", s->key, "' (it holds ", s->id.describe(), ")");
        if (t->dtype != e.dtype || t->numel() != s->count)
          fail_file(f.name, "tensor '", s->key, "' is ", safetensors_dtype_name(t->dtype), " with ", t->numel(),
                    " elements but the index says ", s->id.describe(), " is ", safetensors_dtype_name(e.dtype),
                    " and this slice has ", s->count);
      }
      if (o.file.tensors().size() != by_file[f.name].size())
        for (const TensorInfo& t : o.file.tensors()) {
          bool listed = false;
          for (const IndexSlice* s : by_file[f.name]) listed = listed || s->key == t.name;
          if (!listed) fail_file(f.name, "tensor '", t.name, "' is in no slice of the index");
        }
      files_.emplace(f.name, std::move(o));
    }
  }

  const std::filesystem::path& dir() const { return dir_; }
  const CheckpointIndex& index() const { return planner_.index(); }
  const ReadPlanner& planner() const { return planner_; }
  const IndexEntry& entry(const StateKey& id) const { return planner_.entry(id); }

  // Elements [begin, begin + count) of `id`, in the entry's dtype, into dst, which must
  // have exactly count * size_of(dtype) bytes.
  void read(const StateKey& id, std::uint64_t begin, std::uint64_t count, void* dst, std::uint64_t dst_bytes) const {
    const std::size_t esize = size_of(entry(id).dtype);
    if (count > dst_bytes / esize || count * esize != dst_bytes)
      detail::fail("checkpoint '", dir_.string(), "': reading ", count, " elements of ", id.describe(), " needs ",
                   count, " * ", esize, " bytes but the destination has ", dst_bytes);
    for (const ReadStep& step : planner_.plan(id, begin, count)) {
      const Opened& o = verified(step.file);
      o.file.read_elements(step.key, step.src_offset, step.count, static_cast<std::byte*>(dst) + step.dst_offset * esize);
    }
  }

  // Hashes every file not verified yet and compares it with the index.
  void verify_checksums() const {
    for (const auto& [name, o] : files_) verified(name, true);
  }

 private:
  struct Opened {
    SafetensorsFile file;
    const IndexFile* listed;
    mutable bool checked;
  };

  template <class... Parts>
  [[noreturn]] void fail_file(const std::string& name, Parts&&... parts) const {
    detail::fail("checkpoint '", dir_.string(), "': file '", name, "': ", std::forward<Parts>(parts)...);
  }

  const Opened& verified(const std::string& name, bool force = false) const {
    const Opened& o = files_.at(name);
    if (checksums_ == Checksums::skip && !force) return o;
    std::lock_guard lk(mu_);
    if (o.checked) return o;
    const std::uint64_t h = o.file.xxh64();
    if (h != o.listed->xxh64)
      fail_file(name, "its XXH64 is ", xxh64_hex(h), " but the index says ", xxh64_hex(o.listed->xxh64),
                " (the file is corrupt or from another save)");
    o.checked = true;
    return o;
  }

  std::filesystem::path dir_;
  Checksums checksums_;
  ReadPlanner planner_;
  std::map<std::string, Opened, std::less<>> files_;
  mutable std::mutex mu_;
};

}  // namespace fsdp::checkpoint
