// MixedPrecision, OffloadParams and buffers: parity of every combination with an
// unsharded reference that applies the same casts, what computation sees, the bytes
// moved, where memory lives, low-precision gradients, buffer casting, sync_module_states.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include <fsdp/model/grad_scaler.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/reference_training.hpp"

namespace core_mixed_precision_test {
// A host tensor that MixedPrecision can show in another dtype (tensor_traits' rebind with a
// dtype), so that a module may hold an 8-bit float buffer.
struct ShownTensor {
  fsdp::HostTensor t;
  fsdp::DType shown;
  ShownTensor(std::vector<std::int64_t> shape, fsdp::DType d = fsdp::DType::f32) : t(std::move(shape), d), shown(d) {}
};
}  // namespace core_mixed_precision_test

template <>
struct fsdp::tensor_traits<core_mixed_precision_test::ShownTensor> {
  using T = core_mixed_precision_test::ShownTensor;
  static DType dtype(const T& x) { return x.shown; }
  static std::span<const std::int64_t> shape(const T& x) { return x.t.shape(); }
  static void* data(T& x) { return x.t.data(); }
  static DeviceId device(const T&) { return {DeviceKind::cpu, 0}; }
  static void rebind(T& x, void* p) { x.t.rebind(p); }
  static void rebind(T& x, void* p, DType d) { x.t.rebind(p), x.shown = d; }
};

namespace core_mixed_precision_test {

namespace {

using test_support::bitwise_equal;
using test_support::max_difference;
using test_support::Params;
using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

// SGD, not AdamW: Adam's update hardly depends on the gradient's scale, so it would hide
// a reduction that averages wrong.
template <class Strategy, class Precision, class Offload>
Params sharded(int world, int steps) {
  const auto c = config();
  std::vector<Params> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy, Precision, Offload>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < steps; ++s) engine::sharded_step(model, sm, sgd, engine::make_batch(c, s, comm.rank(), 1));
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  return per_rank[0];
}

// The same training unsharded, with the casts MixedPrecision<param, reduce, buffer> makes.
Params reference(fsdp::DType param, fsdp::DType reduce, int world, int steps) {
  const auto c = config();
  engine::Model master(c), compute(c, engine::heap(), param, param);
  engine::Sgd sgd(0.05f);
  for (int s = 0; s < steps; ++s) engine::unsharded_mixed_step(master, compute, sgd, engine::make_batch(c, s, 0, world), reduce);
  Params p;
  for (auto& np : engine::named_parameters(master))
    p.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  return p;
}

// Low precision: the reference adds each sample's float product into a bf16/f16 gradient,
// the sharded run adds per-rank bf16/f16 gradients — the same sums rounded at different
// points. Measured: under 9e-5 after 4 steps; a gradient off by a factor of 2 moves the
// parameters by ~4e-2.
constexpr double low_precision_tolerance = 4e-4;

template <class Strategy, class Offload>
void check_all_precisions() {
  using fsdp::DType;
  const int world = 4, steps = 4;
  // Full precision and a MixedPrecision equal to the parameters' dtype (a no-op): bitwise.
  const Params f32 = reference(DType::f32, DType::f32, world, steps);
  CHECK(bitwise_equal(sharded<Strategy, fsdp::FullPrecision, Offload>(world, steps), f32));
  CHECK(bitwise_equal(sharded<Strategy, fsdp::MixedPrecision<float>, Offload>(world, steps), f32));
  CHECK(max_difference(sharded<Strategy, fsdp::MixedPrecision<fsdp::bf16>, Offload>(world, steps),
                       reference(DType::bf16, DType::bf16, world, steps)) <= low_precision_tolerance);
  CHECK(max_difference(sharded<Strategy, fsdp::MixedPrecision<fsdp::f16>, Offload>(world, steps),
                       reference(DType::f16, DType::f16, world, steps)) <= low_precision_tolerance);
  CHECK(max_difference(sharded<Strategy, fsdp::MixedPrecision<fsdp::bf16, float>, Offload>(world, steps),
                       reference(DType::bf16, DType::f32, world, steps)) <= low_precision_tolerance);
}

}  // namespace

