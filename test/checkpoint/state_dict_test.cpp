// State dicts: full and sharded, of parameters, buffers and the optimizer, saved on N ranks
// and loaded on M (any N, M, strategies): training continues as if it had never stopped.
// A bad state (missing, extra, wrong shape or dtype; bad on one rank only) is an error on
// every rank and leaves the model and optimizer untouched.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include <fsdp/checkpoint/load_state.hpp>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "test/support/errors.hpp"
#include "test/support/reference_training.hpp"

namespace {

using Params = test_support::Params;

engine::ModelConfig config(std::uint64_t seed = 1) {
  engine::ModelConfig c;
  c.blocks = 3;
  c.seed = seed;
  return c;
}

constexpr int kGlobalBatch = 12;  // divisible by 1, 2, 3, 4

// Runs steps [first, last) of AdamW training on `world` ranks, after `before` (a load) on
// each rank; `after` sees each rank's model at the end. Returns rank 0's full parameters.
template <class Strategy>
Params train(int world, int first, int last, std::uint64_t seed,
             const std::function<void(fsdp::ShardedModel&, engine::AdamWState&, int)>& before,
             const std::function<void(fsdp::ShardedModel&, engine::AdamWState&, int)>& after) {
  auto c = config(seed);
  std::vector<Params> out(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    engine::AdamWState state(opt, sm);
    if (before) before(sm, state, comm.rank());
    const int local = kGlobalBatch / world;
    for (int s = first; s < last; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
    if (after) after(sm, state, comm.rank());
    out[static_cast<std::size_t>(comm.rank())] = engine::gather_full_parameters(model, sm);
  });
  return out[0];
}

std::vector<fsdp::ShardedStateDict> save_sharded(int world, int steps) {
  std::vector<fsdp::ShardedStateDict> dicts(static_cast<std::size_t>(world));
  train<fsdp::FullShard>(world, 0, steps, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    dicts[static_cast<std::size_t>(r)] = fsdp::sharded_state_dict(sm, &st);
  });
  return dicts;
}

}  // namespace

TEST_CASE("a sharded state dict saved on N ranks resumes on M ranks and another strategy") {
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  for (auto [n, m] : {std::pair{2, 3}, {4, 1}, {1, 4}, {3, 2}, {2, 2}}) {
    CAPTURE(n);
    CAPTURE(m);
    const auto dicts = save_sharded(n, 3);
    std::int64_t saved = 0;
    for (auto& d : dicts) saved += static_cast<std::int64_t>(d.slices.size());
    CHECK(saved > 0);
    auto load = [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      auto report = fsdp::load_state(sm, fsdp::ShardedStateDictsSource(dicts), &st);
      CHECK(report.missing.empty());
      CHECK(report.unexpected.empty());
    };
    // seed 7: the fresh model starts elsewhere, so only the load can bring it back.
    const Params resumed = m % 2 ? train<fsdp::ShardGradOp>(m, 3, 6, 7, load, nullptr)
                                 : train<fsdp::FullShard>(m, 3, 6, 7, load, nullptr);
    CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
  }
}

TEST_CASE("without the optimizer state the resumed run differs: the moments are really restored") {
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  const auto dicts = save_sharded(2, 3);
  const Params params_only = train<fsdp::FullShard>(2, 3, 6, 7, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int) {
    fsdp::load_state(sm, fsdp::ShardedStateDictsSource(dicts));
  }, nullptr);
  CHECK(test_support::max_difference(params_only, uninterrupted) > 1e-4);
}

TEST_CASE("full state dict: clean FQNs, whole tensors, rank 0 only on request, and it loads back") {
  const Params uninterrupted = test_support::reference_params(config(), 6, kGlobalBatch);
  fsdp::FullStateDict full;
  std::vector<std::size_t> sizes(3);
  train<fsdp::FullShard>(3, 0, 3, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    auto sd = fsdp::full_state_dict(sm, &st, {.rank0_only = true});
    sizes[static_cast<std::size_t>(r)] = sd.tensors.size();
    if (r == 0) full = std::move(sd);
  });
  CHECK(sizes[1] == 0);
  CHECK(sizes[2] == 0);
  engine::Model probe(config());
  for (auto& p : engine::named_parameters(probe)) {
    REQUIRE(full.tensors.count(p.fqn));
    CHECK(full.tensors[p.fqn].numel() == p.param->numel());
    CHECK(full.optim["exp_avg"].count(p.fqn));
    CHECK(full.optim["exp_avg_sq"][p.fqn].data.size() == static_cast<std::size_t>(p.param->numel()) * 4);
  }
  for (auto& b : engine::named_buffers(probe)) CHECK(full.tensors.count(b.fqn));
  CHECK(full.optim_scalars.at("step") == "3");
  const Params resumed = train<fsdp::FullShard>(2, 3, 6, 7, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_state(sm, fsdp::FullStateDictSource(full), &st);
  }, nullptr);
  CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
}

