#pragma once
// Unit: what the root and the engine see of a sharded unit, whatever its module type
// and policies: the lifecycle hooks, the training state, and the flat shards the
// optimizer steps on.
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <typeindex>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/unit/detail/post_grad_hook_slot.hpp"
#include "fsdp/unit/detail/unit_uses.hpp"
#include "fsdp/unit/detail/zero_batch.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/unit/execution_order.hpp"
#include "fsdp/unit/gradient_view.hpp"
#include "fsdp/policy/configuration.hpp"
#include "fsdp/policy/gradient_sync.hpp"
#include "fsdp/policy/post_accumulate_grad_hook.hpp"
#include "fsdp/policy/reshard_settings.hpp"
#include "fsdp/unit/run_time_settings.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/unit/unit_views.hpp"

namespace fsdp {

namespace detail { class TakeOverLog; }

// How summon_full_params shows the full parameters (FSDP's arguments of the same names).
struct SummonOptions {
  bool writeback = false;        // edits are kept: each rank writes its own slice back to its shard
  bool rank0_only = false;       // only world rank 0 keeps them; the others take part in the gathers
  bool offload_to_host = false;  // kept in host memory, so the device holds one unit's at a time
  // At the end, agree across ranks on the writeback flag (one 8-byte all-gather per unit)
  // and, with writeback, hash the edited parameters and buffers (a pass over the unit's
  // full parameters and one more 8-byte all-gather); fail on every rank, writing nothing
  // back, when ranks differ.
  bool check_writeback = true;
  // The reduced gradients whole as well, in the engine's gradient tensors (FSDP's
  // with_grads): "are my gradients right?" after finish_backward. Read-only: edits to them
  // are not kept. Gradients kept unsharded by gradient accumulation are not included.
  bool with_grads = false;
};
class ShardedModel;

class Unit;

namespace detail {

// What the root (ShardedModel), checkpoints, clipping and the other units of a model need
// of a unit, and an engine does not call: Unit inherits it privately, so it is no part
// of the type an engine holds; detail::internals(unit) reaches it.
class UnitInternals {
 public:
  virtual ~UnitInternals() = default;

  virtual void zero_grad(ZeroBatch& batch) = 0;
  // buffers()[i]'s values in buffers()[i].dtype. While summoned: the storage the engine's
  // tensor shows (write to it there). Otherwise, under MixedPrecision with a cast Buffer
  // dtype: the unit's master copy, refreshed from the cast copy the engine computes with
  // (read it only: the next refresh overwrites it).
  virtual void* buffer_data(std::size_t i) const = 0;
  // IDLE only: sets buffers()[i] from `values` (its dtype, numel elements, host or device
  // memory), in the engine's tensor and in any copy MixedPrecision keeps. What loads use,
  // with no summon (no gather) needed.
  virtual void load_buffer(std::size_t i, const void* values) = 0;
  // Its Device's id(): whether its shards are in memory the host can address (cpu).
  virtual DeviceId device_id() const = 0;
  // Copies bytes through the unit's Device: either side may be host or device memory.
  virtual void copy_bytes(void* dst, const void* src, std::size_t bytes) const = 0;
  // All-gathers an array laid out like shards()[shard] (its numel valid elements of
  // `dtype`, in the shard's memory space; for example an optimizer moment) into
  // `full_host`, host memory for the flat parameter's parameters back to back, in the order
  // parameters() lists them (padding and a layout's gaps left out). A collective over the
  // shard group.
  virtual void gather_like_shard(std::size_t shard, const void* mine, void* full_host, DType dtype) const = 0;
  // Whether `ok` holds on every rank of the world (a collective): so that no rank goes on
  // to change state, or to commit a file, that another rank has found wrong.
  virtual bool all_ranks_agree(bool ok) const = 0;
  // The same for one of the model's own steps (`step`: TagPhase::take_over, abort_step),
  // tagged with it (unit and pass 0), so that a rank that meets it in another collective
  // reads which step its peer was in, and (`note`, may be null; CollectiveTag::note) why.
  virtual bool all_ranks_agree(bool ok, TagPhase step, std::shared_ptr<const std::string> note) const = 0;
  // The largest `v` of any rank of the world (a collective): how one rank's value (a
  // random token, a size) reaches every rank.
  virtual std::int64_t max_over_ranks(std::int64_t v) const = 0;
  // Whether this rank's shards are the copy a sharded checkpoint saves: replicas (NoShard,
  // the replicate dimension of HybridShard) hold the same elements, and one copy is saved.
  virtual bool saves_shards() const = 0;
  // The process groups the unit uses, in words; every unit of a model must use the same.
  virtual std::string groups() const = 0;
  // Those groups as a mesh: {replicate group size, shard group size} (the model's, also
  // for a unit kept unsharded by the persistence threshold).
  virtual MeshShape mesh_shape() const = 0;
  // The number of ranks of its world (shard group size x replicate group size).
  virtual int world_size() const = 0;
  // take_over in three steps, for ShardedModel, which takes over all of its units as one:
  // rebind into `log` (false: taken over before, nothing done), which a throwing rebind
  // rolls back, every unit's tensors; after a failure, forget_take_over (the log gave the
  // tensors back); once the log is committed, finish_take_over (writes rank 0's buffer
  // values under sync_module_states).
  virtual bool take_over(TakeOverLog& log) = 0;
  virtual void forget_take_over() noexcept = 0;
  virtual void finish_take_over() = 0;
  // Completes setup of one unit alone: points the engine's tensors at the unit's storage
  // (their own storage is released). The constructor calls it unless
  // ShardOptions::defer_take_over; units built with it deferred are taken over together by
  // ShardedModel::take_over (fsdp::shard does), so a failed shard leaves the model as it
  // was. A rebind that throws: an fsdp::Error, nothing of this unit taken over.
  virtual void take_over() = 0;

