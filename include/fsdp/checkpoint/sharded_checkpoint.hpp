#pragma once
// Sharded checkpoints on disk: every rank writes its sharded state dict (its slices of
// each parameter and optimizer state; buffers on rank 0) into its own safetensors file of
// one checkpoint directory, rank 0 writes index.json (which slice of which tensor each
// file holds, a checksum per file, user metadata, the optimizer's scalars) and commits the
// directory atomically. Any number of ranks loads it back (see ShardedCheckpointSource).
// The staging directory carries a token rank 0 draws for this save alone, so two saves
// into one path never share one (checkpoint_directory.hpp says how commits and leftovers
// of interrupted saves are dealt with).
//
//   ckpt/index.json
//   ckpt/rank-00000.safetensors   tensors "param/<fqn>", "optim/<state>/<fqn>", "buffer/<fqn>";
//   ckpt/rank-00001.safetensors   __metadata__ "fsdp.slices": JSON of each key's tensor, begin and shape
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/checkpoint_directory.hpp"
#include "fsdp/checkpoint/load_state.hpp"
#include "fsdp/checkpoint/save_id.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/checkpoint/safetensors_writer.hpp"
#include "fsdp/checkpoint/sharded_checkpoint_reader.hpp"
#include "fsdp/checkpoint/state_dict.hpp"

namespace fsdp {

namespace detail {

inline constexpr const char* slices_metadata_key = "fsdp.slices";  // in each rank file's __metadata__
inline constexpr const char* optim_scalar_prefix = "optim.";       // optimizer scalars in the index metadata

// The slice's tensor name in its rank file: "param/<fqn>", "optim/<state>/<fqn>", "buffer/<fqn>".
inline std::string slice_key(const StateKey& id) {
  const std::string kind(name_of(id.kind));
  return id.kind == StateKind::optim ? kind + "/" + id.state + "/" + id.fqn : kind + "/" + id.fqn;
}

inline void check_user_metadata(const std::map<std::string, std::string>& metadata, const std::string& where) {
  for (const auto& [key, value] : metadata)
    if (key.rfind(optim_scalar_prefix, 0) == 0)
      fail(where, ": metadata key '", key, "' starts with '", optim_scalar_prefix,
           "', which is reserved for the optimizer's scalars");
}

// Index metadata without the optimizer's scalars: what the user saved.
template <class Map>
std::map<std::string, std::string> user_metadata(const Map& index_metadata) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : index_metadata)
    if (k.rfind(optim_scalar_prefix, 0) != 0) out[k] = v;
  return out;
}

// This rank's file: each slice (count 0 included) as a 1-D tensor, and in "fsdp.slices"
// what its header cannot say: which tensor it is a slice of, the global shape, the begin.
// A slice with no unit is in host memory; one with a unit is copied from it while writing.
inline checkpoint::WriteResult write_rank_file(const std::filesystem::path& path, const std::vector<SliceSource>& slices,
                                               std::uint64_t save_id) {
  checkpoint::SafetensorsWriter writer;
  writer.mark_fsdp_file(save_id);  // format version, save id, header checksum
  nlohmann::json places = nlohmann::json::object();
  for (const SliceSource& s : slices) {
    const std::string key = slice_key(s.id);
    places[key] = {{"kind", name_of(s.id.kind)}, {"state", s.id.state}, {"fqn", s.id.fqn},
                   {"dtype", checkpoint::safetensors_dtype_name(s.dtype)}, {"shape", s.shape},
                   {"begin", s.begin}, {"count", s.count}};
    if (s.unit == nullptr || s.count == 0)
      writer.add(key, s.dtype, {s.count}, s.src);
    else
      writer.add(key, s.dtype, {s.count}, [&s](std::span<std::byte> out) { fsdp::detail::internals(*s.unit).copy_bytes(out.data(), s.src, out.size()); });
  }
  writer.set_metadata(slices_metadata_key, places.dump());
  return writer.write(path);
}

