#pragma once
// fsdp::shard: a model and wrap policies (fsdp/policy/wrap_policy.hpp) -> a ShardedModel.
//
// The walk. Depth first from the root, children in the order visit_children gives them.
// Decisions are made bottom-up: a module's children are decided before the module, so a
// size or predicate test sees only the parameters of its subtree not already in a unit.
//   - an ignored module is skipped with its whole subtree: it is in no unit;
//   - the outermost module whose static type is in wrap_types becomes a unit with its whole
//     subtree (nothing inside is asked again: the behaviour wrap_types always had);
//   - any other module (not the root) becomes a unit when wrap_modules lists it, or its
//     unwrapped parameter elements reach wrap_min_params, or the wrap_if predicate says so;
//   - the root is always a unit (named ""), taking whatever no other unit took.
// Units may therefore nest; each parameter belongs to the innermost unit around it. Units
// are listed root first, then in depth-first pre-order (a unit before the units nested
// in it): the order of ShardedModel's iteration, shards() and parameters().
//
// fsdp::deferred_init(f) (fsdp/model/deferred_init.hpp), among the options, builds a model whose
// parameters have no storage yet: each unit is initialized and sharded before the next.
// fsdp::module_adapter(a) (fsdp/model/module_adapter.hpp) walks the model through an
// adapter object with per-model state, asked before module_traits, members and ADL.
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/type_name.hpp"
#include "fsdp/model/deferred_init.hpp"
#include "fsdp/model/module_adapter.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/policy/wrap_policy.hpp"
#include "fsdp/unit/make_unit.hpp"
#if !defined(FSDP_SEPARATE_COMPILATION)
#include "fsdp/unit/sharded.hpp"  // detail::make_unit's definition, with the unit's implementation
#endif

namespace fsdp {

namespace detail {
template <class T> struct is_shard_options : std::is_same<T, ShardOptions> {};

template <template <class> class Is, class... Os>
inline constexpr int count_options = (0 + ... + (Is<Os>::value ? 1 : 0));

// The first option that Is accepts, or `fallback`.
template <template <class> class Is, class Fallback>
const Fallback& pick_option(const Fallback& fallback) { return fallback; }
template <template <class> class Is, class Fallback, class O, class... Os>
const auto& pick_option(const Fallback& fallback, const O& o, const Os&... os) {
  if constexpr (Is<O>::value) return o;
  else return pick_option<Is>(fallback, os...);
}

struct NoPredicate {};

// The adapter among the options (an empty pointer to NoModuleAdapter without one).
template <class... Options>
auto adapter_option(const Options&... options) {
  static const ModuleAdapter<NoModuleAdapter> none;
  return pick_option<is_module_adapter>(none, options...).adapter;
}
template <class... Options>
using AdapterOf = typename decltype(adapter_option(std::declval<const Options&>()...))::element_type;

// Adds n elements to a subtree's count; a model beyond int64 elements is refused.
inline void add_elements(std::int64_t& total, std::int64_t n, const std::string& fqn) {
  if (__builtin_add_overflow(total, n, &total))
    fail("shard: the parameter elements under '", fqn, "' overflow int64");
}

// Runs the walk described at the top of this file; see plan().
template <class Types, class Pred, class A = NoModuleAdapter>
class WrapPlanner {
 public:
  struct Node { ModuleId id; std::string fqn; bool unit = false; };

  WrapPlanner(const Pred* pred, const WrapMinParams* min, const WrapModules& manual, const ShardOptions& o,
              A* adapter = nullptr)
      : pred_(pred), min_(min), adapter_(adapter), manual_(manual.modules.begin(), manual.modules.end()),
        ignored_modules_(o.ignored_modules.begin(), o.ignored_modules.end()),
        ignored_params_(o.ignored_parameters.begin(), o.ignored_parameters.end()) {}

  template <class M>
  void run(M& root) {
    const ModuleId id = ModuleId::of(root);
    if (ignored_modules_.count(id)) fail("shard: the model itself is in ShardOptions::ignored_modules");
    manual_found_.insert(id);  // listing the root is harmless: it is a unit anyway
    visit(root, "", 0, {});
    check_found();
  }

