#pragma once
// What fsdp::plan runs the library's own units on: a Device that counts bytes without
// allocating any (PlanDevice: each allocation is an address no program can read, each
// copy, cast or zeroing does nothing), a Communicator that moves nothing between ranks
// (PlanComm), a tensor with a shape and no storage (PlanTensor), and a module made of them
// (PlanModule). A unit built over them (PlanUnit) is a real fsdp::detail::ShardedUnit: its
// setup, hooks, prefetches, reductions and frees are the code a training step runs, so
// the bytes they count are those a step allocates, and a change to the schedule cannot
// leave the planner behind. PlanUnit only names each allocation after the hook it runs in,
// for the plan's peak and its timeline.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/fingerprint.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/module.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/core/work.hpp"
#include "fsdp/unit/sharded_hooks.hpp"
#include "fsdp/unit/unit_setup.hpp"
#include "fsdp/unit/shard_options.hpp"
#include "fsdp/policy/wrap_policy.hpp"

namespace fsdp::detail {

// Addresses handed out by the planning device have the top bit set: no user-space pointer
// does on the 64-bit platforms the library runs on, so a read through one faults at once
// rather than corrupting anything, and PlanComm tells them from real host buffers (the
// setup checks' fingerprints, which it copies as if every rank sent the same).
inline constexpr std::uintptr_t plan_address_base = std::uintptr_t{1} << (sizeof(std::uintptr_t) * 8 - 1);
inline bool is_plan_address(const void* p) { return reinterpret_cast<std::uintptr_t>(p) >= plan_address_base; }

// One change of the live bytes: who allocated or freed, in which hook, and what is live after.
struct PlanEvent {
  MemorySpace space = MemorySpace::device;
  std::int64_t delta = 0;                  // bytes: + allocated, - freed
  std::array<std::size_t, 2> live{};       // per space, after it
  std::string unit;                        // the unit whose memory it is ("" for the engine's state)
  std::string phase;                       // the hook (and the unit running it, when another's)
  int step = 0;                            // 1-based; 0: setup
};

// The bytes every PlanDevice of one plan counts, and where they peaked.
class PlanLedger {
 public:
  // What runs now: a unit's hook (entered by PlanUnit), or the planner's own phase.
  struct Running {
    const std::string* unit;
    const char* hook;
  };
  std::vector<Running> running;
  std::string phase = "setup";  // outside any hook (shard(), the engine's state, summon)
  int step = 0;
  bool record_timeline = true;

  // `phase`: what to call it instead of the hook running (the engine's state).
  void* allocate(std::size_t bytes, MemorySpace space, const std::string& owner, const char* phase = nullptr) {
    if (bytes == 0) return nullptr;
    const auto k = static_cast<std::size_t>(space);
    std::size_t total = 0;
    if (bytes > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) ||
        __builtin_add_overflow(live_[k], bytes, &total))
      fail("fsdp::plan: '", owner, "' allocates ", bytes, " bytes in ", name_of(space), " space on top of ", live_[k],
           " live: the total overflows (a size computed from a negative number?)");
    live_[k] = total;
    const std::string what = phase ? std::string(phase) : describe(owner);
    if (record_timeline) events_.push_back({space, static_cast<std::int64_t>(bytes), live_, owner, what, step});
    if (live_[k] > peaks_[k].bytes) peaks_[k] = {live_[k], owner, what, step};
    void* p = reinterpret_cast<void*>(next_);
    next_ += (bytes + 255) / 256 * 256;  // distinct, aligned, never reused
    return p;
  }
  void deallocate(void* p, std::size_t bytes, MemorySpace space, const std::string& owner) {
    if (!p) return;
    const auto k = static_cast<std::size_t>(space);
    if (!is_plan_address(p) || bytes > live_[k]) {  // reported by check(): frees run in noexcept paths
      if (error.empty())
        error = "fsdp::plan: '" + owner + "' freed " + std::to_string(bytes) + " bytes in " + std::string(name_of(space)) +
                " space that the planning device did not hand out (" + std::to_string(live_[k]) + " live)";
      return;
    }
    live_[k] -= bytes;
    note(space, -static_cast<std::int64_t>(bytes), owner);
  }
  std::size_t live(MemorySpace s) const { return live_[static_cast<std::size_t>(s)]; }
  std::string error;  // the first free the ledger could not match
  void check() const {
    if (!error.empty()) fail(error);
  }
  // An address for the engine's own storage of a tensor (not counted: the engine's).
  void* engine_address(std::size_t bytes) {
    void* p = reinterpret_cast<void*>(next_);
    next_ += (bytes + 255) / 256 * 256 + 256;
    return p;
  }
  struct Peak {
    std::size_t bytes = 0;
    std::string unit, phase;
    int step = 0;
  };
  const Peak& peak(MemorySpace s) const { return peaks_[static_cast<std::size_t>(s)]; }
  std::vector<PlanEvent>& events() { return events_; }

