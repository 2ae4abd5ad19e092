#pragma once
// The memory planner's replay (fsdp/model/memory_plan.hpp): every allocation and free a unit
// makes through its Device during training steps, in the order the unit's state machine
// (fsdp/unit/sharded_unit.hpp), its flat parameters (fsdp/unit/flat_param_group.hpp) and its gradient
// reduction (fsdp/unit/detail/gradient_reduction.hpp, replayed in fsdp/model/detail/simulated_gradients.hpp)
// make them, counted per memory space as a Device counts them. It mirrors that code on
// purpose: a change there that moves a byte must change this too, or memory_plan_test fails.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/model/detail/simulated_gradients.hpp"
#include "fsdp/model/detail/simulated_unit.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/policy/gradient_sync.hpp"

namespace fsdp::detail {

class MemorySimulation {
 public:
  // shard_size: the ranks a sharded unit splits over (the replicate all-reduce runs in
  // place: no bytes of its own); world: the ranks a replicated unit's gradient is
  // all-reduced over; forward: unit indices in the order forward enters them; tops: the
  // outermost units, in forward order.
  MemorySimulation(PolicyConfig p, int shard_size, int world, std::vector<SimUnit> units, std::vector<int> forward,
                   std::vector<int> tops, int max_prefetched, bool async_reductions, Accumulation accumulation)
      : p_(p), units_(std::move(units)), forward_(std::move(forward)), tops_(std::move(tops)),
        max_prefetched_(max_prefetched), async_(async_reductions), accumulation_(accumulation) {
    backward_ = backward_order();
    for (auto& u : units_) {
      UnitState s;
      const bool shards = p_.shards_parameters && !u.kept_unsharded;
      s.reduces_alone = (shards ? shard_size : world) == 1;
      const int n = shards ? shard_size : 1;
      for (auto& f : u.flat) {
        SimFlatState fs;
        const FlatParamLayout layout = sim_layout(f.master, f.numel, n);
        fs.shard = layout.shard_numel();
        fs.padded = layout.padded_numel();
        fs.full = shards ? fs.padded : fs.shard;  // detail::full_numel
        const FlatParamDTypes t = flat_param_dtypes(f.master, p_.precision);
        fs.master = f.master;
        fs.compute = t.compute, fs.gather = t.gather, fs.accumulate = t.accumulate, fs.reduce = t.reduce, fs.grad = t.grad;
        fs.shards = shards;
        if (shards && u.post_forward_ranks > 0) fs.post = fs.padded / u.post_forward_ranks;
        fs.direct = flat_param_is_direct(shards, p_.offload, f.master, t);
        fs.grad_in_shard = grad_accumulates_in_shard(fs.direct, world == 1, p_.offload, t);
        s.flat.push_back(fs);
      }
      state_.push_back(s);
    }
  }

  MemorySimulation(const MemorySimulation&) = delete;  // grads_ refers to ledger_ and p_
  MemorySimulation& operator=(const MemorySimulation&) = delete;

  // Construction: shards, sharded gradients, MixedPrecision's buffer copies.
  void setup() {
    for (std::size_t i = 0; i < units_.size(); ++i) {
      for (auto& f : state_[i].flat) {
        ledger_.add(f.shard, f.master, p_.shard_space(), static_cast<int>(i), "setup");
        ledger_.add(f.shard, f.grad, p_.shard_space(), static_cast<int>(i), "setup");
      }
      if (p_.precision.mixed)
        for (auto& b : units_[i].buffers)
          if (b.dtype != p_.precision.buffer && is_floating(b.dtype)) {
            ledger_.add(b.numel, b.dtype, MemorySpace::device, static_cast<int>(i), "setup");
            ledger_.add(b.numel, p_.precision.buffer, MemorySpace::device, static_cast<int>(i), "setup");
          }
    }
    for (std::size_t i = 0; i < units_.size(); ++i)  // a hook installed with GradientAfterHook::free frees them
      if (units_[i].hook == GradientAfterHook::free) release_shard_grads(static_cast<int>(i));
  }

