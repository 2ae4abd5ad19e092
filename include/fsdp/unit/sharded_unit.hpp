#pragma once
// fsdp::detail::ShardedUnit: all of a unit (fsdp::Sharded) but the walk of its module's
// subtree: the hooks' state machine, the unit's state-dict interface, its construction from
// what the module visit collected. Not a template: it reads its policies as values
// (PolicyConfig, fsdp/unit/detail/flat_param_rules.hpp), so it compiles once, whatever the
// module types and policy configurations an engine uses; Sharded<Module, Ps...> checks the
// policies as types and derives from it.
// Here: the state machine; the construction path is in fsdp/unit/unit_setup.hpp, the
// summon's gathers and writeback check in fsdp/unit/summon_full_params.hpp, the
// post-accumulate-grad hook in fsdp/unit/detail/post_grad_hook_slot.hpp, the hooks' bodies in
// fsdp/unit/sharded_hooks.hpp, which includes this header (include that one: it is the whole unit).
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/unit/detail/buffer_copies.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/unit/summon_full_params.hpp"
#include "fsdp/unit/detail/take_over.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/unit/unit_setup.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/unit/flat_param_group.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/unit/unit.hpp"
#include "fsdp/unit/execution_order_impl.hpp"  // ExecutionOrder's calls into units
#include "fsdp/unit/shard_options.hpp"

namespace fsdp::detail {

class ShardedUnit : public Unit {
 public:
  // The group hands the engine's parameters back empty and frees its storage as it is
  // destroyed; the buffer copies are handed back here.
  ~ShardedUnit() override { buffers_.unbind_and_release(); }

  UnitConfig config() const override {
    UnitConfig c;
    c.fqn = fqn_;
    c.policies = policies_;
    c.mesh = mesh_shape();
    c.persistence_threshold = persistence_threshold_;
    c.local_gradients = local_gradients_;
    c.shard_layout = shard_layout_;
    c.sync_module_states = sync_module_states_;
    c.deferred_parameters = deferred_params_;
    c.kept_unsharded = kept_unsharded();
    c.reshard = reshard_;
    c.sync = sync_;
    c.post_accumulate_grad_hook = has_post_accumulate_grad_hook();
    c.after_hook = gradient_after_hook();
    for (const Unit* u : forward_prefetch()) c.units_to_forward_prefetch.push_back(u->fqn());
    for (const Unit* u : backward_prefetch()) c.units_to_backward_prefetch.push_back(u->fqn());
    return c;
  }

  // The hooks below run their bodies, which fsdp/unit/sharded_hooks.hpp defines (*_body,
  // declared below). Each virtual function is defined here, in the class: one that were not
  // would be the class's key function, and every file that includes the hooks' definitions
  // (fsdp/fsdp.hpp) would compile the vtable and every virtual function, at -O2 about 5 s,
  // even a file that shards nothing.
  // A unit may be entered several times per pass (fsdp/unit/detail/unit_uses.hpp). A
  // recomputed forward is not part of the recorded order, and inside the unit's own
  // backward it needs no all-gather.
  void pre_forward() override { pre_forward_body(); }

  void post_forward() override { post_forward_body(); }

  void pre_backward() override { pre_backward_body(); }

  void post_backward() override { post_backward_body(); }

  void finish_backward() override { finish_backward_body(); }

  void reshard() override {
    HookScope scope(*this, "reshard");
    expect({TrainingState::IDLE}, "reshard");
    expect_taken_over("reshard");
    release_unsharded();
    uses_.end_forward_pass();
  }

  // Also frees what gradient accumulation kept (unsharded gradients, deferred sums).
  using Unit::zero_grad;

