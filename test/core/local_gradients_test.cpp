// ShardOptions::local_gradients (fsdp/policy/reshard_settings.hpp): what the engine's
// gradients are over its local batch, and so what a synchronized reduction divides the
// gradient summed over ranks by. mean (the default): the world size; sum: 1, so an engine
// whose gradients are sums over its local batch (mlpack's) gets the gradient of the global
// batch's sum, as it computes unsharded. An explicit set_gradient_divide_factor overrides it.
//
// First against figures derived by hand: an engine that writes, for each of its samples s,
// the gradient (s + 1) * w_e into parameter element e (w_e a power of two), so that every
// value is exact in bf16 and f16 too; the expected sharded gradient is a closed form
// (below), for every strategy, the persistence threshold, gradient accumulation in each
// mode, every precision path, units built by fsdp::shard and by hand. Then training the
// reference engine with a summed loss: sharded matches unsharded on the global batch's sum,
// bit for bit with one sample per rank (the library scales nothing), as the mean's parity
// tests do.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"
#include "test/support/reference_training.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace core_local_gradients_test {

namespace {

using test_support::contains;
using test_support::Params;

// ---- an engine whose gradients are known in closed form ----

struct Leaf {
  engine::Tensor w{{6}}, g{{6}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
};
struct Root {  // elements 0..3 here, 4..9 in the leaf (a unit of its own)
  engine::Tensor w{{4}}, g{{4}};
  Leaf leaf;
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
  template <class F> void visit_children(F&& f) { f("leaf", leaf); }
};
constexpr int elements = 10;

double weight(int e) { return std::ldexp(1.0, e % 3 - 1); }  // 1/2, 1, 2, 1/2, ...

enum class Accumulate { no_sync, every_microbatch, defer_all_reduce };

struct Case {
  fsdp::LocalGradients local = fsdp::LocalGradients::sum;
  int world = 2;
  int per_rank = 1;  // samples per rank per micro-batch
  int micro = 1;     // micro-batches per step
  Accumulate accumulate = Accumulate::no_sync;
  std::int64_t persistence_threshold = 0;  // 100: both units stay unsharded
  double divide_factor = 0;                // > 0: set_gradient_divide_factor
  bool by_hand = false;                    // fsdp::Sharded units instead of fsdp::shard
};

// Micro-batch j holds the global samples [j G, (j + 1) G), G = world x per_rank; rank r the
// per_rank of them from j G + r per_rank. Sample s contributes (s + 1) w_e to element e of
// the sum over the batch. The closed forms, over the k micro-batches' kG samples:
//   sum:  the engine writes its samples' sum; the ranks' sums add up to
//         w_e sum_{s < kG} (s + 1) = w_e kG (kG + 1) / 2, divided by nothing;
//   mean: the engine writes its samples' sum / per_rank; summed over ranks and divided by
//         the world size, w_e kG (kG + 1) / 2 / G = w_e k (kG + 1) / 2;
//   a divide factor f: the sum's figure / f.
double expected(const Case& c, int e) {
  const double k = c.micro, G = c.world * c.per_rank;
  const double sum = weight(e) * k * G * (k * G + 1) / 2;
  if (c.divide_factor > 0) return sum / c.divide_factor;
  return c.local == fsdp::LocalGradients::sum ? sum : sum / G;
}

// The engine's backward of micro-batch j on `rank`, into the gradient tensor of elements
// [first, first + n): sample by sample, adding (as autograd does).
void write_gradient(engine::Tensor& g, int first, const Case& c, int rank, int j) {
  const int G = c.world * c.per_rank;
  for (int q = 0; q < c.per_rank; ++q) {
    const int s = j * G + rank * c.per_rank + q;
    for (int i = 0; i < g.numel(); ++i) {
      const double v = (s + 1) * weight(first + i);
      g.add(i, static_cast<float>(c.local == fsdp::LocalGradients::sum ? v : v / c.per_rank));
    }
  }
}

void pass(fsdp::ShardedModel& sm, Root& m, const Case& c, int rank, int j) {
  fsdp::Unit& root = sm.unit("");
  fsdp::Unit& leaf = sm.unit("leaf");
  root.pre_forward();
  leaf.pre_forward();
  leaf.post_forward();
  root.post_forward();
  root.pre_backward();
  leaf.pre_backward();
  write_gradient(m.leaf.g, 4, c, rank, j);
  leaf.post_backward();
  write_gradient(m.g, 0, c, rank, j);
  root.post_backward();
  sm.finish_backward();
}

struct Result {
  std::vector<float> grad = std::vector<float>(elements, NAN);  // every element, from the ranks' shards
  bool replicas_agree = true;  // elements several ranks hold are bitwise equal
  std::string config;          // rank 0's unit config line for the leaf
};

template <class Strategy, class Precision, class Group>
fsdp::ShardedModel build(Root& m, Group& group, fsdp::HostDevice& device, const fsdp::ShardOptions& options, bool by_hand) {
  if (!by_hand) return fsdp::shard<Strategy, Precision>(m, group, device, fsdp::wrap_types<Leaf>{}, options);
  fsdp::ShardedModel sm;
  sm.emplace<fsdp::Sharded<Root, Strategy, Precision>>(m, group, device, "", options, fsdp::wrap_types<Leaf>{});
  sm.emplace<fsdp::Sharded<Leaf, Strategy, Precision>>(m.leaf, group, device, "leaf", options);
  return sm;
}

// One step of `c.micro` micro-batches on c.world thread ranks (a 2 x world/2 mesh for the
// hybrid strategies), the sharded gradients gathered from every rank's parameter views.
template <class Strategy, class Precision = fsdp::FullPrecision>
Result run(const Case& c) {
  std::vector<std::vector<std::pair<std::int64_t, std::vector<float>>>> per_rank(c.world);  // (first element, values)
  Result out;
  fsdp::ThreadGroup(c.world).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    Root m;
    fsdp::HostDevice device;
    const fsdp::ShardOptions options{.persistence_threshold = c.persistence_threshold, .local_gradients = c.local};
    std::optional<fsdp::DeviceMesh<fsdp::ThreadComm>> mesh;
    fsdp::ShardedModel sm = [&] {
      if constexpr (Strategy::hybrid) {
        mesh.emplace(comm, fsdp::MeshShape{2, c.world / 2});
        return build<Strategy, Precision>(m, *mesh, device, options, c.by_hand);
      } else {
        return build<Strategy, Precision>(m, comm, device, options, c.by_hand);
      }
    }();
    if (c.divide_factor > 0) sm.set_gradient_divide_factor(c.divide_factor);
    if (c.accumulate == Accumulate::every_microbatch) sm.set_gradient_sync_mode(fsdp::GradientSyncMode::reduce_every_microbatch);
    sm.zero_grad();
    for (int j = 0; j < c.micro; ++j) {
      const bool last = j + 1 == c.micro;
      if (c.accumulate == Accumulate::defer_all_reduce) {
        sm.set_requires_all_reduce(last);
        pass(sm, m, c, r, j);
      } else if (!last) {
        auto no_sync = sm.no_sync();
        pass(sm, m, c, r, j);
      } else {
        pass(sm, m, c, r, j);
      }
    }
    for (const fsdp::ParamView& v : sm.parameters()) {
      CHECK(v.grad_dtype == fsdp::DType::f32);
      const std::int64_t first = (v.fqn == "w" ? 0 : 4) + v.param_begin;
      const float* g = static_cast<const float*>(v.grad);
      per_rank[r].emplace_back(first, std::vector<float>(g, g + v.count));
    }
    if (r == 0) out.config = fsdp::to_string(sm.unit("leaf").config());
  });
  std::vector<bool> seen(elements, false);
  for (const auto& views : per_rank)
    for (const auto& [first, values] : views)
      for (std::size_t i = 0; i < values.size(); ++i) {
        const auto e = static_cast<std::size_t>(first) + i;
        if (seen[e] && std::memcmp(&out.grad[e], &values[i], sizeof(float)) != 0) out.replicas_agree = false;
        out.grad[e] = values[i];
        seen[e] = true;
      }
  return out;
}

