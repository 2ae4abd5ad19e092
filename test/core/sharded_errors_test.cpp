// Bad input is an fsdp::Error naming what and where, on every rank, and never a hang.
#include <doctest/doctest.h>

#include "test/support/rank_errors.hpp"

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"

namespace core_sharded_errors_test {

namespace {

using fsdp::HostTensor;

// A tiny module with parameters chosen per rank, to build disagreeing units on purpose.
struct Layer {
  std::vector<HostTensor> params, grads;
  std::vector<std::string> names;
  void add(std::string name, std::vector<std::int64_t> shape, fsdp::DType t = fsdp::DType::f32) {
    names.push_back(std::move(name));
    params.emplace_back(shape, t);
    grads.emplace_back(shape, t);
  }
  template <class F>
  void visit_parameters(F&& f) {
    for (std::size_t i = 0; i < params.size(); ++i) f(names[i], params[i], grads[i]);
  }
};

struct Net {
  Layer a, b;
  template <class F>
  void visit_parameters(F&&) {}
  template <class F>
  void visit_children(F&& f) {
    f("a", a);
    f("b", b);
  }
};

struct Wide {  // a third child on some ranks only
  Layer a, b, c;
  bool third = false;
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("a", a); f("b", b); if (third) f("c", c); }
};

struct Tied {  // one tensor registered under two names
  HostTensor w{{2, 2}}, g{{2, 2}};
  template <class F> void visit_parameters(F&& f) { f("embed", w, g); f("unembed", w, g); }
};

struct Reshaped {  // one storage seen as [2, 2] and as [4]
  HostTensor w{{2, 2}}, g{{2, 2}}, flat{{4}}, flat_grad{{4}};
  Reshaped() { flat.rebind(w.data()); }
  template <class F> void visit_parameters(F&& f) { f("w", w, g); f("flat", flat, flat_grad); }
};

// Runs fn on every rank with a short collective timeout; returns each rank's fsdp::Error
// message ("" if it threw none). Reaching the end of this function is the no-hang check.
using test_support::contains;
using test_support::errors_per_rank;

}  // namespace

TEST_CASE("hooks called in the wrong state name the unit, the state and the expected states") {
  auto msgs = errors_per_rank(2, [](fsdp::ThreadComm& comm) {
    engine::Model model(engine::ModelConfig{});
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& unit = sm.unit("blocks.1");
    unit.post_forward();  // never entered forward
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "unit 'blocks.1' on rank " + std::to_string(r)));
    CHECK(contains(msgs[r], "post_forward called in state IDLE; expected FORWARD"));
  }
}

TEST_CASE("every out-of-order transition is refused and leaves the state unchanged") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    engine::Model model(engine::ModelConfig{});
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& u = sm.unit("gain");
    using S = fsdp::TrainingState;

    CHECK_THROWS_WITH_AS(u.post_backward(), doctest::Contains("post_backward called in state IDLE; expected BACKWARD_PRE"), fsdp::Error);
    u.pre_forward();
    CHECK(u.state() == S::FORWARD);
    CHECK_THROWS_WITH_AS(u.pre_forward(), doctest::Contains("pre_forward called in state FORWARD; expected IDLE"), fsdp::Error);
    CHECK_THROWS_WITH_AS(u.pre_backward(), doctest::Contains("pre_backward called in state FORWARD; expected IDLE"), fsdp::Error);
    CHECK_THROWS_WITH_AS(u.zero_grad(), doctest::Contains("zero_grad called in state FORWARD"), fsdp::Error);
    CHECK_THROWS_WITH_AS(sm.finish_backward(), doctest::Contains("unit 'gain' on rank 0: finish_backward called in state FORWARD; expected BACKWARD_POST or IDLE"), fsdp::Error);
    CHECK(u.state() == S::FORWARD);
    u.post_forward();
    u.pre_backward();
    CHECK(u.state() == S::BACKWARD_PRE);  // (finish_backward would complete it: test/core/autograd_engine_test.cpp)
    CHECK_THROWS_WITH_AS((void)u.summon_full_params(), doctest::Contains("summon_full_params called in state BACKWARD_PRE; expected IDLE"), fsdp::Error);
    u.post_backward();
    CHECK(u.state() == S::BACKWARD_POST);
    CHECK_THROWS_WITH_AS(u.pre_forward(), doctest::Contains("pre_forward called in state BACKWARD_POST; expected IDLE"), fsdp::Error);
    sm.finish_backward();
    CHECK(u.state() == S::IDLE);
    {
      auto s = u.summon_full_params();
      CHECK(u.state() == S::SUMMON_FULL_PARAMS);
      CHECK_THROWS_WITH_AS(u.pre_forward(), doctest::Contains("state SUMMON_FULL_PARAMS"), fsdp::Error);
    }
    CHECK(u.state() == S::IDLE);
  });
}

