#pragma once
// How the reference engine plugs into fsdp: everything engine-specific that a user writes.
//  - tensor_traits<engine::Tensor>      (in tensor.hpp)
//  - visit_parameters / visit_children  (members of the layers and the model)
//  - UnitHooks: the engine's forward/backward hook points -> unit lifecycle calls
//  - slots(): the units' flat shards -> the engine optimizer's slots
//  - DeviceAllocator: optimizer state allocated (and counted) through the fsdp Device
#include <algorithm>
#include <deque>
#include <span>
#include <vector>

#include <fsdp/fsdp.hpp>

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

inline std::vector<Slot> slots(const fsdp::ShardedModel& m) {
  std::vector<Slot> out;
  for (const auto& v : m.shards()) {
    if (v.dtype != fsdp::DType::f32)
      throw fsdp::Error("reference engine optimizers step on f32 only; unit '" + std::string(v.unit) + "' has " +
                        std::string(fsdp::name_of(v.dtype)));
    out.push_back({static_cast<float*>(v.param), static_cast<const float*>(v.grad), v.numel});
  }
  return out;
}

inline std::vector<Slot> slots(Model& m) {  // unsharded: the model's own tensors
  std::vector<Slot> out;
  for (auto& p : named_parameters(m)) out.push_back({p.param->data(), p.grad->data(), p.param->numel()});
  return out;
}

template <fsdp::Device D>
struct DeviceAllocator final : Allocator {
  explicit DeviceAllocator(D& d) : device(d) {}
  void* allocate(std::size_t bytes) override { return device.allocate(bytes, fsdp::MemorySpace::device); }
  void deallocate(void* p, std::size_t bytes) override { device.deallocate(p, bytes, fsdp::MemorySpace::device); }
  D& device;
};

// The units of the reference model: one per block, one for the gain, the rest at the root.
using Wrap = fsdp::wrap_types<Block, Gain>;

// One sharded training step on this rank's part of the global batch; returns the local loss.
template <class Optimizer>
double sharded_step(Model& model, fsdp::ShardedModel& sharded, Optimizer& opt, const Batch& local) {
  sharded.zero_grad();
  UnitHooks hooks{sharded};
  Mat out = model.forward(local.x, hooks);
  Mat dout;
  const double loss = mse(out, local.y, dout);
  model.backward(dout, hooks);
  sharded.finish_backward();
  const auto s = slots(sharded);
  opt.step(s);
  return loss;
}

// The same step without fsdp, on the whole batch.
template <class Optimizer>
double unsharded_step(Model& model, Optimizer& opt, const Batch& batch) {
  for (auto& p : named_parameters(model)) std::fill_n(p.grad->data(), p.grad->numel(), 0.0f);
  Mat out = model.forward(batch.x);
  Mat dout;
  const double loss = mse(out, batch.y, dout);
  model.backward(dout);
  const auto s = slots(model);
  opt.step(s);
  return loss;
}

// Full parameters by FQN, on every rank, read while every unit is summoned.
inline std::vector<std::pair<std::string, std::vector<float>>> gather_full_parameters(Model& model,
                                                                                      fsdp::ShardedModel& sharded) {
  std::deque<fsdp::UnitBase::SummonScope> summoned;
  for (auto& u : sharded) summoned.emplace_back(*u, false);
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (auto& p : named_parameters(model))
    out.emplace_back(p.fqn, std::vector<float>(p.param->data(), p.param->data() + p.param->numel()));
  return out;
}

}  // namespace engine
