#pragma once
// load_state: puts a saved training state into a ShardedModel (and the engine's
// optimizer) on any number of ranks. Verify first, write after: every tensor this rank
// needs is checked (present, same dtype, same shape) and read into host memory; then the
// ranks agree that all of them succeeded; only then is anything written. A bad checkpoint
// therefore leaves the model and the optimizer untouched on every rank.
#include <cstddef>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/state_key.hpp"
#include "fsdp/checkpoint/state_source.hpp"

namespace fsdp {

struct LoadOptions {
  // false: tensors missing from the source keep their values, tensors the model does not
  // have are ignored; both are listed in the report instead of being errors.
  bool strict = true;
};

struct LoadReport {
  std::vector<std::string> missing;     // in the model, not in the source (strict = false)
  std::vector<std::string> unexpected;  // in the source, not in the model (strict = false)
};

namespace detail {

// A slice of a parameter or of an optimizer state, and where it goes.
struct StagedTensor {
  void* dst;
  std::vector<std::byte> bytes;
};

// A buffer of a unit: buffer_data(index) exists only while the unit is summoned.
struct StagedBuffer {
  std::size_t index;
  std::vector<std::byte> bytes;
};

// Checks the source's entry for `key` against what the model holds and reads elements
// [begin, begin + count) of it; nothing when the source lacks it and !strict.
inline std::optional<std::vector<std::byte>> stage(const StateSource& src, const StateKey& key, DType dtype,
                                                   const std::vector<std::int64_t>& shape, std::int64_t begin,
                                                   std::int64_t count, bool strict, LoadReport& report) {
  const auto meta = src.find(key);
  if (!meta) {
    if (strict) fail(src.name(), ": ", key.describe(), " is missing (the model has it, ", name_of(dtype), " ", format_shape(shape), ")");
    report.missing.push_back(key.describe());
    return std::nullopt;
  }
  if (meta->dtype != dtype || meta->shape != shape)
    fail(src.name(), ": ", key.describe(), " is ", name_of(meta->dtype), " ", format_shape(meta->shape), " but the model has ",
         name_of(dtype), " ", format_shape(shape));
  std::vector<std::byte> bytes(static_cast<std::size_t>(count) * size_of(dtype));
  if (count) src.read(key, begin, count, bytes.data());
  return bytes;
}

}  // namespace detail

// A collective: every rank calls it with a source that describes the same state.
inline LoadReport load_state(ShardedModel& model, const StateSource& src, OptimizerState* optimizer = nullptr,
                             LoadOptions options = {}) {
  LoadReport report;
  if (model.size() == 0) return report;
  std::vector<detail::StagedTensor> params, optim;
  std::vector<std::vector<detail::StagedBuffer>> buffers(model.size());  // per unit
  // Nothing is written before every rank has staged everything: a rank that fails stops
  // every rank in the agreement.
  detail::run_agreed(model, "load_state from " + src.name(), [&] {
    std::set<StateKey> known;  // what the model has (a buffer as a param: sources may not tell them apart)
    const auto names = optimizer ? optimizer->state_names() : std::vector<std::string>{};
    detail::for_each_param(model, [&](UnitBase&, const ParamView& p, std::size_t shard) {
      const auto shape = detail::shape_of(p.shape);
      const std::string fqn(p.fqn);
      known.insert(StateKey::param(fqn));
      if (auto bytes = detail::stage(src, StateKey::param(fqn), p.dtype, shape, p.param_begin, p.count, options.strict, report))
        params.push_back({p.param, std::move(*bytes)});
      for (const auto& name : names) {
        known.insert(StateKey::optim(fqn, name));
        const DType t = optimizer->state_dtype(name);
        auto* base = static_cast<std::byte*>(optimizer->state(name, shard, model.shards()[shard].numel));
        if (auto bytes = detail::stage(src, StateKey::optim(fqn, name), t, shape, p.param_begin, p.count, options.strict, report))
          optim.push_back({base + p.shard_offset * size_of(t), std::move(*bytes)});
      }
    });
    for (std::size_t k = 0; k < model.size(); ++k) {
      UnitBase& u = model[k];
      for (std::size_t i = 0; i < u.buffers().size(); ++i) {
        const auto& b = u.buffers()[i];
        known.insert(StateKey::param(std::string(b.fqn)));
        if (auto bytes = detail::stage(src, StateKey::buffer(std::string(b.fqn)), b.dtype, detail::shape_of(b.shape), 0,
                                       b.numel, options.strict, report))
          buffers[k].push_back({i, std::move(*bytes)});
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
  }, "; nothing was loaded");
  // Buffers first, through a summon that writes back (it also writes the gathered, still
  // unchanged parameters back into the shards, which the parameter copies then replace).
  for (std::size_t k = 0; k < model.size(); ++k) {
    if (buffers[k].empty()) continue;
    UnitBase& u = model[k];
    auto summoned = u.summon_full_params(true);
    for (auto& b : buffers[k]) u.copy_bytes(u.buffer_data(b.index), b.bytes.data(), b.bytes.size());
  }
  for (auto& t : params) model[0].copy_bytes(t.dst, t.bytes.data(), t.bytes.size());
  for (auto& t : optim) model[0].copy_bytes(t.dst, t.bytes.data(), t.bytes.size());
  if (optimizer) {
    const auto scalars = src.optim_scalars();
    if (!scalars.empty()) optimizer->load_scalars(scalars);
  }
  return report;
}

namespace detail {

// The load of a checkpoint on disk, whatever its layout: every rank opens Source(path),
// the ranks agree that all could, then load_state verifies every tensor before writing.
template <class Source>
LoadReport open_and_load(const std::string& what, const std::filesystem::path& path, ShardedModel& model,
                         OptimizerState* optimizer, LoadOptions options) {
  std::optional<Source> source;
  run_agreed(model, what + " '" + path.string() + "'", [&] { source.emplace(path); });
  return load_state(model, *source, optimizer, options);
}

}  // namespace detail

}  // namespace fsdp
