// CountingDevice, and the device-call budget of a training step it pins: every device
// operation is one CUDA runtime call on a GPU (a few microseconds of host time each, see
// docs/cuda.md), so the operations and collectives a unit issues per step are stated here,
// derived from the design, for FullShard in full and mixed precision, over one and two ranks.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>

#include <fsdp/testing/counting_device.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#include "examples/engine/fsdp_integration.hpp"

namespace core_counting_device_test {

namespace {

using fsdp::Collective;
using fsdp::DeviceOp;
using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;

static_assert(fsdp::Device<fsdp::CountingDevice<fsdp::HostDevice>>);
static_assert(fsdp::UnscalingDevice<fsdp::CountingDevice<fsdp::HostDevice>>);  // passed through
static_assert(fsdp::BatchZeroingDevice<fsdp::CountingDevice<fsdp::HostDevice>>);
static_assert(fsdp::CastZeroingDevice<fsdp::CountingDevice<fsdp::HostDevice>>);
static_assert(!fsdp::QueuedDevice<fsdp::CountingDevice<fsdp::HostDevice>>);     // not invented

struct StepCounts {
  std::size_t units = 0;
  fsdp::DeviceOpCounts ops;
  fsdp::CollectiveCounts collectives;
};

// Trains 3 steps; counts the last (steady state: the root unit kept from forward to backward).
template <class Precision>
StepCounts count_step(int world, double divide_factor = 0, fsdp::GradientAfterHook after = fsdp::GradientAfterHook::keep) {
  engine::ModelConfig c;
  c.blocks = 3;
  std::vector<StepCounts> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    Counting counted(comm);
    engine::Model model(c);
    fsdp::HostDevice host;
    fsdp::CountingDevice<fsdp::HostDevice> device(host);
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre, Precision>(model, counted, device, engine::Wrap{});
    if (divide_factor > 0) sm.set_gradient_divide_factor(divide_factor);
    if (after == fsdp::GradientAfterHook::free) sm.set_post_accumulate_grad_hook([](fsdp::Unit&) {}, after);
    engine::Sgd sgd(0.05f);
    struct InHook {  // a freeing hook's optimizer steps in the hook (here: not at all)
      void step(std::span<const engine::Slot>) {}
    } in_hook;
    auto& out = per_rank[comm.rank()];
    for (int s = 0; s < 3; ++s) {
      device.reset();
      counted.reset();
      const auto batch = engine::make_batch(c, s, comm.rank(), 1);
      if (after == fsdp::GradientAfterHook::free) engine::sharded_step(model, sm, in_hook, batch);
      else engine::sharded_step(model, sm, sgd, batch);
    }
    out.units = sm.size();
    out.ops = device.counts();
    out.collectives = counted.counts();
  });
  for (int r = 1; r < world; ++r) {
    CHECK(per_rank[r].ops == per_rank[0].ops);
    CHECK(per_rank[r].collectives == per_rank[0].collectives);
  }
  return per_rank[0];
}

}  // namespace

TEST_CASE("CountingDevice counts each operation by kind and passes it on") {
  fsdp::HostDevice host;
  fsdp::CountingDevice<fsdp::HostDevice> d(host);
  void* a = d.allocate(16, fsdp::MemorySpace::device);
  void* b = d.allocate(16, fsdp::MemorySpace::host);
  d.fill_zero(a, 16);
  float four[4] = {1, 2, 3, 4};
  d.copy(b, four, 16);
  d.accumulate(a, b, 4, fsdp::DType::f32);
  d.scale(a, 4, fsdp::DType::f32, 0.5);
  d.cast(b, fsdp::DType::bf16, a, fsdp::DType::f32, 4);
  d.cast(b, fsdp::DType::f32, a, fsdp::DType::f32, 4);  // same dtype: a copy
  d.cast(a, fsdp::DType::f32, a, fsdp::DType::f32, 4);  // in place: nothing
  d.fill_zero(a, 0);                                     // nothing to do: not a call
  const fsdp::ZeroSpan spans[] = {{a, 4}, {b, 0}, {static_cast<char*>(a) + 8, 4}};
  d.fill_zero_batch(spans);                              // one call, however many buffers
  d.fill_zero_batch({});                                 // none: not a call
  float bf16_dst[2] = {7, 7};
  const fsdp::ZeroSpan tail[] = {{&bf16_dst[1], 4}};
  d.cast_zeroing(bf16_dst, fsdp::DType::bf16, four, fsdp::DType::f32, 2, tail);  // one call for both
  CHECK(bf16_dst[1] == 0.0f);
  std::uint16_t cast_bits[2];
  std::memcpy(cast_bits, bf16_dst, sizeof cast_bits);  // the cast's 2 bf16 values in the first 4 bytes
  CHECK(fsdp::bf16_bits_to_float(cast_bits[1]) == 2.0f);
  d.unscale(a, 4, fsdp::DType::f32, 2.0);
  CHECK(!d.found_nonfinite());
  CHECK(static_cast<float*>(a)[3] == 4.0f);  // (0 + 4) * 0.5 * 2
  CHECK(static_cast<float*>(a)[0] == 0.0f);  // zeroed by the batch: (1 * 0.5 -> 0) * 2
  CHECK(static_cast<float*>(a)[1] == 2.0f);  // between the batch's spans: 2 * 0.5 * 2
  CHECK(static_cast<float*>(b)[0] == 0.5f);  // the batch's empty span left it alone
  d.deallocate(a, 16, fsdp::MemorySpace::device);
  d.deallocate(b, 16, fsdp::MemorySpace::host);
  d.deallocate(nullptr, 0, fsdp::MemorySpace::device);
  const auto& n = d.counts();
  CHECK(n[DeviceOp::allocate] == 2);
  CHECK(n[DeviceOp::deallocate] == 2);
  CHECK(n[DeviceOp::copy] == 2);
  CHECK(n[DeviceOp::fill_zero] == 1);
  CHECK(n[DeviceOp::fill_zero_batch] == 1);
  CHECK(n[DeviceOp::accumulate] == 1);
  CHECK(n[DeviceOp::scale] == 1);
  CHECK(n[DeviceOp::cast] == 1);
  CHECK(n[DeviceOp::cast_zeroing] == 1);
  CHECK(n[DeviceOp::unscale] == 1);
  CHECK(n.total() == 13);
  CHECK(host.stats().live_bytes == 0);  // every call reached the device
  CHECK(name_of(DeviceOp::fill_zero) == "fill_zero");
  d.reset();
  CHECK(d.counts().total() == 0);
}

