// Tied parameters (fsdp/unit/detail/param_collection.hpp, fsdp/model/sharded_model.hpp): one tensor
// reachable under several FQNs — here a GPT-style embedding and the output projection
// that reuses its weight, two engine tensors viewing one storage — is one parameter of
// the unit that holds both uses, stored and gathered once, with every FQN kept. A tie
// across units the engine chose is an error on every rank naming both FQNs and the unit
// that would have to own them, and leaves the model as it was. Training parity of the tied
// model is in repeated_units_test.cpp; state dicts and checkpoint files of it in
// test/checkpoint/tied_state_test.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "test/core/tied_model.hpp"
#include "test/support/rank_errors.hpp"

namespace core_tied_parameters_test {

namespace {

using test_support::contains;

const fsdp::ParamView* find(const fsdp::ShardedModel& sm, std::string_view fqn) {
  for (const auto& p : sm.parameters())
    if (p.fqn == fqn) return &p;
  return nullptr;
}

// A tie between two leaves inside a middle module: a.x.w and a.y.w are one storage.
struct Leaf {
  fsdp::HostTensor w{{3}}, g{{3}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
};
struct Pair {
  Leaf x, y;
  fsdp::HostTensor bias{{2}}, bias_grad{{2}};
  Pair() { y.w.rebind(x.w.data()); }
  template <class F> void visit_parameters(F&& f) { f("bias", bias, bias_grad); }
  template <class F> void visit_children(F&& f) { f("x", x); f("y", y); }
};
struct Outer {
  Pair a;
  Leaf c;
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("a", a); f("c", c); }
};

}  // namespace

TEST_CASE("a tied embedding and projection are one parameter of the root, stored once, with both FQNs") {
  const tied::Config c;
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      tied::TiedLM m(c);
      const std::vector<float> initial(m.embed.weight.data(), m.embed.weight.data() + m.embed.weight.numel());
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<engine::Block>{});
      const fsdp::ParamView* p = find(sm, "embed.weight");
      REQUIRE(p != nullptr);
      CHECK(find(sm, "head.weight") == nullptr);
      REQUIRE(p->aliases.size() == 1);
      CHECK(p->aliases[0] == "head.weight");
      CHECK(p->unit == "");
      // The root holds vocab * dim elements, not twice that.
      const auto& root = sm.unit("");
      REQUIRE(root.shards().size() == 1);
      CHECK(root.shards()[0].padded_numel * world == (c.vocab * c.dim + world - 1) / world * world);
      CHECK(m.embed.weight.raw() == nullptr);
      CHECK(m.head.weight.raw() == nullptr);
      {
        auto summoned = sm.summon_full_params();
        REQUIRE(m.embed.weight.raw() != nullptr);
        CHECK(m.head.weight.raw() == m.embed.weight.raw());
        CHECK(std::equal(initial.begin(), initial.end(), m.head.weight.data()));
      }
      // Both uses' gradient tensors are one buffer while the root runs backward.
      auto& u = sm.unit_for(m);
      u.pre_forward();
      u.post_forward();
      u.pre_backward();
      CHECK(m.head.weight_grad.raw() == m.embed.weight_grad.raw());
      CHECK(m.head.weight_grad.raw() != nullptr);
      u.post_backward();
      sm.finish_backward();
    });
  }
}

TEST_CASE("a tie across units the engine chose names both FQNs and the unit that must own them, on every rank") {
  SUBCASE("the projection wrapped on its own: the root must own both") {
    std::vector<char> intact(2, 0);
    auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      tied::TiedLM m(tied::Config{});
      const tied::TiedLM fresh(tied::Config{});
      fsdp::HostDevice device;
      try {
        auto sm = fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_types<engine::Block>{}, fsdp::wrap_modules(m.head));
      } catch (...) {
        // Nothing was taken over: the tie and the values are the engine's as before.
        intact[static_cast<std::size_t>(comm.rank())] =
            m.embed.weight.raw() != nullptr && m.head.weight.raw() == m.embed.weight.raw() &&
            std::equal(fresh.embed.weight.data(), fresh.embed.weight.data() + fresh.embed.weight.numel(), m.embed.weight.data());
        throw;
      }
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "ShardedModel on rank " + std::to_string(r) +
                                  ": parameters 'embed.weight' (unit '<root>') and 'head.weight' (unit 'head') are the "
                                  "same tensor (tied) but lie in different units; a tied parameter must lie in one unit "
                                  "that holds all its uses: unit '<root>'"));
      CHECK(intact[static_cast<std::size_t>(r)]);
    }
  }
  SUBCASE("a tie between two nested units: their common unit must own it") {
    auto msgs = test_support::errors_per_rank(2, [](fsdp::ThreadComm& comm) {
      Outer o;
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(o, comm, device, fsdp::wrap_modules(o.a, o.a.x, o.a.y));
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "parameters 'a.x.w' (unit 'a.x') and 'a.y.w' (unit 'a.y') are the same tensor (tied)"));
      CHECK(contains(msgs[r], "all its uses: unit 'a'"));
    }
  }
  SUBCASE("the same tie inside one unit is fine") {
    fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
      Outer o;
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(o, comm, device, fsdp::wrap_modules(o.a));
      const fsdp::ParamView* p = find(sm, "a.x.w");
      REQUIRE(p != nullptr);
      CHECK(p->unit == "a");
      CHECK(std::vector<std::string>(p->aliases.begin(), p->aliases.end()) == std::vector<std::string>{"a.y.w"});
    });
  }
}

}  // namespace core_tied_parameters_test