// Every element as the closed form says: exactly, or within `tol` relative where a division
// rounds (a world of 3 under mean).
void check(const Result& got, const Case& c, double tol = 0) {
  CHECK(got.replicas_agree);
  for (int e = 0; e < elements; ++e) {
    CAPTURE(e);
    const double want = expected(c, e);
    if (tol == 0) CHECK(got.grad[static_cast<std::size_t>(e)] == static_cast<float>(want));
    else CHECK(std::abs(got.grad[static_cast<std::size_t>(e)] - want) <= tol * want);
  }
}

template <class Strategy, class Precision>
void check_strategy() {
  const std::vector<int> worlds = Strategy::hybrid ? std::vector<int>{4} : std::vector<int>{2, 4};
  for (int world : worlds)
    for (auto local : {fsdp::LocalGradients::sum, fsdp::LocalGradients::mean})
      for (int per_rank : {1, 2})
        for (std::int64_t threshold : {0, 100})
          for (bool by_hand : {false, true}) {
            const Case c{.local = local, .world = world, .per_rank = per_rank, .persistence_threshold = threshold, .by_hand = by_hand};
            const std::string local_name(fsdp::name_of(local));
            CAPTURE(world);
            CAPTURE(local_name);
            CAPTURE(per_rank);
            CAPTURE(threshold);
            CAPTURE(by_hand);
            check(run<Strategy, Precision>(c), c);
          }
}

}  // namespace

