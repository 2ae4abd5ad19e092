#pragma once
// How the reference engine plugs into fsdp: everything engine-specific that a user writes.
//  - tensor_traits<engine::Tensor>      (in tensor.hpp)
//  - visit_parameters / visit_children  (members of the layers and the model)
//  - UnitHooks: the engine's forward/backward hook points -> unit lifecycle calls
//  - slots(): the units' flat shards -> the engine optimizer's slots
//  - DeviceAllocator: optimizer state allocated (and counted) through the fsdp Device
//  - reset_parameters: the init callback of fsdp::deferred_init
#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include <fsdp/fsdp.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#include "examples/engine/model.hpp"
#include "examples/engine/optim.hpp"

namespace engine {

// Modules are looked up by address and type: a module's first member shares its address.
struct UnitHooks {
  fsdp::ShardedModel& model;
  template <class M> void before_forward(const M* m) { if (auto* u = model.find_unit_for(*m)) u->pre_forward(); }
  template <class M> void after_forward(const M* m) { if (auto* u = model.find_unit_for(*m)) u->post_forward(); }
  template <class M> void before_backward(const M* m) { if (auto* u = model.find_unit_for(*m)) u->pre_backward(); }
  template <class M> void after_backward(const M* m) { if (auto* u = model.find_unit_for(*m)) u->post_backward(); }
};

namespace detail {
// Refuses a shard the f32 optimizers cannot step: its parameters, or (where the library's
// ShardView reports it separately) its gradient, in another dtype.
template <class View>
void check_f32_shard(const View& v) {
  if (v.dtype != fsdp::DType::f32)
    throw fsdp::Error("reference engine optimizers step on f32 only; unit '" + std::string(v.unit) + "' has " +
                      std::string(fsdp::name_of(v.dtype)));
  if constexpr (requires { v.grad_dtype; }) {
    if (v.grad_dtype != fsdp::DType::f32)
      throw fsdp::Error("reference engine optimizers step on f32 only; unit '" + std::string(v.unit) +
                        "' has a " + std::string(fsdp::name_of(v.grad_dtype)) + " gradient");
  }
}
}  // namespace detail

inline std::vector<Slot> slots(const fsdp::ShardedModel& m) {
  std::vector<Slot> out;
  for (const auto& v : m.shards()) {
    detail::check_f32_shard(v);
    out.push_back({static_cast<float*>(v.param), static_cast<const float*>(v.grad), v.numel});
  }
  return out;
}

inline std::vector<Slot> slots(Model& m) {  // unsharded: the model's own tensors, which must be f32
  std::vector<Slot> out;
  for (auto& p : named_parameters(m)) {
    if (p.param->dtype() != fsdp::DType::f32 || p.grad->dtype() != fsdp::DType::f32)
      throw fsdp::Error("reference engine optimizers step on f32 only; parameter '" + p.fqn + "' has " +
                        std::string(fsdp::name_of(p.param->dtype())) + " (gradient " +
                        std::string(fsdp::name_of(p.grad->dtype())) + ")");
    Slot s{p.param->data(), p.grad->data(), p.param->numel()};
    if (p.param->shape().size() == 2) s.rows = p.param->shape()[0], s.cols = p.param->shape()[1];
    out.push_back(s);
  }
  return out;
}

// One slot per parameter this rank holds (ParamView: its slice of the parameter and of the
// gradient), for optimizers that are not element-wise (Muon): a 2-D parameter held whole
// is a matrix slot. One held in part is refused, naming it: such an optimizer needs each
// parameter whole on one rank (ShardOptions::shard_layout = param_atomic()).
inline std::vector<Slot> parameter_slots(const fsdp::ShardedModel& m) {
  std::vector<Slot> out;
  for (const auto& v : m.parameters()) {
    detail::check_f32_shard(v);
    if (v.count == 0) continue;
    if (v.count != v.numel)
      throw fsdp::Error("an optimizer that steps whole parameters got " + std::to_string(v.count) + " of the " +
                        std::to_string(v.numel) + " elements of '" + std::string(v.fqn) +
                        "' on this rank: shard with ShardOptions::shard_layout = ShardLayout::param_atomic()");
    Slot s{static_cast<float*>(v.param), static_cast<const float*>(v.grad), v.count};
    if (v.shape.size() == 2) s.rows = v.shape[0], s.cols = v.shape[1];
    out.push_back(s);
  }
  return out;
}

// The slots `Optimizer` steps on: one per parameter where it says so (Muon), else the flat shards.
template <class Optimizer>
std::vector<Slot> slots_for(const fsdp::ShardedModel& m) {
  if constexpr (requires { Optimizer::per_parameter; }) return parameter_slots(m);
  else return slots(m);
}

// Optimizer in backward: each unit's post-accumulate-grad hook steps that unit's shards as
// soon as their gradient is final, then the library frees the gradient
// (fsdp::GradientAfterHook::free). One optimizer per unit, built by `make`: each keeps
// its own state and step count, so every element steps exactly as under one optimizer
// over all shards after backward. The hooks are removed when this goes (before the model).
template <class Optimizer>
class OptimizerInBackward {
  static_assert(!requires { Optimizer::per_parameter; },
                "OptimizerInBackward hands each unit's flat shards to an element-wise optimizer (SGD, AdamW); an "
                "optimizer that steps whole parameters (engine::Muon) would see no matrix in them: step it after "
                "backward on engine::parameter_slots(model)");

