#pragma once
// torch::optim optimizers on the library's shards, and their state in the library's
// checkpoints.
//
// ParameterViews: one 1-D torch tensor per parameter that this rank holds elements of,
// viewing those elements in the unit's shard (ParamView::param; no copy), with .grad() a
// view of the matching elements of the sharded gradient. A torch::optim optimizer built
// over them (ShardedModule::parameters()) steps each rank's shard in place. AdamW, Adam and
// SGD are elementwise, so a parameter cut by a shard boundary steps as it would whole. The
// gradients are re-attached after every backward, so the optimizer's zero_grad() is safe:
// it zeroes the sharded gradient in place. A parameter whose requires_grad() is false (now:
// it is asked at every backward) gets no gradient, so the optimizer skips it, as it would
// unsharded. Unlike unsharded libtorch, a parameter that no forward used in a step has a
// zero gradient, not none, and steps with it (its unit reduced a gradient for it on every
// rank).
//
// OptimizerState: fsdp::OptimizerState (fsdp/checkpoint/optimizer_state.hpp) for AdamW,
// Adam and SGD. It keeps one array per state and shard (exp_avg for shards()[i], ...) and
// points the optimizer's per-parameter state tensors at slices of them, so the library
// saves, reshards and loads the optimizer's own state, with no copy at a step. The step
// count travels as the scalar "step"; the optimizer's kind as "torch.optimizer", checked
// on load. It is one count for the optimizer: taken from rank 0's trainable parameters,
// which must agree (a parameter unfrozen after others stepped has its own count, which a
// checkpoint cannot keep: the save says so).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fsdp/checkpoint/optimizer_state.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/torch/tensor_traits.hpp"

namespace fsdp::torch {

class ParameterViews {
 public:
  struct Entry {
    std::size_t param = 0;  // index into ShardedModel::parameters()
    at::Tensor tensor;      // this rank's elements of the parameter
    at::Tensor grad;        // the matching elements of the sharded gradient
    at::Tensor source;      // the model's parameter (whether it trains: requires_grad())
    bool trains() const { return !source.defined() || source.requires_grad(); }
  };

  // `sources`: the model's parameters by FQN; `device`: where device-space shards live.
  ParameterViews(ShardedModel& model, const std::map<std::string, at::Tensor, std::less<>>& sources,
                 c10::Device device)
      : model_(&model) {
    const auto views = model.parameters();
    for (std::size_t i = 0; i < views.size(); ++i) {
      const ParamView& pv = views[i];
      if (pv.count == 0) continue;
      const c10::Device where = pv.space == MemorySpace::host ? c10::Device(c10::DeviceType::CPU) : device;
      Entry e;
      e.param = i;
      e.tensor = ::torch::from_blob(pv.param, {pv.count},
                                    ::torch::TensorOptions().dtype(scalar_type_of(pv.dtype)).device(where));
      e.grad = ::torch::from_blob(pv.grad, {pv.count},
                                  ::torch::TensorOptions().dtype(scalar_type_of(pv.grad_dtype)).device(where));
      if (auto it = sources.find(pv.fqn); it != sources.end()) e.source = it->second;
      entries_.push_back(std::move(e));
    }
    attach_gradients();
  }

  const std::vector<Entry>& entries() const { return entries_; }
  std::vector<at::Tensor> tensors() const {
    std::vector<at::Tensor> out;
    for (const auto& e : entries_) out.push_back(e.tensor);
    return out;
  }

  // The views by their parameter's FQN (for parameter groups: no weight decay on biases).
  std::vector<std::pair<std::string, at::Tensor>> named() const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    const auto params = model_->parameters();
    for (const auto& e : entries_) out.emplace_back(std::string(params[e.param].fqn), e.tensor);
    return out;
  }

