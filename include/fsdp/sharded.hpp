#pragma once
// fsdp::Sharded<Module, Policies...>: one unit of sharding (FSDP's wrapped module) and its
// state machine. At construction it takes over the module's parameters (all of its
// subtree, except children whose type is listed in the `exclude` wrap_types and what
// UnitOptions::skip_* name: units of their own, ignored modules and parameters). Module may
// be a polymorphic base (Sharded<Layer> over a Layer&): its FlatParamGroup copies this rank's slice into a flat shard, it
// checks that every rank built the same unit, and it rebinds the engine's tensors to "no
// storage". The hooks then make the parameters valid exactly while the engine computes
// with them; inside a ShardedModel they also follow its ExecutionOrder to prefetch and to
// keep one reduction in flight.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <cstdint>
#include <sstream>
#include <vector>

#include "fsdp/communicator.hpp"
#include "fsdp/detail/buffer_copies.hpp"
#include "fsdp/detail/deferred_storage.hpp"
#include "fsdp/detail/fingerprint.hpp"
#include "fsdp/detail/param_collection.hpp"
#include "fsdp/detail/unit_groups.hpp"
#include "fsdp/device.hpp"
#include "fsdp/device_mesh.hpp"
#include "fsdp/flat_param_group.hpp"
#include "fsdp/policies.hpp"
#include "fsdp/trace.hpp"
#include "fsdp/unit.hpp"
#include "fsdp/wrap_policy.hpp"

namespace fsdp {

struct UnitOptions {
  std::string fqn;  // the module's FQN within the model ("" for the root): names parameters
  // Broadcast rank 0's parameters and buffers to every rank at construction, as FSDP's
  // sync_module_states does: ranks that initialised differently then start the same.
  bool sync_module_states = false;
  // Leave the engine's tensors alone until take_over() (fsdp::shard builds every unit first).
  bool defer_take_over = false;
  // Parts of the module's subtree (at any depth) this unit leaves out: modules that are
  // units of their own (manual nesting: build the child's unit, then the parent's with the
  // child listed here, so the parent takes what is left) and ignored modules; and ignored
  // parameters (the engine's parameter tensors, by address). Nothing manages the ignored.
  std::vector<ModuleId> skip_modules = {};
  std::vector<const void*> skip_parameters = {};
  // Deferred init (fsdp::deferred_init sets it for fsdp::shard): parameters without storage
  // are bound to zeroed storage of the unit's, `init` fills them (it gets their tensors'
  // addresses), the unit copies its shard and frees that storage. Empty: they are an error.
  detail::InitCallback init = {};
  bool check_init_agrees = false;  // then hash every parameter and fail if ranks differ
  // A unit with fewer parameter elements than this keeps them unsharded: whole on every
  // rank, never all-gathered, their gradients all-reduced over the world (as NoShard does),
  // so tiny units (norms, biases) cost no all-gather latency. Its groups() still name the
  // model's groups. 0: every unit follows its strategy.
  std::int64_t persistence_threshold = 0;
};

template <class Module, class... Ps>
class Sharded final : public UnitBase {
 public:
  using module_type = Module;
  using config = Policies<Ps...>;
  using strategy = typename config::strategy;
  using prefetch_policy = typename config::backward_prefetch;
  using precision = typename config::mixed_precision;
  static constexpr bool prefetches_forward = config::forward_prefetch::enabled;
  static constexpr bool prefetches_backward = !std::is_same_v<prefetch_policy, NoBackwardPrefetch>;
  static constexpr bool offload = config::cpu_offload::offload;

  // Over one communicator: FullShard and ShardGradOp shard across it, NoShard replicates.
  template <Communicator C, Device D, class Exclude = wrap_types<>>
  Sharded(Module& module, C& comm, D& device, UnitOptions options = {}, Exclude exclude = {})
      : Sharded(module, detail::UnitGroups::flat<strategy>(comm), detail::DeviceRef(device), std::move(options), exclude) {}

  // Over a mesh: the hybrid strategies shard inside its shard groups and replicate across
  // its replicate groups; the others use its whole world as above.
  template <SplittableCommunicator C, Device D, class Exclude = wrap_types<>>
  Sharded(Module& module, DeviceMesh<C>& mesh, D& device, UnitOptions options = {}, Exclude exclude = {})
      : Sharded(module, detail::UnitGroups::from_mesh<strategy>(mesh), detail::DeviceRef(device), std::move(options),
                exclude) {}

