#pragma once
// The units' hooks driven by libtorch's own forward and autograd, so that an engine calls
// its model's forward and loss.backward() as usual (docs/torch.md):
//
//   pre_forward / post_forward   around the module's forward, in fsdp::torch::call(module,
//                                args...) and ShardedModule::forward (libtorch's C++
//                                modules have no forward hooks, so a unit's forward is
//                                entered through a call that can run them);
//   pre_backward                 the first gradient to reach any of the unit's forward
//                                outputs (a hook on each output that requires grad);
//   post_backward                the gradients of the unit's inputs are computed: an
//                                identity autograd function on the inputs (PostBackward),
//                                applied at pre_forward, whose backward runs it;
//   ShardedModel::finish_backward  a callback queued on the autograd engine by each
//                                backward's first pre_backward: it runs when
//                                loss.backward() is done and completes units whose inputs
//                                needed no gradient.
// Each backward through the graph (retain_graph) starts the units' backward again: the
// output hooks count backwards, not forwards.
//
// Gradients. The library owns each parameter's gradient (fsdp/torch/module_traits.hpp). At
// the unit's pre_backward the adapter points param.grad() at the library's gradient (what
// Unit::gradient shows: zeros, or the sum gradient accumulation kept), so autograd's
// AccumulateGrad adds into it in place and no second unsharded gradient exists. At
// post_backward it resets param.grad() (a gradient autograd made itself, having found none,
// is added in first), so no unsharded gradient outlives its unit's backward.
//
// What autograd must guarantee: a unit's parameters have all their gradients when the
// gradients of its inputs are computed. That holds when the unit's parameters are used
// only inside its forward (libtorch runs AccumulateGrad nodes first among ready nodes). A
// parameter used outside it (read before the unit's call) would get its gradient after
// post_backward: finish() refuses that, naming the parameter, rather than lose it.
//
// Under MixedPrecision a unit's floating-point inputs are cast to its compute dtype before
// its forward (FSDP2's cast_forward_inputs), since its parameters are shown in that dtype.
//
// Which units run is per thread: ShardedModule::forward makes its model the thread's
// active one while the root's forward runs, and call() looks the module up in it. Outside
// it (the same model code, unsharded) call() is the module's plain forward.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/training_state.hpp"
#include "fsdp/model/sharded_model.hpp"
#include "fsdp/torch/module_traits.hpp"
#include "fsdp/torch/tensor_traits.hpp"
#include "fsdp/unit/unit.hpp"

namespace fsdp::torch::detail {

// One unit as the hooks see it: its parameters (handles, to read what autograd computed)
// and the dtype its forward inputs are cast to.
struct UnitEntry {
  Unit* unit = nullptr;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;  // params[i]'s FQN
  std::optional<c10::ScalarType> compute_dtype;  // MixedPrecision's Param
};

// A model's hooks: what the autograd callbacks reach through a stable pointer.
class Hooks {
 public:
  explicit Hooks(ShardedModel& model) : model_(&model) {}

  std::vector<UnitEntry> units;
  // Runs after every finish (the optimizer views re-attach their gradients).
  std::function<void()> after_finish;

  ShardedModel& model() const { return *model_; }

  std::size_t index_of(const Unit& u) const {
    for (std::size_t i = 0; i < units.size(); ++i)
      if (units[i].unit == &u) return i;
    fsdp::detail::fail("fsdp::torch: unit '", fsdp::detail::display_name(u.fqn()), "' is not a unit of this model");
  }

  // The first gradient reached one of the unit's outputs in this backward.
  void pre_backward(std::size_t i) {
    if (!finish_queued_) {
      finish_queued_ = true;
      ::torch::autograd::Engine::get_default_engine().queue_callback([this] { finish(); });
    }
    UnitEntry& e = units[i];
    // An earlier entry of the unit is still in its backward (its inputs needed no gradient,
    // so no post_backward came): this entry's gradients go where that one's go.
    if (e.unit->state() == TrainingState::BACKWARD_PRE) return;
    e.unit->pre_backward();
    for (auto& p : e.params) {
      if (!p.requires_grad()) continue;
      const GradientView v = e.unit->gradient(p);
      at::Tensor& g = p.mutable_grad();
      if (v.numel == 0) {
        g.reset();
        continue;
      }
      g = ::torch::from_blob(v.data, p.sizes(), p.options().dtype(scalar_type_of(v.dtype)).requires_grad(false));
    }
  }

  // Which backward through the graph this is (an output hook starts a unit's backward once per backward).
  std::uint64_t generation() const { return generation_; }

