#pragma once
// Full checkpoints: one plain safetensors file with every parameter and buffer whole under
// its FQN, in master dtypes (what other tools read), user metadata in its __metadata__.
// The optimizer's state, if saved, goes into the sibling "<stem>.optimizer.safetensors"
// with keys "<state>/<fqn>" and the optimizer's scalars in its __metadata__. Both files are
// written under temporary names, by every rank at once where they share a file system, else
// by rank 0 as it gathers, and published together by one journaled commit
// (checkpoint::commit_files): a load sees the previous pair or the new one, also after a
// save killed midway, whose leftovers the next save finishes or removes and reports. Every
// rank reads them to load. Every byte that decides what is loaded
// where is checked before it is used: each header against its checksum when the file is
// opened, the two files against each other (one save id), the data against its chunk
// checksums (data_checksums.hpp) before anything is written.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/data_checksums.hpp"
#include "fsdp/checkpoint/fsdp_metadata.hpp"
#include "fsdp/checkpoint/full_save.hpp"
#include "fsdp/checkpoint/load_state.hpp"
#include "fsdp/checkpoint/safetensors_file.hpp"
#include "fsdp/checkpoint/shared_file_save.hpp"
#include "fsdp/checkpoint/sharded_checkpoint.hpp"

namespace fsdp {

// A collective: every rank calls it. Where every rank can open the files rank 0 creates
// (one host, or a shared file system) and the shards are in host memory, each rank writes
// its own slices into them (detail::save_full_shared); otherwise rank 0 writes, one flat
// parameter at a time as it is gathered. The files are the same either way. Rank 0's report
// says what the commit found of interrupted saves at `file` (see SaveReport).
inline SaveReport save_full_checkpoint(const std::filesystem::path& file, ShardedModel& model, OptimizerState* optimizer = nullptr,
                                       const std::map<std::string, std::string>& metadata = {}) {
  detail::FullSave save(file, model, optimizer, metadata, /*snapshot=*/false);
  SaveReport report;
  if (detail::save_full_shared(save, model, optimizer, &report.recovered)) return report;
  save.commit(model, detail::captured([&] { save.write_streaming(); }));
  report.recovered = save.recovered();
  return report;
}

// A full checkpoint file (and its optimizer file, where there is one) as a StateSource.
class FullCheckpointSource final : public StateSource {
 public:
  // Opening checks each header against its checksum (an fsdp file's: fsdp_metadata.hpp),
  // that a file fsdp wrote is a full checkpoint's, and that the model and optimizer files
  // are from one save. Where a commit is unfinished (its journal is there: a save was
  // killed midway, or is committing now), the files it names are read in place of the
  // targets not yet renamed (checkpoint::committed_files); nothing is written.
  explicit FullCheckpointSource(const std::filesystem::path& file) : model_(open_pair(file)) {}
  std::string name() const override { return "checkpoint '" + model_.path().string() + "'"; }
  // The save id of the files opened (0: none, a file another tool wrote). open_and_load has
  // the ranks agree on it: a commit between two ranks' opens must not load two saves.
  std::uint64_t save_id() const { return checkpoint::save_id_of(model_.metadata()); }
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
  // Each rank checks one contiguous run of the files' chunks, the model file's and then the
  // optimizer file's taken as one sequence split into equal shares of bytes
  // (checkpoint::share_owner), so the disk sees `ranks` sequential streams that end
  // together, every chunk is read from disk and hashed by one rank only, and the ranks' own
  // reads later find their bytes in the page cache (on one host). A file written without
  // checksums (by another tool) is read ahead the same way, unchecked. A damaged chunk is
  // remembered; agree_damage() names it on every rank.
  void verify(int rank, int ranks) const override {
    verified_ = true;
    if (ranks < 1) return;
    std::uint64_t total = 0, before = 0;
    for (int i = 0; i < files(); ++i) total += data_bytes(file(i));
    for (int i = 0; i < files(); ++i) {
      verify_part(i, before, total, rank, ranks);
      before += data_bytes(file(i));
    }
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
  // Opens the model file (returned) and its optimizer file (into optim_) as the last commit
  // left them. A commit that renames them while they are opened can pair an old file with a
  // new one, or remove a temporary file just found: opening again then sees it finished.
  checkpoint::SafetensorsFile open_pair(const std::filesystem::path& file) {
    constexpr int attempts = 3;
    for (int attempt = 1;; ++attempt) {
      const bool last = attempt == attempts;
      const auto at = checkpoint::committed_files(detail::full_checkpoint_targets(file));
      if (attempt > 1) std::this_thread::sleep_for(std::chrono::milliseconds(20 * attempt));  // let the commit finish
      if (!at[0] && !last && std::filesystem::exists(checkpoint::detail::commit_journal_path(file))) continue;
      std::optional<checkpoint::SafetensorsFile> model, optim;
      try {
        model.emplace(checkpoint::SafetensorsFile::open(at[0] ? *at[0] : file));
        if (at[1]) optim.emplace(checkpoint::SafetensorsFile::open(*at[1]));
      } catch (const Error& e) {
        if (last || e.kind() != ErrorKind::io) throw;
        continue;  // a temporary file renamed meanwhile
      }
      check_full_file(*model);
      if (!optim) return std::move(*model);
      check_full_file(*optim);
      const std::uint64_t model_id = checkpoint::save_id_of(model->metadata());
      const std::uint64_t optim_id = checkpoint::save_id_of(optim->metadata());
      if (model_id == optim_id) {
        optim_.emplace(std::move(*optim));
        return std::move(*model);
      }
      if (last)
        detail::fail_as(ErrorKind::corrupt, "checkpoint '", model->path().string(), "' and its optimizer file '",
                        optim->path().string(), "' are from different saves (save id ", describe_id(model_id), " and ",
                        describe_id(optim_id), "): a save was interrupted, or one file was replaced; load neither");
    }
  }
  int files() const { return optim_ ? 2 : 1; }
  const checkpoint::SafetensorsFile& file(int i) const { return i == 0 ? model_ : *optim_; }
  static std::uint64_t data_bytes(const checkpoint::SafetensorsFile& f) { return f.file_bytes() - f.data_offset(); }
  static std::string describe_id(std::uint64_t id) {
    return id ? checkpoint::format_save_id(id) : std::string("none: written by another tool");
  }
  // A file fsdp wrote must be a full checkpoint's (with data checksums), not a rank file of
  // a sharded one; its header was checked when it was opened.
  static void check_full_file(const checkpoint::SafetensorsFile& f) {
    if (checkpoint::is_fsdp_file(f.metadata()) && !f.metadata().count(checkpoint::data_checksums_key))
      detail::fail_as(ErrorKind::corrupt, "checkpoint '", f.path().string(), "' is not a full checkpoint file: it has no '",
                      checkpoint::data_checksums_key, "' (a sharded checkpoint's rank file? load its directory)");
  }
  // The file's chunk checksums; nullopt for a file written without them (another tool's:
  // an fsdp file always has them, check_full_file).
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

  // Reads this rank's run of file i's chunks (checkpoint::share_owner; the file's data is
  // bytes [before, before + its size) of the `total` of all files), checking them where the
  // file has checksums.
  void verify_part(int i, std::uint64_t before, std::uint64_t total, int rank, int ranks) const {
    const checkpoint::SafetensorsFile& f = file(i);
    const std::uint64_t bytes = data_bytes(f);
    const auto sums = checksums_of(f);
    const checkpoint::DataChecksums layout = sums ? *sums : checkpoint::DataChecksums::placeholder(bytes);
    const auto mine = [&](std::size_t c) {
      return checkpoint::share_owner(before + layout.begin(c), before + layout.end(c, bytes), total, ranks) == rank;
    };
    const auto read = [&](std::byte* dst, std::uint64_t n, std::uint64_t at) { f.read_file_bytes(dst, n, f.data_offset() + at); };
    checkpoint::hash_chunks(layout, bytes, mine, read, [&](std::size_t c, std::uint64_t got) {
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

  std::optional<checkpoint::SafetensorsFile> optim_;  // before model_: open_pair, model_'s initializer, sets it
  checkpoint::SafetensorsFile model_;
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