 public:
  template <class Make>
  OptimizerInBackward(fsdp::ShardedModel& model, Make make) : model_(model) {
    for (auto& u : model) index_.push_back(u.get()), optimizers_.push_back(make());
    model.set_post_accumulate_grad_hook([this](fsdp::Unit& u) { step(u); }, fsdp::GradientAfterHook::free);
  }
  ~OptimizerInBackward() {
    try {
      model_.set_post_accumulate_grad_hook({}, fsdp::GradientAfterHook::keep);
    } catch (...) {  // units left mid-step by an error: their hooks die with them
    }
  }
  OptimizerInBackward(const OptimizerInBackward&) = delete;
  OptimizerInBackward& operator=(const OptimizerInBackward&) = delete;

  // How many units stepped since construction (tests: one per unit per step).
  long unit_steps() const { return unit_steps_; }

 private:
  void step(fsdp::Unit& u) {
    const auto at = std::find(index_.begin(), index_.end(), &u);
    if (at == index_.end()) throw fsdp::Error("OptimizerInBackward: unit '" + u.fqn() + "' is not of its model");
    std::vector<Slot> s;
    for (const auto& v : u.shards()) {
      detail::check_f32_shard(v);
      s.push_back({static_cast<float*>(v.param), static_cast<const float*>(v.grad), v.numel});
    }
    optimizers_[static_cast<std::size_t>(at - index_.begin())]->step(s);
    ++unit_steps_;
  }

