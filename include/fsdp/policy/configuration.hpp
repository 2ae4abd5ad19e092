#pragma once
// A unit's whole configuration as values: the compile-time policies it was built with and
// the run-time settings it holds now. A built model reports it (Unit::config(),
// ShardedModel::config()), so nothing has to be restated after fsdp::shard: the memory
// planner reads it (fsdp::plan(model)), an engine prints it to see what it runs, and a test
// compares it. The unit's own code reads its policies through the same PolicyConfig, so
// what is reported is what runs.
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fsdp/core/device.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/policy/gradient_sync.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/policy/post_accumulate_grad_hook.hpp"
#include "fsdp/policy/reshard_settings.hpp"

namespace fsdp {

// The precision policies as values (MixedPrecision and CommPrecision).
struct PrecisionConfig {
  bool mixed = false;  // MixedPrecision<Param, Reduce, Buffer>
  DType param = DType::f32, reduce = DType::f32, buffer = DType::f32;
  bool keep_low_precision_grads = false;
  bool comm = false;  // CommPrecision<Gather, Reduce>
  DType comm_gather = DType::f32, comm_reduce = DType::f32;
  // Gather is a block format (Int8Blocks, F8E4M3Blocks, F8E5M2Blocks, MXFP8) or a per-tensor one
  // (F8E4M3Tensor, F8E5M2Tensor): comm_gather is then u8.
  bool comm_quantized = false;
  QuantFormat comm_gather_format = QuantFormat::int8_blocks;
  std::size_t comm_gather_block = 0;

  friend bool operator==(const PrecisionConfig&, const PrecisionConfig&) = default;
};

// The BackwardPrefetch policy as a value: BackwardPre, BackwardPost, NoBackwardPrefetch.
enum class BackwardPrefetchMode : std::uint8_t { none, backward_pre, backward_post };

constexpr std::string_view name_of(BackwardPrefetchMode m) {
  return m == BackwardPrefetchMode::backward_pre    ? "BACKWARD_PRE"
         : m == BackwardPrefetchMode::backward_post ? "BACKWARD_POST"
                                                    : "NONE";
}

// A configuration's compile-time policies as values: all that a unit's code reads of them.
struct PolicyConfig {
  bool shards_parameters = true, reshard_after_forward = true, hybrid = false;  // the strategy's
  BackwardPrefetchMode backward = BackwardPrefetchMode::backward_pre;
  bool forward_prefetch = false, offload = false;
  PrecisionConfig precision;

  friend bool operator==(const PolicyConfig&, const PolicyConfig&) = default;

