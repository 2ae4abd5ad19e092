#pragma once
// What a unit finds when it walks its module: each parameter (FQN, shape, dtype, data, and
// how to rebind the engine's tensor and gradient, or that the library owns its gradient;
// the module's parameters_rebound hook) and each buffer, type-erased so that the rest of
// the unit does not depend on the engine's tensor or module types. The checks a unit makes
// on them at setup, on its own rank, are in param_checks.hpp.
//
// Handle tensor types (fsdp::TensorHandle: tensor_traits<T>::identity, as torch::Tensor's
// TensorImpl) are held through copies of their handles that the collection makes and the
// unit keeps (ParamBinding::handles, CollectedBuffer::handle): the void* of a binding is
// then the library's own copy, never the engine's object (the visitor may pass copies that
// die with the visit), and tensors are told apart by identity() (ParamBinding::id).
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/core/tensor.hpp"

namespace fsdp::detail {

// Points a tensor at `data`, shown in `dtype` (its own dtype unless MixedPrecision).
using RebindFn = void (*)(void* tensor, void* data, DType dtype);

template <class T>
RebindFn rebind_fn() {
  return [](void* t, void* data, DType d) {
    if constexpr (RebindableAs<T>) tensor_traits<T>::rebind(*static_cast<T*>(t), data, d);
    else tensor_traits<T>::rebind(*static_cast<T*>(t), data);  // only ever asked for its own dtype
  };
}

// The engine's storage of one tensor, kept alive across the take-over
// (tensor_traits<T>::keep); destroying it lets the storage go, restore() gives it back.
class KeptStorage {
 public:
  virtual ~KeptStorage() = default;
  virtual void restore() noexcept = 0;
};
using KeepFn = std::unique_ptr<KeptStorage> (*)(void* tensor);

// Null when T has no keep/restore (tensor_traits<T> says how to keep its storage).
template <class T>
KeepFn keep_fn() {
  if constexpr (KeepsStorage<T>) {
    using Kept = decltype(tensor_traits<T>::keep(std::declval<T&>()));
    static_assert(noexcept(tensor_traits<T>::restore(std::declval<T&>(), std::declval<Kept&&>())),
                  "fsdp: tensor_traits<T>::restore must be noexcept: it runs while a failed take-over is undone, "
                  "where a second exception would leave tensors half restored");
    struct Holder final : KeptStorage {
      explicit Holder(T& t) : tensor(&t), kept(tensor_traits<T>::keep(t)) {}
      void restore() noexcept override { tensor_traits<T>::restore(*tensor, std::move(kept)); }
      T* tensor;
      Kept kept;
    };
    return [](void* t) -> std::unique_ptr<KeptStorage> { return std::make_unique<Holder>(*static_cast<T*>(t)); };
  } else {
    static_assert(!requires(T& t) { tensor_traits<T>::keep(t); },
                  "fsdp: tensor_traits<T> has keep(T&) but no static void restore(T&, K&&) noexcept taking what "
                  "keep returns; without both, a take-over that fails cannot give tensors their storage back");
    return nullptr;
  }
}

// Reads a tensor's current storage.
using DataFn = void* (*)(void* tensor);

template <class T>
DataFn data_fn() {
  return [](void* t) -> void* { return tensor_traits<T>::data(*static_cast<T*>(t)); };
}

// A module's parameters_rebound hook (fsdp/core/module.hpp), type-erased: hook() calls it,
// through the model's module adapter where that has it (`adapter` null without one; the
// unit that holds the hook owns the adapter, ShardedUnit::adapter_).
// Null `call`: the module has none.
struct ReboundHook {
  void* module = nullptr;
  void* adapter = nullptr;
  void (*call)(void* module, void* adapter) = nullptr;
  void operator()() const { call(module, adapter); }
  friend bool operator==(const ReboundHook&, const ReboundHook&) = default;
};

template <class M, class A = NoModuleAdapter>
ReboundHook rebound_hook(M& m, A* adapter = nullptr) {
  if constexpr (has_parameters_rebound<M, A>)
    return {&m, adapter, [](void* p, void* a) { call_parameters_rebound(*static_cast<M*>(p), static_cast<A*>(a)); }};
  else return {};
}

// One parameter as the unit holds it: where to rebind the engine's tensors.
struct ParamBinding {
  void* param = nullptr;
  void* grad = nullptr;  // null: the library owns the gradient (visited as f(name, param))
  RebindFn rebind = nullptr;
  DataFn data = nullptr;  // what the engine's param tensor views now
  KeepFn keep = nullptr;
  ReboundHook rebound;    // the hook of the module that visited it
  // Which tensors they are (fsdp::tensor_identity): the addresses of param and grad, or
  // for a handle type what the handles point to. grad_id is null when grad is.
  const void* id = nullptr;
  const void* grad_id = nullptr;
  // Handle types only: the library's copies of the handles, which `param` and `grad` point
  // into (null otherwise: `param` and `grad` are the engine's objects).
  std::shared_ptr<void> handles;
  bool owns_grad() const { return grad != nullptr; }  // the engine's own gradient tensor
};

// The library's copies of one parameter's handles (a handle type's ParamBinding::handles).
template <class T>
struct HandleCopies {
  T param;
  std::optional<T> grad;
};

// Where to rebind `param` (and `grad`, null: owned by the library) and who they are: the
// engine's objects, or for a handle type fresh copies of the handles, owned by the binding.
template <class T>
void hold_tensors(ParamBinding& b, T& param, T* grad) {
  b.id = tensor_identity(param);
  b.grad_id = grad ? tensor_identity(*grad) : nullptr;
  if constexpr (TensorHandle<T>) {
    auto copies = std::make_shared<HandleCopies<T>>(HandleCopies<T>{param, std::nullopt});
    if (grad) copies->grad.emplace(*grad);
    b.param = &copies->param;
    b.grad = grad ? &*copies->grad : nullptr;
    b.handles = std::move(copies);
  } else {
    b.param = &param;
    b.grad = grad;
  }
}

// A buffer (non-trainable tensor) as the unit found it.
struct CollectedBuffer {
  std::string fqn;
  DType dtype;
  std::int64_t numel;
  void* data;
  void* tensor;
  RebindFn rebind;
  std::vector<std::int64_t> shape;
  DataFn data_of = nullptr;
  KeepFn keep = nullptr;
  const void* id = nullptr;      // fsdp::tensor_identity of the engine's tensor
  std::shared_ptr<void> handle;  // a handle type's copy, which `tensor` points to (else null)
  bool temporary = false;        // as CollectedParam::temporary
};

// Whether a module's visitor hands over tensor objects that die with the visit, for tensor
// types identified by address (not handles). Two visits one after the other cannot tell:
// the second visit's temporaries may reuse the first's addresses (same stack slots, or a
// freed list reallocated in place). So at the module's first such tensor, while the visit
// that passed it is still running (its temporaries alive), the module is visited again,
// nested: a lasting tensor comes back as the same object, a temporary as another one (two
// live objects have two addresses). Tensor j of the visit is compared with tensor j of the
// nested one. Handle types need none of this: the library's copies keep their tensors
// alive across the two visits that check_visits_agree compares.
class TemporaryCheck {
 public:
  // Off: no nested visit (a second collection, compared with the first by check_visits_agree).
  explicit TemporaryCheck(bool enabled) : enabled_(enabled) {}
  // Whether (tensor, grad), the next the visit passes (grad null for a buffer or a gradient
  // the library owns), is a temporary; `visit_again(record)` visits the module again,
  // nested, calling record(tensor, grad) for each.
  template <class T, class VisitAgain>
  bool temporary(const T& tensor, const T* grad, VisitAgain&& visit_again) {
    const std::size_t i = index_++;
    if constexpr (TensorHandle<T>) {
      return false;
    } else {
      if (!enabled_) return false;
      if (!visited_again_) {
        visited_again_ = true;
        visit_again([&](const void* t, const void* g) { again_.emplace_back(t, g); });
      }
      return i >= again_.size() || again_[i] != std::pair<const void*, const void*>(&tensor, grad);
    }
  }

