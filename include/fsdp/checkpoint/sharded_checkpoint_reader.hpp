#pragma once
// ShardedCheckpointReader: a sharded checkpoint directory (index.json plus the files it
// lists) opened for reading ranges of its tensors, on any number of ranks. Opening checks
// everything but the checksums before the caller reads a byte: the index, every file's
// header and size, and that each slice's tensor is in its file with the entry's dtype and
// the slice's element count, and that no file holds a tensor the index does not list; the
// index's own checksum and its world size against the rank files present; each rank file's
// header checksum, its save id against the index's, and its own slice metadata
// ("fsdp.slices") against the index's slices, slice for slice.
// Checksums are verified per file the first time read() uses it (so a rank hashes only the
// files it reads), all at once with verify_checksums(), or by read_all() for the files a
// caller names, hashing each while it is read (one pass over the file, not two).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checkpoint_index.hpp"
#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/fsdp_metadata.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/core/error.hpp"

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
    check_rank_files(ix);
    std::map<std::string_view, std::vector<const IndexSlice*>> by_file;
    for (const IndexSlice& s : ix.slices) by_file[s.file].push_back(&s);
    for (const IndexFile& f : ix.files) {
      Opened o{SafetensorsFile::open(dir_ / f.name), &f, false};  // checks its header's checksum
      if (o.file.file_bytes() != f.bytes)
        fail_file(f.name, "it has ", o.file.file_bytes(), " bytes but the index says ", f.bytes);
      check_same_save(f.name, o.file);
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
      check_slices(f.name, o.file, by_file[f.name]);
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

  // One range of read_all: elements [begin, begin + count) of `id` into dst (count * size bytes).
  struct Range {
    StateKey id;
    std::uint64_t begin = 0, count = 0;
    void* dst = nullptr;
  };

  // Reads every range. Files (by their place in index().files) for which `verify` is true
  // are read whole, in order, and hashed as they are read: the ranges from them land in
  // place and the rest is only hashed; a mismatch throws naming the file (after the bytes
  // were read: the caller must not use them) and is remembered in damaged(). Other files
  // are read only where the ranges are, unverified here (whoever verifies them reports).
  void read_all(std::span<const Range> ranges, const std::function<bool(std::size_t)>& verify) const {
    struct Piece {
      std::uint64_t offset, bytes;
      std::byte* dst;
    };
    std::map<std::string, std::vector<Piece>, std::less<>> pieces;
    for (const Range& r : ranges) {
      const std::size_t esize = size_of(entry(r.id).dtype);
      for (const ReadStep& step : planner_.plan(r.id, r.begin, r.count)) {
        const SafetensorsFile& f = files_.at(step.file).file;
        pieces[step.file].push_back({f.file_offset_of(step.key, step.src_offset, step.count), step.count * esize,
                                     static_cast<std::byte*>(r.dst) + step.dst_offset * esize});
      }
    }
    const CheckpointIndex& ix = index();
    for (std::size_t i = 0; i < ix.files.size(); ++i) {
      const Opened& o = files_.at(ix.files[i].name);
      auto& mine = pieces[ix.files[i].name];
      if (checksums_ == Checksums::verify && verify(i) && !o.checked) {
        stream_verified(ix.files[i].name, o, mine);
      } else {  // in file order: one forward pass over the file (or its pages in the cache)
        std::sort(mine.begin(), mine.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
        for (const Piece& p : mine) o.file.read_file_bytes(p.dst, p.bytes, p.offset);
      }
    }
  }

  // Hashes the files (by their place in index().files) for which `mine` is true and that
  // were not verified yet (none with Checksums::skip); a mismatch throws naming the file
  // and is remembered in damaged().
  void verify_files(const std::function<bool(std::size_t)>& mine) const {
    const CheckpointIndex& ix = index();
    for (std::size_t i = 0; i < ix.files.size(); ++i)
      if (mine(i)) verified(ix.files[i].name);
  }

  // The files whose checksum did not match in this reader, by name.
  std::set<std::string> damaged() const {
    std::lock_guard lk(mu_);
    return damaged_;
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
    detail::fail_as(ErrorKind::corrupt, "checkpoint '", dir_.string(), "': file '", name,
                    "': ", std::forward<Parts>(parts)...);
  }
  template <class... Parts>
  [[noreturn]] void fail_index(Parts&&... parts) const {
    detail::fail_as(ErrorKind::corrupt, "checkpoint '", dir_.string(), "': index '", index_file_name, "': ",
                    std::forward<Parts>(parts)...);
  }

  // The index lists rank-00000 ... rank-<world_size - 1>, in order, and the directory holds
  // no other rank file: a world_size or a file list that disagrees with the files present
  // is an error, not a load of part of the checkpoint.
  void check_rank_files(const CheckpointIndex& ix) const {
    if (ix.files.size() != static_cast<std::size_t>(ix.world_size))
      fail_index("world_size is ", ix.world_size, " but it lists ", ix.files.size(), " files");
    std::set<std::string, std::less<>> listed;
    for (int r = 0; r < ix.world_size; ++r) {
      const std::string& name = ix.files[static_cast<std::size_t>(r)].name;
      if (name != rank_file_name(r))
        fail_index("file ", r, " is '", name, "' where rank ", r, "'s '", rank_file_name(r), "' was expected");
      listed.insert(name);
    }
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("rank-", 0) == 0 && e.path().extension() == ".safetensors" && !listed.count(name))
        fail_index("the directory holds '", name, "', which the index (world_size ", ix.world_size,
                   ") does not list: the index is from another save, or its world_size is wrong");
    }
  }

  // A rank file is fsdp's (its header checked against its checksum when opened) and of the
  // index's save.
  void check_same_save(const std::string& name, const SafetensorsFile& f) const {
    if (!is_fsdp_file(f.metadata()))
      fail_file(name, "it has none of fsdp's metadata (no '", format_version_key, "', '", save_id_key, "', '",
                slices_key, "'): not a rank file of an fsdp sharded checkpoint");
    const std::uint64_t id = save_id_of(f.metadata());
    if (id != index().save_id)
      fail_file(name, "it is from another save than the index (save id ", format_save_id(id), ", the index's ",
                format_save_id(index().save_id), "): a save was interrupted, or files were mixed");
  }

  // Each rank file says in its own "fsdp.slices" which slice of which tensor each of its
  // tensors is; the index must say the same, slice for slice (a key or a begin swapped in
  // the index would otherwise load one slice in another's place).
  void check_slices(const std::string& name, const SafetensorsFile& f, const std::vector<const IndexSlice*>& listed) const {
    const auto it = f.metadata().find(slices_key);
    if (it == f.metadata().end()) fail_file(name, "its metadata has no '", slices_key, "'");
    nlohmann::json places;
    try {
      places = nlohmann::json::parse(it->second);
    } catch (const nlohmann::json::exception&) {
      fail_file(name, "its '", slices_key, "' is not JSON");
    }
    if (!places.is_object()) fail_file(name, "its '", slices_key, "' is not a JSON object");
    if (places.size() != listed.size())
      fail_file(name, "it holds ", places.size(), " slices (its '", slices_key, "') but the index lists ", listed.size());
    for (const IndexSlice* s : listed) {
      const auto p = places.find(s->key);
      if (p == places.end())
        fail_file(name, "the index puts ", s->id.describe(), " at key '", s->key, "', which its '", slices_key,
                  "' does not list");
      const IndexEntry& e = planner_.entry(s->id);
      bool same = false;
      try {
        same = p->at("kind").get<std::string>() == name_of(s->id.kind) && p->at("fqn").get<std::string>() == s->id.fqn &&
               p->value("state", std::string()) == s->id.state && p->at("begin").get<std::uint64_t>() == s->begin &&
               p->at("count").get<std::uint64_t>() == s->count &&
               p->at("dtype").get<std::string>() == safetensors_dtype_name(e.dtype) && p->at("shape").get<Shape>() == e.shape;
      } catch (const nlohmann::json::exception&) {
        fail_file(name, "its '", slices_key, "' entry for '", s->key, "' is malformed: ", detail::json_text(*p));
      }
      if (!same)
        fail_file(name, "the index says tensor '", s->key, "' is elements [", s->begin, ", +", s->count, ") of ",
                  s->id.describe(), " (", safetensors_dtype_name(e.dtype), " ", detail::format_shape(e.shape),
                  ") but the file says ", detail::json_text(*p));
    }
  }

  // Reads file `name` from its first byte to its last in 1 MiB steps, each into its piece's
  // destination (or a scratch buffer between pieces) and hashed while still in cache.
  template <class Pieces>
  void stream_verified(const std::string& name, const Opened& o, Pieces& pieces) const {
    std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
    constexpr std::uint64_t step = hash_piece_bytes;
    const auto scratch = std::make_unique_for_overwrite<std::byte[]>(step);
    Xxh64 h;
    std::uint64_t pos = 0;
    auto hash_through = [&](std::uint64_t end, std::byte* dst) {  // [pos, end) into dst, or scratch
      for (std::uint64_t off = pos; off < end;) {
        const std::uint64_t n = std::min(step, end - off);
        std::byte* to = dst ? dst + (off - pos) : scratch.get();
        o.file.read_file_bytes(to, n, off);
        h.update(to, n);
        off += n;
      }
      pos = end;
    };
    std::vector<const typename Pieces::value_type*> overlapping;  // never from one load: read apart
    for (const auto& p : pieces) {
      if (p.offset < pos) {
        overlapping.push_back(&p);
        continue;
      }
      hash_through(p.offset, nullptr);
      hash_through(p.offset + p.bytes, p.dst);
    }
    hash_through(o.file.file_bytes(), nullptr);
    check_hash(name, o, h.digest());
    for (const auto* p : overlapping) o.file.read_file_bytes(p->dst, p->bytes, p->offset);
  }

  void check_hash(const std::string& name, const Opened& o, std::uint64_t h) const {
    std::lock_guard lk(mu_);
    if (h != o.listed->xxh64) {
      damaged_.insert(name);
      fail_file(name, "its XXH64 is ", xxh64_hex(h), " but the index says ", xxh64_hex(o.listed->xxh64),
                " (the file is corrupt or from another save)");
    }
    o.checked = true;
  }

  const Opened& verified(const std::string& name, bool force = false) const {
    const Opened& o = files_.at(name);
    if (checksums_ == Checksums::skip && !force) return o;
    {
      std::lock_guard lk(mu_);
      if (o.checked) return o;
    }
    check_hash(name, o, o.file.xxh64());
    return o;
  }

  std::filesystem::path dir_;
  Checksums checksums_;
  ReadPlanner planner_;
  std::map<std::string, Opened, std::less<>> files_;
  mutable std::mutex mu_;
  mutable std::set<std::string> damaged_;  // guarded by mu_
};

}  // namespace fsdp::checkpoint
