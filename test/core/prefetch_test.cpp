// Prefetch: every mode keeps parity, the per-rank peak is what the mode's schedule
// implies (to the byte), the limit on gathered-ahead units holds, explicit prefetch lists
// replace the recorded order, and a unit running out of the recorded order is reported.
#include <doctest/doctest.h>

#include <cstring>

#include <fsdp/comm/async_communicator.hpp>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/reference_training.hpp"

namespace core_prefetch_test {

namespace {

using test_support::bitwise_equal;
using test_support::Params;
using test_support::unit_numels;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

enum class Mode { none, backward_pre, backward_post, forward_and_pre };

template <class... Policies>
Params train(int world, int steps, std::vector<std::size_t>* peaks, bool async = false) {
  const auto c = config();
  std::vector<Params> per_rank(world);
  if (peaks) peaks->assign(world, 0);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::AsyncCommunicator stream(comm);  // this rank's communication stream
    auto run = [&](auto& group) {
      auto sm = fsdp::shard<fsdp::FullShard, Policies...>(model, group, device, engine::Wrap{});
      engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
      engine::AdamW opt({}, alloc);
      for (int s = 0; s < steps; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank(), 1));
      if (peaks) (*peaks)[comm.rank()] = device.stats().peak_bytes;
      per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
    };
    if (async) run(stream);
    else run(comm);
  });
  return per_rank[0];
}

// Replays `steps` training steps under FullShard with the given prefetch mode, tracking
// the bytes alive on rank r. The first step records the order and prefetches nothing.
// `deferred`: the backend is asynchronous, so a unit's unsharded gradient stays alive
// until the next unit's post_backward (or finish_backward) completes its reduction.
std::size_t expected_peak(Mode mode, int world, int rank, int steps, bool deferred = false) {
  const auto units = unit_numels(config());
  const std::size_t n = units.size(), gain = n - 1;
  std::size_t steady = 0;
  std::vector<std::size_t> full(n);
  for (std::size_t u = 0; u < n; ++u) {
    const std::int64_t shard = (units[u] + world - 1) / world;
    steady += 4 * static_cast<std::size_t>(2 * shard);  // sharded params + grads
    full[u] = 4 * static_cast<std::size_t>(shard * world);
  }
  // AdamW moments appear at the end of the first step: 2 x valid elements per unit.
  std::size_t adam = 0;
  for (std::size_t u = 0; u < n; ++u) {
    const std::int64_t shard = (units[u] + world - 1) / world;
    adam += 4 * 2 * static_cast<std::size_t>(std::clamp<std::int64_t>(units[u] - rank * shard, 0, shard));
  }
  std::size_t live = steady, peak = steady;
  std::vector<bool> gathered(n, false);
  auto add = [&](std::size_t b) { live += b; peak = std::max(peak, live); };
  auto gather = [&](std::size_t u) { if (!gathered[u]) { gathered[u] = true; add(full[u]); } };
  auto free_params = [&](std::size_t u) { gathered[u] = false; live -= full[u]; };
  std::vector<std::size_t> forward{0}, backward{0, gain};
  for (std::size_t b = 1; b < gain; ++b) forward.push_back(b);
  forward.push_back(gain);
  for (std::size_t b = gain - 1; b >= 1; --b) backward.push_back(b);
  auto next_in = [](const std::vector<std::size_t>& order, std::size_t u) -> long {
    for (std::size_t i = 0; i + 1 < order.size(); ++i) if (order[i] == u) return static_cast<long>(order[i + 1]);
    return -1;
  };
  long pending = -1;  // the unit whose reduction is in flight
  for (int s = 0; s < steps; ++s) {
    const bool prefetch = s > 0;
    for (std::size_t u : forward) {
      gather(u);
      if (prefetch && mode == Mode::forward_and_pre) if (long nx = next_in(forward, u); nx >= 0) gather(nx);
      if (u != 0) free_params(u);
    }
    free_params(0);
    for (std::size_t u : backward) {
      gather(u);
      add(full[u]);  // unsharded gradient
      if (prefetch && (mode == Mode::backward_pre || mode == Mode::forward_and_pre))
        if (long nx = next_in(backward, u); nx >= 0) gather(nx);
      if (u != 0) {
        free_params(u);
        if (prefetch && mode == Mode::backward_post) if (long nx = next_in(backward, u); nx >= 0) gather(nx);
        if (!deferred) live -= full[u];  // reduced synchronously and freed
        else { if (pending >= 0) live -= full[pending]; pending = static_cast<long>(u); }
      }
    }
    free_params(0);
    if (deferred && pending >= 0) live -= full[pending];
    pending = -1;
    live -= full[0];  // the root's reduction is the last one finish_backward completes
    if (s == 0) add(adam);
  }
  return peak;
}

}  // namespace

