// State dicts and checkpoint files of a model with a tied parameter (an embedding whose
// weight the output projection reuses): the tensor is saved once, under its first FQN;
// a state dict that names it under every FQN (an unsharded model's) or only under another
// of them loads; a save and load through files, on other numbers of ranks, keeps the tie.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>

#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/core/tied_model.hpp"

namespace checkpoint_tied_state_test {

namespace {

constexpr float lr = 0.05f;

// Every parameter of the unsharded model by FQN, the tied one under both names.
fsdp::FullStateDict unsharded_dict(tied::TiedLM& m) {
  fsdp::FullStateDict sd;
  std::vector<engine::NamedParam> named;
  engine::collect(m, "", named);
  for (auto& p : named) {
    fsdp::StateTensor t{fsdp::DType::f32, {p.param->shape().begin(), p.param->shape().end()}, {}};
    t.data.resize(static_cast<std::size_t>(p.param->numel()) * 4);
    if (!t.data.empty()) std::memcpy(t.data.data(), p.param->raw(), t.data.size());  // memcpy(nullptr, ..., 0) is UB
    sd.tensors[p.fqn] = std::move(t);
  }
  return sd;
}

// The full parameters of a sharded model by FQN (each tied name too), and whether the
// tied names view one storage while summoned.
struct Full {
  std::vector<std::pair<std::string, std::vector<float>>> params;
  bool tie_kept = false;
};
Full full_of(tied::TiedLM& m, fsdp::ShardedModel& sm) {
  auto summoned = sm.summon_full_params();
  Full f;
  std::vector<engine::NamedParam> named;
  engine::collect(m, "", named);
  for (auto& p : named) f.params.emplace_back(p.fqn, std::vector<float>(p.param->data(), p.param->data() + p.param->numel()));
  f.tie_kept = m.head.weight.raw() == m.embed.weight.raw() && m.head.weight.raw() != nullptr;
  return f;
}

double max_difference(const Full& a, const Full& b) {
  if (a.params.size() != b.params.size()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    if (a.params[i].first != b.params[i].first || a.params[i].second.size() != b.params[i].second.size()) return INFINITY;
    for (std::size_t k = 0; k < a.params[i].second.size(); ++k)
      worst = std::max(worst, std::fabs(double(a.params[i].second[k]) - b.params[i].second[k]));
  }
  return worst;
}

// Runs `world` ranks, each with a fresh sharded tied model.
template <class Fn>
void on_ranks(int world, Fn fn) {
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    tied::TiedLM m(tied::Config{});
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<engine::Block>{});
    fn(comm, m, sm);
  });
}

}  // namespace

TEST_CASE("a tied parameter is saved once, under its first FQN, in full and sharded state dicts") {
  on_ranks(2, [](fsdp::ThreadComm& comm, tied::TiedLM& m, fsdp::ShardedModel& sm) {
    tied::sharded_step(m, sm, tied::make_batch(m.config, 0, comm.rank(), 1), lr);
    const auto full = fsdp::full_state_dict(sm);
    CHECK(full.tensors.count("embed.weight") == 1);
    CHECK(full.tensors.count("head.weight") == 0);
    const auto sharded = fsdp::sharded_state_dict(sm);
    for (const auto& s : sharded.slices) CHECK(s.id.fqn != "head.weight");
    const Full f = full_of(m, sm);
    const auto& w = full.tensors.at("embed.weight");
    CHECK(std::memcmp(w.data.data(), f.params[0].second.data(), w.data.size()) == 0);
  });
}

TEST_CASE("an unsharded model's state dict, with both FQNs or with the second only, loads; training goes on alike") {
  const tied::Config c;
  tied::TiedLM reference(c);
  tied::unsharded_step(reference, tied::make_batch(c, 0, 0, 2), lr);
  const fsdp::FullStateDict both = unsharded_dict(reference);
  fsdp::FullStateDict second_only = both;
  second_only.tensors.erase("embed.weight");
  tied::unsharded_step(reference, tied::make_batch(c, 1, 0, 2), lr);
  Full expected;
  std::vector<engine::NamedParam> named;
  engine::collect(reference, "", named);
  for (auto& p : named) expected.params.emplace_back(p.fqn, std::vector<float>(p.param->data(), p.param->data() + p.param->numel()));

  for (const fsdp::FullStateDict* dict : {&both, static_cast<const fsdp::FullStateDict*>(&second_only)}) {
    CAPTURE(dict == &both);
    std::vector<Full> got(2);
    std::vector<std::size_t> unexpected(2, 99);
    on_ranks(2, [&](fsdp::ThreadComm& comm, tied::TiedLM& m, fsdp::ShardedModel& sm) {
      const auto report = fsdp::load_state(sm, fsdp::FullStateDictSource(*dict));  // strict
      unexpected[static_cast<std::size_t>(comm.rank())] = report.unexpected.size() + report.missing.size();
      tied::sharded_step(m, sm, tied::make_batch(c, 1, comm.rank(), 1), lr);
      got[static_cast<std::size_t>(comm.rank())] = full_of(m, sm);
    });
    for (int r = 0; r < 2; ++r) {
      CHECK(unexpected[static_cast<std::size_t>(r)] == 0);
      CHECK(got[static_cast<std::size_t>(r)].tie_kept);
      CHECK(max_difference(got[static_cast<std::size_t>(r)], expected) < 1e-5);
    }
  }
}

TEST_CASE("checkpoint files round trip a tied model on other numbers of ranks, keeping the tie") {
  test_support::TempDir dir;
  std::vector<Full> saved(2);
  on_ranks(2, [&](fsdp::ThreadComm& comm, tied::TiedLM& m, fsdp::ShardedModel& sm) {
    for (int s = 0; s < 2; ++s) tied::sharded_step(m, sm, tied::make_batch(m.config, s, comm.rank(), 1), lr);
    fsdp::save_sharded_checkpoint(dir / "sharded", sm);
    fsdp::save_full_checkpoint(dir / "full.safetensors", sm);
    saved[static_cast<std::size_t>(comm.rank())] = full_of(m, sm);
  });
  for (int world : {1, 3}) {
    CAPTURE(world);
    std::vector<Full> from_sharded(static_cast<std::size_t>(world)), from_full(static_cast<std::size_t>(world));
    on_ranks(world, [&](fsdp::ThreadComm& comm, tied::TiedLM& m, fsdp::ShardedModel& sm) {
      fsdp::load_sharded_checkpoint(dir / "sharded", sm);
      from_sharded[static_cast<std::size_t>(comm.rank())] = full_of(m, sm);
    });
    on_ranks(world, [&](fsdp::ThreadComm& comm, tied::TiedLM& m, fsdp::ShardedModel& sm) {
      fsdp::load_full_checkpoint(dir / "full.safetensors", sm);
      from_full[static_cast<std::size_t>(comm.rank())] = full_of(m, sm);
    });
    for (int r = 0; r < world; ++r) {
      CHECK(from_sharded[static_cast<std::size_t>(r)].tie_kept);
      CHECK(max_difference(from_sharded[static_cast<std::size_t>(r)], saved[0]) == 0);
      CHECK(max_difference(from_full[static_cast<std::size_t>(r)], saved[0]) == 0);
    }
  }
}

}  // namespace checkpoint_tied_state_test