  std::span<const ShardView> shards() const override { return views_; }
  std::span<const ParamView> parameters() const override { return params_; }
  std::span<const BufferView> buffers() const override { return buffer_views_; }
  void* full_parameter(std::size_t i) const override {
    if (state_ != TrainingState::SUMMON_FULL_PARAMS)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": full_parameter('", params_.at(i).fqn,
                   "') needs the unit summoned (summon_full_params), but it is ", name_of(state_));
    if (summon_holds_nothing_)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": full_parameter('", params_.at(i).fqn,
                   "'): the summon is rank0_only, so only rank 0 holds full parameters");
    return group_.full_parameter(i);
  }

  // Layout of each flat parameter (one per dtype), for state dicts, tests and tools
  // (detail::internals(unit).layouts() on any unit).
  std::vector<const FlatParamLayout*> layouts() const override {
    std::vector<const FlatParamLayout*> out;
    for (auto& fp : group_.flat()) out.push_back(&fp.layout);
    return out;
  }

 protected:
  // The unit's internals (detail::UnitInternals, reached with detail::internals(unit)):
  // what the root, the execution order, checkpoints and clipping call; not on a typed unit.
  int world_size() const override { return group_.groups().world.size(); }
  // Switching to GradientAfterHook::free frees the sharded gradient now (a sum no_sync
  // kept in it stays, as the kept unsharded gradient); keep allocates it again (zeroed)
  // where it was freed, first, so that running out of memory there changes nothing.
  void check_grad_hook() const override { expect_taken_over("set_post_accumulate_grad_hook"); }
  void install_grad_hook(PostAccumulateGradHook hook, GradientAfterHook after) override {
    expect({TrainingState::IDLE}, "set_post_accumulate_grad_hook");
    check_grad_hook();
    const bool freed = grad_hook_.frees_gradient();
    const bool frees = detail::PostGradHookSlot::after_of(hook, after) == GradientAfterHook::free;
    if (!frees) {
      group_.ensure_shard_grads();
      group_.point_views_at_gradients(views_, params_);
    }
    grad_hook_.set(std::move(hook), after);
    if (frees && !freed) free_shard_grads();
  }

  // Full parameters in their own (master) dtype, and buffers in theirs: what FSDP's
  // summon_full_params and state dicts show, whatever the mixed precision.
  void begin_summon_full_params(const SummonOptions& options) override {
    expect({TrainingState::IDLE}, "summon_full_params");
    expect_taken_over("summon_full_params");
    detail::check_summon_options(options, grad_hook_.frees_gradient(), display_name(), rank_);
    release_unsharded();  // a compute-dtype copy kept since forward is not what is asked for
    summon_holds_nothing_ = detail::gather_for_summon(group_, options, rank_, waiter(), tag(TagPhase::summon));
    summon_checks_writeback_ = options.check_writeback;
    buffers_.show_master(true);
    state_ = TrainingState::SUMMON_FULL_PARAMS;
  }

  void end_summon_full_params(bool writeback) override {
    expect({TrainingState::SUMMON_FULL_PARAMS}, "end of summon_full_params");
    if (writeback) check_storage("the end of summon_full_params(writeback)");
    if (summon_checks_writeback_) detail::check_summon_end(group_, *this, writeback, rank_, [this] { discard_summon(); });
    if (writeback) group_.write_back();
    group_.release_summoned_gradients();
    buffers_.show_master(false, writeback);
    release_unsharded();
    state_ = TrainingState::IDLE;
  }

  // Whether ShardOptions::persistence_threshold kept this unit's parameters unsharded.
  bool kept_unsharded() const { return group_.kept_unsharded(); }
  std::string groups() const override { return detail::describe_groups(group_.mesh_groups()); }
  MeshShape mesh_shape() const override { return {group_.mesh_groups().replicate_size, group_.mesh_groups().shard_size}; }
  void prefetch(detail::ZeroBatch* zeros) override { prefetch_body(zeros); }
  // The unit's gradient is final once its reduction completes: the engine's hook runs.
  void finish_reduction() override { finish_reduction_body(); }
  void abandon_step() override { abandon_step_body(); }
  std::string step_state() const override { return (grad_is_zero_ ? "zero " : "reduced ") + group_.gradient_state(); }
  void set_grad_is_zero(bool zero) override { grad_is_zero_ = zero; }
  bool settings_unagreed() const override { return sync_ != agreed_sync_ || reshard_ != agreed_reshard_; }
  void zero_grad(detail::ZeroBatch& batch) override {
    HookScope scope(*this, "zero_grad");
    expect({TrainingState::IDLE}, "zero_grad");
    group_.zero_grad(batch);
    grad_is_zero_ = true;
  }
  void discard_summon() {  // a summon's end that writes nothing back
    buffers_.show_master(false);
    group_.release_summoned_gradients();
    release_unsharded();
    state_ = TrainingState::IDLE;
  }
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
  bool all_ranks_agree(bool ok) const override { return detail::all_ranks_agree(group_.groups().world, ok); }
  bool all_ranks_agree(bool ok, TagPhase step, std::shared_ptr<const std::string> note) const override {
    CollectiveTag tag;  // unit 0, pass 0: ranks may count passes differently after a failure
    tag.phase = step;
    tag.names = order_;  // how a backend names a peer's unit in a mismatch (null outside a model)
    tag.note = std::move(note);  // why, quoted in a peer's mismatch message
    return detail::all_ranks_agree(group_.groups().world, ok, &tag);
  }
  std::int64_t max_over_ranks(std::int64_t v) const override { return detail::max_over_ranks(group_.groups().world, v); }
  // Unit::gradient: where the gradient the library owns of that parameter is shown now.
  GradientView gradient_of(const void* tensor) override {
    const auto* found = group_.find_parameter(tensor);
    if (!found)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": gradient(): the tensor at ", tensor,
                   " is not a parameter of this unit; pass the tensor its module visited (ShardedModel::gradient "
                   "finds the unit)");
    const FlatParam& fp = group_.flat()[found->flat];
    const ParamInfo& info = fp.layout.params()[found->index];
    if (found->binding->owns_grad())
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": gradient('", info.fqn, "'): the parameter was ",
                   "visited with a gradient tensor of its own (f(name, param, grad)), which the engine writes; ",
                   "gradient() is for parameters visited as f(name, param), whose gradient the library owns");
    if (!fp.grad_shown)
      detail::fail("unit '", display_name(), "' on rank ", rank_, ": gradient('", info.fqn, "') outside its backward ",
                   "(the unit is ", name_of(state_),
                   state_ == TrainingState::SUMMON_FULL_PARAMS
                       ? (summon_holds_nothing_ ? ", in a rank0_only summon: only rank 0 holds the gradients"
                                                : ", summoned without with_grads")
                       : "",
                   "): call it between the unit's pre_backward and post_backward, or inside summon_full_params "
                   "with with_grads");
    return {detail::shown_gradient(fp, found->index), fp.grad_shown_dtype, info.shape, info.numel, info.fqn, fqn_, rank_};
  }
  std::vector<const void*> parameter_tensors() const override { return group_.parameter_tensors(); }

  // Setup's last step (detail::internals, ShardedModel::take_over): not on a typed unit.
  // All or nothing for this unit (fsdp/unit/detail/take_over.hpp).
  void take_over() override {
    ShardedUnit* self = this;
    detail::take_over_together(rank_, std::span(&self, 1));
  }
  // Buffers first, so that the group counts as taken over only once every tensor is.
  bool take_over(detail::TakeOverLog& log) override {
    if (group_.took_over()) return false;
    log.unit(display_name());
    buffers_.show_cast(log);
    group_.take_over(fqn_, views_, params_, log);
    return true;
  }
  // Back to before take_over(log): nothing appended, nothing to unbind at destruction.
  void forget_take_over() noexcept override {
    buffers_.forget_shown();
    group_.forget_take_over();
    views_.clear();
    params_.clear();
  }
  // Writes once: the values are released once written.
  void finish_take_over() override {
    rank0_values_.write_engine_buffers([&](const void* tensor) { return buffers_.has_copy(tensor); });
  }

  // Built by Sharded<Module, Ps...> (and fsdp::shard's detail::make_unit, and the planner's
  // PlanUnit), which hands over its policies as values and by name
  // (`settings`, compared across ranks), how to walk its module (`visit`) and the module's
  // identity; nothing below depends on the module's type.
  ShardedUnit(const PolicyConfig& policies, const Settings& settings, ModuleId module, const ModuleVisit& visit,
              UnitGroups unit_groups, DeviceRef device, std::string fqn, const ShardOptions& options, const UnitInit& init)
      : Unit(std::move(fqn), unit_groups.world.rank(), module.address, module.type),
        adapter_(visit.adapter),
        policies_(policies),
        buffers_(device),
        rank0_values_(device),
        group_(unit_groups, device, policies.precision, policies.shard_space()) {
    // Copy everything first; rebind the engine's tensors (which frees their storage) only
    // once nothing can fail, so a failed construction loses no data and leaks nothing (the
    // members free their copies).
    auto setup = detail::set_up_unit(visit, group_, buffers_, rank0_values_, options, init, *this, settings,
                                     policies.buffer_cast());
    storage_ = std::move(setup.storage);
    all_buffers_ = std::move(setup.buffers);
    for (auto& b : all_buffers_) buffer_views_.push_back({fqn_, b.fqn, b.shape, b.dtype, b.numel});
    reshard_.after_forward = policies.reshard_after_forward;
    agreed_reshard_ = reshard_;
    persistence_threshold_ = options.persistence_threshold;
    local_gradients_ = options.local_gradients;
    shard_layout_ = options.shard_layout;
    group_.set_gradient_divide_factor(divide_factor(reshard_, local_gradients_));  // 1 under LocalGradients::sum
    sync_module_states_ = options.sync_module_states;
    deferred_params_ = std::move(setup.deferred);
    if (!options.defer_take_over) take_over();
  }

 private:
  // The hooks' bodies (fsdp/unit/sharded_hooks.hpp).
  void pre_forward_body();
  void post_forward_body();
  void pre_backward_body();
  void post_backward_body();
  void prefetch_body(detail::ZeroBatch* zeros);
  void finish_reduction_body();
  void finish_backward_body();
  void abandon_step_body();

  // Inside a model: the explicit prefetch list when set, else (`follow_order`: the policy
  // prefetches here) the next unit of the recorded order.
  // `zeros` (may be null): this unit's pending zeroing, for the gathers' casts to do too.
  void prefetch_ahead(const std::vector<Unit*>& units, Pass pass, bool follow_order, detail::ZeroBatch* zeros = nullptr) {
    if (!order_) return;
    if (!units.empty()) for (auto* u : units) fsdp::detail::internals(*u).prefetch(zeros);
    else if (follow_order) prefetch_next(pass, zeros);
  }
  void prefetch_next(Pass pass, detail::ZeroBatch* zeros = nullptr) {
    if (auto* next = order_ ? order_->next(pass) : nullptr) fsdp::detail::internals(*next).prefetch(zeros);  // null outside a model
  }

  // A unit built with ShardOptions::defer_take_over computes nothing until its model took
  // the engine's tensors over: they still hold the engine's own storage, and under
  // sync_module_states its buffers not yet rank 0's values. So its hooks (but zero_grad and
  // finish_backward, which touch only its own gradients), summon and the hook setter are
  // refused, a misuse that changes nothing, and nothing prefetches it.
  void expect_taken_over(const char* hook) const {
    if (group_.took_over()) return;
    misuse_ = true;
    detail::fail("unit '", display_name(), "' on rank ", rank_, ": ", hook, " before the unit took the engine's ",
                 "tensors over (it was built with ShardOptions::defer_take_over); call ShardedModel::take_over() first");
  }

  // The engine's parameter tensors still view what the unit bound them to; a tensor whose
  // storage the engine replaced would have its values dropped (one call per parameter).
  void check_storage(const char* where) {
    const std::string moved = group_.moved_storage();
    if (moved.empty()) return;
    if (state_ == TrainingState::SUMMON_FULL_PARAMS) discard_summon();
    detail::fail("unit '", display_name(), "' on rank ", rank_, ": at ", where, ", parameter '", moved,
                 "' no longer views the storage fsdp bound it to: the engine replaced its storage, and values "
                 "put there would be lost. Write into the tensor's own storage, inside summon_full_params(writeback) "
                 "or through a state dict load");
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
    if (back != TrainingState::BACKWARD_PRE) reshard_after_forward(!reshard_.after_forward);  // gathered for it
    state_ = back;
  }

  // After forward: keep the parameters whole (for this unit's next pre_backward only), keep
  // this rank's chunk of them (partial resharding), or free them.
  void reshard_after_forward(bool keep_whole) {
    if (!keep_whole) {
      if (!group_.reshards_partially()) return release_unsharded();
      group_.reshard_to_post_forward();
    }
    kept_ = true;
  }

  void check_post_forward_group(detail::CommRef group) const override {
    group_.check_post_forward_group(group, display_name());
  }
  void set_post_forward_group(std::optional<detail::CommRef> group, bool reshard) override {
    group_.set_post_forward_group(group, display_name());
    reshard_.after_forward = reshard;
    reshard_.post_forward_ranks = group_.reshards_partially() ? group_.post_forward_size() : 0;
  }

  // Reduces the gradient accumulated over this pass's backward entries; returns whether
  // the reduction completed inside the call.
  bool start_reduction() {
    uses_.reduced();
    const auto plan = detail::plan_gradient(sync_, group_.groups());
    const bool inline_done = group_.start_reductions(grad_is_zero_, plan, tag(TagPhase::reduce));
    if (plan == detail::GradientPlan::reduce) grad_is_zero_ = false;  // the others leave it as it was
    if (grad_hook_.frees_gradient()) group_.point_views_at_gradients(views_, params_);  // allocated now
    grad_hook_.arm(detail::gradient_is_final(sync_, plan));  // the hook runs once it completes
    return inline_done;
  }

  void free_shard_grads() {
    group_.release_shard_grads();
    grad_is_zero_ = true;
    group_.point_views_at_gradients(views_, params_);
  }

  // The tag of the collective this unit issues now (fsdp/core/collective_tag.hpp): an
  // all-gather's says forward or backward, by the model's pass. None outside a model.
  const CollectiveTag* tag(TagPhase phase) {
    if (!order_) return nullptr;
    tag_ = order_->tag(order_index_, phase);
    return &tag_;
  }

  void unshard() {
    group_.unshard(waiter(), tag(TagPhase::forward));
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }
  }

  void release_unsharded() {
    group_.release_unsharded();
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }  // gathered ahead, never used
    kept_ = kept_after_backward_ = false;
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

  // The model's module adapter (fsdp::module_adapter; empty without one), its only owner
  // besides the engine. First, so it goes last: the members below rebind and hand back
  // tensors it may own, and call its hooks (ReboundHook holds it by pointer).
  std::shared_ptr<void> adapter_;
  const PolicyConfig policies_;
  std::int64_t persistence_threshold_ = 0;  // ShardOptions::persistence_threshold, for config()
  bool sync_module_states_ = false;         // how it was built, for config()
  LocalGradients local_gradients_ = LocalGradients::mean;  // ShardOptions::local_gradients
  ShardLayout shard_layout_;  // ShardOptions::shard_layout, for config()
  std::vector<std::string> deferred_params_;
  detail::BufferCopies buffers_;
  detail::RankZeroValues rank0_values_;  // sync_module_states: buffer values until the take-over
  FlatParamGroup group_;
  CollectiveTag tag_;  // what tag() hands out
  bool prefetched_ = false;  // gathered ahead of its hook, counted by the order
  bool kept_ = false;        // gathered in a forward and kept (whole or partly) for this unit's backward
  bool kept_after_backward_ = false;  // kept whole by a backward for the next forward
  bool grad_is_zero_ = true;  // nothing reduced into the sharded gradient since zero_grad
  GradientSync agreed_sync_;  // the settings every rank last agreed on (the defaults at first)
  ReshardSettings agreed_reshard_;
  bool summon_holds_nothing_ = false;  // a rank0_only summon on a rank other than 0
  bool summon_checks_writeback_ = true;
  Trace::Clock::time_point compute_begin_{};
  std::vector<ShardView> views_;
  std::vector<ParamView> params_;
  std::vector<detail::CollectedBuffer> all_buffers_;
  std::vector<BufferView> buffer_views_;
};

}  // namespace fsdp::detail

