// fsdp::clip_grad_norm: the sharded total norm against the unsharded model's gradient norm
// for every strategy, clipping to max_norm, a clipped training run against unsharded
// clipped training, low-precision and offloaded gradients, non-finite gradients, misuse.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <fsdp/model/clip_grad_norm.hpp>
#include <fsdp/testing/counting_communicator.hpp>
#include <fsdp/testing/counting_device.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/rank_errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_clip_grad_norm_test {

namespace {

using test_support::max_difference;
using test_support::Params;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNoClip = 1e30;  // a max_norm no gradient reaches: measures without clipping

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13, hidden 7: sizes no group size divides
  c.blocks = 3;
  return c;
}

double norm_of(const std::vector<double>& g, double p) {
  double acc = 0;
  for (double v : g) acc = std::isinf(p) ? std::max(acc, std::fabs(v)) : acc + std::pow(std::fabs(v), p);
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}

// One backward of the unsharded model on the global batch of step `step` (what `world`
// ranks with one sample each see together); returns every gradient element.
std::vector<double> unsharded_backward(engine::Model& m, int world, int step) {
  engine::zero_grads(m);
  const auto batch = engine::make_batch(m.config, step, 0, world);
  engine::Mat dout;
  engine::mse(m.forward(batch.x), batch.y, dout);
  m.backward(dout);
  std::vector<double> g;
  for (auto& p : engine::named_parameters(m))
    for (std::int64_t i = 0; i < p.grad->numel(); ++i) g.push_back(p.grad->get(i));
  return g;
}

std::vector<double> reference_grads(int world) {
  engine::Model m(config());
  return unsharded_backward(m, world, 0);
}

// This rank's gradient shards, bytes as they are (HostDevice: plain host memory).
std::vector<std::vector<std::byte>> grad_bytes(const fsdp::ShardedModel& sm) {
  std::vector<std::vector<std::byte>> out;
  for (const auto& v : sm.shards()) {
    const auto* p = static_cast<const std::byte*>(v.grad);
    out.emplace_back(p, p + v.numel * static_cast<std::int64_t>(fsdp::size_of(v.grad_dtype)));
  }
  return out;
}

// Whether every f32 element of `after` is the one in `before` times `factor`, multiplied in
// double and rounded once.
bool scaled_by(const std::vector<std::vector<std::byte>>& before, const std::vector<std::vector<std::byte>>& after,
               double factor) {
  if (before.size() != after.size()) return false;
  for (std::size_t s = 0; s < after.size(); ++s) {
    if (before[s].size() != after[s].size()) return false;
    for (std::size_t i = 0; i < after[s].size(); i += 4) {
      float was, now;
      std::memcpy(&was, before[s].data() + i, 4);
      std::memcpy(&now, after[s].data() + i, 4);
      if (now != static_cast<float>(static_cast<double>(was) * factor)) return false;
    }
  }
  return true;
}

// Shards the model with S (and policies Ps) over a mesh of `shape`, runs one backward with
// sample r on rank r, and calls `fn(sm, mesh, device, comm)` on every rank.
template <class S, class... Ps, class Fn>
void after_backward(fsdp::MeshShape shape, Fn fn) {
  const auto c = config();
  fsdp::ThreadGroup(shape.size()).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, shape);
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<S, Ps...>(model, mesh, device, engine::Wrap{});
    engine::sharded_forward_backward(model, sm, engine::make_batch(c, 0, comm.rank(), 1));
    fn(sm, mesh, device, comm);
  });
}

// The total norm on every rank, for each norm type.
template <class S>
void check_norms(fsdp::MeshShape shape, double tolerance) {
  CAPTURE(S::name);
  CAPTURE(shape.str());
  const std::vector<double> types{2.0, kInf, 1.0, 3.0};
  std::vector<std::vector<double>> got(types.size(), std::vector<double>(shape.size()));
  after_backward<S>(shape, [&](fsdp::ShardedModel& sm, auto& mesh, auto&, fsdp::ThreadComm& comm) {
    const auto before = grad_bytes(sm);
    for (std::size_t k = 0; k < types.size(); ++k) {
      const auto r = fsdp::clip_grad_norm(sm, mesh, {.max_norm = kNoClip, .norm_type = types[k]});
      CHECK_FALSE(r.clipped);
      CHECK(r.coefficient == 1.0);
      got[k][comm.rank()] = r.total_norm;
    }
    CHECK(grad_bytes(sm) == before);  // below max_norm: untouched
    // Above it, every shard on every rank is scaled: replicas too, or they would diverge.
    const auto r = fsdp::clip_grad_norm(sm, mesh, {.max_norm = 0.5 * got[0][comm.rank()]});
    REQUIRE(r.clipped);
    CHECK(scaled_by(before, grad_bytes(sm), r.coefficient));
  });
  const auto ref = reference_grads(shape.size());
  for (std::size_t k = 0; k < types.size(); ++k) {
    CAPTURE(types[k]);
    for (int r = 1; r < shape.size(); ++r) CHECK(got[k][r] == got[k][0]);  // identical on every rank
    const double want = norm_of(ref, types[k]);
    CHECK(want > 0.1);  // a real gradient, not zeros
    CHECK(std::fabs(got[k][0] - want) <= tolerance * want);
  }
}

