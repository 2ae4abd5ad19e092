#pragma once
// FullSave: the steps of a full checkpoint save that gathers to rank 0 (see the class),
// and where the optimizer's file goes. full_checkpoint.hpp has the public functions.
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
#include "fsdp/checkpoint/host_arena.hpp"
#include "fsdp/checkpoint/safetensors_writer.hpp"
#include "fsdp/checkpoint/state_dict.hpp"

namespace fsdp {

// "model.safetensors" -> "model.optimizer.safetensors", next to it.
inline std::filesystem::path optimizer_file_of(const std::filesystem::path& file) {
  return file.parent_path() / (file.stem().string() + ".optimizer.safetensors");
}

namespace detail {

// A tensor's name in a full checkpoint: its FQN in the model file (parameters and buffers
// share one namespace), "<state>/<fqn>" in the optimizer file.
inline std::string full_file_key(std::string_view state, std::string_view fqn) {
  return state.empty() ? std::string(fqn) : std::string(state) + "/" + std::string(fqn);
}
inline std::string full_file_key(const StateKey& key) { return full_file_key(key.state, key.fqn); }

// A full save in three steps, like ShardedSave: the constructor, with `snapshot`, gathers
// every tensor into rank 0's host memory (a collective); write() has rank 0 write the
// files (no collective, any thread); commit() agrees that it did (a collective). Without
// the snapshot, write_streaming() (every rank, a collective) gathers one flat parameter at
// a time while rank 0 writes it, so the full state is never held whole.
class FullSave {
 public:
  FullSave(const std::filesystem::path& file, ShardedModel& model, OptimizerState* optimizer,
           std::map<std::string, std::string> metadata, bool snapshot = true)
      : what_("save_full_checkpoint '" + file.string() + "'"), file_(file), metadata_(std::move(metadata)),
        optimizer_(optimizer), writes_(model.size() > 0 && fsdp::detail::internals(model[0]).rank() == 0),
        gathers_(full_gathers(model, optimizer)) {
    if (metadata_.count(std::string(checkpoint::data_checksums_key)))
      fail(what_, ": metadata key '", checkpoint::data_checksums_key, "' is the library's own (the data checksums)");
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
  void write() const {
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

  void commit(ShardedModel& model, std::exception_ptr write_failed = nullptr) {
    run_agreed(model, what_, [&] {
      if (write_failed) std::rethrow_exception(write_failed);
    });
  }

 private:
  // Where gather k's bytes come from: host memory, or a fill that gathers them.
  struct Source {
    const std::byte* host;
    checkpoint::SafetensorsWriter::Fill fill;
  };

  // Rank 0: the optimizer file (first, so a model file is never newer than its optimizer
  // file), then the model file.
  template <class SourceOf>
  void write_files(SourceOf&& source_of) const {
    checkpoint::SafetensorsWriter optim, model;
    describe(source_of, optim, model);
    const auto optimizer_file = optimizer_file_of(file_);
    if (optimizer_) optim.write(optimizer_file);
    else std::filesystem::remove(optimizer_file);  // a stale one would load with the new model
    model.write(file_);
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
  std::vector<checkpoint::HostArena> snapshot_;          // per gather, on rank 0 (empty elsewhere)
  std::vector<std::vector<std::byte>> buffer_copies_;    // per buffer, on rank 0 (empty elsewhere)
};

}  // namespace detail

}  // namespace fsdp