  std::vector<Node> nodes;              // every module met outside ignored ones, in pre-order
  std::vector<std::string> ignored;     // FQNs of what is ignored, in visit order
  std::string children;                 // the root's children, for messages
  int type_matches = 0, min_matches = 0, pred_matches = 0;
  bool adapter_used = false;            // a member of the module adapter serves some module

 private:
  struct Closed { std::string by, why; };  // inside a subtree nothing may become a unit

  template <class M>
  [[gnu::cold]] std::int64_t visit(M& m, const std::string& fqn, int depth, const Closed& closed) {
    if constexpr (adapter_param_visit<A, M, param_visitor_archetype> || adapter_child_visit<A, M, child_visitor_archetype> ||
                  adapter_buffer_visit<A, M, buffer_visitor_archetype> || adapter_rebound_hook<A, M>)
      adapter_used = true;
    std::int64_t unwrapped = 0;
    for_each_own_parameter(m, [&](std::string_view name, auto& param, auto&) {
      if (ignored_params_.count(tensor_identity(param))) {  // a handle: what it points to
        if (params_found_.insert(tensor_identity(param)).second) ignored.push_back(join_fqn(fqn, name));
      } else {
        // Checked here, before the units check them: the wrap policies add these up first.
        const std::string pf = join_fqn(fqn, name);
        add_elements(unwrapped, checked_numel(tensor_traits<std::remove_cvref_t<decltype(param)>>::shape(param), pf), pf);
      }
    }, adapter_);
    for_each_child(m, [&](std::string_view name, auto& child) {
      using C = std::remove_cvref_t<decltype(child)>;
      const std::string cf = join_fqn(fqn, name);
      const Met met = meet(ModuleId::of(child), cf, depth, closed);
      if (met.ignored) {
        visit(child, cf, depth + 1, Closed{cf, "an ignored module"});
        return;
      }
      if constexpr (Types::template contains<C>) {
        if (closed.by.empty()) {
          ++type_matches;
          nodes[met.at].unit = true;
          visit(child, cf, depth + 1, Closed{cf, "a unit chosen by " + describe_policy(Types{})});
          return;
        }
      }
      const std::int64_t n = visit(child, cf, depth + 1, closed);
      if (!closed.by.empty()) return;
      bool picked = false;
      if constexpr (std::is_invocable_r_v<bool, const Pred&, C&, std::string_view, int, std::int64_t>)
        picked = pred_ && std::invoke(*pred_, child, std::string_view(cf), depth + 1, n);
      decide(met, n, picked, cf, unwrapped);
    }, adapter_);
    return unwrapped;
  }

  // What visit does with a child that depends on no module type, in two steps, so that it
  // is compiled once per walk and not once per module type: meeting the child (recorded,
  // checked against wrap_modules and the ignored modules), then, once its subtree has
  // been visited, deciding whether it becomes a unit (`picked`: the wrap_if predicate chose
  // it) or adds its `n` elements to its parent's.
  struct Met { std::size_t at = 0; bool listed = false, ignored = false; };
  Met meet(const ModuleId& id, const std::string& cf, int depth, const Closed& closed) {
    if (depth == 0) children += (children.empty() ? "'" : ", '") + cf + "' (" + type_name(id.type) + ")";
    Met met;
    met.listed = manual_.count(id) > 0;
    if (met.listed) manual_found_.insert(id);
    if (ignored_modules_.count(id)) {
      if (met.listed) fail("shard: module '", cf, "' is both in wrap_modules and in ShardOptions::ignored_modules");
      modules_found_.insert(id);
      ignored.push_back(cf);
      met.ignored = true;
      return met;
    }
    if (met.listed && !closed.by.empty())
      fail("shard: wrap_modules lists '", cf, "', but it lies inside '", closed.by, "', ", closed.why,
           ", whose subtree is left whole");
    met.at = nodes.size();
    nodes.push_back({id, cf});
    return met;
  }
  void decide(const Met& met, std::int64_t n, bool picked, const std::string& cf, std::int64_t& unwrapped) {
    bool unit = met.listed;
    if (min_ && n >= min_->min_numel) unit = true, ++min_matches;
    if (picked) unit = true, ++pred_matches;
    if (unit) nodes[met.at].unit = true;
    else add_elements(unwrapped, n, cf);
  }