TEST_CASE_TEMPLATE("the engine's local sums are summed over the ranks, its local means averaged: every strategy",
                   Precision, fsdp::FullPrecision, fsdp::MixedPrecision<fsdp::bf16, float>, fsdp::MixedPrecision<fsdp::f16>,
                   fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>) {
  // f32 and bf16 over powers of two: the collectives average (ReduceOp::avg) under mean and
  // sum under sum; f16 reduces with the pre and post factors (none under sum).
  SUBCASE("FullShard") { check_strategy<fsdp::FullShard, Precision>(); }
  SUBCASE("ShardGradOp") { check_strategy<fsdp::ShardGradOp, Precision>(); }
  SUBCASE("NoShard") { check_strategy<fsdp::NoShard, Precision>(); }
  SUBCASE("HybridShard 2x2") { check_strategy<fsdp::HybridShard, Precision>(); }
  SUBCASE("HybridShardZero2 2x2") { check_strategy<fsdp::HybridShardZero2, Precision>(); }
}

TEST_CASE_TEMPLATE("gradient accumulation: the micro-batches' gradients add up, divided once as local_gradients says",
                   Precision, fsdp::FullPrecision, fsdp::MixedPrecision<fsdp::bf16, float>, fsdp::MixedPrecision<fsdp::f16>,
                   fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>) {
  for (auto local : {fsdp::LocalGradients::sum, fsdp::LocalGradients::mean})
    for (auto mode : {Accumulate::no_sync, Accumulate::every_microbatch}) {
      const std::string local_name(fsdp::name_of(local));
      const std::string mode_name = mode == Accumulate::no_sync ? "no_sync" : "reduce_every_microbatch";
      CAPTURE(local_name);
      CAPTURE(mode_name);
      for (int world : {2, 4}) {
        CAPTURE(world);
        const Case c{.local = local, .world = world, .per_rank = 2, .micro = 2, .accumulate = mode};
        check(run<fsdp::FullShard, Precision>(c), c);
        check(run<fsdp::NoShard, Precision>(c), c);
        Case kept = c;
        kept.persistence_threshold = 100;
        check(run<fsdp::FullShard, Precision>(kept), kept);
      }
      const Case hybrid{.local = local, .world = 4, .per_rank = 2, .micro = 2, .accumulate = mode};
      check(run<fsdp::HybridShard, Precision>(hybrid), hybrid);
    }
  for (auto local : {fsdp::LocalGradients::sum, fsdp::LocalGradients::mean}) {  // the replicate all-reduce deferred
    const Case c{.local = local, .world = 4, .per_rank = 1, .micro = 3, .accumulate = Accumulate::defer_all_reduce};
    const std::string local_name(fsdp::name_of(local));
    CAPTURE(local_name);
    check(run<fsdp::HybridShard, Precision>(c), c);
    check(run<fsdp::HybridShardZero2, Precision>(c), c);
  }
}

