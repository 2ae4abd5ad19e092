#pragma once
// FlatParamGroup: a unit's parameters as flat parameters (one per dtype), with the storage
// the unit owns for them and the collectives that move them. It copies this rank's slice
// into the flat shard, gathers the shards into an unsharded buffer the engine's tensors
// point into, and reduces the unsharded gradient into the sharded one. It knows nothing
// of hooks or training states: that is the unit's state machine (fsdp/unit/sharded_unit.hpp). What
// summons and checkpoints do beyond that is in fsdp/unit/detail/summon_buffers.hpp; how the flat
// parameters are laid out, in fsdp/unit/detail/flat_param_layouts.hpp. After every pass that
// re-points the engine's parameters it runs their modules' parameters_rebound hooks, once
// per module.
#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/unit/detail/gradient_reduction.hpp"
#include "fsdp/unit/detail/flat_param_layouts.hpp"
#include "fsdp/unit/detail/flat_param_rules.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"
#include "fsdp/unit/detail/param_checks.hpp"
#include "fsdp/unit/detail/param_collection.hpp"
#include "fsdp/unit/detail/partial_reshard.hpp"
#include "fsdp/unit/detail/summon_buffers.hpp"
#include "fsdp/unit/detail/take_over.hpp"
#include "fsdp/unit/detail/unit_groups.hpp"
#include "fsdp/core/flat_param.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/core/trace.hpp"
#include "fsdp/unit/unit.hpp"

namespace fsdp {

// Not a template: what it reads of the policies (the dtypes MixedPrecision and
// CommPrecision choose, where CpuOffload keeps the shards) are values, so its code
// compiles once, not once per policy configuration.
class FlatParamGroup {
 public:
  // `shard_space`: where the shards and their gradients live (host under OffloadParams).
  FlatParamGroup(detail::UnitGroups groups, detail::DeviceRef device, PrecisionConfig precision,
                 MemorySpace shard_space)
      : mesh_groups_(groups),
        groups_(groups),
        device_(device),
        precision_(precision),
        shard_space_(shard_space),
        reduction_(groups_, device, shard_space) {}
  FlatParamGroup(const FlatParamGroup&) = delete;
  FlatParamGroup& operator=(const FlatParamGroup&) = delete;

  // Frees everything; once the engine's tensors were taken over, points them at nothing.
  ~FlatParamGroup() {
    for (auto& fp : flat_) {
      fp.gather_work = Work{};  // waits: the buffers below may still be in use by a collective
      fp.reduce_work = Work{};
      reduction_.release_accumulated(fp);
      release_unsharded_params(fp);
      release(fp.post_forward, fp.post_forward_bytes(), MemorySpace::device);
      release(fp.shard, fp.shard_bytes(), shard_space_);
      release(fp.shard_grad, fp.shard_grad_bytes(), shard_space_);
      if (took_over_) {
        detail::bind_tensors(fp, nullptr, &detail::ParamBinding::param, fp.master());
        detail::bind_tensors(fp, nullptr, &detail::ParamBinding::grad, fp.master());
      }
    }
    if (took_over_) {
      try {
        parameters_rebound();  // the engine's other views of the parameters let go too
      } catch (...) {  // a destructor: a hook's error is not heard
      }
    }
  }

  // The groups this unit's collectives use; mesh_groups(): those the model was sharded over
  // (the same, unless the unit is kept unsharded).
  const detail::UnitGroups& groups() const { return groups_; }
  const detail::UnitGroups& mesh_groups() const { return mesh_groups_; }

  // Keeps the parameters whole on every rank, gradients all-reduced over the world (a unit
  // under the persistence threshold). Before build().
  void keep_unsharded() { groups_ = mesh_groups_.replicated(); }  // the reduction reads groups_
  bool kept_unsharded() const { return mesh_groups_.shards_parameters && !groups_.shards_parameters; }
  bool took_over() const { return took_over_; }
  // The take-over was rolled back (the log handed the engine's tensors back): the
  // destructor leaves them alone.
  void forget_take_over() noexcept {
    took_over_ = false;
    param_index_.clear();
  }
  const detail::DeviceRef& device() const { return device_; }
  std::vector<FlatParam>& flat() { return flat_; }
  const std::vector<FlatParam>& flat() const { return flat_; }

