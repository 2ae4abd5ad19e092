#pragma once
// load_state: puts a saved training state into a ShardedModel (and the engine's
// optimizer) on any number of ranks. Verify first, write after: every tensor this rank
// needs is checked (present, same dtype, same shape), checksums are verified (or, staged,
// everything is read into host memory); then the ranks agree that all of them succeeded;
// only then is anything written. A bad checkpoint therefore leaves the model and the
// optimizer untouched on every rank.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/host_arena.hpp"
#include "fsdp/checkpoint/save_id.hpp"
#include "fsdp/checkpoint/state_key.hpp"
#include "fsdp/checkpoint/state_source.hpp"

namespace fsdp {

struct LoadOptions {
  // false: tensors missing from the source keep their values, tensors the model does not
  // have are ignored; both are listed in the report instead of being errors.
  bool strict = true;
  // Checkpoint files on a host device are checked first (keys, shapes, dtypes, sizes and,
  // for sharded checkpoints, every file's checksum), then read straight into the model:
  // after the checks only an I/O error can fail a read, and it is reported on every rank
  // as a partial load. true: every range is read into host memory before anything is
  // written, so even an I/O error leaves the model untouched (costs this rank's share of
  // the state in host memory, and a copy). Sources in memory, and devices whose memory the
  // host cannot address, are always staged.
  bool stage_in_host_memory = false;
};

struct LoadReport {
  std::vector<std::string> missing;     // in the model, not in the source (strict = false)
  std::vector<std::string> unexpected;  // in the source, not in the model (strict = false)
};

namespace detail {

// Where one staged range goes: `offset` into the staging arena, then to `dst` (a parameter
// or optimizer slice), or to buffer `buffer` of unit `unit` (through Unit::load_buffer,
// which also updates a MixedPrecision cast copy).
struct StagedCopy {
  std::size_t offset, bytes;
  void* dst = nullptr;
  std::size_t unit = 0, buffer = 0;
};

// Checks the source's entry for `key` against what the model holds; false when the source
// lacks it and !strict (it is then reported missing, not read).
inline bool check_entry(const StateSource& src, const StateKey& key, DType dtype, const std::vector<std::int64_t>& shape,
                        bool strict, LoadReport& report) {
  const auto meta = src.find(key);
  if (!meta) {
    if (strict) fail(src.name(), ": ", key.describe(), " is missing (the model has it, ", name_of(dtype), " ", format_shape(shape), ")");
    report.missing.push_back(key.describe());
    return false;
  }
  if (meta->dtype != dtype || meta->shape != shape)
    fail(src.name(), ": ", key.describe(), " is ", name_of(meta->dtype), " ", format_shape(meta->shape), " but the model has ",
         name_of(dtype), " ", format_shape(shape));
  return true;
}

}  // namespace detail

// A collective: every rank calls it with a source that describes the same state.
inline LoadReport load_state(ShardedModel& model, const StateSource& src, OptimizerState* optimizer = nullptr,
                             LoadOptions options = {}) {
  LoadReport report;
  if (model.size() == 0) return report;
  const int rank = fsdp::detail::internals(model[0]).rank(), ranks = fsdp::detail::internals(model[0]).world_size();
  // Parameters kept unsharded (after a forward-only pass, or between micro-batches under
  // reshard_after_backward off) would show the old values: freed first (IDLE units only).
  model.reshard();
  // In place: parameters and optimizer state are read straight into the model after the
  // agreement (host memory only; buffers always go through load_buffer). Staged: every
  // range is read into one arena first (not zero-filled: the reads fill it), in one
  // read_all so a source can read each file in one pass. The ranks agree on the way: a rank
  // reading in place runs one agreement more than a staging one, which would pair it with
  // another rank's next collective.
  const bool in_place = fsdp::detail::internals(model[0]).all_ranks_agree(src.reads_in_place() && !options.stage_in_host_memory &&
                                                 fsdp::detail::internals(model[0]).device_id().kind == DeviceKind::cpu);
  std::vector<ReadRequest> requests, staged_requests;
  std::vector<detail::StagedCopy> params_and_optim, buffers;
  checkpoint::HostArena arena;
  std::size_t total = 0;
  auto want = [&](const StateKey& key, DType dtype, const std::vector<std::int64_t>& shape, std::int64_t begin,
                  std::int64_t count, std::vector<detail::StagedCopy>& into, detail::StagedCopy copy) {
    if (!detail::check_entry(src, key, dtype, shape, options.strict, report)) return;
    copy.offset = total, copy.bytes = static_cast<std::size_t>(count) * size_of(dtype);
    const bool staged = !in_place || !copy.dst;
    (staged ? staged_requests : requests).push_back({key, begin, count, staged ? nullptr : copy.dst});
    if (!staged) return;
    into.push_back(copy);
    total += (copy.bytes + 63) / 64 * 64;  // each range cache-line aligned
  };
  auto check = [&] {
    std::set<StateKey> known;  // what the model has (a buffer as a param: sources may not tell them apart)
    const auto names = optimizer ? optimizer->state_names() : std::vector<std::string>{};
    detail::for_each_param(model, [&](Unit&, const ParamView& p, std::size_t shard) {
      const auto shape = detail::shape_of(p.shape);
      // A tied parameter is read under its own FQN, or under another of its names when
      // the source has only that one (an unsharded model's state dict has them all).
      auto saved_as = [&](auto key_of) {
        for (const auto& alias : p.aliases) known.insert(key_of(alias));
        const StateKey own = key_of(std::string(p.fqn));
        known.insert(own);
        if (!src.find(own))
          for (const auto& alias : p.aliases)
            if (src.find(key_of(alias))) return key_of(alias);
        return own;
      };
      want(saved_as([](const std::string& f) { return StateKey::param(f); }), p.dtype, shape, p.param_begin, p.count,
           params_and_optim, {0, 0, p.param});
      for (const auto& name : names) {
        const DType t = optimizer->state_dtype(name);
        auto* base = static_cast<std::byte*>(optimizer->state(name, shard, model.shards()[shard].numel));
        want(saved_as([&](const std::string& f) { return StateKey::optim(f, name); }), t, shape, p.param_begin, p.count,
             params_and_optim, {0, 0, base + p.shard_offset * size_of(t)});
      }
    });
    for (std::size_t k = 0; k < model.size(); ++k) {
      Unit& u = model[k];
      for (std::size_t i = 0; i < u.buffers().size(); ++i) {
        const auto& b = u.buffers()[i];
        known.insert(StateKey::param(std::string(b.fqn)));
        want(StateKey::buffer(std::string(b.fqn)), b.dtype, detail::shape_of(b.shape), 0, b.numel, buffers,
             {0, 0, nullptr, k, i});
      }
    }
    std::vector<std::string> extra;
    for (const auto& key : src.keys()) {
      if (key.kind == StateKind::optim && !optimizer) continue;  // a model-only load ignores optimizer state
      const StateKey as_known = key.kind == StateKind::buffer ? StateKey::param(key.fqn) : key;
      if (!known.count(as_known)) extra.push_back(key.describe());
    }
    if (!extra.empty() && options.strict) {
      std::ostringstream os;
      for (std::size_t i = 0; i < extra.size() && i < 8; ++i) os << (i ? ", " : "") << extra[i];
      if (extra.size() > 8) os << " and " << extra.size() - 8 << " more";
      detail::fail(src.name(), ": holds ", extra.size(), " tensors the model does not have: ", os.str());
    }
    report.unexpected = std::move(extra);
    arena = checkpoint::HostArena(total);
    std::size_t i = 0;
    for (const auto* list : {&params_and_optim, &buffers})
      for (const auto& c : *list) staged_requests[i++].dst = arena.data() + c.offset;
  };
  // Nothing is written before every rank has checked (and, staged, read) everything: a
  // rank that fails stops every rank in the agreement, and a damaged file found by any rank
  // is named on all.
  const std::exception_ptr checked = detail::captured([&] {
    check();
    if (optimizer) optimizer->check_scalars(src.optim_scalars());
    if (in_place) src.verify(rank, ranks);
    src.read_all(staged_requests, rank, ranks);  // in place: only the buffers
  });
  const std::string damage = src.agree_damage([&](bool ok) { return fsdp::detail::internals(model[0]).all_ranks_agree(ok); });
  detail::run_agreed(model, "load_state from " + src.name(), [&] {
    if (checked) std::rethrow_exception(checked);
    if (!damage.empty()) detail::fail_as(ErrorKind::corrupt, damage);
  }, "; nothing was loaded");
  if (in_place)  // verified and agreed: only an I/O error can fail now, and every rank hears of it
    detail::run_agreed(model, "load_state from " + src.name(), [&] { src.read_all(requests, rank, ranks); },
                       "; the source had been checked, but reading it failed: the model and optimizer state are "
                       "partially loaded (load again, or use LoadOptions::stage_in_host_memory)");
  for (const auto& b : buffers) fsdp::detail::internals(model[b.unit]).load_buffer(b.buffer, arena.data() + b.offset);
  for (const auto& c : params_and_optim)
    if (c.bytes) fsdp::detail::internals(model[0]).copy_bytes(c.dst, arena.data() + c.offset, c.bytes);
  if (optimizer) {
    const auto scalars = src.optim_scalars();
    if (!scalars.empty()) optimizer->load_scalars(scalars);
  }
  return report;
}

namespace detail {

// The load of a checkpoint on disk, whatever its layout: every rank opens Source(path),
// the ranks agree that all could and that all opened the same save, then load_state
// verifies every tensor before writing.
//
// Why the save ids are compared: each rank opens the checkpoint on its own, so a commit
// landing between rank 0's open and rank 1's gives them two saves (step N on one, N + 1 on
// the other), each whole: no check of one rank's files finds that. The ranks agree on the
// largest and the smallest id (two maxima, the second of ~id); where they differ every rank
// opens again (the commit has landed by then), a few times, then every rank fails alike.
template <class Source>
LoadReport open_and_load(const std::string& what, const std::filesystem::path& path, ShardedModel& model,
                         OptimizerState* optimizer, LoadOptions options) {
  std::optional<Source> source;
  const std::string where = what + " '" + path.string() + "'";
  constexpr int attempts = 3;
  for (int attempt = 1;; ++attempt) {
    source.reset();
    run_agreed(model, where, [&] { source.emplace(path); });
    if (model.size() == 0) break;  // load_state loads nothing
    const auto& in = fsdp::detail::internals(model[0]);
    const auto id = static_cast<std::int64_t>(source->save_id());  // any 64 bits: ~ reverses the order
    const std::int64_t most = in.max_over_ranks(id), least = ~in.max_over_ranks(~id);
    if (most == least) break;
    if (attempt == attempts)
      fail_as(ErrorKind::mismatch, where, ": the ranks opened different saves (save id ",
              checkpoint::format_save_id(static_cast<std::uint64_t>(least)), " and ",
              checkpoint::format_save_id(static_cast<std::uint64_t>(most)), ", still after ", attempts,
              " opens): saves keep committing into it, or the ranks were given different paths; nothing was loaded");
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * attempt));
  }
  return load_state(model, *source, optimizer, options);
}

}  // namespace detail

}  // namespace fsdp
