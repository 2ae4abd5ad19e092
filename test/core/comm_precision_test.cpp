// CommPrecision (fsdp/policy/policies.hpp): collectives in bf16 / f16 while the engine computes,
// and accumulates into, f32. What the engine sees, the bytes each step moves, the loss
// deviation against f32 communication, the per-rank peak to the byte, and how it composes
// with the other policies.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/reference_training.hpp"

namespace core_comm_precision_test {

namespace {

using test_support::bitwise_equal;
using test_support::max_difference;
using test_support::Params;
using fsdp::Collective;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

using Run = test_support::SgdRun;

template <class... Ps>
Run train(int world, int steps) {
  return test_support::sgd_run<Ps...>(config(), world, steps);
}

double max_loss_deviation(const Run& a, const Run& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  double worst = 0;
  for (std::size_t s = 0; s < a.losses.size(); ++s) worst = std::max(worst, std::fabs(a.losses[s] - b.losses[s]));
  return worst;
}

template <class... Ps>
fsdp::CollectiveCounts step_counts(int world) {
  return test_support::step_collectives<Ps...>(config(), world);
}

float bf16_rounded(float v) { return fsdp::bf16_bits_to_float(fsdp::float_to_bf16_bits(v)); }

}  // namespace

TEST_CASE("the policy composes with the others in any order; off is the default") {
  using A = fsdp::Policies<fsdp::CommPrecision<fsdp::bf16>, fsdp::FullShard, fsdp::OffloadParams>;
  using B = fsdp::Policies<fsdp::OffloadParams, fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16>>;
  static_assert(std::is_same_v<A::comm_precision, B::comm_precision>);
  static_assert(std::is_same_v<A::strategy, B::strategy> && std::is_same_v<A::cpu_offload, B::cpu_offload>);
  static_assert(A::comm_precision::gather == fsdp::DType::bf16 && A::comm_precision::reduce == fsdp::DType::bf16);
  static_assert(!fsdp::Policies<fsdp::FullShard>::comm_precision::enabled);
  using C = fsdp::Policies<fsdp::CommPrecision<fsdp::bf16, fsdp::f16>, fsdp::MixedPrecision<float>>;
  CHECK(C::comm_precision::reduce == fsdp::DType::f16);
}

TEST_CASE("the engine sees f32 parameters holding the bf16-rounded values and accumulates f32 gradients") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    engine::Model fresh(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16>>(model, comm, device, engine::Wrap{});
    for (auto& v : sm.shards()) {
      CHECK(v.dtype == fsdp::DType::f32);
      CHECK(v.grad_dtype == fsdp::DType::f32);
    }
    auto& unit = sm.unit("blocks.0");
    const auto& w = model.blocks[0].fc1.weight;
    bool some_value_rounded = false;
    {
      auto s = unit.forward_scope();
      REQUIRE(w.dtype() == fsdp::DType::f32);
      for (std::int64_t i = 0; i < w.numel(); ++i) {
        REQUIRE(w[i] == bf16_rounded(fresh.blocks[0].fc1.weight[i]));
        some_value_rounded = some_value_rounded || w[i] != fresh.blocks[0].fc1.weight[i];
      }
    }
    CHECK(some_value_rounded);  // else the check above proves nothing
    {
      auto s = unit.backward_scope();
      CHECK(model.blocks[0].fc1.weight_grad.dtype() == fsdp::DType::f32);
    }
    sm.finish_backward();
    auto s = unit.summon_full_params();  // full parameters in their own dtype, unrounded
    CHECK(std::memcmp(w.data(), fresh.blocks[0].fc1.weight.data(), 4 * static_cast<std::size_t>(w.numel())) == 0);
  });
}

