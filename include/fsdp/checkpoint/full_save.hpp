#pragma once
// FullSave: the steps of a full checkpoint save that gathers to rank 0 (see the class),
// and where the optimizer's file goes. full_checkpoint.hpp has the public functions.
// The model file and the optimizer file are one unit: both are written under temporary
// names and published together by one commit (publish_full_files, after
// checkpoint::commit_files), so a save killed at any point leaves the previous pair or the
// new one, never old parameters next to new optimizer state.
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/checkpoint_directory.hpp"
#include "fsdp/checkpoint/host_arena.hpp"
#include "fsdp/checkpoint/safetensors_writer.hpp"
#include "fsdp/checkpoint/state_dict.hpp"

namespace fsdp {

// "model.safetensors" -> "model.optimizer.safetensors", next to it.
inline std::filesystem::path optimizer_file_of(const std::filesystem::path& file) {
  return file.parent_path() / (file.stem().string() + ".optimizer.safetensors");
}

namespace detail {

// A full checkpoint's two names: the model file, then its optimizer file (the commit's targets).
inline std::vector<std::filesystem::path> full_checkpoint_targets(const std::filesystem::path& file) {
  return {file, optimizer_file_of(file)};
}

// Rank 0: publishes a full checkpoint's staged files (the optimizer file's, if any, then the
// model file's) together; a save without an optimizer removes a stale optimizer file in the
// same commit. Returns what it found of interrupted saves at `file`.
inline std::vector<std::string> publish_full_files(const std::filesystem::path& file, std::vector<checkpoint::StagedFile>& staged,
                                                   bool saves_optimizer, std::uint64_t save_id) {
  std::vector<std::filesystem::path> removes;
  if (!saves_optimizer) removes.push_back(optimizer_file_of(file));
  return checkpoint::commit_files(staged, removes, full_checkpoint_targets(file), checkpoint::format_save_id(save_id));
}

// A tensor's name in a full checkpoint: its FQN in the model file (parameters and buffers
// share one namespace), "<state>/<fqn>" in the optimizer file.
inline std::string full_file_key(std::string_view state, std::string_view fqn) {
  return state.empty() ? std::string(fqn) : std::string(state) + "/" + std::string(fqn);
}
inline std::string full_file_key(const StateKey& key) { return full_file_key(key.state, key.fqn); }

// A full save in three steps, like ShardedSave: the constructor, with `snapshot`, gathers
// every tensor into rank 0's host memory (a collective); write() has rank 0 write the
// files under temporary names (no collective, any thread); commit() agrees that it did and
// has rank 0 publish both together (a collective). Destroyed uncommitted, it removes what
// it wrote. Without
// the snapshot, write_streaming() (every rank, a collective) gathers one flat parameter at
// a time while rank 0 writes it, so the full state is never held whole.
class FullSave {
 public:
  FullSave(const std::filesystem::path& file, ShardedModel& model, OptimizerState* optimizer,
           std::map<std::string, std::string> metadata, bool snapshot = true)
      : what_("save_full_checkpoint '" + file.string() + "'"), file_(file), metadata_(std::move(metadata)),
        optimizer_(optimizer), writes_(model.size() > 0 && fsdp::detail::internals(model[0]).rank() == 0),
        gathers_(full_gathers(model, optimizer)) {
    for (const auto& [key, value] : metadata_)
      if (checkpoint::is_fsdp_key(key))
        fail(what_, ": metadata key '", key, "' starts with '", checkpoint::fsdp_key_prefix,
             "', which is reserved for the library's own keys (checksums, format version, save id)");
    for (auto& u : model)
      for (std::size_t i = 0; i < u->buffers().size(); ++i) buffers_.push_back({u.get(), i});
    if (optimizer && writes_) optim_scalars_ = optimizer->scalars();
    if (!snapshot) return;
    const checkpoint::HostArena scratch(writes_ ? 0 : largest_gather(gathers_));  // other ranks keep nothing
    for (const FullGather& g : gathers_) {
      if (writes_) snapshot_.emplace_back(g.bytes);
      gather(g, optimizer_, writes_ ? snapshot_.back().data() : scratch.data());
    }
    if (writes_)
      for (const auto& [u, i] : buffers_) {
        const auto& b = u->buffers()[i];
        buffer_copies_.push_back(to_host(*u, fsdp::detail::internals(*u).buffer_data(i), static_cast<std::size_t>(b.numel) * size_of(b.dtype)));
      }
  }

  const std::string& what() const { return what_; }
  std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const auto& s : snapshot_) n += s.size();
    for (const auto& b : buffer_copies_) n += b.size();
    return n;
  }

  // From the snapshot.
  void write() {
    if (writes_) write_files([&](std::size_t k) { return Source{snapshot_[k].data(), {}}; });
  }

  // Every rank, with no snapshot: the gathers run in the same order on every rank; on rank
  // 0 inside the writes. If rank 0's write fails, it still takes part in the gathers left.
  void write_streaming() {
    std::size_t next = 0;
    bool gather_failed = false;
    auto gather_next = [&](std::size_t k, void* into) {
      if (k != next) fail(what_, ": gather ", k, " asked for out of order (", next, " next)");
      try {
        gather(gathers_[k], optimizer_, into);
      } catch (...) {
        gather_failed = true;  // the group is broken: no more gathers
        throw;
      }
      ++next;
    };
    std::exception_ptr failed;
    if (writes_)
      failed = captured([&] {
        write_files([&](std::size_t k) {
          return Source{nullptr, [&, k](std::span<std::byte> out) { gather_next(k, out.data()); }};
        });
      });
    if (next < gathers_.size() && !gather_failed) {
      const checkpoint::HostArena scratch(largest_gather(gathers_));
      for (std::size_t k = next; k < gathers_.size(); ++k) gather_next(k, scratch.data());
    }
    if (failed) std::rethrow_exception(failed);
  }

