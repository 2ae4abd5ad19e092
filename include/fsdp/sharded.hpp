#pragma once
// fsdp::Sharded<Module, Policies...>: one unit of sharding (FSDP's wrapped module). At
// construction it takes over the module's parameters (all of its subtree, except children
// whose type is listed in the `exclude` wrap_types, which become units of their own):
// it copies this rank's slice into a flat shard, checks that every rank built the same
// unit, and rebinds the engine's tensors to "no storage". The hooks then make the
// parameters valid exactly while the engine computes with them; inside a ShardedModel
// they also follow its ExecutionOrder to prefetch and to keep one reduction in flight.
#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/communicator.hpp"
#include "fsdp/detail/backend_ref.hpp"
#include "fsdp/detail/fingerprint.hpp"
#include "fsdp/device.hpp"
#include "fsdp/device_mesh.hpp"
#include "fsdp/flat_param.hpp"
#include "fsdp/module.hpp"
#include "fsdp/policies.hpp"
#include "fsdp/trace.hpp"
#include "fsdp/unit.hpp"

namespace fsdp {

// Types whose instances become units of their own (FSDP's ModuleWrapPolicy).
template <class... Types>
struct wrap_types {
  template <class T>
  static constexpr bool contains = (std::is_same_v<T, Types> || ...);
};

struct UnitOptions {
  std::string fqn;  // the module's FQN within the model ("" for the root): names parameters
};

// FSDP's split of the 1/N average into a factor before and one after the reduction,
// so low-precision gradients neither overflow in the sum nor underflow before it.
inline double gradient_predivide_factor(int world) {
  int factor = 1;
  while (world % factor == 0 && static_cast<double>(world) / factor > factor) factor *= 2;
  return factor;
}

namespace detail {

// One parameter as the unit holds it: where to rebind the engine's tensors.
struct ParamBinding {
  void* param = nullptr;
  void* grad = nullptr;
  void (*rebind)(void* tensor, void* data) = nullptr;
};

struct CollectedParam {
  ParamInfo info;
  DType dtype, grad_dtype;
  std::vector<std::int64_t> grad_shape;
  DeviceId device;
  const void* data;
  ParamBinding binding;
};

// The process groups one unit talks to, whatever the strategy.
struct UnitGroups {
  CommRef world;      // all ranks: setup checks
  CommRef shard;      // parameters are split across it (unused when the strategy replicates)
  CommRef replicate;  // gradients are all-reduced across it (when replicate_size > 1)
  int shard_size = 1, shard_rank = 0, replicate_size = 1;

  template <class Strategy, Communicator C>
  static UnitGroups flat(C& comm) {
    static_assert(!Strategy::hybrid,
                  "fsdp: HybridShard and HybridShardZero2 shard inside one dimension of a mesh and "
                  "replicate across the other: pass an fsdp::DeviceMesh instead of a communicator");
    UnitGroups g{CommRef(comm), CommRef(comm), CommRef(comm)};
    if constexpr (Strategy::shards_parameters) g.shard_size = comm.size(), g.shard_rank = comm.rank();
    else g.replicate_size = comm.size();
    return g;
  }

  template <class Strategy, class Mesh>
  static UnitGroups from_mesh(Mesh& mesh) {
    if constexpr (!Strategy::hybrid) return flat<Strategy>(mesh.world());
    else {
      UnitGroups g{CommRef(mesh.world()), CommRef(mesh.shard_group()), CommRef(mesh.replicate_group())};
      g.shard_size = mesh.shard_group().size();
      g.shard_rank = mesh.shard_group().rank();
      g.replicate_size = mesh.replicate_group().size();
      return g;
    }
  }
};

template <class Exclude, class M>
void collect_parameters(M& m, const std::string& prefix, std::vector<CollectedParam>& out) {
  for_each_own_parameter(m, [&](std::string_view name, auto& param, auto& grad) {
    using T = std::remove_cvref_t<decltype(param)>;
    using Tr = tensor_traits<T>;
    CollectedParam c;
    c.info.fqn = join_fqn(prefix, name);
    for (auto d : Tr::shape(param)) c.info.shape.push_back(static_cast<std::int64_t>(d));
    c.info.numel = numel(param);
    c.dtype = Tr::dtype(param);
    c.grad_dtype = Tr::dtype(grad);
    for (auto d : Tr::shape(grad)) c.grad_shape.push_back(static_cast<std::int64_t>(d));
    c.device = Tr::device(param);
    c.data = Tr::data(param);
    c.binding = {&param, &grad, [](void* t, void* data) { Tr::rebind(*static_cast<T*>(t), data); }};
    out.push_back(std::move(c));
  });
  for_each_child(m, [&](std::string_view name, auto& child) {
    using C = std::remove_cvref_t<decltype(child)>;
    if constexpr (!Exclude::template contains<C>) collect_parameters<Exclude>(child, join_fqn(prefix, name), out);
  });
}

}  // namespace detail

template <class Module, class... Ps>
class Sharded final : public UnitBase {
 public:
  using module_type = Module;
  using config = Policies<Ps...>;
  using strategy = typename config::strategy;
  using prefetch_policy = typename config::backward_prefetch;
  static constexpr bool prefetches_forward = config::forward_prefetch::enabled;
  static constexpr bool prefetches_backward = !std::is_same_v<prefetch_policy, NoBackwardPrefetch>;

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

