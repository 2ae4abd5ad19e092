// Gradient accumulation over k micro-batches (fsdp/policy/gradient_sync.hpp): parity with an
// unsharded engine that calls backward k times before stepping, for every strategy, both
// accumulation modes, HybridShard's deferred all-reduce, mixed precision and offload; the
// bytes each mode communicates and the memory it keeps; what the engine's gradient tensors
// hold when a later micro-batch's backward starts; and the errors.
//
// Convention checked here: each micro-batch's loss is a mean over its samples; after k
// micro-batches the parameters equal those of an unsharded engine that sums the gradients
// of the k global micro-batches (it calls backward k times, zeroing only once per step).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/rank_errors.hpp"
#include "test/support/reference_training.hpp"

namespace core_gradient_accumulation_test {

namespace {

using fsdp::Collective;
using fsdp::DType;
using fsdp::GradientSyncMode;
using test_support::max_difference;
using test_support::Params;
using Counting = fsdp::CountingCommunicator<fsdp::ThreadComm>;

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13, hidden 7: no size divisible by 2 or 4
  c.blocks = 3;
  return c;
}

// How the first k-1 micro-batches of a step are run (the last one always syncs).
enum class Accum {
  keep_unsharded,           // no_sync, GradientSyncMode::keep_unsharded (the default)
  reduce_every_microbatch,  // no_sync, GradientSyncMode::reduce_every_microbatch
  defer_all_reduce,         // sync on, set_requires_all_reduce(false) (hybrid)
};

struct Layout {
  int world = 2;
  fsdp::MeshShape mesh{1, 2};  // replicate x shard, hybrid strategies only
};

struct Result {
  Params params;
  std::vector<fsdp::CollectiveCounts> sharding, replicating;  // per rank, the last step
  std::vector<fsdp::CollectiveCounts> world_counts;           // per rank, the last step
  std::vector<std::size_t> peak;              // per rank, device space, whole run
  std::vector<std::size_t> live_after_first;  // per rank, device space, after micro-batch 1 of the last step
  std::vector<std::size_t> live_after_sync;   // per rank, device space, after the last step's synced backward
};

void micro_batch(engine::Model& model, fsdp::ShardedModel& sm, const engine::Batch& b) {
  engine::UnitHooks hooks{sm};
  engine::Mat dout;
  engine::mse(model.forward(b.x, hooks), b.y, dout);
  model.backward(dout, hooks);
  sm.finish_backward();
}

// `steps` SGD steps of k micro-batches of `local` samples per rank. SGD, not AdamW: Adam's
// update hardly depends on the gradient's scale, so it would hide a wrong division.
template <class Strategy, class Precision = fsdp::FullPrecision, class Offload = fsdp::NoOffload>
Result sharded(Layout layout, Accum accum, int k, int steps, int local = 1) {
  const auto c = config();
  const int world = layout.world;
  Result out;
  out.sharding.resize(world), out.replicating.resize(world), out.world_counts.resize(world);
  out.peak.resize(world), out.live_after_first.resize(world), out.live_after_sync.resize(world);
  std::vector<Params> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    Counting counted(comm);
    engine::Model model(c);
    fsdp::HostDevice device;
    std::optional<fsdp::DeviceMesh<Counting>> mesh;
    fsdp::ShardedModel sm = test_support::shard_engine<Strategy, Precision, Offload>(model, counted, mesh, layout.mesh, device);
    if (accum == Accum::reduce_every_microbatch) sm.set_gradient_sync_mode(GradientSyncMode::reduce_every_microbatch);
    engine::Sgd sgd(0.05f);
    auto reset_counts = [&] {
      counted.reset();
      if (mesh) mesh->shard_group().reset(), mesh->replicate_group().reset();
    };
    const auto dev = fsdp::MemorySpace::device;
    for (int s = 0; s < steps; ++s) {
      reset_counts();
      sm.zero_grad();
      for (int j = 0; j < k; ++j) {
        const auto batch = engine::make_batch(c, s * k + j, r * local, local);
        const bool last = j == k - 1;
        if (accum == Accum::defer_all_reduce) {
          sm.set_requires_all_reduce(last);
          micro_batch(model, sm, batch);
        } else if (!last) {
          auto scope = sm.no_sync();
          micro_batch(model, sm, batch);
        } else {
          micro_batch(model, sm, batch);
        }
        if (j == 0) out.live_after_first[r] = device.stats(dev).live_bytes;
      }
      out.live_after_sync[r] = device.stats(dev).live_bytes;
      const auto slots = engine::slots(sm);
      sgd.step(slots);
    }
    out.world_counts[r] = counted.counts();
    out.sharding[r] = mesh ? mesh->shard_group().counts() : counted.counts();
    out.replicating[r] = mesh ? mesh->replicate_group().counts() : counted.counts();
    out.peak[r] = device.stats(dev).peak_bytes;
    per_rank[r] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  out.params = per_rank[0];
  return out;
}

// The unsharded engine: per step, zero once, backward on each of the k global micro-batches
// (each loss a mean over its world * local samples), one SGD step. With param != f32 it
// computes in a copy rounded to `param` (gradients accumulating there, as the layers do)
// and the master gradient is that sum rounded to `reduce`: MixedPrecision's casts.
Params reference(int world, int k, int steps, int local = 1, DType param = DType::f32, DType reduce = DType::f32,
                 double loss_scale = 1.0) {
  const auto c = config();
  engine::Model master(c), compute(c, engine::heap(), param, param);
  engine::Sgd sgd(0.05f);
  auto mp = engine::named_parameters(master), cp = engine::named_parameters(compute);
  auto mb = engine::named_buffers(master), cb = engine::named_buffers(compute);
  for (int s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < mp.size(); ++i)
      for (std::int64_t e = 0; e < mp[i].param->numel(); ++e) cp[i].param->set(e, mp[i].param->get(e));
    for (std::size_t i = 0; i < mb.size(); ++i)
      for (std::int64_t e = 0; e < mb[i].buffer->numel(); ++e) cb[i].buffer->set(e, mb[i].buffer->get(e));
    engine::zero_grads(compute);
    for (int j = 0; j < k; ++j) {
      const auto batch = engine::make_batch(c, s * k + j, 0, world * local);
      engine::Mat dout;
      engine::mse(compute.forward(batch.x), batch.y, dout);
      for (auto& v : dout.v) v = static_cast<float>(v * loss_scale);
      compute.backward(dout);
    }
    for (std::size_t i = 0; i < mp.size(); ++i)
      for (std::int64_t e = 0; e < mp[i].grad->numel(); ++e)
        mp[i].grad->set(e, engine::round_to(reduce, cp[i].grad->get(e)));
    const auto slots = engine::slots(master);
    sgd.step(slots);
  }
  Params p;
  for (auto& np : mp) p.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  return p;
}