TEST_CASE("a backward before any forward, then a forward: no crash; that first iteration is the recorded order") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    engine::Model model(engine::ModelConfig{});
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& block = sm.unit("blocks.0");
    auto& gain = sm.unit("gain");
    block.pre_backward();
    gain.pre_forward();  // indexed an empty recorded order once (SIGSEGV)
    CHECK(gain.state() == fsdp::TrainingState::FORWARD);
    gain.post_forward();
    block.post_backward();
    sm.finish_backward();
    for (auto& u : sm) CHECK(u->state() == fsdp::TrainingState::IDLE);
    // An ordinary step now departs from that recorded order: named, not a crash or a hang.
    CHECK_THROWS_WITH_AS(engine::sharded_forward_backward(model, sm, engine::make_batch(engine::ModelConfig{}, 0, comm.rank(), 1)),
                         doctest::Contains("where the first iteration ran 'blocks.0'"), fsdp::Error);
  });
}

TEST_CASE("a root-level hook error names the root unit") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    engine::Model model(engine::ModelConfig{});
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    CHECK_THROWS_WITH_AS(sm.unit_for(model).post_backward(), doctest::Contains("unit '<root>' on rank 0"), fsdp::Error);
  });
}

TEST_CASE("an integer parameter is refused on every rank, naming it") {
  auto msgs = errors_per_rank(3, [](fsdp::ThreadComm& comm) {
    Net net;
    net.a.add("weight", {4, 2});
    net.a.add("step_count", {1}, fsdp::DType::i64);
    fsdp::HostDevice device;
    fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "unit 'a' on rank " + std::to_string(r)));
    CHECK(contains(msgs[r], "parameter 'a.step_count' has dtype i64"));
  }
}

TEST_CASE("an 8-bit float parameter is refused on every rank, naming it and why") {
  for (const fsdp::DType t : {fsdp::DType::f8e4m3, fsdp::DType::f8e5m2, fsdp::DType::e8m0}) {
    CAPTURE(name_of(t));
    auto msgs = errors_per_rank(2, [t](fsdp::ThreadComm& comm) {
      Net net;
      net.a.add("weight", {4, 2});
      net.a.add("scale", {2}, t);
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "unit 'a' on rank " + std::to_string(r)));
      CHECK(contains(msgs[r], "parameter 'a.scale' has dtype " + std::string(name_of(t))));
      CHECK(contains(msgs[r], "only with per-block scales"));
    }
  }
}

TEST_CASE("ranks whose units disagree fail on every rank, naming the unit and both ranks' parameters") {
  SUBCASE("different parameter count") {
    auto msgs = errors_per_rank(4, [](fsdp::ThreadComm& comm) {
      Net net;
      net.a.add("weight", {4, 3});
      net.b.add("weight", {3, 3});
      if (comm.rank() == 2) net.b.add("bias", {3});
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "unit 'b' differs across ranks"));
      CHECK(contains(msgs[r], "rank 0 has 1 parameters, 9 elements: b.weight [3, 3] f32"));
      CHECK(contains(msgs[r], "rank 2 has 2 parameters, 12 elements"));
    }
  }
  SUBCASE("same count, different shape") {
    auto msgs = errors_per_rank(2, [](fsdp::ThreadComm& comm) {
      Net net;
      net.a.add("weight", comm.rank() == 1 ? std::vector<std::int64_t>{2, 6} : std::vector<std::int64_t>{3, 4});
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "unit 'a' differs across ranks"));
      CHECK(contains(msgs[r], "a.weight [3, 4]"));
      CHECK(contains(msgs[r], "a.weight [2, 6]"));
    }
  }
  SUBCASE("different dtype") {
    auto msgs = errors_per_rank(2, [](fsdp::ThreadComm& comm) {
      Net net;
      net.a.add("weight", {3, 4}, comm.rank() == 0 ? fsdp::DType::f32 : fsdp::DType::bf16);
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
    });
    for (int r = 0; r < 2; ++r) CHECK(contains(msgs[r], "unit 'a' differs across ranks"));
  }
  SUBCASE("different set of units") {
    auto msgs = errors_per_rank(3, [](fsdp::ThreadComm& comm) {
      Wide w;
      w.third = comm.rank() == 1;
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(w, comm, device, fsdp::wrap_types<Layer>{});
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "the set of units differs across ranks"));
      CHECK(contains(msgs[r], "rank 1 has 4 units (root + wrapped: a, b, c)"));
    }
  }
}