  ~Sharded() override {
    for (auto& fp : flat_) {
      fp.gather_work = Work{};  // waits: the buffers below may still be in use by a collective
      fp.reduce_work = Work{};
      if (fp.reduce_out && fp.reduce_out != fp.shard_grad) device_.deallocate(fp.reduce_out, fp.layout.shard_bytes(), MemorySpace::device);
      if (fp.full != fp.shard) release(fp.full, fp.layout.padded_bytes());
      release_full_grad(fp);
      release(fp.shard, fp.layout.shard_bytes());
      release(fp.shard_grad, fp.layout.shard_bytes());
      for (auto& b : fp.bindings) { b.rebind(b.param, nullptr); b.rebind(b.grad, nullptr); }
    }
  }

  // "shard group of S ranks, replicate group of R ranks": units of one model must agree.
  std::string groups() const override {
    return "shard group of " + std::to_string(groups_.shard_size) + " ranks, replicate group of " +
           std::to_string(groups_.replicate_size) + " ranks";
  }

  void pre_forward() override {
    expect({TrainingState::IDLE}, "pre_forward");
    if (order_) order_->enter(*this, Pass::forward, groups_.world, prefetches_forward);
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
    record_compute("forward");
    if constexpr (strategy::reshard_after_forward)
      if (!order_ || !order_->keeps_after_forward(*this)) release_unsharded();
    state_ = TrainingState::IDLE;
  }

  void pre_backward() override {
    expect({TrainingState::IDLE}, "pre_backward");
    if (order_) order_->enter(*this, Pass::backward, groups_.world, prefetches_backward);
    unshard();  // a no-op where forward left the parameters unsharded
    for (auto& fp : flat_) {
      if (!strategy::shards_parameters && grad_is_zero_) {
        fp.full_grad = fp.shard_grad;  // replicated and zero: accumulate in place, as DDP does
      } else {
        fp.full_grad = device_.allocate(fp.layout.padded_bytes(), MemorySpace::device);
        device_.fill_zero(fp.full_grad, fp.layout.padded_bytes());  // engines accumulate into grads
      }
      bind(fp, fp.full_grad, &detail::ParamBinding::grad);
    }
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
    bool inline_done = true;
    for (auto& fp : flat_) {
      bind(fp, nullptr, &detail::ParamBinding::grad);
      inline_done = start_reduction(fp) && inline_done;
    }
    grad_is_zero_ = false;
    state_ = TrainingState::BACKWARD_POST;
    // A reduction that finished inside the call is completed now; one still running
    // overlaps the next unit's backward and is completed at that unit's post_backward
    // (or at finish_backward), at the latest.
    if (inline_done || !order_) finish_reduction();
    else order_->reduction_issued(*this);
  }

  void prefetch() override {
    if (!order_ || !order_->may_prefetch() || state_ != TrainingState::IDLE) return;
    bool issued = false;
    for (auto& fp : flat_) {
      if (fp.full) continue;
      start_gather(fp);
      issued = true;
    }
    if (issued) { prefetched_ = true; order_->prefetch_issued(); }
  }

  void finish_reduction() override {
    for (auto& fp : flat_) {
      if (!fp.reducing) continue;
      fp.reducing = false;
      wait_traced(fp.reduce_work, "wait reduce_scatter");
      finish_gradient(fp);
    }
  }

  void finish_backward() override {
    expect({TrainingState::BACKWARD_POST, TrainingState::IDLE}, "finish_backward");
    finish_reduction();
    state_ = TrainingState::IDLE;
  }

  void reshard() override {
    expect({TrainingState::IDLE}, "reshard");
    release_unsharded();
  }