  // The strategy's PyTorch name (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD,
  // HYBRID_SHARD_ZERO2), as fsdp::with_strategy takes it.
  std::string_view strategy() const {
    if (!shards_parameters) return NoShard::name;
    if (hybrid) return reshard_after_forward ? HybridShard::name : HybridShardZero2::name;
    return reshard_after_forward ? FullShard::name : ShardGradOp::name;
  }
  MemorySpace shard_space() const { return offload ? MemorySpace::host : MemorySpace::device; }
  // Under MixedPrecision buffers are shown in its Buffer dtype; otherwise they stay the engine's.
  std::optional<DType> buffer_cast() const { return precision.mixed ? std::optional<DType>(precision.buffer) : std::nullopt; }
};

namespace detail {
// A block format's all-gather (CommPrecision<Int8Blocks<...>, ...>) quantizes on the
// device, a per-tensor one's also takes amaxes there: checked where the policies meet the
// device (fsdp::shard, fsdp::Sharded).
template <class Config, class D>
constexpr void check_device_quantizes() {
  using CP = typename Config::comm_precision;
  if constexpr (gathers_quantized<CP>()) {
    if constexpr (is_per_tensor(CP::gather_format))
      static_assert(TensorScalingDevice<D>,
                    "fsdp: CommPrecision with a per-tensor format (F8E4M3Tensor, F8E5M2Tensor) needs a device that "
                    "scales per tensor: abs_max(x, n, out), max_over_rows(in, rows, n, out), quantize_tensor(format, "
                    "x, n, q, amax) and dequantize_tensor(format, q, n, amax, y), amaxes in device memory "
                    "(fsdp::TensorScalingDevice; "
                    "fsdp::HostDevice and fsdp::CudaDevice have them), or a block format (F8E4M3Blocks<128>)");
    else
      static_assert(QuantizingDevice<D>,
                    "fsdp: CommPrecision with a block format (Int8Blocks, F8E4M3Blocks, F8E5M2Blocks, MXFP8) needs a "
                    "device that quantizes: quantize(format, x, n, q, scales, block), dequantize(format, q, scales, n, "
                    "x, block) and quantize_nonfinite() (fsdp::QuantizingDevice; fsdp::HostDevice and fsdp::CudaDevice "
                    "have them)");
  }
}
}  // namespace detail

template <class MP, class CP>
PrecisionConfig precision_config() {
  PrecisionConfig p;
  p.mixed = MP::enabled;
  p.keep_low_precision_grads = MP::keep_low_precision_grads;
  if constexpr (MP::enabled) p.param = MP::param, p.reduce = MP::reduce, p.buffer = MP::buffer;
  p.comm = CP::enabled;
  if constexpr (CP::enabled) p.comm_gather = CP::gather, p.comm_reduce = CP::reduce;
  if constexpr (CP::enabled && detail::gathers_quantized<CP>())
    p.comm_quantized = true, p.comm_gather_format = CP::gather_format, p.comm_gather_block = CP::gather_block;
  return p;
}

// The policies of a resolved configuration (Policies<Ps...>) as values. A backward prefetch
// policy other than the library's three prefetches nothing.
template <class Config>
PolicyConfig policy_config() {
  using S = typename Config::strategy;
  using BP = typename Config::backward_prefetch;
  PolicyConfig p;
  p.shards_parameters = S::shards_parameters;
  p.reshard_after_forward = S::reshard_after_forward;
  p.hybrid = S::hybrid;
  p.backward = std::is_same_v<BP, BackwardPre>    ? BackwardPrefetchMode::backward_pre
               : std::is_same_v<BP, BackwardPost> ? BackwardPrefetchMode::backward_post
                                                  : BackwardPrefetchMode::none;
  p.forward_prefetch = Config::forward_prefetch::enabled;
  p.offload = Config::cpu_offload::offload;
  p.precision = precision_config<typename Config::mixed_precision, typename Config::comm_precision>();
  return p;
}

// One unit: its policies, where it runs, and its run-time settings as they are now.
struct UnitConfig {
  std::string fqn;  // "" for the root module
  PolicyConfig policies;
  MeshShape mesh;  // replicate x shard ranks of the groups the unit uses
  // ShardOptions::persistence_threshold, and whether it kept this unit's parameters whole.
  std::int64_t persistence_threshold = 0;
  bool kept_unsharded = false;
  // ShardOptions::local_gradients: what the engine's gradients are over its local batch,
  // and so what no gradient divide factor set (reshard.gradient_divide_factor 0) means.
  LocalGradients local_gradients = LocalGradients::mean;
  // ShardOptions::shard_layout as given: how its flat parameters are cut into shards (a unit
  // whose parameters are replicated, kept_unsharded or under NoShard, is not cut).
  ShardLayout shard_layout = ShardLayout::element_flat();
  ReshardSettings reshard;
  GradientSync sync;
  bool post_accumulate_grad_hook = false;
  GradientAfterHook after_hook = GradientAfterHook::keep;
  // Unit::set_units_to_forward_prefetch / _backward_prefetch's lists, by FQN.
  std::vector<std::string> units_to_forward_prefetch, units_to_backward_prefetch;
  // How it was built: ShardOptions::sync_module_states, and the parameters deferred init gave
  // their storage (fsdp::deferred_init), by FQN. The planner builds its units the same way.
  bool sync_module_states = false;
  std::vector<std::string> deferred_parameters;