  void check_found() const {
    for (const auto& id : ignored_modules_)
      if (!modules_found_.count(id))
        fail("shard: ShardOptions::ignored_modules names a ", type_name(id.type), " at ", id.address,
             " that is not in the model");
    for (const void* p : ignored_params_)
      if (!params_found_.count(p))
        fail("shard: ShardOptions::ignored_parameters names a tensor at ", p,
             " that is not a parameter of the model (pass the parameter, not its gradient); a tensor type that is a "
             "handle is named by fsdp::tensor_identity(param)");
    for (const auto& id : manual_)
      if (!manual_found_.count(id))
        fail("shard: wrap_modules names a ", type_name(id.type), " at ", id.address, " that is not in the model");
  }

  const Pred* pred_;
  const WrapMinParams* min_;
  A* adapter_;
  std::set<ModuleId> manual_, manual_found_, ignored_modules_, modules_found_;
  std::set<const void*> ignored_params_, params_found_;
};

// Checks the options and runs the walk. A policy that was asked to wrap something and
// selected nothing is an error naming it: one silent unit for the whole model is almost
// never what was meant.
template <class M, class... Options>
auto plan_units(M& model, const Options&... options) {
  static_assert((... && (is_wrap_types<Options>::value || is_wrap_if<Options>::value || is_min_params<Options>::value ||
                         is_wrap_modules<Options>::value || is_shard_options<Options>::value ||
                         is_deferred_init<Options>::value || is_module_adapter<Options>::value)),
                "fsdp: an argument of fsdp::shard after the device is not a wrap option. Options are "
                "wrap_types<Ts...>{}, wrap_min_params(n), wrap_if(pred), wrap_modules(m...), ShardOptions, "
                "deferred_init(f) and module_adapter(a), in any order, at most one of each");
  static_assert(count_options<is_wrap_types, Options...> <= 1, "fsdp: fsdp::shard takes at most one wrap_types");
  static_assert(count_options<is_wrap_if, Options...> <= 1, "fsdp: fsdp::shard takes at most one wrap_if");
  static_assert(count_options<is_min_params, Options...> <= 1, "fsdp: fsdp::shard takes at most one wrap_min_params");
  static_assert(count_options<is_wrap_modules, Options...> <= 1, "fsdp: fsdp::shard takes at most one wrap_modules");
  static_assert(count_options<is_shard_options, Options...> <= 1, "fsdp: fsdp::shard takes at most one ShardOptions");
  static_assert(count_options<is_deferred_init, Options...> <= 1, "fsdp: fsdp::shard takes at most one deferred_init");
  static_assert(count_options<is_module_adapter, Options...> <= 1, "fsdp: fsdp::shard takes at most one module_adapter");
  static const wrap_types<> no_types;
  static const NoPredicate no_pred;
  static const WrapMinParams no_min;
  static const WrapModules no_modules;
  static const ShardOptions defaults;
  const auto& types = pick_option<is_wrap_types>(no_types, options...);
  const auto& pred = pick_option<is_wrap_if>(no_pred, options...);
  const auto& min = pick_option<is_min_params>(no_min, options...);
  const auto& manual = pick_option<is_wrap_modules>(no_modules, options...);
  const ShardOptions& opts = pick_option<is_shard_options>(defaults, options...);
  using Types = std::remove_cvref_t<decltype(types)>;
  using PredOption = std::remove_cvref_t<decltype(pred)>;
  constexpr bool has_pred = is_wrap_if<PredOption>::value;
  constexpr bool has_min = count_options<is_min_params, Options...> == 1;
  auto call = [&] {
    if constexpr (has_pred) return &pred.pred;
    else return static_cast<const NoPredicate*>(nullptr);
  }();
  using Pred = std::remove_cvref_t<decltype(*call)>;
  using A = AdapterOf<Options...>;
  const auto adapter = adapter_option(options...);
  if constexpr (!std::is_same_v<A, NoModuleAdapter>)
    if (!adapter) fail("shard: fsdp::module_adapter was given a null std::shared_ptr<", type_name(typeid(A)), ">");
  WrapPlanner<Types, Pred, A> planner(call, has_min ? &min : nullptr, manual, opts, adapter.get());
  planner.run(model);
  if constexpr (!std::is_same_v<A, NoModuleAdapter>)
    if (!planner.adapter_used)
      fail("shard: the fsdp::module_adapter given (", type_name(typeid(A)), ") has no visit_parameters, visit_children, ",
           "visit_buffers or parameters_rebound for any module of the model (its root is a ", type_name(typeid(M)),
           "); each takes a module type by non-const reference, e.g. template <class F> void "
           "visit_parameters(Layer&, F&& f)");
  auto none = [&](const std::string& policy, const std::string& extra) {
    fail("shard: wrap policy ", policy, " selected no module", extra, "; the model's children are: ",
         planner.children.empty() ? std::string("none") : planner.children);
  };
  if (!std::is_same_v<Types, wrap_types<>> && planner.type_matches == 0) none(describe_policy(Types{}), "");
  if (has_min && planner.min_matches == 0)
    none("wrap_min_params(" + std::to_string(min.min_numel) + ")", " (no subtree holds that many parameter elements)");
  if constexpr (has_pred)
    if (planner.pred_matches == 0) none("wrap_if(" + pred.name + ")", "");
  return planner;
}

// Builds, in the walk's order, the unit of each module in `units` below m (not m itself),
// without entering ignored modules or wrap_types units (nothing inside them is a unit).
// options_for(module, fqn) gives each unit's deferred init (UnitInit); `adapter` is the
// model's module adapter (empty: none).
template <bool ChangesDtype, class Types, class M, class D, class InitFor, class A>
[[gnu::cold]] void build_units(Types types, M& m, const std::string& fqn, const std::set<ModuleId>& units, const std::set<ModuleId>& ignored,
                 const UnitRecipe& recipe, D& device, const ShardOptions& options, const InitFor& init_for,
                 const std::shared_ptr<A>& adapter, ShardedModel& out) {
  for_each_child(m, [&](std::string_view name, auto& child) {
    using C = std::remove_cvref_t<decltype(child)>;
    const ModuleId id = ModuleId::of(child);
    if (ignored.count(id)) return;
    std::string cf = join_fqn(fqn, name);
    if (units.count(id))
      out.add(make_unit_from<ChangesDtype>(recipe, child, device, cf, options, init_for(child, cf), adapter));
    if constexpr (!Types::template contains<C>)
      build_units<ChangesDtype>(types, child, cf, units, ignored, recipe, device, options, init_for, adapter, out);
  }, adapter.get());
}

// Each unit's part of a deferred init (none without one).
template <class Init, class A>
auto unit_init_for(const ShardOptions& options, const Init& init, const std::shared_ptr<A>& adapter) {
  return [&options, &init, &adapter](auto& module, const std::string& fqn) {
    UnitInit u;
    if constexpr (is_deferred_init<Init>::value) {
      u.init = unit_init(init, module, fqn, adapter);
      u.check_agrees = init.check == InitCheck::ranks_agree && !options.sync_module_states;  // sync makes them agree
    } else {
      (void)module, (void)fqn, (void)options, (void)init, (void)adapter;  // a deferred init's only (clang's -Wunused-lambda-capture)
    }
    return u;
  };
}

// fsdp::shard below, past its policies: they come in as values (`recipe`), so this compiles
// once per model type and options, not once per set of policies. `comm`: the whole world
// (fsdp::shard checked it and the device).
// [[gnu::cold]], here and on the walk (build_units, WrapPlanner::visit, collect_parameters,
// collect_module): they run once, at setup, so the compiler optimises them for size, not
// speed, and every file that calls fsdp::shard compiles faster (bench/compile_cost.sh).
template <bool ChangesDtype, class M, class Comm, class D, class... Options>
[[gnu::cold]] ShardedModel shard_with(const UnitRecipe& recipe, M& model, Comm& comm, D& device, const Options&... options) {
  static const ShardOptions defaults;
  const ShardOptions& opts = pick_option<is_shard_options>(defaults, options...);
  const auto planner = plan_units(model, options...);

  // Agree on the units and the ignored first: a rank with a different model structure
  // would otherwise pair its collectives with the wrong unit's.
  ShardOptions unit_options = opts;  // every unit's: each leaves out the units nested in it
  unit_options.defer_take_over = true;
  Fingerprint f;
  std::set<ModuleId> units;  // besides the root
  for (const auto& n : planner.nodes)
    if (n.unit) {
      f.add(n.fqn);
      units.insert(n.id);
      unit_options.ignored_modules.push_back(n.id);
    }
  const std::size_t count = units.size() + 1;
  f.add_count(count);
  for (const auto& fqn : planner.ignored) f.add("ignored " + fqn);
  check_same_across_ranks(CommRef(comm), f, [] { return "the set of units"; }, [&] {
    std::ostringstream os;  // built only on a mismatch
    os << count << " units (root" << (count > 1 ? " + wrapped" : "");
    const char* sep = ": ";
    for (const auto& n : planner.nodes)
      if (n.unit) os << std::exchange(sep, ", ") << n.fqn;
    os << "), " << planner.ignored.size() << " ignored";
    return os.str();
  });
  // Every unit is built (its copies made, every check passed) before any takes over the
  // engine's tensors: a failure anywhere leaves the engine's model exactly as it was.
  // With deferred_init each unit also materializes, initializes and copies its shard before
  // the next is built, so at most one unit's full parameters exist at a time.
  static const NoDeferredInit no_init;
  const auto adapter = adapter_option(options...);
  const auto init_for = unit_init_for(opts, pick_option<is_deferred_init>(no_init, options...), adapter);
  ShardedModel out;
  out.add(make_unit_from<ChangesDtype>(recipe, model, device, "", unit_options, init_for(model, std::string()), adapter));
  const std::set<ModuleId> ignored(opts.ignored_modules.begin(), opts.ignored_modules.end());
  using Types = std::remove_cvref_t<decltype(pick_option<is_wrap_types>(wrap_types<>{}, options...))>;
  build_units<ChangesDtype>(Types{}, model, "", units, ignored, recipe, device, unit_options, init_for, adapter, out);
  if (!opts.defer_take_over) out.take_over();
  return out;
}
}  // namespace detail

// Shards `model` over `group` (a communicator, or a DeviceMesh for the hybrid strategies)
// with the units the wrap options choose (see the walk above); with none, one root unit.
// Every rank must make the same call.
template <class... Ps, class M, class Group, class D, class... Options>
ShardedModel shard(M& model, Group& group, D& device, const Options&... options) {
  static_assert(ModuleUnder<M, detail::AdapterOf<Options...>>,
                "fsdp: the model passed to fsdp::shard is not an fsdp::Module. Provide visit_parameters(M&, F) "
                "(member, ADL, fsdp::module_traits<M>, or a member of the fsdp::module_adapter passed; it may visit "
                "nothing) and visit_children for its submodules. See docs/concepts.md#module.");
  // The communicator's and device's checks first: their static_asserts say what to write,
  // before any error of the policies' groups over a type that is no communicator.
  check_communicator<std::remove_cvref_t<decltype(detail::world_of(group))>>();
  check_device<D>();
  using Config = Policies<Ps...>;
  detail::check_device_quantizes<Config, D>();
  return detail::shard_with<Config::mixed_precision::enabled>(detail::UnitRecipe::of<Config>(group), model,
                                                             detail::world_of(group), device, options...);
}

}  // namespace fsdp
