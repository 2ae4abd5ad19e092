#pragma once
// fsdp::plan: the per-rank peak bytes per memory space over setup, training steps and a
// summon, before any step, and the live bytes event by event.
//
// The planner runs the library's own code. It builds, for each unit, a real unit
// (fsdp/model/detail/plan_backend.hpp) over a module of the same flat parameters and
// buffers, on a device that counts bytes without allocating any and a communicator that
// moves nothing, with the policies, mesh, persistence threshold and construction options
// of the unit it stands for; it gives them the same run-time settings (reshard, gradient
// sync mode, post-accumulate-grad hooks, explicit prefetch lists, the prefetch limit); and
// it drives them through setup (what fsdp::shard does: sync_module_states, deferred init)
// and training steps, and, if asked, a summon. What those units allocate is what the
// training units allocate, by construction: a change to the schedule moves the plan with it.
//
// The engine's own memory (activations, the model's tensors, optimizer state) is the
// engine's; the plan counts the library's bytes, plus what PlanOptions::engine_state
// says the engine allocates through the same Device after its first step and keeps.
//
// A step, by default: zero_grad, then for each of PlanOptions::micro_batches a pass: one
// forward (units entered in `forward_order`, nested by FQN; a unit may be listed more than
// once, a use each), one backward (the mirror), finish_backward; all passes but the last
// with gradient sync off (no_sync), or (PlanOptions::defer_all_reduce) with the replicate
// all-reduce deferred. PlanOptions::before_pass changes settings between passes (as the
// engine does between micro-batches) and PlanOptions::pass makes a pass's hook calls the
// engine's way (a unit used around separate uses, a forward-only pass), both on the
// planning model, whose units have the FQNs of the model's.
//
// Refused (an fsdp::Error): a model planned with gradient sync or the replicate all-reduce
// off (plan between steps), and a model whose units the given policies or threshold would
// not build (plan<Ps...>: a planning unit holding other shards than the model's unit), and
// a PlanOptions number out of range (check_plan_options: each refusal names the field).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/parse.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/model/detail/plan_backend.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/policy/policies.hpp"