TEST_CASE_TEMPLATE("parity of every precision, with and without offload", Strategy, fsdp::FullShard, fsdp::ShardGradOp,
                   fsdp::NoShard) {
  SUBCASE("NoOffload") { check_all_precisions<Strategy, fsdp::NoOffload>(); }
  SUBCASE("OffloadParams") { check_all_precisions<Strategy, fsdp::OffloadParams>(); }
}

TEST_CASE("computation sees Param; the master shard keeps its dtype") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    engine::Model fresh(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(model, comm, device, engine::Wrap{});
    for (auto& v : sm.shards()) {
      CHECK(v.dtype == fsdp::DType::f32);
      CHECK(v.grad_dtype == fsdp::DType::f32);
    }
    auto& unit = sm.unit("blocks.0");
    {
      auto s = unit.forward_scope();
      const auto& w = model.blocks[0].fc1.weight;
      REQUIRE(w.dtype() == fsdp::DType::bf16);
      for (std::int64_t i = 0; i < w.numel(); ++i)
        REQUIRE(w.get(i) == fsdp::bf16_bits_to_float(fsdp::float_to_bf16_bits(fresh.blocks[0].fc1.weight[i])));
    }
    {
      auto s = unit.backward_scope();
      CHECK(model.blocks[0].fc1.weight_grad.dtype() == fsdp::DType::bf16);
    }
    sm.finish_backward();
    auto s = unit.summon_full_params();  // full parameters in their own dtype, unrounded
    CHECK(model.blocks[0].fc1.weight.dtype() == fsdp::DType::f32);
    CHECK(std::memcmp(model.blocks[0].fc1.weight.data(), fresh.blocks[0].fc1.weight.data(), 4 * fresh.blocks[0].fc1.weight.numel()) == 0);
  });
}

TEST_CASE("bytes moved: bf16 parameters halve the all-gathers; Reduce sets the reduce-scatter's") {
  const auto c = config();
  auto step_counts = [&](auto precision) {
    using P = decltype(precision);
    fsdp::CollectiveCounts counts;
    fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
      Counting counted(comm);
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch, P>(model, counted, device, engine::Wrap{});
      engine::Sgd sgd(0.01f);
      engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
      counted.reset();
      engine::sharded_step(model, sm, sgd, engine::make_batch(c, 1, comm.rank(), 1));
      if (comm.rank() == 0) counts = counted.counts();  // no order check of its own: tags
    });
    return counts;
  };
  using fsdp::Collective;
  const auto full = step_counts(fsdp::FullPrecision{});
  const auto bf16 = step_counts(fsdp::MixedPrecision<fsdp::bf16>{});
  const auto bf16_f32 = step_counts(fsdp::MixedPrecision<fsdp::bf16, float>{});
  CHECK(full[Collective::all_gather].bytes > 0);
  CHECK(bf16[Collective::all_gather].calls == full[Collective::all_gather].calls);
  CHECK(2 * bf16[Collective::all_gather].bytes == full[Collective::all_gather].bytes);
  CHECK(2 * bf16[Collective::reduce_scatter].bytes == full[Collective::reduce_scatter].bytes);
  CHECK(2 * bf16_f32[Collective::all_gather].bytes == full[Collective::all_gather].bytes);
  CHECK(bf16_f32[Collective::reduce_scatter].bytes == full[Collective::reduce_scatter].bytes);
}