// What a rank's write produced, left next to its file for rank 0's index (so the commit
// reads headers only, never the data again) and removed before the commit.
inline std::filesystem::path written_note_path(const std::filesystem::path& rank_file) {
  return rank_file.parent_path() / ("." + rank_file.filename().string() + ".written");
}
inline void note_written(const std::filesystem::path& rank_file, const checkpoint::WriteResult& w) {
  std::ofstream out(written_note_path(rank_file), std::ios::trunc);
  out << w.bytes << " " << checkpoint::xxh64_hex(w.xxh64) << "\n";
  out.close();
  if (!out) fail_as(ErrorKind::io, "cannot write '", written_note_path(rank_file).string(), "'");
}
inline checkpoint::WriteResult read_written_note(const std::filesystem::path& rank_file) {
  const auto note = written_note_path(rank_file);
  std::ifstream in(note);
  checkpoint::WriteResult w;
  std::string hex;
  std::optional<std::uint64_t> h;
  if (!(in >> w.bytes >> hex) || !(h = checkpoint::parse_xxh64_hex(hex)))
    fail_as(ErrorKind::io, "staging file '", note.string(),
            "' is missing or unreadable (did its rank write its file?)");
  w.xxh64 = *h;
  std::filesystem::remove(note);
  return w;
}

// Adds one rank file's entries and slices to the index: from its header, with the size and
// checksum its writer reported.
inline void index_rank_file(checkpoint::CheckpointIndex& index, const std::filesystem::path& path,
                            const checkpoint::WriteResult& written) {
  const auto file = checkpoint::SafetensorsFile::open(path);
  const std::string name = path.filename().string();
  if (file.file_bytes() != written.bytes)
    fail_as(ErrorKind::corrupt, "checkpoint file '", path.string(), "' has ", file.file_bytes(),
            " bytes but its writer wrote ", written.bytes);
  index.files.push_back({name, written.bytes, written.xxh64});
  auto it = file.metadata().find(slices_metadata_key);
  if (it == file.metadata().end())
    fail_as(ErrorKind::corrupt, "checkpoint file '", path.string(), "': no '", slices_metadata_key, "' metadata");
  const nlohmann::json places = nlohmann::json::parse(it->second);  // outlives the loop's proxy
  for (const auto& [key, p] : places.items()) {
    const auto kind = state_kind_from_name(p.at("kind").get<std::string>());
    const auto dtype = checkpoint::dtype_from_safetensors(p.at("dtype").get<std::string>());
    if (!kind || !dtype)
      fail_as(ErrorKind::corrupt, "checkpoint file '", path.string(), "': slice '", key, "' has a bad kind or dtype");
    const StateKey id{*kind, p.at("state").get<std::string>(), p.at("fqn").get<std::string>()};
    const auto shape = p.at("shape").get<checkpoint::Shape>();
    if (const checkpoint::IndexEntry* e = index.find(id)) {
      if (e->dtype != *dtype || e->shape != shape)
        fail_as(ErrorKind::corrupt, "checkpoint file '", path.string(), "': ", id.describe(),
                " disagrees with another rank file on dtype or shape");
    } else {
      index.entries.push_back({id, *dtype, shape});
    }
    index.slices.push_back({id, name, key, p.at("begin").get<std::uint64_t>(), p.at("count").get<std::uint64_t>()});
  }
}

}  // namespace detail

// What a save found at its path of earlier saves that did not finish and what it did with
// them (checkpoint::recover_leftovers), one line each: rank 0's; empty on the other ranks
// and when there was nothing.
struct SaveReport {
  std::vector<std::string> recovered;
};