namespace fsdp {

// One unit as the planner needs it: its flat parameters (one per dtype, in order) and buffers.
struct PlannedUnit {
  std::string fqn;  // "" for the root; nesting is read from FQNs ("blocks.0" lies in "")
  struct Flat {
    DType dtype = DType::f32;
    std::int64_t numel = 0;  // parameter elements (a tied tensor once)
    // Of those, the elements of parameters built without storage (fsdp::deferred_init):
    // setup holds them whole while the init fills them.
    std::int64_t deferred_numel = 0;
    // Its parameters one by one, in order, where each one's place depends on the others'
    // sizes (PlanOptions::shard_layout block_aligned or param_atomic); numel and deferred_numel are then their
    // sums, or 0. Empty: one parameter of numel elements (exact under element_flat, and
    // refused under a per-tensor gather, whose amaxes count the parameters).
    // fsdp::plan(model) fills it.
    struct Param {
      std::int64_t numel = 0;
      bool deferred = false;  // built without storage (fsdp::deferred_init)
    };
    std::vector<Param> params = {};
  };
  std::vector<Flat> flat;
  struct Buffer {
    DType dtype = DType::f32;
    std::int64_t numel = 0;
  };
  std::vector<Buffer> buffers;
  // Its ReshardSettings: reshard after forward (nullopt: its strategy's), and over how many
  // ranks a partial reshard keeps the parameters (0: none; else a divisor of the shard
  // group strictly between 1 and its size). Units whose parameters are not sharded ignore both.
  std::optional<bool> reshard_after_forward = std::nullopt;
  int post_forward_ranks = 0;
  // Gradient accumulation (PlanOptions::micro_batches > 1): what its backwards with sync
  // off do (set_gradient_sync_mode), and whether its parameters are freed after each
  // backward (set_reshard_after_backward; off: kept until the next forward).
  GradientSyncMode gradient_sync_mode = GradientSyncMode::keep_unsharded;
  bool reshard_after_backward = true;
  // Its post-accumulate-grad hook (set_post_accumulate_grad_hook), if any: what it does
  // with the sharded gradient after running.
  std::optional<GradientAfterHook> post_accumulate_grad_hook = std::nullopt;
  // Explicit prefetch lists (set_units_to_forward_prefetch / set_units_to_backward_prefetch), by unit FQN.
  std::vector<std::string> units_to_forward_prefetch = {}, units_to_backward_prefetch = {};
  // How it was built (UnitConfig reports it): with rank 0's values broadcast
  // (sync_module_states: setup holds a copy of the unit's parameters and buffers). Deferred
  // init: Flat::deferred_numel.
  bool sync_module_states = false;
};

// Which pass of the plan runs (PlanOptions::before_pass and pass get it).
struct PlanPass {
  int step = 1;         // 1-based
  int micro_batch = 0;  // 0-based, of PlanOptions::micro_batches
  bool last = true;     // the step's last pass: gradient sync on
};

struct PlanOptions {
  MeshShape mesh{};  // {replicate, shard}; from a ShardedModel, read from its units
  int max_prefetched = 2;  // ShardedModel::set_max_prefetched_units; from a ShardedModel, its own
  // The communicator returns pending Work (AsyncCommunicator, NCCL): each unit's reduction
  // overlaps the next unit's backward, so its buffers live one unit longer.
  bool asynchronous = false;
  std::int64_t persistence_threshold = 0;  // ShardOptions::persistence_threshold
  ShardLayout shard_layout = ShardLayout::element_flat();  // ShardOptions::shard_layout
  int steps = 2;  // steps run; every step after the second repeats the second
  // Forward and backward passes per step (gradient accumulation), all but the last under
  // no_sync, each ending with finish_backward.
  int micro_batches = 1;
  // Those passes run with set_requires_all_reduce(false) instead of no_sync (HSDP: each
  // reduce-scatters inside its shard group, the sums wait for the last pass's all-reduce).
  bool defer_all_reduce = false;
  // What the engine allocates through the same Device at the end of the first step and
  // keeps, per space (device, host): its optimizer state. Zero: the library's bytes only.
  std::array<std::size_t, 2> engine_state{};
  // What the engine allocates through the same Device in a unit's first post-accumulate-grad
  // hook and keeps, per space, by unit FQN ("" for the root): an optimizer stepping in
  // backward creates its state there.
  std::map<std::string, std::array<std::size_t, 2>, std::less<>> engine_state_in_hook = {};
  // Unit FQNs in the order forward enters them, a unit once per use; empty: the units'
  // order (fsdp::shard's depth-first order, which is the forward order of a model that runs
  // its children in visit order). Entries nest by FQN ("blocks.0" inside the root's entry
  // before it); a unit listed twice is entered twice, as a tied embedding or a block
  // applied twice is, and backward mirrors the entries.
  std::vector<std::string> forward_order = {};
  // Called before each pass, after the planner set gradient sync for it: the settings the
  // engine changes between micro-batches (set_reshard_after_backward, set_gradient_sync_mode,
  // ...), made on the planning model's units, found by FQN (model.unit("blocks.0")).
  std::function<void(ShardedModel&, const PlanPass&)> before_pass = {};
  // The hook calls of one pass (forward, then backward; the planner calls finish_backward
  // after it), as the engine makes them, on the planning model; empty: forward_order's.
  std::function<void(ShardedModel&, const PlanPass&)> pass = {};
  // A summon of the whole model (ShardedModel::summon_full_params with these options) after
  // the last step, as a state dict or an evaluation between steps makes one.
  std::optional<SummonOptions> summon = std::nullopt;
  // Keep the timeline of live bytes (MemoryPlan::timeline): one entry per allocation and free.
  bool timeline = true;
  // The device the units are on (a few buffers differ on CUDA: a summon's gradients);
  // from a ShardedModel, read from its units.
  DeviceId device{};
};

struct MemoryPlan {
  struct Peak {
    std::size_t bytes = 0;
    std::string unit;   // the unit whose allocation reached it ("<root>" for the root; "" for PlanOptions::engine_state)
    std::string phase;  // setup, the hook that allocated (pre_backward, ...; "pre_forward of 'a'": a's prefetches it), summon_full_params
    int step = 0;       // 1-based; 0: setup
  };
  std::array<Peak, 2> peaks;          // per MemorySpace
  std::array<std::size_t, 2> steady{};  // live between steps (after the last one run)
  std::array<std::size_t, 2> setup_peak{};  // the peak while fsdp::shard builds the units
  // Every allocation and free, in order: the bytes live after it in each space, whose memory
  // it is (a unit's display name, also for the engine's state made in its hook; "" for
  // PlanOptions::engine_state) and in which hook ("pre_forward"; "pre_forward of 'blocks.0'"
  // when another unit's hook runs it: a prefetch, or a reduction completing), step 0 for setup.
  struct Event {
    std::array<std::size_t, 2> live{};
    std::int64_t delta = 0;
    MemorySpace space = MemorySpace::device;
    std::string unit, phase;
    int step = 0;
  };
  std::vector<Event> timeline;