  // Every rank agrees that rank 0 wrote both files, then rank 0 publishes them together.
  void commit(ShardedModel& model, std::exception_ptr write_failed = nullptr) {
    try {
      run_agreed(model, what_, [&] {
        if (write_failed) std::rethrow_exception(write_failed);
      }, "; nothing was saved");
      run_agreed(model, what_, [&] {
        if (writes_) recovered_ = publish_full_files(file_, staged_, optimizer_ != nullptr, save_id_);
      });
    } catch (...) {
      staged_.clear();  // before the commit point: removed; after it the journal owns them
      throw;
    }
  }
  // What rank 0's commit found of interrupted saves at the file (empty elsewhere).
  const std::vector<std::string>& recovered() const { return recovered_; }
  std::uint64_t save_id() const { return save_id_; }

 private:
  // Where gather k's bytes come from: host memory, or a fill that gathers them.
  struct Source {
    const std::byte* host;
    checkpoint::SafetensorsWriter::Fill fill;
  };

  // Rank 0: the optimizer file, then the model file, under temporary names (commit()
  // publishes them; a stale optimizer file is removed there when this save has none).
  template <class SourceOf>
  void write_files(SourceOf&& source_of) {
    checkpoint::SafetensorsWriter optim, model;
    describe(source_of, optim, model);
    staged_.clear();
    auto stage = [&](const checkpoint::SafetensorsWriter& w, const std::filesystem::path& path) {
      // Hashing::none: with data checksums (describe) the writer overwrites their placeholder.
      staged_.push_back(checkpoint::StagedFile::write(path, [&](checkpoint::FileSink& sink) { w.write_to(sink); },
                                                      checkpoint::Hashing::none));
    };
    if (optimizer_) stage(optim, optimizer_file_of(file_));
    stage(model, file_);
  }

 public:
  // What the two files hold, in order (the gathers' tensors in gathers_ order, then the
  // buffers), with their bytes from source_of(k) for gather k. Every rank gets the same
  // tensor layout; only rank 0 has the optimizer's scalars for the header.
  template <class SourceOf>
  void describe(SourceOf&& source_of, checkpoint::SafetensorsWriter& optim, checkpoint::SafetensorsWriter& model) const {
    auto add = [&](checkpoint::SafetensorsWriter& w, std::size_t k) {
      const FullGather& g = gathers_[k];
      Source src = source_of(k);
      std::vector<checkpoint::SafetensorsWriter::Spec> specs;  // for the fill
      std::size_t offset = 0;  // into the host bytes: parameters lie back to back
      for (const std::size_t i : g.params) {
        const auto& p = g.unit->parameters()[i];
        std::string name = full_file_key(g.state, p.fqn);
        if (src.fill) specs.push_back({std::move(name), g.dtype, shape_of(p.shape)});
        else w.add(std::move(name), g.dtype, shape_of(p.shape), src.host + offset);
        offset += static_cast<std::size_t>(p.numel) * size_of(g.dtype);
      }
      if (src.fill) w.add_together(std::move(specs), std::move(src.fill));
    };
    std::size_t k = 0;
    if (optimizer_) {
      for (; k < gathers_.size() && !gathers_[k].state.empty(); ++k) add(optim, k);
      for (const auto& [key, v] : optim_scalars_) optim.set_metadata(key, v);
    }
    for (; k < gathers_.size(); ++k) add(model, k);
    optim.checksum_data();
    model.checksum_data();
    optim.mark_fsdp_file(save_id_);  // the same id in both files: a load refuses a mixed pair
    model.mark_fsdp_file(save_id_);
    for (std::size_t j = 0; j < buffers_.size(); ++j) {
      const auto& [u, i] = buffers_[j];
      const auto& b = u->buffers()[i];
      if (!buffer_copies_.empty()) {
        model.add(std::string(b.fqn), b.dtype, shape_of(b.shape), buffer_copies_[j].data());
      } else {
        const Unit* unit = u;
        const std::size_t index = i;
        model.add(std::string(b.fqn), b.dtype, shape_of(b.shape),
                  [unit, index](std::span<std::byte> out) { fsdp::detail::internals(*unit).copy_bytes(out.data(), fsdp::detail::internals(*unit).buffer_data(index), out.size()); });
      }
    }
    for (const auto& [key, v] : metadata_) model.set_metadata(key, v);
  }
  // The layout alone: every tensor's bytes from a fill never called.
  void describe(checkpoint::SafetensorsWriter& optim, checkpoint::SafetensorsWriter& model) const {
    describe([](std::size_t) { return Source{nullptr, [](std::span<std::byte>) {}}; }, optim, model);
  }
  const std::filesystem::path& file() const { return file_; }
  bool saves_optimizer() const { return optimizer_ != nullptr; }

 private:
  std::string what_;
  std::filesystem::path file_;
  std::map<std::string, std::string> metadata_;
  OptimizerState* optimizer_;
  bool writes_;
  std::vector<FullGather> gathers_;
  std::vector<std::pair<Unit*, std::size_t>> buffers_;  // (unit, buffer index)
  std::map<std::string, std::string> optim_scalars_;
  std::uint64_t save_id_ = checkpoint::new_save_id();   // rank 0's is written (only its headers are)
  std::vector<checkpoint::HostArena> snapshot_;          // per gather, on rank 0 (empty elsewhere)
  std::vector<std::vector<std::byte>> buffer_copies_;    // per buffer, on rank 0 (empty elsewhere)
  std::vector<checkpoint::StagedFile> staged_;           // rank 0's written files, until commit()
  std::vector<std::string> recovered_;                   // what rank 0's commit found
};

}  // namespace detail

}  // namespace fsdp
