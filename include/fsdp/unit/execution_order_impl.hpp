#pragma once
// ExecutionOrder's members that call into units (fsdp/unit/execution_order.hpp), defined once
// Unit is complete, and those that read the recorded order whole: fsdp/unit/sharded_unit.hpp
// includes it, the one unit that calls them.
#include <cstddef>
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
  if (pass == Pass::forward) last_forward_prefetching_ = prefetching;
  if (pass == Pass::backward) {  // backward ends the first forward (if there was one)
    if (!in_backward_ && aborted_start_ > 0) {  // the second iteration's forward ends here
      // Only under forward prefetching, which gathered the record's next unit in vain.
      if (forward_step_ < forward_.size() && last_forward_prefetching_) drop_aborted_start(forward_step_, -1);
      aborted_start_ = 0;
    }
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
    if (pass == Pass::forward) ++forward_pass_, aborted_start_ = 0;  // the record ran whole: it stands
  }
  if (order.empty()) return;  // the first iteration had no such pass: nothing to follow
  if (order[step] != idx && pass == Pass::forward && aborted_start_ > 0) {  // the first departure
    if (prefetching && drop_aborted_start(step, idx)) {
      ++step;
      return;
    }
    aborted_start_ = 0;
  }
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

FSDP_DECL std::size_t ExecutionOrder::aborted_start() const {
  if (forward_.empty()) return 0;
  std::vector<int> surplus(units_.size(), 0);  // forward entries less backward ones, per unit
  for (int i : forward_) ++surplus[static_cast<std::size_t>(i)];
  for (int i : backward_) --surplus[static_cast<std::size_t>(i)];
  std::size_t start = 0;
  for (int n : surplus) start += n > 0 ? static_cast<std::size_t>(n) : 0;
  if (start == 0 || start >= forward_.size() || forward_[start] != forward_[0]) return 0;
  for (std::size_t i = 0; i < start; ++i)
    if (--surplus[static_cast<std::size_t>(forward_[i])] < 0) return 0;  // not the surplus entries
  for (std::size_t begin = 0; begin < start;) {  // each piece: a beginning of the pass after the start
    std::size_t end = begin + 1;
    while (end < start && forward_[end] != forward_[0]) ++end;
    if (start + (end - begin) > forward_.size()) return 0;
    for (std::size_t i = begin; i < end; ++i)
      if (forward_[i] != forward_[start + i - begin]) return 0;
    begin = end;
  }
  return start;
}

FSDP_DECL bool ExecutionOrder::drop_aborted_start(std::size_t step, int idx) {
  const std::size_t start = std::exchange(aborted_start_, 0);  // decided here, either way
  const std::size_t rest = forward_.size() - start;
  // This iteration ran forward_[0, step) (everything before matched); the rest of the record
  // must begin with that and go on with `idx`, or end there when the forward does.
  if (idx < 0 ? step != rest || start != rest : step >= rest || forward_[start + step] != idx) return false;
  for (std::size_t i = 0; i < step; ++i)
    if (forward_[start + i] != forward_[i]) return false;
  forward_.erase(forward_.begin(), forward_.begin() + static_cast<std::ptrdiff_t>(start));
  return true;
}

FSDP_DECL void ExecutionOrder::reduction_issued(Unit& u) {
  if (Unit* before = std::exchange(reducing_, &u)) fsdp::detail::internals(*before).finish_reduction();
}

FSDP_DECL void ExecutionOrder::finish_reductions() {
  if (Unit* last = std::exchange(reducing_, nullptr)) fsdp::detail::internals(*last).finish_reduction();
}

}  // namespace fsdp
#endif  // FSDP_DEFINES_IMPLEMENTATION