  // The flat parameters, what ranks compare of them and how messages show them
  // (fsdp/unit/detail/flat_param_layouts.hpp), cut as `layout` says where they are sharded
  // (replicated parameters are one shard: nothing to align). Before copy_shards.
  void build(const std::vector<detail::CollectedParam>& params, const std::vector<detail::TiedAlias>& aliases = {},
             ShardLayout layout = {}) {
    flat_ = detail::build_flat_params(params, aliases, groups_.shard_size,
                                      groups_.shards_parameters ? layout : ShardLayout::element_flat());
    hooks_.clear();
    by_tensor_.clear();
    auto add = [&](const detail::ParamBinding& b, std::size_t k, std::size_t i) {
      by_tensor_.emplace(b.id, FoundParam{k, i, &b});  // fsdp::tensor_identity, what gradient(param) looks up
      if (b.rebound.call && std::find(hooks_.begin(), hooks_.end(), b.rebound) == hooks_.end()) hooks_.push_back(b.rebound);
    };
    for (std::size_t k = 0; k < flat_.size(); ++k) {
      for (std::size_t i = 0; i < flat_[k].bindings.size(); ++i) add(flat_[k].bindings[i], k, i);
      for (const auto& [i, b] : flat_[k].alias_bindings) add(b, k, i);
    }
  }

  // The parameter whose engine tensor is `tensor` (fsdp::tensor_identity: its address, or
  // what a handle points to; its flat parameter, its index there, its binding; tied names
  // included), or null.
  struct FoundParam {
    std::size_t flat = 0, index = 0;
    const detail::ParamBinding* binding = nullptr;
  };
  const FoundParam* find_parameter(const void* tensor) const {
    auto it = by_tensor_.find(tensor);
    return it == by_tensor_.end() ? nullptr : &it->second;
  }
  // Every engine tensor of the group's parameters (tied names included), by fsdp::tensor_identity.
  std::vector<const void*> parameter_tensors() const {
    std::vector<const void*> out;
    out.reserve(by_tensor_.size());
    for (const auto& [t, found] : by_tensor_) out.push_back(t);
    return out;
  }
  void add_to(detail::Fingerprint& f) const { detail::add_flat_params_to(f, flat_); }
  std::string describe() const { return detail::describe_flat_params(flat_); }

  // Copies this rank's slices into fresh shards (the engine's tensors are not touched).
  void copy_shards(const std::vector<detail::CollectedParam>& params) {
    std::unordered_map<void*, const void*> data_of;
    for (auto& p : params) data_of[p.binding.param] = p.data;
    for (auto& fp : flat_) {
      const auto& L = fp.layout;
      const std::size_t esize = size_of(L.dtype());
      const auto t = detail::flat_param_dtypes(fp.master(), precision_);
      fp.compute = t.compute, fp.gather = t.gather, fp.accumulate = t.accumulate, fp.reduce = t.reduce, fp.grad = t.grad;
      fp.quantized = detail::gathers_quantized(fp.master(), groups_.shards_parameters, precision_);
      fp.quant_format = precision_.comm_gather_format, fp.quant_block = precision_.comm_gather_block;
      fp.direct = detail::flat_param_is_direct(groups_.shards_parameters, offloaded(), fp.master(), t);
      fp.grad_in_shard = detail::grad_accumulates_in_shard(fp.direct, groups_.world_size() == 1, offloaded(), t);
      fp.shard = device_.allocate(fp.shard_bytes(), shard_space_);
      fp.shard_grad = device_.allocate(fp.shard_grad_bytes(), shard_space_);
      device_.fill_zero(fp.shard, fp.shard_bytes());
      device_.fill_zero(fp.shard_grad, fp.shard_grad_bytes());
      for (std::size_t i = 0; i < L.params().size(); ++i) {
        const ShardSlice sl = L.slice(i, groups_.shard_rank);
        if (sl.count == 0) continue;
        device_.copy(static_cast<std::byte*>(fp.shard) + sl.shard_offset * esize,
                     static_cast<const std::byte*>(data_of[fp.bindings[i].param]) + sl.param_begin * esize,
                     static_cast<std::size_t>(sl.count) * esize);
      }
    }
  }