  // Each trainable view's .grad() is its view of the sharded gradient again (after a
  // zero_grad that reset it, or the optimizer's own detach). An fsdp::Error when the shards
  // moved since the views were made: a post-accumulate hook with GradientAfterHook::free
  // leaves no sharded gradient for a torch::optim optimizer to step on.
  void attach_gradients() {
    const auto params = model_->parameters();
    for (auto& e : entries_) {
      if (e.param >= params.size() || params[e.param].param != e.tensor.data_ptr() ||
          params[e.param].grad != e.grad.data_ptr())
        fsdp::detail::fail("fsdp::torch: the shards of parameter '",
                           e.param < params.size() ? params[e.param].fqn : std::string_view("?"),
                           "' moved after fsdp::torch::shard made the optimizer's views of them "
                           "(set_post_accumulate_param_hook with GradientAfterHook::free leaves no sharded "
                           "gradient for a torch::optim optimizer: step in the hook, or keep the gradient)");
      if (!e.trains()) continue;
      at::Tensor& g = e.tensor.mutable_grad();
      if (!g.defined() || g.unsafeGetTensorImpl() != e.grad.unsafeGetTensorImpl()) g = e.grad;
    }
  }

 private:
  ShardedModel* model_;
  std::vector<Entry> entries_;
};

// The optimizer's state as the library's checkpoints want it (see the top of this file).
class OptimizerState final : public fsdp::OptimizerState {
 public:
  OptimizerState(ShardedModel& model, const ParameterViews& views, ::torch::optim::Optimizer& optimizer)
      : model_(&model), views_(&views), optimizer_(&optimizer) {
    if (dynamic_cast<::torch::optim::AdamW*>(&optimizer)) {
      kind_ = Kind::adamw;
    } else if (dynamic_cast<::torch::optim::Adam*>(&optimizer)) {
      kind_ = Kind::adam;
    } else if (auto* sgd = dynamic_cast<::torch::optim::SGD*>(&optimizer)) {
      kind_ = Kind::sgd;
      for (auto& group : sgd->param_groups()) {
        const auto& o = static_cast<const ::torch::optim::SGDOptions&>(group.options());
        if (o.momentum() != 0 && o.dampening() != 0)
          fsdp::detail::fail("fsdp::torch::OptimizerState: SGD with momentum and dampening ", o.dampening(),
                             " is not supported (its first step takes the gradient undamped, which a momentum "
                             "buffer restored from a checkpoint cannot reproduce); use dampening 0");
        if (o.momentum() != 0) momentum_ = true;
      }
    } else {
      fsdp::detail::fail("fsdp::torch::OptimizerState: the optimizer is not a torch::optim::AdamW, Adam or SGD, "
                         "the optimizers whose state the adapter knows");
    }
    check_parameters();
    const auto shards = model.shards();
    for (const auto& s : shards)
      if (s.dtype != shards.front().dtype)
        fsdp::detail::fail("fsdp::torch::OptimizerState: shards of different dtypes (", name_of(s.dtype), ", ",
                           name_of(shards.front().dtype), "); the state arrays have one dtype");
    dtype_ = shards.empty() ? DType::f32 : shards.front().dtype;
    for (const auto& name : state_names()) {
      auto& arrays = arrays_[name];
      for (const auto& s : shards) {
        const c10::Device where = s.space == MemorySpace::host ? c10::Device(c10::DeviceType::CPU)
                                                                : views.entries().empty()
                                                                      ? c10::Device(c10::DeviceType::CPU)
                                                                      : views.entries().front().grad.device();
        arrays.push_back(::torch::zeros({s.numel}, ::torch::TensorOptions().dtype(scalar_type_of(dtype_)).device(where)));
      }
    }
    for (const auto& e : views.entries())
      if (e.trains()) point_state(e);
  }

  std::vector<std::string> state_names() const override {
    switch (kind_) {
      case Kind::adamw: case Kind::adam: {
        std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
        if (amsgrad()) names.emplace_back("max_exp_avg_sq");
        return names;
      }
      case Kind::sgd: return momentum_ ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
    }
    return {};
  }
  DType state_dtype(std::string_view) const override { return dtype_; }

