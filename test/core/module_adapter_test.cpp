// A module adapter with per-model state (fsdp::module_adapter): fsdp::shard walks the model
// through the adapter object's members, asked before module_traits, and the units call its
// parameters_rebound for as long as the model is sharded. Engines whose layer types cannot
// be changed (mlpack's) keep here what a static module_traits<M> could only keep in a
// process-wide table: which layers belong to which model, and per-layer views.
//
// The engine's types have no visit functions at all; each layer keeps a `head` alias into
// its parameter block, which only the adapter knows how to re-point.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

namespace core_module_adapter_test {

// A vector of floats that the library may re-point (its own memory stays where it was).
struct Vec {
  explicit Vec(std::int64_t n) : mem(static_cast<std::size_t>(n)), ptr(mem.data()), numel(n) {}
  Vec(const Vec&) = delete;
  Vec& operator=(const Vec&) = delete;
  std::vector<float> mem;
  float* ptr;
  std::int64_t numel;
};

struct Layer {
  Layer(std::int64_t n, float first) : weights(n) {
    for (std::int64_t i = 0; i < n; ++i) weights.ptr[i] = first + static_cast<float>(i);
    head = weights.ptr;
  }
  Vec weights;
  float* head;  // an alias of weights' first element, as mlpack's `weight` into `weights`
};

struct Net {
  explicit Net(float first) : a(6, first), b(10, first + 100) {}
  Layer a, b;
};

}  // namespace core_module_adapter_test

template <>
struct fsdp::tensor_traits<core_module_adapter_test::Vec> {
  using Vec = core_module_adapter_test::Vec;
  static fsdp::DType dtype(const Vec&) { return fsdp::DType::f32; }
  static std::vector<std::int64_t> shape(const Vec& v) { return {v.numel}; }
  static void* data(Vec& v) { return v.ptr; }
  static fsdp::DeviceId device(const Vec&) { return {}; }
  static void rebind(Vec& v, void* p) { v.ptr = static_cast<float*>(p); }
};

// A static adaptation that visits nothing: were it asked before the adapter, the layers
// would have no parameters (the test checks their FQNs).
template <>
struct fsdp::module_traits<core_module_adapter_test::Layer> {
  template <class F> static void visit_parameters(core_module_adapter_test::Layer&, F&&) {}
};

namespace core_module_adapter_test {
namespace {

// The per-model state: which layers it re-pointed, how often, and what it walked.
struct Adapter {
  template <class F> void visit_parameters(Layer& l, F&& f) { f("weights", l.weights); }
  template <class F> void visit_parameters(Net&, F&&) {}
  template <class F> void visit_children(Net& n, F&& f) {
    f("a", n.a);
    f("b", n.b);
  }
  void parameters_rebound(Layer& l) {
    ++rebound[&l];
    l.head = l.weights.ptr;
  }
  std::map<const Layer*, int> rebound;
};

std::vector<std::string> fqns(const fsdp::ShardedModel& sm) {
  std::vector<std::string> out;
  for (const auto& p : sm.parameters()) out.emplace_back(p.fqn);
  return out;
}

TEST_CASE("a module adapter walks types with no visit functions, asked before module_traits") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    Net net(1);
    fsdp::HostDevice device;
    auto adapter = std::make_shared<Adapter>();
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}, fsdp::module_adapter(adapter));
    REQUIRE(sm.size() == 3);  // the root and the two layers
    // Each rank holds half of each layer's elements; both FQNs come from the adapter.
    std::vector<std::string> expected{"a.weights", "b.weights"};
    CHECK(fqns(sm) == expected);
    // The take-over re-pointed each layer through the adapter, which re-aliased `head`.
    CHECK(adapter->rebound.size() == 2);
    CHECK(adapter->rebound.count(&net.a) == 1);
    CHECK(adapter->rebound.count(&net.b) == 1);
    CHECK(net.a.head == net.a.weights.ptr);
    // A gather re-points `weights` to the full parameter: `head` follows, with its values.
    const int before = adapter->rebound[&net.b];
    {
      auto scope = sm.find_unit_for(net.b)->forward_scope();
      CHECK(adapter->rebound[&net.b] == before + 1);
      REQUIRE(net.b.head == net.b.weights.ptr);
      CHECK(net.b.head[0] == 101.0f);
      CHECK(net.b.head[9] == 110.0f);
    }
    CHECK(adapter->rebound[&net.b] == before + 2);  // freed after forward: re-pointed again
    CHECK(net.b.head == net.b.weights.ptr);
  });
}