  fsdp::ShardedModel& model_;
  std::vector<fsdp::Unit*> index_;
  std::vector<std::unique_ptr<Optimizer>> optimizers_;
  long unit_steps_ = 0;
};

// Weight-decay masks that decay only matrices (2-D parameters), one per slot, built from the
// per-parameter views: no cast to a unit type. The sharded form marks the elements each
// parameter has in this rank's shards; the unsharded one, each parameter whole.
using DecayMasks = std::vector<std::vector<std::uint8_t>>;

inline DecayMasks decay_masks(const fsdp::ShardedModel& m) {
  DecayMasks out;
  for (const auto& v : m.shards()) out.emplace_back(static_cast<std::size_t>(v.numel), std::uint8_t{0});
  for (const auto& p : m.parameters())
    if (p.shape.size() == 2)
      std::fill_n(out[p.model_shard].begin() + p.shard_offset, p.count, std::uint8_t{1});
  return out;
}

inline DecayMasks decay_masks(Model& m) {
  DecayMasks out;
  for (auto& p : named_parameters(m))
    out.emplace_back(static_cast<std::size_t>(p.param->numel()), std::uint8_t{p.param->shape().size() == 2});
  return out;
}

// Slots with weight decay where `masks` say (masks from decay_masks of the same model).
template <class M>
std::vector<Slot> masked_slots(M& m, const DecayMasks& masks) {
  auto out = slots(m);
  if (out.size() != masks.size()) throw fsdp::Error("masked_slots: the masks are for another model");
  for (std::size_t k = 0; k < out.size(); ++k) out[k].decay = masks[k].data();
  return out;
}

// Zeroes every gradient of the model, whatever its dtype (all-zero bits are +0 in each).
inline void zero_grads(Model& m) {
  for (auto& p : named_parameters(m))
    if (p.grad->raw()) std::memset(p.grad->raw(), 0, static_cast<std::size_t>(p.grad->numel()) * fsdp::size_of(p.grad->dtype()));
}

// In `space`: the device space by default; the host space for optimizer state next to
// shards that OffloadParams put there.
template <fsdp::Device D>
struct DeviceAllocator final : Allocator {
  explicit DeviceAllocator(D& d, fsdp::MemorySpace s = fsdp::MemorySpace::device) : device(d), space(s) {}
  void* allocate(std::size_t bytes) override { return device.allocate(bytes, space); }
  void deallocate(void* p, std::size_t bytes) override { device.deallocate(p, bytes, space); }
  D& device;
  fsdp::MemorySpace space;
};

// The units of the reference model: one per block, one for the gain, the rest at the root.
using Wrap = fsdp::wrap_types<Block, Gain>;

// The init callback of fsdp::deferred_init for a model built with Init::deferred: each layer
// computes the values it would have been built with.
inline constexpr auto reset_parameters = [](auto& module, std::string_view) {
  if constexpr (requires { module.reset_parameters(); }) module.reset_parameters();
};

// Forward and backward of one micro-batch on this rank's part of it, from the loss
// multiplied by `loss_scale` (fp16 loss scaling), adding into the gradients; the gradients
// are reduced when it returns unless sync is off (ShardedModel::no_sync). Returns the local
// (unscaled) loss.
inline double sharded_micro_batch(Model& model, fsdp::ShardedModel& sharded, const Batch& local, double loss_scale = 1.0) {
  UnitHooks hooks{sharded};
  Mat dout;
  const double loss = mse(model.forward(local.x, hooks), local.y, dout, model.config.loss);
  if (loss_scale != 1.0)
    for (auto& v : dout.v) v = static_cast<float>(v * loss_scale);
  model.backward(dout, hooks);
  sharded.finish_backward();
  return loss;
}

// One step's forward and backward over its micro-batches (gradient accumulation: the
// gradient of the sum of their losses), from zeroed gradients. All but the last run with
// gradient sync off, so under GradientSyncMode::keep_unsharded only the last communicates.
// Returns the mean local loss.
inline double sharded_forward_backward(Model& model, fsdp::ShardedModel& sharded, std::span<const Batch> micro,
                                       double loss_scale = 1.0) {
  if (micro.empty()) throw fsdp::Error("sharded_forward_backward: no micro-batch");
  sharded.zero_grad();
  double sum = 0;
  if (micro.size() > 1) {
    auto no_sync = sharded.no_sync();
    for (const Batch& b : micro.first(micro.size() - 1)) sum += sharded_micro_batch(model, sharded, b, loss_scale);
  }
  sum += sharded_micro_batch(model, sharded, micro.back(), loss_scale);
  return sum / static_cast<double>(micro.size());
}
inline double sharded_forward_backward(Model& model, fsdp::ShardedModel& sharded, const Batch& local, double loss_scale = 1.0) {
  return sharded_forward_backward(model, sharded, std::span<const Batch>(&local, 1), loss_scale);
}

// A DeviceMesh over a CountingCommunicator: zero every group's tally, and the collectives
// of its world and both groups together (what one rank sent, sub-groups included).
template <class Mesh>
void reset_counts(Mesh& mesh) {
  mesh.world().reset(), mesh.shard_group().reset(), mesh.replicate_group().reset();
}
template <class Mesh>
fsdp::CollectiveCounts total_counts(Mesh& mesh) {
  fsdp::CollectiveCounts total;
  for (const fsdp::CollectiveCounts* c : {&mesh.world().counts(), &mesh.shard_group().counts(), &mesh.replicate_group().counts()})
    for (std::size_t k = 0; k < fsdp::collective_kinds; ++k) {
      total.by_kind[k].calls += c->by_kind[k].calls;
      total.by_kind[k].bytes += c->by_kind[k].bytes;
    }
  return total;
}

// Runs between the gradients and the optimizer step (gradient clipping); may be empty.
using BeforeStep = std::function<void()>;

// One sharded training step over one batch or several micro-batches; returns the local loss.
template <class Optimizer>
double sharded_step(Model& model, fsdp::ShardedModel& sharded, Optimizer& opt, std::span<const Batch> micro,
                    const BeforeStep& before_step = {}) {
  const double loss = sharded_forward_backward(model, sharded, micro);
  if (before_step) before_step();
  const auto s = slots_for<Optimizer>(sharded);
  opt.step(s);
  return loss;
}
template <class Optimizer>
double sharded_step(Model& model, fsdp::ShardedModel& sharded, Optimizer& opt, const Batch& local,
                    const BeforeStep& before_step = {}) {
  return sharded_step(model, sharded, opt, std::span<const Batch>(&local, 1), before_step);
}

// One fp16 step with dynamic loss scaling (fsdp::ShardedGradScaler): backward from the
// scaled loss, then the optimizer steps on the unscaled gradients unless some rank found
// inf/NaN. Returns the local loss and whether the optimizer stepped (the same on every rank).
struct ScaledStep {
  double loss;
  bool stepped;
};

template <class Optimizer, class Scaler>
ScaledStep sharded_scaled_step(Model& model, fsdp::ShardedModel& sharded, Optimizer& opt, Scaler& scaler,
                               std::span<const Batch> micro, const BeforeStep& before_step = {}) {
  const double loss = sharded_forward_backward(model, sharded, micro, scaler.scale());
  const bool stepped = scaler.step(sharded.shards(), [&] {  // on unscaled, finite gradients
    if (before_step) before_step();
    const auto s = slots_for<Optimizer>(sharded);
    opt.step(s);
  });
  scaler.update();
  return {loss, stepped};
}
template <class Optimizer, class Scaler>
ScaledStep sharded_scaled_step(Model& model, fsdp::ShardedModel& sharded, Optimizer& opt, Scaler& scaler, const Batch& local,
                               const BeforeStep& before_step = {}) {
  return sharded_scaled_step(model, sharded, opt, scaler, std::span<const Batch>(&local, 1), before_step);
}

// The same step without fsdp, on the whole batch (or each whole micro-batch in turn, the
// gradients adding up). Returns the mean loss.
template <class Optimizer>
double unsharded_step(Model& model, Optimizer& opt, std::span<const Batch> micro, const BeforeStep& before_step = {}) {
  zero_grads(model);
  double sum = 0;
  for (const Batch& batch : micro) {
    Mat dout;
    sum += mse(model.forward(batch.x), batch.y, dout, model.config.loss);
    model.backward(dout);
  }
  if (before_step) before_step();
  const auto s = slots(model);
  opt.step(s);
  return sum / static_cast<double>(micro.size());
}
template <class Optimizer>
double unsharded_step(Model& model, Optimizer& opt, const Batch& batch, const BeforeStep& before_step = {}) {
  return unsharded_step(model, opt, std::span<const Batch>(&batch, 1), before_step);
}

// The same step under mixed precision, without fsdp: the reference for fsdp's
// MixedPrecision<Param, Reduce, Buffer>. `master` holds the f32 parameters and buffers the
// optimizer steps; `compute` is a Model of the same config built with param_dtype = Param
// and buffer_dtype = Buffer. The step
//  (a) copies the master parameters into `compute`, rounded to Param, and its buffers,
//      rounded to Buffer;
//  (b) zeroes the compute gradients and runs forward and backward on the whole batch (on
//      each micro-batch in turn), the gradients accumulating in Param sample by sample as
//      the layers do;
//  (c) sets each master gradient to the compute gradient rounded to `reduce`, then to f32;
//  (d) runs `before_step`, then steps `opt` on the master's slots.
// Returns the (mean) loss.
template <class Optimizer>
double unsharded_mixed_step(Model& master, Model& compute, Optimizer& opt, std::span<const Batch> micro, fsdp::DType reduce,
                            const BeforeStep& before_step = {}) {
  round_to(reduce, 0.0f);  // refuses a reduce dtype that is not floating, before any work
  auto mp = named_parameters(master), cp = named_parameters(compute);
  auto mb = named_buffers(master), cb = named_buffers(compute);
  auto mismatch = [](const std::string& what) {
    throw fsdp::Error("unsharded_mixed_step: master and compute models differ: " + what);
  };
  if (mp.size() != cp.size() || mb.size() != cb.size()) mismatch("parameter or buffer count");
  for (std::size_t k = 0; k < mp.size(); ++k) {
    if (mp[k].fqn != cp[k].fqn || mp[k].param->numel() != cp[k].param->numel()) mismatch("parameter '" + mp[k].fqn + "'");
    Tensor& from = *mp[k].param;
    Tensor& to = *cp[k].param;
    for (std::int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
  }
  for (std::size_t k = 0; k < mb.size(); ++k) {
    if (mb[k].fqn != cb[k].fqn || mb[k].buffer->numel() != cb[k].buffer->numel()) mismatch("buffer '" + mb[k].fqn + "'");
    Tensor& from = *mb[k].buffer;
    Tensor& to = *cb[k].buffer;
    for (std::int64_t i = 0; i < from.numel(); ++i) to.set(i, from.get(i));
  }
  zero_grads(compute);
  double sum = 0;
  for (const Batch& batch : micro) {
    Mat dout;
    sum += mse(compute.forward(batch.x), batch.y, dout, compute.config.loss);
    compute.backward(dout);
  }
  for (std::size_t k = 0; k < mp.size(); ++k) {
    const Tensor& from = *cp[k].grad;
    Tensor& to = *mp[k].grad;
    for (std::int64_t i = 0; i < from.numel(); ++i) to.set(i, round_to(reduce, from.get(i)));
  }
  if (before_step) before_step();
  const auto s = slots(master);
  opt.step(s);
  return sum / static_cast<double>(micro.size());
}
template <class Optimizer>
double unsharded_mixed_step(Model& master, Model& compute, Optimizer& opt, const Batch& batch, fsdp::DType reduce,
                            const BeforeStep& before_step = {}) {
  return unsharded_mixed_step(master, compute, opt, std::span<const Batch>(&batch, 1), reduce, before_step);
}

// The unsharded counterpart of fsdp::clip_grad_norm with the 2-norm: scales every gradient
// by max_norm / (norm + 1e-6) when that is below 1. Returns the norm before clipping.
inline double clip_grad_norm(Model& model, double max_norm) {
  double sum = 0;
  for (auto& p : named_parameters(model))
    for (std::int64_t i = 0; i < p.grad->numel(); ++i) sum += double(p.grad->get(i)) * p.grad->get(i);
  const double norm = std::sqrt(sum), coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1)
    for (auto& p : named_parameters(model))
      for (std::int64_t i = 0; i < p.grad->numel(); ++i) p.grad->set(i, static_cast<float>(p.grad->get(i) * coefficient));
  return norm;
}

// Full parameters by FQN, on every rank, read while every unit is summoned.
inline std::vector<std::pair<std::string, std::vector<float>>> gather_full_parameters(Model& model,
                                                                                      fsdp::ShardedModel& sharded) {
  auto summoned = sharded.summon_full_params();
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (auto& p : named_parameters(model)) {
    std::vector<float> v(static_cast<std::size_t>(p.param->numel()));
    for (std::int64_t i = 0; i < p.param->numel(); ++i) v[static_cast<std::size_t>(i)] = p.param->get(i);
    out.emplace_back(p.fqn, std::move(v));
  }
  return out;
}

}  // namespace engine