// On 1, 2 or 4 ranks the sharded gradients are bitwise the unsharded ones (strategies_test;
// dividing by a power of two is exact): only the order of the double sums differs, ~1e-15.
// On 3 ranks the average rounds differently from the whole-batch mean (measured: 1.1e-7
// relative at most), and hybrid adds per shard group first, then across replicas (6e-10).
// An element missed or counted twice moves the norm by far more than either.
constexpr double same_grads_tolerance = 1e-12, f32_ulps_tolerance = 1e-6;

// Clipped SGD, unsharded: the norm in double, each gradient multiplied in double and
// rounded once to f32, as the library does.
Params reference_clipped(int world, int steps, double max_norm, bool clip) {
  engine::Model m(config());
  engine::Sgd sgd(0.05f);
  for (int s = 0; s < steps; ++s) {
    const double coef = max_norm / (norm_of(unsharded_backward(m, world, s), 2.0) + 1e-6);
    if (clip && coef < 1)
      for (auto& p : engine::named_parameters(m))
        for (std::int64_t i = 0; i < p.grad->numel(); ++i) p.grad->data()[i] = static_cast<float>(p.grad->data()[i] * coef);
    sgd.step(engine::slots(m));
  }
  Params out;
  for (auto& np : engine::named_parameters(m))
    out.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  return out;
}

}  // namespace

TEST_CASE("the sharded total norm is the unsharded model's gradient norm, on every rank") {
  SUBCASE("FullShard on 1 rank") { check_norms<fsdp::FullShard>({1, 1}, same_grads_tolerance); }
  SUBCASE("FullShard on 2 ranks") { check_norms<fsdp::FullShard>({1, 2}, same_grads_tolerance); }
  SUBCASE("FullShard on 3 ranks") { check_norms<fsdp::FullShard>({1, 3}, f32_ulps_tolerance); }
  SUBCASE("FullShard on 4 ranks") { check_norms<fsdp::FullShard>({1, 4}, same_grads_tolerance); }
  SUBCASE("ShardGradOp on 4 ranks") { check_norms<fsdp::ShardGradOp>({1, 4}, same_grads_tolerance); }
  SUBCASE("NoShard on 3 ranks: replicas counted once") { check_norms<fsdp::NoShard>({1, 3}, f32_ulps_tolerance); }
  SUBCASE("HybridShard on a 2x2 mesh") { check_norms<fsdp::HybridShard>({2, 2}, f32_ulps_tolerance); }
  SUBCASE("HybridShardZero2 on a 2x2 mesh") { check_norms<fsdp::HybridShardZero2>({2, 2}, f32_ulps_tolerance); }
}