  // The module the unit manages: its address and type together (a module's first member
  // has the same address as the module itself); ShardedModel finds units by them.
  virtual const void* module_address() const = 0;
  virtual std::type_index module_type() const = 0;
  // Which hook last left by an exception (null: none since the last abort_step).
  virtual const char* failed_hook() const = 0;
  // Uses of the unit in the current pass (fsdp/unit/detail/unit_uses.hpp): forward entries
  // so far, and backward entries still expected before its gradient is reduced (-1: not
  // known, so at finish_backward).
  virtual int forward_entries() const = 0;
  virtual int backward_entries_left() const = 0;

  // Issues this unit's all-gather ahead of its own hook, if it is not unsharded yet.
  virtual void prefetch(ZeroBatch* zeros) = 0;  // zeros (may be null): for its cast to do too
  // Completes a reduction that post_backward left in flight (asynchronous backends).
  virtual void finish_reduction() = 0;
  // abort_step's local part: no collective.
  virtual void abandon_step() = 0;
  // Between steps: the gradient state a step captured into a CUDA graph replays from
  // (fsdp::CapturedStep compares it at every replay): "zero" or "reduced", then
  // FlatParamGroup::gradient_state().
  virtual std::string step_state() const = 0;
  // Sets what step_state's first word says: a captured step's host state follows its graph
  // (nothing ran at the capture; a replay does what the captured step did).
  virtual void set_grad_is_zero(bool zero) = 0;
  // Whether run-time settings changed since the ranks last agreed on them (the next
  // backward agrees again, a collective waited for on the host).
  virtual bool settings_unagreed() const = 0;
  // set_reshard_after_forward: `group` for a partial reshard, else whether to reshard. The
  // check refuses a group this unit cannot use, changing nothing (set calls it again).
  virtual void check_post_forward_group(CommRef group) const = 0;
  virtual void set_post_forward_group(std::optional<CommRef> group, bool reshard) = 0;
  // The layout of each flat parameter (one per dtype), for state dicts, tests and tools.
  virtual std::vector<const FlatParamLayout*> layouts() const = 0;
  // set_post_accumulate_grad_hook's work (fsdp/unit/run_time_settings.hpp): whether the
  // unit takes a hook now (refuses, changing nothing), and the change.
  virtual void check_grad_hook() const = 0;
  virtual void install_grad_hook(PostAccumulateGradHook hook, GradientAfterHook after) = 0;
  // Summon without a scope (Unit::summon_full_params and ShardedModel's hold one): IDLE ->
  // SUMMON_FULL_PARAMS, a collective; the end keeps the edits with writeback.
  virtual void begin_summon_full_params(const SummonOptions& options) = 0;
  virtual void end_summon_full_params(bool writeback) = 0;
  // Its rank in its world, for messages.
  virtual int rank() const = 0;
  // Unit::gradient's work: the gradient the library owns of the parameter whose engine
  // tensor is at `tensor` (an error outside the unit's backward, for a parameter visited
  // with its own gradient tensor, and for a tensor that is none of the unit's parameters).
  virtual GradientView gradient_of(const void* tensor) = 0;
  // The engine tensors of its parameters (tied names included): how ShardedModel finds
  // the unit of a parameter.
  virtual std::vector<const void*> parameter_tensors() const = 0;

