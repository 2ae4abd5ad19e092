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
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/data_checksums.hpp"
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
  // The files were checked against their headers when opened; their data against the
  // chunk checksums the save wrote (checkpoint/data_checksums.hpp) in verify().
  bool reads_in_place() const override { return true; }
  // Each rank checks a contiguous run of each file's chunks (DataChecksums::owner), so the
  // disk sees `ranks` sequential streams and the ranks' own reads later find their bytes
  // in the page cache (on one host). A file written without checksums (by another tool)
  // is read ahead the same way, unchecked. A damaged chunk is remembered; agree_damage()
  // names it on every rank.
  void verify(int rank, int ranks) const override {
    verified_ = true;
    if (ranks < 1) return;
    for (int i = 0; i < files(); ++i) verify_part(i, rank, ranks);
  }
  std::string agree_damage(const std::function<bool(bool)>& agree) const override {
    if (agree(damaged_.empty())) return "";
    for (int i = 0; i < files(); ++i) {
      const auto sums = checksums_of(file(i));  // the same on every rank
      for (std::size_t c = 0; sums && c < sums->digests.size(); ++c)
        if (!agree(!damaged_.count({i, c}))) return damage(file(i), *sums, c);
    }
    return name() + ": a rank found damaged data";  // unreachable: the rank that found it names it
  }
  // Then it reads its ranges file by file in file order, not in the model's order (which
  // alternates between the two files).
  void read_all(std::span<const ReadRequest> requests, int rank, int ranks) const override {
    if (!verified_) verify(rank, ranks);  // a staged load checks here
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
    return checkpoint::without_data_checksums(optim_->metadata());
  }
  std::map<std::string, std::string> metadata() const { return checkpoint::without_data_checksums(model_.metadata()); }

 private:
  int files() const { return optim_ ? 2 : 1; }
  const checkpoint::SafetensorsFile& file(int i) const { return i == 0 ? model_ : *optim_; }
  static std::uint64_t data_bytes(const checkpoint::SafetensorsFile& f) { return f.file_bytes() - f.data_offset(); }
  // The file's chunk checksums; nullopt for a file written without them.
  static std::optional<checkpoint::DataChecksums> checksums_of(const checkpoint::SafetensorsFile& f) {
    const auto entry = f.metadata().find(checkpoint::data_checksums_key);
    if (entry == f.metadata().end()) return std::nullopt;
    auto sums = checkpoint::DataChecksums::parse(entry->second, data_bytes(f));
    if (!sums)
      detail::fail_as(ErrorKind::corrupt, "checkpoint '", f.path().string(), "' is damaged: its metadata '",
                      checkpoint::data_checksums_key, "' is not a list of chunk checksums for its ", data_bytes(f),
                      " bytes of data");
    return sums;
  }

  // Reads this rank's run of file i's chunks (DataChecksums::owner), checking them where the
  // file has checksums.
  void verify_part(int i, int rank, int ranks) const {
    const checkpoint::SafetensorsFile& f = file(i);
    const auto sums = checksums_of(f);
    const checkpoint::DataChecksums layout = sums ? *sums : checkpoint::DataChecksums::placeholder(data_bytes(f));
    const auto read = [&](std::byte* dst, std::uint64_t n, std::uint64_t at) { f.read_file_bytes(dst, n, f.data_offset() + at); };
    checkpoint::hash_owned_chunks(layout, data_bytes(f), rank, ranks, read, [&](std::size_t c, std::uint64_t got) {
      if (sums && got != sums->digests[c]) damaged_.insert({i, c});
    });
  }
  static std::string damage(const checkpoint::SafetensorsFile& f, const checkpoint::DataChecksums& sums, std::size_t c) {
    const std::uint64_t begin = sums.begin(c), end = sums.end(c, data_bytes(f));
    std::string names;  // the tensors with bytes in [begin, end)
    int listed = 0;
    for (const auto& t : f.tensors())
      if (t.begin < end && begin < t.end && listed++ < 4) names += (names.empty() ? "" : ", ") + t.name;
    if (listed > 4) names += ", ... (" + std::to_string(listed) + " tensors)";
    return "checkpoint '" + f.path().string() + "' is damaged: bytes [" + std::to_string(begin) + ", " +
           std::to_string(end) + ") of its data (tensors " + names +
           ") do not match the XXH64 its save wrote (found by the rank that checked them)";
  }

  const checkpoint::SafetensorsFile& file_of(const StateKey& key) const {
    return key.kind == StateKind::optim ? *optim_ : model_;
  }
  const checkpoint::TensorInfo* lookup(const StateKey& key) const {
    if (key.kind == StateKind::optim && !optim_) return nullptr;
    return file_of(key).find(detail::full_file_key(key));
  }

  checkpoint::SafetensorsFile model_;
  std::optional<checkpoint::SafetensorsFile> optim_;
  mutable bool verified_ = false;  // by verify(), before read_all
  mutable std::set<std::pair<int, std::size_t>> damaged_;  // (file, chunk) this rank found damaged
};

// A collective: every rank opens the file(s), the ranks agree they could, then load_state
// verifies every tensor before writing any.
inline LoadReport load_full_checkpoint(const std::filesystem::path& file, ShardedModel& model,
                                       OptimizerState* optimizer = nullptr, LoadOptions options = {}) {
  return detail::open_and_load<FullCheckpointSource>("load_full_checkpoint", file, model, optimizer, options);
}

}  // namespace fsdp
