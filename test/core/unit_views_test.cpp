// fsdp/unit/unit_views.hpp: per-parameter shard views (Unit::parameters,
// ShardedModel::parameters): for every parameter, which elements this rank holds, where
// they lie in its shard, and the same for the gradient, with no cast to a concrete unit type.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "examples/engine/fsdp_integration.hpp"

namespace core_unit_views_test {

namespace {

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}

struct Seen {
  std::int64_t begin, count;
  std::vector<float> values;
};

template <class... Ps>
void check_views(int world) {
  const auto c = config();
  std::mutex mu;
  std::map<std::string, std::vector<Seen>> by_fqn;
  std::map<std::string, std::vector<float>> full;
  std::map<std::string, std::int64_t> numel;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    engine::sharded_forward_backward(model, sm, engine::make_batch(c, 0, comm.rank() * 2, 2));
    const auto views = sm.parameters();
    std::size_t count = 0;
    for (auto& u : sm) count += u->parameters().size();
    CHECK(views.size() == count);
    for (const auto& p : views) {
      // The view's pointers are the shard's, at shard_offset.
      const fsdp::Unit& unit = sm.unit(p.unit);
      const auto& shard = unit.shards()[p.shard];
      CHECK(shard.dtype == p.dtype);
      CHECK(shard.padded_numel >= shard.numel);
      CHECK(p.param_begin >= 0);
      CHECK(p.param_begin + p.count <= p.numel);
      if (p.count > 0) {
        CHECK(p.param == static_cast<std::byte*>(shard.param) + p.shard_offset * 4);
        CHECK(p.grad == static_cast<std::byte*>(shard.grad) + p.shard_offset * 4);
        CHECK(p.shard_offset + p.count <= shard.numel);
      } else {
        CHECK(p.param == nullptr);
      }
      const auto* v = static_cast<const float*>(p.param);
      std::lock_guard lock(mu);
      by_fqn[std::string(p.fqn)].push_back({p.param_begin, p.count, std::vector<float>(v, v + p.count)});
      numel[std::string(p.fqn)] = p.numel;
    }
    auto params = engine::gather_full_parameters(model, sm);
    std::lock_guard lock(mu);
    for (auto& [f, vals] : params) full[f] = vals;
  });
  REQUIRE(by_fqn.size() == full.size());
  for (auto& entry : by_fqn) {  // not a structured binding: CAPTURE captures the name
    const std::string& fqn = entry.first;
    auto& seen = entry.second;
    CAPTURE(fqn);
    // Ranks that save a copy cover every element once; replicas (NoShard) each hold all.
    std::sort(seen.begin(), seen.end(), [](const Seen& a, const Seen& b) { return a.begin < b.begin; });
    std::vector<int> hits(static_cast<std::size_t>(numel[fqn]), 0);
    for (auto& s : seen)
      for (std::int64_t i = 0; i < s.count; ++i) {
        ++hits[static_cast<std::size_t>(s.begin + i)];
        CHECK(s.values[static_cast<std::size_t>(i)] == full[fqn][static_cast<std::size_t>(s.begin + i)]);
      }
    const int copies = fsdp::Policies<Ps...>::strategy::shards_parameters ? 1 : world;
    CHECK(std::all_of(hits.begin(), hits.end(), [&](int h) { return h == copies; }));
  }
}

}  // namespace

TEST_CASE("parameter views cover every element once and point into the shards") {
  check_views<fsdp::FullShard>(3);
  check_views<fsdp::FullShard>(4);
  check_views<fsdp::ShardGradOp>(2);
  check_views<fsdp::NoShard>(2);
}

TEST_CASE("parameter views report master dtypes, gradient dtypes and the memory space") {
  const auto c = config();
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    using MP = fsdp::MixedPrecision<fsdp::bf16, fsdp::bf16, fsdp::bf16, true>;
    auto sm = fsdp::shard<fsdp::FullShard, MP, fsdp::OffloadParams>(model, comm, device, engine::Wrap{});
    for (const auto& p : sm.parameters()) {
      CHECK(p.dtype == fsdp::DType::f32);
      CHECK(p.grad_dtype == fsdp::DType::bf16);
      CHECK(p.space == fsdp::MemorySpace::host);
      CHECK(fsdp::checked_numel(p.shape, p.fqn) == p.numel);
    }
    for (const auto& s : sm.shards()) CHECK(s.space == fsdp::MemorySpace::host);
  });
}

TEST_CASE("full_parameter is refused outside a summon, and names the parameter") {
  const auto c = config();
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& root = sm.unit("");
    try {
      root.full_parameter(0);
      FAIL("no error");
    } catch (const fsdp::Error& e) {
      CHECK(std::string(e.what()).find("embed.weight") != std::string::npos);
      CHECK(std::string(e.what()).find("IDLE") != std::string::npos);
    }
    auto s = root.summon_full_params();
    CHECK(root.full_parameter(0) != nullptr);
  });
}

TEST_CASE("a weight-decay mask built from the parameter views trains like the unsharded masked AdamW") {
  const auto c = config();
  constexpr int steps = 3, world = 3, local = 2;
  engine::AdamW::Options o;
  o.weight_decay = 0.5f;  // large, so a wrong mask shows
  auto unsharded = [&](bool masked) {
    engine::Model model(c);
    engine::AdamW opt(o);
    const auto masks = engine::decay_masks(model);
    for (int s = 0; s < steps; ++s) {
      auto batch = engine::make_batch(c, s, 0, world * local);
      engine::zero_grads(model);
      engine::Mat dout;
      engine::mse(model.forward(batch.x), batch.y, dout);
      model.backward(dout);
      opt.step(masked ? engine::masked_slots(model, masks) : engine::slots(model));
    }
    std::map<std::string, std::vector<float>> out;
    for (auto& p : engine::named_parameters(model)) out[p.fqn].assign(p.param->data(), p.param->data() + p.param->numel());
    return out;
  };
  std::map<std::string, std::vector<float>> sharded;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::AdamW opt(o);
    const auto masks = engine::decay_masks(sm);
    for (int s = 0; s < steps; ++s) {
      engine::sharded_forward_backward(model, sm, engine::make_batch(c, s, comm.rank() * local, local));
      opt.step(engine::masked_slots(sm, masks));
    }
    auto full = engine::gather_full_parameters(model, sm);
    if (comm.rank() == 0)
      for (auto& [f, v] : full) sharded[f] = v;
  });
  const auto masked = unsharded(true), plain = unsharded(false);
  double to_masked = 0, to_plain = 0;
  for (auto& [f, v] : sharded)
    for (std::size_t i = 0; i < v.size(); ++i) {
      to_masked = std::max(to_masked, std::fabs(double(v[i]) - masked.at(f)[i]));
      to_plain = std::max(to_plain, std::fabs(double(v[i]) - plain.at(f)[i]));
    }
  CHECK(to_masked < 1e-5);
  CHECK(to_plain > 1e-4);  // the mask changed the result: biases and gains were not decayed
}

}  // namespace core_unit_views_test