  // One training step: zero_grad, then per micro-batch forward, backward, finish_backward.
  void step() {
    ledger_.next_step();
    zero_grad();
    for (int m = 1; m <= accumulation_.micro_batches; ++m) pass(m == accumulation_.micro_batches);
  }

  // Bytes the engine allocates through the same Device after a step and keeps (optimizer state).
  void engine_state(std::size_t b, MemorySpace space) { ledger_.add(b, space, -1, "optimizer state (engine)"); }

  const SimPeak& peak(MemorySpace s) const { return ledger_.peak(s); }
  std::size_t live(MemorySpace s) const { return ledger_.live(s); }

 private:
  // Frees what accumulation kept (nothing once a synchronized backward reduced it).
  void zero_grad() {
    for (auto& s : state_) {
      s.grad_is_zero = true;
      for (auto& f : s.flat) grads_.zero_grad(f);
    }
  }

  // One forward and backward; `last`: the last micro-batch of a step, whose reduction is whole.
  void pass(bool last) {
    sync_.requires_sync = last || accumulation_.defer_all_reduce;
    sync_.requires_all_reduce = last || !accumulation_.defer_all_reduce;
    const bool recorded = ++pass_ > 1;  // the first pass records the order and prefetches nothing
    forward_step_ = backward_step_ = 0;
    std::vector<int> open;  // forward: nested scopes
    for (int u : forward_) {
      while (!open.empty() && !contains(open.back(), u)) post_forward(open.back(), recorded), open.pop_back();
      pre_forward(u, recorded);
      open.push_back(u);
    }
    while (!open.empty()) post_forward(open.back(), recorded), open.pop_back();
    for (auto it = tops_.rbegin(); it != tops_.rend(); ++it) backward(*it, recorded);
    while (!reducing_.empty()) finish_reduction(reducing_.front()), reducing_.pop_front();
    for (std::size_t i = 0; i < units_.size(); ++i) {
      auto& s = state_[i];
      if (s.prefetched || s.kept) release_unsharded(static_cast<int>(i));
      s.state = State::idle;
    }
  }

  // The backward order (unit indices): the mirror of forward's nesting.
  std::vector<int> backward_order() const {
    std::vector<int> out;
    auto visit = [&](auto& self, int u) -> void {
      out.push_back(u);
      const auto& c = units_[static_cast<std::size_t>(u)].children;
      for (auto it = c.rbegin(); it != c.rend(); ++it) self(self, *it);
    };
    for (auto it = tops_.rbegin(); it != tops_.rend(); ++it) visit(visit, *it);
    return out;
  }

  enum class State : std::uint8_t { idle, forward, backward_pre, backward_post };
  struct UnitState {
    std::vector<SimFlatState> flat;
    State state = State::idle;
    bool prefetched = false, kept = false;
    bool reduces_alone = false;  // UnitGroups::reduces_alone: its reductions complete inside the call
    bool grad_is_zero = true;  // nothing reduced into the sharded gradient since zero_grad
    bool hook_due = false, hook_ran = false;
  };

  bool contains(int outer, int inner) const {
    for (int c : units_[static_cast<std::size_t>(outer)].children)
      if (c == inner || contains(c, inner)) return true;
    return false;
  }

  void backward(int u, bool recorded) {
    pre_backward(u, recorded);
    const auto& c = units_[static_cast<std::size_t>(u)].children;
    for (auto it = c.rbegin(); it != c.rend(); ++it) backward(*it, recorded);
    post_backward(u, recorded);
  }

  int next_forward(bool recorded) const {
    return recorded && forward_step_ < forward_.size() ? forward_[forward_step_] : -1;
  }
  int next_backward(bool recorded) const {
    return recorded && backward_step_ < backward_.size() ? backward_[backward_step_] : -1;
  }

