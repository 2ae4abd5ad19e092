#pragma once
// UnitBase: what the root and the engine see of a sharded unit, whatever its module type
// and policies: the lifecycle hooks, the training state, and the flat shards the
// optimizer steps on.
#include <cstdint>
#include <exception>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <typeindex>
#include <utility>
#include <vector>

#include "fsdp/detail/post_grad_hook_slot.hpp"
#include "fsdp/detail/unit_uses.hpp"
#include "fsdp/device.hpp"
#include "fsdp/device_mesh.hpp"
#include "fsdp/dtype.hpp"
#include "fsdp/execution_order.hpp"
#include "fsdp/gradient_sync.hpp"
#include "fsdp/post_accumulate_grad_hook.hpp"
#include "fsdp/training_state.hpp"

namespace fsdp {

// One flat shard of a unit as the optimizer sees it: this rank's slice of the unit's
// parameters of one dtype and the matching slice of the reduced gradient. Padding is
// left out: numel counts only real parameter elements. The gradient has the parameters'
// dtype unless MixedPrecision keeps low-precision gradients.
struct ShardView {
  std::string_view unit;  // FQN of the unit ("" for the root)
  DType dtype = DType::f32;
  void* param = nullptr;
  void* grad = nullptr;
  std::int64_t numel = 0;
  DType grad_dtype = DType::f32;
  std::int64_t padded_numel = 0;  // the shard's size with padding (every rank's shard has it)
  MemorySpace space = MemorySpace::device;  // host when OffloadParams put the shard there
};

// One parameter as this rank holds it: the elements [param_begin, param_begin + count) of
// the flattened parameter, which sit at shard_offset in shards()[shard] of its unit. A
// shard may cut through a parameter, so count may be anything from 0 to numel. What an
// optimizer needs for per-parameter rules (weight-decay masks) and what state dicts and
// checkpoints are made of; no cast to a concrete unit type is needed.
struct ParamView {
  std::string_view unit;  // FQN of the unit ("" for the root)
  std::string_view fqn;   // the parameter's FQN in the model
  std::span<const std::int64_t> shape;
  DType dtype = DType::f32;  // the master dtype: what shards and checkpoints hold
  std::int64_t numel = 0;    // of the whole parameter
  std::size_t shard = 0;     // index into the unit's shards()
  std::size_t model_shard = 0;  // index into ShardedModel::shards() (the unit's own: = shard)
  std::int64_t param_begin = 0, count = 0, shard_offset = 0;
  void* param = nullptr;  // this rank's elements (nullptr when count == 0)
  void* grad = nullptr;   // the matching elements of the sharded gradient, in grad_dtype
  DType grad_dtype = DType::f32;
  MemorySpace space = MemorySpace::device;
  // Its other FQNs when tied (one tensor under several names, stored once): state dicts
  // save it under `fqn` and loads accept any of them.
  std::span<const std::string> aliases;
};

// A parameter's storage as its unit found it at setup (the tensor's data pointer, or the
// tensor object when it holds no elements), with the FQN it was found under: how the
// root finds one tensor in two units.
struct ParamStorage {
  const void* key = nullptr;
  std::string fqn;
};

// A buffer (non-trainable tensor: running statistics, masks) of a unit.
struct BufferView {
  std::string_view unit, fqn;
  std::span<const std::int64_t> shape;
  DType dtype = DType::f32;  // its own dtype (MixedPrecision may show it cast to the engine)
  std::int64_t numel = 0;
};

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

class UnitBase {
 public:
  virtual ~UnitBase() = default;
  UnitBase(const UnitBase&) = delete;
  UnitBase& operator=(const UnitBase&) = delete;

  // Hooks, in the order a training step calls them. Each checks the state first.
  virtual void pre_forward() = 0;    // IDLE -> FORWARD: all-gather; parameters become valid
  virtual void post_forward() = 0;   // FORWARD -> IDLE: free unsharded parameters
  virtual void pre_backward() = 0;   // IDLE -> BACKWARD_PRE: all-gather; zeroed gradients bound
  virtual void post_backward() = 0;  // BACKWARD_PRE -> BACKWARD_POST: reduce-scatter, free
  // Called by the root once per backward, after every unit's post_backward; -> IDLE.
  virtual void finish_backward() = 0;
  virtual void zero_grad() = 0;  // IDLE only: the sharded gradient becomes zero; kept accumulation is freed
  // IDLE only: frees unsharded parameters kept after forward for backward (ShardGradOp
  // keeps every unit's; the unit backward starts with keeps its own). After a forward-only
  // pass, such as evaluation, call this to free them (the next forward regathers anyway).
  virtual void reshard() = 0;

  // Parameters unsharded outside training (inspection, init, export): IDLE ->
  // SUMMON_FULL_PARAMS, a collective. Writeback with rank0_only is an error (the other
  // ranks would have nothing to write back). With writeback, end_ keeps the edits.
  virtual void begin_summon_full_params(const SummonOptions& options) = 0;
  void begin_summon_full_params() { begin_summon_full_params(SummonOptions{}); }
  virtual void end_summon_full_params(bool writeback) = 0;

