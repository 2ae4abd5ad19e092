#pragma once
// How a unit's gradients are averaged: FSDP's pre/post division around a reduce-scatter
// over the shard group (an all-reduce when parameters are replicated), then an all-reduce
// over the replicate group, into the sharded gradient, with every buffer this needs.
#include <cmath>
#include <cstddef>
#include <optional>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/unit/detail/zero_batch.hpp"
#include "fsdp/policy/gradient_sync.hpp"

namespace fsdp {

// FSDP's split of the 1/N average into a factor before and one after the reduction,
// so low-precision gradients neither overflow in the sum nor underflow before it. N is
// what the unit divides by (fsdp::divide_factor, fsdp/policy/reshard_settings.hpp): the
// world size (ShardOptions::local_gradients = mean), 1 (sum: nothing is scaled), or its
// gradient divide factor.
inline double gradient_predivide_factor(double divide_by) {
  double factor = 1;
  while (std::fmod(divide_by, factor) == 0 && divide_by / factor > factor) factor *= 2;
  return factor;
}

namespace detail {

// The plan (fsdp/unit/detail/flat_param_rules.hpp) for a unit's groups: only sharded
// parameters with replicas have an all-reduce of gradient shards to defer.
inline GradientPlan plan_gradient(const GradientSync& sync, const UnitGroups& groups) {
  return plan_gradient(sync, groups.shards_parameters && groups.replicate_size > 1);
}

// Not a template: the one policy it reads (CpuOffload) is a value, so its code compiles
// once, not once per policy configuration.
class GradientReduction {
 public:
  // `groups`: the owning FlatParamGroup's, read at each reduction (a unit kept unsharded
  // changes them before its first); the world, and so the factors, stay the same.
  // `shard_space`: where the sharded gradients live (host under OffloadParams).
  GradientReduction(const UnitGroups& groups, DeviceRef device, MemorySpace shard_space)
      : groups_(groups), device_(device), shard_space_(shard_space) {
    set_divide_factor(0);
  }
  GradientReduction(const GradientReduction&) = delete;
  GradientReduction& operator=(const GradientReduction&) = delete;

  // What a synchronized reduction divides the sum by (fsdp::divide_factor: the unit's
  // gradient divide factor, or 1 under LocalGradients::sum); 0: the world size.
  void set_divide_factor(double f) {
    const double total = f > 0 ? f : groups_.world_size();
    pre_divide_ = gradient_predivide_factor(total);
    post_divide_ = total / pre_divide_;
    by_world_ = total == groups_.world_size();
  }

  // Binds zeroed gradients for the engine to accumulate into: unsharded ones, or the
  // sharded one itself where it is zero and the whole parameter (grad_accumulates_in_shard),
  // or the one an unsynchronized backward kept, to add into. `grad_is_zero`: nothing was
  // reduced into the sharded gradient since zero_grad. The zeroing joins `zeros`, which the
  // caller flushes before the engine's backward.
  void bind_gradients(std::vector<FlatParam>& flat, bool grad_is_zero, ZeroBatch& zeros) {
    for (auto& fp : flat) {
      if (fp.full_grad) {
        // kept by an unsynchronized backward (accumulate == compute): the engine adds into it
      } else if (fp.grad_in_shard && grad_is_zero) {
        ensure_shard_grad(fp, &zeros);
        fp.full_grad = fp.shard_grad;  // zero, and the whole parameter's: accumulate in place, as DDP does
      } else {
        fp.full_grad = device_.allocate(fp.full_bytes(), MemorySpace::device);
        zeros.add(device_, fp.full_grad, fp.full_bytes(), MemorySpace::device);  // engines accumulate into grads
      }
      bind_tensors(fp, fp.full_grad, &ParamBinding::grad, fp.compute);
    }
  }

