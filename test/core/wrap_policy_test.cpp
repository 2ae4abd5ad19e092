// Wrap policies of fsdp::shard: type lists, minimum parameter counts, predicates, manual
// nesting, ignored modules and parameters, the walk's order, and the errors.
#include <doctest/doctest.h>

#include <map>

#include "test/core/layer_engine.hpp"
#include "test/support/errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace core_wrap_policy_test {

using test_support::contains;
using test_support::error_of;

namespace {
// Unit of each parameter, from ShardedModel::parameters() (each parameter must appear once).
std::map<std::string, std::string> unit_of_each_parameter(fsdp::ShardedModel& sm) {
  std::map<std::string, std::string> out;
  for (auto& p : sm.parameters()) {
    auto [it, fresh] = out.emplace(std::string(p.fqn), std::string(p.unit));
    if (!fresh) CHECK(it->second == std::string(p.unit));  // one shard's piece per rank: same unit
  }
  return out;
}

template <class Strategy, class... Options>
void train_and_compare(int world, const std::vector<std::string>& units, const Options&... options) {
  const auto reference = layers::trained_reference(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy>(*net, comm, device, options...);
    CHECK(layers::unit_names(sm) == units);
    for (int s = 0; s < layers::steps; ++s) layers::sharded_step(*net, sm, s, comm.rank());
    auto summon = sm.summon_full_params();
    layers::check_close(*net, *reference);
  });
}
}  // namespace

// Parameter elements: layers.0 48 | layers.1: body.0 54, body.2 56 | layers.2 8 |
// layers.3: body.0 54, body.2 56, body.3 8 | layers.4 27.
TEST_CASE("wrap_min_params: a subtree becomes a unit when its unwrapped parameters reach the minimum") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    fsdp::HostDevice device;
    auto units_for = [&](std::int64_t min) {
      auto net = layers::make_net();
      auto sm = fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_min_params(min));
      return layers::unit_names(sm);
    };
    CHECK(units_for(100) == std::vector<std::string>{"", "layers.1", "layers.3"});
    CHECK(units_for(50) == std::vector<std::string>{"", "layers.1.body.0", "layers.1.body.2", "layers.3.body.0",
                                                    "layers.3.body.2"});
    // 55: body.2 (56) of each block is wrapped first; layers.1 keeps 54 (< 55) but layers.3
    // keeps 54 + 8 = 62 and becomes a unit around its own nested unit.
    CHECK(units_for(55) == std::vector<std::string>{"", "layers.1.body.2", "layers.3", "layers.3.body.2"});
  });
}

TEST_CASE("nested units: each parameter belongs to the innermost unit, exactly once") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_min_params(55));
    const auto owner = unit_of_each_parameter(sm);
    CHECK(owner.size() == layers::named_parameters(*net).size());
    CHECK(owner.at("layers.3.body.2.weight") == "layers.3.body.2");
    CHECK(owner.at("layers.3.body.0.weight") == "layers.3");
    CHECK(owner.at("layers.3.body.3.gain") == "layers.3");
    CHECK(owner.at("layers.1.body.0.bias") == "");
    CHECK(owner.at("layers.1.body.2.bias") == "layers.1.body.2");
  });
}

TEST_CASE("wrap_min_params and nested units train like the unsharded model") {
  const std::vector<std::string> nested{"", "layers.1.body.2", "layers.3", "layers.3.body.2"};
  SUBCASE("FullShard") { train_and_compare<fsdp::FullShard>(2, nested, fsdp::wrap_min_params(55)); }
  SUBCASE("ShardGradOp") { train_and_compare<fsdp::ShardGradOp>(3, nested, fsdp::wrap_min_params(55)); }
}

TEST_CASE("wrap_modules: manual nesting, the outer unit takes what the inner left") {
  const std::vector<std::string> units{"", "layers.3", "layers.3.body.2"};
  const auto reference = layers::trained_reference(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    auto mine = layers::make_net();
    auto& block = static_cast<layers::Residual&>(*mine->body[3]);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::ShardGradOp>(*mine, comm, device, fsdp::wrap_modules(*block.body[2], block));
    CHECK(layers::unit_names(sm) == units);
    CHECK(unit_of_each_parameter(sm).at("layers.3.body.0.weight") == "layers.3");
    for (int s = 0; s < layers::steps; ++s) layers::sharded_step(*mine, sm, s, comm.rank());
    auto summon = sm.summon_full_params();
    layers::check_close(*mine, *reference);
  });
}