  template <class Group, Device D>
  Sharded(Module& module, Group& group, D& device, std::string fqn)
      : Sharded(module, group, device, UnitOptions{std::move(fqn)}) {}

  // The group hands the engine's parameters back empty and frees its storage as it is
  // destroyed; the buffer copies are handed back here.
  ~Sharded() override { buffers_.unbind_and_release(); }

  // "shard group of S ranks, replicate group of R ranks": units of one model must agree.
  // Each rank writes back only its own slice of its own full copy, so edits made on some
  // ranks only would be kept in some slices and lost in others: a collective hash of the
  // full parameters and buffers first, and an error on every rank (nothing written back,
  // the unit IDLE) when they differ.
  void check_edits_agree() {
    const auto& world = group_.groups().world;
    if (world.size() == 1) return;  // one rank: nothing to compare, so no pass over the parameters
    detail::Fingerprint f;
    const bool in_place = group_.hash_unsharded(f);
    for (std::size_t i = 0; i < buffer_views_.size(); ++i)
      f.add_bytes(buffer_data(i), static_cast<std::size_t>(buffer_views_[i].numel) * size_of(buffer_views_[i].dtype));
    std::uint64_t mine = f.value();
    std::vector<std::uint64_t> all(static_cast<std::size_t>(world.size()));
    world.all_gather(&mine, all.data(), 1, DType::i64).wait();
    if (std::all_of(all.begin(), all.end(), [&](std::uint64_t h) { return h == all[0]; })) return;
    std::ostringstream differ;
    for (std::size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0]) differ << (differ.tellp() ? ", " : "") << r;
    buffers_.show_master(false);
    group_.release_summoned_gradients();
    release_unsharded();
    state_ = TrainingState::IDLE;
    detail::fail("unit '", display_name(), "' on rank ", rank_,
                 ": summon_full_params(writeback) ended with full parameters or buffers that differ across ranks "
                 "(rank(s) ", differ.str(), " differ from rank 0): each rank writes back only its own slice, so "
                 "make the same edits on every rank; ",
                 in_place ? "parameters replicated in place kept each rank's own edits"
                          : "nothing was written back");
  }

  int world_size() const override { return group_.groups().world.size(); }
  // Whether UnitOptions::persistence_threshold kept this unit's parameters unsharded.
  bool kept_unsharded() const { return group_.kept_unsharded(); }
  std::string groups() const override {
    const auto& g = group_.mesh_groups();
    return "shard group of " + std::to_string(g.shard_size) + " ranks, replicate group of " +
           std::to_string(g.replicate_size) + " ranks";
  }

  // A unit may be entered several times per pass (fsdp/detail/unit_uses.hpp). A
  // recomputed forward is not part of the recorded order, and inside the unit's own
  // backward it needs no all-gather.
  void pre_forward() override {
    if (uses_.is_recompute(state_, order_ && order_->in_backward())) return begin_recompute();
    expect({TrainingState::IDLE}, "pre_forward");
    if (order_) order_->enter(*this, order_index_, Pass::forward, group_.groups().world, prefetches_forward);
    uses_.enter_forward(order_ ? order_->forward_pass() : 0);
    // Parameters kept since a forward that no backward consumed may predate an optimizer
    // step: gather afresh.
    if (kept_) release_unsharded();
    unshard();
    if (order_) {  // the next unit's all-gather now runs behind this unit's forward
      if (!forward_prefetch_.empty()) for (auto* u : forward_prefetch_) u->prefetch();
      else if constexpr (prefetches_forward) if (auto* next = order_->next(Pass::forward)) next->prefetch();
    }
    state_ = TrainingState::FORWARD;
    compute_begin_ = now_if_traced();
  }

  void post_forward() override {
    expect({TrainingState::FORWARD}, "post_forward");
    if (uses_.recompute_from) return end_recompute();
    record_compute("forward");
    if (strategy::reshard_after_forward && (!order_ || !order_->keeps_after_forward(*this))) release_unsharded();
    else kept_ = true;  // valid for this unit's next pre_backward only
    state_ = TrainingState::IDLE;
  }

