// A unit entered several times per pass (fsdp/unit/sharded.hpp): the root of a GPT-style model
// with a tied embedding is used at both ends, a block may be applied twice, and blocks may
// recompute their forward inside their backward. Gradients accumulate across a unit's
// entries and are reduced once, after its last backward entry; its parameters are freed
// between uses under FullShard, so the root is no longer gathered for the whole step.
//
// Memory (FullShard, no prefetch, synchronous, SGD: no optimizer state). Per unit u with
// n_u elements on N ranks: P_u = ceil(n_u / N) * N * 4 bytes, S_u = P_u / N, and
//   steady = sum_u 2 * S_u
//   root around its uses:    peak = steady + max(2 P_root, P_root + 2 P_block)
//     (the root's gradient, P_root, lives from the projection's backward to the
//     embedding's; in between each block holds its parameters and gradient)
//   block applied twice:     peak = steady + max(2 P_root, P_root + 3 P_block)
//     (its gradient also waits for its second backward entry)
//   root around the pass:    peak = steady + 2 P_root + 2 P_block  (the only way before)
// On one rank the engine adds into the sharded gradients themselves (each the whole padded
// parameter, in steady): no unsharded gradient, so the formulas lose every gradient term:
// max(P_root, P_block) around the uses, block twice or not, and P_root + P_block around the pass.
// Expected numbers come from the configuration, never from the library.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fsdp/model/memory_plan.hpp>
#include <fsdp/testing/counting_communicator.hpp>

#include "test/core/tied_model.hpp"
#include "test/support/rank_errors.hpp"

namespace core_repeated_units_test {

namespace {

using Values = std::vector<std::vector<float>>;

// Every parameter's values (the tied one once), unsharded.
Values values(tied::TiedLM& m) {
  Values out;
  for (auto& s : m.unique_slots()) out.emplace_back(s.param, s.param + s.numel);
  return out;
}

Values reference(const tied::Config& c, int steps, int batch, float lr) {
  tied::TiedLM m(c);
  for (int s = 0; s < steps; ++s) tied::unsharded_step(m, tied::make_batch(c, s, 0, batch), lr);
  return values(m);
}

double max_difference(const Values& a, const Values& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return INFINITY;
    for (std::size_t k = 0; k < a[i].size(); ++k) worst = std::max(worst, std::fabs(double(a[i][k]) - b[i][k]));
  }
  return worst;
}

constexpr float lr = 0.05f;
constexpr int steps = 3;

template <class... Ps, class Comm>
Values train_sharded(const tied::Config& c, Comm& comm) {
  tied::TiedLM m(c);
  fsdp::HostDevice device;
  auto sm = fsdp::shard<Ps...>(m, comm, device, fsdp::wrap_types<engine::Block>{});
  for (int s = 0; s < steps; ++s) tied::sharded_step(m, sm, tied::make_batch(c, s, comm.rank(), 1), lr);
  auto summoned = sm.summon_full_params();
  return values(m);
}

std::vector<tied::Config> shapes() {
  std::vector<tied::Config> out(4);
  out[1].repeat_block = 1;
  out[2].recompute = true;
  out[3].whole_pass_root = true;
  return out;
}

std::size_t padded_bytes(std::int64_t n, int world) { return static_cast<std::size_t>((n + world - 1) / world * world) * 4; }

struct Sizes {
  std::size_t steady = 0, root = 0, block = 0;
};
Sizes sizes(const tied::Config& c, int world) {
  const std::int64_t root = c.vocab * c.dim;  // the tied weight, stored once
  const std::int64_t block = c.dim * c.hidden + c.hidden + c.hidden * c.dim + c.dim;
  Sizes s{2 * padded_bytes(root, world) / world, padded_bytes(root, world), padded_bytes(block, world)};
  s.steady += static_cast<std::size_t>(c.blocks) * 2 * padded_bytes(block, world) / world;
  return s;
}

struct Measured {
  std::size_t first_peak = 0, later_peak = 0, live = 0;
};
Measured measure(const tied::Config& c, int world, int rank_to_report = 0) {
  std::vector<Measured> out(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    tied::TiedLM m(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(m, comm, device, fsdp::wrap_types<engine::Block>{});
    auto& mine = out[static_cast<std::size_t>(comm.rank())];
    tied::sharded_step(m, sm, tied::make_batch(c, 0, comm.rank(), 1), lr);
    mine.first_peak = device.stats().peak_bytes;
    device.reset_peak();
    for (int s = 1; s < steps; ++s) tied::sharded_step(m, sm, tied::make_batch(c, s, comm.rank(), 1), lr);
    mine.later_peak = device.stats().peak_bytes;
    mine.live = device.stats().live_bytes;
  });
  return out[static_cast<std::size_t>(rank_to_report)];
}

}  // namespace

