#pragma once
// What a unit finds when it walks its module: each parameter (FQN, shape, dtype, data, and
// how to rebind the engine's tensor and gradient) and each buffer, type-erased so that the
// rest of the unit does not depend on the engine's tensor type. Plus the local checks on
// them that need no other rank.
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
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

// One parameter as the unit holds it: where to rebind the engine's tensors.
struct ParamBinding {
  void* param = nullptr;
  void* grad = nullptr;
  RebindFn rebind = nullptr;
  DataFn data = nullptr;  // what the engine's param tensor views now
  KeepFn keep = nullptr;
};

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

  bool lacks_storage() const { return info.numel > 0 && data == nullptr; }
};

// What a unit leaves out of its subtree, known at run time: modules (with their subtrees)
// that are units of their own or ignored, and ignored parameters (by tensor address).
struct SkipSet {
  std::set<ModuleId> modules;
  std::unordered_set<const void*> parameters;
};

// f(module, fqn) for m and each module of its subtree that belongs to the same unit
// (minus children whose type is in Exclude, and the modules `skip` names), in pre-order.
template <class Exclude, class M, class F>
void for_each_unit_module(M& m, const std::string& prefix, const SkipSet& skip, F&& f) {
  f(m, prefix);
  for_each_child(m, [&](std::string_view name, auto& child) {
    using C = std::remove_cvref_t<decltype(child)>;
    if constexpr (!Exclude::template contains<C>)
      if (!skip.modules.count(ModuleId::of(child))) for_each_unit_module<Exclude>(child, join_fqn(prefix, name), skip, f);
  });
}

// Walks m's subtree (minus children whose type is in Exclude, and what `skip` names) for
// parameters and buffers. ChangesDtype: MixedPrecision will show them in another dtype,
// which needs the 3-argument tensor_traits::rebind.
template <class Exclude, bool ChangesDtype, class M>
void collect_parameters(M& root, const std::string& root_prefix, std::vector<CollectedParam>& out,
                        std::vector<CollectedBuffer>& buffers, const SkipSet& skip) {
  for_each_unit_module<Exclude>(root, root_prefix, skip, [&](auto& m, const std::string& prefix) {
    for_each_own_parameter(m, [&](std::string_view name, auto& param, auto& grad) {
      using T = std::remove_cvref_t<decltype(param)>;
      if (skip.parameters.count(static_cast<const void*>(&param))) return;
      using Tr = tensor_traits<T>;
      static_assert(!ChangesDtype || RebindableAs<T>,
                    "fsdp: MixedPrecision shows parameters in another dtype: tensor_traits<T> needs "
                    "static void rebind(T&, void* data, fsdp::DType)");
      CollectedParam c;
      c.info.fqn = join_fqn(prefix, name);
      for (auto d : Tr::shape(param)) c.info.shape.push_back(static_cast<std::int64_t>(d));
      c.info.numel = checked_numel(c.info.shape, c.info.fqn);  // negative or overflowing shapes name the parameter
      c.dtype = Tr::dtype(param);
      c.grad_dtype = Tr::dtype(grad);
      for (auto d : Tr::shape(grad)) c.grad_shape.push_back(static_cast<std::int64_t>(d));
      c.device = Tr::device(param);
      c.data = Tr::data(param);
      c.binding = {&param, &grad, rebind_fn<T>(), data_fn<T>(), keep_fn<T>()};
      c.read = read_fn<T>();
      out.push_back(std::move(c));
    });
    for_each_own_buffer(m, [&](std::string_view name, auto& buffer) {
      using T = std::remove_cvref_t<decltype(buffer)>;
      static_assert(!ChangesDtype || RebindableAs<T>,
                    "fsdp: MixedPrecision casts buffers: tensor_traits<T> needs static void rebind(T&, void*, fsdp::DType)");
      std::vector<std::int64_t> shape;
      for (auto d : tensor_traits<T>::shape(buffer)) shape.push_back(static_cast<std::int64_t>(d));
      std::string fqn = join_fqn(prefix, name);
      const std::int64_t n = checked_numel(shape, fqn);
      buffers.push_back({std::move(fqn), tensor_traits<T>::dtype(buffer), n,
                         tensor_traits<T>::data(buffer), &buffer, rebind_fn<T>(), std::move(shape), data_fn<T>(),
                         keep_fn<T>()});
    });
  });
}

