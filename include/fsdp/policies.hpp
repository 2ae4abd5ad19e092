#pragma once
// Policies: small tag types, each belonging to one slot. fsdp::Sharded<Module, P...> takes
// them in any order; a slot left out gets its default; a type that is no policy, or two
// policies for the same slot, stop compilation with a message naming the slot.
#include <type_traits>

namespace fsdp {

// ---- slots ----
struct sharding_strategy_slot { static constexpr const char* name = "ShardingStrategy"; };
struct backward_prefetch_slot { static constexpr const char* name = "BackwardPrefetch"; };
struct mixed_precision_slot { static constexpr const char* name = "MixedPrecision"; };
struct cpu_offload_slot { static constexpr const char* name = "CpuOffload"; };

// ---- ShardingStrategy ----
// ZeRO-3: parameters, gradients and optimizer state sharded; parameters all-gathered
// before forward and again before backward, freed after each.
struct FullShard {
  using fsdp_policy_slot = sharding_strategy_slot;
  static constexpr bool reshard_after_forward = true;
};

// ---- BackwardPrefetch ----
struct NoBackwardPrefetch { using fsdp_policy_slot = backward_prefetch_slot; };

// ---- MixedPrecision ----
struct FullPrecision { using fsdp_policy_slot = mixed_precision_slot; };

// ---- CpuOffload ----
struct NoOffload { using fsdp_policy_slot = cpu_offload_slot; };

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
  using backward_prefetch = typename pick_slot<backward_prefetch_slot, NoBackwardPrefetch, Ps...>::type;
  using mixed_precision = typename pick_slot<mixed_precision_slot, FullPrecision, Ps...>::type;
  using cpu_offload = typename pick_slot<cpu_offload_slot, NoOffload, Ps...>::type;
};

}  // namespace detail

// The resolved configuration. Checked in two steps so that a non-policy argument gives
// one clear message instead of a cascade from the slot lookups.
template <class... Ps>
struct Policies {
  static_assert(detail::all_policies<Ps...>::value,
                "fsdp: a template argument of fsdp::Sharded after the Module is not an fsdp policy. "
                "Policies are ShardingStrategy (FullShard), BackwardPrefetch (NoBackwardPrefetch), "
                "MixedPrecision (FullPrecision) and CpuOffload (NoOffload), in any order.");
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
};

}  // namespace fsdp