TEST_CASE("manual nesting with units built directly: the parent lists its wrapped child") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    auto& block = static_cast<layers::Residual&>(*net->body[1]);
    fsdp::HostDevice device;
    fsdp::ShardedModel sm;
    using LayerUnit = fsdp::Sharded<layers::Layer, fsdp::FullShard>;
    sm.emplace<LayerUnit>(*block.body[0], comm, device, "layers.1.body.0");
    sm.emplace<LayerUnit>(block, comm, device,
                     "layers.1", fsdp::ShardOptions{.ignored_modules = {fsdp::ModuleId::of(*block.body[0])}});
    const auto owner = unit_of_each_parameter(sm);
    CHECK(owner == std::map<std::string, std::string>{{"layers.1.body.0.weight", "layers.1.body.0"},
                                                      {"layers.1.body.0.bias", "layers.1.body.0"},
                                                      {"layers.1.body.2.weight", "layers.1"},
                                                      {"layers.1.body.2.bias", "layers.1"}});
  });
}

TEST_CASE("wrap_if: asked bottom-up, depth first, children in visit order, with unwrapped counts") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    fsdp::HostDevice device;
    std::vector<std::string> calls;
    auto pred = [&](layers::Layer&, std::string_view fqn, int depth, std::int64_t unwrapped) {
      calls.push_back(std::string(fqn) + "@" + std::to_string(depth) + ":" + std::to_string(unwrapped));
      return fqn == "layers.1.body.2" || (depth == 1 && unwrapped > 100);
    };
    auto sm = fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_if(pred));
    CHECK(calls == std::vector<std::string>{"layers.0@1:48", "layers.1.body.0@2:54", "layers.1.body.1@2:0",
                                            "layers.1.body.2@2:56", "layers.1@1:54", "layers.2@1:8",
                                            "layers.3.body.0@2:54", "layers.3.body.1@2:0", "layers.3.body.2@2:56",
                                            "layers.3.body.3@2:8", "layers.3@1:118", "layers.4@1:27"});
    CHECK(layers::unit_names(sm) == std::vector<std::string>{"", "layers.1.body.2", "layers.3"});
  });
}

TEST_CASE("wrap_types keeps its meaning: the outermost listed module is one unit with its whole subtree") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    engine::ModelConfig c;
    c.blocks = 2;
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, fsdp::wrap_types<engine::Block, engine::Linear>{});
    CHECK(layers::unit_names(sm) == std::vector<std::string>{"", "embed", "blocks.0", "blocks.1", "head"});
    // Composed with a predicate, which is not asked inside a wrap_types unit.
    engine::Model other(c);
    std::vector<std::string> asked;
    auto sm2 = fsdp::shard<fsdp::FullShard>(other, comm, device, fsdp::wrap_types<engine::Block>{},
                                            fsdp::wrap_if([&](auto&, std::string_view fqn, int, std::int64_t) {
                                              asked.push_back(std::string(fqn));
                                              return fqn == "gain";
                                            }, "gain"));
    CHECK(asked == std::vector<std::string>{"embed", "gain", "head"});
    CHECK(layers::unit_names(sm2) == std::vector<std::string>{"", "blocks.0", "blocks.1", "gain"});
  });
}

TEST_CASE("ignored modules and parameters: untouched, in no unit, not reduced; the engine steps them") {
  const int world = 2;
  const auto reference = layers::trained_reference(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    auto net = layers::make_net();
    auto& norm = static_cast<layers::Norm&>(*net->body[2]);
    auto& head = static_cast<layers::Linear&>(*net->body[4]);
    auto& inner = static_cast<layers::Residual&>(*net->body[3]);  // a wrapped unit with an ignored module inside
    auto& inner_norm = static_cast<layers::Norm&>(*inner.body[3]);
    float* norm_storage = norm.g.gain.data();
    float* bias_storage = head.lin.bias.data();
    const float bias0 = head.lin.bias[0];
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(
        *net, comm, device, fsdp::wrap_if(layers::is_residual, "residual blocks"),
        fsdp::ShardOptions{.ignored_modules = {fsdp::ModuleId::of(norm), fsdp::ModuleId::of(inner_norm)},
                           .ignored_parameters = {&head.lin.bias}});
    CHECK(layers::unit_names(sm) == std::vector<std::string>{"", "layers.1", "layers.3"});
    CHECK(norm.g.gain.data() == norm_storage);  // the engine keeps its tensors
    CHECK(head.lin.bias.data() == bias_storage);
    CHECK(head.lin.bias[0] == bias0);
    const auto owner = unit_of_each_parameter(sm);
    CHECK(owner.count("layers.2.gain") == 0);
    CHECK(owner.count("layers.3.body.3.gain") == 0);
    CHECK(owner.count("layers.4.bias") == 0);
    CHECK(owner.count("layers.4.weight") == 1);
    std::vector<engine::Tensor*> ignored_grads{&norm.g.gain_grad, &inner_norm.g.gain_grad, &head.lin.bias_grad};
    std::vector<engine::Tensor*> ignored_params{&norm.g.gain, &inner_norm.g.gain, &head.lin.bias};
    for (int s = 0; s < layers::steps; ++s) {
      for (auto* g : ignored_grads) for (std::int64_t i = 0; i < g->numel(); ++i) g->set(i, 0);
      layers::sharded_step(*net, sm, s, comm.rank(), [&] {
        // The gradient is this rank's own: an unsharded model at the same parameters on the
        // same rows computes the same (checked once, at the first step).
        if (s == 0) {
          auto local = layers::make_net();
          layers::Hooks none;
          const auto b = layers::batch(0, comm.rank() * layers::rows_per_rank, layers::rows_per_rank);
          engine::Mat dout;
          engine::mse(local->forward(b.x, none), b.y, dout);
          local->backward(dout, none);
          auto& local_norm = static_cast<layers::Norm&>(*local->body[2]);
          for (std::int64_t i = 0; i < norm.g.gain_grad.numel(); ++i)
            CHECK(norm.g.gain_grad[i] == doctest::Approx(local_norm.g.gain_grad[i]).epsilon(1e-5));
        }
        // The engine's own data parallelism for what it kept: average, then step.
        for (std::size_t k = 0; k < ignored_grads.size(); ++k) {
          auto* g = ignored_grads[k];
          comm.all_reduce(g->data(), g->data(), static_cast<std::size_t>(g->numel()), fsdp::DType::f32,
                          fsdp::ReduceOp::sum).wait();
          for (std::int64_t i = 0; i < g->numel(); ++i) {
            (*g)[i] /= static_cast<float>(world);
            (*ignored_params[k])[i] -= layers::lr * (*g)[i];
          }
        }
      });
    }
    auto summon = sm.summon_full_params();
    layers::check_close(*net, *reference);
  });
}

