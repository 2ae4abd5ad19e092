// Per-rank memory counted by the Device equals the FullShard formula, to the byte, without
// prefetch (test/core/prefetch_test.cpp covers what each prefetch mode adds).
//
// With N ranks, unit u holding n_u parameter elements of 4 bytes:
//   padded P_u = ceil(n_u / N) * N * 4 bytes, shard S_u = P_u / N,
//   valid_u(r) = elements of rank r's shard that are real parameters (not padding).
// Steady state on rank r: sum_u 2*S_u (sharded params + sharded grads)
//                       + optimizer state (AdamW: 2 * 4 * valid_u(r) per unit).
// The root unit (embed + head) is unsharded for the whole forward and backward, the
// layers one at a time, and backward holds parameters and gradients, so
//   peak(train) = steady + 2*P_root + 2*max_layer P_l,  peak(forward only) = steady + P_root + max_layer P_l.
// On one rank the engine adds into the sharded gradient itself (it is the whole padded
// parameter): backward holds no unsharded gradient, and peak(train) = peak(forward only).
// Every expected number here is computed from the model's configuration, not read back
// from the library.
#include <doctest/doctest.h>

#include <algorithm>

#include "examples/engine/fsdp_integration.hpp"

namespace core_sharded_memory_test {

namespace {

struct Expected {
  std::size_t steady_params_grads = 0;  // 2 * sum S_u
  std::size_t adam_state = 0;           // 2 * 4 * sum valid_u(r)
  std::size_t root_padded = 0;
  std::size_t max_layer_padded = 0;
};

Expected expected_for(const engine::ModelConfig& c, int world, int rank) {
  const std::int64_t root = c.in * c.dim + c.dim + c.dim * c.out + c.out;
  const std::int64_t block = c.dim * c.hidden + c.hidden + c.hidden * c.dim + c.dim;  // + adapter of 0
  const std::int64_t gain = c.dim;
  std::vector<std::int64_t> units{root, gain};
  for (int i = 0; i < c.blocks; ++i) units.push_back(block);
  Expected e;
  auto padded_bytes = [&](std::int64_t n) { return static_cast<std::size_t>((n + world - 1) / world * world) * 4; };
  for (auto n : units) {
    const std::int64_t shard = (n + world - 1) / world;
    e.steady_params_grads += 2 * static_cast<std::size_t>(shard) * 4;
    e.adam_state += 2 * 4 * static_cast<std::size_t>(std::clamp<std::int64_t>(n - rank * shard, 0, shard));
  }
  e.root_padded = padded_bytes(root);
  e.max_layer_padded = std::max(padded_bytes(block), padded_bytes(gain));
  return e;
}

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 4;
  return c;
}

}  // namespace

TEST_CASE("FullShard per-rank peak equals the formula, to the byte") {
  const auto c = config();
  for (int world : {1, 2, 3, 4, 8}) {
    CAPTURE(world);
    std::vector<fsdp::MemoryStats> after_setup(world), after_train(world), after_eval(world);
    std::vector<std::size_t> kept_after_eval(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);  // initial weights on the engine's heap, not the Device
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
      after_setup[comm.rank()] = device.stats();

      engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
      engine::AdamW opt({}, alloc);
      for (int s = 0; s < 3; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank(), 1));
      after_train[comm.rank()] = device.stats();

      device.reset_peak();
      engine::UnitHooks hooks{sm};
      model.forward(engine::make_batch(c, 9, comm.rank(), 1).x, hooks);  // evaluation: forward only
      // The unit backward starts with (the root here) keeps its parameters at the end of
      // forward, to skip a free-and-gather; after a forward-only pass reshard() frees them.
      kept_after_eval[comm.rank()] = device.stats().live_bytes;
      sm.reshard();
      after_eval[comm.rank()] = device.stats();
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const Expected e = expected_for(c, world, r);
      const std::size_t steady = e.steady_params_grads + e.adam_state;
      CHECK(after_setup[r].live_bytes == e.steady_params_grads);
      CHECK(after_setup[r].peak_bytes == e.steady_params_grads);
      CHECK(after_train[r].live_bytes == steady);
      const std::size_t unsharded_grads = world == 1 ? 0 : e.root_padded + e.max_layer_padded;
      CHECK(after_train[r].peak_bytes == steady + e.root_padded + e.max_layer_padded + unsharded_grads);
      CHECK(kept_after_eval[r] == steady + e.root_padded);
      CHECK(after_eval[r].live_bytes == steady);
      CHECK(after_eval[r].peak_bytes == steady + e.root_padded + e.max_layer_padded);
    }
  }
}

TEST_CASE("sharding divides the parameter and gradient memory by N") {
  const auto c = config();
  std::size_t one_rank = 0;
  for (int world : {1, 4}) {
    std::size_t live = 0;
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
      if (comm.rank() == 0) live = device.stats().live_bytes;
    });
    if (world == 1) one_rank = live;
    else CHECK(live * world <= one_rank + 5 * 2 * 4 * world);  // equal up to the padding of 5 units
  }
}

TEST_CASE("gradient accumulation without zero_grad costs one shard-sized buffer, not more") {
  // After zero_grad the reduce-scatter writes straight into the sharded gradient; without
  // it a temporary of S_u bytes holds the new reduction before it is added. That
  // temporary is alive while the unsharded gradient still is (params already freed), so
  // it never raises the peak above 2 * P_u per unit.
  const auto c = config();
  const int world = 4;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::NoBackwardPrefetch>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.0f);
    engine::sharded_step(model, sm, sgd, engine::make_batch(c, 0, comm.rank(), 1));
    const auto first = device.stats();
    engine::UnitHooks hooks{sm};
    engine::Mat dout;
    device.reset_peak();
    auto out = model.forward(engine::make_batch(c, 1, comm.rank(), 1).x, hooks);
    engine::mse(out, engine::make_batch(c, 1, comm.rank(), 1).y, dout);
    model.backward(dout, hooks);  // no zero_grad: accumulates
    sm.finish_backward();
    const Expected e = expected_for(c, world, comm.rank());
    CHECK(first.peak_bytes == e.steady_params_grads + 2 * e.root_padded + 2 * e.max_layer_padded);
    CHECK(device.stats().peak_bytes == first.peak_bytes);
    CHECK(device.stats().live_bytes == e.steady_params_grads);
  });
}

}  // namespace core_sharded_memory_test