TEST_CASE("a bad state is an error on every rank and loads nothing") {
  const auto dicts = save_sharded(2, 2);
  fsdp::FullStateDict good;
  train<fsdp::FullShard>(2, 0, 2, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    auto sd = fsdp::full_state_dict(sm, &st);
    if (r == 0) good = std::move(sd);
  });
  const std::string victim = "blocks.1.fc1.weight";
  REQUIRE(good.tensors.count(victim));

  struct Case {
    const char* name;
    std::function<void(fsdp::FullStateDict&)> corrupt;
    const char* expected;
  };
  const std::vector<Case> cases{
      {"missing", [&](fsdp::FullStateDict& d) { d.tensors.erase(victim); }, "is missing"},
      {"extra", [&](fsdp::FullStateDict& d) { d.tensors["blocks.9.w"] = d.tensors[victim]; }, "blocks.9.w"},
      {"shape", [&](fsdp::FullStateDict& d) { d.tensors[victim].shape = {d.tensors[victim].numel()}; }, "but the model has"},
      {"dtype", [&](fsdp::FullStateDict& d) { d.tensors[victim].dtype = fsdp::DType::f64; }, "f64"},
      {"optimizer", [&](fsdp::FullStateDict& d) { d.optim["exp_avg"].erase(victim); }, "optimizer state 'exp_avg'"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    fsdp::FullStateDict bad = good;
    c.corrupt(bad);
    for (bool only_rank1 : {false, true}) {
      CAPTURE(only_rank1);
      std::vector<std::string> errors(2);
      std::vector<Params> before(2), after(2);
      std::vector<long> steps(2);
      fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        engine::Model model(config(7));
        fsdp::HostDevice device;
        auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
        engine::AdamW opt({});
        engine::AdamWState st(opt, sm);
        before[r] = engine::gather_full_parameters(model, sm);
        const auto& source = (only_rank1 && r == 0) ? good : bad;
        errors[r] = test_support::error_of([&] { fsdp::load_state(sm, fsdp::FullStateDictSource(source), &st); });
        after[r] = engine::gather_full_parameters(model, sm);
        steps[r] = opt.step_count();
      });
      for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r);
        CHECK_FALSE(errors[r].empty());
        CHECK(after[r] == before[r]);  // untouched
        CHECK(steps[r] == 0);
      }
      CHECK(test_support::contains(errors[1], c.expected));
      CHECK(test_support::contains(errors[1], "nothing was loaded"));
      if (only_rank1) CHECK(test_support::contains(errors[0], "another rank"));
    }
  }
}

TEST_CASE("strict = false loads what matches and reports the rest") {
  fsdp::FullStateDict sd;
  train<fsdp::FullShard>(2, 0, 1, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int r) {
    auto d = fsdp::full_state_dict(sm);
    if (r == 0) sd = std::move(d);
  });
  sd.tensors.erase("head.bias");
  sd.tensors["extra.weight"] = sd.tensors["head.weight"];
  std::vector<fsdp::LoadReport> reports(2);
  train<fsdp::FullShard>(2, 0, 0, 7, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int r) {
    reports[static_cast<std::size_t>(r)] = fsdp::load_state(sm, fsdp::FullStateDictSource(sd), nullptr, {.strict = false});
  }, nullptr);
  for (auto& rep : reports) {
    REQUIRE(rep.missing.size() == 1);
    CHECK(test_support::contains(rep.missing[0], "head.bias"));
    REQUIRE(rep.unexpected.size() == 1);
    CHECK(test_support::contains(rep.unexpected[0], "extra.weight"));
  }
}