TEST_CASE_TEMPLATE("a root used at both ends, a block applied twice, recompute: training matches unsharded", Strategy,
                   fsdp::FullShard, fsdp::ShardGradOp, fsdp::NoShard) {
  for (const auto& c : shapes()) {
    CAPTURE(c.repeat_block);
    CAPTURE(c.recompute);
    CAPTURE(c.whole_pass_root);
    for (int world : {1, 2, 4}) {
      CAPTURE(world);
      const Values expected = reference(c, steps, world, lr);
      std::vector<Values> got(static_cast<std::size_t>(world));
      fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
        got[static_cast<std::size_t>(comm.rank())] = train_sharded<Strategy, fsdp::NoBackwardPrefetch>(c, comm);
      });
      for (int r = 0; r < world; ++r) {
        // One rank adds the two uses' gradients in the unsharded order: bit for bit. More
        // ranks add each rank's (projection + embedding) sums across ranks: float rounding.
        if (world == 1) CHECK(got[0] == expected);
        else CHECK(max_difference(got[static_cast<std::size_t>(r)], expected) < 1e-5);
      }
    }
  }
}

TEST_CASE("with every prefetch and an asynchronous communicator, repeated entries follow the recorded order") {
  for (const auto& c : shapes()) {
    CAPTURE(c.repeat_block);
    CAPTURE(c.recompute);
    const Values expected = reference(c, steps, 2, lr);
    std::vector<Values> got(2);
    fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
      fsdp::AsyncCommunicator stream(comm);
      got[static_cast<std::size_t>(comm.rank())] =
          train_sharded<fsdp::FullShard, fsdp::BackwardPre, fsdp::ForwardPrefetch>(c, stream);
    });
    for (const auto& g : got) CHECK(max_difference(g, expected) < 1e-5);
  }
}

TEST_CASE("the root is gathered only around its uses: the per-rank peak equals the formula, to the byte") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    tied::Config around_uses, twice, whole_pass;
    twice.repeat_block = 0;
    whole_pass.whole_pass_root = true;
    const Sizes s = sizes(around_uses, world);
    const std::size_t g = world == 1 ? 0 : 1;  // unsharded gradients: none on one rank
    const std::size_t uses = s.steady + std::max((1 + g) * s.root, g * s.root + (1 + g) * s.block);
    const std::size_t with_twice = s.steady + std::max((1 + g) * s.root, g * s.root + (1 + 2 * g) * s.block);
    const std::size_t pass = s.steady + (1 + g) * s.root + (1 + g) * s.block;
    const Measured a = measure(around_uses, world), t = measure(twice, world), p = measure(whole_pass, world);
    CHECK(a.first_peak == uses);
    CHECK(a.later_peak == uses);
    CHECK(a.live == s.steady);
    CHECK(t.later_peak == with_twice);
    CHECK(p.later_peak == pass);
    CHECK(a.later_peak < p.later_peak);
    if (world == 4)
      MESSAGE("4 ranks: steady ", s.steady, ", P_root ", s.root, ", P_block ", s.block, "; peak around uses ",
              a.later_peak, " (block twice ", t.later_peak, ") vs whole pass ", p.later_peak);
  }
}