// f32: the same sums associated differently (per rank first, or per micro-batch first):
// measured under 1e-7 after 3 steps. Dividing the accumulated gradient by k, or not
// accumulating, moves the parameters by > 4e-2 (the first test case checks > 2e-2).
constexpr double f32_tolerance = 1e-6;
// bf16: rounding at different points (the reference adds every sample and micro-batch in
// bf16; here per-rank sums, kept in the reduce dtype, reduced in bf16 or f32): measured
// under 9e-4 (MixedPrecision<bf16, float>, k = 2).
constexpr double bf16_tolerance = 2e-3;

template <class Strategy, class Precision = fsdp::FullPrecision, class Offload = fsdp::NoOffload>
void check_parity(Layout layout, Accum accum, double tol, DType param = DType::f32, DType reduce = DType::f32) {
  for (int k : {1, 2, 4}) {
    CAPTURE(k);
    const auto got = sharded<Strategy, Precision, Offload>(layout, accum, k, 3);
    const double diff = max_difference(got.params, reference(layout.world, k, 3, 1, param, reduce));
    CAPTURE(diff);
    CHECK(diff <= tol);
  }
}

std::vector<Accum> modes() { return {Accum::keep_unsharded, Accum::reduce_every_microbatch}; }

}  // namespace

TEST_CASE("the tolerances can fail: dividing by k, or training without accumulation, is far off") {
  const Params want = reference(2, 4, 3);
  CHECK(max_difference(reference(2, 4, 3, 1, DType::f32, DType::f32, 0.25), want) > 10 * bf16_tolerance);
  CHECK(max_difference(reference(2, 1, 3), want) > 10 * bf16_tolerance);
  CHECK(max_difference(reference(2, 4, 0), want) > 10 * bf16_tolerance);  // training moves the parameters
}

TEST_CASE_TEMPLATE("parity with unsharded accumulation over k = 1, 2, 4 micro-batches (f32)", Strategy,
                   fsdp::FullShard, fsdp::ShardGradOp, fsdp::NoShard) {
  for (Accum a : modes()) {
    CAPTURE(static_cast<int>(a));
    check_parity<Strategy>({1}, a, f32_tolerance);  // one rank: the engine adds into the sharded gradient
    check_parity<Strategy>({2}, a, f32_tolerance);
    check_parity<Strategy>({4}, a, f32_tolerance);
  }
}

TEST_CASE_TEMPLATE("HybridShard on a 2x2 mesh: both modes and the deferred all-reduce", Strategy, fsdp::HybridShard,
                   fsdp::HybridShardZero2) {
  const Layout l{4, {2, 2}};
  for (Accum a : {Accum::keep_unsharded, Accum::reduce_every_microbatch, Accum::defer_all_reduce}) {
    CAPTURE(static_cast<int>(a));
    check_parity<Strategy>(l, a, f32_tolerance);
  }
}

