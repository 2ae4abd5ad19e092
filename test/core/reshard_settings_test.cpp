// Run-time resharding settings (fsdp/policy/reshard_settings.hpp): partial resharding after
// forward (FSDP2's integer reshard_after_forward, ZeRO++ hpZ), reshard_after_forward and
// reshard_after_backward switched at run time, the gradient divide factor. Parity with the
// default settings over several steps, where the backward all-gathers run, the memory a
// partial reshard keeps (and that it is the same every step: pytorch/pytorch#147179), the
// planner's prediction, and the errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include <fsdp/model/memory_plan.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_reshard_settings_test {

namespace {

using fsdp::Collective;
using test_support::Params;
using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13, hidden 7: no size divisible by 2 or 4
  c.blocks = 3;
  return c;
}

struct Knobs {
  int post_forward_ranks = 0;                // > 0: set_reshard_after_forward(group of that many ranks)
  std::optional<bool> reshard_after_forward = std::nullopt;  // set_reshard_after_forward(bool)
  bool keep_after_backward = false;          // set_reshard_after_backward(false) on the micro-batches without sync
  double divide_factor = 0;                  // set_gradient_divide_factor
  int accumulate = 1;                        // micro-batches per step (sync off for all but the last)
  bool plan = false;                         // also plan the run (fsdp::plan) before the first step
};

struct Run {
  Params params;
  std::vector<Params> grads;  // per step, the sharded gradients of rank 0 (before the optimizer)
  std::vector<fsdp::CollectiveCounts> world, post;  // per rank, the last step
  std::vector<std::vector<std::size_t>> peak;       // per rank, per step: device peak
  std::vector<std::vector<std::size_t>> live;       // per rank, per step: device live bytes after the step
  std::vector<std::vector<std::size_t>> live_after_forward;  // per rank, per step, first micro-batch
  std::vector<std::size_t> planned_peak, planned_steady;
};

void micro_batch(engine::Model& model, fsdp::ShardedModel& sm, const engine::Batch& b, std::size_t* live_after_forward,
                 fsdp::HostDevice& device) {
  engine::UnitHooks hooks{sm};
  engine::Mat dout;
  engine::mse(model.forward(b.x, hooks), b.y, dout);
  if (live_after_forward) *live_after_forward = device.stats(fsdp::MemorySpace::device).live_bytes;
  model.backward(dout, hooks);
  sm.finish_backward();
}

Params shard_grads(const fsdp::ShardedModel& sm) {
  Params out;
  for (const auto& v : sm.shards()) {
    const float* g = static_cast<const float*>(v.grad);
    out.emplace_back(std::string(v.unit), std::vector<float>(g, g + v.numel));
  }
  return out;
}

