#pragma once
// What a sharded unit shows of its storage, without a cast to its concrete type: its flat
// shards (what an optimizer steps on), each parameter's place in them (per-parameter rules,
// state dicts, checkpoints), its buffers, and the storage it found its parameters in.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"

namespace fsdp {

// One flat shard of a unit as the optimizer sees it: this rank's slice of the unit's
// parameters of one dtype and the matching slice of the reduced gradient. numel counts up
// to this rank's last real parameter element; the padding after it is left out. Under
// ShardOptions::shard_layout block_aligned or param_atomic the gaps between parameters lie inside numel:
// they hold zeros and their gradients are zeros, so an optimizer that maps a zero
// parameter with a zero gradient to zero (SGD, momentum, Adam, AdamW) keeps them so; one
// that does not steps on ParamViews instead. The gradient has the parameters' dtype unless
// MixedPrecision keeps low-precision gradients.
struct ShardView {
  std::string_view unit;  // FQN of the unit ("" for the root)
  DType dtype = DType::f32;
  void* param = nullptr;
  void* grad = nullptr;
  std::int64_t numel = 0;
  DType grad_dtype = DType::f32;
  std::int64_t padded_numel = 0;  // the shard's size with padding (every rank's shard has it)
  MemorySpace space = MemorySpace::device;  // host when OffloadParams put the shard there
};

// One parameter as this rank holds it: the elements [param_begin, param_begin + count) of
// the flattened parameter, which sit at shard_offset in shards()[shard] of its unit. A
// shard may cut through a parameter, so count may be anything from 0 to numel. What an
// optimizer needs for per-parameter rules (weight-decay masks) and what state dicts and
// checkpoints are made of; no cast to a concrete unit type is needed.
struct ParamView {
  std::string_view unit;  // FQN of the unit ("" for the root)
  std::string_view fqn;   // the parameter's FQN in the model
  std::span<const std::int64_t> shape;
  DType dtype = DType::f32;  // the master dtype: what shards and checkpoints hold
  std::int64_t numel = 0;    // of the whole parameter
  std::size_t shard = 0;     // index into the unit's shards()
  std::size_t model_shard = 0;  // index into ShardedModel::shards() (the unit's own: = shard)
  std::int64_t param_begin = 0, count = 0, shard_offset = 0;
  void* param = nullptr;  // this rank's elements (nullptr when count == 0)
  void* grad = nullptr;   // the matching elements of the sharded gradient, in grad_dtype
  DType grad_dtype = DType::f32;
  MemorySpace space = MemorySpace::device;
  // Its other FQNs when tied (one tensor under several names, stored once): state dicts
  // save it under `fqn` and loads accept any of them.
  std::span<const std::string> aliases;
};

// A parameter's storage as its unit found it at setup (the tensor's data pointer, or the
// tensor object when it holds no elements), with the FQN it was found under: how the
// root finds one tensor in two units.
struct ParamStorage {
  const void* key = nullptr;
  std::string fqn;
};

// A buffer (non-trainable tensor: running statistics, masks) of a unit.
struct BufferView {
  std::string_view unit, fqn;
  std::span<const std::int64_t> shape;
  DType dtype = DType::f32;  // its own dtype (MixedPrecision may show it cast to the engine)
  std::int64_t numel = 0;
};

}  // namespace fsdp