  // The unit's inputs have their gradients: autograd is done with its parameters.
  void post_backward(std::size_t i) {
    UnitEntry& e = units[i];
    if (e.unit->state() != TrainingState::BACKWARD_PRE)
      fsdp::detail::fail("unit '", fsdp::detail::display_name(e.unit->fqn()), "' on rank ", rank(),
                         ": autograd reached the unit's inputs in state ", name_of(e.unit->state()),
                         ", before any gradient reached its outputs; its forward must return the tensors that "
                         "the rest of the model uses (a tensor, a std::tuple or a std::vector of tensors)");
    fold_gradients(e);
    e.unit->post_backward();
  }

  // The end of loss.backward(): units whose inputs needed no gradient (the root, with token
  // ids) never saw their post_backward; ShardedModel::finish_backward completes them.
  void finish() {
    finish_queued_ = false;
    ++generation_;
    for (auto& e : units)
      if (e.unit->state() == TrainingState::BACKWARD_PRE) fold_gradients(e);
    model_->finish_backward();
    for (auto& e : units)
      for (std::size_t k = 0; k < e.params.size(); ++k)
        if (e.params[k].grad().defined()) {
          e.params[k].mutable_grad().reset();
          fsdp::detail::fail("fsdp::torch: parameter '", e.names[k], "' of unit '",
                             fsdp::detail::display_name(e.unit->fqn()), "' on rank ", rank(),
                             " got a gradient after its unit's backward ended: it is used outside the unit's "
                             "forward (read before fsdp::torch::call entered the unit?); its gradient would be lost");
        }
    if (after_finish) after_finish();
  }

  // The root's forward starts a pass. A backward that an exception ended never ran the
  // queued finish: the next pass queues its own.
  void begin_pass() {
    finish_queued_ = false;
    backward_expected = false;
  }

  // Parameters come without an unsharded gradient of their own (a .grad() left by an
  // earlier unsharded backward would otherwise be added into the first step).
  void drop_gradients() {
    for (auto& e : units)
      for (auto& p : e.params) p.mutable_grad().reset();
  }

  // A forward pass that no backward will follow (no gradient mode, or no output that
  // requires one) ends here, as an evaluation pass ends with reshard().
  bool backward_expected = false;

 private:
  int rank() const { return model_->size() ? fsdp::detail::internals((*model_)[0]).rank() : 0; }

  // Unbinds each parameter's gradient; one that autograd made itself (it found none) is
  // added into the library's first.
  void fold_gradients(UnitEntry& e) {
    for (auto& p : e.params) {
      at::Tensor& g = p.mutable_grad();
      if (!g.defined()) continue;
      const GradientView v = e.unit->gradient(p);
      if (v.numel > 0 && g.data_ptr() != v.data) {
        at::Tensor into = ::torch::from_blob(v.data, g.sizes(), g.options().dtype(scalar_type_of(v.dtype)));
        ::torch::NoGradGuard no_grad;
        into.add_(g);
      }
      g.reset();
    }
  }

  ShardedModel* model_;
  bool finish_queued_ = false;
  std::uint64_t generation_ = 0;
};

// The thread's active model (ShardedModule::forward sets it).
inline thread_local Hooks* active = nullptr;

class ActiveScope {
 public:
  explicit ActiveScope(Hooks* h) : previous_(std::exchange(active, h)) {}
  ~ActiveScope() { active = previous_; }
  ActiveScope(const ActiveScope&) = delete;
  ActiveScope& operator=(const ActiveScope&) = delete;