TEST_CASE("every prefetch mode keeps bitwise parity with unsharded training") {
  const int world = 4, steps = 5;
  const Params want = test_support::reference_params(config(), steps, world);
  CHECK(bitwise_equal(train<fsdp::NoBackwardPrefetch>(world, steps, nullptr), want));
  CHECK(bitwise_equal(train<fsdp::BackwardPre>(world, steps, nullptr), want));
  CHECK(bitwise_equal(train<fsdp::BackwardPost>(world, steps, nullptr), want));
  CHECK(bitwise_equal(train<fsdp::BackwardPre, fsdp::ForwardPrefetch>(world, steps, nullptr), want));
}

TEST_CASE("per-rank peak per prefetch mode equals the schedule's, to the byte") {
  for (int world : {2, 3, 4}) {
    CAPTURE(world);
    const int steps = 3;
    std::vector<std::size_t> none, pre, post, fwd;
    train<fsdp::NoBackwardPrefetch>(world, steps, &none);
    train<fsdp::BackwardPre>(world, steps, &pre);
    train<fsdp::BackwardPost>(world, steps, &post);
    train<fsdp::ForwardPrefetch>(world, steps, &fwd);  // BackwardPre is the default
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(none[r] == expected_peak(Mode::none, world, r, steps));
      CHECK(pre[r] == expected_peak(Mode::backward_pre, world, r, steps));
      CHECK(post[r] == expected_peak(Mode::backward_post, world, r, steps));
      CHECK(fwd[r] == expected_peak(Mode::forward_and_pre, world, r, steps));
    }
    // PRE holds one more unit during backward than no prefetch; POST prefetches only
    // after a unit's parameters are freed, so it costs less than PRE.
    CHECK(pre[0] > none[0]);
    CHECK(post[0] < pre[0]);
  }
}

TEST_CASE("on an asynchronous communicator: parity, and a peak that does not depend on timing") {
  // Collectives run on each rank's communication thread; a reduction overlaps the next
  // unit's backward and is completed at that unit's post_backward, so one more unsharded
  // gradient is alive than with a synchronous backend — at points fixed by the hooks.
  const int world = 4, steps = 4;
  const Params want = test_support::reference_params(config(), steps, world);
  for (int repeat = 0; repeat < 3; ++repeat) {
    std::vector<std::size_t> none, pre, post;
    CHECK(bitwise_equal(train<fsdp::NoBackwardPrefetch>(world, steps, &none, true), want));
    CHECK(bitwise_equal(train<fsdp::BackwardPre>(world, steps, &pre, true), want));
    CHECK(bitwise_equal(train<fsdp::BackwardPost, fsdp::ForwardPrefetch>(world, steps, &post, true), want));
    for (int r = 0; r < world; ++r) {
      CHECK(none[r] == expected_peak(Mode::none, world, r, steps, true));
      CHECK(pre[r] == expected_peak(Mode::backward_pre, world, r, steps, true));
    }
    CHECK(none[0] > expected_peak(Mode::none, world, 0, steps, false));  // the deferral is real
  }
}

TEST_CASE("the default backward prefetch is BackwardPre, as in PyTorch") {
  static_assert(std::is_same_v<fsdp::Policies<fsdp::FullShard>::backward_prefetch, fsdp::BackwardPre>);
  static_assert(std::is_same_v<fsdp::Policies<>::forward_prefetch, fsdp::NoForwardPrefetch>);
  std::vector<std::size_t> by_default, pre;
  train<>(2, 3, &by_default);
  train<fsdp::BackwardPre>(2, 3, &pre);
  CHECK(by_default == pre);
}