  void* state(std::string_view name, std::size_t shard, std::int64_t numel) override {
    auto it = arrays_.find(name);
    if (it == arrays_.end() || shard >= it->second.size() || it->second[shard].numel() != numel)
      fsdp::detail::fail("fsdp::torch::OptimizerState: no state '", name, "' of ", numel, " elements for shard ", shard);
    for (const auto& e : views_->entries())  // state the optimizer replaced goes back into the arrays
      if (e.trains() && model_->parameters()[e.param].model_shard == shard) point_state(e);
    return it->second[shard].data_ptr();
  }

  std::map<std::string, std::string> scalars() const override {
    std::map<std::string, std::string> out{{"torch.optimizer", kind_name()}};
    if (kind_ == Kind::sgd) return out;
    std::optional<std::int64_t> step;
    std::string first;
    for (const auto& e : views_->entries()) {
      if (!e.trains()) continue;
      const std::int64_t s = adam_step(e);
      const auto fqn = model_->parameters()[e.param].fqn;
      if (step && *step != s)
        fsdp::detail::fail("fsdp::torch::OptimizerState: parameters '", first, "' and '", fqn,
                           "' have different step counts (", *step, " and ", s,
                           "); a checkpoint keeps one step count for the optimizer");
      if (!step) step = s, first = std::string(fqn);
    }
    if (!step && rank_of(*model_) == 0)  // only rank 0's scalars are saved
      fsdp::detail::fail("fsdp::torch::OptimizerState on rank 0: rank 0 holds no element of a trainable parameter, so "
                         "the checkpoint cannot take the optimizer's step count from it (shard the trainable "
                         "parameters over every rank: make frozen ones part of units with trainable ones)");
    out["step"] = std::to_string(step.value_or(0));
    return out;
  }

  // Before anything is loaded: the state is this kind of optimizer's, with a step count.
  void check_scalars(const std::map<std::string, std::string>& scalars) const override {
    auto kind = scalars.find("torch.optimizer");
    if (kind != scalars.end() && kind->second != kind_name())
      fsdp::detail::fail("fsdp::torch::OptimizerState: the checkpoint's optimizer state is ", kind->second,
                         "'s, not ", kind_name(), "'s");
    if (kind_ == Kind::sgd) return;
    auto it = scalars.find("step");
    if (it == scalars.end()) fsdp::detail::fail("fsdp::torch::OptimizerState: the checkpoint has no optimizer 'step'");
    fsdp::detail::parse_integer<std::int64_t>(it->second, "optimizer scalar 'step'", std::int64_t{0});
  }

  void load_scalars(const std::map<std::string, std::string>& scalars) override {
    check_scalars(scalars);
    if (kind_ == Kind::sgd) return;
    const std::int64_t step = fsdp::detail::parse_integer<std::int64_t>(scalars.at("step"), "optimizer scalar 'step'");
    for (const auto& e : views_->entries()) {
      if (!e.trains()) continue;
      point_state(e);
      auto& st = optimizer_->state().at(key(e));
      if (kind_ == Kind::adamw) static_cast<::torch::optim::AdamWParamState&>(*st).step(step);
      else static_cast<::torch::optim::AdamParamState&>(*st).step(step);
    }
  }

 private:
  enum class Kind { adamw, adam, sgd };

  const char* kind_name() const { return kind_ == Kind::adamw ? "AdamW" : kind_ == Kind::adam ? "Adam" : "SGD"; }

  bool amsgrad() const {
    for (const auto& group : optimizer_->param_groups()) {
      if (kind_ == Kind::adamw && static_cast<const ::torch::optim::AdamWOptions&>(group.options()).amsgrad()) return true;
      if (kind_ == Kind::adam && static_cast<const ::torch::optim::AdamOptions&>(group.options()).amsgrad()) return true;
    }
    return false;
  }

  static int rank_of(const ShardedModel& m) {
    return m.size() ? fsdp::detail::internals(const_cast<ShardedModel&>(m)[0]).rank() : 0;
  }