// `steps` SGD steps on `world` thread ranks (a replicate x shard mesh for hybrid strategies).
template <class Strategy, class... Extra>
Run train(int world, Knobs knobs, int steps, fsdp::MeshShape mesh_shape = {}) {
  const auto c = config();
  Run out;
  out.world.resize(world), out.post.resize(world), out.peak.resize(world), out.live.resize(world);
  out.live_after_forward.resize(world), out.planned_peak.resize(world), out.planned_steady.resize(world);
  std::vector<Params> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    Counting counted(comm);
    engine::Model model(c);
    fsdp::HostDevice device;
    std::optional<fsdp::DeviceMesh<Counting>> mesh;
    fsdp::ShardedModel sm = test_support::shard_engine<Strategy, Extra...>(model, counted, mesh, mesh_shape, device);
    // Groups of consecutive ranks: shard ranks modulo k inside each (k divides the shard size).
    const int k = knobs.post_forward_ranks;
    std::optional<Counting> post;
    if (k > 0) post.emplace(counted.split(r / k, r));
    if (knobs.reshard_after_forward) sm.set_reshard_after_forward(*knobs.reshard_after_forward);
    if (post) sm.set_reshard_after_forward(*post);  // reshard after forward, partially
    if (knobs.divide_factor != 0) sm.set_gradient_divide_factor(knobs.divide_factor);
    if (knobs.plan) {
      const auto plan = fsdp::plan<Strategy, Extra...>(sm, {.steps = steps});
      out.planned_peak[r] = plan.peak_bytes();
      out.planned_steady[r] = plan.steady[0];
    }
    engine::Sgd sgd(0.05f);
    const auto dev = fsdp::MemorySpace::device;
    for (int s = 0; s < steps; ++s) {
      if (mesh) engine::reset_counts(*mesh);
      else counted.reset();
      if (post) post->reset();
      device.reset_peak(dev);
      sm.zero_grad();
      for (int j = 0; j < knobs.accumulate; ++j) {
        const bool last = j == knobs.accumulate - 1;
        sm.set_requires_gradient_sync(last);
        if (knobs.keep_after_backward) sm.set_reshard_after_backward(last);
        std::size_t live_fwd = 0;
        micro_batch(model, sm, engine::make_batch(c, s * knobs.accumulate + j, r, 1), j == 0 ? &live_fwd : nullptr, device);
        if (j == 0) out.live_after_forward[r].push_back(live_fwd);
      }
      if (r == 0) out.grads.push_back(shard_grads(sm));
      out.peak[r].push_back(device.stats(dev).peak_bytes);
      const auto slots = engine::slots(sm);
      sgd.step(slots);
      out.live[r].push_back(device.stats(dev).live_bytes);
    }
    out.world[r] = mesh ? engine::total_counts(*mesh) : counted.counts();
    if (post) out.post[r] = post->counts();
    per_rank[r] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  out.params = per_rank[0];
  return out;
}

std::uint64_t gathers(const fsdp::CollectiveCounts& c) { return c[Collective::all_gather].calls; }

constexpr int units = 5;  // the root and its 4 children (engine::Wrap): every unit gathers one flat parameter

}  // namespace

TEST_CASE_TEMPLATE("partial reshard: the same parameters as a full reshard, the backward all-gathers in the group",
                   Precision, fsdp::FullPrecision, fsdp::MixedPrecision<fsdp::bf16, float>,
                   fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>) {
  const int steps = 4;
  const Run full = train<fsdp::FullShard, Precision>(4, {}, steps);
  const Run partial = train<fsdp::FullShard, Precision>(4, {.post_forward_ranks = 2}, steps);
  // The gathered values are copies either way: bitwise the same training.
  CHECK(partial.params == full.params);
  CHECK(partial.grads == full.grads);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    // Full reshard: every unit gathers in forward; in backward all but the root (kept from
    // forward for the backward that starts with it) gather again, over the world.
    CHECK(gathers(full.world[r]) == units + units - 1);
    // Partial: the backward all-gathers run in the group of 2, moving the same bytes.
    CHECK(gathers(partial.world[r]) == units);
    CHECK(gathers(partial.post[r]) == units - 1);
    CHECK(partial.post[r][Collective::all_gather].bytes + partial.world[r][Collective::all_gather].bytes ==
          full.world[r][Collective::all_gather].bytes);
    // What forward leaves behind is each rank's half of the 4 resharded units' parameters:
    // more than a full reshard (a quarter, in the shards), less than keeping them whole.
    for (int s = 1; s < steps; ++s) {
      CHECK(partial.live_after_forward[r][s] > full.live_after_forward[r][s]);
      // pytorch/pytorch#147179: the second step and later ones must not grow.
      CHECK(partial.peak[r][s] == partial.peak[r][1]);
      CHECK(partial.live[r][s] == partial.live[r][0]);
    }
    CHECK(partial.live[r][0] == full.live[r][0]);  // nothing kept between steps
  }
}

TEST_CASE("partial reshard on a hybrid mesh: groups inside the shard group") {
  const Run full = train<fsdp::HybridShard>(8, {}, 3, {2, 4});
  const Run partial = train<fsdp::HybridShard>(8, {.post_forward_ranks = 2}, 3, {2, 4});
  CHECK(partial.params == full.params);
  for (int r = 0; r < 8; ++r) CHECK(gathers(partial.post[r]) == units - 1);
}