 protected:
  UnitInternals() = default;
};

UnitInternals& internals(Unit& unit);
const UnitInternals& internals(const Unit& unit);
// What the unit does with its sharded gradient after its post-accumulate-grad hook, without
// building its whole config() (clip_grad_norm asks on every call).
GradientAfterHook after_hook_of(const Unit& unit);

}  // namespace detail

namespace detail {
// A scope around one of a unit's hook pairs (Unit::ForwardScope, Unit::BackwardScope): Begin
// runs when it is made, End when it ends, unless it is left by an exception (a collective
// during unwinding could only make things worse): then End::left_by_exception marks the
// step failed, so that the next call asks for abort_step instead of reporting the state
// or order the step was left in. Moves; a default-constructed or moved-from scope ends
// nothing.
template <class Begin, class End>
class HookPairScope {
 public:
  HookPairScope() noexcept : u_(nullptr) {}
  HookPairScope(HookPairScope&& o) noexcept : u_(std::exchange(o.u_, nullptr)), exceptions_(o.exceptions_) {}
  HookPairScope& operator=(HookPairScope&& o) noexcept(false) {
    if (this != &o) {
      close();
      u_ = std::exchange(o.u_, nullptr);
      exceptions_ = o.exceptions_;
    }
    return *this;
  }
  HookPairScope(const HookPairScope&) = delete;
  HookPairScope& operator=(const HookPairScope&) = delete;
  ~HookPairScope() noexcept(false) { close(); }

 protected:
  template <class U>
  explicit HookPairScope(U& u) : u_(&u) { Begin{}(u); }

 private:
  void close() {
    Unit* u = std::exchange(u_, nullptr);
    if (!u) return;
    const int now = std::uncaught_exceptions();
    if (now == exceptions_) End{}(*u);
    else if (now > exceptions_) End::left_by_exception(*u);
  }
  Unit* u_;
  int exceptions_ = std::uncaught_exceptions();
};
}  // namespace detail

class Unit : private detail::UnitInternals, public RunTimeSettings<Unit> {
  friend detail::UnitInternals& detail::internals(Unit&);
  friend const detail::UnitInternals& detail::internals(const Unit&);
  friend GradientAfterHook detail::after_hook_of(const Unit&);
  friend class RunTimeSettings<Unit>;
  friend class RunTimeSettings<ShardedModel>;

 public:
  virtual ~Unit() = default;
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  // Hooks, in the order a training step calls them. Each checks the state first.
  virtual void pre_forward() = 0;    // IDLE -> FORWARD: all-gather; parameters become valid
  virtual void post_forward() = 0;   // FORWARD -> IDLE: free unsharded parameters
  virtual void pre_backward() = 0;   // IDLE -> BACKWARD_PRE: all-gather; zeroed gradients bound
  virtual void post_backward() = 0;  // BACKWARD_PRE -> BACKWARD_POST: reduce-scatter, free
  // Called by the root once per backward, after every unit's post_backward; -> IDLE.
  virtual void finish_backward() = 0;
  // IDLE only: the sharded gradient becomes zero, kept accumulation freed. The zeroing
  // joins a batch flushed as one call (ShardedModel::zero_grad: one for all its units).
  void zero_grad() {
    Unit* u = this;
    detail::zero_grads(std::span<Unit* const>(&u, 1), mark_failed_in_zero_grad);
  }
  // IDLE only: frees unsharded parameters kept after forward for backward (ShardGradOp
  // keeps every unit's; the unit backward starts with keeps its own). After a forward-only
  // pass, such as evaluation, call this to free them (the next forward regathers anyway).
  virtual void reshard() = 0;

  virtual std::span<const ShardView> shards() const = 0;
  // Every parameter and buffer of the unit, in visit order (parameters grouped by dtype as
  // their flat shards are).
  virtual std::span<const ParamView> parameters() const = 0;
  virtual std::span<const BufferView> buffers() const = 0;
  // While summoned: the full parameters()[i], in its master dtype (writable when the summon
  // writes back; in host memory under offload_to_host). An error in any other state, and
  // on ranks other than 0 of a rank0_only summon.
  virtual void* full_parameter(std::size_t i) const = 0;
  // The unit's whole configuration: the policies it was built with and its run-time
  // settings as they are now (fsdp/policy/configuration.hpp; printable with to_string).
  virtual UnitConfig config() const = 0;