namespace detail {

// A token unique to one save and the same on every rank (rank 0 draws it, the others learn
// it; a collective): its staging directory "<dir>.partial-fsdp-<hex of the token>".
inline std::string agreed_save_token(ShardedModel& model) {
  if (model.size() == 0) return "none";  // run_agreed refuses the model next
  const bool root = fsdp::detail::internals(model[0]).rank() == 0;
  // new_save_id: the random source mixed with the clock and the pid (a deterministic
  // random_device in two jobs would otherwise give both saves one staging directory).
  const std::uint64_t drawn = root ? checkpoint::new_save_id() : 0;  // in [1, 2^63)
  const std::int64_t token = fsdp::detail::internals(model[0]).max_over_ranks(static_cast<std::int64_t>(drawn));
  return checkpoint::xxh64_hex(static_cast<std::uint64_t>(token));
}

// A sharded save in three steps, so that the middle one can run on a background thread
// (AsyncCheckpointer): the constructor agrees on the staging directory and, with
// `snapshot`, copies this rank's state into host memory (a collective); write() writes this
// rank's file (no collective; any thread when snapshotted, else the caller's, straight from
// the shards) and notes its size and checksum; commit() agrees that every rank wrote and
// has rank 0 index (headers and notes only) and publish the directory (a collective).
// Until commit, the staging directory is removed if anything fails.
class ShardedSave {
 public:
  ShardedSave(const std::filesystem::path& dir, ShardedModel& model, OptimizerState* optimizer,
              std::map<std::string, std::string> metadata, bool snapshot = true)
      : what_("save_sharded_checkpoint '" + dir.string() + "'"), metadata_(std::move(metadata)),
        token_(agreed_save_token(model)), save_id_(checkpoint::save_id_of_token(token_)) {
    run_agreed(model, what_, [&] {
      check_user_metadata(metadata_, what_);
      staging_dir_ = checkpoint::CheckpointDirectory::staging_path(checkpoint::detail::checkpoint_dir_path(dir), token_);
      rank_ = fsdp::detail::internals(model[0]).rank();
      sources_ = sharded_slice_sources(model, optimizer);  // no collective: inside the agreement
      if (snapshot)  // the same slices, copied: write() then needs nothing of the model
        for (SliceSource& s : sources_) {
          snapshot_.slices.push_back(s.copy_to_host());
          s.unit = nullptr, s.src = snapshot_.slices.back().data.data();
        }
      if (optimizer) optim_scalars_ = optimizer->scalars();
      if (rank_ != 0) return;
      staging_.emplace(checkpoint::CheckpointDirectory::begin(dir, token_));  // recovers leftovers first
      report_.recovered = staging_->recovered();
    });
  }

  const std::string& what() const { return what_; }
  // This save's token, the same on every rank (its staging directory's name ends with it).
  const std::string& token() const { return token_; }
  const SaveReport& report() const { return report_; }
  std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const auto& s : sources_) n += s.bytes();
    return n;
  }

  void write() const {
    const auto file = staging_dir_ / checkpoint::rank_file_name(rank_);
    note_written(file, write_rank_file(file, sources_, save_id_));
  }

  // A save dropped before its commit (no collective possible): this rank removes what it
  // wrote and the staging directory if that leaves it empty. With rank 0's removal of the
  // whole directory, whichever rank finishes last leaves nothing, whatever the order.
  void discard() const noexcept {
    std::error_code ignored;
    const auto file = staging_dir_ / checkpoint::rank_file_name(rank_);
    std::filesystem::remove(written_note_path(file), ignored);
    std::filesystem::remove(file, ignored);
    std::filesystem::remove(staging_dir_, ignored);  // only if empty
  }

  // `write_failed`: what write() threw on this rank, if it ran elsewhere.
  void commit(ShardedModel& model, std::exception_ptr write_failed = nullptr) {
    run_agreed(model, what_, [&] {
      if (write_failed) std::rethrow_exception(write_failed);
    });
    run_agreed(model, what_, [&] {
      if (rank_ != 0) return;
      // Every rank has written its file and its note (the agreement above): the staging
      // directory, fresh from begin(), holds exactly one file per rank.
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(staging_dir_))
        if (e.path().extension() != ".written") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      checkpoint::CheckpointIndex index;
      index.world_size = static_cast<int>(files.size());
      index.save_id = save_id_;
      for (int r = 0; r < index.world_size; ++r)
        if (files[static_cast<std::size_t>(r)].filename() != checkpoint::rank_file_name(r))
          fail_as(ErrorKind::io, "staging directory '", staging_dir_.string(), "' holds '",
                  files[static_cast<std::size_t>(r)].string(), "' where '", checkpoint::rank_file_name(r),
                  "' was expected");
      for (const auto& f : files) index_rank_file(index, f, read_written_note(f));
      for (const auto& [k, v] : metadata_) index.metadata[k] = v;
      for (const auto& [k, v] : optim_scalars_) index.metadata[optim_scalar_prefix + k] = v;
      index.save(staging_dir_ / std::string(checkpoint::index_file_name));
      staging_->commit();
    });
  }

 private:
  std::string what_;
  std::map<std::string, std::string> metadata_;
  std::string token_;
  std::uint64_t save_id_;  // in every file of this save and in the index (checkpoint/save_id.hpp)
  SaveReport report_;
  std::optional<checkpoint::CheckpointDirectory> staging_;  // rank 0's; aborted (removed) unless committed
  std::filesystem::path staging_dir_;
  int rank_ = 0;
  std::vector<SliceSource> sources_;  // what write() writes: into snapshot_ where there is one
  ShardedStateDict snapshot_;
  std::map<std::string, std::string> optim_scalars_;
};

}  // namespace detail