  // The key of a parameter's state in the optimizer's state(): the TensorImpl's address,
  // as a string in libtorch 1.x ("0x..." as c10::guts::to_string wrote it), as a void* from
  // 2.2 on (a template, so the branch not taken is never compiled).
  using StateKey = std::remove_cvref_t<decltype(std::declval<::torch::optim::Optimizer&>().state().begin()->first)>;
  template <class Key = StateKey>
  static Key key(const ParameterViews::Entry& e) {
    void* impl = e.tensor.unsafeGetTensorImpl();
    if constexpr (std::is_same_v<Key, std::string>) {
      std::ostringstream os;
      os << impl;
      return os.str();
    } else {
      return impl;
    }
  }

  // Every parameter the optimizer steps is one of the views: the state of any other would
  // not be in the checkpoint.
  void check_parameters() const {
    for (const auto& group : optimizer_->param_groups())
      for (const auto& p : group.params()) {
        bool mine = false;
        for (const auto& e : views_->entries()) mine = mine || e.tensor.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
        if (!mine)
          fsdp::detail::fail("fsdp::torch::OptimizerState: the optimizer steps a tensor of shape ",
                             detail::shape_text(p), " that is not one of ShardedModule::parameters(); its state "
                             "would not be in the checkpoint (build the optimizer over parameters() only)");
      }
  }

  // The slice of `name`'s arrays that parameter view e's state is.
  at::Tensor slice(std::string_view name, const ParameterViews::Entry& e) const {
    const ParamView& pv = model_->parameters()[e.param];
    return arrays_.find(name)->second[pv.model_shard].narrow(0, pv.shard_offset, pv.count);
  }

  // Points e's state tensors at their slices, copying what the optimizer holds there first
  // (state it made itself, or replaced).
  void point_state(const ParameterViews::Entry& e) {
    auto& states = optimizer_->state();
    const StateKey k = key(e);
    auto adopt = [&](const at::Tensor& current, std::string_view name) {
      at::Tensor s = slice(name, e);
      if (current.defined() && current.data_ptr() != s.data_ptr()) {
        ::torch::NoGradGuard no_grad;
        s.copy_(current);
      }
      return s;
    };
    auto it = states.find(k);
    switch (kind_) {
      case Kind::adamw: case Kind::adam: {
        auto fill = [&](auto* st) {
          st->exp_avg(adopt(st->exp_avg(), "exp_avg"));
          st->exp_avg_sq(adopt(st->exp_avg_sq(), "exp_avg_sq"));
          if (amsgrad()) st->max_exp_avg_sq(adopt(st->max_exp_avg_sq(), "max_exp_avg_sq"));
        };
        if (kind_ == Kind::adamw) {
          if (it == states.end()) it = states.emplace(k, std::make_unique<::torch::optim::AdamWParamState>()).first;
          fill(static_cast<::torch::optim::AdamWParamState*>(it->second.get()));
        } else {
          if (it == states.end()) it = states.emplace(k, std::make_unique<::torch::optim::AdamParamState>()).first;
          fill(static_cast<::torch::optim::AdamParamState*>(it->second.get()));
        }
        break;
      }
      case Kind::sgd:
        if (!momentum_) break;
        if (it == states.end()) it = states.emplace(k, std::make_unique<::torch::optim::SGDParamState>()).first;
        {
          auto* st = static_cast<::torch::optim::SGDParamState*>(it->second.get());
          st->momentum_buffer(adopt(st->momentum_buffer(), "momentum_buffer"));
        }
        break;
    }
  }

  std::int64_t adam_step(const ParameterViews::Entry& e) const {
    auto it = optimizer_->state().find(key(e));
    if (it == optimizer_->state().end()) return 0;
    if (kind_ == Kind::adamw) return static_cast<const ::torch::optim::AdamWParamState&>(*it->second).step();
    return static_cast<const ::torch::optim::AdamParamState&>(*it->second).step();
  }

  ShardedModel* model_;
  const ParameterViews* views_;
  ::torch::optim::Optimizer* optimizer_;
  Kind kind_ = Kind::adamw;
  bool momentum_ = false;
  DType dtype_ = DType::f32;
  std::map<std::string, std::vector<at::Tensor>, std::less<>> arrays_;
};

}  // namespace fsdp::torch