  // Recovery after an exception inside a step (a failed allocation, an engine error between
  // hooks, a hook that threw): frees what the step held (unsharded parameters, gradients,
  // collectives in flight, which are waited for and whose errors are dropped), discards the
  // step's gradients as zero_grad does, and returns the unit to IDLE. A collective over
  // the unit's world: every rank must call it, so no rank continues alone (a rank still in
  // another collective makes it an error on every rank). ShardedModel::abort_step does it
  // for every unit with one agreement.
  void abort_step() {
    abandon_step();
    agree_on_abort();
  }
  // Which units to prefetch, explicitly (FSDP2's set_modules_to_forward_prefetch /
  // _backward_prefetch): when set, these units are gathered at this unit's pre_forward /
  // pre_backward, instead of the next unit in the recorded order that the ForwardPrefetch
  // and BackwardPrefetch policies choose (with the list, when is pre_*, whatever the policy).
  void set_units_to_forward_prefetch(std::vector<Unit*> units) { forward_prefetch_ = std::move(units); }
  void set_units_to_backward_prefetch(std::vector<Unit*> units) { backward_prefetch_ = std::move(units); }

  // The run-time settings (gradient sync, resharding, the divide factor, the
  // post-accumulate-grad hook) are RunTimeSettings<Unit>'s, shared with ShardedModel
  // (fsdp/unit/run_time_settings.hpp). IDLE only.

  const std::string& fqn() const { return fqn_; }
  TrainingState state() const { return state_; }

  // The gradient of `param`, a parameter of this unit that the module visited as
  // f(name, param) (without a gradient tensor: the library owns its gradient), for engines
  // whose layers own no gradient tensors. Between this unit's pre_backward and
  // post_backward the engine writes into it as into a gradient tensor of its own: add (+=),
  // since it holds zeros or what gradient accumulation kept (docs/training_loop.md). Also
  // inside summon_full_params with with_grads (the reduced gradient, read only). An
  // fsdp::Error anywhere else, for a parameter visited with its own gradient tensor, and
  // for a tensor that is not a parameter of the unit. Found by fsdp::tensor_identity: the
  // tensor's address, or for a handle type what it points to (any copy of the handle).
  template <class T>
  GradientView gradient(const T& param) {
    static_assert(Tensor<T>, "fsdp: gradient(param) takes the parameter tensor the module visited (an fsdp::Tensor), "
                             "not a pointer to it or another object");
    return gradient_of(tensor_identity(param));
  }

 protected:
  // The internal overload, not public: named here only so that the public zero_grad()
  // above hides nothing (clang's -Woverloaded-virtual); protected, since a unit class
  // (detail::ShardedUnit) names both overloads of zero_grad with a using-declaration.
  using detail::UnitInternals::zero_grad;

 private:
  // Internals (detail::internals(unit)) that the unit answers itself.
  const void* module_address() const final { return module_; }
  std::type_index module_type() const final { return module_type_; }
  const char* failed_hook() const final { return failed_hook_; }
  int rank() const final { return rank_; }
  int forward_entries() const final { return uses_.forward_entries(); }
  int backward_entries_left() const final { return uses_.backward_left(); }

  struct BeginForward { void operator()(Unit& u) const { u.pre_forward(); } };
  struct EndForward {
    void operator()(Unit& u) const { u.post_forward(); }
    static void left_by_exception(Unit& u) noexcept { u.mark_failed("forward scope"); }
  };
  struct BeginBackward { void operator()(Unit& u) const { u.pre_backward(); } };
  struct EndBackward {
    void operator()(Unit& u) const { u.post_backward(); }
    static void left_by_exception(Unit& u) noexcept { u.mark_failed("backward scope"); }
  };

 public:
  // RAII around the engine's forward / backward of this unit (forward_scope(),
  // backward_scope()). A scope left by an exception skips post_forward / post_backward (a
  // collective during unwinding could only make things worse) and fails the step: the
  // next call on any unit of the model asks for abort_step(). Scopes move (a
  // moved-from scope ends nothing), and a default-constructed one is empty, for an engine
  // whose layer may or may not be a unit:
  //   fsdp::Unit::ForwardScope s;
  //   if (auto* u = sharded.find_unit_for(layer)) s = u->forward_scope();
  // Assigning to an open scope ends it after the new one has begun (the right side runs
  // first), so both units are whole for a moment: `s = {}` ends it first where that
  // matters. Do not keep scopes in a std::optional: its reset() and destructor are
  // noexcept, so a hook that throws there (a timeout, a lost peer) ends the process.
  class ForwardScope : public detail::HookPairScope<BeginForward, EndForward> {
   public:
    ForwardScope() = default;  // empty: ends nothing