  // Unbinds the gradients and issues every reduction the plan asks for; returns whether
  // all completed inside the call.
  // `tag` (may be null) goes with every collective of these reductions.
  bool start_reductions(std::vector<FlatParam>& flat, bool grad_is_zero, GradientPlan plan, const CollectiveTag* tag) {
    tag_ = tag ? std::optional<CollectiveTag>(*tag) : std::nullopt;
    bool inline_done = true;
    for (auto& fp : flat) {
      bind_tensors(fp, nullptr, &ParamBinding::grad, fp.master());
      if (plan == GradientPlan::keep_unsharded) keep_unsharded(fp);
      else inline_done = start_reduction(fp, grad_is_zero, plan == GradientPlan::reduce_partial) && inline_done;
    }
    return inline_done;
  }

  void finish_reductions(std::vector<FlatParam>& flat, const TracedWait& wait) {
    for (auto& fp : flat) {
      if (!fp.reducing) continue;
      fp.reducing = false;
      // On a queued device: the compute queue waits, and the Work owes its host check.
      if (wait_for_use(fp.reduce_work, device_, wait, "wait reduce_scatter")) unchecked_.push_back(std::move(fp.reduce_work));
      finish_gradient(fp, wait);
    }
  }

  // Host waits for every reduction the device waited for since the last check: where the
  // host needs the gradients (the optimizer step after finish_backward), and where a
  // collective's failure, which a device-side wait cannot raise, becomes an fsdp::Error.
  void check_on_host(const TracedWait& wait) {
    struct Clear {  // also on a throw: the rest are dropped unwaited; the capacity stays for the next step
      std::vector<Work>& v;
      ~Clear() { v.clear(); }
    } clear{unchecked_};
    for (auto& w : unchecked_) wait(w, "wait reductions (host)");
  }
  void drop_checks() { unchecked_.clear(); }  // a step abandoned: their errors are reported again

  // Also drops what accumulation kept: unsharded gradients and shard-group sums. The
  // zeroing joins `batch` (the caller flushes it: one call for a whole model's units).
  void zero_grad(std::vector<FlatParam>& flat, ZeroBatch& batch) {
    for (auto& fp : flat) {
      release_accumulated(fp);
      batch.add(device_, fp.shard_grad, fp.shard_grad_bytes(), shard_space_);  // null: freed after a hook
    }
  }

  // The sharded gradient, allocated again where a post-accumulate-grad hook freed it, its
  // zeroing joining `zeros`; none where the reduction writes all of it (null `zeros`: a
  // freed gradient counts as zero, so the reduction goes into it, not adds).
  void ensure_shard_grad(FlatParam& fp, ZeroBatch* zeros) {
    if (fp.shard_grad) return;
    fp.shard_grad = device_.allocate(fp.shard_grad_bytes(), shard_space_);
    if (zeros) zeros->add(device_, fp.shard_grad, fp.shard_grad_bytes(), shard_space_);
  }
  // Where an unsynchronized backward kept its sum in the sharded gradient itself (the
  // engine adds into it: grad_accumulates_in_shard), freeing it would drop that sum: the
  // buffer becomes the kept unsharded gradient instead, and the next reduction writes a new
  // sharded gradient. release_full_grad frees it later as full_bytes() of device memory:
  // the same buffer, as grad_accumulates_in_shard holds only for a device-resident shard
  // that is the whole padded parameter in the compute dtype.
  void release_shard_grad(FlatParam& fp) {
    if (fp.full_grad == fp.shard_grad) fp.shard_grad = nullptr;
    else release(fp.shard_grad, fp.shard_grad_bytes(), shard_space_);
  }

  // Frees what accumulation keeps between backwards (none of it is in flight in IDLE).
  void release_accumulated(FlatParam& fp) {
    release_reduction_buffers(fp);
    release(fp.partial, fp.partial_bytes(), MemorySpace::device);
    release_full_grad(fp);
    fp.grad_kept = false;
  }