  std::size_t peak_bytes(MemorySpace s = MemorySpace::device) const { return peaks[static_cast<std::size_t>(s)].bytes; }
  const Peak& peak(MemorySpace s = MemorySpace::device) const { return peaks[static_cast<std::size_t>(s)]; }
  // The timeline as counter tracks for a trace file (fsdp::write_chrome_json): live bytes
  // per memory space, one microsecond per allocation or free (the plan has no clock), in a
  // process "rank R: fsdp::plan" of its own (pid 1000 + R).
  std::vector<CounterTrack> counter_tracks(int rank) const {
    std::vector<CounterTrack> out;
    for (MemorySpace s : {MemorySpace::device, MemorySpace::host}) {
      CounterTrack t{"rank " + std::to_string(rank) + ": fsdp::plan (1 us per allocation or free)", 1000 + rank,
                     "planned " + std::string(name_of(s)) + " bytes", {}};
      for (std::size_t i = 0; i < timeline.size(); ++i)
        t.points.emplace_back(static_cast<double>(i), static_cast<double>(timeline[i].live[static_cast<std::size_t>(s)]));
      out.push_back(std::move(t));
    }
    return out;
  }
  // The timeline as a table gnuplot reads: a header line, then per event its index, step,
  // device and host bytes live after it, and "unit" and "phase" quoted.
  void write_timeline(std::ostream& os) const {
    os << "# event step device_bytes host_bytes unit phase\n";
    for (std::size_t i = 0; i < timeline.size(); ++i) {
      const Event& e = timeline[i];
      auto quoted = [](std::string s) {  // gnuplot's data strings have no escapes: " becomes '
        for (char& c : s) if (c == '"') c = '\'';
        return '"' + s + '"';
      };
      os << i << ' ' << e.step << ' ' << e.live[0] << ' ' << e.live[1] << ' ' << quoted(e.unit) << ' ' << quoted(e.phase) << '\n';
    }
  }

  // "device: peak 123 B at unit 'blocks.2', pre_backward, step 2; host: ..."
  std::string describe() const {
    std::ostringstream os;
    for (MemorySpace s : {MemorySpace::device, MemorySpace::host}) {
      const Peak& p = peak(s);
      os << (s == MemorySpace::device ? "device: peak " : "; host: peak ") << p.bytes << " B";
      if (p.step == 0) os << " at setup";
      else os << " at " << (p.unit.empty() ? std::string("the engine's state") : "unit '" + p.unit + "'") << ", " << p.phase
              << ", step " << p.step;
    }
    return os.str();
  }
};

namespace detail {

inline bool nests_in(const std::string& outer, const std::string& inner) {
  if (outer == inner) return false;
  return outer.empty() || (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 && inner[outer.size()] == '.');
}

// The planning model and what its units run on; the model goes first, the ledger last.
struct PlanRun {
  PlanLedger ledger;
  std::vector<std::unique_ptr<PlanComm>> comms;
  std::vector<std::unique_ptr<PlanDevice>> devices;
  std::vector<std::unique_ptr<PlanModule>> modules;
  ShardedModel model;

  PlanComm& comm(int rank, int size, bool asynchronous) {
    comms.push_back(std::make_unique<PlanComm>(rank, size, asynchronous));
    return *comms.back();
  }
};

// The groups fsdp::shard gives a unit of `policy` on `rank` of mesh `m` (UnitGroups::flat
// and from_mesh; a hybrid mesh's shard groups are its rows, as DeviceMesh's).
inline UnitGroups plan_groups(PlanRun& run, const PolicyConfig& policy, MeshShape m, int rank, bool asynchronous) {
  const int world = m.size();
  PlanComm& w = run.comm(rank, world, asynchronous);
  if (policy.hybrid) {
    PlanComm& shard = run.comm(rank % m.shard, m.shard, asynchronous);
    PlanComm& replicate = run.comm(rank / m.shard, m.replicate, asynchronous);
    UnitGroups g{CommRef(w), CommRef(shard), CommRef(replicate)};
    g.shard_size = m.shard, g.shard_rank = rank % m.shard, g.replicate_size = m.replicate;
    return g;
  }
  UnitGroups g{CommRef(w), CommRef(w), CommRef(w)};
  g.shards_parameters = policy.shards_parameters;
  if (policy.shards_parameters) g.shard_size = world, g.shard_rank = rank;
  else g.replicate_size = world;
  return g;
}

// Forward entries nested by FQN: each entry's unit, and the entries inside it.
struct PlanEntries {
  struct Entry {
    int unit;
    std::vector<int> inside;
  };
  std::vector<Entry> entries;
  std::vector<int> tops;

  PlanEntries(const std::vector<PlannedUnit>& units, const std::vector<int>& forward) {
    std::vector<int> open;
    for (int u : forward) {
      const std::string& fqn = units[static_cast<std::size_t>(u)].fqn;
      while (!open.empty() && !nests_in(units[static_cast<std::size_t>(entries[static_cast<std::size_t>(open.back())].unit)].fqn, fqn))
        open.pop_back();
      entries.push_back({u, {}});
      const int e = static_cast<int>(entries.size()) - 1;
      (open.empty() ? tops : entries[static_cast<std::size_t>(open.back())].inside).push_back(e);
      open.push_back(e);
    }
  }
  // One pass's hooks: forward in entry order, backward the mirror.
  void run(ShardedModel& model) const {
    for (int e : tops) forward(model, e);
    for (auto it = tops.rbegin(); it != tops.rend(); ++it) backward(model, *it);
  }