   private:
    friend class Unit;
    explicit ForwardScope(Unit& u) : HookPairScope(u) {}
  };
  class BackwardScope : public detail::HookPairScope<BeginBackward, EndBackward> {
   public:
    BackwardScope() = default;  // empty: ends nothing

   private:
    friend class Unit;
    explicit BackwardScope(Unit& u) : HookPairScope(u) {}
  };
  // Parameters unsharded outside training (inspection, init, export): IDLE ->
  // SUMMON_FULL_PARAMS while it lives, a collective (summon_full_params(); SummonOptions).
  // Writeback with rank0_only is an error (the other ranks would have nothing to write
  // back). Left by an exception, it ends without writeback.
  class SummonScope {
   public:
    SummonScope() noexcept : u_(nullptr), writeback_(false) {}  // empty: ends nothing
    SummonScope(SummonScope&& o) noexcept
        : u_(std::exchange(o.u_, nullptr)), writeback_(o.writeback_), exceptions_(o.exceptions_) {}
    SummonScope& operator=(SummonScope&& o) noexcept(false) {
      if (this != &o) {
        close();
        u_ = std::exchange(o.u_, nullptr);
        writeback_ = o.writeback_;
        exceptions_ = o.exceptions_;
      }
      return *this;
    }
    SummonScope(const SummonScope&) = delete;
    SummonScope& operator=(const SummonScope&) = delete;
    ~SummonScope() noexcept(false) { close(); }

   private:
    friend class Unit;
    SummonScope(Unit& u, const SummonOptions& options) : u_(&u), writeback_(options.writeback) {
      u.begin_summon_full_params(options);
    }
    // Leaving by exception: reshard without writeback, so half-edited values are dropped.
    void close() {
      if (Unit* u = std::exchange(u_, nullptr)) u->end_summon_full_params(writeback_ && std::uncaught_exceptions() == exceptions_);
    }
    Unit* u_;
    bool writeback_;
    int exceptions_ = std::uncaught_exceptions();
  };

  [[nodiscard]] ForwardScope forward_scope() { return ForwardScope(*this); }
  [[nodiscard]] BackwardScope backward_scope() { return BackwardScope(*this); }
  [[nodiscard]] SummonScope summon_full_params(bool writeback = false) { return SummonScope(*this, {.writeback = writeback}); }
  [[nodiscard]] SummonScope summon_full_params(const SummonOptions& options) { return SummonScope(*this, options); }

 protected:
  // The FQN as messages and traces show it: "<root>" for the root.
  std::string_view display_name() const { return detail::display_name(fqn_); }
  // The settings as they are now; an engine reads them with config(). ShardedModel (a
  // friend) and the unit's own code use these.
  const std::vector<Unit*>& forward_prefetch() const { return forward_prefetch_; }
  const std::vector<Unit*>& backward_prefetch() const { return backward_prefetch_; }
  const GradientSync& gradient_sync() const { return sync_; }
  const ReshardSettings& reshard_settings() const { return reshard_; }
  bool has_post_accumulate_grad_hook() const { return grad_hook_.installed(); }
  GradientAfterHook gradient_after_hook() const { return grad_hook_.after(); }
  // The root's shared execution order; set when the unit joins a ShardedModel.
  void attach(ExecutionOrder* order) { order_ = order, order_index_ = order->add_unit(this); }
  // Each parameter's storage at setup, aliases of tied parameters included.
  std::span<const ParamStorage> param_storage() const { return storage_; }
  Unit(std::string fqn, int rank, const void* module, std::type_index type)
      : fqn_(std::move(fqn)), rank_(rank), module_(module), module_type_(type) {}
  void expect(std::initializer_list<TrainingState> states, std::string_view hook) const {
    expect_not_failed(hook);
    for (auto s : states)
      if (s == state_) return;
    misuse_ = true;
    // A step begun mid-step: besides a missing hook, an engine exception between hooks
    // (outside any scope, so unseen here) is a likely cause.
    const bool step_begun_mid_step =
        (hook == "pre_forward" || hook == "zero_grad") && state_ != TrainingState::SUMMON_FULL_PARAMS;
    detail::expect_state(state_, states, hook, fqn_, rank_,
                         step_begun_mid_step ? "a hook call is missing, or an exception left the last step between "
                                               "hooks and abort_step() was not called: call abort_step() "
                                               "(ShardedModel::abort_step) on every rank after catching it; "
                                               "docs/reliability.md, failed hooks"
                                             : "");
  }
  void expect_not_failed(std::string_view hook) const {
    if (!failed_hook_) return;
    misuse_ = true;
    // Where the step failed: this unit's hook or scope, another unit's of its model, or the
    // model's own call (failed_by_ null: finish_backward, abort_step).
    const std::string_view where = failed_hook_;
    const bool scope = where.ends_with(" scope");
    const std::string what = failed_by_ && failed_by_ != this
                           ? (scope ? "the " : "") + std::string(where) + " of unit '" + std::string(failed_by_->display_name()) + "'"
                           : (scope ? "its " : "") + std::string(where);
    detail::fail("unit '", display_name(), "' on rank ", rank_, ": ", hook, " called after ", what,
                 " left by an exception, and abort_step() was not called since; call abort_step() "
                 "(ShardedModel::abort_step) on every rank after catching it, before any other call "
                 "(docs/reliability.md, failed hooks)");
  }
  // Held by each hook: a hook left by an exception (other than a call in the wrong state,
  // which changes nothing) leaves the unit in a state only abort_step ends; its next hook
  // says so.
  class HookScope {
   public:
    HookScope(Unit& u, const char* hook) : u_(u), hook_(hook) { u_.misuse_ = false; }
    ~HookScope() {
      if (std::uncaught_exceptions() > exceptions_ && !u_.misuse_) u_.mark_failed(hook_);
    }
    HookScope(const HookScope&) = delete;
    HookScope& operator=(const HookScope&) = delete;

