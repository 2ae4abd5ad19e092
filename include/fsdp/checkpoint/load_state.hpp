#pragma once
// load_state: puts a saved training state into a ShardedModel (and the engine's
// optimizer) on any number of ranks. Verify first, write after: every tensor this rank
// needs is checked (present, same dtype, same shape) and read into host memory; then the
// ranks agree that all of them succeeded; only then is anything written. A bad checkpoint
// therefore leaves the model and the optimizer untouched on every rank.
#include <cstddef>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

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

struct StagedTensor {
  void* dst;  // where it goes: a shard slice, an optimizer state slice, or a buffer
  std::vector<std::byte> bytes;
};

inline std::string shape_text(const std::vector<std::int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? "," : "") << s[i];
  os << "]";
  return os.str();
}

// Checks the source's entry for `key` against what the model holds and reads elements
// [begin, begin + count) of it; nothing staged when the source lacks it and !strict.
inline bool stage(const StateSource& src, const StateKey& key, DType dtype, const std::vector<std::int64_t>& shape,
                  std::int64_t begin, std::int64_t count, void* dst, bool strict, std::vector<StagedTensor>& staged,
                  LoadReport& report) {
  const auto meta = src.find(key);
  if (!meta) {
    if (strict) fail(src.name(), ": ", key.describe(), " is missing (the model has it, ", name_of(dtype), " ", shape_text(shape), ")");
    report.missing.push_back(key.describe());
    return false;
  }
  if (meta->dtype != dtype || meta->shape != shape)
    fail(src.name(), ": ", key.describe(), " is ", name_of(meta->dtype), " ", shape_text(meta->shape), " but the model has ",
         name_of(dtype), " ", shape_text(shape));
  StagedTensor t{dst, std::vector<std::byte>(static_cast<std::size_t>(count) * size_of(dtype))};
  if (count) src.read(key, begin, count, t.bytes.data());
  staged.push_back(std::move(t));
  return true;
}

}  // namespace detail

// A collective: every rank calls it with a source that describes the same state.
inline LoadReport load_state(ShardedModel& model, const StateSource& src, OptimizerState* optimizer = nullptr,
                             LoadOptions options = {}) {
  LoadReport report;
  if (model.size() == 0) return report;
  std::vector<detail::StagedTensor> params, optim;
  std::vector<std::vector<detail::StagedTensor>> buffers(model.size());  // per unit
  std::set<std::pair<std::string, std::string>> known;  // (state or "", fqn) the model has
  std::string error;
  try {
    const auto names = optimizer ? optimizer->state_names() : std::vector<std::string>{};
    detail::for_each_param(model, [&](UnitBase& u, const ParamView& p, std::size_t shard) {
      (void)u;
      const auto shape = detail::shape_of(p.shape);
      known.insert({"", std::string(p.fqn)});
      detail::stage(src, {StateKind::param, "", std::string(p.fqn)}, p.dtype, shape, p.param_begin, p.count, p.param,
                    options.strict, params, report);
      for (const auto& name : names) {
        known.insert({name, std::string(p.fqn)});
        const DType t = optimizer->state_dtype(name);
        auto* base = static_cast<std::byte*>(optimizer->state(name, shard, model.shards()[shard].numel));
        detail::stage(src, {StateKind::optim, name, std::string(p.fqn)}, t, shape, p.param_begin, p.count,
                      base + p.shard_offset * size_of(t), options.strict, optim, report);
      }
    });
    for (std::size_t k = 0; k < model.size(); ++k) {
      UnitBase& u = model[k];
      for (std::size_t i = 0; i < u.buffers().size(); ++i) {
        const auto& b = u.buffers()[i];
        known.insert({"", std::string(b.fqn)});
        detail::stage(src, {StateKind::buffer, "", std::string(b.fqn)}, b.dtype, detail::shape_of(b.shape), 0, b.numel,
                      reinterpret_cast<void*>(i), options.strict, buffers[k], report);  // dst resolved while summoned
      }
    }
    std::vector<std::string> extra;
    for (const auto& key : src.keys()) {
      const std::string state = key.kind == StateKind::optim ? key.state : "";
      if (key.kind == StateKind::optim && !optimizer) continue;  // a model-only load ignores optimizer state
      if (!known.count({state, key.fqn})) extra.push_back(key.describe());
    }
    if (!extra.empty() && options.strict) {
      std::ostringstream os;
      for (std::size_t i = 0; i < extra.size() && i < 8; ++i) os << (i ? ", " : "") << extra[i];
      if (extra.size() > 8) os << " and " << extra.size() - 8 << " more";
      detail::fail(src.name(), ": holds ", extra.size(), " tensors the model does not have: ", os.str());
    }
    report.unexpected = std::move(extra);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Nothing has been written yet: a rank that failed stops every rank here.
  if (!model[0].all_ranks_agree(error.empty())) {
    if (!error.empty()) detail::fail("load_state on rank ", model[0].rank(), ": ", error, "; nothing was loaded");
    detail::fail("load_state on rank ", model[0].rank(), ": another rank could not use ", src.name(),
                 " (its error says why); nothing was loaded");
  }
  // Buffers first, through a summon that writes back (it also writes the gathered, still
  // unchanged parameters back into the shards, which the parameter copies then replace).
  for (std::size_t k = 0; k < model.size(); ++k) {
    if (buffers[k].empty()) continue;
    UnitBase& u = model[k];
    auto summoned = u.summon_full_params(true);
    for (auto& b : buffers[k]) u.copy_bytes(u.buffer_data(reinterpret_cast<std::size_t>(b.dst)), b.bytes.data(), b.bytes.size());
  }
  for (auto& t : params) model[0].copy_bytes(t.dst, t.bytes.data(), t.bytes.size());
  for (auto& t : optim) model[0].copy_bytes(t.dst, t.bytes.data(), t.bytes.size());
  if (optimizer) {
    const auto scalars = src.optim_scalars();
    if (!scalars.empty()) optimizer->load_scalars(scalars);
  }
  return report;
}

}  // namespace fsdp