// Per step, U units, the root kept from forward to backward (so 2U-1 gathers), FSDP's
// schedule: zero_grad zeroes every unit's sharded gradient in one call; each gather allocates the unsharded
// buffer; each backward allocates and zeroes the unsharded gradient the engine adds into,
// and the gradient is reduced straight into the zeroed sharded gradient. Freed: every
// buffer allocated. Over 2 ranks the reduction averages by itself (ReduceOp::avg): no
// scale. Over one rank nothing is exchanged: the gathers are copies, and the engine adds
// into the sharded gradient itself (zeroed by zero_grad, and the whole parameter's): no
// unsharded gradient, no zeroing of one, no copy out of it.
TEST_CASE("a FullShard step's device operations and collectives per unit, f32") {
  for (int world : {1, 2}) {
    CAPTURE(world);
    const auto got = count_step<fsdp::FullPrecision>(world);
    const std::uint64_t U = got.units, gathers = 2 * U - 1;
    const std::uint64_t unsharded_grads = world == 1 ? 0 : U;
    REQUIRE(U == 5);  // 3 blocks, the gain, the root
    CHECK(got.ops[DeviceOp::allocate] == gathers + unsharded_grads);  // gathered parameters, unsharded gradients
    CHECK(got.ops[DeviceOp::deallocate] == gathers + unsharded_grads);
    // zero_grad, every unit's at once; each unit's unsharded gradient (no cast to ride on)
    CHECK(got.ops[DeviceOp::fill_zero_batch] == 1 + unsharded_grads);
    CHECK(got.ops[DeviceOp::fill_zero] == 0);
    CHECK(got.ops[DeviceOp::cast_zeroing] == 0);
    CHECK(got.ops[DeviceOp::cast] == 0);
    CHECK(got.ops[DeviceOp::accumulate] == 0);
    CHECK(got.ops[DeviceOp::scale] == 0);
    CHECK(got.ops[DeviceOp::copy] == (world == 1 ? gathers : 0));  // shard -> full
    CHECK(got.collectives[Collective::all_gather].calls == (world == 2 ? gathers : 0));
    CHECK(got.collectives[Collective::reduce_scatter].calls == (world == 2 ? U : 0));
    CHECK(got.collectives[Collective::all_reduce].calls == 0);
  }
}

// Mixed precision (bf16 parameters, f32 reduction): each gather first casts the f32 shard
// into this rank's slot of the bf16 buffer (gathered in place), and each backward casts the
// bf16 gradient into an f32 buffer of its own, reduced into the sharded gradient; over one
// rank the cast writes the sharded gradient itself (no f32 buffer, nothing else). Each
// backward but the last unit's gathers the next unit ahead (BackwardPre), and that cast
// zeroes the unit's fresh bf16 gradient too (cast_zeroing: one call for both); the last
// unit's gradient is zeroed on its own.
TEST_CASE("a FullShard step's device operations and collectives per unit, bf16 with f32 reduction") {
  using MP = fsdp::MixedPrecision<fsdp::bf16, float>;
  for (int world : {1, 2}) {
    CAPTURE(world);
    const auto got = count_step<MP>(world);
    const std::uint64_t U = got.units, gathers = 2 * U - 1;
    const std::uint64_t f32_grads = world == 2 ? U : 0;
    CHECK(got.ops[DeviceOp::allocate] == gathers + U + f32_grads);  // + unsharded gradients, bf16 (and f32)
    CHECK(got.ops[DeviceOp::deallocate] == gathers + U + f32_grads);
    const std::uint64_t prefetches = U - 1;
    CHECK(got.ops[DeviceOp::cast_zeroing] == prefetches);
    CHECK(got.ops[DeviceOp::cast] == gathers + U - prefetches);
    CHECK(got.ops[DeviceOp::fill_zero_batch] == 1 + U - prefetches);  // zero_grad's, the last unit's gradient
    CHECK(got.ops[DeviceOp::fill_zero] == 0);
    CHECK(got.ops[DeviceOp::scale] == 0);
    CHECK(got.ops[DeviceOp::copy] == 0);  // gathered in place; over one rank nothing to copy either
    CHECK(got.ops[DeviceOp::accumulate] == 0);
    CHECK(got.collectives[Collective::all_gather].calls == (world == 2 ? gathers : 0));
    CHECK(got.collectives[Collective::reduce_scatter].calls == (world == 2 ? U : 0));
  }
}