// The library keeps the addresses of the engine's tensors and rebinds them at every gather,
// so they must be the engine's own, lasting objects. A visitor that builds temporary tensor
// objects for each call would have them rebound in vain while the engine computes with
// its real tensors. `again` is a second visit of the same subtree: the same names must come
// with the same tensor objects; and within one visit, one tensor object may appear under
// two names only as a tie (with the same storage), never as two parameters.
inline void check_visits_agree(const std::vector<CollectedParam>& first, const std::vector<CollectedBuffer>& first_buffers,
                               const std::vector<CollectedParam>& again, const std::vector<CollectedBuffer>& again_buffers,
                               std::string_view unit, int rank) {
  auto temporaries = [&](std::string_view what, const std::string& fqn, const std::string& detail) {
    fail("unit '", unit, "' on rank ", rank, ": the module's visitor handed over ", what, " '", fqn, "' ", detail,
         ": visit_parameters / visit_buffers must pass references to tensors the module owns (they are rebound at "
         "every gather and must outlive the visit), not temporaries");
  };
  if (again.size() != first.size() || again_buffers.size() != first_buffers.size())
    fail("unit '", unit, "' on rank ", rank, ": two visits of the module found ", first.size(), " then ", again.size(),
         " parameters and ", first_buffers.size(), " then ", again_buffers.size(), " buffers; the visitor must be "
         "deterministic");
  for (std::size_t i = 0; i < first.size(); ++i)
    if (again[i].info.fqn != first[i].info.fqn || again[i].binding.param != first[i].binding.param ||
        again[i].binding.grad != first[i].binding.grad)
      temporaries("parameter", first[i].info.fqn, "as another tensor object on a second visit (or in another order)");
  for (std::size_t i = 0; i < first_buffers.size(); ++i)
    if (again_buffers[i].fqn != first_buffers[i].fqn || again_buffers[i].tensor != first_buffers[i].tensor)
      temporaries("buffer", first_buffers[i].fqn, "as another tensor object on a second visit (or in another order)");
  std::unordered_map<const void*, const CollectedParam*> by_tensor;
  for (const auto& p : first) {
    auto [it, fresh] = by_tensor.emplace(p.binding.param, &p);
    if (!fresh && it->second->data != p.data)
      temporaries("parameter", p.info.fqn, "in the same tensor object as '" + it->second->info.fqn + "' but with other storage");
  }
}

inline std::string describe(DeviceId d) {
  return (d.kind == DeviceKind::cpu ? "cpu:" : "cuda:") + std::to_string(d.index);
}

// Checks one rank can make on its own before any collective: dtypes, devices, gradients
// that match their parameters, storage present (unless deferred init will bind it).
inline void validate_collected(const std::vector<CollectedParam>& params, std::string_view unit, int rank,
                               DeviceId device, bool deferred_init = false) {
  for (auto& p : params) {
    if (!is_floating(p.dtype))
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn, "' has dtype ", name_of(p.dtype),
           "; only floating-point parameters (f32, f64, f16, bf16) can be sharded");
    if (p.device != device)
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn, "' is on device ", describe(p.device),
           " but the unit's Device is ", describe(device));
    if (p.grad_dtype != p.dtype || p.grad_shape != p.info.shape)
      fail("unit '", unit, "' on rank ", rank, ": the gradient of parameter '", p.info.fqn,
           "' does not have the parameter's shape and dtype (parameter ", format_shape(p.info.shape), " ",
           name_of(p.dtype), ", gradient ", format_shape(p.grad_shape), " ", name_of(p.grad_dtype),
           "); gradients created lazily by the first backward are not supported: give the gradient tensor "
           "its parameter's shape and dtype when the model is built (it needs no storage)");
    if (p.lacks_storage() && !deferred_init)
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn,
           "' has no storage; is it already managed by another unit? (A model built from shapes and dtypes "
           "alone needs fsdp::deferred_init.)");
    if (p.binding.param == p.binding.grad)
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn,
           "' was visited with the same tensor as parameter and gradient");
  }
}

// What identifies a parameter's tensor: its storage (engines may hand out several tensor
// objects, one per name, viewing one storage), or the tensor object itself when it has no
// storage (no elements).
inline const void* storage_key(const CollectedParam& p) { return p.data ? p.data : p.binding.param; }

// A second name of a tied parameter: the engine's tensors under that name are shown
// whatever the canonical parameter (its first name in visit order) is shown.
struct TiedAlias {
  std::size_t canonical = 0;  // index into the parameters left after take_ties
  std::string fqn;
  ParamBinding binding;
};

// Removes every parameter whose tensor an earlier one already has (a tie) from `params`
// and returns it as an alias of that one. A tie must be the whole tensor under each name.
inline std::vector<TiedAlias> take_ties(std::vector<CollectedParam>& params, std::string_view unit, int rank) {
  std::unordered_map<const void*, std::size_t> first;
  std::vector<CollectedParam> kept;
  std::vector<TiedAlias> aliases;
  for (auto& p : params) {
    auto [it, fresh] = first.emplace(storage_key(p), kept.size());
    if (fresh) { kept.push_back(std::move(p)); continue; }
    const CollectedParam& c = kept[it->second];
    if (c.dtype != p.dtype || c.info.shape != p.info.shape)
      fail("unit '", unit, "' on rank ", rank, ": parameters '", c.info.fqn, "' (", format_shape(c.info.shape), " ",
           name_of(c.dtype), ") and '", p.info.fqn, "' (", format_shape(p.info.shape), " ", name_of(p.dtype),
           ") share storage but not shape and dtype; a tied parameter must be the same whole tensor under each name");
    aliases.push_back({it->second, std::move(p.info.fqn), p.binding});
  }
  params = std::move(kept);
  return aliases;
}

}  // namespace fsdp::detail
