#pragma once
// FlatParamGroup: a unit's parameters as flat parameters (one per dtype), with the storage
// the unit owns for them and the collectives that move them. It copies this rank's slice
// into the flat shard, gathers the shards into an unsharded buffer the engine's tensors
// point into, and reduces the unsharded gradient into the sharded one. It knows nothing
// of hooks or training states: that is the unit's state machine (fsdp/sharded.hpp).
#include <algorithm>
#include <cstddef>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fsdp/detail/backend_ref.hpp"
#include "fsdp/detail/fingerprint.hpp"
#include "fsdp/detail/flat_param_storage.hpp"
#include "fsdp/detail/param_collection.hpp"
#include "fsdp/detail/unit_groups.hpp"
#include "fsdp/flat_param.hpp"
#include "fsdp/policies.hpp"
#include "fsdp/trace.hpp"
#include "fsdp/unit.hpp"

namespace fsdp {

// FSDP's split of the 1/N average into a factor before and one after the reduction,
// so low-precision gradients neither overflow in the sum nor underflow before it.
inline double gradient_predivide_factor(int world) {
  int factor = 1;
  while (world % factor == 0 && static_cast<double>(world) / factor > factor) factor *= 2;
  return factor;
}

namespace detail {

// Waits for a collective, as a span on the trace's compute lane when the model traces.
struct TracedWait {
  Trace* trace = nullptr;
  const std::string* unit = nullptr;
  void operator()(Work& w, const char* what) const {
    if (!trace) return w.wait();
    const auto begin = Trace::Clock::now();
    w.wait();
    trace->add(std::string(what) + " " + *unit, "wait", Trace::Lane::compute, begin, Trace::Clock::now());
  }
};

}  // namespace detail

template <class Config>
class FlatParamGroup {
 public:
  using strategy = typename Config::strategy;
  using precision = typename Config::mixed_precision;
  static constexpr bool offload = Config::cpu_offload::offload;
  static constexpr MemorySpace shard_space = offload ? MemorySpace::host : MemorySpace::device;

  FlatParamGroup(detail::UnitGroups groups, detail::DeviceRef device) : groups_(groups), device_(device) {
    pre_divide_ = gradient_predivide_factor(groups_.world_size());
    post_divide_ = groups_.world_size() / pre_divide_;
  }
  FlatParamGroup(const FlatParamGroup&) = delete;
  FlatParamGroup& operator=(const FlatParamGroup&) = delete;

  // Frees everything; once the engine's tensors were taken over, points them at nothing.
  ~FlatParamGroup() {
    for (auto& fp : flat_) {
      fp.gather_work = Work{};  // waits: the buffers below may still be in use by a collective
      fp.reduce_work = Work{};
      release_reduction_buffers(fp);
      release_unsharded_params(fp);
      release_full_grad(fp);
      release(fp.shard, fp.shard_bytes(), shard_space);
      release(fp.shard_grad, fp.shard_grad_bytes(), shard_space);
      if (took_over_)
        for (auto& b : fp.bindings) { b.rebind(b.param, nullptr, fp.master()); b.rebind(b.grad, nullptr, fp.master()); }
    }
  }

  const detail::UnitGroups& groups() const { return groups_; }
  const detail::DeviceRef& device() const { return device_; }
  std::vector<FlatParam>& flat() { return flat_; }
  const std::vector<FlatParam>& flat() const { return flat_; }

