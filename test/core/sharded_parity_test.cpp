// Sharded training equals unsharded training on the same global batch.
//
// Bitwise where the summation order is the same: with one sample per rank and N a power of
// two, every gradient element is summed sample by sample in the same order both ways
// (ThreadGroup reduces in rank order), and the 1/N scalings are exact, so the parameters
// match to the bit. Otherwise (N = 3, whose divide factors 2 and 1.5 are not exact, or
// several samples per rank, where per-rank partial sums reassociate the batch sum) they
// match within a tolerance of a few float ulps grown over the steps.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "examples/engine/fsdp_integration.hpp"

// core_sharding_test is the header-only mode's run (test/BUILD.bazel, test/defs.bzl): a
// dependency that brought in //:fsdp_separate would make it a separately compiled one.
#if defined(FSDP_SEPARATE_COMPILATION)
#error "core_sharding_test runs the header-only mode: it must not depend on //:fsdp_separate"
#endif

namespace core_sharded_parity_test {

namespace {

enum class Opt { sgd, adamw };

struct Run {
  std::vector<std::pair<std::string, std::vector<float>>> params;
  std::vector<double> losses;  // global loss per step (mean of the ranks' losses)
};

engine::ModelConfig config() {
  engine::ModelConfig c;  // dim 13, hidden 7, in 5, out 3: no size divisible by 2, 3, 4 or 8
  c.blocks = 3;
  return c;
}

template <class O>
Run reference(int steps, int global_batch, O opt) {
  auto c = config();
  engine::Model model(c);
  Run r;
  for (int s = 0; s < steps; ++s) r.losses.push_back(engine::unsharded_step(model, opt, engine::make_batch(c, s, 0, global_batch)));
  for (auto& p : engine::named_parameters(model))
    r.params.emplace_back(p.fqn, std::vector<float>(p.param->data(), p.param->data() + p.param->numel()));
  return r;
}

Run reference(Opt o, int steps, int global_batch) {
  if (o == Opt::sgd) return reference(steps, global_batch, engine::Sgd(0.05f));
  return reference(steps, global_batch, engine::AdamW({}));
}

Run sharded(Opt o, int world, int steps, int local_batch) {
  auto c = config();
  Run out;
  std::vector<std::vector<std::pair<std::string, std::vector<float>>>> per_rank(world);
  std::vector<std::vector<double>> losses(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::Sgd sgd(0.05f);
    engine::AdamW adamw({}, alloc);
    for (int s = 0; s < steps; ++s) {
      auto batch = engine::make_batch(c, s, comm.rank() * local_batch, local_batch);
      losses[comm.rank()].push_back(o == Opt::sgd ? engine::sharded_step(model, sm, sgd, batch)
                                                  : engine::sharded_step(model, sm, adamw, batch));
    }
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);  // every rank sees the same model
  out.params = per_rank[0];
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    for (int r = 0; r < world; ++r) sum += losses[r][s];
    out.losses.push_back(sum / world);
  }
  return out;
}

void check_same_names(const Run& a, const Run& b) {
  REQUIRE(a.params.size() == b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    REQUIRE(a.params[i].first == b.params[i].first);
    REQUIRE(a.params[i].second.size() == b.params[i].second.size());
  }
}

void check_bitwise(const Run& got, const Run& want) {
  check_same_names(got, want);
  for (std::size_t i = 0; i < got.params.size(); ++i) {
    const auto& g = got.params[i].second;
    const auto& w = want.params[i].second;
    INFO("parameter ", got.params[i].first);
    // memcmp must not see the null data() of an empty vector, even with size 0.
    CHECK((g.empty() || std::memcmp(g.data(), w.data(), g.size() * sizeof(float)) == 0));
  }
}

void check_close(const Run& got, const Run& want, double tol) {
  check_same_names(got, want);
  double worst = 0;
  for (std::size_t i = 0; i < got.params.size(); ++i)
    for (std::size_t k = 0; k < got.params[i].second.size(); ++k)
      worst = std::max(worst, std::fabs(double(got.params[i].second[k]) - want.params[i].second[k]));
  CHECK(worst <= tol);
  for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(got.losses[s] == doctest::Approx(want.losses[s]).epsilon(1e-5));
}

}  // namespace

TEST_CASE("the reference model has the edge cases the parity tests rely on") {
  auto c = config();
  engine::Model model(c);
  fsdp::HostDevice device;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    CHECK(&sm.unit("gain") == sm.find_unit_for(model.gain));  // a one-parameter unit
    CHECK(sm.unit("gain").shards().size() == 1);
  });
  CHECK(model.blocks[0].adapter.numel() == 0);  // a zero-size parameter inside each block
  for (int world : {2, 3, 4, 8}) CHECK(c.dim % world != 0);
}

TEST_CASE("FullShard matches unsharded training bit for bit (one sample per rank, N a power of two)") {
  for (Opt o : {Opt::sgd, Opt::adamw}) {
    for (int world : {1, 2, 4, 8}) {
      CAPTURE(world);
      CAPTURE(o == Opt::sgd ? "sgd" : "adamw");
      const Run want = reference(o, 6, world);
      const Run got = sharded(o, world, 6, 1);
      check_bitwise(got, want);
      // Losses are per-rank means averaged over ranks: equal to the global mean up to rounding.
      for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(got.losses[s] == doctest::Approx(want.losses[s]).epsilon(1e-6));
    }
  }
}

TEST_CASE("FullShard matches unsharded training within float rounding where the sum order differs") {
  // tol: a few ulps of values of order 1 after 6 steps; a wrong gradient scale or a lost
  // shard moves parameters by ~1e-3 or more.
  for (Opt o : {Opt::sgd, Opt::adamw}) {
    CAPTURE(o == Opt::sgd ? "sgd" : "adamw");
    SUBCASE("N = 3, one sample per rank") { check_close(sharded(o, 3, 6, 1), reference(o, 6, 3), 2e-6); }
    SUBCASE("N = 4, two samples per rank") { check_close(sharded(o, 4, 6, 2), reference(o, 6, 8), 2e-6); }
    SUBCASE("N = 8, three samples per rank") { check_close(sharded(o, 8, 6, 3), reference(o, 6, 24), 2e-6); }
  }
}

TEST_CASE("training moves the parameters (the parity above is not trivially true)") {
  const Run before = reference(Opt::adamw, 0, 4);
  const Run after = sharded(Opt::adamw, 4, 6, 1);
  check_same_names(before, after);
  double moved = 0;
  for (std::size_t i = 0; i < before.params.size(); ++i)
    for (std::size_t k = 0; k < before.params[i].second.size(); ++k)
      moved = std::max(moved, std::fabs(double(before.params[i].second[k]) - after.params[i].second[k]));
  CHECK(moved > 1e-3);
  CHECK(after.losses.back() < after.losses.front());
}

}  // namespace core_sharded_parity_test