TEST_CASE("errors name the policy or the conflicting options") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    fsdp::HostDevice device;
    auto net = layers::make_net();
    const std::string children =
        "the model's children are: 'layers.0' (layers::Linear), 'layers.1' (layers::Residual), 'layers.2' "
        "(layers::Norm), 'layers.3' (layers::Residual), 'layers.4' (layers::Linear)";
    auto never = [](layers::Layer&, std::string_view, int, std::int64_t) { return false; };
    CHECK(error_of([&] { fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_if(never, "never")); }) ==
          "fsdp: shard: wrap policy wrap_if(never) selected no module; " + children);
    CHECK(error_of([&] { fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_min_params(1000)); }) ==
          "fsdp: shard: wrap policy wrap_min_params(1000) selected no module (no subtree holds that many parameter "
          "elements); " + children);
    auto& block = static_cast<layers::Residual&>(*net->body[1]);
    CHECK(error_of([&] {
            fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_modules(block),
                                         fsdp::ShardOptions{.ignored_modules = {fsdp::ModuleId::of(block)}});
          }) == "fsdp: shard: module 'layers.1' is both in wrap_modules and in ShardOptions::ignored_modules");
    CHECK(error_of([&] {
            fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_modules(*block.body[0]),
                                         fsdp::ShardOptions{.ignored_modules = {fsdp::ModuleId::of(block)}});
          }) == "fsdp: shard: wrap_modules lists 'layers.1.body.0', but it lies inside 'layers.1', an ignored module, "
                "whose subtree is left whole");
    CHECK(error_of([&] {
            fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_modules(*block.body[0]),
                                         fsdp::wrap_types<layers::Layer>{});
          }) == "fsdp: shard: wrap_modules lists 'layers.1.body.0', but it lies inside 'layers.1', a unit chosen by "
                "wrap_types<layers::Layer>, whose subtree is left whole");
    CHECK(error_of([&] {
            fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::ShardOptions{.ignored_modules = {fsdp::ModuleId::of(*net)}});
          }) == "fsdp: shard: the model itself is in ShardOptions::ignored_modules");
    layers::Norm stranger(3, 1);
    CHECK(contains(error_of([&] {
                     fsdp::shard<fsdp::FullShard>(*net, comm, device,
                                                  fsdp::ShardOptions{.ignored_modules = {fsdp::ModuleId::of(stranger)}});
                   }),
                   "fsdp: shard: ShardOptions::ignored_modules names a layers::Norm at "));
    CHECK(contains(error_of([&] {
                     fsdp::shard<fsdp::FullShard>(*net, comm, device,
                                                  fsdp::ShardOptions{.ignored_parameters = {&block.body[0]}});
                   }),
                   "that is not a parameter of the model (pass the parameter, not its gradient)"));
    CHECK(contains(error_of([&] { fsdp::shard<fsdp::FullShard>(*net, comm, device, fsdp::wrap_modules(stranger)); }),
                   "fsdp: shard: wrap_modules names a layers::Norm at "));
    // Nothing was taken over by the failed calls.
    CHECK(static_cast<layers::Linear&>(*block.body[0]).lin.weight.data() != nullptr);
  });
}

}  // namespace core_wrap_policy_test
