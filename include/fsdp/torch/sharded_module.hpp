#pragma once
// fsdp::torch::shard: a libtorch model sharded in place, the one header a libtorch engine
// includes (docs/torch.md). What the engine writes beyond its model and its usual loop:
//
//   auto sharded = fsdp::torch::shard<fsdp::FullShard>(net, comm, device, fsdp::torch::wrap_type<BlockImpl>());
//   torch::optim::AdamW optimizer(sharded.parameters(), torch::optim::AdamWOptions(1e-3));
//   ... loss = loss_fn(sharded.forward(x), y); loss.backward(); optimizer.step(); ...
//
// and, inside the model's forward, fsdp::torch::call(block, x) where it calls a submodule
// that may be a unit (the same code runs unsharded: there call() is block->forward(x)).
// ShardedModule::forward runs the root unit's hooks around the model's forward and makes the
// model the thread's active one for call(); autograd runs the rest (fsdp/torch/unit_hooks.hpp).
// sharded.sharded() is the library's ShardedModel: run-time settings, no_sync, checkpoints,
// state dicts, summon_full_params.
#include <cstddef>
#include <map>
#include <memory>
#include <type_traits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fsdp/core/error.hpp"
#include "fsdp/model/shard.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/policy/wrap_policy.hpp"
#include "fsdp/torch/module_traits.hpp"
#include "fsdp/torch/optimizer.hpp"
#include "fsdp/torch/tensor_traits.hpp"
#include "fsdp/torch/unit_hooks.hpp"
#include "fsdp/unit/unit.hpp"

namespace fsdp::torch {

// Every module whose dynamic type is (or derives from) Impl becomes a unit: the torch form of
// wrap_types<Impl> (libtorch's children are all seen as torch::nn::Module&).
template <class Impl>
auto wrap_type(std::string name = "fsdp::torch::wrap_type") {
  static_assert(std::is_base_of_v<::torch::nn::Module, Impl>,
                "fsdp::torch::wrap_type<Impl>: Impl must be the module class (BlockImpl), not its TORCH_MODULE "
                "holder (Block): write wrap_type<BlockImpl>()");
  return fsdp::wrap_if(
      [](::torch::nn::Module& m, std::string_view, int, std::int64_t) { return dynamic_cast<Impl*>(&m) != nullptr; },
      std::move(name));
}

template <class M>
class ShardedModule {
 public:
  ShardedModule(std::shared_ptr<M> root, ShardedModel model, c10::Device device)
      : root_(std::move(root)), model_(std::make_unique<ShardedModel>(std::move(model))),
        hooks_(std::make_unique<detail::Hooks>(*model_)) {
    // Handles of every parameter by FQN (recursive: libtorch's names are the library's FQNs).
    std::map<std::string, at::Tensor, std::less<>> by_fqn;
    for (auto& item : root_->named_parameters(/*recurse=*/true)) by_fqn.emplace(item.key(), item.value());
    for (auto& u : *model_) {
      detail::UnitEntry e;
      e.unit = u.get();
      const auto config = u->config();
      if (config.policies.precision.mixed) e.compute_dtype = scalar_type_of(config.policies.precision.param);
      for (const ParamView& pv : u->parameters())
        if (auto it = by_fqn.find(pv.fqn); it != by_fqn.end()) {
          e.params.push_back(it->second);
          e.names.emplace_back(pv.fqn);
        }
      hooks_->units.push_back(std::move(e));
    }
    hooks_->drop_gradients();
    views_ = std::make_unique<ParameterViews>(*model_, by_fqn, device);
    hooks_->after_finish = [v = views_.get()] { v->attach_gradients(); };
  }

  // The model's forward, as the root unit: call it where the loop called the model.
  template <class... Args>
  auto forward(Args&&... args) {
    detail::ActiveScope active(hooks_.get());
    hooks_->begin_pass();
    auto plain = [this](auto&&... a) { return root_->forward(std::forward<decltype(a)>(a)...); };
    Unit* root = model_->find_unit_for(static_cast<::torch::nn::Module&>(*root_));
    auto out = root ? detail::run_unit(*hooks_, hooks_->index_of(*root), plain, std::forward<Args>(args)...)
                    : plain(std::forward<Args>(args)...);
    if (!hooks_->backward_expected) model_->reshard();  // an evaluation pass: nothing will come back
    return out;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // What a torch::optim optimizer steps: this rank's elements of each parameter
  // (fsdp/torch/optimizer.hpp, ParameterViews).
  std::vector<at::Tensor> parameters() const { return views_->tensors(); }
  // The same views by their parameter's FQN, for parameter groups (weight decay on weights
  // only, say).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const { return views_->named(); }

  // fsdp::OptimizerState for the library's checkpoints, over an optimizer built on
  // parameters(). Keep it as long as the optimizer.
  OptimizerState optimizer_state(::torch::optim::Optimizer& optimizer) const {
    return OptimizerState(*model_, *views_, optimizer);
  }

  // Zeroes the sharded gradients and drops what gradient accumulation kept (the library's
  // zero_grad). The optimizer's zero_grad() zeroes the same memory in place but keeps what
  // no_sync micro-batches kept on 2 or more ranks: prefer this one.
  void zero_grad() { model_->zero_grad(); }

  ShardedModel& sharded() { return *model_; }
  const ShardedModel& sharded() const { return *model_; }
  M& module() { return *root_; }
  const std::shared_ptr<M>& module_ptr() const { return root_; }

 private:
  std::shared_ptr<M> root_;
  std::unique_ptr<ShardedModel> model_;
  std::unique_ptr<detail::Hooks> hooks_;
  std::unique_ptr<ParameterViews> views_;
};

namespace detail {
template <class R>
auto shared_root(R& root) {
  if constexpr (requires { root.ptr(); }) return root.ptr();  // a ModuleHolder (TORCH_MODULE)
  else return root;                                          // a std::shared_ptr<Impl>
}
}  // namespace detail

// Shards `root` (a ModuleHolder or a std::shared_ptr to a torch::nn::Module) over `group`
// with fsdp::shard<Policies...> and the same options (wrap policies, ShardOptions,
// deferred_init, ...); `device` is the library's Device (fsdp::HostDevice for CPU tensors,
// fsdp::CudaDevice for CUDA ones), on which the model's parameters must be.
template <class... Policies, class R, class Group, class D, class... Options>
auto shard(R& root, Group& group, D& device, const Options&... options) {
  auto ptr = detail::shared_root(root);
  using M = typename decltype(ptr)::element_type;
  static_assert(std::is_base_of_v<::torch::nn::Module, M>,
                "fsdp::torch::shard takes a torch::nn::Module: a ModuleHolder (TORCH_MODULE) or a std::shared_ptr to one");
  if (!ptr) fsdp::detail::fail("fsdp::torch::shard: the model is null");
  c10::Device where(c10::DeviceType::CPU);
  for (const auto& p : ptr->parameters(/*recurse=*/true)) {
    where = p.device();
    break;
  }
  ShardedModel model = fsdp::shard<Policies...>(static_cast<::torch::nn::Module&>(*ptr), group, device, options...);
  return ShardedModule<M>(ptr, std::move(model), where);
}

}  // namespace fsdp::torch
