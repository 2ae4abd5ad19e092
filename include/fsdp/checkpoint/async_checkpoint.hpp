#pragma once
// Asynchronous checkpoint saves (what PyTorch DCP's async_save gives): the state is
// snapshotted into host memory while the caller waits (for a full checkpoint that includes
// the gathers), then a background thread writes the files while training goes on. The
// commit — every rank agreeing that its file is written, rank 0 publishing the directory —
// is a collective, so it runs on the training thread: in wait(), which the next save calls
// first and the end of training calls explicitly, or in try_commit(), which commits as soon
// as every rank's files are written and otherwise returns at once.
//
//   fsdp::AsyncCheckpointer ckpt(sharded, &adamw_state);
//   for (step...) {
//     train_step();
//     ckpt.try_commit();  // a collective: the save in flight is committed once written
//     if (step % k == 0) ckpt.save_sharded(dir / ("step-" + std::to_string(step)), {{"step", ...}});
//   }
//   ckpt.wait();  // the last save is committed here (a collective)
//
// A sharded save that is never waited for is not committed: every rank removes what it
// wrote, rank 0 the staging directory, and the previous checkpoint at that path stays as it
// was. A full save's files (model, optimizer) are staged by rank 0 and published together
// in wait(), like a sharded save's directory; one never waited for is removed, and the
// previous pair stays as it was (docs/checkpoints.md, "How a full checkpoint is committed").
// last_report() says what a commit found left over by earlier saves. The snapshot costs host memory the size of what this rank writes, until wait().
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>

#include "fsdp/checkpoint/full_checkpoint.hpp"
#include "fsdp/checkpoint/sharded_checkpoint.hpp"

namespace fsdp {

// This rank's figures for the last save, for benchmarks and logs.
struct AsyncSaveTiming {
  double snapshot_s = 0;  // in save_*(): agreeing, gathering, copying into host memory
  double write_s = 0;     // on the background thread: writing and syncing the files
  double blocked_s = 0;   // in wait(): waiting for the background write to finish
  double commit_s = 0;    // in wait(): agreeing and publishing
  std::uint64_t bytes = 0;  // snapshot bytes this rank wrote (rank 0 only for a full save)
  // The part of the write that training hid: 1 when wait() never had to wait.
  double hidden_fraction() const { return write_s > 0 ? 1.0 - std::min(blocked_s, write_s) / write_s : 1.0; }
};

class AsyncCheckpointer {
 public:
  // `model` and `optimizer` must outlive the checkpointer.
  explicit AsyncCheckpointer(ShardedModel& model, OptimizerState* optimizer = nullptr)
      : model_(model), optimizer_(optimizer) {}
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;
  // Joins the writer; a save not waited for is discarded (see the top of this file).
  ~AsyncCheckpointer() {
    join();
    if (auto* s = std::get_if<std::shared_ptr<detail::ShardedSave>>(&save_)) (*s)->discard();
  }

  // Collectives: every rank calls them. Waits for the save in flight first, then snapshots
  // and returns while the files are written.
  void save_sharded(const std::filesystem::path& dir, std::map<std::string, std::string> metadata = {}) {
    start<detail::ShardedSave>(dir, std::move(metadata));
  }
  void save_full(const std::filesystem::path& file, std::map<std::string, std::string> metadata = {}) {
    start<detail::FullSave>(file, std::move(metadata));
  }

  // A collective: waits for this rank's write, then every rank agrees and the checkpoint
  // is published; a rank whose write failed makes every rank fail. No-op with no save in flight.
  void wait() {
    if (std::holds_alternative<std::monostate>(save_)) return;
    const auto t0 = Clock::now();
    join();
    const auto t1 = Clock::now();
    timing_.blocked_s = seconds(t1 - t0);
    auto pending = std::exchange(save_, std::monostate{});
    report_ = {};
    std::visit([&](auto& s) {
      if constexpr (!std::is_same_v<std::decay_t<decltype(s)>, std::monostate>) s->commit(model_, write_failed_);
    }, pending);
    if (auto* s = std::get_if<std::shared_ptr<detail::ShardedSave>>(&pending)) report_ = (*s)->report();
    else if (auto* f = std::get_if<std::shared_ptr<detail::FullSave>>(&pending)) report_.recovered = (*f)->recovered();
    timing_.commit_s = seconds(Clock::now() - t1);
  }

  // A collective, for a training loop to call at every step while a save is pending: the
  // ranks agree (one small all-reduce) whether every rank has finished writing, and if so
  // commit as wait() does and return true; else nothing changes and it returns false (no
  // rank waits for a write). Committing as soon as the files are written, instead of at the
  // next save, keeps the last committed checkpoint one save interval old, not two: what a
  // job restarted after a failure resumes from. With no save pending: false, no collective
  // (every rank has the same saves pending).
  bool try_commit() {
    if (!pending()) return false;
    const bool written = !writing();
    if (model_.size() > 0 && !fsdp::detail::internals(model_[0]).all_ranks_agree(written)) return false;
    if (model_.size() == 0 && !written) return false;
    wait();
    return true;
  }

  // Whether a save awaits wait(), and whether this rank is still writing it (no collective).
  bool pending() const { return !std::holds_alternative<std::monostate>(save_); }
  bool writing() const { return pending() && !written_->load(); }

  const AsyncSaveTiming& last_timing() const { return timing_; }
  // What the last committed sharded save found of interrupted saves at its path (rank 0's;
  // see SaveReport).
  const SaveReport& last_report() const { return report_; }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  template <class Save>
  void start(const std::filesystem::path& path, std::map<std::string, std::string> metadata) {
    wait();
    timing_ = {};
    const auto t0 = Clock::now();
    auto save = std::make_shared<Save>(path, model_, optimizer_, std::move(metadata));
    timing_.snapshot_s = seconds(Clock::now() - t0);
    timing_.bytes = save->bytes();
    write_failed_ = nullptr;
    written_ = std::make_shared<std::atomic<bool>>(false);
    auto work = [save, written = written_, failed = &write_failed_, write_s = &timing_.write_s] {
      const auto w0 = Clock::now();
      *failed = detail::captured([&] { save->write(); });
      *write_s = seconds(Clock::now() - w0);
      written->store(true);
    };
    try {
      writer_ = std::thread(work);
    } catch (const std::system_error&) {
      work();  // no thread to be had: write now, still correct, just not hidden
    }
    save_ = std::move(save);
  }

  void join() noexcept {
    if (writer_.joinable()) writer_.join();
  }

  ShardedModel& model_;
  OptimizerState* optimizer_;
  // The save in flight; the writer thread shares it (and writes only its own fields).
  std::variant<std::monostate, std::shared_ptr<detail::ShardedSave>, std::shared_ptr<detail::FullSave>> save_;
  std::thread writer_;
  std::exception_ptr write_failed_;  // set by the writer before `written_`; read after join
  std::shared_ptr<std::atomic<bool>> written_ = std::make_shared<std::atomic<bool>>(true);
  AsyncSaveTiming timing_;
  SaveReport report_;
};

}  // namespace fsdp