  // Points the engine's parameters and gradients at the group's storage (or at nothing,
  // until gathered) and appends the optimizer's view of each shard and parameter. Every
  // tensor first: a rebind that throws leaves the group not taken over (`log` hands back).
  void take_over(std::string_view unit, std::vector<ShardView>& views, std::vector<ParamView>& params,
                 detail::TakeOverLog& log) {
    log.hooks(hooks_);  // a roll back tells the modules too
    for (auto& fp : flat_) {
      if (fp.direct) fp.full = fp.shard, fp.full_dtype = fp.master();  // replicated: the parameters live in the "shard" for good
      detail::take_over_tensors(fp, fp.direct ? fp.full : nullptr, log);
    }
    took_over_ = true;
    parameters_rebound();
    for (std::size_t k = 0; k < flat_.size(); ++k) {
      const auto& fp = flat_[k];
      const auto& L = fp.layout;
      for (std::size_t i = 0; i < L.params().size(); ++i) {
        const auto& info = L.params()[i];
        const ShardSlice sl = L.slice(i, groups_.shard_rank);
        auto at = [&](void* base, DType t) { return sl.count ? static_cast<std::byte*>(base) + sl.shard_offset * size_of(t) : nullptr; };
        params.push_back({unit, info.fqn, info.shape, fp.master(), info.numel, k, k, sl.param_begin, sl.count,
                          sl.shard_offset, at(fp.shard, fp.master()), at(fp.shard_grad, fp.grad), fp.grad, shard_space_,
                          info.aliases});
        param_index_.push_back({k, i});
      }
    }
    for (auto& fp : flat_)
      views.push_back({unit, fp.master(), fp.shard, fp.shard_grad, fp.layout.valid_shard_numel(groups_.shard_rank), fp.grad,
                       fp.layout.shard_numel(), shard_space_});
  }

  // ---- parameters ----

  // Issues the all-gather of one flat parameter into a fresh unsharded buffer of dtype
  // `as`. When the shard is offloaded or cast, it is copied (and cast) straight into this
  // rank's slot of that buffer and gathered in place (NCCL's in-place all-gather), so no
  // staging copy is ever alive. A narrower `wire` dtype (CommPrecision) gathers into a
  // `wire` buffer instead, widened into the `as` buffer once it arrives (finish_gather).
  // Replicated parameters need no collective. `tag` (may be null) goes with the all-gather.
  // `purpose`: a step's gather moves a block format where the flat parameter has one
  // (FlatParam::quantized); a summon's gathers the master dtype, even when it is the
  // compute dtype, so the purpose cannot be read from the dtypes.
  enum class GatherFor : std::uint8_t { step, summon };
  void start_gather(FlatParam& fp, DType as, DType wire, const CollectiveTag* tag, GatherFor purpose,
                    detail::ZeroBatch* zeros = nullptr) {
    auto cast = [&](void* dst, DType to, const void* src, DType from, std::size_t n) {
      if (zeros) zeros->cast(device_, dst, to, src, from, n);
      else device_.cast(dst, to, src, from, n);
    };
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    fp.full_dtype = as;
    if (fp.direct) { fp.full = fp.shard; return; }
    fp.unbound = true;
    if (fp.post_forward) {  // kept by a partial reshard, in the gathered compute dtype
      if (as == fp.compute) return post_forward_.start_gather(fp, as, device_, tag);
      release(fp.post_forward, fp.post_forward_bytes(), MemorySpace::device);
    }
    if (purpose == GatherFor::step && fp.quantized) return start_quantized_gather(fp, S, tag);
    if (wire != as && groups_.shards_parameters) {
      fp.wire = device_.allocate(fp.wire_bytes(), MemorySpace::device);
      void* mine = static_cast<std::byte*>(fp.wire) + groups_.shard_rank * FlatParam::bytes(L.shard_numel(), wire);
      cast(mine, wire, fp.shard, fp.master(), S);
      fp.gather_work = groups_.all_gather(device_, mine, fp.wire, S, wire, tag);
      return;
    }
    fp.full = device_.allocate(FlatParam::bytes(full_numel(fp), as), MemorySpace::device);
    void* mine = static_cast<std::byte*>(fp.full) + (groups_.shards_parameters ? groups_.shard_rank : 0) * FlatParam::bytes(L.shard_numel(), as);
    const bool staged = offloaded() || as != fp.master() || !groups_.shards_parameters;
    if (staged) cast(mine, as, fp.shard, fp.master(), S);  // also the host-to-device copy
    if (groups_.shards_parameters)
      fp.gather_work = groups_.all_gather(device_, staged ? mine : fp.shard, fp.full, S, as, tag);
  }