  // ---- the unit's hooks (Sharded) ----
  void pre_forward(int u, bool recorded) {
    auto& s = state_[static_cast<std::size_t>(u)];
    ++forward_step_;
    if (s.kept) release_unsharded(u);
    unshard(u, "forward");
    const auto& list = units_[static_cast<std::size_t>(u)].forward_prefetch;  // explicit: from the first pass on
    for (int v : list) prefetch(v, "forward (prefetch)");
    if (list.empty() && p_.forward_prefetch)
      if (int next = next_forward(recorded); next >= 0) prefetch(next, "forward (prefetch)");
    s.state = State::forward;
  }
  void post_forward(int u, bool recorded) {
    auto& s = state_[static_cast<std::size_t>(u)];
    // ExecutionOrder::keeps_after_forward: the unit backward starts with, after the last forward entry
    const bool keeps = recorded && backward_[0] == u && forward_step_ == forward_.size();
    const SimUnit& unit = units_[static_cast<std::size_t>(u)];
    if (!unit.reshard_after_forward || keeps) s.kept = true;
    else if (unit.post_forward_ranks == 0) release_unsharded(u);
    else {  // reshard_to_post_forward: this rank's chunk kept, the rest freed
      for (auto& f : s.flat) {
        if (f.direct || !f.full_alive || f.unbound) continue;
        ledger_.add(f.post, f.gather, MemorySpace::device, u, "forward (partial reshard)"), f.post_alive = true;
        ledger_.sub(f.full, f.compute, MemorySpace::device), f.full_alive = false;
      }
      s.kept = true;
    }
    s.state = State::idle;
  }
  void pre_backward(int u, bool recorded) {
    auto& s = state_[static_cast<std::size_t>(u)];
    ++backward_step_;
    unshard(u, "backward");
    s.kept = false;
    for (auto& f : s.flat) grads_.bind(u, f, s.grad_is_zero);
    const auto& list = units_[static_cast<std::size_t>(u)].backward_prefetch;
    for (int v : list) prefetch(v, "backward (prefetch)");
    if (list.empty() && p_.backward == BackwardPrefetchMode::backward_pre)
      if (int next = next_backward(recorded); next >= 0) prefetch(next, "backward (prefetch)");
    s.state = State::backward_pre;
  }
  void post_backward(int u, bool recorded) {
    auto& s = state_[static_cast<std::size_t>(u)];
    const SimUnit& unit = units_[static_cast<std::size_t>(u)];
    GradientSync sync = sync_;
    sync.mode = unit.accumulation;
    // Only sharded parameters with replicas (hybrid strategies) have an all-reduce to defer.
    const GradientPlan plan = plan_gradient(sync, p_.hybrid && !unit.kept_unsharded && accumulation_.replicate > 1);
    const bool final = gradient_is_final(sync, plan);
    if (unit.reshard_after_backward || final) release_unsharded(u);  // else kept for the next forward
    if (p_.backward == BackwardPrefetchMode::backward_post && unit.backward_prefetch.empty())  // a list ran at pre_backward
      if (int next = next_backward(recorded); next >= 0) prefetch(next, "backward (prefetch)");
    s.state = State::backward_post;
    if (plan == GradientPlan::keep_unsharded) {  // no communication
      for (auto& f : s.flat) grads_.keep(u, f);
      return;
    }
    const bool defer = plan == GradientPlan::reduce_partial;
    for (auto& f : s.flat) grads_.start(u, f, s.reduces_alone, s.grad_is_zero, defer);
    if (!defer) s.grad_is_zero = false;
    s.hook_due = unit.hook && final;  // the hook runs once this reduction completes
    // Alone in the reducing group nothing is exchanged: done inside the call, finished at once.
    if (!async_ || s.reduces_alone) return finish_reduction(u);
    reducing_.push_back(u);  // at most one reduction stays in flight (ExecutionOrder)
    while (reducing_.size() > 1) finish_reduction(reducing_.front()), reducing_.pop_front();
  }
  void prefetch(int u, const char* phase) {
    auto& s = state_[static_cast<std::size_t>(u)];
    if (s.state != State::idle) return;
    if (s.prefetched) release_unsharded(u);
    if (prefetched_ >= max_prefetched_) return;
    bool issued = false;
    for (auto& f : s.flat)
      if (!gather_issued(f)) start_gather(u, f, phase), issued = true;
    if (issued) s.prefetched = true, ++prefetched_;
  }

