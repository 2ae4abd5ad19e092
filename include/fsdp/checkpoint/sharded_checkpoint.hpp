#pragma once
// Sharded checkpoints on disk: every rank writes its sharded state dict (its slices of
// each parameter and optimizer state; buffers on rank 0) into its own safetensors file of
// one checkpoint directory, rank 0 writes index.json (which slice of which tensor each
// file holds, a checksum per file, user metadata, the optimizer's scalars) and commits the
// directory atomically. Any number of ranks loads it back (see ShardedCheckpointSource).
//
//   ckpt/index.json
//   ckpt/rank-00000.safetensors   tensors "param/<fqn>", "optim/<state>/<fqn>", "buffer/<fqn>";
//   ckpt/rank-00001.safetensors   __metadata__ "fsdp.slices": JSON of each key's tensor, begin and shape
#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/checkpoint_directory.hpp"
#include "fsdp/checkpoint/load_state.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/checkpoint/safetensors_writer.hpp"
#include "fsdp/checkpoint/sharded_checkpoint_reader.hpp"
#include "fsdp/checkpoint/state_dict.hpp"

namespace fsdp {

namespace detail {

inline constexpr const char* checkpoint_token = "fsdp";           // every rank knows the staging path
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
inline void write_rank_file(const std::filesystem::path& path, const ShardedStateDict& sd) {
  checkpoint::SafetensorsWriter writer;
  nlohmann::json places = nlohmann::json::object();
  for (const StateSlice& s : sd.slices) {
    const std::string key = slice_key(s.id);
    places[key] = {{"kind", name_of(s.id.kind)}, {"state", s.id.state}, {"fqn", s.id.fqn},
                   {"dtype", checkpoint::safetensors_dtype_name(s.dtype)}, {"shape", s.shape},
                   {"begin", s.begin}, {"count", s.count}};
    writer.add(key, s.dtype, {s.count}, s.data.data());
  }
  writer.set_metadata(slices_metadata_key, places.dump());
  writer.write(path);
}

// Adds one rank file's entries and slices to the index, from its header.
inline void index_rank_file(checkpoint::CheckpointIndex& index, const std::filesystem::path& path) {
  const auto file = checkpoint::SafetensorsFile::open(path);
  const std::string name = path.filename().string();
  index.files.push_back({name, file.file_bytes(), file.xxh64()});
  auto it = file.metadata().find(slices_metadata_key);
  if (it == file.metadata().end()) fail("checkpoint file '", path.string(), "': no '", slices_metadata_key, "' metadata");
  const nlohmann::json places = nlohmann::json::parse(it->second);  // outlives the loop's proxy
  for (const auto& [key, p] : places.items()) {
    const auto kind = state_kind_from_name(p.at("kind").get<std::string>());
    const auto dtype = checkpoint::dtype_from_safetensors(p.at("dtype").get<std::string>());
    if (!kind || !dtype) fail("checkpoint file '", path.string(), "': slice '", key, "' has a bad kind or dtype");
    const StateKey id{*kind, p.at("state").get<std::string>(), p.at("fqn").get<std::string>()};
    const auto shape = p.at("shape").get<checkpoint::Shape>();
    if (const checkpoint::IndexEntry* e = index.find(id)) {
      if (e->dtype != *dtype || e->shape != shape)
        fail("checkpoint file '", path.string(), "': ", id.describe(), " disagrees with another rank file on dtype or shape");
    } else {
      index.entries.push_back({id, *dtype, shape});
    }
    index.slices.push_back({id, name, key, p.at("begin").get<std::uint64_t>(), p.at("count").get<std::uint64_t>()});
  }
}

}  // namespace detail

namespace detail {

// A sharded save in three steps, so that the middle one can run on a background thread
// (AsyncCheckpointer): begin() agrees on the staging directory and snapshots this rank's
// state into host memory (a collective), write() writes this rank's file (no collective,
// any thread), commit() agrees that every rank wrote and has rank 0 index and publish the
// directory (a collective). Until commit, the staging directory is removed if anything fails.
class ShardedSave {
 public:
  ShardedSave(const std::filesystem::path& dir, ShardedModel& model, OptimizerState* optimizer,
              std::map<std::string, std::string> metadata)
      : what_("save_sharded_checkpoint '" + dir.string() + "'"), metadata_(std::move(metadata)) {
    run_agreed(model, what_, [&] {
      check_user_metadata(metadata_, what_);
      staging_dir_ = checkpoint::CheckpointDirectory::staging_path(checkpoint::detail::checkpoint_dir_path(dir), checkpoint_token);
      snapshot_ = sharded_state_dict(model, optimizer);  // no collective: inside the agreement
      if (model[0].rank() != 0) return;
      std::filesystem::remove_all(staging_dir_);  // left by a save that was killed
      staging_.emplace(checkpoint::CheckpointDirectory::begin(dir, checkpoint_token));
    });
  }