  void release_reduction_buffers(FlatParam& fp) {
    if (fp.reduce_out && fp.reduce_out != fp.shard_grad && fp.reduce_out != fp.partial)
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
  // cast to the reduce dtype if needed (what was kept, summed in the accumulate dtype, is
  // rounded to it once, here); reduce-scatter over the shard group (all-reduce
  // when parameters are replicated), then all-reduce of the shard over the replicate group;
  // FSDP's pre and post factors in the reduce dtype; then into the sharded gradient (cast
  // to its dtype, copied to host when offloaded). start_reduction issues the first
  // collective and returns whether it completed inside the call; finish_gradient does the
  // rest once it has.
  bool start_reduction(FlatParam& fp, bool grad_is_zero, bool defer_all_reduce) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    const auto padded = static_cast<std::size_t>(L.padded_numel());
    void* in = fp.full_grad;
    if (casts_into_shard_grad(groups_.reduces_alone(), fp.dtypes(), fp.reduce_in != nullptr, grad_is_zero,
                              defer_all_reduce, shard_space_ == MemorySpace::host)) {
      ensure_shard_grad(fp, nullptr);  // the cast writes all of it
      device_.cast(fp.shard_grad, fp.reduce, fp.full_grad, fp.compute, padded);
      release_full_grad(fp);
      in = fp.shard_grad;  // the reduction below is then nothing: in place, alone
    } else if (fp.reduce != fp.compute) {
      to_reduce_dtype(fp);
      in = fp.reduce_in;
    }
    fp.grad_kept = false;  // whatever was kept is in `in` now
    const ReduceOp op = collectives_average(fp) ? ReduceOp::avg : ReduceOp::sum;
    if (op == ReduceOp::sum && pre_divide_ != 1.0) device_.scale(in, padded, fp.reduce, 1.0 / pre_divide_);
    // Right after zero_grad a device-resident sharded gradient of the reduce dtype is zero:
    // reduce straight into it (in place when the engine already accumulated into it).
    // A deferred all-reduce leaves it alone: the shard-group sum waits in `partial` (reduced
    // straight into it when it is the first and partial's dtype is the reduce dtype).
    fp.defer_all_reduce = defer_all_reduce;
    fp.into_shard_grad = grad_is_zero && !defer_all_reduce;
    if (!defer_all_reduce && !fp.shard_grad) {  // a hook freed it: allocated only now
      if (!fp.into_shard_grad) fail("internal: a freed sharded gradient must count as zero");
      ensure_shard_grad(fp, nullptr);  // the reduction (or its copy) writes all of it
    }
    const std::size_t out_bytes = FlatParam::bytes(L.shard_numel(), fp.reduce);
    if (defer_all_reduce) fp.reduce_out = fp.partial || fp.accumulate != fp.reduce
                                              ? device_.allocate(out_bytes, MemorySpace::device)
                                              : (fp.partial = device_.allocate(out_bytes, MemorySpace::device));
    else fp.reduce_out = fp.into_shard_grad && shard_space_ == MemorySpace::device && fp.grad == fp.reduce
                             ? fp.shard_grad
                             : device_.allocate(out_bytes, MemorySpace::device);
    fp.reduce_work = groups_.reduce(device_, in, fp.reduce_out, S, fp.reduce, op, tag());
    fp.reducing = true;
    return fp.reduce_work.completed_inline();
  }

  void finish_gradient(FlatParam& fp, const TracedWait& wait) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    void* out = fp.reduce_out;
    if (fp.defer_all_reduce) {  // the shard-group sum waits for a later all-reduce
      if (out != fp.partial) add_into_partial(fp, out);
      release_reduction_buffers(fp);
      release_full_grad(fp);
      return;
    }
    if (fp.partial) {  // sums whose all-reduce was deferred join this one
      if (fp.accumulate == fp.reduce) {
        device_.accumulate(out, fp.partial, S, fp.reduce);
      } else {  // summed in the accumulate dtype, rounded to the reduce dtype once
        add_into_partial(fp, out);
        device_.cast(out, fp.reduce, fp.partial, fp.accumulate, S);
      }
      release(fp.partial, fp.partial_bytes(), MemorySpace::device);
    }
    const bool average = collectives_average(fp);
    if (groups_.shards_parameters && groups_.replicate_size > 1) {
      Work w = groups_.replicate.all_reduce(out, out, S, fp.reduce, average ? ReduceOp::avg : ReduceOp::sum, tag());
      if (wait_for_use(w, device_, wait, "wait all_reduce")) unchecked_.push_back(std::move(w));
    }
    if (!average && post_divide_ != 1.0) device_.scale(out, S, fp.reduce, 1.0 / post_divide_);
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

