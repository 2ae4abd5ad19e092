#pragma once
// State dicts of a ShardedModel (and of the engine's optimizer), keyed by clean FQNs — the
// parameters' own names, no unit prefixes — and always in master dtypes, whatever the
// mixed precision or offload:
//  - full:    every parameter and buffer whole, gathered one flat parameter at a time
//             (as a full save does), in host memory, on every rank or rank 0 only;
//  - sharded: this rank's slice of each parameter (a 1-D element range of the flattened
//             tensor) and of each optimizer state, no collective; buffers on one rank;
//  - local:   the raw flat shards with their layout (ShardView and ParamView).
// Loading is in fsdp/checkpoint/load_state.hpp.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fsdp/checkpoint/host_arena.hpp"
#include "fsdp/checkpoint/optimizer_state.hpp"
#include "fsdp/checkpoint/state_key.hpp"
#include "fsdp/model/sharded_model.hpp"

namespace fsdp {

// A tensor in host memory.
struct StateTensor {
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
  std::int64_t numel() const { return checked_numel(shape, {}); }
};

struct FullStateDict {
  std::map<std::string, StateTensor> tensors;                        // parameters and buffers by FQN
  std::map<std::string, std::map<std::string, StateTensor>> optim;   // state name -> FQN -> tensor
  std::map<std::string, std::string> optim_scalars;                  // e.g. "step"
};

// Elements [begin, begin + count) of the flattened tensor `id` (of global `shape`).
struct StateSlice {
  StateKey id;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, count = 0;
  std::vector<std::byte> data;
};

struct ShardedStateDict {
  int rank = 0, world = 1;
  std::vector<StateSlice> slices;
  std::map<std::string, std::string> optim_scalars;
};

namespace detail {

inline std::vector<std::byte> to_host(const Unit& u, const void* src, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  fsdp::detail::internals(u).copy_bytes(out.data(), src, bytes);
  return out;
}

inline std::vector<std::int64_t> shape_of(std::span<const std::int64_t> s) { return {s.begin(), s.end()}; }

// Calls f(unit, view, model-level shard index) for every parameter of the model.
template <class F>
void for_each_param(ShardedModel& model, F&& f) {
  std::size_t k = 0;
  for (auto& u : model)
    for (std::size_t i = 0; i < u->parameters().size(); ++i, ++k) {
      const ParamView& p = model.parameters()[k];
      f(*u, p, p.model_shard);
    }
}

// Where one slice of a sharded state dict lives: `src` in `unit`'s memory (shard space).
struct SliceSource {
  StateKey id;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, count = 0;
  const Unit* unit = nullptr;
  const void* src = nullptr;
  std::size_t bytes() const { return static_cast<std::size_t>(count) * size_of(dtype); }
  StateSlice copy_to_host() const { return {id, dtype, shape, begin, count, to_host(*unit, src, bytes())}; }
};

// The slices sharded_state_dict copies, without copying them (a sharded save writes
// straight from them). No collective.
inline std::vector<SliceSource> sharded_slice_sources(ShardedModel& model, OptimizerState* optimizer) {
  std::vector<SliceSource> out;
  if (model.size() == 0) return out;
  const auto names = optimizer ? optimizer->state_names() : std::vector<std::string>{};
  for_each_param(model, [&](Unit& u, const ParamView& p, std::size_t shard) {
    if (!fsdp::detail::internals(u).saves_shards()) return;
    out.push_back({StateKey::param(std::string(p.fqn)), p.dtype, shape_of(p.shape), p.param_begin, p.count, &u, p.param});
    for (const auto& name : names) {
      const DType t = optimizer->state_dtype(name);
      const auto* base = static_cast<const std::byte*>(optimizer->state(name, shard, model.shards()[shard].numel));
      out.push_back({StateKey::optim(std::string(p.fqn), name), t, shape_of(p.shape), p.param_begin, p.count, &u,
                     base + p.shard_offset * size_of(t)});
    }
  });
  if (fsdp::detail::internals(model[0]).rank() == 0)
    for (auto& u : model)
      for (std::size_t i = 0; i < u->buffers().size(); ++i) {
        const auto& b = u->buffers()[i];
        out.push_back({StateKey::buffer(std::string(b.fqn)), b.dtype, shape_of(b.shape), 0, b.numel, u.get(), fsdp::detail::internals(*u).buffer_data(i)});
      }
  return out;
}

}  // namespace detail

// This rank's slices. Where this rank's shards are the saved copy (Unit::saves_shards):
// a slice of every parameter and of its optimizer states, with count 0 where this rank
// holds none of it, so every tensor is known, empty ones included. Buffers on world rank 0.
// No collective.
inline ShardedStateDict sharded_state_dict(ShardedModel& model, OptimizerState* optimizer = nullptr) {
  ShardedStateDict out;
  if (model.size() == 0) return out;
  out.rank = fsdp::detail::internals(model[0]).rank();
  for (auto& s : detail::sharded_slice_sources(model, optimizer))
    out.slices.push_back(s.copy_to_host());
  if (optimizer) out.optim_scalars = optimizer->scalars();
  return out;
}

namespace detail {

// One all-gather of a full state: flat parameter `shard` of `unit` — the parameters
// themselves (`state` empty) or an optimizer state laid out like them — whose parameters
// lie back to back in it, in visit order.
struct FullGather {
  Unit* unit = nullptr;
  std::size_t shard = 0, model_shard = 0;
  std::string state;  // "" for the parameters
  DType dtype = DType::f32;
  std::vector<std::size_t> params;  // indices into unit->parameters(), in the flat parameter's order
  std::size_t bytes = 0;            // of the unpadded flat parameter
};

// Every rank's same sequence of gathers: the optimizer states' (unit, state, flat
// parameter), then the parameters' (unit, flat parameter).
inline std::vector<FullGather> full_gathers(ShardedModel& model, OptimizerState* optimizer) {
  for (auto& u : model)  // gathers between a unit's hooks would pair with its own collectives
    if (u->state() != TrainingState::IDLE)
      fail("unit '", fsdp::detail::display_name(u->fqn()), "' on rank ", fsdp::detail::internals(*u).rank(), ": a full state dict or full ",
           "checkpoint needs every unit IDLE, but it is ", name_of(u->state()));
  std::vector<FullGather> out;
  const auto names = optimizer ? optimizer->state_names() : std::vector<std::string>{};
  for (const bool of_params : {false, true}) {
    std::size_t first_shard = 0;
    for (auto& u : model) {
      for (const auto& name : of_params ? std::vector<std::string>{""} : names)
        for (std::size_t k = 0; k < u->shards().size(); ++k) {
          FullGather g{u.get(), k, first_shard + k, name, of_params ? u->shards()[k].dtype : optimizer->state_dtype(name), {}, 0};
          for (std::size_t i = 0; i < u->parameters().size(); ++i)
            if (u->parameters()[i].shard == k) {
              g.params.push_back(i);
              g.bytes += static_cast<std::size_t>(u->parameters()[i].numel) * size_of(g.dtype);
            }
          out.push_back(std::move(g));
        }
      first_shard += u->shards().size();
    }
  }
  return out;
}

// The bytes of the largest gather: the host buffer that holds any of them.
inline std::size_t largest_gather(const std::vector<FullGather>& gathers) {
  std::size_t n = 0;
  for (const FullGather& g : gathers) n = std::max(n, g.bytes);
  return n;
}

// Runs gather g (a collective over the unit's shard group) into host memory of g.bytes.
inline void gather(const FullGather& g, OptimizerState* optimizer, void* full_host) {
  const ShardView& view = g.unit->shards()[g.shard];
  const void* mine = g.state.empty() ? view.param : optimizer->state(g.state, g.model_shard, view.numel);
  fsdp::detail::internals(*g.unit).gather_like_shard(g.shard, mine, full_host, g.dtype);
}

}  // namespace detail

struct FullStateDictOptions {
  bool rank0_only = false;  // other ranks take part in the gathers but return an empty dict
};

// Every parameter and buffer whole, in master dtypes, through the gathers a full save runs
// (detail::full_gathers): one flat parameter at a time into a reused host buffer, so device
// memory grows by one flat parameter at most. With an optimizer, its states gathered the
// same way. A collective: every rank calls it.
inline FullStateDict full_state_dict(ShardedModel& model, OptimizerState* optimizer = nullptr,
                                     FullStateDictOptions options = {}) {
  FullStateDict out;
  if (model.size() == 0) return out;
  const bool keep = !options.rank0_only || fsdp::detail::internals(model[0]).rank() == 0;
  const auto gathers = detail::full_gathers(model, optimizer);
  const checkpoint::HostArena flat(detail::largest_gather(gathers));  // reused, never zero-filled: each gather fills it
  for (const auto& g : gathers) {
    detail::gather(g, optimizer, flat.data());
    if (!keep) continue;
    auto& into = g.state.empty() ? out.tensors : out.optim[g.state];
    std::size_t offset = 0;  // parameters lie back to back in visit order
    for (const std::size_t i : g.params) {
      const auto& p = g.unit->parameters()[i];
      const std::size_t n = static_cast<std::size_t>(p.numel) * size_of(g.dtype);
      into[std::string(p.fqn)] = {g.dtype, detail::shape_of(p.shape), {flat.data() + offset, flat.data() + offset + n}};
      offset += n;
    }
  }
  if (!keep) return out;
  for (auto& u : model)
    for (std::size_t i = 0; i < u->buffers().size(); ++i) {
      const auto& b = u->buffers()[i];
      out.tensors[std::string(b.fqn)] = {b.dtype, detail::shape_of(b.shape),
                                         detail::to_host(*u, fsdp::detail::internals(*u).buffer_data(i), static_cast<std::size_t>(b.numel) * size_of(b.dtype))};
    }
  if (optimizer) out.optim_scalars = optimizer->scalars();
  return out;
}

}  // namespace fsdp