TEST_CASE("clipping scales every shard to max_norm; one collective; host and device multiply agree") {
  using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;
  struct CountingDevice : fsdp::HostDevice {
    int unscales = 0, waits = 0;
    void unscale(void* p, std::size_t n, fsdp::DType t, double f) { ++unscales, fsdp::HostDevice::unscale(p, n, t, f); }
    bool found_nonfinite() { return ++waits, fsdp::HostDevice::found_nonfinite(); }
  };
  const auto c = config();
  for (double type : {2.0, kInf}) {
    CAPTURE(type);
    fsdp::ThreadGroup(3).run([&](fsdp::ThreadComm& comm) {
      Counting counted(comm);
      engine::Model a(c), b(c);
      CountingDevice device;
      auto host_sm = fsdp::shard<fsdp::FullShard>(a, counted, device, engine::Wrap{});
      auto dev_sm = fsdp::shard<fsdp::FullShard>(b, counted, device, engine::Wrap{});
      for (auto* m : {&a, &b})
        engine::sharded_forward_backward(*m, m == &a ? host_sm : dev_sm, engine::make_batch(c, 0, comm.rank(), 1));
      const auto before = grad_bytes(host_sm);
      const double total = fsdp::clip_grad_norm(host_sm, comm, {.max_norm = kNoClip, .norm_type = type}).total_norm;
      const double max_norm = 0.3 * total;

      counted.reset();
      const auto on_host = fsdp::clip_grad_norm(host_sm, counted, {.max_norm = max_norm, .norm_type = type});
      CHECK(counted.counts()[fsdp::Collective::all_gather].calls == 1);
      std::uint64_t calls = 0;
      for (const auto& e : counted.counts().by_kind) calls += e.calls;
      CHECK(calls == 1);
      CHECK(on_host.clipped);
      CHECK(on_host.total_norm == total);  // the norm before clipping
      CHECK(on_host.coefficient == doctest::Approx(0.3).epsilon(1e-5));
      const auto after = grad_bytes(host_sm);
      CHECK(scaled_by(before, after, on_host.coefficient));
      const auto post = fsdp::clip_grad_norm(host_sm, comm, {.max_norm = kNoClip, .norm_type = type});
      CHECK(post.total_norm == doctest::Approx(max_norm).epsilon(1e-5));

      const auto on_device = fsdp::clip_grad_norm(dev_sm, comm, device, {.max_norm = max_norm, .norm_type = type});
      CHECK(on_device.coefficient == on_host.coefficient);
      CHECK(grad_bytes(dev_sm) == after);
      int nonempty = 0;
      for (const auto& v : dev_sm.shards()) nonempty += v.numel > 0;
      CHECK(device.unscales == nonempty);
      CHECK(device.waits == 1);
    });
  }
}

TEST_CASE("clipped sharded SGD matches clipped unsharded SGD") {
  const int world = 4, steps = 4;
  const double max_norm = 0.5 * norm_of(reference_grads(world), 2.0);  // every step clips
  std::vector<Params> got(world);
  std::vector<int> clipped(world);
  const auto c = config();
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < steps; ++s) {
      engine::sharded_forward_backward(model, sm, engine::make_batch(c, s, comm.rank(), 1));
      clipped[comm.rank()] += fsdp::clip_grad_norm(sm, comm, device, {.max_norm = max_norm}).clipped;
      sgd.step(engine::slots(sm));
    }
    got[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 0; r < world; ++r) CHECK(clipped[r] == steps);
  const Params want = reference_clipped(world, steps, max_norm, true);
  // Measured: bitwise equal (4 ranks reduce exactly). The coefficients may still differ in
  // the last bits of the double norm, which can move an f32 ulp here and there.
  CHECK(max_difference(got[0], want) <= 1e-7);
  // Honest: not clipping moves the parameters far more (measured 1.4e-2).
  CHECK(max_difference(reference_clipped(world, steps, max_norm, false), want) > 1e-3);
}

TEST_CASE_TEMPLATE("low-precision gradients (KeepLowPrecisionGrads) are measured and clipped in their dtype", Half,
                   fsdp::bf16, fsdp::f16) {
  constexpr fsdp::DType half = fsdp::dtype_v<Half>;
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model a(c), b(c);
    fsdp::HostDevice device;
    auto wide = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<Half>>(a, comm, device, engine::Wrap{});
    auto low = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<Half, Half, Half, true>>(b, comm, device, engine::Wrap{});
    engine::sharded_forward_backward(a, wide, engine::make_batch(c, 0, comm.rank(), 1));
    engine::sharded_forward_backward(b, low, engine::make_batch(c, 0, comm.rank(), 1));
    for (const auto& v : low.shards()) REQUIRE(v.grad_dtype == half);
    for (double type : {2.0, kInf}) {
      CAPTURE(type);
      // The f32 gradients are the exact widening of the low-precision ones (mixed_precision_test).
      const double want = fsdp::clip_grad_norm(wide, comm, {.max_norm = kNoClip, .norm_type = type}).total_norm;
      CHECK(fsdp::clip_grad_norm(low, comm, {.max_norm = kNoClip, .norm_type = type}).total_norm == want);
    }
    // Near the f32 model's norm: computed and reduced in Half (measured 2.4e-4 relative).
    const double f32_norm = norm_of(reference_grads(2), 2.0);
    const double low_norm = fsdp::clip_grad_norm(low, comm, {.max_norm = kNoClip}).total_norm;
    CHECK(std::fabs(low_norm - f32_norm) <= 2e-3 * f32_norm);

    const auto before = grad_bytes(low);
    const double max_norm = 0.3 * low_norm;  // not a power of two: the products round
    const auto r = fsdp::clip_grad_norm(low, comm, device, {.max_norm = max_norm});
    REQUIRE(r.clipped);
    const auto after = grad_bytes(low);
    for (std::size_t s = 0; s < after.size(); ++s)
      for (std::size_t i = 0; i < after[s].size() / 2; ++i) {
        std::uint16_t was, now;
        std::memcpy(&was, before[s].data() + 2 * i, 2);
        std::memcpy(&now, after[s].data() + 2 * i, 2);
        const double widened = half == fsdp::DType::bf16 ? fsdp::bf16_bits_to_float(was) : fsdp::f16_bits_to_float(was);
        const std::uint16_t want = half == fsdp::DType::bf16 ? fsdp::double_to_bf16_bits(widened * r.coefficient)
                                                             : fsdp::double_to_f16_bits(widened * r.coefficient);
        REQUIRE(now == want);
      }
    // Each element rounded to 8 (bf16) or 11 (f16) significant bits: the norm within 2^-8.
    const double post = fsdp::clip_grad_norm(low, comm, {.max_norm = kNoClip}).total_norm;
    CHECK(std::fabs(post - max_norm) <= max_norm / 256);
  });
}