TEST_CASE("bf16 mixed precision: parity in both modes, reduce in bf16 or in f32") {
  for (Accum a : modes()) {
    CAPTURE(static_cast<int>(a));
    check_parity<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>({4}, a, bf16_tolerance, DType::bf16, DType::bf16);
    check_parity<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>>({4}, a, bf16_tolerance, DType::bf16, DType::f32);
    check_parity<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>>({1}, a, bf16_tolerance, DType::bf16, DType::f32);
    check_parity<fsdp::NoShard, fsdp::MixedPrecision<fsdp::bf16>>({2}, a, bf16_tolerance, DType::bf16, DType::bf16);
  }
  check_parity<fsdp::HybridShard, fsdp::MixedPrecision<fsdp::bf16>>({4, {2, 2}}, Accum::defer_all_reduce, bf16_tolerance,
                                                                   DType::bf16, DType::bf16);
}

TEST_CASE("OffloadParams: parity in both modes, f32 and bf16") {
  for (Accum a : modes()) {
    CAPTURE(static_cast<int>(a));
    check_parity<fsdp::FullShard, fsdp::FullPrecision, fsdp::OffloadParams>({4}, a, f32_tolerance);
    check_parity<fsdp::FullShard, fsdp::FullPrecision, fsdp::OffloadParams>({1}, a, f32_tolerance);
    check_parity<fsdp::ShardGradOp, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({2}, a, bf16_tolerance,
                                                                                            DType::bf16, DType::bf16);
    check_parity<fsdp::NoShard, fsdp::FullPrecision, fsdp::OffloadParams>({2}, a, f32_tolerance);
  }
  check_parity<fsdp::HybridShard, fsdp::FullPrecision, fsdp::OffloadParams>({4, {2, 2}}, Accum::defer_all_reduce,
                                                                           f32_tolerance);
}

namespace {
std::int64_t round_up(std::int64_t n, std::int64_t g) { return (n + g - 1) / g * g; }

// Bytes of every unit's unsharded (padded) gradient in f32, in unit_numels' order (root,
// blocks, gain); and their sum.
std::vector<std::size_t> unit_grad_bytes(std::int64_t group) {
  std::vector<std::size_t> out;
  for (auto n : test_support::unit_numels(config())) out.push_back(4 * static_cast<std::size_t>(round_up(n, group)));
  return out;
}
std::size_t unsharded_grad_bytes(std::int64_t group) {
  std::size_t sum = 0;
  for (auto b : unit_grad_bytes(group)) sum += b;
  return sum;
}
}  // namespace

TEST_CASE("keep_unsharded communicates 1/k of the gradient bytes and keeps one unsharded gradient per unit") {
  const int world = 4, k = 4;
  const auto a = sharded<fsdp::FullShard>({world}, Accum::keep_unsharded, k, 2);
  const auto b = sharded<fsdp::FullShard>({world}, Accum::reduce_every_microbatch, k, 2);
  const auto plain = sharded<fsdp::FullShard>({world}, Accum::keep_unsharded, 1, 2);
  const std::size_t grads = unsharded_grad_bytes(world);
  const auto per_unit = unit_grad_bytes(world);
  const std::size_t root = per_unit[0], block = per_unit[1];
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    // One reduce-scatter of every unit's gradient per step, as without accumulation; k of them in B.
    CHECK(a.sharding[r][Collective::reduce_scatter].bytes == grads);
    CHECK(a.sharding[r][Collective::reduce_scatter].bytes == plain.sharding[r][Collective::reduce_scatter].bytes);
    CHECK(b.sharding[r][Collective::reduce_scatter].bytes == k * grads);
    CHECK(a.sharding[r][Collective::reduce_scatter].calls * k == b.sharding[r][Collective::reduce_scatter].calls);
    // Parameters are gathered the same either way (plus the same settings agreements).
    CHECK(a.sharding[r][Collective::all_gather] == b.sharding[r][Collective::all_gather]);
    // After micro-batch 1, A holds every unit's unsharded gradient; after the synced
    // backward it holds nothing more than B.
    CHECK(a.live_after_first[r] - b.live_after_first[r] == grads);
    CHECK(a.live_after_sync[r] == b.live_after_sync[r]);
    CHECK(b.live_after_sync[r] == plain.live_after_sync[r]);
    // Peaks: B's, in a block's backward, already holds two unsharded gradients: the root's
    // (its backward spans the whole pass) and that block's; A's holds every unit's.
    CHECK(a.peak[r] - b.peak[r] == grads - root - block);
  }
  MESSAGE("FullShard, 4 ranks, k=4, per rank per step: reduce_scatter bytes keep_unsharded ",
          a.sharding[0][Collective::reduce_scatter].bytes, " vs reduce_every_microbatch ",
          b.sharding[0][Collective::reduce_scatter].bytes, "; device peak ", a.peak[0], " vs ", b.peak[0],
          " (unsharded gradients of all units: ", grads, ")");
}

