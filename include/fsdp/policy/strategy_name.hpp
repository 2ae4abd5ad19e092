#pragma once
// Runtime selection of the compile-time ShardingStrategy, for engines that read it from a
// config file: with_strategy("shard_grad_op", f) calls f(fsdp::ShardGradOp{}). Names are
// PyTorch's ShardingStrategy names, matched case-insensitively as Lightning does.
#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

#include "fsdp/core/error.hpp"
#include "fsdp/policy/policies.hpp"

namespace fsdp {

namespace detail {
template <class... S>
struct strategy_list {
  static std::string names() {
    std::string out;
    ((out += (out.empty() ? "" : ", "), out += S::name), ...);
    return out;
  }
};
using all_strategies = strategy_list<FullShard, ShardGradOp, NoShard, HybridShard, HybridShardZero2>;

inline bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::toupper(static_cast<unsigned char>(x)) == std::toupper(static_cast<unsigned char>(y));
         });
}

template <class F, class S, class... Rest>
decltype(auto) dispatch_strategy(std::string_view name, F& f, strategy_list<S, Rest...>) {
  if (iequals(name, S::name)) return f(S{});
  if constexpr (sizeof...(Rest) > 0) return dispatch_strategy(name, f, strategy_list<Rest...>{});
  else fail("unknown sharding strategy '", name, "'; valid names (any case): ", all_strategies::names());
}
}  // namespace detail

// Calls f(Strategy{}) for the strategy called `name`; f must compile for every strategy
// (the hybrid ones need a DeviceMesh, so pass one: a 1 x N mesh is plain FullShard).
template <class F>
decltype(auto) with_strategy(std::string_view name, F&& f) {
  return detail::dispatch_strategy(name, f, detail::all_strategies{});
}

inline std::string strategy_names() { return detail::all_strategies::names(); }

}  // namespace fsdp