  // The all-gather of a block format (CommPrecision<Int8Blocks<...>, ...>): this rank
  // quantizes its f32 shard into its own slot of the wire buffer (its scales, then its
  // codes; the padding zeroed, so every byte sent is written) and gathers the slots in
  // place. An offloaded shard is copied to the device first. finish_gather dequantizes.
  void start_quantized_gather(FlatParam& fp, std::size_t S, const CollectiveTag* tag) {
    if (fp.scaled_per_tensor()) return start_tensor_scaled_gather(fp, S, tag);
    const auto slot = fp.quant_slot();
    fp.wire = device_.allocate(fp.wire_bytes(), MemorySpace::device);
    auto* mine = static_cast<std::byte*>(fp.wire) + static_cast<std::size_t>(groups_.shard_rank) * slot.bytes;
    if (slot.bytes > slot.used) device_.fill_zero(mine + slot.used, slot.bytes - slot.used);
    detail::DeviceScratch staged(device_, offloaded() ? fp.shard_bytes() : 0);
    if (staged.data) device_.copy(staged.data, fp.shard, fp.shard_bytes());
    const void* x = staged.data ? staged.data : fp.shard;
    device_.quantize(fp.quant_format, static_cast<const float*>(x), S, mine + slot.codes_at, mine + slot.scales_at,
                     fp.quant_block);
    staged.release();
    fp.gather_work = groups_.all_gather(device_, mine, fp.wire, slot.bytes, DType::u8, tag);
  }

  // The all-gather of a per-tensor format (CommPrecision<F8E4M3Tensor, ...>): one scale per
  // parameter, from the amax of the whole unsharded parameter. This rank writes the amax
  // of each of its slices into its row of fp.amax (0 for parameters it holds none of; +inf
  // for a slice holding an inf or NaN), the shard group gathers the rows, and the largest
  // per parameter is the agreed amax (scale_for is monotone, so the largest local amax
  // gives the whole parameter's scale exactly); each slice is quantized with it into this
  // rank's slot (codes only; the padding zero codes) and the slots are gathered in place.
  // The amaxes travel by all-gather, not all-reduce(max): every backend gathers device
  // memory (CudaThreadComm reduces it only with sum), and NcclComm queues all-gathers on
  // its all-gather stream, where a backward prefetch does not wait behind the gradient
  // reduce-scatters of the reduce stream. The quantize waits for that gather on the
  // device's queue where it has one (as finish_gather waits for a gather; no host check
  // here either: a failure breaks the communicator), else on the host. Both gathers carry
  // the unit's tag: every rank runs them, in this order, for the same unit and pass. A
  // flat parameter with no elements gathers as the block formats do, nothing to scale.
  // fp.amax: the agreed row, then one row per shard rank (none on a one-rank group).
  void start_tensor_scaled_gather(FlatParam& fp, std::size_t S, const CollectiveTag* tag) {
    const auto& L = fp.layout;
    const std::size_t P = L.params().size();
    const auto slot = fp.quant_slot();
    fp.wire = device_.allocate(fp.wire_bytes(), MemorySpace::device);
    auto* mine = static_cast<std::byte*>(fp.wire) + static_cast<std::size_t>(groups_.shard_rank) * slot.bytes;
    if (S == 0) {
      fp.gather_work = groups_.all_gather(device_, mine, fp.wire, slot.bytes, DType::u8, tag);
      return;
    }
    fp.amax = device_.allocate(fp.amax_bytes(), MemorySpace::device);
    const auto ranks = static_cast<std::size_t>(L.world());
    auto* agreed = static_cast<float*>(fp.amax);
    float* rows = ranks > 1 ? agreed + P : agreed;
    float* local = rows + (ranks > 1 ? static_cast<std::size_t>(groups_.shard_rank) * P : 0);
    device_.fill_zero(local, P * sizeof(float));
    if (static_cast<std::size_t>(L.param_numel_on(groups_.shard_rank)) < S)
      device_.fill_zero(mine, slot.bytes);  // padding between or after the slices
    else if (slot.bytes > slot.used) device_.fill_zero(mine + slot.used, slot.bytes - slot.used);
    detail::DeviceScratch staged(device_, offloaded() ? fp.shard_bytes() : 0);
    if (staged.data) device_.copy(staged.data, fp.shard, fp.shard_bytes());
    const auto* x = static_cast<const float*>(staged.data ? staged.data : fp.shard);
    for (std::size_t i = 0; i < P; ++i) {
      const ShardSlice sl = L.slice(i, groups_.shard_rank);
      if (sl.count) device_.abs_max(x + sl.shard_offset, static_cast<std::size_t>(sl.count), local + i);
    }
    if (ranks > 1) {
      Work gathered = groups_.all_gather(device_, local, rows, P, DType::f32, tag);
      if (!gathered.completed_inline()) detail::wait_for_use(gathered, device_, detail::TracedWait{}, "wait all_gather");
      device_.max_over_rows(rows, ranks, P, agreed);
    }
    for (std::size_t i = 0; i < P; ++i) {
      const ShardSlice sl = L.slice(i, groups_.shard_rank);
      if (sl.count)
        device_.quantize_tensor(fp.quant_format, x + sl.shard_offset, static_cast<std::size_t>(sl.count),
                                mine + slot.codes_at + sl.shard_offset, agreed + i);
    }
    staged.release();
    fp.gather_work = groups_.all_gather(device_, mine, fp.wire, slot.bytes, DType::u8, tag);
  }