  void pre_backward() override {
    if (!uses_.awaits_backward(state_)) {
      if (state_ == TrainingState::BACKWARD_POST)
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": pre_backward called after the unit's last backward ",
                     "entry of this pass (it ran forward ", uses_.forward_entries(), " time(s) and backward as often, so its ",
                     "gradient was reduced); a unit runs backward once per forward entry until finish_backward");
      expect({TrainingState::IDLE}, "pre_backward");
      if (sync_ != agreed_sync_) {  // only after a change: plain training runs no extra collective
        detail::agree_gradient_sync(group_.groups().world, sync_, display_name(), rank_);
        agreed_sync_ = sync_;
      }
      uses_.start_backward();
    }
    if (order_) order_->enter(*this, order_index_, Pass::backward, group_.groups().world, prefetches_backward);
    unshard();  // a no-op where forward left the parameters unsharded
    kept_ = false;
    group_.bind_gradients(grad_is_zero_);
    if (order_) {
      if (!backward_prefetch_.empty()) for (auto* u : backward_prefetch_) u->prefetch();
      else if constexpr (std::is_same_v<prefetch_policy, BackwardPre>)
        if (auto* next = order_->next(Pass::backward)) next->prefetch();
    }
    state_ = TrainingState::BACKWARD_PRE;
    compute_begin_ = now_if_traced();
  }

  void post_backward() override {
    expect({TrainingState::BACKWARD_PRE}, "post_backward");
    record_compute("backward");
    release_unsharded();  // parameters first, as FSDP does: their memory is free before the reduction
    if constexpr (std::is_same_v<prefetch_policy, BackwardPost>)
      if (order_ && backward_prefetch_.empty())
        if (auto* next = order_->next(Pass::backward)) next->prefetch();
    state_ = TrainingState::BACKWARD_POST;
    if (!uses_.end_backward()) return group_.unbind_gradients();  // more entries to come: it accumulates
    // A reduction that finished inside the call is completed now; one still running
    // overlaps the next unit's backward and is completed at that unit's post_backward
    // (or at finish_backward), at the latest.
    if (start_reduction() || !order_) finish_reduction();
    else order_->reduction_issued(*this);
  }

  void prefetch() override {
    if (!order_ || (state_ != TrainingState::IDLE && !uses_.awaits_backward(state_))) return;
    if (prefetched_) release_unsharded();  // gathered ahead in an earlier pass: may be stale
    if (!order_->may_prefetch()) return;
    if (group_.start_gathers()) { prefetched_ = true; order_->prefetch_issued(); }
  }

  void finish_reduction() override {
    group_.finish_reductions(waiter());
    if (hook_due_) run_grad_hook();
  }

  void set_post_accumulate_grad_hook(PostAccumulateGradHook hook, GradientAfterHook after) override {
    expect({TrainingState::IDLE}, "set_post_accumulate_grad_hook");
    if (!hook) after = GradientAfterHook::keep;
    if (after == GradientAfterHook::free && after_hook_ != after) {
      group_.release_shard_grads();
      grad_is_zero_ = true;
    } else if (after == GradientAfterHook::keep) {
      group_.ensure_shard_grads();  // zeroed where they were freed
    }
    grad_hook_ = std::move(hook);
    after_hook_ = after;
    group_.point_views_at_gradients(views_, params_);
  }

  void finish_backward() override {
    expect({TrainingState::BACKWARD_POST, TrainingState::IDLE}, "finish_backward");
    if (uses_.awaits_backward(state_)) start_reduction();  // fewer backward entries than forward ones, or not known
    finish_reduction();
    uses_.end_pass();
    // Gathered ahead for a pass it did not run in, or kept after a forward for a backward
    // that never came (its outputs did not reach the loss): FSDP's final callback reshards too.
    if (prefetched_ || kept_) release_unsharded();
    if constexpr (offload) group_.device().synchronize();  // gradients copied to host are complete
    state_ = TrainingState::IDLE;
  }

  void reshard() override {
    expect({TrainingState::IDLE}, "reshard");
    release_unsharded();
    uses_.end_forward_pass();
  }

  // Also frees what gradient accumulation kept (unsharded gradients, deferred sums).
  void zero_grad() override {
    expect({TrainingState::IDLE}, "zero_grad");
    group_.zero_grad();
    grad_is_zero_ = true;
  }

  // Full parameters in their own (master) dtype, and buffers in theirs: what FSDP's
  // summon_full_params and state dicts show, whatever the mixed precision.
  using UnitBase::begin_summon_full_params;
  void begin_summon_full_params(const SummonOptions& options) override {
    expect({TrainingState::IDLE}, "summon_full_params");
    if (options.with_grads && after_hook_ == GradientAfterHook::free)
      detail::fail("unit '", display_name(), "' on rank ", rank_,
                   ": summon_full_params with_grads, but its post-accumulate-grad hook frees the sharded gradient "
                   "(GradientAfterHook::free), so there is none to show");
    if (options.writeback && options.rank0_only)
      detail::fail("unit '", display_name(), "' on rank ", rank_,
                   ": summon_full_params with writeback and rank0_only: ranks other than 0 hold no full "
                   "parameters to write back; summon with writeback on every rank instead");
    release_unsharded();  // a compute-dtype copy kept since forward is not what is asked for
    group_.unshard_master(waiter());
    summon_holds_nothing_ = options.rank0_only && rank_ != 0;
    summon_checks_writeback_ = options.check_writeback;
    if (summon_holds_nothing_) group_.release_unsharded();  // gathered only for rank 0's sake
    else if (options.offload_to_host) group_.move_unsharded_to_host();
    if (options.with_grads) {
      try {
        group_.unshard_gradients();
      } catch (...) {
        group_.release_summoned_gradients();
        release_unsharded();
        throw;
      }
      if (summon_holds_nothing_) group_.release_summoned_gradients();
    }
    buffers_.show_master(true);
    state_ = TrainingState::SUMMON_FULL_PARAMS;
  }

  void end_summon_full_params(bool writeback) override {
    expect({TrainingState::SUMMON_FULL_PARAMS}, "end of summon_full_params");
    if (writeback && summon_checks_writeback_) check_edits_agree();
    if (writeback) group_.write_back();
    group_.release_summoned_gradients();
    buffers_.show_master(false, writeback);
    release_unsharded();
    state_ = TrainingState::IDLE;
  }

  void take_over() override {
    if (group_.took_over()) return;
    group_.take_over(fqn_, views_, params_);
    buffers_.show_cast();
  }

  std::span<const ShardView> shards() const override { return views_; }
  std::span<const ParamView> parameters() const override { return params_; }
  std::span<const BufferView> buffers() const override { return buffer_views_; }
  void* buffer_data(std::size_t i) const override {
    const auto& b = all_buffers_.at(i);
    if (state_ != TrainingState::SUMMON_FULL_PARAMS)  // the tensor shows a cast copy under MixedPrecision
      if (void* master = buffers_.current_master(b.tensor)) return master;
    return b.data_of(b.tensor);
  }
  void load_buffer(std::size_t i, const void* values) override {
    expect({TrainingState::IDLE}, "load_buffer");
    const auto& b = all_buffers_.at(i);
    if (buffers_.load(b.tensor, values)) return;
    const std::size_t n = static_cast<std::size_t>(b.numel) * size_of(b.dtype);
    if (n) group_.device().copy(b.data_of(b.tensor), values, n);
  }
  void* full_parameter(std::size_t i) const override {
    if (state_ != TrainingState::SUMMON_FULL_PARAMS)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": full_parameter('", params_.at(i).fqn,
                   "') needs the unit summoned (summon_full_params), but it is ", name_of(state_));
    if (summon_holds_nothing_)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": full_parameter('", params_.at(i).fqn,
                   "'): the summon is rank0_only, so only rank 0 holds full parameters");
    return group_.full_parameter(i);
  }
  DeviceId device_id() const override { return group_.device().id(); }
  void copy_bytes(void* dst, const void* src, std::size_t bytes) const override {
    if (bytes) group_.device().copy(dst, src, bytes);
  }
  void gather_like_shard(std::size_t shard, const void* mine, void* full_host, DType dtype) const override {
    group_.gather_array(shard, mine, full_host, dtype);
  }
  bool saves_shards() const override {
    const auto& g = group_.groups();
    return g.replicate_size == 1 || g.replicate.rank() == 0;
  }
  bool all_ranks_agree(bool ok) const override {
    const auto& world = group_.groups().world;
    if (world.size() == 1) return ok;
    std::int32_t mine = ok ? 1 : 0, all = 0;
    world.all_reduce(&mine, &all, 1, DType::i32, ReduceOp::min).wait();
    return all == 1;
  }
  std::int64_t max_over_ranks(std::int64_t v) const override {
    const auto& world = group_.groups().world;
    if (world.size() == 1) return v;
    std::int64_t all = 0;
    world.all_reduce(&v, &all, 1, DType::i64, ReduceOp::max).wait();
    return all;
  }

  // Layout of each flat parameter (one per dtype), for state dicts, tests and tools.
  std::vector<const FlatParamLayout*> layouts() const {
    std::vector<const FlatParamLayout*> out;
    for (auto& fp : group_.flat()) out.push_back(&fp.layout);
    return out;
  }

 private:
  template <class Exclude>
  Sharded(Module& module, detail::UnitGroups unit_groups, detail::DeviceRef device, UnitOptions options, Exclude)
      : UnitBase(std::move(options.fqn), unit_groups.world.rank(), ModuleId::of(module).address,
                 ModuleId::of(module).type),
        buffers_(device),
        group_(unit_groups, device) {
    std::vector<detail::CollectedParam> params;
    std::vector<detail::CollectedBuffer> buffers;
    const detail::SkipSet skip{{options.skip_modules.begin(), options.skip_modules.end()},
                               {options.skip_parameters.begin(), options.skip_parameters.end()}};
    detail::collect_parameters<Exclude, precision::enabled>(module, fqn_, params, buffers, skip);
    detail::validate_collected(params, display_name(), rank_, device.id(), static_cast<bool>(options.init));
    for (auto& p : params) storage_.push_back({detail::storage_key(p), p.info.fqn});
    const auto aliases = detail::take_ties(params, display_name(), rank_);
    std::int64_t elements = 0;  // a tied tensor once
    for (const auto& p : params) elements += p.info.numel;
    if (group_.groups().shards_parameters && elements < options.persistence_threshold) group_.keep_unsharded();
    group_.build(params, aliases);
    detail::Fingerprint f;
    f.add(fqn_);
    f.add(groups());
    group_.add_to(f);
    detail::check_same_across_ranks(group_.groups().world, f, [&] {  // built only on a mismatch
      return "unit '" + std::string(display_name()) + "'";
    }, [&] { return group_.describe() + " (" + groups() + ")"; });
    detail::DeferredStorage deferred(device);  // what deferred init binds, freed however this ends
    if (options.init)
      detail::run_deferred_init(options.init, options.check_init_agrees, deferred, params, buffers,
                                group_.groups().world, device, display_name(), rank_);
    if (options.sync_module_states) broadcast_from_rank0(params, buffers);
    // Copy everything first; rebind the engine's tensors (which frees their storage) only
    // once nothing can fail, so a failed construction loses no data and leaks nothing (the
    // members free their copies).
    group_.copy_shards(params);
    buffers_.copy(buffers, buffer_cast_dtype());
    all_buffers_ = std::move(buffers);
    for (auto& b : all_buffers_) buffer_views_.push_back({fqn_, b.fqn, b.shape, b.dtype, b.numel});
    deferred.release();  // the shard is copied: one unit's full parameters at most, and only until here
    if (!options.defer_take_over) take_over();
  }

  void begin_recompute() {
    uses_.recompute_from = state_;
    unshard();  // a no-op inside the unit's backward, where the parameters are unsharded already
    state_ = TrainingState::FORWARD;
    compute_begin_ = now_if_traced();
  }
  void end_recompute() {
    record_compute("recompute");
    const TrainingState back = *std::exchange(uses_.recompute_from, std::nullopt);
    if (back != TrainingState::BACKWARD_PRE) {  // gathered for it: freed as after any forward
      if (strategy::reshard_after_forward) release_unsharded();
      else kept_ = true;
    }
    state_ = back;
  }

  // Reduces the gradient accumulated over this pass's backward entries; returns whether
  // the reduction completed inside the call.
  bool start_reduction() {
    uses_.reduced();
    const auto plan = gradient_plan();
    const bool inline_done = group_.start_reductions(grad_is_zero_, plan);
    if (plan == detail::GradientPlan::reduce) grad_is_zero_ = false;  // the others leave it as it was
    if (after_hook_ == GradientAfterHook::free) group_.point_views_at_gradients(views_, params_);  // allocated now
    // Final once this reduction completes: sync on and nothing of it deferred.
    hook_due_ = grad_hook_ && sync_.requires_sync && plan == detail::GradientPlan::reduce;
    return inline_done;
  }

  detail::GradientPlan gradient_plan() const {
    if (!sync_.requires_sync && sync_.mode == GradientSyncMode::keep_unsharded) return detail::GradientPlan::keep_unsharded;
    const bool all_reduces_shards = group_.groups().shards_parameters && group_.groups().replicate_size > 1;
    if (all_reduces_shards && !sync_.requires_all_reduce) return detail::GradientPlan::reduce_partial;
    return detail::GradientPlan::reduce;
  }

  // The unit's gradient is final: the engine's hook, then (GradientAfterHook::free) the
  // gradient freed, also when the hook throws.
  void run_grad_hook() {
    hook_due_ = false;
    if constexpr (offload) group_.device().synchronize();  // the copy into the host-space gradient is complete
    auto after = [this] {
      if (after_hook_ != GradientAfterHook::free) return;
      group_.release_shard_grads();
      grad_is_zero_ = true;
      group_.point_views_at_gradients(views_, params_);
    };
    try {
      grad_hook_(*this);
    } catch (...) {
      after();
      throw;
    }
    after();
  }

  static std::optional<DType> buffer_cast_dtype() {
    if constexpr (precision::enabled) return precision::buffer;
    else return std::nullopt;  // without mixed precision buffers stay the engine's
  }

  void broadcast_from_rank0(const std::vector<detail::CollectedParam>& params,
                            const std::vector<detail::CollectedBuffer>& buffers) {
    const auto& world = group_.groups().world;
    for (auto& p : params)
      if (p.info.numel > 0) {
        void* data = const_cast<void*>(p.data);
        world.broadcast(data, data, static_cast<std::size_t>(p.info.numel), p.dtype, 0).wait();
      }
    for (auto& b : buffers)
      if (b.numel > 0) world.broadcast(b.data, b.data, static_cast<std::size_t>(b.numel), b.dtype, 0).wait();
  }

  void unshard() {
    group_.unshard(waiter());
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }
  }

  void release_unsharded() {
    group_.release_unsharded();
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }  // gathered ahead, never used
    kept_ = false;
  }

  // ---- tracing: one pointer test when off ----
  Trace* trace() const { return order_ ? order_->trace : nullptr; }
  detail::TracedWait waiter() const { return {trace(), display_name()}; }
  Trace::Clock::time_point now_if_traced() const { return trace() ? Trace::Clock::now() : Trace::Clock::time_point{}; }
  void record_compute(const char* pass) {
    Trace* t = trace();
    if (t && compute_begin_ != Trace::Clock::time_point{})  // not when tracing began mid-pass
      t->add(std::string(pass).append(" ").append(display_name()), pass, Trace::Lane::compute, compute_begin_, Trace::Clock::now());
  }

  detail::BufferCopies buffers_;
  FlatParamGroup<config> group_;
  bool prefetched_ = false;  // gathered ahead of its hook, counted by the order
  bool kept_ = false;        // gathered in a forward and kept for this unit's backward
  bool grad_is_zero_ = true;  // nothing reduced into the sharded gradient since zero_grad
  bool hook_due_ = false;     // the post-accumulate-grad hook runs once the reduction completes
  GradientSync agreed_sync_;  // the settings every rank last agreed on (the defaults at first)
  bool summon_holds_nothing_ = false;  // a rank0_only summon on a rank other than 0
  bool summon_checks_writeback_ = true;
  Trace::Clock::time_point compute_begin_{};
  std::vector<ShardView> views_;
  std::vector<ParamView> params_;
  std::vector<detail::CollectedBuffer> all_buffers_;
  std::vector<BufferView> buffer_views_;
};

}  // namespace fsdp