TEST_CASE("f64 gradients (reduced and kept in double) are measured and clipped") {
  after_backward<fsdp::FullShard, fsdp::MixedPrecision<float, double, float, true>>(
      {1, 3}, [&](fsdp::ShardedModel& sm, auto&, auto& device, fsdp::ThreadComm& comm) {
        for (const auto& v : sm.shards()) REQUIRE(v.grad_dtype == fsdp::DType::f64);
        const double want = norm_of(reference_grads(3), 2.0);
        const double total = fsdp::clip_grad_norm(sm, comm, {.max_norm = kNoClip}).total_norm;
        CHECK(std::fabs(total - want) <= 1e-6 * want);  // reduced in double from f32 products
        const double max_norm = 0.5 * total;
        CHECK(fsdp::clip_grad_norm(sm, comm, device, {.max_norm = max_norm}).clipped);
        // Multiplied in double, nothing lost: exactly PyTorch's max_norm * total / (total + 1e-6).
        const double post = fsdp::clip_grad_norm(sm, comm, {.max_norm = kNoClip}).total_norm;
        CHECK(post == doctest::Approx(max_norm * total / (total + 1e-6)).epsilon(1e-12));
      });
}

TEST_CASE("offloaded gradients (host space) are measured and clipped") {
  after_backward<fsdp::FullShard, fsdp::OffloadParams>({1, 2}, [&](fsdp::ShardedModel& sm, auto& mesh, auto& device,
                                                                   fsdp::ThreadComm&) {
    for (const auto& v : sm.shards()) REQUIRE(v.space == fsdp::MemorySpace::host);
    const double want = norm_of(reference_grads(2), 2.0);
    const auto r = fsdp::clip_grad_norm(sm, mesh, device, {.max_norm = 0.5 * want});
    CHECK(std::fabs(r.total_norm - want) <= same_grads_tolerance * want);
    CHECK(r.clipped);
    CHECK(fsdp::clip_grad_norm(sm, mesh, {.max_norm = kNoClip}).total_norm == doctest::Approx(0.5 * want).epsilon(1e-5));
  });
}

TEST_CASE("a non-finite gradient on one rank: an error on every rank naming it, or the norm returned unscaled") {
  for (double type : {2.0, kInf}) {
    for (double poison : {std::numeric_limits<double>::quiet_NaN(), kInf}) {
      CAPTURE(type);
      CAPTURE(poison);
      const auto c = config();
      std::string poisoned;  // the FQN rank 1 poisons
      std::vector<int> untouched(3);
      std::vector<double> returned(3);
      const auto errors = test_support::errors_per_rank(3, [&](fsdp::ThreadComm& comm) {
        engine::Model model(c);
        fsdp::HostDevice device;
        auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
        engine::sharded_forward_backward(model, sm, engine::make_batch(c, 0, comm.rank(), 1));
        if (comm.rank() == 1) {
          for (const auto& p : sm.parameters())
            if (p.count > 2 && p.fqn.find("blocks.1") == 0) {
              static_cast<float*>(p.grad)[2] = static_cast<float>(poison);
              poisoned = p.fqn;
              break;
            }
        }
        const auto before = grad_bytes(sm);
        const auto r = fsdp::clip_grad_norm(sm, comm, {.max_norm = 1e-3, .norm_type = type, .error_if_nonfinite = false});
        returned[comm.rank()] = r.total_norm;
        untouched[comm.rank()] = grad_bytes(sm) == before && !r.clipped && r.coefficient == 1.0;
        try {
          fsdp::clip_grad_norm(sm, comm, device, {.max_norm = 1e-3, .norm_type = type});
        } catch (...) {
          untouched[comm.rank()] &= grad_bytes(sm) == before;
          throw;
        }
      });
      REQUIRE_FALSE(poisoned.empty());
      const std::string norm = std::isinf(type) ? "inf-norm" : "2-norm";
      for (int r = 0; r < 3; ++r) {
        CAPTURE(r);
        CHECK(untouched[r]);
        CHECK((std::isnan(poison) ? std::isnan(returned[r]) : returned[r] == kInf));
        CHECK(errors[r].find(norm) != std::string::npos);
        CHECK(errors[r].find("no gradient was changed") != std::string::npos);
        if (r == 1) CHECK(errors[r].find("'" + poisoned + "'") != std::string::npos);
        else CHECK(errors[r].find("rank 1 found a non-finite gradient") != std::string::npos);
      }
    }
  }
}