TEST_CASE("bytes moved per step: bf16 communication halves the all-gathers and reduce-scatters, with the same calls") {
  const int world = 4;
  const auto f32 = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch>(world);
  const auto bf16 = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::CommPrecision<fsdp::bf16>>(world);
  const auto gather_only = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::CommPrecision<fsdp::bf16, float>>(world);
  // What MixedPrecision<bf16> moves, without making the engine compute in bf16.
  const auto mixed = step_counts<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::MixedPrecision<fsdp::bf16>>(world);
  REQUIRE(f32[Collective::all_gather].bytes > 0);
  for (auto kind : {Collective::all_gather, Collective::reduce_scatter}) {
    CHECK(bf16[kind].calls == f32[kind].calls);
    CHECK(2 * bf16[kind].bytes == f32[kind].bytes);
    CHECK(bf16[kind] == mixed[kind]);
  }
  CHECK(2 * gather_only[Collective::all_gather].bytes == f32[Collective::all_gather].bytes);
  CHECK(gather_only[Collective::reduce_scatter] == f32[Collective::reduce_scatter]);

  // NoShard gathers nothing: only the reduce dtype applies, to its all-reduce.
  const auto ddp = step_counts<fsdp::NoShard>(world);
  const auto ddp_bf16 = step_counts<fsdp::NoShard, fsdp::CommPrecision<fsdp::bf16>>(world);
  CHECK(ddp_bf16[Collective::all_gather].calls == 0);
  CHECK(ddp_bf16[Collective::all_reduce].calls == ddp[Collective::all_reduce].calls);
  CHECK(2 * ddp_bf16[Collective::all_reduce].bytes == ddp[Collective::all_reduce].bytes);
}

TEST_CASE("loss deviation against f32 communication stays small over 20 steps, for bf16 and f16") {
  const int world = 8, steps = 20;  // 8 ranks: f16 reductions use the pre/post divide factors (2 and 4)
  const Run f32 = train<fsdp::FullShard>(world, steps);
  const Run bf16 = train<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16>>(world, steps);
  const Run f16 = train<fsdp::FullShard, fsdp::CommPrecision<fsdp::f16>>(world, steps);
  const Run hybrid = [&] {
    // The same with HybridShard on a 2 x 4 mesh: the replicate all-reduce in bf16 too.
    const auto c = config();
    Run run;
    std::vector<Params> per_rank(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      fsdp::DeviceMesh mesh(comm, {2, 4});
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::HybridShard, fsdp::CommPrecision<fsdp::bf16>>(model, mesh, device, engine::Wrap{});
      engine::Sgd sgd(0.05f);
      for (int s = 0; s < steps; ++s) engine::sharded_step(model, sm, sgd, engine::make_batch(c, s, comm.rank(), 1));
      per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
    });
    for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
    run.params = per_rank[0];
    return run;
  }();
  // Measured: the loss within 3.8e-4 of f32's with bf16 (8.8e-5 with f16), parameters
  // within 7.7e-4 (4.7e-4); the hybrid run as close as the flat one.
  CHECK(max_loss_deviation(bf16, f32) > 0);  // the rounding is real
  CHECK(max_loss_deviation(bf16, f32) <= 1e-3);
  CHECK(max_loss_deviation(f16, f32) <= 1e-3);
  CHECK(max_difference(bf16.params, f32.params) <= 5e-3);
  CHECK(max_difference(f16.params, f32.params) <= 5e-3);
  CHECK(max_difference(hybrid.params, f32.params) <= 5e-3);
  MESSAGE("max |loss - f32 loss| over ", steps, " steps: bf16 ", max_loss_deviation(bf16, f32), ", f16 ",
          max_loss_deviation(f16, f32), "; max |parameter - f32's|: bf16 ", max_difference(bf16.params, f32.params), ", f16 ",
          max_difference(f16.params, f32.params), ", hybrid bf16 ", max_difference(hybrid.params, f32.params));
}