 private:
  // The hook the allocation happens in: the outermost one running, named with its unit
  // when that is not the owner ("pre_forward of 'blocks.0'": a prefetch).
  std::string describe(const std::string& owner) const {
    if (running.empty()) return phase;
    const Running& r = running.front();
    std::string s = r.hook;
    if (*r.unit != owner) s += " of '" + *r.unit + "'";
    return s;
  }
  void note(MemorySpace space, std::int64_t delta, const std::string& owner) {
    if (record_timeline) events_.push_back({space, delta, live_, owner, describe(owner), step});
  }

  std::array<std::size_t, 2> live_{};
  std::array<Peak, 2> peaks_{};
  std::vector<PlanEvent> events_;
  std::uintptr_t next_ = plan_address_base + 4096;
};

// One unit's view of the ledger: the Device its PlanUnit is built on.
class PlanDevice {
 public:
  // `id`: the device of the model planned (the library allocates differently on CUDA in places).
  PlanDevice(PlanLedger& ledger, std::string owner, DeviceId id) : ledger_(&ledger), owner_(std::move(owner)), id_(id) {}
  DeviceId id() const { return id_; }
  void* allocate(std::size_t bytes, MemorySpace s) { return ledger_->allocate(bytes, s, owner_); }
  void deallocate(void* p, std::size_t bytes, MemorySpace s) { ledger_->deallocate(p, bytes, s, owner_); }
  void copy(void*, const void*, std::size_t) {}
  void fill_zero(void*, std::size_t) {}
  void scale(void*, std::size_t, DType, double) {}
  void accumulate(void*, const void*, std::size_t, DType) {}
  void cast(void*, DType, const void*, DType, std::size_t) {}
  void quantize(QuantFormat, const float*, std::size_t, void*, void*, std::size_t) {}
  void dequantize(QuantFormat, const void*, const void*, std::size_t, float*, std::size_t) {}
  std::optional<std::size_t> quantize_nonfinite() { return std::nullopt; }
  void abs_max(const float*, std::size_t, float*) {}
  void max_over_rows(const float*, std::size_t, std::size_t, float*) {}
  void quantize_tensor(QuantFormat, const float*, std::size_t, void*, const float*) {}
  void dequantize_tensor(QuantFormat, const void*, std::size_t, const float*, float*) {}
  void synchronize() {}
  MemoryStats stats(MemorySpace s) const { return {ledger_->live(s), ledger_->peak(s).bytes, 0}; }
  void reset_peak(MemorySpace) {}

 private:
  PlanLedger* ledger_;
  std::string owner_;
  DeviceId id_;
};

// A rank of `size` whose collectives move nothing. Planning buffers are left as they are;
// real host buffers (what setup compares across ranks) are filled as if every rank had
// sent this rank's, so the checks agree. `asynchronous`: each collective returns pending
// Work that completes when waited on, as AsyncCommunicator's and NCCL's do.
class PlanComm {
 public:
  PlanComm(int rank, int size, bool asynchronous) : rank_(rank), size_(size), async_(asynchronous) {}
  int rank() const { return rank_; }
  int size() const { return size_; }
  Work all_gather(const void* s, void* r, std::size_t n, DType t) {
    if (!is_plan_address(r) && !is_plan_address(s))
      for (int i = 0; i < size_; ++i) move(static_cast<std::byte*>(r) + static_cast<std::size_t>(i) * n * size_of(t), s, n * size_of(t));
    return work();
  }
  Work reduce_scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp) {
    if (!is_plan_address(r) && !is_plan_address(s))
      move(r, static_cast<const std::byte*>(s) + static_cast<std::size_t>(rank_) * n * size_of(t), n * size_of(t));
    return work();
  }
  Work all_reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp) {
    if (!is_plan_address(r) && !is_plan_address(s)) move(r, s, n * size_of(t));
    return work();
  }
  Work broadcast(const void* s, void* r, std::size_t n, DType t, int) {
    if (s && r && !is_plan_address(r) && !is_plan_address(s)) move(r, s, n * size_of(t));
    return work();
  }
  Work barrier() { return work(); }

 private:
  static void move(void* to, const void* from, std::size_t bytes) {
    if (bytes && to != from) std::memmove(to, from, bytes);
  }
  struct Pending final : Work::Pending {
    void wait() override {}
    bool ready() override { return false; }  // done only when waited: no free depends on timing
  };
  Work work() const { return async_ ? Work(std::make_unique<Pending>()) : Work{}; }
  int rank_, size_;
  bool async_;
};