  // One flat parameter per dtype, in order of first appearance, parameters in visit order.
  void build(const std::vector<detail::CollectedParam>& params) {
    std::vector<DType> order;
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

  // What every rank must agree on: dtypes, FQNs and shapes, in order.
  void add_to(detail::Fingerprint& f) const {
    f.add_count(flat_.size());
    for (auto& fp : flat_) {
      f.add_count(static_cast<std::uint64_t>(fp.layout.dtype()));
      for (auto& p : fp.layout.params()) {
        f.add(p.fqn);
        f.add_count(p.shape.size());
        for (auto d : p.shape) f.add_count(static_cast<std::uint64_t>(d));
      }
    }
  }

  // "N parameters, E elements: a [2,3] f32, ...", for setup mismatch messages.
  std::string describe() const {
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
    return os.str();
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

  // Points the engine's parameters and gradients at the group's storage (or at nothing,
  // until gathered) and appends the optimizer's view of each shard to `views`.
  void take_over(std::string_view unit, std::vector<ShardView>& views) {
    took_over_ = true;
    for (auto& fp : flat_) {
      bind(fp, nullptr, &detail::ParamBinding::grad, fp.master());
      if (fp.direct) {  // replicated: the parameters live in the "shard" for good
        fp.full = fp.shard;
        fp.full_dtype = fp.master();
        bind(fp, fp.full, &detail::ParamBinding::param, fp.master());
      } else {
        bind(fp, nullptr, &detail::ParamBinding::param, fp.master());
      }
      views.push_back({unit, fp.master(), fp.shard, fp.shard_grad, fp.layout.valid_shard_numel(groups_.shard_rank), fp.grad});
    }
  }

  // ---- parameters ----

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
    fp.full = device_.allocate(FlatParam::bytes(full_numel(fp), as), MemorySpace::device);
    void* mine = static_cast<std::byte*>(fp.full) + (strategy::shards_parameters ? groups_.shard_rank : 0) * FlatParam::bytes(L.shard_numel(), as);
    const bool staged = offload || as != fp.master() || !strategy::shards_parameters;
    if (staged) device_.cast(mine, as, fp.shard, fp.master(), S);  // also the host-to-device copy
    if constexpr (strategy::shards_parameters)
      fp.gather_work = groups_.shard.all_gather(staged ? mine : fp.shard, fp.full, S, as);
  }

  // Hands a gathered buffer to the engine: waits for its all-gather, binds the parameters.
  void finish_gather(FlatParam& fp, DType as, const detail::TracedWait& wait) {
    if (!fp.gather_work.completed_inline()) wait(fp.gather_work, "wait all_gather");  // no empty spans
    fp.gather_work = Work{};
    bind(fp, fp.full, &detail::ParamBinding::param, as);
    fp.unbound = false;
  }

  // Issues the all-gathers not yet issued; returns whether it issued any.
  bool start_gathers() {
    bool issued = false;
    for (auto& fp : flat_) {
      if (fp.full) continue;
      start_gather(fp, fp.compute);
      issued = true;
    }
    return issued;
  }

  // Makes the parameters valid in the compute dtype: waits for a prefetched all-gather, or
  // issues one and waits. Parameters already valid (replicated in place, or kept since
  // forward) cost nothing: not even a rebind.
  void unshard(const detail::TracedWait& wait) {
    for (auto& fp : flat_) {
      if (!fp.full) start_gather(fp, fp.compute);
      if (fp.unbound) finish_gather(fp, fp.compute, wait);
    }
  }

  // Full parameters in their own (master) dtype, for summon_full_params.
  void unshard_master(const detail::TracedWait& wait) {
    for (auto& fp : flat_) {
      start_gather(fp, fp.master());
      finish_gather(fp, fp.master(), wait);
    }
  }

  // Keeps edits made to summoned full parameters: this rank's slice back into its shard.
  void write_back() {
    for (auto& fp : flat_) {
      const auto& L = fp.layout;
      if (fp.full == fp.shard) continue;  // replicated in place: edits are already there
      const void* mine = static_cast<std::byte*>(fp.full) + groups_.shard_rank * L.shard_bytes();
      device_.copy(fp.shard, mine, static_cast<std::size_t>(L.valid_shard_numel(groups_.shard_rank)) * size_of(fp.master()));
    }
  }

  void release_unsharded() {
    for (auto& fp : flat_) {
      if (fp.direct) continue;  // replicated parameters stay valid
      fp.gather_work = Work{};  // a prefetched all-gather may still be writing into the buffer
      fp.unbound = false;
      bind(fp, nullptr, &detail::ParamBinding::param, fp.master());
      release_unsharded_params(fp);
    }
  }

  // ---- gradients ----

  // Binds zeroed unsharded gradients for the engine to accumulate into. `grad_is_zero`:
  // nothing was reduced since zero_grad.
  void bind_gradients(bool grad_is_zero) {
    for (auto& fp : flat_) {
      if (fp.direct && grad_is_zero) {
        fp.full_grad = fp.shard_grad;  // replicated and zero: accumulate in place, as DDP does
      } else {
        fp.full_grad = device_.allocate(fp.full_bytes(), MemorySpace::device);
        device_.fill_zero(fp.full_grad, fp.full_bytes());  // engines accumulate into grads
      }
      bind(fp, fp.full_grad, &detail::ParamBinding::grad, fp.compute);
    }
  }

  // Unbinds the gradients and issues every reduction; returns whether all completed inside
  // the call.
  bool start_reductions(bool grad_is_zero) {
    bool inline_done = true;
    for (auto& fp : flat_) {
      bind(fp, nullptr, &detail::ParamBinding::grad, fp.master());
      inline_done = start_reduction(fp, grad_is_zero) && inline_done;
    }
    return inline_done;
  }

  void finish_reductions(const detail::TracedWait& wait) {
    for (auto& fp : flat_) {
      if (!fp.reducing) continue;
      fp.reducing = false;
      wait(fp.reduce_work, "wait reduce_scatter");
      finish_gradient(fp, wait);
    }
  }

  void zero_grad() {
    for (auto& fp : flat_) device_.fill_zero(fp.shard_grad, fp.shard_grad_bytes());
  }

 private:
  std::int64_t full_numel(const FlatParam& fp) const {
    return strategy::shards_parameters ? fp.layout.padded_numel() : fp.layout.shard_numel();
  }

  void release_unsharded_params(FlatParam& fp) {
    if (!fp.full || fp.full == fp.shard) return;
    device_.deallocate(fp.full, FlatParam::bytes(full_numel(fp), fp.full_dtype), MemorySpace::device);
    fp.full = nullptr;
  }

  // Averages the unit's unsharded gradient over every rank into its sharded gradient:
  // cast to the reduce dtype if needed; reduce-scatter over the shard group (all-reduce
  // when parameters are replicated), then all-reduce of the shard over the replicate group;
  // FSDP's pre and post factors in the reduce dtype; then into the sharded gradient (cast
  // to its dtype, copied to host when offloaded). start_reduction issues the first
  // collective and returns whether it completed inside the call; finish_gradient does the
  // rest once it has.
  bool start_reduction(FlatParam& fp, bool grad_is_zero) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    const auto padded = static_cast<std::size_t>(L.padded_numel());
    void* in = fp.full_grad;
    if (fp.reduce != fp.compute) {
      fp.reduce_in = device_.allocate(FlatParam::bytes(L.padded_numel(), fp.reduce), MemorySpace::device);
      device_.cast(fp.reduce_in, fp.reduce, fp.full_grad, fp.compute, padded);
      release_full_grad(fp);  // cast: the compute-dtype gradient is no longer needed
      in = fp.reduce_in;
    }
    if (pre_divide_ != 1.0) device_.scale(in, padded, fp.reduce, 1.0 / pre_divide_);
    // Right after zero_grad a device-resident sharded gradient of the reduce dtype is zero:
    // reduce straight into it (in place when the engine already accumulated into it).
    fp.into_shard_grad = grad_is_zero;
    fp.reduce_out = grad_is_zero && !offload && fp.grad == fp.reduce
                        ? fp.shard_grad
                        : device_.allocate(FlatParam::bytes(L.shard_numel(), fp.reduce), MemorySpace::device);
    if constexpr (strategy::shards_parameters)
      fp.reduce_work = groups_.shard.reduce_scatter(in, fp.reduce_out, S, fp.reduce, ReduceOp::sum);
    else
      fp.reduce_work = groups_.replicate.all_reduce(in, fp.reduce_out, S, fp.reduce, ReduceOp::sum);
    fp.reducing = true;
    return fp.reduce_work.completed_inline();
  }