TEST_CASE("NoShard keeps in full precision in place: no extra memory, 1/k of the all-reduce bytes") {
  const int world = 2, k = 4;
  const auto a = sharded<fsdp::NoShard>({world}, Accum::keep_unsharded, k, 2);
  const auto b = sharded<fsdp::NoShard>({world}, Accum::reduce_every_microbatch, k, 2);
  const std::size_t grads = unsharded_grad_bytes(1);
  for (int r = 0; r < world; ++r) {
    CHECK(a.world_counts[r][Collective::all_reduce].bytes == grads);
    CHECK(b.world_counts[r][Collective::all_reduce].bytes == k * grads);
    CHECK(a.peak[r] <= b.peak[r]);  // the gradient accumulates in the sharded (= full) gradient itself
  }
}

// One rank: a unit's shard is its whole padded parameter, so after zero_grad the engine
// adds into the sharded gradient itself, as under NoShard. Kept unsharded across k
// micro-batches it stays there: the peak is the one of a step without accumulation. Reduced
// every micro-batch, each later one needs an unsharded gradient of its own (the sharded one
// already holds a sum) from a unit's pre_backward to its post_backward: the root's, which
// spans the whole backward, and one block's at once.
TEST_CASE("FullShard on one rank accumulates in the sharded gradient: no unsharded gradient kept") {
  const int k = 4;
  const auto a = sharded<fsdp::FullShard>({1}, Accum::keep_unsharded, k, 2);
  const auto b = sharded<fsdp::FullShard>({1}, Accum::reduce_every_microbatch, k, 2);
  const auto plain = sharded<fsdp::FullShard>({1}, Accum::keep_unsharded, 1, 2);
  CHECK(a.peak[0] == plain.peak[0]);
  CHECK(a.live_after_first[0] == a.live_after_sync[0]);  // nothing kept beside the sharded gradients
  const auto grads = unit_grad_bytes(1);  // root, blocks, gain
  CHECK(b.peak[0] == a.peak[0] + grads[0] + grads[1]);
}

TEST_CASE("HybridShard 2x2: what each way of accumulating sends and keeps") {
  const Layout l{4, {2, 2}};
  const int k = 4;
  const auto a = sharded<fsdp::HybridShard>(l, Accum::keep_unsharded, k, 2);
  const auto b = sharded<fsdp::HybridShard>(l, Accum::reduce_every_microbatch, k, 2);
  const auto d = sharded<fsdp::HybridShard>(l, Accum::defer_all_reduce, k, 2);
  const std::size_t grads = unsharded_grad_bytes(2);
  const std::size_t shards = grads / 2;  // every unit's gradient shard
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(a.sharding[r][Collective::reduce_scatter].bytes == grads);
    CHECK(a.replicating[r][Collective::all_reduce].bytes == shards);
    CHECK(b.sharding[r][Collective::reduce_scatter].bytes == k * grads);
    CHECK(b.replicating[r][Collective::all_reduce].bytes == k * shards);
    // set_requires_all_reduce(false): every reduce-scatter, one all-reduce.
    CHECK(d.sharding[r][Collective::reduce_scatter].bytes == k * grads);
    CHECK(d.replicating[r][Collective::all_reduce].bytes == shards);
    CHECK(d.live_after_first[r] - b.live_after_first[r] == shards);  // the waiting shard-group sums
    CHECK(d.live_after_sync[r] == b.live_after_sync[r]);
    CHECK(a.live_after_first[r] - b.live_after_first[r] == grads);
  }
  MESSAGE("HybridShard 2x2, k=4, per rank per step: reduce_scatter/all_reduce bytes keep_unsharded ",
          a.sharding[0][Collective::reduce_scatter].bytes, "/", a.replicating[0][Collective::all_reduce].bytes,
          ", reduce_every_microbatch ", b.sharding[0][Collective::reduce_scatter].bytes, "/",
          b.replicating[0][Collective::all_reduce].bytes, ", defer_all_reduce ",
          d.sharding[0][Collective::reduce_scatter].bytes, "/", d.replicating[0][Collective::all_reduce].bytes,
          "; device peak ", a.peak[0], " / ", b.peak[0], " / ", d.peak[0]);
}