  // finish_gather's half of a per-tensor format: each shard rank's slot holds the codes of
  // its S elements of the padded buffer; each parameter's part of it is dequantized with
  // that parameter's agreed amax (NaNs in every element where it is not finite), and the
  // padding comes out as zeros (the slot's region zeroed first where it holds any).
  void dequantize_tensor_scaled(FlatParam& fp, DType as) {
    const auto& L = fp.layout;
    const auto S = static_cast<std::size_t>(L.shard_numel());
    const auto slot = fp.quant_slot();
    const auto* amax = static_cast<const float*>(fp.amax);
    detail::DeviceScratch f32(device_, as == DType::f32 ? 0 : FlatParam::bytes(L.shard_numel(), DType::f32));
    for (int r = 0; S != 0 && r < L.world(); ++r) {
      const auto at = static_cast<std::size_t>(r);
      const auto* codes = static_cast<const std::byte*>(fp.wire) + at * slot.bytes + slot.codes_at;
      auto* place = static_cast<std::byte*>(fp.full) + at * S * size_of(as);
      auto* out = f32.data ? static_cast<float*>(f32.data) : reinterpret_cast<float*>(place);
      if (static_cast<std::size_t>(L.param_numel_on(r)) < S) device_.fill_zero(out, S * sizeof(float));
      for (std::size_t i = 0; i < L.params().size(); ++i) {
        const ShardSlice sl = L.slice(i, r);
        if (sl.count)
          device_.dequantize_tensor(fp.quant_format, codes + sl.shard_offset, static_cast<std::size_t>(sl.count), amax + i,
                                    out + sl.shard_offset);
      }
      if (f32.data) device_.cast(place, as, f32.data, DType::f32, S);
    }
    f32.release();
  }