TEST_CASE("a world that is no power of two: sum divides by nothing (exact), mean by 3 (rounded)") {
  for (int per_rank : {1, 2}) {
    CAPTURE(per_rank);
    const Case sum{.local = fsdp::LocalGradients::sum, .world = 3, .per_rank = per_rank};
    const Case mean{.local = fsdp::LocalGradients::mean, .world = 3, .per_rank = per_rank};
    check(run<fsdp::FullShard>(sum), sum);
    check(run<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>>(sum), sum);
    check(run<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>>(sum), sum);  // bf16 over 3: the factors' path
    check(run<fsdp::NoShard>(sum), sum);
    check(run<fsdp::FullShard>(mean), mean, 1e-6);
    check(run<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>>(mean), mean, 1e-2);
  }
}

TEST_CASE("set_gradient_divide_factor overrides local_gradients") {
  for (double f : {2.0, 4.0, 8.0}) {  // powers of two: exact
    CAPTURE(f);
    for (auto local : {fsdp::LocalGradients::sum, fsdp::LocalGradients::mean}) {
      const std::string local_name(fsdp::name_of(local));
      CAPTURE(local_name);
      // The engine writes what `local` says; the factor replaces whatever local_gradients
      // would divide by, so only the sum's figure / f is expected where the engine sums.
      const Case c{.local = local, .world = 4, .per_rank = 1, .divide_factor = f};
      if (local == fsdp::LocalGradients::sum) {
        check(run<fsdp::FullShard>(c), c);
        check(run<fsdp::NoShard, fsdp::MixedPrecision<fsdp::f16>>(c), c);
        check(run<fsdp::HybridShard>(c), c);
        Case by_hand = c;
        by_hand.by_hand = true;
        check(run<fsdp::ShardGradOp>(by_hand), by_hand);
      } else {  // under mean the engine wrote sums / 1 with one sample per rank: the same figures
        check(run<fsdp::FullShard>(c), c);
      }
    }
  }
}

TEST_CASE("a unit's config reports local_gradients and what it divides by") {
  const Case sum{.local = fsdp::LocalGradients::sum};
  const Case mean{.local = fsdp::LocalGradients::mean};
  const Case both{.local = fsdp::LocalGradients::sum, .divide_factor = 8};
  const Result s = run<fsdp::FullShard>(sum), m = run<fsdp::FullShard>(mean), f = run<fsdp::FullShard>(both);
  CAPTURE(s.config);
  CHECK(contains(s.config, "mesh=1x2 local_gradients=sum reshard_after_forward=on reshard_after_backward=on "
                           "gradient_divide_factor=1 requires_gradient_sync"));
  CHECK(contains(m.config, "mesh=1x2 local_gradients=mean reshard_after_forward=on reshard_after_backward=on "
                           "gradient_divide_factor=world requires_gradient_sync"));
  CHECK(contains(f.config, "local_gradients=sum "));
  CHECK(contains(f.config, " gradient_divide_factor=8 "));
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    Root m;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<Leaf>{},
                                           fsdp::ShardOptions{.local_gradients = fsdp::LocalGradients::sum});
    for (const fsdp::UnitConfig& u : sm.config().units) {
      CHECK(u.local_gradients == fsdp::LocalGradients::sum);
      CHECK(u.reshard.gradient_divide_factor == 0);  // none set
      CHECK(fsdp::divide_factor(u.reshard, u.local_gradients) == 1);
    }
    Leaf other;  // the default
    CHECK(fsdp::shard<fsdp::FullShard>(other, comm, device).config().units[0].local_gradients == fsdp::LocalGradients::mean);
  });
}