  void finish_gradient(FlatParam& fp, const detail::TracedWait& wait) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    void* out = fp.reduce_out;
    if (strategy::shards_parameters && groups_.replicate_size > 1) {
      Work w = groups_.replicate.all_reduce(out, out, S, fp.reduce, ReduceOp::sum);
      wait(w, "wait all_reduce");
    }
    if (post_divide_ != 1.0) device_.scale(out, S, fp.reduce, 1.0 / post_divide_);
    if (out != fp.shard_grad) {
      // Bring the result to the sharded gradient's dtype and memory space, then add it.
      void* in_grad_dtype = out;
      if (fp.grad != fp.reduce) {
        in_grad_dtype = device_.allocate(FlatParam::bytes(L.shard_numel(), fp.grad), MemorySpace::device);
        device_.cast(in_grad_dtype, fp.grad, out, fp.reduce, S);
      }
      // Into the sharded gradient, wherever it lives (device to host when offloaded).
      if (fp.into_shard_grad) device_.copy(fp.shard_grad, in_grad_dtype, fp.shard_grad_bytes());
      else device_.accumulate(fp.shard_grad, in_grad_dtype, S, fp.grad);
      if (in_grad_dtype != out) device_.deallocate(in_grad_dtype, FlatParam::bytes(L.shard_numel(), fp.grad), MemorySpace::device);
    }
    release_reduction_buffers(fp);
    release_full_grad(fp);
  }

  void release_reduction_buffers(FlatParam& fp) {
    if (fp.reduce_out && fp.reduce_out != fp.shard_grad)
      device_.deallocate(fp.reduce_out, FlatParam::bytes(fp.layout.shard_numel(), fp.reduce), MemorySpace::device);
    fp.reduce_out = nullptr;
    if (fp.reduce_in) device_.deallocate(fp.reduce_in, FlatParam::bytes(fp.layout.padded_numel(), fp.reduce), MemorySpace::device);
    fp.reduce_in = nullptr;
  }

  void release_full_grad(FlatParam& fp) {
    if (fp.full_grad == fp.shard_grad) fp.full_grad = nullptr;  // an alias, not an allocation
    else release(fp.full_grad, fp.full_bytes(), MemorySpace::device);
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
  std::vector<FlatParam> flat_;
  bool took_over_ = false;
};

}  // namespace fsdp
