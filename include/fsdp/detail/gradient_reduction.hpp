#pragma once
// How a unit's gradients are averaged: FSDP's pre/post division around a reduce-scatter
// over the shard group (an all-reduce when parameters are replicated), then an all-reduce
// over the replicate group, into the sharded gradient, with every buffer this needs.
#include <cstddef>
#include <vector>

#include "fsdp/detail/backend_ref.hpp"
#include "fsdp/detail/flat_param_storage.hpp"
#include "fsdp/detail/unit_groups.hpp"

namespace fsdp {

// FSDP's split of the 1/N average into a factor before and one after the reduction,
// so low-precision gradients neither overflow in the sum nor underflow before it.
inline double gradient_predivide_factor(int world) {
  int factor = 1;
  while (world % factor == 0 && static_cast<double>(world) / factor > factor) factor *= 2;
  return factor;
}

namespace detail {

template <class Config>
class GradientReduction {
 public:
  using strategy = typename Config::strategy;
  static constexpr bool offload = Config::cpu_offload::offload;

  GradientReduction(UnitGroups groups, DeviceRef device) : groups_(groups), device_(device) {
    pre_divide_ = gradient_predivide_factor(groups_.world_size());
    post_divide_ = groups_.world_size() / pre_divide_;
  }

  // Binds zeroed unsharded gradients for the engine to accumulate into. `grad_is_zero`:
  // nothing was reduced since zero_grad.
  void bind_gradients(std::vector<FlatParam>& flat, bool grad_is_zero) {
    for (auto& fp : flat) {
      if (fp.direct && grad_is_zero) {
        fp.full_grad = fp.shard_grad;  // replicated and zero: accumulate in place, as DDP does
      } else {
        fp.full_grad = device_.allocate(fp.full_bytes(), MemorySpace::device);
        device_.fill_zero(fp.full_grad, fp.full_bytes());  // engines accumulate into grads
      }
      bind_tensors(fp, fp.full_grad, &ParamBinding::grad, fp.compute);
    }
  }

  // Unbinds the gradients and issues every reduction; returns whether all completed inside
  // the call.
  bool start_reductions(std::vector<FlatParam>& flat, bool grad_is_zero) {
    bool inline_done = true;
    for (auto& fp : flat) {
      bind_tensors(fp, nullptr, &ParamBinding::grad, fp.master());
      inline_done = start_reduction(fp, grad_is_zero) && inline_done;
    }
    return inline_done;
  }

  void finish_reductions(std::vector<FlatParam>& flat, const TracedWait& wait) {
    for (auto& fp : flat) {
      if (!fp.reducing) continue;
      fp.reducing = false;
      wait(fp.reduce_work, "wait reduce_scatter");
      finish_gradient(fp, wait);
    }
  }

  void zero_grad(std::vector<FlatParam>& flat) {
    for (auto& fp : flat) device_.fill_zero(fp.shard_grad, fp.shard_grad_bytes());
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

 private:
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

  void finish_gradient(FlatParam& fp, const TracedWait& wait) {
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

  void release(void*& p, std::size_t n, MemorySpace space) {
    if (p) device_.deallocate(p, n, space);
    p = nullptr;
  }

  UnitGroups groups_;
  DeviceRef device_;
  double pre_divide_ = 1.0, post_divide_ = 1.0;
};

}  // namespace detail
}  // namespace fsdp