TEST_CASE("bf16 reduce: the kept gradient is in the reduce dtype; with OffloadParams it stays in device space") {
  const int world = 2, k = 2;
  const auto a = sharded<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({world}, Accum::keep_unsharded, k, 2);
  const auto b = sharded<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>({world}, Accum::reduce_every_microbatch, k, 2);
  const auto f = sharded<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>, fsdp::OffloadParams>({world}, Accum::keep_unsharded, k, 2);
  const std::size_t grads = unsharded_grad_bytes(world);
  for (int r = 0; r < world; ++r) {
    CHECK(a.live_after_first[r] - b.live_after_first[r] == grads / 2);  // bf16
    CHECK(f.live_after_first[r] - b.live_after_first[r] == grads);      // f32
    // Freed by the synced backward: what stays in device space is what B keeps too (the
    // buffers' bf16 copies; offloaded shards live in host space).
    CHECK(a.live_after_sync[r] == b.live_after_sync[r]);
    CHECK(f.live_after_sync[r] == b.live_after_sync[r]);
    CHECK(b.live_after_sync[r] < grads / 8);
    CHECK(a.sharding[r][Collective::reduce_scatter].bytes == grads / 2);
    CHECK(f.sharding[r][Collective::reduce_scatter].bytes == grads);
  }
}

namespace {
bool all_zero(const fsdp::ShardedModel& sm) {
  for (const auto& v : sm.shards())
    for (std::int64_t i = 0; i < v.numel; ++i)
      if (static_cast<const float*>(v.grad)[i] != 0.0f) return false;
  return true;
}
}  // namespace

TEST_CASE("what the sharded gradient holds between micro-batches") {
  const auto c = config();
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, fsdp::MeshShape{2, 2});
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::HybridShard>(model, mesh, device, engine::Wrap{});
    const auto batch = engine::make_batch(c, 0, comm.rank(), 1);
    sm.zero_grad();
    {
      auto scope = sm.no_sync();  // keep_unsharded: nothing reduced
      micro_batch(model, sm, batch);
    }
    CHECK(all_zero(sm));
    sm.set_requires_all_reduce(false);  // reduce-scattered, waiting for the all-reduce
    micro_batch(model, sm, batch);
    CHECK(all_zero(sm));
    sm.set_requires_all_reduce(true);
    micro_batch(model, sm, batch);
    CHECK(!all_zero(sm));
    sm.zero_grad();
    sm.set_gradient_sync_mode(GradientSyncMode::reduce_every_microbatch);
    {
      auto scope = sm.no_sync();  // reduces anyway
      micro_batch(model, sm, batch);
    }
    CHECK(!all_zero(sm));
  });
}

TEST_CASE("zero_grad frees kept unsharded gradients and waiting shard-group sums") {
  const auto c = config();
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, fsdp::MeshShape{2, 2});
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::HybridShard, fsdp::MixedPrecision<fsdp::bf16, float>>(model, mesh, device, engine::Wrap{});
    const auto dev = fsdp::MemorySpace::device;
    const std::size_t idle = device.stats(dev).live_bytes;
    const auto batch = engine::make_batch(c, 0, comm.rank(), 1);
    for (bool keep : {true, false}) {
      CAPTURE(keep);
      if (keep) sm.set_requires_gradient_sync(false);
      else sm.set_requires_all_reduce(false);
      micro_batch(model, sm, batch);
      micro_batch(model, sm, batch);
      const std::size_t kept = device.stats(dev).live_bytes - idle;
      // f32 (the reduce dtype) unsharded gradients, or f32 shards of them.
      CHECK(kept == (keep ? unsharded_grad_bytes(2) : unsharded_grad_bytes(2) / 2));
      sm.zero_grad();
      CHECK(device.stats(dev).live_bytes == idle);
      sm.set_requires_gradient_sync(true);
      sm.set_requires_all_reduce(true);
    }
  });
}

TEST_CASE("per-unit settings: only some units keep their gradients; parity holds") {
  const int world = 2, k = 3;
  std::vector<Params> per_rank(world);
  std::vector<fsdp::CollectiveCounts> counts(world);
  const auto c = config();
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    Counting counted(comm);
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, counted, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < 3; ++s) {
      counted.reset();
      sm.zero_grad();
      for (int j = 0; j < k; ++j) {
        sm.unit("blocks.1").set_requires_gradient_sync(j == k - 1);
        sm.unit("").set_requires_gradient_sync(j == k - 1);
        micro_batch(model, sm, engine::make_batch(c, s * k + j, comm.rank(), 1));
      }
      const auto slots = engine::slots(sm);
      sgd.step(slots);
    }
    counts[comm.rank()] = counted.counts();
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  CHECK(max_difference(per_rank[0], reference(world, k, 3)) <= f32_tolerance);
  const auto per_unit = unit_grad_bytes(world);
  std::size_t expected = 0;  // root and blocks.1 once, the others every micro-batch
  for (std::size_t u = 0; u < per_unit.size(); ++u) expected += (u == 0 || u == 2 ? 1 : k) * per_unit[u];
  CHECK(counts[0][Collective::reduce_scatter].bytes == expected);
}

