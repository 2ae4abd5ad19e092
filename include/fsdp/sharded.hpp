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
  // Broadcast rank 0's parameters and buffers to every rank at construction, as FSDP's
  // sync_module_states does: ranks that initialised differently then start the same.
  bool sync_module_states = false;
};

// FSDP's split of the 1/N average into a factor before and one after the reduction,
// so low-precision gradients neither overflow in the sum nor underflow before it.
inline double gradient_predivide_factor(int world) {
  int factor = 1;
  while (world % factor == 0 && static_cast<double>(world) / factor > factor) factor *= 2;
  return factor;
}

namespace detail {

// Points a tensor at `data`, shown in `dtype` (its own dtype unless MixedPrecision).
using RebindFn = void (*)(void* tensor, void* data, DType dtype);

template <class T>
RebindFn rebind_fn() {
  return [](void* t, void* data, DType d) {
    if constexpr (RebindableAs<T>) tensor_traits<T>::rebind(*static_cast<T*>(t), data, d);
    else tensor_traits<T>::rebind(*static_cast<T*>(t), data);  // only ever asked for its own dtype
  };
}

// One parameter as the unit holds it: where to rebind the engine's tensors.
struct ParamBinding {
  void* param = nullptr;
  void* grad = nullptr;
  RebindFn rebind = nullptr;
};

// A buffer (non-trainable tensor) as the unit found it.
struct CollectedBuffer {
  std::string fqn;
  DType dtype;
  std::int64_t numel;
  void* data;
  void* tensor;
  RebindFn rebind;
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

// Walks m's subtree (minus children whose type is in Exclude) for parameters and buffers.
// ChangesDtype: MixedPrecision will show them in another dtype, which needs the 3-argument
// tensor_traits::rebind.
template <class Exclude, bool ChangesDtype, class M>
void collect_parameters(M& m, const std::string& prefix, std::vector<CollectedParam>& out,
                        std::vector<CollectedBuffer>& buffers) {
  for_each_own_parameter(m, [&](std::string_view name, auto& param, auto& grad) {
    using T = std::remove_cvref_t<decltype(param)>;
    using Tr = tensor_traits<T>;
    static_assert(!ChangesDtype || RebindableAs<T>,
                  "fsdp: MixedPrecision shows parameters in another dtype: tensor_traits<T> needs "
                  "static void rebind(T&, void* data, fsdp::DType)");
    CollectedParam c;
    c.info.fqn = join_fqn(prefix, name);
    for (auto d : Tr::shape(param)) c.info.shape.push_back(static_cast<std::int64_t>(d));
    c.info.numel = numel(param);
    c.dtype = Tr::dtype(param);
    c.grad_dtype = Tr::dtype(grad);
    for (auto d : Tr::shape(grad)) c.grad_shape.push_back(static_cast<std::int64_t>(d));
    c.device = Tr::device(param);
    c.data = Tr::data(param);
    c.binding = {&param, &grad, rebind_fn<T>()};
    out.push_back(std::move(c));
  });
  for_each_own_buffer(m, [&](std::string_view name, auto& buffer) {
    using T = std::remove_cvref_t<decltype(buffer)>;
    static_assert(!ChangesDtype || RebindableAs<T>,
                  "fsdp: MixedPrecision casts buffers: tensor_traits<T> needs static void rebind(T&, void*, fsdp::DType)");
    buffers.push_back({join_fqn(prefix, name), tensor_traits<T>::dtype(buffer), numel(buffer),
                       tensor_traits<T>::data(buffer), &buffer, rebind_fn<T>()});
  });
  for_each_child(m, [&](std::string_view name, auto& child) {
    using C = std::remove_cvref_t<decltype(child)>;
    if constexpr (!Exclude::template contains<C>)
      collect_parameters<Exclude, ChangesDtype>(child, join_fqn(prefix, name), out, buffers);
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

  ~Sharded() override {
    for (auto& fp : flat_) {
      fp.gather_work = Work{};  // waits: the buffers below may still be in use by a collective
      fp.reduce_work = Work{};
      release_reduction_buffers(fp);
      release_unsharded_params(fp);
      release_full_grad(fp);
      release(fp.shard, fp.shard_bytes(), shard_space);
      release(fp.shard_grad, fp.shard_grad_bytes(), shard_space);
      for (auto& b : fp.bindings) { b.rebind(b.param, nullptr, fp.master()); b.rebind(b.grad, nullptr, fp.master()); }
    }
    for (auto& b : buffers_) {
      b.rebind(b.tensor, nullptr, b.dtype);
      release(b.master, bytes(b.numel, b.dtype), MemorySpace::device);
      release(b.cast, bytes(b.numel, precision_buffer()), MemorySpace::device);
    }
  }

  // "shard group of S ranks, replicate group of R ranks": units of one model must agree.
  std::string groups() const override {
    return "shard group of " + std::to_string(groups_.shard_size) + " ranks, replicate group of " +
           std::to_string(groups_.replicate_size) + " ranks";
  }

  void pre_forward() override {
    expect({TrainingState::IDLE}, "pre_forward");
    if (order_) order_->enter(*this, order_index_, Pass::forward, groups_.world, prefetches_forward);
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
    record_compute("forward");
    if (strategy::reshard_after_forward && (!order_ || !order_->keeps_after_forward(*this))) release_unsharded();
    else kept_ = true;  // valid for this unit's next pre_backward only
    state_ = TrainingState::IDLE;
  }

  void pre_backward() override {
    expect({TrainingState::IDLE}, "pre_backward");
    if (order_) order_->enter(*this, order_index_, Pass::backward, groups_.world, prefetches_backward);
    unshard();  // a no-op where forward left the parameters unsharded
    kept_ = false;
    for (auto& fp : flat_) {
      if (fp.direct && grad_is_zero_) {
        fp.full_grad = fp.shard_grad;  // replicated and zero: accumulate in place, as DDP does
      } else {
        fp.full_grad = device_.allocate(fp.full_bytes(), MemorySpace::device);
        device_.fill_zero(fp.full_grad, fp.full_bytes());  // engines accumulate into grads
      }
      bind(fp, fp.full_grad, &detail::ParamBinding::grad, fp.compute);
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
      bind(fp, nullptr, &detail::ParamBinding::grad, fp.master());
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
    if (!order_ || state_ != TrainingState::IDLE) return;
    if (prefetched_) release_unsharded();  // gathered ahead in an earlier pass: may be stale
    if (!order_->may_prefetch()) return;
    bool issued = false;
    for (auto& fp : flat_) {
      if (fp.full) continue;
      start_gather(fp, fp.compute);
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
    if (prefetched_) release_unsharded();  // gathered ahead for a pass it did not run in
    if constexpr (offload) device_.synchronize();  // gradients copied to host are complete
    state_ = TrainingState::IDLE;
  }

  void reshard() override {
    expect({TrainingState::IDLE}, "reshard");
    release_unsharded();
  }

  void zero_grad() override {
    expect({TrainingState::IDLE}, "zero_grad");
    for (auto& fp : flat_) device_.fill_zero(fp.shard_grad, fp.shard_grad_bytes());
    grad_is_zero_ = true;
  }

  // Full parameters in their own (master) dtype, and buffers in theirs: what FSDP's
  // summon_full_params and state dicts show, whatever the mixed precision.
  void begin_summon_full_params() override {
    expect({TrainingState::IDLE}, "summon_full_params");
    release_unsharded();  // a compute-dtype copy kept since forward is not what is asked for
    for (auto& fp : flat_) {
      start_gather(fp, fp.master());
      finish_gather(fp, fp.master());
    }
    show_buffers_in_master_dtype(true);
    state_ = TrainingState::SUMMON_FULL_PARAMS;
  }

  void end_summon_full_params(bool writeback) override {
    expect({TrainingState::SUMMON_FULL_PARAMS}, "end of summon_full_params");
    for (auto& fp : flat_) {
      const auto& L = fp.layout;
      if (!writeback || fp.full == fp.shard) continue;  // replicated in place: edits are already there
      const void* mine = static_cast<std::byte*>(fp.full) + groups_.shard_rank * L.shard_bytes();
      device_.copy(fp.shard, mine, static_cast<std::size_t>(L.valid_shard_numel(groups_.shard_rank)) * size_of(fp.master()));
    }
    show_buffers_in_master_dtype(false, writeback);
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
  static constexpr MemorySpace shard_space = offload ? MemorySpace::host : MemorySpace::device;
  static std::size_t bytes(std::int64_t n, DType t) { return static_cast<std::size_t>(n) * size_of(t); }
  static DType precision_buffer() {
    if constexpr (precision::enabled) return precision::buffer;
    else return DType::f32;  // unused: without mixed precision buffers are not copied
  }

  template <class Exclude>
  Sharded(Module& module, detail::UnitGroups groups, detail::DeviceRef device, UnitOptions options, Exclude)
      : UnitBase(std::move(options.fqn), groups.world.rank(), &module, typeid(Module)), groups_(groups), device_(device) {
    const int world = groups_.shard_size * groups_.replicate_size;
    pre_divide_ = gradient_predivide_factor(world);
    post_divide_ = world / pre_divide_;
    std::vector<detail::CollectedParam> params;
    std::vector<detail::CollectedBuffer> buffers;
    detail::collect_parameters<Exclude, precision::enabled>(module, fqn_, params, buffers);
    validate_local(params);
    build_flat_params(params);
    detail::check_same_across_ranks(groups_.world, fingerprint(), "unit '" + display_name() + "'", describe_local());
    if (options.sync_module_states) broadcast_from_rank0(params, buffers);
    // Copy everything first; rebind the engine's tensors (which frees their storage) only
    // once nothing can fail, so a failed construction loses no data and leaks nothing.
    try {
      copy_shards(params);
      copy_buffers(buffers);
    } catch (...) {
      free_copies();
      throw;
    }
    take_over();
  }

  void free_copies() {
    for (auto& fp : flat_) {
      release(fp.shard, fp.shard_bytes(), shard_space);
      release(fp.shard_grad, fp.shard_grad_bytes(), shard_space);
    }
    for (auto& b : buffers_) {
      release(b.master, bytes(b.numel, b.dtype), MemorySpace::device);
      release(b.cast, bytes(b.numel, precision_buffer()), MemorySpace::device);
    }
    buffers_.clear();
  }

  struct FlatParam {
    explicit FlatParam(FlatParamLayout l) : layout(std::move(l)) {}
    FlatParamLayout layout;
    std::vector<detail::ParamBinding> bindings;  // parallel to layout.params()
    DType compute = DType::f32;  // what the engine computes with (MixedPrecision's Param)
    DType reduce = DType::f32;   // what gradients are reduced in
    DType grad = DType::f32;     // what the sharded gradient is kept in
    bool direct = false;         // replicated, same dtype, not offloaded: the shard *is* the parameters
    void* shard = nullptr;       // shard_numel master-dtype elements, this rank's (host space when offloaded)
    void* shard_grad = nullptr;  // shard_numel `grad`-dtype elements, the reduced gradient
    void* full = nullptr;        // padded_numel elements while unsharded, in the dtype asked for
    DType full_dtype = DType::f32;
    void* full_grad = nullptr;   // padded_numel compute-dtype elements during backward
    Work gather_work;            // the all-gather into `full`, until its first use
    bool unbound = false;        // `full` gathered (or gathering) but not yet shown to the engine
    Work reduce_work;            // the reduction, until finished
    void* reduce_in = nullptr;   // full_grad cast to `reduce`, when that differs
    void* reduce_out = nullptr;  // shard_numel `reduce`-dtype elements: where it reduces to
    bool into_shard_grad = false;
    bool reducing = false;

    DType master() const { return layout.dtype(); }
    std::size_t shard_bytes() const { return bytes(layout.shard_numel(), master()); }
    std::size_t shard_grad_bytes() const { return bytes(layout.shard_numel(), grad); }
    std::size_t full_bytes() const { return bytes(layout.padded_numel(), compute); }
  };

  // A buffer cast for computation: the unit keeps the master copy (original dtype) and
  // the cast one, and points the engine's tensor at the one in use.
  struct BufferCopy {
    std::string fqn;
    DType dtype;
    std::int64_t numel;
    void* tensor;
    detail::RebindFn rebind;
    void* master = nullptr;
    void* cast = nullptr;
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

  void broadcast_from_rank0(const std::vector<detail::CollectedParam>& params,
                            const std::vector<detail::CollectedBuffer>& buffers) {
    for (auto& p : params)
      if (p.info.numel > 0) {
        void* data = const_cast<void*>(p.data);
        groups_.world.broadcast(data, data, static_cast<std::size_t>(p.info.numel), p.dtype, 0).wait();
      }
    for (auto& b : buffers)
      if (b.numel > 0) groups_.world.broadcast(b.data, b.data, static_cast<std::size_t>(b.numel), b.dtype, 0).wait();
  }

  // Copies this rank's slices into fresh shards (the engine's tensors are not touched).
  void copy_shards(const std::vector<detail::CollectedParam>& params) {
    std::unordered_map<void*, const void*> data_of;
    for (auto& p : params) data_of[p.binding.param] = p.data;
    for (auto& fp : flat_) {
      const auto& L = fp.layout;
      const std::size_t esize = size_of(L.dtype());
      fp.compute = fp.reduce = fp.grad = fp.master();
      if constexpr (precision::enabled) {
        fp.compute = precision::param;
        fp.reduce = precision::reduce;
        fp.grad = precision::keep_low_precision_grads ? precision::reduce : fp.master();
      }
      fp.direct = !strategy::shards_parameters && !offload && fp.compute == fp.master() && fp.reduce == fp.master();
      fp.shard = device_.allocate(fp.shard_bytes(), shard_space);
      fp.shard_grad = device_.allocate(fp.shard_grad_bytes(), shard_space);
      device_.fill_zero(fp.shard, fp.shard_bytes());
      device_.fill_zero(fp.shard_grad, fp.shard_grad_bytes());
      for (std::size_t i = 0; i < L.params().size(); ++i) {
        const ShardSlice sl = L.slice(i, groups_.shard_rank);
        if (sl.count == 0) continue;
        device_.copy(static_cast<std::byte*>(fp.shard) + sl.shard_offset * esize,
                     static_cast<const std::byte*>(data_of[fp.bindings[i].param]) + sl.param_begin * esize,
                     static_cast<std::size_t>(sl.count) * esize);
      }
    }
  }

  // Points the engine's parameters, gradients and cast buffers at the unit's storage.
  void take_over() {
    for (auto& fp : flat_) {
      bind(fp, nullptr, &detail::ParamBinding::grad, fp.master());
      if (fp.direct) {  // replicated: the parameters live in the "shard" for good
        fp.full = fp.shard;
        fp.full_dtype = fp.master();
        bind(fp, fp.full, &detail::ParamBinding::param, fp.master());
      } else {
        bind(fp, nullptr, &detail::ParamBinding::param, fp.master());
      }
      views_.push_back({fqn_, fp.master(), fp.shard, fp.shard_grad, fp.layout.valid_shard_numel(groups_.shard_rank), fp.grad});
    }
    for (auto& b : buffers_) b.rebind(b.tensor, b.cast, precision_buffer());
  }

  // Under MixedPrecision with a Buffer dtype other than a buffer's own, the unit keeps the
  // buffer in both dtypes and shows the cast one to the engine; otherwise buffers stay the
  // engine's.
  void copy_buffers(const std::vector<detail::CollectedBuffer>& buffers) {
    if constexpr (precision::enabled) {
      for (auto& b : buffers) {
        if (b.dtype == precision::buffer || !is_floating(b.dtype)) continue;
        auto& c = buffers_.emplace_back(BufferCopy{b.fqn, b.dtype, b.numel, b.tensor, b.rebind});  // freed by free_copies on failure
        c.master = device_.allocate(bytes(b.numel, b.dtype), MemorySpace::device);
        c.cast = device_.allocate(bytes(b.numel, precision::buffer), MemorySpace::device);
        if (b.numel) device_.copy(c.master, b.data, bytes(b.numel, b.dtype));
        device_.cast(c.cast, precision::buffer, c.master, b.dtype, static_cast<std::size_t>(b.numel));
      }
    }
  }

  // Summon shows buffers in their own dtype; leaving it casts them back (keeping edits).
  void show_buffers_in_master_dtype(bool show, bool keep_edits = false) {
    for (auto& b : buffers_) {
      const auto n = static_cast<std::size_t>(b.numel);
      if (show) {
        device_.cast(b.master, b.dtype, b.cast, precision_buffer(), n);  // training may have updated it
        b.rebind(b.tensor, b.master, b.dtype);
      } else {
        if (keep_edits) device_.cast(b.cast, precision_buffer(), b.master, b.dtype, n);
        b.rebind(b.tensor, b.cast, precision_buffer());
      }
    }
  }

  // Issues the all-gather of one flat parameter, in dtype `as`, into a fresh unsharded
  // buffer. When the shard is offloaded or cast, it is copied (and cast) straight into this
  // rank's slot of that buffer and gathered in place (NCCL's in-place all-gather), so no
  // staging copy is ever alive. Replicated parameters need no collective.
  void start_gather(FlatParam& fp, DType as) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    fp.full_dtype = as;
    if (fp.direct) { fp.full = fp.shard; return; }
    fp.unbound = true;
    const std::int64_t n = strategy::shards_parameters ? L.padded_numel() : L.shard_numel();
    fp.full = device_.allocate(bytes(n, as), MemorySpace::device);
    void* mine = static_cast<std::byte*>(fp.full) + (strategy::shards_parameters ? groups_.shard_rank : 0) * bytes(L.shard_numel(), as);
    const bool staged = offload || as != fp.master() || !strategy::shards_parameters;
    if (staged) device_.cast(mine, as, fp.shard, fp.master(), S);  // also the host-to-device copy
    if constexpr (strategy::shards_parameters)
      fp.gather_work = groups_.shard.all_gather(staged ? mine : fp.shard, fp.full, S, as);
  }

  // Hands a gathered buffer to the engine: waits for its all-gather, binds the parameters.
  void finish_gather(FlatParam& fp, DType as) {
    if (!fp.gather_work.completed_inline()) wait_traced(fp.gather_work, "wait all_gather");  // no empty spans
    fp.gather_work = Work{};
    bind(fp, fp.full, &detail::ParamBinding::param, as);
    fp.unbound = false;
  }

  // Makes the parameters valid in the compute dtype: waits for a prefetched all-gather, or
  // issues one and waits. Parameters already valid (replicated in place, or kept since
  // forward) cost nothing: not even a rebind.
  void unshard() {
    for (auto& fp : flat_) {
      if (!fp.full) start_gather(fp, fp.compute);
      if (fp.unbound) finish_gather(fp, fp.compute);
    }
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }
  }

  void release_unsharded() {
    for (auto& fp : flat_) {
      if (fp.direct) continue;  // replicated parameters stay valid
      fp.gather_work = Work{};  // a prefetched all-gather may still be writing into the buffer
      fp.unbound = false;
      bind(fp, nullptr, &detail::ParamBinding::param, fp.master());
      release_unsharded_params(fp);
    }
    if (prefetched_) { prefetched_ = false; order_->prefetch_consumed(); }  // gathered ahead, never used
    kept_ = false;
  }

  void release_unsharded_params(FlatParam& fp) {
    if (!fp.full || fp.full == fp.shard) return;
    const std::int64_t n = strategy::shards_parameters ? fp.layout.padded_numel() : fp.layout.shard_numel();
    device_.deallocate(fp.full, bytes(n, fp.full_dtype), MemorySpace::device);
    fp.full = nullptr;
  }

  // Averages the unit's unsharded gradient over every rank into its sharded gradient:
  // cast to the reduce dtype if needed; reduce-scatter over the shard group (all-reduce
  // when parameters are replicated), then all-reduce of the shard over the replicate group;
  // FSDP's pre and post factors in the reduce dtype; then into the sharded gradient (cast
  // to its dtype, copied to host when offloaded). start_reduction issues the first
  // collective and returns whether it completed inside the call; finish_gradient does the
  // rest once it has.
  bool start_reduction(FlatParam& fp) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    const auto padded = static_cast<std::size_t>(L.padded_numel());
    void* in = fp.full_grad;
    if (fp.reduce != fp.compute) {
      fp.reduce_in = device_.allocate(bytes(L.padded_numel(), fp.reduce), MemorySpace::device);
      device_.cast(fp.reduce_in, fp.reduce, fp.full_grad, fp.compute, padded);
      release_full_grad(fp);  // cast: the compute-dtype gradient is no longer needed
      in = fp.reduce_in;
    }
    if (pre_divide_ != 1.0) device_.scale(in, padded, fp.reduce, 1.0 / pre_divide_);
    // Right after zero_grad a device-resident sharded gradient of the reduce dtype is zero:
    // reduce straight into it (in place when the engine already accumulated into it).
    fp.into_shard_grad = grad_is_zero_;
    fp.reduce_out = grad_is_zero_ && !offload && fp.grad == fp.reduce
                        ? fp.shard_grad
                        : device_.allocate(bytes(L.shard_numel(), fp.reduce), MemorySpace::device);
    if constexpr (strategy::shards_parameters)
      fp.reduce_work = groups_.shard.reduce_scatter(in, fp.reduce_out, S, fp.reduce, ReduceOp::sum);
    else
      fp.reduce_work = groups_.replicate.all_reduce(in, fp.reduce_out, S, fp.reduce, ReduceOp::sum);
    fp.reducing = true;
    return fp.reduce_work.completed_inline();
  }

  void finish_gradient(FlatParam& fp) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    void* out = fp.reduce_out;
    if (strategy::shards_parameters && groups_.replicate_size > 1) {
      Work w = groups_.replicate.all_reduce(out, out, S, fp.reduce, ReduceOp::sum);
      wait_traced(w, "wait all_reduce");
    }
    if (post_divide_ != 1.0) device_.scale(out, S, fp.reduce, 1.0 / post_divide_);
    if (out != fp.shard_grad) {
      // Bring the result to the sharded gradient's dtype and memory space, then add it.
      void* in_grad_dtype = out;
      if (fp.grad != fp.reduce) {
        in_grad_dtype = device_.allocate(bytes(L.shard_numel(), fp.grad), MemorySpace::device);
        device_.cast(in_grad_dtype, fp.grad, out, fp.reduce, S);
      }
      // Into the sharded gradient, wherever it lives (device to host when offloaded).
      if (fp.into_shard_grad) device_.copy(fp.shard_grad, in_grad_dtype, fp.shard_grad_bytes());
      else device_.accumulate(fp.shard_grad, in_grad_dtype, S, fp.grad);
      if (in_grad_dtype != out) device_.deallocate(in_grad_dtype, bytes(L.shard_numel(), fp.grad), MemorySpace::device);
    }
    release_reduction_buffers(fp);
    release_full_grad(fp);
  }

  void release_reduction_buffers(FlatParam& fp) {
    if (fp.reduce_out && fp.reduce_out != fp.shard_grad)
      device_.deallocate(fp.reduce_out, bytes(fp.layout.shard_numel(), fp.reduce), MemorySpace::device);
    fp.reduce_out = nullptr;
    if (fp.reduce_in) device_.deallocate(fp.reduce_in, bytes(fp.layout.padded_numel(), fp.reduce), MemorySpace::device);
    fp.reduce_in = nullptr;
  }

  void release_full_grad(FlatParam& fp) {
    if (fp.full_grad == fp.shard_grad) fp.full_grad = nullptr;  // an alias, not an allocation
    else release(fp.full_grad, fp.full_bytes(), MemorySpace::device);
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

  // Points every parameter's param (or grad) tensor into `base`, shown in `dtype`, or at nothing.
  void bind(FlatParam& fp, void* base, void* detail::ParamBinding::*which, DType dtype) {
    const std::size_t esize = size_of(dtype);
    const auto& infos = fp.layout.params();
    for (std::size_t i = 0; i < fp.bindings.size(); ++i) {
      auto& b = fp.bindings[i];
      b.rebind(b.*which, base ? static_cast<std::byte*>(base) + infos[i].offset * esize : nullptr, dtype);
    }
  }

  void release(void*& p, std::size_t n, MemorySpace space) {
    if (p) device_.deallocate(p, n, space);
    p = nullptr;
  }

  detail::UnitGroups groups_;
  detail::DeviceRef device_;
  double pre_divide_ = 1.0, post_divide_ = 1.0;
  bool prefetched_ = false;  // gathered ahead of its hook, counted by the order
  bool kept_ = false;        // gathered in a forward and kept for this unit's backward
  Trace::Clock::time_point compute_begin_{};
  std::vector<FlatParam> flat_;
  std::vector<BufferCopy> buffers_;
  std::vector<ShardView> views_;
  bool grad_is_zero_ = true;
};

}  // namespace fsdp
