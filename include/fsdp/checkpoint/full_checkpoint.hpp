#pragma once
// Full checkpoints: one plain safetensors file with every parameter and buffer whole under
// its FQN, in master dtypes (what other tools read), user metadata in its __metadata__.
// The optimizer's state, if saved, goes into the sibling "<stem>.optimizer.safetensors"
// with keys "<state>/<fqn>" and the optimizer's scalars in its __metadata__. Each file is
// written atomically by rank 0; every rank reads them to load.
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/load_state.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/checkpoint/safetensors_writer.hpp"
#include "fsdp/checkpoint/state_dict.hpp"

namespace fsdp {

// "model.safetensors" -> "model.optimizer.safetensors", next to it.
inline std::filesystem::path optimizer_file_of(const std::filesystem::path& file) {
  return file.parent_path() / (file.stem().string() + ".optimizer.safetensors");
}

namespace detail {

// A full save in three steps, like ShardedSave: the constructor gathers every tensor into
// rank 0's host memory (a collective), write() has rank 0 write the files (no collective,
// any thread), commit() agrees that it did (a collective).
class FullSave {
 public:
  FullSave(const std::filesystem::path& file, ShardedModel& model, OptimizerState* optimizer,
           std::map<std::string, std::string> metadata)
      : what_("save_full_checkpoint '" + file.string() + "'"), file_(file), metadata_(std::move(metadata)),
        has_optimizer_(optimizer != nullptr), writes_(model.size() > 0 && model[0].rank() == 0),
        snapshot_(full_state_dict(model, optimizer, {.rank0_only = true})) {}

  const std::string& what() const { return what_; }
  std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const auto& [fqn, t] : snapshot_.tensors) n += t.data.size();
    for (const auto& [state, tensors] : snapshot_.optim)
      for (const auto& [fqn, t] : tensors) n += t.data.size();
    return n;
  }

  void write() const {
    if (!writes_) return;
    const auto optimizer_file = optimizer_file_of(file_);
    if (has_optimizer_) {  // first, so a model file is never newer than its optimizer file
      checkpoint::SafetensorsWriter w;
      for (const auto& [state, tensors] : snapshot_.optim)
        for (const auto& [fqn, t] : tensors) w.add(state + "/" + fqn, t.dtype, t.shape, t.data.data());
      for (const auto& [k, v] : snapshot_.optim_scalars) w.set_metadata(k, v);
      w.write(optimizer_file);
    } else {
      std::filesystem::remove(optimizer_file);  // a stale one would load with the new model
    }
    checkpoint::SafetensorsWriter w;
    for (const auto& [fqn, t] : snapshot_.tensors) w.add(fqn, t.dtype, t.shape, t.data.data());
    for (const auto& [k, v] : metadata_) w.set_metadata(k, v);
    w.write(file_);
  }

  void commit(ShardedModel& model, std::exception_ptr write_failed = nullptr) {
    run_agreed(model, what_, [&] {
      if (write_failed) std::rethrow_exception(write_failed);
    });
  }

 private:
  std::string what_;
  std::filesystem::path file_;
  std::map<std::string, std::string> metadata_;
  bool has_optimizer_, writes_;
  FullStateDict snapshot_;
};

}  // namespace detail

// A collective: every rank calls it (the gathers need every rank); rank 0 writes.
inline void save_full_checkpoint(const std::filesystem::path& file, ShardedModel& model, OptimizerState* optimizer = nullptr,
                                 const std::map<std::string, std::string>& metadata = {}) {
  detail::FullSave save(file, model, optimizer, metadata);
  save.commit(model, detail::captured([&] { save.write(); }));
}

// A full checkpoint file (and its optimizer file, where there is one) as a StateSource.
class FullCheckpointSource final : public StateSource {
 public:
  explicit FullCheckpointSource(const std::filesystem::path& file) : model_(checkpoint::SafetensorsFile::open(file)) {
    const auto optimizer_file = optimizer_file_of(file);
    if (std::filesystem::exists(optimizer_file)) optim_.emplace(checkpoint::SafetensorsFile::open(optimizer_file));
  }
  std::string name() const override { return "checkpoint '" + model_.path().string() + "'"; }
  std::optional<TensorMeta> find(const StateKey& key) const override {
    const checkpoint::TensorInfo* t = lookup(key);
    if (!t) return std::nullopt;
    return TensorMeta{t->dtype, t->shape};
  }
  void read(const StateKey& key, std::int64_t begin, std::int64_t count, void* dst) const override {
    if (!lookup(key)) detail::fail(name(), ": no ", key.describe());
    if (begin < 0 || count < 0) detail::fail(name(), ": ", key.describe(), ": negative range [", begin, ", +", count, ")");
    file_of(key).read_elements(file_key(key), static_cast<std::uint64_t>(begin), static_cast<std::uint64_t>(count), dst);
  }
  std::vector<StateKey> keys() const override {
    std::vector<StateKey> out;
    for (const auto& t : model_.tensors()) out.push_back(StateKey::param(t.name));  // param or buffer: see lookup
    if (optim_)
      for (const auto& t : optim_->tensors()) {
        const auto slash = t.name.find('/');
        out.push_back(StateKey::optim(slash == std::string::npos ? "" : t.name.substr(slash + 1), t.name.substr(0, slash)));
      }
    return out;
  }
  std::map<std::string, std::string> optim_scalars() const override {
    if (!optim_) return {};
    return {optim_->metadata().begin(), optim_->metadata().end()};
  }
  std::map<std::string, std::string> metadata() const { return {model_.metadata().begin(), model_.metadata().end()}; }

 private:
  // Parameters and buffers share one FQN namespace in the model file.
  static std::string file_key(const StateKey& key) { return key.kind == StateKind::optim ? key.state + "/" + key.fqn : key.fqn; }
  const checkpoint::SafetensorsFile& file_of(const StateKey& key) const {
    return key.kind == StateKind::optim ? *optim_ : model_;
  }
  const checkpoint::TensorInfo* lookup(const StateKey& key) const {
    if (key.kind == StateKind::optim && !optim_) return nullptr;
    return file_of(key).find(file_key(key));
  }

  checkpoint::SafetensorsFile model_;
  std::optional<checkpoint::SafetensorsFile> optim_;
};

// A collective: every rank opens the file(s), the ranks agree they could, then load_state
// verifies every tensor before writing any.
inline LoadReport load_full_checkpoint(const std::filesystem::path& file, ShardedModel& model,
                                       OptimizerState* optimizer = nullptr, LoadOptions options = {}) {
  return detail::open_and_load<FullCheckpointSource>("load_full_checkpoint", file, model, optimizer, options);
}

}  // namespace fsdp