 private:
  Hooks* previous_;
};

// Identity on the unit's inputs; its backward is the unit's post_backward.
struct PostBackward : public ::torch::autograd::Function<PostBackward> {
  static ::torch::autograd::variable_list forward(::torch::autograd::AutogradContext* ctx, std::int64_t hooks,
                                                  std::int64_t unit, at::TensorList inputs) {
    ctx->saved_data["hooks"] = hooks;
    ctx->saved_data["unit"] = unit;
    return {inputs.begin(), inputs.end()};
  }
  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    auto* hooks = reinterpret_cast<Hooks*>(static_cast<std::intptr_t>(ctx->saved_data["hooks"].toInt()));
    hooks->post_backward(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
    ::torch::autograd::variable_list out{at::Tensor(), at::Tensor()};  // for hooks and unit
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::remove_cvref_t<T>, at::Tensor>;

// An argument as the unit's forward gets it: tensors by value (cast, then passed through
// PostBackward), anything else as it came.
template <class A>
using prepared_t = std::conditional_t<is_tensor_v<A>, at::Tensor, A&&>;

template <class Out, class F>
void for_each_output(Out& out, const F& f) {
  using O = std::remove_cvref_t<Out>;
  if constexpr (is_tensor_v<O>) {
    f(out);
  } else if constexpr (std::is_same_v<O, std::vector<at::Tensor>>) {
    for (auto& t : out) f(t);
  } else if constexpr (requires { std::tuple_size<O>::value; }) {
    std::apply([&](auto&... parts) { (for_each_output(parts, f), ...); }, out);
  } else {
    static_assert(std::is_arithmetic_v<O> || std::is_enum_v<O>,
                  "fsdp::torch: a unit's forward must return an at::Tensor, a std::vector<at::Tensor>, or a "
                  "std::tuple / std::pair of those (its outputs get the hooks that start the unit's backward)");
  }
}

// Runs `forward` (the module's forward on `args`) as a forward entry of unit i.
template <class Forward, class... Args>
auto run_unit(Hooks& hooks, std::size_t i, const Forward& forward, Args&&... args) {
  UnitEntry& e = hooks.units[i];
  const bool training = at::GradMode::is_enabled();
  std::tuple<prepared_t<Args>...> prepared{std::forward<Args>(args)...};

  // Cast, then route the inputs that need a gradient through PostBackward.
  std::vector<at::Tensor> need;
  std::apply(
      [&](auto&... a) {
        auto visit = [&](auto& x) {
          if constexpr (is_tensor_v<decltype(x)>) {
            if (e.compute_dtype && x.defined() && x.is_floating_point() && x.scalar_type() != *e.compute_dtype)
              x = x.to(*e.compute_dtype);
            if (training && x.defined() && x.requires_grad()) need.push_back(x);
          }
        };
        (visit(a), ...);
      },
      prepared);
  auto out = [&] {
    auto scope = e.unit->forward_scope();  // post_forward when this returns
    if (!need.empty()) {
    auto routed = PostBackward::apply(static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&hooks)),
                                      static_cast<std::int64_t>(i), at::TensorList(need));
    std::size_t k = 0;
    std::apply(
        [&](auto&... a) {
          auto visit = [&](auto& x) {
            if constexpr (is_tensor_v<decltype(x)>)
              if (training && x.defined() && x.requires_grad()) x = routed[k++];
          };
          (visit(a), ...);
        },
        prepared);
    }
    return std::apply([&](auto&&... a) { return forward(std::forward<decltype(a)>(a)...); }, std::move(prepared));
  }();

  if (training) {
    auto fired = std::make_shared<std::uint64_t>(~std::uint64_t{0});  // the backward that last fired
    Hooks* h = &hooks;
    for_each_output(out, [&](auto& t) {
      if constexpr (is_tensor_v<decltype(t)>) {
        if (!t.defined() || !t.requires_grad()) return;
        hooks.backward_expected = true;
        t.register_hook([h, i, fired](const at::Tensor&) {
          if (*fired == h->generation()) return;
          *fired = h->generation();
          h->pre_backward(i);
        });
      }
    });
  }
  return out;
}

// The module behind a holder, a shared_ptr or a reference.
template <class H>
decltype(auto) impl_of(H& m) {
  if constexpr (requires { m.ptr(); }) return *m.ptr();  // torch::nn::ModuleHolder
  else if constexpr (requires { *m; m.get(); }) return *m;  // std::shared_ptr<Impl>
  else return (m);
}

// A module whose first parameter holds no memory is sharded (one parameter suffices: a unit
// frees all of its parameters together).
template <class I>
void check_not_sharded(I& impl) {
  for (const auto& p : impl.parameters(/*recurse=*/true)) {
    if (p.numel() > 0 && !p.is_meta() && p.has_storage() && p.storage().data() == nullptr)
      fsdp::detail::fail("fsdp::torch: a sharded module's forward was called outside ShardedModule::forward (its "
                         "parameters hold no memory between the unit's hooks); call the model through the "
                         "ShardedModule that fsdp::torch::shard returned");
    return;
  }
}

}  // namespace fsdp::torch::detail

namespace fsdp::torch {

// The forward of `module` (a ModuleHolder such as Linear, a std::shared_ptr<Impl> or an
// Impl&), with its unit's hooks when the thread's active model (ShardedModule::forward)
// made it a unit; its plain forward otherwise. Write it where the model calls a submodule
// that may be a unit: x = fsdp::torch::call(blocks[i], x).
template <class H, class... Args>
decltype(auto) call(H& module, Args&&... args) {
  auto& impl = detail::impl_of(module);
  if (detail::Hooks* h = detail::active) {
    if (Unit* u = h->model().find_unit_for(static_cast<::torch::nn::Module&>(impl)))
      return detail::run_unit(
          *h, h->index_of(*u), [&impl](auto&&... a) { return impl.forward(std::forward<decltype(a)>(a)...); },
          std::forward<Args>(args)...);
  } else {
    detail::check_not_sharded(impl);
  }
  return impl.forward(std::forward<Args>(args)...);
}

}  // namespace fsdp::torch