  virtual std::span<const ShardView> shards() const = 0;
  // Every parameter and buffer of the unit, in visit order (parameters grouped by dtype as
  // their flat shards are).
  virtual std::span<const ParamView> parameters() const = 0;
  virtual std::span<const BufferView> buffers() const = 0;
  // buffers()[i]'s values in buffers()[i].dtype. While summoned: the storage the engine's
  // tensor shows (write to it there). Otherwise, under MixedPrecision with a cast Buffer
  // dtype: the unit's master copy, refreshed from the cast copy the engine computes with
  // (read it only: the next refresh overwrites it).
  virtual void* buffer_data(std::size_t i) const = 0;
  // IDLE only: sets buffers()[i] from `values` (its dtype, numel elements, host or device
  // memory), in the engine's tensor and in any copy MixedPrecision keeps. What loads use,
  // with no summon (no gather) needed.
  virtual void load_buffer(std::size_t i, const void* values) = 0;
  // While summoned: the full parameters()[i], in its master dtype (writable when the summon
  // writes back; in host memory under offload_to_host). An error in any other state, and
  // on ranks other than 0 of a rank0_only summon.
  virtual void* full_parameter(std::size_t i) const = 0;
  // Its Device's id(): whether its shards are in memory the host can address (cpu).
  virtual DeviceId device_id() const = 0;
  // Copies bytes through the unit's Device: either side may be host or device memory.
  virtual void copy_bytes(void* dst, const void* src, std::size_t bytes) const = 0;
  // All-gathers an array laid out like shards()[shard] (its numel valid elements of
  // `dtype`, in the shard's memory space; for example an optimizer moment) into
  // `full_host`, host memory for the flat parameter's unpadded elements. A collective over
  // the shard group.
  virtual void gather_like_shard(std::size_t shard, const void* mine, void* full_host, DType dtype) const = 0;
  // Whether `ok` holds on every rank of the world (a collective): so that no rank goes on
  // to change state, or to commit a file, that another rank has found wrong.
  virtual bool all_ranks_agree(bool ok) const = 0;
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

  // Completes setup: points the engine's tensors at the unit's storage (their own storage
  // is released). The constructor calls it unless UnitOptions::defer_take_over; fsdp::shard
  // defers it until every unit is built, so a failed shard leaves the model as it was.
  virtual void take_over() = 0;

  // Issues this unit's all-gather ahead of its own hook, if it is not unsharded yet.
  virtual void prefetch() = 0;
  // Completes a reduction that post_backward left in flight (asynchronous backends).
  virtual void finish_reduction() = 0;

  // Explicit prefetch lists (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch):
  // when set, these units are gathered at this unit's pre_forward / pre_backward instead
  // of the next unit in the recorded order.
  void set_forward_prefetch(std::vector<UnitBase*> units) { forward_prefetch_ = std::move(units); }
  void set_backward_prefetch(std::vector<UnitBase*> units) { backward_prefetch_ = std::move(units); }
  bool has_explicit_prefetch() const { return !forward_prefetch_.empty() || !backward_prefetch_.empty(); }

  // Gradient accumulation (fsdp/gradient_sync.hpp): the settings the unit's next
  // post_backward reads. IDLE only; every rank must make the same calls (a unit checks
  // that they did at its first backward after a change).
  void set_requires_gradient_sync(bool on) { expect({TrainingState::IDLE}, "set_requires_gradient_sync"); sync_.requires_sync = on; }
  void set_requires_all_reduce(bool on) { expect({TrainingState::IDLE}, "set_requires_all_reduce"); sync_.requires_all_reduce = on; }
  void set_gradient_sync_mode(GradientSyncMode m) { expect({TrainingState::IDLE}, "set_gradient_sync_mode"); sync_.mode = m; }
  const GradientSync& gradient_sync() const { return sync_; }

  // Post-accumulate-grad hook (fsdp/post_accumulate_grad_hook.hpp): run once this unit's
  // sharded gradient is final; with GradientAfterHook::free the gradient is freed after it
  // (switching to free drops the current sharded gradient, as zero_grad would). An empty
  // hook removes it (and frees nothing). IDLE only. ShardedModel sets it for every unit.
  virtual void set_post_accumulate_grad_hook(PostAccumulateGradHook hook, GradientAfterHook after) = 0;
  bool has_post_accumulate_grad_hook() const { return grad_hook_.installed(); }
  GradientAfterHook gradient_after_hook() const { return grad_hook_.after(); }

  // The root's shared execution order; set when the unit joins a ShardedModel.
  void attach(ExecutionOrder* order) { order_ = order, order_index_ = order->add_unit(this); }

  // Uses of the unit in the current pass (fsdp/detail/unit_uses.hpp): forward entries so
  // far, and backward entries still expected before its gradient is reduced (-1: not
  // known, so at finish_backward).
  int forward_entries() const { return uses_.forward_entries(); }
  int backward_entries_left() const { return uses_.backward_left(); }
  // Each parameter's storage at setup, aliases of tied parameters included.
  std::span<const ParamStorage> param_storage() const { return storage_; }