TEST_CASE("explicit prefetch lists gather the listed units, no more than the limit") {
  const auto c = config();
  for (int limit : {0, 1, 2, 3}) {
    CAPTURE(limit);
    fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
      engine::Sgd sgd(0.01f);
      engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));  // records the order
      sm.set_max_prefetched_units(limit);
      auto& root = sm.unit_for(model);
      root.set_units_to_forward_prefetch({&sm.unit("blocks.0"), &sm.unit("blocks.1"), &sm.unit("blocks.2")});
      const auto steady = device.stats().live_bytes;
      root.pre_forward();
      const std::int64_t block = c.dim * c.hidden + c.hidden + c.hidden * c.dim + c.dim;
      const std::int64_t root_numel = c.in * c.dim + c.dim + c.dim * c.out + c.out;
      auto padded = [](std::int64_t n) { return static_cast<std::size_t>((n + 1) / 2 * 2) * 4; };
      const std::size_t gathered_ahead = static_cast<std::size_t>(std::min(limit, 3));
      CHECK(device.stats().live_bytes == steady + padded(root_numel) + gathered_ahead * padded(block));
      // A prefetched unit's parameters become valid at its own hook, from the prefetched buffer.
      CHECK(model.blocks[0].fc1.weight.data() == nullptr);
      sm.unit("blocks.0").pre_forward();
      CHECK(model.blocks[0].fc1.weight.data() != nullptr);
      sm.unit("blocks.0").post_forward();
      for (auto* name : {"blocks.1", "blocks.2"}) { sm.unit(name).pre_forward(); sm.unit(name).post_forward(); }
      root.post_forward();
      CHECK(device.stats().live_bytes == steady);  // nothing gathered ahead is left behind
    });
  }
}

TEST_CASE("a unit that runs out of the recorded order is reported when prefetching") {
  const auto c = config();
  std::vector<std::string> msgs(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::ForwardPrefetch>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.01f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    sm.unit_for(model).pre_forward();
    try {
      sm.unit("blocks.1").pre_forward();  // the first iteration ran blocks.0 here
    } catch (const fsdp::Error& e) {
      msgs[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    CHECK(msgs[r] == "fsdp: unit 'blocks.1' on rank " + std::to_string(r) +
                         " runs at forward step #1 where the first iteration ran 'blocks.0'; prefetching follows the "
                         "first iteration's order, so a model whose order changes needs NoBackwardPrefetch and "
                         "NoForwardPrefetch");
}

TEST_CASE("without prefetch a later change of order is fine") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.01f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    sm.unit("blocks.2").pre_forward();
    sm.unit("blocks.2").post_forward();
    CHECK(sm.unit("blocks.2").state() == fsdp::TrainingState::IDLE);
  });
}

TEST_CASE("reshard() of a unit gathered ahead but never run frees it and its prefetch slot") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::AsyncCommunicator stream(comm);
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, stream, device, engine::Wrap{});
    engine::Sgd sgd(0.01f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    sm.set_max_prefetched_units(1);
    const auto steady = device.stats().live_bytes;
    auto& root = sm.unit_for(model);
    root.set_units_to_forward_prefetch({&sm.unit("blocks.2")});
    root.pre_forward();  // gathers blocks.2 ahead
    root.post_forward();
    sm.reshard();        // blocks.2 never ran: its buffer and its prefetch slot are released
    CHECK(device.stats().live_bytes == steady);
    root.set_units_to_forward_prefetch({&sm.unit("blocks.1")});
    root.pre_forward();  // the slot is free again: blocks.1 is gathered ahead
    const std::int64_t block = c.dim * c.hidden + c.hidden + c.hidden * c.dim + c.dim;
    const std::int64_t root_numel = c.in * c.dim + c.dim + c.dim * c.out + c.out;
    auto padded = [](std::int64_t n) { return static_cast<std::size_t>((n + 1) / 2 * 2) * 4; };
    CHECK(device.stats().live_bytes == steady + padded(root_numel) + padded(block));
    root.post_forward();
    sm.reshard();
  });
}

}  // namespace core_prefetch_test
