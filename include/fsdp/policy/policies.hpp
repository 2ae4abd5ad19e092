#pragma once
// Policies: small tag types, each belonging to one slot. fsdp::Sharded<Module, P...> takes
// them in any order; a slot left out gets its default; a type that is no policy, or two
// policies for the same slot, stop compilation with a message naming the slot.
#include <cstddef>
#include <type_traits>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/quant_format.hpp"

namespace fsdp {

// ---- slots ----
struct sharding_strategy_slot { static constexpr const char* name = "ShardingStrategy"; };
struct backward_prefetch_slot { static constexpr const char* name = "BackwardPrefetch"; };
struct mixed_precision_slot { static constexpr const char* name = "MixedPrecision"; };
struct cpu_offload_slot { static constexpr const char* name = "CpuOffload"; };
struct forward_prefetch_slot { static constexpr const char* name = "ForwardPrefetch"; };
struct comm_precision_slot { static constexpr const char* name = "CommPrecision"; };

// ---- ShardingStrategy ----
// Each says how parameters are split and how gradients are reduced:
//   shards_parameters      parameters are split across the shard group (else replicated)
//   reshard_after_forward  unsharded parameters are freed after forward (else kept until
//                          the end of that unit's backward, so backward needs no all-gather)
//   hybrid                 the shard group is one dimension of a DeviceMesh; gradient shards
//                          are then all-reduced across the other (replicate) dimension
struct FullShard {  // ZeRO-3
  using fsdp_policy_slot = sharding_strategy_slot;
  static constexpr const char* name = "FULL_SHARD";
  static constexpr bool shards_parameters = true, reshard_after_forward = true, hybrid = false;
};
struct ShardGradOp {  // ZeRO-2
  using fsdp_policy_slot = sharding_strategy_slot;
  static constexpr const char* name = "SHARD_GRAD_OP";
  static constexpr bool shards_parameters = true, reshard_after_forward = false, hybrid = false;
};
struct NoShard {  // DDP: replicated parameters, gradients all-reduced
  using fsdp_policy_slot = sharding_strategy_slot;
  static constexpr const char* name = "NO_SHARD";
  static constexpr bool shards_parameters = false, reshard_after_forward = false, hybrid = false;
};
struct HybridShard {  // ZeRO-3 inside a shard group, replicated across groups
  using fsdp_policy_slot = sharding_strategy_slot;
  static constexpr const char* name = "HYBRID_SHARD";
  static constexpr bool shards_parameters = true, reshard_after_forward = true, hybrid = true;
};
struct HybridShardZero2 {  // ZeRO-2 inside a shard group, replicated across groups
  using fsdp_policy_slot = sharding_strategy_slot;
  static constexpr const char* name = "HYBRID_SHARD_ZERO2";
  static constexpr bool shards_parameters = true, reshard_after_forward = false, hybrid = true;
};

// ---- BackwardPrefetch ----
// When the next unit's all-gather is issued during backward (the next unit in the
// backward order recorded on the first iteration):
struct BackwardPre {  // before this unit's backward: most overlap, one more unit alive
  using fsdp_policy_slot = backward_prefetch_slot;
  static constexpr const char* name = "BACKWARD_PRE";
};
struct BackwardPost {  // after this unit's backward, once its parameters are freed
  using fsdp_policy_slot = backward_prefetch_slot;
  static constexpr const char* name = "BACKWARD_POST";
};
struct NoBackwardPrefetch {  // each unit gathers when its backward starts
  using fsdp_policy_slot = backward_prefetch_slot;
  static constexpr const char* name = "NONE";
};

// ---- ForwardPrefetch ----
struct ForwardPrefetch {  // issue the next unit's all-gather before this unit's forward
  using fsdp_policy_slot = forward_prefetch_slot;
  static constexpr bool enabled = true;
};
struct NoForwardPrefetch {
  using fsdp_policy_slot = forward_prefetch_slot;
  static constexpr bool enabled = false;
};

// ---- MixedPrecision ----
// FSDP's MixedPrecision: the sharded master parameters keep their own dtype; each unshard
// casts the shard to Param before the all-gather (so the all-gather moves Param-sized
// bytes) and computation sees Param; gradients (computed in Param) are reduced in Reduce
// and kept in the master dtype, or in Reduce with KeepLowPrecisionGrads; buffers are
// computed with in Buffer. Reduce and Buffer default to Param. Dtypes are named by type:
// float, double, fsdp::bf16, fsdp::f16. A dtype equal to a tensor's own is no cast.
template <class Param, class Reduce = Param, class Buffer = Param, bool KeepLowPrecisionGrads = false>
struct MixedPrecision {
  using fsdp_policy_slot = mixed_precision_slot;
  static constexpr bool enabled = true;
  static constexpr DType param = dtype_v<Param>, reduce = dtype_v<Reduce>, buffer = dtype_v<Buffer>;
  static constexpr bool keep_low_precision_grads = KeepLowPrecisionGrads;
  static_assert(is_compute_dtype(param) && is_compute_dtype(reduce) && is_compute_dtype(buffer),
                "fsdp: MixedPrecision dtypes must be floating point (float, double, fsdp::bf16, fsdp::f16); "
                "the 8-bit floats need per-block scales and are not one");
};
struct FullPrecision {
  using fsdp_policy_slot = mixed_precision_slot;
  static constexpr bool enabled = false;
  static constexpr bool keep_low_precision_grads = false;
};

// ---- CommPrecision ----
// Collectives in a narrower dtype than the engine computes in, for engines that compute
// (and accumulate gradients) in f32: each all-gather moves Gather, each gradient reduction
// Reduce, while the engine is still shown, and accumulates into, its compute dtype. The
// casts happen in the unit's own buffers: the shard is cast into this rank's slot of a
// Gather buffer, gathered, then widened into the compute-dtype buffer the engine sees (the
// Gather buffer lives only until then); the gradient is cast to Reduce before the
// reduce-scatter (f16 relies on FSDP's pre/post divide factors) and widened back into the
// sharded gradient. Accumulation over micro-batches stays in the compute dtype: only the
// synchronized reduction rounds to Reduce. A dtype applies to a flat parameter only when
// it has fewer bytes than that parameter's compute dtype. Replicated parameters (NoShard, units under the
// persistence threshold) are never gathered: only Reduce applies to them. Summons and state
// dicts gather in the master dtype, unrounded. With MixedPrecision, Reduce comes from here:
// MixedPrecision may then set only Param (and Buffer).
//
// Gather may also be a block format (Int8Blocks, F8E4M3Blocks, F8E5M2Blocks, MXFP8 below; or
// a per-tensor one, F8E4M3Tensor and F8E5M2Tensor, whose scale the ranks agree on): each rank
// quantizes its own f32 shard into one-byte codes and one scale per block (its blocks
// cut from its own first element, so no block spans two ranks and no scale is agreed),
// the all-gather moves those, and every rank dequantizes them into the compute-dtype
// buffer the engine sees (through an f32 buffer when the compute dtype is not f32). About
// a quarter of f32's bytes (int8 blocks of 128: 1.03 bytes per value). It applies to f32
// flat parameters; others gather as without it. A block holding an inf or NaN arrives
// as NaNs, never as numbers. The all-gather of a partial reshard's group
// (set_reshard_after_forward(group)) moves the compute dtype. Reduce must be named then
// (the compute dtype leaves reductions as they are): CommPrecision<Int8Blocks<>, float>.
template <std::size_t Block = 128>
struct Int8Blocks {  // int8 codes, one f32 scale (amax / 127) per Block elements
  static_assert(Block > 0, "fsdp: Int8Blocks<Block> needs a positive Block (128 is the default)");
  static constexpr QuantFormat format = QuantFormat::int8_blocks;
  static constexpr std::size_t block = Block;
};
template <std::size_t Block = 128>
struct F8E4M3Blocks {  // E4M3 codes, one f32 scale (amax / 448) per Block elements
  static_assert(Block > 0, "fsdp: F8E4M3Blocks<Block> needs a positive Block (128 is the default)");
  static constexpr QuantFormat format = QuantFormat::f8e4m3_blocks;
  static constexpr std::size_t block = Block;
};
// E5M2 codes, one f32 scale (amax / 57344) per Block elements. Two mantissa bits, so each
// value is rounded by up to 2^-3 of itself (E4M3's: 2^-4), for a wider range: the bound
// holds for values down to 2^-29 of their block's largest (E4M3's: 2^-14). Pick it when a
// block mixes an outlier with far smaller values; else F8E4M3Blocks or Int8Blocks keep
// more of each value.
template <std::size_t Block = 128>
struct F8E5M2Blocks {
  static_assert(Block > 0, "fsdp: F8E5M2Blocks<Block> needs a positive Block (128 is the default)");
  static constexpr QuantFormat format = QuantFormat::f8e5m2_blocks;
  static constexpr std::size_t block = Block;
};
struct MXFP8 {  // OCP MXFP8: E4M3 codes, one e8m0 (power-of-two) scale per 32 elements
  static constexpr QuantFormat format = QuantFormat::mxfp8;
  static constexpr std::size_t block = kMxBlock;
};

// Per-tensor scaling (as torchao's float8 all-gather): one f32 scale per *parameter*,
// scale_for(amax, qmax) of the amax of the whole unsharded parameter, which the ranks of
// the shard group agree on before quantizing (each writes its slices' amaxes, one small
// all-gather of one f32 per parameter, whose largest per parameter is the agreed amax,
// then each quantizes its slices with it). The wire then carries codes only, no scales
// (1.00 byte per value), and the gathered parameter is, bit for bit,
// quantize_f8e4m3_tensor (or _f8e5m2_) of the whole parameter and back. The cost: one
// outlier coarsens its whole parameter (blocks confine it to 128 values), and the small
// all-gather runs before the quantize. A parameter holding an inf or NaN on any rank
// arrives as NaNs in every element, on every rank; the others are unaffected. Needs a
// device with abs_max, max_over_rows, quantize_tensor and dequantize_tensor
// (fsdp::TensorScalingDevice: HostDevice and CudaDevice). No block: `block` is 0.
struct F8E4M3Tensor {  // E4M3 codes, one f32 scale (amax / 448) per parameter
  static constexpr QuantFormat format = QuantFormat::f8e4m3_tensor;
  static constexpr std::size_t block = 0;
};
struct F8E5M2Tensor {  // E5M2 codes, one f32 scale (amax / 57344) per parameter
  static constexpr QuantFormat format = QuantFormat::f8e5m2_tensor;
  static constexpr std::size_t block = 0;
};

namespace detail {
template <class T>
concept QuantizedGather = requires {
  { T::format } -> std::convertible_to<QuantFormat>;
  { T::block } -> std::convertible_to<std::size_t>;
};
// Whether a CommPrecision-slot policy gathers in a block format (a policy of the user's
// own need not say).
template <class CP>
constexpr bool gathers_quantized() {
  if constexpr (requires { CP::quantized; }) return CP::quantized;
  else return false;
}
template <class T>
constexpr DType comm_dtype() {
  if constexpr (QuantizedGather<T>) return DType::u8;  // one-byte codes (and their scales)
  else return dtype_v<T>;
}
}  // namespace detail

template <class Gather, class Reduce = Gather>
struct CommPrecision {
  using fsdp_policy_slot = comm_precision_slot;
  static constexpr bool enabled = true;
  static constexpr bool quantized = detail::QuantizedGather<Gather>;
  static_assert(!detail::QuantizedGather<Reduce>,
                "fsdp: CommPrecision's Reduce is a dtype (float, fsdp::bf16, fsdp::f16): block formats quantize "
                "all-gathers only; write CommPrecision<fsdp::Int8Blocks<128>, float> (float, or your compute dtype, "
                "leaves reductions as they are)");
  // Under a block format, the codes' dtype (u8); gather_format and gather_block say which.
  static constexpr DType gather = detail::comm_dtype<Gather>(), reduce = detail::comm_dtype<Reduce>();
  static constexpr QuantFormat gather_format = [] {
    if constexpr (quantized) return Gather::format;
    else return QuantFormat::int8_blocks;
  }();
  static constexpr std::size_t gather_block = [] {
    if constexpr (quantized) return std::size_t{Gather::block};
    else return std::size_t{0};
  }();
  static_assert(!quantized || (gather_format == QuantFormat::mxfp8 ? gather_block == kMxBlock
                               : is_per_tensor(gather_format)    ? gather_block == 0
                                                                 : gather_block > 0),
                "fsdp: CommPrecision's block format has a block its format cannot have: MXFP8's is 32 elements, "
                "int8, E4M3 and E5M2 blocks need a positive one, the per-tensor formats (F8E4M3Tensor, "
                "F8E5M2Tensor) none (0)");
  static_assert((quantized || is_compute_dtype(gather)) && is_compute_dtype(reduce),
                "fsdp: CommPrecision dtypes must be floating point (float, double, fsdp::bf16, fsdp::f16), or for "
                "Gather a block format (fsdp::Int8Blocks<128>, fsdp::F8E4M3Blocks<128>, fsdp::F8E5M2Blocks<128>, "
                "fsdp::MXFP8); the 8-bit floats need per-block scales (or a per-tensor one: fsdp::F8E4M3Tensor, "
                "fsdp::F8E5M2Tensor) and are not one");
};
struct FullCommPrecision {  // collectives in the compute dtype (MixedPrecision's Param, else the parameters')
  using fsdp_policy_slot = comm_precision_slot;
  static constexpr bool enabled = false;
};

// ---- CpuOffload ----
// OffloadParams: sharded parameters and gradients live in the Device's host space (pinned
// memory on CUDA); the shard is copied to the device before each all-gather and the reduced
// gradient back after each reduction; the optimizer steps on host memory.
struct OffloadParams {
  using fsdp_policy_slot = cpu_offload_slot;
  static constexpr bool offload = true;
};
struct NoOffload {
  using fsdp_policy_slot = cpu_offload_slot;
  static constexpr bool offload = false;
};

template <class P>
concept Policy = requires { typename P::fsdp_policy_slot; };

namespace detail {

template <class Slot, class... Ps>
inline constexpr int count_in_slot = (0 + ... + (std::is_same_v<typename Ps::fsdp_policy_slot, Slot> ? 1 : 0));

template <class Slot, class Default, class... Ps>
struct pick_slot { using type = Default; };
template <class Slot, class Default, class P, class... Ps>
struct pick_slot<Slot, Default, P, Ps...> {
  using type = std::conditional_t<std::is_same_v<typename P::fsdp_policy_slot, Slot>, P,
                                  typename pick_slot<Slot, Default, Ps...>::type>;
};

template <class... Ps>
struct all_policies : std::bool_constant<(Policy<Ps> && ...)> {};

template <class... Ps>
struct resolve_policies_impl {
  using strategy = typename pick_slot<sharding_strategy_slot, FullShard, Ps...>::type;
  using backward_prefetch = typename pick_slot<backward_prefetch_slot, BackwardPre, Ps...>::type;
  using forward_prefetch = typename pick_slot<forward_prefetch_slot, NoForwardPrefetch, Ps...>::type;
  using mixed_precision = typename pick_slot<mixed_precision_slot, FullPrecision, Ps...>::type;
  using cpu_offload = typename pick_slot<cpu_offload_slot, NoOffload, Ps...>::type;
  using comm_precision = typename pick_slot<comm_precision_slot, FullCommPrecision, Ps...>::type;
};

// CommPrecision next to MixedPrecision: one of them chooses the reduce dtype, and each
// communication dtype is the compute dtype or has fewer bytes (a 16-bit dtype for another
// would round without saving a byte).
// (MP is looked into only under an enabled CP: a user's own precision policy need not
// have these members.)
template <class MP, class CP>
constexpr bool reduce_dtype_chosen_once() {
  if constexpr (CP::enabled) {
    if constexpr (MP::enabled) return MP::reduce == MP::param;
  }
  return true;
}
inline constexpr bool same_or_narrower(DType comm, DType compute) {
  return comm == compute || size_of(comm) < size_of(compute);
}
template <class MP, class CP>
constexpr bool comm_no_wider_than_compute() {
  if constexpr (CP::enabled) {
    if constexpr (MP::enabled)
      return (gathers_quantized<CP>() || same_or_narrower(CP::gather, MP::param)) && same_or_narrower(CP::reduce, MP::param);
  }
  return true;
}

}  // namespace detail

// The resolved configuration. Checked in two steps so that a non-policy argument gives
// one clear message instead of a cascade from the slot lookups.
template <class... Ps>
struct Policies {
  static_assert(detail::all_policies<Ps...>::value,
                "fsdp: a policy argument (of fsdp::shard, or of fsdp::Sharded after the Module) is not an fsdp policy. "
                "Policies are ShardingStrategy (FullShard, ShardGradOp, NoShard, HybridShard, "
                "HybridShardZero2), BackwardPrefetch (BackwardPre, BackwardPost, NoBackwardPrefetch), "
                "ForwardPrefetch (ForwardPrefetch, NoForwardPrefetch), MixedPrecision (FullPrecision, "
                "MixedPrecision<Param, Reduce, Buffer>), CommPrecision (FullCommPrecision, CommPrecision<Gather, Reduce>) "
                "and CpuOffload (NoOffload, OffloadParams), in any order.");
};

template <class... Ps>
  requires(Policy<Ps> && ...)
struct Policies<Ps...> : detail::resolve_policies_impl<Ps...> {
  static_assert(detail::count_in_slot<sharding_strategy_slot, Ps...> <= 1,
                "fsdp: more than one policy for the ShardingStrategy slot");
  static_assert(detail::count_in_slot<backward_prefetch_slot, Ps...> <= 1,
                "fsdp: more than one policy for the BackwardPrefetch slot");
  static_assert(detail::count_in_slot<mixed_precision_slot, Ps...> <= 1,
                "fsdp: more than one policy for the MixedPrecision slot");
  static_assert(detail::count_in_slot<cpu_offload_slot, Ps...> <= 1,
                "fsdp: more than one policy for the CpuOffload slot");
  static_assert(detail::count_in_slot<forward_prefetch_slot, Ps...> <= 1,
                "fsdp: more than one policy for the ForwardPrefetch slot");
  static_assert(detail::count_in_slot<comm_precision_slot, Ps...> <= 1,
                "fsdp: more than one policy for the CommPrecision slot");
  using resolved = detail::resolve_policies_impl<Ps...>;
  static_assert(detail::reduce_dtype_chosen_once<typename resolved::mixed_precision, typename resolved::comm_precision>(),
                "fsdp: MixedPrecision<Param, Reduce> and CommPrecision both choose the gradient reduction dtype: "
                "with CommPrecision, give MixedPrecision only Param (and Buffer) and let CommPrecision's Reduce decide");
  static_assert(detail::comm_no_wider_than_compute<typename resolved::mixed_precision, typename resolved::comm_precision>(),
                "fsdp: each CommPrecision dtype must be MixedPrecision's Param (what the engine computes in) or "
                "have fewer bytes than it: a wider one would move more bytes, one of the same size only rounds");
};

}  // namespace fsdp