  // Hands a gathered buffer to the engine: waits for its all-gather, widens a narrower
  // gather into the compute-dtype buffer (freeing the narrow one), or dequantizes each
  // shard rank's slot of a block format's, or each parameter of a per-tensor format's
  // with its agreed amax (through an f32 buffer when the compute dtype is another), binds
  // the parameters.
  void finish_gather(FlatParam& fp, DType as, const detail::TracedWait& wait) {
    // On a queued device the compute queue waits, not the host (no empty spans if inline).
    if (!fp.gather_work.completed_inline()) detail::wait_for_use(fp.gather_work, device_, wait, "wait all_gather");
    fp.gather_work = Work{};  // no host check here: a failure breaks the communicator (docs/cuda.md)
    if (fp.wire) {
      const auto padded = static_cast<std::size_t>(fp.layout.padded_numel());
      fp.full = device_.allocate(FlatParam::bytes(fp.layout.padded_numel(), as), MemorySpace::device);
      if (fp.scaled_per_tensor()) {  // only its all-gather fills the wire of such a flat parameter
        dequantize_tensor_scaled(fp, as);
      } else if (fp.quantized) {  // only a block format's all-gather fills the wire of such a flat parameter
        const auto S = static_cast<std::size_t>(fp.layout.shard_numel());
        const auto slot = fp.quant_slot();
        // One launch per shard rank (the slots are apart); under another compute dtype each
        // slot goes through one shard of f32, then is cast into place.
        detail::DeviceScratch f32(device_, as == DType::f32 ? 0 : FlatParam::bytes(fp.layout.shard_numel(), DType::f32));
        for (std::size_t r = 0; S != 0 && r < padded / S; ++r) {
          const auto* at = static_cast<const std::byte*>(fp.wire) + r * slot.bytes;
          auto* place = static_cast<std::byte*>(fp.full) + r * S * size_of(as);
          auto* out = f32.data ? static_cast<float*>(f32.data) : reinterpret_cast<float*>(place);
          device_.dequantize(fp.quant_format, at + slot.codes_at, at + slot.scales_at, S, out, fp.quant_block);
          if (f32.data) device_.cast(place, as, f32.data, DType::f32, S);
        }
        f32.release();
      } else {
        device_.cast(fp.full, as, fp.wire, fp.gather, padded);
      }
      release(fp.wire, fp.wire_bytes(), MemorySpace::device);
    }
    release(fp.amax, fp.amax_bytes(), MemorySpace::device);
    detail::bind_tensors(fp, fp.full, &detail::ParamBinding::param, as);
    fp.unbound = false;
    release(fp.post_forward, fp.post_forward_bytes(), MemorySpace::device);  // gathered from: done
  }

  // Issues the all-gathers not yet issued; returns whether it issued any.
  // `zeros` (may be null): another unit's pending zeroing, done by this gather's cast.
  bool start_gathers(const CollectiveTag* tag, detail::ZeroBatch* zeros = nullptr) {
    bool issued = false;
    for (auto& fp : flat_) {
      if (fp.gather_issued()) continue;
      start_gather(fp, fp.compute, fp.gather, tag, GatherFor::step, zeros);
      issued = true;
    }
    return issued;
  }

  // Makes the parameters valid in the compute dtype: waits for a prefetched all-gather, or
  // issues one and waits. Parameters already valid (replicated in place, or kept since
  // forward) cost nothing: not even a rebind.
  void unshard(const detail::TracedWait& wait, const CollectiveTag* tag) {
    bool rebound = false;
    for (auto& fp : flat_) {
      if (!fp.gather_issued()) start_gather(fp, fp.compute, fp.gather, tag, GatherFor::step);
      if (fp.unbound) finish_gather(fp, fp.compute, wait), rebound = true;
    }
    if (rebound) parameters_rebound();
  }

  // Full parameters in their own (master) dtype, for summon_full_params.
  void unshard_master(const detail::TracedWait& wait, const CollectiveTag* tag) {
    for (auto& fp : flat_) {
      start_gather(fp, fp.master(), fp.master(), tag, GatherFor::summon);
      finish_gather(fp, fp.master(), wait);
    }
    parameters_rebound();
  }

  // Parameter i (in take_over's order) inside the unsharded buffer, in the dtype gathered.
  void* full_parameter(std::size_t i) const {
    const auto [k, j] = param_index_.at(i);
    const auto& fp = flat_[k];
    if (!fp.full || fp.unbound) return nullptr;
    return static_cast<std::byte*>(fp.full) + fp.layout.params()[j].offset * size_of(fp.full_dtype);
  }

  // ---- summons and checkpoints (fsdp/unit/detail/summon_buffers.hpp) ----

  void move_unsharded_to_host() {
    if (detail::move_unsharded_to_host(flat_, groups_, device_)) parameters_rebound();
  }
  void unshard_gradients() { detail::unshard_gradients(flat_, groups_, device_); }
  void release_summoned_gradients() { detail::release_summoned_gradients(flat_, device_); }
  bool hash_unsharded(detail::Fingerprint& f) const { return detail::hash_unsharded(flat_, device_, f); }
  void write_back() { detail::write_back(flat_, groups_, device_); }
  // An array laid out like flat parameter k's shard, gathered into host memory, its
  // parameters back to back in their order (the layout's gaps left out).
  void gather_array(std::size_t k, const void* mine, void* full_host, DType dtype) const {
    detail::gather_array(flat_.at(k).layout, groups_, device_, mine, full_host, dtype, /*packed=*/true);
  }

