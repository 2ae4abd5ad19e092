#pragma once
// Helpers shared by the tests that train the reference engine: the unsharded reference
// run, comparisons of full parameters, and the engine model's unit sizes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/support/full_params.hpp"

namespace test_support {

// `steps` AdamW steps of the unsharded model on global batches of `global_batch` samples.
inline Params reference_params(const engine::ModelConfig& c, int steps, int global_batch) {
  engine::Model model(c);
  engine::AdamW opt({});
  for (int s = 0; s < steps; ++s) engine::unsharded_step(model, opt, engine::make_batch(c, s, 0, global_batch));
  Params p;
  for (auto& np : engine::named_parameters(model))
    p.emplace_back(np.fqn, std::vector<float>(np.param->data(), np.param->data() + np.param->numel()));
  return p;
}

// Largest absolute difference; infinity when names or sizes differ.
inline double max_difference(const Params& a, const Params& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.size() != b[i].second.size()) return INFINITY;
    for (std::size_t k = 0; k < a[i].second.size(); ++k)
      worst = std::max(worst, std::fabs(double(a[i].second[k]) - b[i].second[k]));
  }
  return worst;
}

// Element counts of the reference model's units, in forward order: the root (embed +
// head), the blocks, the gain.
inline std::vector<std::int64_t> unit_numels(const engine::ModelConfig& c) {
  std::vector<std::int64_t> u{c.in * c.dim + c.dim + c.dim * c.out + c.out};
  for (int i = 0; i < c.blocks; ++i) u.push_back(c.dim * c.hidden + c.hidden + c.hidden * c.dim + c.dim);
  u.push_back(c.dim);
  return u;
}

// The reference engine sharded over `comm` with the policies Ps: over a mesh of `shape`
// built into `mesh` when the strategy (the first policy) is hybrid, else over `comm` itself.
template <class Strategy, class... Ps, class C>
fsdp::ShardedModel shard_engine(engine::Model& model, C& comm, std::optional<fsdp::DeviceMesh<C>>& mesh,
                                fsdp::MeshShape shape, fsdp::HostDevice& device) {
  if constexpr (Strategy::hybrid) {
    mesh.emplace(comm, shape);
    return fsdp::shard<Strategy, Ps...>(model, *mesh, device, engine::Wrap{});
  } else {
    return fsdp::shard<Strategy, Ps...>(model, comm, device, engine::Wrap{});
  }
}

}  // namespace test_support