 private:
  bool enabled_;
  std::size_t index_ = 0;
  bool visited_again_ = false;
  std::vector<std::pair<const void*, const void*>> again_;
};

// A tensor's shape, dtype and storage as they are now (read again after deferred init).
struct TensorState {
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
  void* data = nullptr;
};
using ReadFn = TensorState (*)(void* tensor);

template <class T>
ReadFn read_fn() {
  return [](void* p) {
    T& t = *static_cast<T*>(p);
    TensorState s{{}, tensor_traits<T>::dtype(t), tensor_traits<T>::data(t)};
    for (auto d : tensor_traits<T>::shape(t)) s.shape.push_back(static_cast<std::int64_t>(d));
    return s;
  };
}

struct CollectedParam {
  ParamInfo info;
  DType dtype, grad_dtype;
  std::vector<std::int64_t> grad_shape;
  DeviceId device;
  const void* data;
  ParamBinding binding;
  ReadFn read = nullptr;
  // A visit nested in the one that found it, made while its tensor objects were alive,
  // found another object in its place: a temporary (TemporaryCheck).
  bool temporary = false;

  bool lacks_storage() const { return info.numel > 0 && data == nullptr; }
};

// What a unit leaves out of its subtree, known at run time: modules (with their subtrees)
// that are units of their own or ignored, and ignored parameters (by fsdp::tensor_identity:
// the tensor's address, or what a handle points to).
struct SkipSet {
  std::set<ModuleId> modules;
  std::unordered_set<const void*> parameters;
};

// f(module, fqn) for m and each module of its subtree that belongs to the same unit
// (minus children whose type is in Exclude, and the modules `skip` names), in pre-order,
// walked through the model's module adapter (null: none).
template <class Exclude, class M, class F, class A = NoModuleAdapter>
void for_each_unit_module(M& m, const std::string& prefix, const SkipSet& skip, F&& f, A* adapter = nullptr) {
  f(m, prefix);
  for_each_child(m, [&](std::string_view name, auto& child) {
    using C = std::remove_cvref_t<decltype(child)>;
    if constexpr (!Exclude::template contains<C>)
      if (!skip.modules.count(ModuleId::of(child)))
        for_each_unit_module<Exclude>(child, join_fqn(prefix, name), skip, f, adapter);
  }, adapter);
}

// One module's own parameters and buffers (collect_parameters' step): a template of the
// module's type (and the walk's options), not of the root the walk started from, so that
// the walks from every root share one copy per module type. Cold: it runs at setup only
// (fsdp/model/shard.hpp).
template <bool ChangesDtype, class M, class A>
[[gnu::cold]] void collect_module(M& m, const std::string& prefix, std::vector<CollectedParam>& out,
                    std::vector<CollectedBuffer>& buffers, const SkipSet& skip, bool check_temporaries, A* adapter) {
  TemporaryCheck params_check(check_temporaries), buffers_check(check_temporaries);
  for_each_own_parameter(m, [&](std::string_view name, auto& param, auto* grad) {
    using T = std::remove_cvref_t<decltype(param)>;
    const bool temporary = params_check.temporary(param, static_cast<const T*>(grad), [&](auto&& record) {
      for_each_own_parameter(m, [&](std::string_view, auto& p, auto* g) { record(&p, g); }, adapter);
    });
    if (skip.parameters.count(tensor_identity(param))) return;
    using Tr = tensor_traits<T>;
    static_assert(!ChangesDtype || RebindableAs<T>,
                  "fsdp: MixedPrecision shows parameters in another dtype: tensor_traits<T> needs "
                  "static void rebind(T&, void* data, fsdp::DType)");
    CollectedParam c;
    c.info.fqn = join_fqn(prefix, name);
    for (auto d : Tr::shape(param)) c.info.shape.push_back(static_cast<std::int64_t>(d));
    c.info.numel = checked_numel(c.info.shape, c.info.fqn);  // negative or overflowing shapes name the parameter
    c.dtype = Tr::dtype(param);
    if (grad) {
      c.grad_dtype = Tr::dtype(*grad);
      for (auto d : Tr::shape(*grad)) c.grad_shape.push_back(static_cast<std::int64_t>(d));
    } else {  // the library owns it: the parameter's shape and dtype by construction
      c.grad_dtype = c.dtype;
      c.grad_shape = c.info.shape;
    }
    c.device = Tr::device(param);
    c.data = Tr::data(param);
    c.binding.rebind = rebind_fn<T>();
    c.binding.data = data_fn<T>();
    c.binding.keep = keep_fn<T>();
    c.binding.rebound = rebound_hook(m, adapter);
    hold_tensors(c.binding, param, grad);
    c.read = read_fn<T>();
    c.temporary = temporary;
    out.push_back(std::move(c));
  }, adapter);
  for_each_own_buffer(m, [&](std::string_view name, auto& buffer) {
    using T = std::remove_cvref_t<decltype(buffer)>;
    const bool temporary = buffers_check.temporary(buffer, static_cast<const T*>(nullptr), [&](auto&& record) {
      for_each_own_buffer(m, [&](std::string_view, auto& b) { record(&b, nullptr); }, adapter);
    });
    static_assert(!ChangesDtype || RebindableAs<T>,
                  "fsdp: MixedPrecision casts buffers: tensor_traits<T> needs static void rebind(T&, void*, fsdp::DType)");
    std::vector<std::int64_t> shape;
    for (auto d : tensor_traits<T>::shape(buffer)) shape.push_back(static_cast<std::int64_t>(d));
    std::string fqn = join_fqn(prefix, name);
    const std::int64_t n = checked_numel(shape, fqn);
    CollectedBuffer& b = buffers.emplace_back(CollectedBuffer{std::move(fqn), tensor_traits<T>::dtype(buffer), n,
                                                              tensor_traits<T>::data(buffer), &buffer, rebind_fn<T>(),
                                                              std::move(shape), data_fn<T>(), keep_fn<T>(),
                                                              tensor_identity(buffer), nullptr, temporary});
    if constexpr (TensorHandle<T>) {  // the library's copy of the handle, not the visitor's object
      auto copy = std::make_shared<T>(buffer);
      b.tensor = copy.get();
      b.handle = std::move(copy);
    }
  }, adapter);
}

// Walks m's subtree (minus children whose type is in Exclude, and what `skip` names) for
// parameters and buffers, through the model's module adapter (null: none). ChangesDtype:
// MixedPrecision will show them in another dtype, which needs the 3-argument
// tensor_traits::rebind.
template <class Exclude, bool ChangesDtype, class M, class A = NoModuleAdapter>
[[gnu::cold]] void collect_parameters(M& root, const std::string& root_prefix, std::vector<CollectedParam>& out,
                        std::vector<CollectedBuffer>& buffers, const SkipSet& skip, bool check_temporaries = true,
                        A* adapter = nullptr) {
  for_each_unit_module<Exclude>(root, root_prefix, skip, [&](auto& m, const std::string& prefix) {
    collect_module<ChangesDtype>(m, prefix, out, buffers, skip, check_temporaries, adapter);
  }, adapter);
}

}  // namespace fsdp::detail