TEST_CASE("no_sync restores each unit's setting when it ends, also by an exception") {
  const auto c = config();
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    sm.unit("gain").set_requires_gradient_sync(false);
    auto syncs = [&] {
      std::vector<bool> out;
      for (auto& u : sm) out.push_back(u->config().sync.requires_sync);
      return out;
    };
    const auto before = syncs();
    CHECK(before == std::vector<bool>{true, true, true, true, false});
    {
      auto scope = sm.no_sync();
      CHECK(syncs() == std::vector<bool>(5, false));
      {
        auto inner = sm.no_sync();
      }
      CHECK(syncs() == std::vector<bool>(5, false));  // nested: the outer scope still holds
    }
    CHECK(syncs() == before);
    try {
      auto scope = sm.no_sync();
      engine::UnitHooks hooks{sm};
      model.forward(engine::make_batch(c, 0, 0, 1).x, hooks);
      throw std::runtime_error("engine failure");
    } catch (const std::runtime_error&) {
    }
    CHECK(syncs() == before);
  });
}

TEST_CASE("changing the settings outside IDLE is an error naming the unit and its state") {
  const auto c = config();
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& unit = sm.unit("blocks.0");
    auto f = unit.forward_scope();
    CHECK_THROWS_WITH_AS(unit.set_requires_gradient_sync(false),
                         "fsdp: unit 'blocks.0' on rank 0: set_requires_gradient_sync called in state FORWARD; expected IDLE",
                         fsdp::Error);
    CHECK_THROWS_WITH_AS(sm.set_requires_all_reduce(false),
                         "fsdp: unit 'blocks.0' on rank 0: set_requires_all_reduce called in state FORWARD; expected IDLE",
                         fsdp::Error);
    CHECK_THROWS_AS(auto scope = sm.no_sync(), fsdp::Error);
    for (auto& u : sm) CHECK(u->config().sync.requires_sync);  // a failed no_sync changes nothing
  });
}

TEST_CASE("settings that differ across ranks fail on every rank, naming the unit and the ranks") {
  const auto c = config();
  auto run = [&](auto configure) {
    return test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      sm.zero_grad();
      micro_batch(model, sm, engine::make_batch(c, 0, comm.rank(), 1));  // a first iteration in step
      configure(sm, comm.rank());
      micro_batch(model, sm, engine::make_batch(c, 1, comm.rank(), 1));
      micro_batch(model, sm, engine::make_batch(c, 2, comm.rank(), 1));
    });
  };
  SUBCASE("both ranks change, to different settings") {
    const auto msgs = run([](fsdp::ShardedModel& sm, int rank) {
      if (rank == 0) sm.set_requires_gradient_sync(false);
      else sm.set_gradient_sync_mode(GradientSyncMode::reduce_every_microbatch);
    });
    for (int r = 0; r < 2; ++r)
      CHECK(msgs[r] == "fsdp: unit '<root>': run-time settings differ across ranks (seen on rank " + std::to_string(r) +
                           "): rank 0 sync off, all-reduce on, keep_unsharded, reshard after forward on, reshard after "
                           "backward on, gradient divide factor the world size; rank 1 sync on, all-reduce on, "
                           "reduce_every_microbatch, reshard after forward on, reshard after backward on, gradient "
                           "divide factor the world size");
  }
  SUBCASE("one rank turns sync off, the other does not") {
    const auto msgs = run([](fsdp::ShardedModel& sm, int rank) {
      if (rank == 1) sm.set_requires_gradient_sync(false);
    });
    for (int r = 0; r < 2; ++r) CHECK(!msgs[r].empty());
    CHECK(msgs[1].find("unit '<root>' on rank 1: its run-time settings changed at this backward (now sync off, "
                       "all-reduce on, keep_unsharded, reshard after forward on, reshard after backward on, gradient "
                       "divide factor the world size) but another rank ran a different collective here") != std::string::npos);
    CHECK(msgs[1].find("rank 0") != std::string::npos);  // the backend's message names the other rank
  }
}