// A tensor with a shape, a dtype and an address (null, or the planning device's).
struct PlanTensor {
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
  void* data = nullptr;
  DeviceId device{};
};

// A module of one parameter per flat parameter (with its gradient) and its buffers: what
// a unit needs to lay out, gather and reduce the same bytes as the unit it stands for.
struct PlanModule {
  struct Param {
    std::string name;
    PlanTensor param, grad;
  };
  std::vector<Param> params;
  std::vector<std::pair<std::string, PlanTensor>> buffers;

  template <class F>
  void visit_parameters(F&& f) {
    for (auto& p : params) f(std::string_view(p.name), p.param, p.grad);
  }
  template <class F>
  void visit_buffers(F&& f) {
    for (auto& [name, b] : buffers) f(std::string_view(name), b);
  }
};

}  // namespace fsdp::detail

template <>
struct fsdp::tensor_traits<fsdp::detail::PlanTensor> {
  using T = fsdp::detail::PlanTensor;
  static DType dtype(const T& t) { return t.dtype; }
  static const std::vector<std::int64_t>& shape(const T& t) { return t.shape; }
  static void* data(T& t) { return t.data; }
  static DeviceId device(const T& t) { return t.device; }
  static void rebind(T& t, void* p) { t.data = p; }
  static void rebind(T& t, void* p, DType d) { t.data = p, t.dtype = d; }
};

namespace fsdp::detail {

// A real unit over a PlanModule, on a PlanDevice and PlanComm groups; each hook tells the
// ledger it runs, so what it allocates is named after it.
class PlanUnit final : public ShardedUnit {
 public:
  PlanUnit(const PolicyConfig& policies, PlanModule& module, UnitGroups groups, PlanDevice& device, std::string fqn,
           const ShardOptions& options, const UnitInit& init, PlanLedger& ledger)
      : ShardedUnit(policies, Settings{}, ModuleId::of(module), visit(module, policies.precision.mixed), groups,
                    DeviceRef(device), std::move(fqn), options, init),
        ledger_(&ledger),
        name_(display_name()) {}

  void pre_forward() override { in("pre_forward", [&] { ShardedUnit::pre_forward(); }); }
  void post_forward() override { in("post_forward", [&] { ShardedUnit::post_forward(); }); }
  void pre_backward() override { in("pre_backward", [&] { ShardedUnit::pre_backward(); }); }
  void post_backward() override { in("post_backward", [&] { ShardedUnit::post_backward(); }); }
  void prefetch(ZeroBatch* zeros) override { in("prefetch", [&] { ShardedUnit::prefetch(zeros); }); }
  void finish_reduction() override { in("finish_reduction", [&] { ShardedUnit::finish_reduction(); }); }
  void finish_backward() override { in("finish_backward", [&] { ShardedUnit::finish_backward(); }); }
  void reshard() override { in("reshard", [&] { ShardedUnit::reshard(); }); }
  using ShardedUnit::zero_grad;
  void zero_grad(ZeroBatch& batch) override { in("zero_grad", [&] { ShardedUnit::zero_grad(batch); }); }
 protected:
  void begin_summon_full_params(const SummonOptions& o) override {
    in("summon_full_params", [&] { ShardedUnit::begin_summon_full_params(o); });
  }
  void end_summon_full_params(bool writeback) override {
    in("summon_full_params", [&] { ShardedUnit::end_summon_full_params(writeback); });
  }

 private:
  static ModuleVisit visit(PlanModule& m, bool changes_dtype) {
    return changes_dtype ? ModuleVisit::of<wrap_types<>, true>(m) : ModuleVisit::of<wrap_types<>, false>(m);
  }
  template <class F>
  void in(const char* hook, F&& f) {
    ledger_->running.push_back({&name_, hook});
    struct Pop {
      PlanLedger* l;
      ~Pop() { l->running.pop_back(); }
    } pop{ledger_};
    f();
  }
  PlanLedger* ledger_;
  std::string name_;
};

}  // namespace fsdp::detail
