// State dicts: full and sharded, of parameters, buffers and the optimizer, saved on N ranks
// and loaded on M (any N, M, strategies): training continues as if it had never stopped.
// A bad state (missing, extra, wrong shape or dtype; bad on one rank only) is an error on
// every rank and leaves the model and optimizer untouched.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <fsdp/checkpoint/load_state.hpp>

#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_state_dict_test {

namespace {

using test_support::Params;
using test_support::train;

std::vector<fsdp::ShardedStateDict> save_sharded(int world, int steps) {
  std::vector<fsdp::ShardedStateDict> dicts(static_cast<std::size_t>(world));
  train<fsdp::FullShard>(world, 0, steps, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    dicts[static_cast<std::size_t>(r)] = fsdp::sharded_state_dict(sm, &st);
  });
  return dicts;
}

}  // namespace

TEST_CASE("a sharded state dict saved on N ranks resumes on M ranks and another strategy") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  engine::Model probe(test_support::resume_config());
  for (const auto& ranks : {std::pair{2, 3}, {4, 1}, {1, 4}, {3, 2}, {2, 2}}) {
    const int n = ranks.first, m = ranks.second;  // not bound: CAPTURE captures them
    CAPTURE(n);
    CAPTURE(m);
    const auto dicts = save_sharded(n, 3);
    // Every rank has a slice of every parameter (count 0 where it holds none of it, as
    // for the zero-element blocks.0.adapter), and the slices add up to the parameter.
    for (auto& p : engine::named_parameters(probe)) {
      CAPTURE(p.fqn);
      int slices = 0;
      std::int64_t elements = 0;
      for (const auto& d : dicts)
        for (const auto& s : d.slices)
          if (s.id == fsdp::StateKey::param(p.fqn)) ++slices, elements += s.count;
      CHECK(slices == n);
      CHECK(elements == p.param->numel());
    }
    const Params resumed = test_support::resume(m, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
      fsdp::load_state(sm, fsdp::ShardedStateDictsSource(dicts), &st);
    });
    CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
  }
}

TEST_CASE("without the optimizer state the resumed run differs: the moments are really restored") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  const auto dicts = save_sharded(2, 3);
  const Params params_only = train<fsdp::FullShard>(2, 3, 6, 7, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int) {
    fsdp::load_state(sm, fsdp::ShardedStateDictsSource(dicts));
  }, nullptr);
  CHECK(test_support::max_difference(params_only, uninterrupted) > 1e-4);
}

TEST_CASE("full state dict: clean FQNs, whole tensors, rank 0 only on request, and it loads back") {
  const Params uninterrupted = test_support::uninterrupted_params(6);
  fsdp::FullStateDict full;
  std::vector<std::size_t> sizes(3);
  train<fsdp::FullShard>(3, 0, 3, 1, nullptr, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
    auto sd = fsdp::full_state_dict(sm, &st, {.rank0_only = true});
    sizes[static_cast<std::size_t>(r)] = sd.tensors.size();
    if (r == 0) full = std::move(sd);
  });
  CHECK(sizes[1] == 0);
  CHECK(sizes[2] == 0);
  engine::Model probe(test_support::resume_config());
  for (auto& p : engine::named_parameters(probe)) {
    REQUIRE(full.tensors.count(p.fqn));
    CHECK(full.tensors[p.fqn].numel() == p.param->numel());
    CHECK(full.optim["exp_avg"].count(p.fqn));
    CHECK(full.optim["exp_avg_sq"][p.fqn].data.size() == static_cast<std::size_t>(p.param->numel()) * 4);
  }
  for (auto& b : engine::named_buffers(probe)) CHECK(full.tensors.count(b.fqn));
  CHECK(full.optim_scalars.at("step") == "3");
  const Params resumed = test_support::resume(2, [&](fsdp::ShardedModel& sm, engine::AdamWState& st, int) {
    fsdp::load_state(sm, fsdp::FullStateDictSource(full), &st);
  });
  CHECK(test_support::max_difference(resumed, uninterrupted) < 2e-5);
}