TEST_CASE("the planner, given the pass's hook calls, plans each way of using the root to the byte") {
  // The hook calls TiedLM makes, on the planning model (its units have the model's FQNs):
  // the engine's own sequence, without the compute. fsdp::plan's default (each unit once,
  // nested by FQN) is the whole-pass root; the two others need the pass spelled out.
  auto pass_of = [](const tied::Config& c) {
    return [c](fsdp::ShardedModel& sm, const fsdp::PlanPass&) {
      fsdp::Unit& root = sm.unit("");
      std::vector<int> uses;
      for (int i = 0; i < c.blocks; ++i) uses.push_back(i);
      if (c.repeat_block >= 0) uses.push_back(c.repeat_block);
      auto block = [&](int i) -> fsdp::Unit& { return sm.unit("blocks." + std::to_string(i)); };
      if (c.whole_pass_root) root.pre_forward();
      else root.pre_forward(), root.post_forward();  // the embedding
      for (int i : uses) block(i).pre_forward(), block(i).post_forward();
      if (!c.whole_pass_root) root.pre_forward(), root.post_forward();  // the projection
      else root.post_forward();
      if (c.whole_pass_root) root.pre_backward();
      else root.pre_backward(), root.post_backward();
      for (std::size_t k = uses.size(); k-- > 0;) {
        fsdp::Unit& b = block(uses[k]);
        b.pre_backward();
        if (c.repeat_block >= 0 && uses[k] == c.repeat_block) b.pre_forward(), b.post_forward();  // recomputed
        b.post_backward();
      }
      if (!c.whole_pass_root) root.pre_backward(), root.post_backward();
      else root.post_backward();
    };
  };
  for (int world : {1, 2, 4}) {
    CAPTURE(world);
    tied::Config around_uses, twice, whole_pass;
    twice.repeat_block = 0;
    whole_pass.whole_pass_root = true;
    for (const tied::Config& c : {around_uses, twice, whole_pass}) {
      CAPTURE(c.repeat_block);
      CAPTURE(c.whole_pass_root);
      std::vector<fsdp::MemoryPlan> plans(static_cast<std::size_t>(world)), defaults(static_cast<std::size_t>(world));
      fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
        tied::TiedLM m(c);
        fsdp::HostDevice device;
        auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(m, comm, device, fsdp::wrap_types<engine::Block>{});
        const auto r = static_cast<std::size_t>(comm.rank());
        plans[r] = fsdp::plan(sm, {.steps = steps, .pass = pass_of(c)});
        defaults[r] = fsdp::plan(sm, {.steps = steps});
      });
      const Measured got = measure(c, world);
      CHECK(plans[0].peak_bytes() == std::max(got.first_peak, got.later_peak));
      CHECK(plans[0].steady[0] == got.live);
      for (int r = 1; r < world; ++r) CHECK(plans[static_cast<std::size_t>(r)].peak_bytes() == plans[0].peak_bytes());
      // The default pass is the whole-pass root; the others differ from it where gradients
      // are unsharded (more than one rank), so `pass` is what planned them.
      if (c.whole_pass_root) CHECK(defaults[0].peak_bytes() == plans[0].peak_bytes());
      else if (world > 1) CHECK(defaults[0].peak_bytes() != plans[0].peak_bytes());
    }
  }
}

TEST_CASE("recomputing inside the unit's backward needs no all-gather and no memory") {
  auto run = [](bool recompute) {
    tied::Config c;
    c.recompute = recompute;
    std::vector<fsdp::CollectiveCounts> counts(2);
    std::vector<std::size_t> peaks(2);
    fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
      fsdp::CountingCommunicator counted(comm);
      tied::TiedLM m(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(m, counted, device, fsdp::wrap_types<engine::Block>{});
      tied::sharded_step(m, sm, tied::make_batch(c, 0, comm.rank(), 1), lr);
      counted.reset();
      device.reset_peak();
      tied::sharded_step(m, sm, tied::make_batch(c, 1, comm.rank(), 1), lr);
      counts[static_cast<std::size_t>(comm.rank())] = counted.counts();
      peaks[static_cast<std::size_t>(comm.rank())] = device.stats().peak_bytes;
    });
    return std::pair{counts[0], peaks[0]};
  };
  const auto [plain, plain_peak] = run(false);
  const auto [recomputed, recomputed_peak] = run(true);
  CHECK(recomputed == plain);
  CHECK(recomputed_peak == plain_peak);
  // Per step: the root twice in forward (the second use kept for backward) and once more in
  // backward (freed between its backward uses); each block once per pass; one reduction per
  // unit; no order check of its own (ThreadComm compares each collective's tag).
  const tied::Config c;
  CHECK(plain[fsdp::Collective::all_gather].calls == static_cast<std::uint64_t>(2 + 1 + 2 * c.blocks));
  CHECK(plain[fsdp::Collective::reduce_scatter].calls == static_cast<std::uint64_t>(1 + c.blocks));
}