TEST_CASE("misuse is an error on every rank and changes nothing") {
  const auto c = config();
  auto on_two_ranks = [&](auto misuse) {
    return test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      engine::sharded_forward_backward(model, sm, engine::make_batch(c, 0, comm.rank(), 1));
      const auto before = grad_bytes(sm);
      try {
        misuse(sm, comm);
      } catch (...) {
        CHECK(grad_bytes(sm) == before);
        throw;
      }
    });
  };
  auto expect_everywhere = [](const std::vector<std::string>& errors, const std::string& own, const std::string& other) {
    CHECK(errors[0].find(own) != std::string::npos);
    CHECK((errors[1].find(own) != std::string::npos || errors[1].find(other) != std::string::npos));
  };
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  SUBCASE("bad options") {
    for (double max_norm : {0.0, -1.0, nan, kInf}) {
      CAPTURE(max_norm);
      const auto e = on_two_ranks([&](auto& sm, auto& comm) { fsdp::clip_grad_norm(sm, comm, {.max_norm = max_norm}); });
      for (const auto& m : e) CHECK(m.find("max_norm must be a positive finite number") != std::string::npos);
    }
    for (double type : {0.5, 0.0, -kInf, nan}) {
      CAPTURE(type);
      const auto e = on_two_ranks([&](auto& sm, auto& comm) { fsdp::clip_grad_norm(sm, comm, {.max_norm = 1, .norm_type = type}); });
      for (const auto& m : e) CHECK(m.find("norm_type must be a number p >= 1") != std::string::npos);
    }
  }
  SUBCASE("bad options on one rank only") {
    const auto e = on_two_ranks([&](auto& sm, auto& comm) {
      fsdp::clip_grad_norm(sm, comm, {.max_norm = comm.rank() == 0 ? -1.0 : 1.0});
    });
    CHECK(e[0].find("max_norm must be") != std::string::npos);
    CHECK(e[1].find("rank 0 was given inputs it cannot clip") != std::string::npos);
  }
  SUBCASE("ranks that disagree on the options") {
    const auto e = on_two_ranks([&](auto& sm, auto& comm) {
      fsdp::clip_grad_norm(sm, comm, {.max_norm = 1.0 + comm.rank()});
    });
    for (const auto& m : e) CHECK(m.find("ranks were given different options") != std::string::npos);
  }
  SUBCASE("before finish_backward") {
    const auto e = on_two_ranks([&](fsdp::ShardedModel& sm, auto& comm) {
      auto& gain = sm.unit("gain");
      auto scope = gain.forward_scope();
      fsdp::clip_grad_norm(sm, comm, {.max_norm = 1.0});
    });
    expect_everywhere(e, "is in state FORWARD", "cannot clip");
  }
  SUBCASE("a sub-group instead of the world") {
    const auto e = test_support::errors_per_rank(4, [&](fsdp::ThreadComm& comm) {
      fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, {2, 2});
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::HybridShard>(model, mesh, device, engine::Wrap{});
      engine::sharded_forward_backward(model, sm, engine::make_batch(c, 0, comm.rank(), 1));
      fsdp::clip_grad_norm(sm, mesh.shard_group(), {.max_norm = 1.0});
    });
    for (const auto& m : e) CHECK(m.find("world communicator") != std::string::npos);
  }
}

}  // namespace core_clip_grad_norm_test