TEST_CASE("OffloadParams: sharded parameters and gradients live in host space; the device peak drops by them") {
  const auto c = config();
  const int world = 4;
  auto run = [&](auto offload) {
    using O = decltype(offload);
    std::vector<fsdp::MemoryStats> dev(world), host(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, O>(model, comm, device, engine::Wrap{});
      engine::Sgd sgd(0.01f);
      for (int s = 0; s < 3; ++s) engine::sharded_step(model, sm, sgd, engine::make_batch(c, s, comm.rank(), 1));
      dev[comm.rank()] = device.stats(fsdp::MemorySpace::device);
      host[comm.rank()] = device.stats(fsdp::MemorySpace::host);
    });
    return std::pair{dev, host};
  };
  const auto [dev_on, host_on] = run(fsdp::OffloadParams{});
  const auto [dev_off, host_off] = run(fsdp::NoOffload{});
  std::size_t shards = 0;  // sharded parameters + gradients of every unit, per rank
  for (auto n : test_support::unit_numels(c)) shards += 2 * 4 * static_cast<std::size_t>((n + world - 1) / world);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(host_off[r].peak_bytes == 0);
    CHECK(host_on[r].live_bytes == shards);
    CHECK(host_on[r].peak_bytes == shards);  // after zero_grad the reduced gradient is copied straight in
    CHECK(dev_on[r].live_bytes == 0);
    CHECK(dev_off[r].live_bytes == shards);
    CHECK(dev_off[r].peak_bytes - dev_on[r].peak_bytes == shards);
  }
}

TEST_CASE("keep_low_precision_grads keeps the sharded gradient in Reduce") {
  const auto c = config();
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    engine::Model a(c), b(c);
    fsdp::HostDevice device;
    auto kept_f32 = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(a, comm, device, engine::Wrap{});
    auto kept_low = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, fsdp::bf16, fsdp::bf16, true>>(
        b, comm, device, engine::Wrap{});
    auto backward = [&](engine::Model& m, fsdp::ShardedModel& sm) {
      sm.zero_grad();
      engine::UnitHooks hooks{sm};
      const auto batch = engine::make_batch(c, 0, comm.rank(), 1);
      engine::Mat dout;
      engine::mse(m.forward(batch.x, hooks), batch.y, dout);
      m.backward(dout, hooks);
      sm.finish_backward();
    };
    backward(a, kept_f32);
    backward(b, kept_low);
    REQUIRE(kept_f32.shards().size() == kept_low.shards().size());
    for (std::size_t i = 0; i < kept_low.shards().size(); ++i) {
      const auto& hi = kept_f32.shards()[i];
      const auto& lo = kept_low.shards()[i];
      CHECK(lo.grad_dtype == fsdp::DType::bf16);
      CHECK(lo.dtype == fsdp::DType::f32);  // the master parameters stay f32
      // The same bf16 reduction either way; the f32 one is its exact widening.
      for (std::int64_t k = 0; k < lo.numel; ++k)
        REQUIRE(fsdp::bf16_bits_to_float(static_cast<const std::uint16_t*>(lo.grad)[k]) == static_cast<const float*>(hi.grad)[k]);
    }
    CHECK_THROWS_AS(engine::slots(kept_low), fsdp::Error);  // the engine's optimizers step on f32 gradients only
  });
}

TEST_CASE("buffers: computed with in Buffer, shown in their own dtype when summoned, edits kept with writeback") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    engine::Model fresh(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float, fsdp::f16>>(model, comm, device, engine::Wrap{});
    const auto& scale = model.gain.scale;
    REQUIRE(scale.dtype() == fsdp::DType::f16);
    for (std::int64_t i = 0; i < scale.numel(); ++i)
      CHECK(scale.get(i) == fsdp::f16_bits_to_float(fsdp::float_to_f16_bits(fresh.gain.scale[i])));
    auto& gain = sm.unit("gain");
    {
      auto s = gain.summon_full_params();
      REQUIRE(model.gain.scale.dtype() == fsdp::DType::f32);
      // Shown from the f16 copy training uses: the f16 value, widened.
      CHECK(model.gain.scale[0] == fsdp::f16_bits_to_float(fsdp::float_to_f16_bits(fresh.gain.scale[0])));
      model.gain.scale[0] = 3.0f;
    }
    CHECK(model.gain.scale.get(0) != 3.0f);  // no writeback: dropped
    {
      auto s = gain.summon_full_params(/*writeback=*/true);
      model.gain.scale[0] = 3.0f;
    }
    CHECK(model.gain.scale.dtype() == fsdp::DType::f16);
    CHECK(model.gain.scale.get(0) == 3.0f);
  });
}

