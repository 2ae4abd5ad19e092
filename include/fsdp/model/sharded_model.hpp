#pragma once
// ShardedModel: the root over a model's units (FSDP's root instance). It owns the units,
// finds the unit of a module, ends each backward (finish_backward, the job of FSDP's
// queued root callback: every pending unit completed, every unit back to IDLE) and lists
// the flat shards for the optimizer. fsdp::shard (fsdp/model/shard.hpp)
// builds one from a model and wrap policies.
#include <algorithm>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <map>
#include <span>
#include <type_traits>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/type_name.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/unit/detail/zero_batch.hpp"
#include "fsdp/unit/run_time_settings.hpp"
#include "fsdp/unit/unit.hpp"
#if FSDP_DEFINES_IMPLEMENTATION  // what only the members defined below use
#include "fsdp/unit/detail/take_over.hpp"
#include "fsdp/unit/execution_order_impl.hpp"
#endif

namespace fsdp {

namespace detail {
struct CaptureAccess;
}  // namespace detail

// Every unit of a model summoned at once (FSDP's summon_full_params on the root; see
// ShardedModel::summon_full_params). Ends each unit's summon when it goes, in unit order on
// every rank (the writeback check is a collective per unit); leaving by exception drops the
// edits. A unit whose end fails does not stop the others from ending: the first error is
// rethrown after all have.
class ModelSummon {
 public:
  template <class Units>
  ModelSummon(Units& units, const SummonOptions& options) : writeback_(options.writeback) {
    try {
      for (auto& u : units) {  // in unit order: the same gathers on every rank
        detail::internals(*u).begin_summon_full_params(options);
        summoned_.push_back(u.get());
      }
    } catch (...) {
      end_all(false);
      throw;
    }
  }
  ModelSummon(ModelSummon&& o) noexcept
      : summoned_(std::exchange(o.summoned_, {})), writeback_(o.writeback_), exceptions_(o.exceptions_) {}
  ModelSummon(const ModelSummon&) = delete;
  ModelSummon& operator=(const ModelSummon&) = delete;
  ~ModelSummon() noexcept(false) {
    const bool unwinding = std::uncaught_exceptions() != exceptions_;
    if (auto error = end_all(writeback_ && !unwinding); error && !unwinding) std::rethrow_exception(error);
  }