// Where the collectives cannot average: an f16 sum may overflow, so FSDP's factors split
// the division around it (for 2 ranks: pre 2, post 1: one scale); a divide factor other
// than the world size (here 4 over 2 ranks: pre 2, post 2) is not what avg divides by.
TEST_CASE("f16 reductions, bf16 over 3 ranks and other divide factors keep FSDP's pre/post scaling") {
  const auto f16 = count_step<fsdp::MixedPrecision<fsdp::f16, fsdp::f16>>(2);
  CHECK(f16.ops[DeviceOp::scale] == f16.units);
  // bf16 averages in the collectives only over a power of two ranks (NCCL would multiply
  // by 1/3 rounded to bf16); over 3 ranks: pre 2, post 1.5, two scales.
  const auto bf16_2 = count_step<fsdp::MixedPrecision<fsdp::bf16>>(2);
  CHECK(bf16_2.ops[DeviceOp::scale] == 0);
  const auto bf16_3 = count_step<fsdp::MixedPrecision<fsdp::bf16>>(3);
  CHECK(bf16_3.ops[DeviceOp::scale] == 2 * bf16_3.units);
  const auto f32_3 = count_step<fsdp::FullPrecision>(3);
  CHECK(f32_3.ops[DeviceOp::scale] == 0);
  const auto f32_by_4 = count_step<fsdp::FullPrecision>(2, 4.0);
  CHECK(f32_by_4.ops[DeviceOp::scale] == 2 * f32_by_4.units);
  const auto f32_by_2 = count_step<fsdp::FullPrecision>(2, 2.0);  // the world size, given
  CHECK(f32_by_2.ops[DeviceOp::scale] == 0);
  const auto one_rank_by_3 = count_step<fsdp::FullPrecision>(1, 3.0);  // pre 2, post 1.5, no collective
  CHECK(one_rank_by_3.ops[DeviceOp::scale] == 2 * one_rank_by_3.units);
}

// A hook that frees the sharded gradients after each backward: each step allocates them
// again, and that is all. The reduction writes all of a freed gradient (it counts as
// zero), so it needs no zeroing, and zero_grad finds nothing to zero. Where the engine
// adds into the sharded gradient itself (one rank, full precision) it must be zero
// first: each unit's backward zeroes it (no cast to ride on), and that is all.
TEST_CASE("a freeing post-accumulate-grad hook adds the sharded gradients' allocations, not their zeroing") {
  auto check = [](const StepCounts& keep, const StepCounts& freeing, bool engine_adds_into_it) {
    const std::uint64_t U = keep.units, zeroed_for_engine = engine_adds_into_it ? U : 0;
    CHECK(freeing.ops[DeviceOp::allocate] == keep.ops[DeviceOp::allocate] + U);
    CHECK(freeing.ops[DeviceOp::deallocate] == keep.ops[DeviceOp::deallocate] + U);
    CHECK(freeing.ops[DeviceOp::fill_zero] == 0);
    // zero_grad's is gone
    CHECK(freeing.ops[DeviceOp::fill_zero_batch] == keep.ops[DeviceOp::fill_zero_batch] - 1 + zeroed_for_engine);
    for (DeviceOp op : {DeviceOp::copy, DeviceOp::cast, DeviceOp::cast_zeroing, DeviceOp::scale, DeviceOp::accumulate})
      CHECK(freeing.ops[op] == keep.ops[op]);
    CHECK(freeing.collectives == keep.collectives);
  };
  using MP = fsdp::MixedPrecision<fsdp::bf16, float>;
  for (int world : {1, 2}) {
    CAPTURE(world);
    check(count_step<MP>(world), count_step<MP>(world, 0, fsdp::GradientAfterHook::free), false);
    check(count_step<fsdp::FullPrecision>(world), count_step<fsdp::FullPrecision>(world, 0, fsdp::GradientAfterHook::free),
          world == 1);
  }
}

}  // namespace core_counting_device_test