  void zero_grad() override {
    expect({TrainingState::IDLE}, "zero_grad");
    for (auto& fp : flat_) device_.fill_zero(fp.shard_grad, fp.layout.shard_bytes());
    grad_is_zero_ = true;
  }

  void begin_summon_full_params() override {
    expect({TrainingState::IDLE}, "summon_full_params");
    unshard();
    state_ = TrainingState::SUMMON_FULL_PARAMS;
  }

  void end_summon_full_params(bool writeback) override {
    expect({TrainingState::SUMMON_FULL_PARAMS}, "end of summon_full_params");
    if (writeback) {
      for (auto& fp : flat_) {
        const auto& L = fp.layout;
        const std::size_t esize = size_of(L.dtype());
        if (fp.full == fp.shard) continue;  // replicated: the parameters are the shard
        device_.copy(fp.shard, static_cast<std::byte*>(fp.full) + groups_.shard_rank * L.shard_bytes(),
                     static_cast<std::size_t>(L.valid_shard_numel(groups_.shard_rank)) * esize);
      }
    }
    release_unsharded();
    state_ = TrainingState::IDLE;
  }

  std::span<const ShardView> shards() const override { return views_; }

  // Layout of each flat parameter (one per dtype), for state dicts, tests and tools.
  std::vector<const FlatParamLayout*> layouts() const {
    std::vector<const FlatParamLayout*> out;
    for (auto& fp : flat_) out.push_back(&fp.layout);
    return out;
  }

 private:
  template <class Exclude>
  Sharded(Module& module, detail::UnitGroups groups, detail::DeviceRef device, UnitOptions options, Exclude)
      : UnitBase(std::move(options.fqn), groups.world.rank(), &module, typeid(Module)), groups_(groups), device_(device) {
    const int world = groups_.shard_size * groups_.replicate_size;
    pre_divide_ = gradient_predivide_factor(world);
    post_divide_ = world / pre_divide_;
    std::vector<detail::CollectedParam> params;
    detail::collect_parameters<Exclude>(module, fqn_, params);
    validate_local(params);
    build_flat_params(params);
    detail::check_same_across_ranks(groups_.world, fingerprint(), "unit '" + display_name() + "'", describe_local());
    take_over_storage(params);
  }

  struct FlatParam {
    explicit FlatParam(FlatParamLayout l) : layout(std::move(l)) {}
    FlatParamLayout layout;
    std::vector<detail::ParamBinding> bindings;  // parallel to layout.params()
    void* shard = nullptr;       // shard_numel elements, this rank's
    void* shard_grad = nullptr;  // shard_numel elements, reduced gradient
    void* full = nullptr;        // padded_numel elements while unsharded
    void* full_grad = nullptr;   // padded_numel elements during backward
    Work gather_work;            // the all-gather into `full`, until its first use
    Work reduce_work;            // the reduction out of `full_grad`, until finished
    void* reduce_out = nullptr;  // where it reduces to
    bool reducing = false;
  };

  std::string display_name() const { return fqn_.empty() ? "<root>" : fqn_; }
  static std::string describe(DeviceId d) {
    return (d.kind == DeviceKind::cpu ? "cpu:" : "cuda:") + std::to_string(d.index);
  }

