#pragma once
// ExecutionOrder's members that call into units (fsdp/unit/execution_order.hpp), defined once
// Unit is complete: fsdp/unit/sharded_unit.hpp includes it, the one unit that calls them.
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/unit/unit.hpp"

#if FSDP_DEFINES_IMPLEMENTATION  // compiled once under FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp)
namespace fsdp {

FSDP_DECL std::string ExecutionOrder::name_of(int index) const {
  if (index < 0 || index >= static_cast<int>(units_.size())) return "<not a unit of this model>";
  return std::string(fsdp::detail::display_name(units_[index]->fqn()));
}

FSDP_DECL void ExecutionOrder::enter(Unit& u, int idx, Pass pass, const detail::CommRef& world, bool prefetching) {
  auto& order = pass == Pass::forward ? forward_ : backward_;
  auto& step = pass == Pass::forward ? forward_step_ : backward_step_;
  auto& recorded = pass == Pass::forward ? forward_recorded_ : backward_recorded_;
  const char* pass_name = pass == Pass::forward ? "forward" : "backward";
  passes_.enter(idx, pass == Pass::backward, world);
  if (pass == Pass::backward) {  // backward ends the first forward (if there was one)
    in_backward_ = true;
    if (!forward_.empty()) forward_recorded_ = true;
  }
  if (!recorded) {
    if (world.size() > 1) {  // every rank must be entering the same unit here
      const std::int32_t mine = idx;
      std::vector<std::int32_t> all(static_cast<std::size_t>(world.size()));
      world.all_gather(&mine, all.data(), 1, DType::i32).wait();
      for (std::int32_t other : all) {
        if (other == mine) continue;
        std::ostringstream os;
        os << "ranks run units in different orders: at " << pass_name << " step #" << step << " of the first iteration";
        for (std::size_t r = 0; r < all.size(); ++r) os << (r ? "," : "") << " rank " << r << " runs '" << name_of(all[r]) << "'";
        os << " (seen on rank " << world.rank() << ")";
        throw Error(ErrorKind::mismatch, os.str());
      }
    }
    if (pass == Pass::backward && order.empty()) first_backward_ = &u;
    order.push_back(idx);
    ++step;
    return;
  }
  if (step == order.size()) {  // a new pass
    step = 0;
    if (pass == Pass::forward) ++forward_pass_;
  }
  if (order.empty()) return;  // the first iteration had no such pass: nothing to follow
  if (order[step] != idx && prefetching) {
    // The unit that begins the pass, mid-pass: the last pass never ended, most likely left by
    // an exception the library did not see (an engine error between hooks, outside any scope).
    std::string restart;
    if (step > 0 && order[0] == idx)
      restart = ": the " + std::string(pass_name) + " pass starts over before the last one ended (at step #" +
                std::to_string(step) + "); if an exception left that step, call abort_step() (ShardedModel::abort_step) "
                "on every rank before the next one (docs/reliability.md, failed hooks). Otherwise";
    detail::fail("unit '", name_of(idx), "' on rank ", world.rank(), " runs at ", pass_name, " step #", step,
                 " where the first iteration ran '", name_of(order[step]), "'", restart,
                 "; prefetching follows the first iteration's order, so a model whose order changes needs "
                 "NoBackwardPrefetch and NoForwardPrefetch");
  }
  ++step;
}

FSDP_DECL void ExecutionOrder::reduction_issued(Unit& u) {
  if (Unit* before = std::exchange(reducing_, &u)) fsdp::detail::internals(*before).finish_reduction();
}

FSDP_DECL void ExecutionOrder::finish_reductions() {
  if (Unit* last = std::exchange(reducing_, nullptr)) fsdp::detail::internals(*last).finish_reduction();
}

}  // namespace fsdp
#endif  // FSDP_DEFINES_IMPLEMENTATION