  friend bool operator==(const UnitConfig&, const UnitConfig&) = default;
};

// A model: its units' configurations, in unit order, and the root's prefetch limit.
struct ModelConfig {
  std::vector<UnitConfig> units;
  int max_prefetched = 0;

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

namespace detail {
inline void print_precision(std::ostream& os, const PrecisionConfig& p) {
  if (p.mixed) {
    os << "MixedPrecision<" << name_of(p.param) << ", " << name_of(p.reduce) << ", " << name_of(p.buffer) << ">";
    if (p.keep_low_precision_grads) os << " keep_low_precision_grads";
  } else {
    os << "FullPrecision";
  }
  if (!p.comm) return;
  os << " CommPrecision<";
  if (!p.comm_quantized) {
    os << name_of(p.comm_gather);
  } else {
    switch (p.comm_gather_format) {
      case QuantFormat::int8_blocks: os << "Int8Blocks<" << p.comm_gather_block << ">"; break;
      case QuantFormat::f8e4m3_blocks: os << "F8E4M3Blocks<" << p.comm_gather_block << ">"; break;
      case QuantFormat::f8e5m2_blocks: os << "F8E5M2Blocks<" << p.comm_gather_block << ">"; break;
      case QuantFormat::mxfp8: os << "MXFP8"; break;
      case QuantFormat::f8e4m3_tensor: os << "F8E4M3Tensor"; break;
      case QuantFormat::f8e5m2_tensor: os << "F8E5M2Tensor"; break;
    }
  }
  os << ", " << name_of(p.comm_reduce) << ">";
}
}  // namespace detail

// One line: "FULL_SHARD BACKWARD_PRE forward_prefetch=off offload=off FullPrecision".
inline std::string to_string(const PolicyConfig& p) {
  std::ostringstream os;
  os << p.strategy() << " " << name_of(p.backward) << " forward_prefetch=" << (p.forward_prefetch ? "on" : "off")
     << " offload=" << (p.offload ? "on" : "off") << " ";
  detail::print_precision(os, p.precision);
  return os.str();
}

// One line: the unit's name, policies, mesh and settings.
inline std::string to_string(const UnitConfig& u) {
  std::ostringstream os;
  os << "'" << detail::display_name(u.fqn) << "': " << to_string(u.policies) << " mesh=" << u.mesh.str();
  if (u.kept_unsharded) os << " kept_unsharded(threshold=" << u.persistence_threshold << ")";
  if (u.shard_layout != ShardLayout::element_flat()) os << " shard_layout=" << name_of(u.shard_layout);
  os << " local_gradients=" << name_of(u.local_gradients) << " reshard_after_forward=";
  if (!u.reshard.after_forward) os << "off";
  else if (u.reshard.post_forward_ranks > 0) os << u.reshard.post_forward_ranks << "-rank groups";
  else os << "on";
  // What a synchronized reduction divides by: the factor set, else what local_gradients gives.
  os << " reshard_after_backward=" << (u.reshard.after_backward ? "on" : "off") << " gradient_divide_factor=";
  if (const double f = divide_factor(u.reshard, u.local_gradients); f == 0) os << "world";
  else os << f;
  // The setters' names (set_requires_gradient_sync, ...), as the reshard settings above.
  os << " requires_gradient_sync=" << (u.sync.requires_sync ? "on" : "off")
     << " requires_all_reduce=" << (u.sync.requires_all_reduce ? "on" : "off") << " gradient_sync_mode=" << name_of(u.sync.mode);
  if (u.post_accumulate_grad_hook)
    os << " post_accumulate_grad_hook(" << (u.after_hook == GradientAfterHook::free ? "free" : "keep") << ")";
  auto list = [&](const char* what, const std::vector<std::string>& fqns) {
    if (fqns.empty()) return;
    os << " " << what << "=[";
    for (std::size_t i = 0; i < fqns.size(); ++i) os << (i ? ", " : "") << "'" << fqns[i] << "'";
    os << "]";
  };
  list("units_to_forward_prefetch", u.units_to_forward_prefetch);
  list("units_to_backward_prefetch", u.units_to_backward_prefetch);
  if (u.sync_module_states) os << " sync_module_states";
  if (!u.deferred_parameters.empty()) os << " deferred_init(" << u.deferred_parameters.size() << " parameters)";
  return os.str();
}

// One line per unit, after a line with the model's own settings.
inline std::string to_string(const ModelConfig& m) {
  std::ostringstream os;
  os << m.units.size() << " units, max_prefetched=" << m.max_prefetched << "\n";
  for (const UnitConfig& u : m.units) os << "  " << to_string(u) << "\n";
  return os.str();
}

}  // namespace fsdp
