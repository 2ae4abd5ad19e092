// Type-erased module trees: units over modules seen through their virtual base (Sharded<Layer>),
// lookup by base type or address, run-time selection, and module_traits adapters.
#include <doctest/doctest.h>

#include "test/core/layer_engine.hpp"
#include "test/support/errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace core_type_erased_model_test {

using test_support::contains;
using test_support::error_of;

TEST_CASE("a unit over a child seen as its base class manages the child's whole subtree") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    layers::Layer& block = *net->body[3];  // a Residual, seen as Layer
    fsdp::HostDevice device;
    fsdp::ShardedModel sm;
    auto& unit = sm.emplace<fsdp::Sharded<layers::Layer, fsdp::FullShard>>(block, comm, device,
                                                                          "layers.3");
    std::vector<std::string> fqns;
    for (auto& p : unit.parameters()) fqns.push_back(std::string(p.fqn));
    CHECK(fqns == std::vector<std::string>{"layers.3.body.0.weight", "layers.3.body.0.bias", "layers.3.body.2.weight",
                                           "layers.3.body.2.bias", "layers.3.body.3.gain"});
    CHECK(unit.buffers().size() == 1);
    // Found through the base, the derived type, and by address.
    CHECK(sm.find_unit_for(block) == &unit);
    CHECK(sm.find_unit_for(static_cast<layers::Residual&>(block)) == &unit);
    CHECK(sm.find_unit_at(&block) == &unit);
    CHECK(sm.find_unit_for(*net->body[1]) == nullptr);
    CHECK(fsdp::detail::internals(static_cast<fsdp::Unit&>(unit)).module_type() == std::type_index(typeid(layers::Residual)));  // the dynamic type
  });
}

namespace {
template <class Strategy>
void train_with_predicate(int world) {
  const auto reference = layers::trained_reference(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    fsdp::HostDevice device;
    layers::Layer& root = *net;  // the root seen as its base too
    auto sm = fsdp::shard<Strategy>(root, comm, device, fsdp::wrap_if(layers::is_residual, "residual blocks"));
    CHECK(layers::unit_names(sm) == std::vector<std::string>{"", "layers.1", "layers.3"});
    CHECK(sm.unit_for(*net->body[1]).fqn() == "layers.1");
    CHECK(sm.unit_for(root).fqn() == "");
    for (int s = 0; s < layers::steps; ++s) layers::sharded_step(*net, sm, s, comm.rank());
    auto summon = sm.summon_full_params();
    layers::check_close(*net, *reference);
  });
}
}  // namespace

TEST_CASE("a run-time predicate picks type-erased children; training matches unsharded training") {
  SUBCASE("FullShard, 2 ranks") { train_with_predicate<fsdp::FullShard>(2); }
  SUBCASE("FullShard, 3 ranks") { train_with_predicate<fsdp::FullShard>(3); }
  SUBCASE("ShardGradOp, 2 ranks") { train_with_predicate<fsdp::ShardGradOp>(2); }
}

TEST_CASE("a type list matches the static type a child is visited as, and says so when it matches nothing") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    fsdp::HostDevice device;
    const auto msg = error_of([&] { fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_types<layers::Residual>{}); });
    CHECK(contains(msg, "fsdp: shard: wrap policy wrap_types<layers::Residual> selected no module; the model's children "
                        "are: 'layers.0' (layers::Linear), 'layers.1' (layers::Residual), 'layers.2' (layers::Norm), "
                        "'layers.3' (layers::Residual), 'layers.4' (layers::Linear)"));
    CHECK(static_cast<layers::Linear&>(*net->body[0]).lin.weight.data() != nullptr);  // nothing taken over
    // Visited as Layer, every child matches the base type.
    auto sm = fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_types<layers::Layer>{});
    CHECK(layers::unit_names(sm) == std::vector<std::string>{"", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4"});
  });
}

}  // namespace core_type_erased_model_test

// ---- module_traits: adapting module types one does not own ----
// (At global scope: a specialization of fsdp::module_traits cannot be in this file's namespace.)
namespace thirdparty {  // no visit functions, and none may be added here
struct Dense {
  fsdp::HostTensor w{{4}}, w_grad{{4}};
};
struct Stack {
  Dense a, b;
  fsdp::HostTensor scale{{2}};
};
}  // namespace thirdparty

template <>
struct fsdp::module_traits<thirdparty::Dense> {
  template <class F> static void visit_parameters(thirdparty::Dense& d, F&& f) { f("w", d.w, d.w_grad); }
};
template <>
struct fsdp::module_traits<thirdparty::Stack> {
  template <class F> static void visit_parameters(thirdparty::Stack&, F&&) {}
  template <class F> static void visit_children(thirdparty::Stack& s, F&& f) { f("a", s.a); f("b", s.b); }
  template <class F> static void visit_buffers(thirdparty::Stack& s, F&& f) { f("scale", s.scale); }
};

namespace core_type_erased_model_test {

TEST_CASE("a module_traits specialization adapts module types without touching their namespace") {
  static_assert(fsdp::Module<thirdparty::Dense> && fsdp::Module<thirdparty::Stack>);
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    thirdparty::Stack stack;
    static_cast<float*>(stack.a.w.data())[1] = 3.0f;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(stack, comm, device, fsdp::wrap_types<thirdparty::Dense>{});
    CHECK(layers::unit_names(sm) == std::vector<std::string>{"", "a", "b"});
    std::vector<std::string> fqns;
    for (auto& p : sm.parameters()) fqns.push_back(std::string(p.fqn));
    CHECK(fqns == std::vector<std::string>{"a.w", "b.w"});
    CHECK(sm.unit("").buffers().size() == 1);
    CHECK(stack.a.w.data() == nullptr);  // taken over
    auto summon = sm.summon_full_params();
    CHECK(static_cast<float*>(stack.a.w.data())[1] == 3.0f);
  });
}

}  // namespace core_type_erased_model_test