TEST_CASE("two models in one process, each with its own adapter: neither sees the other's layers") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    Net first(1), second(1000);
    fsdp::HostDevice device;
    auto a1 = std::make_shared<Adapter>(), a2 = std::make_shared<Adapter>();
    auto sm1 = fsdp::shard<fsdp::FullShard>(first, comm, device, fsdp::wrap_types<Layer>{}, fsdp::module_adapter(a1));
    auto sm2 = fsdp::shard<fsdp::ShardGradOp>(second, comm, device, fsdp::wrap_types<Layer>{}, fsdp::module_adapter(a2));
    { auto scope = sm2.find_unit_for(second.a)->forward_scope(); }
    CHECK(a1->rebound.count(&second.a) == 0);
    CHECK(a1->rebound.count(&second.b) == 0);
    CHECK(a2->rebound.count(&first.a) == 0);
    CHECK(a2->rebound.count(&first.b) == 0);
    CHECK(a1->rebound.size() == 2);
    CHECK(a2->rebound.size() == 2);
    CHECK(a2->rebound[&second.a] > a1->rebound[&first.a]);  // only the second model gathered
  });
}

TEST_CASE("the units keep an adapter moved into the model alive, and let it go with the model") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    Net net(1);
    fsdp::HostDevice device;
    std::weak_ptr<Adapter> watch;
    {
      auto adapter = std::make_shared<Adapter>();
      watch = adapter;
      std::optional<fsdp::ShardedModel> sm;
      sm.emplace(fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{},
                                              fsdp::module_adapter(std::move(adapter))));
      REQUIRE_FALSE(watch.expired());  // the engine holds no handle now: the units do
      { auto scope = sm->find_unit_for(net.a)->forward_scope(); }
      CHECK(watch.lock()->rebound[&net.a] >= 3);
      sm.reset();
    }
    CHECK(watch.expired());
  });
}

TEST_CASE("an adapter moved in by value is used as it is") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    Net net(1);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::module_adapter(Adapter{}));
    std::vector<std::string> expected{"a.weights", "b.weights"};
    CHECK(fqns(sm) == expected);
    CHECK(net.b.head == net.b.weights.ptr);
  });
}

// An adapter that owns the tensors it hands the library (a layer type with no room for
// them), and has no parameters_rebound: nothing but the units holds it once it is moved in.
struct Owner {
  template <class F> void visit_parameters(Layer& l, F&& f) {
    auto& t = extra[&l];
    if (!t) {
      t = std::make_unique<Vec>(4);
      for (std::int64_t i = 0; i < 4; ++i) t->ptr[i] = 7.0f + static_cast<float>(i);
    }
    f("extra", *t);
  }
  template <class F> void visit_parameters(Net&, F&&) {}
  template <class F> void visit_children(Net& n, F&& f) {
    f("a", n.a);
    f("b", n.b);
  }
  std::map<const Layer*, std::unique_ptr<Vec>> extra;
};

TEST_CASE("an adapter that owns visited tensors and has no hook lives as long as the units") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    Net net(1);
    fsdp::HostDevice device;
    auto owner = std::make_shared<Owner>();
    std::weak_ptr<Owner> watch = owner;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{},
                                           fsdp::module_adapter(std::move(owner)));
    REQUIRE_FALSE(watch.expired());
    const Vec& extra = *watch.lock()->extra.at(&net.b);
    {
      auto scope = sm.find_unit_for(net.b)->forward_scope();  // rebinds the adapter's tensor
      REQUIRE(extra.ptr != nullptr);
      CHECK(extra.ptr[0] == 7.0f);
      CHECK(extra.ptr[3] == 10.0f);
    }
  });
}

// A module that is one by itself, and an adapter for another engine's types only.
struct Plain {
  Vec w{3};
  template <class F> void visit_parameters(F&& f) { f("w", w); }
};
struct Elsewhere {
  template <class F> void visit_parameters(Vec&, F&&) {}
};

TEST_CASE("a null adapter, and one that serves no module of the model, are refused naming it") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    Net net(1);
    fsdp::HostDevice device;
    CHECK_THROWS_WITH_AS(fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::module_adapter(std::shared_ptr<Adapter>())),
                         doctest::Contains("fsdp::module_adapter was given a null std::shared_ptr"), fsdp::Error);
    Plain plain;
    CHECK_THROWS_WITH_AS(fsdp::shard<fsdp::FullShard>(plain, comm, device, fsdp::module_adapter(Elsewhere{})),
                         doctest::Contains("has no visit_parameters, visit_children, visit_buffers or parameters_rebound "
                                           "for any module of the model"),
                         fsdp::Error);
    CHECK(plain.w.ptr == plain.w.mem.data());  // refused before anything was taken over
  });
}

}  // namespace
}  // namespace core_module_adapter_test