// A collective: every rank calls it. `dir` is complete or absent afterwards (an older
// checkpoint there is replaced only at the commit). A rank that fails makes every rank fail.
// Before it writes, rank 0 deals with what interrupted saves left at `dir` and returns
// what it found (see SaveReport).
inline SaveReport save_sharded_checkpoint(const std::filesystem::path& dir, ShardedModel& model,
                                          OptimizerState* optimizer = nullptr,
                                          const std::map<std::string, std::string>& metadata = {}) {
  detail::ShardedSave save(dir, model, optimizer, metadata, /*snapshot=*/false);
  save.commit(model, detail::captured([&] { save.write(); }));
  return save.report();
}

namespace detail {
// Called, when set, before each of ShardedCheckpointSource's attempts to open `dir` (attempt
// 1, 2, ...). Tests only: a commit that lands inside an open (after it read index.json,
// before it opened the rank files) cannot be timed from outside, so a test puts `dir` here
// into the state such an open sees. Null by default.
inline std::function<void(const std::filesystem::path& dir, int attempt)>& sharded_open_hook() {
  static std::function<void(const std::filesystem::path&, int)> hook;
  return hook;
}
}  // namespace detail

// A sharded checkpoint directory as a StateSource. Opening reads the index and every file's
// header. Checksums: read() verifies a file the first time it uses it; a load (read_all)
// splits the files among the loading ranks (file i to rank i mod ranks), each hashing its
// files whole while reading its own ranges from them, and agree_damage() names a damaged
// file on every rank before anything is written. Every file is thus verified by exactly
// one rank per load, whichever ranks read it.
class ShardedCheckpointSource final : public StateSource {
 public:
  // A `dir` that a commit interrupted between its renames left absent is read from its old
  // copy (checkpoint::committed_checkpoint_dir).
  explicit ShardedCheckpointSource(const std::filesystem::path& dir) : reader_(open_reader(dir)) {
    for (const auto& e : reader_.index().entries) metas_[e.id] = {e.dtype, e.shape};
  }
  std::string name() const override { return "checkpoint '" + reader_.dir().string() + "'"; }
  // The save id of the index opened (its rank files were checked to carry the same one).
  // open_and_load has the ranks agree on it: a commit between two ranks' opens must not load
  // two saves.
  std::uint64_t save_id() const { return reader_.index().save_id; }
  std::optional<TensorMeta> find(const StateKey& key) const override {
    auto it = metas_.find(key);
    if (it == metas_.end()) return std::nullopt;
    return it->second;
  }
  void read(const StateKey& key, std::int64_t begin, std::int64_t count, void* dst) const override {
    auto it = metas_.find(key);
    check_read(it != metas_.end(), key, begin, count);
    reader_.read(key, static_cast<std::uint64_t>(begin), static_cast<std::uint64_t>(count), dst,
                 static_cast<std::uint64_t>(count) * size_of(it->second.dtype));
  }
  void read_all(std::span<const ReadRequest> requests, int rank, int ranks) const override {
    std::vector<checkpoint::ShardedCheckpointReader::Range> ranges;
    for (const ReadRequest& r : requests) {
      check_read(metas_.count(r.key) != 0, r.key, r.begin, r.count);
      if (r.count) ranges.push_back({r.key, static_cast<std::uint64_t>(r.begin), static_cast<std::uint64_t>(r.count), r.dst});
    }
    reader_.read_all(ranges, verifies(rank, ranks));
  }
  bool reads_in_place() const override { return true; }
  void verify(int rank, int ranks) const override { reader_.verify_files(verifies(rank, ranks)); }
  // One agreement when no rank found damage; else one per file, up to the first damaged one.
  std::string agree_damage(const std::function<bool(bool)>& agree) const override {
    const auto damaged = reader_.damaged();
    if (agree(damaged.empty())) return "";
    for (const auto& f : reader_.index().files)
      if (!agree(!damaged.count(f.name)))
        return name() + ": file '" + f.name + "': its XXH64 does not match the index (found by the rank that verified "
               "it; the file is corrupt or from another save)";
    return name() + ": a rank found a damaged file";  // unreachable: some rank named one
  }
  std::vector<StateKey> keys() const override {
    std::vector<StateKey> out;
    for (const auto& [k, m] : metas_) out.push_back(k);
    return out;
  }
  std::map<std::string, std::string> optim_scalars() const override {
    std::map<std::string, std::string> out;
    const std::string prefix = detail::optim_scalar_prefix;
    for (const auto& [k, v] : reader_.index().metadata)
      if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
    return out;
  }
  // The user metadata given to save_sharded_checkpoint (without the optimizer's scalars).
  std::map<std::string, std::string> metadata() const { return detail::user_metadata(reader_.index().metadata); }