// Groups of one (one rank, HSDP over shard groups of one): the reduction is a copy, or
// the cast straight into the sharded gradient, which must not drop what earlier
// micro-batches reduced or kept (grad_is_zero, kept sums, deferral).
TEST_CASE("groups of one rank: parity in every accumulation mode, bf16 with f32 reduction and f32") {
  using MP = fsdp::MixedPrecision<fsdp::bf16, float>;
  for (Accum a : modes()) {
    CAPTURE(static_cast<int>(a));
    check_parity<fsdp::FullShard, MP>({1}, a, bf16_tolerance, DType::bf16, DType::f32);
    check_parity<fsdp::NoShard, MP>({1}, a, bf16_tolerance, DType::bf16, DType::f32);
    check_parity<fsdp::FullShard>({1}, a, f32_tolerance);
    check_parity<fsdp::NoShard>({1}, a, f32_tolerance);
  }
  for (Accum a : {Accum::keep_unsharded, Accum::reduce_every_microbatch, Accum::defer_all_reduce}) {
    CAPTURE(static_cast<int>(a));
    check_parity<fsdp::HybridShard, MP>({2, {2, 1}}, a, bf16_tolerance, DType::bf16, DType::f32);
    check_parity<fsdp::HybridShard>({2, {2, 1}}, a, f32_tolerance);
    check_parity<fsdp::HybridShard>({6, {2, 3}}, a, f32_tolerance);
  }
}

// What the engine finds in its gradient tensors when a unit's backward starts (the table
// in docs/training_loop.md#what-the-gradient-holds-when-backward-starts): zeros, or the
// gradient the engine wrote in the previous micro-batch (the kept unsharded sum, handed back
// to be added into). Read right after each unit's pre_backward, before the engine writes.
namespace {

enum class FirstBackward {
  synced,             // sync on: no accumulation (two backwards between zero_grads)
  keep_unsharded,     // no_sync, GradientSyncMode::keep_unsharded (the default)
  reduce_every,       // no_sync, GradientSyncMode::reduce_every_microbatch
  no_all_reduce,      // sync on, set_requires_all_reduce(false) (hybrid)
  set_sync_off,       // set_requires_gradient_sync(false), the default mode
};

enum class Holds { zeros, first, other };

const char* name_of(Holds h) { return h == Holds::zeros ? "zeros" : h == Holds::first ? "first" : "other"; }

// Hooks that call the units' hooks (as engine::UnitHooks does) and read every bound
// gradient tensor: the first time one is seen in a pass (right after its unit's
// pre_backward), and the last time (right before its unit's post_backward).
struct GradientReader {
  engine::Model& model;
  fsdp::ShardedModel& sm;
  std::map<std::string, std::vector<float>> at_start, at_end;

  void read(std::map<std::string, std::vector<float>>& into, bool first_only) {
    for (auto& p : engine::named_parameters(model)) {
      if (!p.grad->raw() || (first_only && into.count(p.fqn))) continue;
      std::vector<float> v(static_cast<std::size_t>(p.grad->numel()));
      for (std::int64_t i = 0; i < p.grad->numel(); ++i) v[static_cast<std::size_t>(i)] = p.grad->get(i);
      into[p.fqn] = std::move(v);
    }
  }
  template <class M> void before_forward(const M* m) { if (auto* u = sm.find_unit_for(*m)) u->pre_forward(); }
  template <class M> void after_forward(const M* m) { if (auto* u = sm.find_unit_for(*m)) u->post_forward(); }
  template <class M> void before_backward(const M* m) {
    if (auto* u = sm.find_unit_for(*m)) u->pre_backward(), read(at_start, true);
  }
  template <class M> void after_backward(const M* m) {
    if (auto* u = sm.find_unit_for(*m)) read(at_end, false), u->post_backward();
  }
  void micro_batch(const engine::Batch& b) {
    at_start.clear(), at_end.clear();
    engine::Mat dout;
    engine::mse(model.forward(b.x, *this), b.y, dout);
    model.backward(dout, *this);
    sm.finish_backward();
  }
};

// For every rank and parameter: what its gradient tensor held when the second
// micro-batch's backward reached its unit, the first having run as `first`.
template <class Strategy, class... Ps>
std::set<std::string> second_backward_sees(Layout layout, FirstBackward first) {
  const auto c = config();
  std::vector<std::set<std::string>> per_rank(layout.world);
  fsdp::ThreadGroup(layout.world).run([&](fsdp::ThreadComm& comm) {
    const int r = comm.rank();
    engine::Model model(c);
    fsdp::HostDevice device;
    std::optional<fsdp::DeviceMesh<fsdp::ThreadComm>> mesh;
    fsdp::ShardedModel sm = test_support::shard_engine<Strategy, Ps...>(model, comm, mesh, layout.mesh, device);
    GradientReader reader{model, sm, {}, {}};
    sm.zero_grad();
    const auto b1 = engine::make_batch(c, 0, r, 1), b2 = engine::make_batch(c, 1, r, 1);
    switch (first) {
      case FirstBackward::synced: reader.micro_batch(b1); break;
      case FirstBackward::keep_unsharded: {
        auto scope = sm.no_sync();
        reader.micro_batch(b1);
        break;
      }
      case FirstBackward::reduce_every: {
        sm.set_gradient_sync_mode(GradientSyncMode::reduce_every_microbatch);
        auto scope = sm.no_sync();
        reader.micro_batch(b1);
        break;
      }
      case FirstBackward::no_all_reduce:
        sm.set_requires_all_reduce(false);
        reader.micro_batch(b1);
        sm.set_requires_all_reduce(true);
        break;
      case FirstBackward::set_sync_off:
        sm.set_requires_gradient_sync(false);
        reader.micro_batch(b1);
        sm.set_requires_gradient_sync(true);
        break;
    }
    const auto written = reader.at_end;  // what the engine wrote in micro-batch 1
    reader.micro_batch(b2);              // synced
    const std::size_t params = engine::named_parameters(model).size();
    REQUIRE(written.size() == params);
    REQUIRE(reader.at_start.size() == params);
    for (const auto& [fqn, seen] : reader.at_start) {
      const auto& w = written.at(fqn);
      if (w.empty()) continue;  // blocks.N.adapter holds no elements
      // Zeros and the first gradient must be told apart: every parameter got some gradient.
      REQUIRE(std::any_of(w.begin(), w.end(), [](float x) { return x != 0.0f; }));
      const bool zero = std::all_of(seen.begin(), seen.end(), [](float x) { return x == 0.0f; });
      per_rank[r].insert(name_of(zero ? Holds::zeros : seen == w ? Holds::first : Holds::other));
    }
  });
  for (int r = 1; r < layout.world; ++r) CHECK(per_rank[r] == per_rank[0]);
  return per_rank[0];
}

const std::set<std::string> zeros{"zeros"}, first{"first"};

}  // namespace