  void validate_local(const std::vector<detail::CollectedParam>& params) const {
    std::unordered_map<const void*, const std::string*> seen;
    for (auto& p : params) {
      if (!is_floating(p.dtype))
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": parameter '", p.info.fqn, "' has dtype ",
                     name_of(p.dtype), "; only floating-point parameters (f32, f64, f16, bf16) can be sharded");
      if (p.device != device_.id())
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": parameter '", p.info.fqn, "' is on device ",
                     describe(p.device), " but the unit's Device is ", describe(device_.id()));
      if (p.grad_dtype != p.dtype || p.grad_shape != p.info.shape)
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": the gradient of parameter '", p.info.fqn,
                     "' does not have the parameter's shape and dtype");
      if (p.info.numel > 0 && p.data == nullptr)
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": parameter '", p.info.fqn,
                     "' has no storage; is it already managed by another unit?");
      if (p.binding.param == p.binding.grad)
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": parameter '", p.info.fqn,
                     "' was visited with the same tensor as parameter and gradient");
      if (auto [it, fresh] = seen.emplace(p.binding.param, &p.info.fqn); !fresh)
        detail::fail("unit '", display_name(), "' on rank ", rank_, ": parameters '", *it->second, "' and '",
                     p.info.fqn, "' are the same tensor; shared parameters are not supported");
    }
  }

  void build_flat_params(const std::vector<detail::CollectedParam>& params) {
    std::vector<DType> order;  // dtypes in order of first appearance
    for (auto& p : params)
      if (std::find(order.begin(), order.end(), p.dtype) == order.end()) order.push_back(p.dtype);
    flat_.reserve(order.size());
    for (DType t : order) {
      std::vector<ParamInfo> infos;
      std::vector<detail::ParamBinding> bindings;
      for (auto& p : params)
        if (p.dtype == t) { infos.push_back(p.info); bindings.push_back(p.binding); }
      auto& fp = flat_.emplace_back(FlatParamLayout(t, std::move(infos), groups_.shard_size));
      fp.bindings = std::move(bindings);
    }
  }

  detail::Fingerprint fingerprint() const {
    detail::Fingerprint f;
    f.add(fqn_);
    f.add(groups());
    f.add_count(flat_.size());
    for (auto& fp : flat_) {
      f.add_count(static_cast<std::uint64_t>(fp.layout.dtype()));
      for (auto& p : fp.layout.params()) {
        f.add(p.fqn);
        f.add_count(p.shape.size());
        for (auto d : p.shape) f.add_count(static_cast<std::uint64_t>(d));
      }
    }
    return f;
  }

  std::string describe_local() const {
    std::ostringstream os;
    std::size_t n = 0;
    std::int64_t elems = 0;
    for (auto& fp : flat_) { n += fp.layout.params().size(); elems += fp.layout.numel(); }
    os << n << " parameters, " << elems << " elements";
    const char* sep = ": ";
    for (auto& fp : flat_)
      for (auto& p : fp.layout.params()) {
        os << sep << p.fqn << " [";
        for (std::size_t i = 0; i < p.shape.size(); ++i) os << (i ? "," : "") << p.shape[i];
        os << "] " << name_of(fp.layout.dtype());
        sep = ", ";
      }
    os << " (" << groups() << ")";
    return os.str();
  }

  // Copies this rank's slices into fresh shards and leaves the engine's tensors empty.
  void take_over_storage(const std::vector<detail::CollectedParam>& params) {
    std::unordered_map<void*, const void*> data_of;
    for (auto& p : params) data_of[p.binding.param] = p.data;
    for (auto& fp : flat_) {
      const auto& L = fp.layout;
      const std::size_t esize = size_of(L.dtype());
      fp.shard = device_.allocate(L.shard_bytes(), MemorySpace::device);
      fp.shard_grad = device_.allocate(L.shard_bytes(), MemorySpace::device);
      device_.fill_zero(fp.shard, L.shard_bytes());
      device_.fill_zero(fp.shard_grad, L.shard_bytes());
      for (std::size_t i = 0; i < L.params().size(); ++i) {
        const ShardSlice s = L.slice(i, groups_.shard_rank);
        if (s.count == 0) continue;
        device_.copy(static_cast<std::byte*>(fp.shard) + s.shard_offset * esize,
                     static_cast<const std::byte*>(data_of[fp.bindings[i].param]) + s.param_begin * esize,
                     static_cast<std::size_t>(s.count) * esize);
      }
      bind(fp, nullptr, &detail::ParamBinding::grad);
      if constexpr (strategy::shards_parameters) {
        bind(fp, nullptr, &detail::ParamBinding::param);
      } else {  // replicated: the parameters live in the "shard" for good
        fp.full = fp.shard;
        bind(fp, fp.full, &detail::ParamBinding::param);
      }
      views_.push_back({fqn_, L.dtype(), fp.shard, fp.shard_grad, L.valid_shard_numel(groups_.shard_rank)});
    }
  }

  // Issues the all-gather of one flat parameter into a fresh unsharded buffer.
  void start_gather(FlatParam& fp) {
    const auto& L = fp.layout;
    fp.full = device_.allocate(L.padded_bytes(), MemorySpace::device);
    fp.gather_work = groups_.shard.all_gather(fp.shard, fp.full, static_cast<std::size_t>(L.shard_numel()), L.dtype());
  }

  // Makes the parameters valid: waits for a prefetched all-gather, or issues one and waits,
  // unless they are valid already (replicated, or kept since forward).
  void unshard() {
    for (auto& fp : flat_) {
      if (!fp.full) start_gather(fp);
      if (!fp.gather_work.completed_inline()) wait_traced(fp.gather_work, "wait all_gather");
      fp.gather_work = Work{};
      bind(fp, fp.full, &detail::ParamBinding::param);
    }
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }
  }

  void release_unsharded() {
    if constexpr (!strategy::shards_parameters) return;  // replicated parameters stay valid
    for (auto& fp : flat_) {
      bind(fp, nullptr, &detail::ParamBinding::param);
      release(fp.full, fp.layout.padded_bytes());
    }
  }

  // Averages the unit's unsharded gradient over every rank into its sharded gradient:
  // reduce-scatter over the shard group (all-reduce when parameters are replicated), then
  // all-reduce of the shard over the replicate group, with FSDP's pre and post factors.
  // start_reduction issues the first collective; finish_gradient does the rest once it is
  // done. Returns whether the collective completed inside the call.
  bool start_reduction(FlatParam& fp) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    if (pre_divide_ != 1.0) device_.scale(fp.full_grad, static_cast<std::size_t>(L.padded_numel()), L.dtype(), 1.0 / pre_divide_);
    // Right after zero_grad the sharded gradient is zero: reduce straight into it (in place
    // when the engine already accumulated into it).
    fp.reduce_out = grad_is_zero_ ? fp.shard_grad : device_.allocate(L.shard_bytes(), MemorySpace::device);
    if constexpr (strategy::shards_parameters)
      fp.reduce_work = groups_.shard.reduce_scatter(fp.full_grad, fp.reduce_out, S, L.dtype(), ReduceOp::sum);
    else
      fp.reduce_work = groups_.replicate.all_reduce(fp.full_grad, fp.reduce_out, S, L.dtype(), ReduceOp::sum);
    fp.reducing = true;
    return fp.reduce_work.completed_inline();
  }

  void finish_gradient(FlatParam& fp) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    void* out = fp.reduce_out;
    if (strategy::shards_parameters && groups_.replicate_size > 1)
    {
      Work w = groups_.replicate.all_reduce(out, out, S, L.dtype(), ReduceOp::sum);
      wait_traced(w, "wait all_reduce");
    }
    if (post_divide_ != 1.0) device_.scale(out, S, L.dtype(), 1.0 / post_divide_);
    if (out != fp.shard_grad) {
      device_.accumulate(fp.shard_grad, out, S, L.dtype());
      device_.deallocate(out, L.shard_bytes(), MemorySpace::device);
    }
    fp.reduce_out = nullptr;
    release_full_grad(fp);
  }

  // ---- tracing: one pointer test when off ----
  Trace* trace() const { return order_ ? order_->trace : nullptr; }
  Trace::Clock::time_point now_if_traced() const { return trace() ? Trace::Clock::now() : Trace::Clock::time_point{}; }
  void record_compute(const char* pass) {
    Trace* t = trace();
    if (t && compute_begin_ != Trace::Clock::time_point{})  // not when tracing began mid-pass
      t->add(std::string(pass) + " " + display_name(), pass, Trace::Lane::compute, compute_begin_, Trace::Clock::now());
  }
  void wait_traced(Work& w, const char* what) {
    if (Trace* t = trace()) {
      const auto begin = Trace::Clock::now();
      w.wait();
      t->add(std::string(what) + " " + display_name(), "wait", Trace::Lane::compute, begin, Trace::Clock::now());
    } else {
      w.wait();
    }
  }

  // Points every parameter's param (or grad) tensor into `base`, or at nothing.
  void bind(FlatParam& fp, void* base, void* detail::ParamBinding::*which) {
    const std::size_t esize = size_of(fp.layout.dtype());
    const auto& infos = fp.layout.params();
    for (std::size_t i = 0; i < fp.bindings.size(); ++i) {
      auto& b = fp.bindings[i];
      b.rebind(b.*which, base ? static_cast<std::byte*>(base) + infos[i].offset * esize : nullptr);
    }
  }

  void release_full_grad(FlatParam& fp) {
    if (fp.full_grad == fp.shard_grad) fp.full_grad = nullptr;  // an alias, not an allocation
    else release(fp.full_grad, fp.layout.padded_bytes());
  }

  void release(void*& p, std::size_t bytes) {
    if (p) device_.deallocate(p, bytes, MemorySpace::device);
    p = nullptr;
  }

  detail::UnitGroups groups_;
  detail::DeviceRef device_;
  double pre_divide_ = 1.0, post_divide_ = 1.0;
  bool prefetched_ = false;  // gathered ahead of its hook, counted by the order
  Trace::Clock::time_point compute_begin_{};
  std::vector<FlatParam> flat_;
  std::vector<ShardView> views_;
  bool grad_is_zero_ = true;
};

}  // namespace fsdp