 private:
  // The index is read from dir/index.json and the rank files by path after it: a commit
  // renaming another save into `dir` in between gives rank files of another save than the
  // index, or none (both an error here). Opening again then finds the new save whole, so
  // such an error (io or corrupt) is retried a few times, with a short pause, before it is
  // reported; a checkpoint that is really damaged fails the same way each time.
  static checkpoint::ShardedCheckpointReader open_reader(const std::filesystem::path& dir) {
    constexpr int attempts = 3;
    for (int attempt = 1;; ++attempt) {
      try {
        if (const auto& hook = detail::sharded_open_hook()) hook(dir, attempt);
        return checkpoint::ShardedCheckpointReader(checkpoint::committed_checkpoint_dir(dir));
      } catch (const Error& e) {
        if (attempt == attempts || (e.kind() != ErrorKind::io && e.kind() != ErrorKind::corrupt)) throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20 * attempt));
    }
  }
  // File i is verified by rank i mod ranks.
  static std::function<bool(std::size_t)> verifies(int rank, int ranks) {
    const auto n = static_cast<std::size_t>(std::max(ranks, 1));
    return [n, rank](std::size_t file) { return file % n == static_cast<std::size_t>(rank); };
  }
  checkpoint::ShardedCheckpointReader reader_;
  std::map<StateKey, TensorMeta> metas_;
};

// A collective: every rank opens the checkpoint (index and headers), the ranks agree it is
// usable, then load_state reads and verifies every tensor (and every file's checksum,
// split among the ranks) before writing any.
inline LoadReport load_sharded_checkpoint(const std::filesystem::path& dir, ShardedModel& model,
                                          OptimizerState* optimizer = nullptr, LoadOptions options = {}) {
  return detail::open_and_load<ShardedCheckpointSource>("load_sharded_checkpoint", dir, model, optimizer, options);
}

}  // namespace fsdp
