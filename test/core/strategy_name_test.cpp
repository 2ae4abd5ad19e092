// Runtime selection of the compile-time sharding strategy by name.
#include <doctest/doctest.h>

#include <fsdp/fsdp.hpp>

#include <string>
#include <type_traits>

namespace core_strategy_name_test {

namespace {
template <class S>
std::string picked(const char* name) {
  return fsdp::with_strategy(name, [](auto s) -> std::string {
    return std::is_same_v<decltype(s), S> ? "yes" : std::string("no: got ") + decltype(s)::name;
  });
}
}  // namespace

TEST_CASE("every PyTorch strategy name selects its policy, in any case") {
  CHECK(picked<fsdp::FullShard>("FULL_SHARD") == "yes");
  CHECK(picked<fsdp::FullShard>("full_shard") == "yes");
  CHECK(picked<fsdp::ShardGradOp>("Shard_Grad_Op") == "yes");
  CHECK(picked<fsdp::NoShard>("no_shard") == "yes");
  CHECK(picked<fsdp::HybridShard>("hybrid_shard") == "yes");
  CHECK(picked<fsdp::HybridShardZero2>("HYBRID_SHARD_ZERO2") == "yes");
}

TEST_CASE("an unknown name is an error that lists the valid ones") {
  CHECK_THROWS_WITH_AS(picked<fsdp::FullShard>("zero3"),
                       "fsdp: unknown sharding strategy 'zero3'; valid names (any case): FULL_SHARD, SHARD_GRAD_OP, "
                       "NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2",
                       fsdp::Error);
  CHECK_THROWS_AS(picked<fsdp::FullShard>("full_shard "), fsdp::Error);  // no trimming: a stray space is a typo
  CHECK_THROWS_AS(picked<fsdp::FullShard>(""), fsdp::Error);
}

}  // namespace core_strategy_name_test