TEST_CASE("the planner predicts a partial reshard's peak to the byte, every step") {
  for (int k : {2, 4}) {
    CAPTURE(k);
    const Run run = train<fsdp::FullShard, fsdp::BackwardPost>(8, {.post_forward_ranks = k, .plan = true}, 3);
    for (int r = 0; r < 8; ++r) {
      std::size_t measured = 0;
      for (auto p : run.peak[r]) measured = std::max(measured, p);
      CHECK(run.planned_peak[r] == measured);
      CHECK(run.planned_steady[r] == run.live[r].back());
    }
  }
  auto check = [](const Run& run) {
    for (std::size_t r = 0; r < run.peak.size(); ++r)
      CHECK(run.planned_peak[r] == *std::max_element(run.peak[r].begin(), run.peak[r].end()));
  };
  const Knobs two{.post_forward_ranks = 2, .plan = true};
  check(train<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>>(4, two, 3));
  check(train<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>, fsdp::ForwardPrefetch>(4, two, 3));
  check(train<fsdp::FullShard, fsdp::NoBackwardPrefetch, fsdp::OffloadParams>(4, two, 3));
  check(train<fsdp::ShardGradOp, fsdp::CommPrecision<fsdp::bf16, fsdp::bf16>>(4, two, 3));  // partial: resharding after all
  check(train<fsdp::HybridShard, fsdp::MixedPrecision<fsdp::bf16, float>>(8, two, 3, {2, 4}));
}

TEST_CASE("reshard_after_forward switched at run time") {
  const Run kept = train<fsdp::FullShard>(2, {.reshard_after_forward = false}, 2);
  const Run zero3 = train<fsdp::ShardGradOp>(2, {.reshard_after_forward = true}, 2);
  const Run full = train<fsdp::FullShard>(2, {}, 2);
  CHECK(kept.params == full.params);
  CHECK(zero3.params == full.params);
  for (int r = 0; r < 2; ++r) {
    CHECK(gathers(kept.world[r]) == units);  // forward only, as ShardGradOp
    CHECK(gathers(zero3.world[r]) == gathers(full.world[r]));
    CHECK(kept.live_after_forward[r][1] > full.live_after_forward[r][1]);
  }
}

TEST_CASE("reshard_after_backward off while accumulating: the next forward needs no all-gather") {
  const int k = 3;
  const Run plain = train<fsdp::FullShard>(2, {.accumulate = k}, 3);
  const Run kept = train<fsdp::FullShard>(2, {.keep_after_backward = true, .accumulate = k}, 3);
  CHECK(kept.params == plain.params);
  for (int r = 0; r < 2; ++r) {
    // Each unit agrees on its settings at the first and the last micro-batch's backward,
    // where they change (one small all-gather each).
    const int agreements = 2 * units;
    CHECK(gathers(plain.world[r]) == k * (units + units - 1) + agreements);
    // Micro-batches 2..k find their parameters kept by the previous backward.
    CHECK(gathers(kept.world[r]) == units + k * (units - 1) + agreements);
    CHECK(kept.live[r] == plain.live[r]);  // after the synchronized backward nothing stays
  }
}

TEST_CASE("the gradient divide factor replaces the world size") {
  const Run plain = train<fsdp::FullShard>(2, {}, 1);
  const Run sum = train<fsdp::FullShard>(2, {.divide_factor = 1}, 1);
  const Run quarter = train<fsdp::FullShard>(2, {.divide_factor = 4}, 1);
  const Run third = train<fsdp::FullShard>(2, {.divide_factor = 3}, 1);
  REQUIRE(plain.grads.size() == 1);
  const Params& g = plain.grads[0];
  bool any_nonzero = false;
  for (std::size_t i = 0; i < g.size(); ++i)
    for (std::size_t e = 0; e < g[i].second.size(); ++e) {
      const float want = g[i].second[e];
      any_nonzero = any_nonzero || want != 0;
      CHECK(sum.grads[0][i].second[e] == want * 2);      // powers of two: exact
      CHECK(quarter.grads[0][i].second[e] == want / 2);
      CHECK(std::abs(third.grads[0][i].second[e] - want * 2 / 3) <= 1e-6 * std::abs(want) + 1e-12);
    }
  CHECK(any_nonzero);
  CHECK(sum.params != plain.params);
}