// A module with an e8m0 buffer (power-of-two scales) beside an f32 one.
struct ScaledLayer {
  ShownTensor w{{4}}, gw{{4}}, gain{{2}}, scales{{3}, fsdp::DType::e8m0};
  template <class F> void visit_parameters(F&& f) { f("w", w, gw); }
  template <class F> void visit_buffers(F&& f) {
    f("gain", gain);
    f("scales", scales);
  }
};

TEST_CASE("buffers of an 8-bit float dtype stay the engine's, uncast, under a Buffer dtype") {
  // 2^-30, 1 and 2^16 (e8m0 exponents 97, 127, 143): f16 would flush the first to zero and
  // overflow the last.
  const std::uint8_t scales[3] = {97, 127, 143};
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    ScaledLayer m;
    static_cast<float*>(m.gain.t.data())[0] = 1.5f;
    std::memcpy(m.scales.t.data(), scales, 3);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float, fsdp::f16>>(m, comm, device);
    CHECK(m.gain.shown == fsdp::DType::f16);  // a compute dtype: cast to Buffer
    CHECK(fsdp::f16_bits_to_float(static_cast<const std::uint16_t*>(m.gain.t.data())[0]) == 1.5f);
    CHECK(m.scales.shown == fsdp::DType::e8m0);
    CHECK(std::memcmp(m.scales.t.data(), scales, 3) == 0);
  });
}

TEST_CASE("sync_module_states starts every rank from rank 0's parameters and buffers") {
  for (bool sync : {false, true}) {
    CAPTURE(sync);
    std::vector<Params> got(3);
    std::vector<float> scale0(3);
    fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
      auto c = config();
      c.seed = 1 + static_cast<std::uint64_t>(comm.rank());  // every rank initialises differently
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.sync_module_states = sync});
      scale0[comm.rank()] = model.gain.scale[0];
      got[comm.rank()] = engine::gather_full_parameters(model, sm);
    });
    auto c0 = config();
    const Params rank0 = [&] {
      engine::Model m(c0);
      Params p;
      for (auto& np : engine::named_parameters(m))
        p.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
      return p;
    }();
    if (sync) {
      for (int r = 0; r < 3; ++r) CHECK(got[r] == rank0);
      CHECK(scale0[1] == scale0[0]);
      CHECK(scale0[2] == scale0[0]);
    } else {
      CHECK(got[0] != rank0);  // each shard came from its own rank's initialisation
      CHECK(scale0[1] != scale0[0]);
    }
  }
}

TEST_CASE("fp16 with the sharded loss scaler: trains like unscaled fp16, and skips the step on overflow everywhere") {
  const auto c = config();
  const int world = 4, steps = 4;
  // Scaling the loss by a power of two scales every fp16 gradient exactly (short of
  // overflow), and unscaling the sharded f32 gradient undoes it exactly.
  for (double init : {1024.0, 1e30}) {  // 1e30 overflows fp16: every step is skipped and the scale backs off
    CAPTURE(init);
    std::vector<Params> per_rank(world);
    std::vector<int> stepped(world, 0);
    std::vector<double> final_scale(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::f16>>(model, comm, device, engine::Wrap{});
      fsdp::ShardedGradScaler scaler(comm, fsdp::GradScalerOptions{.init_scale = init});
      engine::Sgd sgd(0.05f);
      for (int s = 0; s < steps; ++s)
        if (engine::sharded_scaled_step(model, sm, sgd, scaler, engine::make_batch(c, s, comm.rank(), 1)).stepped)
          ++stepped[comm.rank()];
      final_scale[comm.rank()] = scaler.scale();
      per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
    });
    for (int r = 1; r < world; ++r) {
      CHECK(stepped[r] == stepped[0]);
      CHECK(final_scale[r] == final_scale[0]);
    }
    if (init == 1024.0) {
      CHECK(stepped[0] == steps);
      CHECK(max_difference(per_rank[0], reference(fsdp::DType::f16, fsdp::DType::f16, world, steps)) <= low_precision_tolerance);
    } else {
      CHECK(stepped[0] == 0);
      CHECK(final_scale[0] == init / 16);  // four back-offs by half
      CHECK(bitwise_equal(per_rank[0], test_support::reference_params(c, 0, world)));  // untouched
    }
  }
}

}  // namespace core_mixed_precision_test