TEST_CASE("prefetching and offloading change where bytes sit, not the result") {
  const int world = 4, steps = 3;
  using B = fsdp::CommPrecision<fsdp::bf16>;
  const Run plain = train<fsdp::FullShard, fsdp::NoBackwardPrefetch, B>(world, steps);
  CHECK(bitwise_equal(train<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch, B>(world, steps).params, plain.params));
  CHECK(bitwise_equal(train<B, fsdp::OffloadParams, fsdp::FullShard>(world, steps).params, plain.params));
  CHECK(bitwise_equal(train<fsdp::ShardGradOp, B>(world, steps).params, plain.params));
}

// The FullShard formula of sharded_memory_test.cpp, with bf16 collectives: the sharded
// parameters and gradients stay f32, so the steady state is unchanged. A gathered unit
// needs its bf16 buffer (P/2) next to the f32 one (P) while it is widened; backward's peak,
// 2*P_root + 2*P_layer with every gradient bound, is above that, so training peaks where
// f32 communication does, and a forward-only pass 0.5*P_layer higher.
TEST_CASE("per-rank peak with bf16 communication equals the formula, to the byte") {
  engine::ModelConfig c;
  c.blocks = 4;
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    std::vector<fsdp::MemoryStats> after_setup(world), after_train(world), after_eval(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::CommPrecision<fsdp::bf16>>(model, comm, device,
                                                                                                       engine::Wrap{});
      after_setup[comm.rank()] = device.stats();
      engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
      engine::AdamW opt({}, alloc);
      for (int s = 0; s < 3; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank(), 1));
      after_train[comm.rank()] = device.stats();
      device.reset_peak();
      engine::UnitHooks hooks{sm};
      model.forward(engine::make_batch(c, 9, comm.rank(), 1).x, hooks);
      sm.reshard();
      after_eval[comm.rank()] = device.stats();
    });
    // Unit sizes from the model's configuration (root, blocks, gain), 4-byte masters.
    const auto units = test_support::unit_numels(c);
    auto padded = [&](std::int64_t n) { return static_cast<std::size_t>((n + world - 1) / world * world) * 4; };
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      std::size_t params_grads = 0, adam = 0, max_layer = 0;
      for (std::size_t u = 0; u < units.size(); ++u) {
        const std::int64_t shard = (units[u] + world - 1) / world;
        params_grads += 2 * static_cast<std::size_t>(shard) * 4;
        adam += 2 * 4 * static_cast<std::size_t>(std::clamp<std::int64_t>(units[u] - r * shard, 0, shard));
        if (u > 0) max_layer = std::max(max_layer, padded(units[u]));
      }
      const std::size_t root = padded(units[0]), steady = params_grads + adam;
      CHECK(after_setup[r].peak_bytes == params_grads);
      CHECK(after_train[r].live_bytes == steady);
      CHECK(after_train[r].peak_bytes == steady + 2 * root + 2 * max_layer);
      CHECK(after_eval[r].live_bytes == steady);
      CHECK(after_eval[r].peak_bytes == steady + std::max(root + root / 2, root + max_layer + max_layer / 2));
    }
  }
}