TEST_CASE("errors: ranks that choose differently, a value that is no choice") {
  SUBCASE("ranks that choose differently are refused when the unit is built, naming the option") {
    const auto msgs = test_support::errors_per_rank(2, [](fsdp::ThreadComm& comm) {
      Root m;
      fsdp::HostDevice device;
      const auto local = comm.rank() == 0 ? fsdp::LocalGradients::sum : fsdp::LocalGradients::mean;
      auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<Leaf>{}, fsdp::ShardOptions{.local_gradients = local});
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "local_gradients: rank 0 sum, rank 1 mean"));
    }
  }
  SUBCASE("a value outside the enum") {
    const auto msgs = test_support::errors_per_rank(1, [](fsdp::ThreadComm& comm) {
      Root m;
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<Leaf>{},
                                             fsdp::ShardOptions{.local_gradients = static_cast<fsdp::LocalGradients>(7)});
    });
    CHECK(contains(msgs[0], "ShardOptions::local_gradients must be LocalGradients::mean or LocalGradients::sum, got the value 7"));
  }
  SUBCASE("run-time settings that differ name what no factor means under sum") {
    const auto msgs = test_support::errors_per_rank(2, [](fsdp::ThreadComm& comm) {
      Root m;
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<Leaf>{},
                                             fsdp::ShardOptions{.local_gradients = fsdp::LocalGradients::sum});
      if (comm.rank() == 1) sm.set_gradient_divide_factor(2);
      else sm.set_reshard_after_backward(false);
      pass(sm, m, Case{}, comm.rank(), 0);
    });
    CAPTURE(msgs[0]);
    CHECK(contains(msgs[0], "rank 0 sync on, all-reduce on, keep_unsharded, reshard after forward on, reshard after backward "
                            "off, gradient divide factor 1 (local_gradients=sum)"));
    CHECK(contains(msgs[0], "gradient divide factor 2"));
  }
}

// ---- the reference engine, its loss summed over its local batch ----

namespace {

engine::ModelConfig summed_config() {
  engine::ModelConfig c;  // dim 13, hidden 7: no size divisible by 2 or 4
  c.blocks = 2;
  c.loss = engine::LossReduction::sum;
  return c;
}

enum class Opt { sgd, adamw };

// `steps` steps of the unsharded engine on global batches of `global` samples (each step
// `micro` micro-batches of them).
Params reference(const engine::ModelConfig& c, Opt o, int steps, int global, int micro) {
  engine::Model model(c);
  engine::Sgd sgd(0.01f);
  engine::AdamW adamw({});
  for (int s = 0; s < steps; ++s) {
    std::vector<engine::Batch> batches;
    for (int j = 0; j < micro; ++j) batches.push_back(engine::make_batch(c, s * micro + j, 0, global));
    if (o == Opt::sgd) engine::unsharded_step(model, sgd, batches);
    else engine::unsharded_step(model, adamw, batches);
  }
  Params p;
  for (auto& np : engine::named_parameters(model))
    p.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  return p;
}

struct Training {
  int world = 2, per_rank = 1, micro = 1, steps = 4;
  Opt opt = Opt::sgd;
  fsdp::ShardOptions options{.local_gradients = fsdp::LocalGradients::sum};
  fsdp::GradientSyncMode mode = fsdp::GradientSyncMode::keep_unsharded;
};

template <class Strategy>
Params sharded(const engine::ModelConfig& c, const Training& t) {
  std::vector<Params> per_rank(t.world);
  fsdp::ThreadGroup(t.world).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    engine::Model model(c);
    fsdp::HostDevice device;
    std::optional<fsdp::DeviceMesh<fsdp::ThreadComm>> mesh;
    fsdp::ShardedModel sm = [&] {
      if constexpr (Strategy::hybrid) {
        mesh.emplace(comm, fsdp::MeshShape{2, t.world / 2});
        return fsdp::shard<Strategy>(model, *mesh, device, engine::Wrap{}, t.options);
      } else {
        return fsdp::shard<Strategy>(model, comm, device, engine::Wrap{}, t.options);
      }
    }();
    sm.set_gradient_sync_mode(t.mode);
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::Sgd sgd(0.01f);
    engine::AdamW adamw({}, alloc);
    for (int s = 0; s < t.steps; ++s) {
      std::vector<engine::Batch> micro;
      for (int j = 0; j < t.micro; ++j) micro.push_back(engine::make_batch(c, s * t.micro + j, r * t.per_rank, t.per_rank));
      if (t.opt == Opt::sgd) engine::sharded_step(model, sm, sgd, micro);
      else engine::sharded_step(model, sm, adamw, micro);
    }
    per_rank[r] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < t.world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  return per_rank[0];
}

}  // namespace