  // Frees the unsharded parameters and what a partial reshard kept of them.
  void release_unsharded() {
    if (release_unsharded_tensors()) parameters_rebound();
  }
  // The same on a path that recovers from an error (abort_step, a summon that failed part
  // way): the modules' hooks still run, but an error of theirs is dropped, so that the
  // recovery finishes (and ranks that agree on it are not left waiting) and the error that
  // started it is the one reported.
  void release_unsharded_after_error() {
    if (!release_unsharded_tensors()) return;
    try {
      parameters_rebound();
    } catch (...) {
    }
  }

 private:
  // release_unsharded without the hooks; whether the engine's tensors were re-pointed.
  bool release_unsharded_tensors() {
    bool rebound = false;
    for (auto& fp : flat_) {
      if (fp.direct) continue;  // replicated parameters stay valid
      detail::settle_before_free(fp.gather_work, device_);  // a prefetched all-gather may still be writing into the buffer
      rebound = rebound || (fp.full && !fp.unbound);  // the engine's tensors viewed it: re-pointed now
      fp.unbound = false;
      detail::bind_tensors(fp, nullptr, &detail::ParamBinding::param, fp.master());
      release_unsharded_params(fp);
      release(fp.post_forward, fp.post_forward_bytes(), MemorySpace::device);
    }
    return rebound;
  }

 public:
  // ---- partial resharding (fsdp/unit/detail/partial_reshard.hpp) ----

  // The group for set_reshard_after_forward(group), or nullopt; checked on this rank.
  // Units whose parameters are not sharded have nothing to keep: they ignore it.
  void set_post_forward_group(std::optional<detail::CommRef> group, std::string_view unit) {
    post_forward_.set(groups_.shards_parameters ? group : std::nullopt, groups_, unit);
  }
  void check_post_forward_group(const detail::CommRef& group, std::string_view unit) const {
    if (groups_.shards_parameters) detail::PostForwardGroup::check(group, groups_, unit);
  }
  bool reshards_partially() const { return post_forward_.active(); }
  int post_forward_size() const { return post_forward_.size(); }

  // After forward: keeps this rank's chunk of each unsharded buffer and frees the rest.
  void reshard_to_post_forward() {
    bool rebound = false;
    for (auto& fp : flat_) {
      if (fp.direct || !fp.full || fp.unbound || fp.post_forward) continue;
      post_forward_.keep_chunk(fp, groups_.shard_rank, device_);
      detail::bind_tensors(fp, nullptr, &detail::ParamBinding::param, fp.master());
      release_unsharded_params(fp);
      rebound = true;
    }
    if (rebound) parameters_rebound();
  }

  // A step abandoned (abort_step): collectives in flight finished (their errors dropped:
  // the backend reports them again), every unsharded buffer freed, the step's gradients
  // dropped and the sharded gradients zeroed. Before take-over the engine's tensors are
  // the engine's: nothing is rebound.
  void abandon() {
    for (auto& fp : flat_) {
      fp.gather_work = Work{};  // waits quietly: a peer may still read or write the buffers
      fp.reduce_work = Work{};
      fp.reducing = false;
    }
    reduction_.drop_checks();
    if (!took_over_) return;
    release_unsharded_after_error();
    unbind_gradients();
    zero_grad();
  }

  // A parameter whose engine tensor no longer views what it was bound to (its storage
  // replaced behind the library's back), or "".
  std::string moved_storage() const {
    if (!took_over_) return {};
    for (const auto& fp : flat_) {
      const bool shown = fp.direct || (fp.full && !fp.unbound);
      std::string moved = detail::moved_storage(fp, shown ? fp.full : nullptr, shown ? fp.full_dtype : fp.master());
      if (!moved.empty()) return moved;
    }
    return {};
  }

  // ---- gradients (the reduction owns their buffers) ----

