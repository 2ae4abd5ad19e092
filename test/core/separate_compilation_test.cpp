// FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp): this file is compiled in that mode, so
// it sees only what an engine calls of a unit, and fsdp::shard builds every unit through
// detail::make_unit, compiled once in //:fsdp_separate. Sharded training then equals
// unsharded training to the bit, as it does header-only (test/core/sharded_parity_test.cpp:
// one sample per rank, two ranks, SGD).
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"

#if !defined(FSDP_SEPARATE_COMPILATION)
#error "separate_compilation_test is built in the separately compiled mode: it depends on //:fsdp_separate"
#endif
#if FSDP_DEFINES_IMPLEMENTATION
#error "separate_compilation_test must not compile the unit's implementation itself"
#endif

namespace core_separate_compilation_test {

using Params = std::vector<std::pair<std::string, std::vector<float>>>;

TEST_CASE("separately compiled, fsdp::shard trains the reference model exactly as the unsharded engine does") {
  engine::ModelConfig c;
  c.blocks = 3;
  constexpr int kSteps = 3;
  engine::Model reference(c);
  engine::Sgd reference_sgd(0.05f);
  for (int s = 0; s < kSteps; ++s) engine::unsharded_step(reference, reference_sgd, engine::make_batch(c, s, 0, 2));
  Params want;
  for (auto& p : engine::named_parameters(reference))
    want.emplace_back(p.fqn, std::vector<float>(p.param->data(), p.param->data() + p.param->numel()));

  std::vector<Params> got(2);
  std::vector<std::size_t> units(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < kSteps; ++s) engine::sharded_step(model, sm, sgd, engine::make_batch(c, s, comm.rank(), 1));
    units[comm.rank()] = sm.size();
    got[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  CHECK(units[0] == 1 + 3 + 1);  // the root, three blocks, the gain
  REQUIRE(got[0] == got[1]);
  REQUIRE(got[0].size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("parameter ", want[i].first);
    CHECK(got[0][i].first == want[i].first);
    REQUIRE(got[0][i].second.size() == want[i].second.size());
    CHECK((want[i].second.empty() ||
           std::memcmp(got[0][i].second.data(), want[i].second.data(), want[i].second.size() * sizeof(float)) == 0));
  }
}

}  // namespace core_separate_compilation_test