TEST_CASE("a bad state is an error on every rank and loads nothing") {
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
      const auto failed = test_support::load_expecting_failure([&](fsdp::ShardedModel& sm, engine::AdamWState& st, int r) {
        fsdp::load_state(sm, fsdp::FullStateDictSource(only_rank1 && r == 0 ? good : bad), &st);
      });
      for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r);
        CAPTURE(failed.errors[r]);
        CHECK_FALSE(failed.errors[r].empty());
        CHECK(failed.untouched[r]);
      }
      CHECK(test_support::contains(failed.errors[1], c.expected));
      CHECK(test_support::contains(failed.errors[1], "nothing was loaded"));
      if (only_rank1) {
        CHECK(test_support::contains(failed.errors[0], "another rank"));
        CHECK(test_support::contains(failed.errors[0], "nothing was loaded"));
      }
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
  const Params loaded = train<fsdp::FullShard>(2, 0, 0, 7, [&](fsdp::ShardedModel& sm, engine::AdamWState&, int r) {
    reports[static_cast<std::size_t>(r)] = fsdp::load_state(sm, fsdp::FullStateDictSource(sd), nullptr, {.strict = false});
  }, nullptr);
  for (auto& rep : reports) {
    REQUIRE(rep.missing.size() == 1);
    CHECK(test_support::contains(rep.missing[0], "head.bias"));
    REQUIRE(rep.unexpected.size() == 1);
    CHECK(test_support::contains(rep.unexpected[0], "extra.weight"));
  }
  // head.weight came from the state dict; head.bias kept the fresh model's values.
  const Params fresh = train<fsdp::FullShard>(2, 0, 0, 7, nullptr, nullptr);
  auto values = [](const Params& ps, const std::string& fqn) {
    for (const auto& [name, v] : ps)
      if (name == fqn) return v;
    FAIL("no parameter " << fqn);
    return std::vector<float>{};
  };
  const fsdp::StateTensor& w = sd.tensors.at("head.weight");
  const auto* saved = reinterpret_cast<const float*>(w.data.data());
  CHECK(values(loaded, "head.weight") == std::vector<float>(saved, saved + w.numel()));
  CHECK(values(loaded, "head.weight") != values(fresh, "head.weight"));
  CHECK(values(loaded, "head.bias") == values(fresh, "head.bias"));
}

TEST_CASE("under MixedPrecision a sharded state dict holds buffers in their own dtype, as a summon shows them") {
  // The engine computes with bf16 copies of the f32 buffers; the state dict must hold the
  // f32 values (rounded through bf16 at most), never the bf16 bytes read as f32.
  engine::Model probe(test_support::resume_config());
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(test_support::resume_config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(model, comm, device, engine::Wrap{});
    const auto sharded = fsdp::sharded_state_dict(sm);
    const auto full = fsdp::full_state_dict(sm);
    {  // and it loads back into both copies, with no summon: zero the buffers, then load
      {
        auto s = sm.summon_full_params({.writeback = true});
        for (auto& b : engine::named_buffers(model))
          for (std::int64_t i = 0; i < b.buffer->numel(); ++i) b.buffer->set(i, 0.0f);
      }
      fsdp::load_state(sm, fsdp::FullStateDictSource(full));
      const auto again = fsdp::full_state_dict(sm);
      for (auto& b : engine::named_buffers(model)) CHECK(again.tensors.at(b.fqn).data == full.tensors.at(b.fqn).data);
      for (auto& b : engine::named_buffers(model)) CHECK(b.buffer->get(0) != 0.0f);  // the engine's bf16 copy too
    }
    if (comm.rank() != 0) return;
    std::size_t buffers = 0;
    for (auto& b : engine::named_buffers(probe)) {
      CAPTURE(b.fqn);
      const auto it = std::find_if(sharded.slices.begin(), sharded.slices.end(), [&](const fsdp::StateSlice& s) {
        return s.id == fsdp::StateKey::buffer(b.fqn);
      });
      REQUIRE(it != sharded.slices.end());
      CHECK(it->dtype == fsdp::DType::f32);
      REQUIRE(it->data.size() == static_cast<std::size_t>(b.buffer->numel()) * sizeof(float));
      CHECK(it->data == full.tensors.at(b.fqn).data);
      const auto* saved = reinterpret_cast<const float*>(it->data.data());
      for (std::int64_t i = 0; i < b.buffer->numel(); ++i) {
        const float want = (*b.buffer)[i];
        CHECK(std::fabs(saved[i] - want) <= std::fabs(want) / 256);
      }
      ++buffers;
    }
    CHECK(buffers > 0);
  });
}

TEST_CASE("a full state dict inside a forward is an error naming the unit, on every rank") {
  std::vector<std::string> errors(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(test_support::resume_config());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& unit = sm.unit("gain");
    unit.pre_forward();
    errors[static_cast<std::size_t>(comm.rank())] = test_support::error_of([&] { fsdp::full_state_dict(sm); });
    unit.post_forward();
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(test_support::contains(errors[static_cast<std::size_t>(r)], "unit 'gain' on rank " + std::to_string(r)));
    CHECK(test_support::contains(errors[static_cast<std::size_t>(r)], "needs every unit IDLE, but it is FORWARD"));
  }
}

}  // namespace checkpoint_state_dict_test
