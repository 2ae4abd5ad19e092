#pragma once
// The memory planner's replay (fsdp/memory_plan.hpp): every allocation and free a unit
// makes through its Device during training steps, in the order the unit's state machine
// (fsdp/detail/sharded_unit.hpp), its flat parameters (fsdp/flat_param_group.hpp) and its gradient
// reduction (fsdp/detail/gradient_reduction.hpp) make them, counted per memory space as
// a Device counts them. It mirrors that code on purpose: a change there that moves a byte
// must change this too, or memory_plan_test fails.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/detail/flat_param_rules.hpp"
#include "fsdp/detail/simulated_unit.hpp"
#include "fsdp/device.hpp"
#include "fsdp/dtype.hpp"
#include "fsdp/flat_param.hpp"
#include "fsdp/gradient_sync.hpp"

namespace fsdp::detail {

class MemorySimulation {
 public:
  // shard_size: the ranks a sharded unit splits over (the replicate all-reduce runs in
  // place: no bytes of its own); world: the ranks a replicated unit's gradient is
  // all-reduced over; forward: unit indices in the order forward enters them; tops: the
  // outermost units, in forward order.
  MemorySimulation(PolicyValues p, int shard_size, int world, std::vector<SimUnit> units, std::vector<int> forward,
                   std::vector<int> tops, int max_prefetched, bool async_reductions, Accumulation accumulation)
      : p_(p), units_(std::move(units)), forward_(std::move(forward)), tops_(std::move(tops)),
        max_prefetched_(max_prefetched), async_(async_reductions), accumulation_(accumulation) {
    backward_ = backward_order();
    for (auto& u : units_) {
      UnitState s;
      const bool shards = p_.shards_parameters && !u.kept_unsharded;
      const int n = shards ? shard_size : 1;
      for (auto& f : u.flat) {
        FlatState fs;
        const FlatParamLayout layout = sim_layout(f.master, f.numel, n);
        fs.shard = layout.shard_numel();
        fs.padded = layout.padded_numel();
        fs.full = shards ? fs.padded : fs.shard;  // detail::full_numel
        const FlatParamDTypes t = flat_param_dtypes(f.master, p_.precision);
        fs.master = f.master;
        fs.compute = t.compute, fs.gather = t.gather, fs.accumulate = t.accumulate, fs.reduce = t.reduce, fs.grad = t.grad;
        fs.shards = shards;
        fs.reduces_alone = (shards ? shard_size : world) == 1;  // UnitGroups::reduces_alone
        if (shards && u.post_forward_ranks > 0) fs.post = fs.padded / u.post_forward_ranks;
        fs.direct = flat_param_is_direct(shards, p_.offload, f.master, t);
        s.flat.push_back(fs);
      }
      state_.push_back(s);
    }
  }

  // Construction: shards, sharded gradients, MixedPrecision's buffer copies.
  void setup() {
    for (std::size_t i = 0; i < units_.size(); ++i) {
      for (auto& f : state_[i].flat) {
        add(bytes(f.shard, f.master), p_.shard_space(), static_cast<int>(i), "setup");
        add(bytes(f.shard, f.grad), p_.shard_space(), static_cast<int>(i), "setup");
      }
      if (p_.precision.mixed)
        for (auto& b : units_[i].buffers)
          if (b.dtype != p_.precision.buffer && is_floating(b.dtype)) {
            add(bytes(b.numel, b.dtype), MemorySpace::device, static_cast<int>(i), "setup");
            add(bytes(b.numel, p_.precision.buffer), MemorySpace::device, static_cast<int>(i), "setup");
          }
    }
    for (std::size_t i = 0; i < units_.size(); ++i)  // a hook installed with GradientAfterHook::free frees them
      if (units_[i].hook == GradientAfterHook::free) release_shard_grads(static_cast<int>(i));
  }

  // One training step: zero_grad, then per micro-batch forward, backward, finish_backward.
  void step() {
    ++step_;
    zero_grad();
    for (int m = 1; m <= accumulation_.micro_batches; ++m) pass(m == accumulation_.micro_batches);
  }