  const std::string& fqn() const { return fqn_; }
  // The FQN as messages and traces show it: "<root>" for the root.
  std::string_view display_name() const { return fqn_.empty() ? std::string_view("<root>") : std::string_view(fqn_); }
  TrainingState state() const { return state_; }
  int rank() const { return rank_; }
  // The module this unit manages: its address and type together (a module's first member
  // has the same address as the module itself).
  const void* module_address() const { return module_; }
  std::type_index module_type() const { return module_type_; }

  // RAII around the engine's forward / backward of this unit. The backward scope skips
  // post_backward when it is left by an exception: a collective during unwinding could
  // only make things worse.
  class ForwardScope {
   public:
    explicit ForwardScope(UnitBase& u) : u_(u) { u_.pre_forward(); }
    ~ForwardScope() noexcept(false) {
      if (std::uncaught_exceptions() == exceptions_) u_.post_forward();
    }
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;
   private:
    UnitBase& u_;
    int exceptions_ = std::uncaught_exceptions();
  };
  class BackwardScope {
   public:
    explicit BackwardScope(UnitBase& u) : u_(u) { u_.pre_backward(); }
    ~BackwardScope() noexcept(false) {
      if (std::uncaught_exceptions() == exceptions_) u_.post_backward();
    }
    BackwardScope(const BackwardScope&) = delete;
    BackwardScope& operator=(const BackwardScope&) = delete;
   private:
    UnitBase& u_;
    int exceptions_ = std::uncaught_exceptions();
  };
  class SummonScope {
   public:
    SummonScope(UnitBase& u, const SummonOptions& options) : u_(u), writeback_(options.writeback) {
      u_.begin_summon_full_params(options);
    }
    ~SummonScope() noexcept(false) {
      // Leaving by exception: reshard without writeback, so half-edited values are dropped.
      u_.end_summon_full_params(writeback_ && std::uncaught_exceptions() == exceptions_);
    }
    SummonScope(const SummonScope&) = delete;
    SummonScope& operator=(const SummonScope&) = delete;
   private:
    UnitBase& u_;
    bool writeback_;
    int exceptions_ = std::uncaught_exceptions();
  };

  [[nodiscard]] ForwardScope forward_scope() { return ForwardScope(*this); }
  [[nodiscard]] BackwardScope backward_scope() { return BackwardScope(*this); }
  [[nodiscard]] SummonScope summon_full_params(bool writeback = false) { return SummonScope(*this, {.writeback = writeback}); }
  [[nodiscard]] SummonScope summon_full_params(const SummonOptions& options) { return SummonScope(*this, options); }

 protected:
  UnitBase(std::string fqn, int rank, const void* module, std::type_index type)
      : fqn_(std::move(fqn)), rank_(rank), module_(module), module_type_(type) {}
  void expect(std::initializer_list<TrainingState> states, std::string_view hook) const {
    detail::expect_state(state_, states, hook, fqn_, rank_);
  }
  std::string fqn_;
  TrainingState state_ = TrainingState::IDLE;
  int rank_ = 0;
  const void* module_ = nullptr;
  std::type_index module_type_;
  ExecutionOrder* order_ = nullptr;
  int order_index_ = -1;  // this unit's index in the order
  std::vector<UnitBase*> forward_prefetch_, backward_prefetch_;
  GradientSync sync_;
  detail::UnitUses uses_;
  std::vector<ParamStorage> storage_;
  detail::PostGradHookSlot grad_hook_;

 private:
  friend class ShardedModel;  // its no_sync scope restores the setting even mid-backward
};

// ---- ExecutionOrder, now that UnitBase is complete ----

inline std::string ExecutionOrder::name_of(int index) const {
  if (index < 0 || index >= static_cast<int>(units_.size())) return "<not a unit of this model>";
  return std::string(units_[index]->display_name());
}

inline void ExecutionOrder::enter(UnitBase& u, int idx, Pass pass, const detail::CommRef& world, bool prefetching) {
  auto& order = pass == Pass::forward ? forward_ : backward_;
  auto& step = pass == Pass::forward ? forward_step_ : backward_step_;
  auto& recorded = pass == Pass::forward ? forward_recorded_ : backward_recorded_;
  const char* pass_name = pass == Pass::forward ? "forward" : "backward";
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
        throw Error(os.str());
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
  if (order[step] != idx && prefetching)
    detail::fail("unit '", name_of(idx), "' on rank ", world.rank(), " runs at ", pass_name, " step #", step,
                 " where the first iteration ran '", name_of(order[step]),
                 "'; prefetching follows the first iteration's order, so a model whose order changes needs "
                 "NoBackwardPrefetch and NoForwardPrefetch");
  ++step;
}

inline void ExecutionOrder::reduction_issued(UnitBase& u) {
  if (UnitBase* before = std::exchange(reducing_, &u)) before->finish_reduction();
}

inline void ExecutionOrder::finish_reductions() {
  if (UnitBase* last = std::exchange(reducing_, nullptr)) last->finish_reduction();
}

}  // namespace fsdp