TEST_CASE("an engine that sums over its local batch, sharded with local_gradients = sum, trains as unsharded on the global "
          "batch's sum: bit for bit with one sample per rank") {
  const auto c = summed_config();
  for (Opt o : {Opt::sgd, Opt::adamw}) {
    CAPTURE(o == Opt::sgd ? "sgd" : "adamw");
    for (int world : {2, 4}) {
      CAPTURE(world);
      const Params want = reference(c, o, 4, world, 1);
      const Training t{.world = world, .opt = o};
      CHECK(test_support::bitwise_equal(sharded<fsdp::FullShard>(c, t), want));
      CHECK(test_support::bitwise_equal(sharded<fsdp::ShardGradOp>(c, t), want));
      CHECK(test_support::bitwise_equal(sharded<fsdp::NoShard>(c, t), want));
      Training kept = t;  // every unit kept unsharded: all-reduced over the world
      kept.options.persistence_threshold = 1 << 20;
      CHECK(test_support::bitwise_equal(sharded<fsdp::FullShard>(c, kept), want));
    }
  }
}

TEST_CASE("local_gradients = sum: HybridShard on a 2x2 mesh, several samples per rank, accumulation (within rounding)") {
  // The sums reassociate (per rank, per shard group, across replicas, per micro-batch), so
  // they match within a few float ulps; had the library averaged, the SGD steps would be a
  // quarter as long and the parameters would differ by ~1e-3 and more.
  const auto c = summed_config();
  auto near = [](const Params& got, const Params& want) {
    const double d = test_support::max_difference(got, want);
    CAPTURE(d);
    CHECK(d <= 2e-6);
  };
  near(sharded<fsdp::HybridShard>(c, {.world = 4}), reference(c, Opt::sgd, 4, 4, 1));
  near(sharded<fsdp::HybridShardZero2>(c, {.world = 4, .per_rank = 2}), reference(c, Opt::sgd, 4, 8, 1));
  near(sharded<fsdp::FullShard>(c, {.world = 4, .per_rank = 3}), reference(c, Opt::sgd, 4, 12, 1));
  for (auto mode : {fsdp::GradientSyncMode::keep_unsharded, fsdp::GradientSyncMode::reduce_every_microbatch}) {
    const std::string mode_name(fsdp::name_of(mode));
    CAPTURE(mode_name);
    const Params want = reference(c, Opt::sgd, 3, 4, 2);
    near(sharded<fsdp::FullShard>(c, {.world = 4, .micro = 2, .steps = 3, .mode = mode}), want);
    near(sharded<fsdp::NoShard>(c, {.world = 4, .micro = 2, .steps = 3, .mode = mode}), want);
    near(sharded<fsdp::HybridShard>(c, {.world = 4, .micro = 2, .steps = 3, .mode = mode}), want);
  }
}

TEST_CASE("the default, mean, is what it was: a mean engine matches bit for bit, a summing one does not") {
  engine::ModelConfig mean = summed_config();
  mean.loss = engine::LossReduction::mean;
  const Training t{.world = 4, .options = {}};
  CHECK(test_support::bitwise_equal(sharded<fsdp::FullShard>(mean, t), reference(mean, Opt::sgd, 4, 4, 1)));
  // A summing engine left at the default: its sums are averaged, a step a quarter as long.
  const auto summed = summed_config();
  CHECK(test_support::max_difference(sharded<fsdp::FullShard>(summed, t), reference(summed, Opt::sgd, 4, 4, 1)) > 1e-4);
}

}  // namespace core_local_gradients_test
