#pragma once
// ShardedGradScaler: dynamic loss scaling for fp16 mixed precision over sharded gradients,
// the role of PyTorch's torch.distributed.fsdp.ShardedGradScaler.
//
// fp16 has a narrow range: small gradients underflow to zero. The loss is multiplied by a
// large scale before backward, so every gradient is computed `scale` times too large;
// before the optimizer step the gradients are divided by the scale again. When the scale
// was too large some gradient overflows to inf (or becomes NaN): the step is skipped and
// the scale backs off. After `growth_interval` good steps in a row the scale grows again.
//
// Each rank holds only its shard of every gradient, so one rank may see an inf that the
// others do not. unscale() therefore agrees across the communicator's group (an all_reduce
// max of a flag): every rank skips, or every rank steps, and every rank's scale stays the
// same. Pass the group the gradients are sharded over; the world group is always right.
//
//   fsdp::ShardedGradScaler scaler(comm);
//   backward(scaler.scale_loss(loss));            // i.e. seed the output gradient with scale()
//   scaler.step(model.shards(), [&] { optimizer.step(); });  // unscales, skips on inf/NaN
//   scaler.update();
//   // checkpoints: save scaler.state(), resume with scaler.load_state(saved)
//
// One scaler per rank; it is not shared between threads. Built with only a communicator,
// it unscales with a host loop (a HostDevice of its own), so the gradients must be host
// memory (the host device, or CPU offload). Built with a Device as well, it unscales where
// the gradients live, with the device's unscale: on CUDA one kernel per shard and one wait
// for the inf/NaN flag per step. The agreed flag is a 4-byte host value, all-reduced with
// one collective per step.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <utility>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/unit/unit.hpp"

namespace fsdp {

struct GradScalerOptions {
  double init_scale = 65536.0;   // 2^16, PyTorch's default
  double growth_factor = 2.0;    // scale *= growth_factor after growth_interval good steps
  double backoff_factor = 0.5;   // scale *= backoff_factor after a step with inf/NaN
  int growth_interval = 2000;    // consecutive good steps before the scale grows
};

// What a checkpoint keeps of a scaler to resume exactly: its scale and its growth tracker.
struct GradScalerState {
  double scale = 65536.0;
  int good_steps = 0;
};

namespace detail {

// The gradient's dtype: ShardView::grad_dtype where the view has one (gradients kept in
// another dtype than the parameters), else the parameters' dtype.
template <class View>
DType grad_dtype_of(const View& v) {
  if constexpr (requires { v.grad_dtype; }) {
    return static_cast<DType>(v.grad_dtype);
  } else {
    return v.dtype;
  }
}

// The Device a scaler unscales on, without making the scaler a template on it.
struct UnscaleTarget {
  void* device = nullptr;
  void (*unscale)(void* device, void* p, std::size_t n, DType t, double inv_scale) = nullptr;
  bool (*found_nonfinite)(void* device) = nullptr;

  template <class D>
  static UnscaleTarget of(D& d) {
    static_assert(UnscalingDevice<D>,
                  "fsdp: ShardedGradScaler(comm, device) needs a Device with unscale(ptr, count, dtype, inv_scale) "
                  "and found_nonfinite() (fsdp::UnscalingDevice); HostDevice and CudaDevice have them");
    return {&d, [](void* x, void* p, std::size_t n, DType t, double inv) { static_cast<D*>(x)->unscale(p, n, t, inv); },
            [](void* x) { return static_cast<bool>(static_cast<D*>(x)->found_nonfinite()); }};
  }
};

}  // namespace detail

template <Communicator C>
class ShardedGradScaler {
 public:
  // Unscales on the host (with a HostDevice of its own): the gradient shards must be host memory.
  explicit ShardedGradScaler(C& comm, GradScalerOptions options = {}) : ShardedGradScaler(comm, host_, options) {}

  // Unscales on `device`, wherever its gradient shards live (device or host space). The
  // device is held by reference and must outlive the scaler.
  template <Device D>
  ShardedGradScaler(C& comm, D& device, GradScalerOptions options = {})
      : comm_(comm), opt_(options), target_(detail::UnscaleTarget::of(device)) {
    const auto& o = opt_;
    if (!(std::isfinite(o.init_scale) && o.init_scale >= std::numeric_limits<double>::min()))
      fail("init_scale must be a positive finite number, got ", o.init_scale);
    if (!(std::isfinite(o.growth_factor) && o.growth_factor > 1.0))
      fail("growth_factor must be finite and greater than 1, got ", o.growth_factor);
    if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
      fail("backoff_factor must be in (0, 1), got ", o.backoff_factor);
    if (o.growth_interval < 1) fail("growth_interval must be at least 1, got ", o.growth_interval);
    scale_ = o.init_scale;
  }

 public:
  ShardedGradScaler(const ShardedGradScaler&) = delete;
  ShardedGradScaler& operator=(const ShardedGradScaler&) = delete;

  double scale() const { return scale_; }
  // The loss to backpropagate from: the engine multiplies its output gradient by scale().
  double scale_loss(double loss) const { return loss * scale_; }
  // Consecutive steps without inf/NaN since the scale last changed.
  int good_steps() const { return good_steps_; }
  const GradScalerOptions& options() const { return opt_; }