  const std::string& what() const { return what_; }
  std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const auto& s : snapshot_.slices) n += s.data.size();
    return n;
  }

  void write() const { write_rank_file(staging_dir_ / checkpoint::rank_file_name(snapshot_.rank), snapshot_); }

  // `write_failed`: what write() threw on this rank, if it ran elsewhere.
  void commit(ShardedModel& model, std::exception_ptr write_failed = nullptr) {
    run_agreed(model, what_, [&] {
      if (write_failed) std::rethrow_exception(write_failed);
    });
    run_agreed(model, what_, [&] {
      if (snapshot_.rank != 0) return;
      // Every rank has written its file (the agreement above): the staging directory, fresh
      // from begin(), holds exactly one per rank.
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(staging_dir_)) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      checkpoint::CheckpointIndex index;
      index.world_size = static_cast<int>(files.size());
      for (int r = 0; r < index.world_size; ++r)
        if (files[static_cast<std::size_t>(r)].filename() != checkpoint::rank_file_name(r))
          fail("staging directory '", staging_dir_.string(), "' holds '", files[static_cast<std::size_t>(r)].string(),
               "' where '", checkpoint::rank_file_name(r), "' was expected");
      for (const auto& f : files) index_rank_file(index, f);
      for (const auto& [k, v] : metadata_) index.metadata[k] = v;
      for (const auto& [k, v] : snapshot_.optim_scalars) index.metadata[optim_scalar_prefix + k] = v;
      index.save(staging_dir_ / std::string(checkpoint::index_file_name));
      staging_->commit();
    });
  }

 private:
  std::string what_;
  std::map<std::string, std::string> metadata_;
  std::optional<checkpoint::CheckpointDirectory> staging_;  // rank 0's; aborted (removed) unless committed
  std::filesystem::path staging_dir_;
  ShardedStateDict snapshot_;
};

}  // namespace detail

// A collective: every rank calls it. `dir` is complete or absent afterwards (an older
// checkpoint there is replaced only at the commit). A rank that fails makes every rank fail.
inline void save_sharded_checkpoint(const std::filesystem::path& dir, ShardedModel& model, OptimizerState* optimizer = nullptr,
                                    const std::map<std::string, std::string>& metadata = {}) {
  detail::ShardedSave save(dir, model, optimizer, metadata);
  save.commit(model, detail::captured([&] { save.write(); }));
}

// A sharded checkpoint directory as a StateSource. Every file's checksum is verified when
// it opens, so a damaged file is named on every rank before anything is loaded.
class ShardedCheckpointSource final : public StateSource {
 public:
  explicit ShardedCheckpointSource(const std::filesystem::path& dir) : reader_(dir) {
    reader_.verify_checksums();
    for (const auto& e : reader_.index().entries) metas_[e.id] = {e.dtype, e.shape};
  }
  std::string name() const override { return "checkpoint '" + reader_.dir().string() + "'"; }
  std::optional<TensorMeta> find(const StateKey& key) const override {
    auto it = metas_.find(key);
    if (it == metas_.end()) return std::nullopt;
    return it->second;
  }
  void read(const StateKey& key, std::int64_t begin, std::int64_t count, void* dst) const override {
    auto it = metas_.find(key);
    if (it == metas_.end()) detail::fail(name(), ": no ", key.describe());
    if (begin < 0 || count < 0) detail::fail(name(), ": ", key.describe(), ": negative range [", begin, ", +", count, ")");
    reader_.read(key, static_cast<std::uint64_t>(begin), static_cast<std::uint64_t>(count), dst,
                 static_cast<std::uint64_t>(count) * size_of(it->second.dtype));
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
  checkpoint::ShardedCheckpointReader reader_;
  std::map<StateKey, TensorMeta> metas_;
};

// A collective: every rank opens (and checksums) the checkpoint, the ranks agree it is
// usable, then load_state verifies every tensor before writing any.
inline LoadReport load_sharded_checkpoint(const std::filesystem::path& dir, ShardedModel& model,
                                          OptimizerState* optimizer = nullptr, LoadOptions options = {}) {
  return detail::open_and_load<ShardedCheckpointSource>("load_sharded_checkpoint", dir, model, optimizer, options);
}

}  // namespace fsdp