  // An unsynchronized backward: no communication. FSDP2 accumulates in MixedPrecision's
  // reduce dtype; where that is the compute dtype the engine's buffer itself is kept and
  // added into. Never in CommPrecision's narrower reduce dtype: that is only what the
  // synchronized reduction moves (flat_param_dtypes: accumulate is compute or reduce).
  void keep_unsharded(FlatParam& fp) {
    if (fp.accumulate != fp.compute) to_reduce_dtype(fp);
    fp.grad_kept = true;
  }

  // The compute-dtype gradient, cast to the reduce dtype, into reduce_in (added to the sum
  // unsynchronized backwards kept there, if any); the compute-dtype buffer is freed.
  void to_reduce_dtype(FlatParam& fp) {
    const auto padded = static_cast<std::size_t>(fp.layout.padded_numel());
    const std::size_t bytes = FlatParam::bytes(fp.layout.padded_numel(), fp.reduce);
    if (!fp.reduce_in) {
      fp.reduce_in = device_.allocate(bytes, MemorySpace::device);
      device_.cast(fp.reduce_in, fp.reduce, fp.full_grad, fp.compute, padded);
    } else {
      void* cast = device_.allocate(bytes, MemorySpace::device);
      device_.cast(cast, fp.reduce, fp.full_grad, fp.compute, padded);
      device_.accumulate(fp.reduce_in, cast, padded, fp.reduce);
      device_.deallocate(cast, bytes, MemorySpace::device);
    }
    release_full_grad(fp);
  }

  // A deferred shard-group sum `out` (reduce dtype) added into `partial` (accumulate dtype).
  void add_into_partial(FlatParam& fp, void* out) {
    const auto S = static_cast<std::size_t>(fp.layout.shard_numel());
    if (fp.accumulate == fp.reduce) return device_.accumulate(fp.partial, out, S, fp.reduce);
    if (!fp.partial) {
      fp.partial = device_.allocate(fp.partial_bytes(), MemorySpace::device);
      return device_.cast(fp.partial, fp.accumulate, out, fp.reduce, S);
    }
    void* wide = device_.allocate(fp.partial_bytes(), MemorySpace::device);
    device_.cast(wide, fp.accumulate, out, fp.reduce, S);
    device_.accumulate(fp.partial, wide, S, fp.accumulate);
    device_.deallocate(wide, fp.partial_bytes(), MemorySpace::device);
  }

  // Whether the collectives divide by the group sizes themselves (ReduceOp::avg, NCCL's
  // pre-multiplied sum), instead of the pre/post factors' two scale kernels, as FSDP2 does
  // where the sum cannot overflow: every floating dtype but f16, dividing by the world. In
  // bf16 only over groups of a power of two ranks: NCCL multiplies by 1/n rounded to bf16
  // (1/3 becomes 0.333984), which would bias every gradient. Single-stage reductions give
  // bitwise what the factors give where no value is subnormal, over a power of two ranks
  // on NCCL and over any number on the host backends (a sum, then one multiplication by
  // 1/n, where the pre-factor is a power of two); hybrid ones round once per group.
  bool collectives_average(const FlatParam& fp) const {
    if (!by_world_ || fp.reduce == DType::f16) return false;
    auto power_of_two = [](int n) { return n > 0 && (n & (n - 1)) == 0; };
    return fp.reduce != DType::bf16 || (power_of_two(groups_.shard_size) && power_of_two(groups_.replicate_size));
  }

  void release(void*& p, std::size_t n, MemorySpace space) { release_buffer(device_, p, n, space); }

  const CollectiveTag* tag() const { return tag_ ? &*tag_ : nullptr; }

  const UnitGroups& groups_;
  DeviceRef device_;
  MemorySpace shard_space_;
  std::optional<CollectiveTag> tag_;  // the reduction in flight's (its all-reduce may come later)
  double pre_divide_ = 1, post_divide_ = 1;
  bool by_world_ = true;  // the divide factor is the world size (set_divide_factor)
  std::vector<Work> unchecked_;  // waited on the device's queue; the host has not seen them complete
};

}  // namespace detail
}  // namespace fsdp