TEST_CASE("what the engine's gradient holds when the second micro-batch's backward starts") {
  using F = FirstBackward;
  using MPbf16 = fsdp::MixedPrecision<fsdp::bf16>;                       // reduce in bf16 = param
  using MPf32 = fsdp::MixedPrecision<fsdp::bf16, float>;                 // reduce in f32
  using MPbf16Keep = fsdp::MixedPrecision<fsdp::bf16, fsdp::bf16, fsdp::bf16, true>;
  using MPf32Keep = fsdp::MixedPrecision<fsdp::bf16, float, fsdp::bf16, true>;
  const Layout one{1}, two{2}, hybrid{4, {2, 2}};
  // No accumulation: every backward starts from zeros (each one reduced right away).
  CHECK(second_backward_sees<fsdp::FullShard>(two, F::synced) == zeros);
  CHECK(second_backward_sees<fsdp::FullShard>(one, F::synced) == zeros);  // the engine wrote into the shard
  CHECK(second_backward_sees<fsdp::NoShard>(two, F::synced) == zeros);
  // Sync off, keep_unsharded, accumulating in the compute dtype: the kept sum, to add into.
  CHECK(second_backward_sees<fsdp::FullShard>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::FullShard>(two, F::set_sync_off) == first);
  CHECK(second_backward_sees<fsdp::FullShard>(one, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::ShardGradOp>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::NoShard>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::HybridShard>(hybrid, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::FullShard, fsdp::OffloadParams>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::FullShard, fsdp::CommPrecision<fsdp::bf16>>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::FullShard, MPbf16>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::FullShard, MPbf16Keep>(two, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::FullShard, MPbf16>(one, F::keep_unsharded) == first);
  CHECK(second_backward_sees<fsdp::NoShard, MPbf16>(two, F::keep_unsharded) == first);
  // keep_unsharded with a reduce dtype other than the compute dtype: the sum is kept in the
  // reduce dtype, apart, and the engine gets a zeroed compute-dtype gradient.
  CHECK(second_backward_sees<fsdp::FullShard, MPf32>(two, F::keep_unsharded) == zeros);
  CHECK(second_backward_sees<fsdp::FullShard, MPf32Keep>(two, F::keep_unsharded) == zeros);
  CHECK(second_backward_sees<fsdp::FullShard, MPf32>(one, F::keep_unsharded) == zeros);
  CHECK(second_backward_sees<fsdp::NoShard, MPf32>(two, F::keep_unsharded) == zeros);
  // Reduced every micro-batch, or reduce-scattered with the all-reduce deferred: zeros.
  CHECK(second_backward_sees<fsdp::FullShard>(two, F::reduce_every) == zeros);
  CHECK(second_backward_sees<fsdp::FullShard>(one, F::reduce_every) == zeros);
  CHECK(second_backward_sees<fsdp::NoShard>(two, F::reduce_every) == zeros);
  CHECK(second_backward_sees<fsdp::HybridShard>(hybrid, F::no_all_reduce) == zeros);
}

}  // namespace core_gradient_accumulation_test