  // Bytes the engine allocates through the same Device after a step and keeps (optimizer state).
  void engine_state(std::size_t b, MemorySpace space) { add(b, space, -1, "optimizer state (engine)"); }

  const SimPeak& peak(MemorySpace s) const { return peak_[static_cast<std::size_t>(s)]; }
  std::size_t live(MemorySpace s) const { return live_[static_cast<std::size_t>(s)]; }

 private:
  // Frees what accumulation kept (nothing once a synchronized backward reduced it).
  void zero_grad() {
    for (auto& s : state_) {
      s.grad_is_zero = true;
      for (auto& f : s.flat) {
        if (f.reduce_in_alive) sub(bytes(f.padded, f.reduce), MemorySpace::device), f.reduce_in_alive = false;
        if (f.partial_alive) sub(bytes(f.shard, f.accumulate), MemorySpace::device), f.partial_alive = false;
        release_full_grad(f);
      }
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
  struct FlatState {
    std::int64_t shard = 0, padded = 0, full = 0;  // elements: shard, padded flat, what a gather holds
    DType master{}, compute{}, gather{}, accumulate{}, reduce{}, grad{};
    bool shards = true, direct = false, reduces_alone = false;
    std::int64_t post = 0;  // elements a partial reshard keeps (0: none)
    bool full_alive = false, wire_alive = false, unbound = false, post_alive = false;
    bool full_grad_alive = false, full_grad_alias = false;
    bool reduce_in_alive = false, reduce_out_alive = false, reducing = false;
    bool partial_alive = false, deferred = false;  // a shard-group sum waiting for its all-reduce
    bool shard_grad_alive = true;
  };
  struct UnitState {
    std::vector<FlatState> flat;
    State state = State::idle;
    bool prefetched = false, kept = false;
    bool grad_is_zero = true;  // nothing reduced into the sharded gradient since zero_grad
    bool hook_due = false, hook_ran = false;
  };

  static std::size_t bytes(std::int64_t n, DType t) { return static_cast<std::size_t>(n) * size_of(t); }

  void add(std::size_t b, MemorySpace space, int unit, const char* phase) {
    auto& live = live_[static_cast<std::size_t>(space)];
    live += b;
    auto& pk = peak_[static_cast<std::size_t>(space)];
    if (live > pk.bytes) pk = {live, unit, phase, step_};
  }
  void sub(std::size_t b, MemorySpace space) { live_[static_cast<std::size_t>(space)] -= b; }

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
        add(bytes(f.post, f.gather), MemorySpace::device, u, "forward (partial reshard)"), f.post_alive = true;
        sub(bytes(f.full, f.compute), MemorySpace::device), f.full_alive = false;
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
    for (auto& f : s.flat) {  // bind_gradients
      if (f.full_grad_alive || f.full_grad_alias) continue;  // kept by a backward with sync off: added into
      if (f.direct && s.grad_is_zero) ensure_shard_grad(u, f, "backward (gradient)"), f.full_grad_alias = true;
      else add(bytes(f.padded, f.compute), MemorySpace::device, u, "backward (gradient)"), f.full_grad_alive = true;
    }
    const auto& list = units_[static_cast<std::size_t>(u)].backward_prefetch;
    for (int v : list) prefetch(v, "backward (prefetch)");
    if (list.empty() && p_.backward == PrefetchMode::backward_pre)
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
    if (p_.backward == PrefetchMode::backward_post && unit.backward_prefetch.empty())  // a list ran at pre_backward
      if (int next = next_backward(recorded); next >= 0) prefetch(next, "backward (prefetch)");
    s.state = State::backward_post;
    if (plan == GradientPlan::keep_unsharded) {  // no communication
      for (auto& f : s.flat)
        if (f.accumulate != f.compute) to_reduce_dtype(u, f, "backward (accumulation)");
      return;
    }
    const bool defer = plan == GradientPlan::reduce_partial;
    for (auto& f : s.flat) start_reduction(u, f, s.grad_is_zero, defer);
    if (!defer) s.grad_is_zero = false;
    s.hook_due = unit.hook && final;  // the hook runs once this reduction completes
    // Alone in the reducing group nothing is exchanged: done inside the call, finished at once.
    if (!async_ || s.flat.empty() || s.flat.front().reduces_alone) return finish_reduction(u);
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
  bool gather_issued(const FlatState& f) const { return f.direct || f.full_alive || f.wire_alive; }
  void start_gather(int u, FlatState& f, const char* phase) {
    if (f.direct) return;
    f.unbound = true;
    if (f.gather != f.compute && (f.shards || f.post_alive)) {
      add(bytes(f.padded, f.gather), MemorySpace::device, u, phase), f.wire_alive = true;
      return;
    }
    add(bytes(f.full, f.compute), MemorySpace::device, u, phase), f.full_alive = true;
  }
  void unshard(int u, const char* phase) {
    auto& s = state_[static_cast<std::size_t>(u)];
    for (auto& f : s.flat) {
      if (!gather_issued(f)) start_gather(u, f, phase);
      if (f.unbound) {  // finish_gather: a narrower gather is widened, then freed
        if (f.wire_alive) {
          add(bytes(f.padded, f.compute), MemorySpace::device, u, phase), f.full_alive = true;
          sub(bytes(f.padded, f.gather), MemorySpace::device), f.wire_alive = false;
        }
        f.unbound = false;
        if (f.post_alive) sub(bytes(f.post, f.gather), MemorySpace::device), f.post_alive = false;  // gathered from: done
      }
    }
    if (s.prefetched) s.prefetched = false, --prefetched_;
  }
  void release_unsharded(int u) {
    auto& s = state_[static_cast<std::size_t>(u)];
    for (auto& f : s.flat) {
      if (f.direct) continue;
      f.unbound = false;
      if (f.wire_alive) sub(bytes(f.padded, f.gather), MemorySpace::device), f.wire_alive = false;
      if (f.full_alive) sub(bytes(f.full, f.compute), MemorySpace::device), f.full_alive = false;
      if (f.post_alive) sub(bytes(f.post, f.gather), MemorySpace::device), f.post_alive = false;
    }
    if (s.prefetched) s.prefetched = false, --prefetched_;
    s.kept = false;
  }

  // ---- gradients (GradientReduction), the sharded gradient zero (after zero_grad) ----
  void start_reduction(int u, FlatState& f, bool grad_is_zero, bool defer) {
    const FlatParamDTypes t{f.compute, f.gather, f.accumulate, f.reduce, f.grad};
    if (casts_into_shard_grad(f.reduces_alone, t, f.reduce_in_alive, grad_is_zero, defer, p_.offload)) {
      ensure_shard_grad(u, f, "backward (reduction)");
      release_full_grad(f);
    } else if (f.reduce != f.compute) {
      to_reduce_dtype(u, f, "backward (reduction)");
    }
    if (!defer) ensure_shard_grad(u, f, "backward (reduction)");  // where a hook freed it
    f.deferred = defer;
    if (defer && !f.partial_alive && f.accumulate == f.reduce) {  // the first deferred sum is reduced into `partial`
      add(bytes(f.shard, f.accumulate), MemorySpace::device, u, "backward (reduction)"), f.partial_alive = true;
    } else {
      const bool into_shard_grad = !defer && grad_is_zero && !p_.offload && f.grad == f.reduce;
      if (!into_shard_grad) add(bytes(f.shard, f.reduce), MemorySpace::device, u, "backward (reduction)"), f.reduce_out_alive = true;
    }
    f.reducing = true;
  }
  // A shard-group sum in the reduce dtype added into `partial` (the accumulate dtype):
  // cast through a buffer of its own where the two differ, or cast into a new `partial`.
  void add_into_partial(int u, FlatState& f) {
    if (f.accumulate == f.reduce) return;
    add(bytes(f.shard, f.accumulate), MemorySpace::device, u, "backward (reduction)");
    if (f.partial_alive) sub(bytes(f.shard, f.accumulate), MemorySpace::device);
    f.partial_alive = true;
  }
  void finish_reduction(int u) {
    for (auto& f : state_[static_cast<std::size_t>(u)].flat) {
      if (!f.reducing) continue;
      f.reducing = false;
      if (f.deferred) {  // the sum waits in `partial` for a later all-reduce
        if (f.reduce_out_alive) add_into_partial(u, f), sub(bytes(f.shard, f.reduce), MemorySpace::device), f.reduce_out_alive = false;
        if (f.reduce_in_alive) sub(bytes(f.padded, f.reduce), MemorySpace::device), f.reduce_in_alive = false;
        release_full_grad(f);
        continue;
      }
      if (f.partial_alive) {  // earlier deferred sums join this reduction
        add_into_partial(u, f);
        sub(bytes(f.shard, f.accumulate), MemorySpace::device), f.partial_alive = false;
      }
      if (f.reduce_out_alive && f.grad != f.reduce) {  // the result cast to the gradient's dtype
        add(bytes(f.shard, f.grad), MemorySpace::device, u, "backward (reduction)");
        sub(bytes(f.shard, f.grad), MemorySpace::device);
      }
      if (f.reduce_out_alive) sub(bytes(f.shard, f.reduce), MemorySpace::device), f.reduce_out_alive = false;
      if (f.reduce_in_alive) sub(bytes(f.padded, f.reduce), MemorySpace::device), f.reduce_in_alive = false;
      release_full_grad(f);
    }
    auto& s = state_[static_cast<std::size_t>(u)];
    if (!std::exchange(s.hook_due, false)) return;
    const SimUnit& unit = units_[static_cast<std::size_t>(u)];
    if (!std::exchange(s.hook_ran, true))  // the engine's state for this unit (an optimizer in backward)
      for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
        if (std::size_t b = unit.hook_engine_state[static_cast<std::size_t>(space)]) add(b, space, u, "optimizer state (engine, in backward)");
    if (unit.hook == GradientAfterHook::free) release_shard_grads(u), s.grad_is_zero = true;
  }
  void ensure_shard_grad(int u, FlatState& f, const char* phase) {
    if (!f.shard_grad_alive) add(bytes(f.shard, f.grad), p_.shard_space(), u, phase), f.shard_grad_alive = true;
  }
  void release_shard_grads(int u) {
    for (auto& f : state_[static_cast<std::size_t>(u)].flat)
      if (std::exchange(f.shard_grad_alive, false)) sub(bytes(f.shard, f.grad), p_.shard_space());
  }
  // The compute-dtype gradient cast to the reduce dtype (added into what earlier backwards
  // kept there, through a temporary), then freed.
  void to_reduce_dtype(int u, FlatState& f, const char* phase) {
    add(bytes(f.padded, f.reduce), MemorySpace::device, u, phase);
    if (f.reduce_in_alive) sub(bytes(f.padded, f.reduce), MemorySpace::device);
    f.reduce_in_alive = true;
    release_full_grad(f);
  }
  void release_full_grad(FlatState& f) {
    if (f.full_grad_alive) sub(bytes(f.padded, f.compute), MemorySpace::device);
    f.full_grad_alive = f.full_grad_alias = false;
  }

  PolicyValues p_;
  std::vector<SimUnit> units_;
  std::vector<UnitState> state_;
  std::vector<int> forward_, tops_, backward_;
  int max_prefetched_ = 2;
  bool async_ = false;
  Accumulation accumulation_;
  GradientSync sync_;  // the pass's gradient sync and replicate all-reduce (each unit's mode aside)
  int step_ = 0, pass_ = 0;
  std::size_t forward_step_ = 0, backward_step_ = 0;
  int prefetched_ = 0;
  std::deque<int> reducing_;
  std::array<std::size_t, 2> live_{};
  std::array<SimPeak, 2> peak_{};
};

}  // namespace fsdp::detail
