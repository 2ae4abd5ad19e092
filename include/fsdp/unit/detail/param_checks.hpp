#pragma once
// The checks a unit makes at setup on the parameters and buffers it collected
// (param_collection.hpp), each on its own rank before any collective: that the visitor
// handed over the module's own, lasting tensors (no temporaries), that dtypes, devices and
// gradients fit, and which parameters are ties of another. Apart from the collection, which
// every engine file that shards a model compiles, because only the unit's setup uses them.
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/unit/detail/param_collection.hpp"

namespace fsdp::detail {

// The library keeps the addresses of the engine's tensors and rebinds them at every gather,
// so they must be the engine's own, lasting objects. A visitor that builds temporary tensor
// objects for each call would have them rebound in vain while the engine computes with
// its real tensors. `again` is a second visit of the same subtree: the same names must come
// with the same tensors (ParamBinding::id: the same objects, or for a handle type handles
// to the same tensors: copies of the handles pass, new tensors such as detach() each visit
// do not; the first visit's copies are alive, so a new tensor cannot reuse an old one's
// address); and within one visit, one tensor may appear under two names only as a tie (with
// the same storage), never as two parameters. What TemporaryCheck found is refused first.
inline void check_visits_agree(const std::vector<CollectedParam>& first, const std::vector<CollectedBuffer>& first_buffers,
                               const std::vector<CollectedParam>& again, const std::vector<CollectedBuffer>& again_buffers,
                               std::string_view unit, int rank) {
  auto temporaries = [&](std::string_view what, const std::string& fqn, const std::string& detail) {
    fail("unit '", unit, "' on rank ", rank, ": the module's visitor handed over ", what, " '", fqn, "' ", detail,
         ": visit_parameters / visit_buffers must pass references to tensors the module owns (they are rebound at "
         "every gather and must outlive the visit), not temporaries; a tensor type that is a handle (torch::Tensor) "
         "declares tensor_traits<T>::identity and may pass copies of its handles, but not new tensors (detach(), "
         "clone()) at each visit (docs/concepts.md#tensor)");
  };
  if (again.size() != first.size() || again_buffers.size() != first_buffers.size())
    fail("unit '", unit, "' on rank ", rank, ": two visits of the module found ", first.size(), " then ", again.size(),
         " parameters and ", first_buffers.size(), " then ", again_buffers.size(), " buffers; the visitor must be "
         "deterministic");
  for (const auto& p : first)
    if (p.temporary)
      temporaries("parameter", p.info.fqn, "as another tensor object on a second visit made while the first one ran (a "
                  "temporary of the visit)");
  for (const auto& b : first_buffers)
    if (b.temporary)
      temporaries("buffer", b.fqn, "as another tensor object on a second visit made while the first one ran (a "
                  "temporary of the visit)");
  for (std::size_t i = 0; i < first.size(); ++i)
    if (again[i].info.fqn != first[i].info.fqn || again[i].binding.id != first[i].binding.id ||
        again[i].binding.grad_id != first[i].binding.grad_id)
      temporaries("parameter", first[i].info.fqn, "as another tensor object on a second visit (or in another order)");
  for (std::size_t i = 0; i < first_buffers.size(); ++i)
    if (again_buffers[i].fqn != first_buffers[i].fqn || again_buffers[i].id != first_buffers[i].id)
      temporaries("buffer", first_buffers[i].fqn, "as another tensor object on a second visit (or in another order)");
  std::unordered_map<const void*, const CollectedParam*> by_tensor;
  for (const auto& p : first) {
    auto [it, fresh] = by_tensor.emplace(p.binding.id, &p);
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
    if (!is_compute_dtype(p.dtype))
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn, "' has dtype ", name_of(p.dtype),
           "; only floating-point parameters (f32, f64, f16, bf16) can be sharded",
           is_floating(p.dtype) ? " (an 8-bit float holds values only with per-block scales)" : "");
    if (p.device != device)
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn, "' is on device ", describe(p.device),
           " but the unit's Device is ", describe(device));
    if (p.grad_dtype != p.dtype || p.grad_shape != p.info.shape)
      fail("unit '", unit, "' on rank ", rank, ": the gradient of parameter '", p.info.fqn,
           "' does not have the parameter's shape and dtype (parameter ", format_shape(p.info.shape), " ",
           name_of(p.dtype), ", gradient ", format_shape(p.grad_shape), " ", name_of(p.grad_dtype),
           "); gradients created lazily by the first backward are not supported: give the gradient tensor "
           "its parameter's shape and dtype when the model is built (it needs no storage), or visit the "
           "parameter as f(name, param) and let the library own its gradient (Unit::gradient, "
           "docs/fitting_your_engine.md)");
    if (p.lacks_storage() && !deferred_init)
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn,
           "' has no storage; is it already managed by another unit? (A model built from shapes and dtypes "
           "alone needs fsdp::deferred_init.)");
    if (p.binding.grad && p.binding.id == p.binding.grad_id)
      fail("unit '", unit, "' on rank ", rank, ": parameter '", p.info.fqn,
           "' was visited with the same tensor as parameter and gradient");
  }
}

// What identifies a parameter's tensor: its storage (engines may hand out several tensor
// objects, one per name, viewing one storage), or the tensor itself (its identity) when it
// has no storage (no elements).
inline const void* storage_key(const CollectedParam& p) { return p.data ? p.data : p.binding.id; }

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