 private:
  std::exception_ptr end_all(bool writeback) noexcept {
    std::exception_ptr first;
    for (Unit* u : std::exchange(summoned_, {})) {
      try {
        detail::internals(*u).end_summon_full_params(writeback);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    return first;
  }

  std::vector<Unit*> summoned_;
  bool writeback_;
  int exceptions_ = std::uncaught_exceptions();
};

class ShardedModel : public RunTimeSettings<ShardedModel> {
 public:
  ShardedModel() : order_(std::make_unique<ExecutionOrder>()) {}
  ShardedModel(ShardedModel&&) noexcept = default;
  ShardedModel& operator=(ShardedModel&&) noexcept = default;

  // Adds a unit built in place; returns it.
  template <class U, class... Args>
  U& emplace(Args&&... args) {
    auto u = std::make_unique<U>(std::forward<Args>(args)...);
    U& ref = *u;
    add(std::move(u));
    return ref;
  }

  void add(std::unique_ptr<Unit> unit);

  // Completes setup of units built with ShardOptions::defer_take_over (fsdp::shard's). A
  // collective: every rank calls it. All units on all ranks or none: a rebind that throws
  // in any unit on any rank gives back every unit's tensors on every rank (their storage and
  // values too, for tensor types with keep/restore; detail/take_over.hpp), and every rank's
  // error names the rank that failed and quotes it.
  void take_over();

  std::size_t size() const { return units_.size(); }
  Unit& operator[](std::size_t i) { return *units_.at(i); }
  auto begin() { return units_.begin(); }
  auto end() { return units_.end(); }

  // The unit that manages `module`, or nullptr. A polymorphic module may be passed as any
  // of its bases (Layer&): it is identified by its dynamic type (ModuleId).
  template <class M>
  Unit* find_unit_for(const M& module) const {
    static_assert(!std::is_pointer_v<M>, "fsdp: pass the module itself (unit_for(block)), not a pointer to it");
    const ModuleId id = ModuleId::of(module);
    auto it = by_module_.find(ModuleKey{id.address, id.type});
    return it == by_module_.end() ? nullptr : it->second;
  }
  template <class M>
  Unit& unit_for(const M& module) const {
    if (auto* u = find_unit_for(module)) return *u;
    const ModuleId id = ModuleId::of(module);
    detail::fail("ShardedModel: the ", detail::type_name(id.type), " at ", id.address, " is not a unit; units are: ",
                 unit_names());
  }
  // The unit whose module lies at `address` whatever its type (for hooks that only keep a
  // pointer), or nullptr; an error when a module and its first member are both units there.
  Unit* find_unit_at(const void* address) const;
  // The gradient the library owns of `param`, a parameter visited as f(name, param), from
  // the unit that holds it (Unit::gradient: valid between that unit's pre_backward and
  // post_backward, and in a summon with_grads). Found by fsdp::tensor_identity: the tensor's
  // address, or for a handle type what it points to (any copy of the handle).
  template <class T>
  GradientView gradient(const T& param) {
    static_assert(Tensor<T>, "fsdp: gradient(param) takes the parameter tensor the module visited (an fsdp::Tensor), "
                             "not a pointer to it or another object");
    auto it = unit_of_tensor_.find(tensor_identity(param));
    if (it == unit_of_tensor_.end())
      detail::fail("ShardedModel on rank ", units_.empty() ? 0 : units_.front()->rank(), ": gradient(): the tensor at ",
                   tensor_identity(param), " is not a parameter of any unit; pass the tensor a module visited "
                   "(ignored parameters have no unit, and no gradient of the library's)");
    return it->second->gradient(param);
  }

  Unit& unit(std::string_view fqn) const;

  // Ends a backward pass (the job of FSDP's queued final callback), so that an engine need
  // not track which units' hooks fired: a unit whose pre_backward ran but post_backward did
  // not gets its post_backward now (reverse unit order: nested units before the units around
  // them; the same on every rank, as the reductions must be); every reduction is finished;
  // a unit that ran no backward frees what its forward kept; every unit is IDLE again. A
  // unit left in FORWARD is an error.
  void finish_backward();

  // Records every unit's forward, backward and waits (and, with an AsyncCommunicator
  // given the same Trace, its collectives) into `trace`; nullptr stops. Off by default.
  void set_trace(Trace* trace) { order_->trace = trace; }

  // At most `n` units gathered ahead of the one computing (FSDP's limit_all_gathers);
  // a prefetch beyond it is skipped and that unit gathers when its hook runs. Default 2.
  void set_max_prefetched_units(int n);

  // The whole configuration: each unit's policies and run-time settings as they are now,
  // and the prefetch limit (fsdp/policy/configuration.hpp; to_string prints it).
  ModelConfig config() const;

  // The recorded execution order (after the first iteration), for tests and tools.
  const ExecutionOrder& execution_order() const { return *order_; }

  // Zeroes the sharded gradients and frees what accumulation kept. Every unit's zeroing
  // goes out in one device call where the device can (BatchZeroingDevice).
  void zero_grad() { detail::zero_grads(units_, Unit::mark_failed_in_zero_grad); }

  // Every parameter whole, in its master dtype, in the engine's tensors until the returned
  // scope ends; IDLE units only, a collective. With writeback each rank keeps the edits to
  // its own slice, so edits must be the same on every rank. rank0_only: the other ranks
  // gather for rank 0 and hold nothing (writeback with it is an error). offload_to_host:
  // the full parameters live in host memory and the device holds one unit's at a time.
  [[nodiscard]] ModelSummon summon_full_params(const SummonOptions& options = {}) { return ModelSummon(units_, options); }

  // The run-time settings for every unit (gradient sync, resharding, the divide factor,
  // the post-accumulate-grad hook) are RunTimeSettings<ShardedModel>'s, the same setters a
  // unit has (fsdp/unit/run_time_settings.hpp): all units or none, every unit IDLE. With
  // GradientAfterHook::free, shards() and parameters() show grad == nullptr: the gradient
  // exists only while the hook runs (see the unit's views).
  //
  // A post-accumulate-grad hook per parameter: each of the unit's parameters in turn.
  void set_post_accumulate_param_hook(const PostAccumulateParamHook& hook, GradientAfterHook after = GradientAfterHook::keep) {
    PostAccumulateGradHook per_unit;
    if (hook) per_unit = [hook](Unit& u) {
      for (const ParamView& p : u.parameters()) hook(u, p);
    };
    set_post_accumulate_grad_hook(per_unit, after);
  }

  // FSDP1's no_sync: gradient sync off for every unit while the scope lives; each unit's
  // setting is restored when it ends, also by an exception (then whatever state the units
  // are in: a destructor must not throw).
  class NoSyncScope {
   public:
    explicit NoSyncScope(ShardedModel& m) {
      for (auto& u : m.units_) saved_.emplace_back(u.get(), u->gradient_sync().requires_sync);
      try {
        m.set_requires_gradient_sync(false);
      } catch (...) {
        restore();
        throw;
      }
    }
    ~NoSyncScope() { restore(); }
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;

   private:
    void restore() noexcept {
      for (auto& [u, on] : saved_) u->sync_.requires_sync = on;
    }
    std::vector<std::pair<Unit*, bool>> saved_;
  };
  [[nodiscard]] NoSyncScope no_sync() { return NoSyncScope(*this); }

  // Frees unsharded parameters kept after forward for a backward that is not coming
  // (ShardGradOp's, and the first backward unit's); call it after a forward-only pass.
  void reshard();

  // Recovery after an exception inside a step (a failed allocation, an engine error, a hook
  // that threw; Unit::abort_step): every unit frees what the step held, discards the
  // step's gradients (as zero_grad) and returns to IDLE, and the execution order forgets
  // the pass (an order still being recorded is recorded again). Then one agreement across
  // the world: every rank must call it; a rank still inside another collective makes it
  // an error on every rank instead, and the units then stay failed. The next step computes
  // with the parameters as they were before the aborted one.
  void abort_step();

  // This rank's flat shards of every unit, for the optimizer.
  std::span<const ShardView> shards() const { return views_; }
  // Every parameter of every unit as this rank holds it (unit by unit, in unit order):
  // FQN, shape, dtype and where its elements lie in this rank's shard and in the parameter.
  std::span<const ParamView> parameters() const { return params_; }

 private:
  friend class RunTimeSettings<ShardedModel>;
  friend struct detail::CaptureAccess;
  // RunTimeSettings<ShardedModel>'s (fsdp/unit/run_time_settings.hpp): every unit checked
  // first, so a refused call changes none.
  template <class Check, class Change>
  void apply_setting(const char* name, const Check& check, const Change& change, bool views_change) {
    for (auto& u : units_) u->expect({TrainingState::IDLE}, name);
    for (auto& u : units_) check(*u);
    try {
      for (auto& u : units_) change(*u);
    } catch (...) {  // out of memory in the hook setter: the views show what the units hold
      if (views_change) refresh_views();
      throw;
    }
    if (views_change) refresh_views();
  }

  void refresh_views();

  // A tensor reachable under several FQNs (tied) is sharded once, by the one unit that
  // holds all its uses; found in two units it would be two copies that drift apart.
  void check_no_tie_across(const Unit& unit) const;

  // The innermost unit whose module holds both FQNs, in words.
  std::string owner_of(const std::string& a, const std::string& b, const Unit& adding) const;

  std::string unit_names() const;

  using ModuleKey = std::pair<const void*, std::type_index>;
  // Declared before the units, so destroyed after them: a unit's destructor waits for its
  // collectives, whose error messages name their unit through it (CollectiveTag::names).
  std::unique_ptr<ExecutionOrder> order_;  // on the heap: units keep its address across moves
  std::vector<std::unique_ptr<Unit>> units_;
  std::map<ModuleKey, Unit*> by_module_;
  std::map<const void*, std::pair<Unit*, std::string>> storage_owner_;  // every unit's parameters, by storage
  std::unordered_map<const void*, Unit*> unit_of_tensor_;  // every unit's parameters, by engine tensor
  std::vector<ShardView> views_;
  std::vector<ParamView> params_;
};

#if FSDP_DEFINES_IMPLEMENTATION
// ShardedModel's members that do not depend on a template argument: compiled once under
// FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp), in every file that uses them otherwise.
FSDP_DECL void ShardedModel::add(std::unique_ptr<Unit> unit) {
  for (auto& u : units_)
    if (u->fqn() == unit->fqn())
      detail::fail("ShardedModel: two units named '", unit->display_name(), "' on rank ",
                   unit->rank());
  if (!units_.empty() && fsdp::detail::internals(*unit).groups() != fsdp::detail::internals(*units_.front()).groups())
    detail::fail("ShardedModel on rank ", unit->rank(), ": unit '", unit->fqn(), "' uses a ",
                 fsdp::detail::internals(*unit).groups(),
                 " but unit '", units_.front()->display_name(), "' a ",
                 fsdp::detail::internals(*units_.front()).groups(), "; every unit of a model must use the same groups");
  const ModuleKey key{fsdp::detail::internals(*unit).module_address(), fsdp::detail::internals(*unit).module_type()};
  if (by_module_.count(key))
    detail::fail("ShardedModel on rank ", unit->rank(), ": unit '", unit->fqn(), "' manages a module that unit '",
                 by_module_[key]->fqn(), "' already manages");
  check_no_tie_across(*unit);
  // Room first: once the unit is attached to the execution order (which may write
  // through its pointer), the push_back below must not throw and free it.
  if (units_.size() == units_.capacity()) units_.reserve(std::max<std::size_t>(8, 2 * units_.size()));
  by_module_[key] = unit.get();
  for (const auto& st : unit->param_storage()) storage_owner_.emplace(st.key, std::make_pair(unit.get(), st.fqn));
  for (const void* t : fsdp::detail::internals(*unit).parameter_tensors()) unit_of_tensor_.emplace(t, unit.get());
  unit->attach(order_.get());
  units_.push_back(std::move(unit));  // within capacity: cannot throw
  refresh_views();
}

FSDP_DECL void ShardedModel::take_over() {
  if (units_.empty()) return;
  detail::take_over_together(units_.front()->rank(), units_);
  refresh_views();
}

FSDP_DECL Unit* ShardedModel::find_unit_at(const void* address) const {
  Unit* found = nullptr;
  for (const auto& [key, unit] : by_module_) {
    if (key.first != address) continue;
    if (found)
      detail::fail("ShardedModel: units '", found->fqn(), "' and '", unit->fqn(), "' both manage a module at ",
                   address, "; look the unit up by module (find_unit_for) instead");
    found = unit;
  }
  return found;
}

FSDP_DECL Unit& ShardedModel::unit(std::string_view fqn) const {
  for (auto& u : units_) if (u->fqn() == fqn) return *u;
  detail::fail("ShardedModel: no unit named '", fqn, "'; units are: ", unit_names());
}

FSDP_DECL void ShardedModel::finish_backward() {
  for (auto& u : units_)  // before any collective: the unit's own check names it and its state (or failure)
    if (u->state() == TrainingState::FORWARD || u->failed_hook_) u->finish_backward();
  for (auto it = units_.rbegin(); it != units_.rend(); ++it)
    if ((*it)->state() == TrainingState::BACKWARD_PRE) (*it)->post_backward();
  order_->finish_reductions();
  for (auto& u : units_) u->finish_backward();
  try {
    order_->check_pass();
  } catch (...) {  // the gradients are wrong: nothing may use them before abort_step
    for (auto& u : units_) u->failed_hook_ = "finish_backward", u->failed_by_ = nullptr;
    throw;
  }
  order_->end_iteration();
}

FSDP_DECL void ShardedModel::set_max_prefetched_units(int n) {
  if (n < 0) detail::fail("ShardedModel: the prefetch limit must be >= 0, got ", n);
  order_->max_prefetched = n;
}

FSDP_DECL ModelConfig ShardedModel::config() const {
  ModelConfig c;
  c.max_prefetched = order_->max_prefetched;
  for (const auto& u : units_) c.units.push_back(u->config());
  return c;
}

FSDP_DECL void ShardedModel::reshard() {
  for (auto& u : units_) u->reshard();
  if (!order_->in_backward()) order_->check_pass();  // a forward-only pass ends here
  order_->end_forward_pass();
}

FSDP_DECL void ShardedModel::abort_step() {
  for (auto& u : units_) fsdp::detail::internals(*u).abandon_step();
  order_->abort_pass();
  if (units_.empty()) return;
  for (auto& u : units_) u->failed_hook_ = "abort_step", u->failed_by_ = nullptr;  // until every rank took part
  detail::naming_what_left_the_step([&](std::shared_ptr<const std::string> why) {
    fsdp::detail::internals(*units_[0]).all_ranks_agree(true, TagPhase::abort_step, std::move(why));
  });
  for (auto& u : units_) u->failed_hook_ = nullptr;
}

FSDP_DECL void ShardedModel::refresh_views() {
  views_.clear();
  params_.clear();
  for (auto& u : units_) {
    const std::size_t first = views_.size();
    views_.insert(views_.end(), u->shards().begin(), u->shards().end());
    for (ParamView p : u->parameters()) {
      p.model_shard = first + p.shard;
      params_.push_back(p);
    }
  }
}

FSDP_DECL void ShardedModel::check_no_tie_across(const Unit& unit) const {
  for (const auto& st : unit.param_storage()) {
    auto it = storage_owner_.find(st.key);
    if (it == storage_owner_.end()) continue;
    const auto& [other, other_fqn] = it->second;
    detail::fail("ShardedModel on rank ", unit.rank(), ": parameters '", other_fqn, "' (unit '", other->display_name(),
                 "') and '", st.fqn, "' (unit '", unit.display_name(), "') are the same tensor (tied) but lie in ",
                 "different units; a tied parameter must lie in one unit that holds all its uses: ",
                 owner_of(other_fqn, st.fqn, unit), " (do not make the modules in between units of their own)");
  }
}

FSDP_DECL std::string ShardedModel::owner_of(const std::string& a, const std::string& b, const Unit& adding) const {
  auto holds = [](const std::string& unit, const std::string& fqn) {
    return unit.empty() || (fqn.size() > unit.size() && fqn.compare(0, unit.size(), unit) == 0 && fqn[unit.size()] == '.');
  };
  const Unit* best = nullptr;
  auto consider = [&](const Unit& u) {
    if (holds(u.fqn(), a) && holds(u.fqn(), b) && (!best || u.fqn().size() > best->fqn().size())) best = &u;
  };
  for (const auto& u : units_) consider(*u);
  consider(adding);
  if (best) return "unit '" + std::string(best->display_name()) + "'";
  std::size_t common = 0;  // their common module, for a model built without a unit around it
  for (std::size_t i = 0; i < a.size() && i < b.size() && a[i] == b[i]; ++i)
    if (a[i] == '.') common = i;
  return "a unit wrapping module '" + (common ? a.substr(0, common) : std::string("<root>")) + "'";
}

FSDP_DECL std::string ShardedModel::unit_names() const {
  std::ostringstream os;
  for (std::size_t i = 0; i < units_.size(); ++i)
    os << (i ? ", " : "") << "'" << units_[i]->display_name() << "'";
  return os.str();
}
#endif  // FSDP_DEFINES_IMPLEMENTATION

namespace detail {
// What fsdp::CapturedStep (fsdp/graph/captured_step.hpp) needs of a model, and nothing an
// engine calls: the capture switch (ExecutionOrder::capturing), and why a step cannot be
// captured now ("" when it can).
struct CaptureAccess {
  static void set_capturing(ShardedModel& m, bool on) { m.order_->capturing = on; }
  // abort_step's local part (every unit frees what the step held), which a capture can
  // record; the agreement across ranks that follows waits on the host, after the capture.
  static void abandon_step(ShardedModel& m) {
    for (auto& u : m.units_) internals(*u).abandon_step();
    m.order_->abort_pass();
  }
  // Each unit's gradient state between steps (Unit's step_state), in unit order: what a
  // replay must find as the capture found it.
  static std::vector<std::string> step_states(const ShardedModel& m) {
    std::vector<std::string> out;
    out.reserve(m.units_.size());
    for (const auto& u : m.units_) out.push_back(internals(*u).step_state());
    return out;
  }
  // Puts each unit's gradient state back to `states` (step_states' form): where a capture
  // left it (nothing ran), or where a replay leaves it (what the captured step did).
  static void set_step_states(ShardedModel& m, const std::vector<std::string>& states) {
    for (std::size_t i = 0; i < m.units_.size() && i < states.size(); ++i)
      internals(*m.units_[i]).set_grad_is_zero(states[i].rfind("zero", 0) == 0);
  }
  static std::string unit_name(const ShardedModel& m, std::size_t i) {
    return std::string(display_name(m.units_.at(i)->fqn()));
  }
  static std::string not_capturable(const ShardedModel& m) {
    if (std::string why = not_replayable(m, false); !why.empty()) return why;
    for (const auto& u : m.units_) {
      const UnitConfig c = u->config();
      const std::string unit = "unit '" + std::string(display_name(u->fqn())) + "'";
      if (c.policies.offload)
        return unit + " offloads its parameters (OffloadParams): finish_backward then synchronizes the device for a "
               "CPU optimizer, which a graph cannot";
      if (c.post_accumulate_grad_hook)
        return unit + " has a post-accumulate-grad hook: it runs on the host, once at the capture, never at a replay";
    }
    return {};
  }
  // "" when a step has ended and every unit is between steps with its settings agreed,
  // else why not: what a replay checks besides the states and the configuration, which
  // cover the rest of the above (offloading and hooks are in the configuration). Settings
  // can be unagreed with the captured configuration: changed, a step run, changed back.
  // `replay`: for a replay (what to do differs).
  static std::string not_replayable(const ShardedModel& m, bool replay = true) {
    if (!m.order_->iteration_recorded())
      return "no step has ended yet: run one eagerly first (the first iteration records the order of the units and "
             "agrees on it across ranks, on the host)";
    for (const auto& u : m.units_) {
      if (u->state() != TrainingState::IDLE)
        return "unit '" + std::string(display_name(u->fqn())) + "' is in state " + std::string(name_of(u->state())) +
               ": capture a whole step, begun between steps";
      if (internals(*u).settings_unagreed())
        return "unit '" + std::string(display_name(u->fqn())) + "': its run-time settings changed since the last " +
               "step, and the ranks agree on them in the next backward, on the host" +
               (replay ? ", which a replay does not run: set them back as captured, or run a step eagerly and capture "
                         "again"
                       : ": run one step eagerly first");
    }
    return {};
  }
};

template <class G> struct is_mesh : std::false_type {};
template <class C> struct is_mesh<DeviceMesh<C>> : std::true_type {};

template <class Group>
auto& world_of(Group& g) {
  if constexpr (is_mesh<Group>::value) return g.world();
  else return g;
}

}  // namespace detail

}  // namespace fsdp