  void bind_gradients(bool grad_is_zero, detail::ZeroBatch& zeros) { reduction_.bind_gradients(flat_, grad_is_zero, zeros); }
  // Between backward entries of one pass: the engine's gradients point at nothing while the
  // unsharded gradient stays, for the next entry to add into.
  void unbind_gradients() {
    for (auto& fp : flat_) detail::bind_tensors(fp, nullptr, &detail::ParamBinding::grad, fp.master());
  }
  bool start_reductions(bool grad_is_zero, detail::GradientPlan plan, const CollectiveTag* tag) {
    return reduction_.start_reductions(flat_, grad_is_zero, plan, tag);
  }
  void finish_reductions(const detail::TracedWait& wait) { reduction_.finish_reductions(flat_, wait); }
  // The host-side check of the reductions the device waited for (finish_backward).
  void check_reductions_on_host(const detail::TracedWait& wait) { reduction_.check_on_host(wait); }
  void drop_reduction_checks() { reduction_.drop_checks(); }
  // What a step captured into a CUDA graph depends on besides the settings (fsdp::CapturedStep):
  // per flat parameter, whether a gradient sum is kept across steps (an unsharded gradient
  // or its cast of an unsynchronized backward, or shard-group sums awaiting the replicate
  // all-reduce) and whether the sharded gradient exists (a hook may have freed it).
  std::string gradient_state() const {
    std::string s;
    for (const auto& fp : flat_)
      s += fp.grad_kept || fp.full_grad || fp.reduce_in || fp.partial ? 'k' : '-', s += fp.shard_grad ? 's' : 'n';
    return s;
  }
  void zero_grad(detail::ZeroBatch& batch) { reduction_.zero_grad(flat_, batch); }
  void zero_grad() {
    detail::ZeroBatch::run([&](detail::ZeroBatch& batch) { zero_grad(batch); });
  }
  void set_gradient_divide_factor(double f) { reduction_.set_divide_factor(f); }

  // Where a post-accumulate-grad hook frees the sharded gradients between backwards.
  void release_shard_grads() {
    for (auto& fp : flat_) reduction_.release_shard_grad(fp);
  }
  void ensure_shard_grads() {  // zeroed, with one call
    detail::ZeroBatch::run([&](detail::ZeroBatch& zeros) {
      for (auto& fp : flat_) reduction_.ensure_shard_grad(fp, &zeros);
    });
  }
  // Points the optimizer's views at the current sharded gradients (nullptr while freed).
  void point_views_at_gradients(std::vector<ShardView>& views, std::vector<ParamView>& params) const {
    for (std::size_t k = 0; k < flat_.size(); ++k) views.at(k).grad = flat_[k].shard_grad;
    for (std::size_t j = 0; j < params.size(); ++j) {
      const auto& fp = flat_[param_index_.at(j).first];
      auto& p = params[j];
      p.grad = fp.shard_grad && p.count ? static_cast<std::byte*>(fp.shard_grad) + p.shard_offset * size_of(fp.grad) : nullptr;
    }
  }

 private:
  bool offloaded() const { return shard_space_ == MemorySpace::host; }

  // After a pass that re-pointed the engine's parameters: each module's hook, once.
  void parameters_rebound() const {
    for (const auto& h : hooks_) h();
  }
  std::int64_t full_numel(const FlatParam& fp) const { return detail::full_numel(fp, groups_); }

  void release_unsharded_params(FlatParam& fp) {
    release(fp.wire, fp.wire_bytes(), MemorySpace::device);  // gathered ahead, never widened
    release(fp.amax, fp.amax_bytes(), MemorySpace::device);
    if (!fp.full || fp.full == fp.shard) return;
    device_.deallocate(fp.full, FlatParam::bytes(full_numel(fp), fp.full_dtype), fp.full_space);
    fp.full = nullptr;
    fp.full_space = MemorySpace::device;
  }

  void release(void*& p, std::size_t n, MemorySpace space) { detail::release_buffer(device_, p, n, space); }

  detail::UnitGroups mesh_groups_, groups_;
  detail::PostForwardGroup post_forward_;
  detail::DeviceRef device_;
  PrecisionConfig precision_;
  MemorySpace shard_space_;
  detail::GradientReduction reduction_;
  std::vector<FlatParam> flat_;
  std::vector<std::pair<std::size_t, std::size_t>> param_index_;  // parameter -> (flat, index in it)
  std::vector<detail::ReboundHook> hooks_;  // each module's with parameters here, once, in visit order
  std::unordered_map<const void*, FoundParam> by_tensor_;  // engine tensor -> its parameter
  bool took_over_ = false;
};

}  // namespace fsdp