TEST_CASE("a rank that runs a different unit fails every rank, naming what each ran, instead of hanging") {
  // The first iteration checks the order at every unit before its all-gather, so even units
  // of the same size (whose all-gathers would pair silently) are caught.
  for (const char* other : {"gain", "blocks.1"}) {
    CAPTURE(other);
    auto msgs = errors_per_rank(3, [&](fsdp::ThreadComm& comm) {
      engine::Model model(engine::ModelConfig{});
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      sm.unit(comm.rank() == 1 ? other : "blocks.0").pre_forward();
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], std::string("ranks run units in different orders: at forward step #0 of the first iteration rank 0 runs 'blocks.0', rank 1 runs '") + other + "', rank 2 runs 'blocks.0'"));
    }
  }
}

TEST_CASE("parameters the library cannot take over are named") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    fsdp::HostDevice device;
    SUBCASE("the same tensor twice is one tied parameter, not an error") {
      Tied tied;
      fsdp::Sharded<Tied> unit(tied, comm, device);
      REQUIRE(unit.parameters().size() == 1);
      CHECK(unit.parameters()[0].fqn == "embed");
      REQUIRE(unit.parameters()[0].aliases.size() == 1);
      CHECK(unit.parameters()[0].aliases[0] == "unembed");
    }
    SUBCASE("storage shared under another shape") {
      Reshaped m;
      CHECK_THROWS_WITH_AS(fsdp::Sharded<Reshaped>(m, comm, device),
                           doctest::Contains("parameters 'w' ([2, 2] f32) and 'flat' ([4] f32) share storage but not shape and dtype"),
                           fsdp::Error);
      CHECK(m.w.owns_storage());
    }
    SUBCASE("a module wrapped twice") {
      Layer l;
      l.add("weight", {2, 3});
      fsdp::Sharded<Layer> first(l, comm, device, "l");
      CHECK_THROWS_WITH_AS(fsdp::Sharded<Layer>(l, comm, device, "again"), doctest::Contains("parameter 'again.weight' has no storage"), fsdp::Error);
    }
  });
}

namespace {
struct FailingDevice : fsdp::HostDevice {  // fails its n-th allocation
  int left;
  explicit FailingDevice(int n) : left(n) {}
  void* allocate(std::size_t bytes, fsdp::MemorySpace space = fsdp::MemorySpace::device) {
    if (left-- == 0) fsdp::detail::fail("injected out of memory");
    return HostDevice::allocate(bytes, space);
  }
};
struct TwoDtypes {
  HostTensor w{{4}}, g{{4}}, v{{4}, fsdp::DType::f64}, gv{{4}, fsdp::DType::f64};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); f("v", v, gv); }
};
}  // namespace

TEST_CASE("a construction that fails part way leaks nothing and leaves the engine's parameters intact") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    for (int fail_at : {0, 1, 2, 3}) {  // 4 allocations: shard + gradient for each of two dtypes
      CAPTURE(fail_at);
      TwoDtypes m;
      m.w.as<float>()[0] = 3.0f;
      FailingDevice device(fail_at);
      CHECK_THROWS_WITH_AS(fsdp::Sharded<TwoDtypes>(m, comm, device), "fsdp: injected out of memory", fsdp::Error);
      CHECK(device.stats().live_bytes == 0);
      REQUIRE(m.w.owns_storage());
      CHECK(m.w.as<float>()[0] == 3.0f);
    }
  });
}

TEST_CASE("fsdp::shard that fails at a later unit leaves every engine parameter as it was, on every rank") {
  // Rank 1's blocks have another hidden size: the root unit is built on both ranks, then
  // blocks.0 disagrees. The root must not have taken the engine's parameters over.
  std::vector<std::string> errors(2);
  std::vector<char> intact(2, 0);  // not vector<bool>: ranks write apart
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::ModelConfig c;
    if (comm.rank() == 1) c.hidden = 8;
    engine::Model model(c);
    std::vector<std::vector<float>> before;
    for (auto& p : engine::named_parameters(model)) before.emplace_back(p.param->data(), p.param->data() + p.param->numel());
    fsdp::HostDevice device;
    try {
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    } catch (const fsdp::Error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    bool same = device.stats().live_bytes == 0;
    auto params = engine::named_parameters(model);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const float* d = params[i].param->data();
      same = same && (d != nullptr || before[i].empty()) && std::equal(before[i].begin(), before[i].end(), d);
    }
    intact[static_cast<std::size_t>(comm.rank())] = same;
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(errors[static_cast<std::size_t>(r)].find("blocks.0") != std::string::npos);
    CHECK(intact[static_cast<std::size_t>(r)]);
  }
}

}  // namespace core_sharded_errors_test
