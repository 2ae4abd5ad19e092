#pragma once
// fsdp::clip_grad_norm: gradient-norm clipping over a sharded model, the role of PyTorch
// FSDP's clip_grad_norm_. Call it after ShardedModel::finish_backward() and before the
// optimizer step:
//
//   model.finish_backward();
//   const auto clip = fsdp::clip_grad_norm(sharded, world, {.max_norm = 1.0});
//   optimizer.step(...);
//
// The norm is the one of the whole model's gradient, as the unsharded model would have
// it: each rank sums its own shards' elements (|g|^p, or max |g| for the inf-norm) and one
// collective over the world combines them, so the result is identical on every rank. Each
// element counts exactly once: padding is never in a ParamView, and where replicas hold the
// same reduced gradient (NoShard; the replicate dimension of the hybrid strategies) only
// the copy Unit::saves_shards() names is counted.
//
// When the total norm exceeds max_norm, every gradient shard on every rank (replicas too)
// is multiplied by max_norm / (total_norm + 1e-6), PyTorch's coefficient, applied only when
// it is below 1. A non-finite total (inf/NaN in a gradient on any rank) never scales: with
// error_if_nonfinite it is an fsdp::Error on every rank, without it the non-finite norm is
// returned and the gradients are left as they are.
//
// Gradients are read to the host through Unit::copy_bytes in fixed-size chunks (a GPU
// path would reduce on the device with a kernel and copy back one number per shard; CUDA
// cannot run here). Built with a Device (one with unscale(), fsdp::UnscalingDevice) the
// multiply runs there, wherever the shards live; without one it is a host read-multiply-
// write through copy_bytes, which works for any space too, only slower on a GPU.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/model/sharded_model.hpp"