  // For checkpoints: the state update() leaves behind, and putting it back between steps.
  GradScalerState state() const { return {scale_, good_steps_}; }
  void load_state(const GradScalerState& s) {
    if (state_ != State::fresh) fail("load_state() between unscale()/step() and update(); load it between steps");
    if (!(std::isfinite(s.scale) && s.scale >= std::numeric_limits<double>::min()))
      fail("load_state(): the scale must be a positive finite number, got ", s.scale);
    if (s.good_steps < 0 || s.good_steps >= opt_.growth_interval)
      fail("load_state(): good_steps must be in [0, growth_interval ", opt_.growth_interval, "), got ", s.good_steps);
    scale_ = s.scale;
    good_steps_ = s.good_steps;
  }

  // Divides this rank's gradient shards by scale() in place (only the first numel elements
  // of each: padding is left alone), checks them for inf/NaN, and agrees across the group.
  // Returns true, identically on every rank, when some rank found inf/NaN: the step must be
  // skipped. Collective: every rank of the group must call it, with or without shards.
  bool unscale(std::span<const ShardView> shards) {
    if (state_ != State::fresh)
      fail("unscale() called again after ", state_ == State::stepped ? "step()" : "unscale()",
           " without update() in between; the gradients would be divided by the scale twice. Call update() "
           "after each step");
    // Shards this rank cannot unscale are reported to every rank through the same
    // all_reduce, so that all ranks fail together instead of leaving the others waiting.
    std::string bad_shard;
    for (std::size_t i = 0; i < shards.size() && bad_shard.empty(); ++i) bad_shard = check_shard(shards[i], i);

    float local = 0.0f;  // 0: finite, 1: inf/NaN, 2 + r: rank r's shards are invalid
    if (!bad_shard.empty()) {
      local = 2.0f + static_cast<float>(comm_.rank());
    } else {
      const double inv = 1.0 / scale_;
      for (const ShardView& s : shards)  // dtypes were checked by check_shard
        if (s.numel > 0) target_.unscale(target_.device, s.grad, static_cast<std::size_t>(s.numel), detail::grad_dtype_of(s), inv);
      if (target_.found_nonfinite(target_.device)) local = 1.0f;  // one wait for all shards
    }
    float agreed = 0.0f;
    comm_.all_reduce(&local, &agreed, 1, DType::f32, ReduceOp::max).wait();
    if (!bad_shard.empty()) fail(bad_shard);
    if (agreed >= 2.0f)
      fail("unscale() on rank ", comm_.rank(), ": rank ", static_cast<int>(agreed) - 2,
           " passed gradient shards it cannot unscale (see that rank's error); this rank's gradients may "
           "already be unscaled");
    found_inf_ = agreed > 0.0f;
    state_ = State::unscaled;
    return found_inf_;
  }

  // Runs opt_step() unless the gradients hold inf/NaN on some rank; unscales first if
  // unscale() was not called since the last update(). Returns whether the step ran (the
  // same on every rank).
  template <class F>
  bool step(std::span<const ShardView> shards, F&& opt_step) {
    if (state_ == State::stepped) fail("step() called twice since the last update(); call update() after each step");
    if (state_ == State::fresh) unscale(shards);
    state_ = State::stepped;
    if (found_inf_) return false;
    std::invoke(std::forward<F>(opt_step));
    return true;
  }

  // Adjusts the scale after a step: on inf/NaN scale *= backoff_factor and the good-step
  // count restarts; after growth_interval good steps in a row scale *= growth_factor
  // (unless that would overflow). The same on every rank, since unscale() agreed.
  void update() {
    if (state_ == State::fresh)
      fail("update() called without unscale() or step() since the last update(); it needs to know whether "
           "this step's gradients were finite");
    if (found_inf_) {
      const double next = scale_ * opt_.backoff_factor;
      if (next < std::numeric_limits<double>::min())
        fail("the loss scale underflowed (", scale_, " * backoff ", opt_.backoff_factor,
             "): the gradients held inf/NaN at every scale tried, so the loss or the model itself "
             "is probably not finite");
      scale_ = next;
      good_steps_ = 0;
    } else if (++good_steps_ >= opt_.growth_interval) {
      const double next = scale_ * opt_.growth_factor;
      if (std::isfinite(next)) scale_ = next;
      good_steps_ = 0;
    }
    found_inf_ = false;
    state_ = State::fresh;
  }

 private:
  enum class State : std::uint8_t { fresh, unscaled, stepped };

  template <class... Parts>
  [[noreturn]] static void fail(Parts&&... parts) {
    detail::fail("ShardedGradScaler: ", std::forward<Parts>(parts)...);
  }

  std::string check_shard(const ShardView& s, std::size_t index) const {
    const DType t = detail::grad_dtype_of(s);
    const std::string unit(detail::display_name(s.unit));
    const std::string where = "unscale() on rank " + std::to_string(comm_.rank()) + ": shard " +
                              std::to_string(index) + " of unit '" + unit + "' ";
    if (s.numel < 0) return where + "has negative numel " + std::to_string(s.numel);
    if (t != DType::f32 && t != DType::f64 && t != DType::f16 && t != DType::bf16)
      return where + "has gradient dtype " + std::string(name_of(t)) +
             "; only f32, f64, f16 and bf16 gradients can be unscaled";
    if (s.numel > 0 && s.grad == nullptr) return where + "has no gradient buffer (grad is null)";
    return {};
  }

  C& comm_;
  GradScalerOptions opt_;
  HostDevice host_;  // what the communicator-only constructor unscales on
  detail::UnscaleTarget target_;
  double scale_ = 1.0;
  int good_steps_ = 0;
  bool found_inf_ = false;
  State state_ = State::fresh;
};

}  // namespace fsdp