   private:
    Unit& u_;
    const char* hook_;
    int exceptions_ = std::uncaught_exceptions();
  };
  static void mark_failed_in_zero_grad(Unit& u) { u.mark_failed("zero_grad"); }
  // The step failed in `where` (a hook of this unit, or its scope left by an exception):
  // this unit's next call, and that of every unit of its model (which share the step), asks
  // for abort_step first. The first failure is the one named. Only on failure paths.
  void mark_failed(const char* where) noexcept {
    auto mark = [&](Unit& u) {
      if (!u.failed_hook_) u.failed_hook_ = where, u.failed_by_ = this;
    };
    mark(*this);
    if (order_)
      for (Unit* u : order_->units()) mark(*u);
  }
  void agree_on_abort() {
    failed_hook_ = "abort_step";  // until every rank took part
    failed_by_ = nullptr;
    detail::naming_what_left_the_step(
        [&](std::shared_ptr<const std::string> why) { all_ranks_agree(true, TagPhase::abort_step, std::move(why)); });
    failed_hook_ = nullptr;
  }
  const char* failed_hook_ = nullptr;
  const Unit* failed_by_ = nullptr;  // whose hook or scope failed (null: the model's call)
  mutable bool misuse_ = false;  // the exception leaving a hook is expect()'s
  std::string fqn_;
  TrainingState state_ = TrainingState::IDLE;
  int rank_ = 0;
  const void* module_ = nullptr;
  std::type_index module_type_;
  ExecutionOrder* order_ = nullptr;
  int order_index_ = -1;  // this unit's index in the order
  std::vector<Unit*> forward_prefetch_, backward_prefetch_;
  GradientSync sync_;
  ReshardSettings reshard_;
  detail::UnitUses uses_;
  std::vector<ParamStorage> storage_;
  detail::PostGradHookSlot grad_hook_;

 private:
  friend class ShardedModel;  // its no_sync scope restores the setting even mid-backward
  // RunTimeSettings<Unit>'s: one unit, IDLE (fsdp/unit/run_time_settings.hpp).
  template <class Check, class Change>
  void apply_setting(const char* name, const Check& check, const Change& change, bool) {
    expect({TrainingState::IDLE}, name);
    check(*this);
    change(*this);
  }
};

// The name before issue 34 (CHANGELOG.md): kept one release so that engines compile, with a
// warning, while they rename.
using UnitBase [[deprecated("fsdp::UnitBase is now fsdp::Unit (CHANGELOG.md)")]] = Unit;

namespace detail {
inline UnitInternals& internals(Unit& unit) { return unit; }
inline const UnitInternals& internals(const Unit& unit) { return unit; }
inline GradientAfterHook after_hook_of(const Unit& unit) { return unit.gradient_after_hook(); }
}  // namespace detail

}  // namespace fsdp