namespace {

// Gradient accumulation under CommPrecision<bf16>: micro-batch gradients chosen so that a
// bf16 running sum differs from the f32 one. Every element of every rank gets 1, then
// 2^-9 three times: in bf16 1 + 2^-9 rounds back to 1 each time; in f32 the sum is exact.
constexpr float tiny = 1.0f / 512;
constexpr float micro_grads[] = {1.0f, tiny, tiny, tiny};

enum class Accumulation { keep_unsharded, reduce_every_microbatch, defer_all_reduce };

// The sharded gradient of one engine::Linear (the whole model one unit) after the four
// micro-batches, the last synchronized; every rank's valid elements, in order.
template <class Strategy>
std::vector<float> accumulated_gradient(int world, fsdp::MeshShape mesh, Accumulation how) {
  std::vector<std::vector<float>> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Linear layer(3, 2, 7);
    fsdp::HostDevice device;
    std::optional<fsdp::DeviceMesh<fsdp::ThreadComm>> m;
    fsdp::ShardedModel sm;
    if constexpr (Strategy::hybrid) {
      m.emplace(comm, mesh);
      sm = fsdp::shard<Strategy, fsdp::CommPrecision<fsdp::bf16>>(layer, *m, device);
    } else {
      sm = fsdp::shard<Strategy, fsdp::CommPrecision<fsdp::bf16>>(layer, comm, device);
    }
    if (how == Accumulation::reduce_every_microbatch) sm.set_gradient_sync_mode(fsdp::GradientSyncMode::reduce_every_microbatch);
    auto& unit = sm.unit("");
    sm.zero_grad();
    for (std::size_t j = 0; j < std::size(micro_grads); ++j) {
      const bool last = j + 1 == std::size(micro_grads);
      if (how == Accumulation::defer_all_reduce) sm.set_requires_all_reduce(last);
      else sm.set_requires_gradient_sync(last);
      {
        auto s = unit.backward_scope();  // the engine adds this micro-batch's gradient
        for (std::int64_t i = 0; i < layer.weight_grad.numel(); ++i) layer.weight_grad[i] += micro_grads[j];
        for (std::int64_t i = 0; i < layer.bias_grad.numel(); ++i) layer.bias_grad[i] += micro_grads[j];
      }
      sm.finish_backward();
    }
    for (const auto& v : sm.shards()) {
      REQUIRE(v.grad_dtype == fsdp::DType::f32);
      const auto* g = static_cast<const float*>(v.grad);
      per_rank[comm.rank()].assign(g, g + v.numel);
    }
  });
  std::vector<float> all;
  for (const auto& r : per_rank) all.insert(all.end(), r.begin(), r.end());
  return all;
}

}  // namespace

TEST_CASE("accumulation over micro-batches is in f32: only the synchronized reduction rounds to bf16") {
  // Every rank contributes the same, so the average over ranks is each rank's own sum. The
  // pre/post divide factors are powers of two: exact.
  float f32_sum = 0, bf16_running_sum = 0;
  for (float g : micro_grads) f32_sum += g, bf16_running_sum = bf16_rounded(bf16_running_sum + g);
  const float once_rounded = bf16_rounded(f32_sum);
  float each_rounded = 0;  // each micro-batch reduced (rounded) alone, then added in f32
  for (float g : micro_grads) each_rounded += bf16_rounded(g);
  REQUIRE(once_rounded == 1.0078125f);
  REQUIRE(bf16_running_sum == 1.0f);  // what summing in the wire dtype gives: the test can fail
  REQUIRE(each_rounded == f32_sum);
  auto check_all = [](const std::vector<float>& got, float want) {
    REQUIRE(!got.empty());  // weight 2x3 and bias 2: every rank's shard of them (replicas included)
    REQUIRE(got.size() % 8 == 0);
    for (float g : got) CHECK(g == want);
  };
  SUBCASE("keep_unsharded (no_sync): the kept unsharded gradient sums in f32") {
    check_all(accumulated_gradient<fsdp::FullShard>(2, {1, 2}, Accumulation::keep_unsharded), once_rounded);
    check_all(accumulated_gradient<fsdp::NoShard>(2, {1, 2}, Accumulation::keep_unsharded), once_rounded);
    check_all(accumulated_gradient<fsdp::HybridShard>(4, {2, 2}, Accumulation::keep_unsharded), once_rounded);
  }
  SUBCASE("reduce_every_microbatch: each reduction rounds alone, the sharded gradient sums in f32") {
    check_all(accumulated_gradient<fsdp::FullShard>(2, {1, 2}, Accumulation::reduce_every_microbatch), each_rounded);
    check_all(accumulated_gradient<fsdp::NoShard>(2, {1, 2}, Accumulation::reduce_every_microbatch), each_rounded);
  }
  SUBCASE("HybridShard's deferred all-reduce: the waiting shard-group sums add in f32") {
    check_all(accumulated_gradient<fsdp::HybridShard>(4, {2, 2}, Accumulation::defer_all_reduce), once_rounded);
  }
}

}  // namespace core_comm_precision_test