TEST_CASE("errors: bad groups, bad factors, settings that differ across ranks") {
  using test_support::contains;
  auto with_model = [](int world, auto fn) {
    return test_support::errors_per_rank(world, [&](fsdp::ThreadComm& comm) {
      engine::Model model(config());
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      fn(comm, model, sm, device);
    });
  };
  auto step = [](engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice& device, int s, int r) {
    sm.zero_grad();
    micro_batch(model, sm, engine::make_batch(config(), s, r, 1), nullptr, device);
  };
  SUBCASE("a group size that does not divide the shard group, or is all of it") {
    for (int k : {3, 4}) {
      const auto msgs = with_model(4, [&](fsdp::ThreadComm& comm, auto&, fsdp::ShardedModel& sm, auto&) {
        auto group = comm.split(comm.rank() < k ? 0 : 1, comm.rank());
        sm.set_reshard_after_forward(group);
      });
      for (int r = 0; r < 4; ++r)
        if (r < k) CHECK(contains(msgs[r], "a partial reshard needs a group whose size divides the shard group's 4 ranks"));
    }
  }
  SUBCASE("a group whose ranks are not shard ranks modulo k") {
    const auto msgs = with_model(4, [&](fsdp::ThreadComm& comm, auto&, fsdp::ShardedModel& sm, auto&) {
      auto strided = comm.split(comm.rank() % 2, comm.rank());  // {0, 2}, {1, 3}
      sm.set_reshard_after_forward(strided);
    });
    CHECK(msgs[0].empty());
    CHECK(contains(msgs[2], "unit '<root>' on rank 2: set_reshard_after_forward(group): this rank is rank 1 of the group "
                            "but rank 2 of its shard group of 4"));
  }
  SUBCASE("bad divide factors") {
    for (double f : {0.0, -2.0, std::nan(""), double(INFINITY)}) {
      const auto msgs = with_model(2, [&](auto&, auto&, fsdp::ShardedModel& sm, auto&) { sm.set_gradient_divide_factor(f); });
      CHECK(contains(msgs[0], "set_gradient_divide_factor("));
      CHECK(contains(msgs[0], "the factor must be a positive finite number"));
    }
  }
  SUBCASE("only one rank changes a setting: an error on every rank, before any backward all-gather") {
    const auto msgs = with_model(2, [&](fsdp::ThreadComm& comm, engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice& device) {
      step(model, sm, device, 0, comm.rank());
      if (comm.rank() == 1) sm.set_reshard_after_forward(false);
      step(model, sm, device, 1, comm.rank());
    });
    CHECK(contains(msgs[1], "its run-time settings changed at this backward (now sync on, all-reduce on, keep_unsharded, "
                            "reshard after forward off"));
    CHECK(!msgs[0].empty());
  }
  SUBCASE("ranks change to different settings") {
    const auto msgs = with_model(4, [&](fsdp::ThreadComm& comm, engine::Model& model, fsdp::ShardedModel& sm, fsdp::HostDevice& device) {
      step(model, sm, device, 0, comm.rank());
      auto group = comm.split(comm.rank() / 2, comm.rank());
      if (comm.rank() < 2) sm.set_reshard_after_forward(group);
      else sm.set_gradient_divide_factor(8);
      step(model, sm, device, 1, comm.rank());
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "run-time settings differ across ranks"));
      CHECK(contains(msgs[r], "rank 0 sync on, all-reduce on, keep_unsharded, reshard after forward to groups of 2 ranks"));
      CHECK(contains(msgs[r], "rank 3 sync on, all-reduce on, keep_unsharded, reshard after forward on, reshard after "
                              "backward on, gradient divide factor 8"));
    }
  }
  SUBCASE("settings changed mid-step") {
    const auto msgs = with_model(1, [&](fsdp::ThreadComm&, engine::Model& model, fsdp::ShardedModel& sm, auto&) {
      sm[0].pre_forward();
      sm.set_reshard_after_backward(false);
      (void)model;
    });
    CHECK(contains(msgs[0], "set_reshard_after_backward"));
  }
}

}  // namespace core_reshard_settings_test
