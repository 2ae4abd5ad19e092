// fsdp/policy/policies.hpp: resolving fsdp::Policies<P...> into one policy per slot.
//
// The library ships one policy per slot, and each is also that slot's default, so the
// tests add their own policies (any type naming a slot is a policy) to tell "picked"
// from "defaulted". Misuse (non-policies, two policies for a slot) is a compile error,
// checked by policy_errors_test.sh.
#include <doctest/doctest.h>

#include <string_view>
#include <type_traits>

#include "fsdp/policy/policies.hpp"
#include "fsdp/unit/detail/flat_param_rules.hpp"

namespace core_policies_test {

namespace {

// Test-only policies, one per slot, distinct from the library's defaults and from any
// policy the library ships.
struct TestStrategy {
  using fsdp_policy_slot = fsdp::sharding_strategy_slot;
  static constexpr bool reshard_after_forward = false;
};
struct TestPrefetch { using fsdp_policy_slot = fsdp::backward_prefetch_slot; };
struct TestPrecision { using fsdp_policy_slot = fsdp::mixed_precision_slot; };
struct TestOffload { using fsdp_policy_slot = fsdp::cpu_offload_slot; };

struct NotAPolicy {};

template <class P, class Strategy, class Prefetch, class Mixed, class Offload>
constexpr bool resolves_to =
    std::is_same_v<typename P::strategy, Strategy> && std::is_same_v<typename P::backward_prefetch, Prefetch> &&
    std::is_same_v<typename P::mixed_precision, Mixed> && std::is_same_v<typename P::cpu_offload, Offload>;

}  // namespace

TEST_CASE("the Policy concept: a type naming a slot") {
  static_assert(fsdp::Policy<fsdp::FullShard>);
  static_assert(fsdp::Policy<fsdp::NoBackwardPrefetch>);
  static_assert(fsdp::Policy<fsdp::FullPrecision>);
  static_assert(fsdp::Policy<fsdp::NoOffload>);
  static_assert(fsdp::Policy<TestStrategy>);
  static_assert(!fsdp::Policy<int>);
  static_assert(!fsdp::Policy<NotAPolicy>);
  static_assert(!fsdp::Policy<fsdp::sharding_strategy_slot>);  // a slot is not a policy
  CHECK(fsdp::Policy<TestOffload>);
  CHECK_FALSE(fsdp::Policy<void*>);
}

TEST_CASE("each library policy belongs to its slot") {
  static_assert(std::is_same_v<fsdp::FullShard::fsdp_policy_slot, fsdp::sharding_strategy_slot>);
  static_assert(std::is_same_v<fsdp::NoBackwardPrefetch::fsdp_policy_slot, fsdp::backward_prefetch_slot>);
  static_assert(std::is_same_v<fsdp::BackwardPre::fsdp_policy_slot, fsdp::backward_prefetch_slot>);
  static_assert(std::is_same_v<fsdp::BackwardPost::fsdp_policy_slot, fsdp::backward_prefetch_slot>);
  static_assert(std::is_same_v<fsdp::ForwardPrefetch::fsdp_policy_slot, fsdp::forward_prefetch_slot>);
  static_assert(std::is_same_v<fsdp::FullPrecision::fsdp_policy_slot, fsdp::mixed_precision_slot>);
  static_assert(std::is_same_v<fsdp::NoOffload::fsdp_policy_slot, fsdp::cpu_offload_slot>);
  static_assert(fsdp::FullShard::reshard_after_forward);
  CHECK(std::string_view(fsdp::sharding_strategy_slot::name) == "ShardingStrategy");
  CHECK(std::string_view(fsdp::backward_prefetch_slot::name) == "BackwardPrefetch");
  CHECK(std::string_view(fsdp::mixed_precision_slot::name) == "MixedPrecision");
  CHECK(std::string_view(fsdp::cpu_offload_slot::name) == "CpuOffload");
}

TEST_CASE("the library's sharding strategies each fill the ShardingStrategy slot") {
  CHECK(resolves_to<fsdp::Policies<fsdp::ShardGradOp>, fsdp::ShardGradOp, fsdp::BackwardPre,
                    fsdp::FullPrecision, fsdp::NoOffload>);
  CHECK(resolves_to<fsdp::Policies<fsdp::NoOffload, fsdp::NoShard>, fsdp::NoShard, fsdp::BackwardPre,
                    fsdp::FullPrecision, fsdp::NoOffload>);
  CHECK(resolves_to<fsdp::Policies<TestPrecision, fsdp::HybridShard>, fsdp::HybridShard, fsdp::BackwardPre,
                    TestPrecision, fsdp::NoOffload>);
  CHECK(resolves_to<fsdp::Policies<fsdp::HybridShardZero2>, fsdp::HybridShardZero2, fsdp::BackwardPre,
                    fsdp::FullPrecision, fsdp::NoOffload>);
}

TEST_CASE("no policies: every slot gets its default") {
  using P = fsdp::Policies<>;
  static_assert(std::is_same_v<P::strategy, fsdp::FullShard>);
  static_assert(std::is_same_v<P::backward_prefetch, fsdp::BackwardPre>);
  static_assert(std::is_same_v<P::forward_prefetch, fsdp::NoForwardPrefetch>);
  static_assert(std::is_same_v<P::mixed_precision, fsdp::FullPrecision>);
  static_assert(std::is_same_v<P::cpu_offload, fsdp::NoOffload>);
  CHECK(resolves_to<P, fsdp::FullShard, fsdp::BackwardPre, fsdp::FullPrecision, fsdp::NoOffload>);
}

TEST_CASE("the library's own policies, spelled out, resolve to themselves") {
  using P = fsdp::Policies<fsdp::NoOffload, fsdp::FullPrecision, fsdp::NoBackwardPrefetch, fsdp::FullShard>;
  CHECK(resolves_to<P, fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::FullPrecision, fsdp::NoOffload>);
}

TEST_CASE("each slot alone: that slot picked, the others defaulted") {
  CHECK(resolves_to<fsdp::Policies<TestStrategy>, TestStrategy, fsdp::BackwardPre, fsdp::FullPrecision,
                    fsdp::NoOffload>);
  CHECK(resolves_to<fsdp::Policies<TestPrefetch>, fsdp::FullShard, TestPrefetch, fsdp::FullPrecision,
                    fsdp::NoOffload>);
  CHECK(resolves_to<fsdp::Policies<TestPrecision>, fsdp::FullShard, fsdp::BackwardPre, TestPrecision,
                    fsdp::NoOffload>);
  CHECK(resolves_to<fsdp::Policies<TestOffload>, fsdp::FullShard, fsdp::BackwardPre,
                    fsdp::FullPrecision, TestOffload>);
  // Two slots, the other two defaulted.
  CHECK(resolves_to<fsdp::Policies<TestOffload, TestStrategy>, TestStrategy, fsdp::BackwardPre,
                    fsdp::FullPrecision, TestOffload>);
  // Mixed with library policies.
  CHECK(resolves_to<fsdp::Policies<fsdp::FullShard, TestPrecision>, fsdp::FullShard, fsdp::BackwardPre,
                    TestPrecision, fsdp::NoOffload>);
}

namespace {

// All 24 orders of the four test policies resolve the same way.
template <class... Ps>
constexpr bool all_four_resolved = resolves_to<fsdp::Policies<Ps...>, TestStrategy, TestPrefetch, TestPrecision, TestOffload>;

template <class A, class B, class C, class D>
constexpr bool orders_with_first = all_four_resolved<A, B, C, D> && all_four_resolved<A, B, D, C> &&
                                   all_four_resolved<A, C, B, D> && all_four_resolved<A, C, D, B> &&
                                   all_four_resolved<A, D, B, C> && all_four_resolved<A, D, C, B>;

}  // namespace

TEST_CASE("all four slots in every order") {
  using S = TestStrategy;
  using B = TestPrefetch;
  using M = TestPrecision;
  using O = TestOffload;
  static_assert(orders_with_first<S, B, M, O>);
  static_assert(orders_with_first<B, S, M, O>);
  static_assert(orders_with_first<M, S, B, O>);
  static_assert(orders_with_first<O, S, B, M>);
  CHECK(orders_with_first<S, B, M, O>);
  CHECK(orders_with_first<O, M, B, S>);
}

TEST_CASE("a resolved policy keeps its members") {
  using P = fsdp::Policies<TestPrecision, TestStrategy>;
  static_assert(!P::strategy::reshard_after_forward);
  static_assert(fsdp::Policies<>::strategy::reshard_after_forward);
  CHECK_FALSE(P::strategy::reshard_after_forward);
}

TEST_CASE("policy_config: the policies as the unit, the memory planner and a model's report read them, in any order") {
  using fsdp::BackwardPrefetchMode;
  const auto a = fsdp::policy_config<fsdp::Policies<fsdp::BackwardPost, fsdp::ShardGradOp, fsdp::OffloadParams>>();
  CHECK(a.shards_parameters);
  CHECK_FALSE(a.reshard_after_forward);  // ShardGradOp's
  CHECK_FALSE(a.hybrid);
  CHECK(a.backward == BackwardPrefetchMode::backward_post);
  CHECK_FALSE(a.forward_prefetch);
  CHECK(a.offload);
  CHECK(a.strategy() == "SHARD_GRAD_OP");
  CHECK(a.shard_space() == fsdp::MemorySpace::host);
  CHECK_FALSE(a.precision.mixed);
  CHECK_FALSE(a.buffer_cast().has_value());

  const auto b = fsdp::policy_config<
      fsdp::Policies<fsdp::ForwardPrefetch, fsdp::MixedPrecision<fsdp::bf16, float, fsdp::f16>, fsdp::NoBackwardPrefetch,
                     fsdp::HybridShard>>();
  CHECK(b.hybrid);
  CHECK(b.reshard_after_forward);
  CHECK(b.backward == BackwardPrefetchMode::none);
  CHECK(b.forward_prefetch);
  CHECK(b.strategy() == "HYBRID_SHARD");
  CHECK(b.shard_space() == fsdp::MemorySpace::device);
  CHECK(b.precision.param == fsdp::DType::bf16);
  CHECK(b.precision.reduce == fsdp::DType::f32);
  CHECK(b.buffer_cast() == fsdp::DType::f16);

  // The defaults (BackwardPre); a backward prefetch policy of the engine's own prefetches nothing.
  CHECK(fsdp::policy_config<fsdp::Policies<>>().backward == BackwardPrefetchMode::backward_pre);
  CHECK(fsdp::policy_config<fsdp::Policies<TestPrefetch>>().backward == BackwardPrefetchMode::none);
}

}  // namespace core_policies_test