namespace fsdp {

struct ClipOptions {
  double max_norm = 0.0;   // must be positive and finite
  double norm_type = 2.0;  // any p >= 1, or std::numeric_limits<double>::infinity()
  bool error_if_nonfinite = true;
};

struct ClipResult {
  double total_norm = 0.0;   // before clipping; the same on every rank
  double coefficient = 1.0;  // what the gradients were multiplied by (1 when not clipped)
  bool clipped = false;
};

namespace detail {

// One rank's contribution, all-gathered as doubles: its partial norm, what it counted and
// how it went, and the options it was given (so ranks that disagree are caught).
struct ClipRecord {
  double partial = 0;  // sum of |g|^p, or max |g|
  double counted = 0;  // gradient elements this rank counted
  double status = 0;   // one of the codes below
  double max_norm = 0, norm_type = 0, error_if_nonfinite = 0;
  static constexpr double ok = 0, nonfinite = 1, invalid = 2;
};
static_assert(sizeof(ClipRecord) == 6 * sizeof(double));

inline std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

inline std::string norm_name(double p) { return (std::isinf(p) ? std::string("inf") : number_text(p)) + "-norm"; }

inline std::string check_clip_options(const ClipOptions& o) {
  if (!(std::isfinite(o.max_norm) && o.max_norm > 0))
    return "max_norm must be a positive finite number, got " + number_text(o.max_norm);
  if (!((std::isfinite(o.norm_type) && o.norm_type >= 1) || o.norm_type == std::numeric_limits<double>::infinity()))
    return "norm_type must be a number p >= 1 (2 for the Euclidean norm) or infinity for the max-norm, got " +
           number_text(o.norm_type);
  return {};
}

// Sums |g|^p (or takes max |g|) over n host elements of dtype t into `acc`; false when an
// element is inf/NaN (its index in *bad).
inline bool accumulate_norm(const void* p, std::size_t n, DType t, double norm_type, double& acc, std::size_t* bad) {
  const bool inf_norm = std::isinf(norm_type);
  auto visit = [&](auto load) {
    for (std::size_t i = 0; i < n; ++i) {
      const double a = std::fabs(load(i));
      if (!std::isfinite(a)) { *bad = i; return false; }
      if (inf_norm) acc = std::max(acc, a);
      else acc += norm_type == 2.0 ? a * a : norm_type == 1.0 ? a : std::pow(a, norm_type);
    }
    return true;
  };
  switch (t) {
    case DType::f32: return visit([p](std::size_t i) { return double(static_cast<const float*>(p)[i]); });
    case DType::f64: return visit([p](std::size_t i) { return static_cast<const double*>(p)[i]; });
    default: return visit([p, t](std::size_t i) { return double(half_load(static_cast<const std::uint16_t*>(p)[i], t)); });
  }
}

// Host staging for gradients that may live in device memory: bounded, reused chunk by chunk.
constexpr std::size_t clip_chunk_bytes = std::size_t{1} << 18;

// This rank's record; `why` gets the message of an invalid input or a non-finite gradient.
inline ClipRecord local_clip_record(ShardedModel& model, int world_rank, int world_size, const ClipOptions& o,
                                     std::string& why) {
  ClipRecord rec{0, 0, ClipRecord::ok, o.max_norm, o.norm_type, o.error_if_nonfinite ? 1.0 : 0.0};
  // Messages are built only when something is wrong.
  auto prefix = [&] { return "clip_grad_norm on rank " + std::to_string(world_rank) + ": "; };
  auto invalid = [&](std::string msg) { rec.status = ClipRecord::invalid, why = prefix() + msg; return rec; };
  if (auto bad = check_clip_options(o); !bad.empty()) return invalid(bad);
  for (auto& u : model) {
    const int unit_world = fsdp::detail::internals(*u).world_size();
    if (fsdp::detail::internals(*u).rank() != world_rank || unit_world != world_size)
      return invalid("unit '" + std::string(fsdp::detail::display_name(u->fqn())) + "' is on rank " + std::to_string(fsdp::detail::internals(*u).rank()) + " of a world of " +
                     std::to_string(unit_world) + " ranks, but the communicator passed has rank " +
                     std::to_string(world_rank) + " of " + std::to_string(world_size) +
                     "; pass the world communicator the model was sharded over (or its DeviceMesh)");
    if (u->state() != TrainingState::IDLE)
      return invalid("unit '" + std::string(fsdp::detail::display_name(u->fqn())) + "' is in state " + std::string(name_of(u->state())) +
                     "; clip gradients after ShardedModel::finish_backward() and before the optimizer step");
    if (fsdp::detail::after_hook_of(*u) == GradientAfterHook::free)
      return invalid("unit '" + std::string(fsdp::detail::display_name(u->fqn())) + "' frees its sharded gradient after its "
                     "post-accumulate-grad hook (the optimizer steps inside backward), so no gradient is left to "
                     "clip; the global norm needs every gradient before any step: clip outside backward, or not at all");
    for (const ParamView& p : u->parameters()) {
      if (p.count == 0) continue;
      if (!is_compute_dtype(p.grad_dtype))
        return invalid("parameter '" + std::string(p.fqn) + "' has a " + std::string(name_of(p.grad_dtype)) +
                       " gradient; only f32, f64, f16 and bf16 gradients can be clipped");
      if (!p.grad) return invalid("parameter '" + std::string(p.fqn) + "' has no gradient buffer (grad is null)");
    }
  }
  std::vector<std::byte> host(clip_chunk_bytes);
  for (auto& u : model) {
    if (!fsdp::detail::internals(*u).saves_shards()) continue;  // a replica: another rank counts these elements
    for (const ParamView& p : u->parameters()) {
      const std::size_t elem = size_of(p.grad_dtype), per_chunk = clip_chunk_bytes / elem;
      for (std::size_t done = 0; done < static_cast<std::size_t>(p.count);) {
        const std::size_t n = std::min(per_chunk, static_cast<std::size_t>(p.count) - done);
        fsdp::detail::internals(*u).copy_bytes(host.data(), static_cast<const std::byte*>(p.grad) + done * elem, n * elem);
        std::size_t bad = 0;
        if (!accumulate_norm(host.data(), n, p.grad_dtype, o.norm_type, rec.partial, &bad)) {
          rec.status = ClipRecord::nonfinite;
          const double v = load_as_double(host.data(), bad, p.grad_dtype);
          why = prefix() + "parameter '" + std::string(p.fqn) + "' (unit '" + std::string(fsdp::detail::display_name(u->fqn())) + "') has a non-finite gradient (" +
                number_text(v) + " at element " + std::to_string(p.param_begin + std::int64_t(done + bad)) + ")";
          rec.partial = std::fabs(v);  // inf or NaN: what the total becomes
          return rec;
        }
        done += n;
      }
      rec.counted += static_cast<double>(p.count);
    }
  }
  return rec;
}

// Host read-multiply-write of every gradient shard of this rank, through copy_bytes.
inline void scale_grads_on_host(ShardedModel& model, double factor) {
  std::vector<std::byte> host(clip_chunk_bytes);
  for (auto& u : model)
    for (const ShardView& s : u->shards()) {
      const std::size_t elem = size_of(s.grad_dtype), per_chunk = clip_chunk_bytes / elem;
      for (std::size_t done = 0; done < static_cast<std::size_t>(s.numel);) {
        const std::size_t n = std::min(per_chunk, static_cast<std::size_t>(s.numel) - done);
        std::byte* at = static_cast<std::byte*>(s.grad) + done * elem;
        fsdp::detail::internals(*u).copy_bytes(host.data(), at, n * elem);
        host_unscale(host.data(), n, s.grad_dtype, factor);  // the product in double, rounded once
        fsdp::detail::internals(*u).copy_bytes(at, host.data(), n * elem);
        done += n;
      }
    }
}

// Combines every rank's record; the same decisions on every rank. Scales through `scale`.
template <class Comm, class Scale>
ClipResult clip_grad_norm_impl(ShardedModel& model, Comm& world, const ClipOptions& o, Scale&& scale) {
  const int rank = world.rank(), size = world.size();
  std::string why;
  const ClipRecord mine = local_clip_record(model, rank, size, o, why);
  std::vector<ClipRecord> all(static_cast<std::size_t>(size));
  // One small collective: an all_gather rather than an all_reduce, so that every rank also
  // sees who failed, whether the options agree, and sums the partials in the same order.
  world.all_gather(&mine, all.data(), sizeof(ClipRecord) / sizeof(double), DType::f64).wait();
  auto fail = [rank](auto&&... parts) { detail::fail("clip_grad_norm on rank ", rank, ": ", parts...); };
  if (mine.status == ClipRecord::invalid) detail::fail(why, "; no gradient was changed");
  for (int r = 0; r < size; ++r)
    if (all[r].status == ClipRecord::invalid) {
      fail("rank ", r, " was given inputs it cannot clip (see that rank's error); no gradient was changed");
    }
  for (int r = 1; r < size; ++r)
    if (all[r].max_norm != all[0].max_norm || all[r].norm_type != all[0].norm_type ||
        all[r].error_if_nonfinite != all[0].error_if_nonfinite)
      fail_as(ErrorKind::mismatch, "ranks were given different options: rank 0 max_norm ", all[0].max_norm,
              ", norm_type ", all[0].norm_type, ", error_if_nonfinite ",
              all[0].error_if_nonfinite != 0 ? "true" : "false", "; rank ", r, " max_norm ", all[r].max_norm,
              ", norm_type ", all[r].norm_type, ", error_if_nonfinite ",
              all[r].error_if_nonfinite != 0 ? "true" : "false",
              "; every rank must pass the same ClipOptions. No gradient was changed");

  const bool inf_norm = std::isinf(o.norm_type);
  double total = 0, counted = 0;
  int first_bad = -1;
  for (int r = 0; r < size; ++r) {
    total = inf_norm ? std::max(total, all[r].partial) : total + all[r].partial;
    counted += all[r].counted;
    if (all[r].status == ClipRecord::nonfinite && first_bad < 0) first_bad = r;
  }
  if (first_bad >= 0) {  // NaN if any rank found a NaN, else inf
    total = std::numeric_limits<double>::infinity();
    for (const ClipRecord& r : all) if (std::isnan(r.partial)) total = r.partial;
  } else if (!inf_norm) total = o.norm_type == 2.0 ? std::sqrt(total) : std::pow(total, 1.0 / o.norm_type);

  double expected = 0;  // every parameter is listed on every rank, with its whole numel
  for (const ParamView& p : model.parameters()) expected += static_cast<double>(p.numel);
  if (first_bad < 0 && counted != expected)
    fail("the ranks counted ", counted, " gradient elements but the model has ", expected,
         "; pass the world communicator the model was sharded over (for a DeviceMesh, the mesh or "
         "mesh.world()), not a sub-group. No gradient was changed");

  if (!std::isfinite(total)) {
    if (o.error_if_nonfinite) {
      const std::string norm = "the total " + norm_name(o.norm_type) + " of the gradients is ";
      if (first_bad == rank) detail::fail(why, ": ", norm, "not finite; no gradient was changed");
      if (first_bad >= 0)
        fail(norm, "not finite: rank ", first_bad,
             " found a non-finite gradient (see that rank's error); no gradient was changed");
      fail(norm, total, " although every gradient element is finite (the sum overflowed); no gradient was changed");
    }
    return {total, 1.0, false};  // never scale by a NaN or zero coefficient
  }
  const double coefficient = o.max_norm / (total + 1e-6);
  if (coefficient >= 1.0) return {total, 1.0, false};
  scale(coefficient);
  return {total, coefficient, true};
}

}  // namespace detail

// Clips with a host read-multiply-write through each unit's copy_bytes (any memory space).
// `group` is the world communicator the model was sharded over, or its DeviceMesh.
// Collective: every rank of the world must call it with the same options.
template <class Group>
ClipResult clip_grad_norm(ShardedModel& model, Group& group, ClipOptions options) {
  auto& world = detail::world_of(group);
  check_communicator<std::remove_cvref_t<decltype(world)>>();
  return detail::clip_grad_norm_impl(model, world, options,
                                     [&](double factor) { detail::scale_grads_on_host(model, factor); });
}

// Clips on `device` (the Device the model was sharded with): one unscale per shard, where
// the shards live, then one wait. Note that this consumes the device's found_nonfinite()
// flag, as a ShardedGradScaler's unscale() does.
template <class Group, class D>
ClipResult clip_grad_norm(ShardedModel& model, Group& group, D& device, ClipOptions options) {
  static_assert(UnscalingDevice<D>,
                "fsdp: clip_grad_norm(model, world, device, options) multiplies the gradients with the Device's "
                "unscale(ptr, count, dtype, factor) and waits with found_nonfinite() (fsdp::UnscalingDevice); "
                "HostDevice and CudaDevice have them. Without a Device, clip_grad_norm(model, world, options) "
                "multiplies on the host");
  auto& world = detail::world_of(group);
  check_communicator<std::remove_cvref_t<decltype(world)>>();
  return detail::clip_grad_norm_impl(model, world, options, [&](double factor) {
    for (const ShardView& s : model.shards())
      if (s.numel > 0) device.unscale(s.grad, static_cast<std::size_t>(s.numel), s.grad_dtype, factor);
    (void)device.found_nonfinite();  // the wait; the total was finite, so nothing became inf here
  });
}

}  // namespace fsdp
