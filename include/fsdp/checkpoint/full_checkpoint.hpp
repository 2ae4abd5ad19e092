#pragma once
// Full checkpoints: one plain safetensors file with every parameter and buffer whole under
// its FQN, in master dtypes (what other tools read), user metadata in its __metadata__.
// The optimizer's state, if saved, goes into the sibling "<stem>.optimizer.safetensors"
// with keys "<state>/<fqn>" and the optimizer's scalars in its __metadata__. Each file is
// written atomically: by every rank at once where they share a file system, else by rank 0
// as it gathers; every rank reads them to load.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fsdp/checkpoint/full_save.hpp"
#include "fsdp/checkpoint/load_state.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/checkpoint/shared_file_save.hpp"

namespace fsdp {

// A collective: every rank calls it. Where every rank can open the files rank 0 creates
// (one host, or a shared file system) and the shards are in host memory, each rank writes
// its own slices into them (detail::save_full_shared); otherwise rank 0 writes, one flat
// parameter at a time as it is gathered. The files are the same either way.
inline void save_full_checkpoint(const std::filesystem::path& file, ShardedModel& model, OptimizerState* optimizer = nullptr,
                                 const std::map<std::string, std::string>& metadata = {}) {
  detail::FullSave save(file, model, optimizer, metadata, /*snapshot=*/false);
  if (detail::save_full_shared(save, model, optimizer)) return;
  save.commit(model, detail::captured([&] { save.write_streaming(); }));
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
    check_read(lookup(key) != nullptr, key, begin, count);
    file_of(key).read_elements(detail::full_file_key(key), static_cast<std::uint64_t>(begin),
                               static_cast<std::uint64_t>(count), dst);
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
  // The files were checked against their headers when opened; no checksums to verify.
  bool reads_in_place() const override { return true; }
  // Every rank reads a strided part of each file. Before the agreement, rank r reads the
  // r-th contiguous part of each (into a scratch buffer), so the disk sees `ranks`
  // sequential streams instead of `ranks` strided ones; after it, the ranks' own reads
  // find their bytes in the page cache (on one host; ranks on other hosts read theirs).
  void verify(int rank, int ranks) const override {
    if (ranks < 1) return;
    std::vector<std::byte> scratch(std::size_t{4} << 20);
    for (const checkpoint::SafetensorsFile* f : {&model_, optim_ ? &*optim_ : nullptr}) {
      if (!f) continue;
      const std::uint64_t part = (f->file_bytes() + ranks - 1) / static_cast<std::uint64_t>(ranks);
      const std::uint64_t end = std::min(f->file_bytes(), part * static_cast<std::uint64_t>(rank + 1));
      for (std::uint64_t at = part * static_cast<std::uint64_t>(rank); at < end; at += scratch.size())
        f->read_file_bytes(scratch.data(), std::min<std::uint64_t>(scratch.size(), end - at), at);
    }
  }
  // Then it reads its ranges file by file in file order, not in the model's order (which
  // alternates between the two files).
  void read_all(std::span<const ReadRequest> requests, int /*rank*/, int /*ranks*/) const override {
    struct Placed {
      bool optim;
      std::uint64_t offset;
      const ReadRequest* request;
    };
    std::vector<Placed> order;
    for (const ReadRequest& r : requests) {
      check_read(lookup(r.key) != nullptr, r.key, r.begin, r.count);
      if (r.count == 0) continue;
      const bool optim = r.key.kind == StateKind::optim;
      order.push_back({optim, file_of(r.key).file_offset_of(detail::full_file_key(r.key), static_cast<std::uint64_t>(r.begin),
                                                            static_cast<std::uint64_t>(r.count)), &r});
    }
    std::sort(order.begin(), order.end(), [](const Placed& a, const Placed& b) {
      return a.optim != b.optim ? !a.optim : a.offset < b.offset;
    });
    for (const Placed& p : order) read(p.request->key, p.request->begin, p.request->count, p.request->dst);
  }
  std::map<std::string, std::string> optim_scalars() const override {
    if (!optim_) return {};
    return {optim_->metadata().begin(), optim_->metadata().end()};
  }
  std::map<std::string, std::string> metadata() const { return {model_.metadata().begin(), model_.metadata().end()}; }

 private:
  const checkpoint::SafetensorsFile& file_of(const StateKey& key) const {
    return key.kind == StateKind::optim ? *optim_ : model_;
  }
  const checkpoint::TensorInfo* lookup(const StateKey& key) const {
    if (key.kind == StateKind::optim && !optim_) return nullptr;
    return file_of(key).find(detail::full_file_key(key));
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