 private:
  void forward(ShardedModel& model, int e) const {
    const Entry& entry = entries[static_cast<std::size_t>(e)];
    Unit& u = model[static_cast<std::size_t>(entry.unit)];
    u.pre_forward();
    for (int i : entry.inside) forward(model, i);
    u.post_forward();
  }
  void backward(ShardedModel& model, int e) const {
    const Entry& entry = entries[static_cast<std::size_t>(e)];
    Unit& u = model[static_cast<std::size_t>(entry.unit)];
    u.pre_backward();
    for (auto it = entry.inside.rbegin(); it != entry.inside.rend(); ++it) backward(model, *it);
    u.post_backward();
  }
};

// Every PlanOptions field that holds a number, checked before anything is built: each
// refusal names the field and its value. The mesh's product is taken in 64 bits (a shape
// whose ranks overflow an int is refused, not wrapped to a small world); steps after the
// second repeat it, so more than kMaxPlanSteps is a mistake, not a longer plan; a byte
// count past int64 (a negative number stored in a size_t) is no byte count.
inline constexpr int kMaxPlanSteps = 1000;
inline constexpr int kMaxPlanMicroBatches = 1 << 16;
inline void check_plan_options(const PlanOptions& options) {
  const MeshShape m = options.mesh;
  if (m.replicate < 1 || m.shard < 1) detail::fail("fsdp::plan: the mesh ", m.str(), " has no ranks; set PlanOptions::mesh");
  if (m.ranks() > std::numeric_limits<int>::max())
    detail::fail("fsdp::plan: PlanOptions::mesh ", m.str(), " is ", m.ranks(), " ranks, more than an int counts (",
                 std::numeric_limits<int>::max(), ")");
  if (options.max_prefetched < 0)
    detail::fail("fsdp::plan: the prefetch limit (PlanOptions::max_prefetched) must be >= 0, got ", options.max_prefetched);
  if (options.persistence_threshold < 0)
    detail::fail("fsdp::plan: PlanOptions::persistence_threshold must be >= 0 (0: every unit follows its strategy), got ",
                 options.persistence_threshold);
  check_shard_layout(options.shard_layout, "fsdp::plan: PlanOptions::shard_layout");
  if (options.steps < 1 || options.steps > kMaxPlanSteps)
    detail::fail("fsdp::plan: PlanOptions::steps must be >= 1 and at most ", kMaxPlanSteps,
                 " (every step after the second repeats the second), got ", options.steps);
  if (options.micro_batches < 1 || options.micro_batches > kMaxPlanMicroBatches)
    detail::fail("fsdp::plan: PlanOptions::micro_batches must be >= 1 and at most ", kMaxPlanMicroBatches, ", got ",
                 options.micro_batches);
  constexpr auto most_bytes = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
  auto check_bytes = [&](const std::array<std::size_t, 2>& state, auto&&... where) {
    for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
      if (const std::size_t b = state[static_cast<std::size_t>(space)]; b > most_bytes)
        detail::fail("fsdp::plan: PlanOptions::", where..., "[", name_of(space), "] is ", b,
                     " bytes, more than int64 counts (a negative number converted to size_t?)");
  };
  check_bytes(options.engine_state, "engine_state");
  for (const auto& [fqn, state] : options.engine_state_in_hook)
    check_bytes(state, "engine_state_in_hook['", fqn, "']");
}

// The plan of `units` under `policy` on `rank`: builds a real unit for each over the
// planning backend (fsdp/model/detail/plan_backend.hpp) and runs setup, the steps and the
// summon on them. `model` (may be null): the model planned, whose shards each planning
// unit must reproduce (else the policies or threshold given are not the model's).
inline MemoryPlan plan_for(const PolicyConfig& policy, const std::vector<PlannedUnit>& units, const PlanOptions& options,
                           int rank = 0, ShardedModel* model = nullptr) {
  check_plan_options(options);
  const MeshShape m = options.mesh;
  if (units.empty()) detail::fail("fsdp::plan: no units");
  const int shard = policy.hybrid ? m.shard : policy.shards_parameters ? m.size() : 1;
  std::map<std::string_view, int> index;  // by FQN
  for (std::size_t i = 0; i < units.size(); ++i)
    if (!index.emplace(units[i].fqn, static_cast<int>(i)).second)
      detail::fail("fsdp::plan: two units named '", detail::display_name(units[i].fqn), "'");
  auto index_of = [&](const std::string& fqn, auto&&... what) {
    const auto it = index.find(fqn);
    if (it == index.end()) detail::fail("fsdp::plan: ", what..., " names '", detail::display_name(fqn), "', which is no unit");
    return it->second;
  };
  for (const PlannedUnit& u : units) {
    const std::string name = std::string(detail::display_name(u.fqn));
    for (const auto& f : u.flat) {
      if (f.numel < 0) detail::fail("fsdp::plan: unit '", name, "' has a flat parameter of ", f.numel, " elements");
      if (!f.params.empty()) {  // given one by one: the totals, where given too, must be theirs
        std::int64_t all = 0, deferred = 0;
        for (const auto& p : f.params) {
          if (p.numel < 0) detail::fail("fsdp::plan: unit '", name, "' has a parameter of ", p.numel, " elements");
          all = checked_sum(all, p.numel, "fsdp::plan: unit '" + name + "': the elements of a flat parameter");
          checked_product<std::int64_t>(all, static_cast<std::int64_t>(size_of(f.dtype)),
                                        "fsdp::plan: unit '" + name + "': the bytes of a flat parameter");
          if (p.deferred) deferred += p.numel;
        }
        if ((f.numel != 0 && f.numel != all) || (f.deferred_numel != 0 && f.deferred_numel != deferred))
          detail::fail("fsdp::plan: unit '", name, "' has a flat parameter of ", f.numel, " elements (", f.deferred_numel,
                       " deferred) whose parameters hold ", all, " (", deferred, " deferred); give one or the other");
      } else if (options.shard_layout.depends_on_each_size() && policy.shards_parameters && f.numel > 0) {
        detail::fail("fsdp::plan: unit '", name, "': under the shard layout ", name_of(options.shard_layout),
                     " where each parameter lies depends on each one's size; list them in PlannedUnit::Flat::params");
      } else if (policy.precision.comm_quantized && is_per_tensor(policy.precision.comm_gather_format) &&
                 policy.shards_parameters && f.numel > 0) {
        detail::fail("fsdp::plan: unit '", name, "': a per-tensor gather (", name_of(policy.precision.comm_gather_format),
                     ") keeps an amax per parameter, so the plan needs the parameters; list them in "
                     "PlannedUnit::Flat::params");
      }
      checked_product<std::int64_t>(f.numel, static_cast<std::int64_t>(size_of(f.dtype)),
                                    "fsdp::plan: unit '" + name + "': the bytes of a flat parameter");
    }
    for (const auto& b : u.buffers) {
      if (b.numel < 0) detail::fail("fsdp::plan: unit '", name, "' has a buffer of ", b.numel, " elements");
      checked_product<std::int64_t>(b.numel, static_cast<std::int64_t>(size_of(b.dtype)),
                                    "fsdp::plan: unit '" + name + "': the bytes of a buffer");
    }
    const int k = u.post_forward_ranks;
    if (k != 0 && (k <= 1 || k >= shard || shard % k != 0))
      detail::fail("fsdp::plan: unit '", name, "' reshards after forward to groups of ", k, " ranks, which must divide the ",
                   shard, " ranks of its shard group and lie strictly between 1 and ", shard);
    for (const auto& f : u.units_to_forward_prefetch) index_of(f, "unit '", name, "''s forward prefetch");
    for (const auto& f : u.units_to_backward_prefetch) index_of(f, "unit '", name, "''s backward prefetch");
  }
  for (const auto& [fqn, bytes] : options.engine_state_in_hook)
    if (!units[static_cast<std::size_t>(index_of(fqn, "engine_state_in_hook"))].post_accumulate_grad_hook)
      detail::fail("fsdp::plan: engine_state_in_hook names unit '", detail::display_name(fqn), "', which has no post-accumulate-grad hook");
  std::vector<int> forward;
  if (options.forward_order.empty()) {
    for (std::size_t i = 0; i < units.size(); ++i) forward.push_back(static_cast<int>(i));
  } else {
    for (const auto& name : options.forward_order) forward.push_back(index_of(name, "forward_order"));
    for (std::size_t i = 0; i < units.size(); ++i)
      if (std::find(forward.begin(), forward.end(), static_cast<int>(i)) == forward.end() && !options.pass)
        detail::fail("fsdp::plan: forward_order does not name unit '", detail::display_name(units[i].fqn),
                     "'; list every unit once per use in forward");
  }
  const PlanEntries entries(units, forward);

  PlanRun run;
  run.ledger.record_timeline = options.timeline;
  const UnitGroups groups = plan_groups(run, policy, m, rank, options.asynchronous);
  for (const PlannedUnit& u : units) {  // setup: fsdp::shard's order, every unit built before any takes over
    auto module = std::make_unique<PlanModule>();
    // One parameter per flat parameter (two where deferred init binds part of it: the
    // layout is the same, parameters lie end to end), built without storage where deferred.
    bool deferred = false;
    auto add = [&](const std::string& name, std::int64_t numel, DType t, bool without_storage) {
      const std::size_t bytes = static_cast<std::size_t>(numel) * size_of(t);
      void* engine = without_storage || bytes == 0 ? nullptr : run.ledger.engine_address(bytes);
      module->params.push_back({name, {{numel}, t, engine, options.device}, {{numel}, t, nullptr, options.device}});
    };
    for (std::size_t k = 0; k < u.flat.size(); ++k) {
      const auto& f = u.flat[k];
      if (!f.params.empty()) {  // one by one, as the unit holds them
        for (std::size_t i = 0; i < f.params.size(); ++i) {
          add("flat" + std::to_string(k) + "." + std::to_string(i), f.params[i].numel, f.dtype, f.params[i].deferred);
          deferred = deferred || f.params[i].deferred;
        }
        continue;
      }
      if (f.deferred_numel < 0 || f.deferred_numel > f.numel)
        detail::fail("fsdp::plan: unit '", detail::display_name(u.fqn), "' has ", f.deferred_numel, " deferred elements in a flat parameter of ",
                     f.numel);
      if (f.deferred_numel > 0) add("flat" + std::to_string(k) + ".deferred", f.deferred_numel, f.dtype, true), deferred = true;
      if (f.deferred_numel == 0 || f.numel > f.deferred_numel) add("flat" + std::to_string(k), f.numel - f.deferred_numel, f.dtype, false);
    }
    for (std::size_t b = 0; b < u.buffers.size(); ++b) {
      const auto& buf = u.buffers[b];
      void* engine = run.ledger.engine_address(static_cast<std::size_t>(buf.numel) * size_of(buf.dtype));
      module->buffers.push_back({"buffer" + std::to_string(b), {{buf.numel}, buf.dtype, engine, options.device}});
    }
    ShardOptions o;
    o.sync_module_states = u.sync_module_states;
    o.defer_take_over = true;
    o.persistence_threshold = options.persistence_threshold;
    o.shard_layout = options.shard_layout;
    UnitInit init;
    if (deferred) init.init = [](const MaterializedTensors&, const SkipSet&) {};
    run.devices.push_back(std::make_unique<PlanDevice>(run.ledger, std::string(detail::display_name(u.fqn)), options.device));
    run.modules.push_back(std::move(module));  // before the unit that points into it
    run.model.emplace<PlanUnit>(policy, *run.modules.back(), groups, *run.devices.back(), u.fqn, o, init, run.ledger);
  }
  run.model.take_over();
  run.ledger.check();
  MemoryPlan out;
  for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
    out.setup_peak[static_cast<std::size_t>(space)] = run.ledger.peak(space).bytes;
  ShardedModel& sm = run.model;
  if (model) {  // each planning unit holds what the model's does, or the policies given are not its own
    for (std::size_t i = 0; i < units.size(); ++i) {
      const Unit& real = (*model)[i];
      const auto mine = sm[i].shards(), theirs = real.shards();
      auto refuse = [&](const std::string& why) {
        detail::fail("fsdp::plan: unit '", fsdp::detail::display_name(real.fqn()), "' on rank ", fsdp::detail::internals(real).rank(), ": ", why);
      };
      // On a shard group of one rank a unit kept whole holds shards of the same size as a
      // sharded one, and allocates otherwise: the threshold is compared by its outcome.
      if (const bool kept = sm[i].config().kept_unsharded; kept != real.config().kept_unsharded)
        refuse(std::string(kept ? "is sharded where the plan keeps it whole under" : "is kept whole where the plan shards it under") +
               " the persistence threshold " + std::to_string(options.persistence_threshold) + ": is it the one given to fsdp::shard?");
      for (std::size_t k = 0; k < theirs.size() && k < mine.size(); ++k) {
        const ShardView &v = theirs[k], &p = mine[k];
        const bool kept = sm[i].config().kept_unsharded;
        if (v.padded_numel != p.padded_numel)
          refuse("its " + std::string(name_of(v.dtype)) + " shard holds " + std::to_string(v.padded_numel) + " elements where " +
                 std::to_string(p.padded_numel) + " are planned (" + (kept ? "kept whole under" : "sharded; are") +
                 " the persistence threshold " + std::to_string(options.persistence_threshold) +
                 (kept ? ")" : " and the shard layout " + name_of(options.shard_layout) + " the ones given to fsdp::shard?)"));
        if (v.grad_dtype != p.grad_dtype)
          refuse("its gradient is " + std::string(name_of(v.grad_dtype)) + ", the policies give " + std::string(name_of(p.grad_dtype)) +
                 ": plan with the policies given to fsdp::shard");
        if (v.space != p.space)
          refuse(std::string("its shard is in ") + std::string(fsdp::name_of(v.space)) +
                 " space, the policies say otherwise (CpuOffload): plan with the policies given to fsdp::shard");
      }
      if (mine.size() != theirs.size())
        refuse("it has " + std::to_string(theirs.size()) + " flat parameters, the plan " + std::to_string(mine.size()));
    }
  }
  // The run-time settings of each unit, as the model's are now.
  sm.set_max_prefetched_units(options.max_prefetched);
  for (std::size_t i = 0; i < units.size(); ++i) {
    const PlannedUnit& u = units[i];
    Unit& s = sm[i];
    if (u.reshard_after_forward) s.set_reshard_after_forward(*u.reshard_after_forward);
    if (u.post_forward_ranks > 0 && policy.shards_parameters && !s.config().kept_unsharded)
      s.set_reshard_after_forward(run.comm(groups.shard_rank % u.post_forward_ranks, u.post_forward_ranks, options.asynchronous));
    s.set_reshard_after_backward(u.reshard_after_backward);
    s.set_gradient_sync_mode(u.gradient_sync_mode);
    if (u.post_accumulate_grad_hook) {
      std::array<std::size_t, 2> state{};
      if (auto it = options.engine_state_in_hook.find(u.fqn); it != options.engine_state_in_hook.end()) state = it->second;
      s.set_post_accumulate_grad_hook(
          [ledger = &run.ledger, name = std::string(detail::display_name(u.fqn)), state, ran = false](Unit&) mutable {
            if (std::exchange(ran, true)) return;  // an optimizer in backward creates its state in its first hook
            for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
              if (std::size_t b = state[static_cast<std::size_t>(space)])
                ledger->allocate(b, space, name, "optimizer state (engine, in backward)");
          },
          *u.post_accumulate_grad_hook);
    }
    std::vector<Unit*> list;
    for (const auto& f : u.units_to_forward_prefetch) list.push_back(&sm[static_cast<std::size_t>(index_of(f))]);
    s.set_units_to_forward_prefetch(std::exchange(list, {}));
    for (const auto& f : u.units_to_backward_prefetch) list.push_back(&sm[static_cast<std::size_t>(index_of(f))]);
    s.set_units_to_backward_prefetch(std::move(list));
  }
  for (int step = 1; step <= options.steps; ++step) {
    run.ledger.step = step;
    run.ledger.phase = "step";
    sm.zero_grad();
    for (int mb = 0; mb < options.micro_batches; ++mb) {
      const PlanPass pass{step, mb, mb + 1 == options.micro_batches};
      if (options.defer_all_reduce) sm.set_requires_all_reduce(pass.last);
      else sm.set_requires_gradient_sync(pass.last);
      if (options.before_pass) options.before_pass(sm, pass);
      if (options.pass) options.pass(sm, pass);
      else entries.run(sm);
      sm.finish_backward();
    }
    if (step == 1)
      for (MemorySpace space : {MemorySpace::device, MemorySpace::host})
        if (std::size_t b = options.engine_state[static_cast<std::size_t>(space)])
          run.ledger.allocate(b, space, "", "optimizer state (engine)");
  }
  for (MemorySpace space : {MemorySpace::device, MemorySpace::host}) out.steady[static_cast<std::size_t>(space)] = run.ledger.live(space);
  if (options.summon) {
    run.ledger.phase = "summon_full_params";
    auto summoned = sm.summon_full_params(*options.summon);
  }
  run.ledger.check();
  for (MemorySpace space : {MemorySpace::device, MemorySpace::host}) {
    const auto& p = run.ledger.peak(space);
    out.peaks[static_cast<std::size_t>(space)] = {p.bytes, p.unit, p.phase, p.step};
  }
  out.timeline.reserve(run.ledger.events().size());
  for (auto& e : run.ledger.events()) out.timeline.push_back({e.live, e.delta, e.space, std::move(e.unit), std::move(e.phase), e.step});
  return out;
}

// A ShardedModel's units as the planner needs them, read from the units' public views and
// configurations (options.mesh, device, max_prefetched and shard_layout from the model's
// first unit); refused while a step is under way.
inline std::vector<PlannedUnit> planned_units_for(ShardedModel& model, PlanOptions& options) {
  if (model.size() == 0) detail::fail("fsdp::plan: the model has no units");
  options.mesh = fsdp::detail::internals(model[0]).mesh_shape();  // every unit of a model uses the same groups
  options.device = fsdp::detail::internals(model[0]).device_id();
  options.max_prefetched = model.execution_order().max_prefetched;
  options.shard_layout = model[0].config().shard_layout;
  std::vector<PlannedUnit> out;
  for (auto& unit : model) {
    const Unit& u = *unit;
    const UnitConfig config = u.config();
    auto refuse = [&](const std::string& why) {
      detail::fail("fsdp::plan: unit '", fsdp::detail::display_name(u.fqn()), "' on rank ", fsdp::detail::internals(u).rank(), ": ", why);
    };
    if (!config.sync.requires_sync)
      refuse("has gradient sync off; plan between steps, with sync on, and give the micro-batches per step in "
             "PlanOptions::micro_batches");
    if (!config.sync.requires_all_reduce)
      refuse("has the replicate all-reduce off; plan between steps, with it on, and set PlanOptions::defer_all_reduce "
             "and micro_batches");
    if (u.state() != TrainingState::IDLE) refuse("is not IDLE; plan between steps");
    PlannedUnit p;
    p.fqn = u.fqn();
    const auto shards = u.shards();
    p.flat.resize(shards.size());
    for (std::size_t k = 0; k < shards.size(); ++k) p.flat[k].dtype = shards[k].dtype;
    for (const ParamView& v : u.parameters()) {
      const bool deferred =
          std::find(config.deferred_parameters.begin(), config.deferred_parameters.end(), v.fqn) != config.deferred_parameters.end();
      auto& f = p.flat.at(v.shard);
      f.numel += v.numel;
      if (deferred) f.deferred_numel += v.numel;
      f.params.push_back({v.numel, deferred});
    }
    for (const BufferView& b : u.buffers()) p.buffers.push_back({b.dtype, b.numel});
    p.reshard_after_forward = config.reshard.after_forward;
    p.post_forward_ranks = config.reshard.post_forward_ranks;
    p.reshard_after_backward = config.reshard.after_backward;
    p.gradient_sync_mode = config.sync.mode;
    if (config.post_accumulate_grad_hook) p.post_accumulate_grad_hook = config.after_hook;
    p.units_to_forward_prefetch = config.units_to_forward_prefetch;
    p.units_to_backward_prefetch = config.units_to_backward_prefetch;
    p.sync_module_states = config.sync_module_states;
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace detail

// The plan of units described by hand (nothing built): Ps are the policies fsdp::shard
// would get. options.mesh is required ({1, N} for N ranks without a hybrid strategy).
template <class... Ps>
MemoryPlan plan(const std::vector<PlannedUnit>& units, const PlanOptions& options) {
  return detail::plan_for(policy_config<Policies<Ps...>>(), units, options);
}

// The units of a sharded model as the planner needs them (options.mesh and max_prefetched
// are read from the model). Ps are not needed to read them; plan<Ps...>(model) checks them.
template <class... Ps>
std::vector<PlannedUnit> planned_units(ShardedModel& model, PlanOptions& options) {
  return detail::planned_units_for(model, options);
}

namespace detail {
// Plans a model's units under `policy`, checking that its units use the groups the
// policy's strategy gives (the planning units' shards are compared with theirs in plan_for).
inline MemoryPlan plan_model(const PolicyConfig& policy, ShardedModel& model, PlanOptions& options) {
  const auto units = planned_units_for(model, options);
  const int shard = options.mesh.shard;
  const int shard_size = policy.hybrid ? shard : policy.shards_parameters ? options.mesh.size() : 1;
  if (shard_size != shard)
    fail("fsdp::plan: the model uses a ", internals(model[0]).groups(), ", which its policies' strategy would not: plan with the "
         "policies given to fsdp::shard");
  return plan_for(policy, units, options, fsdp::detail::internals(model[0]).rank(), &model);
}
}  // namespace detail

// The plan of `model`'s training steps, built before any step (or between steps), checked
// against the policies Ps given to fsdp::shard. fsdp::plan(model) below needs none.
template <class... Ps>
MemoryPlan plan(ShardedModel& model, PlanOptions options = {}) {
  return detail::plan_model(policy_config<Policies<Ps...>>(), model, options);
}

// The plan of `model`'s training steps, from what the model reports of itself
// (ShardedModel::config()): its policies, mesh, prefetch limit, persistence threshold and
// how each unit was built are read, not restated; options.mesh, max_prefetched and
// persistence_threshold are overwritten. Every unit must have the same policies and
// threshold (units built by hand with different ones are refused).
inline MemoryPlan plan(ShardedModel& model, PlanOptions options = {}) {
  if (model.size() == 0) detail::fail("fsdp::plan: the model has no units");
  const ModelConfig config = model.config();
  const UnitConfig& first = config.units.front();
  for (const UnitConfig& u : config.units) {
    if (u.policies != first.policies)
      detail::fail("fsdp::plan: units '", detail::display_name(first.fqn), "' (", to_string(first.policies), ") and '",
                   detail::display_name(u.fqn), "' (", to_string(u.policies), ") on rank ", fsdp::detail::internals(model[0]).rank(),
                   " have different policies; the planner builds one configuration");
    if (u.persistence_threshold != first.persistence_threshold)
      detail::fail("fsdp::plan: units '", detail::display_name(first.fqn), "' and '", detail::display_name(u.fqn), "' on rank ",
                   fsdp::detail::internals(model[0]).rank(), " have different persistence thresholds (", first.persistence_threshold, " and ",
                   u.persistence_threshold, "); the planner builds one configuration");
    if (u.shard_layout != first.shard_layout)
      detail::fail("fsdp::plan: units '", detail::display_name(first.fqn), "' and '", detail::display_name(u.fqn), "' on rank ",
                   fsdp::detail::internals(model[0]).rank(), " have different shard layouts (", name_of(first.shard_layout), " and ",
                   name_of(u.shard_layout), "); the planner builds one configuration");
  }
  options.persistence_threshold = first.persistence_threshold;
  options.shard_layout = first.shard_layout;
  return detail::plan_model(first.policies, model, options);
}

}  // namespace fsdp