  // ---- parameters (FlatParamGroup) ----
  bool gather_issued(const SimFlatState& f) const { return f.direct || f.full_alive || f.wire_alive; }
  void start_gather(int u, SimFlatState& f, const char* phase) {
    if (f.direct) return;
    f.unbound = true;
    if (f.gather != f.compute && (f.shards || f.post_alive)) {
      ledger_.add(f.padded, f.gather, MemorySpace::device, u, phase), f.wire_alive = true;
      return;
    }
    ledger_.add(f.full, f.compute, MemorySpace::device, u, phase), f.full_alive = true;
  }
  void unshard(int u, const char* phase) {
    auto& s = state_[static_cast<std::size_t>(u)];
    for (auto& f : s.flat) {
      if (!gather_issued(f)) start_gather(u, f, phase);
      if (f.unbound) {  // finish_gather: a narrower gather is widened, then freed
        if (f.wire_alive) {
          ledger_.add(f.padded, f.compute, MemorySpace::device, u, phase), f.full_alive = true;
          ledger_.sub(f.padded, f.gather, MemorySpace::device), f.wire_alive = false;
        }
        f.unbound = false;
        if (f.post_alive) ledger_.sub(f.post, f.gather, MemorySpace::device), f.post_alive = false;  // gathered from: done
      }
    }
    if (s.prefetched) s.prefetched = false, --prefetched_;
  }
  void release_unsharded(int u) {
    auto& s = state_[static_cast<std::size_t>(u)];
    for (auto& f : s.flat) {
      if (f.direct) continue;
      f.unbound = false;
      if (f.wire_alive) ledger_.sub(f.padded, f.gather, MemorySpace::device), f.wire_alive = false;
      if (f.full_alive) ledger_.sub(f.full, f.compute, MemorySpace::device), f.full_alive = false;
      if (f.post_alive) ledger_.sub(f.post, f.gather, MemorySpace::device), f.post_alive = false;
    }
    if (s.prefetched) s.prefetched = false, --prefetched_;
    s.kept = false;
  }

  // A reduction completes: the gradient's buffers (SimulatedGradients::finish), then the
  // unit's post-accumulate-grad hook when its gradient is final.
  void finish_reduction(int u) {
    auto& s = state_[static_cast<std::size_t>(u)];
    for (auto& f : s.flat) grads_.finish(u, f);
    if (!std::exchange(s.hook_due, false)) return;
    const SimUnit& unit = units_[static_cast<std::size_t>(u)];
    if (!std::exchange(s.hook_ran, true))  // the engine's state for this unit (an optimizer in backward)
      for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
        if (std::size_t b = unit.hook_engine_state[static_cast<std::size_t>(space)])
          ledger_.add(b, space, u, "optimizer state (engine, in backward)");
    if (unit.hook == GradientAfterHook::free) release_shard_grads(u), s.grad_is_zero = true;
  }
  void release_shard_grads(int u) {
    for (auto& f : state_[static_cast<std::size_t>(u)].flat) grads_.release_shard_grad(f);
  }

  PolicyConfig p_;
  std::vector<SimUnit> units_;
  std::vector<UnitState> state_;
  std::vector<int> forward_, tops_, backward_;
  int max_prefetched_ = 2;
  bool async_ = false;
  Accumulation accumulation_;
  GradientSync sync_;  // the pass's gradient sync and replicate all-reduce (each unit's mode aside)
  int pass_ = 0;
  std::size_t forward_step_ = 0, backward_step_ = 0;
  int prefetched_ = 0;
  std::deque<int> reducing_;
  SimLedger ledger_;
  SimulatedGradients grads_{ledger_, p_};
};

}  // namespace fsdp::detail