TEST_CASE("entry counts: backward counts down from the forward entries; unknown counts reduce at finish_backward") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    tied::Config c;
    fsdp::CountingCommunicator counted(comm);
    tied::TiedLM m(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(m, counted, device, fsdp::wrap_types<engine::Block>{});
    auto& root = sm.unit("");
    auto reductions = [&] { return counted.counts()[fsdp::Collective::reduce_scatter].calls; };
    root.pre_forward(); root.post_forward();
    root.pre_forward(); root.post_forward();
    CHECK(fsdp::detail::internals(root).forward_entries() == 2);
    root.pre_backward();
    CHECK(fsdp::detail::internals(root).backward_entries_left() == 2);
    root.post_backward();
    CHECK(root.state() == fsdp::TrainingState::BACKWARD_POST);
    CHECK(fsdp::detail::internals(root).backward_entries_left() == 1);
    const auto before = reductions();
    root.pre_backward();
    root.post_backward();
    CHECK(reductions() == before + 1);  // after the last entry, not at finish_backward
    sm.finish_backward();
    CHECK(fsdp::detail::internals(root).forward_entries() == 0);

    // A backward with no forward entry: the count is unknown, so the reduction waits for
    // finish_backward, and any number of backward entries may come first.
    root.pre_backward();
    CHECK(fsdp::detail::internals(root).backward_entries_left() == -1);
    root.post_backward();
    root.pre_backward();
    root.post_backward();
    const auto unknown = reductions();
    sm.finish_backward();
    CHECK(reductions() == unknown + 1);
    CHECK(root.state() == fsdp::TrainingState::IDLE);

    // reshard() ends a forward-only pass: its entries are not counted into the next.
    root.pre_forward(); root.post_forward();
    sm.reshard();
    root.pre_forward(); root.post_forward();
    CHECK(fsdp::detail::internals(root).forward_entries() == 1);
    sm.reshard();
  });
}

namespace {
// Runs `misuse` on the units of a fresh sharded tied model on 2 ranks; each rank's error.
template <class Fn>
std::vector<std::string> errors_of(Fn misuse) {
  return test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    tied::TiedLM m(tied::Config{});
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<engine::Block>{});
    misuse(sm);
  });
}
}  // namespace

TEST_CASE("a unit entered in an impossible order is an error on every rank, never a hang") {
  using test_support::contains;
  SUBCASE("more backward entries than forward entries") {
    auto msgs = errors_of([](fsdp::ShardedModel& sm) {
      auto& b = sm.unit("blocks.1");
      b.pre_forward(); b.post_forward();
      b.pre_backward(); b.post_backward();
      b.pre_backward();
    });
    for (int r = 0; r < 2; ++r)
      CHECK(contains(msgs[r], "unit 'blocks.1' on rank " + std::to_string(r) + ": pre_backward called after the unit's last "
                              "backward entry of this pass (it ran forward 1 time(s) and backward as often"));
  }
  SUBCASE("post_backward while a recomputed forward is open") {
    auto msgs = errors_of([](fsdp::ShardedModel& sm) {
      auto& b = sm.unit("blocks.0");
      b.pre_forward(); b.post_forward();
      b.pre_backward();
      b.pre_forward();  // recompute
      b.post_backward();
    });
    for (int r = 0; r < 2; ++r)
      CHECK(contains(msgs[r], "unit 'blocks.0' on rank " + std::to_string(r) +
                                  ": post_backward called in state FORWARD; expected BACKWARD_PRE"));
  }
  SUBCASE("a second forward inside an open forward") {
    auto msgs = errors_of([](fsdp::ShardedModel& sm) {
      auto& b = sm.unit("blocks.0");
      b.pre_forward();
      b.pre_forward();
    });
    for (int r = 0; r < 2; ++r) CHECK(contains(msgs[r], "pre_forward called in state FORWARD; expected IDLE"));
  }
}

}  // namespace core_repeated_units_test
